// SPEC §1 known answers and every class of invalid layout.
#include <gmock/gmock.h>

#include "core/layout.hpp"

#include "tests/tensor_helpers.hpp"

using namespace cpsim;
using ::testing::AllOf;
using ::testing::HasSubstr;

namespace {
using cpsim::testing::i64;
using cpsim::testing::values;
Batch spec_example() {
  return {{"input_ids", i64({1, 8}, {5, 6, 0, 0, 7, 0, 0, 0})},
          {"seq_lens", i64({1, 3}, {3, 2, -1000})},
          {"seq_lens_padded", i64({1, 3}, {4, 2, -1000})}};
}
// Runs f and returns the InvalidInput message (fails the test if none).
template <class F>
std::string invalid(F f) {
  try {
    f();
  } catch (const InvalidInput& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidInput thrown";
  return "";
}
}  // namespace

TEST(Layout, SpecExampleDocIdsPaddingPositionsSegments) {
  const Layout l = derive_layout(spec_example());
  EXPECT_EQ(values(l.doc_ids), (std::vector<std::int64_t>{1, 1, 1, 1, 2, 2, 0, 0}));
  EXPECT_EQ(values(l.padding), (std::vector<std::int64_t>{0, 0, 0, 1, 0, 0, 1, 1}));
  EXPECT_EQ(values(l.positions), (std::vector<std::int64_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(segment_cu_seqlens(l.doc_ids), (std::vector<std::int64_t>{0, 4, 6, 8}));
}

TEST(Layout, PaddingComesFromLengthsNeverFromTokenIds) {
  // Token 0 is the pad id and also a real EOS inside document 1.
  const Layout l = derive_layout(spec_example());
  EXPECT_FALSE(l.padding.get_int(2));
}

TEST(Layout, DocIdsFromCuSeqlensGiveOneRow) {
  EXPECT_EQ(values(doc_ids_from_cu_seqlens(i64({3}, {0, 5, 12}), 14)),
            (std::vector<std::int64_t>{1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0}));
  EXPECT_EQ(values(doc_ids_from_cu_seqlens(i64({4}, {0, 2, -1, -1}), 3)), (std::vector<std::int64_t>{1, 1, 0}));
}

TEST(Layout, ZeroLengthDocumentsYieldNoSegment) {
  const Tensor ids = doc_ids_from_seq_lens(i64({1, 3}, {2, 0, 1}), 4);
  EXPECT_EQ(values(ids), (std::vector<std::int64_t>{1, 1, 3, 0}));
  EXPECT_EQ(segment_cu_seqlens(ids), (std::vector<std::int64_t>{0, 2, 3, 4}));
}

TEST(Layout, OneDimensionalTensorsAreNormalisedToOneRow) {
  Batch b{{"input_ids", i64({4}, {1, 2, 3, 4})}, {"cu_seqlens", i64({2}, {0, 3})}};
  normalize_batch_axis(b);
  EXPECT_EQ(b.at("input_ids").shape(), (Shape{1, 4}));
  EXPECT_EQ(b.at("cu_seqlens").shape(), (Shape{2}));
}

TEST(Layout, UnpackedBatchTakesPaddingFromMasks) {
  Batch b{{"input_ids", i64({1, 5}, {0, 0, 4, 5, 6})}, {"attention_mask", i64({1, 5}, {0, 0, 1, 1, 1})}};
  const Layout l = derive_layout(b);
  EXPECT_EQ(values(l.padding), (std::vector<std::int64_t>{1, 1, 0, 0, 0}));
  EXPECT_EQ(values(l.positions), (std::vector<std::int64_t>{0, 1, 0, 1, 2}));
  Batch none{{"input_ids", i64({1, 3}, {0, 0, 0})}};
  EXPECT_EQ(values(derive_layout(none).padding), (std::vector<std::int64_t>{0, 0, 0}));
}

TEST(Layout, UnpackRowLayoutReplacesLengthsInPlaceAndKeepsTokens) {
  Batch b = spec_example();
  b["labels"] = i64({1, 8}, {1, 2, 3, 4, 5, 6, 7, 8});
  unpack_row_layout(b);
  EXPECT_FALSE(b.count("seq_lens"));
  EXPECT_FALSE(b.count("seq_lens_padded"));
  EXPECT_EQ(values(b.at("padding_mask")), (std::vector<std::int64_t>{0, 0, 0, 1, 0, 0, 1, 1}));
  EXPECT_EQ(values(b.at("position_ids")), (std::vector<std::int64_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(values(b.at("input_ids")), (std::vector<std::int64_t>{5, 6, 0, 0, 7, 0, 0, 0}));
  EXPECT_EQ(values(b.at("labels")), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST(Layout, UnpackKeepsGivenPositionIds) {
  Batch b = spec_example();
  b["position_ids"] = i64({1, 8}, {4, 5, 6, 9, 0, 1, 9, 9});  // a shard starting inside a document
  unpack_row_layout(b);
  EXPECT_EQ(values(b.at("position_ids")), (std::vector<std::int64_t>{4, 5, 6, 9, 0, 1, 9, 9}));
}

TEST(Layout, PositionRule) {
  auto keep = [](std::vector<std::int64_t> k) {
    Tensor t({1, static_cast<std::int64_t>(k.size())}, DType::b8);
    for (std::size_t i = 0; i < k.size(); ++i) t.set(i, static_cast<double>(k[i]));
    return t;
  };
  validate_document_positions(keep({1, 1, 1, 1}), i64({1, 4}, {7, 8, 0, 1}));      // starts mid-document
  validate_document_positions(keep({0, 0, 1, 1}), i64({1, 4}, {9, 9, 3, 4}));      // left padding
  EXPECT_THAT(invalid([&] { validate_document_positions(keep({1, 1, 1}), i64({1, 3}, {0, 1, 3})); }),
              AllOf(HasSubstr("position_ids"), HasSubstr("row 0"), HasSubstr("index 2")));
  EXPECT_THAT(invalid([&] { validate_document_positions(keep({1, 0, 1}), i64({1, 3}, {0, 1, 2})); }),
              AllOf(HasSubstr("gap"), HasSubstr("index 2")));
  EXPECT_THAT(invalid([&] { validate_document_positions(keep({1, 1}), i64({1, 2}, {-1, 0})); }), HasSubstr("index 0"));
}

TEST(LayoutErrors, NegativeLengthOtherThanSentinel) {
  Batch b = spec_example();
  b["seq_lens"] = i64({1, 3}, {3, -2, -1000});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("seq_lens row 0 index 1"), HasSubstr("negative")));
}

TEST(LayoutErrors, RealEntryAfterSentinel) {
  Batch b = spec_example();
  b["seq_lens_padded"] = i64({1, 3}, {4, -1000, 2});
  b["seq_lens"] = i64({1, 3}, {3, -1000, 2});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("row 0 index 2"), HasSubstr("after the sentinel")));
}

TEST(LayoutErrors, RealLengthExceedsPadded) {
  Batch b = spec_example();
  b["seq_lens"] = i64({1, 3}, {5, 2, -1000});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("seq_lens row 0 index 0"), HasSubstr("exceeds")));
}

TEST(LayoutErrors, LengthsOverflowTheRow) {
  Batch b = spec_example();
  b["seq_lens_padded"] = i64({1, 3}, {4, 5, -1000});
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("seq_lens_padded row 0 index 1"), HasSubstr("overflowing")));
}

TEST(LayoutErrors, CuSeqlensNotStartingAtZeroOrDecreasing) {
  Batch b{{"input_ids", i64({1, 6}, {1, 2, 3, 4, 5, 6})}, {"cu_seqlens", i64({3}, {1, 3, 6})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("cu_seqlens"), HasSubstr("index 0")));
  b["cu_seqlens"] = i64({3}, {0, 4, 3});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("cu_seqlens row 0 index 2"), HasSubstr("decreasing")));
  b["cu_seqlens"] = i64({4}, {0, 4, -1, 5});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), HasSubstr("index 3"));
}

TEST(LayoutErrors, ShapesThatDisagree) {
  Batch b = spec_example();
  b["labels"] = i64({1, 7}, {1, 2, 3, 4, 5, 6, 7});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), HasSubstr("labels"));
  Batch c = spec_example();
  c["seq_lens"] = i64({2, 3}, {3, 2, -1000, 1, -1000, -1000});
  c["seq_lens_padded"] = i64({2, 3}, {4, 2, -1000, 1, -1000, -1000});
  EXPECT_THAT(invalid([&] { derive_layout(c); }), HasSubstr("rows"));
  Batch d = spec_example();
  d["seq_lens_padded"] = i64({1, 2}, {4, 2});
  EXPECT_THAT(invalid([&] { derive_layout(d); }), HasSubstr("seq_lens_padded"));
}

TEST(LayoutErrors, PositionsThatBreakTheRule) {
  Batch b = spec_example();
  b["position_ids"] = i64({1, 8}, {0, 1, 2, 3, 1, 2, 0, 0});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("position_ids row 0 index 4")));
}

// Either cu_seqlens key alone is both the real and the occupied lengths: a THD
// batch with only cu_seqlens_padded keeps its two documents apart (EOS = PAD).
TEST(Layout, CuSeqlensPaddedAloneServesAsBoth) {
  Batch b{{"input_ids", i64({17}, {7, 7, 7, 7, 7, 0, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0})},
          {"cu_seqlens_padded", i64({3}, {0, 6, 13})}};
  normalize_batch_axis(b);
  const Layout l = derive_layout(b);
  EXPECT_EQ(values(l.doc_ids), (std::vector<std::int64_t>{1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0}));
  EXPECT_EQ(values(l.padding), (std::vector<std::int64_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(segment_cu_seqlens(l.doc_ids), (std::vector<std::int64_t>{0, 6, 13, 17}));
  EXPECT_EQ(values(global_doc_ids(b)), values(l.doc_ids));
  // cu_seqlens alone gives the same layout.
  Batch c{{"input_ids", b.at("input_ids")}, {"cu_seqlens", i64({3}, {0, 6, 13})}};
  EXPECT_EQ(values(derive_layout(c).doc_ids), values(l.doc_ids));
  unpack_row_layout(b);
  EXPECT_FALSE(b.count("cu_seqlens_padded"));
  EXPECT_EQ(values(b.at("padding_mask")), values(l.padding));
}

TEST(LayoutErrors, SeqLensPaddedWithoutSeqLens) {
  Batch b{{"input_ids", i64({1, 4}, {1, 2, 3, 4})}, {"seq_lens_padded", i64({1, 2}, {2, 2})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("seq_lens_padded"), HasSubstr("without seq_lens")));
  EXPECT_THAT(invalid([&] { global_doc_ids(b); }), HasSubstr("seq_lens_padded"));
}

TEST(LayoutErrors, CuSeqlensPaddedDescribesOneRow) {
  Batch b{{"input_ids", i64({2, 3}, {1, 2, 3, 4, 5, 6})}, {"cu_seqlens_padded", i64({2}, {0, 3})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("cu_seqlens_padded"), HasSubstr("one packed row")));
}

// Every key but the packing lengths is a [B, S] token stream.
TEST(LayoutErrors, OtherKeysMustBeTokenStreams) {
  Batch b = spec_example();
  b["token_type_ids"] = i64({1, 8}, {0, 0, 0, 0, 1, 1, 1, 1});
  EXPECT_NO_THROW(derive_layout(b));
  b["token_type_ids"] = i64({1, 7}, {0, 0, 0, 0, 1, 1, 1});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("token_type_ids"), HasSubstr("disagrees")));
  b["token_type_ids"] = i64({2, 2, 2}, {0, 0, 0, 0, 1, 1, 1, 1});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("token_type_ids"), HasSubstr("[batch, sequence]")));
}

TEST(LayoutErrors, EmptySequenceOrNoRows) {
  Batch empty{{"input_ids", Tensor({1, 0}, DType::i64)}};
  EXPECT_THAT(invalid([&] { derive_layout(empty); }), AllOf(HasSubstr("input_ids"), HasSubstr("empty sequence")));
  Batch none{{"input_ids", Tensor({0, 4}, DType::i64)}};
  EXPECT_THAT(invalid([&] { derive_layout(none); }), AllOf(HasSubstr("input_ids"), HasSubstr("no rows")));
}
