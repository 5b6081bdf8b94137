// The kernels every operator runs, as one table per device kind: the host's is
// built in (core/kernels/host.cpp, Thrust's CPP system), gpu/ registers CUDA's,
// both instantiated from the same functor headers (movement.hpp, ...). Arguments
// are plain structs of pointers and sizes; `stream` is the caller's CUDA stream
// (current_stream()), which the host ignores.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device.hpp"
#include "core/model_shape.hpp"
#include "core/tensor.hpp"

namespace cpsim::kernels {

// Rank blocks [c][B][row] <-> sequence [B][c][row], where a row is one rank's shard
// of one batch row (L positions of every trailing dimension), `row_bytes` long.
struct Rearrange {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t rows = 0, ranks = 0;
  std::size_t row_bytes = 0;
};

// Positions [from, from + n) of a [B, src_len, ...] tensor to positions [to, to + n)
// of a [B, dst_len, ...] one; a position is `position_bytes` long.
struct PositionCopy {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t rows = 0, src_len = 0, dst_len = 0, from = 0, to = 0, n = 0;
  std::size_t position_bytes = 0;
};

// dst[b][j] = src[b][start + j] where 0 <= start + j < src_len, else `fill`: a
// shard of a padded sequence (SPEC §2 fill values), or a window that begins before
// position 0. Elements are element_bytes (1, 2, 4 or 8) long; fill holds the
// element's bytes in its low bytes.
struct Slice {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t rows = 0, src_len = 0, start = 0, len = 0;
  std::size_t element_bytes = 0;
  std::uint64_t fill = 0;
};

// Document ids and padding [B, S] from each row's document starts [B, D+1]
// (occupied lengths, cumulated; the last entry is where the documents end) and
// real lengths [B, D].
struct DocIds {
  const std::int64_t* starts = nullptr;
  const std::int64_t* real = nullptr;
  std::int64_t* ids = nullptr;
  bool* padding = nullptr;
  std::int64_t rows = 0, seq_len = 0, docs = 0;
};

// The packed causal conv over windows [B, N+W-1, C] (see conv.hpp); run_start
// [B, N+W-1] are the window's run starts (run_starts). Backward writes gx, gw, gbias.
struct Conv {
  const void* x = nullptr;
  const std::int64_t* run_start = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // may be null
  void* y = nullptr;
  const void* gy = nullptr;
  void* gx = nullptr;
  void* gw = nullptr;
  void* gbias = nullptr;
  std::int64_t rows = 0, outputs = 0, channels = 0, width = 0;
};

// Per-row plan, flattened: row b's segments are segments[seg_at[b] .. seg_at[b+1]),
// its forward fold ranks fold_fwd[fwd_at[b] .. fwd_at[b+1]), its backward ones
// fold_bwd[bwd_at[b] .. bwd_at[b+1]).
struct RecurrencePlanView {
  const std::int64_t *segments, *seg_at;
  const std::int64_t *fold_fwd, *fwd_at;
  const std::int64_t *fold_bwd, *bwd_at;
  const std::int64_t* transition_segment;  // [B]
  const std::uint8_t* publishes;           // [B]: bit 0 transition, bit 1 state gradient
};

// The four passes of the CP gated delta rule: each rank's transition (M, S_ext) of
// the segment it publishes; forward (fold the earlier ranks' transitions, then run
// every segment); backward inside the shard (and the gradient it publishes); the
// backward fold of the later ranks' gradients into the published segment.
enum class RecurrenceStep : int { publish = 0, forward = 1, backward_local = 2, backward_fold = 3 };

struct RecurrenceArgs {
  std::int64_t B, L, H, K, V;
  const double *q, *k, *v, *beta, *g;  // [B,L,H,K], [B,L,H,K], [B,L,H,V], [B,L,H], [B,L,H,K]
  RecurrencePlanView plan;
  double* work;         // per (b, h): recurrence_workspace(L, K, V) doubles
  double* mine;         // [B][H][K][K+V]: what this rank publishes
  const double* all;    // [c][B][H][K][K+V]: what every rank published
  double* S0;           // [B][H][K][V]: state entering the first segment
  double* M_first;      // [B][H][K][K]: transition of the first segment
  double* o;            // [B,L,H,V]
  const double* d_o;    // [B,L,H,V]; null: zero
  double *gq, *gk, *gv, *gbeta, *gg;
};

// dst[i] = srcs[0][i] + ... + srcs[n-1][i], left to right (see reduce.hpp); `srcs`
// is an array of n pointers that lives on the device that runs the kernel.
struct Sum {
  const void* const* srcs = nullptr;
  void* dst = nullptr;
  std::size_t n = 0, count = 0;
};

// Rotary embedding of x [B, L, H, D] (D even) by positions [B, L]: each pair
// (x_2m, x_2m+1) turns by sign * pos * base^(-2m/D) (sign -1: the inverse, which
// is also the backward).
struct Rope {
  const void* x = nullptr;
  const std::int64_t* pos = nullptr;  // [B, L], or mRoPE's [3, B, L] (planes 3)
  void* y = nullptr;
  std::int64_t rows = 0, len = 0, heads = 0, dim = 0;
  double base = kRopeBase;
  int sign = 1;
  // mRoPE: pair m turns by plane 0 (temporal) while m < section_t, plane 1
  // (height) while m < section_t + section_h, else plane 2 (width).
  std::int64_t planes = 1, section_t = 0, section_h = 0;
};

// Document-masked causal attention of local queries q [B, Lq, H, D] (query t at
// global position q_start + t) over keys k [B, Lk, H, D] and values v
// [B, Lk, H, Dv] at global positions 0..Lk-1. Query t sees key j iff its id
// q_ids[b][t] is not 0, k_ids[b][j] equals it and j <= q_start + t (ids: doc ids,
// 0 where a token is not real; a document's tokens are one run of positions, so
// its keys lie between the previous document's last real token and the query).
// With `kept` ([B, Lq, topk], ascending, -1 after the last), only those keys.
// lse [B, Lq, H] is saved by the forward for the backward; a query that sees
// nothing outputs 0. The backward writes all of dq, and dk and dv only where a
// local query sees the key: they must arrive zeroed.
struct Attention {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  const std::int64_t *q_ids = nullptr, *k_ids = nullptr;
  const std::int64_t* kept = nullptr;
  // [B, Lq]: the first query t' >= t whose id is not 0 (q_len when none): the key
  // gradient visits only the queries that see anything.
  const std::int64_t* next_query = nullptr;
  // [B, Lk]: where the run of key j's document starts (first_key at j for its own
  // id), so that a query finds its first key at once instead of scanning back.
  const std::int64_t* k_first = nullptr;
  // Backward scratch [B, Lq, H]: dO_i . o_i of each query (the softmax gradient's
  // shift), computed once per query instead of once per (query, key) pair.
  void* delta = nullptr;
  std::int64_t topk = 0;
  void *o = nullptr, *lse = nullptr;
  const void* d_o = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  std::int64_t rows = 0, q_len = 0, k_len = 0, heads = 0, dim = 0, v_dim = 0, q_start = 0;
  double scale = 1;
};

// The keys a top-k indexer keeps: indexer queries q [B, Lq, Di] and keys k
// [B, Lk, Di] score s_tj = q_t . k_j over the keys query t sees (the Attention
// rule); kept[b][t] lists its min(topk, visible) best (ties: the smaller j),
// ascending, then -1.
struct TopK {
  const void *q = nullptr, *k = nullptr;
  const std::int64_t *q_ids = nullptr, *k_ids = nullptr;
  const std::int64_t* k_first = nullptr;  // as Attention::k_first
  std::int64_t* kept = nullptr;
  std::int64_t rows = 0, q_len = 0, k_len = 0, dim = 0, q_start = 0, topk = 0;
};

// Cross entropy of `tokens` rows of logits [tokens, vocab] against targets
// [tokens] (negative: no target). Forward writes token_loss [tokens] and sums
// [2] (float64, on the device: the loss sum and the target count, added in
// token order); backward writes grad = grad_scale * (softmax - onehot) for the
// tokens with a target, 0 for the others.
struct CrossEntropy {
  const void* logits = nullptr;
  const std::int64_t* targets = nullptr;
  void* token_loss = nullptr;
  double* sums = nullptr;
  void* grad = nullptr;
  double grad_scale = 1;
  std::int64_t tokens = 0, vocab = 0;
};

struct KernelTable {
  void (*blocks_to_sequence)(const Rearrange&, void* stream);
  void (*sequence_to_blocks)(const Rearrange&, void* stream);
  void (*copy_positions)(const PositionCopy&, void* stream);
  void (*slice)(const Slice&, void* stream);
  // dst positions += src positions, elementwise in `dtype` (bool: or).
  void (*add_positions)(const PositionCopy&, DType dtype, void* stream);

  void (*doc_ids_from_starts)(const DocIds&, void* stream);
  // out[b][t] = first position of the run of equal ids holding (b, t), rows of `len`.
  void (*run_starts)(const std::int64_t* ids, std::int64_t* out, std::int64_t rows, std::int64_t len, void* stream);
  // SPEC §1 derived positions; `tails` is [rows] scratch.
  void (*derived_positions)(const std::int64_t* ids, std::int64_t* tails, std::int64_t* positions, std::int64_t rows,
                            std::int64_t len, void* stream);
  // Starts of the runs of equal ids of one row into out; returns how many.
  std::int64_t (*segment_starts)(const std::int64_t* ids, std::int64_t len, std::int64_t* out, void* stream);

  // float32 or float64.
  void (*conv_forward)(const Conv&, DType dtype, void* stream);
  void (*conv_backward)(const Conv&, DType dtype, void* stream);

  // One pass of the CP gated delta rule over every (row, head) (see recurrence.hpp).
  void (*recurrence_pass)(const RecurrenceArgs&, RecurrenceStep pass, void* stream);

  // The rank-order sum of reduce_scatter and all_reduce (and add_inplace: n = 2).
  void (*sum_in_order)(const Sum&, DType dtype, void* stream);

  // The layers of SPEC §3b (layers.hpp); float32 or float64.
  void (*rope)(const Rope&, DType dtype, void* stream);
  void (*attention_forward)(const Attention&, DType dtype, void* stream);
  void (*attention_backward)(const Attention&, DType dtype, void* stream);
  void (*topk_select)(const TopK&, DType dtype, void* stream);
  void (*cross_entropy_forward)(const CrossEntropy&, DType dtype, void* stream);
  void (*cross_entropy_backward)(const CrossEntropy&, DType dtype, void* stream);
};

// The table of a device kind; throws Unavailable when none is registered.
const KernelTable& kernels_for(Device device);
void register_kernels(DeviceKind kind, const KernelTable* table);

// The stream kernels of this thread run on (a backend sets it per rank thread).
void*& current_stream();

}  // namespace cpsim::kernels
