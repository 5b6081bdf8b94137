#include "core/comm/point_to_point.hpp"

#include <algorithm>
#include <sstream>

#include "core/comm/call_check.hpp"
#include "core/error.hpp"

namespace cpsim {

void ActivityBoard::set(int rank, std::string what, std::optional<std::string> group) {
  std::lock_guard<std::mutex> lock(mutex_);
  doing_.at(rank) = {std::move(what), std::move(group)};
}

std::string ActivityBoard::in_another_group(int rank, const std::string& group) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Doing& d = doing_.at(rank);
  return d.group && *d.group != group ? d.what : std::string();
}

std::string ActivityBoard::lines(bool outside_collectives, int except) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  for (std::size_t q = 0; q < doing_.size(); ++q)
    if (!doing_[q].what.empty() && !(outside_collectives && doing_[q].group) && static_cast<int>(q) != except)
      out += "\n  rank " + std::to_string(q) + ": " + doing_[q].what;
  return out;
}

namespace {
// "recv from rank 0 (tag 3, float32 x 2) at step.py:12": a posted call, as reports name it.
std::string posted_call(const std::string& op, int tag, const std::string& shape, const std::string& site) {
  return op + " (tag " + std::to_string(tag) + ", " + shape + ")" + (site.empty() ? "" : " at " + site);
}
}  // namespace

std::string PostedRecv::what() const {
  return posted_call("recv from " + (src < 0 ? std::string("any rank") : "rank " + std::to_string(src)), tag,
                     Payload{{}, dtype, numel}.shape(), site);
}

std::string PostedSend::what() const { return posted_call("send to rank " + std::to_string(dst), tag, shape, site); }

Mailbox::Mailbox(int ranks, std::chrono::milliseconds timeout, std::shared_ptr<ActivityBoard> board, Sends sends)
    : state_(ranks, "running"), sent_(ranks, 0), timeout_(timeout), board_(std::move(board)), sends_(sends) {}

void Mailbox::set_remote(int local, Remote remote, Receipt receipt, Publish publish, std::vector<int> members) {
  local_ = local, remote_ = std::move(remote), receipt_ = std::move(receipt), publish_ = std::move(publish);
  wire_sent_.assign(state_.size(), 0);
  wire_got_.assign(state_.size(), 0);
  if (members.empty())
    for (int q = 0; q < static_cast<int>(state_.size()); ++q) members.push_back(q);
  members_ = std::move(members);
}

void Mailbox::remote_state(int rank, State state) {
  std::lock_guard<std::mutex> lock(mutex_);
  remote_states_[rank] = std::move(state);
  cv_.notify_all();
}

const Mailbox::Waiting* Mailbox::local_wait_locked() const {
  const auto mine = std::find_if(waiting_.begin(), waiting_.end(),
                                 [&](const Waiting* w) { return w->rank == local_ && !w->over(); });
  return mine == waiting_.end() ? nullptr : *mine;
}

void Mailbox::publish_locked() {
  if (!publish_) return;
  const Waiting* mine = local_wait_locked();
  if (!mine && !published_waiting_) return;  // not waiting, and its peers know: its counts need not go
  published_waiting_ = mine != nullptr;
  publish_(State{published_waiting_, mine ? mine->doing : "", wire_sent_, wire_got_});
}

bool Mailbox::processes_deadlocked_locked() const {
  if (!publish_ || !local_wait_locked()) return false;
  auto counts = [&](int q) -> std::pair<const std::vector<std::int64_t>*, const std::vector<std::int64_t>*> {
    if (q == local_) return {&wire_sent_, &wire_got_};
    const State& s = remote_states_.at(q);
    return {&s.sent, &s.got};
  };
  for (int q : members_) {
    if (q == local_) continue;
    // A rank that ended: its last counts are not known here (its peers' waits on it end by themselves).
    if (state_[q] != "running") return false;
    const auto it = remote_states_.find(q);
    if (it == remote_states_.end() || !it->second.waiting || it->second.sent.size() != state_.size() ||
        it->second.got.size() != state_.size())
      return false;
  }
  for (int p : members_)
    for (int q : members_)
      if (p != q && (*counts(p).first)[q] != (*counts(q).second)[p]) return false;  // something is on its way
  return true;
}

std::shared_ptr<PostedSend> Mailbox::send(const std::string& group, int src, int dst, int tag, Payload payload,
                                          const std::string& site) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_peer(src, dst, "send to");
  auto receipt = std::make_shared<PostedSend>();
  receipt->src = src, receipt->dst = dst, receipt->tag = tag, receipt->shape = payload.shape(), receipt->site = site;
  Message m{std::move(payload), ++sent_[src], site};
  if (remote_ && dst != local_) {  // another process's rank: it leaves before the send returns
    const std::pair<int, int> key{dst, m.seq};
    if (sends_ == Sends::eager) receipt->taken = true;
    else remote_sends_[key] = receipt;  // until its receipt comes
    ++wire_sent_[dst];
    lock.unlock();
    try {
      remote_(src, dst, tag, m);
    } catch (...) {
      std::lock_guard<std::mutex> relock(mutex_);
      remote_sends_.erase(key);
      throw;
    }
    return receipt;
  }
  if (sends_ == Sends::eager) receipt->taken = true;
  else m.receipt = receipt;
  arrive_locked(group, src, dst, tag, std::move(m));
  return receipt;
}

void Mailbox::arrive(const std::string& group, int src, int dst, int tag, Message m) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (m.remote) ++wire_got_[src];
  arrive_locked(group, src, dst, tag, std::move(m));
  publish_locked();  // its counts changed (and maybe whether it waits)
}

void Mailbox::taken(int dst, int seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++wire_got_[dst];
  if (const auto it = remote_sends_.find({dst, seq}); it != remote_sends_.end()) {
    it->second->taken = true;
    remote_sends_.erase(it);
    cv_.notify_all();
  }
  publish_locked();  // its counts changed, and the wait this ends is over
}

std::shared_ptr<PostedRecv> Mailbox::post(const std::string& group, int dst, int src, int tag, std::string dtype,
                                          std::int64_t numel,
                                          std::function<void(const std::vector<std::uint8_t>&)> write,
                                          const std::string& site) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (src >= 0) check_peer(dst, src, "recv from");
  auto p = std::make_shared<PostedRecv>();
  p->group = group, p->dst = dst, p->src = src, p->tag = tag, p->dtype = std::move(dtype), p->numel = numel;
  p->write = std::move(write), p->site = site;
  // The earliest message that matches (from any source: whichever came first).
  std::deque<Message>* earliest = nullptr;
  int from = -1;
  for (auto& [key, queue] : queues_) {
    const auto& [g, s, d, tg] = key;
    if (queue.empty() || g != group || d != dst || tg != tag || (src >= 0 && s != src)) continue;
    if (earliest == nullptr || queue.front().arrival < earliest->front().arrival) earliest = &queue, from = s;
  }
  if (earliest != nullptr) {
    Message m = std::move(earliest->front());
    earliest->pop_front();
    deliver(*p, from, m);
    cv_.notify_all();  // its sender may wait for it to be taken
    return p;
  }
  posted_.push_back(p);
  return p;
}

void Mailbox::wait_locked(std::unique_lock<std::mutex>& lock, const Waiting& w, std::chrono::milliseconds limit,
                          const std::function<std::string()>& stopped) {
  if (w.over()) return;
  const auto start = Clock::now();
  const std::chrono::milliseconds timeout = limit.count() > 0 ? std::min(limit, timeout_) : timeout_;
  const auto deadline = start + timeout;
  const std::string me = "rank " + std::to_string(w.rank) + " ";
  board_->set(w.rank, w.doing);
  waiting_.push_back(&w);
  publish_locked();
  struct Leave {
    Mailbox& box;
    const Waiting& w;
    ~Leave() {
      box.waiting_.remove(&w);
      box.publish_locked();
    }
  } leave{*this, w};
  auto end = [&](const std::string& report, const std::string& doing = "") {
    board_->set(w.rank, doing);
    throw CollectiveError(report);
  };
  while (!w.over()) {
    if (!deadlock_.empty()) end(deadlock_);
    if (!failure_.empty()) end(me + w.doing + ", but the group stopped: " + failure_);
    const std::string peer = stopped();
    if (!peer.empty()) end(me + w.doing + ", but " + peer + pending_locked(&w));
    if (deadlocked_locked()) {
      deadlock_ =
          "deadlock: every rank still running waits in point to point for what none of them will send or receive "
          "(a blocking send returns only when a receive takes it, as on Gloo and NCCL):";
      std::map<int, std::string> doing;  // every rank's wait: this process's, and the others' as published
      for (const Waiting* x : waiting_) doing.emplace(x->rank, x->doing);
      if (remote_)
        for (const auto& [q, state] : remote_states_)
          if (state.waiting) doing.emplace(q, state.doing);
      for (const auto& [q, what] : doing) deadlock_ += "\n  rank " + std::to_string(q) + ": " + what;
      cv_.notify_all();
      end(deadlock_);
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !w.over()) {
      const std::string others = board_->lines(false, w.rank);
      const std::string report = "timeout: " + me + waited_since(start, timeout) + " for its " + w.what + " " +
                                 w.not_came + pending_locked(&w) +
                                 (others.empty() ? "" : "\n what the other ranks are doing:" + others);
      failure_ = me + "timed out in its " + w.what;
      cv_.notify_all();
      end(report, "timed out waiting for its " + w.what);
    }
  }
  board_->set(w.rank, "");
}

void Mailbox::wait(PostedRecv& p, std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(mutex_);
  const Waiting w{p.dst, p.what(), "waits for its " + p.what(), "and nothing came", [&p] { return p.done; }};
  wait_locked(lock, w, limit, [&]() -> std::string {
    if (p.src >= 0 && state_[p.src] != "running") return "rank " + std::to_string(p.src) + " " + state_[p.src] +
                                                           " without sending it";
    return "";
  });
  forget(p);
  if (!p.error.empty()) throw CollectiveError(p.error);
}

void Mailbox::wait(PostedSend& s, std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(mutex_);
  const Waiting w{s.src, s.what(), "waits for its " + s.what() + " to be received", "and no receive took it",
                  [&s] { return s.taken; }};
  wait_locked(lock, w, limit, [&]() -> std::string {
    if (state_[s.dst] != "running") return "rank " + std::to_string(s.dst) + " " + state_[s.dst] + " without receiving it";
    return "";
  });
}

bool Mailbox::deadlocked_locked() const {
  if (remote_) return processes_deadlocked_locked();
  bool any = false;
  for (std::size_t q = 0; q < state_.size(); ++q) {
    if (state_[q] != "running") continue;
    const bool stuck = std::any_of(waiting_.begin(), waiting_.end(), [&](const Waiting* w) {
      return w->rank == static_cast<int>(q) && !w->over();
    });
    if (!stuck) return false;
    any = true;
  }
  return any;
}

void Mailbox::stopped(int rank, const std::string& how, bool failed) {
  std::lock_guard<std::mutex> lock(mutex_);
  state_[rank] = how;
  if (failed && failure_.empty()) failure_ = "rank " + std::to_string(rank) + " " + how;
  cv_.notify_all();
}

std::string Mailbox::unreceived() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream os;
  for (const auto& [key, queue] : queues_)
    for (const Message& m : queue)
      os << (os.tellp() > 0 ? "\n  " : "a send no recv took:\n  ") << "rank " << std::get<1>(key) << "'s send #"
         << m.seq << " to rank " << std::get<2>(key) << " (tag " << std::get<3>(key) << ", " << m.payload.shape()
         << ")" << (m.site.empty() ? "" : " at " + m.site);
  return os.str();
}

std::string Mailbox::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_locked();
}

// The message to the first posted receive it matches, else to its queue.
void Mailbox::arrive_locked(const std::string& group, int src, int dst, int tag, Message m) {
  m.arrival = ++arrivals_;
  for (auto& p : posted_) {
    if (p->done || p->group != group || p->dst != dst || p->tag != tag || (p->src >= 0 && p->src != src)) continue;
    deliver(*p, src, m);
    cv_.notify_all();
    return;
  }
  queues_[{group, src, dst, tag}].push_back(std::move(m));
}

void Mailbox::deliver(PostedRecv& p, int src, const Message& m) {
  p.done = true;
  p.source = src;
  if (m.receipt) m.receipt->taken = true;
  if (m.remote) {
    // Queued before the lock is let go, so before this rank can go on and end:
    // its peer learns the message was taken before it learns this rank ended.
    receipt_(src, m.seq);
    ++wire_sent_[src];
  }
  if (m.payload.numel != p.numel || m.payload.dtype != p.dtype) {
    p.error = "rank " + std::to_string(p.dst) + "'s " + p.what() + " got rank " + std::to_string(src) + "'s send #" +
              std::to_string(m.seq) + ", which holds " + m.payload.shape() +
              (m.site.empty() ? "" : " (sent at " + m.site + ")");
    return;
  }
  if (p.write) p.write(m.payload.bytes);
}

void Mailbox::forget(PostedRecv& p) {
  posted_.remove_if([&](const std::shared_ptr<PostedRecv>& q) { return q.get() == &p; });
}

void Mailbox::check_peer(int me, int peer, const char* op) const {
  if (peer < 0 || peer >= static_cast<int>(state_.size()) || peer == me)
    throw InvalidInput("rank " + std::to_string(me) + ": " + op + " rank " + std::to_string(peer) + " in a group of " +
                       std::to_string(state_.size()));
}

std::string Mailbox::pending_locked(const Waiting* w) const {
  std::string out;
  const auto not_received = [&](int src, int dst, const std::string& shape, int tag, const std::string& site) {
    out += "\n  rank " + std::to_string(src) + " sent rank " + std::to_string(dst) + " " + shape + " (tag " +
           std::to_string(tag) + (site.empty() ? "" : ", at " + site) + "), not received yet";
  };
  for (const auto& [key, queue] : queues_)
    for (const Message& m : queue)
      not_received(std::get<1>(key), std::get<2>(key), m.payload.shape(), std::get<3>(key), m.site);
  for (const auto& [key, s] : remote_sends_)  // sent to another process, no receipt yet
    if (!(w && w->rank == s->src && w->what == s->what())) not_received(s->src, s->dst, s->shape, s->tag, s->site);
  for (const auto& p : posted_)
    if (!p->done && !(w && w->rank == p->dst && w->what == p->what()))
      out += "\n  rank " + std::to_string(p->dst) + " posted a " + p->what() + ", nothing came yet";
  return out.empty() ? out : "; pending point-to-point:" + out;
}

}  // namespace cpsim
