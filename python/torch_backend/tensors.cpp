#include "python/torch_backend/tensors.hpp"

#include <cctype>
#include <cstring>

#include "core/error.hpp"

namespace cpsim::torch_backend {

std::string dtype_text(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: break;
  }
  std::string s = c10::toString(t.scalar_type());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string shape_text(const at::Tensor& t) { return dtype_text(t) + " x " + std::to_string(t.numel()); }

void expect_cpu(const at::Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    throw Unsupported(std::string("cpsim does not support ") + op + " of " + t.device().str() +
                      " tensors (this build's ranks keep host tensors)");
  if (t.is_sparse()) throw Unsupported(std::string("cpsim does not support ") + op + " of sparse tensors");
}

void expect_one(std::size_t n, const char* op) {
  if (n != 1)
    throw Unsupported(std::string("cpsim does not support ") + op + " of " + std::to_string(n) +
                      " tensors per rank (one device per rank)");
}

at::Tensor as_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (c.numel() == 0) return at::empty({0}, at::kByte);
  return c.view({-1}).view(at::kByte);
}

void write_bytes(at::Tensor& out, const at::Tensor& bytes) {
  if (out.numel() == 0) return;
  at::Tensor typed = bytes.view(out.scalar_type()).view(out.sizes());
  out.copy_(typed);
}

Payload payload_of(const at::Tensor& t) {
  const at::Tensor bytes = as_bytes(t);
  Payload p{std::vector<std::uint8_t>(static_cast<std::size_t>(bytes.numel())), dtype_text(t), t.numel()};
  if (bytes.numel()) std::memcpy(p.bytes.data(), bytes.data_ptr(), p.bytes.size());
  return p;
}

std::function<void(const std::vector<std::uint8_t>&)> writer_of(at::Tensor t) {
  return [t](const std::vector<std::uint8_t>& bytes) mutable {
    if (bytes.empty()) return;
    at::Tensor view =
        at::from_blob(const_cast<std::uint8_t*>(bytes.data()), {static_cast<std::int64_t>(bytes.size())}, at::kByte);
    write_bytes(t, view);
  };
}

}  // namespace cpsim::torch_backend
