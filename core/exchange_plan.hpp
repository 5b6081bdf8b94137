// The exchange plan of a CP step, apart from its execution: which positions and
// states each rank sends to whom (a shard plan, core/shard_plan.hpp, says which
// positions it owns), as pure functions of the layout, the rank and the
// sizes. Operators execute a plan; negative-control tests perturb one (a fold
// in the wrong order, a missing reset) instead of copying an operator.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/shard.hpp"

namespace cpsim {

// ---------------------------------------------------------------------------
// Convolution halo (convolution_history) of rank `rank` under `plan`, width W:
// the H = W - 1 global positions before its interval [a_r, a_{r+1}).

// One hop of the send_recv exchange: rank r sends the last `send_count` positions
// of its interval to r + distance (dst; -1: none) and receives `recv_count` from
// r - distance (src; -1: none). A pair exchanges what of the sender's interval lies
// in the receiver's window: an empty rank sends nothing (its neighbours' hops pass
// over it) and receives its window like any rank.
struct HaloHop {
  int distance = 1;
  std::int64_t send_count = 0, recv_count = 0;
  int dst = -1, src = -1;
};

struct HaloPlan {
  std::int64_t local_len = 0;  // this rank's interval
  std::int64_t history = 0;    // H = W - 1 positions before it
  // The all_gather exchange: every rank contributes its last min(size, H) positions
  // in a slot of `tail` = min(largest interval, H) positions, right-aligned.
  std::int64_t tail = 0;
  std::vector<HaloHop> hops;   // send_recv exchange, nearest first, the same number on every rank
};
HaloPlan halo_plan(const ShardPlan& plan, int width, int rank);

// ---------------------------------------------------------------------------
// Gated delta rule recurrence, per row (SPEC §3).

struct RecurrencePlan {
  std::vector<std::int64_t> segments;  // local segment boundaries [0, ..., L]; the state resets at each
  std::vector<int> fold_forward;       // ranks whose (M, S_ext) fold into the first segment's initial state, in order
  std::vector<int> fold_backward;      // ranks whose (M^T, dS_ext) fold into the last segment's end gradient, in order
  std::size_t transition_segment = 0;  // the local segment whose transition this rank publishes
  bool publishes_transition = false;   // its last segment continues on later ranks
  bool publishes_state_gradient = false;  // its first segment began on earlier ranks
};
// The fold lists name the non-empty ranks the context counts (an empty rank
// publishes nothing and is skipped).
RecurrencePlan recurrence_plan(const FlaCpContext& context, const ShardPlan& plan, int rank);

// A change to a rank's plan for one row (tests only: the identity in training).
using RecurrencePlanEdit = std::function<void(RecurrencePlan& plan, int rank, int row)>;

}  // namespace cpsim
