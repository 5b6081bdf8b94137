// The layers that consume the layout (SPEC §3b): rotary embedding by the batch's
// global positions, document-masked causal attention over the gathered K/V, and
// its top-k sparse form (an indexer picks the keys each query attends to). Every
// op runs the one kernel source on the device its inputs live on.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"
#include "core/model_shape.hpp"
#include "core/shard.hpp"

namespace cpsim {

// x [B, L, H, D] (D even) rotated by positions [B, L] int64: pair (x_2m, x_2m+1)
// turns by pos * base^(-2m/D). float32 or float64. mRoPE: positions [3, B, L]
// (temporal, height, width planes); the D/2 pairs split into mrope_sections(D),
// each part turned by its plane's position.
Var rope(const Var& x, const Tensor& positions, double base = kRopeBase);

// How many rotary pairs each mRoPE plane turns (temporal, height, width): height
// and width 3/8 of the D/2 pairs each (at least 1), temporal the rest, as
// Qwen2-VL's mrope_section [16, 24, 24] for D = 128. D >= 4.
struct MropeSections {
  std::int64_t t, h, w;
};
MropeSections mrope_sections(std::int64_t dim);

// Attention of local queries q [B, Lq, H, D] (query t at global position
// q_start + t) over keys k [B, Lk, H, D] and values v [B, Lk, H, Dv] at global
// positions 0..Lk-1. Query t sees key j iff q_ids[b][t] != 0, k_ids[b][j] ==
// q_ids[b][t] and j <= q_start + t (ids: global doc ids, 0 where a token is not
// real), and only the keys `kept` lists when it is given ([B, Lq, topk] int64,
// ascending, -1 after the last). A query that sees nothing outputs 0. scale 0
// means 1/sqrt(D).
Var document_attention(const Var& q, const Var& k, const Var& v, const Tensor& q_ids, const Tensor& k_ids,
                       std::int64_t q_start, double scale = 0, const Tensor& kept = Tensor());

// The keys a top-k indexer keeps ([B, Lq, topk] int64, ascending, -1 after the
// last): indexer queries [B, Lq, Di] and keys [B, Lk, Di] score the keys each
// query sees (the rule above); each query keeps its min(topk, visible) best,
// ties to the smaller position. No gradient.
Tensor topk_keep(const Tensor& index_q, const Tensor& index_k, const Tensor& q_ids, const Tensor& k_ids,
                 std::int64_t q_start, std::int64_t topk);

// Token ids for attention: the rank's global doc ids with 0 where a token is
// padding ([B, L], from its packed context and its shard of padding_mask).
Tensor visible_doc_ids(const PackedContext& context, const Tensor& local_padding);

// The sharded layer on one rank: its q, k, v shards [B, L_r, H, D]; k and v are
// gathered (gather_sequence, differentiable, under `plan`: nullptr is equal
// intervals), and so are the token ids; the queries start at the rank's cut. With an
// indexer (its query and key shards, [B, L, Di], and topk), attention runs over
// the keys it keeps (the indexer key gathered without a gradient). `anchor` is a
// zero scalar to add to the loss (all_gather_backward_anchor of both gathers), so
// that every rank runs the backward collectives even when its loss does not reach
// the gathered tensors. `probe` ([B, L], nonzero: evaluate), when given, names the
// local queries to evaluate: the others output 0, keep no key and pass no
// gradient, but every token is still a key; a check of a long document evaluates
// a chosen set of queries at a cost of their (query, key) pairs.
struct SparseIndexer {
  Tensor q, k;
  std::int64_t topk = 0;
};
struct CpAttention {
  Var out;
  Var anchor;
  Tensor kept;  // with an indexer: the keys each local query kept (topk_keep)
};
CpAttention cp_document_attention(const Var& q, const Var& k, const Var& v, const Tensor& local_ids,
                                  const ShardPlan* plan, Communicator* comm, const SparseIndexer* indexer = nullptr,
                                  double scale = 0, const Tensor& probe = Tensor());

}  // namespace cpsim
