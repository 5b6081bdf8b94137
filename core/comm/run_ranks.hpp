// run_ranks: runs one function per rank of a group of a registered backend, each
// with its own Communicator, and rethrows the first failure on the caller's thread
// once every rank has stopped. In one process the ranks are threads. When this
// process is one rank of a multi-process job of that backend, it runs only its
// own rank, and every process receives every rank's outputs.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/comm/registry.hpp"

namespace cpsim {

struct RunOptions {
  std::string backend = "threads";
  std::chrono::milliseconds timeout{20000};
  // The multi-process job this process is one rank of (sim/job/), or none: the
  // ranks are threads of this process.
  std::shared_ptr<Job> job = nullptr;
};

// Runs fn on n ranks. Throws the first rank failure (the root cause: later
// CollectiveErrors on the peers are consequences of it), or Unavailable when the
// backend is unknown, cannot run here or cannot run in the job.
void run_ranks(int n, const RankFn& fn, const RunOptions& options = {}, const RankOutputs& outputs = {});

}  // namespace cpsim
