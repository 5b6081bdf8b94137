// A golden folder being assembled (verify/golden.cpp): the case, its reference
// layout and geometry, and the files. write_golden writes the batch and the
// manifest; every property row that has values in the folder adds them
// (PropertyRow::golden, in the row's own file), from the inputs its check draws
// (verify/rows/inputs.hpp).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "verify/golden.hpp"
#include "verify/reference.hpp"
#include "verify/reference_layers.hpp"
#include "verify/rows/inputs.hpp"
#include "verify/safetensors.hpp"

namespace cpsim::verify {

// One file being assembled: its tensors and, for the manifest, what each means.
struct GoldenFile {
  std::map<std::string, RawTensor> tensors;
  nlohmann::json keys = nlohmann::json::object();
  DType floating = DType::f64;  // the dtype floating tensors are stored in
  // `section`: where the user's guide defines it (§1 the layout, §2 sharding, §3 the operators).
  nlohmann::json& add(const std::string& key, const RawTensor& t, const std::string& meaning,
                      const std::string& section);
  nlohmann::json& add(const std::string& key, const Tensor& t, const std::string& meaning, const std::string& section) {
    return add(key, raw_tensor(is_floating(t.dtype()) && t.dtype() != floating ? t.to(floating) : t), meaning, section);
  }
};

struct GoldenBuild {
  GoldenBuild(const LayoutCase& c, const CheckOptions& o, const GoldenOptions& given);

  const LayoutCase& c;
  const CheckOptions& o;
  const GoldenOptions& given;
  ReferenceShape shape;
  ReferenceGeometry g;  // with the cuts of the case's plan
  LayoutTruth truth;
  std::int64_t B, P;
  Tensor ids;     // reference doc ids [B, P]
  Batch padded;   // the batch padded to P
  DType dt;       // of every floating tensor
  GoldenFile inputs, ref;
  std::vector<GoldenFile> ranks;  // rank_<r>.safetensors

  // A floating input rounded to the folder's dtype (kept in float64: the
  // references run on the rounded values).
  Tensor low(const Tensor& t) const { return dt == DType::f64 ? t : t.to(dt).to(DType::f64); }
  // Rank r's slice [B, L_r, ...] of a global [B, P, ...] tensor.
  // Rank r's slice of a global [B, P, ...] tensor; mRoPE's position_ids
  // [3, B, P] along their last axis (the sequence).
  Tensor slice(const Tensor& global, int r) const { return narrow(global, 1, g.start(r), g.size(r)); }
  Tensor slice_key(const std::string& key, const Tensor& global, int r) const {
    return key == "position_ids" && global.ndim() == 3 ? narrow(global, 2, g.start(r), g.size(r)) : slice(global, r);
  }
  // Inputs several rows' values share, drawn once and rounded.
  const inputs::Conv& conv_inputs();         // x: the conv's, the halo's and what the gather gathers
  const AttentionInputs& attention_inputs();  // the dense and the sparse form's, and RoPE's
  const Tensor& rope_q();                     // attention_q rotated by the batch's positions
  const Tensor& rope_k();

 private:
  std::optional<inputs::Conv> conv_;
  std::optional<AttentionInputs> attention_;
  std::optional<Tensor> rope_q_, rope_k_;
};

}  // namespace cpsim::verify
