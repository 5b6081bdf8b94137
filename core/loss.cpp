#include "core/loss.hpp"

#include "core/kernels/table.hpp"

namespace cpsim {

Tensor next_token_targets(const Tensor& input_ids, const Tensor& doc_ids, const Tensor& padding) {
  CPSIM_ENFORCE(input_ids.ndim() == 2 && doc_ids.shape() == input_ids.shape() && padding.shape() == input_ids.shape(),
                "next_token_targets: input_ids ", shape_str(input_ids.shape()), ", doc ids ",
                shape_str(doc_ids.shape()), ", padding ", shape_str(padding.shape()));
  const Tensor ids = input_ids.is_cpu() ? input_ids : input_ids.to(Device::host());
  const Tensor docs = doc_ids.is_cpu() ? doc_ids : doc_ids.to(Device::host());
  const Tensor pad = padding.is_cpu() ? padding : padding.to(Device::host());
  const std::int64_t B = ids.dim(0), S = ids.dim(1);
  Tensor out({B, S}, DType::i64);
  auto* t = out.data<std::int64_t>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t i = b * S + s, next = i + 1;
      const bool has_next = s + 1 < S && docs.get_int(i) != 0 && docs.get_int(next) == docs.get_int(i) &&
                            pad.get_int(i) == 0 && pad.get_int(next) == 0;
      t[i] = has_next ? ids.get_int(next) : kIgnoreTarget;
    }
  return out;
}

Var token_mean_loss(const Var& logits, const Tensor& targets, Communicator* comm) {
  const Tensor& x = logits.value();
  CPSIM_ENFORCE(x.ndim() == 3 && targets.dtype() == DType::i64 && targets.shape() == Shape({x.dim(0), x.dim(1)}),
                "token_mean_loss: logits ", shape_str(x.shape()), ", targets ", shape_str(targets.shape()));
  CPSIM_ENFORCE(x.dtype() == DType::f32 || x.dtype() == DType::f64, "token_mean_loss supports float32 and float64");
  const Tensor host_targets = targets.is_cpu() ? targets : targets.to(Device::host());
  for (std::int64_t i = 0; i < host_targets.numel(); ++i) {
    const std::int64_t t = host_targets.get_int(i);
    CPSIM_ENFORCE(t == kIgnoreTarget || (t >= 0 && t < x.dim(2)), "token_mean_loss: target ", t,
                  " outside the vocabulary of ", x.dim(2));
  }
  const Tensor tg = targets.device() == x.device() ? targets : targets.to(x.device());
  Tensor token_loss({x.dim(0) * x.dim(1)}, x.dtype(), x.device());
  Tensor sums({2}, DType::f64, x.device());
  kernels::CrossEntropy a;
  a.logits = x.raw();
  a.targets = static_cast<const std::int64_t*>(tg.raw());
  a.token_loss = token_loss.raw();
  a.sums = static_cast<double*>(sums.raw());
  a.tokens = x.dim(0) * x.dim(1), a.vocab = x.dim(2);
  kernels::kernels_for(x.device()).cross_entropy_forward(a, x.dtype(), kernels::current_stream());
  // Every rank takes part, with zeros when it has no target: a rank that skipped
  // this call would leave its peers waiting in it.
  if (comm && comm->size() > 1) comm->all_reduce(sums.raw(), 2, DType::f64);
  const Tensor total = sums.is_cpu() ? sums : sums.to(Device::host());
  const double sum = total.get(0), count = total.get(1);
  Tensor value = Tensor::full({1}, DType::f64, count > 0 ? sum / count : 0.0);
  return record(value, "token_mean_loss", {logits}, [a, x, tg, count](const Tensor& g) {
    Tensor gx(x.shape(), x.dtype(), x.device());
    kernels::CrossEntropy b = a;  // its targets point into tg, which this closure keeps
    b.grad = gx.raw();
    b.grad_scale = count > 0 ? g.get(0) / count : 0.0;
    kernels::kernels_for(x.device()).cross_entropy_backward(b, x.dtype(), kernels::current_stream());
    return std::vector<Tensor>{gx};
  });
}

}  // namespace cpsim
