// What the torch backend says of a tensor and how it moves one: torch's names
// (dtype; a reduction's: reductions.hpp), the checks every call makes, a tensor as bytes and as the
// comm layer's Payload.
#pragma once
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/comm/point_to_point.hpp"

namespace cpsim::torch_backend {

// torch's Python name of the dtype ("float16", "int32").
std::string dtype_text(const at::Tensor& t);
// "float16 x 8": what every rank's tensor must agree on.
std::string shape_text(const at::Tensor& t);

// Unsupported unless a dense host tensor.
void expect_cpu(const at::Tensor& t, const char* op);
// Unsupported unless one tensor per rank.
void expect_one(std::size_t n, const char* op);

// The bytes of a tensor (a contiguous copy when it is not contiguous).
at::Tensor as_bytes(const at::Tensor& t);
// Copies flat bytes into a tensor of any layout.
void write_bytes(at::Tensor& out, const at::Tensor& bytes);

// A tensor as point to point carries it: its bytes, dtype name and count.
Payload payload_of(const at::Tensor& t);
// Where a matching message's bytes go: the receive's tensor, of any layout.
std::function<void(const std::vector<std::uint8_t>&)> writer_of(at::Tensor t);

}  // namespace cpsim::torch_backend
