// Targets and the token-mean loss across ranks (SPEC §3b).
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"

namespace cpsim {

inline constexpr std::int64_t kIgnoreTarget = -100;

// Next-token targets on whole rows, before sharding: targets[b][t] =
// input_ids[b][t+1] when t and t+1 are real tokens of one document (doc ids
// [B, S], padding [B, S] bool), else kIgnoreTarget.
Tensor next_token_targets(const Tensor& input_ids, const Tensor& doc_ids, const Tensor& padding);

// Cross entropy of logits [B, L, V] against targets [B, L] (kIgnoreTarget: none),
// averaged over the targets of every rank: each rank sums its token losses and
// counts its targets, both are all-reduced (every rank takes part, with zeros
// when it has none) and loss = sum / count (0 when count is 0). The gradient of
// the local logits is d(local sum) / count. A host scalar [1], float64.
Var token_mean_loss(const Var& logits, const Tensor& targets, Communicator* comm);

}  // namespace cpsim
