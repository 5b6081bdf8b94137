// Every property must be able to fail: each is run against a deliberately broken
// variant of the code it checks, and must find (and shrink) a counterexample.
#include <gmock/gmock.h>

#include <cstring>
#include <map>
#include <mutex>

#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/recurrence.hpp"
#include "tests/rapidcheck_gtest.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/rows/common.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using cpsim::testing::expect_counterexample;
using ::testing::HasSubstr;

namespace {

// Doc ids decided from token ids: PAD tokens end documents and count as padding.
Layout layout_from_token_ids(const Batch& b) {
  const std::int64_t pad = 0;
  Layout layout = derive_layout(b);
  const Tensor& ids = b.at("input_ids");
  Tensor out(ids.shape(), DType::i64);
  const std::int64_t B = ids.dim(0), S = ids.dim(1);
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t doc = 1;
    for (std::int64_t s = 0; s < S; ++s) {
      const bool is_pad = ids.get_int(r * S + s) == pad;
      out.data<std::int64_t>()[r * S + s] = is_pad ? 0 : doc;
      if (is_pad && s > 0 && ids.get_int(r * S + s - 1) != pad) ++doc;
    }
  }
  layout.doc_ids = out;
  return layout;
}

// Each rank keeps [a_r + 1, a_{r+1} + 1): one token too far right.
ShardedBatch off_by_one_shard(int rank, int cp, const Batch& b, std::int64_t pad, bool primary, const PlanChoice& plan) {
  ShardedBatch mine = shard_batch_at(rank, cp, b, std::nullopt, pad, primary, 1, plan);
  if (rank + 1 >= cp) return mine;
  const ShardedBatch next = shard_batch_at(rank + 1, cp, b, std::nullopt, pad, primary, 1, plan);
  for (auto& [key, t] : mine.local) {
    if (!next.local.count(key) || t.ndim() != 2 || t.dim(1) != mine.context.local_seq_len()) continue;
    t = narrow(cat({t, next.local.at(key)}, 1), 1, 1, t.dim(1));
  }
  return mine;
}

// Shards concatenated in reverse rank order.
Var gather_reversed(const Var& x, Communicator* comm, bool, const ShardPlan* plan) {
  if (!is_distributed(comm)) return x;
  const Tensor g = all_gather_sequence_tensor(x.value(), *comm, plan);
  const ShardPlan p = plan_for("gather_reversed", plan, *comm, x.value().dim(1));
  std::vector<Tensor> blocks;
  for (int q = comm->size() - 1; q >= 0; --q) blocks.push_back(narrow(g, 1, p.begin(q), p.size(q)));
  return Var(cat(blocks, 1), false);
}

// Zeroes its input, then gathers it: the result is the zeroed global, so only the
// run's check of its inputs finds it where ranks read their inputs in place.
Var gather_zeroes_its_input(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan) {
  Tensor in = x.value();  // shares the storage
  if (in.nbytes() > 0) std::memset(in.raw(), 0, in.nbytes());
  return default_gather()(x, comm, differentiable, plan);
}

// Backward keeps only this rank's own slice instead of summing every rank's.
Var gather_backward_slices(const Var& x, Communicator* comm, bool, const ShardPlan* plan) {
  if (!is_distributed(comm)) return x;
  const ShardPlan p = plan_for("gather_backward_slices", plan, *comm, x.value().dim(1));
  const int r = comm->rank();
  return record(all_gather_sequence_tensor(x.value(), *comm, plan), "gather_backward_slices", {x},
                [p, r](const Tensor& g) { return std::vector<Tensor>{narrow(g, 1, p.begin(r), p.size(r))}; });
}

// A zero with no backward edge: ranks that ignore the gather skip its backward again.
Var anchor_without_edge(const Var& gathered) { return constant_scalar(0.0, gathered.value().dtype()); }

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

void expect_found(const std::string& report) {
  EXPECT_FALSE(report.empty()) << "the property passed every case against a broken implementation";
  EXPECT_THAT(report, HasSubstr("cp=")) << "the counterexample is not printed as a batch";
  if (std::getenv("CPSIM_SHOW_COUNTEREXAMPLES")) std::cout << report << "\n";
}

}  // namespace

TEST(NegativeControls, LayoutCatchesDocIdsBuiltFromTokenIds) {
  expect_found(expect_counterexample("layout vs doc ids from token ids", [](const LayoutCase& c) {
    const auto r = check_row("layout", c, {}, {.layout = layout_from_token_ids});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, ShardCatchesAnOffByOneShard) {
  expect_found(expect_counterexample("shard vs off-by-one shard", [](const LayoutCase& c) {
    const auto r = check_row("shard", c, {}, {.shard = off_by_one_shard});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, GatherForwardCatchesTheWrongRankOrder) {
  expect_found(expect_counterexample("gather_forward vs reversed ranks", [](const LayoutCase& c) {
    const auto r = check_row("gather_forward", c, CheckOptions{}, {.gather = gather_reversed});
    RC_ASSERT(r.ok);
  }));
}

// With one row, a rank's slices of the global inputs are read in place: a write
// into them changes what the row compares against (the gathered result equals the
// zeroed global). The run's check that its inputs are unchanged fails the row.
TEST(NegativeControls, GatherForwardCatchesAGatherThatWritesIntoItsInput) {
  const auto gen = gen_layout_case(4);
  int one_row = 0;
  for (int i = 0; i < 400 && one_row < 5; ++i) {
    const LayoutCase c = at_cp(gen(rc::Random(31 + i), 30).value(), 3);
    if (c.batch.at("input_ids").dim(0) != 1) continue;
    ++one_row;
    const auto r = check_row("gather_forward", c, CheckOptions{}, {.gather = gather_zeroes_its_input});
    EXPECT_FALSE(r.ok) << c;
    EXPECT_THAT(r.detail, HasSubstr("a rank wrote into its input")) << c;
  }
  EXPECT_EQ(one_row, 5) << "too few one-row cases drawn";
  expect_found(expect_counterexample("gather_forward vs a gather that zeroes its input", [](const LayoutCase& c) {
    const auto r = check_row("gather_forward", c, CheckOptions{}, {.gather = gather_zeroes_its_input});
    RC_ASSERT(r.ok);
  }));
}

// What run_reading compares: any one byte written, at any place of a tensor of any
// length (the eight lanes, the words after them, the tail), changes it.
TEST(NegativeControls, AnInputsFingerprintChangesWithAnyByteWritten) {
  for (std::int64_t n : {1, 7, 8, 9, 63, 64, 65, 71, 200}) {
    Tensor t({n}, DType::b8);
    for (std::int64_t i = 0; i < n; ++i) static_cast<unsigned char*>(t.raw())[i] = static_cast<unsigned char>(i * 37);
    const std::uint64_t before = rows::fingerprint(t);
    for (std::int64_t i = 0; i < n; ++i) {
      auto* byte = static_cast<unsigned char*>(t.raw()) + i;
      const unsigned char was = *byte;
      for (const int to_int : {was ^ 1, was ^ 0x80, 0}) {
        const auto to = static_cast<unsigned char>(to_int);
        if (to == was) continue;
        *byte = to;
        EXPECT_NE(rows::fingerprint(t), before) << n << " bytes, byte " << i << " written";
      }
      *byte = was;
    }
    EXPECT_EQ(rows::fingerprint(t), before);
  }
}

TEST(NegativeControls, GatherBackwardCatchesABackwardThatSlicesInsteadOfSumming) {
  expect_found(expect_counterexample("gather_backward vs slicing backward", [](const LayoutCase& c) {
    const auto r = check_row("gather_backward", c, CheckOptions{}, {.gather = gather_backward_slices});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, AnchorCatchesAnAnchorWithoutABackwardEdge) {
  expect_found(expect_counterexample("anchor vs anchor without edge", [](const LayoutCase& c) {
    const auto r = check_row("anchor", c, CheckOptions{}, {.gather = default_gather(), .anchor = anchor_without_edge});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, HaloForwardCatchesAHistoryOnePositionOff) {
  expect_found(expect_counterexample("halo_forward vs one position off", [](const LayoutCase& c) {
    const auto r = check_row("halo_forward", c, wide_conv(), {.halo = halo_one_position_off});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, HaloBackwardCatchesAGradientSentToTheWrongRank) {
  expect_found(expect_counterexample("halo_backward vs wrong rank", [](const LayoutCase& c) {
    const auto r = check_row("halo_backward", c, wide_conv(), {.halo = halo_gradient_to_wrong_rank});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, ConvForwardCatchesTapsThatIgnoreDocumentBoundaries) {
  expect_found(expect_counterexample("conv_forward vs ignored boundaries", [](const LayoutCase& c) {
    const auto r = check_row("conv_forward", c, wide_conv(), {.halo = default_halo(), .conv = conv_ignoring_documents});
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, ConvBackwardCatchesAGradientSentToTheWrongRank) {
  expect_found(expect_counterexample("conv_backward vs wrong rank", [](const LayoutCase& c) {
    const auto r = check_row("conv_backward", c, wide_conv(), {.halo = halo_gradient_to_wrong_rank});
    RC_ASSERT(r.ok);
  }));
}

// The design the seeds rest on: under the load-balanced zigzag sharding (rank r
// holds chunks r and 2c-1-r), naive left-to-right state passing is wrong, and the
// property finds and shrinks a counterexample.
TEST(NegativeControls, RecurrenceUnderZigzagShardingIsCaught) {
  const std::string report = expect_counterexample("recurrence_forward under zigzag sharding", [](const LayoutCase& c) {
    const auto r = check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = default_recurrence(), .sharding = Sharding::zigzag});
    RC_ASSERT(r.ok);
  });
  expect_found(report);
  std::cout << "zigzag counterexample:\n" << report << "\n";
}

namespace {
// The real operator running a perturbed plan: one mistake, no copied code.
void expect_plan_fault_found(const RecurrencePlanEdit& edit, const std::string& name) {
  const auto broken = [edit](const Var& q, const Var& k, const Var& v, const Var& b, const Var& g,
                             const PackedContext& ctx, Communicator* comm) {
    return gated_delta_rule(q, k, v, b, g, ctx, comm, edit);
  };
  expect_found(expect_counterexample(name, [&](const LayoutCase& c) {
    const auto r = check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = broken});
    RC_ASSERT(r.ok);
  }));
}
}  // namespace

// S <- M_j S + S_ext_j from the nearest predecessor back instead of the farthest first.
namespace {
// A plan made once per rank and kept across steps: the first context a rank sees
// is used for every later batch (a cache keyed by rank, never invalidated).
std::mutex stale_mutex;
std::map<int, PackedContext> stale_plans;
Var recurrence_with_a_stale_plan(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                                 const PackedContext& context, Communicator* comm) {
  PackedContext plan;
  {
    std::lock_guard<std::mutex> lock(stale_mutex);
    auto it = stale_plans.find(comm->rank());
    if (it == stale_plans.end()) it = stale_plans.emplace(comm->rank(), context).first;
    plan = it->second;
  }
  return gated_delta_rule(q, k, v, beta, g, plan, comm);
}
}  // namespace

TEST(NegativeControls, TwoStepsCatchAPlanKeptFromTheLastBatch) {
  expect_found(expect_counterexample("two steps vs a plan kept across steps", [](const LayoutCase& c) {
    {
      std::lock_guard<std::mutex> lock(stale_mutex);
      stale_plans.clear();  // a fresh loop for every case
    }
    RC_ASSERT(check_row("two_steps", c, CheckOptions{}, {.recurrence = recurrence_with_a_stale_plan}).ok);
  }));
  // The plans hold tensors: let them go now, not after the device runtime at exit.
  std::lock_guard<std::mutex> lock(stale_mutex);
  stale_plans.clear();
}

TEST(NegativeControls, RecurrenceCatchesAFoldInTheWrongOrder) {
  expect_plan_fault_found([](RecurrencePlan& p, int, int) { std::reverse(p.fold_forward.begin(), p.fold_forward.end()); },
                          "fold in the wrong order");
}

// The state carries across segment starts inside a shard.
TEST(NegativeControls, RecurrenceCatchesAMissingResetAtASegmentStartInsideAShard) {
  expect_plan_fault_found(
      [](RecurrencePlan& p, int, int) {
        p.segments = {p.segments.front(), p.segments.back()};
        p.transition_segment = 0;
      },
      "no reset inside a shard");
}

// The fold of a code that assumes equal intervals: the ranks before this one from
// the owner (at L = P/c) of the first segment's start, empty ones included. Right
// under the equal plan; wrong when the intervals differ.
TEST(NegativeControls, RecurrenceCatchesAFoldThatAssumesEqualIntervals) {
  const auto broken = [](const Var& q, const Var& k, const Var& v, const Var& b, const Var& g, const PackedContext& ctx,
                         Communicator* comm) {
    const RecurrencePlanEdit equal_fold = [&ctx](RecurrencePlan& p, int rank, int row) {
      const FlaCpContext cp = build_fla_cp_context(ctx, row);
      if (cp.pre_num_ranks == 0) return;
      const std::int64_t L = ctx.doc_ids().dim(1) / ctx.cp_size(), start = ctx.seq_start() - cp.pre_num_conv_tokens;
      p.fold_forward.clear();
      for (int j = static_cast<int>(start / L); j < rank; ++j) p.fold_forward.push_back(j);
    };
    return gated_delta_rule(q, k, v, b, g, ctx, comm, equal_fold);
  };
  expect_found(expect_counterexample("fold assuming equal intervals", [&](const LayoutCase& c) {
    RC_ASSERT(check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = broken}).ok);
  }));
  // The same code passes every case under the equal plan: the control plants
  // exactly the assumption, nothing else.
  const auto gen = gen_layout_case(8, PlanChoice{});
  for (int i = 0; i < 40; ++i) {
    const LayoutCase c = gen(rc::Random(77 + i), 30).value();
    EXPECT_TRUE(check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = broken}).ok) << c;
  }
}

// A balanced plan each rank computes from its own row (rank r balances row r % B):
// the ranks cut differently, and the shard property names the context's cuts.
TEST(NegativeControls, ShardCatchesAPlanComputedFromRankLocalRows) {
  const auto local_plan = [](int rank, int cp, const Batch& b, std::int64_t pad, bool primary, const PlanChoice& plan) {
    if (plan.kind != PlanChoice::Kind::balanced) return shard_batch_at(rank, cp, b, std::nullopt, pad, primary, 1, plan);
    Batch batch = b;
    normalize_batch_axis(batch);
    const Layout layout = derive_layout(batch);
    const std::int64_t row = rank % layout.doc_ids.dim(0), P = shard_geometry(layout.doc_ids.dim(1), cp).padded_len;
    PlanChoice mine;
    mine.kind = PlanChoice::Kind::cuts;
    mine.cuts = balanced_plan({token_costs(layout, P, plan.cost)[row]}, P, cp).cuts;
    return shard_batch_at(rank, cp, b, std::nullopt, pad, primary, 1, mine);
  };
  const std::string report = expect_counterexample("shard vs plans from rank-local rows", [&](const LayoutCase& c) {
    const auto r = check_row("shard", c, {}, {.shard = local_plan});
    if (!r.ok) RC_FAIL(r.detail);
  });
  expect_found(report);
  EXPECT_THAT(report, HasSubstr("plan=balanced"));
  EXPECT_THAT(report, HasSubstr("its plan cuts"));
}

// Ranks publish (M, S_ext) of their first local segment instead of their last.
TEST(NegativeControls, RecurrenceCatchesTheFirstInsteadOfTheLastLocalSegment) {
  expect_plan_fault_found([](RecurrencePlan& p, int, int) { p.transition_segment = 0; },
                          "first instead of last local segment");
}

// ---------------------------------------------------------------------------
// Planted faults: code under test that throws, or returns a result of the wrong
// size, is that property failing with its case, never a crash of the harness.

namespace {

struct Planted : std::runtime_error {
  Planted() : std::runtime_error("planted fault") {}
};

Layout layout_throws(const Batch&) { throw Planted(); }
// Doc ids and positions one column short; padding a row short.
Layout layout_short(const Batch& b) {
  Layout l = derive_layout(b);
  l.doc_ids = narrow(l.doc_ids, 1, 0, l.doc_ids.dim(1) - 1);
  l.positions = narrow(l.positions, 1, 0, l.positions.dim(1) - 1);
  l.padding = narrow(l.padding, 0, 0, l.padding.dim(0) - 1);
  return l;
}

ShardedBatch shard_throws(int, int, const Batch&, std::int64_t, bool, const PlanChoice&) { throw Planted(); }

// P rounded down instead of up: the context and every local tensor cover
// floor(S / c) * c positions (which may be none), cut equally.
ShardedBatch shard_rounded_down(int rank, int cp, const Batch& b, std::int64_t pad, bool primary, const PlanChoice&) {
  Batch batch = b;
  normalize_batch_axis(batch);
  const std::int64_t S = sequence_length(batch), P = S / cp * cp, L = P / cp;
  ShardedBatch out = shard_batch_at(rank, cp, batch, std::nullopt, pad, primary);
  for (auto& [key, t] : out.local)
    if (t.dim(1) > L) t = narrow(t, 1, 0, key == "input_ids" && !primary ? P : L);
  out.context = PackedContext(narrow(out.context.doc_ids(), 1, 0, P), equal_plan(P, cp), rank, S);
  return out;
}

// One rank throws before the collective the others enter.
Var gather_throws_on_rank_0(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan) {
  if (!comm || comm->rank() == 0) throw Planted();
  return gather_sequence(x, comm, differentiable, plan);
}
// The local shard comes back as if it were the gathered sequence.
Var gather_returns_the_shard(const Var& x, Communicator*, bool, const ShardPlan*) { return x; }

Var anchor_throws(const Var&) { throw Planted(); }

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

Var recurrence_wrong_shape(const Var& q, const Var&, const Var&, const Var&, const Var&, const PackedContext&,
                           Communicator*) {
  return Var(Tensor({1, 1}, DType::f64), true);
}
Var recurrence_throws(const Var&, const Var&, const Var&, const Var&, const Var&, const PackedContext&,
                      Communicator*) {
  throw Planted();
}

// Every planted property must fail on some case, report why, and leave the process standing.
template <class Check>
void expect_reported(const std::string& name, Check check) {
  const std::string report = expect_counterexample(name, [&](const LayoutCase& c) {
    const PropertyResult r = check(c);
    RC_ASSERT(r.ok || !r.detail.empty());  // a failure always says why
    RC_ASSERT(r.ok);
  }, 100);
  EXPECT_FALSE(report.empty()) << name << ": the property passed every case";
  EXPECT_THAT(report, HasSubstr("cp=")) << name;
  EXPECT_THAT(report, ::testing::Not(HasSubstr("a failure always says why"))) << name << ": " << report;
}

}  // namespace

TEST(PlantedFaults, LayoutThatThrowsOrReturnsTheWrongSize) {
  expect_reported("layout throws", [](const LayoutCase& c) { return check_row("layout", c, {}, {.layout = layout_throws}); });
  expect_reported("layout short", [](const LayoutCase& c) { return check_row("layout", c, {}, {.layout = layout_short}); });
}

TEST(PlantedFaults, ShardThatThrowsOrRoundsThePaddedLengthDown) {
  expect_reported("shard throws", [](const LayoutCase& c) { return check_row("shard", c, {}, {.shard = shard_throws}); });
  expect_reported("shard rounds P down", [](const LayoutCase& c) { return check_row("shard", c, {}, {.shard = shard_rounded_down}); });
}

TEST(PlantedFaults, GatherAndAnchorThatThrowOrReturnTheWrongSize) {
  const CheckOptions o;
  expect_reported("gather throws", [&](const LayoutCase& c) { return check_row("gather_forward", c, o, {.gather = gather_throws_on_rank_0}); });
  expect_reported("gather backward throws",
                  [&](const LayoutCase& c) { return check_row("gather_backward", c, o, {.gather = gather_throws_on_rank_0}); });
  expect_reported("gather returns the shard",
                  [&](const LayoutCase& c) { return check_row("gather_forward", c, o, {.gather = gather_returns_the_shard}); });
  expect_reported("gather backward of the shard",
                  [&](const LayoutCase& c) { return check_row("gather_backward", c, o, {.gather = gather_returns_the_shard}); });
  expect_reported("anchor throws",
                  [&](const LayoutCase& c) { return check_row("anchor", c, o, {.gather = default_gather(), .anchor = anchor_throws}); });
}

TEST(PlantedFaults, HaloAndConvThatThrowOrReturnTheWrongSize) {
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

TEST(PlantedFaults, RecurrenceThatThrowsOrReturnsTheWrongSize) {
  const CheckOptions o;
  expect_reported("recurrence wrong shape",
                  [&](const LayoutCase& c) { return check_row("recurrence_forward", c, o, {.recurrence = recurrence_wrong_shape}); });
  expect_reported("recurrence backward wrong shape",
                  [&](const LayoutCase& c) { return check_row("recurrence_backward", c, o, {.recurrence = recurrence_wrong_shape}); });
  expect_reported("recurrence throws",
                  [&](const LayoutCase& c) { return check_row("recurrence_forward", c, o, {.recurrence = recurrence_throws}); });
}

// A user's batch has no construction truth: the layout property must still compare
// with an independent reference, never with the code under test. The old bug of
// reading cu_seqlens_padded alone as an unpacked row is caught on such cases.
TEST(NegativeControls, LayoutOfAUserBatchCatchesCuSeqlensPaddedReadAsUnpacked) {
  const auto merged = [](const Batch& b) {
    Batch copy = b;
    if (!copy.count("cu_seqlens")) copy.erase("cu_seqlens_padded");
    return derive_layout(copy);
  };
  expect_found(expect_counterexample("layout of user batches vs cu_seqlens_padded ignored", [&](LayoutCase c) {
    c.truth.reset();
    const auto r = check_row("layout", c, {}, {.layout = merged});
    RC_ASSERT(r.ok);
  }));
}

// A layout that ignores position_ids resets (reads a flattening collator's row as
// one document, the attention leak across documents) is caught on user batches.
TEST(NegativeControls, LayoutOfAUserBatchCatchesPositionResetsIgnored) {
  const auto one_document = [](const Batch& b) {
    Batch copy = b;
    if (!copy.count("seq_lens") && !copy.count("cu_seqlens") && !copy.count("cu_seqlens_padded")) copy.erase("position_ids");
    Layout layout = derive_layout(copy);
    if (b.count("position_ids")) layout.positions = b.at("position_ids").to(DType::i64);
    return layout;
  };
  // Only rows packed by position resets: the bug shows on no other form.
  const auto resets = rc::gen::map(gen_layout_spec(8), [](LayoutSpec spec) {
    spec.form = LayoutForm::position_resets;
    return build_case(spec);
  });
  expect_found(expect_counterexample("layout of user batches vs position resets ignored", [&] {
    LayoutCase c = *resets;
    c.truth.reset();
    const auto r = check_row("layout", c, {}, {.layout = one_document});
    RC_ASSERT(r.ok);
  }));
}
