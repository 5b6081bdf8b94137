// Unsharded references of the operators (docs/operators.md): the halo, the packed
// causal conv, the gated delta rule and the gather's backward, token by token.
#include <cmath>
#include <algorithm>
#include <vector>

#include "verify/reference.hpp"
#include "verify/random.hpp"

namespace cpsim::verify {

Tensor reference_padded_doc_ids(const LayoutTruth& t, std::int64_t P) {
  const std::int64_t B = t.doc_ids.dim(0);
  Tensor out({B, P}, DType::i64);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto row = reference_padded_doc_ids_row(t, static_cast<int>(b), P);
    for (std::int64_t s = 0; s < P; ++s) out.data<std::int64_t>()[b * P + s] = row[s];
  }
  return out;
}

Tensor masked_activation(const LayoutTruth& t, std::int64_t P, std::int64_t C, std::uint64_t seed) {
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
                  Tensor({C}, DType::f64),       Tensor({C, W}, DType::f64),    Tensor({C}, DType::f64)};
  // Every value read as float64 (what get() gives), the same sums in the same order.
  const Tensor xv = host_values(x, DType::f64), wv = host_values(w, DType::f64), iv = host_values(ids, DType::i64);
  const Tensor bv = bias.defined() ? host_values(bias, DType::f64) : Tensor();
  const Tensor gv = gy.defined() ? host_values(gy, DType::f64) : Tensor();
  const double *X = xv.data<double>(), *Wt = wv.data<double>(), *Bs = bias.defined() ? bv.data<double>() : nullptr,
               *G = gy.defined() ? gv.data<double>() : nullptr;
  const std::int64_t* I = iv.data<std::int64_t>();
  double *Y = r.y.data<double>(), *DX = r.dx.data<double>(), *DW = r.dw.data<double>(),
         *DB = r.dbias.data<double>(), *DWT = r.dw_terms.data<double>(), *DBT = r.dbias_terms.data<double>();
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t seg = 0;  // start of t's segment, carried along the row (linear in P)
    for (std::int64_t t = 0; t < P; ++t) {
      if (t > 0 && I[b * P + t] != I[b * P + t - 1]) seg = t;
      for (std::int64_t c = 0; c < C; ++c) {
        double acc = Bs ? Bs[c] : 0.0;
        const double g = G ? G[(b * P + t) * C + c] : 0.0;
        if (Bs) {
          DB[c] += g;
          DBT[c] += std::abs(g);
        }
        for (std::int64_t j = 0; j < W; ++j) {
          const std::int64_t p = t - (W - 1) + j;
          if (p < seg) continue;
          const double xp = X[(b * P + p) * C + c], wj = Wt[c * W + j];
          acc += wj * xp;
          DX[(b * P + p) * C + c] += wj * g;
          DW[c * W + j] += xp * g;
          DWT[c * W + j] += std::abs(xp * g);
        }
        Y[(b * P + t) * C + c] = acc;
      }
    }
  }
  return r;
}

}  // namespace cpsim::verify

namespace cpsim::verify {

RecurrenceInputs random_recurrence_inputs(std::int64_t B, std::int64_t P, std::int64_t H, std::int64_t K,
                                          std::int64_t V, std::uint64_t seed, bool live_gates) {
  RecurrenceInputs in{random_tensor({B, P, H, K}, DType::f64, mix_seed(seed, 1)),
                      random_tensor({B, P, H, K}, DType::f64, mix_seed(seed, 2)),
                      random_tensor({B, P, H, V}, DType::f64, mix_seed(seed, 3)),
                      random_tensor({B, P, H}, DType::f64, mix_seed(seed, 4)),
                      random_tensor({B, P, H, K}, DType::f64, mix_seed(seed, 5))};
  // Keys normalised (as KDA does), beta in (0, 1), log-decay g in [-1, 0] (live:
  // times the head's factor).
  static constexpr double kLiveFactors[] = {1.0, 0.01, 0.1, 0.0};
  const std::int64_t rotation = live_gates ? SplitMix64(mix_seed(seed, 6)).below(4) : 0;
  for (std::int64_t i = 0; i < B * P * H; ++i) {
    const double factor = live_gates ? kLiveFactors[(i % H + rotation) % 4] : 1.0;
    double n = 0;
    for (std::int64_t a = 0; a < K; ++a) n += in.k.get(i * K + a) * in.k.get(i * K + a);
    n = std::sqrt(n) + 1e-6;
    for (std::int64_t a = 0; a < K; ++a) in.k.set(i * K + a, in.k.get(i * K + a) / n);
    in.beta.set(i, 0.05 + 0.45 * (in.beta.get(i) + 1.0));
    for (std::int64_t a = 0; a < K; ++a) in.g.set(i * K + a, -0.5 * factor * (in.g.get(i * K + a) + 1.0));
  }
  return in;
}

RecurrenceReference reference_recurrence(const RecurrenceInputs& in, const Tensor& ids, const Tensor& d_o_in) {
  const std::int64_t B = in.q.dim(0), P = in.q.dim(1), H = in.q.dim(2), K = in.q.dim(3), V = in.v.dim(3);
  RecurrenceReference r{Tensor({B, P, H, V}, DType::f64), Tensor(in.q.shape(), DType::f64),
                        Tensor(in.k.shape(), DType::f64), Tensor(in.v.shape(), DType::f64),
                        Tensor(in.beta.shape(), DType::f64), Tensor(in.g.shape(), DType::f64)};
  const auto f64 = [](const Tensor& t) { return host_values(t, DType::f64); };
  const Tensor q = f64(in.q), k = f64(in.k), v = f64(in.v), beta_t = f64(in.beta), g = f64(in.g), d_o = f64(d_o_in);
  const double *qp = q.data<double>(), *kp = k.data<double>(), *vp = v.data<double>(), *bp = beta_t.data<double>(),
               *gp = g.data<double>(), *gop = d_o.defined() ? d_o.data<double>() : nullptr;
  double *O = r.o.data<double>(), *DQ = r.dq.data<double>(), *DK = r.dk.data<double>(), *DV = r.dv.data<double>(),
         *DB = r.dbeta.data<double>(), *DG = r.dg.data<double>();
  auto Q = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t a) { return qp[((b * P + t) * H + h) * K + a]; };
  auto Kk = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t a) { return kp[((b * P + t) * H + h) * K + a]; };
  auto Vv = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t a) { return vp[((b * P + t) * H + h) * V + a]; };
  auto Bt = [&](std::int64_t b, std::int64_t t, std::int64_t h) { return bp[(b * P + t) * H + h]; };
  auto Gg = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t a) { return gp[((b * P + t) * H + h) * K + a]; };
  const std::vector<double> zero(K * V, 0.0);
  std::vector<double> S((P + 1) * K * V), A(K * V), u(V), e(V), dS(K * V), dprev(K * V), decay(K);
  std::vector<bool> starts(P, false);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      // Forward, keeping S_t for every t (S_{t+1}, at S + (t+1)KV, is the state after token t).
      std::fill(S.begin(), S.begin() + K * V, 0.0);
      for (std::int64_t t = 0; t < P; ++t) {
        starts[t] = t == 0 || ids.get_int(b * P + t) != ids.get_int(b * P + t - 1);
        const double* prev = starts[t] ? zero.data() : S.data() + t * K * V;
        double* next = S.data() + (t + 1) * K * V;
        std::fill(u.begin(), u.end(), 0.0);
        for (std::int64_t i = 0; i < K; ++i) {
          const double decay_i = std::exp(Gg(b, t, h, i));
          for (std::int64_t j = 0; j < V; ++j) A[i * V + j] = decay_i * prev[i * V + j];
        }
        for (std::int64_t j = 0; j < V; ++j)
          for (std::int64_t i = 0; i < K; ++i) u[j] += Kk(b, t, h, i) * A[i * V + j];
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < V; ++j)
            next[i * V + j] = A[i * V + j] + Bt(b, t, h) * Kk(b, t, h, i) * (Vv(b, t, h, j) - u[j]);
        for (std::int64_t j = 0; j < V; ++j) {
          double o = 0;
          for (std::int64_t i = 0; i < K; ++i) o += next[i * V + j] * Q(b, t, h, i);
          O[((b * P + t) * H + h) * V + j] = o;
        }
      }
      if (!gop) continue;
      // Backward, token by token from the end; dS is the gradient of S_t.
      std::fill(dS.begin(), dS.end(), 0.0);
      for (std::int64_t t = P - 1; t >= 0; --t) {
        const double* prev = starts[t] ? zero.data() : S.data() + t * K * V;
        const double* next = S.data() + (t + 1) * K * V;
        const double beta = Bt(b, t, h);
        std::fill(u.begin(), u.end(), 0.0);
        std::fill(e.begin(), e.end(), 0.0);
        for (std::int64_t i = 0; i < K; ++i) {
          decay[i] = std::exp(Gg(b, t, h, i));
          for (std::int64_t j = 0; j < V; ++j) A[i * V + j] = decay[i] * prev[i * V + j];
        }
        for (std::int64_t j = 0; j < V; ++j)
          for (std::int64_t i = 0; i < K; ++i) u[j] += Kk(b, t, h, i) * A[i * V + j];
        for (std::int64_t i = 0; i < K; ++i) {
          double dq = 0;
          for (std::int64_t j = 0; j < V; ++j) {
            const double g_o = gop[((b * P + t) * H + h) * V + j];
            dq += next[i * V + j] * g_o;
            dS[i * V + j] += Q(b, t, h, i) * g_o;
          }
          DQ[((b * P + t) * H + h) * K + i] = dq;
        }
        for (std::int64_t j = 0; j < V; ++j)
          for (std::int64_t i = 0; i < K; ++i) e[j] += Kk(b, t, h, i) * dS[i * V + j];
        double dbeta = 0;
        for (std::int64_t j = 0; j < V; ++j) {
          dbeta += e[j] * (Vv(b, t, h, j) - u[j]);
          DV[((b * P + t) * H + h) * V + j] = beta * e[j];
        }
        DB[(b * P + t) * H + h] = dbeta;
        for (std::int64_t i = 0; i < K; ++i) {
          double dk = 0, dg = 0;
          for (std::int64_t j = 0; j < V; ++j) {
            const double du = -beta * e[j];
            dk += beta * dS[i * V + j] * (Vv(b, t, h, j) - u[j]) + A[i * V + j] * du;
            const double dA = dS[i * V + j] + Kk(b, t, h, i) * du;
            dg += dA * A[i * V + j];
            dprev[i * V + j] = starts[t] ? 0.0 : decay[i] * dA;
          }
          DK[((b * P + t) * H + h) * K + i] = dk;
          DG[((b * P + t) * H + h) * K + i] = dg;
        }
        dS.swap(dprev);
      }
    }
  return r;
}

RecurrenceStates reference_recurrence_states(const RecurrenceInputs& in, const Tensor& ids, std::int64_t start,
                                             std::int64_t L) {
  const std::int64_t B = in.q.dim(0), P = in.q.dim(1), H = in.q.dim(2), K = in.q.dim(3), V = in.v.dim(3);
  RecurrenceStates r{Tensor::full({B, H, K, V}, DType::f64, 0.0), Tensor::full({B, H, K, V}, DType::f64, 0.0),
                     Tensor::full({B, H, K, K}, DType::f64, 0.0), Tensor::full({B, H, K, V}, DType::f64, 0.0)};
  const auto starts = [&](std::int64_t b, std::int64_t t) {
    return t == 0 || ids.get_int(b * P + t) != ids.get_int(b * P + t - 1);
  };
  if (L == 0) return r;  // an empty interval: no tokens, nothing received or published (all zero)
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      // One token: X <- (I - beta k k^T) Diag(exp g) X (+ beta k v^T when `add_kv`), X [K, cols].
      const auto step = [&](std::int64_t t, std::vector<double>& X, std::int64_t cols, bool add_kv) {
        const std::int64_t at = (b * P + t) * H + h;
        const double beta = in.beta.get(at);
        std::vector<double> D(K * cols), u(cols, 0.0);
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < cols; ++j) D[i * cols + j] = std::exp(in.g.get(at * K + i)) * X[i * cols + j];
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < cols; ++j) u[j] += in.k.get(at * K + i) * D[i * cols + j];
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < cols; ++j)
            X[i * cols + j] = D[i * cols + j] + beta * in.k.get(at * K + i) * ((add_kv ? in.v.get(at * V + j) : 0.0) - u[j]);
      };
      const auto put = [&](Tensor& t, const std::vector<double>& X) {
        for (std::size_t i = 0; i < X.size(); ++i) t.set(static_cast<std::int64_t>((b * H + h) * X.size() + i), X[i]);
      };
      std::vector<double> S(K * V, 0.0);
      for (std::int64_t t = 0; t < start + L; ++t) {
        if (starts(b, t)) std::fill(S.begin(), S.end(), 0.0);
        if (t == start) put(r.initial, S);
        step(t, S, V, true);
      }
      put(r.final_state, S);
      std::int64_t first = start;  // the last local segment's first local token
      for (std::int64_t t = start; t < start + L; ++t)
        if (starts(b, t)) first = t;
      std::vector<double> M(K * K, 0.0), ext(K * V, 0.0);
      for (std::int64_t i = 0; i < K; ++i) M[i * K + i] = 1;
      for (std::int64_t t = first; t < start + L; ++t) step(t, M, K, false), step(t, ext, V, true);
      put(r.m, M);
      put(r.s_ext, ext);
    }
  return r;
}

namespace {

// Plain rank-order sum of upstream slices in the element type: the reference reduce-scatter.
template <class T>
Tensor gather_backward_as(const std::vector<Tensor>& upstream, const std::vector<bool>& contributes,
                             const ReferenceGeometry& g, int rank) {
  const Tensor& u0 = upstream[0];
  Shape shape = u0.shape();
  const std::int64_t L = g.size(rank);
  shape[1] = L;
  Tensor out(shape, u0.dtype());
  const std::int64_t B = shape[0], inner = u0.numel() / (B * g.padded_len);
  bool first = true;
  for (std::size_t q = 0; q < upstream.size(); ++q) {
    if (!contributes[q]) continue;
    const T* u = upstream[q].data<T>();
    T* o = out.data<T>();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < L; ++s)
        for (std::int64_t k = 0; k < inner; ++k) {
          const T v = u[(b * g.padded_len + g.start(rank) + s) * inner + k];
          T& dst = o[(b * L + s) * inner + k];
          dst = first ? v : static_cast<T>(dst + v);
        }
    first = false;
  }
  return out;
}

}  // namespace

Tensor reference_gather_backward(DType dt, const std::vector<Tensor>& upstream, const std::vector<bool>& contributes,
                      const ReferenceGeometry& g, int rank) {
  return dt == DType::f64 ? gather_backward_as<double>(upstream, contributes, g, rank)
                          : gather_backward_as<float>(upstream, contributes, g, rank);
}


}  // namespace cpsim::verify
