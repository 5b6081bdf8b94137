#include "core/conv.hpp"

#include <vector>

namespace cpsim {

namespace {

// First window index of the equal-id run holding each window position.
std::vector<std::int64_t> run_starts(const std::int64_t* ids, std::int64_t n) {
  std::vector<std::int64_t> start(n);
  for (std::int64_t i = 0; i < n; ++i) start[i] = (i > 0 && ids[i] == ids[i - 1]) ? start[i - 1] : i;
  return start;
}

struct ConvShape {
  std::int64_t B, N, C, W;
};

template <class T>
void conv_forward(const ConvShape& s, const T* x, const std::int64_t* ids, const T* w, const T* bias, T* y) {
  const std::int64_t NW = s.N + s.W - 1;
  for (std::int64_t b = 0; b < s.B; ++b) {
    const auto start = run_starts(ids + b * NW, NW);
    for (std::int64_t t = 0; t < s.N; ++t) {
      const std::int64_t first = start[t + s.W - 1] - t;  // lowest valid tap j
      for (std::int64_t c = 0; c < s.C; ++c) {
        T acc = bias ? bias[c] : T(0);
        for (std::int64_t j = std::max<std::int64_t>(0, first); j < s.W; ++j)
          acc += w[c * s.W + j] * x[(b * NW + t + j) * s.C + c];
        y[(b * s.N + t) * s.C + c] = acc;
      }
    }
  }
}

template <class T>
void conv_backward(const ConvShape& s, const T* x, const std::int64_t* ids, const T* w, const T* gy, T* gx, T* gw,
                   T* gbias) {
  const std::int64_t NW = s.N + s.W - 1;
  for (std::int64_t b = 0; b < s.B; ++b) {
    const auto start = run_starts(ids + b * NW, NW);
    for (std::int64_t t = 0; t < s.N; ++t) {
      const std::int64_t first = start[t + s.W - 1] - t;
      for (std::int64_t c = 0; c < s.C; ++c) {
        const T g = gy[(b * s.N + t) * s.C + c];
        gbias[c] += g;
        for (std::int64_t j = std::max<std::int64_t>(0, first); j < s.W; ++j) {
          gx[(b * NW + t + j) * s.C + c] += w[c * s.W + j] * g;
          gw[c * s.W + j] += x[(b * NW + t + j) * s.C + c] * g;
        }
      }
    }
  }
}

}  // namespace

Var packed_causal_conv(const Var& x_window, const Tensor& ids, const Var& weight, const Var& bias) {
  const Tensor& x = x_window.value();
  const Tensor& w = weight.value();
  CPSIM_ENFORCE(x.ndim() == 3 && w.ndim() == 2 && w.dim(0) == x.dim(2) && x.dim(1) >= w.dim(1) - 1,
                "packed_causal_conv: x ", shape_str(x.shape()), ", weight ", shape_str(w.shape()));
  CPSIM_ENFORCE(ids.dtype() == DType::i64 && ids.shape() == Shape({x.dim(0), x.dim(1)}), "window doc ids ",
                shape_str(ids.shape()), " do not match x ", shape_str(x.shape()));
  CPSIM_ENFORCE(x.dtype() == w.dtype() && (x.dtype() == DType::f32 || x.dtype() == DType::f64),
                "packed_causal_conv supports float32 and float64");
  const bool has_bias = bias.defined();
  const ConvShape s{x.dim(0), x.dim(1) - w.dim(1) + 1, x.dim(2), w.dim(1)};
  Tensor y({s.B, s.N, s.C}, x.dtype());
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
      conv_forward<T>(s, x.data<T>(), ids.data<std::int64_t>(), w.data<T>(), has_bias ? bias.value().data<T>() : nullptr,
                      y.data<T>());
  });
  std::vector<Var> inputs{x_window, weight};
  if (has_bias) inputs.push_back(bias);
  return record(y, "packed_causal_conv", inputs, [x, ids, w, s, has_bias](const Tensor& gy) {
    Tensor gx(x.shape(), x.dtype()), gw(w.shape(), w.dtype()), gb({s.C}, x.dtype());
    visit_dtype(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
        conv_backward<T>(s, x.data<T>(), ids.data<std::int64_t>(), w.data<T>(), gy.data<T>(), gx.data<T>(),
                         gw.data<T>(), gb.data<T>());
    });
    std::vector<Tensor> grads{gx, gw};
    if (has_bias) grads.push_back(gb);
    return grads;
  });
}

Tensor window_doc_ids(const Tensor& global, std::int64_t start, std::int64_t len, int width) {
  const std::int64_t B = global.dim(0), P = global.dim(1), NW = len + width - 1;
  Tensor out({B, NW}, DType::i64);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < NW; ++i) {
      const std::int64_t p = start - (width - 1) + i;
      out.data<std::int64_t>()[b * NW + i] = p < 0 ? kBeforeSequenceDocId : global.data<std::int64_t>()[b * P + p];
    }
  return out;
}

Var sharded_packed_conv(const Var& x_masked, const PackedContext& context, Communicator* comm, const Var& weight,
                        const Var& bias, HaloExchange exchange) {
  const int width = static_cast<int>(weight.value().dim(1));
  const Var window = convolution_history(x_masked, comm, width, exchange);
  return packed_causal_conv(window, window_doc_ids(context.doc_ids(), context.seq_start(), context.local_seq_len(), width),
                            weight, bias);
}

}  // namespace cpsim
