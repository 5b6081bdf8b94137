// Layout families (SPEC §5): the shipped families read, their generator draws only
// members (checked by family_violation, which reads the batch's own keys), every
// property holds on them, a malformed family file is one line naming the field,
// and a bug only interior padding exposes is found by the interior-padding family
// with a counterexample that is still a member, while a family without it cannot
// find it.
#include <gmock/gmock.h>

#include <filesystem>
#include <fstream>

#include "tests/rapidcheck_gtest.hpp"
#include "tests/subprocess.hpp"
#include "verify/family.hpp"
#include "verify/properties.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {

const std::string kFamilies = std::string(CPSIM_SOURCE_DIR) + "/examples/families/";

std::vector<std::string> shipped() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(kFamilies)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A layout that assumes padding only at the row's tail: the first (number of real
// tokens) positions are real. Right wherever documents carry no padding inside.
Layout padding_at_the_tail(const Batch& batch) {
  Layout l = derive_layout(batch);
  const std::int64_t B = l.padding.dim(0), S = l.padding.dim(1);
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t real = 0;
    for (std::int64_t s = 0; s < S; ++s) real += l.padding.get_int(b * S + s) == 0;
    for (std::int64_t s = 0; s < S; ++s) l.padding.set(b * S + s, s >= real ? 1.0 : 0.0);
  }
  return l;
}

// mRoPE turned as plain RoPE by the temporal plane alone (a text model's rotary
// layer reused for a vision-language one): right on text, wrong inside an image.
Var rope_by_temporal_plane(const Var& x, const Tensor& positions) {
  if (positions.ndim() != 3) return rope(x, positions);
  return rope(x, narrow(positions, 0, 0, 1).reshape({positions.dim(1), positions.dim(2)}));
}

// A sharder that cuts [3, B, S] position_ids along axis 1 (pos[:, lo:hi], as for
// [B, S] keys): the rows, not the sequence. Right at CP size 1 only.
ShardedBatch shard_planes_by_rows(int rank, int cp, const Batch& batch, std::int64_t pad_token_id, bool shard_primary,
                                  const PlanChoice& plan) {
  ShardedBatch sb = shard_batch_at(rank, cp, batch, std::nullopt, pad_token_id, shard_primary, 1, plan);
  Batch b = batch;
  normalize_batch_axis(b);
  if (!b.count("position_ids")) return sb;
  const Tensor& pos = b.at("position_ids");
  if (pos.ndim() == 3) {
    const std::int64_t rows = pos.dim(1), lo = std::min(sb.context.seq_start(), rows),
                       hi = std::min(sb.context.seq_start() + sb.context.local_seq_len(), rows);
    sb.local["position_ids"] = narrow(pos.to(DType::i64), 1, lo, hi - lo);
  }
  return sb;
}

}  // namespace

TEST(Families, TheShippedFamiliesDrawOnlyTheirMembers) {
  const auto files = shipped();
  ASSERT_GE(files.size(), 7u);
  for (const auto& path : files) {
    const LayoutFamily family = read_family(path);
    const auto gen = gen_family_case(family);
    for (int k = 0; k < 150; ++k) {
      const LayoutCase c = gen(rc::Random(k + 1), k % 101).value();
      ASSERT_EQ(family_violation(family, c), "") << path << " draw " << k << ": " << c;
      Batch b = c.batch;
      normalize_batch_axis(b);  // THD families give [S] tensors
      ASSERT_NO_THROW(derive_layout(b)) << path << ": " << c;
    }
  }
}

// Under the equal plan, the balanced one and drawn plans (random cuts, empty
// intervals included). `cpsim fuzz --family F --cases 500 --plan equal|balanced`
// is the long form of this.
TEST(Families, EveryPropertyHoldsOnEveryShippedFamilyUnderEveryPlan) {
  const std::vector<PlanDraw> plans = {PlanChoice{}, parse_plan_choice("balanced"), std::nullopt};
  for (const auto& path : shipped()) {
    const LayoutFamily family = read_family(path);
    CheckOptions o;
    for (const PlanDraw& plan : plans) {
      const auto gen = gen_family_case(family, 16, plan);
      for (int k = 0; k < 8; ++k) {
        const LayoutCase c = gen(rc::Random(100 + k), 20).value();
        for (const auto& r : check_all(c, o)) ASSERT_TRUE(r.ok) << path << " " << r.property << ": " << r.detail << "\n" << c;
      }
    }
  }
}

TEST(Families, FuzzDrawsAFamilyAndShowDrawsItsMembers) {
  const auto r = cpsim::testing::run_process(
      {CPSIM_BINARY, "fuzz", "--family", kFamilies + "te_thd_2cp.json", "--cases", "20", "--max-cp", "8"}, 120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("20 members of family te_thd_2cp"));
  const auto none = cpsim::testing::run_process(
      {CPSIM_BINARY, "fuzz", "--family", kFamilies + "fewer_tokens_than_ranks.json", "--max-cp", "2"}, 60s);
  EXPECT_EQ(none.status, 2);
  EXPECT_THAT(none.err, HasSubstr("--max-cp 2 leaves none"));
  const auto s = cpsim::testing::run_process(
      {CPSIM_BINARY, "show", "--family", kFamilies + "static_graph_thd.json", "--samples", "2", "--color", "never"},
      60s);
  EXPECT_EQ(s.status, 0) << s.out << s.err;
  EXPECT_THAT(s.out, HasSubstr("member 2 (cp="));
  EXPECT_THAT(s.out, HasSubstr("cu_seqlens_padded"));
}

TEST(Families, AMalformedFamilyIsOneLineNamingTheField) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-families-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"form": "seq_lens", "documents": [1, 2], "document_length": [3, 1]})", "\"document_length\""},
      {R"({"form": "thd", "documents": [1, 2], "document_length": [1, 3]})", "\"form\""},
      {R"({"form": "seq_lens", "document_length": [1, 3]})", "\"documents\""},
      {R"({"form": "seq_lens", "documents": [1, 2], "document_length": [1, 3], "interior_padding": [1, 2]})",
       "\"interior_padding\""},
      {R"({"form": "cu_seqlens", "rows": [1, 4], "documents": [1, 2], "document_length": [1, 3]})", "\"rows\""},
      {R"({"form": "seq_lens", "documents": [1, 2], "document_length": [1, 3], "colour": 1})", "\"colour\""},
      {R"({"form": "seq_lens", "documents": [1, 2], "document_length": [1, 3], "pad_documents_to": "3*cp"})",
       "\"pad_documents_to\""},
      {R"({"form": "seq_lens", "documents": [1, 2], "document_length": [1, 3], "tail_in_last_document": true})",
       "\"tail_in_last_document\""},
      {R"({"form": "unpacked", "documents": [1, 1], "document_length": [1, 3], "position_ids": true})",
       "\"position_ids\""}};
  for (const auto& [text, field] : bad) {
    const auto path = dir / "family.json";
    std::ofstream(path) << text;
    const auto r = cpsim::testing::run_process({CPSIM_BINARY, "fuzz", "--family", path.string(), "--cases", "1"}, 30s);
    EXPECT_EQ(r.status, 2) << text << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(field)) << text;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  std::filesystem::remove_all(dir);
}

// The negative control: padding assumed at the row's tail. Only layouts with
// padding inside the row show it; the interior-padding family finds it and shrinks
// within the family; a family whose documents carry no padding never does.
TEST(Families, PaddingAssumedAtTheTailIsFoundOnlyByInteriorPaddingLayouts) {
  const LayoutFamily interior = read_family(kFamilies + "interior_padding.json");
  std::optional<LayoutCase> smallest;
  const auto gen = gen_family_case(interior);
  const std::string report = cpsim::testing::expect_counterexample("padding at the tail", [&] {
    const LayoutCase c = *gen;
    const PropertyResult r = check_row("layout", c, {}, {.layout = padding_at_the_tail});
    if (!r.ok) smallest = c;
    RC_ASSERT(r.ok);
  });
  ASSERT_FALSE(report.empty()) << "the interior-padding family did not find the bug";
  ASSERT_TRUE(smallest.has_value());
  EXPECT_EQ(family_violation(interior, *smallest), "") << *smallest;
  EXPECT_LE(smallest->batch.at("seq_lens").dim(1), 3) << *smallest;  // at most 3 documents
  if (std::getenv("CPSIM_SHOW_COUNTEREXAMPLES")) std::cout << *smallest << "\n";

  const LayoutFamily tail_only = read_family(kFamilies + "eos_is_pad.json");
  const auto tail_gen = gen_family_case(tail_only);
  const std::string none = cpsim::testing::expect_counterexample(
      "padding at the tail, tail-only family", [&] { RC_ASSERT(check_row("layout", *tail_gen, {}, {.layout = padding_at_the_tail}).ok); },
      200);
  EXPECT_EQ(none, "") << "a family without interior padding should not expose the bug";
}

// A packer that counts a row's tail in its last document (Automodel's pack_dataset):
// every member's rows are filled by their documents and carry position_ids, and a
// batch whose tail lies after its last document, or without position_ids, is not one.
TEST(Families, ATailInTheLastDocumentFillsEveryRow) {
  const LayoutFamily family = read_family(kFamilies + "nemo_automodel_pack_dataset.json");
  ASSERT_TRUE(family.tail_in_last_document && family.position_ids);
  const auto gen = gen_family_case(family);
  for (int k = 0; k < 60; ++k) {
    const LayoutCase c = gen(rc::Random(k + 7), k % 101).value();
    const Tensor &padded = c.batch.at("seq_lens_padded"), &ids = c.batch.at("input_ids");
    const std::int64_t S = ids.dim(1);
    for (std::int64_t r = 0; r < padded.dim(0); ++r) {
      std::int64_t used = 0;
      for (std::int64_t d = 0; d < padded.dim(1); ++d) used += std::max<std::int64_t>(0, padded.get_int(r * padded.dim(1) + d));
      EXPECT_EQ(used, S) << c;
    }
    ASSERT_TRUE(c.batch.count("position_ids")) << c;
    LayoutCase without = c;
    without.batch.erase("position_ids");
    EXPECT_THAT(family_violation(family, without), HasSubstr("position_ids"));
  }
  LayoutFamily tail_after = family;
  tail_after.tail_in_last_document = false;
  tail_after.tail_padding = {1, 8};
  const auto outside = gen_family_case(tail_after);
  for (int k = 0; k < 20; ++k) {
    const LayoutCase c = outside(rc::Random(k + 3), 50).value();
    EXPECT_THAT(family_violation(family, c), HasSubstr("the tail in the last document")) << c;
  }
}

// mRoPE (vision_language_mrope): members carry [3, S] position_ids whose planes
// differ inside image grids; every property holds on them (above), and two bugs
// that pass every [B, S] layout are found on them: RoPE by the temporal plane
// alone, and a sharder that cuts the planes' rows instead of their sequence.
TEST(Families, MropeMembersCatchRopeByOnePlaneAndPlanesShardedByRows) {
  const LayoutFamily family = read_family(kFamilies + "vision_language_mrope.json");
  ASSERT_TRUE(family.mrope && family.image_spans);
  const auto gen = gen_family_case(family);
  int grids = 0;
  for (int k = 0; k < 50; ++k) {
    const LayoutCase c = gen(rc::Random(k + 1), 40).value();
    const Tensor& pos = c.batch.at("position_ids");
    ASSERT_EQ(pos.shape(), (Shape{3, c.batch.at("input_ids").numel()})) << c;
    for (std::int64_t s = 0; s < pos.dim(1); ++s) grids += pos.get_int(s) != pos.get_int(2 * pos.dim(1) + s);
  }
  EXPECT_GT(grids, 0) << "no member had an image grid";
  CheckOptions o;
  o.key_dim = 8;  // pairs: 2 temporal, 1 height, 1 width
  for (const auto& planted :
       {std::tuple<std::string, std::string, Impl>{"rope by the temporal plane", "rope", {.rope = rope_by_temporal_plane}},
        {"attention after rope by the temporal plane", "attention_forward", {.rope = rope_by_temporal_plane}},
        {"planes sharded by rows", "shard", {.shard = shard_planes_by_rows}}}) {
    // Named copies, not structured bindings: the lambdas below capture them.
    const std::string& name = std::get<0>(planted);
    const std::string& row = std::get<1>(planted);
    const Impl& impl = std::get<2>(planted);
    const std::string report = cpsim::testing::expect_counterexample(name, [&] {
      const LayoutCase c = *gen;
      RC_ASSERT(check_row(row, c, o, impl).ok);
    });
    EXPECT_FALSE(report.empty()) << name << ": passed every member";
    // Neither bug shows on [B, S] positions: the plain vision-language family passes.
    const auto plain = gen_family_case(read_family(kFamilies + "vision_language.json"));
    EXPECT_EQ(cpsim::testing::expect_counterexample(
                  name + " on [B, S] positions", [&] { RC_ASSERT(check_row(row, *plain, o, impl).ok); }, 100),
              "")
        << name;
  }
}

// cpsim fuzz draws mRoPE too (1 in 6 layouts, image spans as grids):
// RoPE by the temporal plane alone, found on the mRoPE family above, is found
// by fuzz's random draw as well.
TEST(Families, FuzzDrawsMropeLayoutsAndFindsRopeByOnePlane) {
  const auto gen = gen_layout_case(8, std::nullopt, fuzz_draw_limits());
  int planes = 0, grids = 0;
  for (int i = 0; i < 300; ++i) {
    const LayoutCase c = gen(rc::Random(777 + i), i % 100).value();
    if (!c.batch.count("position_ids") || c.batch.at("position_ids").numel() != 3 * c.batch.at("input_ids").numel())
      continue;
    ++planes;
    const Tensor& pos = c.batch.at("position_ids");
    const std::int64_t n = pos.numel() / 3;
    for (std::int64_t i = 0; i < n; ++i) grids += pos.get_int(i) != pos.get_int(2 * n + i);
  }
  EXPECT_GE(planes, 20) << "of 300 draws";
  EXPECT_GT(grids, 0);
  CheckOptions o;
  o.key_dim = 8;
  EXPECT_NE(cpsim::testing::expect_counterexample("rope by the temporal plane, fuzz's draw", [&] {
              const LayoutCase c = *gen;
              RC_ASSERT(check_row("rope", c, o, {.rope = rope_by_temporal_plane}).ok);
            }),
            "");
}
