// Sequence all-gather with autograd (SPEC §3): gather_sequence and the backward
// anchor that keeps a rank from skipping the backward reduce-scatter.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"
#include "core/shard_plan.hpp"

namespace cpsim {

// [B, L_r, ...] per rank -> [B, P, ...], shards in rank order per row. `plan`
// gives every rank's interval (nullptr: equal intervals of x's length); with
// unequal intervals the gather is an all-gather of unequal counts (each rank's
// block padded to the longest interval on the wire, placed at its own cut). With
// `differentiable`, backward is a reduce-scatter along the sequence (rank order
// sums). nullptr or a one-rank communicator returns x itself.
Var gather_sequence(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan = nullptr);

// A zero scalar with a backward edge to `gathered`; add it to a loss that might
// otherwise not reach the gather, so every rank enters the backward collective.
Var all_gather_backward_anchor(const Var& gathered);

// The data movement of gather_sequence, without autograd: [B, L_r, ...] -> [B, P, ...].
Tensor all_gather_sequence_tensor(const Tensor& x, Communicator& comm, const ShardPlan* plan = nullptr);
// Its adjoint: [B, P, ...] -> this rank's [B, L_r, ...], summed over ranks in rank order.
Tensor reduce_scatter_sequence_tensor(const Tensor& grad, Communicator& comm, const ShardPlan* plan = nullptr);

// The plan a collective runs: `plan` checked against the group and this rank's
// length, or equal intervals of `local_len` (InvalidInput naming the operator).
ShardPlan plan_for(const char* op, const ShardPlan* plan, const Communicator& comm, std::int64_t local_len);

}  // namespace cpsim
