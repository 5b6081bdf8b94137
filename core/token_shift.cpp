#include "core/token_shift.hpp"

#include <cstring>

#include "core/conv.hpp"

namespace cpsim {

namespace {

// For each batch row b and position t < L with keep[b * L + t]: row t of `to`'s
// batch row b (`to_rows` rows a batch row) from row t of `from`'s (`from_rows`).
// Rows are equal in size: the trailing dimensions. Every other row stays +0.
void copy_kept(const Tensor& from, std::int64_t from_rows, Tensor& to, std::int64_t to_rows,
               const std::vector<char>& keep, std::int64_t B, std::int64_t L) {
  if (B * L == 0) return;
  const std::size_t row = from.nbytes() / static_cast<std::size_t>(B * from_rows);
  const auto* src = static_cast<const char*>(from.raw());
  auto* dst = static_cast<char*>(to.raw());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < L; ++t)
      if (keep[b * L + t]) std::memcpy(dst + (b * to_rows + t) * row, src + (b * from_rows + t) * row, row);
}

}  // namespace

Var token_shift(const Var& x_masked, const PackedContext& context, Communicator* comm, HaloExchange exchange) {
  // Window slot t is global position start - 1 + t: y's position t reads slot t.
  const Var window = convolution_history(x_masked, comm, 2, exchange, &context.plan());  // [B, L+1, ...]
  const Tensor ids = window_doc_ids(context.doc_ids(), context.seq_start(), context.local_seq_len(), 2);
  const Device device = window.value().device();
  const Tensor w = device.is_cpu() ? window.value() : window.value().to(Device::host());
  const Shape window_shape = w.shape();
  const std::int64_t B = window_shape[0], L = window_shape[1] - 1;
  std::vector<char> keep(static_cast<std::size_t>(B * L));  // slot t and position t in one document
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < L; ++t) keep[b * L + t] = ids.get_int(b * (L + 1) + t) == ids.get_int(b * (L + 1) + t + 1);
  Shape shape = window_shape;
  shape[1] = L;
  Tensor y(shape, w.dtype());
  copy_kept(w, L + 1, y, L, keep, B, L);
  return record(device.is_cpu() ? y : y.to(device), "token_shift", {window},
                [keep, B, L, window_shape, device](const Tensor& dy) {
                  const Tensor g = device.is_cpu() ? dy : dy.to(Device::host());
                  Tensor dw(window_shape, g.dtype());  // the window's last slot feeds no output: +0
                  copy_kept(g, L, dw, L + 1, keep, B, L);
                  return std::vector<Tensor>{device.is_cpu() ? dw : dw.to(device)};
                });
}

}  // namespace cpsim
