// The commands, one file each (cli/NAME.cpp runs `cpsim NAME`); main.cpp
// dispatches to them.
#pragma once

#include "cli/options.hpp"

namespace cpsim::cli {

int run_check(CheckArgs a);    // cli/check.cpp
int run_fuzz(FuzzArgs a);      // cli/fuzz.cpp
int run_show(const ShowArgs& a);        // cli/show.cpp
int run_golden(const GoldenArgs& a);    // cli/golden.cpp
int run_plan(const PlanArgs& a);        // cli/plan.cpp
int run_harness(const HarnessArgs& a);  // cli/harness.cpp
int run_bench(BenchArgs a);    // cli/bench.cpp

}  // namespace cpsim::cli
