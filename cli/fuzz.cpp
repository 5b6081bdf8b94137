// cpsim fuzz: random layouts, shrunk to the smallest failing one.
#include <unistd.h>

#include <cstdio>
#include <iomanip>
#include <iostream>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "core/comm/registry.hpp"
#include "verify/batch_io.hpp"
#include "verify/family.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/property_runner.hpp"

namespace cpsim::cli {

using namespace cpsim::verify;

namespace {

// Progress bar on a terminal; silent otherwise.
struct Progress : PropertyListener {
  int total, done = 0;
  bool tty;
  Progress(int n, bool report) : total(n), tty(report && isatty(STDERR_FILENO) != 0) {}
  void on_case() override {
    ++done;
    if (!tty) return;
    const int width = 40, fill = total ? std::min(width, done * width / total) : width;
    std::fprintf(stderr, "\r[%s%s] %d/%d", std::string(fill, '#').c_str(), std::string(width - fill, ' ').c_str(),
                 std::min(done, total), total);
  }
  void on_shrink(bool accepted) override {
    if (tty && accepted) std::fprintf(stderr, "\rshrinking...%40s", "");
  }
  void on_done() override {
    if (tty) std::fprintf(stderr, "\n");
  }
};

}  // namespace

int run_fuzz(FuzzArgs a) {
  join_job(a.job);
  CheckOptions o = check_options(a.model);
  o.live_gates_every = kFuzzLiveGatesEvery;
  o.backend = a.job.backend;
  o.timeout = milliseconds_of(a.job.timeout);
  o.job = a.job.joined;
  if (a.job.multi) a.max_cp = std::min(a.max_cp, a.job.size);
  else if (const auto [most, why] = find_backend(a.job.backend).max_ranks(); most > 0 && a.max_cp > most) {
    std::cerr << "cpsim fuzz: --max-cp " << a.max_cp << " capped at " << most << ": " << why << "\n";
    a.max_cp = most;
  }
  std::optional<LayoutCase> smallest;
  std::string failure;
  std::map<std::string, int> passed;
  // Why the run could not complete. Every later case fails at once, so RapidCheck
  // stops (its shrinking of an instant failure is quick); no case is blamed.
  std::string aborted;
  auto property = [&](const LayoutCase& c) {
    if (aborted.empty() && job_broken(a.job)) aborted = "the job stopped";
    if (!aborted.empty()) RC_FAIL("aborted: " + aborted);
    for (const auto& r : check_all(c, o)) {
      if (r.aborted) {
        aborted = r.property + " at cp=" + std::to_string(r.cp) + ": " + r.detail;
        RC_FAIL("aborted: " + aborted);
      }
      if (!r.ok) {
        smallest = c;  // the last failure seen is the most shrunk one
        failure = r.property + " at cp=" + std::to_string(r.cp) + ": " + r.detail;
        RC_FAIL(failure);
      }
      passed[r.property]++;
    }
  };
  PropertySettings settings;
  settings.name = "cpsim fuzz";
  settings.cases = a.cases;
  settings.seed = a.seed;
  Progress progress(a.cases, a.job.rank == 0);
  std::optional<LayoutFamily> family;
  if (!a.family.empty()) family = read_family(a.family);  // invalid: exit 2, naming the field
  if (family && a.max_cp < family->cp.min)
    throw UsageError("cpsim fuzz: family " + family->name + " runs at cp " + std::to_string(family->cp.min) + "-" +
                     std::to_string(family->cp.max) + "; --max-cp " + std::to_string(a.max_cp) + " leaves none");
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  if (plan && plan->kind == PlanChoice::Kind::cuts)
    throw UsageError("--plan " + a.plan.plan + ": fuzz draws the lengths and CP sizes, which a plan file's cuts cannot "
                     "fit; give equal, balanced or random");
  // 1 in 8 random layouts is long (512-2048 tokens): what one property row leaves
  // in the host memory cache is handed to the next, of other shapes, and
  // balanced plans part from equal ones over padding gaps; 1 in 6 layouts
  // gives mRoPE position_ids (image spans as grids); unpacked rows draw padding
  // gaps inside their document.
  const auto gen = family ? gen_family_case(*family, a.max_cp, plan)
                          : gen_layout_case(a.max_cp, plan, fuzz_draw_limits());
  const PropertyOutcome result = run_property(settings, [&] { property(*gen); }, &progress);
  if (!aborted.empty() && !smallest) {
    // A job that broke says why itself (finish_job), once.
    if (!job_broken(a.job)) report_error("aborted: the run could not complete, no verdict: " + aborted);
    return finish_job(a.job, kExitAborted);
  }
  if (result.ok) {
    std::cout << "fuzz: " << a.cases
              << (family ? " members of family " + family->name : std::string(" random layouts")) << " (seed "
              << a.seed << ", cp " << (family ? std::min(family->cp.min, a.max_cp) : 1) << "-"
              << (family ? std::min(family->cp.max, a.max_cp) : a.max_cp) << ", backend "
              << a.job.backend << (a.job.multi ? ", " + std::to_string(a.job.size) + " processes" : std::string())
              << ", plans " << (plan ? plan_choice_name(*plan) : std::string("drawn: equal, balanced and random cuts"))
              << "): every property holds\n";
    std::size_t width = 0;
    for (const auto& [name, n] : passed) width = std::max(width, name.size() + 2);
    for (const auto& [name, n] : passed)
      std::cout << "  " << std::left << std::setw(static_cast<int>(width)) << name << n << " cases\n";
    return finish_job(a.job, kExitOk);
  }
  std::cout << "fuzz: property failed: " << failure << "\n";
  if (!aborted.empty()) std::cout << "(shrinking stopped early: the run could not complete: " << aborted << ")\n";
  if (smallest && a.job.rank == 0) {
    write_batch_json(a.out, smallest->batch, smallest->pad_token_id);
    // The plan goes with the batch: its cuts into a plan file beside it, or its name.
    std::string replay_plan;
    const PlanChoice& p = smallest->plan;
    if (p.kind == PlanChoice::Kind::cuts) {
      const std::string plan_path = a.out + ".plan.json";
      std::ofstream(plan_path) << nlohmann::json{{"cuts", p.cuts}}.dump() << "\n";
      replay_plan = " --plan " + plan_path;
    } else if (p.kind == PlanChoice::Kind::balanced) {
      replay_plan = " --plan balanced --cost " + token_cost_name(p.cost);
    }
    std::cout << "smallest failing layout (cp=" << smallest->cp << "): " << *smallest << "\n"
              << "saved to " << a.out << "; replay with: cpsim check " << a.out << " --cp " << smallest->cp
              << " --seed " << smallest->seed << replay_plan << model_flags(a.model) << "\n";
  }
  return finish_job(a.job, kExitFailed);
}

}  // namespace cpsim::cli
