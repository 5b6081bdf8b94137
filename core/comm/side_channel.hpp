// A multi-process job, as run_ranks sees it: this process is one rank of a job
// of N processes (sim/job/ joins one), so a run of n ranks runs only this
// process's rank here and hands every rank's outputs to every process.
//
// The processes of a job share a side channel: it checks every call (a
// CallChannel) and moves small bytes. A backend that moves its data another way
// (nccl) builds its rank's transport from the side channel of the run's ranks
// (sharing a unique id over it) and has its calls checked over it; the job never
// learns which backend runs on it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"
#include "core/tensor.hpp"

namespace cpsim {

// One rank's function in a run.
using RankFn = std::function<void(Communicator&)>;
// Per-rank outputs of a run: lists of n slots, slot[r] written by rank r. In a
// job every process receives every slot.
using RankOutputs = std::vector<std::vector<Tensor>*>;

class SideChannel : public CallChannel {
 public:
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  // `bytes` bytes of rank `root`'s buffer into every rank's.
  virtual void broadcast_bytes(void* data, std::size_t bytes, int root) = 0;
  // Every rank's `bytes` bytes into `out` (size() * bytes), in rank order.
  virtual void all_gather_bytes(const void* in, void* out, std::size_t bytes) = 0;
};

// A backend's communicator for this process's rank of a run of n ranks, made from
// the side channel of those n ranks.
using JobTransport = std::function<std::unique_ptr<Communicator>(const std::shared_ptr<SideChannel>& side, int n)>;

class Job {
 public:
  virtual ~Job() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Why the job broke (a timeout or a lost peer: every later run fails), or "".
  virtual std::string failure() const = 0;
  // run_ranks in the job: fn runs on this process's rank when it is below n,
  // over the communicator `transport` makes; then every process receives every
  // rank's outputs and failure, and throws the root cause of a failed run.
  virtual void run(int n, const RankFn& fn, std::chrono::milliseconds timeout, const RankOutputs& outputs,
                   const JobTransport& transport) = 0;
};

}  // namespace cpsim
