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

// The first tap of output (b, t) inside its run: the taps before it would read
// another document (negative: every tap is inside).
CPSIM_HD inline index_t first_tap(const Conv& a, index_t b, index_t t) {
  return a.run_start[b * (a.outputs + a.width - 1) + t + a.width - 1] - t;
}

template <class T>
struct ConvForward {
  Conv a;
  CPSIM_HD void operator()(index_t i) const {  // i over (b, t, c)
    const index_t N = a.outputs, C = a.channels, W = a.width, NW = N + W - 1;
    const index_t b = i / (N * C), rem = i - b * N * C, t = rem / C, c = rem - t * C, first = first_tap(a, b, t);
    const T *x = static_cast<const T*>(a.x), *w = static_cast<const T*>(a.w), *bias = static_cast<const T*>(a.bias);
    T acc = bias ? bias[c] : T(0);
    for (index_t j = first > 0 ? first : 0; j < W; ++j) acc += w[c * W + j] * x[(b * NW + t + j) * C + c];
    static_cast<T*>(a.y)[i] = acc;
  }
};

template <class T>
struct ConvInputGrad {
  Conv a;
  CPSIM_HD void operator()(index_t i) const {  // i over (b, p, c), p a window position
    const index_t N = a.outputs, C = a.channels, W = a.width, NW = N + W - 1;
    const index_t b = i / (NW * C), rem = i - b * NW * C, p = rem / C, c = rem - p * C;
    const T *w = static_cast<const T*>(a.w), *gy = static_cast<const T*>(a.gy);
    T acc = T(0);
    for (index_t j = W - 1; j >= 0; --j) {  // outputs t = p - j in increasing order
      const index_t t = p - j;
      if (t < 0 || t >= N || j < first_tap(a, b, t)) continue;
      acc += w[c * W + j] * gy[(b * N + t) * C + c];
    }
    static_cast<T*>(a.gx)[i] = acc;
  }
};

template <class T>
struct ConvWeightGrad {
  Conv a;
  CPSIM_HD void operator()(index_t i) const {  // i over C*W weights, then C biases
    const index_t N = a.outputs, C = a.channels, W = a.width, NW = N + W - 1;
    const T *x = static_cast<const T*>(a.x), *gy = static_cast<const T*>(a.gy);
    if (i >= C * W) {
      const index_t c = i - C * W;
      T acc = T(0);
      for (index_t b = 0; b < a.rows; ++b)
        for (index_t t = 0; t < N; ++t) acc += gy[(b * N + t) * C + c];
      static_cast<T*>(a.gbias)[c] = acc;
      return;
    }
    const index_t c = i / W, j = i - c * W;
    T acc = T(0);
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t t = 0; t < N; ++t)
        if (j >= first_tap(a, b, t)) acc += x[(b * NW + t + j) * C + c] * gy[(b * N + t) * C + c];
    static_cast<T*>(a.gw)[i] = acc;
  }
};

// Calls f(T{}) with float or double.
template <class F>
void with_float(DType dtype, F&& f) {
  if (dtype == DType::f32) f(float{});
  else f(double{});
}

// Runs F<T>{a} over indices 0..n-1, T the float type of dtype: how an op's
// functor (holding the op's arguments) runs.
template <template <class> class F, class Policy, class Args>
void for_each_float(Policy&& policy, DType dtype, index_t n, const Args& a) {
  with_float(dtype, [&](auto tag) { for_each_index(policy, n, F<decltype(tag)>{a}); });
}

template <class Policy>
void conv_forward(Policy&& policy, const Conv& a, DType dtype) {
  for_each_float<ConvForward>(policy, dtype, a.rows * a.outputs * a.channels, a);
}

template <class Policy>
void conv_backward(Policy&& policy, const Conv& a, DType dtype) {
  for_each_float<ConvInputGrad>(policy, dtype, a.rows * (a.outputs + a.width - 1) * a.channels, a);
  for_each_float<ConvWeightGrad>(policy, dtype, a.channels * a.width + a.channels, a);
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

// What the host's passes share: the sizes, x, the weights transposed to [W][C]
// (a tap's channels contiguous), and the walk over the outputs.
template <class T>
struct HostConv {
  const Conv& a;
  index_t N, C, W, NW;
  const T* x;
  std::vector<T> wt;
  explicit HostConv(const Conv& conv)
      : a(conv), N(conv.outputs), C(conv.channels), W(conv.width), NW(N + W - 1), x(static_cast<const T*>(conv.x)),
        wt(taps_by_channel(static_cast<const T*>(conv.w), C, W)) {}
  // f(b, t, first) for each output (row b, token t) in order, `first` its first
  // tap inside its run (the taps before it would read another document).
  template <class F>
  void each_output(F&& f) const {
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t t = 0; t < N; ++t) {
        const index_t first = first_tap(a, b, t);
        f(b, t, first > 0 ? first : 0);
      }
  }
};

// The host's conv runs along the channels: per (row, token), each tap adds its
// weights times x across all channels at once, a loop the compiler vectorises.
// Every output adds the same terms in the same order as the functors (bias, then
// taps in increasing j; the input gradient's outputs in increasing t), so the
// results are bitwise theirs.
inline void conv_forward_host(const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const HostConv<T> h(a);
    const T* bias = static_cast<const T*>(a.bias);
    h.each_output([&](index_t b, index_t t, index_t first) {
      T* out = static_cast<T*>(a.y) + (b * h.N + t) * h.C;
      for (index_t c = 0; c < h.C; ++c) out[c] = bias ? bias[c] : T(0);
      for (index_t j = first; j < h.W; ++j)
        add_products(out, h.wt.data() + j * h.C, h.x + (b * h.NW + t + j) * h.C, h.C);
    });
  });
}

// The host's backward: the input gradient along the channels as above; the weight
// and bias gradients in one pass over the tokens (ConvWeightGrad runs a pass per
// weight, strided by C: a thread per weight on a GPU). Each weight still adds its
// terms in token order (b, then t), so the sums are bitwise ConvWeightGrad's.
inline void conv_backward_host(const Conv& a, DType dtype) {
  with_float(dtype, [&](auto tag) {
    using T = decltype(tag);
    const HostConv<T> h(a);
    const index_t N = h.N, C = h.C, W = h.W, NW = h.NW;
    const T* gy = static_cast<const T*>(a.gy);
    for (index_t b = 0; b < a.rows; ++b)
      for (index_t p = 0; p < NW; ++p) {
        T* out = static_cast<T*>(a.gx) + (b * NW + p) * C;
        for (index_t c = 0; c < C; ++c) out[c] = T(0);
        for (index_t j = W - 1; j >= 0; --j) {  // outputs t = p - j in increasing order
          const index_t t = p - j;
          if (t < 0 || t >= N || j < first_tap(a, b, t)) continue;
          add_products(out, h.wt.data() + j * C, gy + (b * N + t) * C, C);
        }
      }
    T* gw = static_cast<T*>(a.gw);
    T* gbias = static_cast<T*>(a.gbias);
    for (index_t i = 0; i < C * W; ++i) gw[i] = T(0);
    for (index_t c = 0; c < C; ++c) gbias[c] = T(0);
    h.each_output([&](index_t b, index_t t, index_t first) {
      const T* g = gy + (b * N + t) * C;
      for (index_t c = 0; c < C; ++c) gbias[c] += g[c];
      for (index_t j = first; j < W; ++j) {
        const T* xj = h.x + (b * NW + t + j) * C;
        for (index_t c = 0; c < C; ++c) gw[c * W + j] += xj[c] * g[c];
      }
    });
  });
}

}  // namespace cpsim::kernels
