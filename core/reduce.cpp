#include "core/reduce.hpp"

#include "core/kernels/table.hpp"

namespace cpsim {

void sum_in_order(DType dtype, void* dst, const void* const* srcs, std::size_t n_srcs, std::size_t count) {
  CPSIM_ENFORCE(n_srcs > 0, "sum of no sources");
  if (count == 0) return;
  kernels::kernels_for(Device::host()).sum_in_order({srcs, dst, n_srcs, count}, dtype, nullptr);
}

}  // namespace cpsim
