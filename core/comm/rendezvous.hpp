// The rendezvous of ranks that share one address space (the threads backend,
// and cuda-sim's host threads): each call posts this rank's record, waits until
// every rank has posted the same sequence number, checks the records against
// each other (call_check.hpp), lets each rank read what it needs from its peers'
// buffers, and waits until every rank has read before any returns, so buffers stay
// valid. Distributed bugs become CollectiveErrors on every rank, never a hang:
//   different collectives, sizes, dtypes, roots or peers at one sequence number;
//   a rank that never arrives (timeout); a rank that threw; a rank that returned.
// The first such error poisons the group, so every peer fails fast with the same
// report naming each rank's state and call.
//
// Cost: each phase (arrive, then finish reading) wakes the waiting ranks once, from
// the last rank to get there, which also checks the calls once for everybody; no
// text is formatted unless something fails. Waiting ranks sleep on one futex word
// (no lock to take again when they wake); while a phase is short and there are
// cores for every rank, they spin briefly first.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"

namespace cpsim {

class Rendezvous {
 public:
  // `names`: how its reports name its ranks (global ranks, and the group where
  // it is a subgroup).
  Rendezvous(int size, std::chrono::milliseconds timeout, RankNames names = {});
  int size() const { return static_cast<int>(ranks_.size()); }
  const RankNames& names() const { return names_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // One call of `rank`: rendezvous, check, then `read` (which may read every
  // peer's buffers through their records), a second rendezvous, then `after`.
  // When every rank's record is `staged` there is no second rendezvous: the
  // buffers stay valid until every rank has arrived at the next call (a backend's
  // own staging, alternating between two slots). Both waits end by `timeout`.
  void run(int rank, CallRecord call, std::chrono::milliseconds timeout,
           const std::function<void(const std::vector<CallRecord>&)>& read,
           const std::function<void()>& after = {});

  // Lifecycle: a rank that returned, or threw.
  void finish(int rank);
  void fail(int rank, const std::string& what);

 private:
  enum class Phase { idle, waiting, exited, failed };
  struct RankState {
    Phase phase = Phase::idle;
    std::uint64_t posted = 0, done = 0;  // calls posted, and read
    CallRecord call;
    std::optional<CallRecord> last;  // the last call it completed
    std::string failure;
  };
  // Every rank's line; `cause`'s failure is left out (the report begins with it).
  std::string states_locked(int cause = -1) const;
  // Stops the group: every rank's next wait or call throws `why` with the states
  // of all ranks, as an Aborted (a timeout) or a CollectiveError (a bug).
  [[noreturn]] void poison_locked(const std::string& why, bool aborted = false);
  [[noreturn]] void rethrow_poison_locked() const;
  // The ranks whose `field` (calls posted, or read) has not reached seq.
  std::vector<int> behind_locked(std::uint64_t RankState::*field, std::uint64_t seq) const;
  // Rank `rank` waited in `call` since `start` for `who` (`what` they did not do).
  [[noreturn]] void timeout_locked(int rank, const CallRecord& call, std::chrono::steady_clock::time_point start,
                                   std::chrono::milliseconds timeout, const std::vector<int>& who, const char* what);
  // Waits, without the lock, until `reached` is at least seq (true), or until the
  // deadline or something `stop` sees under the lock (false).
  template <class Stop>
  bool wait_for(const std::atomic<std::uint64_t>& reached, std::uint64_t seq,
                std::chrono::steady_clock::time_point deadline, Stop stop);
  // Something waiters must look at happened: bump the event word, wake them all.
  void wake_all();

  std::chrono::milliseconds timeout_;
  RankNames names_;
  bool spin_;  // a core for every rank: spin briefly before sleeping
  mutable std::mutex mutex_;
  std::atomic<std::uint32_t> event_{0};  // the futex word waiters sleep on
  std::vector<RankState> ranks_;
  std::optional<std::string> poison_;
  bool poison_aborted_ = false;
  std::atomic<bool> poisoned_{false};
  // The current call: how many ranks arrived / finished reading, the sequence
  // number whose arrival (reading) completed, and the calls the last arriver collected.
  int arrivals_ = 0, readers_ = 0;
  std::atomic<std::uint64_t> arrived_{0}, read_{0};
  std::vector<CallRecord> calls_;
};

// The rendezvous as the call channel of rank `rank` (nccl's ranks in one process):
// it exchanges the records and applies the rule as the ranks meet (checks()).
std::shared_ptr<CallChannel> rendezvous_channel(std::shared_ptr<Rendezvous> rendezvous, int rank);

}  // namespace cpsim
