// Multi-process jobs (sim/job/): this process is one rank of a job of N
// processes, on one host or many. The rank and size come from the environment
// (cpsim launch, torchrun-style RANK/WORLD_SIZE, Slurm, Open MPI); the processes
// meet through a store (file:DIR or redis://HOST:PORT) and talk over Gloo, which
// is the job's side channel (core/comm/side_channel.hpp) whatever backend the run uses.
//
// Once joined, run_ranks(n, fn) with RunOptions::job runs fn only on this
// process's rank (ranks 0..n-1 of the job form the group; the others sit the run
// out). Afterwards every process receives every rank's outputs and every rank's
// failure, so all processes hold the same results and make the same next call:
// the job stays in step, and any process can compare (rank 0 reports).
// launch.hpp starts the processes of a job on one host.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/side_channel.hpp"

namespace gloo::rendezvous {
class Store;
}

namespace cpsim::sim {

class GlooRank;

struct JobConfig {
  int rank = 0, size = 1;
  std::string store;   // file:DIR | redis://HOST:PORT
  std::string id;      // key prefix in the store: one job, one prefix
  std::string source;  // where rank and size came from, for messages
  std::chrono::milliseconds timeout{20000};
};

// Rank and size from RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or
// OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (first found), the store from
// CPSIM_STORE and the job id from CPSIM_JOB_ID (else the Slurm or Open MPI job
// id). Nothing when no launcher set a rank. Throws InvalidInput on inconsistent
// values.
std::optional<JobConfig> job_from_environment();

class ProcessJob final : public Job {
 public:
  // Joins the job: claims this rank in the store, connects to every other
  // process (all must join). Throws InvalidInput when the rank is claimed by
  // another process, CollectiveError when peers do not come within the timeout.
  explicit ProcessJob(const JobConfig& config);
  // Leaves the job: one last barrier (nobody closes a connection a peer still
  // reads from) unless it broke. Destroying a job that did not leave just closes
  // its connections, and its peers see them lost.
  void leave();

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string failure() const override { return failure_; }
  void run(int n, const RankFn& fn, std::chrono::milliseconds timeout, const RankOutputs& outputs,
           const JobTransport& transport) override;

  // A session: this process's rank of a group of every process, held open for
  // calls that come as a program makes them (the torch backend's process group),
  // not for one run_ranks run. Each call is checked over the session's own side
  // channel under `timeout`. name "" is the job's own group; any other name
  // connects a fresh group (every process must open it), so that what fails in
  // it (a mismatch, a rank that raised) stays in it. With `ranks` (ascending job
  // ranks, this process among them), the group is of those processes only, this
  // process its rank ranks.index(rank()); only they open it.
  class Session {
   public:
    Session(std::shared_ptr<GlooRank> rank, std::unique_ptr<Communicator> comm);
    ~Session();
    const std::shared_ptr<Communicator>& communicator() const { return comm_; }
    // The program returned: a peer still in a call learns it (and this rank's
    // finish throws the report); a transport failure throws too.
    void finish();
    // The program raised: peers fail with "rank R threw: what". Never throws.
    void fail(const std::string& what) noexcept;
    // The group's Gloo rank (its context carries the torch backend's point to point).
    const std::shared_ptr<GlooRank>& gloo() const { return rank_; }

   private:
    std::shared_ptr<GlooRank> rank_;
    std::shared_ptr<Communicator> comm_;
  };
  std::unique_ptr<Session> open_session(const std::string& name, std::chrono::milliseconds timeout,
                                        const JobTransport& transport, const std::vector<int>& ranks = {});

  // Every process must run the same job: same command, same batch bytes. Each
  // passes a fingerprint of its own; throws InvalidInput naming the ranks that
  // differ from rank 0 (say, a batch file that changed on one host), on every
  // process.
  void expect_same(std::uint64_t fingerprint);

 private:
  std::shared_ptr<gloo::rendezvous::Store> prefixed(const std::string& prefix);
  std::shared_ptr<GlooRank> connect(int n, const std::string& name);
  std::shared_ptr<GlooRank> group(int n);
  [[noreturn]] void fail(const std::string& why);

  JobConfig config_;
  std::shared_ptr<gloo::rendezvous::Store> base_;
  std::shared_ptr<gloo::rendezvous::Store> job_;  // base, under the job id: where ranks meet, and failure records
  std::vector<std::shared_ptr<gloo::rendezvous::Store>> prefixes_;
  std::shared_ptr<GlooRank> all_;                    // every process
  std::map<int, std::shared_ptr<GlooRank>> groups_;  // ranks 0..n-1, for n < size
  std::string failure_;
};

}  // namespace cpsim::sim
