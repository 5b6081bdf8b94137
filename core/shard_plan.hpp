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
  std::int64_t end(int r) const { return cuts[r + 1]; }
  std::int64_t size(int r) const { return cuts[r + 1] - cuts[r]; }
  std::int64_t padded_len() const { return cuts.back(); }
  std::int64_t largest() const;  // the longest interval
  bool equal_sizes() const;      // every interval as long as the first
  // The rank whose (non-empty) interval holds position p of [0, P).
  int owner(std::int64_t p) const;
  friend bool operator==(const ShardPlan&, const ShardPlan&) = default;
};
std::string plan_text(const ShardPlan& plan);  // "[0, 4, 8]"

// InvalidInput naming the plan unless it has c + 1 cuts from 0 to P, non-decreasing.
void validate_plan(const ShardPlan& plan, std::int64_t padded_len, int cp);

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

// How a step's plan is chosen, before the layout is known: equal intervals, the
// balanced plan of a per-token cost, or given cuts (a plan file).
struct PlanChoice {
  enum class Kind { equal, balanced, cuts };
  Kind kind = Kind::equal;
  TokenCost cost;                  // balanced
  std::vector<std::int64_t> cuts;  // cuts
};
// "equal", "balanced"; cost (for balanced) as parse_token_cost reads it.
PlanChoice parse_plan_choice(const std::string& name, const std::string& cost = "attention");
std::string plan_choice_name(const PlanChoice& choice);  // equal, balanced[:cost], cuts [..]
// The plan of a batch whose layout is `layout`, padded to P, at CP size cp
// (given cuts are validated against P and cp).
ShardPlan resolve_plan(const PlanChoice& choice, const Layout& layout, std::int64_t padded_len, int cp);

}  // namespace cpsim
