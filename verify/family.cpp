#include "verify/family.hpp"

#include <algorithm>
#include <climits>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.hpp"
#include "verify/random.hpp"
#include "verify/strict_json.hpp"

namespace cpsim::verify {

using nlohmann::json;

const std::map<std::string, LayoutForm>& layout_forms() {
  static const std::map<std::string, LayoutForm> f = {
      {"seq_lens_padded", LayoutForm::seq_lens_padded}, {"seq_lens", LayoutForm::seq_lens},
      {"cu_seqlens", LayoutForm::cu_seqlens},           {"cu_seqlens_only", LayoutForm::cu_seqlens_only},
      {"cu_seqlens_padded_only", LayoutForm::cu_seqlens_padded_only},
      {"unpacked", LayoutForm::unpacked},               {"position_ids", LayoutForm::position_resets}};
  return f;
}

namespace {

bool thd(LayoutForm f) {
  return f == LayoutForm::cu_seqlens || f == LayoutForm::cu_seqlens_only || f == LayoutForm::cu_seqlens_padded_only;
}
// Forms whose documents carry padding of their own (a real and an occupied length).
bool two_keys(LayoutForm f) { return f == LayoutForm::seq_lens_padded || f == LayoutForm::cu_seqlens; }
bool packed(LayoutForm f) { return f != LayoutForm::unpacked && f != LayoutForm::position_resets; }

int round_up(int n, int m) { return m <= 1 ? n : (n + m - 1) / m * m; }

// One field's reader: every error names the file and the field.
struct Reader {
  const json& doc;
  const std::string& source;
  [[noreturn]] void fail(const std::string& field, const std::string& why) const {
    CPSIM_INVALID(source, ": family field \"", field, "\": ", why);
  }
  Range range(const char* field, Range def, int lo, int hi) const {
    if (!doc.contains(field)) return def;
    const json& v = doc.at(field);
    if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || !v[1].is_number_integer())
      fail(field, "expected [min, max], two integers");
    const auto a = v[0].get<std::int64_t>(), b = v[1].get<std::int64_t>();
    if (a > b) fail(field, "min " + std::to_string(a) + " is greater than max " + std::to_string(b));
    if (a < lo || b > hi) fail(field, "expected values in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return {static_cast<int>(a), static_cast<int>(b)};
  }
  bool flag(const char* field, bool def) const {
    if (!doc.contains(field)) return def;
    if (!doc.at(field).is_boolean()) fail(field, "expected true or false");
    return doc.at(field).get<bool>();
  }
  std::string text(const char* field, const std::string& def) const {
    if (!doc.contains(field)) return def;
    if (!doc.at(field).is_string()) fail(field, "expected a string");
    return doc.at(field).get<std::string>();
  }
  int integer(const char* field, int def, int lo, int hi) const {
    if (!doc.contains(field)) return def;
    const json& v = doc.at(field);
    if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)
      fail(field, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return static_cast<int>(v.get<std::int64_t>());
  }
};

}  // namespace

LayoutFamily parse_family(const std::string& text, const std::string& source) {
  const json doc = parse_strict_json(text, source, 4);
  if (!doc.is_object()) CPSIM_INVALID(source, ": a family file is a JSON object");
  static const std::set<std::string> known = {
      "name",           "description",      "form",         "cp",          "rows",
      "documents",      "document_length",  "length_distribution",         "pad_documents_to",
      "interior_padding", "zero_length_placeholders", "tail_padding", "left_padding", "eos_is_pad",
      "pad_token_id",   "one_dimensional",  "image_spans", "tail_in_last_document", "position_ids",
      "mrope"};
  for (auto it = doc.begin(); it != doc.end(); ++it)
    if (!known.count(it.key()))
      CPSIM_INVALID(source, ": family field \"", it.key().substr(0, 64), "\": unknown (docs/files.md lists the fields)");
  const Reader in{doc, source};
  LayoutFamily f;
  f.name = in.text("name", source);
  f.description = in.text("description", "");
  if (!doc.contains("form")) in.fail("form", "missing (seq_lens_padded, seq_lens, cu_seqlens, cu_seqlens_only, "
                                             "cu_seqlens_padded_only, unpacked or position_ids)");
  f.form_name = in.text("form", "");
  if (!layout_forms().count(f.form_name))
    in.fail("form", "unknown form '" + f.form_name.substr(0, 32) +
                        "' (seq_lens_padded, seq_lens, cu_seqlens, cu_seqlens_only, cu_seqlens_padded_only, unpacked "
                        "or position_ids)");
  f.form = layout_forms().at(f.form_name);
  f.cp = in.range("cp", {1, 16}, 1, 1024);
  f.rows = in.range("rows", {1, 1}, 1, 64);
  if (thd(f.form) && f.rows.max > 1) in.fail("rows", "a THD form (cu_seqlens) holds one packed row: [1, 1]");
  if (!doc.contains("documents")) in.fail("documents", "missing: [min, max] documents per row");
  f.documents = in.range("documents", {1, 1}, 1, 256);
  if (f.form == LayoutForm::unpacked && f.documents.max > 1) in.fail("documents", "an unpacked row holds one: [1, 1]");
  if (!doc.contains("document_length")) in.fail("document_length", "missing: [min, max] real tokens per document");
  f.document_length = in.range("document_length", {1, 1}, 1, 1 << 16);
  const std::string dist = in.text("length_distribution", "uniform");
  if (dist != "uniform" && dist != "short") in.fail("length_distribution", "expected \"uniform\" or \"short\"");
  f.short_lengths = dist == "short";
  if (doc.contains("pad_documents_to")) {
    const json& v = doc.at("pad_documents_to");
    if (v.is_string() && (v == "cp" || v == "2*cp")) f.pad_to_cp = v == "cp" ? 1 : 2;
    else f.pad_documents_to = in.integer("pad_documents_to", 1, 1, 1 << 16);
    if ((f.pad_to_cp || f.pad_documents_to > 1) && !packed(f.form))
      in.fail("pad_documents_to", "needs a packed form (lengths keys)");
  }
  f.interior_padding = in.range("interior_padding", {0, 0}, 0, 1 << 16);
  if (f.interior_padding.max > 0 && !two_keys(f.form))
    in.fail("interior_padding", "needs real and occupied lengths: form seq_lens_padded or cu_seqlens");
  f.zero_length_placeholders = in.range("zero_length_placeholders", {0, 0}, 0, 64);
  if (f.zero_length_placeholders.max > 0 && !packed(f.form))
    in.fail("zero_length_placeholders", "needs a packed form (lengths keys)");
  f.tail_padding = in.range("tail_padding", {0, 0}, 0, 1 << 16);
  if (f.tail_padding.max > 0 && f.form == LayoutForm::cu_seqlens_padded_only)
    in.fail("tail_padding", "cu_seqlens_padded alone covers the row: pad the last document instead");
  f.left_padding = in.range("left_padding", {0, 0}, 0, 1 << 16);
  if (f.left_padding.max > 0 && f.form != LayoutForm::unpacked) in.fail("left_padding", "needs form unpacked");
  f.tail_in_last_document = in.flag("tail_in_last_document", false);
  if (f.tail_in_last_document && !two_keys(f.form))
    in.fail("tail_in_last_document", "needs real and occupied lengths: form seq_lens_padded or cu_seqlens");
  f.position_ids = in.flag("position_ids", false);
  if (f.position_ids && !packed(f.form))
    in.fail("position_ids", "a packed form's option (form position_ids always gives them)");
  f.mrope = in.flag("mrope", false);
  if (f.mrope && f.form == LayoutForm::position_resets)
    in.fail("mrope", "documents from lengths or one a row: form position_ids gives [B, S] resets");
  if (f.mrope) f.position_ids = true;
  f.eos_is_pad = in.flag("eos_is_pad", false);
  f.pad_token_id = in.integer("pad_token_id", 0, 0, 1 << 30);
  f.one_dimensional = in.flag("one_dimensional", false);
  if (f.one_dimensional && f.rows.max > 1) in.fail("one_dimensional", "needs rows [1, 1]");
  if (doc.contains("image_spans")) {
    const json& v = doc.at("image_spans");
    if (!v.is_object()) in.fail("image_spans", "expected {\"token_id\", \"per_document\", \"length\"}");
    for (auto it = v.begin(); it != v.end(); ++it)
      if (it.key() != "token_id" && it.key() != "per_document" && it.key() != "length")
        in.fail("image_spans", "unknown field \"" + it.key().substr(0, 64) + "\"");
    const Reader spans{v, source};
    LayoutFamily::ImageSpans s;
    s.token_id = spans.integer("token_id", 0, 0, 1 << 30);
    s.per_document = spans.range("per_document", {0, 1}, 0, 64);
    s.length = spans.range("length", {1, 4}, 1, 1 << 16);
    f.image_spans = s;
  }
  return f;
}

LayoutFamily read_family(const std::string& path) {
  std::ifstream in(path);
  if (!in) CPSIM_INVALID(path, ": cannot open the family file");
  std::stringstream text;
  text << in.rdbuf();
  return parse_family(text.str(), path);
}

namespace {

// What the generator draws: plain numbers, so that shrinking stays in the family.
struct Draw {
  int cp = 1;
  std::vector<std::vector<std::pair<int, int>>> docs;  // (real, interior padding) per document, per row
  std::vector<int> placeholders, lefts;                // per row
  int tail = 0;
  std::uint64_t seed = 0;
  PlanSpec plan;
};

LayoutCase member(const LayoutFamily& f, const Draw& d) {
  LayoutSpec spec;
  spec.cp = d.cp;
  spec.plan = d.plan;
  spec.form = f.form;
  spec.pad_token_id = f.pad_token_id;
  spec.eos_is_pad = f.eos_is_pad;
  spec.one_dimensional = f.one_dimensional;
  spec.absorb_tail = f.tail_in_last_document;
  spec.give_positions = f.position_ids;
  spec.seed = d.seed;
  const int m = f.document_multiple(d.cp);
  const std::size_t B = d.docs.size();
  int longest = 0;
  if (f.form == LayoutForm::unpacked) {
    for (std::size_t r = 0; r < B; ++r) longest = std::max(longest, d.lefts[r] + d.docs[r][0].first);
    spec.seq_len = longest + d.tail;
    for (std::size_t r = 0; r < B; ++r)
      spec.row_pads.push_back({d.lefts[r], spec.seq_len - d.lefts[r] - d.docs[r][0].first});
    spec.mask_kind = MaskKind::padding_mask;
  } else {
    for (std::size_t r = 0; r < B; ++r) {
      std::vector<DocSpec> row;
      int used = 0;
      for (const auto& [real, interior] : d.docs[r]) {
        DocSpec doc;
        if (two_keys(f.form)) {
          doc.real = real;
          doc.extra = round_up(real, m) - real + interior;
        } else {
          doc.real = round_up(real, m);  // one key: the packer's lengths are the occupied ones
        }
        used += doc.real + doc.extra;
        row.push_back(doc);
      }
      for (int k = 0; k < d.placeholders[r]; ++k) row.push_back(DocSpec{0, 0});
      longest = std::max(longest, used);
      spec.rows.push_back(row);
    }
    spec.seq_len = longest + d.tail;
    // position_ids alone: the tail (and shorter rows) marked by a padding mask.
    spec.mask_kind = MaskKind::padding_mask;
  }
  if (f.image_spans)
    spec.image_spans = ImageSpans{f.image_spans->token_id, {f.image_spans->per_document.min, f.image_spans->per_document.max},
                                  {f.image_spans->length.min, f.image_spans->length.max}};
  spec.mrope = f.mrope;
  return build_case(spec);
}

}  // namespace

namespace {

rc::Gen<LayoutCase> family_case_at(const LayoutFamily& f, const rc::Gen<int>& cp_size, const PlanDraw& draw) {
  using namespace rc;
  const auto in = [](Range r) { return gen::inRange(r.min, r.max + 1); };
  const Gen<int> length = f.short_lengths
                              ? gen::weightedOneOf<int>({{3, gen::inRange(f.document_length.min,
                                                                          std::min(f.document_length.max,
                                                                                   f.document_length.min + 3) + 1)},
                                                         {1, in(f.document_length)}})
                              : in(f.document_length);
  const auto doc = gen::pair(length, in(f.interior_padding));
  const auto row = gen::mapcat(in(f.documents), [doc](int n) {
    return gen::container<std::vector<std::pair<int, int>>>(static_cast<std::size_t>(n), doc);
  });
  const Range rows = thd(f.form) ? Range{1, 1} : f.rows;
  return gen::mapcat(gen::pair(cp_size, in(rows)), [=](std::pair<int, int> cp_rows) {
    const int cp = cp_rows.first, B = cp_rows.second;
    const std::size_t n = static_cast<std::size_t>(B);
    return gen::map(gen::tuple(gen::container<std::vector<std::vector<std::pair<int, int>>>>(n, row),
                               gen::container<std::vector<int>>(n, in(f.zero_length_placeholders)),
                               gen::container<std::vector<int>>(n, in(f.left_padding)), in(f.tail_padding),
                               gen::arbitrary<std::uint64_t>(), draw ? gen::just(plan_spec_of(*draw)) : gen_plan_spec(cp)),
                    [f, cp](const auto& t) {
                      Draw d;
                      d.cp = cp;
                      std::tie(d.docs, d.placeholders, d.lefts, d.tail, d.seed, d.plan) = t;
                      return member(f, d);
                    });
  });
}

}  // namespace

rc::Gen<LayoutCase> gen_family_case(const LayoutFamily& f, int max_cp, const PlanDraw& draw) {
  const int hi = std::max(1, std::min(f.cp.max, max_cp)), lo = std::min(f.cp.min, hi);
  return family_case_at(f, rc::gen::inRange(lo, hi + 1), draw);
}


namespace {

// A row's entries of a lengths key, sentinels dropped.
std::vector<std::int64_t> entries(const Tensor& t, std::int64_t row, bool cumulative) {
  std::vector<std::int64_t> out;
  const Tensor flat = t.reshape({t.numel()});
  if (cumulative) {
    std::int64_t prev = -1;
    for (std::int64_t i = 0; i < flat.numel(); ++i) {
      const std::int64_t v = flat.get_int(i);
      if (v < 0) break;
      if (prev >= 0) out.push_back(v - prev);
      prev = v;
    }
    return out;
  }
  const std::int64_t D = t.dim(t.ndim() - 1);
  for (std::int64_t i = 0; i < D; ++i) {
    const std::int64_t v = t.get_int(row * D + i);
    if (v < 0) break;
    out.push_back(v);
  }
  return out;
}

bool within(std::int64_t v, Range r) { return v >= r.min && v <= r.max; }
std::string range_text(Range r) { return "[" + std::to_string(r.min) + ", " + std::to_string(r.max) + "]"; }

}  // namespace

std::string family_violation(const LayoutFamily& f, const LayoutCase& c) {
  const Batch& b = c.batch;
  const auto has = [&](const char* key) { return b.count(key) != 0; };
  if (!within(c.cp, f.cp)) return "cp " + std::to_string(c.cp) + " outside " + range_text(f.cp);
  const bool want_lens = f.form == LayoutForm::seq_lens_padded || f.form == LayoutForm::seq_lens;
  const bool want_cu = f.form == LayoutForm::cu_seqlens || f.form == LayoutForm::cu_seqlens_only;
  const bool want_cu_padded = f.form == LayoutForm::cu_seqlens || f.form == LayoutForm::cu_seqlens_padded_only;
  if (has("seq_lens") != want_lens || has("seq_lens_padded") != (f.form == LayoutForm::seq_lens_padded) ||
      has("cu_seqlens") != want_cu || has("cu_seqlens_padded") != want_cu_padded ||
      (f.form == LayoutForm::position_resets && !has("position_ids")))
    return "its keys are not those of form " + f.form_name;
  if (packed(f.form) && has("position_ids") != f.position_ids)
    return f.position_ids ? "no position_ids (the family's packer gives them)" : "position_ids the family does not give";
  const Tensor& ids = b.at("input_ids");
  const std::int64_t B = ids.ndim() == 1 ? 1 : ids.dim(0), S = ids.dim(ids.ndim() - 1);
  if (has("position_ids") && (b.at("position_ids").numel() == 3 * B * S) != f.mrope)
    return f.mrope ? "position_ids not mRoPE's three planes" : "mRoPE position_ids the family does not give";
  if (!within(B, thd(f.form) ? Range{1, 1} : f.rows)) return std::to_string(B) + " rows, outside " + range_text(f.rows);
  const int m = f.document_multiple(c.cp);
  std::int64_t longest = 0;
  for (std::int64_t r = 0; r < B; ++r) {
    std::vector<std::int64_t> real, occupied;
    if (f.form == LayoutForm::unpacked || f.form == LayoutForm::position_resets) {
      // Real runs from the mask (and, with position_ids, the resets to 0).
      const Tensor& mask = b.at("padding_mask");
      std::int64_t left = 0;
      while (left < S && mask.get_int(r * S + left) != 0) ++left;
      if (f.form == LayoutForm::unpacked && !within(left, f.left_padding)) return "left padding outside the family";
      for (std::int64_t s = left; s < S; ++s) {
        if (mask.get_int(r * S + s) != 0) continue;
        const bool starts = s == left || (f.form == LayoutForm::position_resets && b.at("position_ids").get_int(r * S + s) == 0);
        if (starts) real.push_back(0);
        ++real.back();
      }
      occupied = real;
      longest = std::max(longest, left + [&] {
        std::int64_t n = 0;
        for (auto v : real) n += v;
        return n;
      }());
    } else {
      real = entries(b.at(want_lens ? "seq_lens" : want_cu ? "cu_seqlens" : "cu_seqlens_padded"), r, !want_lens);
      occupied = f.form == LayoutForm::seq_lens_padded ? entries(b.at("seq_lens_padded"), r, false)
                 : f.form == LayoutForm::cu_seqlens     ? entries(b.at("cu_seqlens_padded"), r, true)
                                                        : real;
      if (occupied.size() != real.size()) return "row " + std::to_string(r) + ": lengths keys disagree in count";
      std::size_t docs = real.size();
      while (docs > 0 && real[docs - 1] == 0 && occupied[docs - 1] == 0) --docs;
      if (!within(static_cast<std::int64_t>(real.size() - docs), f.zero_length_placeholders))
        return "row " + std::to_string(r) + ": " + std::to_string(real.size() - docs) +
               " zero-length placeholders, outside " + range_text(f.zero_length_placeholders);
      real.resize(docs);
      occupied.resize(docs);
      std::int64_t used = 0;
      for (std::size_t i = 0; i < docs; ++i) {
        const std::string where = "row " + std::to_string(r) + " document " + std::to_string(i);
        // The last document of a row that holds the row's tail: any more padding (the
        // row must then fill S, checked below; a shorter row's tail is longer).
        const bool holds_tail = f.tail_in_last_document && i + 1 == docs;
        const Range interior =
            holds_tail ? Range{f.interior_padding.min, static_cast<int>(std::min<std::int64_t>(S, INT_MAX))}
                       : f.interior_padding;
        if (two_keys(f.form)) {
          if (!within(real[i], f.document_length)) return where + ": length outside " + range_text(f.document_length);
          if (!within(occupied[i] - round_up(static_cast<int>(real[i]), m), interior))
            return where + ": occupied " + std::to_string(occupied[i]) + " is not its length rounded up to " +
                   std::to_string(m) + " plus padding in " + range_text(interior);
        } else if (real[i] % m != 0 || real[i] < f.document_length.min ||
                   real[i] > round_up(f.document_length.max, m)) {
          return where + ": length " + std::to_string(real[i]) + " is not a multiple of " + std::to_string(m) +
                 " within the family's lengths";
        }
        used += occupied[i];
      }
      if (f.tail_in_last_document && docs > 0 && used != S)
        return "row " + std::to_string(r) + ": its documents occupy " + std::to_string(used) + " of " +
               std::to_string(S) + " (the family's packer puts the tail in the last document)";
      longest = std::max(longest, used);
    }
    if (!within(static_cast<std::int64_t>(real.size()), f.documents))
      return "row " + std::to_string(r) + ": " + std::to_string(real.size()) + " documents, outside " +
             range_text(f.documents);
    if (f.form == LayoutForm::unpacked || f.form == LayoutForm::position_resets)
      for (std::size_t i = 0; i < real.size(); ++i)
        if (!within(real[i], f.document_length))
          return "row " + std::to_string(r) + " document " + std::to_string(i) + ": length outside " +
                 range_text(f.document_length);
  }
  if (!f.tail_in_last_document && !within(S - longest, f.tail_padding))
    return "tail padding " + std::to_string(S - longest) + " outside " + range_text(f.tail_padding);
  return "";
}

rc::Gen<LayoutCase> gen_family_case(const LayoutFamily& f, const std::vector<int>& cp_sizes, const PlanDraw& draw) {
  std::vector<int> in_range;
  for (int cp : cp_sizes)
    if (within(cp, f.cp)) in_range.push_back(cp);
  if (in_range.empty())
    throw InvalidInput("family " + f.name + " runs at cp " + range_text(f.cp) + "; none of the CP sizes asked for is in it");
  return family_case_at(f, gen_cp_size(in_range), draw);
}

}  // namespace cpsim::verify
