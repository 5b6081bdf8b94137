// Element-wise sums of the one kernel source: the rank-order sum every backend's
// reduce_scatter and all_reduce use (sources added left to right in the element
// type, bf16 accumulated in float and rounded once, bool as or), so results agree
// bitwise across backends and devices.
#pragma once

#include "core/kernels/hd.hpp"
#include "core/kernels/movement.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

template <class T>
struct SumInOrder {
  const T* const* srcs;  // on the device that runs the functor
  T* dst;
  index_t n;
  CPSIM_HD void operator()(index_t i) const {
    T acc = srcs[0][i];
    for (index_t s = 1; s < n; ++s) acc = static_cast<T>(acc + srcs[s][i]);
    dst[i] = acc;
  }
};
template <>
struct SumInOrder<bool> {
  const bool* const* srcs;
  bool* dst;
  index_t n;
  CPSIM_HD void operator()(index_t i) const {
    bool acc = false;
    for (index_t s = 0; s < n; ++s) acc = acc || srcs[s][i];
    dst[i] = acc;
  }
};
template <>
struct SumInOrder<Bf16Bits> {
  const Bf16Bits* const* srcs;
  Bf16Bits* dst;
  index_t n;
  CPSIM_HD void operator()(index_t i) const {
    float acc = bf16_to_float(srcs[0][i].bits);
    for (index_t s = 1; s < n; ++s) acc += bf16_to_float(srcs[s][i].bits);
    dst[i].bits = bf16_from_float(acc);
  }
};

template <class Policy>
void sum_in_order(Policy&& policy, const Sum& a, DType dtype) {
  with_element(dtype, [&](auto element) {
    using T = decltype(element);
    for_each_index(policy, static_cast<index_t>(a.count),
                   SumInOrder<T>{reinterpret_cast<const T* const*>(a.srcs), static_cast<T*>(a.dst),
                                 static_cast<index_t>(a.n)});
  });
}

}  // namespace cpsim::kernels
