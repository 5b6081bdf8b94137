#include "verify/cases.hpp"

#include <algorithm>

#include "verify/batch_io.hpp"
#include "verify/random.hpp"

namespace cpsim::verify {

std::ostream& operator<<(std::ostream& os, const LayoutCase& c) {
  os << "cp=" << c.cp << " seed=" << c.seed;
  if (c.plan.kind != PlanChoice::Kind::equal) os << " plan=" << plan_choice_name(c.plan);
  return os << " batch=" << batch_to_json(c.batch, c.pad_token_id);
}

LayoutCase at_cp(LayoutCase c, int cp) {
  if (cp != c.cp && c.plan.kind == PlanChoice::Kind::cuts) c.plan = PlanChoice{};
  c.cp = cp;
  return c;
}

PlanChoice plan_of_spec(const PlanSpec& spec, std::int64_t P, int cp) {
  PlanChoice out;
  out.kind = spec.kind;
  if (spec.kind == PlanChoice::Kind::balanced) {
    out.cost = {std::max(0, spec.attention), std::max(0, spec.linear)};
    if (out.cost.attention == 0 && out.cost.linear == 0) out.cost.attention = 1;
  }
  if (spec.kind != PlanChoice::Kind::cuts) return out;
  std::vector<std::int64_t> w(cp, 0);
  std::int64_t total = 0;
  for (int r = 0; r < cp && r < static_cast<int>(spec.weights.size()); ++r) total += w[r] = std::max(0, spec.weights[r]);
  if (total == 0) {
    out.kind = PlanChoice::Kind::equal;
    return out;
  }
  std::int64_t prefix = 0;
  out.cuts = {0};
  for (int r = 0; r < cp; ++r) {
    prefix += w[r];
    out.cuts.push_back(r + 1 == cp ? P : P * prefix / total);
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const PlanSpec& p) {
  os << (p.kind == PlanChoice::Kind::equal ? "equal" : p.kind == PlanChoice::Kind::balanced ? "balanced" : "cuts");
  if (p.kind == PlanChoice::Kind::balanced) os << " attention=" << p.attention << " linear=" << p.linear;
  if (p.kind == PlanChoice::Kind::cuts) {
    os << " weights";
    for (int w : p.weights) os << " " << w;
  }
  return os;
}

namespace {

// Truth positions: offset inside the occupied run; a trailing pad run continues.
void fill_positions(LayoutTruth& t, std::int64_t B, std::int64_t S) {
  const auto* id = t.doc_ids.data<std::int64_t>();
  auto* p = t.positions.data<std::int64_t>();
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t i = r * S + s;
      if (s == 0) p[i] = 0;
      else if (id[i] == id[i - 1]) p[i] = p[i - 1] + 1;
      else p[i] = 0;
    }
  // The trailing doc-id-0 run (after at least one document) continues the count.
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t s = S;
    while (s > 0 && id[r * S + s - 1] == kPadDocId) --s;
    if (s == 0) continue;
    for (std::int64_t k = s; k < S; ++k) p[r * S + k] = p[r * S + k - 1] + 1;
  }
}

// The grid an image span of n tokens is read as (one frame): the most square
// gh x gw = n, gh <= gw.
std::pair<std::int64_t, std::int64_t> image_grid(std::int64_t n) {
  std::int64_t gh = 1;
  for (std::int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) gh = d;
  return {gh, n / gh};
}

// Image-token spans inside each document's real tokens, placed by the seed.
// Row r's documents start at row_start[r] (an unpacked row's left padding).
void place_image_spans(Tensor& ids, const std::vector<std::vector<DocSpec>>& docs,
                       const std::vector<std::int64_t>& row_start, std::int64_t S, const ImageSpans& spans,
                       std::uint64_t seed) {
  SplitMix64 rng(mix_seed(seed, 7));
  const auto draw = [&](std::pair<int, int> range) {
    return range.first + static_cast<int>(rng.below(std::max(0, range.second - range.first) + 1));
  };
  for (std::size_t r = 0; r < docs.size(); ++r) {
    std::int64_t at = row_start[r];
    for (const DocSpec& doc : docs[r]) {
      const int count = draw(spans.per_document);
      for (int k = 0; k < count && doc.real > 0; ++k) {
        const int len = std::min(doc.real, draw(spans.length));
        const std::int64_t first = at + static_cast<std::int64_t>(rng.below(doc.real - len + 1));
        for (std::int64_t s = first; s < first + len; ++s) ids.set(static_cast<std::int64_t>(r) * S + s, spans.token_id);
      }
      at += doc.real + doc.extra;
    }
  }
}

// mRoPE position_ids [3, B, S] as Qwen2-VL's get_rope_index gives them, per
// document: a text token is one past the document's largest position so far in
// all three planes (0 at its start); a run of image tokens is a grid from
// offset o (that same next position): temporal o, height o + i / gw, width
// o + i % gw, and the token after it follows the grid's largest. Tokens that
// are not real (a document's padding, the row's tail) go on as text; an
// unpacked row's left padding is (0, 0, 0).
Tensor mrope_planes(const Tensor& ids, const std::vector<std::vector<DocSpec>>& docs,
                    const std::vector<std::int64_t>& row_start, std::int64_t S, int image) {
  const auto B = static_cast<std::int64_t>(docs.size());
  Tensor planes({3, B, S}, DType::i64);
  auto* p = planes.data<std::int64_t>();
  const auto put = [&](std::int64_t r, std::int64_t s, std::int64_t t, std::int64_t h, std::int64_t w) {
    p[r * S + s] = t, p[(B + r) * S + s] = h, p[(2 * B + r) * S + s] = w;
  };
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t s = 0, top = -1;
    for (; s < row_start[r]; ++s) put(r, s, 0, 0, 0);
    const auto text = [&](std::int64_t at) {
      ++top;
      put(r, at, top, top, top);
    };
    for (const DocSpec& doc : docs[r]) {
      top = -1;  // a document starts at 0
      const std::int64_t end = s + doc.real;
      while (s < end) {
        std::int64_t n = 0;
        while (s + n < end && ids.get_int(r * S + s + n) == image) ++n;
        if (n == 0) {
          text(s++);
          continue;
        }
        const auto [gh, gw] = image_grid(n);
        const std::int64_t o = top + 1;
        for (std::int64_t i = 0; i < n; ++i) put(r, s + i, o, o + i / gw, o + i % gw);
        top = o + std::max(gh, gw) - 1;
        s += n;
      }
      for (std::int64_t k = 0; k < doc.extra; ++k) text(s++);
    }
    for (; s < S; ++s) text(s);
  }
  return planes;
}

}  // namespace

LayoutCase build_case(const LayoutSpec& spec) {
  const std::int64_t S = std::max(1, spec.seq_len);
  const bool unpacked = spec.form == LayoutForm::unpacked;
  const bool resets = spec.form == LayoutForm::position_resets;
  const bool unmasked_resets = resets && spec.mask_kind == MaskKind::none;  // no mask: every token is real
  const bool thd = spec.form == LayoutForm::cu_seqlens || spec.form == LayoutForm::cu_seqlens_only ||
                   spec.form == LayoutForm::cu_seqlens_padded_only;
  // One lengths key alone gives real = occupied: documents carry no padding of their own.
  const bool one_key = spec.form == LayoutForm::seq_lens || spec.form == LayoutForm::cu_seqlens_only ||
                       spec.form == LayoutForm::cu_seqlens_padded_only;
  const std::int64_t B = thd ? 1
                         : unpacked ? std::max<std::int64_t>(1, spec.row_pads.size())
                                    : std::max<std::int64_t>(1, spec.rows.size());
  LayoutTruth truth{Tensor({B, S}, DType::i64), Tensor({B, S}, DType::b8), Tensor({B, S}, DType::i64)};
  auto* id = truth.doc_ids.data<std::int64_t>();
  auto* pad = truth.padding.data<bool>();
  std::fill(pad, pad + B * S, true);
  LayoutCase out;
  std::vector<std::vector<DocSpec>> docs(B);
  for (std::int64_t r = 0; r < B; ++r) {
    if (unpacked) {
      auto [left, right] = r < static_cast<std::int64_t>(spec.row_pads.size()) ? spec.row_pads[r] : std::pair{0, 0};
      if (spec.mask_kind == MaskKind::none) left = right = 0;
      const std::int64_t l = std::min<std::int64_t>(left, S), rp = std::min<std::int64_t>(right, S - l);
      for (std::int64_t s = l; s < S - rp; ++s) {
        id[r * S + s] = 1;
        pad[r * S + s] = false;
      }
      // An interior gap: the mask's zeros between real tokens of the one
      // document (row padding, doc id 0; the tokens after it are the document's).
      const auto [at, len] = r < static_cast<std::int64_t>(spec.row_gaps.size()) ? spec.row_gaps[r] : std::pair{0, 0};
      if (len > 0 && at > 0 && spec.mask_kind != MaskKind::none && !spec.give_positions && !spec.mrope)
        for (std::int64_t s = l + at; s < std::min<std::int64_t>(l + at + len, S - rp - 1); ++s) {
          id[r * S + s] = kPadDocId;
          pad[r * S + s] = true;
        }
      continue;
    }
    std::int64_t pos = 0;
    const auto& row = r < static_cast<std::int64_t>(spec.rows.size()) ? spec.rows[r] : std::vector<DocSpec>{};
    for (const DocSpec& d : row) {
      // A full row takes no more documents; a zero-length entry (a static-graph
      // packer's placeholder) still follows.
      if (pos >= S && (d.real > 0 || d.extra > 0)) break;
      DocSpec c = d;
      if (one_key) c.extra = 0;
      c.real = static_cast<int>(std::min<std::int64_t>(std::max(0, c.real), S - pos));
      c.extra = static_cast<int>(std::min<std::int64_t>(std::max(0, c.extra), S - pos - c.real));
      docs[r].push_back(c);
      pos += c.real + c.extra;
    }
    if (unmasked_resets) {
      // Without a mask nothing is padding: the documents cover the row.
      for (DocSpec& d : docs[r]) d.extra = 0;
      std::int64_t covered = 0;
      for (const DocSpec& d : docs[r]) covered += d.real;
      if (docs[r].empty() || docs[r].back().real == 0) docs[r].push_back(DocSpec{0, 0});
      docs[r].back().real += static_cast<int>(S - covered);
      pos = S;
    }
    if (spec.absorb_tail && !one_key && !resets && !docs[r].empty())
      docs[r].back().extra += static_cast<int>(S - pos);
    pos = 0;
    std::int64_t number = 0;  // position_resets: documents with real tokens, from 1; padding is doc 0
    for (std::size_t i = 0; i < docs[r].size(); ++i) {
      if (docs[r][i].real > 0) ++number;
      for (int k = 0; k < docs[r][i].real + docs[r][i].extra; ++k) {
        const bool padding = k >= docs[r][i].real;
        id[r * S + pos + k] = resets ? (padding ? kPadDocId : number) : static_cast<std::int64_t>(i + 1);
        pad[r * S + pos + k] = padding;
      }
      pos += docs[r][i].real + docs[r][i].extra;
    }
  }
  fill_positions(truth, B, S);

  Batch& b = out.batch;
  SplitMix64 rng(spec.seed);
  Tensor ids({B, S}, DType::i64), labels({B, S}, DType::i64);
  for (std::int64_t i = 0; i < B * S; ++i) {
    // Small vocabulary that contains the pad id: real EOS tokens equal to PAD occur.
    ids.data<std::int64_t>()[i] = rng.below(6);
    labels.data<std::int64_t>()[i] = pad[i] ? kIgnoreLabel : rng.below(6);
  }
  if (spec.eos_is_pad) {
    // Each run of real tokens ends with an EOS equal to the pad id and holds one more inside.
    for (std::int64_t r = 0; r < B; ++r)
      for (std::int64_t s = 0, run = 0; s < S; ++s) {
        const std::int64_t i = r * S + s;
        if (pad[i]) {
          run = 0;
          continue;
        }
        ++run;
        const bool last = s + 1 == S || pad[i + 1] || id[i + 1] != id[i];
        if (last) ids.data<std::int64_t>()[i] = spec.pad_token_id;
        if (last && run >= 3) ids.data<std::int64_t>()[i - run / 2] = spec.pad_token_id;
        if (last) run = 0;
      }
  }
  // Where each row's documents start: an unpacked row's one document after its left padding.
  std::vector<std::int64_t> row_start(static_cast<std::size_t>(B), 0);
  if (unpacked)
    for (std::int64_t r = 0; r < B; ++r) {
      std::int64_t l = S;
      for (std::int64_t s = 0; s < S && l == S; ++s)
        if (!pad[r * S + s]) l = s;
      std::int64_t real = 0;
      for (std::int64_t s = l; s < S && !pad[r * S + s]; ++s) ++real;
      row_start[r] = l == S ? 0 : l;
      docs[r] = {DocSpec{static_cast<int>(real), static_cast<int>(S - row_start[r] - real)}};
    }
  if (spec.image_spans) place_image_spans(ids, docs, row_start, S, *spec.image_spans, spec.seed);
  b["input_ids"] = ids;
  b["labels"] = labels;
  if (thd) {
    const auto& d = docs[0];
    std::vector<std::int64_t> cu{0}, cu_padded{0};
    for (const auto& doc : d) {
      cu.push_back(cu.back() + doc.real);
      cu_padded.push_back(cu_padded.back() + doc.real + doc.extra);
    }
    for (int k = 0; k < spec.cu_sentinels; ++k) {
      cu.push_back(kSeqLensSentinel);
      cu_padded.push_back(kSeqLensSentinel);
    }
    // cu_seqlens holds real lengths only when documents carry padding of their own.
    if (spec.form != LayoutForm::cu_seqlens_padded_only)
      b["cu_seqlens"] = Tensor::from<std::int64_t>({static_cast<std::int64_t>(cu.size())}, cu);
    if (spec.form != LayoutForm::cu_seqlens_only)
      b["cu_seqlens_padded"] = Tensor::from<std::int64_t>({static_cast<std::int64_t>(cu_padded.size())}, cu_padded);
  } else if (!unpacked && !resets) {
    std::size_t D = 1;
    for (const auto& d : docs) D = std::max(D, d.size());
    Tensor lens({B, static_cast<std::int64_t>(D)}, DType::i64), padded = lens.clone();
    for (std::int64_t r = 0; r < B; ++r)
      for (std::size_t i = 0; i < D; ++i) {
        const bool real = i < docs[r].size();
        lens.data<std::int64_t>()[r * D + i] = real ? docs[r][i].real : kSeqLensSentinel;
        padded.data<std::int64_t>()[r * D + i] = real ? docs[r][i].real + docs[r][i].extra : kSeqLensSentinel;
      }
    b["seq_lens"] = lens;
    if (spec.form == LayoutForm::seq_lens_padded) b["seq_lens_padded"] = padded;
  } else if (spec.mask_kind == MaskKind::padding_mask) {
    b["padding_mask"] = truth.padding.clone();
  } else if (spec.mask_kind == MaskKind::attention_mask) {
    Tensor am({B, S}, DType::i64);
    for (std::int64_t i = 0; i < B * S; ++i) am.data<std::int64_t>()[i] = pad[i] ? 0 : 1;
    b["attention_mask"] = am;
  }
  const bool planes = spec.mrope && !resets;  // mRoPE: packed forms and unpacked rows
  if (planes)
    truth.positions = mrope_planes(ids, docs, row_start, S, spec.image_spans ? spec.image_spans->token_id : -1);
  if (spec.give_positions || resets || planes) b["position_ids"] = truth.positions.clone();
  if (spec.give_loss_mask) {
    Tensor lm({B, S}, DType::i64);
    for (std::int64_t i = 0; i < B * S; ++i) lm.data<std::int64_t>()[i] = pad[i] ? 0 : 1;
    b["loss_mask"] = lm;
  }
  if (spec.token_type_ids) {
    Tensor tt({B, S}, DType::i64);
    for (std::int64_t i = 0; i < B * S; ++i) tt.data<std::int64_t>()[i] = 1 + rng.below(3);
    b["token_type_ids"] = tt;
  }
  if (spec.one_dimensional && B == 1)
    for (auto& [key, t] : b)
      if (key != "cu_seqlens" && key != "cu_seqlens_padded") t = t.ndim() == 3 ? t.reshape({3, S}) : t.reshape({t.numel()});
  out.pad_token_id = spec.pad_token_id;
  out.cp = std::max(1, spec.cp);
  out.seed = spec.seed;
  out.plan = plan_of_spec(spec.plan, (S + out.cp - 1) / out.cp * out.cp, out.cp);
  out.truth = std::move(truth);
  return out;
}

}  // namespace cpsim::verify
