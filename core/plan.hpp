// The CP plan of a step, apart from its execution: which positions and states
// each rank sends to whom, as pure functions of the layout, the rank and the
// sizes. Operators execute a plan; negative-control tests perturb one (a fold
// in the wrong order, a missing reset) instead of copying an operator.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/shard.hpp"

namespace cpsim {

// ---------------------------------------------------------------------------
// Convolution halo (convolution_history) of rank `rank` of `ranks`, shard L, width W.

// One hop of the send_recv exchange: rank r sends the last `count` positions of
// its shard to r + distance and receives as many from r - distance (-1: none).
struct HaloHop {
  int distance = 1;
  std::int64_t count = 0;
  int dst = -1, src = -1;
};

struct HaloPlan {
  std::int64_t local_len = 0;  // L
  std::int64_t history = 0;    // H = W - 1 positions before the shard
  std::int64_t tail = 0;       // T = min(L, H): what each rank contributes to the all_gather exchange
  std::vector<HaloHop> hops;   // send_recv exchange, nearest first; the history spans several
                               // earlier ranks when L < H
};
HaloPlan halo_plan(std::int64_t local_len, int width, int rank, int ranks);

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
RecurrencePlan recurrence_plan(const FlaCpContext& context, int rank);

// A change to a rank's plan for one row (tests only: the identity in training).
using RecurrencePlanEdit = std::function<void(RecurrencePlan& plan, int rank, int row)>;

}  // namespace cpsim
