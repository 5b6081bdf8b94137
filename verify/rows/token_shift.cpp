// The token-shift row: each position takes the previous position of its
// document, over a one-token halo at a shard's first position (core/token_shift.hpp),
// bitwise, forward and backward. The whole row is this file and its line in
// verify/rows/table.def: its head (name, claim, comparison, cost), its inputs,
// its unsharded reference, its check and its descriptor.
#include "core/token_shift.hpp"
#include "verify/random.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify::rows {

namespace {

// Cost: x and the upstream gradient of y, the reference's y and dx, every rank's
// slices of x and of the gradient, its window, y and dx, and their gradients on
// the tape: 14 float64 values a channel and token at the peak; 1.2 + 0.02 x cp
// us a token, as the halo rows (docs/operators.md, Memory, has the measurement).
const RowHead kTokenShift{.name = "token_shift",
    .claim = "each position takes the previous one of its document, over a one-token halo: bitwise",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = true,
    .cost = {.bytes_per_token = [](const RowShapes& s) { return 8 * s.C * 14 + 100; },
             .us_per_token = 1.2,
             .us_per_token_per_rank = 0.02}};


// The unsharded token shift on the reference's doc ids [B, P]: y[t] = x[t-1]
// where t-1 is in t's document, and its gradient dx[t] = dy[t+1] where t+1 is
// in t's; +0 elsewhere.
struct Reference {
  Tensor y, dx;
};
Reference reference(const Tensor& x, const Tensor& grad_y, const Tensor& doc_ids) {
  const std::int64_t B = x.dim(0), P = x.dim(1), C = x.numel() / std::max<std::int64_t>(1, B * P);
  Reference r{Tensor(x.shape(), x.dtype()), Tensor(x.shape(), x.dtype())};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 1; t < P; ++t) {
      if (doc_ids.get_int(b * P + t - 1) != doc_ids.get_int(b * P + t)) continue;
      for (std::int64_t k = 0; k < C; ++k) {
        r.y.set((b * P + t) * C + k, x.get((b * P + t - 1) * C + k));
        r.dx.set((b * P + t - 1) * C + k, grad_y.get((b * P + t) * C + k));
      }
    }
  return r;
}

}  // namespace

namespace {

// The row's check, with the operator under test (Impl::token_shift, or the model's).
PropertyResult token_shift_of(const Prepared& s, const CheckOptions& o, const TokenShiftFn& shift) {
  const LayoutCase& c = s.c;
  const inputs::TokenShift in = inputs::token_shift(s.truth, s.shape.rows, s.g.padded_len, o, s.c.seed);
  const Reference ref = reference(in.x, in.grad_y, s.padded_ids);
  std::vector<Tensor> y(c.cp), dx(c.cp);
  run_reading({{"x", &in.x}, {"grad_y", &in.grad_y}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    Var xr(on(comm, local(in.x, ctx)), true);
    const Var yr = shift(xr, ctx, &comm);
    y[r] = host(yr.value());
    backward(dot(yr, on(comm, local(in.grad_y, ctx))));
    dx[r] = host(xr.grad());
  }, run_options(o), {&y, &dx});
  BitwiseTally t;
  for (int r = 0; r < c.cp; ++r) {
    t.expect_equal(narrow(ref.y, 1, s.g.start(r), s.g.size(r)), y[r], "y of rank " + std::to_string(r));
    t.expect_equal(narrow(ref.dx, 1, s.g.start(r), s.g.size(r)), dx[r], "dx of rank " + std::to_string(r));
  }
  return t.result();
}

}  // namespace

std::vector<PropertyRow> token_shift_rows() {
  return {kTokenShift.with(
      // Forward and backward, one position of every batch row to or from a neighbour.
      [](const Prepared& p, const CheckOptions& o) { return p.c.cp > 1 ? 2 * p.shape.rows * o.channels * 8 : 0; },
      [](Prepared& p, const CheckOptions& o, const Impl& impl) {
        return token_shift_of(p, o, or_default(impl.token_shift, default_token_shift));
      })};
}

}  // namespace cpsim::verify::rows
