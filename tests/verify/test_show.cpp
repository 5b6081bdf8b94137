// cpsim show: the text picture of known layouts (golden text), aggregation of rows
// wider than the terminal, and the SVG: well-formed XML with one rectangle per
// document.
#include <gmock/gmock.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tests/subprocess.hpp"
#include "verify/batch_io.hpp"
#include "verify/show.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {
const std::string& kExamples = cpsim::testing::kExamplesDir;
ShowOptions at(int cp, int width = 4) {
  ShowOptions o;
  o.cp = cp;
  o.conv_width = width;
  o.title = "batch";
  return o;
}
}  // namespace

TEST(Show, SpecExampleAtCp3) {
  const BatchFile f = read_batch_file(kExamples + "spec_example.json");
  EXPECT_EQ(show_text(f.batch, at(3)),
            "batch: 1 row, S = 8, cp = 3: P = 9, L = 3\n"
            "row 0  AAA|aBB|..:\n"
            "row 0: doc 1 [0, 4) on ranks 0-1, crosses edge 3\n"
            "halo (conv width 4, 3 positions before each shard): rank 1 [0, 3) from rank 0; rank 2 [3, 6) from rank 1\n"
            "A-Z document (lower case: its padding), . row padding, : padding to P, | shard cut\n");
}

TEST(Show, DocumentsAcrossManyEdgesAndHalosAcrossRanks) {
  const BatchFile f = read_batch_file(kExamples + "packed_two_rows.json");
  EXPECT_EQ(show_text(f.batch, at(4, 6)),
            "batch: 2 rows, S = 13, cp = 4: P = 16, L = 4\n"
            "row 0  AAAa|BBBC|CCCc|c:::\n"
            "row 1  AAAB|BBBB|Bbbb|b:::\n"
            "row 0: doc 3 [7, 13) on ranks 1-3, crosses edges 8, 12\n"
            "row 1: doc 2 [3, 13) on ranks 0-3, crosses edges 4, 8, 12\n"
            "halo (conv width 6, 5 positions before each shard): rank 1 [0, 4) from rank 0; rank 2 [3, 8) from "
            "ranks 0-1; rank 3 [7, 12) from ranks 1-2\n"
            "A-Z document (lower case: its padding), . row padding, : padding to P, | shard cut\n");
}

TEST(Show, RowsWiderThanTheTerminalAreBucketed) {
  Batch b{{"input_ids", Tensor({1, 1000}, DType::i64)},
          {"seq_lens", Tensor::from<std::int64_t>({1, 3}, {500, 1, 300})}};
  ShowOptions o = at(4);
  o.columns = 60;
  const std::string text = show_text(b, o);
  EXPECT_THAT(text, HasSubstr("one character per 20 positions"));
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line))
    if (line.rfind("row 0  ", 0) == 0) {
      EXPECT_LE(static_cast<int>(line.size()), 60) << line;
      EXPECT_EQ(line.substr(7, 5), "AAAAA");
      EXPECT_NE(line.find('#'), std::string::npos) << "the bucket holding documents 1, 2 and 3: " << line;
      EXPECT_EQ(std::count(line.begin(), line.end(), '|'), 3) << line;
    }
  // The legend is printed also when a row is bucketed, with what '#' means.
  EXPECT_THAT(text, HasSubstr("| shard cut, # several documents in one character\n"));
}

// A batch of position_ids alone: its documents are the resets, drawn as such.
TEST(Show, DocumentsFromPositionResetsAreDrawn) {
  const Batch b{{"input_ids", Tensor::from<std::int64_t>({1, 7}, {1, 2, 3, 4, 5, 6, 7})},
                {"position_ids", Tensor::from<std::int64_t>({1, 7}, {0, 1, 2, 0, 1, 0, 1})}};
  EXPECT_THAT(show_text(b, at(1)), HasSubstr("row 0  AAABBCC\n"));
}

TEST(Show, SvgIsXmlWithOneRectanglePerDocument) {
  if (std::system("python3 -c 'import xml.etree.ElementTree' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 is needed to parse the SVG as XML";
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-show-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string svg = (dir / "two.svg").string();
  const auto r = cpsim::testing::run_process(
      {CPSIM_BINARY, "show", kExamples + "packed_two_rows.json", "--cp", "4", "--svg", svg, "--color", "never"}, 30s);
  ASSERT_EQ(r.status, 0) << r.err;
  // packed_two_rows: 3 documents in row 0, 2 in row 1; 3 shard cuts; 3 halo spans a row.
  const std::string count =
      "python3 -c \"import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); "
      "ns = '{http://www.w3.org/2000/svg}'; c = lambda k, t='rect': sum(1 for e in r.iter(ns + t) if e.get('class') == k); "
      "print(c('doc'), c('halo'), c('cut', 'line'), c('docs'))\" " +
      svg + " > " + (dir / "count.txt").string();
  ASSERT_EQ(std::system(count.c_str()), 0) << "the SVG is not well-formed XML";
  std::ifstream in(dir / "count.txt");
  std::string counts;
  std::getline(in, counts);
  EXPECT_EQ(counts, "5 6 3 0");
  // The halo has a colour of its own, no document's.
  std::ifstream picture(svg);
  const std::string text((std::istreambuf_iterator<char>(picture)), std::istreambuf_iterator<char>());
  const auto style = text.substr(text.find(".halo{"), text.find('}', text.find(".halo{")) - text.find(".halo{"));
  for (const char* doc_colour : {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"})
    EXPECT_EQ(style.find(doc_colour), std::string::npos) << style;
  std::filesystem::remove_all(dir);
}

TEST(Show, CommandLineHelpVersionAndInvalidInput) {
  const auto help = cpsim::testing::run_process({CPSIM_BINARY, "show", "--help"}, 30s);
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, HasSubstr("Example:"));
  for (const char* cmd : {"check", "fuzz", "launch"}) {
    const auto h = cpsim::testing::run_process({CPSIM_BINARY, cmd, "--help"}, 30s);
    EXPECT_THAT(h.out, HasSubstr("Example:")) << cmd;
  }
  const auto version = cpsim::testing::run_process({CPSIM_BINARY, "--version"}, 30s);
  EXPECT_EQ(version.status, 0);
  EXPECT_THAT(version.out, HasSubstr("cpsim "));
  const auto bad = cpsim::testing::run_process({CPSIM_BINARY, "show", kExamples + "invalid/sentinel_in_middle.json"}, 30s);
  EXPECT_EQ(bad.status, 2) << bad.err;
  EXPECT_THAT(bad.err, HasSubstr("seq_lens"));
}
