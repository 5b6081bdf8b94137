// Element-wise sums of the one kernel source: the rank-order sum every backend's
// reduce_scatter and all_reduce use (sources added left to right in the element
// type, bf16 accumulated in float and rounded once, bool as or), so results agree
// bitwise across backends and devices.
#pragma once

#include "core/kernels/hd.hpp"
#include "core/kernels/movement.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

// The type a sum runs in: the element's own, except bf16, which adds in float and
// rounds once at the end. (bool adds as int and converts back: an or.)
template <class T>
struct Accumulator {
  using type = T;
  CPSIM_HD static T load(T v) { return v; }
  CPSIM_HD static T store(T a) { return a; }
};
template <>
struct Accumulator<Bf16Bits> {
  using type = float;
  CPSIM_HD static float load(Bf16Bits v) { return bf16_to_float(v.bits); }
  CPSIM_HD static Bf16Bits store(float a) { return Bf16Bits{bf16_from_float(a)}; }
};

template <class T>
struct SumInOrder {
  const T* const* srcs;  // on the device that runs the functor
  T* dst;
  index_t n;
  CPSIM_HD void operator()(index_t i) const {
    using A = Accumulator<T>;
    typename A::type acc = A::load(srcs[0][i]);
    for (index_t s = 1; s < n; ++s) acc = static_cast<typename A::type>(acc + A::load(srcs[s][i]));
    dst[i] = A::store(acc);
  }
};

// The host's rank-order sum: the same additions as SumInOrder, source by source
// over a block of elements (vectorised across elements) instead of element by
// element over the sources; bitwise the same result.
inline void sum_in_order_blocks(const Sum& a, DType dtype) {
  with_element(dtype, [&](auto element) {
    using T = decltype(element);
    using A = Accumulator<T>;
    using Acc = typename A::type;
    constexpr index_t kBlock = 2048;
    Acc acc[kBlock];
    const T* const* srcs = reinterpret_cast<const T* const*>(a.srcs);
    T* dst = static_cast<T*>(a.dst);
    const index_t count = static_cast<index_t>(a.count), n = static_cast<index_t>(a.n);
    for (index_t at = 0; at < count; at += kBlock) {
      const index_t len = count - at < kBlock ? count - at : kBlock;
      for (index_t i = 0; i < len; ++i) acc[i] = A::load(srcs[0][at + i]);
      for (index_t s = 1; s < n; ++s) {
        const T* __restrict src = srcs[s] + at;
        for (index_t i = 0; i < len; ++i) acc[i] = static_cast<Acc>(acc[i] + A::load(src[i]));
      }
      for (index_t i = 0; i < len; ++i) dst[at + i] = A::store(acc[i]);
    }
  });
}

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
