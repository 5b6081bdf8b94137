// Element-wise sums that every backend uses for reduce_scatter and all_reduce, so
// results agree bitwise across backends: sources are added in the order given
// (rank order), in the element type, bf16 accumulated in float and rounded once.
#pragma once

#include <cstddef>

#include "core/tensor.hpp"

namespace cpsim {

// dst[i] = srcs[0][i] + srcs[1][i] + ... (left to right).
void sum_in_order(DType dtype, void* dst, const void* const* srcs, std::size_t n_srcs,
                  std::size_t count);

}  // namespace cpsim
