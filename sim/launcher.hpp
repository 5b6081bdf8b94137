// run_ranks: runs one function per rank of a simulated group in one process
// (threads, each with its own Communicator of the chosen backend), and rethrows
// the first failure on the caller's thread once every rank has stopped.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/communicator.hpp"

namespace cpsim::sim {

struct RunOptions {
  std::string backend = "threads";  // threads | gloo
  std::chrono::milliseconds timeout{20000};
};

using RankFn = std::function<void(Communicator&)>;

// Runs fn on n ranks. Throws the first rank failure (the root cause: later
// CollectiveErrors on the peers are consequences of it).
void run_ranks(int n, const RankFn& fn, const RunOptions& options = {});

// Backend names run_ranks accepts in this build.
std::vector<std::string> simulated_backends();

}  // namespace cpsim::sim
