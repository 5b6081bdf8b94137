// Unsharded references of the layers that consume the layout (SPEC §3b), written
// from the SPEC alone with plain loops in float64: they never call core/, so a bug
// there cannot hide in its own reference. Tensors are host, row-major.
#pragma once

#include <cstdint>

#include "core/model_shape.hpp"
#include "core/tensor.hpp"

namespace cpsim::verify {

// The inputs of one attention layer over the whole (padded) sequence, as the layer
// rows and `cpsim golden` draw them from a case's seed: q, k [B, P, H, D], v and
// the upstream gradient of o [B, P, H, Dv], and the sparse indexer's query and key
// [B, P, Di], integer-valued in [-3, 3] so that no summation order can change a
// selection.
struct AttentionInputs {
  Tensor q, k, v, grad_o, index_q, index_k;
};
AttentionInputs random_attention_inputs(std::int64_t B, std::int64_t P, std::int64_t H, std::int64_t D,
                                        std::int64_t Dv, std::int64_t Di, std::uint64_t seed);
// The loss's inputs: token ids folded into the vocabulary (id mod V) [B, P], and
// logits [B, P, V].
struct LossInputs {
  Tensor tokens, logits;
};
LossInputs random_loss_inputs(const Tensor& input_ids, std::int64_t vocab, std::uint64_t seed);

// x [B, S, H, D] with each pair (x_2m, x_2m+1) turned by pos * base^(-2m/D);
// positions [B, S], or mRoPE's [3, B, S] (each pair by its plane's position).
Tensor reference_rope(const Tensor& x, const Tensor& positions, double base = kRopeBase);
// The gradient of x through reference_rope: dy turned back by -pos * base^(-2m/D).
Tensor reference_rope_backward(const Tensor& dy, const Tensor& positions, double base = kRopeBase);

// Attention of every query over the keys it sees: key j is visible to query i iff
// both are real tokens (padding false), doc_ids[b][i] != 0, doc_ids[b][j] ==
// doc_ids[b][i] and j <= i; with topk >= 0, only the min(topk, visible) keys of
// highest indexer score (iq_i . ik_j; ties: the smaller j). The outputs and the
// gradients of q, k, v under the upstream gradient d_o; with topk, kept
// [B, S, topk] lists each query's kept keys, ascending, then -1. With `queries`
// ([B, S], nonzero: evaluate) only those queries are evaluated (the others
// output 0, keep nothing, and add nothing to the gradients, as if their upstream
// gradient were 0): a cost of their (query, key) pairs.
struct AttentionReference {
  Tensor o, dq, dk, dv, kept;
};
AttentionReference reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& doc_ids,
                                       const Tensor& padding, const Tensor& d_o, double scale,
                                       const Tensor& index_q = Tensor(), const Tensor& index_k = Tensor(),
                                       std::int64_t topk = -1, const Tensor& queries = Tensor());

// Next-token targets on whole rows (-100 at a document's last token, on padding
// and where the next token is padding), the token-mean cross entropy of logits
// [B, S, V] over them, and its gradient (softmax - onehot) / count.
struct LossReference {
  Tensor targets;
  double loss = 0;
  double count = 0;
  Tensor grad;
};
LossReference reference_loss(const Tensor& logits, const Tensor& input_ids, const Tensor& doc_ids,
                             const Tensor& padding);

}  // namespace cpsim::verify
