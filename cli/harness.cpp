// cpsim harness: the generator side of the Python property harness
// (cpsim.torch.check). cpsim's generators draw the layouts (random, or a family's
// members) with RapidCheck, which shrinks a failure to the smallest layout; for
// every drawn case the golden writer puts the inputs and every rank's expected
// values (from the references, never from the code under test) in a folder, and
// the Python side, which runs the user's step on simulated ranks, gives the
// verdict. The protocol, one line each way per case:
//   cpsim -> python   case FOLDER
//   python -> cpsim   ok | fail WHY | stop
// and at the end cpsim writes WORKDIR/result.json and prints "done".
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "cli/job.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/shard_plan.hpp"
#include "verify/batch_io.hpp"
#include "verify/family.hpp"
#include "verify/generators.hpp"
#include "verify/golden.hpp"
#include "verify/property_runner.hpp"

namespace cpsim::cli {

using namespace cpsim::verify;

int run_harness(const HarnessArgs& a) {
  if (a.workdir.empty()) throw UsageError("cpsim harness: --workdir is required");
  std::optional<LayoutFamily> family;
  if (!a.family.empty()) family = read_family(a.family);  // invalid: exit 2, naming the field
  PlanDraw plan;
  if (a.plan != "random") plan = parse_plan_choice(a.plan, a.cost);
  if (family && a.max_cp < family->cp.min)
    throw UsageError("cpsim harness: family " + family->name + " runs at cp " + std::to_string(family->cp.min) + "-" +
                     std::to_string(family->cp.max) + "; --max-cp " + std::to_string(a.max_cp) + " leaves none");
  const auto gen = family ? gen_family_case(*family, a.max_cp, plan) : gen_layout_case(a.max_cp, plan);
  CheckOptions o;
  o.conv_width = a.conv_width;
  GoldenOptions g;
  g.shard_primary = a.shard_primary;
  const std::filesystem::path folder = std::filesystem::path(a.workdir) / "case";

  std::optional<LayoutCase> smallest;
  std::string failure;
  bool stopped = false;  // the Python side went away or asked to stop: no verdict
  int ran = 0;
  auto property = [&](const LayoutCase& c) {
    if (stopped) RC_FAIL("stopped");
    std::filesystem::remove_all(folder);
    write_golden(c, o, folder.string(), "drawn", g);
    std::cout << "case " << folder.string() << std::endl;
    std::string verdict;
    if (!std::getline(std::cin, verdict) || verdict == "stop") {
      stopped = true;
      RC_FAIL("stopped");
    }
    ++ran;
    if (verdict != "ok") {
      smallest = c;  // the last failure seen is the most shrunk one
      failure = verdict.rfind("fail ", 0) == 0 ? verdict.substr(5) : verdict;
      RC_FAIL(failure);
    }
  };
  PropertySettings settings;
  settings.name = "cpsim harness";
  settings.cases = a.cases;
  settings.seed = a.seed;
  const PropertyOutcome outcome =
      run_property(settings, [&] { property(a.cp > 0 ? at_cp(*gen, a.cp) : *gen); });

  nlohmann::json result{{"ok", outcome.ok && !stopped}, {"stopped", stopped}, {"ran", ran},
                        {"failure", failure}, {"report", outcome.report}};
  if (smallest && !stopped) {
    result["batch"] = batch_to_json(smallest->batch, smallest->pad_token_id, true) + "\n";
    result["cp"] = smallest->cp;
    result["seed"] = smallest->seed;
    result["plan"] = plan_choice_name(smallest->plan);
    result["cuts"] = smallest->plan.kind == PlanChoice::Kind::cuts ? nlohmann::json(smallest->plan.cuts)
                                                                     : nlohmann::json(nullptr);
    std::ostringstream line;
    line << *smallest;
    result["case"] = line.str();
  }
  std::ofstream((std::filesystem::path(a.workdir) / "result.json").string()) << result.dump() << "\n";
  std::cout << "done" << std::endl;
  return stopped ? kExitAborted : outcome.ok ? kExitOk : kExitFailed;
}

}  // namespace cpsim::cli
