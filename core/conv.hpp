// The packed causal depthwise convolution (SPEC §3), the consumer the halo exists for:
//   y[b,t,c] = bias[c] + sum_j w[c,j] * x[b, t-(W-1)+j, c],
// with a tap dropped when its position lies before the start of t's segment.
// One op serves the unsharded and the sharded layer: it convolves a window that
// starts W-1 positions early (zeros or the halo) with that window's doc ids.
#pragma once

#include "core/autograd.hpp"
#include "core/halo.hpp"
#include "core/model_shape.hpp"
#include "core/shard.hpp"

namespace cpsim {

// Doc id of window positions before global position 0.
inline constexpr std::int64_t kBeforeSequenceDocId = -1;

// x_window [B, N+W-1, C], window_doc_ids [B, N+W-1] int64, weight [C, W], bias [C]
// or an undefined Var -> y [B, N, C]. float32 or float64.
Var packed_causal_conv(const Var& x_window, const Tensor& window_doc_ids, const Var& weight, const Var& bias);

// Global doc ids [B, P] of positions [start-(W-1), start+len), kBeforeSequenceDocId before 0.
Tensor window_doc_ids(const Tensor& global_doc_ids, std::int64_t start, std::int64_t len, int width);

// The sharded layer on one rank: halo exchange, then the packed conv of the shard.
Var sharded_packed_conv(const Var& x_masked, const PackedContext& context, Communicator* comm, const Var& weight,
                        const Var& bias, HaloExchange exchange = HaloExchange::send_recv);

}  // namespace cpsim
