// Deliberately broken forward passes of the CP gated delta rule, for the
// negative-control tests: each makes one mistake the properties must catch.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/autograd.hpp"
#include "core/shard.hpp"

namespace cpsim::testing {

enum class RecurrenceFault {
  fold_in_wrong_order,        // S <- M_j S + S_ext_j from the nearest predecessor back
  no_reset_inside_shard,      // the state carries across segment starts inside a shard
  first_segment_transition,   // ranks publish (M, S_ext) of their first local segment
};

inline Var broken_recurrence(RecurrenceFault fault, const Var& q, const Var& k, const Var& v, const Var& beta,
                             const Var& g, const PackedContext& ctx, Communicator* comm) {
  const Tensor &Q = q.value(), &Kt = k.value(), &Vt = v.value(), &Bt = beta.value(), &G = g.value();
  const std::int64_t B = Q.dim(0), L = Q.dim(1), H = Q.dim(2), K = Q.dim(3), V = Vt.dim(3);
  const int c = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  using Mat = std::vector<double>;
  auto at = [&](const Tensor& t, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t i, std::int64_t n) {
    return t.data<double>()[((b * L + s) * H + h) * n + i];
  };
  // X (K x n) <- (I - beta k k^T) D X (+ beta k v^T when with_v).
  auto step = [&](Mat& X, std::int64_t n, std::int64_t b, std::int64_t s, std::int64_t h, bool with_v) {
    std::vector<double> u(n, 0.0);
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        X[i * n + j] *= std::exp(at(G, b, s, h, i, K));
        u[j] += at(Kt, b, s, h, i, K) * X[i * n + j];
      }
    const double bt = Bt.data<double>()[(b * L + s) * H + h];
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < n; ++j)
        X[i * n + j] += bt * at(Kt, b, s, h, i, K) * ((with_v ? at(Vt, b, s, h, j, V) : 0.0) - u[j]);
  };
  const std::int64_t KV = K * (K + V);
  Tensor mine({B * H * KV}, DType::f64);
  std::vector<FlaCpContext> fla;
  for (std::int64_t b = 0; b < B; ++b) {
    fla.push_back(build_fla_cp_context(ctx, static_cast<int>(b)));
    const auto& cu = fla[b].cu_seqlens;
    const bool first = fault == RecurrenceFault::first_segment_transition;
    const std::int64_t t0 = first ? 0 : cu[cu.size() - 2], t1 = first ? cu[1] : L;
    for (std::int64_t h = 0; h < H; ++h) {
      Mat M(K * K, 0.0), S(K * V, 0.0);
      for (std::int64_t i = 0; i < K; ++i) M[i * K + i] = 1.0;
      for (std::int64_t s = t0; s < t1; ++s) {
        step(M, K, b, s, h, false);
        step(S, V, b, s, h, true);
      }
      double* dst = mine.data<double>() + (b * H + h) * KV;
      for (std::int64_t i = 0; i < K; ++i) {
        for (std::int64_t m = 0; m < K; ++m) dst[i * (K + V) + m] = M[i * K + m];
        for (std::int64_t j = 0; j < V; ++j) dst[i * (K + V) + K + j] = S[i * V + j];
      }
    }
  }
  Tensor all({c, B * H * KV}, DType::f64);
  if (comm && c > 1) comm->all_gather(mine.raw(), all.raw(), mine.numel(), DType::f64);
  else all = mine.reshape({1, mine.numel()});
  Tensor o({B, L, H, V}, DType::f64);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      Mat S(K * V, 0.0);
      std::vector<int> order;
      for (int j = r - fla[b].pre_num_ranks; j < r; ++j) order.push_back(j);
      if (fault == RecurrenceFault::fold_in_wrong_order) std::reverse(order.begin(), order.end());
      for (int j : order) {
        const double* blk = all.data<double>() + j * B * H * KV + (b * H + h) * KV;
        Mat next(K * V, 0.0);
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t jj = 0; jj < V; ++jj) {
            double acc = blk[i * (K + V) + K + jj];
            for (std::int64_t m = 0; m < K; ++m) acc += blk[i * (K + V) + m] * S[m * V + jj];
            next[i * V + jj] = acc;
          }
        S = next;
      }
      const auto& cu = fla[b].cu_seqlens;
      for (std::size_t seg = 0; seg + 1 < cu.size(); ++seg) {
        if (seg > 0 && fault != RecurrenceFault::no_reset_inside_shard) S.assign(K * V, 0.0);
        for (std::int64_t s = cu[seg]; s < cu[seg + 1]; ++s) {
          step(S, V, b, s, h, true);
          for (std::int64_t j = 0; j < V; ++j) {
            double acc = 0;
            for (std::int64_t i = 0; i < K; ++i) acc += S[i * V + j] * at(Q, b, s, h, i, K);
            o.data<double>()[((b * L + s) * H + h) * V + j] = acc;
          }
        }
      }
    }
  return Var(o);
}

}  // namespace cpsim::testing
