#include "core/gather.hpp"

#include "core/kernels/table.hpp"

namespace cpsim {

namespace {
// Bytes of one row's shard: L * (product of trailing dims) elements.
std::size_t row_bytes(const Tensor& x, std::int64_t seq) {
  std::int64_t inner = 1;
  for (int d = 2; d < x.ndim(); ++d) inner *= x.dim(d);
  return static_cast<std::size_t>(seq * inner) * dtype_size(x.dtype());
}
}  // namespace

Tensor all_gather_sequence_tensor(const Tensor& x, Communicator& comm) {
  CPSIM_ENFORCE(x.ndim() >= 2, "gather_sequence needs [B, L, ...], got ", shape_str(x.shape()));
  const int c = comm.size();
  const std::int64_t B = x.dim(0), L = x.dim(1);
  // Ranks' blocks arrive as [c][B][L...]; rows are reassembled as [B][c][L...].
  Tensor staged({static_cast<std::int64_t>(c) * x.numel()}, x.dtype(), x.device());
  comm.all_gather(x.raw(), staged.raw(), static_cast<std::size_t>(x.numel()), x.dtype());
  Shape out_shape = x.shape();
  out_shape[1] = L * c;
  Tensor out(out_shape, x.dtype(), x.device());
  kernels::kernels_for(x.device())
      .blocks_to_sequence({staged.raw(), out.raw(), B, c, row_bytes(x, L)}, kernels::current_stream());
  return out;
}

Tensor reduce_scatter_sequence_tensor(const Tensor& grad, Communicator& comm) {
  const int c = comm.size();
  const std::int64_t B = grad.dim(0), L = grad.dim(1) / c;
  CPSIM_ENFORCE(grad.dim(1) % c == 0, "gradient sequence ", grad.dim(1), " not divisible by ", c);
  Tensor staged({grad.numel()}, grad.dtype(), grad.device());
  kernels::kernels_for(grad.device())
      .sequence_to_blocks({grad.raw(), staged.raw(), B, c, row_bytes(grad, L)}, kernels::current_stream());
  Shape local_shape = grad.shape();
  local_shape[1] = L;
  Tensor out(local_shape, grad.dtype(), grad.device());
  comm.reduce_scatter(staged.raw(), out.raw(), static_cast<std::size_t>(out.numel()), grad.dtype());
  return out;
}

Var gather_sequence(const Var& x, Communicator* comm, bool differentiable) {
  if (!is_distributed(comm)) return x;
  Tensor out = all_gather_sequence_tensor(x.value(), *comm);
  if (!differentiable) return Var(out, false);
  return record(out, "gather_sequence", {x}, [comm](const Tensor& g) {
    return std::vector<Tensor>{reduce_scatter_sequence_tensor(g, *comm)};
  });
}

Var all_gather_backward_anchor(const Var& gathered) {
  const Shape shape = gathered.value().shape();
  const DType dt = gathered.value().dtype();
  const Device device = gathered.value().device();
  // A zero scalar added to the loss; losses are host scalars (dot), whatever device.
  return record(Tensor({1}, dt), "all_gather_backward_anchor", {gathered},
                [shape, dt, device](const Tensor&) { return std::vector<Tensor>{Tensor(shape, dt, device)}; });
}

}  // namespace cpsim
