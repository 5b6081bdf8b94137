// RapidCheck inside GoogleTest with cpsim's defaults: 200 cases per property
// unless RC_PARAMS sets max_success (RC_PARAMS="seed=..." reproduces a failure).
// expect_counterexample() runs a property that must fail (a negative control)
// and returns RapidCheck's report with the shrunk counterexample. Both go through
// verify/property_runner.hpp, cpsim's one adapter to RapidCheck's runner.
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <concepts>
#include <string>

#include "verify/generators.hpp"
#include "verify/property_runner.hpp"

namespace cpsim::testing {

// A property over one drawn argument of type Arg (rc::gen::arbitrary<Arg>()).
template <class Arg, class F>
std::function<void()> over(F&& f) {
  return [f = std::forward<F>(f)] { f(*rc::gen::arbitrary<Arg>()); };
}

inline void check_property(const std::function<void()>& property) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto settings = verify::PropertySettings::from_environment(
      std::string(info->test_suite_name()) + "/" + info->name(), 200);
  const auto outcome = verify::run_property(settings, property);
  if (!outcome.ok) FAIL() << outcome.report;
}

// Runs a property that must find a counterexample; returns the failure report
// ("" if it passed every case, which the caller reports as a test failure).
inline std::string expect_counterexample(const std::string& name, const std::function<void()>& property,
                                         int max_success = 300) {
  auto settings = verify::PropertySettings::from_environment(name, max_success);
  settings.cases = max_success;
  return verify::run_property(settings, property).report;
}

// The same for a property over one drawn layout case.
template <class F>
  requires std::invocable<F, const verify::LayoutCase&>
std::string expect_counterexample(const std::string& name, F&& f, int max_success = 300) {
  return expect_counterexample(name, over<verify::LayoutCase>(std::forward<F>(f)), max_success);
}

}  // namespace cpsim::testing

// A RapidCheck property as a GoogleTest test, with cpsim's defaults. The body sees `c`.
#define CPSIM_PROP(Suite, Name, ArgList)                                                                     \
  void cpsim_prop_##Suite##_##Name ArgList;                                                                  \
  TEST(Suite, Name) {                                                                                        \
    ::cpsim::testing::check_property(                                                                        \
        ::cpsim::testing::over<::cpsim::verify::LayoutCase>(&cpsim_prop_##Suite##_##Name));                  \
  }                                                                                                          \
  void cpsim_prop_##Suite##_##Name ArgList

// A property over layouts run on every registered backend: a test of the
// value-parameterised suite `Suite` (a ::testing::TestWithParam<std::string>
// whose parameter is the backend name). The body sees `backend` and `c`.
#define CPSIM_BACKEND_PROP(Suite, Name)                                                                      \
  void cpsim_prop_##Suite##_##Name(const std::string& backend, const ::cpsim::verify::LayoutCase& c);        \
  TEST_P(Suite, Name) {                                                                                      \
    const std::string backend = GetParam();                                                                  \
    ::cpsim::testing::check_property(::cpsim::testing::over<::cpsim::verify::LayoutCase>(                    \
        [backend](const ::cpsim::verify::LayoutCase& c) { cpsim_prop_##Suite##_##Name(backend, c); }));      \
  }                                                                                                          \
  void cpsim_prop_##Suite##_##Name(const std::string& backend, const ::cpsim::verify::LayoutCase& c)
