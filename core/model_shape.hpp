// The model's shape where nobody says otherwise, and its fixed constants: one
// place each. The rows' seeded inputs, the golden folders, every command's
// defaults (--conv-width, --channels, ...), the operators, the kernels and the
// C++ references read them from here (the independent numpy check keeps its
// own, on purpose).
#pragma once

#include <cstdint>

namespace cpsim {

// The shape of the seeded inputs the properties, golden folders and benchmarks
// draw.
struct ModelShape {
  int conv_width = 4;                          // the short convolution's taps W
  int channels = 8;                            // the activation's channels C
  int heads = 2, key_dim = 4, value_dim = 4;   // recurrence and attention (RoPE: key_dim rounded up to even)
  int topk = 3, index_dim = 4;                 // sparse attention's indexer
  int vocab = 16;                              // the loss's logits
  // The attention's q and k head size: key_dim rounded up to even (RoPE turns pairs).
  std::int64_t rope_dim() const { return 2 * ((key_dim + 1) / 2); }
};

// The convolution's taps W where nobody says otherwise (a short conv of a
// linear-attention layer).
inline constexpr int kDefaultConvWidth = ModelShape{}.conv_width;

// RoPE's base: pair m of a head of size D turns by pos * kRopeBase^(-2m/D).
inline constexpr double kRopeBase = 10000;

}  // namespace cpsim
