// What the controls share: every property row must be able to fail, so each is
// run against a deliberately broken variant of the code it checks (one file of
// tests/verify/controls/ per file of verify/rows/) and must find, and shrink, a
// counterexample; planted faults (code that throws, or returns the wrong size)
// are that row failing with its case, never a crash of the harness.
#pragma once

#include <gmock/gmock.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "core/attention.hpp"
#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/loss.hpp"
#include "core/recurrence.hpp"
#include "core/token_shift.hpp"
#include "tests/rapidcheck_gtest.hpp"
#include "verify/batch_io.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/rows/common.hpp"

namespace cpsim::testing {

// A control found its bug: a counterexample, printed as a batch.
inline void expect_found(const std::string& report) {
  EXPECT_FALSE(report.empty()) << "the property passed every case against a broken implementation";
  EXPECT_THAT(report, ::testing::HasSubstr("cp=")) << "the counterexample is not printed as a batch";
  if (std::getenv("CPSIM_SHOW_COUNTEREXAMPLES")) std::cout << report << "\n";
}

// A row run against a broken implementation finds a counterexample.
inline void expect_row_catches(const std::string& name, const std::string& row, const verify::CheckOptions& o,
                               const verify::Impl& impl) {
  expect_found(expect_counterexample(name, [&](const verify::LayoutCase& c) {
    RC_ASSERT(verify::check_row(row, c, o, impl).ok);
  }));
}

// The same, its options drawn in each case (a width from a generator, say).
inline void expect_row_catches(const std::string& name, const std::string& row,
                               const std::function<verify::CheckOptions()>& options, const verify::Impl& impl) {
  expect_found(expect_counterexample(name, [&](const verify::LayoutCase& c) {
    RC_ASSERT(verify::check_row(row, c, options(), impl).ok);
  }));
}

// What a planted fault throws.
struct Planted : std::runtime_error {
  Planted() : std::runtime_error("planted fault") {}
};

// Every planted property must fail on some case, report why, and leave the process standing.
template <class Check>
void expect_reported(const std::string& name, Check check) {
  const std::string report = expect_counterexample(name, [&](const verify::LayoutCase& c) {
    const verify::PropertyResult r = check(c);
    RC_ASSERT(r.ok || !r.detail.empty());  // a failure always says why
    RC_ASSERT(r.ok);
  }, 100);
  EXPECT_FALSE(report.empty()) << name << ": the property passed every case";
  EXPECT_THAT(report, ::testing::HasSubstr("cp=")) << name;
  EXPECT_THAT(report, ::testing::Not(::testing::HasSubstr("a failure always says why"))) << name << ": " << report;
}

// Options of a control whose variant skips a collective: a short timeout.
inline verify::CheckOptions quick() {
  verify::CheckOptions o;
  o.timeout = std::chrono::milliseconds(3000);
  return o;
}

}  // namespace cpsim::testing

// The controls' own preamble (this header is included by tests/verify/controls/
// only): the names every control file uses.
using namespace cpsim;
using namespace cpsim::verify;
using cpsim::testing::expect_counterexample;
using cpsim::testing::expect_found;
using cpsim::testing::expect_reported;
using cpsim::testing::expect_row_catches;
using cpsim::testing::Planted;
using cpsim::testing::quick;
using ::testing::AnyOf;
using ::testing::HasSubstr;
