#include "core/shard_plan.hpp"

#include <sstream>

#include "core/error.hpp"

namespace cpsim {

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
    std::int64_t start = 0;
    for (std::int64_t t = 0; t < S; ++t) {
      const std::int64_t id = layout.doc_ids.get_int(b * S + t);
      if (t == 0 || id != layout.doc_ids.get_int(b * S + t - 1)) start = t;
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

}  // namespace cpsim
