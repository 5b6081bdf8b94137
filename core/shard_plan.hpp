// Shard plans (SPEC §2): the contiguous interval [a_r, a_{r+1}) of the padded row
// each rank owns, the same cut for every row. The equal plan is a_r = r*L; the
// balanced plan cuts where the running per-token cost, summed over rows, crosses
// r/c of the total. Pure functions of the layout: `cpsim plan` compares plans
// before any operator runs them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.hpp"

namespace cpsim {

struct ShardPlan {
  std::vector<std::int64_t> cuts;  // c + 1 entries: 0 = a_0 <= a_1 <= ... <= a_c = P
  int ranks() const { return static_cast<int>(cuts.size()) - 1; }
  std::int64_t begin(int r) const { return cuts[r]; }
  std::int64_t size(int r) const { return cuts[r + 1] - cuts[r]; }
};

// The per-token cost a plan balances: causal attention costs `t - doc_start + 1`
// for a real token (the keys it reads), a linear layer 1, padding 0; a mix weighs
// them with integer weights.
struct TokenCost {
  std::int64_t attention = 1, linear = 0;
};
// "attention", "linear", or "attention=A,linear=B" (non-negative integers, not both
// 0); InvalidInput otherwise.
TokenCost parse_token_cost(const std::string& text);
std::string token_cost_name(const TokenCost& cost);

// Each token's cost [B, P] from the layout's doc ids and padding ([B, S]; the
// positions past S are padding).
std::vector<std::vector<std::int64_t>> token_costs(const Layout& layout, std::int64_t padded_len,
                                                   const TokenCost& cost);

ShardPlan equal_plan(std::int64_t padded_len, int cp);
// a_r = the smallest t with c * cost[0, t) >= r * total (exact integers: ties go to
// the earlier cut); an all-padding batch (total 0) gets the equal plan.
ShardPlan balanced_plan(const std::vector<std::vector<std::int64_t>>& costs, std::int64_t padded_len, int cp);

}  // namespace cpsim
