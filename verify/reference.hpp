// Unsharded references for every property, written plainly (token-by-token loops)
// and separately from the sharded code in core/, so a shared bug cannot hide.
#pragma once

#include <cstdint>
#include <vector>

#include "core/shard.hpp"
#include "verify/cases.hpp"

namespace cpsim::verify {

// The layout a case must have: its construction truth, else derive_layout's.
LayoutTruth expected_layout(const LayoutCase& c);

// Segment boundaries by a direct scan.
std::vector<std::int64_t> reference_segments(const std::vector<std::int64_t>& ids);

// The padded global tensors of SPEC §2 ([B, P]) that the shards must concatenate to.
Batch reference_padded_global(const LayoutCase& c, std::int64_t padded_len);
std::vector<std::int64_t> reference_padded_doc_ids_row(const LayoutTruth& t, int row, std::int64_t padded_len);

// FLA CP context by walking tokens one at a time.
FlaCpContext reference_cp_context(const std::vector<std::int64_t>& padded_ids_row, int cp, int rank);

// Relative RMSE in float64: rms(ref - got) / rms(ref); 0 when both are 0, inf on shape mismatch.
double relative_rmse(const Tensor& ref, const Tensor& got);
// Number of elements whose bytes differ (inf-like large on shape/dtype mismatch).
std::int64_t count_wrong(const Tensor& ref, const Tensor& got);

}  // namespace cpsim::verify
