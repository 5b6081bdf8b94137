// The packed causal depthwise convolution of the one kernel source. A window of
// N+W-1 positions per row (the W-1 positions before the shard, then the shard)
// and its doc ids; output t takes taps j in [first(t), W), where first(t) =
// runstart(t+W-1) - t drops the taps before the start of t's segment.
//   forward   one thread per output (b, t, c) (the host: along the channels)
//   dx        one thread per window position (b, p, c), gathering the outputs that read it
//   dw, dbias one thread per weight (c, j) / channel, summing over (b, t) in order
#pragma once

#include <vector>

#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

template <class T>
struct ConvForward {
  const T* x;
  const std::int64_t* start;  // run starts of the window [B][NW]
  const T* w;
  const T* bias;
  T* y;
  index_t N, C, W;
  CPSIM_HD void operator()(index_t i) const {
    const index_t NW = N + W - 1, b = i / (N * C), rem = i - b * N * C, t = rem / C, c = rem - t * C;
    const index_t first = start[b * NW + t + W - 1] - t;
    T acc = bias ? bias[c] : T(0);
    for (index_t j = first > 0 ? first : 0; j < W; ++j) acc += w[c * W + j] * x[(b * NW + t + j) * C + c];
    y[i] = acc;
  }
};

template <class T>
struct ConvInputGrad {
  const std::int64_t* start;
  const T* w;
  const T* gy;
  T* gx;
  index_t N, C, W;
  CPSIM_HD void operator()(index_t i) const {
    const index_t NW = N + W - 1, b = i / (NW * C), rem = i - b * NW * C, p = rem / C, c = rem - p * C;
    T acc = T(0);
    for (index_t j = W - 1; j >= 0; --j) {  // outputs t = p - j in increasing order
      const index_t t = p - j;
      if (t < 0 || t >= N || j < start[b * NW + t + W - 1] - t) continue;
      acc += w[c * W + j] * gy[(b * N + t) * C + c];
    }
    gx[i] = acc;
  }
};

template <class T>
struct ConvWeightGrad {
  const T* x;
  const std::int64_t* start;
  const T* gy;
  T* gw;
  T* gbias;
  index_t B, N, C, W;
  CPSIM_HD void operator()(index_t i) const {  // i over C*W weights, then C biases
    const index_t NW = N + W - 1;
    if (i >= C * W) {
      const index_t c = i - C * W;
      T acc = T(0);
      for (index_t b = 0; b < B; ++b)
        for (index_t t = 0; t < N; ++t) acc += gy[(b * N + t) * C + c];
      gbias[c] = acc;
      return;
    }
    const index_t c = i / W, j = i - c * W;
    T acc = T(0);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < N; ++t)
        if (j >= start[b * NW + t + W - 1] - t) acc += x[(b * NW + t + j) * C + c] * gy[(b * N + t) * C + c];
    gw[i] = acc;
  }
};

// Calls f(T{}) with float or double.
template <class F>
void with_float(DType dtype, F&& f) {
  if (dtype == DType::f32) f(float{});
  else f(double{});
}

template <class Policy>
void conv_forward(Policy&& policy, const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_index(policy, a.rows * a.outputs * a.channels,
                   ConvForward<T>{static_cast<const T*>(a.x), a.run_start, static_cast<const T*>(a.w),
                                  static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.outputs, a.channels, a.width});
  });
}

template <class Policy>
void conv_backward(Policy&& policy, const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const index_t NW = a.outputs + a.width - 1;
    for_each_index(policy, a.rows * NW * a.channels,
                   ConvInputGrad<T>{a.run_start, static_cast<const T*>(a.w), static_cast<const T*>(a.gy),
                                    static_cast<T*>(a.gx), a.outputs, a.channels, a.width});
    for_each_index(policy, a.channels * a.width + a.channels,
                   ConvWeightGrad<T>{static_cast<const T*>(a.x), a.run_start, static_cast<const T*>(a.gy),
                                     static_cast<T*>(a.gw), static_cast<T*>(a.gbias), a.rows, a.outputs, a.channels,
                                     a.width});
  });
}

// out[c] += a[c] * b[c] for every channel.
template <class T>
inline void add_products(T* out, const T* a, const T* b, index_t C) {
  for (index_t c = 0; c < C; ++c) out[c] += a[c] * b[c];
}

template <class T>
std::vector<T> taps_by_channel(const T* w, index_t C, index_t W) {
  std::vector<T> wt(static_cast<std::size_t>(C * W));
  for (index_t c = 0; c < C; ++c)
    for (index_t j = 0; j < W; ++j) wt[j * C + c] = w[c * W + j];
  return wt;
}

// The host's conv runs along the channels: per (row, token), each tap adds its
// weights times x across all channels at once (the weights transposed to [W][C]
// so a tap's channels are contiguous), a loop the compiler vectorises. Every
// output adds the same terms in the same order as the functors (bias, then taps
// in increasing j; the input gradient's outputs in increasing t), so the results
// are bitwise theirs.
inline void conv_forward_host(const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const index_t N = a.outputs, C = a.channels, W = a.width, NW = N + W - 1;
    const T *x = static_cast<const T*>(a.x), *bias = static_cast<const T*>(a.bias);
    const std::vector<T> wt = taps_by_channel(static_cast<const T*>(a.w), C, W);
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t t = 0; t < N; ++t) {
        const index_t first = a.run_start[b * NW + t + W - 1] - t;
        T* out = static_cast<T*>(a.y) + (b * N + t) * C;
        for (index_t c = 0; c < C; ++c) out[c] = bias ? bias[c] : T(0);
        for (index_t j = first > 0 ? first : 0; j < W; ++j)
          add_products(out, wt.data() + j * C, x + (b * NW + t + j) * C, C);
      }
  });
}

// The host's backward: the input gradient along the channels as above; the weight
// and bias gradients in one pass over the tokens (ConvWeightGrad runs a pass per
// weight, strided by C: a thread per weight on a GPU). Each weight still adds its
// terms in token order (b, then t), so the sums are bitwise ConvWeightGrad's.
inline void conv_backward_host(const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const index_t N = a.outputs, C = a.channels, W = a.width, NW = N + W - 1;
    const T *x = static_cast<const T*>(a.x), *gy = static_cast<const T*>(a.gy);
    const std::vector<T> wt = taps_by_channel(static_cast<const T*>(a.w), C, W);
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t p = 0; p < NW; ++p) {
        T* out = static_cast<T*>(a.gx) + (b * NW + p) * C;
        for (index_t c = 0; c < C; ++c) out[c] = T(0);
        for (index_t j = W - 1; j >= 0; --j) {  // outputs t = p - j in increasing order
          const index_t t = p - j;
          if (t < 0 || t >= N || j < a.run_start[b * NW + t + W - 1] - t) continue;
          add_products(out, wt.data() + j * C, gy + (b * N + t) * C, C);
        }
      }
    T* gw = static_cast<T*>(a.gw);
    T* gbias = static_cast<T*>(a.gbias);
    for (index_t i = 0; i < C * W; ++i) gw[i] = T(0);
    for (index_t c = 0; c < C; ++c) gbias[c] = T(0);
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t t = 0; t < N; ++t) {
        const index_t first = a.run_start[b * NW + t + W - 1] - t;
        const T* g = gy + (b * N + t) * C;
        for (index_t c = 0; c < C; ++c) gbias[c] += g[c];
        for (index_t j = first > 0 ? first : 0; j < W; ++j) {
          const T* xj = x + (b * NW + t + j) * C;
          for (index_t c = 0; c < C; ++c) gw[c * W + j] += xj[c] * g[c];
        }
      }
  });
}

}  // namespace cpsim::kernels
