#include "verify/reference_layers.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "verify/random.hpp"
#include "verify/reference.hpp"

namespace cpsim::verify {

AttentionInputs random_attention_inputs(std::int64_t B, std::int64_t P, std::int64_t H, std::int64_t D,
                                        std::int64_t Dv, std::int64_t Di, std::uint64_t seed) {
  auto integers = [](const Shape& shape, std::uint64_t s) {
    Tensor t = Tensor::empty(shape, DType::f64);
    SplitMix64 rng(s);
    double* v = t.data<double>();
    for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<double>(rng.below(7)) - 3;
    return t;
  };
  return {random_tensor({B, P, H, D}, DType::f64, mix_seed(seed, 1)),
          random_tensor({B, P, H, D}, DType::f64, mix_seed(seed, 2)),
          random_tensor({B, P, H, Dv}, DType::f64, mix_seed(seed, 3)),
          random_tensor({B, P, H, Dv}, DType::f64, mix_seed(seed, 4)),
          integers({B, P, Di}, mix_seed(seed, 5)),
          integers({B, P, Di}, mix_seed(seed, 6))};
}

LossInputs random_loss_inputs(const Tensor& input_ids, std::int64_t vocab, std::uint64_t seed) {
  const std::int64_t B = input_ids.dim(0), P = input_ids.dim(1);
  Tensor tokens({B, P}, DType::i64);
  for (std::int64_t i = 0; i < tokens.numel(); ++i)
    tokens.set(i, static_cast<double>(((input_ids.get_int(i) % vocab) + vocab) % vocab));
  return {tokens, random_tensor({B, P, vocab}, DType::f64, seed)};
}

Tensor reference_rope(const Tensor& x_in, const Tensor& positions, double base) {
  const std::int64_t B = x_in.dim(0), S = x_in.dim(1), H = x_in.dim(2), D = x_in.dim(3);
  const Tensor x = host_values(x_in, DType::f64);
  Tensor y(x.shape(), DType::f64);  // an odd D leaves its last element 0
  const double* X = x.data<double>();
  double* Y = y.data<double>();
  std::vector<double> c(D / 2), sn(D / 2);
  // mRoPE ([3, B, S] positions): the pairs in three runs, temporal, height,
  // width; height and width 3/8 of the pairs each (at least one), as Qwen2-VL's
  // [16, 24, 24] of 64 pairs. Pair m reads its run's plane.
  const bool mrope = positions.ndim() == 3;
  const std::int64_t pairs = D / 2, side = std::max<std::int64_t>(1, pairs * 3 / 8);
  std::vector<std::int64_t> plane(static_cast<std::size_t>(pairs), 0);
  for (std::int64_t m = 0; m < pairs && mrope; ++m) plane[m] = m >= pairs - side ? 2 : m >= pairs - 2 * side ? 1 : 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s) {
      // This token's angle for each pair m, the same for every head: pos *
      // base^(-2m/D) as SPEC §3b writes it, the one float64 expression both
      // sides agree on (p / base^(2m/D) rounds differently, and at a large
      // position one unit in the last place of the angle is a visible turn).
      for (std::int64_t m = 0; m < D / 2; ++m) {
        const double p = static_cast<double>(positions.get_int((plane[m] * B + b) * S + s));
        const double theta = p * std::pow(base, -2.0 * static_cast<double>(m) / static_cast<double>(D));
        c[m] = std::cos(theta), sn[m] = std::sin(theta);
      }
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t m = 0; m < D / 2; ++m) {
          const std::int64_t at = ((b * S + s) * H + h) * D + 2 * m;
          const double x0 = X[at], x1 = X[at + 1];
          Y[at] = x0 * c[m] - x1 * sn[m];
          Y[at + 1] = x0 * sn[m] + x1 * c[m];
        }
    }
  return y;
}

Tensor reference_rope_backward(const Tensor& dy, const Tensor& positions, double base) {
  Tensor back = positions.to(DType::i64).clone();
  for (std::int64_t i = 0; i < back.numel(); ++i) back.set(i, -back.get(i));
  return reference_rope(dy, back, base);
}

AttentionReference reference_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                       const Tensor& doc_ids_in, const Tensor& padding_in, const Tensor& d_o_in,
                                       double scale, const Tensor& index_q_in, const Tensor& index_k_in,
                                       std::int64_t topk, const Tensor& queries_in) {
  // Float64 / int64 values on the host, read through pointers.
  const auto f64 = [](const Tensor& t) { return host_values(t, DType::f64); };
  const Tensor q = f64(q_in), k = f64(k_in), v = f64(v_in), d_o = f64(d_o_in);
  const Tensor doc_ids = host_values(doc_ids_in, DType::i64), padding = host_values(padding_in, DType::i64);
  const Tensor index_q = topk >= 0 ? f64(index_q_in) : Tensor(), index_k = topk >= 0 ? f64(index_k_in) : Tensor();
  const std::int64_t B = q.dim(0), S = q.dim(1), H = q.dim(2), D = q.dim(3), Dv = v.dim(3);
  AttentionReference r;
  r.o = Tensor::full({B, S, H, Dv}, DType::f64, 0.0);
  r.dq = Tensor::full(q.shape(), DType::f64, 0.0);
  r.dk = Tensor::full(k.shape(), DType::f64, 0.0);
  r.dv = Tensor::full(v.shape(), DType::f64, 0.0);
  if (topk >= 0) r.kept = Tensor::full({B, S, topk}, DType::i64, -1.0);
  const double *Q = q.data<double>(), *K = k.data<double>(), *Vv = v.data<double>(), *G = d_o.data<double>();
  const std::int64_t *doc = doc_ids.data<std::int64_t>(), *pad = padding.data<std::int64_t>();
  const Tensor queries = queries_in.defined() ? host_values(queries_in, DType::i64) : Tensor();
  const std::int64_t* evaluate = queries.defined() ? queries.data<std::int64_t>() : nullptr;
  double *O = r.o.data<double>(), *DQ = r.dq.data<double>(), *DK = r.dk.data<double>(), *DV = r.dv.data<double>();
  auto inner = [](const double* a, const double* c, std::int64_t n) {
    double s = 0;
    for (std::int64_t d = 0; d < n; ++d) s += a[d] * c[d];
    return s;
  };
  std::vector<double> p, dp, top, z, mean;  // [key][head], [head]
  for (std::int64_t b = 0; b < B; ++b) {
    // Each document's real tokens, in position order.
    std::map<std::int64_t, std::vector<std::int64_t>> members;
    for (std::int64_t j = 0; j < S; ++j)
      if (pad[b * S + j] == 0 && doc[b * S + j] != 0) members[doc[b * S + j]].push_back(j);
    for (std::int64_t i = 0; i < S; ++i) {
      if (evaluate && evaluate[b * S + i] == 0) continue;
      // The keys query i attends to: the real tokens of its document up to i.
      std::vector<std::int64_t> keys;
      if (doc[b * S + i] != 0 && pad[b * S + i] == 0)
        for (std::int64_t j : members[doc[b * S + i]]) {
          if (j > i) break;
          keys.push_back(j);
        }
      if (topk >= 0) {
        const std::int64_t Di = index_q.dim(2);
        const double *IQ = index_q.data<double>(), *IK = index_k.data<double>();
        std::vector<std::pair<double, std::int64_t>> scored;
        for (std::int64_t j : keys) scored.push_back({inner(IQ + (b * S + i) * Di, IK + (b * S + j) * Di, Di), j});
        // The best topk, best first (higher score, then the earlier key).
        const std::size_t take = std::min<std::size_t>(scored.size(), static_cast<std::size_t>(topk));
        std::partial_sort(scored.begin(), scored.begin() + take, scored.end(), [](const auto& x, const auto& y) {
          return x.first != y.first ? x.first > y.first : x.second < y.second;
        });
        scored.resize(take);
        keys.clear();
        for (std::size_t n = 0; n < scored.size() && static_cast<std::int64_t>(n) < topk; ++n)
          keys.push_back(scored[n].second);
        std::sort(keys.begin(), keys.end());
        for (std::size_t n = 0; n < keys.size(); ++n) r.kept.set((b * S + i) * topk + n, static_cast<double>(keys[n]));
      }
      if (keys.empty()) continue;
      // Every head of a key at once (a token's heads are one contiguous row):
      // P the softmax over the kept keys, then dP = dO V^T; dS = P (dP - sum_n P dP);
      // dq = scale dS K; dk += scale dS q; dv += P dO.
      const std::size_t n_keys = keys.size();
      p.assign(n_keys * H, 0.0);
      dp.assign(n_keys * H, 0.0);
      top.assign(H, -INFINITY);
      z.assign(H, 0.0);
      mean.assign(H, 0.0);
      const std::int64_t q_row = (b * S + i) * H;
      for (std::size_t n = 0; n < n_keys; ++n) {
        const std::int64_t k_row = (b * S + keys[n]) * H;
        for (std::int64_t h = 0; h < H; ++h) {
          double& x = p[n * H + h];
          x = scale * inner(Q + (q_row + h) * D, K + (k_row + h) * D, D);
          top[h] = std::max(top[h], x);
          dp[n * H + h] = inner(G + (q_row + h) * Dv, Vv + (k_row + h) * Dv, Dv);
        }
      }
      for (std::size_t n = 0; n < n_keys; ++n)
        for (std::int64_t h = 0; h < H; ++h) z[h] += (p[n * H + h] = std::exp(p[n * H + h] - top[h]));
      for (std::size_t n = 0; n < n_keys; ++n)
        for (std::int64_t h = 0; h < H; ++h) {
          p[n * H + h] /= z[h];
          mean[h] += p[n * H + h] * dp[n * H + h];
        }
      for (std::size_t n = 0; n < n_keys; ++n) {
        const std::int64_t k_row = (b * S + keys[n]) * H;
        for (std::int64_t h = 0; h < H; ++h) {
          const double pn = p[n * H + h], ds = pn * (dp[n * H + h] - mean[h]);
          const std::int64_t qi = q_row + h, kj = k_row + h;
          for (std::int64_t d = 0; d < Dv; ++d) O[qi * Dv + d] += pn * Vv[kj * Dv + d];
          for (std::int64_t d = 0; d < D; ++d) {
            DQ[qi * D + d] += scale * ds * K[kj * D + d];
            DK[kj * D + d] += scale * ds * Q[qi * D + d];
          }
          for (std::int64_t d = 0; d < Dv; ++d) DV[kj * Dv + d] += pn * G[qi * Dv + d];
        }
      }
    }
  }
  return r;
}

LossReference reference_loss(const Tensor& logits, const Tensor& input_ids, const Tensor& doc_ids,
                             const Tensor& padding) {
  const std::int64_t B = logits.dim(0), S = logits.dim(1), V = logits.dim(2);
  LossReference r;
  r.targets = Tensor::full({B, S}, DType::i64, -100.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s + 1 < S; ++s) {
      const std::int64_t i = b * S + s;
      const bool real = padding.get_int(i) == 0 && padding.get_int(i + 1) == 0 && doc_ids.get_int(i) != 0;
      if (real && doc_ids.get_int(i + 1) == doc_ids.get_int(i)) r.targets.set(i, static_cast<double>(input_ids.get_int(i + 1)));
    }
  r.grad = Tensor::full(logits.shape(), DType::f64, 0.0);
  double sum = 0;
  std::vector<double> softmax(V);
  for (std::int64_t i = 0; i < B * S; ++i) {
    const std::int64_t t = r.targets.get_int(i);
    if (t < 0) continue;
    double top = -INFINITY, z = 0;
    for (std::int64_t c = 0; c < V; ++c) top = std::max(top, logits.get(i * V + c));
    for (std::int64_t c = 0; c < V; ++c) z += (softmax[c] = std::exp(logits.get(i * V + c) - top));
    for (double& x : softmax) x /= z;
    sum += -std::log(softmax[t]);
    r.count += 1;
    for (std::int64_t c = 0; c < V; ++c) r.grad.set(i * V + c, softmax[c] - (c == t ? 1.0 : 0.0));
  }
  r.loss = r.count > 0 ? sum / r.count : 0;
  if (r.count > 0)
    for (std::int64_t i = 0; i < r.grad.numel(); ++i) r.grad.set(i, r.grad.get(i) / r.count);
  return r;
}

}  // namespace cpsim::verify
