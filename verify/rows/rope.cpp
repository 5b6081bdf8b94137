// The RoPE row (SPEC §3b): each rank rotates its shard by the batch's positions,
// forward and backward.
#include "verify/golden_build.hpp"
#include "verify/reference_layers.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

// Cost (RowCost): x, its upstream gradient, every rank's y and dx, the reference's two.
const RowHead kRope{.name = "rope",
    .claim = "each rank rotates by its shard of the batch's positions, forward and backward",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = [](const RowShapes& s) { return 8 * s.H * s.K * 8 + 40; },
             .us_per_token = 0.44,
             .us_per_token_per_rank = 0.015}};

// The rotated attention inputs, whole and each rank's slice.
void rope_golden(GoldenBuild& build) {
  build.ref.add("rope_q", build.rope_q(), "attention_q rotated by padded.position_ids [B, P, H, D]", "§3b");
  build.ref.add("rope_k", build.rope_k(), "attention_k rotated by padded.position_ids [B, P, H, D]", "§3b");
  for (int r = 0; r < build.c.cp; ++r) {
    build.ranks[r].add("rope_q", build.slice(build.rope_q(), r), "this rank's attention_q rotated by its position_ids",
                       "§3b");
    build.ranks[r].add("rope_k", build.slice(build.rope_k(), r), "this rank's attention_k rotated by its position_ids",
                       "§3b");
  }
}

}  // namespace


// ---------------------------------------------------------------------------
// RoPE alone.

static PropertyResult rope_of(const Prepared& s, const CheckOptions& o, const RopeFn& fn) {
  const LayoutCase& c = s.c;
  ToleranceTally t;
  const std::int64_t B = s.shape.rows, P = s.g.padded_len;
  const LayerRows rows = layer_rows(s);
  const inputs::Rope in = inputs::rope(B, P, o, c.seed);
  const Tensor &x = in.x, &up = in.grad_y;
  std::vector<Tensor> y(c.cp), dx(c.cp);
  run_reading({{"x", &x}, {"up", &up}, {"positions", &rows.positions}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    Var xv(on(comm, local(x, ctx)), true);
    const Var out = fn(xv, local_positions(rows.positions, ctx));
    backward(dot(out, local(up, ctx)));
    y[r] = host(out.value());
    dx[r] = host(xv.grad());
  }, run_options(o), {&y, &dx});
  t.expect_close(reference_rope(x, rows.positions), joined(y), kRope.tolerance, "rotated x");
  t.expect_close(reference_rope_backward(up, rows.positions), joined(dx), kRope.tolerance, "dx");
  return t.result(kRope.tolerance);
}

namespace rows {

std::vector<PropertyRow> rope_rows() {
  return {
      kRope.with(no_bytes, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
        return rope_of(p, o, or_default(impl.rope, default_rope));
      }, rope_golden)};
}

}  // namespace rows

}  // namespace cpsim::verify
