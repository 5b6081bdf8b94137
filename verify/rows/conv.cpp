// The halo and conv rows: convolution_history forward and backward, and the
// packed causal conv that consumes it (both exchanges).
#include "core/conv.hpp"
#include "core/exchange_plan.hpp"

#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

// Costs (RowCost). The conv: x, the upstream gradient and both exchanges' results
// (the reference's y and dx come after the ranks' run): one run serves both rows.
double conv_bytes(const RowShapes& s) { return 8 * s.C * 10.5 + 60; }

const RowHead kHaloForward{.name = "halo_forward",
    .claim = "convolution_history is the zero-padded previous W-1 positions",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = true,
    .cost = {.bytes_per_token = [](const RowShapes& s) { return 8 * s.C * 4.2 + 100; },
             .us_per_token = 0.13,
             .us_per_token_per_rank = 0.015}};
const RowHead kHaloBackward{.name = "halo_backward",
    .claim = "history gradients return to the ranks that own the positions",
    .comparison = Comparison::tolerance,
    .tolerance = kConvTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = [](const RowShapes& s) { return 8 * s.C * 9.3 + 80; },
             .us_per_token = 0.3,
             .us_per_token_per_rank = 0.02}};
const RowHead kConvForward{.name = "conv_forward",
    .claim = "the sharded packed causal conv matches the unsharded one",
    .comparison = Comparison::tolerance,
    .tolerance = kConvTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = conv_bytes, .us_per_token = 0.57, .us_per_token_per_rank = 0.03}};
const RowHead kConvBackward{.name = "conv_backward",
    .claim = "dx, and dw, dbias summed over ranks, match the unsharded conv",
    .comparison = Comparison::tolerance,
    .tolerance = kConvTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = conv_bytes, .us_per_token = 0.08, .us_per_token_per_rank = 0}};

std::int64_t halo_bytes(const Prepared& p, const CheckOptions& o) {
  // Both exchanges, the busiest rank: the all_gather of its tail slot, and its send_recv hops.
  std::int64_t most = 0;
  for (int r = 0; r < p.c.cp && p.c.cp > 1; ++r) {
    const HaloPlan plan = halo_plan(ShardPlan{p.g.cuts}, o.conv_width, r);
    std::int64_t positions = plan.tail;
    for (const HaloHop& hop : plan.hops) positions += hop.send_count;
    most = std::max(most, positions);
  }
  return most * p.shape.rows * o.channels * 8;
}


}  // namespace

namespace {

constexpr HaloExchange kExchanges[] = {HaloExchange::all_gather, HaloExchange::send_recv};

std::string exchange_tag(HaloExchange e) { return std::string(" (") + halo_exchange_name(e) + " exchange)"; }


}  // namespace

static PropertyResult halo_forward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo) {
  const LayoutCase& c = s.c;
  BitwiseTally t;
  const Tensor x = inputs::halo_forward_x(s.truth, s.g.padded_len, o, c.seed);
  std::vector<std::vector<Tensor>> got(std::size(kExchanges), std::vector<Tensor>(c.cp));
  run_reading({{"x", &x}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    for (std::size_t k = 0; k < std::size(kExchanges); ++k)
      got[k][r] = host(halo(Var(on(comm, local(x, s.context(r))), true), &comm, o.conv_width, kExchanges[k],
                            &s.context(r).plan())
                           .value());
  }, run_options(o), {&got[0], &got[1]});
  for (std::size_t k = 0; k < std::size(kExchanges); ++k)
    for (int r = 0; r < c.cp; ++r)
      t.expect_equal(reference_history(x, s.g.start(r), s.g.size(r), o.conv_width), got[k][r],
                     "history of rank " + std::to_string(r) + exchange_tag(kExchanges[k]));
  return t.result();
}

static PropertyResult halo_backward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo) {
  const LayoutCase& c = s.c;
  ToleranceTally t;
  const std::int64_t H = o.conv_width - 1, P = s.g.padded_len, C = o.channels;
  const Tensor x = inputs::halo_backward_x(s.truth, P, o, c.seed);
  std::vector<Tensor> upstream;
  for (int q = 0; q < c.cp; ++q)
    upstream.push_back(inputs::halo_upstream({s.shape.rows, s.g.size(q) + H, C}, q, c.seed));
  // Reference: every window slot's gradient lands on the global position it came from.
  Tensor owner_grad({s.shape.rows, P, C}, DType::f64);
  for (int q = 0; q < c.cp; ++q)
    for (std::int64_t b = 0, L = s.g.size(q); b < s.shape.rows; ++b)
      for (std::int64_t i = 0; i < L + H; ++i) {
        const std::int64_t p = s.g.start(q) - H + i;
        if (p < 0) continue;
        for (std::int64_t k = 0; k < C; ++k) {
          const std::int64_t at = (b * P + p) * C + k;
          owner_grad.set(at, owner_grad.get(at) + upstream[q].get((b * (L + H) + i) * C + k));
        }
      }
  std::vector<std::vector<Tensor>> grads(std::size(kExchanges), std::vector<Tensor>(c.cp));
  run_reading({{"x", &x}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    for (std::size_t k = 0; k < std::size(kExchanges); ++k) {
      Var xr(on(comm, local(x, s.context(r))), true);
      backward(dot(halo(xr, &comm, o.conv_width, kExchanges[k], &s.context(r).plan()), upstream[r]));
      grads[k][r] = host(xr.grad());
    }
  }, run_options(o), {&grads[0], &grads[1]});
  for (std::size_t k = 0; k < std::size(kExchanges); ++k)
    for (int r = 0; r < c.cp; ++r)
      t.expect_close(narrow(owner_grad, 1, s.g.start(r), s.g.size(r)), grads[k][r], kHaloBackward.tolerance,
                     "input gradient of rank " + std::to_string(r) + exchange_tag(kExchanges[k]));
  return t.result(kHaloBackward.tolerance);
}

struct ConvRun {
  ConvReference ref;
  std::vector<std::vector<Tensor>> y, dx;  // [exchange][rank]
  std::vector<Tensor> dw, dbias;           // [exchange], summed over ranks in rank order
};

namespace {

// One conv layer per rank, forward and backward, both exchanges. With neither part
// given, the model's own layer (sharded_packed_conv on the rank's packed context);
// otherwise the same composition with the given halo and/or conv.
ConvRun run_conv(const Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  const LayoutCase& c = s.c;
  const std::int64_t P = s.g.padded_len, W = o.conv_width;
  const inputs::Conv in = inputs::conv(s.truth, s.shape.rows, P, o, c.seed);
  const Tensor &x = in.x, &w = in.weight, &bias = in.bias, &gy = in.grad_y;
  const bool layer = !halo && !conv;
  const HaloFn halo_fn = or_default(halo, default_halo);
  const ConvFn conv_fn = or_default(conv, default_conv);
  ConvRun run;
  // Both exchanges in one run: [exchange][rank].
  const std::size_t E = std::size(kExchanges);
  std::vector<std::vector<Tensor>> y(E, std::vector<Tensor>(c.cp)), dx = y, dw = y, db = y;
  run_reading({{"x", &x}, {"gy", &gy}}, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    for (std::size_t k = 0; k < E; ++k) {
      const HaloExchange e = kExchanges[k];
      Var xr(on(comm, local(x, ctx)), true), wr(on(comm, w.clone()), true), br(on(comm, bias.clone()), true);
      Var out;
      if (layer) {
        out = sharded_packed_conv(xr, ctx, &comm, wr, br, e);
      } else {
        const Var window = halo_fn(xr, &comm, static_cast<int>(W), e, &ctx.plan());
        out = conv_fn(window,
                      on(comm, window_doc_ids(ctx.doc_ids(), ctx.seq_start(), ctx.local_seq_len(), static_cast<int>(W))),
                      wr, br);
      }
      backward(dot(out, local(gy, ctx)));
      y[k][r] = host(out.value());
      dx[k][r] = host(xr.grad());
      dw[k][r] = host(wr.grad());
      db[k][r] = host(br.grad());
    }
  }, run_options(o), {&y[0], &dx[0], &dw[0], &db[0], &y[1], &dx[1], &dw[1], &db[1]});
  for (std::size_t k = 0; k < E; ++k) {
    Tensor dw_sum = dw[k][0].defined() ? dw[k][0].clone() : Tensor();
    Tensor db_sum = db[k][0].defined() ? db[k][0].clone() : Tensor();
    for (int r = 1; r < c.cp; ++r) {
      if (dw_sum.defined() && dw[k][r].defined()) add_inplace(dw_sum, dw[k][r]);
      if (db_sum.defined() && db[k][r].defined()) add_inplace(db_sum, db[k][r]);
    }
    run.y.push_back(y[k]);
    run.dx.push_back(dx[k]);
    run.dw.push_back(dw_sum);
    run.dbias.push_back(db_sum);
  }
  // After the ranks' run (run_reading checked that their inputs are unchanged):
  // the reference's results are not held through the ranks' peak.
  run.ref = reference_conv(x, s.padded_ids, w, bias, gy);
  return run;
}

// The shared conv run of the model's layer (the table's rows), or a fresh one.
std::shared_ptr<const ConvRun> conv_run(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  if (halo || conv) return std::make_shared<ConvRun>(run_conv(s, o, halo, conv));
  if (!s.runs->conv) s.runs->conv = std::make_shared<ConvRun>(run_conv(s, o, halo, conv));
  return s.runs->conv;
}

}  // namespace

static PropertyResult conv_forward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  ToleranceTally t;
  const auto held = conv_run(s, o, halo, conv);  // keeps a fresh run alive
  const ConvRun& run = *held;
  for (std::size_t e = 0; e < run.y.size(); ++e)
    t.expect_close(run.ref.y, cat(run.y[e], 1), kConvForward.tolerance, "conv output" + exchange_tag(kExchanges[e]));
  return t.result(kConvForward.tolerance);
}

static PropertyResult conv_backward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  ToleranceTally t;
  const auto held = conv_run(s, o, halo, conv);  // keeps a fresh run alive
  const ConvRun& run = *held;
  for (std::size_t e = 0; e < run.dx.size(); ++e) {
    bool all = true;
    for (const auto& g : run.dx[e]) all = all && g.defined();
    const std::string tag = exchange_tag(kExchanges[e]);
    if (!all) {
      t.expect_close(run.ref.dx, Tensor(), kConvBackward.tolerance, "dx undefined on a rank" + tag);
      continue;
    }
    t.expect_close(run.ref.dx, cat(run.dx[e], 1), kConvBackward.tolerance, "dx" + tag);
    t.expect_close_sum(run.ref.dw, run.dw[e], run.ref.dw_terms, kConvBackward.tolerance, "dw summed over ranks" + tag);
    t.expect_close_sum(run.ref.dbias, run.dbias[e], run.ref.dbias_terms, kConvBackward.tolerance, "dbias summed over ranks" + tag);
  }
  s.runs->conv.reset();  // the last row of the pair: its memory goes before the next row's
  return t.result(kConvBackward.tolerance);
}



namespace {

// Each rank's halo window of x.
void halo_golden(GoldenBuild& build) {
  const Tensor& x = build.conv_inputs().x;
  for (int r = 0; r < build.c.cp; ++r)
    build.ranks[r].add("halo", reference_history(x, build.g.start(r), build.g.size(r), build.o.conv_width),
                       "convolution_history(x shard, W): the W-1 positions before the shard (zeros before 0), then the "
                       "shard [B, L+W-1, C]",
                       "§3");
}

// The conv's inputs, its unsharded outputs and gradients, and each rank's part.
void conv_golden(GoldenBuild& build) {
  const inputs::Conv& in = build.conv_inputs();
  const Tensor &x = in.x, &w = in.weight, &bias = in.bias, &gy = in.grad_y;
  const std::int64_t B = build.B, P = build.P, C = build.o.channels;
  const int W = build.o.conv_width;
  build.inputs.add("x", x,
                   "activation [B, P, C], zero at padding: the conv and halo input, and what gather_sequence gathers",
                   "§3");
  build.inputs.add("conv_weight", w, "depthwise conv weight [C, W]", "§3");
  build.inputs.add("conv_bias", bias, "conv bias [C]", "§3");
  build.inputs.add("conv_grad_y", gy, "upstream gradient of the conv output [B, P, C]", "§3");
  const ConvReference conv = reference_conv(x, build.ids, w, bias, gy);
  build.ref.add("conv_y", conv.y, "packed causal conv output [B, P, C]", "§3");
  build.ref.add("conv_dx", conv.dx, "conv input gradient [B, P, C]", "§3");
  build.ref.add("conv_dw", conv.dw, "conv weight gradient [C, W]; ranks' partial dw summed", "§3");
  build.ref.add("conv_dbias", conv.dbias, "conv bias gradient [C]; ranks' partial dbias summed", "§3");
  for (int r = 0; r < build.c.cp; ++r) {
    GoldenFile& rank = build.ranks[r];
    const std::int64_t start = build.g.start(r), L = build.g.size(r);
    // This rank's part of the conv backward: the unsharded conv under the upstream
    // gradient of this rank's outputs only.
    Tensor gy_mine = Tensor::full(gy.shape(), DType::f64, 0.0);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = start; t < start + L; ++t)
        for (std::int64_t ch = 0; ch < C; ++ch) gy_mine.set((b * P + t) * C + ch, gy.get((b * P + t) * C + ch));
    const ConvReference part = reference_conv(x, build.ids, w, bias, gy_mine);
    rank.add("conv_dw_partial", part.dw,
             "this rank's dw [C, W] before the sum over ranks (its outputs' taps only); conv_dw is the sum", "§3");
    rank.add("conv_dbias_partial", part.dbias, "this rank's dbias [C] before the sum over ranks", "§3");
    rank.add("halo_grad", reference_history(part.dx, start, L, W),
             "gradient of this rank's halo window [B, L+W-1, C] (its conv's input gradient): the first W-1 "
             "positions go back to the ranks that own them",
             "§3");
    rank.add("conv_y", build.slice(conv.y, r), "this rank's conv output [B, L, C]", "§3");
    rank.add("conv_dx", build.slice(conv.dx, r), "gradient of this rank's x shard, halo returns included [B, L, C]",
             "§3");
  }
}

}  // namespace

namespace rows {

std::vector<PropertyRow> conv_rows() {
  const auto twice = [](const Prepared& p, const CheckOptions& o) { return 2 * halo_bytes(p, o); };
  return {kHaloForward.with(halo_bytes,
                            [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                              return halo_forward_of(p, o, or_default(impl.halo, default_halo));
                            },
                            halo_golden),
          kHaloBackward.with(twice,
                             [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                               return halo_backward_of(p, o, or_default(impl.halo, default_halo));
                             }),
          kConvForward.with(halo_bytes, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return conv_forward_of(p, o, impl.halo, impl.conv);
          },
          conv_golden),
          kConvBackward.with(twice, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return conv_backward_of(p, o, impl.halo, impl.conv);
          })};
}

}  // namespace rows

}  // namespace cpsim::verify
