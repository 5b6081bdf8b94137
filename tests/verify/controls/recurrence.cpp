// Controls of the recurrence rows and two_steps (verify/rows/recurrence.cpp,
// steps.cpp): zigzag sharding, perturbed fold plans, a plan kept across steps.
#include "tests/verify/controls/controls.hpp"

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

Var recurrence_wrong_shape(const Var& q, const Var&, const Var&, const Var&, const Var&, const PackedContext&,
                           Communicator*) {
  return Var(Tensor({1, 1}, DType::f64), true);
}
Var recurrence_throws(const Var&, const Var&, const Var&, const Var&, const Var&, const PackedContext&,
                      Communicator*) {
  throw Planted();
}

}  // namespace

// The design the seeds rest on: under the load-balanced zigzag sharding (rank r
// holds chunks r and 2c-1-r), naive left-to-right state passing is wrong, and the
// property finds and shrinks a counterexample.
TEST(RecurrenceControls, RecurrenceUnderZigzagShardingIsCaught) {
  const std::string report = expect_counterexample("recurrence_forward under zigzag sharding", [](const LayoutCase& c) {
    const auto r = check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = default_recurrence(), .sharding = Sharding::zigzag});
    RC_ASSERT(r.ok);
  });
  expect_found(report);
  std::cout << "zigzag counterexample:\n" << report << "\n";
}

// S <- M_j S + S_ext_j from the nearest predecessor back instead of the farthest first.
TEST(RecurrenceControls, TwoStepsCatchAPlanKeptFromTheLastBatch) {
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

TEST(RecurrenceControls, RecurrenceCatchesAFoldInTheWrongOrder) {
  expect_plan_fault_found([](RecurrencePlan& p, int, int) { std::reverse(p.fold_forward.begin(), p.fold_forward.end()); },
                          "fold in the wrong order");
}

// The state carries across segment starts inside a shard.
TEST(RecurrenceControls, RecurrenceCatchesAMissingResetAtASegmentStartInsideAShard) {
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
TEST(RecurrenceControls, RecurrenceCatchesAFoldThatAssumesEqualIntervals) {
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
  expect_row_catches("fold assuming equal intervals", "recurrence_forward", CheckOptions{}, {.recurrence = broken});
  // The same code passes every case under the equal plan: the control plants
  // exactly the assumption, nothing else.
  const auto gen = gen_layout_case(8, PlanChoice{});
  for (int i = 0; i < 40; ++i) {
    const LayoutCase c = gen(rc::Random(77 + i), 30).value();
    EXPECT_TRUE(check_row("recurrence_forward", c, CheckOptions{}, {.recurrence = broken}).ok) << c;
  }
}

// Ranks publish (M, S_ext) of their first local segment instead of their last.
TEST(RecurrenceControls, RecurrenceCatchesTheFirstInsteadOfTheLastLocalSegment) {
  expect_plan_fault_found([](RecurrencePlan& p, int, int) { p.transition_segment = 0; },
                          "first instead of last local segment");
}

TEST(RecurrenceControls, PlantedFaultsRecurrenceThatThrowsOrReturnsTheWrongSize) {
  const CheckOptions o;
  expect_reported("recurrence wrong shape",
                  [&](const LayoutCase& c) { return check_row("recurrence_forward", c, o, {.recurrence = recurrence_wrong_shape}); });
  expect_reported("recurrence backward wrong shape",
                  [&](const LayoutCase& c) { return check_row("recurrence_backward", c, o, {.recurrence = recurrence_wrong_shape}); });
  expect_reported("recurrence throws",
                  [&](const LayoutCase& c) { return check_row("recurrence_forward", c, o, {.recurrence = recurrence_throws}); });
}
