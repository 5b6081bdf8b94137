// The properties cpsim verifies (SPEC §5). Each compares a sharded result,
// gathered from every rank of a group of a registered backend, with an unsharded
// reference. They form one table (property_table): each row names what it runs,
// how it compares (bitwise, or within a tolerance) and the bytes a rank moves, and
// one harness (check_all) runs every row on a case prepared once, on the model's
// path: shard_batch gives each rank its packed context, and the operators run on
// it as a training step calls them.
//
// The check_* functions run one row with the implementation under test as a
// parameter (defaulting to the real one), so negative-control tests hand a
// deliberately broken variant to the same property and watch it fail.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/job.hpp"
#include "core/autograd.hpp"
#include "core/halo.hpp"
#include "core/shard.hpp"
#include "verify/cases.hpp"
#include "verify/reference.hpp"

namespace cpsim::verify {

struct CheckOptions {
  std::string backend = "threads";
  int conv_width = 4;
  int channels = 8;
  int heads = 2, key_dim = 4, value_dim = 4;  // recurrence
  std::chrono::milliseconds timeout{20000};
  std::shared_ptr<Job> job = nullptr;  // the multi-process job the runs go to (sim/job/), or none
};

struct PropertyResult {
  std::string property;
  int cp = 1;
  bool ok = false;
  double error = 0;    // wrong elements, or relative RMSE for floating-point results
  std::string detail;  // why it failed
  // The run could not complete (a rank timed out or died, memory ran out): no
  // verdict on the code under test, and not a failure of the property.
  bool aborted = false;
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
  ReferenceGeometry g;
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
                                           bool shard_primary)>;
using GatherFn = std::function<Var(const Var& x, Communicator* comm, bool differentiable)>;
using AnchorFn = std::function<Var(const Var& gathered)>;

using HaloFn = std::function<Var(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange)>;
using ConvFn = std::function<Var(const Var& x_window, const Tensor& window_doc_ids, const Var& weight, const Var& bias)>;

using RecurrenceFn = std::function<Var(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                                       const PackedContext& context, Communicator* comm)>;
// How the sequence is split across ranks: contiguous (SPEC §2), or the load-balanced
// zigzag (rank r holds chunks r and 2c-1-r) that recurrent layers cannot use.
enum class Sharding { contiguous, zigzag };

LayoutFn default_layout();
RecurrenceFn default_recurrence();
HaloFn default_halo();
ConvFn default_conv();
ShardFn default_shard();
GatherFn default_gather();
AnchorFn default_anchor();

// Doc ids, padding and positions against reference_layout (and, for a generated case,
// the generator's construction), and the seq_lens <-> cu_seqlens <-> doc ids <->
// segments round trips.
PropertyResult check_layout(const LayoutCase& c, const LayoutFn& layout = default_layout());
// Shards concatenate to the padded global tensors (every [B, S] key); local doc ids,
// row_cu_seqlens and the recurrent CP context tile each shard. Geometry and
// expectations come from the reference, so a wrong size is a failure, not a crash.
PropertyResult check_shard(const LayoutCase& c, const ShardFn& shard = default_shard());
// gather_sequence forward is bitwise the global tensor, for every dtype.
PropertyResult check_gather_forward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather = default_gather());
// Backward: each rank's gradient is the rank-order sum of every rank's upstream slice.
PropertyResult check_gather_backward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather = default_gather());
// Ranks whose loss ignores the gathered tensor: with the anchor backward completes with the
// right gradients; without it the simulator reports the skipped collective (never hangs).
PropertyResult check_anchor(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather = default_gather(),
                            const AnchorFn& anchor = default_anchor());

// Halo forward is bitwise the zero-padded previous W-1 global positions (both exchanges).
PropertyResult check_halo_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = default_halo());
// Halo backward returns each history gradient to the rank that owns the position.
PropertyResult check_halo_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = default_halo());
// Sharded packed causal conv matches the unsharded reference (relative RMSE <= 1e-12).
// With neither part given, the model's layer (sharded_packed_conv); a given part
// replaces that part of the layer (halo, then conv over the window's doc ids).
PropertyResult check_conv_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = {},
                                  const ConvFn& conv = {});
// dx per rank, dw and dbias summed over ranks, match the unsharded reference.
PropertyResult check_conv_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = {},
                                   const ConvFn& conv = {});

inline constexpr double kConvTolerance = 1e-12;
inline constexpr double kRecurrenceTolerance = 1e-10;

// The CP gated delta rule: outputs o match the unsharded recurrence.
PropertyResult check_recurrence_forward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn = {},
                                        Sharding sharding = Sharding::contiguous);
// Gradients of q, k, v, beta, g match the unsharded recurrence.
PropertyResult check_recurrence_backward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn = {},
                                         Sharding sharding = Sharding::contiguous);

// ---------------------------------------------------------------------------
// The table: like nccl-tests' table of collectives, one row per property.

enum class Comparison { bitwise, tolerance };

struct PropertyRow {
  std::string name;
  std::string claim;
  // How results compare on a backend whose sums run in rank order; sums on other
  // backends compare within a tolerance (Capabilities::rank_order_sums).
  Comparison comparison = Comparison::bitwise;
  double tolerance = 0;      // relative RMSE bound, for Comparison::tolerance
  bool runs_ranks = false;   // needs a backend (else a single-process check)
  // Bytes one rank sends through its communicator for one case.
  std::function<std::int64_t(const Prepared&, const CheckOptions&)> bytes;
  std::function<PropertyResult(Prepared&, const CheckOptions&)> check;
};

// Every property, in the order `cpsim check` reports them.
const std::vector<PropertyRow>& property_table();

// Every row of the table on one case, prepared once.
std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o);

}  // namespace cpsim::verify
