// Deterministic, platform-independent random numbers for seeded inputs
// (std:: distributions differ between standard libraries; these do not).
#pragma once

#include <cstdint>

#include "core/tensor.hpp"

namespace cpsim::verify {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

inline std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b) { return SplitMix64(a * 0x2545F4914F6CDD1Dull ^ b).next(); }

// Values in [-1, 1) for floating dtypes, [-50, 50) for integers, 0/1 for bool.
inline Tensor random_tensor(const Shape& shape, DType dtype, std::uint64_t seed) {
  Tensor t = Tensor::empty(shape, dtype);
  SplitMix64 rng(seed);
  const bool floating = is_floating(dtype);
  visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* d = t.data<T>();
    const std::int64_t n = t.numel();
    for (std::int64_t i = 0; i < n; ++i) {
      if (floating) d[i] = from_f64<T>(rng.uniform(-1.0, 1.0));
      else if (dtype == DType::b8) d[i] = from_f64<T>(static_cast<double>(rng.below(2)));
      else d[i] = from_f64<T>(static_cast<double>(rng.below(100) - 50));
    }
  });
  return t;
}

}  // namespace cpsim::verify
