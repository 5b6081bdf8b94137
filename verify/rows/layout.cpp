// The layout and shard rows: the layout a batch describes, and the shards of it.
#include "core/shard.hpp"

#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

const RowHead kLayout{.name = "layout",
    .claim = "doc ids, padding and positions of the layout (docs/layout.md); round trips; unpack_row_layout",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = false,
    .cost = {.bytes_per_token = [](const RowShapes&) { return 120.0; },
             .us_per_token = 0.12,
             .us_per_token_per_rank = 0}};
const RowHead kShard{.name = "shard",
    .claim = "shards concatenate to the padded global tensors; contexts tile each shard",
    .comparison = Comparison::bitwise,
    .tolerance = 0,
    .runs_ranks = false,
    .cost = {.bytes_per_token = [](const RowShapes&) { return 150.0; },
             .us_per_token = 0.11,
             .us_per_token_per_rank = 0.07}};

PropertyResult layout_of(const LayoutCase& c, const LayoutFn& layout_fn) {
  BitwiseTally t;
  const LayoutTruth want = reference_layout(c.batch);
  const std::int64_t B = want.doc_ids.dim(0), S = want.doc_ids.dim(1);
  if (c.truth) {
    // A generated case also knows its layout by construction: a second opinion
    // that keeps the reference honest.
    t.expect_equal(c.truth->doc_ids, want.doc_ids, "reference doc ids vs the generator's construction");
    t.expect_equal(c.truth->padding, want.padding, "reference padding vs the generator's construction");
    t.expect_equal(c.truth->positions, want.positions, "reference positions vs the generator's construction");
  }
  const Batch b = normalized(c.batch);
  const Layout layout = layout_fn(b);
  t.expect_equal(want.doc_ids, layout.doc_ids, "doc ids");
  t.expect_equal(want.padding, layout.padding, "padding");
  t.expect_equal(want.positions, layout.positions, "positions");
  t.expect_equal(want.doc_ids, global_doc_ids(b), "global_doc_ids");
  for (std::int64_t r = 0; r < B; ++r) {
    const auto row = row_of(want.doc_ids, r);
    // doc ids -> segments -> doc ids.
    const auto cu = segment_cu_seqlens(row.data(), S);
    t.expect(cu == reference_segments(row), "segments of row " + std::to_string(r));
    // doc ids -> occupied lengths -> cu_seqlens / seq_lens -> doc ids: the same ids.
    std::vector<std::int64_t> lens;
    std::vector<std::int64_t> cu_docs{0};
    bool contiguous = true;  // packed documents leave no pad run between them
    for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
      if (row[cu[k]] == kPadDocId) {
        contiguous = contiguous && k + 2 == cu.size();
        continue;
      }
      lens.push_back(cu[k + 1] - cu[k]);
      cu_docs.push_back(cu_docs.back() + lens.back());
    }
    if (contiguous && !lens.empty()) {
      const Tensor cu_t = Tensor::from<std::int64_t>({static_cast<std::int64_t>(cu_docs.size())}, cu_docs);
      const Tensor lens_t = Tensor::from<std::int64_t>({1, static_cast<std::int64_t>(lens.size())}, lens);
      // Ids are renumbered 1..D by the round trip; the segments must survive.
      t.expect(segment_cu_seqlens(row_of(doc_ids_from_cu_seqlens(cu_t, S), 0).data(), S) == cu,
               "cu_seqlens round trip of row " + std::to_string(r));
      t.expect(row_of(doc_ids_from_seq_lens(lens_t, S), 0) == row_of(doc_ids_from_cu_seqlens(cu_t, S), 0),
               "seq_lens vs cu_seqlens of row " + std::to_string(r));
    }
  }
  Tensor keep({B, S}, DType::b8);
  for (std::int64_t i = 0; i < B * S; ++i) keep.data<bool>()[i] = !want.padding.data<bool>()[i];
  validate_document_positions(keep, layout.positions);
  Batch unpacked = b;
  unpack_row_layout(unpacked);
  t.expect(!unpacked.count("seq_lens") && !unpacked.count("cu_seqlens") && !unpacked.count("cu_seqlens_padded") &&
               !unpacked.count("seq_lens_padded"),
           "unpack kept packing metadata");
  t.expect_equal(want.padding, unpacked.at("padding_mask"), "unpacked padding_mask");
  t.expect_equal(want.positions, unpacked.at("position_ids"), "unpacked position_ids");
  t.expect_equal(b.at("input_ids"), unpacked.at("input_ids"), "unpack changed input_ids");
  return t.result();
}

PropertyResult shard_of(const LayoutCase& c, const ShardFn& shard) {
  BitwiseTally t;
  const auto [B, S] = reference_shape(c.batch);
  ReferenceGeometry g = reference_geometry(S, c.cp);
  const Batch ref = reference_padded_global(c, g.padded_len);
  const LayoutTruth truth = reference_layout(c.batch);
  g.cuts = reference_cuts(truth, g.padded_len, c.cp, c.plan);
  std::map<std::string, std::vector<Tensor>> parts;
  std::vector<Tensor> local_ids;
  for (int r = 0; r < c.cp; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    const ShardedBatch sb = shard(r, c.cp, c.batch, c.pad_token_id, false, c.plan);
    const PackedContext& ctx = sb.context;
    const bool geometry = ctx.doc_ids().defined() && ctx.doc_ids().shape() == (Shape{B, g.padded_len}) &&
                          ctx.plan().cuts == g.cuts && ctx.rank() == r && ctx.local_seq_len() == g.size(r) &&
                          ctx.seq_start() == g.start(r) && ctx.cp_size() == c.cp && ctx.original_seq_len() == S &&
                          ctx.cp_enabled() == (c.cp > 1);
    t.expect(geometry, "packed context geometry of " + rank + (ctx.plan().cuts == g.cuts ? "" :
             ": its plan cuts " + plan_text(ctx.plan()) + ", the reference's " + plan_text({g.cuts})));
    for (const auto& [key, expected] : ref) {
      if (!sb.local.count(key)) {
        t.expect(false, rank + " lost " + key);
        continue;
      }
      const Tensor& got = sb.local.at(key);
      if (key == "input_ids") {
        t.expect_equal(expected, got, "global input_ids of " + rank);
      } else if (Shape want = expected.shape(); (want.back() = g.size(r), got.shape() != want)) {
        // [B, L], or mRoPE's [3, B, L]: each key's sequence is its last axis.
        t.expect(false, key + " of " + rank + " has shape " + shape_str(got.shape()) + ", not " + shape_str(want));
      } else {
        parts[key].push_back(got);
      }
    }
    for (const auto& [key, got] : sb.local) t.expect(ref.count(key) != 0, rank + " holds an unexpected key " + key);
    const ShardedBatch primary = shard(r, c.cp, c.batch, c.pad_token_id, true, c.plan);
    t.expect(primary.local.count("input_ids") != 0, rank + " lost input_ids when sharding them");
    if (primary.local.count("input_ids"))
      t.expect_equal(narrow(ref.at("input_ids"), 1, g.start(r), g.size(r)), primary.local.at("input_ids"),
                     "sharded input_ids of " + rank);
    if (!geometry) continue;  // the context's answers below would be read out of its bounds
    local_ids.push_back(ctx.local_doc_ids());
    for (std::int64_t row = 0; row < B; ++row) {
      const auto padded_ids = reference_padded_doc_ids_row(truth, static_cast<int>(row), g.padded_len);
      const FlaCpContext want = reference_cp_context(padded_ids, g, r);
      t.expect(ctx.row_cu_seqlens(static_cast<int>(row)) == want.cu_seqlens,
               "row_cu_seqlens of " + rank + " row " + std::to_string(row));
      const FlaCpContext got = build_fla_cp_context(ctx, static_cast<int>(row));
      t.expect(got.cu_seqlens == want.cu_seqlens && got.pre_num_conv_tokens == want.pre_num_conv_tokens &&
                   got.pre_num_ranks == want.pre_num_ranks && got.post_num_ranks == want.post_num_ranks &&
                   got.is_first_rank == want.is_first_rank && got.is_last_rank == want.is_last_rank,
               "CP context of " + rank + " row " + std::to_string(row));
    }
  }
  for (const auto& [key, shards] : parts)
    if (static_cast<int>(shards.size()) == c.cp)
      t.expect_equal(ref.at(key), cat(shards, ref.at(key).ndim() - 1), "concatenated " + key);
  if (static_cast<int>(local_ids.size()) == c.cp) {
    Tensor ref_ids({B, g.padded_len}, DType::i64);
    for (std::int64_t row = 0; row < B; ++row) {
      const auto ids = reference_padded_doc_ids_row(truth, static_cast<int>(row), g.padded_len);
      std::copy(ids.begin(), ids.end(), ref_ids.data<std::int64_t>() + row * g.padded_len);
    }
    t.expect_equal(ref_ids, cat(local_ids, 1), "concatenated local doc ids");
  }
  // Each balanced plan of this layout, whatever plan the case drew: its cuts are
  // the reference's (the cost runs on across a padding gap inside a document and
  // starts again at the next document), so that a cost bug shows on every layout
  // that has what it gets wrong, not only on the fifth of them drawn balanced.
  for (const char* cost : {"attention", "linear"}) {
    const PlanChoice balanced = parse_plan_choice("balanced", cost);
    if (c.plan.kind == balanced.kind && c.plan.cost.attention == balanced.cost.attention &&
        c.plan.cost.linear == balanced.cost.linear)
      continue;  // the case's own plan: compared above
    const std::vector<std::int64_t> want = reference_cuts(truth, g.padded_len, c.cp, balanced);
    const ShardedBatch sb = shard(0, c.cp, c.batch, c.pad_token_id, false, balanced);
    t.expect(sb.context.plan().cuts == want, std::string("the balanced plan (") + cost + " cost) of this layout: cuts " +
                                                 plan_text(sb.context.plan()) + ", the reference's " + plan_text({want}));
  }
  return t.result();
}


}  // namespace


namespace {

Tensor i64_vector(const std::vector<std::int64_t>& v) {
  return Tensor::from<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}

// The reference layout, and the batch padded to P.
void layout_golden(GoldenBuild& b) {
  b.ref.add("doc_ids", b.ids, "global document ids [B, P]: i+1 over document i, 0 beyond", "§1, §2");
  b.ref.add("padding", b.truth.padding, "padding [B, S]: true where padding (decided from lengths)", "§1");
  b.ref.add("position_ids", b.truth.positions, "positions [B, S] (given, or derived; mRoPE's [3, B, S])", "§1");
  for (const auto& [key, t] : b.padded)
    b.ref.add("padded." + key, t, key + " padded to P with its fill value [B, P]" + (t.ndim() == 3 ? " in each plane" : ""),
              "§2");
}

// Each rank: what it must hold after shard_batch.
void shard_golden(GoldenBuild& build) {
  const std::int64_t B = build.B, P = build.P;
  for (int r = 0; r < build.c.cp; ++r) {
    GoldenFile& rank = build.ranks[r];
    for (const auto& [key, t] : build.padded) {
      const bool global = key == "input_ids" && !build.given.shard_primary;
      rank.add("batch." + key, global ? t : build.slice_key(key, t, r),
               global ? "input_ids after shard_batch: global, padded to P [B, P] (shard_primary false)"
                      : key + " after shard_batch: this rank's slice [B, L]" + (t.ndim() == 3 ? " of each plane" : ""),
               "§2");
    }
    rank.add("local_doc_ids", build.slice(build.ids, r), "PackedContext.local_doc_ids() [B, L]", "§2");
    std::vector<std::int64_t> pre_tokens, pre_ranks, post_ranks;
    std::vector<bool> first, last;
    for (std::int64_t b = 0; b < B; ++b) {
      const FlaCpContext ctx =
          reference_cp_context(reference_padded_doc_ids_row(build.truth, static_cast<int>(b), P), build.g, r);
      const Tensor cu = i64_vector(ctx.cu_seqlens);
      rank.add("row_cu_seqlens." + std::to_string(b), build.given.index_int32 ? cu.to(DType::i32) : cu,
               "PackedContext.row_cu_seqlens(" + std::to_string(b) + "), also the FLA CP context's cu_seqlens", "§2");
      pre_tokens.push_back(ctx.pre_num_conv_tokens);
      pre_ranks.push_back(ctx.pre_num_ranks);
      post_ranks.push_back(ctx.post_num_ranks);
      first.push_back(ctx.is_first_rank);
      last.push_back(ctx.is_last_rank);
    }
    rank.add("cp_context.pre_num_conv_tokens", i64_vector(pre_tokens), "per row", "§2");
    rank.add("cp_context.pre_num_ranks", i64_vector(pre_ranks), "per row", "§2");
    rank.add("cp_context.post_num_ranks", i64_vector(post_ranks), "per row", "§2");
    Tensor is_first({B}, DType::b8), is_last({B}, DType::b8);
    for (std::int64_t b = 0; b < B; ++b) is_first.data<bool>()[b] = first[b], is_last.data<bool>()[b] = last[b];
    rank.add("cp_context.is_first_rank", is_first, "per row", "§2");
    rank.add("cp_context.is_last_rank", is_last, "per row", "§2");
  }
}

}  // namespace

namespace rows {

std::vector<PropertyRow> layout_rows() {
  return {kLayout.with(no_bytes, [](Prepared& p, const CheckOptions&, const Impl& impl) {
            return layout_of(p.c, or_default(impl.layout, default_layout));
          }, layout_golden),
          kShard.with(no_bytes, [](Prepared& p, const CheckOptions&, const Impl& impl) {
            return shard_of(p.c, or_default(impl.shard, default_shard));
          }, shard_golden)};
}

}  // namespace rows

}  // namespace cpsim::verify
