#include "core/shard_plan.hpp"

#include <algorithm>
#include <sstream>

#include "core/error.hpp"

namespace cpsim {

std::int64_t ShardPlan::largest() const {
  std::int64_t m = 0;
  for (int r = 0; r < ranks(); ++r) m = std::max(m, size(r));
  return m;
}

bool ShardPlan::equal_sizes() const {
  for (int r = 1; r < ranks(); ++r)
    if (size(r) != size(0)) return false;
  return true;
}

int ShardPlan::owner(std::int64_t p) const {
  // The last cut at or before p; empty intervals share their cut with the next one.
  const auto it = std::upper_bound(cuts.begin(), cuts.end() - 1, p);
  return static_cast<int>(it - cuts.begin()) - 1;
}

std::string plan_text(const ShardPlan& plan) {
  std::string s = "[";
  for (std::size_t i = 0; i < plan.cuts.size(); ++i) s += (i ? ", " : "") + std::to_string(plan.cuts[i]);
  return s + "]";
}

void validate_plan(const ShardPlan& plan, std::int64_t P, int cp) {
  if (static_cast<int>(plan.cuts.size()) != cp + 1)
    CPSIM_INVALID("plan cuts ", plan_text(plan).substr(0, 80), ": ", plan.cuts.size(), " cuts for cp ", cp,
                  " (a plan of c ranks has c + 1 cuts)");
  if (plan.cuts.front() != 0 || plan.cuts.back() != P)
    CPSIM_INVALID("plan cuts ", plan_text(plan).substr(0, 80), ": must run from 0 to the padded length ", P);
  for (int r = 0; r < cp; ++r)
    if (plan.cuts[r + 1] < plan.cuts[r])
      CPSIM_INVALID("plan cuts index ", r + 1, ": ", plan.cuts[r + 1], " is below the cut before it, ", plan.cuts[r]);
}

TokenCost parse_token_cost(const std::string& text) {
  if (text == "attention") return {1, 0};
  if (text == "linear") return {0, 1};
  TokenCost c{0, 0};
  std::stringstream in(text);
  std::string part;
  bool any = false;
  while (std::getline(in, part, ',')) {
    const auto eq = part.find('=');
    const std::string name = part.substr(0, eq);
    std::int64_t w = -1;
    try {
      std::size_t used = 0;
      if (eq != std::string::npos) w = std::stoll(part.substr(eq + 1), &used);
      if (eq == std::string::npos || used != part.size() - eq - 1) w = -1;
    } catch (const std::exception&) {
      w = -1;
    }
    if ((name != "attention" && name != "linear") || w < 0 || w > (1 << 20))
      CPSIM_INVALID("--cost ", text.substr(0, 64), ": expected attention, linear, or attention=A,linear=B "
                    "(non-negative integer weights)");
    (name == "attention" ? c.attention : c.linear) = w;
    any = true;
  }
  if (!any || (c.attention == 0 && c.linear == 0))
    CPSIM_INVALID("--cost ", text.substr(0, 64), ": the weights are all 0");
  return c;
}

std::string token_cost_name(const TokenCost& c) {
  if (c.linear == 0 && c.attention == 1) return "attention";
  if (c.attention == 0 && c.linear == 1) return "linear";
  return "attention=" + std::to_string(c.attention) + ",linear=" + std::to_string(c.linear);
}

std::vector<std::vector<std::int64_t>> token_costs(const Layout& layout, std::int64_t P, const TokenCost& cost) {
  const std::int64_t B = layout.doc_ids.dim(0), S = layout.doc_ids.dim(1);
  std::vector<std::vector<std::int64_t>> out(B, std::vector<std::int64_t>(P, 0));
  for (std::int64_t b = 0; b < B; ++b) {
    // Where the current document starts: its first position, not where its
    // last run of positions began (a padding gap inside a document, as an
    // unpacked row's padding_mask makes, does not restart it: the causal window
    // of a token after the gap still spans the keys before it).
    std::int64_t start = 0, doc = kPadDocId;
    for (std::int64_t t = 0; t < S; ++t) {
      const std::int64_t id = layout.doc_ids.get_int(b * S + t);
      if (id != kPadDocId && id != doc) doc = id, start = t;
      if (layout.padding.get_int(b * S + t) != 0 || id == kPadDocId) continue;
      out[b][t] = cost.attention * (t - start + 1) + cost.linear;
    }
  }
  return out;
}

ShardPlan equal_plan(std::int64_t P, int cp) {
  ShardPlan p;
  for (int r = 0; r <= cp; ++r) p.cuts.push_back(P / cp * r);
  return p;
}

ShardPlan balanced_plan(const std::vector<std::vector<std::int64_t>>& costs, std::int64_t P, int cp) {
  std::vector<std::int64_t> column(P, 0);  // summed over rows
  std::int64_t total = 0;
  for (const auto& row : costs)
    for (std::int64_t t = 0; t < P; ++t) column[t] += row[t], total += row[t];
  if (total == 0) return equal_plan(P, cp);
  ShardPlan p;
  p.cuts.push_back(0);
  std::int64_t t = 0, prefix = 0;  // prefix = cost[0, t)
  for (int r = 1; r < cp; ++r) {
    // The smallest t with cp * cost[0, t) >= r * total.
    while (static_cast<__int128>(cp) * prefix < static_cast<__int128>(r) * total) prefix += column[t++];
    p.cuts.push_back(t);
  }
  p.cuts.push_back(P);
  return p;
}

PlanChoice parse_plan_choice(const std::string& name, const std::string& cost) {
  PlanChoice c;
  if (name == "equal") return c;
  if (name != "balanced") CPSIM_INVALID("--plan ", name.substr(0, 64), ": expected equal, balanced or a plan file");
  c.kind = PlanChoice::Kind::balanced;
  c.cost = parse_token_cost(cost);
  return c;
}

std::string plan_choice_name(const PlanChoice& c) {
  switch (c.kind) {
    case PlanChoice::Kind::equal: return "equal";
    case PlanChoice::Kind::balanced: return "balanced:" + token_cost_name(c.cost);
    case PlanChoice::Kind::cuts: return "cuts " + plan_text({c.cuts});
  }
  return "?";
}

ShardPlan resolve_plan(const PlanChoice& c, const Layout& layout, std::int64_t P, int cp) {
  switch (c.kind) {
    case PlanChoice::Kind::equal: return equal_plan(P, cp);
    case PlanChoice::Kind::balanced: return balanced_plan(token_costs(layout, P, c.cost), P, cp);
    case PlanChoice::Kind::cuts: break;
  }
  ShardPlan p{c.cuts};
  validate_plan(p, P, cp);
  return p;
}

}  // namespace cpsim
