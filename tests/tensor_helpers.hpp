// Small helpers the unit tests share: int64 tensors from literals and back.
#pragma once

#include <vector>

#include "core/tensor.hpp"

namespace cpsim::testing {

inline Tensor i64(Shape s, std::vector<std::int64_t> v) { return Tensor::from<std::int64_t>(std::move(s), v); }

inline std::vector<std::int64_t> values(const Tensor& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t.get_int(i));
  return v;
}

}  // namespace cpsim::testing
