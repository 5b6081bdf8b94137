// SPEC §2 known answers for contiguous sharding and the recurrent CP context.
#include <gtest/gtest.h>

#include "core/shard.hpp"

using namespace cpsim;

namespace {
Tensor i64(Shape s, std::vector<std::int64_t> v) { return Tensor::from<std::int64_t>(std::move(s), v); }
std::vector<std::int64_t> values(const Tensor& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t.get_int(i));
  return v;
}
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
  const FlaCpContext c = cp_context_from_global_cu({0, 5, 12}, 3, 1);
  EXPECT_EQ(c.cu_seqlens, (std::vector<std::int64_t>{0, 1, 4}));
  EXPECT_EQ(c.pre_num_conv_tokens, 4);
  EXPECT_EQ(c.pre_num_ranks, 1);
  EXPECT_EQ(c.post_num_ranks, 1);
  EXPECT_FALSE(c.is_first_rank);
  EXPECT_FALSE(c.is_last_rank);
  const FlaCpContext first = cp_context_from_global_cu({0, 5, 12}, 3, 0);
  EXPECT_TRUE(first.is_first_rank);
  EXPECT_EQ(first.post_num_ranks, 1);
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
