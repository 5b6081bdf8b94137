#include "core/conv.hpp"

#include <vector>

#include "core/kernels/table.hpp"

namespace cpsim {

Var packed_causal_conv(const Var& x_window, const Tensor& ids, const Var& weight, const Var& bias) {
  const Tensor& x = x_window.value();
  const Tensor& w = weight.value();
  CPSIM_ENFORCE(x.ndim() == 3 && w.ndim() == 2 && w.dim(0) == x.dim(2) && x.dim(1) >= w.dim(1) - 1,
                "packed_causal_conv: x ", shape_str(x.shape()), ", weight ", shape_str(w.shape()));
  CPSIM_ENFORCE(ids.dtype() == DType::i64 && ids.shape() == Shape({x.dim(0), x.dim(1)}), "window doc ids ",
                shape_str(ids.shape()), " do not match x ", shape_str(x.shape()));
  CPSIM_ENFORCE(x.dtype() == w.dtype() && (x.dtype() == DType::f32 || x.dtype() == DType::f64),
                "packed_causal_conv supports float32 and float64");
  CPSIM_ENFORCE(ids.device() == x.device() && w.device() == x.device(), "packed_causal_conv: x, weight and doc ids on one device");
  const bool has_bias = bias.defined();
  const std::int64_t B = x.dim(0), C = x.dim(2), W = w.dim(1), N = x.dim(1) - W + 1, NW = x.dim(1);
  const Device device = x.device();
  const auto& k = kernels::kernels_for(device);
  // Run starts of the window's doc ids: where each output's taps must stop.
  Tensor start({B, NW}, DType::i64, device);
  k.run_starts(static_cast<const std::int64_t*>(ids.raw()), static_cast<std::int64_t*>(start.raw()), B, NW,
               kernels::current_stream());
  Tensor y({B, N, C}, x.dtype(), device);
  kernels::Conv a;
  a.x = x.raw();
  a.run_start = static_cast<const std::int64_t*>(start.raw());
  a.w = w.raw();
  a.bias = has_bias ? bias.value().raw() : nullptr;
  a.y = y.raw();
  a.rows = B, a.outputs = N, a.channels = C, a.width = W;
  k.conv_forward(a, x.dtype(), kernels::current_stream());
  std::vector<Var> inputs{x_window, weight};
  if (has_bias) inputs.push_back(bias);
  return record(y, "packed_causal_conv", inputs, [x, start, w, a, has_bias](const Tensor& gy) {
    Tensor gx(x.shape(), x.dtype(), x.device()), gw(w.shape(), w.dtype(), x.device()),
        gb({a.channels}, x.dtype(), x.device());
    kernels::Conv g = a;
    g.y = nullptr;
    g.gy = gy.raw();
    g.gx = gx.raw();
    g.gw = gw.raw();
    g.gbias = gb.raw();
    kernels::kernels_for(x.device()).conv_backward(g, x.dtype(), kernels::current_stream());
    std::vector<Tensor> grads{gx, gw};
    if (has_bias) grads.push_back(gb);
    return grads;
  });
}

Tensor window_doc_ids(const Tensor& global, std::int64_t start, std::int64_t len, int width) {
  return slice_sequence(global, start - (width - 1), len + width - 1, kBeforeSequenceDocId);
}

Var sharded_packed_conv(const Var& x_masked, const PackedContext& context, Communicator* comm, const Var& weight,
                        const Var& bias, HaloExchange exchange) {
  const int width = static_cast<int>(weight.value().dim(1));
  const Var window = convolution_history(x_masked, comm, width, exchange, &context.plan());
  // The layout lives on the host (as cu_seqlens do); its window goes where x is.
  const Tensor ids = window_doc_ids(context.doc_ids(), context.seq_start(), context.local_seq_len(), width);
  const Device device = window.value().device();
  return packed_causal_conv(window, device.is_cpu() ? ids : ids.to(device), weight, bias);
}

}  // namespace cpsim
