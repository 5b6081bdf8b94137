// Token shift, the one-token mix of RWKV-style and short-convolution layers, on a
// packed, sharded sequence:
//   y[b, t] = x[b, t-1] when global position t-1 lies in t's document, else 0.
// A rank's first position takes t-1 from whichever earlier rank holds it: a
// one-token halo (convolution_history with W = 2); the backward returns dy[b, t]
// to x[b, t-1], over the halo to its owner. Values are moved, never computed, so
// the result is bitwise the unsharded one.
#pragma once

#include "core/autograd.hpp"
#include "core/halo.hpp"
#include "core/shard.hpp"

namespace cpsim {

// x_masked [B, L, ...] (this rank's shard, padding zeroed) -> y [B, L, ...].
Var token_shift(const Var& x_masked, const PackedContext& context, Communicator* comm,
                HaloExchange exchange = HaloExchange::send_recv);

}  // namespace cpsim
