#include "core/halo.hpp"

#include <algorithm>
#include <cstring>

namespace cpsim {

const char* halo_exchange_name(HaloExchange e) {
  return e == HaloExchange::all_gather ? "all_gather" : "send_recv";
}

namespace {

// Copies positions [from, from+n) of a [B, len_src, C] tensor into positions
// [to, to+n) of a [B, len_dst, C] tensor (adding when `accumulate`).
void copy_positions(const Tensor& src, std::int64_t from, Tensor& dst, std::int64_t to, std::int64_t n,
                    bool accumulate) {
  if (n <= 0) return;
  const std::int64_t B = src.dim(0), C = src.dim(2);
  if (!accumulate) {
    const std::size_t es = dtype_size(src.dtype()), bytes = static_cast<std::size_t>(n * C) * es;
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<std::byte*>(dst.raw()) + ((b * dst.dim(1) + to) * C) * es,
                  static_cast<const std::byte*>(src.raw()) + ((b * src.dim(1) + from) * C) * es, bytes);
    return;
  }
  Tensor part = narrow(src, 1, from, n);
  Tensor cur = narrow(dst, 1, to, n);
  add_inplace(cur, part);
  copy_positions(cur, 0, dst, to, n, false);
}

// Elements to move on hop k (rank r-k -> r): the tail of r-k's shard that lies
// inside r's history window. The same on every rank.
std::int64_t hop_count(std::int64_t L, int width, int k) {
  return std::clamp<std::int64_t>((width - 1) - (k - 1) * L, 0, L);
}

// Splits a [c*B, T, C] staging buffer into c per-rank [B, T, C] blocks and back.
std::vector<Tensor> split_ranks(const Tensor& staged, int c) {
  std::vector<Tensor> parts;
  const std::int64_t rows = staged.dim(0) / c;
  for (int q = 0; q < c; ++q) parts.push_back(narrow(staged, 0, q * rows, rows));
  return parts;
}

Tensor history_all_gather(const Tensor& x, Communicator& comm, int width) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1, T = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  Tensor tail = narrow(x, 1, L - T, T);
  Tensor staged({c * B, T, C}, x.dtype());
  comm.all_gather(tail.raw(), staged.raw(), static_cast<std::size_t>(tail.numel()), x.dtype());
  const std::vector<Tensor> tails = split_ranks(staged, c);
  Tensor out({B, L + H, C}, x.dtype());
  for (std::int64_t i = 0; i < H; ++i) {
    const std::int64_t p = r * L - H + i;  // global position of history slot i
    if (p < 0) continue;
    const int q = static_cast<int>(p / L);
    copy_positions(tails[q], p - (q * L + L - T), out, i, 1, false);
  }
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_all_gather_backward(const Tensor& g, Communicator& comm, int width) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H, T = std::min(L, H);
  const int c = comm.size(), r = comm.rank();
  // Each rank scatters its history gradient into per-owner tail slots; the
  // reduce-scatter sums the slots in rank order and hands each owner its own.
  std::vector<Tensor> slots;
  for (int q = 0; q < c; ++q) slots.emplace_back(Shape{B, T, C}, g.dtype());
  for (std::int64_t i = 0; i < H; ++i) {
    const std::int64_t p = r * L - H + i;
    if (p < 0) continue;
    const int q = static_cast<int>(p / L);
    copy_positions(g, i, slots[q], p - (q * L + L - T), 1, false);
  }
  Tensor staged = cat(slots, 0);
  Tensor mine({B, T, C}, g.dtype());
  comm.reduce_scatter(staged.raw(), mine.raw(), static_cast<std::size_t>(mine.numel()), g.dtype());
  Tensor dx = narrow(g, 1, H, L);
  copy_positions(mine, 0, dx, L - T, T, true);
  return dx;
}

Tensor history_send_recv(const Tensor& x, Communicator& comm, int width) {
  const std::int64_t B = x.dim(0), L = x.dim(1), C = x.dim(2), H = width - 1;
  const int c = comm.size(), r = comm.rank();
  Tensor out({B, L + H, C}, x.dtype());
  for (int k = 1; hop_count(L, width, k) > 0 && k < c; ++k) {
    const std::int64_t n = hop_count(L, width, k);
    Tensor send = narrow(x, 1, L - n, n), recv({B, n, C}, x.dtype());
    const int dst = r + k < c ? r + k : -1, src = r - k >= 0 ? r - k : -1;
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), dst, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), src},
                   x.dtype());
    // Rank r-k's last n positions sit at global (r-k+1)L - n ... in r's window.
    if (src >= 0) copy_positions(recv, 0, out, (r - k + 1) * L - n - (r * L - H), n, false);
  }
  copy_positions(x, 0, out, H, L, false);
  return out;
}

Tensor history_send_recv_backward(const Tensor& g, Communicator& comm, int width) {
  const std::int64_t B = g.dim(0), C = g.dim(2), H = width - 1, L = g.dim(1) - H;
  const int c = comm.size(), r = comm.rank();
  Tensor dx = narrow(g, 1, H, L);
  for (int k = 1; hop_count(L, width, k) > 0 && k < c; ++k) {
    const std::int64_t n = hop_count(L, width, k);
    Tensor send({B, n, C}, g.dtype()), recv({B, n, C}, g.dtype());
    const int dst = r - k >= 0 ? r - k : -1, src = r + k < c ? r + k : -1;
    if (dst >= 0) copy_positions(g, (r - k + 1) * L - n - (r * L - H), send, 0, n, false);
    comm.send_recv({send.raw(), static_cast<std::size_t>(send.numel()), dst, recv.raw(),
                    static_cast<std::size_t>(recv.numel()), src},
                   g.dtype());
    if (src >= 0) copy_positions(recv, 0, dx, L - n, n, true);
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
    Tensor out({x.dim(0), L + H, x.dim(2)}, x.dtype());
    copy_positions(x, 0, out, H, L, false);
    return record(out, "convolution_history", {x_masked},
                  [H, L](const Tensor& g) { return std::vector<Tensor>{narrow(g, 1, H, L)}; });
  }
  const bool gather = exchange == HaloExchange::all_gather;
  Tensor out = gather ? history_all_gather(x, *comm, width) : history_send_recv(x, *comm, width);
  return record(out, "convolution_history", {x_masked}, [comm, width, gather](const Tensor& g) {
    return std::vector<Tensor>{gather ? history_all_gather_backward(g, *comm, width)
                                      : history_send_recv_backward(g, *comm, width)};
  });
}

}  // namespace cpsim
