#include "verify/reference.hpp"

#include <cmath>
#include <cstring>
#include <limits>

namespace cpsim::verify {

LayoutTruth expected_layout(const LayoutCase& c) {
  if (c.truth) return *c.truth;
  Batch b = c.batch;
  normalize_batch_axis(b);
  Layout l = derive_layout(b);
  return {l.doc_ids, l.padding, l.positions};
}

std::vector<std::int64_t> reference_segments(const std::vector<std::int64_t>& ids) {
  std::vector<std::int64_t> cu;
  for (std::size_t t = 0; t < ids.size(); ++t)
    if (t == 0 || ids[t] != ids[t - 1]) cu.push_back(static_cast<std::int64_t>(t));
  cu.push_back(static_cast<std::int64_t>(ids.size()));
  if (ids.empty()) cu = {0};
  return cu;
}

std::vector<std::int64_t> reference_padded_doc_ids_row(const LayoutTruth& t, int row, std::int64_t P) {
  const std::int64_t S = t.doc_ids.dim(1);
  std::vector<std::int64_t> ids(P, kPadDocId);
  for (std::int64_t s = 0; s < S; ++s) ids[s] = t.doc_ids.get_int(row * S + s);
  return ids;
}

Batch reference_padded_global(const LayoutCase& c, std::int64_t P) {
  const LayoutTruth t = expected_layout(c);
  const std::int64_t B = t.doc_ids.dim(0), S = t.doc_ids.dim(1);
  Batch in = c.batch;
  normalize_batch_axis(in);
  Batch out;
  auto padded = [&](const Tensor* src, DType dt, auto fill_at) {
    Tensor o({B, P}, dt);
    for (std::int64_t r = 0; r < B; ++r)
      for (std::int64_t s = 0; s < P; ++s)
        o.set(r * P + s, s < S && src ? src->get(r * S + s) : fill_at(r, s));
    return o;
  };
  auto constant = [](double v) { return [v](std::int64_t, std::int64_t) { return v; }; };
  out["input_ids"] = padded(&in.at("input_ids"), DType::i64, constant(static_cast<double>(c.pad_token_id)));
  if (in.count("labels")) out["labels"] = padded(&in.at("labels"), DType::i64, constant(-100.0));
  out["padding_mask"] = padded(&t.padding, DType::b8, constant(1.0));
  out["position_ids"] = padded(&t.positions, DType::i64, [&](std::int64_t r, std::int64_t s) {
    return static_cast<double>(t.positions.get_int(r * S + S - 1) + (s - S + 1));
  });
  if (in.count("loss_mask")) out["loss_mask"] = padded(&in.at("loss_mask"), DType::i64, constant(0.0));
  return out;
}

FlaCpContext reference_cp_context(const std::vector<std::int64_t>& ids, int cp, int rank) {
  const std::int64_t P = static_cast<std::int64_t>(ids.size()), L = P / cp, lo = rank * L, hi = lo + L;
  FlaCpContext c;
  // Walk left from lo while the document continues; walk right from hi-1 likewise.
  std::int64_t start = lo;
  while (start > 0 && ids[start - 1] == ids[lo]) --start;
  std::int64_t end = hi;
  while (end < P && ids[end] == ids[hi - 1]) ++end;
  c.pre_num_conv_tokens = lo - start;
  c.pre_num_ranks = rank - static_cast<int>(start / L);
  c.post_num_ranks = static_cast<int>((end - 1) / L) - rank;
  c.is_first_rank = c.pre_num_ranks == 0;
  c.is_last_rank = c.post_num_ranks == 0;
  c.cu_seqlens = reference_segments(std::vector<std::int64_t>(ids.begin() + lo, ids.begin() + hi));
  return c;
}

double relative_rmse(const Tensor& ref, const Tensor& got) {
  if (ref.shape() != got.shape()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    const double r = ref.get(i), d = r - got.get(i);
    num += d * d;
    den += r * r;
  }
  if (num == 0) return 0;
  if (den == 0) return std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

std::int64_t count_wrong(const Tensor& ref, const Tensor& got) {
  if (ref.shape() != got.shape() || ref.dtype() != got.dtype()) return std::max<std::int64_t>(1, ref.numel());
  const std::size_t es = dtype_size(ref.dtype());
  const auto* a = static_cast<const std::byte*>(ref.raw());
  const auto* b = static_cast<const std::byte*>(got.raw());
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) wrong += std::memcmp(a + i * es, b + i * es, es) != 0;
  return wrong;
}

}  // namespace cpsim::verify

#include "verify/random.hpp"

namespace cpsim::verify {

Tensor reference_padded_doc_ids(const LayoutCase& c, std::int64_t P) {
  const LayoutTruth t = expected_layout(c);
  const std::int64_t B = t.doc_ids.dim(0);
  Tensor out({B, P}, DType::i64);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto row = reference_padded_doc_ids_row(t, static_cast<int>(b), P);
    for (std::int64_t s = 0; s < P; ++s) out.data<std::int64_t>()[b * P + s] = row[s];
  }
  return out;
}

Tensor masked_activation(const LayoutCase& c, std::int64_t P, std::int64_t C, std::uint64_t seed) {
  const LayoutTruth t = expected_layout(c);
  const std::int64_t B = t.padding.dim(0), S = t.padding.dim(1);
  Tensor x = random_tensor({B, P, C}, DType::f64, seed);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < P; ++s)
      if (s >= S || t.padding.get_int(b * S + s))
        for (std::int64_t k = 0; k < C; ++k) x.set((b * P + s) * C + k, 0.0);
  return x;
}

Tensor reference_history(const Tensor& g, std::int64_t start, std::int64_t L, int width) {
  const std::int64_t B = g.dim(0), P = g.dim(1), C = g.dim(2), H = width - 1;
  Tensor out({B, L + H, C}, g.dtype());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L + H; ++i) {
      const std::int64_t p = start - H + i;
      if (p < 0 || p >= P) continue;
      for (std::int64_t k = 0; k < C; ++k) out.set((b * (L + H) + i) * C + k, g.get((b * P + p) * C + k));
    }
  return out;
}

ConvReference reference_conv(const Tensor& x, const Tensor& ids, const Tensor& w, const Tensor& bias, const Tensor& gy) {
  const std::int64_t B = x.dim(0), P = x.dim(1), C = x.dim(2), W = w.dim(1);
  ConvReference r{Tensor({B, P, C}, DType::f64), Tensor({B, P, C}, DType::f64), Tensor({C, W}, DType::f64),
                  Tensor({C}, DType::f64)};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < P; ++t) {
      std::int64_t seg = t;  // start of t's segment
      while (seg > 0 && ids.get_int(b * P + seg - 1) == ids.get_int(b * P + t)) --seg;
      for (std::int64_t c = 0; c < C; ++c) {
        double acc = bias.defined() ? bias.get(c) : 0.0;
        const double g = gy.defined() ? gy.get((b * P + t) * C + c) : 0.0;
        if (bias.defined()) r.dbias.set(c, r.dbias.get(c) + g);
        for (std::int64_t j = 0; j < W; ++j) {
          const std::int64_t p = t - (W - 1) + j;
          if (p < seg) continue;
          acc += w.get(c * W + j) * x.get((b * P + p) * C + c);
          r.dx.set((b * P + p) * C + c, r.dx.get((b * P + p) * C + c) + w.get(c * W + j) * g);
          r.dw.set(c * W + j, r.dw.get(c * W + j) + x.get((b * P + p) * C + c) * g);
        }
        r.y.set((b * P + t) * C + c, acc);
      }
    }
  return r;
}

}  // namespace cpsim::verify
