// The loss rows (SPEC §3b): targets aligned on whole rows, and the token-mean
// cross entropy across ranks (its sum and count all-reduced).
#include <cmath>

#include "core/loss.hpp"
#include "verify/reference_layers.hpp"
#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

// Cost (RowCost): the logits, the reference's softmax gradient and every rank's gradient.
double loss_bytes_per_token(const RowShapes& s) { return 8.0 * s.vocab * 4 + 80; }

const RowHead kLossForward{.name = "loss_forward",
    .claim = "targets aligned on whole rows; sum and count all-reduced: every rank's loss",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = loss_bytes_per_token, .us_per_token = 0.85, .us_per_token_per_rank = 0.02}};
const RowHead kLossBackward{.name = "loss_backward",
    .claim = "each rank's logits gradient is its slice of the unsharded one",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = loss_bytes_per_token, .us_per_token = 0.06, .us_per_token_per_rank = 0}};

}  // namespace


// ---------------------------------------------------------------------------
// Targets and the loss across ranks.

struct LossRun {
  LossReference ref;
  std::vector<double> losses;  // every rank's
  Tensor grad;
};

namespace {

LossRun run_loss(const Prepared& s, const CheckOptions& opt, const TargetsFn& targets_fn, const LossFn& loss_fn) {
  const LayoutCase& c = s.c;
  const LayerRows rows = layer_rows(s);
  // Token ids folded into the vocabulary: targets come from the batch's own ids.
  const LossInputs in = inputs::loss(rows.input_ids, opt, c.seed);
  const Tensor &tokens = in.tokens, &logits = in.logits;
  LossRun run;
  run.ref = reference_loss(logits, tokens, rows.doc_ids, rows.padding);
  std::vector<Tensor> loss(c.cp), grad(c.cp);
  run_reading({{"logits", &logits}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    const Tensor targets = targets_fn(tokens, ctx.doc_ids(), rows.padding, ctx);
    Var lv(on(comm, local(logits, ctx)), true);
    const Var l = loss_fn(lv, on(comm, targets), &comm);
    backward(l);
    loss[r] = host(l.value());
    grad[r] = host(lv.grad());
  }, run_options(opt), {&loss, &grad});
  for (const Tensor& l : loss) run.losses.push_back(l.defined() ? l.get(0) : std::nan(""));
  run.grad = joined(grad);
  return run;
}

std::shared_ptr<const LossRun> loss_run(Prepared& s, const CheckOptions& o, const TargetsFn& targets_fn,
                                        const LossFn& loss_fn) {
  if (targets_fn || loss_fn)
    return std::make_shared<LossRun>(
        run_loss(s, o, or_default(targets_fn, default_targets), or_default(loss_fn, default_loss)));
  if (!s.runs->loss) s.runs->loss = std::make_shared<LossRun>(run_loss(s, o, default_targets(), default_loss()));
  return s.runs->loss;
}

}  // namespace

static PropertyResult loss_forward_of(Prepared& s, const CheckOptions& o, const TargetsFn& targets_fn, const LossFn& loss_fn) {
  ToleranceTally t;
  const auto run = loss_run(s, o, targets_fn, loss_fn);
  for (std::size_t r = 0; r < run->losses.size(); ++r)
    t.expect_close(Tensor::full({1}, DType::f64, run->ref.loss), Tensor::full({1}, DType::f64, run->losses[r]),
                   kLossForward.tolerance,
                   "rank " + std::to_string(r) + "'s loss " + std::to_string(run->losses[r]) + " (unsharded " +
                       std::to_string(run->ref.loss) + " over " + std::to_string(static_cast<std::int64_t>(run->ref.count)) +
                       " targets)");
  return t.result(kLossForward.tolerance);
}

static PropertyResult loss_backward_of(Prepared& s, const CheckOptions& o, const TargetsFn& targets_fn,
                                const LossFn& loss_fn) {
  ToleranceTally t;
  const auto run = loss_run(s, o, targets_fn, loss_fn);
  s.runs->loss.reset();
  t.expect_close(run->ref.grad, run->grad, kLossBackward.tolerance, "d logits");
  return t.result(kLossBackward.tolerance);
}


namespace {

// The loss's inputs, its targets, value and gradient, and each rank's share.
void loss_golden(GoldenBuild& build) {
  LossInputs li = inputs::loss(build.padded.at("input_ids"), build.o, build.c.seed);
  li.logits = build.low(li.logits);
  build.inputs.add("loss_tokens", li.tokens,
                   "padded input_ids mod vocab [B, P]: the ids the targets are aligned from", "§3b");
  build.inputs.add("logits", li.logits, "logits [B, P, vocab]", "§3b");
  const LossReference loss = reference_loss(li.logits, li.tokens, build.ids, build.padded.at("padding_mask"));
  const std::vector<std::pair<std::string, std::pair<Tensor, std::string>>> keys = {
      {"targets",
       {loss.targets,
        "next-token targets aligned on whole rows: loss_tokens[t+1] within t's document, else -100 [B, P]"}},
      {"loss_grad_logits", {loss.grad, "gradient of the token-mean loss for logits [B, P, vocab]"}}};
  for (const auto& [key, value] : keys) {
    build.ref.add(key, value.first, value.second, "§3b");
    for (int r = 0; r < build.c.cp; ++r)
      build.ranks[r].add(key, build.slice(value.first, r), "this rank's slice: " + value.second, "§3b");
  }
  const Tensor loss_value = Tensor::from<double>({1}, {loss.loss}),
               loss_count = Tensor::from<std::int64_t>({1}, {static_cast<std::int64_t>(loss.count)});
  build.ref.add("loss", loss_value, "the token-mean cross entropy over every rank's targets [1]", "§3b");
  build.ref.add("loss_count", loss_count, "the number of targets (the all-reduced count) [1]", "§3b");
  for (int r = 0; r < build.c.cp; ++r)
    build.ranks[r].add("loss", loss_value, "the loss every rank returns (sum and count all-reduced) [1]", "§3b");
}

}  // namespace

namespace rows {

std::vector<PropertyRow> loss_rows() {
  const auto loss_bytes = [](const Prepared&, const CheckOptions&) -> std::int64_t { return 16; };
  return {
      kLossForward.with(loss_bytes, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
        return loss_forward_of(p, o, impl.targets, impl.loss);
      }, loss_golden),
      kLossBackward.with(loss_bytes, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
        return loss_backward_of(p, o, impl.targets, impl.loss);
      })};
}

}  // namespace rows

}  // namespace cpsim::verify
