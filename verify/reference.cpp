#include "verify/reference.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

namespace cpsim::verify {

namespace {

bool packing_length_key(const std::string& key) {
  return key == "seq_lens" || key == "seq_lens_padded" || key == "cu_seqlens" || key == "cu_seqlens_padded";
}

// Columns of a [B, S] key, or of a 1-D [S] one read as one row.
std::int64_t columns(const Tensor& t) { return t.ndim() == 1 ? t.dim(0) : t.dim(1); }

// One row of a lengths key: the entries before the first negative one.
std::vector<std::int64_t> lengths_of_row(const Tensor& t, std::int64_t row) {
  std::vector<std::int64_t> out;
  const std::int64_t D = columns(t);
  for (std::int64_t i = 0; i < D; ++i) {
    const std::int64_t v = t.get_int(row * D + i);
    if (v < 0) break;
    out.push_back(v);
  }
  return out;
}

// Differences of consecutive cu_seqlens entries, up to the first negative one.
std::vector<std::int64_t> lengths_of_cu(const Tensor& cu) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 1; i < cu.numel(); ++i) {
    const std::int64_t v = cu.get_int(i);
    if (v < 0) break;
    out.push_back(v - cu.get_int(i - 1));
  }
  return out;
}

// Writes an integer into any dtype exactly (int64 without a detour through double).
void put_int(Tensor& t, std::int64_t at, std::int64_t v) {
  switch (t.dtype()) {
    case DType::i64: t.data<std::int64_t>()[at] = v; break;
    case DType::i32: t.data<std::int32_t>()[at] = static_cast<std::int32_t>(v); break;
    case DType::b8: t.data<bool>()[at] = v != 0; break;
    default: t.set(at, static_cast<double>(v));
  }
}

// Copies element `from` of src to element `to` of dst, same dtype, bytewise.
void copy_element(const Tensor& src, std::int64_t from, Tensor& dst, std::int64_t to) {
  const std::size_t es = dtype_size(src.dtype());
  std::memcpy(static_cast<std::byte*>(dst.raw()) + to * es, static_cast<const std::byte*>(src.raw()) + from * es, es);
}

}  // namespace

ReferenceShape reference_shape(const Batch& raw) {
  auto it = raw.find("input_ids");
  if (it == raw.end())
    for (it = raw.begin(); it != raw.end() && packing_length_key(it->first); ++it) {
    }
  if (it == raw.end()) throw Error("reference: the batch has no token key");
  const Tensor& t = it->second;
  return {t.ndim() == 1 ? 1 : t.dim(0), columns(t)};
}

ReferenceGeometry reference_geometry(std::int64_t seq_len, int cp, std::int64_t pad_multiple) {
  ReferenceGeometry g;
  g.seq_len = seq_len;
  g.cp = cp;
  const std::int64_t unit = cp * pad_multiple;
  g.padded_len = (seq_len + unit - 1) / unit * unit;
  for (int r = 0; r <= cp; ++r) g.cuts.push_back(r * (g.padded_len / cp));
  return g;
}

std::int64_t ReferenceGeometry::largest() const {
  std::int64_t m = 0;
  for (int r = 0; r < cp; ++r) m = std::max(m, size(r));
  return m;
}

std::vector<std::int64_t> reference_cuts(const LayoutTruth& t, std::int64_t P, int cp, const PlanChoice& plan) {
  if (plan.kind == PlanChoice::Kind::cuts) return plan.cuts;
  std::vector<std::int64_t> equal;
  for (int r = 0; r <= cp; ++r) equal.push_back(r * (P / cp));
  if (plan.kind == PlanChoice::Kind::equal) return equal;
  const std::int64_t B = t.doc_ids.dim(0), S = t.doc_ids.dim(1);
  // cost[t] summed over rows; a token's document starts at the first position
  // holding its doc id in the row (padding gaps inside it included).
  std::vector<std::int64_t> cost(P, 0);
  for (std::int64_t b = 0; b < B; ++b) {
    std::map<std::int64_t, std::int64_t> first;  // doc id -> its first position
    for (std::int64_t s = S - 1; s >= 0; --s) first[t.doc_ids.get_int(b * S + s)] = s;
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t id = t.doc_ids.get_int(b * S + s);
      if (t.padding.get_int(b * S + s) != 0 || id == 0) continue;
      cost[s] += plan.cost.attention * (s - first.at(id) + 1) + plan.cost.linear;
    }
  }
  std::int64_t total = 0;
  for (std::int64_t v : cost) total += v;
  if (total == 0) return equal;
  std::vector<std::int64_t> cuts{0};
  for (int r = 1; r < cp; ++r) {
    std::int64_t at = 0, prefix = 0;  // prefix = cost[0, at)
    while (static_cast<long double>(cp) * prefix < static_cast<long double>(r) * total) prefix += cost[at++];
    cuts.push_back(at);
  }
  cuts.push_back(P);
  return cuts;
}

LayoutTruth reference_layout(const Batch& raw) {
  const auto [B, S] = reference_shape(raw);
  LayoutTruth t{Tensor({B, S}, DType::i64), Tensor({B, S}, DType::b8), Tensor({B, S}, DType::i64)};
  auto* id = t.doc_ids.data<std::int64_t>();
  auto* pad = t.padding.data<bool>();
  const auto has = [&](const char* key) { return raw.count(key) != 0; };
  // position_ids: K planes of B x S positions (K = 3: mRoPE's temporal, height, width).
  const std::int64_t K = has("position_ids") ? raw.at("position_ids").numel() / (B * S) : 1;
  const std::int64_t rows = B, columns = S;  // a lambda may not capture structured bindings (clang, C++17)
  const auto given = [&](std::int64_t k, std::int64_t r, std::int64_t s) {
    return raw.at("position_ids").get_int((k * rows + r) * columns + s);
  };
  if (K == 3) t.positions = Tensor({3, B, S}, DType::i64);
  for (std::int64_t r = 0; r < B; ++r) {
    std::vector<std::int64_t> real, occupied;
    bool packed = true;
    if (has("seq_lens")) {
      real = lengths_of_row(raw.at("seq_lens"), r);
      occupied = has("seq_lens_padded") ? lengths_of_row(raw.at("seq_lens_padded"), r) : real;
    } else if (has("cu_seqlens") || has("cu_seqlens_padded")) {
      real = lengths_of_cu(raw.at(has("cu_seqlens") ? "cu_seqlens" : "cu_seqlens_padded"));
      occupied = lengths_of_cu(raw.at(has("cu_seqlens_padded") ? "cu_seqlens_padded" : "cu_seqlens"));
    } else {
      packed = false;
    }
    for (std::int64_t s = 0; s < S; ++s) {
      id[r * S + s] = kPadDocId;
      pad[r * S + s] = true;
    }
    if (packed) {
      // Document i occupies occupied[i] tokens from where the previous one ended;
      // its first real[i] of them are real.
      std::int64_t start = 0;
      for (std::size_t i = 0; i < occupied.size(); ++i) {
        for (std::int64_t k = 0; k < occupied[i] && start + k < S; ++k) {
          id[r * S + start + k] = static_cast<std::int64_t>(i + 1);
          pad[r * S + start + k] = k >= real[i];
        }
        start += occupied[i];
      }
    } else {
      // One document of real tokens, or with position_ids one per run that starts
      // at a reset to 0 (the first real token starts the first).
      std::int64_t documents = 0;
      for (std::int64_t s = 0; s < S; ++s) {
        bool is_pad = false;
        if (has("padding_mask")) is_pad = raw.at("padding_mask").get_int(r * S + s) != 0;
        else if (has("attention_mask")) is_pad = raw.at("attention_mask").get_int(r * S + s) == 0;
        pad[r * S + s] = is_pad;
        if (is_pad) continue;
        bool reset = has("position_ids");  // 0 in every plane
        for (std::int64_t k = 0; k < K && reset; ++k) reset = given(k, r, s) == 0;
        if (documents == 0 || reset) ++documents;
        id[r * S + s] = has("position_ids") ? documents : 1;
      }
    }
    auto* p = t.positions.data<std::int64_t>() + r * S;
    if (has("position_ids")) {
      for (std::int64_t k = 0; k < K; ++k)
        for (std::int64_t s = 0; s < S; ++s) p[k * B * S + s] = given(k, r, s);
      continue;
    }
    // Offset inside each run of one id; the padding after the last document continues it.
    std::int64_t tail = S;
    while (tail > 0 && id[r * S + tail - 1] == kPadDocId) --tail;
    for (std::int64_t s = 0; s < S; ++s) {
      const bool continues = s > 0 && (id[r * S + s] == id[r * S + s - 1] || s >= tail);
      p[s] = continues ? p[s - 1] + 1 : 0;
    }
  }
  return t;
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
  for (std::int64_t s = 0; s < std::min(S, P); ++s) ids[s] = t.doc_ids.get_int(row * S + s);
  return ids;
}

Batch reference_padded_global(const LayoutCase& c, std::int64_t P) {
  const LayoutTruth t = reference_layout(c.batch);
  const auto [B, S] = reference_shape(c.batch);
  const std::int64_t n = std::min(S, P);
  Batch out;
  for (const auto& [key, src] : c.batch) {
    if (packing_length_key(key) || key == "padding_mask" || key == "position_ids") continue;
    // loss_mask, attention_mask and every other [B, S] key are padded with 0.
    const std::int64_t fill = key == "input_ids" ? c.pad_token_id : key == "labels" ? kIgnoreLabel : 0;
    Tensor o({B, P}, src.dtype());
    for (std::int64_t r = 0; r < B; ++r) {
      for (std::int64_t s = 0; s < n; ++s) copy_element(src, r * S + s, o, r * P + s);
      for (std::int64_t s = n; s < P; ++s) put_int(o, r * P + s, fill);
    }
    out[key] = o;
  }
  const std::int64_t K = t.positions.numel() / (B * S);  // mRoPE: 3 planes
  Tensor padding({B, P}, DType::b8), positions(K == 1 ? Shape{B, P} : Shape{K, B, P}, DType::i64);
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t s = 0; s < P; ++s) padding.data<bool>()[r * P + s] = s < S ? t.padding.data<bool>()[r * S + s] : true;
  // Positions continue last+1, ... into the padded tail, in every plane.
  for (std::int64_t kr = 0; kr < K * B; ++kr)
    for (std::int64_t s = 0; s < P; ++s) {
      const auto* from = t.positions.data<std::int64_t>() + kr * S;
      positions.data<std::int64_t>()[kr * P + s] = s < S ? from[s] : from[S - 1] + (s - S + 1);
    }
  out["padding_mask"] = padding;
  out["position_ids"] = positions;
  return out;
}

FlaCpContext reference_cp_context(const std::vector<std::int64_t>& ids, const ReferenceGeometry& g, int rank) {
  const std::int64_t P = static_cast<std::int64_t>(ids.size()), lo = g.start(rank), hi = g.end(rank);
  FlaCpContext c;
  c.cu_seqlens = {0};
  if (hi == lo) return c;
  // Walk left from lo while the document continues; walk right from hi-1 likewise.
  std::int64_t start = lo;
  while (start > 0 && ids[start - 1] == ids[lo]) --start;
  std::int64_t end = hi;
  while (end < P && ids[end] == ids[hi - 1]) ++end;
  c.pre_num_conv_tokens = lo - start;
  // Token by token: each earlier (later) position of the segment names its rank;
  // count the distinct ones.
  std::vector<bool> seen(g.cp, false);
  for (std::int64_t t = start; t < lo; ++t)
    for (int q = 0; q < g.cp; ++q)
      if (g.start(q) <= t && t < g.end(q)) seen[q] = true;
  for (std::int64_t t = hi; t < end; ++t)
    for (int q = 0; q < g.cp; ++q)
      if (g.start(q) <= t && t < g.end(q)) seen[q] = true;
  for (int q = 0; q < g.cp; ++q) {
    if (!seen[q]) continue;
    if (q < rank) ++c.pre_num_ranks;
    else ++c.post_num_ranks;
  }
  c.is_first_rank = c.pre_num_ranks == 0;
  c.is_last_rank = c.post_num_ranks == 0;
  c.cu_seqlens = reference_segments(std::vector<std::int64_t>(ids.begin() + lo, ids.begin() + hi));
  return c;
}

Tensor host_values(const Tensor& t, DType dtype) {
  const Tensor h = !t.defined() || t.is_cpu() ? t : t.to(Device::host());
  return !h.defined() || h.dtype() == dtype ? h : h.to(dtype);
}

namespace {
// Whether two values agree as far as non-finite values go: both finite, or the
// same non-finite value (both NaN, or the same infinity).
bool nonfinite_agrees(double r, double g) {
  if (std::isfinite(r) && std::isfinite(g)) return true;
  return (std::isnan(r) && std::isnan(g)) || r == g;
}

// rms(ref - got) / rms(scale), in element order and in double; `scale` is ref
// itself, or float64 values. Elements holding the same non-finite value on both
// sides are left out; one that holds it on one side only makes the measure inf.
double rmse_over(const Tensor& ref_in, const Tensor& got_in, const double* scale) {
  if (ref_in.shape() != got_in.shape()) return std::numeric_limits<double>::infinity();
  const Tensor a = host_values(ref_in, ref_in.dtype()), b = host_values(got_in, got_in.dtype());
  double num = 0, den = 0;
  bool mismatch = false;
  visit_dtype(a.dtype(), [&](auto at) {
    visit_dtype(b.dtype(), [&](auto bt) {
      const auto* x = static_cast<const decltype(at)*>(a.raw());
      const auto* y = static_cast<const decltype(bt)*>(b.raw());
      for (std::int64_t i = 0; i < a.numel(); ++i) {
        const double r = to_f64(x[i]), g = to_f64(y[i]), s = scale ? scale[i] : r;
        const double d = r - g;
        if (!std::isfinite(d)) {  // a non-finite side, or two finite ones too far apart for a double
          mismatch = mismatch || !(nonfinite_agrees(r, g) && !(std::isfinite(r) && std::isfinite(g)));
          continue;
        }
        if (!std::isfinite(s)) continue;
        num += d * d;
        den += s * s;
      }
    });
  });
  if (mismatch) return std::numeric_limits<double>::infinity();
  if (num == 0) return 0;
  if (!(den > 0)) return std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}
}  // namespace

double relative_rmse(const Tensor& ref, const Tensor& got) { return rmse_over(ref, got, nullptr); }

double relative_rmse(const Tensor& ref, const Tensor& got, const Tensor& scale) {
  if (scale.shape() != ref.shape()) return std::numeric_limits<double>::infinity();
  const Tensor s = host_values(scale, DType::f64);
  return rmse_over(ref, got, s.data<double>());
}

std::int64_t first_nonfinite_mismatch(const Tensor& ref_in, const Tensor& got_in) {
  if (ref_in.shape() != got_in.shape() || (!is_floating(ref_in.dtype()) && !is_floating(got_in.dtype()))) return -1;
  const Tensor a = host_values(ref_in, ref_in.dtype()), b = host_values(got_in, got_in.dtype());
  std::int64_t found = -1;
  visit_dtype(a.dtype(), [&](auto at) {
    visit_dtype(b.dtype(), [&](auto bt) {
      const auto* x = static_cast<const decltype(at)*>(a.raw());
      const auto* y = static_cast<const decltype(bt)*>(b.raw());
      for (std::int64_t i = 0; i < a.numel() && found < 0; ++i)
        if (!nonfinite_agrees(to_f64(x[i]), to_f64(y[i]))) found = i;
    });
  });
  return found;
}

std::string describe_element(const Tensor& ref, const Tensor& got, std::int64_t at) {
  std::vector<std::int64_t> index(ref.shape().size());
  std::int64_t rest = at;
  for (std::size_t d = index.size(); d-- > 0;) {
    const std::int64_t n = std::max<std::int64_t>(1, ref.shape()[d]);
    index[d] = rest % n;
    rest /= n;
  }
  std::ostringstream out;
  out << "element [";
  for (std::size_t d = 0; d < index.size(); ++d) out << (d ? ", " : "") << index[d];
  const auto value = [at](const Tensor& t) { return host_values(t, DType::f64).data<double>()[at]; };
  out << "] is " << value(got) << ", expected " << value(ref);
  return out.str();
}

std::int64_t count_wrong(const Tensor& ref, const Tensor& got) {
  if (ref.shape() != got.shape() || ref.dtype() != got.dtype()) return std::max<std::int64_t>(1, ref.numel());
  const std::size_t es = dtype_size(ref.dtype());
  const auto* a = static_cast<const std::byte*>(ref.raw());
  const auto* b = static_cast<const std::byte*>(got.raw());
  if (ref.nbytes() == 0 || std::memcmp(a, b, ref.nbytes()) == 0) return 0;  // the common case, at memory speed
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) wrong += std::memcmp(a + i * es, b + i * es, es) != 0;
  return wrong;
}


}  // namespace cpsim::verify
