#include "core/exchange_plan.hpp"

#include <algorithm>

namespace cpsim {

namespace {
// Positions of q's interval inside r's window [a_r - H, a_r).
std::int64_t overlap(const ShardPlan& plan, std::int64_t H, int q, int r) {
  const std::int64_t lo = std::max(plan.begin(q), plan.begin(r) - H), hi = std::min(plan.end(q), plan.begin(r));
  return std::max<std::int64_t>(0, hi - lo);
}
}  // namespace

HaloPlan halo_plan(const ShardPlan& plan, int width, int rank) {
  HaloPlan p;
  const int c = plan.ranks();
  p.local_len = plan.size(rank);
  p.history = width - 1;
  p.tail = std::min(plan.largest(), p.history);
  // Hop k pairs every r with r + k; it runs when some pair at that distance
  // overlaps (every rank computes the same hops from the same plan).
  for (int k = 1; k < c; ++k) {
    bool any = false;
    for (int q = 0; q + k < c && !any; ++q) any = overlap(plan, p.history, q, q + k) > 0;
    if (!any) continue;
    HaloHop hop;
    hop.distance = k;
    if (rank + k < c) hop.send_count = overlap(plan, p.history, rank, rank + k);
    if (rank - k >= 0) hop.recv_count = overlap(plan, p.history, rank - k, rank);
    hop.dst = hop.send_count > 0 ? rank + k : -1;
    hop.src = hop.recv_count > 0 ? rank - k : -1;
    p.hops.push_back(hop);
  }
  return p;
}

RecurrencePlan recurrence_plan(const FlaCpContext& ctx, const ShardPlan& plan, int rank) {
  RecurrencePlan p;
  p.segments = ctx.cu_seqlens;
  // The nearest pre_num_ranks non-empty ranks before, left to right; after, right to left.
  for (int j = rank - 1, n = 0; j >= 0 && n < ctx.pre_num_ranks; --j)
    if (plan.size(j) > 0) p.fold_forward.insert(p.fold_forward.begin(), j), ++n;
  for (int j = rank + 1, n = 0; j < plan.ranks() && n < ctx.post_num_ranks; ++j)
    if (plan.size(j) > 0) p.fold_backward.insert(p.fold_backward.begin(), j), ++n;
  p.transition_segment = p.segments.size() >= 2 ? p.segments.size() - 2 : 0;
  p.publishes_transition = ctx.post_num_ranks > 0;
  p.publishes_state_gradient = ctx.pre_num_ranks > 0;
  return p;
}

}  // namespace cpsim
