// The properties cpsim verifies (SPEC §5). Each compares a sharded result,
// gathered from every rank of a group of a registered backend, with an unsharded
// reference. They form one table (property_table): each row names what it runs,
// how it compares (bitwise, or within a tolerance) and the bytes a rank moves, and
// one driver (check_all) runs every row on a case prepared once, on the model's
// path: shard_batch gives each rank its packed context, and the operators run on
// it as a training step calls them.
//
// check_row runs one row with the implementation under test (Impl: the model's
// own operators unless replaced), so negative-control tests hand a deliberately
// broken variant to the same property and watch it fail.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/conv.hpp"
#include "core/comm/side_channel.hpp"
#include "core/attention.hpp"
#include "core/autograd.hpp"
#include "core/halo.hpp"
#include "core/model_shape.hpp"
#include "core/shard.hpp"
#include "verify/cases.hpp"
#include "verify/reference.hpp"

namespace cpsim::verify {

struct CheckOptions : ModelShape {  // the seeded inputs' shape (core/model_shape.hpp)
  std::string backend = "threads";
  std::chrono::milliseconds timeout{20000};
  std::shared_ptr<Job> job = nullptr;  // the multi-process job the runs go to (sim/job/), or none
  // check_all measures each row's peak resident memory, resetting the process's
  // high-water mark before each row (the process's own peak is then lost).
  bool row_memory = false;
  // The rows check_all runs, by name (empty: every row of the table).
  std::vector<std::string> rows;
  // Told before each row check_all runs (its name, how many rows of this case
  // ran before it, how many it runs in all) and once after the last (name "").
  std::function<void(const std::string& row, int done, int total)> on_row;
  // 1 in N cases (by the case's seed; 0: none) draws the recurrence's gates live
  // (random_recurrence_inputs): a state that outlives a chunk, heads that differ.
  int live_gates_every = 0;
};

// The work of the attention rows on a layout (doc ids and padding [B, S] or
// [B, P], the cuts of `g`, the case's seed): the (query, key) pairs they evaluate
// and how many of the real queries, as the rows choose them.
struct AttentionWork {
  std::int64_t pairs = 0, queries_evaluated = 0, queries = 0;
};
AttentionWork attention_work(const Tensor& doc_ids, const Tensor& padding, const ReferenceGeometry& g,
                             std::uint64_t seed);

// The names of the table's rows, in its order.
std::vector<std::string> property_row_names();
// The rows named in `names` ("NAME,NAME"), or every row but them (skip); an
// unknown name is InvalidInput listing the names.
std::vector<std::string> choose_rows(const std::vector<std::string>& only, const std::vector<std::string>& skip);

struct GoldenBuild;  // verify/golden_build.hpp

struct PropertyResult {
  std::string property;
  int cp = 1;
  bool ok = false;
  double error = 0;    // wrong elements, or relative RMSE for floating-point results
  std::string detail;  // why it failed
  // The run could not complete (a rank timed out or died, memory ran out): no
  // verdict on the code under test, and not a failure of the property.
  bool aborted = false;
  // CPU time of the process while the row ran (every rank's thread; rows that
  // share a simulation count it in the first of them).
  double cpu_seconds = 0;
  // With CheckOptions::row_memory, the process's peak resident bytes while the row
  // ran (Linux: its high-water mark, reset before the row); else, or where the
  // system cannot say, 0.
  std::int64_t peak_bytes = 0;
  // The attention rows on long documents evaluate a chosen set of queries:
  // how many (-1: not such a row), of how many real ones, and the (query, key)
  // pairs evaluated. (Last: results are also made by position.)
  std::int64_t queries_evaluated = -1, queries = 0, pairs = 0;
};

// One case prepared once: its reference layout and geometry (never from the code
// under test), and every rank's packed context from shard_batch (the code under
// test, as a training step runs it). Simulations several rows share (the conv and
// the recurrence, forward and backward) are run once and kept here.
class Prepared {
 public:
  explicit Prepared(LayoutCase c);
  LayoutCase c;
  ReferenceShape shape;
  ReferenceGeometry g;  // with the reference's cuts of the case's plan
  LayoutTruth truth;
  Tensor padded_ids;  // [B, P], reference
  // Rank r's context; throws (naming why) when shard_batch threw for this case.
  const PackedContext& context(int rank) const;

  // Shared runs; the backward row of each pair (the later one in the table) lets
  // its run go, so that one pair's memory is free before the next pair runs.
  struct Runs;
  std::shared_ptr<Runs> runs;

 private:
  std::vector<PackedContext> contexts;
  std::exception_ptr shard_failure;
};

using LayoutFn = std::function<Layout(const Batch& batch)>;
using ShardFn = std::function<ShardedBatch(int rank, int cp, const Batch& batch, std::int64_t pad_token_id,
                                           bool shard_primary, const PlanChoice& plan)>;
// gather_sequence's form: every rank's interval from `plan` (its packed context's).
using GatherFn = std::function<Var(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan)>;
using AnchorFn = std::function<Var(const Var& gathered)>;

using HaloFn = std::function<Var(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange,
                                 const ShardPlan* plan)>;
using ConvFn = std::function<Var(const Var& x_window, const Tensor& window_doc_ids, const Var& weight, const Var& bias)>;

using RecurrenceFn = std::function<Var(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                                       const PackedContext& context, Communicator* comm)>;
// The layers that consume the layout (SPEC §3b). RoPE rotates a rank's x [B, L, H,
// D] by its positions. Attention runs one rank's layer on its q, k, v shards (after
// RoPE) with its context and its shard of padding_mask; with an indexer it is the
// top-k sparse form. Targets are this rank's [B, L] targets, made from the global
// rows [B, P] (token ids, doc ids, padding) and its context. The loss is the
// token-mean cross entropy of the rank's logits across ranks.
using RopeFn = std::function<Var(const Var& x, const Tensor& positions)>;
// `probe` ([B, L], undefined: every query) names the local queries the row
// evaluates on a long document; an implementation may evaluate more (the row
// compares outputs at the probed queries only, and their upstream gradient is
// the only one that is not zero) or pass it to cp_document_attention.
using AttentionFn = std::function<CpAttention(const Var& q, const Var& k, const Var& v, const PackedContext& context,
                                              const Tensor& local_padding, Communicator* comm,
                                              const SparseIndexer* indexer, const Tensor& probe)>;
using TargetsFn = std::function<Tensor(const Tensor& tokens, const Tensor& doc_ids, const Tensor& padding,
                                       const PackedContext& context)>;
using LossFn = std::function<Var(const Var& logits, const Tensor& targets, Communicator* comm)>;

// How the sequence is split across ranks: contiguous (SPEC §2), or the load-balanced
// zigzag (rank r holds chunks r and 2c-1-r) that recurrent layers cannot use.
enum class Sharding { contiguous, zigzag };

// The model's own operators (verify/model_operators.cpp).
LayoutFn default_layout();
RecurrenceFn default_recurrence();
HaloFn default_halo();
ConvFn default_conv();
ShardFn default_shard();
GatherFn default_gather();
AnchorFn default_anchor();
RopeFn default_rope();
AttentionFn default_attention();
TargetsFn default_targets();
LossFn default_loss();
// One rank's token shift of its shard (core/token_shift.hpp's form).
using TokenShiftFn = std::function<Var(const Var& x_masked, const PackedContext& context, Communicator* comm)>;
TokenShiftFn default_token_shift();

// The implementation under test: the operators the rows run, each the model's own
// where it is left empty. A negative control replaces one with a broken variant
// and runs the row that uses it: check_row("conv_forward", c, o, {.halo = broken}).
struct Impl {
  LayoutFn layout{};
  ShardFn shard{};
  GatherFn gather{};
  AnchorFn anchor{};
  HaloFn halo{};  // with conv: that part of the conv layer (neither: the layer itself)
  ConvFn conv{};
  RecurrenceFn recurrence{};
  Sharding sharding = Sharding::contiguous;  // the recurrence's (zigzag: a control)
  RopeFn rope{};
  AttentionFn attention{};
  TargetsFn targets{};
  LossFn loss{};
  TokenShiftFn token_shift{};
};

inline constexpr double kConvTolerance = 1e-12;
inline constexpr double kRecurrenceTolerance = 1e-10;
inline constexpr double kAttentionTolerance = 1e-10;  // attention, RoPE and loss (SPEC §3b)

// ---------------------------------------------------------------------------
// The table: like nccl-tests' table of collectives, one row per property.

enum class Comparison { bitwise, tolerance };

// The model shapes a row's cost depends on.
struct RowShapes {
  double cp, C, H, K, V;
  double vocab, Di, topk;
  double in() const { return H * (3 * K + V + 1) * 8; }  // q, k, g (K each), v (V), beta: float64
  double out() const { return H * V * 8; }               // o and its upstream gradient
  double states() const { return H * K * V * 8; }        // one K x V state per token and head
  static RowShapes of(int cp, const CheckOptions& o);
};

// What a row costs, per token of the padded batch (B x P), for the estimates
// `cpsim check` makes before it runs (verify/memory.hpp): the bytes it holds at its
// peak on top of what every row shares (fitted to peak RSS measured with `cpsim
// check --row-memory`, and kept an upper bound by
// Cli.TheMemoryEstimateBoundsTheMeasuredPeak), and microseconds of CPU, a + b x cp
// (fitted to `cpsim check --json`'s cpu_seconds on the threads backend at the
// default shapes), plus, for a row that runs an attention simulation, per (query,
// key) pair evaluated. A row that shares another row's simulation costs only its
// comparison.
struct RowCost {
  double (*bytes_per_token)(const RowShapes&) = nullptr;
  double us_per_token = 0, us_per_token_per_rank = 0, us_per_pair = 0;
};

struct PropertyRow {
  std::string name;
  std::string claim;
  // How results compare on a backend whose sums run in rank order; sums on other
  // backends compare within a tolerance (Capabilities::rank_order_sums).
  Comparison comparison = Comparison::bitwise;
  double tolerance = 0;      // relative RMSE bound, for Comparison::tolerance
  bool runs_ranks = false;   // needs a backend (else a single-process check)
  RowCost cost;
  // Bytes one rank sends through its communicator for one case.
  std::function<std::int64_t(const Prepared&, const CheckOptions&)> bytes;
  std::function<PropertyResult(Prepared&, const CheckOptions&, const Impl&)> check;
  // What the row adds to a golden folder (`cpsim golden`): its inputs, references
  // and each rank's values (empty: nothing; verify/golden_build.hpp).
  std::function<void(GoldenBuild&)> golden;
};

// Every property, in the order `cpsim check` reports them.
const std::vector<PropertyRow>& property_table();

// The table's rows by the file of verify/rows/ that defines them (a line of
// verify/rows/table.def each), in the table's order: the property suite runs
// each file's rows on every backend, on one prepared case per drawn layout.
struct RowFile {
  std::string name;               // "gather": verify/rows/gather.cpp
  std::vector<std::string> rows;  // its rows' names
  bool runs_ranks = false;        // whether any of its rows needs a backend
};
const std::vector<RowFile>& property_files();

// One row on a prepared case: its verdict, named; what the check throws is its
// failure (or, when the run could not complete, an aborted result).
PropertyResult run_row(const PropertyRow& row, Prepared& p, const CheckOptions& o, const Impl& impl = {});

// The row named `name` on one case, with `impl` under test: how a negative
// control runs one row against a broken operator. An unknown name is InvalidInput
// listing the names.
PropertyResult check_row(const std::string& name, const LayoutCase& c, const CheckOptions& o = {},
                         const Impl& impl = {});

// Every row of the table on one case, prepared once.
std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o);

}  // namespace cpsim::verify
