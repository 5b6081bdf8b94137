// Shard plans (SPEC §2) and `cpsim plan`: the per-token cost, the equal and the
// balanced cut (checked against its definition by brute force), and the report.
#include <gmock/gmock.h>
#include <rapidcheck.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/shard_plan.hpp"
#include "tests/rapidcheck_gtest.hpp"
#include "tests/subprocess.hpp"

using namespace cpsim;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

TEST(ShardPlan, TokenCostsFollowTheSpecExample) {
  // seq_lens [[3, 2]], seq_lens_padded [[4, 2]], S = 8: ids [1,1,1,1,2,2,0,0], padding [F,F,F,T,F,F,T,T].
  Batch b;
  b["seq_lens"] = Tensor::from<std::int64_t>({1, 2}, {3, 2});
  b["seq_lens_padded"] = Tensor::from<std::int64_t>({1, 2}, {4, 2});
  b["input_ids"] = Tensor::from<std::int64_t>({1, 8}, {5, 5, 5, 0, 6, 6, 0, 0});
  const Layout l = derive_layout(b);
  EXPECT_EQ(token_costs(l, 8, {1, 0})[0], (std::vector<std::int64_t>{1, 2, 3, 0, 1, 2, 0, 0}));
  EXPECT_EQ(token_costs(l, 10, {0, 1})[0], (std::vector<std::int64_t>{1, 1, 1, 0, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(token_costs(l, 8, {2, 3})[0], (std::vector<std::int64_t>{5, 7, 9, 0, 5, 7, 0, 0}));
  EXPECT_EQ(equal_plan(8, 4).cuts, (std::vector<std::int64_t>{0, 2, 4, 6, 8}));
  // Total 9 at cp 3: cost[0, t) must reach 3 and 6: [1, 3, 6, ...] -> cuts 2 and 3.
  EXPECT_EQ(balanced_plan(token_costs(l, 8, {1, 0}), 8, 3).cuts, (std::vector<std::int64_t>{0, 2, 3, 8}));
  EXPECT_EQ(balanced_plan({{0, 0, 0, 0}}, 4, 2).cuts, (std::vector<std::int64_t>{0, 2, 4}));  // all padding: equal
  EXPECT_EQ(token_cost_name(parse_token_cost("attention=2,linear=3")), "attention=2,linear=3");
  EXPECT_THROW(parse_token_cost("attention=-1"), InvalidInput);
  EXPECT_THROW(parse_token_cost("attention=0,linear=0"), InvalidInput);
  EXPECT_THROW(parse_token_cost("quadratic"), InvalidInput);
}

// A padding gap inside a document (an unpacked row's padding_mask) does not restart
// its attention cost: a token after the gap costs t - doc_start + 1, the span of
// its causal window, as docs/sharding.md says. [1, 2, pad, 4, 5, 6] cut at CP 3
// where the running cost (1, 3, 3, 7, 12, 18) reaches 6 and 12: [0, 4, 5, 6].
TEST(ShardPlan, APaddingGapInsideADocumentDoesNotRestartItsCost) {
  Batch b;
  b["input_ids"] = Tensor::from<std::int64_t>({1, 6}, {1, 2, 0, 3, 4, 5});
  b["padding_mask"] = Tensor::from<std::int64_t>({1, 6}, {0, 0, 1, 0, 0, 0});
  const Layout l = derive_layout(b);
  EXPECT_EQ(token_costs(l, 6, {1, 0})[0], (std::vector<std::int64_t>{1, 2, 0, 4, 5, 6}));
  EXPECT_EQ(balanced_plan(token_costs(l, 6, {1, 0}), 6, 3).cuts, (std::vector<std::int64_t>{0, 4, 5, 6}));
  // A left-padded row starts its document after the padding.
  Batch left;
  left["input_ids"] = Tensor::from<std::int64_t>({1, 5}, {0, 0, 7, 8, 9});
  left["padding_mask"] = Tensor::from<std::int64_t>({1, 5}, {1, 1, 0, 0, 0});
  EXPECT_EQ(token_costs(derive_layout(left), 5, {1, 0})[0], (std::vector<std::int64_t>{0, 0, 1, 2, 3}));
  // cpsim plan says the same.
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-gap-plan-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "gap.json") << R"({"input_ids": [[1, 2, 0, 3, 4, 5]], "padding_mask": [[0, 0, 1, 0, 0, 0]]})";
  const auto r = cpsim::testing::run_process(
      {CPSIM_BINARY, "plan", (dir / "gap.json").string(), "--cp", "3", "--json"}, 60s);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.dump().find("[0,4,5,6]") != std::string::npos, true) << r.out;
  std::filesystem::remove_all(dir);
}

// Every balanced cut is the smallest t with c * cost[0, t) >= r * total, by brute force.
TEST(ShardPlan, TheBalancedCutIsTheSmallestThatReachesItsShare) {
  cpsim::testing::check_property([] {
    const int cp = *rc::gen::inRange(1, 17);
    const int rows = *rc::gen::inRange(1, 4);
    const std::int64_t P = cp * *rc::gen::inRange(1, 12);
    std::vector<std::vector<std::int64_t>> costs(rows);
    for (auto& row : costs) row = *rc::gen::container<std::vector<std::int64_t>>(P, rc::gen::inRange<std::int64_t>(0, 9));
    const ShardPlan plan = balanced_plan(costs, P, cp);
    RC_ASSERT(plan.ranks() == cp);
    RC_ASSERT(plan.cuts.front() == 0 && plan.cuts.back() == P);
    std::int64_t total = 0;
    for (const auto& row : costs)
      for (auto v : row) total += v;
    const auto prefix = [&](std::int64_t t) {
      std::int64_t s = 0;
      for (const auto& row : costs)
        for (std::int64_t i = 0; i < t; ++i) s += row[i];
      return s;
    };
    for (int r = 1; r < cp; ++r) {
      RC_ASSERT(plan.cuts[r] >= plan.cuts[r - 1]);
      if (total == 0) {
        RC_ASSERT(plan.cuts[r] == P / cp * r);
        continue;
      }
      std::int64_t want = 0;
      while (cp * prefix(want) < r * total) ++want;
      RC_ASSERT(plan.cuts[r] == want);
    }
  });
}

TEST(ShardPlan, PlanShowsTheBalancedPlanAgainstTheEqualOne) {
  const std::string examples = std::string(CPSIM_SOURCE_DIR) + "/examples/";
  for (const char* example : {"packed_two_rows.json", "lengths_only.json", "thd_cu_seqlens.json"}) {
    const auto r = cpsim::testing::run_process({CPSIM_BINARY, "plan", examples + example, "--cp", "4", "--json"}, 60s);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    const double equal = j["plans"]["equal"]["imbalance"], balanced = j["plans"]["balanced"]["imbalance"];
    EXPECT_LE(balanced, equal + 1e-12) << example;
    EXPECT_EQ(j["plans"]["balanced"]["ranks"].size(), 4u);
    std::int64_t tokens = 0;
    for (const auto& rank : j["plans"]["balanced"]["ranks"]) tokens += rank["tokens"].get<std::int64_t>();
    std::int64_t equal_tokens = 0;
    for (const auto& rank : j["plans"]["equal"]["ranks"]) equal_tokens += rank["tokens"].get<std::int64_t>();
    EXPECT_EQ(tokens, equal_tokens) << "a plan moves tokens, it never loses them";
  }
  const auto t = cpsim::testing::run_process({CPSIM_BINARY, "plan", examples + "lengths_only.json", "--cp", "8"}, 60s);
  EXPECT_EQ(t.status, 0) << t.err;
  EXPECT_THAT(t.out, HasSubstr("imbalance (max / mean cost): equal"));
  const auto svg = std::filesystem::temp_directory_path() / ("cpsim-plan-" + std::to_string(::getpid()) + ".svg");
  const auto drawn = cpsim::testing::run_process(
      {CPSIM_BINARY, "plan", examples + "packed_two_rows.json", "--cp", "3", "--svg", svg.string()}, 60s);
  EXPECT_EQ(drawn.status, 0) << drawn.err;
  std::ifstream in(svg);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("balanced (imbalance "));
  EXPECT_THAT(text, HasSubstr("<g transform"));  // the bars, under the layout picture
  std::size_t svgs = 0;
  for (auto at = text.find("<svg"); at != std::string::npos; at = text.find("<svg", at + 1)) ++svgs;
  EXPECT_EQ(svgs, 2u);
  std::filesystem::remove(svg);
  const auto f = cpsim::testing::run_process({CPSIM_BINARY, "plan", "--family", examples + "families/interior_padding.json",
                                              "--cp", "4", "--samples", "30"},
                                             60s);
  EXPECT_EQ(f.status, 0) << f.err;
  EXPECT_THAT(f.out, HasSubstr("balanced imbalance mean"));
  const auto bad = cpsim::testing::run_process({CPSIM_BINARY, "plan", examples + "lengths_only.json", "--cp", "2",
                                                "--cost", "cubic"},
                                               30s);
  EXPECT_EQ(bad.status, 2);
  EXPECT_THAT(bad.err, HasSubstr("--cost cubic"));
}

// --plan on check, show, fuzz and golden: equal, balanced, a plan file; what does
// not fit is exit 2 with one line naming it.
TEST(ShardPlan, EveryCommandTakesAPlan) {
  const std::string cpsim = CPSIM_BINARY, example = std::string(CPSIM_SOURCE_DIR) + "/examples/spec_example.json";
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-plan-cli-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream((dir / name).string()) << text;
    return (dir / name).string();
  };
  const std::string cuts = write("cuts.json", R"({"cuts": [0, 7, 7, 9]})");  // S = 8, cp 3: P = 9, rank 1 empty
  auto r = cpsim::testing::run_process({cpsim, "check", example, "--plan", cuts}, 60s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("cp=3"));  // a plan file fixes the CP size
  r = cpsim::testing::run_process({cpsim, "check", example, "--plan", "balanced", "--cost", "attention=1,linear=4",
                                   "--cp", "1,2,3,4,8"},
                                  60s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  r = cpsim::testing::run_process({cpsim, "show", example, "--cp", "3", "--plan", cuts, "--color", "never"}, 60s);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("cuts [0, 7, 7, 9]"));
  EXPECT_THAT(r.out, HasSubstr("||"));  // the empty interval between two cuts
  r = cpsim::testing::run_process({cpsim, "fuzz", "--cases", "30", "--max-cp", "6", "--plan", "balanced"}, 120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("plans balanced:attention"));
  // What does not fit: exit 2, one line.
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{cpsim, "check", example, "--plan", cuts, "--cp", "2"}, "cuts for 3 ranks"},
      {{cpsim, "check", example, "--plan", write("short.json", R"({"cuts": [0, 5, 9]})"), "--cp", "2"},
       "must run from 0 to the padded length 8"},
      {{cpsim, "check", example, "--plan", write("down.json", R"({"cuts": [0, 6, 4, 9]})")}, "cuts index 2"},
      {{cpsim, "check", example, "--plan", write("bad.json", R"({"cuts": [0, "x", 9]})")}, "cuts index 1"},
      {{cpsim, "check", example, "--plan", write("key.json", R"({"cut": [0, 9]})")}, "expected {\"cuts\""},
      // Read as strictly as batch files: a key twice, or more after the object.
      {{cpsim, "check", example, "--plan", write("twice.json", R"({"cuts": [0, 9], "cuts": [0, 4, 9]})")},
       "cuts: key appears twice"},
      {{cpsim, "check", example, "--plan", write("more.json", R"({"cuts": [0, 9]} {})")}, "more after the JSON value"},
      {{cpsim, "check", example, "--plan", write("deep.json", R"({"cuts": [0, 9], "comment": [[[[1]]]]})")},
       "nested deeper than 4 levels"},
      {{cpsim, "check", example, "--plan", "zigzag"}, "expected equal, balanced or a plan file"},
      {{cpsim, "check", example, "--plan", "random"}, "draws plans for fuzz"},
      {{cpsim, "fuzz", "--plan", cuts}, "cannot fit"},
      {{cpsim, "check", example, "--plan", "balanced", "--cost", "quadratic"}, "--cost quadratic"}};
  for (const auto& [argv, why] : refused) {
    const auto e = cpsim::testing::run_process(argv, 60s);
    EXPECT_EQ(e.status, 2) << argv[3] << "\n" << e.out << e.err;
    EXPECT_THAT(e.err, HasSubstr(why)) << argv[3];
    EXPECT_EQ(std::count(e.err.begin(), e.err.end(), '\n'), 1) << e.err;
  }
  std::filesystem::remove_all(dir);
}
