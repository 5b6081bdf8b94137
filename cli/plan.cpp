// cpsim plan: the equal and the balanced shard plan of a batch side by side: each
// rank's interval, tokens and cost, the imbalance (max / mean cost), the bytes each
// collective moves and the halo's and fold's reach; or, with --family, the
// imbalance of each plan over members of a layout family.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "core/shard_plan.hpp"
#include "verify/strict_json.hpp"
#include "verify/batch_io.hpp"
#include "verify/family.hpp"
#include "verify/show.hpp"

namespace cpsim::cli {

namespace {

using nlohmann::json;

struct RankLoad {
  std::int64_t begin = 0, end = 0, tokens = 0, cost = 0;
  std::int64_t gather_recv = 0, halo_recv = 0, state_recv = 0;  // bytes
  int halo_hops = 0, fold_ranks = 0;
};

struct PlanLoad {
  std::string name;
  ShardPlan plan;
  std::vector<RankLoad> ranks;
  double imbalance = 1;
};

// Everything a plan costs each rank, for one float32 activation [B, ., C], a conv of
// width W and the recurrence's (M, S_ext) of H heads (K x K and K x V).
PlanLoad load_of(const std::string& name, const ShardPlan& plan, const Layout& layout,
                 const std::vector<std::vector<std::int64_t>>& costs, const ModelArgs& m) {
  PlanLoad out{name, plan, {}, 1};
  const int c = plan.ranks();
  const std::int64_t B = static_cast<std::int64_t>(costs.size()), W = m.conv_width;
  const std::int64_t S = layout.doc_ids.dim(1);
  const auto id = [&](std::int64_t b, std::int64_t t) { return t < S ? layout.doc_ids.get_int(b * S + t) : kPadDocId; };
  double total = 0, most = 0;
  for (int r = 0; r < c; ++r) {
    RankLoad l;
    l.begin = plan.begin(r);
    l.end = plan.begin(r) + plan.size(r);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = l.begin; t < l.end; ++t) {
        l.cost += costs[b][t];
        l.tokens += t < S && layout.padding.get_int(b * S + t) == 0;
      }
    // The gather moves every other rank's block padded to the longest interval.
    l.gather_recv = B * (c - 1) * plan.largest() * m.channels * 4;
    if (plan.size(r) > 0) {
      // The W-1 positions before the interval, and the ranks (with positions) they lie on.
      const std::int64_t from = std::max<std::int64_t>(0, l.begin - (W - 1));
      l.halo_recv = B * (l.begin - from) * m.channels * 4;
      for (int q = 0; q < r; ++q)
        l.halo_hops += plan.size(q) > 0 && plan.begin(q) < l.begin && plan.begin(q) + plan.size(q) > from;
      // The fold: the earlier ranks the segment holding position `begin` reaches into, per row.
      for (std::int64_t b = 0; b < B && l.begin > 0; ++b) {
        std::int64_t start = l.begin;
        while (start > 0 && id(b, start - 1) == id(b, l.begin)) --start;
        int reach = 0;
        for (int q = 0; q < r; ++q) reach += plan.size(q) > 0 && plan.begin(q) + plan.size(q) > start;
        l.fold_ranks = std::max(l.fold_ranks, reach);
      }
    }
    l.state_recv = (c - 1) * B * m.heads * (m.key_dim * m.key_dim + m.key_dim * m.value_dim) * 4;
    total += static_cast<double>(l.cost);
    most = std::max(most, static_cast<double>(l.cost));
    out.ranks.push_back(l);
  }
  out.imbalance = total > 0 ? most / (total / c) : 1.0;
  return out;
}

std::vector<PlanLoad> plans_of(const Batch& batch, int cp, const TokenCost& cost, const ModelArgs& m, Layout* layout_out) {
  const Layout layout = derive_layout(batch);
  const std::int64_t P = shard_geometry(layout.doc_ids.dim(1), cp).padded_len;
  const auto costs = token_costs(layout, P, cost);
  if (layout_out) *layout_out = layout;
  return {load_of("equal", equal_plan(P, cp), layout, costs, m), load_of("balanced", balanced_plan(costs, P, cp), layout, costs, m)};
}

std::string bytes_text(std::int64_t n) {
  std::ostringstream os;
  if (n >= (1 << 20)) os << std::fixed << std::setprecision(1) << n / double(1 << 20) << " MiB";
  else if (n >= 1024) os << std::fixed << std::setprecision(1) << n / 1024.0 << " KiB";
  else os << n << " B";
  return os.str();
}

json plan_json(const PlanLoad& p) {
  json ranks = json::array();
  for (const RankLoad& l : p.ranks)
    ranks.push_back({{"begin", l.begin},          {"end", l.end},
                     {"tokens", l.tokens},        {"cost", l.cost},
                     {"gather_recv_bytes", l.gather_recv}, {"halo_recv_bytes", l.halo_recv},
                     {"halo_hops", l.halo_hops},  {"fold_ranks", l.fold_ranks},
                     {"state_recv_bytes", l.state_recv}});
  return {{"cuts", p.plan.cuts}, {"imbalance", p.imbalance}, {"ranks", ranks}};
}

// Per-rank cost bars of each plan, under the layout picture.
std::string svg_of(const Batch& batch, int cp, const std::vector<PlanLoad>& plans, const std::string& title) {
  verify::ShowOptions o;
  o.cp = cp;
  o.title = title;
  std::string layout = verify::show_svg(batch, o);
  if (layout.rfind("<?xml", 0) == 0) layout = layout.substr(layout.find("?>") + 2);
  std::int64_t most = 1;
  for (const auto& p : plans)
    for (const auto& l : p.ranks) most = std::max(most, l.cost);
  const int bar_h = 14, gap = 4, width = 640, label = 90;
  std::ostringstream bars;
  int y = 0;
  for (const auto& p : plans) {
    bars << "<text x=\"0\" y=\"" << y + 12 << "\" font-size=\"12\" font-family=\"monospace\">" << p.name
         << " (imbalance " << std::fixed << std::setprecision(2) << p.imbalance << ")</text>\n";
    y += 16;
    for (std::size_t r = 0; r < p.ranks.size(); ++r) {
      const int w = static_cast<int>((width - label - 80) * static_cast<double>(p.ranks[r].cost) / most);
      bars << "<text x=\"0\" y=\"" << y + 11 << "\" font-size=\"11\" font-family=\"monospace\">rank " << r
           << "</text><rect x=\"" << label << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar_h
           << "\" fill=\"" << (p.name == "equal" ? "#8da0cb" : "#66c2a5") << "\"><title>rank " << r << " ["
           << p.ranks[r].begin << ", " << p.ranks[r].end << "): cost " << p.ranks[r].cost << "</title></rect>"
           << "<text x=\"" << label + w + 4 << "\" y=\"" << y + 11 << "\" font-size=\"11\" font-family=\"monospace\">"
           << p.ranks[r].cost << "</text>\n";
      y += bar_h + gap;
    }
    y += 8;
  }
  // The layout picture's own size (its first width= and height= attributes).
  const auto attribute = [&](const char* name) {
    const auto at = layout.find(name);
    return at == std::string::npos ? 0 : std::atoi(layout.c_str() + at + std::strlen(name));
  };
  const int layout_w = attribute("width=\""), layout_h = attribute("height=\"");
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << std::max(width, layout_w) << "\" height=\""
      << layout_h + 10 + y << "\">\n"
      << layout << "\n<g transform=\"translate(0, " << layout_h + 10 << ")\">\n" << bars.str() << "</g>\n</svg>\n";
  return out.str();
}

int plan_family(const PlanArgs& a, const TokenCost& cost) {
  const verify::LayoutFamily family = verify::read_family(a.family);
  const auto gen = verify::gen_family_case(family);
  struct Stat {
    double sum = 0, worst = 0;
  };
  std::map<std::string, Stat> stats;
  for (int k = 0; k < a.samples; ++k) {
    verify::LayoutCase c = gen(rc::Random(a.seed * 1000003 + k), 50).value();
    Batch b = c.batch;
    normalize_batch_axis(b);
    for (const PlanLoad& p : plans_of(b, a.cp, cost, a.model, nullptr)) {
      stats[p.name].sum += p.imbalance;
      stats[p.name].worst = std::max(stats[p.name].worst, p.imbalance);
    }
  }
  if (a.json) {
    json out = {{"family", family.name}, {"cp", a.cp}, {"cost", token_cost_name(cost)}, {"samples", a.samples}};
    for (const auto& [name, s] : stats) out["plans"][name] = {{"mean_imbalance", s.sum / a.samples}, {"worst_imbalance", s.worst}};
    std::cout << out.dump(1) << "\n";
    return kExitOk;
  }
  std::cout << "family " << family.name << ": " << a.samples << " members at cp " << a.cp << ", cost "
            << token_cost_name(cost) << "\n";
  for (const char* name : {"equal", "balanced"})
    std::cout << "  " << std::left << std::setw(9) << name << "imbalance mean " << std::fixed << std::setprecision(3)
              << stats[name].sum / a.samples << ", worst " << stats[name].worst << "\n";
  return kExitOk;
}

}  // namespace

std::optional<PlanChoice> plan_choice_of(const PlanOption& arg) {
  if (arg.plan == "random") return std::nullopt;
  if (arg.plan == "equal" || arg.plan == "balanced") return parse_plan_choice(arg.plan, arg.cost);
  std::ifstream in(arg.plan, std::ios::binary);
  if (!in)
    throw UsageError("--plan " + arg.plan.substr(0, 200) + ": expected equal, balanced or a plan file that exists");
  std::ostringstream text;
  text << in.rdbuf();
  const std::string where = "plan file " + arg.plan.substr(0, 200);
  // Read as strictly as a batch file: no key twice, bounded nesting, nothing after the object.
  const json j = verify::parse_strict_json(text.str(), where, 4);
  if (!j.is_object() || !j.contains("cuts")) throw InvalidInput(where + ": expected {\"cuts\": [0, a_1, ..., P]}");
  for (const auto& [key, v] : j.items())
    if (key != "cuts" && key != "comment") throw InvalidInput(where + ": unknown key " + key.substr(0, 64));
  const json& cuts = j.at("cuts");
  if (!cuts.is_array() || cuts.size() < 2) throw InvalidInput(where + ": cuts: expected a list of at least 2 integers");
  PlanChoice c;
  c.kind = PlanChoice::Kind::cuts;
  for (std::size_t i = 0; i < cuts.size(); ++i) {
    if (!cuts[i].is_number_integer() || cuts[i].get<std::int64_t>() < 0)
      throw InvalidInput(where + ": cuts index " + std::to_string(i) + ": expected a non-negative integer");
    c.cuts.push_back(cuts[i].get<std::int64_t>());
  }
  return c;
}

void expect_plan_fits(const PlanChoice& plan, std::int64_t seq_len, int cp, const std::string& batch,
                      std::int64_t pad_multiple) {
  if (plan.kind != PlanChoice::Kind::cuts) return;
  const int ranks = static_cast<int>(plan.cuts.size()) - 1;
  if (ranks != cp)
    throw UsageError("--plan: the plan file cuts for " + std::to_string(ranks) + " ranks; --cp " + std::to_string(cp) +
                     " needs its own (give --cp " + std::to_string(ranks) + ")");
  try {
    validate_plan(ShardPlan{plan.cuts}, shard_geometry(seq_len, cp, pad_multiple).padded_len, cp);
  } catch (const InvalidInput& e) {
    throw InvalidInput(batch + ": " + e.what());
  }
}

int run_plan(const PlanArgs& a) {
  const TokenCost cost = parse_token_cost(a.cost);
  if (!a.family.empty() && !a.svg.empty()) throw UsageError("cpsim plan: --svg draws one batch, not a --family");
  if (!a.family.empty()) return plan_family(a, cost);
  if (a.batch.empty()) throw UsageError("cpsim plan: give a BATCH file, or --family FILE");
  const verify::BatchFile f = verify::read_batch_file(a.batch);
  Layout layout;
  const std::vector<PlanLoad> plans = plans_of(f.batch, a.cp, cost, a.model, &layout);
  if (a.json) {
    json out = {{"batch", a.batch}, {"cp", a.cp}, {"cost", token_cost_name(cost)}, {"rows", layout.doc_ids.dim(0)},
                {"S", layout.doc_ids.dim(1)}, {"P", plans[0].plan.cuts.back()}};
    for (const PlanLoad& p : plans) out["plans"][p.name] = plan_json(p);
    std::cout << out.dump(1) << "\n";
  } else {
    std::cout << a.batch << ": " << layout.doc_ids.dim(0) << " rows, S = " << layout.doc_ids.dim(1) << ", cp = " << a.cp
              << ": P = " << plans[0].plan.cuts.back() << "; cost " << token_cost_name(cost)
              << "; bytes for one float32 activation of " << a.model.channels << " channels\n";
    std::cout << "  plan      rank  interval          tokens      cost  gather recv   halo recv  halo hops  fold ranks\n";
    for (const PlanLoad& p : plans)
      for (std::size_t r = 0; r < p.ranks.size(); ++r) {
        const RankLoad& l = p.ranks[r];
        std::ostringstream interval;
        interval << "[" << l.begin << ", " << l.end << ")";
        std::cout << "  " << std::left << std::setw(9) << (r == 0 ? p.name : "") << std::right << std::setw(5) << r
                  << "  " << std::left << std::setw(16) << interval.str() << std::right << std::setw(8) << l.tokens
                  << std::setw(10) << l.cost << std::setw(13) << bytes_text(l.gather_recv) << std::setw(12)
                  << bytes_text(l.halo_recv) << std::setw(11) << l.halo_hops << std::setw(12) << l.fold_ranks << "\n";
      }
    std::cout << "  imbalance (max / mean cost): equal " << std::fixed << std::setprecision(3) << plans[0].imbalance
              << ", balanced " << plans[1].imbalance << "; the recurrent state all-gather moves "
              << bytes_text(plans[0].ranks[0].state_recv) << " to each rank under either plan\n";
  }
  if (!a.svg.empty()) {
    std::ofstream out(a.svg);
    if (!out) throw UsageError("--svg " + a.svg + ": cannot write");
    out << svg_of(f.batch, a.cp, plans, a.batch);
    if (!a.json) std::cout << "wrote " << a.svg << "\n";
  }
  return kExitOk;
}

}  // namespace cpsim::cli
