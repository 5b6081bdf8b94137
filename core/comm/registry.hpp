// Backends by name. Each backend registers itself here with a
// static BackendRegistrar; everything above it (verify/, the command line, tests,
// bench) runs "every registered backend" through run_ranks and never includes one.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/side_channel.hpp"

namespace cpsim {

// The ranks of one run in this process: a communicator per rank, and the
// lifecycle hooks that let a backend fail the peers of a rank that stopped.
class Group {
 public:
  virtual ~Group() = default;
  // Called on rank r's own thread.
  virtual std::unique_ptr<Communicator> communicator(int rank) = 0;
  virtual void finish(int rank) = 0;                          // rank returned
  virtual void fail(int rank, const std::string& what) = 0;  // rank threw (never throws)
  virtual void done() {}                                      // every rank has stopped
};

struct Backend {
  std::string name;
  std::string description;  // one line, for --help and errors
  Capabilities capabilities;
  // A group of n ranks as threads of this process; `names` say how its reports
  // name them (a subgroup's global ranks; {} for a run of its own).
  std::function<std::shared_ptr<Group>(int n, std::chrono::milliseconds timeout, const RankNames& names)> make_group;
  // Why this backend cannot run here (no device, say), or nothing.
  std::function<std::optional<std::string>()> unavailable = [] { return std::nullopt; };
  // This backend's rank in a multi-process job (core/comm/side_channel.hpp); empty: its
  // ranks run only as threads of one process.
  JobTransport job_transport = nullptr;
  // The most ranks one group may have in this process (outside a multi-process job) (nccl: one per visible GPU),
  // with the reason; 0 means no limit.
  std::function<std::pair<int, std::string>()> max_ranks = [] { return std::pair<int, std::string>{0, ""}; };
};

void register_backend(Backend backend);
// The backend of that name; throws Unavailable naming the registered ones.
const Backend& find_backend(const std::string& name);
// Registered backends, in registration order (threads first).
std::vector<std::string> backend_names();
// Those that can run here (unavailable() says nothing).
std::vector<std::string> available_backends();

// Registers a backend during static initialisation (define one per backend folder).
struct BackendRegistrar {
  explicit BackendRegistrar(Backend backend) { register_backend(std::move(backend)); }
};

}  // namespace cpsim
