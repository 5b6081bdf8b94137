// Data-movement kernels of the one kernel source: the rank-block <-> sequence
// rearrangement of gather_sequence and its reduce-scatter staging, and position
// copies (unequal rank blocks, tail packing, history assembly from each owner's
// tail, halo gradient return). Host-device functors; entries templated on the
// Thrust execution policy (thrust::host here, a CUDA stream policy in gpu/).
#pragma once

#include <cstring>

#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

// Rank blocks [c][B][row] <-> sequence [B][c][row], i over dst. to_sequence:
// dst[b][q][j] = src[q][b][j]; otherwise dst[q][b][j] = src[b][q][j].
template <class W, bool to_sequence>
struct Rearrangement {
  const W* src;
  W* dst;
  index_t rows, ranks, row;
  CPSIM_HD void operator()(index_t i) const {
    const index_t outer = to_sequence ? ranks : rows, inner = to_sequence ? rows : ranks;
    const index_t x = i / (outer * row), rem = i - x * outer * row, y = rem / row, j = rem - y * row;
    dst[i] = src[(y * inner + x) * row + j];
  }
};

// dst[b][j] = src[b][start + j] inside [0, src_len), else fill.
template <class E>
struct SliceWithFill {
  const E* src;
  E* dst;
  index_t src_len, start, len;
  E fill;
  CPSIM_HD void operator()(index_t i) const {
    const index_t b = i / len, j = i - b * len, p = start + j;
    dst[i] = (p >= 0 && p < src_len) ? src[b * src_len + p] : fill;
  }
};

struct Bf16Bits {
  std::uint16_t bits;
};
template <class T>
CPSIM_HD inline void accumulate(T& a, T b) {
  a = static_cast<T>(a + b);
}
CPSIM_HD inline void accumulate(bool& a, bool b) { a = a || b; }
CPSIM_HD inline void accumulate(Bf16Bits& a, Bf16Bits b) {
  a.bits = bf16_from_float(bf16_to_float(a.bits) + bf16_to_float(b.bits));
}

// Calls fn(T{}) with the element type the kernels use for `dtype`.
template <class Fn>
void with_element(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: return fn(float{});
    case DType::f64: return fn(double{});
    case DType::bf16: return fn(Bf16Bits{});
    case DType::i32: return fn(std::int32_t{});
    case DType::i64: return fn(std::int64_t{});
    case DType::b8: return fn(bool{});
  }
}

// Position k of row b: dst[b][to + k][e] = (or +=, with add) src[b][from + k][e];
// P elements (words, for a copy) a position.
template <class T, bool add>
struct MovePositions {
  const T* src;
  T* dst;
  index_t src_len, dst_len, from, to, n, P;
  CPSIM_HD void operator()(index_t i) const {
    const index_t b = i / (n * P), rem = i - b * n * P, k = rem / P, e = rem - k * P;
    T& d = dst[(b * dst_len + to + k) * P + e];
    const T& v = src[(b * src_len + from + k) * P + e];
    if constexpr (add) accumulate(d, v);
    else d = v;
  }
};

template <bool to_sequence, class Policy>
void rearrange(Policy&& policy, const Rearrange& a) {
  with_words(a.row_bytes, a.src, a.dst, [&](auto word, index_t row) {
    using W = decltype(word);
    for_each_index(policy, a.rows * a.ranks * row,
                   Rearrangement<W, to_sequence>{static_cast<const W*>(a.src), static_cast<W*>(a.dst), a.rows, a.ranks,
                                                 row});
  });
}

// The host's rearrangement and position copy: the same mapping as the functors
// above, a contiguous run (one rank's row, or n positions of one row) at a time,
// each one memcpy. (A GPU runs the functors, an element a thread; the CPU suite
// checks both against each other: tests/core/test_kernels.cpp.)
template <bool to_sequence>
void rearrange_runs(const Rearrange& a) {
  const auto* src = static_cast<const std::byte*>(a.src);
  auto* dst = static_cast<std::byte*>(a.dst);
  for (index_t b = 0; b < a.rows; ++b)
    for (index_t q = 0; q < a.ranks; ++q) {
      const index_t seq = (b * a.ranks + q), blk = (q * a.rows + b);
      const index_t from = to_sequence ? blk : seq, to = to_sequence ? seq : blk;
      std::memcpy(dst + to * a.row_bytes, src + from * a.row_bytes, a.row_bytes);
    }
}
inline void copy_position_runs(const PositionCopy& a) {
  if (a.n <= 0) return;
  const auto* src = static_cast<const std::byte*>(a.src);
  auto* dst = static_cast<std::byte*>(a.dst);
  const std::size_t P = a.position_bytes;
  for (index_t b = 0; b < a.rows; ++b)
    std::memmove(dst + (b * a.dst_len + a.to) * P, src + (b * a.src_len + a.from) * P, a.n * P);
}

// The host's add_positions: one row's n*P elements at a time, a loop the compiler
// vectorises (the same additions as MovePositions<T, true>, element by element).
inline void add_position_runs(const PositionCopy& a, DType dtype) {
  if (a.n <= 0) return;
  with_element(dtype, [&](auto element) {
    using T = decltype(element);
    const index_t P = static_cast<index_t>(a.position_bytes / sizeof(T)), run = a.n * P;
    for (index_t b = 0; b < a.rows; ++b) {
      const T* __restrict src = static_cast<const T*>(a.src) + (b * a.src_len + a.from) * P;
      T* __restrict dst = static_cast<T*>(a.dst) + (b * a.dst_len + a.to) * P;
      for (index_t k = 0; k < run; ++k) accumulate(dst[k], src[k]);
    }
  });
}

template <class Policy>
void copy_positions(Policy&& policy, const PositionCopy& a) {
  with_words(a.position_bytes, a.src, a.dst, [&](auto word, index_t P) {
    using W = decltype(word);
    for_each_index(policy, a.rows * a.n * P,
                   MovePositions<W, false>{static_cast<const W*>(a.src), static_cast<W*>(a.dst), a.src_len, a.dst_len,
                                           a.from, a.to, a.n, P});
  });
}

template <class Policy>
void slice(Policy&& policy, const Slice& a) {
  auto run = [&](auto element) {
    using E = decltype(element);
    E fill;
    static_assert(sizeof(E) <= sizeof(a.fill));
    std::memcpy(&fill, &a.fill, sizeof(E));  // little-endian: the element's bytes are the low ones
    for_each_index(policy, a.rows * a.len,
                   SliceWithFill<E>{static_cast<const E*>(a.src), static_cast<E*>(a.dst), a.src_len, a.start, a.len, fill});
  };
  switch (a.element_bytes) {
    case 1: return run(std::uint8_t{});
    case 2: return run(std::uint16_t{});
    case 4: return run(std::uint32_t{});
    default: return run(std::uint64_t{});
  }
}

template <class Policy>
void add_positions(Policy&& policy, const PositionCopy& a, DType dtype) {
  auto run = [&](auto element) {
    using T = decltype(element);
    const index_t P = static_cast<index_t>(a.position_bytes / sizeof(T));
    for_each_index(policy, a.rows * a.n * P,
                   MovePositions<T, true>{static_cast<const T*>(a.src), static_cast<T*>(a.dst), a.src_len, a.dst_len,
                                          a.from, a.to, a.n, P});
  };
  with_element(dtype, run);
}

}  // namespace cpsim::kernels
