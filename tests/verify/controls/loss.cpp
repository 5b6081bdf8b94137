// Controls of the loss rows (verify/rows/loss.cpp).
#include "tests/verify/controls/controls.hpp"

namespace {

// Targets aligned on each shard after sharding: the target at every shard edge
// inside a document is lost.
Tensor targets_after_sharding(const Tensor& tokens, const Tensor& doc_ids, const Tensor& padding,
                              const PackedContext& ctx) {
  auto mine = [&](const Tensor& t) { return narrow(t, 1, ctx.seq_start(), ctx.local_seq_len()).clone(); };
  return next_token_targets(mine(tokens), mine(doc_ids), mine(padding));
}

// Each rank's own mean, averaged over the ranks.
Var mean_of_rank_means(const Var& logits, const Tensor& targets, Communicator* comm) {
  const Var local = token_mean_loss(logits, targets, nullptr);
  const double n = comm ? comm->size() : 1;
  Tensor sum = local.value().clone();
  if (comm && comm->size() > 1) comm->all_reduce(sum.raw(), 1, DType::f64);
  return record(Tensor::full({1}, DType::f64, sum.get(0) / n), "mean_of_rank_means", {local},
                [n](const Tensor& g) { return std::vector<Tensor>{Tensor::full({1}, DType::f64, g.get(0) / n)}; });
}

// A rank without targets returns early, skipping the all-reduce its peers enter.
Var loss_skipped_without_targets(const Var& logits, const Tensor& targets, Communicator* comm) {
  const Tensor t = targets.is_cpu() ? targets : targets.to(Device::host());
  bool any = false;
  for (std::int64_t i = 0; i < t.numel(); ++i) any = any || t.get_int(i) >= 0;
  return token_mean_loss(logits, targets, any ? comm : nullptr);
}

}  // namespace

TEST(LossControls, LossCatchesTargetsAlignedAfterSharding) {
  expect_row_catches("targets aligned after sharding", "loss_forward", quick(), {.targets = targets_after_sharding});
}

TEST(LossControls, LossCatchesAMeanOfRankMeans) {
  expect_row_catches("per-rank mean averaged over ranks", "loss_forward", quick(), {.loss = mean_of_rank_means});
}

TEST(LossControls, ALossSkippedOnARankWithoutTargetsIsANamedMismatch) {
  const auto report = expect_counterexample("loss all-reduce skipped without targets", [](const LayoutCase& c) {
    const auto r = check_row("loss_forward", c, quick(), {.loss = loss_skipped_without_targets});
    if (!r.ok) RC_FAIL(r.detail);
  });
  expect_found(report);
  EXPECT_THAT(report, HasSubstr("returned without joining all_reduce"));
}
