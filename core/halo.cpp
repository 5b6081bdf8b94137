#include "core/halo.hpp"

#include <algorithm>
#include "core/kernels/table.hpp"
#include "core/gather.hpp"
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

Tensor history_all_gather(const Tensor& x, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const std::int64_t T = halo_plan(plan, width, comm.rank()).tail, mine = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  const std::size_t position = static_cast<std::size_t>(C) * dtype_size(x.dtype());
  Tensor tail({B, T, C}, x.dtype(), x.device());  // right-aligned: the last `mine` positions end the slot
  copy_positions(x, L - mine, tail, T - mine, mine, false);
  Tensor tails({c * B, T, C}, x.dtype(), x.device());  // [c][B][T][C]
  comm.all_gather(tail.raw(), tails.raw(), static_cast<std::size_t>(tail.numel()), x.dtype());
  Tensor out({B, L + H, C}, x.dtype(), x.device());  // slots before position 0 stay zero
  for (const WindowPart& w : window_parts(plan, H, T, r))
    move_raw(slot(tails, w.owner, B, T, C), T, w.offset, out.raw(), L + H, w.slot, w.n, B, position, x.device());
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_all_gather_backward(const Tensor& g, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H;
  const std::int64_t T = halo_plan(plan, width, comm.rank()).tail, mine_n = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  const std::size_t position = static_cast<std::size_t>(C) * dtype_size(g.dtype());
  // Each rank moves its history gradient into per-owner tail slots; the
  // reduce-scatter sums the slots in rank order and hands each owner its own.
  Tensor slots({c * B, T, C}, g.dtype(), g.device());  // [c][B][T][C], zero where nothing lands
  for (const WindowPart& w : window_parts(plan, H, T, r))
    move_raw(g.raw(), L + H, w.slot, const_cast<std::byte*>(slot(slots, w.owner, B, T, C)), T, w.offset, w.n, B,
             position, g.device());
  Tensor mine({B, T, C}, g.dtype(), g.device());
  comm.reduce_scatter(slots.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), g.dtype());
  Tensor dx = positions(g, H, L);
  copy_positions(mine, T - mine_n, dx, L - mine_n, mine_n, true);
  return dx;
}

Tensor history_send_recv(const Tensor& x, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const int r = comm.rank();
  Tensor out({B, L + H, C}, x.dtype(), x.device());
  for (const HaloHop& hop : halo_plan(plan, width, r).hops) {
    Tensor send = positions(x, L - hop.send_count, hop.send_count), recv({B, hop.recv_count, C}, x.dtype(), x.device());
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.dst, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.src},
                   x.dtype());
    // The sender's last recv_count positions end at a_{src+1}, at window slot a_{src+1} - (a_r - H).
    if (hop.src >= 0)
      copy_positions(recv, 0, out, plan.end(hop.src) - hop.recv_count - (plan.begin(r) - H), hop.recv_count, false);
  }
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_send_recv_backward(const Tensor& g, Communicator& comm, int width, const ShardPlan& plan) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H;
  const int r = comm.rank();
  Tensor dx = positions(g, H, L);
  for (const HaloHop& hop : halo_plan(plan, width, r).hops) {
    // The forward hop run backwards: gradients go to src, arrive from dst.
    Tensor send({B, hop.recv_count, C}, g.dtype(), g.device()), recv({B, hop.send_count, C}, g.dtype(), g.device());
    if (hop.src >= 0)
      copy_positions(g, plan.end(hop.src) - hop.recv_count - (plan.begin(r) - H), send, 0, hop.recv_count, false);
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), hop.src, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), hop.dst},
                   g.dtype());
    if (hop.dst >= 0) copy_positions(recv, 0, dx, L - hop.send_count, hop.send_count, true);
  }
  return dx;
}

}  // namespace

Var convolution_history(const Var& x_masked, Communicator* comm, int width, HaloExchange exchange,
                        const ShardPlan* plan) {
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
  const ShardPlan p = plan_for("convolution_history", plan, *comm, L);
  const bool gather = exchange == HaloExchange::all_gather;
  Tensor out = gather ? history_all_gather(x, *comm, width, p) : history_send_recv(x, *comm, width, p);
  return record(out, "convolution_history", {x_masked}, [comm, width, gather, p](const Tensor& g) {
    return std::vector<Tensor>{gather ? history_all_gather_backward(g, *comm, width, p)
                                      : history_send_recv_backward(g, *comm, width, p)};
  });
}

}  // namespace cpsim
