// Process mode of the gloo backend: this process is one rank of a job of N
// processes, on one host or many. The rank and size come from the environment
// (cpsim launch, torchrun-style RANK/WORLD_SIZE, Slurm, Open MPI); the processes
// meet through a rendezvous store (file:DIR or redis://HOST:PORT).
//
// Once a process has joined, run_ranks(n, fn) with backend gloo runs fn only on
// this process's rank (ranks 0..n-1 of the job form the group; the others sit the
// run out). Afterwards every process receives every rank's outputs and every
// rank's failure, so all processes hold the same results and make the same next
// call: the job stays in step, and any process can compare (rank 0 reports).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/tensor.hpp"

namespace cpsim::sim {

struct WorldConfig {
  int rank = 0, size = 1;
  std::string store;   // file:DIR | redis://HOST:PORT
  std::string job;     // key prefix in the store: one job, one prefix
  std::string source;  // where rank and size came from, for messages
  std::chrono::milliseconds timeout{20000};
};

// Rank and size from RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or
// OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (first found), the store from
// CPSIM_STORE and the job from CPSIM_JOB_ID (else the Slurm or Open MPI job id).
// Nothing when no launcher set a rank. Throws InvalidInput on inconsistent values.
std::optional<WorldConfig> world_from_environment();

// Joins the job: connects to every other process (all must call it). Throws
// CollectiveError when peers do not come within the timeout.
void join_world(const WorldConfig& config);
// Leaves the job (closes the connections); a no-op when not joined.
void leave_world();

// Every process must run the same job: same command, same batch bytes. Each passes
// a fingerprint of its own; throws InvalidInput naming the ranks that differ from
// rank 0 (say, a batch file that changed on one host), on every process.
void expect_same_job(std::uint64_t fingerprint);

struct WorldInfo {
  int rank = 0, size = 1;
  std::string failure;  // non-empty once a timeout or lost peer broke the job
};
// The joined job, or nothing in a single process.
std::optional<WorldInfo> current_world();

class GlooRank;
// The communicator a group's rank runs fn with, made from its Gloo rank: a backend
// that moves data another way (nccl) keeps the Gloo rank as the side channel its
// calls are checked over, and shares its setup (a unique id) through it.
using RankTransport = std::function<std::unique_ptr<Communicator>(const std::shared_ptr<GlooRank>& side, int n)>;

// run_ranks in process mode (see above). Throws the root cause of a failed run
// on every process. Without `transport`, ranks run on the Gloo group itself.
void run_in_world(int n, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout,
                  const RankOutputs& outputs, const RankTransport& transport = {});

// Bytes of a list of tensors (undefined ones included) and back.
std::vector<std::uint8_t> serialize_tensors(const std::vector<Tensor>& tensors);
std::vector<Tensor> deserialize_tensors(const std::uint8_t* data, std::size_t size);

}  // namespace cpsim::sim
