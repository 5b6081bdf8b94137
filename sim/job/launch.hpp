// `cpsim launch -n N -- COMMAND...`: starts N processes of one Gloo job on this
// host and supervises them. Each process gets RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, CPSIM_STORE, CPSIM_JOB_ID and (unless set) CPSIM_GLOO_HOST=127.0.0.1.
// When a process dies or fails, launch writes why into the store (key
// failed/<rank> of the job) so its peers can name it, gives the others `grace`
// to exit, then kills what is left: it never hangs. The result is the worst exit
// status of the processes (128+signal for a killed one).
#pragma once

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

namespace cpsim::sim {

struct LaunchOptions {
  int processes = 2;
  std::string store;  // empty: file: store in a fresh temporary directory, removed afterwards
  std::chrono::milliseconds grace{30000};
  std::vector<std::string> command;  // "cpsim" as the program means this very executable
};

int launch_processes(const LaunchOptions& options, std::ostream& log);

}  // namespace cpsim::sim
