// torch's reduce ops as the torch backend runs them: one table, a row each
// (torch's name, the dtypes it takes, how one rank's part joins the others').
#pragma once
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>

namespace cpsim::torch_backend {

struct Reduction {
  c10d::ReduceOp::RedOpType op;
  const char* name;  // torch's ("SUM", "MAX")
  enum class Takes { any, floating, integral } takes;  // floating: float and complex; integral: integer and bool
  // acc = acc (op) x, elementwise; null for an op torch names that cpsim does not run.
  void (*join)(at::Tensor& acc, const at::Tensor& x);
  bool average = false;  // divided by the group's size once joined (AVG)
};

// op's row of the table (nullptr for none).
const Reduction* reduction_of(const c10d::ReduceOp& op);
// torch's name of a reduction ("SUM", "MAX"; "UNUSED" for none).
std::string reduce_name(const c10d::ReduceOp& op);

}  // namespace cpsim::torch_backend
