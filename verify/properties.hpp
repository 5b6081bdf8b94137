// The properties cpsim verifies (SPEC §5), as functions that tests and the CLI
// call. Each compares a sharded result, gathered from every rank of a simulated
// group, with an unsharded reference. The implementation under test is a
// parameter (defaulting to the real one), so negative-control tests can hand a
// deliberately broken variant to the same property and watch it fail.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/autograd.hpp"
#include "core/halo.hpp"
#include "core/shard.hpp"
#include "verify/cases.hpp"

namespace cpsim::verify {

struct CheckOptions {
  std::string backend = "threads";
  int conv_width = 4;
  int channels = 8;
  int heads = 2, key_dim = 4, value_dim = 4;  // recurrence
  std::chrono::milliseconds timeout{20000};
};

struct PropertyResult {
  std::string property;
  int cp = 1;
  bool ok = false;
  double error = 0;    // wrong elements, or relative RMSE for floating-point results
  std::string detail;  // why it failed
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
PropertyResult check_conv_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = default_halo(),
                                  const ConvFn& conv = default_conv());
// dx per rank, dw and dbias summed over ranks, match the unsharded reference.
PropertyResult check_conv_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo = default_halo(),
                                   const ConvFn& conv = default_conv());

inline constexpr double kConvTolerance = 1e-12;
inline constexpr double kRecurrenceTolerance = 1e-10;

// The CP gated delta rule: outputs o match the unsharded recurrence.
PropertyResult check_recurrence_forward(const LayoutCase& c, const CheckOptions& o,
                                        const RecurrenceFn& fn = default_recurrence(),
                                        Sharding sharding = Sharding::contiguous);
// Gradients of q, k, v, beta, g match the unsharded recurrence.
PropertyResult check_recurrence_backward(const LayoutCase& c, const CheckOptions& o,
                                         const RecurrenceFn& fn = default_recurrence(),
                                         Sharding sharding = Sharding::contiguous);

// Every property, in the order `cpsim check` reports them.
std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o);

}  // namespace cpsim::verify
