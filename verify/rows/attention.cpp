// The attention rows (SPEC §3b): attention over the gathered K/V (dense, and top-k
// sparse) after RoPE (RoPE alone: rope.cpp; the loss: loss.cpp).
#include <cmath>

#include "verify/reference_layers.hpp"
#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

// Costs (RowCost). Attention: q, k, v and the upstream gradient, their RoPE
// copies and the reference's outputs and gradients (global); each rank's gathered
// k and v are resident (half a unit); the gradients of the gathered tensors only
// where its queries see keys (attention_backward leaves the rest unwritten, and
// the anchor's zero gradient adds as +0 without writing them), so a rank adds
// about a unit with its share of the work; the reference's results come after the
// ranks' run; one run serves both rows of a form. The sparse form adds the
// indexer's query and key and the kept lists of the run and the reference. The
// loss: the logits, the reference's softmax gradient and every rank's gradient.
double attention_bytes_per_token(const RowShapes& s) { return 8 * s.H * (2 * s.K + 2 * s.V) * (2.1 + 0.96 * s.cp) + 200; }
double sparse_bytes_per_token(const RowShapes& s) { return attention_bytes_per_token(s) + 24 * s.Di + 16 * s.topk; }

const RowHead kAttentionForward{.name = "attention_forward",
    .claim = "RoPE, then document-masked causal attention over the gathered K/V (o)",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = attention_bytes_per_token,
             .us_per_token = 1.5,
             .us_per_token_per_rank = 0.075,
             .us_per_pair = 0.2}};
const RowHead kAttentionBackward{.name = "attention_backward",
    .claim = "gradients of q, k, v through attention, the gather and RoPE",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = attention_bytes_per_token, .us_per_token = 0.09, .us_per_token_per_rank = 0}};
const RowHead kSparseForward{.name = "sparse_attention_forward",
    .claim = "the top-k indexer keeps the unsharded keys exactly; o over them",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = sparse_bytes_per_token,
             .us_per_token = 1.5,
             .us_per_token_per_rank = 0.075,
             .us_per_pair = 0.1}};
const RowHead kSparseBackward{.name = "sparse_attention_backward",
    .claim = "gradients of q, k, v over the kept keys",
    .comparison = Comparison::tolerance,
    .tolerance = kAttentionTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = sparse_bytes_per_token, .us_per_token = 0.09, .us_per_token_per_rank = 0}};

}  // namespace

// ---------------------------------------------------------------------------
// RoPE then attention.

struct AttentionRun {
  AttentionReference ref;
  Tensor o, dq, dk, dv, kept;
  std::int64_t queries_evaluated = 0, queries = 0, pairs = 0;
};

namespace {

// Which queries an attention row evaluates. A query costs its visible keys (the
// real tokens of its document up to it), so a long document costs the square of
// its length. Up to kAllQueriesPairs (query, key) pairs every query is evaluated;
// beyond, the queries where CP goes wrong, plus a seeded sample:
// * each shard's first two and last two positions;
// * each document's first and last real token (the last reads every cut the
//   document crosses);
// * the first three real tokens after each cut inside a document (their keys
//   lie on earlier ranks) and the last three before it;
// * random real queries, seeded, until the sample's pairs reach kSampledPairs.
// The chosen queries cost O(cp x tokens) pairs in all: linear in the tokens.
constexpr std::int64_t kAllQueriesPairs = std::int64_t{1} << 22;
constexpr std::int64_t kSampledPairs = std::int64_t{1} << 22;

struct QueryChoice {
  Tensor mask;  // [B, P] i64, 1: evaluated; undefined: every query
  std::int64_t chosen = 0, real = 0;
};

QueryChoice choose_queries(const Tensor& doc_ids, const Tensor& padding_in, const ReferenceGeometry& g,
                           std::uint64_t seed, std::int64_t* pairs_out = nullptr) {
  const std::int64_t B = doc_ids.dim(0), P = doc_ids.dim(1);
  const Tensor ids = host_values(doc_ids, DType::i64), pad = host_values(padding_in, DType::i64);
  const std::int64_t *id = ids.data<std::int64_t>(), *padding = pad.data<std::int64_t>();
  // Each real query's visible keys: the real tokens of its document so far.
  std::vector<std::int64_t> visible(static_cast<std::size_t>(B * P), 0);
  QueryChoice c;
  std::int64_t total = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t doc = 0, seen = 0;
    for (std::int64_t t = 0; t < P; ++t) {
      const std::int64_t i = b * P + t;
      if (id[i] == 0 || padding[i] != 0) continue;
      if (id[i] != doc) doc = id[i], seen = 0;
      visible[i] = ++seen;
      total += seen;
      ++c.real;
    }
  }
  if (total <= kAllQueriesPairs) {
    c.chosen = c.real;
    if (pairs_out) *pairs_out = total;
    return c;
  }
  c.mask = Tensor::full({B, P}, DType::i64, 0.0);
  auto* m = c.mask.data<std::int64_t>();
  std::int64_t pairs = 0;
  const auto take = [&](std::int64_t b, std::int64_t t) {
    if (t < 0 || t >= P) return;
    const std::int64_t i = b * P + t;
    if (visible[i] == 0 || m[i]) return;
    m[i] = 1;
    pairs += visible[i];
    ++c.chosen;
  };
  for (std::int64_t b = 0; b < B; ++b) {
    for (int r = 0; r < g.cp; ++r) {
      if (g.size(r) == 0) continue;
      for (std::int64_t d = 0; d < 2; ++d) take(b, g.start(r) + d), take(b, g.end(r) - 1 - d);
    }
    // Documents' first and last real tokens.
    std::int64_t last = -1;
    for (std::int64_t t = 0; t < P; ++t) {
      if (visible[b * P + t] == 0) continue;
      if (visible[b * P + t] == 1) {
        take(b, t);
        if (last >= 0) take(b, last);
      }
      last = t;
    }
    if (last >= 0) take(b, last);
    // Around each cut inside a document: three real queries on either side.
    for (int r = 1; r < g.cp; ++r) {
      const std::int64_t cut = g.start(r);
      if (cut <= 0 || cut >= P) continue;
      int n = 0;
      for (std::int64_t t = cut; t < P && n < 3; ++t)
        if (visible[b * P + t] > 1) take(b, t), ++n;  // reads keys before the cut
      n = 0;
      for (std::int64_t t = cut - 1; t >= 0 && n < 3; --t)
        if (visible[b * P + t] != 0) take(b, t), ++n;
    }
  }
  // A seeded sample of the rest, within the budget of pairs.
  auto rng = inputs::query_sampler(seed);
  const std::int64_t budget = pairs + kSampledPairs;
  for (std::int64_t tries = 0; pairs < budget && c.chosen < c.real && tries < 8 * B * P; ++tries)
    take(rng.below(B), rng.below(P));
  if (pairs_out) *pairs_out = pairs;
  return c;
}

// t with the rows of [B, P, ...] that `mask` ([B, P]) leaves out set to `fill`.
Tensor only_rows(const Tensor& t, const Tensor& mask, double fill = 0) {
  if (!mask.defined() || !t.defined()) return t;
  Tensor out = host_values(t, t.dtype()).clone();
  const std::int64_t rows = mask.numel(), per = rows ? out.numel() / rows : 0;
  const auto* m = mask.data<std::int64_t>();
  for (std::int64_t i = 0; i < rows; ++i)
    if (!m[i])
      for (std::int64_t e = 0; e < per; ++e) out.set(i * per + e, fill);
  return out;
}

AttentionRun run_attention(const Prepared& s, const CheckOptions& opt, const AttentionFn& fn, const RopeFn& rope_fn,
                           std::int64_t topk) {
  const LayoutCase& c = s.c;
  const std::int64_t B = s.shape.rows, P = s.g.padded_len, D = opt.rope_dim();
  const LayerRows rows = layer_rows(s);
  // One set of inputs for the dense and the sparse form (and `cpsim golden`).
  const AttentionInputs in = inputs::attention(B, P, opt, c.seed);
  // The loss is sum(o * up) over the evaluated queries: up is 0 at the others.
  std::int64_t pairs = 0;
  const QueryChoice chosen = choose_queries(rows.doc_ids, rows.padding, s.g, c.seed, &pairs);
  const Tensor up = only_rows(in.grad_o, chosen.mask);
  const Tensor &q = in.q, &k = in.k, &v = in.v, &probe = chosen.mask;
  const Tensor iq = topk >= 0 ? in.index_q : Tensor(), ik = topk >= 0 ? in.index_k : Tensor();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  AttentionRun run;
  std::vector<Tensor> o(c.cp), dq(c.cp), dk(c.cp), dv(c.cp), kept(c.cp);
  const std::vector<Input> inputs = {{"q", &q},        {"k", &k},         {"v", &v},
                                     {"up", &up},      {"index_q", &iq},  {"index_k", &ik},
                                     {"positions", &rows.positions},      {"padding", &rows.padding},
                                     {"probe", &probe}};
  run_reading(inputs, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    auto mine = [&](const Tensor& t) { return Var(on(comm, local(t, ctx)), true); };
    Var vq = mine(q), vk = mine(k), vv = mine(v);
    const Tensor pos = local_positions(rows.positions, ctx);
    const SparseIndexer indexer{topk >= 0 ? local(iq, ctx) : Tensor(), topk >= 0 ? local(ik, ctx) : Tensor(), topk};
    const CpAttention a = fn(rope_fn(vq, pos), rope_fn(vk, pos), vv, ctx, local(rows.padding, ctx), &comm,
                             topk >= 0 ? &indexer : nullptr, probe.defined() ? local(probe, ctx) : Tensor());
    backward(a.anchor.defined() ? add(dot(a.out, local(up, ctx)), a.anchor) : dot(a.out, local(up, ctx)));
    o[r] = host(a.out.value());
    dq[r] = host(vq.grad()), dk[r] = host(vk.grad()), dv[r] = host(vv.grad());
    kept[r] = host(a.kept);
  }, run_options(opt), {&o, &dq, &dk, &dv, &kept});
  // Outputs compare at the evaluated queries (an implementation may evaluate
  // more); dq is 0 at the others for any implementation (their upstream is 0).
  run.o = only_rows(joined(o), probe);
  run.dq = only_rows(joined(dq), probe), run.dk = joined(dk), run.dv = joined(dv);
  if (topk >= 0) run.kept = only_rows(joined(kept), probe, -1);
  run.queries_evaluated = chosen.chosen, run.queries = chosen.real, run.pairs = pairs;
  o = dq = dk = dv = kept = {};
  // The reference after the ranks' run (their inputs are unchanged: run_reading
  // checked), so that its results are not held through the ranks' peak.
  run.ref = reference_attention(reference_rope(q, rows.positions), reference_rope(k, rows.positions), v, rows.doc_ids,
                                rows.padding, up, scale, iq, ik, topk, probe);
  run.ref.dq = reference_rope_backward(run.ref.dq, rows.positions);
  run.ref.dk = reference_rope_backward(run.ref.dk, rows.positions);
  return run;
}

std::shared_ptr<const AttentionRun> attention_run(Prepared& s, const CheckOptions& o, const AttentionFn& fn,
                                                  const RopeFn& rope_fn, std::int64_t topk) {
  if (fn || rope_fn) return std::make_shared<AttentionRun>(run_attention(s, o, or_default(fn, default_attention),
                                                                         or_default(rope_fn, default_rope), topk));
  auto& cached = topk >= 0 ? s.runs->sparse_attention : s.runs->attention;
  if (!cached) cached = std::make_shared<AttentionRun>(run_attention(s, o, default_attention(), default_rope(), topk));
  return cached;
}

// A row's result, saying how many queries it evaluated.
PropertyResult evaluated(PropertyResult r, const AttentionRun& run) {
  r.queries_evaluated = run.queries_evaluated;
  r.queries = run.queries;
  r.pairs = run.pairs;
  return r;
}

}  // namespace

AttentionWork attention_work(const Tensor& doc_ids, const Tensor& padding, const ReferenceGeometry& g,
                             std::uint64_t seed) {
  AttentionWork w;
  const QueryChoice c = choose_queries(doc_ids, padding, g, seed, &w.pairs);
  w.queries_evaluated = c.chosen, w.queries = c.real;
  return w;
}

static PropertyResult attention_forward_of(Prepared& s, const CheckOptions& o, const AttentionFn& fn, const RopeFn& rope_fn,
                                    std::int64_t topk) {
  ToleranceTally t;
  const auto run = attention_run(s, o, fn, rope_fn, topk);
  if (topk >= 0) {
    const std::int64_t wrong = count_wrong(run->ref.kept, run->kept);
    if (wrong)
      return evaluated(failed("kept keys differ from the unsharded selection in " + std::to_string(wrong) + " places"),
                       *run);
  }
  const double tol = (topk >= 0 ? kSparseForward : kAttentionForward).tolerance;
  t.expect_close(run->ref.o, run->o, tol, "o");
  return evaluated(t.result(tol), *run);
}

static PropertyResult attention_backward_of(Prepared& s, const CheckOptions& o, const AttentionFn& fn,
                                     const RopeFn& rope_fn, std::int64_t topk) {
  ToleranceTally t;
  const auto run = attention_run(s, o, fn, rope_fn, topk);
  (topk >= 0 ? s.runs->sparse_attention : s.runs->attention).reset();  // the pair is done
  const double tol = (topk >= 0 ? kSparseBackward : kAttentionBackward).tolerance;
  t.expect_close(run->ref.dq, run->dq, tol, "dq");
  t.expect_close(run->ref.dk, run->dk, tol, "dk");
  t.expect_close(run->ref.dv, run->dv, tol, "dv");
  return evaluated(t.result(tol), *run);
}


namespace {

// The attention's inputs (the dense and the sparse form share them, and RoPE's).
void attention_inputs_golden(GoldenBuild& build) {
  const AttentionInputs& at = build.attention_inputs();
  build.inputs.add("attention_q", at.q, "attention queries [B, P, H, D] before RoPE (D: key_dim rounded up to even)",
                   "§3b");
  build.inputs.add("attention_k", at.k, "attention keys [B, P, H, D] before RoPE", "§3b");
  build.inputs.add("attention_v", at.v, "attention values [B, P, H, Dv]", "§3b");
  build.inputs.add("attention_grad_o", at.grad_o, "upstream gradient of the attention output [B, P, H, Dv]", "§3b");
  build.inputs.add("index_q", at.index_q, "sparse indexer query [B, P, Di], integer-valued", "§3b");
  build.inputs.add("index_k", at.index_k, "sparse indexer key [B, P, Di], integer-valued", "§3b");
}

// A [B, P, ...] layer key in the reference, and each rank's slice of it.
void add_layer_key(GoldenBuild& build, const std::string& key, const Tensor& t, const std::string& meaning) {
  build.ref.add(key, t, meaning, "§3b");
  for (int r = 0; r < build.c.cp; ++r) build.ranks[r].add(key, build.slice(t, r), "this rank's slice: " + meaning, "§3b");
}

// RoPE, then attention (topk < 0: dense) on the rounded inputs; dq and dk are
// the gradients of the unrotated inputs.
AttentionReference attention_reference(GoldenBuild& build, std::int64_t topk) {
  const AttentionInputs& at = build.attention_inputs();
  const Tensor& pos = build.padded.at("position_ids");
  const double scale = 1.0 / std::sqrt(static_cast<double>(build.o.rope_dim()));
  AttentionReference a = reference_attention(build.rope_q(), build.rope_k(), at.v, build.ids,
                                             build.padded.at("padding_mask"), at.grad_o, scale, at.index_q, at.index_k,
                                             topk);
  a.dq = reference_rope_backward(a.dq, pos);
  a.dk = reference_rope_backward(a.dk, pos);
  return a;
}

void attention_golden(GoldenBuild& build) {
  attention_inputs_golden(build);
  const AttentionReference dense = attention_reference(build, -1);
  add_layer_key(build, "attention_o", dense.o, "RoPE, then document-masked causal attention: o [B, P, H, Dv]");
  add_layer_key(build, "attention_dq", dense.dq, "gradient of attention_q (through attention and RoPE) [B, P, H, D]");
  add_layer_key(build, "attention_dk", dense.dk,
                "gradient of attention_k, summed over every query that sees it [B, P, H, D]");
  add_layer_key(build, "attention_dv", dense.dv, "gradient of attention_v [B, P, H, Dv]");
}

void sparse_attention_golden(GoldenBuild& build) {
  const AttentionReference sparse = attention_reference(build, build.o.topk);
  add_layer_key(build, "sparse_attention_kept", sparse.kept,
                "each query's kept keys (global positions, ascending, then -1) [B, P, topk]");
  add_layer_key(build, "sparse_attention_o", sparse.o, "attention over the kept keys only: o [B, P, H, Dv]");
  add_layer_key(build, "sparse_attention_dq", sparse.dq, "gradient of attention_q in the sparse form [B, P, H, D]");
  add_layer_key(build, "sparse_attention_dk", sparse.dk, "gradient of attention_k in the sparse form [B, P, H, D]");
  add_layer_key(build, "sparse_attention_dv", sparse.dv, "gradient of attention_v in the sparse form [B, P, H, Dv]");
}

}  // namespace

namespace rows {

std::vector<PropertyRow> attention_rows() {
  // Each rank's gathered k and v ([B, P, H, D] float64), and their gradients back.
  const auto attention_bytes = [](const Prepared& p, const CheckOptions& o) -> std::int64_t {
    return p.shape.rows * p.g.largest() * o.heads * (o.rope_dim() + o.value_dim) * 8 * p.c.cp;
  };
  const auto twice = [=](const Prepared& p, const CheckOptions& o) { return 2 * attention_bytes(p, o); };
  return {
      kAttentionForward.with(attention_bytes,
                             [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                               return attention_forward_of(p, o, impl.attention, impl.rope, -1);
                             },
                             attention_golden),
      kAttentionBackward.with(
          twice, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return attention_backward_of(p, o, impl.attention, impl.rope, -1);
          }),
      kSparseForward.with(attention_bytes,
                          [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                            return attention_forward_of(p, o, impl.attention, impl.rope, o.topk);
                          },
                          sparse_attention_golden),
      kSparseBackward.with(
          twice, [](Prepared& p, const CheckOptions& o, const Impl& impl) {
            return attention_backward_of(p, o, impl.attention, impl.rope, o.topk);
          })};
}

}  // namespace rows

}  // namespace cpsim::verify
