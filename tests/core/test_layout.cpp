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
  return cpsim::testing::thrown<InvalidInput>(f, "InvalidInput");
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
  b["position_ids"] = i64({1, 8}, {0, 1, 2, 9, 0, 1, 9, 9});  // padding's positions are the batch's own
  unpack_row_layout(b);
  EXPECT_EQ(values(b.at("position_ids")), (std::vector<std::int64_t>{0, 1, 2, 9, 0, 1, 9, 9}));
  // Without lengths, a row may begin inside a document (a shard of one).
  Batch shard{{"input_ids", i64({1, 4}, {1, 2, 3, 4})}, {"position_ids", i64({1, 4}, {4, 5, 0, 1})}};
  unpack_row_layout(shard);
  EXPECT_EQ(values(shard.at("position_ids")), (std::vector<std::int64_t>{4, 5, 0, 1}));
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
  EXPECT_THAT(invalid([&] { derive_layout(b); }), AllOf(HasSubstr("seq_lens row 0 index 0: document 1"), HasSubstr("more than its padded length 4")));
}

TEST(LayoutErrors, LengthsOverflowTheRow) {
  Batch b = spec_example();
  b["seq_lens_padded"] = i64({1, 3}, {4, 5, -1000});
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("seq_lens_padded row 0 index 1: document 2 ends at 9"), HasSubstr("past the sequence length 8")));
}

// One indexing convention: "index" is the index into the key's own array (a cu_seqlens
// entry ends its document), "document" counts from 1 as doc ids do.
TEST(LayoutErrors, MessagesIndexTheKeysArrayAndNumberDocumentsFromOne) {
  const Batch b{{"input_ids", i64({1, 6}, {1, 2, 3, 4, 5, 6})}, {"cu_seqlens", i64({3}, {0, 3, 7})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              HasSubstr("cu_seqlens row 0 index 2: document 2 ends at 7, past the sequence length 6"));
}

// A mask holds 0 or 1; document indices (as some collators write) are refused.
TEST(LayoutErrors, AMaskThatIsNotZeroOrOneIsInvalid) {
  const Batch b{{"input_ids", i64({1, 6}, {1, 2, 3, 4, 5, 6})}, {"attention_mask", i64({1, 6}, {1, 1, 2, 2, 2, 0})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("attention_mask row 0 index 2: value 2"), HasSubstr("0 or 1")));
}

// Two forms of the padding that disagree are invalid input, not one silently dropped.
TEST(LayoutErrors, MasksThatContradictTheLengthsOrEachOtherAreInvalid) {
  Batch b = spec_example();  // padding [F,F,F,T,F,F,T,T]
  b["attention_mask"] = i64({1, 8}, {1, 1, 1, 0, 1, 1, 0, 1});
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("attention_mask row 0 index 7"), HasSubstr("seq_lens makes it padding")));
  b["attention_mask"] = i64({1, 8}, {1, 1, 1, 0, 1, 1, 0, 0});
  derive_layout(b);  // agrees
  b.erase("attention_mask");
  b["padding_mask"] = Tensor::from<bool>({1, 8}, {false, true, false, true, false, false, true, true});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), HasSubstr("padding_mask row 0 index 1"));
  const Batch both{{"input_ids", i64({1, 3}, {1, 2, 3})},
                   {"padding_mask", Tensor::from<bool>({1, 3}, {false, false, true})},
                   {"attention_mask", i64({1, 3}, {1, 1, 1})}};
  EXPECT_THAT(invalid([&] { derive_layout(both); }),
              AllOf(HasSubstr("attention_mask row 0 index 2"), HasSubstr("padding_mask makes it padding")));
}

// A key one or two edits from a known key is a misspelling, not a token stream.
TEST(LayoutErrors, AMisspelledKeyIsInvalidNamingTheKnownOne) {
  Batch b = spec_example();
  b["attention_masks"] = i64({1, 8}, {1, 1, 1, 0, 1, 1, 0, 0});
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("attention_masks: not a key cpsim knows; did you mean attention_mask?")));
  b.erase("attention_masks");
  b["Position_Id"] = i64({1, 8}, {0, 1, 2, 3, 0, 1, 2, 3});
  EXPECT_THAT(invalid([&] { derive_layout(b); }), HasSubstr("did you mean position_ids?"));
  b.erase("Position_Id");
  b["token_type_ids"] = i64({1, 8}, {0, 0, 0, 0, 1, 1, 1, 1});
  b["image_mask"] = i64({1, 8}, {0, 0, 0, 0, 1, 1, 1, 1});  // far from every known key: a token stream
  derive_layout(b);
}

// Given positions must agree with the lengths: 0 at every document start, unit
// steps inside (the packed RoPE bug: positions that never reset).
TEST(LayoutErrors, PositionsThatContradictTheLengthsAreInvalid) {
  Batch b{{"input_ids", i64({1, 8}, {1, 2, 3, 4, 5, 6, 7, 8})}, {"cu_seqlens", i64({3}, {0, 3, 8})}};
  b["position_ids"] = i64({1, 8}, {0, 1, 2, 3, 4, 5, 6, 7});  // never resets
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("position_ids row 0 index 3: position 3"), HasSubstr("the start of document 2")));
  b["position_ids"] = i64({1, 8}, {0, 1, 2, 0, 1, 0, 1, 2});  // resets inside document 2
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("position_ids row 0 index 5: position 0"), HasSubstr("offset 2 of document 2")));
  b["position_ids"] = i64({1, 8}, {0, 1, 2, 0, 1, 2, 3, 4});
  derive_layout(b);
}

// A batch with only position_ids takes its documents from the resets to 0 (a
// flattening collator's packing).
TEST(Layout, PositionIdsAloneGiveTheDocumentsAtTheirResets) {
  const Batch b{{"input_ids", i64({1, 9}, {1, 2, 3, 4, 5, 6, 7, 8, 9})},
                {"position_ids", i64({1, 9}, {0, 1, 2, 0, 1, 0, 0, 1, 2})}};
  EXPECT_EQ(values(derive_layout(b).doc_ids), (std::vector<std::int64_t>{1, 1, 1, 2, 2, 3, 4, 4, 4}));
  // With padding (attention_mask 0): padding is doc 0, a reset after it starts the next.
  const Batch padded{{"input_ids", i64({1, 6}, {0, 1, 2, 0, 3, 4})},
                     {"attention_mask", i64({1, 6}, {0, 1, 1, 0, 1, 1})},
                     {"position_ids", i64({1, 6}, {0, 0, 1, 0, 0, 1})}};
  EXPECT_EQ(values(derive_layout(padded).doc_ids), (std::vector<std::int64_t>{0, 1, 1, 0, 2, 2}));
}

// The padded tail's positions continue from the last one: a position that leaves
// no room for them is refused, never wrapped to a negative one.
// Positions are at most 2^52: RoPE turns by them in float64 (exact below 2^53), and
// the padded tail continues from the last one.
TEST(LayoutErrors, PositionsBeyondWhatAFloat64HoldsAreInvalid) {
  const std::int64_t top = std::int64_t{1} << 52;
  const Batch b{{"input_ids", i64({1, 3}, {1, 2, 3})}, {"position_ids", i64({1, 3}, {top - 1, top, top + 1})}};
  EXPECT_THAT(invalid([&] { derive_layout(b); }),
              AllOf(HasSubstr("position_ids row 0 index 2"), HasSubstr("beyond 2^52")));
  const Batch overflow{{"input_ids", i64({1, 3}, {1, 2, 3})},
                       {"position_ids", i64({1, 3}, {INT64_MAX - 2, INT64_MAX - 1, INT64_MAX})}};
  EXPECT_THAT(invalid([&] { derive_layout(overflow); }), HasSubstr("position_ids row 0 index 0"));
  const Batch highest{{"input_ids", i64({1, 3}, {1, 2, 3})}, {"position_ids", i64({1, 3}, {top - 2, top - 1, top})}};
  EXPECT_NO_THROW(derive_layout(highest));
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

// mRoPE position_ids (Qwen2-VL's get_rope_index): two documents of one row, the
// first with a 2 x 3 image grid after one text token, written as [3, S] beside
// [S] tokens (one row), or as [3, B, S].
namespace {
Batch mrope_batch() {
  // doc 1: text 0; image grid from 1 (t 1; h 1..2; w 1..3); text after it at 4 and 5.
  // doc 2: text 0, 1.
  return {{"input_ids", i64({10}, {5, 9, 9, 9, 9, 9, 9, 6, 7, 8})},
          {"cu_seqlens", i64({3}, {0, 8, 10})},
          {"position_ids", i64({3, 10}, {0, 1, 1, 1, 1, 1, 1, 4, 0, 1,    //
                                         0, 1, 1, 1, 2, 2, 2, 4, 0, 1,    //
                                         0, 1, 2, 3, 1, 2, 3, 4, 0, 1})}};
}
}  // namespace

TEST(Layout, MropePlanesAreKeptAndCheckedPerDocument) {
  Batch b = mrope_batch();
  normalize_batch_axis(b);
  EXPECT_EQ(b.at("position_ids").shape(), (Shape{3, 1, 10}));
  EXPECT_EQ(b.at("input_ids").shape(), (Shape{1, 10}));
  const Layout l = derive_layout(b);
  EXPECT_EQ(l.positions.shape(), (Shape{3, 1, 10}));
  EXPECT_EQ(values(l.doc_ids), (std::vector<std::int64_t>{1, 1, 1, 1, 1, 1, 1, 1, 2, 2}));
  unpack_row_layout(b);
  EXPECT_EQ(values(b.at("position_ids")), values(mrope_batch().at("position_ids")));

  // A grid token that moves the temporal plane; text not one past the largest;
  // a document of the lengths that does not start at (0, 0, 0); (0, 0, 0) inside one.
  const auto broken = [](std::int64_t at, std::int64_t value) {
    Batch x = mrope_batch();
    x.at("position_ids").set(at, static_cast<double>(value));
    normalize_batch_axis(x);
    return invalid([&] { derive_layout(x); });
  };
  EXPECT_THAT(broken(3, 2), AllOf(HasSubstr("position_ids row 0 index 3: mRoPE position (2, 1, 3)"),
                                  HasSubstr("keep the temporal position 1")));
  EXPECT_THAT(broken(7, 3), HasSubstr("index 7: mRoPE position (3, 4, 4) must be (4, 4, 4)"));
  EXPECT_THAT(broken(8, 1), HasSubstr("index 8: mRoPE positions not 0 in every plane at the start of a document"));
  Batch inside = mrope_batch();
  for (std::int64_t k = 0; k < 3; ++k) inside.at("position_ids").set(k * 10 + 9, 0.0);
  normalize_batch_axis(inside);
  EXPECT_THAT(invalid([&] { derive_layout(inside); }), HasSubstr("index 9: mRoPE positions 0 in every plane inside"));
  // Planes that are not three: [2, B, S] is no form.
  Batch two{{"input_ids", i64({1, 2}, {1, 2})}, {"position_ids", i64({2, 1, 2}, {0, 1, 0, 1})}};
  EXPECT_THAT(invalid([&] { derive_layout(two); }), HasSubstr("mRoPE's [3, batch, sequence]"));
}

TEST(Layout, MropeResetsStartDocumentsOnlyWhereEveryPlaneIsZero) {
  // A flattening collator's row: no lengths, documents where all planes are 0.
  // The image grid at the start of the first document has temporal 0 throughout.
  Batch b{{"input_ids", i64({1, 7}, {9, 9, 9, 9, 5, 6, 7})},
          {"position_ids", i64({3, 1, 7}, {0, 0, 0, 0, 2, 0, 1,  //
                                            0, 0, 1, 1, 2, 0, 1,  //
                                            0, 1, 0, 1, 2, 0, 1})}};
  const Layout l = derive_layout(b);
  EXPECT_EQ(values(l.doc_ids), (std::vector<std::int64_t>{1, 1, 1, 1, 1, 2, 2}));
}
