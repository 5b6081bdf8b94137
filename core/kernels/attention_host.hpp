// The host's attention and top-k selection: the same sums as the one kernel
// source's functors (core/kernels/layers.hpp), in the same order, so the results
// are bitwise theirs (tests/core/test_kernels.cpp), computed in tiles:
//   dense       the evaluated queries of a row in tiles of up to kAttentionTile
//               consecutive queries of one document (they share their first key);
//               each key is read once per tile, for every head, and its score and
//               value update run across the tile's queries (loops the compiler
//               vectorises). The backward is one pass: each visible (query, key)
//               pair's probability and score gradient are computed once and added
//               to dq, dk and dv (the functors compute them twice: once for dq,
//               once for dk and dv).
//   sparse      forward: the functor itself (scattered reads: tiles share no
//               keys); backward: a query at a time, every head of a key at once,
//               in one pass.
//   top-k       the functor, holding up to 1024 kept scores instead of 32, so
//               each candidate is scored once.
// Order is what makes the bits equal: a query's sums run over its keys in
// ascending order, a key's over its queries in ascending order (tiles ascend, and
// a tile's queries ascend within it), each term written as the functor writes it.
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "core/kernels/layers.hpp"

// GCC notes that a vector of the tile's width passes differently between
// instruction sets; these functions are inline, within one build.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace cpsim::kernels {

constexpr index_t kAttentionTile = 8;

// Up to kAttentionTile evaluated queries of one row and document, ascending; they
// share their first key lo, and query n sees the document's keys in [lo, hi[n]].
struct QueryTile {
  std::int64_t doc = 0;
  index_t lo = 0, count = 0;
  index_t t[kAttentionTile] = {}, hi[kAttentionTile] = {};
};

// Calls f(tile) for the dense queries of row b that see a key, tile by tile in
// ascending order.
template <class F>
void for_each_query_tile(const Attention& a, index_t b, F&& f) {
  const std::int64_t* next = a.next_query + b * a.q_len;
  QueryTile tile;
  for (index_t t = next_at(next, a.q_len, 0); t < a.q_len; t = next_at(next, a.q_len, t + 1)) {
    const QueryKeys keys = query_keys(a, b, t);
    if (keys.count <= 0) continue;
    if (tile.count == kAttentionTile || (tile.count > 0 && (keys.doc != tile.doc || keys.lo != tile.lo))) {
      f(tile);
      tile.count = 0;
    }
    if (tile.count == 0) tile.doc = keys.doc, tile.lo = keys.lo;
    tile.t[tile.count] = t;
    tile.hi[tile.count] = keys.hi;
    ++tile.count;
  }
  if (tile.count > 0) f(tile);
}

// Calls f(t, keys) for each query of row b that may see a key, ascending.
template <class F>
void for_each_query(const Attention& a, index_t b, F&& f) {
  const std::int64_t* next = a.next_query + b * a.q_len;
  for (index_t t = next_at(next, a.q_len, 0); t < a.q_len; t = next_at(next, a.q_len, t + 1)) {
    const QueryKeys keys = query_keys(a, b, t);
    if (keys.count > 0) f(t, keys);
  }
}

// A tile's lanes as one vector (GCC's and Clang's vector extension: each lane's
// + and * are the scalar operations), read and written unaligned.
template <class T>
struct Lanes {
  using type __attribute__((vector_size(kAttentionTile * sizeof(T)))) = T;
};
template <class W, class T>
inline W load_lanes(const T* p) {
  W w;
  std::memcpy(&w, p, sizeof(W));
  return w;
}
template <class W, class T>
inline void store_lanes(T* p, const W& w) {
  std::memcpy(p, &w, sizeof(W));
}

// The online softmax's step for a score s of one (query, head): the functor's two
// branches as o = o * scale_o + scale_v * v (scale_o = 1 or scale_v = 1 keep the
// products exact: o * 1 is o, 1 * v is v).
template <class T>
inline void softmax_step(T s, T& m, T& z, T& any, T& scale_o, T& scale_v) {
  if (any == T(0) || s > m) {
    const T c = any != T(0) ? exp(m - s) : T(0);
    z = z * c + T(1);
    scale_o = c, scale_v = T(1);
    m = s;
    any = T(1);
  } else {
    const T p = exp(s - m);
    z += p;
    scale_o = T(1), scale_v = p;
  }
}

template <class T>
void attention_forward_host_typed(const Attention& a) {
  if (a.kept) {  // sparse: the functor itself (its kept keys are scattered: tiles share none)
    for_each_index(thrust::host, a.rows * a.q_len * a.heads, AttentionForward<T>{a});
    return;
  }
  const index_t H = a.heads, D = a.dim, Dv = a.v_dim, N = kAttentionTile;
  const T *Q = static_cast<const T*>(a.q), *K = static_cast<const T*>(a.k), *V = static_cast<const T*>(a.v);
  T *O = static_cast<T*>(a.o), *LSE = static_cast<T*>(a.lse);
  const T scale = static_cast<T>(a.scale);
  for (index_t i = 0; i < a.rows * a.q_len * H; ++i) {
    for (index_t d = 0; d < Dv; ++d) O[i * Dv + d] = T(0);
    LSE[i] = T(0);
  }
  // Tile state, [head][element][query of the tile]: the queries' vectors, their
  // outputs, and per (head, query) the running maximum, normaliser and weights.
  std::vector<T> qt(H * D * N), ot(H * Dv * N), m(H * N), z(H * N), any(H * N), so(H * N), sv(H * N);
  for (index_t b = 0; b < a.rows; ++b) {
    const std::int64_t* ids = a.k_ids + b * a.k_len;
    for_each_query_tile(a, b, [&](const QueryTile& tile) {
      const index_t count = tile.count;
      for (index_t n = 0; n < count; ++n)
        for (index_t e = 0; e < H * D; ++e) qt[e * N + n] = Q[(b * a.q_len + tile.t[n]) * H * D + e];
      for (index_t e = 0; e < H * Dv * N; ++e) ot[e] = T(0);
      for (index_t e = 0; e < H * N; ++e) m[e] = z[e] = any[e] = T(0);
      // One key for the tile's queries [from, to); a full tile's in vectors of
      // the tile's width (each lane the same operations as the functor's).
      auto key = [&](index_t j, index_t from, index_t to) {
        const T* k = K + (b * a.k_len + j) * H * D;
        const T* v = V + (b * a.k_len + j) * H * Dv;
        for (index_t h = 0; h < H; ++h) {
          T s[N];
          for (index_t n = from; n < to; ++n) s[n] = T(0);
          for (index_t d = 0; d < D; ++d) {
            const T kd = k[h * D + d];
            const T* qd = qt.data() + (h * D + d) * N;
            for (index_t n = from; n < to; ++n) s[n] += qd[n] * kd;
          }
          for (index_t n = from; n < to; ++n)
            softmax_step(scale * s[n], m[h * N + n], z[h * N + n], any[h * N + n], so[h * N + n], sv[h * N + n]);
          for (index_t d = 0; d < Dv; ++d) {
            const T vd = v[h * Dv + d];
            T* od = ot.data() + (h * Dv + d) * N;
            const T *a_o = so.data() + h * N, *a_v = sv.data() + h * N;
            for (index_t n = from; n < to; ++n) od[n] = od[n] * a_o[n] + a_v[n] * vd;
          }
        }
      };
      auto full_key = [&](index_t j) {
        using W = typename Lanes<T>::type;
        const T* k = K + (b * a.k_len + j) * H * D;
        const T* v = V + (b * a.k_len + j) * H * Dv;
        for (index_t h = 0; h < H; ++h) {
          W s = {};
          for (index_t d = 0; d < D; ++d) s += load_lanes<W>(qt.data() + (h * D + d) * N) * k[h * D + d];
          for (index_t n = 0; n < N; ++n)
            softmax_step(scale * s[n], m[h * N + n], z[h * N + n], any[h * N + n], so[h * N + n], sv[h * N + n]);
          const W a_o = load_lanes<W>(so.data() + h * N), a_v = load_lanes<W>(sv.data() + h * N);
          for (index_t d = 0; d < Dv; ++d) {
            T* od = ot.data() + (h * Dv + d) * N;
            store_lanes(od, load_lanes<W>(od) * a_o + a_v * v[h * Dv + d]);
          }
        }
      };
      index_t from = 0;  // the tile's first query that still sees key j (hi ascends)
      for (index_t j = tile.lo; j <= tile.hi[count - 1]; ++j) {
        while (tile.hi[from] < j) ++from;
        if (ids[j] != tile.doc) continue;
        if (from == 0 && count == N) full_key(j);
        else key(j, from, count);
      }
      for (index_t n = 0; n < count; ++n)
        for (index_t h = 0; h < H; ++h) {
          if (any[h * N + n] == T(0)) continue;  // saw nothing: 0, as written above
          const index_t qi = (b * a.q_len + tile.t[n]) * H + h;
          for (index_t d = 0; d < Dv; ++d) O[qi * Dv + d] = ot[(h * Dv + d) * N + n] / z[h * N + n];
          LSE[qi] = m[h * N + n] + log(z[h * N + n]);
        }
    });
  }
}

template <class T>
void attention_backward_host_typed(const Attention& a) {
  const index_t H = a.heads, D = a.dim, Dv = a.v_dim, N = kAttentionTile;
  const T *Q = static_cast<const T*>(a.q), *K = static_cast<const T*>(a.k), *V = static_cast<const T*>(a.v);
  const T *G = static_cast<const T*>(a.d_o), *O = static_cast<const T*>(a.o), *LSE = static_cast<const T*>(a.lse);
  T *DQ = static_cast<T*>(a.dq), *DK = static_cast<T*>(a.dk), *DV = static_cast<T*>(a.dv);
  T* DELTA = static_cast<T*>(a.delta);
  const T scale = static_cast<T>(a.scale);
  for (index_t i = 0; i < a.rows * a.q_len * H; ++i) {
    T delta = T(0);
    for (index_t d = 0; d < Dv; ++d) delta += G[i * Dv + d] * O[i * Dv + d];
    DELTA[i] = delta;
    for (index_t d = 0; d < D; ++d) DQ[i * D + d] = T(0);
  }
  std::vector<T> qt(H * D * N), gt(H * Dv * N), dqt(H * D * N), lse(H * N), delta(H * N);
  for (index_t b = 0; b < a.rows; ++b) {
    const std::int64_t* ids = a.k_ids + b * a.k_len;
    if (a.kept) {
      for_each_query(a, b, [&](index_t t, const QueryKeys& keys) {
        const index_t q0 = (b * a.q_len + t) * H;
        const T *q = Q + q0 * D, *g = G + q0 * Dv;
        T* dq = DQ + q0 * D;
        for (index_t i = 0; i < keys.count; ++i) {
          const index_t j = keys.key(i);
          if (!keys.sees(j)) continue;
          const index_t k0 = (b * a.k_len + j) * H;
          const T *k = K + k0 * D, *v = V + k0 * Dv;
          T *dk = DK + k0 * D, *dv = DV + k0 * Dv;
          for (index_t h = 0; h < H; ++h) {
            T sc = T(0), dpv = T(0);
            for (index_t d = 0; d < D; ++d) sc += q[h * D + d] * k[h * D + d];
            const T pp = exp(scale * sc - LSE[q0 + h]);
            for (index_t d = 0; d < Dv; ++d) dpv += g[h * Dv + d] * v[h * Dv + d];
            const T dd = pp * (dpv - DELTA[q0 + h]);
            for (index_t d = 0; d < D; ++d) dq[h * D + d] += scale * dd * k[h * D + d];
            for (index_t d = 0; d < D; ++d) dk[h * D + d] += scale * dd * q[h * D + d];
            for (index_t d = 0; d < Dv; ++d) dv[h * Dv + d] += pp * g[h * Dv + d];
          }
        }
      });
      continue;
    }
    for_each_query_tile(a, b, [&](const QueryTile& tile) {
      const index_t count = tile.count;
      const T* qrow[N];
      const T* grow[N];
      for (index_t n = 0; n < count; ++n) {
        const index_t q0 = (b * a.q_len + tile.t[n]) * H;
        qrow[n] = Q + q0 * D, grow[n] = G + q0 * Dv;
        for (index_t e = 0; e < H * D; ++e) qt[e * N + n] = Q[q0 * D + e];
        for (index_t e = 0; e < H * Dv; ++e) gt[e * N + n] = G[q0 * Dv + e];
        for (index_t h = 0; h < H; ++h) lse[h * N + n] = LSE[q0 + h], delta[h * N + n] = DELTA[q0 + h];
      }
      for (index_t e = 0; e < H * D * N; ++e) dqt[e] = T(0);
      // The key's sums over the tile's queries [from, to), in their order.
      auto key_sums = [&](T* dk, T* dv, index_t h, const T* sds, const T* ph, index_t from, index_t to) {
        for (index_t n = from; n < to; ++n) {
          const T *q = qrow[n] + h * D, *g = grow[n] + h * Dv;
          for (index_t d = 0; d < D; ++d) dk[d] += sds[n] * q[d];
          for (index_t d = 0; d < Dv; ++d) dv[d] += ph[n] * g[d];
        }
      };
      // One key for the tile's queries [from, to).
      auto key = [&](index_t j, index_t from, index_t to) {
        const index_t k0 = (b * a.k_len + j) * H;
        const T *k = K + k0 * D, *v = V + k0 * Dv;
        for (index_t h = 0; h < H; ++h) {
          T s[N], dp[N], ph[N], sds[N];
          for (index_t n = from; n < to; ++n) s[n] = dp[n] = T(0);
          for (index_t d = 0; d < D; ++d) {
            const T kd = k[h * D + d];
            const T* qd = qt.data() + (h * D + d) * N;
            for (index_t n = from; n < to; ++n) s[n] += qd[n] * kd;
          }
          for (index_t d = 0; d < Dv; ++d) {
            const T vd = v[h * Dv + d];
            const T* gd = gt.data() + (h * Dv + d) * N;
            for (index_t n = from; n < to; ++n) dp[n] += gd[n] * vd;
          }
          for (index_t n = from; n < to; ++n) {
            ph[n] = exp(scale * s[n] - lse[h * N + n]);
            sds[n] = scale * (ph[n] * (dp[n] - delta[h * N + n]));
          }
          for (index_t d = 0; d < D; ++d) {
            const T kd = k[h * D + d];
            T* dqd = dqt.data() + (h * D + d) * N;
            for (index_t n = from; n < to; ++n) dqd[n] += sds[n] * kd;
          }
          key_sums(DK + k0 * D + h * D, DV + k0 * Dv + h * Dv, h, sds, ph, from, to);
        }
      };
      // The same for a full tile, in vectors of its width.
      auto full_key = [&](index_t j) {
        using W = typename Lanes<T>::type;
        const index_t k0 = (b * a.k_len + j) * H;
        const T *k = K + k0 * D, *v = V + k0 * Dv;
        for (index_t h = 0; h < H; ++h) {
          W s = {}, dp = {}, ph;
          for (index_t d = 0; d < D; ++d) s += load_lanes<W>(qt.data() + (h * D + d) * N) * k[h * D + d];
          for (index_t d = 0; d < Dv; ++d) dp += load_lanes<W>(gt.data() + (h * Dv + d) * N) * v[h * Dv + d];
          const W x = scale * s - load_lanes<W>(lse.data() + h * N);
          for (index_t n = 0; n < N; ++n) ph[n] = exp(x[n]);
          const W sds = scale * (ph * (dp - load_lanes<W>(delta.data() + h * N)));
          for (index_t d = 0; d < D; ++d) {
            T* dqd = dqt.data() + (h * D + d) * N;
            store_lanes(dqd, load_lanes<W>(dqd) + sds * k[h * D + d]);
          }
          T sds_n[N], ph_n[N];
          store_lanes(sds_n, sds), store_lanes(ph_n, ph);
          key_sums(DK + k0 * D + h * D, DV + k0 * Dv + h * Dv, h, sds_n, ph_n, 0, N);
        }
      };
      index_t from = 0;
      for (index_t j = tile.lo; j <= tile.hi[count - 1]; ++j) {
        while (tile.hi[from] < j) ++from;
        if (ids[j] != tile.doc) continue;
        if (from == 0 && count == N) full_key(j);
        else key(j, from, count);
      }
      for (index_t n = 0; n < count; ++n) {
        T* dq = DQ + (b * a.q_len + tile.t[n]) * H * D;
        for (index_t e = 0; e < H * D; ++e) dq[e] = dqt[e * N + n];
      }
    });
  }
}

inline void attention_forward_host(const Attention& a, DType dtype) {
  with_float(dtype, [&](auto tag) { attention_forward_host_typed<decltype(tag)>(a); });
}

inline void attention_backward_host(const Attention& a, DType dtype) {
  with_float(dtype, [&](auto tag) { attention_backward_host_typed<decltype(tag)>(a); });
}

// Top-k: the functor, holding up to 1024 kept scores (a GPU thread holds 32):
// each candidate is scored once.
inline void topk_select_host(const TopK& a, DType dtype) {
  with_float(dtype, [&](auto tag) { for_each_index(thrust::host, a.rows * a.q_len, TopKKeep<decltype(tag), 1024>{a}); });
}

}  // namespace cpsim::kernels

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
