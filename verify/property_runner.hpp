// Runs a RapidCheck property with a case count and a seed, reporting progress,
// and returns RapidCheck's report (with the shrunk counterexample) as text.
//
// cpsim's one contact with RapidCheck's internals: its public rc::check reads its
// configuration only from RC_PARAMS and prints to stdout, while `cpsim fuzz` needs
// a count and a seed from its command line and a progress bar, and the tests need
// the report of a property that must fail as data. Everything else uses
// RapidCheck's public generators and RC_ macros.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace cpsim::verify {

struct PropertySettings {
  std::string name = "property";
  int cases = 100;
  std::optional<std::uint64_t> seed;  // RapidCheck's configured seed (RC_PARAMS) when unset
  // Settings from RC_PARAMS (seed, max_success), with `default_cases` when it names none.
  static PropertySettings from_environment(const std::string& name, int default_cases);
};

struct PropertyListener {
  virtual ~PropertyListener() = default;
  virtual void on_case() {}
  virtual void on_shrink(bool accepted) {}
  virtual void on_done() {}
};

struct PropertyOutcome {
  bool ok = false;
  std::string report;  // empty when ok
  // RapidCheck gave up: too many draws discarded (RC_DISCARD) for the cases asked.
  bool gave_up = false;
  int ran = 0;  // the cases that ran before it gave up
};

// `property` draws its inputs with *gen and asserts with RC_ASSERT / RC_FAIL.
PropertyOutcome run_property(const PropertySettings& settings, const std::function<void()>& property,
                             PropertyListener* listener = nullptr);

}  // namespace cpsim::verify
