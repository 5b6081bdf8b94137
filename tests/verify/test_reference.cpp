// The references are the oracle: known answers for them, written by hand from
// SPEC §1-§2, so that a reference bug cannot hide behind agreement with core/.
#include <gmock/gmock.h>

#include "verify/reference.hpp"

#include "tests/tensor_helpers.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {
using cpsim::testing::i64;
using cpsim::testing::values;
using V = std::vector<std::int64_t>;
}  // namespace

TEST(Reference, SpecExample) {
  const Batch b{{"input_ids", i64({1, 8}, {5, 6, 0, 0, 7, 0, 0, 0})},
                {"seq_lens", i64({1, 3}, {3, 2, -1000})},
                {"seq_lens_padded", i64({1, 3}, {4, 2, -1000})}};
  const LayoutTruth t = reference_layout(b);
  EXPECT_EQ(values(t.doc_ids), (V{1, 1, 1, 1, 2, 2, 0, 0}));
  EXPECT_EQ(values(t.padding), (V{0, 0, 0, 1, 0, 0, 1, 1}));
  EXPECT_EQ(values(t.positions), (V{0, 1, 2, 3, 0, 1, 2, 3}));
}

// The batch that once merged two documents: only cu_seqlens_padded, given 1-D.
TEST(Reference, CuSeqlensPaddedAloneKeepsDocumentsApart) {
  const Batch b{{"input_ids", i64({17}, {7, 7, 7, 7, 7, 0, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0})},
                {"cu_seqlens_padded", i64({3}, {0, 6, 13})}};
  const LayoutTruth t = reference_layout(b);
  EXPECT_EQ(values(t.doc_ids), (V{1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0}));
  EXPECT_EQ(values(t.padding), (V{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(values(t.positions), (V{0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(reference_shape(b).rows, 1);
  EXPECT_EQ(reference_shape(b).seq_len, 17);
}

TEST(Reference, BothCuKeysSeparateRealFromOccupied) {
  const Batch b{{"input_ids", i64({1, 7}, {1, 2, 3, 4, 5, 6, 7})},
                {"cu_seqlens", i64({4}, {0, 2, 4, -1})},
                {"cu_seqlens_padded", i64({4}, {0, 3, 5, -1})}};
  const LayoutTruth t = reference_layout(b);
  EXPECT_EQ(values(t.doc_ids), (V{1, 1, 1, 2, 2, 0, 0}));
  EXPECT_EQ(values(t.padding), (V{0, 0, 1, 0, 0, 1, 1}));
}

TEST(Reference, UnpackedRowsFromMasksAndPositionIdsOnly) {
  const Batch left{{"input_ids", i64({1, 5}, {0, 0, 4, 5, 6})}, {"attention_mask", i64({1, 5}, {0, 0, 1, 1, 1})}};
  const LayoutTruth l = reference_layout(left);
  EXPECT_EQ(values(l.doc_ids), (V{0, 0, 1, 1, 1}));
  EXPECT_EQ(values(l.positions), (V{0, 1, 0, 1, 2}));
  const Batch right{{"input_ids", i64({1, 5}, {4, 5, 0, 0, 0})},
                    {"padding_mask", Tensor::from<bool>({1, 5}, {false, false, true, true, true})}};
  EXPECT_EQ(values(reference_layout(right).positions), (V{0, 1, 2, 3, 4}));
  const Batch positions{{"input_ids", i64({1, 4}, {1, 2, 3, 4})}, {"position_ids", i64({1, 4}, {5, 6, 7, 8})}};
  const LayoutTruth p = reference_layout(positions);
  EXPECT_EQ(values(p.doc_ids), (V{1, 1, 1, 1}));
  EXPECT_EQ(values(p.padding), (V{0, 0, 0, 0}));
  EXPECT_EQ(values(p.positions), (V{5, 6, 7, 8}));
}

TEST(Reference, GeometryRoundsUpToCpTimesPadMultiple) {
  const auto g = reference_geometry(10, 3);
  EXPECT_EQ(g.padded_len, 12);
  EXPECT_EQ(g.size(1), 4);
  EXPECT_EQ(g.start(2), 8);
  EXPECT_EQ(reference_geometry(13, 3, 4).padded_len, 24);
  EXPECT_EQ(reference_geometry(8, 1).padded_len, 8);
}

TEST(Reference, PaddedGlobalFillsEveryKey) {
  LayoutCase c;
  c.batch = {{"input_ids", i64({1, 5}, {5, 6, 7, 8, 9})},
             {"labels", i64({1, 5}, {6, 7, 8, 9, 1})},
             {"token_type_ids", i64({1, 5}, {1, 1, 2, 2, 2})},
             {"seq_lens", i64({1, 2}, {2, 3})}};
  c.pad_token_id = 99;
  const Batch g = reference_padded_global(c, 6);
  EXPECT_EQ(values(g.at("input_ids")), (V{5, 6, 7, 8, 9, 99}));
  EXPECT_EQ(values(g.at("labels")), (V{6, 7, 8, 9, 1, -100}));
  EXPECT_EQ(values(g.at("token_type_ids")), (V{1, 1, 2, 2, 2, 0}));
  EXPECT_EQ(values(g.at("position_ids")), (V{0, 1, 0, 1, 2, 3}));
  EXPECT_EQ(values(g.at("padding_mask")), (V{0, 0, 0, 0, 0, 1}));
  EXPECT_FALSE(g.count("seq_lens"));
}

// Integers past 2^53 are copied exactly, never through double.
TEST(Reference, LargeTokenIdsAreCopiedExactly) {
  LayoutCase c;
  const std::int64_t big = (std::int64_t{1} << 60) + 1;
  c.batch = {{"input_ids", i64({1, 2}, {big, big + 2})}, {"labels", i64({1, 2}, {big + 4, -100})}};
  const Batch g = reference_padded_global(c, 4);
  EXPECT_EQ(values(g.at("input_ids")), (V{big, big + 2, 0, 0}));
  EXPECT_EQ(values(g.at("labels")), (V{big + 4, -100, -100, -100}));
}

// The reference's own reading of a batch with only position_ids: a document per
// run that starts at a reset to 0; padding (mask 0) is doc 0.
TEST(Reference, PositionIdsAloneGiveTheDocumentsAtTheirResets) {
  const Batch b{{"input_ids", i64({1, 9}, {1, 2, 3, 4, 5, 6, 7, 8, 9})},
                {"position_ids", i64({1, 9}, {0, 1, 2, 0, 1, 0, 0, 1, 2})}};
  EXPECT_EQ(values(reference_layout(b).doc_ids), (V{1, 1, 1, 2, 2, 3, 4, 4, 4}));
  const Batch padded{{"input_ids", i64({1, 6}, {0, 1, 2, 0, 3, 4})},
                     {"attention_mask", i64({1, 6}, {0, 1, 1, 0, 1, 1})},
                     {"position_ids", i64({1, 6}, {0, 0, 1, 0, 0, 1})}};
  EXPECT_EQ(values(reference_layout(padded).doc_ids), (V{0, 1, 1, 0, 2, 2}));
}
