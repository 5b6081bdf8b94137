// Joining a multi-process job: where a process finds its rank (torchrun-style
// variables, Slurm, Open MPI), and how a rank is claimed in the store (a job id
// is used once per store; of two processes that want one rank, one gets it).
#include <gmock/gmock.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "core/error.hpp"
#include "sim/job/job.hpp"
#include "tests/subprocess.hpp"

using namespace cpsim;
using namespace std::chrono_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;
using cpsim::testing::run_process;

namespace {
const std::string kCpsim = CPSIM_BINARY;
const std::string& kExample = cpsim::testing::kSpecExample;
}  // namespace

// Where a process finds its rank.

namespace {
struct Env {
  std::vector<std::string> keys;
  void set(std::initializer_list<std::pair<std::string, std::string>> variables) {
    for (const auto& [k, v] : variables) {
      setenv(k.c_str(), v.c_str(), 1);
      keys.push_back(k);
    }
  }
  ~Env() {
    for (const auto& k : keys) unsetenv(k.c_str());
  }
};
const char* kAllRankVariables[] = {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
                                   "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "CPSIM_STORE",
                                   "CPSIM_JOB_ID", "OMPI_MCA_ess_base_jobid"};
void clear_rank_variables() {
  for (const char* k : kAllRankVariables) unsetenv(k);
}
// The job the environment names, expected to be rank `rank` of `size` (a job of
// rank -1 where it names none).
sim::JobConfig expect_job(int rank, int size) {
  const auto w = sim::job_from_environment();
  EXPECT_TRUE(w);
  if (!w) return sim::JobConfig{.rank = -1};
  EXPECT_EQ(w->rank, rank);
  EXPECT_EQ(w->size, size);
  return *w;
}
}  // namespace

TEST(JobEnvironment, NoLauncherMeansOneProcess) {
  clear_rank_variables();
  EXPECT_FALSE(sim::job_from_environment());
}

TEST(JobEnvironment, TorchrunStyleVariablesWinOverSlurmAndOpenMpi) {
  clear_rank_variables();
  Env e;
  e.set({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "123"}, {"OMPI_COMM_WORLD_RANK", "1"},
         {"OMPI_COMM_WORLD_SIZE", "2"}});
  auto w = expect_job(5, 8);
  EXPECT_EQ(w.source, "Slurm");
  EXPECT_EQ(w.id, "slurm-123.0");
  e.set({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"CPSIM_STORE", "redis://10.0.0.1:6379"}, {"CPSIM_JOB_ID", "run-42"}});
  w = expect_job(3, 4);
  EXPECT_EQ(w.store, "redis://10.0.0.1:6379");
  EXPECT_EQ(w.id, "run-42");
}

TEST(JobEnvironment, OpenMpiVariables) {
  clear_rank_variables();
  Env e;
  e.set({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(expect_job(1, 2).source, "Open MPI");
}

TEST(JobEnvironment, ARankOutsideTheJobIsInvalid) {
  clear_rank_variables();
  Env e;
  e.set({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
  EXPECT_THROW(sim::job_from_environment(), InvalidInput);
  e.set({{"RANK", "x"}});
  EXPECT_THROW(sim::job_from_environment(), InvalidInput);
}

// A job id is used once per store: a second job under the same id is refused
// (exit 2, naming the id and the process that holds it), never joined.
TEST(JobClaims, AJobIdAlreadyInUseOnAStoreIsRefused) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-test-jobid-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  auto run_job = [&](const std::string& job) {
    std::vector<cpsim::testing::ProcessResult> results(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      std::vector<std::pair<std::string, std::string>> env = {
          {"WORLD_SIZE", "2"}, {"RANK", std::to_string(r)}, {"CPSIM_STORE", "file:" + dir.string()},
          {"CPSIM_JOB_ID", job}, {"CPSIM_GLOO_HOST", "127.0.0.1"}};
      ranks.emplace_back([&, r, env] { results[r] = run_process({kCpsim, "check", kExample, "--timeout", "5"}, 60s, {}, env); });
    }
    for (auto& t : ranks) t.join();
    return results;
  };
  const auto first = run_job("once");
  for (const auto& r : first) EXPECT_EQ(r.status, 0) << r.out << r.err;
  const auto start = std::chrono::steady_clock::now();
  const auto second = run_job("once");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  for (const auto& r : second) {
    EXPECT_EQ(r.status, 2) << r.out << r.err;
    EXPECT_THAT(r.err, AllOf(HasSubstr("job id 'once' is already in use on store file:"), HasSubstr("claimed by")));
  }
  const auto other = run_job("another");  // the same store under another id: fine
  for (const auto& r : other) EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::filesystem::remove_all(dir);
}

// Two identical jobs (one id, one store) started in the same instant: each rank is
// claimed atomically before anyone connects, so exactly one process gets each
// rank and runs; every other one is refused at once (exit 2). Never two runs of
// one rank, never a process that waits for a partner that was refused.
TEST(JobClaims, TwoIdenticalJobsStartedTogetherGiveEachRankToOneProcess) {
  for (int trial = 0; trial < 5; ++trial) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("cpsim-test-twins-" + std::to_string(getpid()) + "-" + std::to_string(trial));
    std::filesystem::remove_all(dir);
    std::vector<cpsim::testing::ProcessResult> results(4);
    std::vector<std::thread> procs;
    for (int p = 0; p < 4; ++p) {
      std::vector<std::pair<std::string, std::string>> env = {
          {"WORLD_SIZE", "2"}, {"RANK", std::to_string(p % 2)}, {"CPSIM_STORE", "file:" + dir.string()},
          {"CPSIM_JOB_ID", "twins"}, {"CPSIM_GLOO_HOST", "127.0.0.1"}};
      procs.emplace_back([&, p, env] {
        results[p] = run_process({kCpsim, "check", kExample, "--cp", "2", "--timeout", "5"}, 60s, {}, env);
      });
    }
    for (auto& t : procs) t.join();
    int ran[2] = {0, 0}, refused = 0;
    for (int p = 0; p < 4; ++p) {
      if (results[p].status == 0) ++ran[p % 2];
      else if (results[p].status == 2 && results[p].err.find("is already in use") != std::string::npos) ++refused;
      else ADD_FAILURE() << "trial " << trial << " process " << p << ": status " << results[p].status << "\n" << results[p].err;
    }
    EXPECT_EQ(ran[0], 1) << "trial " << trial;
    EXPECT_EQ(ran[1], 1) << "trial " << trial;
    EXPECT_EQ(refused, 2) << "trial " << trial;
    std::filesystem::remove_all(dir);
  }
}

