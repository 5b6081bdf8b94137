// SPEC §2 known answers for contiguous sharding and the recurrent CP context.
#include <gtest/gtest.h>

#include "core/exchange_plan.hpp"
#include "core/shard.hpp"
#include "core/comm/run_ranks.hpp"
#include "core/gather.hpp"

#include <optional>

#include "tests/tensor_helpers.hpp"

using namespace cpsim;

namespace {
using cpsim::testing::i64;
using cpsim::testing::values;
}  // namespace

TEST(Shard, GeometryPadsToAMultipleOfCpTimesPadMultiple) {
  const auto g = shard_geometry(10, 3);
  EXPECT_EQ(g.padded_len, 12);
  EXPECT_EQ(g.local_len, 4);
  EXPECT_EQ(shard_geometry(10, 3, 4).padded_len, 12);
  EXPECT_EQ(shard_geometry(13, 3, 4).padded_len, 24);
  EXPECT_EQ(shard_geometry(8, 1).padded_len, 8);
}

TEST(Shard, SpecKnownAnswerForTheRecurrentContext) {
  const FlaCpContext c = cp_context_from_global_cu({0, 5, 12}, equal_plan(12, 3), 1);
  EXPECT_EQ(c.cu_seqlens, (std::vector<std::int64_t>{0, 1, 4}));
  EXPECT_EQ(c.pre_num_conv_tokens, 4);
  EXPECT_EQ(c.pre_num_ranks, 1);
  EXPECT_EQ(c.post_num_ranks, 1);
  EXPECT_FALSE(c.is_first_rank);
  EXPECT_FALSE(c.is_last_rank);
  const FlaCpContext first = cp_context_from_global_cu({0, 5, 12}, equal_plan(12, 3), 0);
  EXPECT_TRUE(first.is_first_rank);
  EXPECT_EQ(first.post_num_ranks, 1);
}

TEST(Shard, TheRecurrentContextUnderAnUnequalPlanCountsOnlyRanksItReaches) {
  // One document over [0, 12); cuts [0, 3, 3, 10, 12]: rank 1 is empty.
  const ShardPlan plan{{0, 3, 3, 10, 12}};
  const FlaCpContext r2 = cp_context_from_global_cu({0, 12}, plan, 2);
  EXPECT_EQ(r2.cu_seqlens, (std::vector<std::int64_t>{0, 7}));
  EXPECT_EQ(r2.pre_num_conv_tokens, 3);
  EXPECT_EQ(r2.pre_num_ranks, 1);  // rank 0 only: the empty rank 1 is not counted
  EXPECT_EQ(r2.post_num_ranks, 1);
  const FlaCpContext empty = cp_context_from_global_cu({0, 12}, plan, 1);
  EXPECT_EQ(empty.cu_seqlens, (std::vector<std::int64_t>{0}));
  EXPECT_EQ(empty.pre_num_ranks + empty.post_num_ranks + empty.pre_num_conv_tokens, 0);
  EXPECT_TRUE(empty.is_first_rank && empty.is_last_rank);
  const RecurrencePlan fold = recurrence_plan(r2, plan, 2);
  EXPECT_EQ(fold.fold_forward, (std::vector<int>{0}));
  EXPECT_EQ(fold.fold_backward, (std::vector<int>{3}));
  const RecurrencePlan last = recurrence_plan(cp_context_from_global_cu({0, 12}, plan, 3), plan, 3);
  EXPECT_EQ(last.fold_forward, (std::vector<int>{0, 2}));  // left to right, skipping rank 1
}

TEST(Shard, ShardBatchCutsWhereThePlanSays) {
  Batch b;
  b["input_ids"] = Tensor::from<std::int64_t>({1, 10}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  b["seq_lens"] = Tensor::from<std::int64_t>({1, 2}, {4, 6});
  PlanChoice cuts;
  cuts.kind = PlanChoice::Kind::cuts;
  cuts.cuts = {0, 7, 7, 12};  // P = roundup(10, 3) = 12
  const ShardedBatch r0 = shard_batch_at(0, 3, b, std::nullopt, 0, true, 1, cuts);
  EXPECT_EQ(values(r0.local.at("input_ids")), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(r0.context.row_cu_seqlens(0), (std::vector<std::int64_t>{0, 4, 7}));
  const ShardedBatch r1 = shard_batch_at(1, 3, b, std::nullopt, 0, true, 1, cuts);
  EXPECT_EQ(r1.local.at("input_ids").dim(1), 0);
  EXPECT_EQ(r1.context.local_seq_len(), 0);
  EXPECT_EQ(r1.context.seq_start(), 7);
  EXPECT_EQ(r1.context.row_cu_seqlens(0), (std::vector<std::int64_t>{0}));
  const ShardedBatch r2 = shard_batch_at(2, 3, b, std::nullopt, 0, true, 1, cuts);
  EXPECT_EQ(values(r2.local.at("input_ids")), (std::vector<std::int64_t>{8, 9, 10, 0, 0}));
  // The balanced plan of causal attention: costs 1 2 3 4 | 1 2 3 4 5 6 (total 31):
  // a_1 is the first t with 2 * cost[0, t) >= 31: cost[0, 7) = 10 + 6 = 16.
  const ShardedBatch bal = shard_batch_at(1, 2, b, std::nullopt, 0, true, 1, parse_plan_choice("balanced"));
  EXPECT_EQ(bal.context.plan().cuts, (std::vector<std::int64_t>{0, 7, 10}));
  // Cuts that do not fit are invalid input naming the plan.
  cuts.cuts = {0, 11, 10, 12};
  EXPECT_THROW(shard_batch_at(0, 3, b, std::nullopt, 0, true, 1, cuts), InvalidInput);
  cuts.cuts = {0, 5, 10};
  EXPECT_THROW(shard_batch_at(0, 3, b, std::nullopt, 0, true, 1, cuts), InvalidInput);
}

TEST(Shard, FillValuesAndSlices) {
  Batch b{{"input_ids", i64({1, 5}, {5, 6, 7, 8, 9})},
          {"labels", i64({1, 5}, {6, 7, 8, 9, 1})},
          {"seq_lens", i64({1, 2}, {2, 3})}};
  Tensor loss_mask = i64({1, 5}, {1, 1, 1, 1, 0});
  const ShardedBatch last = shard_batch_at(2, 3, b, loss_mask, 99, false);  // P = 6, L = 2
  EXPECT_EQ(values(last.local.at("labels")), (std::vector<std::int64_t>{1, -100}));
  EXPECT_EQ(values(last.local.at("position_ids")), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(values(last.local.at("padding_mask")), (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(values(last.local.at("loss_mask")), (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(values(last.local.at("input_ids")), (std::vector<std::int64_t>{5, 6, 7, 8, 9, 99}));  // stays global
  EXPECT_EQ(values(last.context.local_doc_ids()), (std::vector<std::int64_t>{2, 0}));
  EXPECT_EQ(last.context.row_cu_seqlens(0), (std::vector<std::int64_t>{0, 1, 2}));
  const ShardedBatch primary = shard_batch_at(2, 3, b, std::nullopt, 99, true);
  EXPECT_EQ(values(primary.local.at("input_ids")), (std::vector<std::int64_t>{9, 99}));
  EXPECT_FALSE(primary.local.count("seq_lens"));
}

TEST(Shard, NullCommunicatorIsOneRank) {
  Batch b{{"input_ids", i64({1, 3}, {1, 2, 3})}};
  const ShardedBatch s = shard_batch(nullptr, b);
  EXPECT_FALSE(s.context.cp_enabled());
  EXPECT_EQ(s.context.local_seq_len(), 3);
}

// SPEC §2: every other [B, S] key is padded with 0 and sliced like labels, whether
// or not S divides by c.
TEST(Shard, OtherSequenceKeysArePaddedWithZeroAndSliced) {
  for (const std::int64_t S : {5, 6}) {
    std::vector<std::int64_t> ids(S), types(S);
    for (std::int64_t s = 0; s < S; ++s) ids[s] = 10 + s, types[s] = 1 + s % 2;
    Batch b{{"input_ids", i64({1, S}, ids)}, {"token_type_ids", i64({1, S}, types)}};
    std::vector<std::int64_t> joined;
    for (int r = 0; r < 3; ++r) {
      const ShardedBatch sb = shard_batch_at(r, 3, b, std::nullopt, 0, false);
      ASSERT_TRUE(sb.local.count("token_type_ids"));
      EXPECT_EQ(sb.local.at("token_type_ids").shape(), (Shape{1, 2})) << "S=" << S << " rank " << r;
      for (auto v : values(sb.local.at("token_type_ids"))) joined.push_back(v);
    }
    std::vector<std::int64_t> want = types;
    want.resize(6, 0);
    EXPECT_EQ(joined, want) << "S=" << S;
  }
}

// The row_cu_seqlens cache: answers belong to the context's own batch and row,
// through copies, moves, reassignment and reuse across rows and batches.
TEST(Shard, PackedContextCacheFollowsItsBatchThroughCopyMoveAndReassignment) {
  const Batch one{{"input_ids", i64({2, 6}, {1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2})},
                  {"seq_lens", i64({2, 3}, {2, 4, -1000, 6, -1000, -1000})}};
  const Batch two{{"input_ids", i64({2, 6}, {3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4})},
                  {"seq_lens", i64({2, 3}, {1, 1, 4, 3, 3, -1000})}};
  using Cu = std::vector<std::int64_t>;
  // cp = 2, L = 3. one: row 0 ids 1 1 2 2 2 2, row 1 all 1; two: row 0 ids 1 2 3 3 3 3, row 1 1 1 1 2 2 2.
  ShardedBatch a = shard_batch_at(1, 2, one, std::nullopt, 0, false);
  EXPECT_EQ(a.context.row_cu_seqlens(0), (Cu{0, 3}));  // doc 2 covers [2, 6)
  EXPECT_EQ(a.context.row_cu_seqlens(1), (Cu{0, 3}));
  const ShardedBatch b = shard_batch_at(0, 2, two, std::nullopt, 0, false);  // [0, 3)
  EXPECT_EQ(b.context.row_cu_seqlens(0), (Cu{0, 1, 2, 3}));
  EXPECT_EQ(b.context.row_cu_seqlens(1), (Cu{0, 3}));

  PackedContext copy = a.context;  // a copy answers for the same batch
  EXPECT_EQ(copy.row_cu_seqlens(0), (Cu{0, 3}));
  copy = b.context;  // reassigned: its cached rows must not survive
  EXPECT_EQ(copy.row_cu_seqlens(0), (Cu{0, 1, 2, 3}));
  EXPECT_EQ(copy.row_cu_seqlens(1), (Cu{0, 3}));
  EXPECT_EQ(a.context.row_cu_seqlens(0), (Cu{0, 3}));  // the source is untouched

  PackedContext moved = std::move(copy);
  EXPECT_EQ(moved.row_cu_seqlens(0), (Cu{0, 1, 2, 3}));
  moved = std::move(a.context);
  EXPECT_EQ(moved.row_cu_seqlens(0), (Cu{0, 3}));
  EXPECT_EQ(moved.seq_start(), 3);

  PackedContext& self = moved;
  moved = self;  // self-assignment keeps the answers
  EXPECT_EQ(moved.row_cu_seqlens(1), (Cu{0, 3}));

  // A ShardedBatch reused for the next batch, the way a training loop reuses its variables.
  ShardedBatch step = shard_batch_at(1, 2, one, std::nullopt, 0, false);
  EXPECT_EQ(step.context.row_cu_seqlens(0), (Cu{0, 3}));
  step = shard_batch_at(1, 2, two, std::nullopt, 0, false);  // [3, 6) of two: row 0 ids 3 3 3 -> one segment
  EXPECT_EQ(step.context.row_cu_seqlens(0), (Cu{0, 3}));
  EXPECT_EQ(step.context.row_cu_seqlens(1), (Cu{0, 3}));
  EXPECT_EQ(values(step.context.local_doc_ids()), (std::vector<std::int64_t>{3, 3, 3, 2, 2, 2}));
  step = shard_batch_at(0, 2, two, std::nullopt, 0, false);
  EXPECT_EQ(step.context.row_cu_seqlens(0), (Cu{0, 1, 2, 3}));
}

// Ranks whose plans differ (a plan file per rank, or a balanced plan computed from
// rank-local data) are a named error in shard_batch, before any operator runs; on
// every backend through the one all-gather of the cuts.
TEST(Shard, RanksThatCutDifferentlyAreANamedError) {
  Batch b;
  b["input_ids"] = Tensor::from<std::int64_t>({1, 9}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  b["seq_lens"] = Tensor::from<std::int64_t>({1, 2}, {4, 5});
  for (const char* backend : {"threads", "gloo"}) {
    std::string error;
    try {
      run_ranks(3, [&](Communicator& comm) {
        PlanChoice mine;
        mine.kind = PlanChoice::Kind::cuts;
        mine.cuts = comm.rank() == 1 ? std::vector<std::int64_t>{0, 4, 5, 9} : std::vector<std::int64_t>{0, 3, 6, 9};
        shard_batch(&comm, b, std::nullopt, 0, false, 1, mine);
      }, {backend});
    } catch (const InvalidInput& e) {
      error = e.what();
    }
    EXPECT_NE(error.find("ranks disagree on the cuts"), std::string::npos) << backend << ": " << error;
    EXPECT_NE(error.find("[0, 4, 5, 9]"), std::string::npos) << backend << ": " << error;
  }
  // Agreeing ranks pass, and each holds its own interval.
  std::vector<std::int64_t> sizes(3);
  run_ranks(3, [&](Communicator& comm) {
    sizes[comm.rank()] = shard_batch(&comm, b, std::nullopt, 0, false, 1, parse_plan_choice("balanced")).context.local_seq_len();
  });
  EXPECT_EQ(sizes[0] + sizes[1] + sizes[2], 9);
}

// The gather of unequal intervals, forward and backward, by hand: rank r holds
// [a_r, a_{r+1}) of one row of 7 positions, cuts [0, 4, 4, 7].
TEST(Gather, UnequalIntervalsGatherAndScatterBack) {
  const ShardPlan plan{{0, 4, 4, 7}};
  std::vector<Tensor> got(3), grads(3);
  run_ranks(3, [&](Communicator& comm) {
    const int r = comm.rank();
    Tensor x({1, plan.size(r)}, DType::f64);
    for (std::int64_t i = 0; i < plan.size(r); ++i) x.set(i, static_cast<double>(plan.begin(r) + i));
    Var xv(x, true);
    const Var g = gather_sequence(xv, &comm, true, &plan);
    Tensor up({1, 7}, DType::f64);
    for (std::int64_t i = 0; i < 7; ++i) up.set(i, static_cast<double>((r + 1) * 100 + i));
    backward(dot(g, up));
    got[r] = g.value();
    grads[r] = xv.grad().defined() ? xv.grad() : Tensor({1, 0}, DType::f64);
  }, {}, {&got, &grads});
  for (int r = 0; r < 3; ++r) EXPECT_EQ(values(got[r]), (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6})) << r;
  // Rank r's gradient: sum over q of (q+1)*100 + position, positions of its interval.
  EXPECT_EQ(values(grads[0]), (std::vector<std::int64_t>{600, 603, 606, 609}));
  EXPECT_EQ(grads[1].numel(), 0);
  EXPECT_EQ(values(grads[2]), (std::vector<std::int64_t>{612, 615, 618}));
}

// The CP plan as pure functions (core/exchange_plan.hpp).
TEST(Plan, HaloHopsSpanEarlierRanksWhenTheShardIsShorterThanTheWindow) {
  const HaloPlan p = halo_plan(equal_plan(10, 5), /*width=*/6, /*rank=*/3);  // L = 2, H = 5
  EXPECT_EQ(p.history, 5);
  EXPECT_EQ(p.tail, 2);
  ASSERT_EQ(p.hops.size(), 3u);
  EXPECT_EQ(p.hops[0].send_count, 2);
  EXPECT_EQ(p.hops[0].recv_count, 2);
  EXPECT_EQ(p.hops[1].recv_count, 2);
  EXPECT_EQ(p.hops[2].recv_count, 1);
  EXPECT_EQ(p.hops[0].dst, 4);
  EXPECT_EQ(p.hops[0].src, 2);
  EXPECT_EQ(p.hops[1].dst, -1);  // rank 5 does not exist
  EXPECT_EQ(p.hops[2].src, 0);
  EXPECT_TRUE(halo_plan(equal_plan(8, 1), 4, 0).hops.empty());  // one rank: nothing to exchange
}

TEST(Plan, HaloHopsPassOverEmptyRanks) {
  // cuts [0, 5, 5, 5, 9], W = 4 (H = 3): rank 3's window [2, 5) lies on rank 0, three ranks back.
  const ShardPlan plan{{0, 5, 5, 5, 9}};
  const HaloPlan r3 = halo_plan(plan, 4, 3);
  // The empty ranks 1 and 2 receive their windows too (rank 0's last 3 positions),
  // at distances 1 and 2; rank 3's comes from distance 3, over them.
  ASSERT_EQ(r3.hops.size(), 3u);
  EXPECT_EQ(r3.hops[0].src, -1);  // rank 2 holds nothing
  EXPECT_EQ(r3.hops[1].src, -1);
  EXPECT_EQ(r3.hops[2].distance, 3);
  EXPECT_EQ(r3.hops[2].src, 0);
  EXPECT_EQ(r3.hops[2].recv_count, 3);
  const HaloPlan r0 = halo_plan(plan, 4, 0);
  EXPECT_EQ(r0.hops[2].dst, 3);
  EXPECT_EQ(r0.hops[2].send_count, 3);
  EXPECT_EQ(r0.hops[0].dst, 1);
  EXPECT_EQ(r0.tail, 3);
  // Rank 1 (empty) sends nothing at any distance.
  for (const HaloHop& hop : halo_plan(plan, 4, 1).hops) EXPECT_EQ(hop.dst, -1);
}

TEST(Plan, RecurrenceFoldsFollowTheSpecKnownAnswer) {
  // Global cu [0, 5, 12], c = 3: rank 1 holds [4, 8), local cu [0, 1, 4].
  const RecurrencePlan p = recurrence_plan(cp_context_from_global_cu({0, 5, 12}, equal_plan(12, 3), 1), equal_plan(12, 3), 1);
  EXPECT_EQ(p.segments, (std::vector<std::int64_t>{0, 1, 4}));
  EXPECT_EQ(p.fold_forward, (std::vector<int>{0}));
  EXPECT_EQ(p.fold_backward, (std::vector<int>{2}));
  EXPECT_EQ(p.transition_segment, 1u);
  EXPECT_TRUE(p.publishes_transition);
  EXPECT_TRUE(p.publishes_state_gradient);
  // One document over four ranks: rank 3 folds 0, 1, 2 left to right.
  const RecurrencePlan last = recurrence_plan(cp_context_from_global_cu({0, 8}, equal_plan(8, 4), 3), equal_plan(8, 4), 3);
  EXPECT_EQ(last.fold_forward, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(last.fold_backward.empty());
  EXPECT_FALSE(last.publishes_transition);
}
