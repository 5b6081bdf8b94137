// The gather rows: gather_sequence forward (every dtype) and backward, and the anchor.
#include "core/gather.hpp"

#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {
// Costs (RowCost). Gather forward: six dtypes of [B, P, ...] (6C + 40 bytes a
// token), each rank's gathered copy. Gather backward and the anchor, per dtype
// (float64 the larger): every rank's upstream gradient and gathered tensor are
// whole [B, P, C] tensors (the upstream gradient is the reduce-scatter's input
// itself, not a copy), and a few per-rank positions.
double gather_backward_bytes(const RowShapes& s) { return 8 * s.C * (3.3 + 2.2 * s.cp) + 100 + 16 * s.cp; }

const RowHead kGatherForward{.name = "gather_forward",
    .claim = "gather_sequence is bitwise the global tensor, every dtype",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = true,
    .cost = {.bytes_per_token = [](const RowShapes& s) { return (6 * s.C + 40) * (1.2 + 1.3 * s.cp); },
             .us_per_token = 0.05,
             .us_per_token_per_rank = 0.05}};
const RowHead kGatherBackward{.name = "gather_backward",
    .claim = "each rank's gradient is the rank-order sum of the upstream slices",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = true,
    .cost = {.bytes_per_token = gather_backward_bytes, .us_per_token = 0.02, .us_per_token_per_rank = 0.17}};
const RowHead kAnchor{.name = "anchor",
    .claim = "the anchor makes every rank run backward; without it the skip is reported",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = true,
    .cost = {.bytes_per_token = gather_backward_bytes, .us_per_token = 0.02, .us_per_token_per_rank = 0.12}};
}  // namespace

static PropertyResult gather_forward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather) {
  const LayoutCase& c = s.c;
  BitwiseTally t;
  const std::vector<std::pair<DType, Shape>> cases = {
      {DType::f32, {s.shape.rows, s.g.padded_len, o.channels}}, {DType::f64, {s.shape.rows, s.g.padded_len, 2}},
      {DType::bf16, {s.shape.rows, s.g.padded_len, o.channels}}, {DType::i32, {s.shape.rows, s.g.padded_len, 3}},
      {DType::i64, {s.shape.rows, s.g.padded_len}},              {DType::b8, {s.shape.rows, s.g.padded_len, 2, 2}}};
  // One run for every dtype (a run per dtype would cost more than the gathers).
  std::vector<Tensor> globals;
  for (const auto& [dt, shape] : cases) globals.push_back(inputs::gather_forward_global(shape, dt, c.seed));
  std::vector<std::vector<Tensor>> got(cases.size(), std::vector<Tensor>(c.cp));
  RankOutputs outputs;
  for (auto& g : got) outputs.push_back(&g);
  std::vector<Input> inputs;
  for (const Tensor& g : globals) inputs.push_back({"of the gather", &g});
  run_reading(inputs, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const bool floating = is_floating(cases[k].first);
      Var x(on(comm, local(globals[k], s.context(r))), floating);
      got[k][r] = host(gather(x, &comm, floating, &s.context(r).plan()).value());
    }
  }, run_options(o), outputs);
  for (std::size_t k = 0; k < cases.size(); ++k)
    for (int r = 0; r < c.cp; ++r)
      t.expect_equal(globals[k], got[k][r],
                     std::string("gathered ") + dtype_name(cases[k].first) + " on rank " + std::to_string(r));
  return t.result();
}


static PropertyResult gather_backward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather) {
  const LayoutCase& c = s.c;
  BitwiseTally t;
  // One dtype at a time: every rank's upstream gradient is a whole [B, P, C]
  // tensor, so the cp of them are what this row holds at its peak; a run per
  // dtype holds one dtype's at a time.
  const Shape shape{s.shape.rows, s.g.padded_len, o.channels};
  const std::vector<bool> all(c.cp, true);
  for (const DType dt : {DType::f64, DType::f32}) {
    const Tensor global = inputs::gather_backward_global(shape, dt, c.seed);
    std::vector<Tensor> upstream, grads(c.cp);
    for (int q = 0; q < c.cp; ++q) upstream.push_back(inputs::gather_upstream(shape, dt, q, c.seed));
    run_reading({{"global", &global}}, c.cp, [&](Communicator& comm) {
      const int r = comm.rank();
      Var x(on(comm, local(global, s.context(r))), true);
      backward(dot(gather(x, &comm, true, &s.context(r).plan()), upstream[r]));
      grads[r] = host(x.grad());
    }, run_options(o), {&grads});
    for (int r = 0; r < c.cp; ++r) {
      if (!grads[r].defined()) {
        t.expect(false, "rank " + std::to_string(r) + " got no gradient");
        continue;
      }
      t.expect_sum(reference_gather_backward(dt, upstream, all, s.g, r), grads[r], capabilities_of(o),
                   std::string(dtype_name(dt)) + " gradient of rank " + std::to_string(r));
    }
  }
  return t.result();
}

static PropertyResult anchor_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather, const AnchorFn& anchor) {
  const LayoutCase& c = s.c;
  BitwiseTally t;
  const Shape shape{s.shape.rows, s.g.padded_len, o.channels};
  const inputs::Anchor drawn = inputs::anchor(shape, c.cp, c.seed);
  const Tensor& global = drawn.global;
  const std::vector<Tensor>& upstream = drawn.upstream;
  const std::vector<bool>& uses = drawn.uses;  // whether rank q's loss depends on the gathered tensor
  int users = 0;
  for (int q = 0; q < c.cp; ++q) users += uses[q];
  auto step = [&](bool with_anchor, std::vector<Tensor>& grads) {
    run_reading({{"global", &global}}, c.cp, [&](Communicator& comm) {
      const int r = comm.rank();
      Var x(on(comm, local(global, s.context(r))), true);
      Var gathered = gather(x, &comm, true, &s.context(r).plan());
      Var loss = uses[r] ? dot(gathered, upstream[r]) : constant_scalar(0.0);
      if (with_anchor) loss = add(loss, anchor(gathered));
      backward(loss);
      grads[r] = host(x.grad());
      comm.barrier();  // what the next training step would do
    }, run_options(o), {&grads});
  };
  std::vector<Tensor> grads(c.cp);
  step(true, grads);
  for (int r = 0; r < c.cp; ++r) {
    if (!grads[r].defined()) {
      t.expect(false, "with the anchor, rank " + std::to_string(r) + " got no gradient");
      continue;
    }
    t.expect_sum(reference_gather_backward(DType::f64, upstream, uses, s.g, r), grads[r], capabilities_of(o),
                 "gradient with the anchor on rank " + std::to_string(r));
  }
  if (c.cp > 1 && users > 0 && users < c.cp) {
    std::string error;
    try {
      std::vector<Tensor> unused(c.cp);
      step(false, unused);
    } catch (const CollectiveError& e) {
      error = e.what();
    }
    t.expect(error.find("reduce_scatter") != std::string::npos,
             "without the anchor the skipped reduce_scatter was not reported" +
                 (error.empty() ? std::string() : " (got: " + error + ")"));
  }
  return t.result();
}



namespace {

// Each rank's gathered tensor: x, the conv's input (verify/rows/inputs.hpp).
void gather_forward_golden(GoldenBuild& build) {
  const Tensor& x = build.conv_inputs().x;
  for (int r = 0; r < build.c.cp; ++r)
    build.ranks[r].add("gathered", x, "gather_sequence(x shard): the global tensor [B, P, C]", "§3");
}

// Every rank's upstream gradient of what it gathered, and each rank's gradient:
// their sum over ranks, in rank order.
void gather_backward_golden(GoldenBuild& build) {
  const std::int64_t B = build.B, P = build.P, C = build.o.channels;
  std::vector<Tensor> upstream;
  for (int q = 0; q < build.c.cp; ++q) {
    upstream.push_back(build.low(inputs::gather_upstream({B, P, C}, DType::f64, q, build.c.seed)));
    build.inputs.add("gather_grad." + std::to_string(q), upstream.back(),
                     "upstream gradient of rank " + std::to_string(q) + "'s gathered tensor [B, P, C]", "§3");
  }
  for (int r = 0; r < build.c.cp; ++r) {
    const std::int64_t L = build.g.size(r);
    Tensor grad = Tensor::full({B, L, C}, build.dt, 0.0);     // summed in rank order, in the dtype
    Tensor terms = Tensor::full({B, L, C}, DType::f64, 0.0);  // the sums of the terms' magnitudes
    for (int q = 0; q < build.c.cp; ++q) {
      const Tensor part = build.slice(upstream[q], r);
      for (std::int64_t i = 0; i < grad.numel(); ++i) {
        grad.set(i, grad.get(i) + part.get(i));
        terms.set(i, terms.get(i) + std::abs(part.get(i)));
      }
    }
    // A sum over ranks is held to the scale of its terms, not of its value: in
    // another order (a ring, Gloo, NCCL, a float32 accumulator) the rounding
    // follows the terms, and a sum that cancels is not held to its own tiny size.
    GoldenFile& rank = build.ranks[r];
    rank.add("gather_grad_x", grad,
             "gradient of the x shard through gather_sequence: sum over ranks q, in rank order, of gather_grad.q "
             "sliced to this shard [B, L, C]",
             "§3")["scale"] = "gather_grad_x_terms";
    rank.add("gather_grad_x_terms", terms,
             "the scale gather_grad_x is held to: the sum over ranks q of |gather_grad.q| sliced to this shard [B, L, "
             "C]; gather_grad_x's error is rms(expected - got) / rms(gather_grad_x_terms)",
             "§3")["compared"] = false;
  }
}

}  // namespace

namespace rows {

std::vector<PropertyRow> gather_rows() {
  return {
      kGatherForward.with(
          [](const Prepared& p, const CheckOptions& o) {
            // f32, f64, bf16, i32, i64, bool shards as gather_forward_of draws them (each
            // rank's block is as long as the longest interval on the wire).
            return p.shape.rows * p.g.largest() * (o.channels * 4 + 2 * 8 + o.channels * 2 + 3 * 4 + 8 + 4);
          },
          [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return gather_forward_of(p, o, or_default(impl.gather, default_gather));
          },
          gather_forward_golden),
      kGatherBackward.with(
          [](const Prepared& p, const CheckOptions& o) {
            return 2 * p.shape.rows * p.g.largest() * o.channels * (8 + 4) * p.c.cp;
          },
          [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return gather_backward_of(p, o, or_default(impl.gather, default_gather));
          },
          gather_backward_golden),
      kAnchor.with(
          [](const Prepared& p, const CheckOptions& o) { return 2 * p.shape.rows * p.g.largest() * o.channels * 8 * p.c.cp; },
          [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return anchor_of(p, o, or_default(impl.gather, default_gather), or_default(impl.anchor, default_anchor));
          })};
}

}  // namespace rows

}  // namespace cpsim::verify
