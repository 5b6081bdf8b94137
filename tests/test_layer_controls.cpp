// Negative controls of the layers that consume the layout (SPEC §3b): each row is
// run against a planted variant of a bug CP stacks have shipped, and must find a
// counterexample (shrunk by RapidCheck). A variant that skips a collective on one
// rank must be a named call mismatch within the timeout, never a hang.
#include <gmock/gmock.h>

#include "core/attention.hpp"
#include "core/gather.hpp"
#include "core/conv.hpp"
#include "core/loss.hpp"
#include "core/token_shift.hpp"
#include "tests/rapidcheck_gtest.hpp"
#include "verify/batch_io.hpp"
#include "verify/properties.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using cpsim::testing::expect_counterexample;
using ::testing::AnyOf;
using ::testing::HasSubstr;

namespace {

void expect_found(const std::string& report) {
  EXPECT_FALSE(report.empty()) << "the property passed every case against a broken implementation";
  EXPECT_THAT(report, HasSubstr("cp=")) << "the counterexample is not printed as a batch";
  if (std::getenv("CPSIM_SHOW_COUNTEREXAMPLES")) std::cout << report << "\n";
}

// Positions 0..L-1 on every rank instead of the batch's global positions.
Var rope_by_local_index(const Var& x, const Tensor& positions) {
  Tensor local(positions.shape(), DType::i64);
  for (std::int64_t i = 0; i < local.numel(); ++i) local.set(i, static_cast<double>(i % positions.dim(1)));
  return rope(x, local);
}

// Causality by local index: query t sees keys 0..t of the gathered sequence.
CpAttention attention_by_local_index(const Var& q, const Var& k, const Var& v, const PackedContext& ctx,
                                     const Tensor& padding, Communicator* comm, const SparseIndexer* indexer,
                                     const Tensor& probe) {
  // The layer's own steps (gathers, indexer), with every query placed at local index t.
  const ShardPlan* plan = &ctx.plan();
  const Tensor all = visible_doc_ids(ctx, padding);
  const bool sharded = is_distributed(comm);
  const Var kg = gather_sequence(k, comm, true, plan), vg = gather_sequence(v, comm, true, plan);
  const Tensor key_ids = sharded ? all_gather_sequence_tensor(all, *comm, plan) : all;
  Tensor ids = all.clone();  // the probed queries only
  for (std::int64_t i = 0; probe.defined() && i < ids.numel(); ++i)
    if (probe.get_int(i) == 0) ids.set(i, 0);
  CpAttention out;
  if (indexer)
    out.kept = topk_keep(indexer->q, sharded ? all_gather_sequence_tensor(indexer->k, *comm, plan) : indexer->k, ids,
                         key_ids, 0, indexer->topk);
  out.out = document_attention(q, kg, vg, ids, key_ids, 0, 0, out.kept);
  out.anchor = add(all_gather_backward_anchor(kg), all_gather_backward_anchor(vg));
  return out;
}

// Doc ids numbered per shard (from 1 at the rank's first document), as a mask
// built from a local cu_seqlens would number them.
CpAttention attention_by_local_doc_ids(const Var& q, const Var& k, const Var& v, const PackedContext& ctx,
                                       const Tensor& padding, Communicator* comm, const SparseIndexer* indexer,
                                       const Tensor& probe) {
  Tensor ids = visible_doc_ids(ctx, padding);
  const std::int64_t B = ids.dim(0), L = ids.dim(1);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t first = ctx.local_doc_ids().get_int(b * L);
    for (std::int64_t t = 0; t < L; ++t)
      if (ids.get_int(b * L + t) != 0) ids.set(b * L + t, static_cast<double>(ids.get_int(b * L + t) - first + 1));
  }
  return cp_document_attention(q, k, v, ids, &ctx.plan(), comm, indexer, 0, probe);
}

// A rank whose queries are all padding skips the layer (zeros, no anchor): its
// loss no longer reaches the gathered K/V, so it skips their backward.
CpAttention attention_skipped_on_padding(const Var& q, const Var& k, const Var& v, const PackedContext& ctx,
                                         const Tensor& padding, Communicator* comm, const SparseIndexer* indexer,
                                         const Tensor& probe) {
  const Tensor ids = visible_doc_ids(ctx, padding);
  bool any = false;
  for (std::int64_t i = 0; i < ids.numel(); ++i) any = any || ids.get_int(i) != 0;
  CpAttention a = cp_document_attention(q, k, v, ids, &ctx.plan(), comm, indexer, 0, probe);
  if (!any) {
    const Tensor& o = a.out.value();
    a.out = Var(Tensor::full(o.shape(), o.dtype(), 0.0).to(o.device()));
    a.anchor = Var();
  }
  return a;
}

// Targets aligned on each shard after sharding: the target at every shard edge
// inside a document is lost.
Tensor targets_after_sharding(const Tensor& tokens, const Tensor& doc_ids, const Tensor& padding,
                              const PackedContext& ctx) {
  auto mine = [&](const Tensor& t) { return narrow(t, 1, ctx.seq_start(), ctx.local_seq_len()).clone(); };
  return next_token_targets(mine(tokens), mine(doc_ids), mine(padding));
}

// Each rank's own mean, averaged over the ranks.
Var mean_of_rank_means(const Var& logits, const Tensor& targets, Communicator* comm) {
  const Var local = token_mean_loss(logits, targets, nullptr);
  const double n = comm ? comm->size() : 1;
  Tensor sum = local.value().clone();
  if (comm && comm->size() > 1) comm->all_reduce(sum.raw(), 1, DType::f64);
  return record(Tensor::full({1}, DType::f64, sum.get(0) / n), "mean_of_rank_means", {local},
                [n](const Tensor& g) { return std::vector<Tensor>{Tensor::full({1}, DType::f64, g.get(0) / n)}; });
}

// A rank without targets returns early, skipping the all-reduce its peers enter.
Var loss_skipped_without_targets(const Var& logits, const Tensor& targets, Communicator* comm) {
  const Tensor t = targets.is_cpu() ? targets : targets.to(Device::host());
  bool any = false;
  for (std::int64_t i = 0; i < t.numel(); ++i) any = any || t.get_int(i) >= 0;
  return token_mean_loss(logits, targets, any ? comm : nullptr);
}

CheckOptions quick() {
  CheckOptions o;
  o.timeout = std::chrono::milliseconds(3000);
  return o;
}

}  // namespace

namespace {

// No halo: a shard's first position takes zeros, not the previous rank's last token.
Var token_shift_without_halo(const Var& x, const PackedContext& ctx, Communicator*) {
  return token_shift(x, ctx, nullptr);
}

// Across documents: the previous token whatever its document (a conv of taps [1, 0]
// over one document id).
Var token_shift_across_documents(const Var& x, const PackedContext& ctx, Communicator* comm) {
  const Var window = convolution_history(x, comm, 2, HaloExchange::send_recv, &ctx.plan());
  const std::int64_t C = x.value().dim(2);
  Tensor taps({C, 2}, x.value().dtype());
  for (std::int64_t k = 0; k < C; ++k) taps.set(2 * k, 1.0);
  return packed_causal_conv(window, Tensor({x.value().dim(0), x.value().dim(1) + 1}, DType::i64), Var(taps), Var());
}

}  // namespace

TEST(LayerControls, TokenShiftCatchesAMissingHaloAndAShiftAcrossDocuments) {
  for (const auto& [name, variant] : std::vector<std::pair<std::string, TokenShiftFn>>{
           {"token shift without its halo", token_shift_without_halo},
           {"token shift across documents", token_shift_across_documents}}) {
    const std::string report = expect_counterexample(name, [&, v = variant](const LayoutCase& c) {
      RC_ASSERT(check_row("token_shift", c, quick(), {.token_shift = v}).ok);
    });
    expect_found(report);
  }
  // The operator itself holds on the same draws.
  cpsim::testing::check_property(cpsim::testing::over<LayoutCase>(
      [](const LayoutCase& c) { RC_ASSERT(check_row("token_shift", c, quick()).ok); }));
}

TEST(LayerControls, RopeCatchesRotationByLocalIndex) {
  expect_found(expect_counterexample("rope by 0..L-1", [](const LayoutCase& c) {
    RC_ASSERT(check_row("rope", c, quick(), {.rope = rope_by_local_index}).ok);
  }));
}

TEST(LayerControls, AttentionCatchesRopeByLocalIndex) {
  expect_found(expect_counterexample("attention after rope by 0..L-1", [](const LayoutCase& c) {
    RC_ASSERT(check_row("attention_forward", c, quick(), {.rope = rope_by_local_index}).ok);
  }));
}

TEST(LayerControls, AttentionCatchesAMaskByLocalIndex) {
  expect_found(expect_counterexample("attention masked by local index", [](const LayoutCase& c) {
    RC_ASSERT(check_row("attention_forward", c, quick(), {.attention = attention_by_local_index}).ok);
  }));
}

TEST(LayerControls, AttentionCatchesAMaskByLocalDocIds) {
  expect_found(expect_counterexample("attention masked by local doc ids", [](const LayoutCase& c) {
    RC_ASSERT(check_row("attention_forward", c, quick(), {.attention = attention_by_local_doc_ids}).ok);
  }));
}

TEST(LayerControls, SparseAttentionCatchesAMaskByLocalIndex) {
  expect_found(expect_counterexample("sparse attention masked by local index", [](const LayoutCase& c) {
    const CheckOptions o = quick();
    RC_ASSERT(check_row("sparse_attention_forward", c, o, {.attention = attention_by_local_index}).ok);
  }));
}

// The skip is found, and on a rank that is all padding beside one that is not, it
// is reported as the call the other rank waits in, within the timeout (not a hang).
TEST(LayerControls, AttentionSkippedWithoutAnAnchorIsANamedMismatch) {
  expect_found(expect_counterexample("attention skipped on an all-padding rank", [](const LayoutCase& c) {
    const auto r = check_row("attention_backward", c, quick(), {.attention = attention_skipped_on_padding});
    if (!r.ok) RC_FAIL(r.detail);
  }));
  LayoutCase c;
  c.batch = parse_batch(R"({"input_ids":[[1,1,1,0]],"seq_lens":[[2]],"seq_lens_padded":[[2]]})", "case").batch;
  c = at_cp(c, 2);  // rank 1 holds positions 2 and 3: padding only
  const auto start = std::chrono::steady_clock::now();
  const auto r = check_row("attention_backward", c, quick(), {.attention = attention_skipped_on_padding});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.detail, HasSubstr("rank 1 returned without joining reduce_scatter"));
}

// Positions up to 2^52 (the largest a batch may give): the reference and the
// layer turn by the same float64 angle, pos * base^(-2m/D), so a correct rotation
// holds there (an angle computed as pos / base^(2m/D) is off by a visible turn at
// such positions); rotating by the local index still fails.
TEST(LayerControls, RopeHoldsAtTheLargestPositionsAndTheLocalIndexStillFails) {
  LayoutCase c;
  c.batch = parse_batch(R"({"input_ids":[[5,6,7,8,9,4]],
                            "position_ids":[[4503599627370491,4503599627370492,4503599627370493,0,1,2]]})",
                        "case").batch;
  for (int cp : {1, 2, 3}) {
    c = at_cp(c, cp);
    const auto r = check_row("rope", c, quick());
    EXPECT_TRUE(r.ok) << "cp=" << cp << ": " << r.detail;
    if (cp > 1) {
      EXPECT_FALSE(check_row("rope", c, quick(), {.rope = rope_by_local_index}).ok) << "cp=" << cp;
    }
  }
}

// On a long-document batch (64k tokens: documents of 20k, 25k and 4k tokens with
// 1-token ones between, the last rank all padding) the attention rows evaluate
// a chosen set of queries, not all of them; every planted attention bug is still
// caught there: the local-index mask, the local doc ids, RoPE by local index, the
// sparse form's local-index mask, and the layer skipped on the all-padding rank.
TEST(LayerControls, EveryAttentionControlFailsOnALongDocumentBatch) {
  LayoutCase c;
  c.batch = parse_batch(R"({"seq_len": 65536, "seq_lens": [[1, 20000, 25000, 1, 4000]]})", "long").batch;
  c = at_cp(c, 4);
  const CheckOptions o = quick();
  const PropertyResult right = check_row("attention_forward", c, o);
  ASSERT_TRUE(right.ok) << right.detail;
  ASSERT_GT(right.queries_evaluated, 0);
  ASSERT_LT(right.queries_evaluated, right.queries / 10) << "the long batch should be sampled";
  ASSERT_TRUE(check_row("attention_backward", c, o).ok);
  ASSERT_TRUE(check_row("sparse_attention_forward", c, o).ok);
  EXPECT_FALSE(check_row("attention_forward", c, o, {.attention = attention_by_local_index}).ok);
  EXPECT_FALSE(check_row("attention_forward", c, o, {.attention = attention_by_local_doc_ids}).ok);
  EXPECT_FALSE(check_row("attention_forward", c, o, {.rope = rope_by_local_index}).ok);
  EXPECT_FALSE(check_row("sparse_attention_forward", c, o, {.attention = attention_by_local_index}).ok);
  const PropertyResult skipped = check_row("attention_backward", c, o, {.attention = attention_skipped_on_padding});
  EXPECT_FALSE(skipped.ok);
  EXPECT_THAT(skipped.detail, HasSubstr("rank 3 returned without joining reduce_scatter")) << skipped.detail;
}

// Which queries the attention rows evaluate: every one while the pairs are few;
// on long documents a set that is the same for a seed, differs with the seed,
// and costs pairs linear in the tokens: at most six queries a rank (its first and
// last positions, those around its cuts) and two a document (first and last),
// each reading at most its document, plus the sample's budget and one last
// query's keys.
TEST(LayerControls, TheAttentionRowsChooseTheirQueriesByTheLayout) {
  const auto work = [](const std::string& json, int cp, std::uint64_t seed) {
    const Batch b = parse_batch(json, "case").batch;
    const Layout l = derive_layout(b);
    return attention_work(l.doc_ids, l.padding, reference_geometry(l.doc_ids.dim(1), cp), seed);
  };
  const AttentionWork small = work(R"({"seq_len": 4096, "seq_lens": [[1000, 2000, 1000]]})", 4, 1);
  EXPECT_EQ(small.queries_evaluated, small.queries);
  EXPECT_EQ(small.queries, 4000);
  EXPECT_EQ(small.pairs, (1000 * 1001 / 2) * 2 + 2000 * 2001 / 2);
  const std::string long_row = R"({"seq_len": 262144, "seq_lens": [[1, 100000, 150000, 1]]})";
  const AttentionWork a = work(long_row, 8, 1), again = work(long_row, 8, 1), other = work(long_row, 8, 2);
  EXPECT_LT(a.queries_evaluated, a.queries / 100);
  EXPECT_EQ(a.queries, 250002);
  EXPECT_EQ(a.queries_evaluated, again.queries_evaluated);
  EXPECT_EQ(a.pairs, again.pairs);
  EXPECT_NE(a.pairs, other.pairs);
  EXPECT_LE(a.pairs, 6 * 8 * 150000 + 2 * 262144 + (std::int64_t{1} << 22) + 150000);
  EXPECT_GE(a.pairs, std::int64_t{1} << 22);
}

TEST(LayerControls, LossCatchesTargetsAlignedAfterSharding) {
  expect_found(expect_counterexample("targets aligned after sharding", [](const LayoutCase& c) {
    RC_ASSERT(check_row("loss_forward", c, quick(), {.targets = targets_after_sharding}).ok);
  }));
}

TEST(LayerControls, LossCatchesAMeanOfRankMeans) {
  expect_found(expect_counterexample("per-rank mean averaged over ranks", [](const LayoutCase& c) {
    RC_ASSERT(check_row("loss_forward", c, quick(), {.loss = mean_of_rank_means}).ok);
  }));
}

TEST(LayerControls, ALossSkippedOnARankWithoutTargetsIsANamedMismatch) {
  const auto report = expect_counterexample("loss all-reduce skipped without targets", [](const LayoutCase& c) {
    const auto r = check_row("loss_forward", c, quick(), {.loss = loss_skipped_without_targets});
    if (!r.ok) RC_FAIL(r.detail);
  });
  expect_found(report);
  EXPECT_THAT(report, HasSubstr("returned without joining all_reduce"));
}
