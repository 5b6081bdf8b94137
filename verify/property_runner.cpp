#include "verify/property_runner.hpp"

#include <rapidcheck.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace cpsim::verify {

namespace {

struct Adapter : rc::detail::TestListener {
  PropertyListener* to;
  explicit Adapter(PropertyListener* l) : to(l) {}
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {
    if (to) to->on_case();
  }
  void onShrinkTried(const rc::detail::CaseDescription&, bool accepted) override {
    if (to) to->on_shrink(accepted);
  }
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {
    if (to) to->on_done();
  }
};

const rc::detail::Configuration& configuration() {
  // RapidCheck announces its configuration on first use; cpsim states its own seed.
  static const rc::detail::Configuration& config = [] () -> const rc::detail::Configuration& {
    std::streambuf* err = std::cerr.rdbuf(nullptr);
    const auto& c = rc::detail::configuration();
    std::cerr.rdbuf(err);
    return c;
  }();
  return config;
}

}  // namespace

PropertySettings PropertySettings::from_environment(const std::string& name, int default_cases) {
  PropertySettings s;
  s.name = name;
  const char* env = std::getenv("RC_PARAMS");
  const bool named_count = env && std::string(env).find("max_success") != std::string::npos;
  s.cases = named_count ? configuration().testParams.maxSuccess : default_cases;
  s.seed = configuration().testParams.seed;
  return s;
}

PropertyOutcome run_property(const PropertySettings& settings, const std::function<void()>& property,
                             PropertyListener* listener) {
  rc::detail::TestParams params = configuration().testParams;
  params.maxSuccess = settings.cases;
  if (settings.seed) params.seed = *settings.seed;
  rc::detail::TestMetadata meta;
  meta.id = meta.description = settings.name;
  Adapter adapter(listener);
  const auto result = rc::detail::checkProperty(rc::detail::toProperty([&] { property(); }), meta, params, adapter);
  if (result.is<rc::detail::SuccessResult>()) return {true, ""};
  std::ostringstream ss;
  rc::detail::printResultMessage(result, ss);
  PropertyOutcome outcome{false, ss.str()};
  rc::detail::GaveUpResult gave_up;
  if (result.match(gave_up)) {
    outcome.gave_up = true;
    outcome.ran = gave_up.numSuccess;
  }
  return outcome;
}

}  // namespace cpsim::verify
