#include "verify/golden.hpp"

#include <cmath>
#include <cstring>
#include <tuple>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "verify/random.hpp"
#include "verify/reference.hpp"
#include "verify/reference_layers.hpp"
#include "verify/rows/inputs.hpp"
#include "verify/safetensors.hpp"

namespace cpsim::verify {

namespace {

using nlohmann::json;

// The torch name of a safetensors dtype ("I32" -> "int32").
std::string torch_dtype(const std::string& st) {
  static const std::map<std::string, std::string> names = {
      {"F64", "float64"}, {"F32", "float32"}, {"BF16", "bfloat16"}, {"I64", "int64"}, {"I32", "int32"},
      {"I16", "int16"},   {"I8", "int8"},     {"U8", "uint8"},      {"U16", "uint16"}, {"U32", "uint32"},
      {"U64", "uint64"},  {"BOOL", "bool"}};
  const auto it = names.find(st);
  return it == names.end() ? st : it->second;
}

// One file being assembled: its tensors and, for the manifest, what each means.
struct GoldenFile {
  std::map<std::string, RawTensor> tensors;
  json keys = json::object();
  DType floating = DType::f64;  // the dtype floating tensors are stored in
  // `section`: where the user's guide defines it (§1 the layout, §2 sharding, §3 the operators).
  json& add(const std::string& key, const RawTensor& t, const std::string& meaning, const std::string& section) {
    tensors[key] = t;
    const std::string page = section == "§1" ? "docs/layout.md" : section == "§2" ? "docs/sharding.md" : "docs/operators.md";
    return keys[key] = {{"shape", t.shape}, {"dtype", torch_dtype(t.dtype)}, {"meaning", meaning}, {"see", page}};
  }
  json& add(const std::string& key, const Tensor& t, const std::string& meaning, const std::string& section) {
    return add(key, raw_tensor(is_floating(t.dtype()) && t.dtype() != floating ? t.to(floating) : t), meaning, section);
  }
};

Tensor slice(const Tensor& global, std::int64_t start, std::int64_t len) { return narrow(global, 1, start, len); }

Tensor i64_vector(const std::vector<std::int64_t>& v) {
  return Tensor::from<std::int64_t>({static_cast<std::int64_t>(v.size())}, v);
}

}  // namespace

GoldenTolerances golden_tolerances(DType dt) {
  // float64: the properties' own. float32 and bfloat16: about 4x the worst
  // relative RMSE scripts/measure-golden-tolerances.py measured (golden_check's
  // numpy implementation in float32, every example at CP 1-8): float32 conv
  // 1.4e-6, recurrence 2.3e-6, layers 1.1e-6; bfloat16 conv 6.5e-3 (the gather's
  // rank-order sum), recurrence 3.5e-3, layers 3.5e-3.
  switch (dt) {
    case DType::f32: return {5e-6, 1e-5, 5e-6};
    case DType::bf16: return {3e-2, 2e-2, 2e-2};
    default: return {kConvTolerance, kRecurrenceTolerance, kAttentionTolerance};
  }
}

std::vector<std::string> write_golden(const LayoutCase& c, const CheckOptions& o, const std::string& dir,
                                      const std::string& batch_name, const GoldenOptions& given) {
  const ReferenceShape shape = reference_shape(c.batch);
  ReferenceGeometry g = reference_geometry(shape.seq_len, c.cp, given.pad_multiple);
  const LayoutTruth truth = reference_layout(c.batch);
  g.cuts = reference_cuts(truth, g.padded_len, c.cp, c.plan);
  const std::int64_t B = shape.rows, P = g.padded_len, C = o.channels, W = o.conv_width;
  bool equal_sizes = true;
  for (int r = 0; r < c.cp; ++r) equal_sizes = equal_sizes && g.size(r) == g.size(0);
  const Tensor ids = reference_padded_doc_ids(truth, P);

  // The batch as given (dtype and shape as the file had them), stand-ins marked,
  // and the seeded inputs, drawn as `cpsim check --seed` draws them.
  GoldenFile inputs;
  for (const auto& [key, t] : c.batch) {
    const auto form = given.forms.find(key);
    if (form != given.forms.end()) {
      inputs.add("inputs." + key, raw_tensor(t, form->second), "the batch's " + key + ", as given", "§1")["origin"] =
          "given";
    } else if (given.forms.empty()) {
      inputs.add("inputs." + key, t, "the batch's " + key, "§1")["origin"] = "given";
    } else {
      inputs.add("stand_in." + key, t,
                 key + " the file did not give: cpsim's stand-in (token ids never decide the layout)", "§1")["origin"] =
          "stand-in";
    }
  }
  // In --dtype f32 or bf16, every floating input is rounded to it first; the
  // references run in float64 on the rounded values, and every floating tensor is
  // stored in the dtype (GoldenFile::floating).
  const DType dt = given.dtype;
  const auto low = [&](const Tensor& t) { return dt == DType::f64 ? t : t.to(dt).to(DType::f64); };
  inputs.floating = dt;
  // The rows' own inputs (verify/rows/inputs.hpp), drawn as `cpsim check` draws them.
  const inputs::Conv conv_in = inputs::conv(truth, B, P, o, c.seed);
  const Tensor x = low(conv_in.x), w = low(conv_in.weight), bias = low(conv_in.bias), gy = low(conv_in.grad_y);
  inputs::Recurrence rec_in = inputs::recurrence(B, P, o, c.seed);
  RecurrenceInputs& in = rec_in.in;
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g}) *t = low(*t);
  const Tensor d_o = low(rec_in.grad_o);
  inputs.add("x", x, "activation [B, P, C], zero at padding: the conv and halo input, and what gather_sequence gathers",
             "§3");
  inputs.add("conv_weight", w, "depthwise conv weight [C, W]", "§3");
  inputs.add("conv_bias", bias, "conv bias [C]", "§3");
  inputs.add("conv_grad_y", gy, "upstream gradient of the conv output [B, P, C]", "§3");
  inputs.add("q", in.q, "recurrence queries [B, P, H, K]", "§3");
  inputs.add("k", in.k, "recurrence keys [B, P, H, K], normalised", "§3");
  inputs.add("v", in.v, "recurrence values [B, P, H, V]", "§3");
  inputs.add("beta", in.beta, "recurrence beta [B, P, H], in (0, 1)", "§3");
  inputs.add("g", in.g, "recurrence log-decay [B, P, H, K], <= 0", "§3");
  inputs.add("recurrence_grad_o", d_o, "upstream gradient of o [B, P, H, V]", "§3");
  std::vector<Tensor> upstream;
  for (int q = 0; q < c.cp; ++q) {
    upstream.push_back(low(inputs::gather_upstream({B, P, C}, DType::f64, q, c.seed)));
    inputs.add("gather_grad." + std::to_string(q), upstream.back(),
               "upstream gradient of rank " + std::to_string(q) + "'s gathered tensor [B, P, C]", "§3");
  }

  // The unsharded references.
  GoldenFile ref;
  ref.floating = dt;
  ref.add("doc_ids", ids, "global document ids [B, P]: i+1 over document i, 0 beyond", "§1, §2");
  ref.add("padding", truth.padding, "padding [B, S]: true where padding (decided from lengths)", "§1");
  ref.add("position_ids", truth.positions, "positions [B, S] (given, or derived)", "§1");
  const Batch padded = reference_padded_global(c, P);
  for (const auto& [key, t] : padded)
    ref.add("padded." + key, t, key + " padded to P with its fill value [B, P]", "§2");
  const ConvReference conv = reference_conv(x, ids, w, bias, gy);
  ref.add("conv_y", conv.y, "packed causal conv output [B, P, C]", "§3");
  ref.add("conv_dx", conv.dx, "conv input gradient [B, P, C]", "§3");
  ref.add("conv_dw", conv.dw, "conv weight gradient [C, W]; ranks' partial dw summed", "§3");
  ref.add("conv_dbias", conv.dbias, "conv bias gradient [C]; ranks' partial dbias summed", "§3");
  const RecurrenceReference rec = reference_recurrence(in, ids, d_o);
  ref.add("o", rec.o, "recurrence output [B, P, H, V]", "§3");
  for (const auto& [name, t] : std::vector<std::pair<std::string, Tensor>>{
           {"dq", rec.dq}, {"dk", rec.dk}, {"dv", rec.dv}, {"dbeta", rec.dbeta}, {"dg", rec.dg}})
    ref.add(name, t, "recurrence gradient " + name, "§3");

  // The layers that consume the layout (§3b), on the inputs the layer rows draw.
  const std::int64_t D = o.rope_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const Tensor &pos = padded.at("position_ids"), &pad = padded.at("padding_mask");
  AttentionInputs at = inputs::attention(B, P, o, c.seed);
  for (Tensor* t : {&at.q, &at.k, &at.v, &at.grad_o, &at.index_q, &at.index_k}) *t = low(*t);
  inputs.add("attention_q", at.q, "attention queries [B, P, H, D] before RoPE (D: key_dim rounded up to even)", "§3b");
  inputs.add("attention_k", at.k, "attention keys [B, P, H, D] before RoPE", "§3b");
  inputs.add("attention_v", at.v, "attention values [B, P, H, Dv]", "§3b");
  inputs.add("attention_grad_o", at.grad_o, "upstream gradient of the attention output [B, P, H, Dv]", "§3b");
  inputs.add("index_q", at.index_q, "sparse indexer query [B, P, Di], integer-valued", "§3b");
  inputs.add("index_k", at.index_k, "sparse indexer key [B, P, Di], integer-valued", "§3b");
  LossInputs li = inputs::loss(padded.at("input_ids"), o, c.seed);
  li.logits = low(li.logits);
  inputs.add("loss_tokens", li.tokens, "padded input_ids mod vocab [B, P]: the ids the targets are aligned from", "§3b");
  inputs.add("logits", li.logits, "logits [B, P, vocab]", "§3b");
  const Tensor rq = reference_rope(at.q, pos), rk = reference_rope(at.k, pos);
  ref.add("rope_q", rq, "attention_q rotated by padded.position_ids [B, P, H, D]", "§3b");
  ref.add("rope_k", rk, "attention_k rotated by padded.position_ids [B, P, H, D]", "§3b");
  const auto attention = [&](std::int64_t topk) {
    AttentionReference a = reference_attention(rq, rk, at.v, ids, pad, at.grad_o, scale, at.index_q, at.index_k, topk);
    a.dq = reference_rope_backward(a.dq, pos);  // the gradients of q and k before RoPE
    a.dk = reference_rope_backward(a.dk, pos);
    return a;
  };
  const AttentionReference dense = attention(-1), sparse = attention(o.topk);
  const LossReference loss = reference_loss(li.logits, li.tokens, ids, pad);
  // Each [B, P, ...] layer key: its name, value and meaning (ranks hold their slice).
  const std::vector<std::tuple<std::string, Tensor, std::string>> layers = {
      {"attention_o", dense.o, "RoPE, then document-masked causal attention: o [B, P, H, Dv]"},
      {"attention_dq", dense.dq, "gradient of attention_q (through attention and RoPE) [B, P, H, D]"},
      {"attention_dk", dense.dk, "gradient of attention_k, summed over every query that sees it [B, P, H, D]"},
      {"attention_dv", dense.dv, "gradient of attention_v [B, P, H, Dv]"},
      {"sparse_attention_kept", sparse.kept,
       "each query's kept keys (global positions, ascending, then -1) [B, P, topk]"},
      {"sparse_attention_o", sparse.o, "attention over the kept keys only: o [B, P, H, Dv]"},
      {"sparse_attention_dq", sparse.dq, "gradient of attention_q in the sparse form [B, P, H, D]"},
      {"sparse_attention_dk", sparse.dk, "gradient of attention_k in the sparse form [B, P, H, D]"},
      {"sparse_attention_dv", sparse.dv, "gradient of attention_v in the sparse form [B, P, H, Dv]"},
      {"targets", loss.targets,
       "next-token targets aligned on whole rows: loss_tokens[t+1] within t's document, else -100 [B, P]"},
      {"loss_grad_logits", loss.grad, "gradient of the token-mean loss for logits [B, P, vocab]"}};
  for (const auto& [key, t, meaning] : layers) ref.add(key, t, meaning, "§3b");
  const Tensor loss_value = Tensor::from<double>({1}, {loss.loss}), loss_count = Tensor::from<std::int64_t>({1}, {static_cast<std::int64_t>(loss.count)});
  ref.add("loss", loss_value, "the token-mean cross entropy over every rank's targets [1]", "§3b");
  ref.add("loss_count", loss_count, "the number of targets (the all-reduced count) [1]", "§3b");

  std::filesystem::create_directories(dir);
  json manifest = {{"cpsim", "golden vectors"},
                   {"batch", batch_name},
                   {"cp", c.cp},
                   {"S", shape.seq_len},
                   {"P", P},
                   {"L", equal_sizes ? json(g.size(0)) : json(nullptr)},
                   {"plan", plan_choice_name(c.plan)},
                   {"cuts", g.cuts},
                   {"rows", B},
                   {"pad_token_id", c.pad_token_id},
                   {"pad_multiple", given.pad_multiple},
                   {"dtype", dtype_name(dt)},
                   {"shard_primary", given.shard_primary},
                   {"index_dtype", given.index_int32 ? "int32" : "int64"},
                   {"seed", c.seed},
                   {"conv_width", W},
                   {"channels", C},
                   {"heads", o.heads},
                   {"key_dim", o.key_dim},
                   {"value_dim", o.value_dim},
                   {"attention_dim", D},
                   {"softmax_scale", scale},
                   {"rope_base", 10000},
                   {"topk", o.topk},
                   {"index_dim", o.index_dim},
                   {"vocab", o.vocab},
                   {"conventions",
                    {{"q_scale", 1.0},
                     {"q_scale_note", "the recurrence does not scale q (FLA defaults to K^-0.5: pass scale=1.0)"},
                     {"conv_taps", "y[b,t,c] = bias[c] + sum_j w[c,j] * x[b, t-(W-1)+j, c]: w[:, W-1] multiplies x[t], "
                                   "w[:, 0] the oldest tap; a tap before t's segment start is dropped"},
                     {"activation", "none: the conv output is not passed through SiLU or any activation"},
                     {"loss", "every gradient in these files is that of sum(output * upstream) for the upstream "
                              "gradient the inputs give (conv_grad_y, recurrence_grad_o, attention_grad_o, "
                              "gather_grad.q); the loss keys are the token-mean cross entropy"},
                     {"recurrence", "S_t = (I - beta k k^T) Diag(exp g) S_{t-1} + beta k v^T, o_t = S_t^T q_t, "
                                    "S = 0 at every segment start (q, k, g: [K], v: [V], per head)"},
                     {"doc_ids_vs_padding", "doc_ids and padded.* are [B, P] (padded to the CP size); padding and "
                                            "position_ids are [B, S] (the batch's own length)"},
                     {"rope_angle", "pair m of a token at position pos turns by pos * rope_base^(-2m/D), computed in "
                                    "float64 as that product (pos converted to float64, exact: positions are at most "
                                    "2^52); interleaved pairs (x_2m, x_2m+1); D = attention_dim"},
                     {"attention_order", "RoPE first (on attention_q and attention_k), then attention over the "
                                         "gathered rotated keys; the dense and the sparse form both take "
                                         "attention_grad_o as the upstream gradient of their output, and their dq, "
                                         "dk are the gradients of the unrotated inputs"},
                     {"softmax_scale", "1/sqrt(attention_dim), attention_dim = key_dim rounded up to even (RoPE "
                                       "turns pairs)"},
                     {"sparse_indexer", "one head shared by all heads: score s_ij = index_q_i . index_k_j over the "
                                        "visible keys; each query keeps its min(topk, visible) highest scores, ties "
                                        "to the smaller position; index_q and index_k get no gradient"},
                     {"targets", "aligned from loss_tokens (the padded input_ids mod vocab) on whole rows: "
                                 "loss_tokens[t+1] when t+1 is a real token of t's document, else -100; no loss_mask"}}},
                   {"cp_context",
                    {{"row_cu_seqlens.<b>", "boundaries of the segments of row b inside this rank's shard, clipped to "
                                            "it, from 0 to L (flash-linear-attention's cu_seqlens); [0] on a rank "
                                            "with an empty interval"},
                     {"intervals", "rank r holds [cuts[r], cuts[r+1]) of the padded row (L = its length; every L "
                                   "is the same under the equal plan, and the manifest's L is null otherwise)"},
                     {"pre_num_conv_tokens", "cuts[r] minus the global start of the segment that contains position "
                                             "cuts[r]; 0 on an empty rank"},
                     {"pre_num_ranks", "how many earlier ranks the first local segment reaches back into (ranks with "
                                       "an empty interval are never counted)"},
                     {"post_num_ranks", "how many later ranks the last local segment reaches into (empty ones not "
                                        "counted)"},
                     {"is_first_rank", "pre_num_ranks == 0"},
                     {"is_last_rank", "post_num_ranks == 0"}}},
                   {"tolerance", {{"note", "each key's own tolerance is in files.<file>.<key>.tolerance"},
                                  {"bitwise", "batch, doc ids, contexts, halo, gathered, sparse_attention_kept, targets"},
                                  {"summed_across_ranks",
                                   "gather_grad_x is a sum over ranks, written in rank order: another order (a "
                                   "ring, Gloo, NCCL, a float32 accumulator) rounds differently, so it is held to "
                                   "relative_rmse_conv measured against the sums of its terms' magnitudes: a key "
                                   "whose entry names a \"scale\" key compares rms(expected - got) / rms(scale)"},
                                  {"non_finite",
                                   "a NaN or an inf on one side only (expected or computed) always fails, whatever "
                                   "the tolerance"},
                                  {"relative_rmse_conv", golden_tolerances(dt).conv},
                                  {"relative_rmse_recurrence", golden_tolerances(dt).recurrence},
                                  {"relative_rmse_layers", golden_tolerances(dt).layers}}},
                   {"files", json::object()}};
  std::vector<std::string> written;
  // Every reference key's tolerance (relative RMSE; 0: bitwise).
  const auto tolerance_of = [dt](const std::string& key, const json& entry) -> double {
    const std::string dtype = entry.at("dtype");
    const auto starts = [&](const char* p) { return key.rfind(p, 0) == 0; };
    if (dtype.find("float") == std::string::npos || key == "halo" || key == "gathered" || starts("batch.") ||
        starts("padded."))
      return 0;
    const GoldenTolerances tol = golden_tolerances(dt);
    // A sum over ranks: a reduce-scatter in another order than the reference's
    // rank order rounds differently, in float64 too (torch's Gloo all_reduce does).
    if (key == "gather_grad_x") return tol.conv;
    if (starts("conv_") || key == "halo_grad") return tol.conv;
    if (starts("rope_") || starts("attention_") || starts("sparse_attention_") || starts("loss")) return tol.layers;
    return tol.recurrence;
  };
  auto save = [&](const std::string& name, GoldenFile f) {
    if (name != "inputs.safetensors")
      for (auto& [key, entry] : f.keys.items()) entry["tolerance"] = tolerance_of(key, entry);
    const std::string path = (std::filesystem::path(dir) / name).string();
    std::ofstream out(path, std::ios::binary);
    if (!out) throw Aborted(path + ": cannot write (" + std::string(std::strerror(errno)) + ")");
    out << write_safetensors(f.tensors, {{"format", "pt"}});
    manifest["files"][name] = f.keys;
    written.push_back(path);
  };
  save("inputs.safetensors", inputs);
  save("reference.safetensors", ref);

  // Each rank: what it must hold after shard_batch and after each operator.
  for (int r = 0; r < c.cp; ++r) {
    GoldenFile rank;
    rank.floating = dt;
    const std::int64_t start = g.start(r), L = g.size(r);
    for (const auto& [key, t] : padded)
    {
      const bool global = key == "input_ids" && !given.shard_primary;
      rank.add("batch." + key, global ? t : slice(t, start, L),
               global ? "input_ids after shard_batch: global, padded to P [B, P] (shard_primary false)"
                      : key + " after shard_batch: this rank's slice [B, L]",
               "§2");
    }
    rank.add("local_doc_ids", slice(ids, start, L), "PackedContext.local_doc_ids() [B, L]", "§2");
    std::vector<std::int64_t> pre_tokens, pre_ranks, post_ranks;
    std::vector<bool> first, last;
    for (std::int64_t b = 0; b < B; ++b) {
      const FlaCpContext ctx = reference_cp_context(reference_padded_doc_ids_row(truth, static_cast<int>(b), P), g, r);
      const Tensor cu = i64_vector(ctx.cu_seqlens);
      rank.add("row_cu_seqlens." + std::to_string(b), given.index_int32 ? cu.to(DType::i32) : cu,
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
    rank.add("halo", reference_history(x, start, L, static_cast<int>(W)),
             "convolution_history(x shard, W): the W-1 positions before the shard (zeros before 0), then the shard "
             "[B, L+W-1, C]",
             "§3");
    rank.add("gathered", x, "gather_sequence(x shard): the global tensor [B, P, C]", "§3");
    Tensor grad = Tensor::full({B, L, C}, dt, 0.0);  // summed in rank order, in the dtype
    Tensor terms = Tensor::full({B, L, C}, DType::f64, 0.0);  // the sums of the terms' magnitudes
    for (int q = 0; q < c.cp; ++q) {
      const Tensor part = slice(upstream[q], start, L);
      for (std::int64_t i = 0; i < grad.numel(); ++i) {
        grad.set(i, grad.get(i) + part.get(i));
        terms.set(i, terms.get(i) + std::abs(part.get(i)));
      }
    }
    // A sum over ranks is held to the scale of its terms, not of its value: in
    // another order (a ring, Gloo, NCCL, a float32 accumulator) the rounding
    // follows the terms, and a sum that cancels is not held to its own tiny size.
    rank.add("gather_grad_x", grad,
             "gradient of the x shard through gather_sequence: sum over ranks q, in rank order, of gather_grad.q "
             "sliced to this shard [B, L, C]",
             "§3")["scale"] = "gather_grad_x_terms";
    rank.add("gather_grad_x_terms", terms,
             "the scale gather_grad_x is held to: the sum over ranks q of |gather_grad.q| sliced to this shard [B, L, "
             "C]; gather_grad_x's error is rms(expected - got) / rms(gather_grad_x_terms)",
             "§3")["compared"] = false;
    // This rank's part of the conv backward: the unsharded conv under the upstream
    // gradient of this rank's outputs only.
    Tensor gy_mine = Tensor::full(gy.shape(), DType::f64, 0.0);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = start; t < start + L; ++t)
        for (std::int64_t ch = 0; ch < C; ++ch) gy_mine.set((b * P + t) * C + ch, gy.get((b * P + t) * C + ch));
    const ConvReference part = reference_conv(x, ids, w, bias, gy_mine);
    rank.add("conv_dw_partial", part.dw,
             "this rank's dw [C, W] before the sum over ranks (its outputs' taps only); conv_dw is the sum", "§3");
    rank.add("conv_dbias_partial", part.dbias, "this rank's dbias [C] before the sum over ranks", "§3");
    rank.add("halo_grad", reference_history(part.dx, start, L, static_cast<int>(W)),
             "gradient of this rank's halo window [B, L+W-1, C] (its conv's input gradient): the first W-1 "
             "positions go back to the ranks that own them",
             "§3");
    rank.add("conv_y", slice(conv.y, start, L), "this rank's conv output [B, L, C]", "§3");
    rank.add("conv_dx", slice(conv.dx, start, L), "gradient of this rank's x shard, halo returns included [B, L, C]",
             "§3");
    rank.add("o", slice(rec.o, start, L), "this rank's recurrence output [B, L, H, V]", "§3");
    for (const auto& [name, t] : std::vector<std::pair<std::string, Tensor>>{
             {"dq", rec.dq}, {"dk", rec.dk}, {"dv", rec.dv}, {"dbeta", rec.dbeta}, {"dg", rec.dg}})
      rank.add(name, slice(t, start, L), "this rank's recurrence gradient " + name, "§3");
    const RecurrenceStates states = reference_recurrence_states(in, ids, start, L);
    rank.add("recurrence_initial_state", states.initial,
             "the state [B, H, K, V] this rank's first token starts from: the fold of the earlier ranks' transitions "
             "over pre_num_ranks (0 where a segment starts at the shard; every recurrence_* key is 0 on a rank "
             "with an empty interval)",
             "§3");
    rank.add("recurrence_final_state", states.final_state, "the state [B, H, K, V] after this rank's last token", "§3");
    rank.add("recurrence_transition_m", states.m,
             "M [B, H, K, K] of this rank's last local segment (from its first local token, from a zero state): "
             "S_out = M S_in + S_ext, what the rank publishes in the all-gather",
             "§3");
    rank.add("recurrence_transition_s_ext", states.s_ext, "S_ext [B, H, K, V] of this rank's last local segment", "§3");
    rank.add("rope_q", slice(rq, start, L), "this rank's attention_q rotated by its position_ids", "§3b");
    rank.add("rope_k", slice(rk, start, L), "this rank's attention_k rotated by its position_ids", "§3b");
    for (const auto& [key, t, meaning] : layers) rank.add(key, slice(t, start, L), "this rank's slice: " + meaning, "§3b");
    rank.add("loss", loss_value, "the loss every rank returns (sum and count all-reduced) [1]", "§3b");
    save("rank_" + std::to_string(r) + ".safetensors", rank);
  }
  const std::string mpath = (std::filesystem::path(dir) / "manifest.json").string();
  std::ofstream(mpath) << manifest.dump(1) << "\n";
  written.push_back(mpath);
  return written;
}

}  // namespace cpsim::verify
