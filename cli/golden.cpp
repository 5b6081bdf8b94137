// cpsim golden: the reference values of a batch at one CP size, as safetensors files
// (docs/files.md) for a user's own implementation to be compared against.
#include <iostream>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "verify/batch_io.hpp"
#include "verify/golden.hpp"

namespace cpsim::cli {

int run_golden(const GoldenArgs& a) {
  const verify::BatchFile f = verify::read_batch_file(a.batch);
  derive_layout(f.batch);
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  if (!plan) throw UsageError("--plan random draws plans for fuzz; golden takes equal, balanced or a plan file");
  expect_plan_fits(*plan, sequence_length(f.batch), a.cp, a.batch, a.pad_multiple);
  verify::LayoutCase c{f.batch, f.pad_token_id, a.cp, a.model.seed, std::nullopt, *plan};
  const verify::CheckOptions o = check_options(a.model);
  for (const auto& path : verify::write_golden(c, o, a.out, a.batch, {f.given, a.shard_primary, a.index_dtype == "int32", a.pad_multiple,
                                                 a.dtype == "f32" ? DType::f32 : a.dtype == "bf16" ? DType::bf16 : DType::f64})) std::cout << "wrote " << path << "\n";
  return kExitOk;
}

}  // namespace cpsim::cli
