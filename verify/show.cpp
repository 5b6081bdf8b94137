#include "verify/show.hpp"

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/shard.hpp"
#include "core/shard_plan.hpp"

namespace cpsim::verify {

namespace {

struct Run {  // a document's occupied span in one row
  std::int64_t id, begin, end, real_end;
};

struct View {
  std::int64_t B = 0, S = 0;
  ShardGeometry g;
  ShardPlan plan;  // where the cuts fall
  Layout layout;
  std::vector<std::vector<Run>> docs;  // per row, documents in order
};

View view_of(const Batch& raw, int cp, const PlanChoice& plan) {
  Batch b = raw;
  normalize_batch_axis(b);
  View v;
  v.layout = derive_layout(b);
  v.B = v.layout.doc_ids.dim(0);
  v.S = v.layout.doc_ids.dim(1);
  v.g = shard_geometry(v.S, cp);
  v.plan = resolve_plan(plan, v.layout, v.g.padded_len, cp);
  const auto* id = v.layout.doc_ids.data<std::int64_t>();
  const auto* pad = v.layout.padding.data<bool>();
  v.docs.resize(v.B);
  for (std::int64_t r = 0; r < v.B; ++r)
    for (std::int64_t t = 0; t < v.S; ++t) {
      const std::int64_t d = id[r * v.S + t];
      if (d == kPadDocId) continue;
      if (v.docs[r].empty() || v.docs[r].back().id != d || v.docs[r].back().end != t) v.docs[r].push_back({d, t, t, t});
      Run& run = v.docs[r].back();
      run.end = t + 1;
      if (!pad[r * v.S + t]) run.real_end = t + 1;
    }
  return v;
}

char letter(std::int64_t id, bool real) { return static_cast<char>((real ? 'A' : 'a') + (id - 1) % 26); }

std::string ranks_of(const ShardPlan& plan, std::int64_t begin, std::int64_t end) {
  const int a = plan.owner(begin), b = plan.owner(end - 1);
  return a == b ? "rank " + std::to_string(a) : "ranks " + std::to_string(a) + "-" + std::to_string(b);
}

// "L = 4", or the cuts of an unequal plan.
std::string intervals_text(const ShardPlan& plan) {
  return plan.equal_sizes() ? "L = " + std::to_string(plan.size(0)) : "cuts " + plan_text(plan);
}

// How many cuts (inner ones: a_1 .. a_{c-1}) fall at position p: an empty interval
// shows as two cuts together.
int cuts_at(const ShardPlan& plan, std::int64_t p) {
  int n = 0;
  for (int q = 1; q < plan.ranks(); ++q) n += plan.begin(q) == p;
  return n;
}

const char* kColors[] = {"31", "32", "33", "34", "35", "36"};

}  // namespace

std::string show_text(const Batch& batch, const ShowOptions& o) {
  const View v = view_of(batch, o.cp, o.plan);
  const ShardPlan& g = v.plan;
  const std::int64_t P = v.g.padded_len, H = o.conv_width - 1;
  std::ostringstream os;
  os << (o.title.empty() ? "batch" : o.title) << ": " << v.B << (v.B == 1 ? " row" : " rows") << ", S = " << v.S
     << ", cp = " << o.cp << ": P = " << P << ", " << intervals_text(g)
     << (o.plan.kind == PlanChoice::Kind::balanced ? " (" + plan_choice_name(o.plan) + " plan)" : "") << "\n";
  const std::string prefix_fmt = "row " + std::to_string(v.B - 1) + "  ";
  const int prefix = static_cast<int>(prefix_fmt.size());
  // Columns: one per position and one per cut, while they fit; else buckets.
  const std::int64_t avail = std::max<std::int64_t>(8, o.columns - prefix - 1);
  const bool exact = P + (o.cp - 1) <= avail;
  const std::int64_t bucket = exact ? 1 : (P + avail - 1) / avail;
  if (!exact) os << "(one character per " << bucket << " positions; '#' holds several documents)\n";
  const auto* id = v.layout.doc_ids.data<std::int64_t>();
  const auto* pad = v.layout.padding.data<bool>();
  auto paint = [&](char ch, std::int64_t doc, bool real) -> std::string {
    if (!o.color) return std::string(1, ch);
    if (ch == '|') return "\033[1m|\033[0m";
    if (doc <= 0) return std::string("\033[90m") + ch + "\033[0m";
    return std::string("\033[") + (real ? "1;" : "2;") + kColors[(doc - 1) % 6] + "m" + ch + "\033[0m";
  };
  for (std::int64_t r = 0; r < v.B; ++r) {
    std::string label = "row " + std::to_string(r);
    os << label << std::string(prefix - label.size(), ' ');
    for (std::int64_t b0 = 0; b0 < P; b0 += bucket) {
      const std::int64_t b1 = std::min(P, b0 + bucket);
      for (int k = exact ? cuts_at(g, b0) : 0; k > 0; --k) os << paint('|', 0, false);
      std::int64_t doc = -1;
      bool several = false, real = false;
      for (std::int64_t t = b0; t < b1; ++t) {
        const std::int64_t d = t < v.S ? id[r * v.S + t] : -2;
        if (doc == -1) doc = d;
        else if (d != doc) several = true;
        real = real || (t < v.S && d > 0 && !pad[r * v.S + t]);
      }
      char ch = several ? '#' : doc == -2 ? ':' : doc == kPadDocId ? '.' : letter(doc, real);
      if (!exact) {
        for (int q = 1; q < o.cp; ++q)
          if (g.begin(q) >= b0 && g.begin(q) < b1 && g.begin(q) > 0) ch = '|';
      }
      os << paint(ch, several ? 0 : doc, real);
    }
    os << "\n";
  }
  // Documents that cross shard edges, per row.
  for (std::int64_t r = 0; r < v.B; ++r) {
    std::vector<std::string> lines;
    for (const Run& d : v.docs[r]) {
      if (g.owner(d.begin) == g.owner(d.end - 1)) continue;
      std::string edges;
      for (std::int64_t e = d.begin + 1; e < d.end; ++e)
        if (cuts_at(g, e) > 0) edges += (edges.empty() ? "" : ", ") + std::to_string(e);
      lines.push_back("doc " + std::to_string(d.id) + " [" + std::to_string(d.begin) + ", " + std::to_string(d.end) +
                      ") on " + ranks_of(g, d.begin, d.end) + ", crosses edge" +
                      (edges.find(',') == std::string::npos ? " " : "s ") + edges);
    }
    if (lines.empty()) continue;
    os << "row " << r << ": ";
    const std::size_t shown = std::min<std::size_t>(lines.size(), 8);
    for (std::size_t i = 0; i < shown; ++i) os << (i ? "; " : "") << lines[i];
    if (lines.size() > shown) os << "; and " << lines.size() - shown << " more";
    os << "\n";
  }
  // Halo spans: the W-1 positions before each shard, and whose they are.
  if (H > 0 && o.cp > 1) {
    os << "halo (conv width " << o.conv_width << ", " << H << " positions before each shard):";
    const int shown = std::min(o.cp, 9);
    for (int q = 1; q < shown; ++q) {
      const std::int64_t b = std::max<std::int64_t>(0, g.begin(q) - H), e = g.begin(q);
      os << (q > 1 ? ";" : "") << " rank " << q;
      if (e > b) os << " [" << b << ", " << e << ") from " << ranks_of(g, b, e);
      else os << " none";
      if (g.size(q) == 0) os << " (empty interval)";
    }
    if (o.cp > shown) os << "; ...";
    os << "\n";
  }
  os << "A-Z document (lower case: its padding), . row padding, : padding to P, | shard cut"
     << (exact ? "" : ", # several documents in one character") << "\n";
  return os.str();
}

std::string show_svg(const Batch& batch, const ShowOptions& o) {
  const View v = view_of(batch, o.cp, o.plan);
  const ShardPlan& g = v.plan;
  const std::int64_t P = v.g.padded_len, H = o.conv_width - 1;
  const double left = 60, top = 40, width = 1000, row_h = v.B > 32 ? 12 : 24, gap = v.B > 32 ? 4 : 10;
  const double height = top + v.B * (row_h + gap) + 30;
  const double sx = width / static_cast<double>(P);
  auto x = [&](std::int64_t p) { return left + p * sx; };
  std::ostringstream os;
  os.precision(6);
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 20 << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
     << "<title>" << (o.title.empty() ? "batch" : o.title) << ": " << v.B << " rows, S = " << v.S << ", cp = " << o.cp
     << ", P = " << P << ", " << intervals_text(g) << "</title>\n"
     << "<style>.doc{stroke:#fff;stroke-width:0.5}.doc-padding{fill:#fff;fill-opacity:0.55}.pad{fill:#ddd}"
        ".fill{fill:#eee;stroke:#ccc;stroke-dasharray:2,2}.docs{fill:#888}.halo{fill:#111;fill-opacity:0.75}"
        ".cut{stroke:#000;stroke-width:1.5}</style>\n";
  const char* palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"};
  for (int q = 0; q < o.cp && o.cp <= 64; ++q)
    os << "<text x=\"" << x(g.begin(q)) + g.size(q) * sx / 2 << "\" y=\"" << top - 14 << "\" text-anchor=\"middle\">rank " << q << "</text>\n";
  for (std::int64_t r = 0; r < v.B; ++r) {
    const double y = top + r * (row_h + gap);
    os << "<text x=\"4\" y=\"" << y + row_h * 0.7 << "\">row " << r << "</text>\n";
    os << "<rect class=\"pad\" x=\"" << x(0) << "\" y=\"" << y << "\" width=\"" << x(v.S) - x(0) << "\" height=\"" << row_h
       << "\"><title>row padding</title></rect>\n";
    if (P > v.S)
      os << "<rect class=\"fill\" x=\"" << x(v.S) << "\" y=\"" << y << "\" width=\"" << x(P) - x(v.S) << "\" height=\""
         << row_h << "\"><title>padding to P = " << P << "</title></rect>\n";
    // Documents narrower than half a pixel are drawn together.
    std::size_t i = 0;
    const auto& docs = v.docs[r];
    while (i < docs.size()) {
      const Run& d = docs[i];
      if ((d.end - d.begin) * sx >= 0.5) {
        os << "<rect class=\"doc\" x=\"" << x(d.begin) << "\" y=\"" << y << "\" width=\"" << (d.end - d.begin) * sx
           << "\" height=\"" << row_h << "\" fill=\"" << palette[(d.id - 1) % 8] << "\"><title>row " << r << ", doc "
           << d.id << ": [" << d.begin << ", " << d.end << "), " << d.real_end - d.begin << " real, on "
           << ranks_of(g, d.begin, d.end) << "</title></rect>\n";
        if (d.real_end < d.end)
          os << "<rect class=\"doc-padding\" x=\"" << x(d.real_end) << "\" y=\"" << y << "\" width=\""
             << (d.end - d.real_end) * sx << "\" height=\"" << row_h << "\"/>\n";
        if ((d.end - d.begin) * sx >= 28 && row_h >= 20)
          os << "<text x=\"" << x(d.begin) + 3 << "\" y=\"" << y + row_h * 0.7 << "\" fill=\"#fff\">" << d.id << "</text>\n";
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < docs.size() && (docs[j].end - docs[j].begin) * sx < 0.5) ++j;
      os << "<rect class=\"docs\" x=\"" << x(docs[i].begin) << "\" y=\"" << y << "\" width=\""
         << std::max(0.5, (docs[j - 1].end - docs[i].begin) * sx) << "\" height=\"" << row_h << "\"><title>row " << r
         << ": " << j - i << " documents in [" << docs[i].begin << ", " << docs[j - 1].end << ")</title></rect>\n";
      i = j;
    }
    // Halo spans: the W-1 positions each rank reads before its shard.
    for (int q = 1; q < o.cp && H > 0; ++q) {
      const std::int64_t b = std::max<std::int64_t>(0, g.begin(q) - H), e = g.begin(q);
      if (e <= b) continue;
      os << "<rect class=\"halo\" x=\"" << x(b) << "\" y=\"" << y - 3 << "\" width=\"" << (e - b) * sx
         << "\" height=\"3\"><title>halo of rank " << q << ": [" << b << ", " << e << ") from " << ranks_of(g, b, e)
         << "</title></rect>\n";
    }
  }
  for (int q = 1; q < o.cp; ++q)
    os << "<line class=\"cut\" x1=\"" << x(g.begin(q)) << "\" y1=\"" << top - 8 << "\" x2=\"" << x(g.begin(q)) << "\" y2=\""
       << height - 24 << "\"/>\n";
  os << "<text x=\"" << left << "\" y=\"" << height - 8
     << "\">coloured: documents (pale: their padding); grey: row padding; dashed: padding to P; black bars: halo; lines: "
        "shard cuts</text>\n</svg>\n";
  return os.str();
}

}  // namespace cpsim::verify
