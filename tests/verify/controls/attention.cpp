// Controls of the rope and attention rows (verify/rows/rope.cpp, attention.cpp):
// bugs CP stacks have shipped (RoPE or masks by local index, a layer skipped on
// a padding rank: a named call mismatch within the timeout, never a hang).
#include "tests/verify/controls/controls.hpp"

namespace {

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

}  // namespace

TEST(AttentionControls, RopeCatchesRotationByLocalIndex) {
  expect_row_catches("rope by 0..L-1", "rope", quick(), {.rope = rope_by_local_index});
}

TEST(AttentionControls, AttentionCatchesRopeByLocalIndex) {
  expect_row_catches("attention after rope by 0..L-1", "attention_forward", quick(), {.rope = rope_by_local_index});
}

TEST(AttentionControls, AttentionCatchesAMaskByLocalIndex) {
  expect_row_catches("attention masked by local index", "attention_forward", quick(), {.attention = attention_by_local_index});
}

TEST(AttentionControls, AttentionCatchesAMaskByLocalDocIds) {
  expect_row_catches("attention masked by local doc ids", "attention_forward", quick(), {.attention = attention_by_local_doc_ids});
}

TEST(AttentionControls, SparseAttentionCatchesAMaskByLocalIndex) {
  expect_found(expect_counterexample("sparse attention masked by local index", [](const LayoutCase& c) {
    const CheckOptions o = quick();
    RC_ASSERT(check_row("sparse_attention_forward", c, o, {.attention = attention_by_local_index}).ok);
  }));
}

// The skip is found, and on a rank that is all padding beside one that is not, it
// is reported as the call the other rank waits in, within the timeout (not a hang).
TEST(AttentionControls, AttentionSkippedWithoutAnAnchorIsANamedMismatch) {
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
TEST(AttentionControls, RopeHoldsAtTheLargestPositionsAndTheLocalIndexStillFails) {
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
TEST(AttentionControls, EveryAttentionControlFailsOnALongDocumentBatch) {
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
TEST(AttentionControls, TheAttentionRowsChooseTheirQueriesByTheLayout) {
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
