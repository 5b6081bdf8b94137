// The command line's options, parsed once (cli/options.cpp) into one struct that
// the commands read.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/conv.hpp"
#include "core/model_shape.hpp"
#include "core/shard_plan.hpp"
#include "sim/job/job.hpp"
#include "sim/job/launch.hpp"

namespace cpsim::cli {

// Exit statuses: every property holds; a property failed; bad usage or invalid
// input; the run could not complete (a rank died or timed out, memory, a store or
// another resource failed: no verdict on the code under test).
inline constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2, kExitAborted = 3;
inline constexpr const char* kVersion = "cpsim 0.4.0";

// Options of every command that runs ranks.
struct JobArgs {
  std::string backend = "threads";
  bool backend_given = false;
  std::string store;     // process mode: overrides CPSIM_STORE
  double timeout = 20;   // seconds a rank waits for its peers
  int rank = 0, size = 1;  // this process in a multi-process job
  bool multi = false;
  std::shared_ptr<sim::ProcessJob> joined;  // that job, once joined
};

// The shapes and seed of the seeded inputs the properties draw (check, golden).
struct ModelArgs : ModelShape {
  std::uint64_t seed = 0;
};

// --plan and --cost: equal, balanced (by --cost) or a plan file's cuts; fuzz also
// takes random (drawn plans, its default).
struct PlanOption {
  std::string plan = "equal";
  std::string cost = "attention";
};

struct CheckArgs {
  std::vector<std::string> batches;
  PlanOption plan;
  std::vector<int> cp_sizes{1, 2, 3, 4, 8};
  bool cp_given = false;
  JobArgs job;
  ModelArgs model;
  bool json = false;
  bool row_memory = false;  // each row's peak resident bytes (resets the process's high-water mark)
  std::string max_memory;  // "8G"; empty: 80% of the machine's memory
  double max_time = 0;     // seconds of CPU a batch may be estimated to take (0: no limit)
  std::vector<std::string> rows, skip;  // the property rows to run, or to leave out
  bool quiet = false;                   // no progress lines
};

struct FuzzArgs {
  int cases = 200;
  PlanOption plan{"random"};
  std::uint64_t seed = 1;
  int max_cp = 16;
  JobArgs job;
  ModelArgs model;  // its seed unused: each drawn case has its own
  std::string out = "cpsim-counterexample.json";
  std::string family;  // draw only members of this layout family (a family file)
};

// cpsim harness: the generator side of cpsim.torch.check (cli/harness.cpp).
struct HarnessArgs {
  int cases = 100;
  int max_cp = 8;
  int cp = 0;  // every case at this CP size (the processes of a job); 0: drawn, 1..max_cp
  std::vector<int> cp_sizes;  // drawn from this list, each as often as any other (instead of 1..max_cp)
  std::string batch;          // replay this batch file at --cp (one case, no drawing)
  std::string family;
  PlanOption plan;  // equal, balanced (by its cost) or random (drawn cuts); with batch, a plan file too
  std::optional<std::uint64_t> seed;  // RapidCheck's (RC_PARAMS, else random) when unset
  int conv_width = kDefaultConvWidth;
  bool shard_primary = false;
  std::string dtype = "f64";  // of every floating input and expected value: f64, f32 or bf16
  std::int64_t pad_multiple = 1;  // the sequence padded to a multiple of cp * this
  int min_shard = 1;  // drawn layouts give every rank (equal plan) at least this many positions
  std::vector<std::string> forms;  // random layouts only in these forms (family form names); empty: all
  int probes = 2;  // layouts just outside each contract (--min-shard, --forms) handed to the step after
  int long_every = 0;                    // 1 in N random layouts long (0: none)
  std::vector<int> long_lengths{64, 512};  // the long ones' lengths, at least and at most
  bool long_per_rank = false;            // the long lengths are each rank's (S = cp x the drawn length)
  int live_gates_every = 0;              // 1 in N cases draws the recurrence's gates live (0: none)
  int rows_multiple = 1;  // every layout a multiple of this many rows (check(dp=D): D replicas' rows)
  std::string workdir;
};

struct ShowArgs {
  std::string batch;
  PlanOption plan;
  std::string family;  // instead of a batch: draw members of this family
  int samples = 3;
  std::uint64_t seed = 1;
  int cp = 1;
  int conv_width = kDefaultConvWidth;
  std::string svg;            // write an SVG here as well
  std::string color = "auto";  // auto | always | never
};

struct GoldenArgs {
  std::string batch, out;
  PlanOption plan;
  int cp = 2;
  bool shard_primary = false;
  std::string index_dtype = "int64";
  std::int64_t pad_multiple = 1;
  std::string dtype = "f64";
  ModelArgs model;
};

struct LaunchArgs {
  sim::LaunchOptions launch;
  double grace = 30;  // seconds
};

struct BenchArgs {
  std::vector<std::string> backends;  // empty: every backend that can run here
  std::vector<int> ranks{2, 4, 8};
  std::vector<std::string> sizes{"8", "64", "512", "4K", "32K", "256K", "2M", "16M"};
  std::vector<std::string> ops{"all_gather", "reduce_scatter", "send_recv"};
  int iterations = 0;        // 0: enough for about 256 MiB of traffic a point
  double properties = 0;     // seconds of property throughput per row (0: none)
  bool json = false;
  std::string svg;
  bool quick = false;  // a first look in under a minute: threads, 2 and 4 ranks, three sizes
  JobArgs job;  // in a multi-process job: gloo or nccl, one rank per process
};

struct PlanArgs {
  std::string batch, family;
  int cp = 2;
  std::string cost = "attention";
  int samples = 200;
  std::uint64_t seed = 1;
  bool json = false;
  std::string svg;
  ModelArgs model;
};

enum class Command { check, fuzz, show, golden, plan, launch, bench, harness };

struct Options {
  Command command = Command::check;
  CheckArgs check;
  FuzzArgs fuzz;
  ShowArgs show;
  GoldenArgs golden;
  PlanArgs plan;
  LaunchArgs launch;
  BenchArgs bench;
  HarnessArgs harness;
};

// The options of argv, or the exit status when parsing ended the run (--help: 0,
// a usage error: 2, after CLI11 printed its message).
struct Parsed {
  std::optional<Options> options;
  int exit_status = kExitOk;
};
Parsed parse_options(int argc, char** argv);

// The plan --plan names: equal, balanced (by --cost), or the cuts of a plan file
// ({"cuts": [0, a_1, ..., P]}; InvalidInput naming the file and field). nullopt
// for random (fuzz: drawn plans).
std::optional<PlanChoice> plan_choice_of(const PlanOption& arg);
// A plan file's cuts must fit a batch: c + 1 cuts for CP size c, from 0 to its P.
void expect_plan_fits(const PlanChoice& plan, std::int64_t seq_len, int cp, const std::string& batch,
                      std::int64_t pad_multiple = 1);

}  // namespace cpsim::cli
