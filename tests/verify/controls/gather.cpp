// Controls of the gather rows and the anchor (verify/rows/gather.cpp).
#include "tests/verify/controls/controls.hpp"

namespace {

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

// One rank throws before the collective the others enter.
Var gather_throws_on_rank_0(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan) {
  if (!comm || comm->rank() == 0) throw Planted();
  return gather_sequence(x, comm, differentiable, plan);
}
// The local shard comes back as if it were the gathered sequence.
Var gather_returns_the_shard(const Var& x, Communicator*, bool, const ShardPlan*) { return x; }

Var anchor_throws(const Var&) { throw Planted(); }

}  // namespace

TEST(GatherControls, GatherForwardCatchesTheWrongRankOrder) {
  expect_row_catches("gather_forward vs reversed ranks", "gather_forward", CheckOptions{}, {.gather = gather_reversed});
}

// With one row, a rank's slices of the global inputs are read in place: a write
// into them changes what the row compares against (the gathered result equals the
// zeroed global). The run's check that its inputs are unchanged fails the row.
TEST(GatherControls, GatherForwardCatchesAGatherThatWritesIntoItsInput) {
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
  expect_row_catches("gather_forward vs a gather that zeroes its input", "gather_forward", CheckOptions{}, {.gather = gather_zeroes_its_input});
}

// What run_reading compares: any one byte written, at any place of a tensor of any
// length (the eight lanes, the words after them, the tail), changes it.
TEST(GatherControls, AnInputsFingerprintChangesWithAnyByteWritten) {
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

TEST(GatherControls, GatherBackwardCatchesABackwardThatSlicesInsteadOfSumming) {
  expect_row_catches("gather_backward vs slicing backward", "gather_backward", CheckOptions{}, {.gather = gather_backward_slices});
}

TEST(GatherControls, AnchorCatchesAnAnchorWithoutABackwardEdge) {
  expect_row_catches("anchor vs anchor without edge", "anchor", CheckOptions{}, {.gather = default_gather(), .anchor = anchor_without_edge});
}

TEST(GatherControls, PlantedFaultsGatherAndAnchorThatThrowOrReturnTheWrongSize) {
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
