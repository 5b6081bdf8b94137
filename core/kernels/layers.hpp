// The layers that consume the layout (SPEC §3b), in the one kernel source: rotary
// embedding by position, document-masked causal attention over gathered keys
// (dense, or over the keys a top-k indexer keeps) and the token cross entropy.
// Written plainly (one thread per output, loops in index order, so results do not
// depend on the device's scheduling). The host runs attention and top-k in tiles
// (core/kernels/attention_host.hpp), bitwise these functors.
//   rope            one thread per (b, t, h, pair)
//   attention       forward: one thread per (b, t, h) query, one pass over its
//                   keys (the online softmax); backward: dO.o once per query,
//                   dq per query, dk and dv per (b, j, h) key, summing over the
//                   queries that see anything (a skip list) in order. A query
//                   finds its first key from the run starts of the key ids; the
//                   sparse form visits only its kept keys
//   top-k           one thread per query: a running list of its topk best keys
//                   (higher score, or equal and earlier), then in position order
// A query's keys are its document's run of positions up to it: work grows with
// the documents' lengths, not the row's.
//   cross entropy   one thread per token, then one that adds them in token order
#pragma once

#include <cmath>
#include <vector>

#include "core/kernels/conv.hpp"
#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

// Where pair m's position lies in a Rope's pos: its plane's offset (0 but for mRoPE).
CPSIM_HD inline index_t rope_plane_offset(const Rope& a, index_t m) {
  if (a.planes == 1) return 0;
  const index_t plane = m < a.section_t ? 0 : m < a.section_t + a.section_h ? 1 : 2;
  return plane * a.rows * a.len;
}

template <class T>
struct RopeRotate {
  Rope a;
  CPSIM_HD void operator()(index_t i) const {  // i over (b, t, h, m) with m < D/2
    const index_t D = a.dim, half = D / 2, m = i % half, bth = i / half, bt = bth / a.heads;
    const double angle =
        a.sign * static_cast<double>(a.pos[rope_plane_offset(a, m) + bt]) * pow(a.base, -2.0 * static_cast<double>(m) / D);
    const double c = cos(angle), s = sin(angle);
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const T p = x[bth * D + 2 * m], q = x[bth * D + 2 * m + 1];
    y[bth * D + 2 * m] = static_cast<T>(p * c - q * s);
    y[bth * D + 2 * m + 1] = static_cast<T>(p * s + q * c);
  }
};

template <class Policy>
void rope(Policy&& policy, const Rope& a, DType dtype) {
  for_each_float<RopeRotate>(policy, dtype, a.rows * a.len * a.heads * (a.dim / 2), a);
}

// The host's rope: each token's angles once (pow per pair index, sin and cos per
// pair), applied to all its heads; the same expressions as RopeRotate, so the
// results are bitwise its.
inline void rope_host(const Rope& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const index_t H = a.heads, D = a.dim, half = D / 2;
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    std::vector<double> freq(static_cast<std::size_t>(half)), c(freq.size()), s(freq.size());
    std::vector<index_t> plane(freq.size());
    for (index_t m = 0; m < half; ++m) {
      freq[m] = pow(a.base, -2.0 * static_cast<double>(m) / D);
      plane[m] = rope_plane_offset(a, m);
    }
    for (index_t bt = 0; bt < a.rows * a.len; ++bt) {
      for (index_t m = 0; m < half; ++m) {
        const double angle = a.sign * static_cast<double>(a.pos[plane[m] + bt]) * freq[m];
        c[m] = cos(angle), s[m] = sin(angle);
      }
      for (index_t h = 0; h < H; ++h) {
        const T* in = x + (bt * H + h) * D;
        T* out = y + (bt * H + h) * D;
        for (index_t m = 0; m < half; ++m) {
          const T p = in[2 * m], q = in[2 * m + 1];
          out[2 * m] = static_cast<T>(p * c[m] - q * s[m]);
          out[2 * m + 1] = static_cast<T>(p * s[m] + q * c[m]);
        }
      }
    }
  });
}

// The keys of a document lie in one run of positions: the first position a
// query at global position `at` with doc id `doc` can see (scanning back over its
// document and not-real tokens, 0, up to another document's real token).
CPSIM_HD inline index_t first_key(const std::int64_t* ids, index_t at, std::int64_t doc) {
  index_t j = at;
  while (j > 0 && (ids[j - 1] == doc || ids[j - 1] == 0)) --j;
  return j;
}

// The first key a query at `at` of document `doc` sees: the run start precomputed
// for the key at `at` when that key is of the query's document (`first`, may be
// null), else by scanning back.
CPSIM_HD inline index_t first_key_of(const std::int64_t* ids, const std::int64_t* first, index_t at,
                                     std::int64_t doc) {
  return first && at >= 0 && ids[at] == doc ? first[at] : first_key(ids, at, doc);
}

// Whether query t of row b sees key j (and, with a kept list, kept it).
CPSIM_HD inline bool attention_sees(const Attention& a, index_t b, index_t t, index_t j) {
  const std::int64_t doc = a.q_ids[b * a.q_len + t];
  if (doc == 0 || j > a.q_start + t || a.k_ids[b * a.k_len + j] != doc) return false;
  if (!a.kept) return true;
  const std::int64_t* kept = a.kept + (b * a.q_len + t) * a.topk;
  for (index_t n = 0; n < a.topk && kept[n] >= 0; ++n)
    if (kept[n] == j) return true;
  return false;
}

// The first query at or after t whose id is not 0 (Attention::next_query).
CPSIM_HD inline index_t next_at(const std::int64_t* next, index_t q_len, index_t t) {
  return t < q_len ? next[t] : q_len;
}

// The keys query t of row b may see, in ascending order: its document's run of
// positions [lo, hi], or, with a kept list, the kept keys in that run. key(i) for
// i < count is a candidate; sees(j) says whether it is one of the query's.
struct QueryKeys {
  const std::int64_t* ids = nullptr;   // the row's key ids
  const std::int64_t* kept = nullptr;  // the query's kept list, or null
  std::int64_t doc = 0;
  index_t lo = 0, hi = -1, count = 0;
  CPSIM_HD index_t key(index_t i) const { return kept ? kept[i] : lo + i; }
  CPSIM_HD bool sees(index_t j) const { return j >= lo && j <= hi && ids[j] == doc; }
};
CPSIM_HD inline QueryKeys query_keys(const Attention& a, index_t b, index_t t) {
  QueryKeys k;
  k.doc = a.q_ids[b * a.q_len + t];
  k.ids = a.k_ids + b * a.k_len;
  if (k.doc == 0 || a.k_len == 0) return k;
  k.hi = a.q_start + t < a.k_len ? a.q_start + t : a.k_len - 1;
  k.lo = first_key_of(k.ids, a.k_first ? a.k_first + b * a.k_len : nullptr, k.hi, k.doc);
  if (a.kept) {
    k.kept = a.kept + (b * a.q_len + t) * a.topk;
    while (k.count < a.topk && k.kept[k.count] >= 0) ++k.count;
  } else {
    k.count = k.hi - k.lo + 1;
  }
  return k;
}

// An index over (b, position, h) of a [B][len][heads] layout, split.
struct HeadIndex {
  index_t b, position, h;
};
CPSIM_HD inline HeadIndex head_index(index_t i, index_t heads, index_t len) {
  const index_t bp = i / heads;
  return {bp / len, bp % len, i % heads};
}

template <class T>
struct AttentionForward {
  Attention a;
  CPSIM_HD T score(index_t b, index_t t, index_t h, index_t j) const {
    const T* q = static_cast<const T*>(a.q) + ((b * a.q_len + t) * a.heads + h) * a.dim;
    const T* k = static_cast<const T*>(a.k) + ((b * a.k_len + j) * a.heads + h) * a.dim;
    T acc = T(0);
    for (index_t d = 0; d < a.dim; ++d) acc += q[d] * k[d];
    return static_cast<T>(a.scale) * acc;
  }
  // One pass over the keys with a running maximum (the online softmax): the
  // output and the normaliser are rescaled when a larger score arrives.
  CPSIM_HD void operator()(index_t i) const {  // i over (b, t, h)
    const auto [b, t, h] = head_index(i, a.heads, a.q_len);
    T* o = static_cast<T*>(a.o) + i * a.v_dim;
    for (index_t d = 0; d < a.v_dim; ++d) o[d] = T(0);
    const QueryKeys keys = query_keys(a, b, t);
    T m = T(0), z = T(0);
    bool any = false;
    for (index_t n = 0; n < keys.count; ++n) {
      const index_t j = keys.key(n);
      if (!keys.sees(j)) continue;
      const T s = score(b, t, h, j);
      const T* v = static_cast<const T*>(a.v) + ((b * a.k_len + j) * a.heads + h) * a.v_dim;
      if (!any || s > m) {
        const T c = any ? exp(m - s) : T(0);  // what the sums so far weigh at the new maximum
        z = z * c + T(1);
        for (index_t d = 0; d < a.v_dim; ++d) o[d] = o[d] * c + v[d];
        m = s;
        any = true;
      } else {
        const T p = exp(s - m);
        z += p;
        for (index_t d = 0; d < a.v_dim; ++d) o[d] += p * v[d];
      }
    }
    if (!any) {
      static_cast<T*>(a.lse)[i] = T(0);
      return;
    }
    for (index_t d = 0; d < a.v_dim; ++d) o[d] /= z;
    static_cast<T*>(a.lse)[i] = m + log(z);
  }
};

// p_ij and ds_ij = p_ij (dO_i . v_j - dO_i . o_i) of one visible (query, key)
// pair (dO_i . o_i from the delta scratch).
template <class T>
CPSIM_HD inline void attention_pair(const Attention& a, index_t b, index_t t, index_t h, index_t j, T& p, T& ds) {
  const AttentionForward<T> f{a};
  const index_t qi = (b * a.q_len + t) * a.heads + h, kj = (b * a.k_len + j) * a.heads + h;
  p = exp(f.score(b, t, h, j) - static_cast<const T*>(a.lse)[qi]);
  const T* g = static_cast<const T*>(a.d_o) + qi * a.v_dim;
  const T* v = static_cast<const T*>(a.v) + kj * a.v_dim;
  T dp = T(0);
  for (index_t d = 0; d < a.v_dim; ++d) dp += g[d] * v[d];
  ds = p * (dp - static_cast<const T*>(a.delta)[qi]);
}

// dO_i . o_i of each query (b, t, h): the delta scratch.
template <class T>
struct AttentionDelta {
  Attention a;
  CPSIM_HD void operator()(index_t i) const {
    const T* g = static_cast<const T*>(a.d_o) + i * a.v_dim;
    const T* o = static_cast<const T*>(a.o) + i * a.v_dim;
    T delta = T(0);
    for (index_t d = 0; d < a.v_dim; ++d) delta += g[d] * o[d];
    static_cast<T*>(a.delta)[i] = delta;
  }
};

template <class T>
struct AttentionQueryGrad {
  Attention a;
  CPSIM_HD void operator()(index_t i) const {  // i over (b, t, h)
    T* dq = static_cast<T*>(a.dq) + i * a.dim;
    for (index_t d = 0; d < a.dim; ++d) dq[d] = T(0);
    const auto [b, t, h] = head_index(i, a.heads, a.q_len);
    const QueryKeys keys = query_keys(a, b, t);
    for (index_t n = 0; n < keys.count; ++n) {
      const index_t j = keys.key(n);
      if (!keys.sees(j)) continue;
      T p, ds;
      attention_pair<T>(a, b, t, h, j, p, ds);
      const T* k = static_cast<const T*>(a.k) + ((b * a.k_len + j) * a.heads + h) * a.dim;
      for (index_t d = 0; d < a.dim; ++d) dq[d] += static_cast<T>(a.scale) * ds * k[d];
    }
  }
};

template <class T>
struct AttentionKeyGrad {
  Attention a;
  CPSIM_HD void operator()(index_t i) const {  // i over (b, j, h)
    const auto [b, j, h] = head_index(i, a.heads, a.k_len);
    T* dk = static_cast<T*>(a.dk) + i * a.dim;
    T* dv = static_cast<T*>(a.dv) + i * a.v_dim;
    const std::int64_t doc = a.k_ids[b * a.k_len + j];
    if (doc == 0) return;
    // The local queries of its document run at or after j, in order. dk and dv
    // arrive zeroed and each query that sees the key adds to them: a key no local
    // query sees is never written, so the gathered-length gradients of a rank cost
    // (and make resident) only the keys its queries see. Queries with id 0 (not
    // real, or not evaluated) are skipped through next_query, so the cost is that
    // of the (query, key) pairs, however sparse the evaluated queries are.
    const std::int64_t* next = a.next_query + b * a.q_len;
    for (index_t t = next_at(next, a.q_len, j > a.q_start ? j - a.q_start : 0); t < a.q_len;
         t = next_at(next, a.q_len, t + 1)) {
      const std::int64_t id = a.q_ids[b * a.q_len + t];
      if (id != doc) break;
      if (!attention_sees(a, b, t, j)) continue;
      T p, ds;
      attention_pair<T>(a, b, t, h, j, p, ds);
      const index_t qi = (b * a.q_len + t) * a.heads + h;
      const T* q = static_cast<const T*>(a.q) + qi * a.dim;
      const T* g = static_cast<const T*>(a.d_o) + qi * a.v_dim;
      for (index_t d = 0; d < a.dim; ++d) dk[d] += static_cast<T>(a.scale) * ds * q[d];
      for (index_t d = 0; d < a.v_dim; ++d) dv[d] += p * g[d];
    }
  }
};

template <class Policy>
void attention_forward(Policy&& policy, const Attention& a, DType dtype) {
  for_each_float<AttentionForward>(policy, dtype, a.rows * a.q_len * a.heads, a);
}

template <class Policy>
void attention_backward(Policy&& policy, const Attention& a, DType dtype) {
  for_each_float<AttentionDelta>(policy, dtype, a.rows * a.q_len * a.heads, a);
  for_each_float<AttentionQueryGrad>(policy, dtype, a.rows * a.q_len * a.heads, a);
  for_each_float<AttentionKeyGrad>(policy, dtype, a.rows * a.k_len * a.heads, a);
}

// Top-k query i's kept list set to none (-1s); true when it has candidates: its
// document's keys in [lo, hi] (ids: the row's key ids).
CPSIM_HD inline bool topk_candidates(const TopK& a, index_t i, const std::int64_t*& ids, index_t& lo, index_t& hi) {
  std::int64_t* kept = a.kept + i * a.topk;
  for (index_t n = 0; n < a.topk; ++n) kept[n] = -1;
  const index_t t = i % a.q_len, b = i / a.q_len;
  const std::int64_t doc = a.q_ids[i];
  if (doc == 0 || a.topk == 0) return false;
  ids = a.k_ids + b * a.k_len;
  hi = a.q_start + t < a.k_len ? a.q_start + t : a.k_len - 1;
  lo = first_key_of(ids, a.k_first ? a.k_first + b * a.k_len : nullptr, hi, doc);
  return true;
}

// kept[0, n) in position order.
CPSIM_HD inline void kept_in_position_order(std::int64_t* kept, index_t n) {
  for (index_t x = 1; x < n; ++x)
    for (index_t y = x; y > 0 && kept[y - 1] > kept[y]; --y) {
      const std::int64_t tmp = kept[y];
      kept[y] = kept[y - 1];
      kept[y - 1] = tmp;
    }
}

// kLocalScores: how many kept scores a thread holds (a GPU thread's registers; the
// host holds more).
template <class T, index_t kLocalScores = 32>
struct TopKKeep {
  TopK a;
  CPSIM_HD T score(index_t b, index_t t, index_t j) const {
    const T* q = static_cast<const T*>(a.q) + (b * a.q_len + t) * a.dim;
    const T* k = static_cast<const T*>(a.k) + (b * a.k_len + j) * a.dim;
    T acc = T(0);
    for (index_t d = 0; d < a.dim; ++d) acc += q[d] * k[d];
    return acc;
  }
  CPSIM_HD void operator()(index_t i) const {  // i over (b, t): one query
    const std::int64_t* ids = nullptr;
    index_t lo = 0, hi = -1;
    if (!topk_candidates(a, i, ids, lo, hi)) return;
    const index_t t = i % a.q_len, b = i / a.q_len;
    const std::int64_t doc = a.q_ids[i];
    std::int64_t* kept = a.kept + i * a.topk;
    // kept[0, n) holds the best keys so far, best first (higher score; on equal
    // scores the earlier key, which came first). A key enters before the first
    // kept key it beats. Up to kLocalScores kept keys, their scores are kept in
    // the thread; beyond, a kept key is scored again at each comparison.
    T best[kLocalScores];
    const bool local = a.topk <= kLocalScores;
    index_t n = 0;
    for (index_t j = lo; j <= hi; ++j) {
      if (ids[j] != doc) continue;
      const T s = score(b, t, j);
      index_t at = 0;
      while (at < n && !((local ? best[at] : score(b, t, kept[at])) < s)) ++at;
      if (at >= a.topk) continue;
      for (index_t m = (n < a.topk ? n : a.topk - 1); m > at; --m) {
        kept[m] = kept[m - 1];
        if (local) best[m] = best[m - 1];
      }
      kept[at] = j;
      if (local) best[at] = s;
      if (n < a.topk) ++n;
    }
    kept_in_position_order(kept, n);
  }
};

template <class Policy>
void topk_select(Policy&& policy, const TopK& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_index(policy, a.rows * a.q_len, TopKKeep<T>{a});
  });
}

template <class T>
struct TokenCrossEntropy {
  CrossEntropy a;
  CPSIM_HD void operator()(index_t i) const {  // i over tokens
    const T* x = static_cast<const T*>(a.logits) + i * a.vocab;
    const std::int64_t target = a.targets[i];
    T m = x[0];
    for (index_t v = 1; v < a.vocab; ++v) m = x[v] > m ? x[v] : m;
    T z = T(0);
    for (index_t v = 0; v < a.vocab; ++v) z += exp(x[v] - m);
    const T lse = m + log(z);
    if (a.token_loss) static_cast<T*>(a.token_loss)[i] = target >= 0 ? lse - x[target] : T(0);
    if (a.grad) {
      T* g = static_cast<T*>(a.grad) + i * a.vocab;
      for (index_t v = 0; v < a.vocab; ++v)
        g[v] = target >= 0 ? static_cast<T>(a.grad_scale) * (exp(x[v] - lse) - (v == target ? T(1) : T(0))) : T(0);
    }
  }
};

template <class T>
struct TokenSums {
  CrossEntropy a;
  CPSIM_HD void operator()(index_t) const {  // one thread: token order
    double sum = 0, count = 0;
    for (index_t i = 0; i < a.tokens; ++i)
      if (a.targets[i] >= 0) {
        sum += static_cast<double>(static_cast<const T*>(a.token_loss)[i]);
        count += 1;
      }
    a.sums[0] = sum;
    a.sums[1] = count;
  }
};

// Forward: each token's loss, then the sum and count in token order; backward:
// each token's gradient (the same pass, writing the other output).
template <class Policy>
void cross_entropy_pass(Policy&& policy, CrossEntropy a, DType dtype, bool forward) {
  (forward ? a.grad : a.token_loss) = nullptr;
  for_each_float<TokenCrossEntropy>(policy, dtype, a.tokens, a);
  if (forward) for_each_float<TokenSums>(policy, dtype, 1, a);
}
template <class Policy>
void cross_entropy_forward(Policy&& policy, const CrossEntropy& a, DType dtype) {
  cross_entropy_pass(policy, a, dtype, true);
}
template <class Policy>
void cross_entropy_backward(Policy&& policy, const CrossEntropy& a, DType dtype) {
  cross_entropy_pass(policy, a, dtype, false);
}

}  // namespace cpsim::kernels
