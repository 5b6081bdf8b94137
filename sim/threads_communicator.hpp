// The `threads` backend: ranks are threads of one process and collectives move
// bytes through shared memory, one copy per byte (each rank pulls what it needs
// straight from its peers' buffers). Reductions add in rank order, so results are
// bitwise deterministic. The group checks every call against its peers and turns
// distributed bugs into CollectiveErrors on every rank, never a hang:
//   different collectives, sizes or dtypes at one sequence number; a rank that
//   never arrives (timeout); a rank that threw; a rank that returned early.
// The whole group is poisoned by the first such error, so every peer fails fast.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "sim/call_check.hpp"

namespace cpsim::sim {

class ThreadsGroup : public std::enable_shared_from_this<ThreadsGroup> {
 public:
  ThreadsGroup(int size, std::chrono::milliseconds timeout);
  int size() const { return static_cast<int>(ranks_.size()); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::unique_ptr<Communicator> communicator(int rank);

  // Lifecycle hooks for the launcher: a rank that returned, or threw.
  void finish(int rank);
  void fail(int rank, const std::string& what);

  // Runs one collective for `rank`: rendezvous, consistency check, then `read`
  // (may read every peer's buffers), a second rendezvous, then `after`.
  void run(int rank, CallRecord call, std::chrono::milliseconds timeout,
           const std::function<void(const std::vector<CallRecord>&)>& read,
           const std::function<void()>& after = {});

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

}  // namespace cpsim::sim
