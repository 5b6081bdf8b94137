// Controls of the halo and conv rows (verify/rows/conv.cpp).
#include "tests/verify/controls/controls.hpp"

namespace {

// History slots hold positions a_r-W .. a_r-2: one position too early.
Var halo_one_position_off(const Var& x, Communicator* comm, int width, HaloExchange e, const ShardPlan* plan) {
  const std::int64_t L = x.value().dim(1), H = width - 1;
  const Tensor wider = convolution_history(Var(x.value()), comm, width + 1, e, plan).value();
  return Var(cat({narrow(wider, 1, 0, H), narrow(wider, 1, H + 1, L)}, 1));
}

// Correct forward; backward sends the nearest history gradient two ranks back instead of one.
Var halo_gradient_to_wrong_rank(const Var& x, Communicator* comm, int width, HaloExchange e, const ShardPlan* plan) {
  const std::int64_t L = x.value().dim(1), H = width - 1;
  const Tensor window = convolution_history(Var(x.value()), comm, width, e, plan).value();
  if (!is_distributed(comm)) return Var(window);
  const ShardPlan p = plan_for("halo_gradient_to_wrong_rank", plan, *comm, L);
  return record(window, "halo_gradient_to_wrong_rank", {x}, [comm, L, H, p](const Tensor& g) {
    Tensor dx = narrow(g, 1, H, L);
    if (H == 0) return std::vector<Tensor>{dx};
    const int r = comm->rank(), c = comm->size();
    const int dst = r - 2 >= 0 ? r - 2 : -1, src = r + 2 < c ? r + 2 : -1;
    // Each pair agrees on the count: the receiver's min(L, H) tail.
    const std::int64_t n = dst >= 0 ? std::min(p.size(dst), H) : 0, m = std::min(L, H);
    Tensor send = narrow(g, 1, H - n, n), recv({g.dim(0), src >= 0 ? m : 0, g.dim(2)}, g.dtype());
    comm->send_recv({send.raw(), static_cast<std::size_t>(send.numel()), dst, recv.raw(),
                     static_cast<std::size_t>(recv.numel()), src},
                    g.dtype());
    if (src >= 0 && m > 0) {
      Tensor tail = narrow(dx, 1, L - m, m);
      add_inplace(tail, recv);
      dx = cat({narrow(dx, 1, 0, L - m), tail}, 1);
    }
    return std::vector<Tensor>{dx};
  });
}

// Taps are never cut at document boundaries.
Var conv_ignoring_documents(const Var& x, const Tensor& ids, const Var& w, const Var& b) {
  return packed_causal_conv(x, Tensor(ids.shape(), DType::i64), w, b);
}

CheckOptions wide_conv() {
  CheckOptions o;
  o.conv_width = *rc::gen::inRange(2, 9);
  o.channels = 2;
  return o;
}

// The local shard without its history.
Var halo_without_history(const Var& x, Communicator*, int, HaloExchange, const ShardPlan*) { return x; }
Var halo_throws_on_last_rank(const Var& x, Communicator* comm, int width, HaloExchange e, const ShardPlan* plan) {
  if (!comm || comm->rank() + 1 == comm->size()) throw Planted();
  return convolution_history(x, comm, width, e, plan);
}

// One output position short.
Var conv_one_short(const Var& x, const Tensor& ids, const Var& w, const Var& b) {
  const Var y = packed_causal_conv(x, ids, w, b);
  return Var(narrow(y.value(), 1, 0, std::max<std::int64_t>(0, y.value().dim(1) - 1)), true);
}

}  // namespace

TEST(ConvControls, HaloForwardCatchesAHistoryOnePositionOff) {
  expect_row_catches("halo_forward vs one position off", "halo_forward", wide_conv, {.halo = halo_one_position_off});
}

TEST(ConvControls, HaloBackwardCatchesAGradientSentToTheWrongRank) {
  expect_row_catches("halo_backward vs wrong rank", "halo_backward", wide_conv, {.halo = halo_gradient_to_wrong_rank});
}

TEST(ConvControls, ConvForwardCatchesTapsThatIgnoreDocumentBoundaries) {
  expect_row_catches("conv_forward vs ignored boundaries", "conv_forward", wide_conv, {.halo = default_halo(), .conv = conv_ignoring_documents});
}

TEST(ConvControls, ConvBackwardCatchesAGradientSentToTheWrongRank) {
  expect_row_catches("conv_backward vs wrong rank", "conv_backward", wide_conv, {.halo = halo_gradient_to_wrong_rank});
}

TEST(ConvControls, PlantedFaultsHaloAndConvThatThrowOrReturnTheWrongSize) {
  const CheckOptions o;
  expect_reported("halo without history", [&](const LayoutCase& c) { return check_row("halo_forward", c, o, {.halo = halo_without_history}); });
  expect_reported("halo backward without history",
                  [&](const LayoutCase& c) { return check_row("halo_backward", c, o, {.halo = halo_without_history}); });
  expect_reported("halo throws", [&](const LayoutCase& c) { return check_row("halo_forward", c, o, {.halo = halo_throws_on_last_rank}); });
  expect_reported("conv one short",
                  [&](const LayoutCase& c) { return check_row("conv_forward", c, o, {.halo = default_halo(), .conv = conv_one_short}); });
  expect_reported("conv backward one short",
                  [&](const LayoutCase& c) { return check_row("conv_backward", c, o, {.halo = default_halo(), .conv = conv_one_short}); });
}
