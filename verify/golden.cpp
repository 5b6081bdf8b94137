#include "verify/golden.hpp"

#include <cmath>
#include <cstring>
#include <tuple>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/model_shape.hpp"
#include "verify/golden_build.hpp"

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

}  // namespace

json& GoldenFile::add(const std::string& key, const RawTensor& t, const std::string& meaning,
                      const std::string& section) {
  tensors[key] = t;
  const std::string page = section == "§1" ? "docs/layout.md" : section == "§2" ? "docs/sharding.md" : "docs/operators.md";
  return keys[key] = {{"shape", t.shape}, {"dtype", torch_dtype(t.dtype)}, {"meaning", meaning}, {"see", page}};
}

GoldenBuild::GoldenBuild(const LayoutCase& c_in, const CheckOptions& o_in, const GoldenOptions& given_in)
    : c(c_in), o(o_in), given(given_in), shape(reference_shape(c_in.batch)),
      g(reference_geometry(shape.seq_len, c_in.cp, given_in.pad_multiple)), truth(reference_layout(c_in.batch)),
      B(shape.rows), dt(given_in.dtype), ranks(c_in.cp) {
  g.cuts = reference_cuts(truth, g.padded_len, c.cp, c.plan);
  P = g.padded_len;
  ids = reference_padded_doc_ids(truth, P);
  padded = reference_padded_global(c, P);
  ref.floating = dt;
  for (GoldenFile& rank : ranks) rank.floating = dt;
}

const inputs::Conv& GoldenBuild::conv_inputs() {
  if (!conv_) {
    const inputs::Conv drawn = inputs::conv(truth, B, P, o, c.seed);
    conv_ = inputs::Conv{low(drawn.x), low(drawn.weight), low(drawn.bias), low(drawn.grad_y)};
  }
  return *conv_;
}

const AttentionInputs& GoldenBuild::attention_inputs() {
  if (!attention_) {
    AttentionInputs at = inputs::attention(B, P, o, c.seed);
    for (Tensor* t : {&at.q, &at.k, &at.v, &at.grad_o, &at.index_q, &at.index_k}) *t = low(*t);
    attention_ = at;
  }
  return *attention_;
}

const Tensor& GoldenBuild::rope_q() {
  if (!rope_q_) rope_q_ = reference_rope(attention_inputs().q, padded.at("position_ids"));
  return *rope_q_;
}

const Tensor& GoldenBuild::rope_k() {
  if (!rope_k_) rope_k_ = reference_rope(attention_inputs().k, padded.at("position_ids"));
  return *rope_k_;
}

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
  GoldenBuild build(c, o, given);
  const ReferenceShape& shape = build.shape;
  const ReferenceGeometry& g = build.g;
  const std::int64_t B = build.B, P = build.P, C = o.channels, W = o.conv_width;
  bool equal_sizes = true;
  for (int r = 0; r < c.cp; ++r) equal_sizes = equal_sizes && g.size(r) == g.size(0);

  // The batch as given (dtype and shape as the file had them), stand-ins marked.
  GoldenFile& inputs = build.inputs;
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
  // In --dtype f32 or bf16, every floating input the rows draw is rounded to it
  // first; the references run in float64 on the rounded values, and every
  // floating tensor is stored in the dtype (GoldenFile::floating).
  const DType dt = given.dtype;
  inputs.floating = dt;
  // Every row's values: the seeded inputs it draws (drawn as `cpsim check --seed`
  // draws them), its unsharded references, and what each rank must hold.
  for (const PropertyRow& row : property_table())
    if (row.golden) row.golden(build);
  const std::int64_t D = o.rope_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

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
                   {"rope_base", static_cast<std::int64_t>(kRopeBase)},  // an integer, as manifests write it
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
  // Where cases may draw live gates (cpsim harness --live-gates-every): whether
  // this one did (case.live_gates), for a step whose layer makes its own gates.
  if (o.live_gates_every > 0) manifest["live_gates"] = inputs::live_gates(o, c.seed);
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
  save("reference.safetensors", build.ref);
  for (int r = 0; r < c.cp; ++r) save("rank_" + std::to_string(r) + ".safetensors", build.ranks[r]);
  const std::string mpath = (std::filesystem::path(dir) / "manifest.json").string();
  std::ofstream(mpath) << manifest.dump(1) << "\n";
  written.push_back(mpath);
  return written;
}

}  // namespace cpsim::verify
