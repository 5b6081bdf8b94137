#include "core/gather.hpp"

#include "core/kernels/table.hpp"

namespace cpsim {

namespace {
// Elements of one position: the product of the dims after the sequence.
std::int64_t inner_of(const Tensor& x) {
  std::int64_t inner = 1;
  for (int d = 2; d < x.ndim(); ++d) inner *= x.dim(d);
  return inner;
}

// Positions [from, from+n) of rows of `src_len` at `src` -> positions [to, to+n) of
// rows of `dst_len` at `dst`, B rows, `position` bytes each, on `device`.
void move(const void* src, std::int64_t src_len, std::int64_t from, void* dst, std::int64_t dst_len, std::int64_t to,
          std::int64_t n, std::int64_t B, std::size_t position, Device device) {
  if (n <= 0 || B <= 0) return;
  kernels::kernels_for(device).copy_positions({src, dst, B, src_len, dst_len, from, to, n, position},
                                              kernels::current_stream());
}

std::byte* at(Tensor& t, std::int64_t elements) {
  return static_cast<std::byte*>(t.raw()) + elements * static_cast<std::int64_t>(dtype_size(t.dtype()));
}
}  // namespace

ShardPlan plan_for(const char* op, const ShardPlan* plan, const Communicator& comm, std::int64_t local_len) {
  const int c = comm.size(), r = comm.rank();
  if (!plan) return equal_plan(local_len * c, c);
  if (plan->ranks() != c) CPSIM_INVALID(op, ": a shard plan of ", plan->ranks(), " ranks in a group of ", c);
  if (plan->size(r) != local_len)
    CPSIM_INVALID(op, ": the shard plan ", plan_text(*plan).substr(0, 120), " gives rank ", r, " ", plan->size(r),
                  " positions, its tensor holds ", local_len);
  return *plan;
}

Tensor all_gather_sequence_tensor(const Tensor& x, Communicator& comm, const ShardPlan* given) {
  CPSIM_ENFORCE(x.ndim() >= 2, "gather_sequence needs [B, L, ...], got ", shape_str(x.shape()));
  const ShardPlan plan = plan_for("gather_sequence", given, comm, x.dim(1));
  const int c = comm.size();
  const std::int64_t B = x.dim(0), L = x.dim(1), inner = inner_of(x), M = plan.largest();
  const std::size_t position = static_cast<std::size_t>(inner) * dtype_size(x.dtype());
  // Each rank's block, padded to the longest interval, arrives as [c][B][M...];
  // rank q's first size(q) positions of each row go to [a_q, a_{q+1}) of that row.
  // Every buffer below is written in full before it is read (the cuts cover the
  // padded row): none is zeroed.
  Shape out_shape = x.shape();
  out_shape[1] = plan.padded_len();
  Tensor out = Tensor::empty(out_shape, x.dtype(), x.device());
  if (plan.equal_sizes() && B == 1) {  // [c][1][L...] is [1][c*L...]: gathered in place
    comm.all_gather(x.raw(), out.raw(), static_cast<std::size_t>(L * inner), x.dtype());
    return out;
  }
  Tensor block = x;
  if (M != L) {
    block = Tensor::empty({B, M * inner}, x.dtype(), x.device());
    move(x.raw(), L, 0, block.raw(), M, 0, L, B, position, x.device());  // the tail past L is not read
  }
  Tensor staged = Tensor::empty({static_cast<std::int64_t>(c) * B * M * inner}, x.dtype(), x.device());
  comm.all_gather(block.raw(), staged.raw(), static_cast<std::size_t>(B * M * inner), x.dtype());
  if (plan.equal_sizes()) {  // one rearrangement: [c][B][L...] -> [B][c][L...]
    kernels::kernels_for(x.device())
        .blocks_to_sequence({staged.raw(), out.raw(), B, c, static_cast<std::size_t>(L) * position},
                            kernels::current_stream());
    return out;
  }
  for (int q = 0; q < c; ++q)
    move(at(staged, q * B * M * inner), M, 0, out.raw(), plan.padded_len(), plan.begin(q), plan.size(q), B, position,
         x.device());
  return out;
}

Tensor reduce_scatter_sequence_tensor(const Tensor& grad, Communicator& comm, const ShardPlan* given) {
  CPSIM_ENFORCE(grad.ndim() >= 2, "gather_sequence backward needs [B, P, ...], got ", shape_str(grad.shape()));
  const int c = comm.size(), r = comm.rank();
  if (!given) CPSIM_ENFORCE(grad.dim(1) % c == 0, "gradient sequence ", grad.dim(1), " not divisible by ", c);
  const ShardPlan plan = plan_for("gather_sequence backward", given, comm, given ? given->size(r) : grad.dim(1) / c);
  CPSIM_ENFORCE(grad.dim(1) == plan.padded_len(), "gather_sequence backward: gradient of ", grad.dim(1),
                " positions for a plan over ", plan.padded_len());
  const std::int64_t B = grad.dim(0), inner = inner_of(grad), M = plan.largest(), L = plan.size(r);
  const std::size_t position = static_cast<std::size_t>(inner) * dtype_size(grad.dtype());
  Shape local_shape = grad.shape();
  local_shape[1] = M;
  Tensor mine = Tensor::empty(local_shape, grad.dtype(), grad.device());  // the reduce-scatter writes it all
  if (plan.equal_sizes() && B == 1) {  // [1][c*L...] is [c][1][L...]: scattered in place
    comm.reduce_scatter(grad.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), grad.dtype());
    return mine;
  }
  // [c][B][M...]; under unequal cuts each block's tail past its rank's size stays zero.
  Tensor staged = plan.equal_sizes()
                      ? Tensor::empty({static_cast<std::int64_t>(c) * B * M * inner}, grad.dtype(), grad.device())
                      : Tensor({static_cast<std::int64_t>(c) * B * M * inner}, grad.dtype(), grad.device());
  if (plan.equal_sizes())
    kernels::kernels_for(grad.device())
        .sequence_to_blocks({grad.raw(), staged.raw(), B, c, static_cast<std::size_t>(M) * position},
                            kernels::current_stream());
  else
    for (int q = 0; q < c; ++q)
      move(grad.raw(), plan.padded_len(), plan.begin(q), at(staged, q * B * M * inner), M, 0, plan.size(q), B, position,
           grad.device());
  comm.reduce_scatter(staged.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), grad.dtype());
  if (M == L) return mine;
  local_shape[1] = L;
  Tensor out = Tensor::empty(local_shape, grad.dtype(), grad.device());
  move(mine.raw(), M, 0, out.raw(), L, 0, L, B, position, grad.device());
  return out;
}

Var gather_sequence(const Var& x, Communicator* comm, bool differentiable, const ShardPlan* plan) {
  if (!is_distributed(comm)) return x;
  Tensor out = all_gather_sequence_tensor(x.value(), *comm, plan);
  if (!differentiable) return Var(out, false);
  std::shared_ptr<const ShardPlan> kept = plan ? std::make_shared<const ShardPlan>(*plan) : nullptr;
  return record(out, "gather_sequence", {x}, [comm, kept](const Tensor& g) {
    return std::vector<Tensor>{reduce_scatter_sequence_tensor(g, *comm, kept.get())};
  });
}

Var all_gather_backward_anchor(const Var& gathered) {
  const Shape shape = gathered.value().shape();
  const DType dt = gathered.value().dtype();
  const Device device = gathered.value().device();
  // A zero scalar added to the loss; losses are host scalars (dot), whatever device.
  return record(Tensor({1}, dt), "all_gather_backward_anchor", {gathered},
                [shape, dt, device](const Tensor&) { return std::vector<Tensor>{Tensor(shape, dt, device)}; },
                /*zero_gradients=*/true);
}

}  // namespace cpsim
