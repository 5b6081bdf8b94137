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
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"

namespace cpsim {

class Rendezvous {
 public:
  Rendezvous(int size, std::chrono::milliseconds timeout);
  int size() const { return static_cast<int>(ranks_.size()); }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // One call of `rank`: rendezvous, check, then `read` (which may read every
  // peer's buffers through their records), a second rendezvous, then `after`.
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
    std::uint64_t posted = 0, done = 0;
    CallRecord call;
    std::string last = "nothing";
    std::string failure;
  };
  std::string states_locked() const;
  [[noreturn]] void poison_locked(const std::string& why);

  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<RankState> ranks_;
  std::optional<std::string> poison_;
};

}  // namespace cpsim
