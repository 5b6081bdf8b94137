// The model's own operators: what every row runs where the implementation under
// test (Impl, verify/properties.hpp) leaves an operator empty. A row takes an
// operator as or_default(impl.X, default_X), and nowhere else names these.
#include "core/attention.hpp"
#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/layout.hpp"
#include "core/loss.hpp"
#include "core/recurrence.hpp"
#include "core/shard.hpp"
#include "core/token_shift.hpp"
#include "verify/properties.hpp"

namespace cpsim::verify {

LayoutFn default_layout() { return derive_layout; }
ShardFn default_shard() {
  return [](int rank, int cp, const Batch& b, std::int64_t pad, bool primary, const PlanChoice& plan) {
    return shard_batch_at(rank, cp, b, std::nullopt, pad, primary, 1, plan);
  };
}
GatherFn default_gather() {
  return [](const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan) {
    return gather_sequence(x, comm, differentiable, plan);
  };
}
RecurrenceFn default_recurrence() {
  return [](const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const PackedContext& context,
            Communicator* comm) { return gated_delta_rule(q, k, v, beta, g, context, comm); };
}
HaloFn default_halo() {
  return [](const Var& x, Communicator* comm, int width, HaloExchange exchange, const ShardPlan* plan) {
    return convolution_history(x, comm, width, exchange, plan);
  };
}
ConvFn default_conv() { return packed_causal_conv; }
AnchorFn default_anchor() { return all_gather_backward_anchor; }
RopeFn default_rope() {
  return [](const Var& x, const Tensor& positions) { return rope(x, positions); };
}
AttentionFn default_attention() {
  return [](const Var& q, const Var& k, const Var& v, const PackedContext& context, const Tensor& local_padding,
            Communicator* comm, const SparseIndexer* indexer, const Tensor& probe) {
    return cp_document_attention(q, k, v, visible_doc_ids(context, local_padding), &context.plan(), comm, indexer, 0,
                                 probe);
  };
}
TargetsFn default_targets() {
  return [](const Tensor& tokens, const Tensor& doc_ids, const Tensor& padding, const PackedContext& context) {
    return narrow(next_token_targets(tokens, doc_ids, padding), 1, context.seq_start(), context.local_seq_len()).clone();
  };
}
LossFn default_loss() { return token_mean_loss; }
TokenShiftFn default_token_shift() {
  return [](const Var& x, const PackedContext& context, Communicator* comm) { return token_shift(x, context, comm); };
}

}  // namespace cpsim::verify
