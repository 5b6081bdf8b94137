#include "core/reduce.hpp"

#include <cstdint>

namespace cpsim {

void sum_in_order(DType dtype, void* dst, const void* const* srcs, std::size_t n_srcs,
                  std::size_t count) {
  CPSIM_ENFORCE(n_srcs > 0, "sum of no sources");
  visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(dst);
    if constexpr (std::is_same_v<T, bf16>) {
      for (std::size_t i = 0; i < count; ++i) {
        float acc = static_cast<const T*>(srcs[0])[i].to_float();
        for (std::size_t s = 1; s < n_srcs; ++s) acc += static_cast<const T*>(srcs[s])[i].to_float();
        out[i] = bf16::from_float(acc);
      }
    } else if constexpr (std::is_same_v<T, bool>) {
      for (std::size_t i = 0; i < count; ++i) {
        bool acc = false;
        for (std::size_t s = 0; s < n_srcs; ++s) acc = acc || static_cast<const T*>(srcs[s])[i];
        out[i] = acc;
      }
    } else {
      for (std::size_t i = 0; i < count; ++i) {
        T acc = static_cast<const T*>(srcs[0])[i];
        for (std::size_t s = 1; s < n_srcs; ++s) acc = static_cast<T>(acc + static_cast<const T*>(srcs[s])[i]);
        out[i] = acc;
      }
    }
  });
}

}  // namespace cpsim
