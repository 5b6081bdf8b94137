// Tensors as bytes, for the processes of a job: a run's outputs travel between
// processes in this format (sim/job/). Little more than dtype, shape and the
// contiguous bytes of each tensor; undefined tensors are kept as such.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor.hpp"

namespace cpsim {

// Appends plain values to a byte buffer.
struct WireWriter {
  std::vector<std::uint8_t>& out;
  template <class T>
  void put(T v) {
    const std::size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
  }
  void put_bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    out.insert(out.end(), p, p + n);
  }
};

// Reads them back; a message shorter than its contents is an internal error.
struct WireReader {
  const std::uint8_t* p;
  const std::uint8_t* end;
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, bytes(sizeof(T)), sizeof(T));
    return v;
  }
  const std::uint8_t* bytes(std::size_t n) {
    CPSIM_ENFORCE(static_cast<std::size_t>(end - p) >= n, "truncated message between processes");
    const std::uint8_t* at = p;
    p += n;
    return at;
  }
};

// Bytes of a list of tensors (undefined ones included), appended to `out`; and back.
void write_tensors(WireWriter out, const std::vector<Tensor>& tensors);
std::vector<Tensor> read_tensors(WireReader& in);

}  // namespace cpsim
