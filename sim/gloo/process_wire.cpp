#include "sim/gloo/process_wire.hpp"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "sim/gloo/protocol.hpp"

namespace cpsim::sim {

ProcessWire::ProcessWire(const GlooRank& rank, std::vector<int> ranks, std::shared_ptr<Mailbox> mailbox,
                         std::chrono::milliseconds timeout)
    : context_(rank.context_ptr()), ranks_(std::move(ranks)), me_(rank.rank()), mailbox_(std::move(mailbox)),
      timeout_(timeout) {
  if (context_ && ranks_.size() > 1) {
    notifier_ = std::thread([this] { send_notices(); });
    thread_ = std::thread([this] { take(); });
  }
}

ProcessWire::~ProcessWire() {
  {
    std::lock_guard<std::mutex> lock(notices_mutex_);
    notices_stop_ = true;
    notices_cv_.notify_all();
  }
  if (notifier_.joinable()) notifier_.join();
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (header_) header_->abortWaitRecv();
  }
  if (thread_.joinable()) thread_.join();
}

void ProcessWire::put(int peer, Header header, const std::uint8_t* bytes, std::size_t nbytes) {
  std::unique_ptr<gloo::transport::UnboundBuffer> h, payload;
  {
    // A message of the program's thread and a notice of the notifier's may go
    // to one peer at once: each posts its header and bytes under one lock, and
    // its bytes on a slot of their own, so the peer's receive for the bytes a
    // header announced takes those bytes and no others.
    std::lock_guard<std::mutex> lock(post_mutex_);
    if (nbytes) header.payload = static_cast<std::int64_t>(payloads_++);
    h = context_->createUnboundBuffer(&header, sizeof header);
    h->send(peer, kWireHeaderSlot);
    if (nbytes) {
      payload = context_->createUnboundBuffer(const_cast<std::uint8_t*>(bytes), nbytes);
      payload->send(peer, wire_payload_slot(static_cast<std::uint64_t>(header.payload)));
    }
  }
  h->waitSend(timeout_);
  if (payload) payload->waitSend(timeout_);
}

int ProcessWire::peer_of(int rank) const {
  const auto it = std::find(ranks_.begin(), ranks_.end(), rank);
  return it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
}

void ProcessWire::send(int dst, int tag, const Mailbox::Message& m) {
  const int peer = peer_of(dst);
  if (peer < 0 || !context_) throw InvalidInput("send to rank " + std::to_string(dst) + ": not in this group");
  Header h;
  h.tag = tag, h.numel = m.payload.numel, h.nbytes = static_cast<std::int64_t>(m.payload.bytes.size()), h.seq = m.seq;
  std::strncpy(h.dtype, m.payload.dtype.c_str(), sizeof h.dtype - 1);
  std::strncpy(h.site, m.site.c_str(), sizeof h.site - 1);
  try {
    put(peer, h, m.payload.bytes.data(), m.payload.bytes.size());
  } catch (const std::exception& e) {
    throw CollectiveError("rank " + std::to_string(ranks_[me_]) + "'s send to rank " + std::to_string(dst) + " (tag " +
                          std::to_string(tag) + ", " + m.payload.shape() + ") did not leave within " +
                          std::to_string(timeout_.count()) + " ms: " + e.what());
  }
}

void ProcessWire::notify(Notice n) {
  std::lock_guard<std::mutex> lock(notices_mutex_);
  notices_.push_back(std::move(n));
  ++notices_queued_;
  notices_cv_.notify_all();
}

void ProcessWire::notify_peers(const Header& header, const std::vector<std::uint8_t>& bytes) {
  for (int q = 0; q < static_cast<int>(ranks_.size()); ++q)
    if (q != me_) notify(Notice{q, header, bytes});
}

void ProcessWire::send_notices() {
  std::unique_lock<std::mutex> lock(notices_mutex_);
  while (true) {
    notices_cv_.wait(lock, [&] { return notices_stop_ || !notices_.empty(); });
    if (notices_stop_) return;
    Notice n = std::move(notices_.front());
    notices_.pop_front();
    lock.unlock();
    try {
      // As long as a message may take: Gloo closes every connection of the
      // group when a wait of its times out, so a shorter limit would end the
      // group's collectives too (on a slow, lossy link a notice can take seconds).
      // Every peer takes them: its wire takes until every peer's end came
      // (wait_for_ends before it goes), and a peer that is gone closed its
      // connections. A send is never aborted half way: Gloo would leave the
      // peer's receive matched to bytes that never come.
      put(n.peer, n.header, n.bytes.data(), n.bytes.size());
    } catch (const std::exception&) {
      // That peer's connection is gone: what waited on it has been told, or its session's end says so.
    }
    lock.lock();
    ++notices_sent_;
    notices_cv_.notify_all();
  }
}

namespace {

// A state's bytes: the count of ranks, the sent counts, the got counts (int64),
// then what it waits for.
std::vector<std::uint8_t> state_bytes(const Mailbox::State& s) {
  std::vector<std::int64_t> numbers{static_cast<std::int64_t>(s.sent.size())};
  numbers.insert(numbers.end(), s.sent.begin(), s.sent.end());
  numbers.insert(numbers.end(), s.got.begin(), s.got.end());
  std::vector<std::uint8_t> out(numbers.size() * sizeof(std::int64_t) + s.doing.size());
  std::memcpy(out.data(), numbers.data(), numbers.size() * sizeof(std::int64_t));
  std::memcpy(out.data() + numbers.size() * sizeof(std::int64_t), s.doing.data(), s.doing.size());
  return out;
}

Mailbox::State state_of(const std::vector<std::uint8_t>& bytes, bool waiting) {
  Mailbox::State s;
  s.waiting = waiting;
  std::int64_t n = 0;
  if (bytes.size() < sizeof n) return s;
  std::memcpy(&n, bytes.data(), sizeof n);
  const std::size_t head = static_cast<std::size_t>(1 + 2 * n) * sizeof(std::int64_t);
  if (n < 0 || bytes.size() < head) return s;
  s.sent.resize(static_cast<std::size_t>(n));
  s.got.resize(static_cast<std::size_t>(n));
  if (n > 0) {  // an empty vector's data() may be null, and memcpy takes none
    std::memcpy(s.sent.data(), bytes.data() + sizeof n, static_cast<std::size_t>(n) * sizeof n);
    std::memcpy(s.got.data(), bytes.data() + (1 + n) * sizeof n, static_cast<std::size_t>(n) * sizeof n);
  }
  s.doing.assign(bytes.begin() + static_cast<std::ptrdiff_t>(head), bytes.end());
  return s;
}

}  // namespace

void ProcessWire::state(const Mailbox::State& s) {
  if (!notifier_.joinable()) return;
  Header h;
  std::vector<std::uint8_t> bytes = state_bytes(s);
  h.kind = Kind::state, h.numel = s.waiting ? 1 : 0, h.nbytes = static_cast<std::int64_t>(bytes.size());
  notify_peers(h, bytes);
}

void ProcessWire::receipt(int dst, int seq) {
  const int peer = peer_of(dst);
  if (peer < 0 || !notifier_.joinable()) return;
  Header h;
  h.kind = Kind::receipt, h.seq = seq;
  notify(Notice{peer, h, {}});
}

void ProcessWire::ended(const std::string& how, bool failed) {
  if (!notifier_.joinable()) return;
  Header h;
  h.kind = Kind::end, h.numel = failed ? 1 : 0, h.nbytes = static_cast<std::int64_t>(how.size());
  notify_peers(h, std::vector<std::uint8_t>(how.begin(), how.end()));
  // Gone before the session's end: the peers learn it first.
  std::unique_lock<std::mutex> lock(notices_mutex_);
  const std::int64_t mine = notices_queued_;
  notices_cv_.wait_for(lock, timeout_, [&] { return notices_sent_ >= mine || notices_stop_; });
}

void ProcessWire::wait_for_ends() {
  std::unique_lock<std::mutex> lock(ends_mutex_);
  const int peers = static_cast<int>(ranks_.size()) - 1;
  ends_cv_.wait_for(lock, timeout_, [&] { return ends_ >= peers || !taking_; });
}

void ProcessWire::take() {
  struct Done {  // whoever waits for the peers' ends stops waiting when nothing more comes
    ProcessWire& wire;
    ~Done() {
      std::lock_guard<std::mutex> lock(wire.ends_mutex_);
      wire.taking_ = false;
      wire.ends_cv_.notify_all();
    }
  } done{*this};
  std::vector<int> peers;
  for (int q = 0; q < static_cast<int>(ranks_.size()); ++q)
    if (q != me_) peers.push_back(q);
  while (!stopping_) {
    Header h;
    int src = -1;
    try {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
        header_ = context_->createUnboundBuffer(&h, sizeof h);
        header_->recv(peers, kWireHeaderSlot);
      }
      if (!header_->waitRecv(&src, std::chrono::hours(24 * 365)) || stopping_) return;
      std::vector<std::uint8_t> bytes(static_cast<std::size_t>(h.nbytes));
      if (h.nbytes) {
        auto payload = context_->createUnboundBuffer(bytes.data(), static_cast<std::size_t>(h.nbytes));
        payload->recv(src, wire_payload_slot(static_cast<std::uint64_t>(h.payload)));
        payload->waitRecv(timeout_);
      }
      switch (h.kind) {
        case Kind::send:
          h.dtype[sizeof h.dtype - 1] = h.site[sizeof h.site - 1] = 0;
          mailbox_->arrive("", ranks_[src], ranks_[me_], static_cast<int>(h.tag),
                           Mailbox::Message{Payload{std::move(bytes), h.dtype, h.numel}, static_cast<int>(h.seq),
                                            h.site, 0, nullptr, /*remote=*/true});
          break;
        case Kind::receipt:
          mailbox_->taken(ranks_[src], static_cast<int>(h.seq));
          break;
        case Kind::state:
          mailbox_->remote_state(ranks_[src], state_of(bytes, h.numel != 0));
          break;
        case Kind::end: {
          mailbox_->stopped(ranks_[src], std::string(bytes.begin(), bytes.end()), h.numel != 0);
          std::lock_guard<std::mutex> lock(ends_mutex_);
          ++ends_;
          ends_cv_.notify_all();
          break;
        }
      }
    } catch (const std::exception&) {
      return;  // the group's connections closed (a peer ended or failed): its calls report that
    }
  }
}

}  // namespace cpsim::sim
