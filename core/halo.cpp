#include "core/halo.hpp"

#include <algorithm>
#include "core/kernels/table.hpp"
#include "core/plan.hpp"

namespace cpsim {

const char* halo_exchange_name(HaloExchange e) {
  return e == HaloExchange::all_gather ? "all_gather" : "send_recv";
}

namespace {

// Copies positions [from, from+n) of a [B, len_src, C] tensor into positions
// [to, to+n) of a [B, len_dst, C] tensor (adding when `accumulate`), on their device.
void copy_positions(const Tensor& src, std::int64_t from, Tensor& dst, std::int64_t to, std::int64_t n,
                    bool accumulate) {
  if (n <= 0) return;
  const kernels::PositionCopy a{src.raw(), dst.raw(),  src.dim(0), src.dim(1), dst.dim(1), from, to, n,
                                static_cast<std::size_t>(src.dim(2)) * dtype_size(src.dtype())};
  const auto& k = kernels::kernels_for(src.device());
  if (accumulate) k.add_positions(a, src.dtype(), kernels::current_stream());
  else k.copy_positions(a, kernels::current_stream());
}

// Positions [from, from+n) of a [B, len, C] tensor, as a new [B, n, C] tensor.
Tensor positions(const Tensor& t, std::int64_t from, std::int64_t n) {
  Tensor out({t.dim(0), n, t.dim(2)}, t.dtype(), t.device());
  copy_positions(t, from, out, 0, n, false);
  return out;
}

Tensor history_all_gather(const Tensor& x, Communicator& comm, int width) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const std::int64_t T = halo_plan(L, width, comm.rank(), comm.size()).tail;
  const int c = comm.size(), r = comm.rank();
  const Tensor tail = positions(x, L - T, T);
  Tensor tails({c * B, T, C}, x.dtype(), x.device());  // [c][B][T][C]
  comm.all_gather(tail.raw(), tails.raw(), static_cast<std::size_t>(tail.numel()), x.dtype());
  Tensor out({B, L + H, C}, x.dtype(), x.device());
  kernels::kernels_for(x.device())
      .history_from_tails({out.raw(), tails.raw(), B, L, H, T, r, static_cast<std::size_t>(C) * dtype_size(x.dtype())},
                          kernels::current_stream());
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_all_gather_backward(const Tensor& g, Communicator& comm, int width) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H;
  const std::int64_t T = halo_plan(L, width, comm.rank(), comm.size()).tail;
  const int c = comm.size(), r = comm.rank();
  // Each rank moves its history gradient into per-owner tail slots; the
  // reduce-scatter sums the slots in rank order and hands each owner its own.
  Tensor slots({c * B, T, C}, g.dtype(), g.device());  // [c][B][T][C], zero where nothing lands
  kernels::kernels_for(g.device())
      .history_to_tails({const_cast<void*>(g.raw()), slots.raw(), B, L, H, T, r,
                         static_cast<std::size_t>(C) * dtype_size(g.dtype())},
                        kernels::current_stream());
  Tensor mine({B, T, C}, g.dtype(), g.device());
  comm.reduce_scatter(slots.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), g.dtype());
  Tensor dx = positions(g, H, L);
  copy_positions(mine, 0, dx, L - T, T, true);
  return dx;
}

Tensor history_send_recv(const Tensor& x, Communicator& comm, int width) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const int r = comm.rank();
  Tensor out({B, L + H, C}, x.dtype(), x.device());
  for (const HaloHop& hop : halo_plan(L, width, r, comm.size()).hops) {
    const std::int64_t n = hop.count;
    Tensor send = positions(x, L - n, n), recv({B, n, C}, x.dtype(), x.device());
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.dst, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.src},
                   x.dtype());
    // Rank r-k's last n positions sit at global (r-k+1)L - n ... in r's window.
    if (hop.src >= 0) copy_positions(recv, 0, out, (r - hop.distance + 1) * L - n - (r * L - H), n, false);
  }
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_send_recv_backward(const Tensor& g, Communicator& comm, int width) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H;
  const int r = comm.rank();
  Tensor dx = positions(g, H, L);
  for (const HaloHop& hop : halo_plan(L, width, r, comm.size()).hops) {
    // The forward hop run backwards: gradients go to r - k, arrive from r + k.
    const std::int64_t n = hop.count;
    Tensor send({B, n, C}, g.dtype(), g.device()), recv({B, n, C}, g.dtype(), g.device());
    if (hop.src >= 0) copy_positions(g, (r - hop.distance + 1) * L - n - (r * L - H), send, 0, n, false);
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.src, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.dst},
                   g.dtype());
    if (hop.dst >= 0) copy_positions(recv, 0, dx, L - n, n, true);
  }
  return dx;
}

}  // namespace

Var convolution_history(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange) {
  CPSIM_ENFORCE(width >= 1, "convolution width must be >= 1, got ", width);
  CPSIM_ENFORCE(x_masked.value().ndim() == 3, "convolution_history takes [B, L, C], got ",
                shape_str(x_masked.value().shape()));
  if (width == 1) return x_masked;
  const Tensor& x = x_masked.value();
  const std::int64_t H = width - 1, L = x.dim(1);
  if (!is_distributed(comm)) {
    Tensor out({x.dim(0), L + H, x.dim(2)}, x.dtype(), x.device());
    copy_positions(x, 0, out, H, L, false);
    return record(out, "convolution_history", {x_masked},
                  [H, L](const Tensor& g) { return std::vector<Tensor>{positions(g, H, L)}; });
  }
  const bool gather = exchange == HaloExchange::all_gather;
  Tensor out = gather ? history_all_gather(x, *comm, width) : history_send_recv(x, *comm, width);
  return record(out, "convolution_history", {x_masked}, [comm, width, gather](const Tensor& g) {
    return std::vector<Tensor>{gather ? history_all_gather_backward(g, *comm, width)
                                      : history_send_recv_backward(g, *comm, width)};
  });
}

}  // namespace cpsim
