#include "core/tensor_wire.hpp"

namespace cpsim {

void write_tensors(WireWriter out, const std::vector<Tensor>& tensors) {
  out.put<std::uint32_t>(static_cast<std::uint32_t>(tensors.size()));
  for (const Tensor& t : tensors) {
    out.put<std::uint8_t>(t.defined());
    if (!t.defined()) continue;
    out.put<std::uint8_t>(static_cast<std::uint8_t>(t.dtype()));
    out.put<std::uint32_t>(static_cast<std::uint32_t>(t.ndim()));
    for (std::int64_t d : t.shape()) out.put<std::int64_t>(d);
    const Tensor c = t.clone();  // contiguous bytes of exactly this view
    out.put_bytes(c.raw(), c.nbytes());
  }
}

std::vector<Tensor> read_tensors(WireReader& in) {
  std::vector<Tensor> out(in.get<std::uint32_t>());
  for (Tensor& t : out) {
    if (!in.get<std::uint8_t>()) continue;
    const auto dtype = static_cast<DType>(in.get<std::uint8_t>());
    Shape shape(in.get<std::uint32_t>());
    for (auto& d : shape) d = in.get<std::int64_t>();
    t = Tensor(shape, dtype);
    if (t.nbytes()) std::memcpy(t.raw(), in.bytes(t.nbytes()), t.nbytes());
  }
  return out;
}

}  // namespace cpsim
