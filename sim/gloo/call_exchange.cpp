// The call exchange of a Gloo group (the wire protocol), and how a group stops or breaks.
#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <unistd.h>
#include <fstream>
#include <cstring>
#include <sstream>
#include <utility>
#include <thread>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "sim/gloo/rank.hpp"
#include "sim/gloo/protocol.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// The call exchange.

namespace {

// A call record as it travels: fixed size, no pointers.
struct Wire {
  std::uint8_t status = 0, kind = 0, dtype = 0, pad = 0;
  std::int32_t root = -1, dst = -1, src = -1;
  std::uint64_t seq = 0, count = 0, recv_count = 0;
  char text[200] = {};
  CallLabel label;
};
static_assert(std::is_trivially_copyable_v<Wire>);

Wire to_wire(const CallRecord& c, GlooRank::Status status, const std::string& text) {
  Wire w;
  w.status = static_cast<std::uint8_t>(status);
  w.kind = static_cast<std::uint8_t>(c.kind);
  w.dtype = static_cast<std::uint8_t>(c.dtype);
  w.root = c.root, w.dst = c.dst, w.src = c.src;
  w.seq = c.seq, w.count = c.count, w.recv_count = c.recv_count;
  std::strncpy(w.text, text.c_str(), sizeof(w.text) - 1);
  w.label = c.label;
  return w;
}

CallRecord from_wire(const Wire& w) {
  CallRecord c;
  c.kind = static_cast<CollectiveKind>(w.kind);
  c.dtype = static_cast<DType>(w.dtype);
  c.root = w.root, c.dst = w.dst, c.src = w.src;
  c.seq = w.seq, c.count = w.count, c.recv_count = w.recv_count;
  c.label = w.label;
  return c;
}

// What this host can tell of a quiet rank from its claim ("host H pid P tag T"):
// whether its process is stopped, alive or gone. A rank on another host is only
// named with it.
std::string liveness(Store& records, int rank) {
  std::string claim;
  try {
    if (store_has(records, "holder/" + std::to_string(rank))) {
      const auto v = records.get("holder/" + std::to_string(rank));
      claim.assign(v.begin(), v.end());
    }
  } catch (const std::exception&) {
  }
  std::istringstream in(claim);
  std::string word, host;
  long pid = -1;
  while (in >> word) {
    if (word == "host") in >> host;
    else if (word == "pid") in >> pid;
  }
  if (host.empty() || pid <= 0) return "nothing known of its process (killed or crashed outside cpsim launch, or hung)";
  char here[256] = {};
  gethostname(here, sizeof here - 1);
  if (host != here)
    return "its process (pid " + std::to_string(pid) + " on " + host +
           ") is on another host: hung, stopped, killed or crashed outside cpsim launch";
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return "its process (pid " + std::to_string(pid) + ") is gone: killed or crashed outside cpsim launch";
  const auto close = line.rfind(')');
  const char state = close != std::string::npos && close + 2 < line.size() ? line[close + 2] : '?';
  if (state == 'T' || state == 't') return "its process (pid " + std::to_string(pid) + ") is stopped (SIGSTOP or a debugger)";
  if (state == 'Z' || state == 'X') return "its process (pid " + std::to_string(pid) + ") has exited";
  return "its process (pid " + std::to_string(pid) + ") is alive but did not answer in time (busy or hung)";
}

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  return std::max(1ms, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// A rank that sits a group's run out waits for the group with the long limit
// (the run may take long), and nothing comes over a link that was cut: no
// record, no closed connection. While it waits, this looks at the job's failure
// records four times a second: a record of any other rank (the group failed, or a
// rank lost its peers) ends the wait, and so does a store that has not answered
// for the run's timeout (this rank cannot tell whether the group is alive; the
// ranks that can reach it are ending too). Ends the wait through abortWaitRecv:
// waitRecv then returns false, and `why()` says why.
class SitOutWatch {
 public:
  SitOutWatch(Store& records, std::vector<int> peers, std::chrono::milliseconds patience,
              gloo::transport::UnboundBuffer& recv)
      : records_(records), peers_(std::move(peers)), patience_(patience), recv_(recv) {
    thread_ = std::thread([this] { watch(); });
  }
  ~SitOutWatch() {
    {
      std::lock_guard<std::mutex> lock(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::string why() {
    std::lock_guard<std::mutex> lock(m_);
    return why_;
  }

 private:
  void watch() {
    Clock::time_point answered = Clock::now();  // the store's last answer (it answered before this wait)
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(m_);
        if (cv_.wait_for(lock, std::min<std::chrono::milliseconds>(patience_, 250ms), [this] { return done_; }))
          return;
      }
      bool unreachable = false;
      std::string found;
      for (int q : peers_) {
        if (const auto record = failure_record(records_, q, &unreachable)) {
          found = "the failure record of rank " + std::to_string(q) + ": " + *record;
          break;
        }
        if (unreachable) break;
      }
      const auto now = Clock::now();
      if (!unreachable) answered = now;
      else if (found.empty() && now - answered >= patience_)
        found = "the job's store, silent for " +
                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - answered).count()) +
                " ms: this rank cannot tell whether the group is alive";
      if (!found.empty()) {
        {
          std::lock_guard<std::mutex> lock(m_);
          why_ = found;
        }
        recv_.abortWaitRecv();
        return;
      }
    }
  }

  Store& records_;
  std::vector<int> peers_;  // job ranks
  std::chrono::milliseconds patience_;
  gloo::transport::UnboundBuffer& recv_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string why_;
  std::thread thread_;
};

// A rank's part of the report (core/comm/call_check.hpp). A rank that returned or
// threw sends the last call it completed as its record.
RankActivity activity_of(const CallRecord& c, GlooRank::Status status, const std::string& text) {
  switch (status) {
    case GlooRank::Status::call: return {RankActivity::Phase::calling, c, ""};
    case GlooRank::Status::returned: return {RankActivity::Phase::returned, c, ""};
    case GlooRank::Status::threw: return {RankActivity::Phase::threw, c, text};
  }
  return {};
}

// Where a rank is in an exchange: in its call, or past its last one (its
// record tells its peers it returned or threw).
std::string place(const CallRecord& me, GlooRank::Status status, const RankNames& names) {
  if (status == GlooRank::Status::call) return "in " + describe_call(me, names) + names.on();
  return std::string("after it ") + (status == GlooRank::Status::returned ? "returned" : "threw") + names.on() +
         " (last completed: " + (me.seq > 0 ? describe_call(me, names) : "nothing") + ")";
}

}  // namespace

GlooRank::GlooRank(std::shared_ptr<gloo::Context> context, int rank, int size, std::shared_ptr<Store> records,
                   std::chrono::milliseconds timeout, bool processes)
    : context_(std::move(context)),
      rank_(rank),
      size_(size),
      records_(std::move(records)),
      timeout_(timeout),
      processes_(processes) {
  CPSIM_ENFORCE(size_ == 1 || context_, "a Gloo group of ", size_, " ranks needs a context");
}

GlooRank::~GlooRank() = default;

void GlooRank::begin(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  seq_ = 0;
  current_ = CallRecord{};
  stopped_.clear();
}

std::string GlooRank::records_of(const std::vector<int>& suspects, std::chrono::milliseconds timeout) {
  if (!records_ || suspects.empty()) return "";
  // A peer writes its record before it closes its connections, and cpsim launch
  // writes one for a process that died; give them a moment to land, and wait the
  // whole moment for launch's record, which names the process that died.
  //
  // The rank that died need not be a suspect: this rank may have heard from it
  // before it died and lost only a peer that lost it too (whose record says so).
  // So launch's records are read for every rank of the group, the suspects'
  // own records only for them.
  //
  // A suspect that writes nothing in that moment is named as such: it stopped
  // answering (SIGSTOP, a hang), or died outside cpsim launch.
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout, 1000ms);
  for (;;) {
    std::string died, lost;  // records cpsim launch wrote for dead processes come first
    bool timed_out = false;  // a suspect's own record is a timeout: it saw the cause itself
    std::vector<int> silent;
    bool unreachable = false;  // the store itself did not answer: no record will come
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const bool suspect = std::find(suspects.begin(), suspects.end(), q) != suspects.end();
      if (!suspect && !processes_) continue;  // in-process ranks are never killed alone
      const auto record = failure_record(*records_, names_.number(q), &unreachable);
      if (!record) {
        if (suspect) silent.push_back(q);
        continue;
      }
      if (is_launch_record(*record)) died += "\n  " + *record;
      else if (suspect) {
        lost += "\n  " + *record;
        timed_out = timed_out || is_call_timeout(*record);
      }
    }
    std::string quiet;  // a process's liveness; in-process ranks are threads that just did not call
    if (processes_)
      for (int q : silent)
        quiet += "\n  no failure record from " + names_.rank(q) + ": " + liveness(*records_, names_.number(q));
    // Peers' records that only say they lost someone too are worth the wait for the
    // root cause; a peer's timeout is one (it names whom it waited for).
    if (!died.empty() || (!lost.empty() && (!processes_ || timed_out || Clock::now() >= deadline)))
      return died + lost + quiet;
    if (processes_ && unreachable)
      return died + lost + quiet + "\n  (the store did not answer: no failure record can be read)";
    if (Clock::now() >= deadline) return quiet;
    std::this_thread::sleep_for(20ms);
  }
}

void GlooRank::break_group(const std::string& why, const std::vector<int>& suspects,
                           std::chrono::milliseconds timeout) {
  // Record first, so peers that lose their connection to this rank can name it.
  // A store behind the link that failed would hold each command for the whole
  // timeout: the records get a moment (records_of's) each, no more.
  if (processes_) shorten_store_commands(1000ms);
  if (records_) {
    try {
      const std::string line = why.substr(0, why.find('\n'));
      records_->set("failed/" + std::to_string(names_.number(rank_)), std::vector<char>(line.begin(), line.end()));
    } catch (const std::exception&) {
    }
  }
  broken_ = why + records_of(suspects, timeout);
  // Raised before the connections close: a peer that fails because they did
  // raises its own failure later (run_ranks reports the earliest).
  Aborted failure(broken_);
  if (context_) {
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
    }
  }
  throw failure;
}

std::vector<CallRecord> GlooRank::exchange(const CallRecord& mine, Status status, const std::string& text,
                                           std::chrono::milliseconds timeout) {
  if (!broken_.empty()) throw Aborted("group broken by an earlier failure: " + broken_);
  if (!stopped_.empty()) throw CollectiveError(stopped_);
  enter_batch_scheduling();
  CallRecord me = mine;
  if (status == Status::call) me.seq = ++seq_;
  std::vector<CallRecord> calls(size_);
  std::vector<Status> statuses(size_, Status::call);
  std::vector<std::string> texts(size_);
  calls[rank_] = me;
  statuses[rank_] = status;
  texts[rank_] = text;
  if (size_ > 1) {
    Wire out = to_wire(me, status, text);
    std::vector<Wire> in(size_);
    std::vector<bool> arrived(size_, false);
    arrived[rank_] = true;
    auto send = context_->createUnboundBuffer(&out, sizeof(Wire));
    auto recv = context_->createUnboundBuffer(in.data(), sizeof(Wire) * size_);
    const auto start = Clock::now();
    auto deadline = start + timeout;
    const int first = std::exchange(patience_first_, 0);
    const auto then = std::exchange(patience_, std::chrono::milliseconds(0));
    // The group's last exchange ends on all its ranks at once, so the first of
    // them to arrive means the group is done: the rest get `then`. (Waiting for
    // all of them would wait the long limit for a group rank that stopped after
    // the group's run: a peer that times out and closes its connections ends no
    // receive of this rank's that already completed.)
    auto group_done = [&] {
      for (int q = 0; q < first && q < size_; ++q)
        if (arrived[q]) return true;
      return false;
    };
    std::optional<SitOutWatch> watch;  // only while this rank sits a run out, in a job of processes
    std::string sat_out;               // why the watch ended the wait
    try {
      for (int q = 0; q < size_; ++q)
        if (q != rank_) recv->recv(q, kCallSlot, q * sizeof(Wire), sizeof(Wire));
      for (int q = 0; q < size_; ++q)
        if (q != rank_) send->send(q, kCallSlot);
      if (first > 0 && processes_ && records_) {
        std::vector<int> peers;
        for (int q = 0; q < size_; ++q)
          if (q != rank_) peers.push_back(names_.number(q));
        watch.emplace(*records_, std::move(peers), then, *recv);
      }
      for (int i = 1; i < size_; ++i) {
        if (first > 0 && group_done()) deadline = std::min(deadline, Clock::now() + then);
        int src = -1;
        if (!recv->waitRecv(&src, remaining(deadline))) {
          sat_out = watch ? watch->why() : "";
          throw std::runtime_error("the wait was ended: " + sat_out);
        }
        if (src >= 0 && src < size_) arrived[src] = true;
      }
      watch.reset();
      for (int i = 1; i < size_; ++i) send->waitSend(remaining(deadline));
    } catch (const std::exception& e) {
      watch.reset();
      std::vector<int> missing;
      std::vector<RankActivity> activities(size_);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) activities[q] = activity_of(me, status, text);
        else if (arrived[q])
          activities[q] = activity_of(from_wire(in[q]), static_cast<Status>(in[q].status),
                                      std::string(in[q].text, strnlen(in[q].text, sizeof(in[q].text))));
        else {
          // Every rank completed the calls before this one (the group agreed on
          // them): a rank that has not arrived is between calls.
          missing.push_back(q);
          activities[q] = {RankActivity::Phase::idle, current_, ""};
        }
      }
      const std::string what = e.what();
      const bool timed_out = is_gloo_timeout(what) || Clock::now() >= deadline;
      // Every record arrived but this rank's own did not get out: a peer died or
      // stopped after it sent. Which one, the send does not say: every peer is a suspect.
      const bool sending = missing.empty();
      std::vector<int> suspects = missing;
      if (sending)
        for (int q = 0; q < size_; ++q)
          if (q != rank_) suspects.push_back(q);
      std::string why;
      if (!sat_out.empty())
      {
        std::vector<int> group(first);
        for (int q = 0; q < first; ++q) group[q] = q;
        why = names_.rank(rank_) + " sat out the run of " + names_.ranks(group) + " and stopped waiting for " +
              names_.ranks(missing) + " at " + sat_out;
      }
      else {
        const std::string waited = status == Status::call
                                       ? call_timeout(rank_, me, start, timeout, names_)
                                       : "timeout: " + names_.rank(rank_) + " " + waited_since(start, timeout) + " " +
                                             place(me, status, names_);
        if (timed_out && !sending)
          why = waited + " for " + names_.ranks(missing) + ", which never arrived";
        else if (timed_out)
          why = waited + " to deliver its call to " + names_.ranks(suspects) + " after every peer's had arrived";
        else
          why = names_.rank(rank_) + " lost its connection to " + names_.ranks(suspects) + " " +
                place(me, status, names_) + " (gloo: " + what + ")";
      }
      break_group(why + describe_ranks(activities, names_), suspects, timeout);
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      calls[q] = from_wire(in[q]);
      statuses[q] = static_cast<Status>(in[q].status);
      texts[q] = std::string(in[q].text, strnlen(in[q].text, sizeof(in[q].text)));
    }
  }
  int threw = -1, returned = -1, waiting = -1;
  for (int q = 0; q < size_; ++q) {
    if (statuses[q] == Status::threw && threw < 0) threw = q;
    if (statuses[q] == Status::returned && returned < 0) returned = q;
    if (statuses[q] == Status::call && waiting < 0) waiting = q;
  }
  auto states = [&] {
    std::vector<RankActivity> activities(size_);
    // The rank that threw is named with its failure in the first line.
    for (int q = 0; q < size_; ++q) activities[q] = activity_of(calls[q], statuses[q], q == threw ? "" : texts[q]);
    return describe_ranks(activities, names_);
  };
  std::string why;
  if (threw >= 0 || returned >= 0) {
    if (waiting < 0) return calls;  // every rank has stopped: nobody waits
    const CallRecord& w = calls[waiting];
    const std::string joining =
        call_name(w) + " #" + std::to_string(w.seq) + names_.on() + " that " + names_.rank(waiting) + " waits in";
    // The first line as every backend words it (core/comm/rendezvous.cpp); which
    // call each rank is in follows in the states.
    why = threw >= 0 ? names_.rank(threw) + " threw: " + texts[threw]
                     : names_.rank(returned) + " returned without joining " + joining;
  } else {
    return calls;  // the mismatch check is the checked communicator's (core/comm/call_check.hpp)
  }
  stopped_ = why + states();
  throw CollectiveError(stopped_);
}

std::vector<CallRecord> GlooRank::exchange(const CallRecord& mine, std::chrono::milliseconds timeout) {
  auto calls = exchange(mine, Status::call, "", timeout);
  current_ = calls[rank_];
  return calls;
}

void GlooRank::stop(const std::string& why) {
  stopped_ = why;
  throw CollectiveError(stopped_);
}

void GlooRank::finish() {
  if (!broken_.empty() || !stopped_.empty()) return;
  exchange(current_, Status::returned, "", timeout_);
}

void GlooRank::fail(const std::string& what) noexcept {
  if (!broken_.empty() || !stopped_.empty()) return;
  try {
    exchange(current_, Status::threw, what, timeout_);
  } catch (...) {
  }
}

}  // namespace cpsim::sim
