// Small helpers the unit tests share: int64 tensors from literals and back, and
// the message of what a call that must fail threw.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace cpsim::testing {

inline Tensor i64(Shape s, std::vector<std::int64_t> v) { return Tensor::from<std::int64_t>(std::move(s), v); }

inline std::vector<std::int64_t> values(const Tensor& t) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < t.numel(); ++i) v.push_back(t.get_int(i));
  return v;
}

// What f threw: an E's message; a failure of the test, and "", when it threw none.
template <class E, class F>
std::string thrown(F&& f, const char* expected) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no " << expected << " thrown";
  return "";
}

}  // namespace cpsim::testing
