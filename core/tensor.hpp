// A minimal tensor: contiguous row-major storage on one device (cpu, cuda:N), a
// shape and a dtype. It is the value type of the autograd tape and of every CP
// operator; backends see only its raw bytes. Copies share storage (like
// torch.Tensor); clone() copies on the same device, to(Device) across devices.
// Element access (data<T>, get, set) is for host tensors only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/device.hpp"
#include "core/error.hpp"

namespace cpsim {

enum class DType : std::uint8_t { f32, f64, bf16, i32, i64, b8 };

std::size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
bool is_floating(DType dt);

// bfloat16 stored as its upper 16 bits of an IEEE float; rounds to nearest even.
struct bf16 {
  std::uint16_t bits = 0;
  static bf16 from_float(float f);
  float to_float() const;
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };

// Calls f(T{}) with the C++ type of dt.
template <class F>
decltype(auto) visit_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16{});
    case DType::i32: return f(std::int32_t{});
    case DType::i64: return f(std::int64_t{});
    case DType::b8: return f(bool{});
  }
  throw Error("unknown dtype");
}

inline double to_f64(float v) { return v; }
inline double to_f64(double v) { return v; }
inline double to_f64(bf16 v) { return v.to_float(); }
inline double to_f64(std::int32_t v) { return static_cast<double>(v); }
inline double to_f64(std::int64_t v) { return static_cast<double>(v); }
inline double to_f64(bool v) { return v ? 1.0 : 0.0; }

template <class T> T from_f64(double v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16::from_float(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else return static_cast<T>(v);
}

using Shape = std::vector<std::int64_t>;
std::string shape_str(const Shape& s);
std::int64_t shape_numel(const Shape& s);

// The bytes of a tensor, owned, on one device.
class Storage {
 public:
  Storage(std::size_t bytes, Device device, bool zeroed = true);  // zero-filled, unless not `zeroed`
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  std::byte* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  // On the host: whether every page is resident (host_allocate), so that a cache
  // may keep the block. Declared first: data_'s allocation sets it.
  bool resident_ = false;
  std::byte* data_;
  std::size_t nbytes_;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(Shape shape, DType dtype, Device device = Device::host());  // zero-filled
  // Uninitialised: for a result the next kernel or collective writes in full.
  static Tensor empty(Shape shape, DType dtype, Device device = Device::host());

  template <class T>
  static Tensor from(Shape shape, const std::vector<T>& values) {
    Tensor t(std::move(shape), dtype_of<T>::value);
    CPSIM_ENFORCE(static_cast<std::int64_t>(values.size()) == t.numel(), "value count ",
                  values.size(), " does not fill shape ", shape_str(t.shape()));
    T* d = t.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) d[i] = values[i];
    return t;
  }
  static Tensor full(Shape shape, DType dtype, double value);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const { return numel_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::host(); }
  bool is_cpu() const { return device().is_cpu(); }

  template <class T> T* data() {
    check_type(dtype_of<T>::value);
    return reinterpret_cast<T*>(raw());
  }
  template <class T> const T* data() const {
    check_type(dtype_of<T>::value);
    return reinterpret_cast<const T*>(raw());
  }
  void* raw() { return storage_ ? storage_->data() + offset_ : nullptr; }
  const void* raw() const { return storage_ ? storage_->data() + offset_ : nullptr; }

  // Element access through double / int64, for any dtype, bounds-checked (tests,
  // references and I/O; the checks stay, inline).
  double get(std::int64_t flat) const {
    check_index(flat);
    return visit_dtype(dtype_, [&](auto tag) {
      using T = decltype(tag);
      return to_f64(reinterpret_cast<const T*>(raw())[flat]);
    });
  }
  void set(std::int64_t flat, double v) {
    check_index(flat);
    visit_dtype(dtype_, [&](auto tag) {
      using T = decltype(tag);
      reinterpret_cast<T*>(raw())[flat] = from_f64<T>(v);
    });
  }
  std::int64_t get_int(std::int64_t flat) const {
    check_index(flat);
    switch (dtype_) {
      case DType::i64: return reinterpret_cast<const std::int64_t*>(raw())[flat];
      case DType::i32: return reinterpret_cast<const std::int32_t*>(raw())[flat];
      case DType::b8: return reinterpret_cast<const bool*>(raw())[flat] ? 1 : 0;
      default: return static_cast<std::int64_t>(get(flat));
    }
  }

  Tensor clone() const;                // same device
  Tensor to(Device device) const;      // a copy on `device` (shares nothing)
  Tensor reshape(Shape shape) const;   // shares storage
  // Slice [start, start+len) of dimension `dim`, sharing storage: every dimension
  // before `dim` must be 1 (the slice is one contiguous run). For reading; narrow
  // copies any slice.
  Tensor contiguous_slice(int dim, std::int64_t start, std::int64_t len) const;
  Tensor to(DType dtype) const;        // converting copy (host)
  bool bitwise_equal(const Tensor& other) const;
  bool same_storage(const Tensor& other) const { return storage_ == other.storage_ && offset_ == other.offset_; }
  // No other tensor (view, copy, capture) holds this one's storage: it may be
  // written without anyone else seeing it.
  bool sole_owner() const { return storage_ && storage_.use_count() == 1; }

 private:
  void check_type(DType want) const;
  void check_index(std::int64_t flat) const {
    if (!storage_ || !storage_->device().is_cpu() || flat < 0 || flat >= numel_) [[unlikely]]
      index_error(flat);
  }
  [[noreturn]] void index_error(std::int64_t flat) const;
  Tensor(Shape shape, DType dtype, Device device, bool zeroed);
  void check_host() const;
  Shape shape_;
  std::int64_t numel_ = 1;  // shape_numel(shape_), kept with it
  DType dtype_ = DType::f32;
  std::shared_ptr<Storage> storage_;
  std::size_t offset_ = 0;
};

// Copying slice [start, start+len) of dimension `dim`.
Tensor narrow(const Tensor& t, int dim, std::int64_t start, std::int64_t len);
// Concatenation along `dim`; all other dimensions must agree.
Tensor cat(const std::vector<Tensor>& parts, int dim);
// Extends dimension 1 to `length` with `fill` (SPEC §2 padding of the sequence dim).
Tensor pad_sequence_dim(const Tensor& t, std::int64_t length, double fill);
// t += other, elementwise, for floating dtypes (bf16 through float).
void add_inplace(Tensor& t, const Tensor& other);
// t += 0, exactly: negative zeros become positive zeros, nothing else changes. On
// the host it writes only where it finds a negative zero (a sparse tensor's
// untouched pages are only read).
void add_zero_inplace(Tensor& t);
// Whether add_zero_inplace would change t (a floating tensor holding a negative
// zero; true for any floating tensor off the host).
bool has_negative_zero(const Tensor& t);

}  // namespace cpsim
