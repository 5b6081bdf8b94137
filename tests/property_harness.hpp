// RapidCheck inside GoogleTest with cpsim's defaults: 200 cases per property
// unless RC_PARAMS sets max_success (RC_PARAMS="seed=..." reproduces a failure).
// expect_counterexample() runs a property that must fail (a negative control)
// and returns RapidCheck's report with the shrunk counterexample.
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <cstdlib>
#include <sstream>
#include <string>

namespace cpsim::testing {

inline rc::detail::TestParams property_params() {
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  const char* env = std::getenv("RC_PARAMS");
  if (env == nullptr || std::string(env).find("max_success") == std::string::npos) params.maxSuccess = 200;
  return params;
}

template <class Testable>
void check_property(Testable&& testable) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata metadata;
  metadata.id = std::string(info->test_suite_name()) + "/" + info->name();
  metadata.description = info->name();
  const auto result = rc::detail::checkTestable(std::forward<Testable>(testable), metadata, property_params());
  if (!result.template is<rc::detail::SuccessResult>()) {
    std::ostringstream ss;
    rc::detail::printResultMessage(result, ss);
    FAIL() << ss.str();
  }
}

// Runs a property that must find a counterexample; returns the failure report
// ("" if it passed every case, which the caller reports as a test failure).
template <class Testable>
std::string expect_counterexample(const std::string& name, Testable&& testable, int max_success = 300) {
  rc::detail::TestMetadata metadata;
  metadata.id = name;
  metadata.description = name;
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  params.maxSuccess = max_success;
  // A silent listener: an expected failure is not a reproduction hint for the user.
  struct Silent : rc::detail::TestListener {
    void onTestCaseFinished(const rc::detail::CaseDescription&) override {}
    void onShrinkTried(const rc::detail::CaseDescription&, bool) override {}
    void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {}
  } silent;
  const auto result =
      rc::detail::checkProperty(rc::detail::toProperty(std::forward<Testable>(testable)), metadata, params, silent);
  if (result.template is<rc::detail::SuccessResult>()) return "";
  std::ostringstream ss;
  rc::detail::printResultMessage(result, ss);
  return ss.str();
}

}  // namespace cpsim::testing

// A RapidCheck property as a GoogleTest test, with property_params().
#define CPSIM_PROP(Suite, Name, ArgList)                                        \
  void cpsim_prop_##Suite##_##Name ArgList;                                     \
  TEST(Suite, Name) { ::cpsim::testing::check_property(&cpsim_prop_##Suite##_##Name); } \
  void cpsim_prop_##Suite##_##Name ArgList

// A property over layouts run on every simulated backend: a test of the
// value-parameterised suite `Suite` (a ::testing::TestWithParam<std::string>
// whose parameter is the backend name). The body sees `backend` and `c`.
#define CPSIM_BACKEND_PROP(Suite, Name)                                                       \
  void cpsim_prop_##Suite##_##Name(const std::string& backend, const ::cpsim::verify::LayoutCase& c); \
  TEST_P(Suite, Name) {                                                                       \
    const std::string backend = GetParam();                                                   \
    ::cpsim::testing::check_property(                                                         \
        [backend](const ::cpsim::verify::LayoutCase& c) { cpsim_prop_##Suite##_##Name(backend, c); }); \
  }                                                                                           \
  void cpsim_prop_##Suite##_##Name(const std::string& backend, const ::cpsim::verify::LayoutCase& c)
