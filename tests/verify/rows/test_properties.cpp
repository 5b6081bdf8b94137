// The SPEC §5 properties over random packed layouts, CP sizes 1-16.
#include <gmock/gmock.h>

#include "tests/rapidcheck_gtest.hpp"
#include "core/device.hpp"
#include "verify/batch_io.hpp"
#include "verify/generators.hpp"
#include "verify/memory.hpp"
#include "verify/properties.hpp"
#include "core/comm/run_ranks.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <map>
#include <set>

using namespace cpsim;
using namespace cpsim::verify;

namespace {
void assert_holds(const PropertyResult& r) {
  if (!r.ok) RC_FAIL(r.property + " failed at cp=" + std::to_string(r.cp) + ": " + r.detail);
}
CheckOptions on(const std::string& backend) {
  CheckOptions o;
  o.backend = backend;
  return o;
}
// Case `seed` of `gen` (size 30) at cp `cp`.
LayoutCase drawn_at(const rc::Gen<LayoutCase>& gen, int seed, int cp) {
  return at_cp(gen(rc::Random(seed), 30).value(), cp);
}
// Convolution shapes drawn per case: every width 1-8, a few channels.
CheckOptions conv_options(const std::string& backend) {
  CheckOptions o = on(backend);
  o.conv_width = *rc::gen::inRange(1, 9);
  o.channels = *rc::gen::inRange(1, 4);
  return o;
}
}  // namespace

// Every file of rows of the property table (verify/rows/table.def) on every
// registered backend: a row added to the table runs here, on every backend, with
// no edit. A file's rows run on one prepared case per drawn layout, so the rows
// that share a simulation (a forward and its backward) share it, as `cpsim check`
// runs them; a file whose rows run no ranks runs once ("local"). Convolution
// shapes are drawn for every case (every width 1-8, a few channels).
struct RowsOn {
  std::string file, backend;
};
void PrintTo(const RowsOn& r, std::ostream* os) { *os << r.file << " on " << r.backend; }
std::vector<RowsOn> every_file_on_every_backend() {
  std::vector<RowsOn> out;
  for (const RowFile& f : property_files()) {
    if (!f.runs_ranks) out.push_back({f.name, "local"});
    else
      for (const std::string& b : backend_names()) out.push_back({f.name, b});
  }
  return out;
}

class Rows : public ::testing::TestWithParam<RowsOn> {};
INSTANTIATE_TEST_SUITE_P(Table, Rows, ::testing::ValuesIn(every_file_on_every_backend()),
                         [](const auto& info) {
                           std::string name = info.param.file + "_on_" + info.param.backend;
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST_P(Rows, HoldOnDrawnLayouts) {
  const RowsOn on_param = GetParam();
  const RowFile& file = *std::find_if(property_files().begin(), property_files().end(),
                                      [&](const RowFile& f) { return f.name == on_param.file; });
  cpsim::testing::check_property(cpsim::testing::over<LayoutCase>([&](const LayoutCase& c) {
    const CheckOptions o = conv_options(on_param.backend == "local" ? "threads" : on_param.backend);
    Prepared prepared(c);
    for (const PropertyRow& row : property_table())
      if (std::find(file.rows.begin(), file.rows.end(), row.name) != file.rows.end())
        assert_holds(run_row(row, prepared, o));
  }));
}

// The table's files are table.def's lines, and together they hold every row once.
TEST(PropertyTable, ItsFilesAreTableDefsLinesAndHoldEveryRowOnce) {
  std::vector<std::string> lines, rows;
  std::ifstream in(std::string(CPSIM_SOURCE_DIR) + "/verify/rows/table.def");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("CPSIM_ROWS(", 0) == 0) lines.push_back(line.substr(11, line.find(')') - 11));
  std::vector<std::string> files;
  for (const RowFile& f : property_files()) {
    files.push_back(f.name);
    rows.insert(rows.end(), f.rows.begin(), f.rows.end());
  }
  EXPECT_EQ(files, lines);
  std::vector<std::string> table;
  for (const PropertyRow& row : property_table()) table.push_back(row.name);
  EXPECT_EQ(rows, table);
}

// Properties beyond the table's rows that run ranks: once per simulated backend.
class Distributed : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Backends, Distributed, ::testing::ValuesIn(backend_names()),
                         [](const auto& info) { return info.param; });

// A library's contract limits the random draw: only the listed forms, each as
// often as any other at every generator size (small sizes included, where
// RapidCheck starts), and every row long enough for min_shard positions a rank.
TEST(Generators, DrawLimitsKeepToTheFormsAndTheShortestShard) {
  DrawLimits limits;
  limits.forms = {LayoutForm::unpacked, LayoutForm::position_resets};
  limits.min_shard = 3;
  const auto gen = gen_layout_case(std::vector<int>{1, 2, 4, 8}, std::nullopt, limits);
  std::map<std::string, int> seen;
  for (int i = 0; i < 400; ++i) {
    const LayoutCase c = gen(rc::Random(99 + i), i % 20).value();
    Batch b = c.batch;
    normalize_batch_axis(b);
    const std::int64_t S = sequence_length(b);
    EXPECT_GE((S + c.cp - 1) / c.cp, 3) << c;
    EXPECT_FALSE(b.count("seq_lens") || b.count("cu_seqlens") || b.count("cu_seqlens_padded")) << c;
    seen[b.count("position_ids") && !b.count("attention_mask") && !b.count("padding_mask") ? "resets, no mask"
                                                                                           : "other"]++;
    seen["cp " + std::to_string(c.cp)]++;
  }
  for (const char* cp : {"cp 1", "cp 2", "cp 4", "cp 8"}) EXPECT_GE(seen[cp], 60) << cp;
  EXPECT_GE(seen["other"], 100);
}

// cpsim fuzz draws long layouts too (512-2048 tokens): their tensors pass the

// check(dp=D) draws one global batch whose rows the D replicas share: a
// multiple of D rows, in [B, S] row forms only (a THD stream is one row), each
// multiple drawn; with a forms filter, its row forms only.
TEST(Generators, RowsMultipleDrawsRowsEveryReplicaTakesItsShareOf) {
  for (const int m : {2, 3}) {
    DrawLimits limits;
    limits.rows_multiple = m;
    const auto gen = gen_layout_case(std::vector<int>{1, 2, 4}, std::nullopt, limits);
    std::set<std::int64_t> rows;
    for (int i = 0; i < 300; ++i) {
      const LayoutCase c = gen(rc::Random(77 + i), i % 100).value();
      EXPECT_FALSE(c.batch.count("cu_seqlens") || c.batch.count("cu_seqlens_padded")) << c;
      EXPECT_EQ(c.batch.at("input_ids").ndim(), 2) << c;
      EXPECT_EQ(batch_rows(c.batch) % m, 0) << c;
      rows.insert(batch_rows(c.batch));
    }
    EXPECT_EQ(rows, (std::set<std::int64_t>{m, 2 * m, 3 * m})) << "rows multiple " << m;
  }
  DrawLimits limits;
  limits.rows_multiple = 2;
  limits.forms = {LayoutForm::cu_seqlens, LayoutForm::seq_lens};
  const auto gen = gen_layout_case(std::vector<int>{2}, std::nullopt, limits);
  for (int i = 0; i < 50; ++i) {
    const LayoutCase c = gen(rc::Random(5 + i), 10).value();
    EXPECT_TRUE(c.batch.count("seq_lens") && !c.batch.count("cu_seqlens")) << c;
  }
  limits.forms = {LayoutForm::cu_seqlens};
  EXPECT_THROW(gen_layout_case(std::vector<int>{2}, std::nullopt, limits), Error);
}
// host memory cache's 64 KiB, so the blocks one property row frees are handed
// to the next rows, of other shapes (a reused block not cleared was caught only
// by tests/core/test_host_memory.cpp before: 1300 short fuzz cases passed it).
TEST(Generators, FuzzDrawsLongLayoutsWhoseBlocksTheNextRowsReuse) {
  const auto gen = gen_layout_case(8, std::nullopt, fuzz_draw_limits());
  std::vector<LayoutCase> long_ones;
  for (int i = 0; i < 200; ++i) {
    LayoutCase c = gen(rc::Random(4321 + i), i % 100).value();
    Batch b = c.batch;
    normalize_batch_axis(b);
    if (sequence_length(b) >= 512) long_ones.push_back(std::move(c));
  }
  EXPECT_GE(long_ones.size(), 10u) << "of 200 draws";
  ASSERT_FALSE(long_ones.empty());
  CheckOptions o;
  std::size_t cached = 0;  // the most the cache held as a row began
  o.on_row = [&](const std::string&, int, int) { cached = std::max(cached, host_cache_bytes()); };
  for (const auto& r : check_all(long_ones[0], o)) EXPECT_TRUE(r.ok) << r.property << ": " << r.detail;
  EXPECT_GE(cached, std::size_t{64} << 10) << "the rows of a long case hand their blocks on";
}

// Long lengths per rank: every long draw is cp x 65..80 tokens, so that each
// rank's equal shard spans two 64-token chunks at every CP size.
TEST(Generators, LongLengthsPerRankGiveEveryShardTheLongLengths) {
  DrawLimits limits;
  limits.long_every = 1;  // every draw long
  limits.long_min = 65, limits.long_max = 80, limits.long_per_rank = true;
  const auto gen = gen_layout_case(std::vector<int>{1, 2, 3, 4}, std::nullopt, limits);
  std::set<int> sizes;
  for (int i = 0; i < 60; ++i) {
    const LayoutCase c = gen(rc::Random(99 + i), 30).value();
    Batch b = c.batch;
    normalize_batch_axis(b);
    const std::int64_t S = sequence_length(b);
    EXPECT_GE(S, 65 * c.cp) << c;
    EXPECT_LE(S, 80 * c.cp) << c;
    sizes.insert(c.cp);
  }
  EXPECT_EQ(sizes.size(), 4u);
}

// Live gates: each head's log-decay in [-factor, 0] for its own factor (1, 0.01,
// 0.1, 0 in a drawn rotation): heads differ, and one head in two keeps a state
// over a 64-token chunk (a mean decay of e^(-0.5) or more over it); else every
// head's in [-1, 0], its mean over a chunk e^(-32). The recurrence rows, cpsim's CP
// operator against its reference, hold on long shards with them.
TEST(Generators, LiveGatesDecayEachHeadByItsOwnFactorAndTheRecurrenceHolds) {
  const std::int64_t H = 2, K = 4, P = 64;
  std::set<std::pair<int, int>> pairs;
  for (std::uint64_t seed = 1; seed <= 16; ++seed) {
    const RecurrenceInputs live = random_recurrence_inputs(1, P, H, K, 4, seed, true);
    const RecurrenceInputs plain = random_recurrence_inputs(1, P, H, K, 4, seed, false);
    int slowest = 0;
    std::vector<int> factor_index(H);
    for (std::int64_t h = 0; h < H; ++h) {
      double least = 0, sum = 0, plain_sum = 0;
      for (std::int64_t t = 0; t < P; ++t)
        for (std::int64_t a = 0; a < K; ++a) {
          const double g = live.g.get((t * H + h) * K + a);
          ASSERT_LE(g, 0.0);
          least = std::min(least, g);
          sum += g;
          plain_sum += plain.g.get((t * H + h) * K + a);
        }
      // The live head is the plain draw times its factor, one of the four.
      const double factor = plain_sum == 0 ? 1 : sum / plain_sum;
      const double factors[] = {1.0, 0.01, 0.1, 0.0};
      const auto it = std::find_if(std::begin(factors), std::end(factors),
                                   [&](double f) { return std::abs(f - factor) < 1e-9; });
      ASSERT_NE(it, std::end(factors)) << "head " << h << " scaled by " << factor;
      factor_index[h] = static_cast<int>(it - std::begin(factors));
      EXPECT_GE(least, -*it - 1e-12);
      if (sum / K >= -0.5) ++slowest;  // a channel's mean decay over the chunk, e^(sum / K), at least e^(-0.5)
    }
    EXPECT_NE(factor_index[0], factor_index[1]) << "seed " << seed;
    EXPECT_GE(slowest, 1) << "seed " << seed;
    pairs.insert({factor_index[0], factor_index[1]});
  }
  EXPECT_EQ(pairs.size(), 4u) << "every rotation drawn";

  DrawLimits limits;
  limits.long_every = 1;
  limits.long_min = 65, limits.long_max = 80, limits.long_per_rank = true;
  const auto gen = gen_layout_case(std::vector<int>{2, 3}, std::nullopt, limits);
  CheckOptions o;
  o.live_gates_every = 1;
  for (int i = 0; i < 4; ++i) {
    const LayoutCase c = gen(rc::Random(7 + i), 30).value();
    for (const char* row : {"recurrence_forward", "recurrence_backward", "two_steps"}) {
      const PropertyResult r = check_row(row, c, o);
      EXPECT_TRUE(r.ok && r.cp == c.cp) << row << " at cp " << c.cp << ": " << r.detail;
    }
  }
}

// Fuzz draws unpacked rows whose document has a padding gap inside it (the
// mask's zeros between its real tokens, doc id 0 there and the document's on
// both sides); every such case derives to its truth and holds the layout and
// shard rows. Without the limit no gap is drawn.
TEST(Generators, FuzzDrawsPaddingGapsInsideADocument) {
  const auto interior = [](const LayoutCase& c) {
    const Tensor& id = c.truth->doc_ids;
    const std::int64_t B = id.dim(0), S = id.dim(1);
    for (std::int64_t r = 0; r < B; ++r)
      for (std::int64_t s = 1; s + 1 < S; ++s)
        if (id.get_int(r * S + s) == 0 && id.get_int(r * S + s - 1) > 0)
          for (std::int64_t e = s + 1; e < S; ++e)
            if (id.get_int(r * S + e) != 0) {
              if (id.get_int(r * S + e) == id.get_int(r * S + s - 1)) return true;
              break;
            }
    return false;
  };
  const auto gen = gen_layout_case(4, std::nullopt, fuzz_draw_limits());
  int gaps = 0;
  for (int i = 0; i < 3000 && gaps < 12; ++i) {
    const LayoutCase c = gen(rc::Random(9001 + i), i % 100).value();
    if (!interior(c)) continue;
    ++gaps;
    for (const char* row : {"layout", "shard"}) {
      const PropertyResult r = check_row(row, c, CheckOptions{}, Impl{});
      EXPECT_TRUE(r.ok) << row << ": " << r.detail << "\n" << c;
    }
  }
  EXPECT_GE(gaps, 12) << "of up to 3000 fuzz draws";
  const auto plain = gen_layout_case(4);
  for (int i = 0; i < 300; ++i) EXPECT_FALSE(interior(plain(rc::Random(9001 + i), i % 100).value()));
}

// The generator must draw every layout class SPEC §5 lists; counted over a fixed sample.
TEST(Generators, DrawEveryLayoutClassOfSpecSection5) {
  std::map<std::string, int> seen;
  const auto gen = gen_layout_case();
  for (int i = 0; i < 600; ++i) {
    const LayoutCase c = gen(rc::Random(1234 + i), i % 100).value();
    const LayoutTruth t = *c.truth;
    const std::int64_t B = t.doc_ids.dim(0), S = t.doc_ids.dim(1);
    // Shard edges where the case's plan puts them (the reference's cuts).
    ReferenceGeometry g = reference_geometry(S, c.cp);
    g.cuts = reference_cuts(t, g.padded_len, c.cp, c.plan);
    const auto owner = [&](std::int64_t p) {
      int q = 0;
      while (!(g.start(q) <= p && p < g.end(q))) ++q;
      return q;
    };
    std::set<std::int64_t> edges;
    for (int q = 1; q < c.cp; ++q) edges.insert(g.start(q));
    seen["c=" + std::to_string(c.cp)]++;
    seen[std::string("plan: ") + (c.plan.kind == PlanChoice::Kind::equal      ? "equal"
                                  : c.plan.kind == PlanChoice::Kind::balanced ? "balanced"
                                                                              : "drawn cuts")]++;
    bool unequal = false;
    for (int q = 0; q < c.cp; ++q) {
      if (c.cp > 1 && g.size(q) == 0) seen["plan: an empty interval"]++;
      unequal = unequal || g.size(q) != g.size(0);
      if (c.cp > 1 && g.size(q) > 0 && g.size(q) < 3) seen["shard shorter than W-1"]++;
    }
    if (unequal) seen["plan: unequal intervals"]++;
    if (g.padded_len != S) seen["S not divisible by c"]++;
    std::set<std::int64_t> doc_counts;
    for (std::int64_t r = 0; r < B; ++r) {
      std::vector<std::int64_t> ids(g.padded_len, 0);
      for (std::int64_t s = 0; s < S; ++s) ids[s] = t.doc_ids.get_int(r * S + s);
      const auto cu = segment_cu_seqlens(ids.data(), g.padded_len);
      std::int64_t docs = 0;
      for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
        if (ids[cu[k]] == 0) continue;
        ++docs;
        const int crossed = owner(cu[k + 1] - 1) - owner(cu[k]);
        if (crossed == 1) seen["document crosses one shard edge"]++;
        if (crossed >= 2) seen["document crosses many shard edges"]++;
        if (edges.count(cu[k])) seen["boundary exactly on a shard edge"]++;
        if (cu[k + 1] - cu[k] == 1 && (edges.count(cu[k]) || edges.count(cu[k + 1])))
          seen["length-1 document at a shard edge"]++;
      }
      doc_counts.insert(docs);
      for (int q = 0; q < c.cp && c.cp > 1; ++q) {
        bool all_pad = g.size(q) > 0;
        for (std::int64_t s = g.start(q); s < g.end(q); ++s) all_pad = all_pad && (s >= S || t.padding.get_int(r * S + s));
        if (all_pad) seen["all-padding shard"]++;
      }
      if (S > 1 && t.padding.get_int(r * S) && !t.padding.get_int(r * S + S - 1)) seen["left padding"]++;
      for (std::int64_t s = 0; s < S; ++s)
        if (!t.padding.get_int(r * S + s) && c.batch.at("input_ids").get_int(r * S + s) == c.pad_token_id) {
          seen["real token equal to PAD"]++;
          break;
        }
    }
    if (doc_counts.size() > 1) seen["rows with different document counts"]++;
    // Which SPEC §1 keys carry the layout.
    const auto has = [&](const char* k) { return c.batch.count(k) != 0; };
    if (has("seq_lens") && has("seq_lens_padded")) seen["keys: seq_lens + seq_lens_padded"]++;
    if (has("seq_lens") && !has("seq_lens_padded")) seen["keys: seq_lens alone"]++;
    if (has("cu_seqlens") && has("cu_seqlens_padded")) seen["keys: cu_seqlens + cu_seqlens_padded"]++;
    if (has("cu_seqlens") && !has("cu_seqlens_padded")) seen["keys: cu_seqlens alone"]++;
    if (!has("cu_seqlens") && has("cu_seqlens_padded")) seen["keys: cu_seqlens_padded alone"]++;
    const bool unpacked = !has("seq_lens") && !has("cu_seqlens") && !has("cu_seqlens_padded");
    if (unpacked && has("padding_mask")) seen["keys: unpacked with padding_mask"]++;
    if (unpacked && has("attention_mask")) seen["keys: unpacked with attention_mask"]++;
    if (unpacked && !has("padding_mask") && !has("attention_mask") && has("position_ids"))
      seen["keys: position_ids only"]++;
    if (unpacked && !has("padding_mask") && !has("attention_mask") && !has("position_ids")) seen["keys: tokens only"]++;
    if (unpacked && has("position_ids"))
      for (std::int64_t i = 1; i < t.doc_ids.numel(); ++i)
        if (t.doc_ids.get_int(i) > 1) {
          seen["keys: documents from position_ids resets"]++;
          break;
        }
    if (has("token_type_ids")) seen["an extra [B, S] key"]++;
    if (c.batch.at("input_ids").ndim() == 1) seen["1-D tensors"]++;
    // Real tokens equal to the pad id at a document's end and inside one.
    for (std::int64_t r = 0; r < B; ++r)
      for (std::int64_t s = 0; s + 1 < S; ++s) {
        const std::int64_t i = r * S + s;
        if (t.padding.get_int(i) || c.batch.at("input_ids").get_int(i) != c.pad_token_id) continue;
        const bool ends = t.padding.get_int(i + 1) || t.doc_ids.get_int(i + 1) != t.doc_ids.get_int(i);
        const bool inside = !ends && s > 0 && !t.padding.get_int(i - 1) && t.doc_ids.get_int(i - 1) == t.doc_ids.get_int(i);
        if (ends) seen["PAD id as a document's last real token"]++;
        if (inside) seen["PAD id inside a document"]++;
      }
  }
  for (const char* k : {"c=1", "c=16", "plan: equal", "plan: balanced", "plan: drawn cuts", "plan: an empty interval",
                        "plan: unequal intervals", "S not divisible by c", "shard shorter than W-1", "document crosses one shard edge",
                        "document crosses many shard edges", "boundary exactly on a shard edge",
                        "length-1 document at a shard edge", "all-padding shard", "left padding",
                        "real token equal to PAD", "rows with different document counts",
                        "keys: seq_lens + seq_lens_padded", "keys: seq_lens alone", "keys: cu_seqlens + cu_seqlens_padded",
                        "keys: cu_seqlens alone", "keys: cu_seqlens_padded alone", "keys: unpacked with padding_mask",
                        "keys: unpacked with attention_mask", "keys: position_ids only", "keys: tokens only",
                        "keys: documents from position_ids resets",
                        "an extra [B, S] key", "1-D tensors", "PAD id as a document's last real token",
                        "PAD id inside a document"})
    EXPECT_GT(seen[k], 0) << "the generator never drew: " << k;
}

// convolution_halo (the history alone) through the same rows: the test prepends
// it to the shard itself, so the rows' references judge the halo's values, and the
// gradients it returns to the owners of the history positions.
HaloFn halo_then_shard() {
  return [](const Var& x, Communicator* comm, int width, HaloExchange e, const ShardPlan* plan) {
    const Var halo = convolution_halo(x, comm, width, e, plan);
    EXPECT_EQ(halo.value().shape(), Shape({x.value().dim(0), width - 1, x.value().dim(2)}));
    const std::int64_t H = width - 1, L = x.value().dim(1);
    return record(cat({halo.value(), x.value()}, 1), "test_prepend", {halo, x}, [H, L](const Tensor& g) {
      return std::vector<Tensor>{narrow(g, 1, 0, H).clone(), narrow(g, 1, H, L).clone()};
    });
  };
}

CPSIM_BACKEND_PROP(Distributed, HaloAloneIsTheHistoryAndReturnsItsGradientToTheOwners) {
  const CheckOptions o = conv_options(backend);
  assert_holds(check_row("halo_forward", c, o, {.halo = halo_then_shard()}));
  assert_holds(check_row("halo_backward", c, o, {.halo = halo_then_shard()}));
}

// A case CI drew: one channel whose dbias terms nearly cancel, so the sum over 14
// ranks (empty intervals among them) differs from the token-order reference by
// 2e-12 of its own tiny value. The sums are judged against their summed terms.
TEST(Properties, ConvGradientSumsThatCancelAreJudgedByTheirTerms) {
  const BatchFile f = parse_batch_json(
      R"({"input_ids":[[3,5,4,3,3,5,2,4,1,4,5,0,5,4,3]],"labels":[[-100,-100,-100,-100,-100,-100,-100,-100,-100,)"
      R"(-100,-100,-100,-100,-100,-100]],"pad_token_id":0,"seq_lens":[[-1000]],"seq_lens_padded":[[-1000]]})");
  PlanChoice plan;
  plan.kind = PlanChoice::Kind::cuts;
  plan.cuts = {0, 2, 14, 16, 16, 16, 16, 19, 19, 19, 25, 28, 28, 28, 28};
  const LayoutCase c{f.batch, f.pad_token_id, 14, 8710843780237195814ULL, std::nullopt, plan};
  CheckOptions o;
  o.conv_width = 1;
  o.channels = 1;
  const PropertyResult r = check_row("conv_backward", c, o);
  EXPECT_TRUE(r.ok) << r.detail;
}

namespace cpsim::testing {
extern std::atomic<std::int64_t> counting_groups;  // tests/doubles/delayed_backend.cpp
extern std::atomic<std::int64_t> host_device_allocations;
void register_counting_backend();
void register_host_device_backend();
void register_stalling_backend();
}

// A run that cannot complete (a rank stalls past the timeout) is no verdict on the
// code: every row whose ranks talk is aborted (with the timeout's report), never
// FAIL, and the rows whose ranks do not (no ranks, or RoPE: no collective) still
// give theirs.
TEST(PropertyTable, ARunThatTimesOutIsAbortedNotFailed) {
  cpsim::testing::register_stalling_backend();
  const auto gen = gen_layout_case(4);
  LayoutCase c = gen(rc::Random(5), 30).value();
  c = at_cp(c, 3);
  CheckOptions o;
  o.backend = "stalling";
  o.timeout = std::chrono::milliseconds(150);
  const auto all = check_all(c, o);
  ASSERT_EQ(all.size(), property_table().size());
  const Prepared p(c);
  for (std::size_t k = 0; k < all.size(); ++k) {
    SCOPED_TRACE(all[k].property);
    if (!property_table()[k].runs_ranks || property_table()[k].bytes(p, o) == 0) {
      EXPECT_TRUE(all[k].ok) << all[k].detail;
      EXPECT_FALSE(all[k].aborted);
      continue;
    }
    EXPECT_FALSE(all[k].ok);
    EXPECT_TRUE(all[k].aborted) << all[k].detail;
    EXPECT_THAT(all[k].detail, ::testing::HasSubstr("timeout: rank"));
    EXPECT_THAT(all[k].detail, ::testing::HasSubstr("for rank 2, which never arrived"));
  }
}

// Every row holds when each rank's tensors live on its backend's device: inputs
// go there, operators run there (kernels, plans, layouts, gradients), results come
// back. The device is host memory posing as cuda:0, so this runs without a GPU.
TEST(PropertyTable, EveryRowHoldsWithTensorsOnTheBackendsDevice) {
  cpsim::testing::register_host_device_backend();
  const auto gen = gen_layout_case(4);
  const CheckOptions o = on("host-device");
  for (int i = 0; i < 30; ++i) {
    const LayoutCase c = drawn_at(gen, 911 + i, 1 + i % 4);
    const std::int64_t before = cpsim::testing::host_device_allocations;
    for (const auto& r : check_all(c, o)) EXPECT_TRUE(r.ok) << r.property << ": " << r.detail << "\n" << c;
    if (c.cp > 1) {
      EXPECT_GT(cpsim::testing::host_device_allocations, before) << "nothing was placed on the device";
    }
  }
}

// One table, one harness: every row runs on a case prepared once, and rows that
// share a simulation (the conv forward and backward, the recurrence forward and
// backward) share one run instead of simulating twice.
TEST(PropertyTable, EveryRowRunsOnceOnASharedPreparedCase) {
  const auto& table = property_table();
  std::vector<std::string> names;
  for (const auto& row : table) names.push_back(row.name);
  // The table is what the README and docs/operators.md list, in their order: a row
  // added, removed or moved shows there too.
  for (const char* page : {"README.md", "docs/operators.md"}) {
    std::ifstream in(std::string(CPSIM_SOURCE_DIR) + "/" + page);
    std::vector<std::string> listed;
    bool in_table = false;
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("| property | claim |", 0) == 0) in_table = true;
      else if (in_table && line.empty()) break;
      else if (in_table && line.rfind("| `", 0) == 0) {
        const std::string cell = line.substr(1, line.find(" |", 1) - 1);
        for (std::size_t at = cell.find('`'); at != std::string::npos; at = cell.find('`', cell.find('`', at + 1) + 1))
          listed.push_back(cell.substr(at + 1, cell.find('`', at + 1) - at - 1));
      }
    }
    EXPECT_EQ(listed, names) << page << " lists other property rows than the table";
  }
  std::set<std::string> unique(names.begin(), names.end());
  EXPECT_EQ(unique.size(), names.size()) << "a row name twice";
  for (const auto& row : table) {
    EXPECT_FALSE(row.claim.empty()) << row.name;
    EXPECT_EQ(row.comparison == Comparison::tolerance, row.tolerance > 0) << row.name;
  }
  cpsim::testing::register_counting_backend();
  const auto gen = gen_layout_case(4);
  const CheckOptions o = on("counting");
  for (int i = 0; i < 20; ++i) {
    const LayoutCase c = drawn_at(gen, 77 + i, 2 + i % 3);
    cpsim::testing::counting_groups = 0;
    const auto all = check_all(c, o);
    const std::int64_t shared = cpsim::testing::counting_groups;
    cpsim::testing::counting_groups = 0;
    // Each row alone, on a case prepared for it: nothing shared.
    std::vector<PropertyResult> alone;
    for (const auto& row : table) {
      Prepared own(c);
      alone.push_back(run_row(row, own, o));
    }
    const std::int64_t separate = cpsim::testing::counting_groups;
    // The conv runs once instead of twice (both exchanges in one group), and so do
    // the recurrence, both attention forms and the loss.
    EXPECT_EQ(shared, separate - 5) << c;
    ASSERT_EQ(all.size(), table.size());
    for (std::size_t k = 0; k < all.size(); ++k) {
      EXPECT_TRUE(all[k].ok) << all[k].property << ": " << all[k].detail << "\n" << c;
      EXPECT_EQ(all[k].property, table[k].name);
    }
    for (const auto& r : alone) EXPECT_TRUE(r.ok) << r.property << ": " << r.detail;
  }
}

// Every row has a memory model, so `cpsim check` can estimate a batch's peak before
// it allocates anything (a new row without one would go unestimated).
TEST(PropertyTable, EveryRowHasAMemoryModel) { EXPECT_TRUE(every_row_has_a_memory_model()); }
