// Controls of the token_shift row (verify/rows/token_shift.cpp).
#include "tests/verify/controls/controls.hpp"

namespace {

// No halo: a shard's first position takes zeros, not the previous rank's last token.
Var token_shift_without_halo(const Var& x, const PackedContext& ctx, Communicator*) {
  return token_shift(x, ctx, nullptr);
}

// Across documents: the previous token whatever its document (a conv of taps [1, 0]
// over one document id).
Var token_shift_across_documents(const Var& x, const PackedContext& ctx, Communicator* comm) {
  const Var window = convolution_history(x, comm, 2, HaloExchange::send_recv, &ctx.plan());
  const std::int64_t C = x.value().dim(2);
  Tensor taps({C, 2}, x.value().dtype());
  for (std::int64_t k = 0; k < C; ++k) taps.set(2 * k, 1.0);
  return packed_causal_conv(window, Tensor({x.value().dim(0), x.value().dim(1) + 1}, DType::i64), Var(taps), Var());
}

}  // namespace

TEST(TokenShiftControls, TokenShiftCatchesAMissingHaloAndAShiftAcrossDocuments) {
  for (const auto& [name, variant] : std::vector<std::pair<std::string, TokenShiftFn>>{
           {"token shift without its halo", token_shift_without_halo},
           {"token shift across documents", token_shift_across_documents}}) {
    const std::string report = expect_counterexample(name, [&, v = variant](const LayoutCase& c) {
      RC_ASSERT(check_row("token_shift", c, quick(), {.token_shift = v}).ok);
    });
    expect_found(report);
  }
  // The operator itself holds on the same draws.
  cpsim::testing::check_property(cpsim::testing::over<LayoutCase>(
      [](const LayoutCase& c) { RC_ASSERT(check_row("token_shift", c, quick()).ok); }));
}
