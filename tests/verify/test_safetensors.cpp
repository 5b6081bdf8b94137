// safetensors batches: files built here byte by byte (an independent writer, not
// the reader's code), and every class of malformed file as one clear InvalidInput.
#include <gmock/gmock.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tests/subprocess.hpp"
#include "tests/tensor_helpers.hpp"
#include "verify/batch_io.hpp"
#include "verify/safetensors.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using cpsim::testing::values;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {

// Little-endian bytes of integers.
template <class T, class List = std::initializer_list<T>>
std::string le(const List& vs) {
  std::string out;
  for (T v : vs)
    for (std::size_t b = 0; b < sizeof(T); ++b)
      out.push_back(static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * b)) & 0xFF));
  return out;
}

// The file: header length, header, data.
std::string file(const std::string& header, const std::string& data) {
  return le<std::uint64_t>({header.size()}) + header + data;
}

std::string invalid(const std::string& bytes) {
  return cpsim::testing::thrown<InvalidInput>([&] { parse_batch_safetensors(bytes, "batch.safetensors"); },
                                              "InvalidInput");
}

// The SPEC §1 example as safetensors: input_ids I64 [1, 8], seq_lens I32 [1, 3],
// seq_lens_padded I16 [1, 3], padding... and pad_token_id in the metadata.
std::string spec_example() {
  const std::string ids = le<std::int64_t>({5, 6, 0, 0, 7, 0, 0, 0});
  const std::string lens = le<std::int32_t>({3, 2, -1000});
  const std::string padded = le<std::int16_t>({4, 2, -1000});
  const std::string header =
      R"({"__metadata__":{"pad_token_id":"0"},)"
      R"("input_ids":{"dtype":"I64","shape":[1,8],"data_offsets":[0,64]},)"
      R"("seq_lens":{"dtype":"I32","shape":[1,3],"data_offsets":[64,76]},)"
      R"("seq_lens_padded":{"dtype":"I16","shape":[1,3],"data_offsets":[76,82]}})";
  return file(header, ids + lens + padded);
}

}  // namespace

TEST(Safetensors, ReadsWhatATrainingStepWrites) {
  const BatchFile f = parse_batch_safetensors(spec_example(), "spec.safetensors");
  EXPECT_EQ(f.pad_token_id, 0);
  EXPECT_EQ(values(f.batch.at("input_ids")), (std::vector<std::int64_t>{5, 6, 0, 0, 7, 0, 0, 0}));
  EXPECT_EQ(values(f.batch.at("seq_lens")), (std::vector<std::int64_t>{3, 2, -1000}));
  EXPECT_EQ(values(f.batch.at("seq_lens_padded")), (std::vector<std::int64_t>{4, 2, -1000}));
  const Layout l = derive_layout(f.batch);
  EXPECT_EQ(values(l.doc_ids), (std::vector<std::int64_t>{1, 1, 1, 1, 2, 2, 0, 0}));
}

TEST(Safetensors, OneDimensionalBoolAndUnsignedKeys) {
  // A THD row: input_ids [S] U8, padding_mask BOOL [S], cu_seqlens I64 [D+1]; the
  // I64 values past 2^53 are read exactly.
  const std::int64_t big = (std::int64_t{1} << 60) + 3;
  const std::string header =
      R"({"input_ids":{"dtype":"I64","shape":[4],"data_offsets":[0,32]},)"
      R"("token_type_ids":{"dtype":"U8","shape":[4],"data_offsets":[32,36]},)"
      R"("padding_mask":{"dtype":"BOOL","shape":[4],"data_offsets":[36,40]}})";
  const BatchFile f = parse_batch_safetensors(
      file(header, le<std::int64_t>({big, 2, 3, 0}) + std::string("\x01\x02\xff\x00", 4) + std::string("\0\0\0\1", 4)),
      "thd.safetensors");
  EXPECT_EQ(f.batch.at("input_ids").shape(), (Shape{1, 4}));
  EXPECT_EQ(values(f.batch.at("input_ids")), (std::vector<std::int64_t>{big, 2, 3, 0}));
  EXPECT_EQ(values(f.batch.at("token_type_ids")), (std::vector<std::int64_t>{1, 2, 255, 0}));
  EXPECT_EQ(f.batch.at("padding_mask").dtype(), DType::b8);
  EXPECT_EQ(values(f.batch.at("padding_mask")), (std::vector<std::int64_t>{0, 0, 0, 1}));
}

TEST(Safetensors, MropePositionIdsAreThreePlanes) {
  // position_ids I32 [3, 1, 4]: temporal, height, width of one row (a 1 x 2
  // image grid after one text token, then text one past the grid's largest).
  const std::string header =
      R"({"input_ids":{"dtype":"I64","shape":[1,4],"data_offsets":[0,32]},)"
      R"("position_ids":{"dtype":"I32","shape":[3,1,4],"data_offsets":[32,80]}})";
  const BatchFile f = parse_batch_safetensors(
      file(header, le<std::int64_t>({5, 9, 9, 6}) + le<std::int32_t>({0, 1, 1, 3, 0, 1, 1, 3, 0, 1, 2, 3})),
      "mrope.safetensors");
  EXPECT_EQ(f.batch.at("position_ids").shape(), (Shape{3, 1, 4}));
  EXPECT_EQ(derive_layout(f.batch).positions.shape(), (Shape{3, 1, 4}));
  // Only position_ids have planes, and only three.
  const std::string four =
      R"({"input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]},)"
      R"("position_ids":{"dtype":"I64","shape":[4,1,2],"data_offsets":[16,80]}})";
  EXPECT_THAT(invalid(file(four, le<std::int64_t>({1, 2, 0, 1, 0, 1, 0, 1, 0, 1}))),
              HasSubstr("position_ids: shape must be [S] or [B, S] (mRoPE's: [3, B, S]) (got [4, 1, 2])"));
}

TEST(SafetensorsErrors, EveryMalformedFileIsOneClearError) {
  const std::string ids = R"("input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]})";
  const std::string data = le<std::int64_t>({1, 2});
  EXPECT_THAT(invalid("abc"), HasSubstr("truncated"));
  EXPECT_THAT(invalid(le<std::uint64_t>({1000}) + "{}"), HasSubstr("header length 1000 exceeds"));
  EXPECT_THAT(invalid(file("{not json", "")), HasSubstr("not JSON"));
  EXPECT_THAT(invalid(file("[1,2]", "")), HasSubstr("not a JSON object"));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"Q7","shape":[1,2],"data_offsets":[0,16]}})", data)),
              AllOf(HasSubstr("input_ids"), HasSubstr("unknown safetensors dtype 'Q7'")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})", data)),
              AllOf(HasSubstr("input_ids"), HasSubstr("floating")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[1,3],"data_offsets":[0,16]}})", data)),
              AllOf(HasSubstr("input_ids"), HasSubstr("needs 24 bytes, data_offsets give 16")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[0,160]}})", data)),
              AllOf(HasSubstr("input_ids"), HasSubstr("past the 16 data bytes")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[16,0]}})", data)),
              HasSubstr("end before they begin"));
  EXPECT_THAT(invalid(file("{" + ids + R"(,"labels":{"dtype":"I64","shape":[1,2],"data_offsets":[8,24]}})",
                           le<std::int64_t>({1, 2, 3}))),
              AllOf(HasSubstr("labels"), HasSubstr("overlap"), HasSubstr("input_ids")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[1099511627776,1099511627776],"data_offsets":[0,16]}})",
                           data)),
              AllOf(HasSubstr("input_ids"), HasSubstr("more elements than the file has bytes")));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[-1,2],"data_offsets":[0,16]}})", data)),
              HasSubstr("not a non-negative integer"));
  EXPECT_THAT(invalid(file(R"({"input_ids":{"dtype":"I64","shape":[1,2]}})", data)), HasSubstr("data_offsets"));
  EXPECT_THAT(invalid(file("{" + ids + "," + ids + "}", data)), AllOf(HasSubstr("input_ids"), HasSubstr("twice")));
  EXPECT_THAT(invalid(file(std::string(40, '[') + std::string(40, ']'), "")), HasSubstr("nested deeper"));
  EXPECT_THAT(invalid(file(R"({"__metadata__":{"pad_token_id":"zero"},)" + ids + "}", data)),
              HasSubstr("pad_token_id"));
  // A file that parses but has no token key: the layout's error.
  EXPECT_THAT(invalid(file(R"({"seq_lens":{"dtype":"I64","shape":[1,1],"data_offsets":[0,8]}})", le<std::int64_t>({2}))),
              HasSubstr("input_ids: missing"));
  // The format's own header limit (100 MB), before any of it is read.
  EXPECT_THAT(invalid(le<std::uint64_t>({100000001}) + "{}"), HasSubstr("exceeds the format's limit of 100000000 bytes"));
  // A key that is no name: control characters are escaped, a long one is cut.
  EXPECT_THAT(invalid(file(R"({"input\u0001":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]}})", data)),
              HasSubstr("input\\x01"));
  EXPECT_THAT(invalid(file("{\"" + std::string(2000, 'k') + R"(":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]}})", data)),
              HasSubstr("... (2000 characters)"));
}

// A batch without input_ids (labels, a mask, positions and lengths only) is valid:
// the reader gives stand-in token ids and says so.
TEST(Safetensors, ABatchWithoutInputIdsGetsStandInTokenIds) {
  const BatchFile f = parse_batch_safetensors(
      file(R"({"labels":{"dtype":"I64","shape":[1,3],"data_offsets":[0,24]},"seq_lens":{"dtype":"I64","shape":[1,1],"data_offsets":[24,32]}})",
           le<std::int64_t>({5, 6, -100, 2})),
      "x.safetensors");
  EXPECT_TRUE(f.stand_in_ids);
  ASSERT_TRUE(f.batch.count("input_ids"));
  EXPECT_EQ(f.batch.at("input_ids").shape(), (Shape{1, 3}));
  derive_layout(f.batch);
}

// Many tensors: the header is read in one linear pass (the duplicate-key check once
// scanned the whole object per tensor).
TEST(Safetensors, AHeaderOfManyTensorsIsRead) {
  std::string header = "{";
  std::vector<std::int64_t> values;
  for (int i = 0; i < 20000; ++i) {
    std::string name = "k";
    name += std::to_string(i);
    if (i == 0) name = "input_ids";
    if (i) header += ',';
    header.append("\"").append(name).append(R"(":{"dtype":"I64","shape":[1,1],"data_offsets":[)");
    header.append(std::to_string(8 * i)).append(",").append(std::to_string(8 * i + 8)).append("]}");
    values.push_back(i);
  }
  const BatchFile f = parse_batch_safetensors(file(header + "}", le<std::int64_t, std::vector<std::int64_t>>(values)), "many.safetensors");
  EXPECT_EQ(f.batch.size(), 20000u);
}

// Truncating a valid file anywhere is an error, never a crash or a read past the end.
TEST(SafetensorsErrors, EveryTruncationIsAnError) {
  const std::string whole = spec_example();
  for (std::size_t n = 0; n < whole.size(); ++n) EXPECT_THROW(parse_batch_safetensors(whole.substr(0, n), "t"), InvalidInput) << n;
}

TEST(Safetensors, TheCommandLineChecksASafetensorsBatch) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-st-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto path = (dir / "spec.safetensors").string();
  std::ofstream(path, std::ios::binary) << spec_example();
  const auto r = cpsim::testing::run_process({CPSIM_BINARY, "check", path, "--cp", "1,2,3"}, 60s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("all properties hold"));
  const auto bad = (dir / "bad.safetensors").string();
  std::ofstream(bad, std::ios::binary) << spec_example().substr(0, 50);
  const auto e = cpsim::testing::run_process({CPSIM_BINARY, "check", bad}, 60s);
  EXPECT_EQ(e.status, 2) << e.err;
  EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  std::filesystem::remove_all(dir);
}

// A JSON batch nests mRoPE's position_ids three deep ([3, B, S]); a batch
// written back (a counterexample) reads as the same tensors.
TEST(BatchJson, MropePositionIdsNestThreeDeepAndRoundTrip) {
  const BatchFile f = parse_batch_json(
      R"({"input_ids": [[5, 9, 9, 6], [1, 2, 3, 4]], "seq_lens": [[4], [4]],
          "position_ids": [[[0, 1, 1, 3], [0, 1, 2, 3]], [[0, 1, 1, 3], [0, 1, 2, 3]], [[0, 1, 2, 3], [0, 1, 2, 3]]]})");
  const Tensor& pos = f.batch.at("position_ids");
  EXPECT_EQ(pos.shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(pos.get_int(2 * 8 + 2), 2);  // width plane, row 0, token 2
  const BatchFile again = parse_batch_json(batch_to_json(f.batch, 0));
  EXPECT_EQ(again.batch.at("position_ids").shape(), (Shape{3, 2, 4}));
  EXPECT_EQ(values(again.batch.at("position_ids")), values(pos));
  // Planes of different shapes are ragged.
  EXPECT_THAT(cpsim::testing::thrown<InvalidInput>(
                  [] { parse_batch_json(R"({"input_ids": [[1, 2]], "position_ids": [[[0, 1]], [[0, 1]], [[0]]]})"); },
                  "InvalidInput"),
              HasSubstr("position_ids plane 2"));
}
