// Sequence all-gather with autograd (SPEC §3): gather_sequence and the backward
// anchor that keeps a rank from skipping the backward reduce-scatter.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"

namespace cpsim {

// [B, L, ...] per rank -> [B, c*L, ...], shards in rank order per row. With
// `differentiable`, backward is a reduce-scatter along the sequence (rank order sums).
// nullptr or a one-rank communicator returns x itself.
Var gather_sequence(const Var& x, Communicator* comm, bool differentiable);

// A zero scalar with a backward edge to `gathered`; add it to a loss that might
// otherwise not reach the gather, so every rank enters the backward collective.
Var all_gather_backward_anchor(const Var& gathered);

// The data movement of gather_sequence, without autograd: [B, L, ...] -> [B, c*L, ...].
Tensor all_gather_sequence_tensor(const Tensor& x, Communicator& comm);
// Its adjoint: [B, c*L, ...] -> this rank's [B, L, ...], summed over ranks in rank order.
Tensor reduce_scatter_sequence_tensor(const Tensor& grad, Communicator& comm);

}  // namespace cpsim
