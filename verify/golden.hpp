// cpsim golden: conformance vectors for another implementation of CP (a PyTorch
// one), as safetensors, every value from cpsim's references (never from the code
// they check): the seeded inputs, the unsharded outputs and gradients, and for
// each rank the expected local batch, local doc ids, row_cu_seqlens, the recurrent
// CP context, the halo, the gathered tensor and every local gradient, and the
// layers that consume the layout (RoPE, dense and top-k sparse attention, targets
// and the token-mean loss) with their inputs and each rank's slice; plus
// manifest.json naming each file's keys with shape, dtype and meaning.
#pragma once

#include <cstdint>
#include <string>

#include "verify/batch_io.hpp"
#include "verify/cases.hpp"
#include "verify/properties.hpp"

namespace cpsim::verify {

struct GoldenOptions {
  // How the batch file gave its keys (BatchFile::given): inputs.safetensors stores
  // each as given; a key of the case the file did not give (stand-in input_ids) is
  // stored as stand_in.<key>. Empty: every key of the case, as it is.
  std::map<std::string, BatchFile::Form> forms;
  bool shard_primary = false;     // input_ids sharded like the other keys (a language-only model)
  bool index_int32 = false;       // row_cu_seqlens as int32 (flash-linear-attention's cu_seqlens)
  std::int64_t pad_multiple = 1;  // P = roundup(S, cp * pad_multiple)
  // The dtype of every floating tensor (inputs rounded to it before the references
  // run in float64 on them; expected values rounded to it): f64, f32 or bf16.
  DType dtype = DType::f64;
};

// The relative-RMSE tolerance of the expected values in a dtype, by family.
struct GoldenTolerances {
  double conv, recurrence, layers;
};
GoldenTolerances golden_tolerances(DType dtype);

// Writes DIR/inputs.safetensors, DIR/reference.safetensors, DIR/rank_<r>.safetensors
// and DIR/manifest.json; returns the files written.
std::vector<std::string> write_golden(const LayoutCase& c, const CheckOptions& o, const std::string& dir,
                                      const std::string& batch_name, const GoldenOptions& given = {});

}  // namespace cpsim::verify
