#include "core/halo.hpp"

#include <algorithm>
#include "core/kernels/table.hpp"
#include "core/gather.hpp"
#include "core/exchange_plan.hpp"

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

// Rank q's tail slot in the gathered tails [c][B][T][C], as a [B, T, C] view's data.
const std::byte* slot(const Tensor& tails, int q, std::int64_t B, std::int64_t T, std::int64_t C) {
  return static_cast<const std::byte*>(tails.raw()) +
         static_cast<std::int64_t>(q) * B * T * C * static_cast<std::int64_t>(dtype_size(tails.dtype()));
}

// Each earlier owner's part of rank r's window: positions [lo, hi) of owner q, at
// window slot lo - (a_r - H) and at offset lo - (a_{q+1} - T) of q's right-aligned tail.
struct WindowPart {
  int owner;
  std::int64_t slot, offset, n;
};
std::vector<WindowPart> window_parts(const ShardPlan& plan, std::int64_t H, std::int64_t T, int r) {
  std::vector<WindowPart> parts;
  const std::int64_t w0 = plan.begin(r) - H;
  for (int q = 0; q < r; ++q) {
    const std::int64_t lo = std::max(plan.begin(q), w0), hi = std::min(plan.end(q), plan.begin(r));
    if (hi > lo) parts.push_back({q, lo - w0, lo - (plan.end(q) - T), hi - lo});
  }
  return parts;
}

void move_raw(const void* src, std::int64_t src_len, std::int64_t from, void* dst, std::int64_t dst_len,
              std::int64_t to, std::int64_t n, std::int64_t B, std::size_t position, Device device) {
  if (n <= 0 || B <= 0) return;
  kernels::kernels_for(device).copy_positions({src, dst, B, src_len, dst_len, from, to, n, position},
                                              kernels::current_stream());
}

// The exchanges below produce a rank's history alone, [B, H, C] (window slots
// [0, H): the H global positions before a_r), and run backwards from that
// history's gradient, adding each owner's part into its dx [B, L, C]. Their cost
// follows the W-1 positions they move, never L.

Tensor halo_all_gather(const Tensor& x, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const std::int64_t T = halo_plan(plan, width, comm.rank()).tail, mine = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  const std::size_t position = static_cast<std::size_t>(C) * dtype_size(x.dtype());
  Tensor tail({B, T, C}, x.dtype(), x.device());  // right-aligned: the last `mine` positions end the slot
  copy_positions(x, L - mine, tail, T - mine, mine, false);
  Tensor tails = Tensor::empty({c * B, T, C}, x.dtype(), x.device());  // [c][B][T][C], every slot gathered
  comm.all_gather(tail.raw(), tails.raw(), static_cast<std::size_t>(tail.numel()), x.dtype());
  Tensor halo({B, H, C}, x.dtype(), x.device());  // slots before position 0 stay zero
  for (const WindowPart& w : window_parts(plan, H, T, r))
    move_raw(slot(tails, w.owner, B, T, C), T, w.offset, halo.raw(), H, w.slot, w.n, B, position, x.device());
  return halo;
}

void halo_all_gather_backward(const Tensor& gh, Tensor& dx, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = dx.dim(0), L = dx.dim(1), C = dx.dim(2), H = width - 1;
  const std::int64_t T = halo_plan(plan, width, comm.rank()).tail, mine_n = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  const std::size_t position = static_cast<std::size_t>(C) * dtype_size(gh.dtype());
  // Each rank moves its history gradient into per-owner tail slots; the
  // reduce-scatter sums the slots in rank order and hands each owner its own.
  Tensor slots({c * B, T, C}, gh.dtype(), gh.device());  // [c][B][T][C], zero where nothing lands
  for (const WindowPart& w : window_parts(plan, H, T, r))
    move_raw(gh.raw(), H, w.slot, const_cast<std::byte*>(slot(slots, w.owner, B, T, C)), T, w.offset, w.n, B,
             position, gh.device());
  Tensor mine = Tensor::empty({B, T, C}, gh.dtype(), gh.device());
  comm.reduce_scatter(slots.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), gh.dtype());
  copy_positions(mine, T - mine_n, dx, L - mine_n, mine_n, true);
}

Tensor halo_send_recv(const Tensor& x, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const int r = comm.rank();
  Tensor halo({B, H, C}, x.dtype(), x.device());
  for (const HaloHop& hop : halo_plan(plan, width, r).hops) {
    Tensor send = positions(x, L - hop.send_count, hop.send_count),
           recv = Tensor::empty({B, hop.recv_count, C}, x.dtype(), x.device());
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.dst, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.src},
                   x.dtype());
    // The sender's last recv_count positions end at a_{src+1}, at window slot a_{src+1} - (a_r - H).
    if (hop.src >= 0)
      copy_positions(recv, 0, halo, plan.end(hop.src) - hop.recv_count - (plan.begin(r) - H), hop.recv_count, false);
  }
  return halo;
}

void halo_send_recv_backward(const Tensor& gh, Tensor& dx, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = dx.dim(0), L = dx.dim(1), C = dx.dim(2), H = width - 1;
  const int r = comm.rank();
  for (const HaloHop& hop : halo_plan(plan, width, r).hops) {
    // The forward hop run backwards: gradients go to src, arrive from dst.
    Tensor send({B, hop.recv_count, C}, gh.dtype(), gh.device()),
        recv = Tensor::empty({B, hop.send_count, C}, gh.dtype(), gh.device());
    if (hop.src >= 0)
      copy_positions(gh, plan.end(hop.src) - hop.recv_count - (plan.begin(r) - H), send, 0, hop.recv_count, false);
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.src, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.dst},
                   gh.dtype());
    if (hop.dst >= 0) copy_positions(recv, 0, dx, L - hop.send_count, hop.send_count, true);
  }
}

// One rank's halo exchange, forward and backward. Without a plan (no distributed
// communicator, or W = 1: no history to fetch) it moves nothing: zeros forward,
// nothing to return backward.
struct Exchange {
  Communicator* comm;
  int width;
  bool gather;
  ShardPlan plan;

  Tensor forward(const Tensor& x) const {
    if (plan.cuts.empty()) return Tensor({x.dim(0), width - 1, x.dim(2)}, x.dtype(), x.device());
    return gather ? halo_all_gather(x, *comm, width, plan) : halo_send_recv(x, *comm, width, plan);
  }
  // Adds the history gradient gh [B, H, C] to its owners' dx [B, L, C].
  void backward(const Tensor& gh, Tensor& dx) const {
    if (plan.cuts.empty()) return;
    if (gather) halo_all_gather_backward(gh, dx, *comm, width, plan);
    else halo_send_recv_backward(gh, dx, *comm, width, plan);
  }
};

Exchange exchange_for(const char* op, const Tensor& x, Communicator* comm, int width, HaloExchange exchange,
                      const ShardPlan* plan) {
  CPSIM_ENFORCE(width >= 1, "convolution width must be >= 1, got ", width);
  CPSIM_ENFORCE(x.ndim() == 3, op, " takes [B, L, C], got ", shape_str(x.shape()));
  if (!is_distributed(comm) || width == 1) return {comm, width, false, ShardPlan()};
  return {comm, width, exchange == HaloExchange::all_gather, plan_for(op, plan, *comm, x.dim(1))};
}

}  // namespace

Var convolution_halo(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange,
                     const ShardPlan* plan) {
  const Tensor& x = x_masked.value();
  const Exchange ex = exchange_for("convolution_halo", x, comm, width, exchange, plan);
  return record(ex.forward(x), "convolution_halo", {x_masked}, [ex, shape = x.shape()](const Tensor& g) {
    Tensor dx(shape, g.dtype(), g.device());
    ex.backward(g, dx);
    return std::vector<Tensor>{dx};
  });
}

Var convolution_history(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange,
                        const ShardPlan* plan) {
  const Tensor& x = x_masked.value();
  const Exchange ex = exchange_for("convolution_history", x, comm, width, exchange, plan);
  if (width == 1) return x_masked;
  const std::int64_t H = width - 1, L = x.dim(1);
  const Tensor halo = ex.forward(x);
  Tensor out = Tensor::empty({x.dim(0), L + H, x.dim(2)}, x.dtype(), x.device());
  copy_positions(halo, 0, out, 0, H, false);
  copy_positions(x, 0, out, H, L, false);
  return record(out, "convolution_history", {x_masked}, [ex, H, L](const Tensor& g) {
    Tensor dx = positions(g, H, L);
    ex.backward(positions(g, 0, H), dx);
    return std::vector<Tensor>{dx};
  });
}

}  // namespace cpsim
