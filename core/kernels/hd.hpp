// Host-device basics of the one kernel source: every functor under core/kernels
// is a plain struct of pointers and sizes with a CPSIM_HD call operator, run over
// an index range by a Thrust algorithm. g++ builds them with Thrust's CPP system
// for the host (the CPU property suite runs this very code); nvcc builds the same
// headers for CUDA (gpu/). Nothing here names a CUDA type.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define CPSIM_HD __host__ __device__
#else
#define CPSIM_HD
#endif

// g++ has no CUDA: Thrust's device system is its CPP one (nvcc keeps CUDA's).
#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>

namespace cpsim::kernels {

using index_t = std::int64_t;

// Runs f(i) for every i in [0, n) under the execution policy (thrust::host, or a
// CUDA policy on a stream).
template <class Policy, class F>
void for_each_index(Policy&& policy, index_t n, F f) {
  if (n > 0) thrust::for_each_n(policy, thrust::counting_iterator<index_t>(0), n, f);
}

// Row and offset of flat index i in rows of `len`: i / len and i % len. A GPU
// divides 64-bit integers in software, several times slower than 32-bit ones, so
// indices and lengths that fit in 32 bits (every row a benchmark or a test has)
// take the 32-bit division; the result is the same either way.
struct RowOffset {
  index_t row, offset;
};
CPSIM_HD inline RowOffset split_index(index_t i, index_t len) {
  if (((static_cast<std::uint64_t>(i) | static_cast<std::uint64_t>(len)) >> 32) == 0) {
    const auto a = static_cast<std::uint32_t>(i), l = static_cast<std::uint32_t>(len), q = a / l;
    return {static_cast<index_t>(q), static_cast<index_t>(a - q * l)};
  }
  const index_t q = i / len;
  return {q, i - q * len};
}

// Data movement copies words, the widest that divide the bytes moved per
// contiguous run and the buffers' alignment (16 bytes on a GPU is one vector load).
struct alignas(16) Word16 {
  std::uint64_t lo, hi;
};

inline std::size_t word_size(std::size_t run_bytes, const void* a, const void* b) {
  const auto addr = reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b);
  for (std::size_t w : {std::size_t{16}, std::size_t{8}, std::size_t{4}, std::size_t{2}})
    if (run_bytes % w == 0 && addr % w == 0) return w;
  return 1;
}

// Calls fn(W{}, n): W the word type of word_size(run_bytes, a, b), n the words
// of one run.
template <class Fn>
void with_words(std::size_t run_bytes, const void* a, const void* b, Fn&& fn) {
  const auto n = [run_bytes](auto word) { return static_cast<index_t>(run_bytes / sizeof(word)); };
  switch (word_size(run_bytes, a, b)) {
    case 16: return fn(Word16{}, n(Word16{}));
    case 8: return fn(std::uint64_t{}, n(std::uint64_t{}));
    case 4: return fn(std::uint32_t{}, n(std::uint32_t{}));
    case 2: return fn(std::uint16_t{}, n(std::uint16_t{}));
    default: return fn(std::uint8_t{}, n(std::uint8_t{}));
  }
}

// bfloat16 arithmetic on both sides (upper 16 bits of an IEEE float, round to nearest even).
CPSIM_HD inline float bf16_to_float(std::uint16_t bits) {
  union {
    std::uint32_t u;
    float f;
  } v{static_cast<std::uint32_t>(bits) << 16};
  return v.f;
}
CPSIM_HD inline std::uint16_t bf16_from_float(float f) {
  union {
    float f;
    std::uint32_t u;
  } v{f};
  if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x007FFFFFu)) return static_cast<std::uint16_t>((v.u >> 16) | 0x40);
  return static_cast<std::uint16_t>((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

}  // namespace cpsim::kernels
