// run_ranks: runs one function per rank of a group, each with its own Communicator
// of the chosen backend, and rethrows the first failure on the caller's thread once
// every rank has stopped. In one process the ranks are threads (backends threads
// and gloo). When this process has joined a multi-process gloo job (sim/world.hpp),
// it runs only its own rank and then receives every rank's outputs.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "sim/world.hpp"

namespace cpsim::sim {

struct RunOptions {
  std::string backend = "threads";  // threads | gloo
  std::chrono::milliseconds timeout{20000};
};

using RankFn = std::function<void(Communicator&)>;
// RankOutputs (sim/world.hpp): lists of per-rank results, n slots each, that rank r
// fills at index r. Across processes run_ranks hands every slot to every process;
// in one process the threads fill them directly.

// Runs fn on n ranks. Throws the first rank failure (the root cause: later
// CollectiveErrors on the peers are consequences of it).
void run_ranks(int n, const RankFn& fn, const RunOptions& options = {}, const RankOutputs& outputs = {});

// Backend names run_ranks accepts in this build.
std::vector<std::string> simulated_backends();

}  // namespace cpsim::sim
