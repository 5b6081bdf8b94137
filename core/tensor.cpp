#include "core/tensor.hpp"

#include <algorithm>

#include "core/kernels/table.hpp"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace cpsim {

std::size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::b8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::b8: return "bool";
  }
  return "?";
}

bool is_floating(DType dt) { return dt == DType::f32 || dt == DType::f64 || dt == DType::bf16; }

bf16 bf16::from_float(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  bf16 out;
  if (std::isnan(f)) {
    out.bits = static_cast<std::uint16_t>((u >> 16) | 0x40);
    return out;
  }
  std::uint32_t rounding = 0x7FFF + ((u >> 16) & 1);
  out.bits = static_cast<std::uint16_t>((u + rounding) >> 16);
  return out;
}

float bf16::to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

std::int64_t shape_numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Storage::Storage(std::size_t bytes, Device device, bool zeroed)
    : data_(static_cast<std::byte*>(device.is_cpu() ? host_allocate(bytes, zeroed, &resident_)
                                                    : device_runtime(device.kind).allocate(device, bytes))),
      nbytes_(bytes),
      device_(device) {
  if (zeroed && !device.is_cpu()) device_runtime(device.kind).zero(device, data_, bytes);  // the host's comes zeroed
}

Storage::~Storage() {
  if (device_.is_cpu()) host_deallocate(data_, nbytes_, resident_);
  else device_runtime(device_.kind).deallocate(device_, data_, nbytes_);
}

Tensor::Tensor(Shape shape, DType dtype, Device device, bool zeroed) : shape_(std::move(shape)), dtype_(dtype) {
  for (auto d : shape_) CPSIM_ENFORCE(d >= 0, "negative dimension in ", shape_str(shape_));
  numel_ = shape_numel(shape_);
  storage_ = std::make_shared<Storage>(nbytes(), device, zeroed);
}

Tensor::Tensor(Shape shape, DType dtype, Device device) : Tensor(std::move(shape), dtype, device, true) {}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) { return Tensor(std::move(shape), dtype, device, false); }

Tensor Tensor::full(Shape shape, DType dtype, double value) {
  if (value == 0 && !std::signbit(value)) return Tensor(std::move(shape), dtype);  // comes zeroed
  Tensor t = empty(std::move(shape), dtype);
  visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    std::fill_n(static_cast<T*>(t.raw()), t.numel(), from_f64<T>(value));
  });
  return t;
}

std::int64_t Tensor::dim(int i) const {
  CPSIM_ENFORCE(i >= 0 && i < ndim(), "dimension ", i, " of a ", ndim(), "-d tensor");
  return shape_[i];
}

void Tensor::check_host() const {
  CPSIM_ENFORCE(is_cpu(), "element access to a tensor on ", device().str(), " (copy it with to(Device::host()))");
}

void Tensor::check_type(DType want) const {
  check_host();
  CPSIM_ENFORCE(want == dtype_, "tensor is ", dtype_name(dtype_), ", accessed as ", dtype_name(want));
}

void Tensor::index_error(std::int64_t flat) const {
  check_host();
  CPSIM_ENFORCE(storage_, "element ", flat, " of an undefined tensor");
  CPSIM_ENFORCE(false, "element ", flat, " of a tensor of shape ", shape_str(shape_));
  std::abort();  // not reached
}

Tensor Tensor::clone() const { return defined() ? to(device()) : Tensor(); }

Tensor Tensor::to(Device device) const {
  if (!defined()) return {};
  Tensor t = empty(shape_, dtype_, device);  // written in full below
  copy_bytes(t.raw(), device, raw(), this->device(), nbytes());
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  CPSIM_ENFORCE(shape_numel(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ",
                shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  t.numel_ = shape_numel(t.shape_);
  return t;
}

Tensor Tensor::contiguous_slice(int dim, std::int64_t start, std::int64_t len) const {
  CPSIM_ENFORCE(dim >= 0 && dim < ndim() && start >= 0 && len >= 0 && start + len <= shape_[dim], "slice [", start,
                ", ", start + len, ") of dimension ", dim, " of ", shape_str(shape_));
  for (int d = 0; d < dim; ++d)
    CPSIM_ENFORCE(shape_[d] == 1, "a shared slice of dimension ", dim, " of ", shape_str(shape_),
                  " is not contiguous");
  std::int64_t inner = 1;
  for (int d = dim + 1; d < ndim(); ++d) inner *= shape_[d];
  Tensor t = *this;
  t.shape_[dim] = len;
  t.numel_ = shape_numel(t.shape_);
  t.offset_ += static_cast<std::size_t>(start * inner) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  if (!is_cpu()) return to(Device::host()).to(dtype).to(device());  // conversions run on the host
  Tensor t(shape_, dtype);
  for (std::int64_t i = 0; i < numel(); ++i) t.set(i, get(i));
  return t;
}

bool Tensor::bitwise_equal(const Tensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  if (!is_cpu() || !other.is_cpu()) return to(Device::host()).bitwise_equal(other.to(Device::host()));
  return nbytes() == 0 || std::memcmp(raw(), other.raw(), nbytes()) == 0;
}

namespace {
// Splits a shape around `dim` into (outer, extent, inner) element counts.
void split_at(const Shape& s, int dim, std::int64_t& outer, std::int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < dim; ++i) outer *= s[i];
  for (int i = dim + 1; i < static_cast<int>(s.size()); ++i) inner *= s[i];
}
}  // namespace

Tensor narrow(const Tensor& t, int dim, std::int64_t start, std::int64_t len) {
  CPSIM_ENFORCE(start >= 0 && len >= 0 && start + len <= t.dim(dim), "narrow [", start, ", ",
                start + len, ") out of ", t.dim(dim));
  Shape s = t.shape();
  s[dim] = len;
  Tensor out(s, t.dtype(), t.device());
  std::int64_t outer, inner;
  split_at(t.shape(), dim, outer, inner);
  const std::size_t es = dtype_size(t.dtype());
  const auto* src = static_cast<const std::byte*>(t.raw());
  auto* dst = static_cast<std::byte*>(out.raw());
  const std::size_t chunk = static_cast<std::size_t>(len * inner) * es;
  for (std::int64_t o = 0; o < outer; ++o)
    if (chunk) copy_bytes(dst + o * chunk, t.device(), src + ((o * t.dim(dim) + start) * inner) * es, t.device(), chunk);
  return out;
}

Tensor cat(const std::vector<Tensor>& parts, int dim) {
  CPSIM_ENFORCE(!parts.empty(), "cat of nothing");
  for (const auto& p : parts) CPSIM_ENFORCE(p.defined(), "cat of an undefined tensor");
  Shape s = parts[0].shape();
  std::int64_t total = 0;
  for (const auto& p : parts) {
    Shape ps = p.shape();
    CPSIM_ENFORCE(p.dtype() == parts[0].dtype() && ps.size() == s.size() && p.device() == parts[0].device(),
                  "cat of unlike tensors");
    ps[dim] = s[dim];
    CPSIM_ENFORCE(ps == s, "cat shapes disagree: ", shape_str(p.shape()), " vs ", shape_str(s));
    total += p.dim(dim);
  }
  s[dim] = total;
  const Device device = parts[0].device();
  Tensor out(s, parts[0].dtype(), device);
  std::int64_t outer, inner;
  split_at(s, dim, outer, inner);
  const std::size_t es = dtype_size(out.dtype());
  auto* dst = static_cast<std::byte*>(out.raw());
  std::int64_t offset = 0;
  for (const auto& p : parts) {
    const std::size_t chunk = static_cast<std::size_t>(p.dim(dim) * inner) * es;
    const auto* src = static_cast<const std::byte*>(p.raw());
    for (std::int64_t o = 0; o < outer; ++o)
      if (chunk) copy_bytes(dst + ((o * total + offset) * inner) * es, device, src + o * chunk, device, chunk);
    offset += p.dim(dim);
  }
  return out;
}

Tensor pad_sequence_dim(const Tensor& t, std::int64_t length, double fill) {
  CPSIM_ENFORCE(t.ndim() >= 2 && t.dim(1) <= length, "cannot pad ", shape_str(t.shape()), " to ",
                length);
  if (t.dim(1) == length) return t.clone();
  Shape s = t.shape();
  s[1] = length - t.dim(1);
  return cat({t, Tensor::full(s, t.dtype(), fill)}, 1);
}

void add_inplace(Tensor& t, const Tensor& other) {
  CPSIM_ENFORCE(t.shape() == other.shape() && t.dtype() == other.dtype(), "add of ",
                shape_str(t.shape()), " and ", shape_str(other.shape()));
  CPSIM_ENFORCE(t.device() == other.device(), "add of tensors on ", t.device().str(), " and ", other.device().str());
  if (t.numel() == 0) return;
  // One position of every element: the kernels' elementwise add (bf16 rounded, bool or).
  kernels::PositionCopy a;
  a.src = other.raw();
  a.dst = t.raw();
  a.rows = a.src_len = a.dst_len = a.n = 1;
  a.position_bytes = t.nbytes();
  kernels::kernels_for(t.device()).add_positions(a, t.dtype(), kernels::current_stream());
}

namespace {
// Calls f(words, n, negative zero's bits) with t's elements as unsigned words.
template <class F>
void negative_zero_words(const Tensor& t, F&& f) {
  const void* raw = t.raw();
  const auto n = t.numel();
  switch (dtype_size(t.dtype())) {
    case 8: return f(static_cast<const std::uint64_t*>(raw), n, std::uint64_t{1} << 63);
    case 4: return f(static_cast<const std::uint32_t*>(raw), n, std::uint32_t{1} << 31);
    case 2: return f(static_cast<const std::uint16_t*>(raw), n, std::uint16_t{1 << 15});
    default: CPSIM_ENFORCE(false, "negative zeros of ", dtype_name(t.dtype()));
  }
}
}  // namespace

bool has_negative_zero(const Tensor& t) {
  if (t.numel() == 0 || !is_floating(t.dtype())) return false;
  if (!t.device().is_cpu()) return true;
  bool found = false;
  negative_zero_words(t, [&](const auto* w, std::int64_t n, auto sign) {
    for (std::int64_t at = 0; at < n && !found; at += 4096) {  // blocks the compiler vectorises
      const std::int64_t end = std::min(n, at + 4096);
      bool any = false;
      for (std::int64_t i = at; i < end; ++i) any |= w[i] == sign;
      found = any;
    }
  });
  return found;
}

void add_zero_inplace(Tensor& t) {
  if (t.numel() == 0 || !is_floating(t.dtype())) return;
  if (!t.device().is_cpu()) {
    add_inplace(t, Tensor(t.shape(), t.dtype(), t.device()));
    return;
  }
  // -0 + +0 is +0 (round to nearest); x + 0 is x for every other x, NaN included.
  negative_zero_words(t, [&](const auto* w, std::int64_t n, auto sign) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    W* out = static_cast<W*>(t.raw());
    for (std::int64_t i = 0; i < n; ++i)
      if (w[i] == sign) out[i] = 0;  // stores only there
  });
}

}  // namespace cpsim
