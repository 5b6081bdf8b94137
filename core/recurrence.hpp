// The gated delta rule / KDA recurrence under contiguous CP (SPEC §3), per head:
//   S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t,
// with S = 0 at every segment start. Each step is affine in S, so a shard's last
// segment has a transition (M, S_ext): S_out = M S_in + S_ext. Forward: every rank
// computes (M, S_ext) of its last local segment from a zero state, all ranks
// all-gather them, and each rank folds S <- M_j S + S_ext_j over its pre_num_ranks
// predecessors to start its first segment. Backward mirrors it right to left: the
// state gradient of each first segment is affine in the gradient arriving at its
// end (dS_in = M^T dS_out + dS_ext), all-gathered, folded over post_num_ranks.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"
#include "core/exchange_plan.hpp"
#include "core/shard.hpp"

namespace cpsim {

// q, k, g: [B, L, H, K]; v: [B, L, H, V]; beta: [B, L, H]; float64. Returns o [B, L, H, V].
// One rank: pass a context with cp_size 1 and comm nullptr (the unsharded recurrence).
// The step runs each row's recurrence_plan (core/exchange_plan.hpp); `edit` changes it (tests only).
Var gated_delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                     const PackedContext& context, Communicator* comm, const RecurrencePlanEdit& edit = {});

// Bytes one rank sends in each all-gather (forward, and again in backward): B*H*K*(K+V) float64.
inline std::int64_t recurrence_state_bytes(std::int64_t B, std::int64_t H, std::int64_t K, std::int64_t V) {
  return B * H * K * (K + V) * 8;
}

}  // namespace cpsim
