// The property driver: prepares a case once (its reference layout and every
// rank's packed context) and runs the table, whose rows live by family in
// verify/rows/ (layout and shard, gather, halo and conv, recurrence).
#include "verify/properties.hpp"

#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/recurrence.hpp"
#include "verify/rows/common.hpp"

namespace cpsim::verify {

using namespace rows;

LayoutFn default_layout() { return derive_layout; }
ShardFn default_shard() {
  return [](int rank, int cp, const Batch& b, std::int64_t pad, bool primary) {
    return shard_batch_at(rank, cp, b, std::nullopt, pad, primary);
  };
}
GatherFn default_gather() { return gather_sequence; }
RecurrenceFn default_recurrence() {
  return [](const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const PackedContext& context,
            Communicator* comm) { return gated_delta_rule(q, k, v, beta, g, context, comm); };
}
HaloFn default_halo() { return convolution_history; }
ConvFn default_conv() { return packed_causal_conv; }
AnchorFn default_anchor() { return all_gather_backward_anchor; }


Prepared::Prepared(LayoutCase c_in) : c(std::move(c_in)), runs(std::make_shared<Runs>()) {
  shape = reference_shape(c.batch);
  g = reference_geometry(shape.seq_len, c.cp);
  truth = reference_layout(c.batch);
  padded_ids = reference_padded_doc_ids(truth, g.padded_len);
  // Every rank's packed context, as a training step makes it (shard_batch).
  try {
    for (int r = 0; r < c.cp; ++r)
      contexts.push_back(shard_batch_at(r, c.cp, c.batch, std::nullopt, c.pad_token_id, false).context);
  } catch (...) {
    contexts.clear();
    shard_failure = std::current_exception();
  }
}

const PackedContext& Prepared::context(int rank) const {
  if (contexts.empty()) {
    const FailureReport report = classify_failure(shard_failure);
    if (report.kind == FailureKind::aborted) throw Aborted(report.what);
    throw Error("shard_batch threw: " + report.what);
  }
  return contexts.at(rank);
}

// ---------------------------------------------------------------------------
// The public checks: each prepares its case and runs one row's check.

namespace {
// A failed preparation (a reference that cannot read the batch) fails the property, never the harness.
template <class F>
PropertyResult prepared(const LayoutCase& c, const char* name, F&& f) {
  std::optional<Prepared> p;
  try {
    p.emplace(c);
  } catch (...) {
    return threw(name, c.cp, "could not prepare the case: ");
  }
  return f(*p);
}
}  // namespace

PropertyResult check_gather_forward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather) {
  return prepared(c, "gather_forward", [&](Prepared& p) { return gather_forward_of(p, o, gather); });
}
PropertyResult check_gather_backward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather) {
  return prepared(c, "gather_backward", [&](Prepared& p) { return gather_backward_of(p, o, gather); });
}
PropertyResult check_anchor(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather, const AnchorFn& anchor) {
  return prepared(c, "anchor", [&](Prepared& p) { return anchor_of(p, o, gather, anchor); });
}
PropertyResult check_halo_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo) {
  return prepared(c, "halo_forward", [&](Prepared& p) { return halo_forward_of(p, o, halo); });
}
PropertyResult check_halo_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo) {
  return prepared(c, "halo_backward", [&](Prepared& p) { return halo_backward_of(p, o, halo); });
}
PropertyResult check_conv_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  return prepared(c, "conv_forward", [&](Prepared& p) { return conv_forward_of(p, o, halo, conv); });
}
PropertyResult check_conv_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  return prepared(c, "conv_backward", [&](Prepared& p) { return conv_backward_of(p, o, halo, conv); });
}
PropertyResult check_recurrence_forward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn,
                                        Sharding sharding) {
  return prepared(c, "recurrence_forward", [&](Prepared& p) { return recurrence_forward_of(p, o, fn, sharding); });
}
PropertyResult check_recurrence_backward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn,
                                         Sharding sharding) {
  return prepared(c, "recurrence_backward", [&](Prepared& p) { return recurrence_backward_of(p, o, fn, sharding); });
}

PropertyResult check_two_steps(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn) {
  return prepared(c, "two_steps", [&](Prepared& p) { return two_steps_of(p, o, fn ? fn : default_recurrence()); });
}
PropertyResult check_rope(const LayoutCase& c, const CheckOptions& o, const RopeFn& fn) {
  return prepared(c, "rope", [&](Prepared& p) { return rope_of(p, o, fn ? fn : default_rope()); });
}
PropertyResult check_attention_forward(const LayoutCase& c, const CheckOptions& o, const AttentionFn& fn,
                                       const RopeFn& rope_fn, std::int64_t topk) {
  return prepared(c, topk >= 0 ? "sparse_attention_forward" : "attention_forward",
                  [&](Prepared& p) { return attention_forward_of(p, o, fn, rope_fn, topk); });
}
PropertyResult check_attention_backward(const LayoutCase& c, const CheckOptions& o, const AttentionFn& fn,
                                        const RopeFn& rope_fn, std::int64_t topk) {
  return prepared(c, topk >= 0 ? "sparse_attention_backward" : "attention_backward",
                  [&](Prepared& p) { return attention_backward_of(p, o, fn, rope_fn, topk); });
}
PropertyResult check_loss_forward(const LayoutCase& c, const CheckOptions& o, const TargetsFn& targets,
                                  const LossFn& loss) {
  return prepared(c, "loss_forward", [&](Prepared& p) { return loss_forward_of(p, o, targets, loss); });
}
PropertyResult check_loss_backward(const LayoutCase& c, const CheckOptions& o, const TargetsFn& targets,
                                   const LossFn& loss) {
  return prepared(c, "loss_backward", [&](Prepared& p) { return loss_backward_of(p, o, targets, loss); });
}

// ---------------------------------------------------------------------------
// The table: every family's rows (verify/rows/), in order.

const std::vector<PropertyRow>& property_table() {
  static const std::vector<PropertyRow> table = [] {
    std::vector<PropertyRow> t;
    for (auto family : {layout_rows, gather_rows, conv_rows, recurrence_rows, layer_rows, step_rows})
      for (PropertyRow& row : family()) t.push_back(std::move(row));
    return t;
  }();
  return table;
}

std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o) {
  std::vector<PropertyResult> out;
  std::optional<Prepared> p;
  std::exception_ptr why;
  try {
    p.emplace(c);
  } catch (...) {
    why = std::current_exception();
  }
  for (const PropertyRow& row : property_table())
    out.push_back(p ? row.check(*p, o) : threw(row.name, c.cp, "could not prepare the case: ", why));
  return out;
}

}  // namespace cpsim::verify
