#include "core/plan.hpp"

#include <algorithm>

namespace cpsim {

HaloPlan halo_plan(std::int64_t L, int width, int rank, int ranks) {
  HaloPlan p;
  p.local_len = L;
  p.history = width - 1;
  p.tail = std::min(L, p.history);
  // Hop k moves the tail of rank r-k's shard that lies inside r's window: the same
  // count on every rank, so every rank takes part in every hop.
  for (int k = 1; k < ranks; ++k) {
    const std::int64_t count = std::clamp<std::int64_t>(p.history - (k - 1) * L, 0, L);
    if (count == 0) break;
    p.hops.push_back({k, count, rank + k < ranks ? rank + k : -1, rank - k >= 0 ? rank - k : -1});
  }
  return p;
}

RecurrencePlan recurrence_plan(const FlaCpContext& ctx, int rank) {
  RecurrencePlan p;
  p.segments = ctx.cu_seqlens;
  for (int j = rank - ctx.pre_num_ranks; j < rank; ++j) p.fold_forward.push_back(j);  // left to right
  for (int j = rank + ctx.post_num_ranks; j > rank; --j) p.fold_backward.push_back(j);  // right to left
  p.transition_segment = p.segments.size() >= 2 ? p.segments.size() - 2 : 0;
  p.publishes_transition = ctx.post_num_ranks > 0;
  p.publishes_state_gradient = ctx.pre_num_ranks > 0;
  return p;
}

}  // namespace cpsim
