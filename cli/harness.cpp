// cpsim harness: the generator side of the Python property harness
// (cpsim.torch.check). cpsim's generators draw the layouts (random, or a family's
// members) with RapidCheck, which shrinks a failure to the smallest layout; for
// every drawn case the golden writer puts the inputs and every rank's expected
// values (from the references, never from the code under test) in a folder, and
// the Python side, which runs the user's step on simulated ranks, gives the
// verdict. The protocol, one line each way per case:
//   cpsim -> python   case FOLDER
//   python -> cpsim   ok | fail WHY | outside WHY | stop
// (with --batch, one case: the given layout at --cp, nothing drawn or shrunk).
// Once the property held, the contract is probed: a few layouts just outside
// what --min-shard and --forms limit the draw to, each as
//   cpsim -> python   probe FOLDER
//   python -> cpsim   ok | fail WHY | refused WHY | partial WHY | stop
// (refused: OutsideContract or an exception of the step's own on every rank;
// partial: an exception on some ranks only, the others waiting in a collective,
// a hang on NCCL; a wrong result is a finding: the run fails with that layout). At the end cpsim writes
// WORKDIR/result.json and prints "done".
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"
#include "core/layout.hpp"
#include "core/shard.hpp"
#include "core/shard_plan.hpp"
#include "verify/batch_io.hpp"
#include "verify/family.hpp"
#include "verify/generators.hpp"
#include "verify/golden.hpp"
#include "verify/property_runner.hpp"

namespace cpsim::cli {

using namespace cpsim::verify;

namespace {

// One case's verdict from the Python side: passed, failed (why), outside the
// step's contract (why: the step declared the layout is not one its library
// takes; RapidCheck discards it and draws another), or nullopt when the Python
// side went away or asked to stop.
struct Verdict {
  enum Kind { ok, fail, outside } kind = ok;
  std::string why;
  bool partial = false;  // a probe refused by some ranks only
};

std::optional<Verdict> ask_verdict(const LayoutCase& c, const CheckOptions& o, const GoldenOptions& g,
                                   const std::filesystem::path& folder, const char* kind = "case") {
  std::filesystem::remove_all(folder);
  write_golden(c, o, folder.string(), "drawn", g);
  std::cout << kind << " " << folder.string() << std::endl;
  std::string line;
  if (!std::getline(std::cin, line) || line == "stop") return std::nullopt;
  if (line == "ok") return Verdict{};
  if (line.rfind("outside ", 0) == 0) return Verdict{Verdict::outside, line.substr(8)};
  if (line.rfind("refused ", 0) == 0) return Verdict{Verdict::outside, line.substr(8)};
  if (line.rfind("partial ", 0) == 0) return Verdict{Verdict::outside, line.substr(8), true};
  return Verdict{Verdict::fail, line.rfind("fail ", 0) == 0 ? line.substr(5) : line};
}

// The positions each rank of the equal plan holds: the sequence padded to a
// multiple of cp * pad_multiple, over cp.
std::int64_t equal_shard(const LayoutCase& c, std::int64_t pad_multiple) {
  Batch rows = c.batch;  // one row may be given as [S] tensors
  normalize_batch_axis(rows);
  return shard_geometry(sequence_length(rows), c.cp, pad_multiple).padded_len / c.cp;
}

// A batch's rows, a 1-D ([S]) batch's one included.
std::int64_t rows_of(Batch batch) {
  normalize_batch_axis(batch);
  return batch_rows(batch);
}

// A layout just outside a contract, and which contract and how.
struct Probe {
  LayoutCase c;
  std::string contract;  // "min_shard 3: its equal shards hold 2 positions"
};

// `per_contract` layouts just outside each contract the draw keeps to: shards
// one position shorter than --min-shard (the longest below it that the padding
// allows), and each form --forms leaves out, every other limit kept.
std::vector<Probe> draw_probes(const std::vector<int>& sizes, const PlanDraw& plan, const DrawLimits& limits,
                               std::int64_t pad_multiple, int per_contract, std::uint64_t seed) {
  std::vector<Probe> out;
  if (per_contract <= 0) return out;
  if (limits.min_shard > 1) {
    DrawLimits wider = limits;
    wider.min_shard = 1;
    const auto gen = gen_layout_case(sizes, plan, wider);
    std::vector<std::pair<std::int64_t, LayoutCase>> below;  // (shard, case), shard < min_shard
    for (int k = 0; k < 2000 && static_cast<int>(below.size()) < 50 * per_contract; ++k) {
      LayoutCase c = gen(rc::Random(seed + static_cast<std::uint64_t>(k)), k % 40).value();
      if (const std::int64_t shard = equal_shard(c, pad_multiple); shard < limits.min_shard)
        below.emplace_back(shard, std::move(c));
    }
    // The longest shards below the contract, at the largest CP sizes first (where
    // a shard's halo or state spans the most ranks).
    std::stable_sort(below.begin(), below.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second.cp > b.second.cp;
    });
    for (int i = 0; i < per_contract && i < static_cast<int>(below.size()); ++i)
      out.push_back({below[i].second, "min_shard " + std::to_string(limits.min_shard) + ": its equal shards hold " +
                                          std::to_string(below[i].first) + " positions"});
  }
  if (!limits.forms.empty()) {
    std::string allowed;  // "seq_lens, cu_seqlens": the contract's forms
    std::vector<std::pair<std::string, LayoutForm>> left_out;
    for (const auto& [name, form] : layout_forms()) {
      if (std::find(limits.forms.begin(), limits.forms.end(), form) == limits.forms.end())
        left_out.emplace_back(name, form);
      else
        allowed += (allowed.empty() ? "" : ", ") + name;
    }
    if (limits.rows_multiple > 1)  // a THD form is one row: replicas cannot each take rows of it
      left_out.erase(std::remove_if(left_out.begin(), left_out.end(),
                                    [](const auto& f) {
                                      return f.second == LayoutForm::cu_seqlens ||
                                             f.second == LayoutForm::cu_seqlens_only ||
                                             f.second == LayoutForm::cu_seqlens_padded_only;
                                    }),
                     left_out.end());
    for (int i = 0; i < per_contract && i < static_cast<int>(left_out.size()); ++i) {
      const auto& [name, form] = left_out[static_cast<std::size_t>(i)];
      DrawLimits other = limits;
      other.forms = {form};
      const auto gen = gen_layout_case(sizes, plan, other);
      out.push_back({gen(rc::Random(seed + 7919u * static_cast<std::uint64_t>(i + 1)), 10).value(),
                     "forms " + allowed + ": a layout in form " + name});
    }
  }
  return out;
}

nlohmann::json case_json(const LayoutCase& c) {
  std::ostringstream line;
  line << c;
  return {{"batch", batch_to_json(c.batch, c.pad_token_id, true) + "\n"},
          {"cp", c.cp},
          {"seed", c.seed},
          {"plan", plan_choice_name(c.plan)},
          {"cuts", c.plan.kind == PlanChoice::Kind::cuts ? nlohmann::json(c.plan.cuts) : nlohmann::json(nullptr)},
          {"case", line.str()}};
}

void finish(const HarnessArgs& a, const nlohmann::json& result) {
  std::ofstream((std::filesystem::path(a.workdir) / "result.json").string()) << result.dump() << "\n";
  std::cout << "done" << std::endl;
}

// --batch: the user's step on one saved layout (a counterexample), no drawing.
int replay_batch(const HarnessArgs& a, const CheckOptions& o, const GoldenOptions& g,
                 const std::filesystem::path& folder) {
  if (a.cp <= 0) throw UsageError("cpsim harness --batch: --cp N says the CP size to replay at");
  if (a.plan.plan == "random") throw UsageError("cpsim harness --batch: --plan equal, balanced or a plan file, not random");
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  const BatchFile file = read_batch_file(a.batch);  // invalid: exit 2, naming the file and the key
  try {
    derive_layout(file.batch);  // its layout too (positions against the documents), as cpsim check reads it
  } catch (const InvalidInput& e) {
    throw InvalidInput(a.batch + ": " + e.what());
  }
  if (rows_of(file.batch) % a.rows_multiple != 0)
    throw InvalidInput(a.batch + ": " + std::to_string(rows_of(file.batch)) + " rows; " +
                       std::to_string(a.rows_multiple) + " data-parallel replicas each take rows of it (a multiple of " +
                       std::to_string(a.rows_multiple) + " rows)");
  LayoutCase c{file.batch, file.pad_token_id, a.cp, a.seed.value_or(0), std::nullopt, *plan};
  if (c.plan.kind == PlanChoice::Kind::cuts && static_cast<int>(c.plan.cuts.size()) - 1 != a.cp)
    throw UsageError("cpsim harness --batch: the plan file cuts for " + std::to_string(c.plan.cuts.size() - 1) +
                     " ranks, --cp is " + std::to_string(a.cp));
  expect_plan_fits(c.plan, sequence_length(c.batch), a.cp, a.batch);
  const std::optional<Verdict> verdict = ask_verdict(c, o, g, folder);
  const bool failed = verdict && verdict->kind == Verdict::fail;
  nlohmann::json result{{"ok", verdict && !failed},
                        {"stopped", !verdict},
                        {"ran", verdict && verdict->kind != Verdict::outside ? 1 : 0},
                        {"outside", verdict && verdict->kind == Verdict::outside ? 1 : 0},
                        {"outside_why", verdict && verdict->kind == Verdict::outside
                                            ? nlohmann::json{{verdict->why, 1}} : nlohmann::json::object()},
                        {"failure", failed ? verdict->why : ""},
                        {"report", ""}};
  if (failed) result.update(case_json(c));
  finish(a, result);
  return !verdict ? kExitAborted : failed ? kExitFailed : kExitOk;
}

// The check could not run the cases asked: the step set aside so many drawn
// layouts (OutsideContract) that drawing stopped (more than 10 set aside per
// case asked). How many were drawn, refused and why, in cpsim's words.
std::string gave_up_report(int cases, int ran, int outside, const std::map<std::string, int>& why, int too_short) {
  std::ostringstream s;
  s << "the step set aside " << outside << " of " << (ran + outside + too_short)
    << " drawn layouts as outside its contract and ran " << ran << " of the " << cases
    << " cases asked: cpsim stops drawing once more than 10 layouts for each case asked were set aside";
  if (too_short)
    s << " (" << too_short << " more drawn were shorter than min_shard, or had rows the dp replicas cannot share)";
  s << ". Its reasons:";
  std::vector<std::pair<int, std::string>> order;
  for (const auto& [text, n] : why) order.emplace_back(-n, text);
  std::sort(order.begin(), order.end());
  for (const auto& [n, text] : order) s << "\n  " << -n << " x " << text;
  s << "\nDraw within the contract instead: forms=[...], a family=, min_shard= or pad_multiple= (docs/harness.md)";
  return s.str();
}

}  // namespace

int run_harness(const HarnessArgs& a) {
  if (a.workdir.empty()) throw UsageError("cpsim harness: --workdir is required");
  CheckOptions o;
  o.conv_width = a.conv_width;
  o.live_gates_every = a.live_gates_every;
  GoldenOptions g;
  g.shard_primary = a.shard_primary;
  g.dtype = a.dtype == "f32" ? DType::f32 : a.dtype == "bf16" ? DType::bf16 : DType::f64;
  const std::filesystem::path folder = std::filesystem::path(a.workdir) / "case";
  g.pad_multiple = a.pad_multiple;
  if (a.pad_multiple > 1 && a.plan.plan == "random")
    throw UsageError("cpsim harness: --pad-multiple takes the equal or the balanced plan (drawn cuts fit the "
                     "sequence padded to a multiple of cp)");
  if (!a.batch.empty()) return replay_batch(a, o, g, folder);

  std::optional<LayoutFamily> family;
  if (!a.family.empty()) family = read_family(a.family);  // invalid: exit 2, naming the field
  PlanDraw plan;
  if (a.plan.plan != "random") plan = parse_plan_choice(a.plan.plan, a.plan.cost);
  // The CP sizes: --cp (every case), else --cps (each as often as any other),
  // else 1..--max-cp.
  std::vector<int> sizes = a.cp_sizes;
  if (sizes.empty())
    for (int cp = 1; cp <= a.max_cp; ++cp) sizes.push_back(cp);
  std::sort(sizes.begin(), sizes.end());  // a failure shrinks towards the smallest
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  // (a family none of whose sizes is asked for: InvalidInput, exit 2)
  DrawLimits limits;
  limits.min_shard = a.min_shard;
  limits.long_every = a.long_every;
  if (a.long_lengths.size() != 2 || a.long_lengths[0] > a.long_lengths[1])
    throw UsageError("cpsim harness --long-lengths: MIN,MAX with MIN <= MAX");
  limits.long_min = a.long_lengths[0], limits.long_max = a.long_lengths[1];
  limits.long_per_rank = a.long_per_rank;
  limits.rows_multiple = a.rows_multiple;
  for (const std::string& name : a.forms) {
    const auto form = layout_forms().find(name);
    if (form == layout_forms().end()) throw UsageError("cpsim harness --forms: no form " + name);
    limits.forms.push_back(form->second);
  }
  if (a.rows_multiple > 1 && !limits.forms.empty() &&
      std::all_of(limits.forms.begin(), limits.forms.end(), [](LayoutForm f) {
        return f == LayoutForm::cu_seqlens || f == LayoutForm::cu_seqlens_only || f == LayoutForm::cu_seqlens_padded_only;
      }))
    throw UsageError("cpsim harness: --rows-multiple " + std::to_string(a.rows_multiple) +
                     " gives each data-parallel replica rows of one [B, S] batch; --forms lists THD forms only (one "
                     "row): add a row form");
  if (family && !limits.forms.empty())
    throw UsageError("cpsim harness: --forms draws random layouts; a family has its form");
  const auto gen = family ? gen_family_case(*family, sizes, plan) : gen_layout_case(sizes, plan, limits);
  // A family's members are drawn by its own lengths: one whose shards are shorter
  // than --min-shard is discarded here, never shown to the step.
  const auto too_short = [&](const LayoutCase& c) {
    return (a.min_shard > 1 && equal_shard(c, a.pad_multiple) < a.min_shard) ||
           (a.rows_multiple > 1 && rows_of(c.batch) % a.rows_multiple != 0);  // a family's member the replicas cannot share
  };

  std::optional<LayoutCase> smallest;
  std::string failure;
  bool stopped = false;  // the Python side went away or asked to stop: no verdict
  int ran = 0, outside = 0, too_short_drawn = 0;
  std::map<std::string, int> outside_why;  // each reason given, how often
  const auto set_aside = [&](const std::string& why) {
    ++outside;
    ++outside_why[why];
  };
  auto property = [&](const LayoutCase& c) {
    if (stopped) RC_FAIL("stopped");
    if (too_short(c)) {
      ++too_short_drawn;
      RC_DISCARD("shards shorter than --min-shard, or rows not a multiple of --rows-multiple");
    }
    const std::optional<Verdict> verdict = ask_verdict(c, o, g, folder);
    if (!verdict) {
      stopped = true;
      RC_FAIL("stopped");
    }
    if (verdict->kind == Verdict::outside) {
      set_aside(verdict->why);
      RC_DISCARD(verdict->why);
    }
    ++ran;
    if (verdict->kind == Verdict::fail) {
      smallest = c;  // the last failure seen is the most shrunk one
      failure = verdict->why;
      RC_FAIL(failure);
    }
  };
  PropertySettings settings;
  settings.name = "cpsim harness";
  settings.cases = a.cases;
  settings.seed = a.seed;
  const PropertyOutcome outcome =
      run_property(settings, [&] { property(a.cp > 0 ? at_cp(*gen, a.cp) : *gen); });

  // RapidCheck shrinks the CP size with the layout drawn after it, so a smaller
  // size may show the same shrunk layout failing: the smallest that does is the
  // one reported (a random plan's cuts become equal intervals at another size).
  if (smallest && !stopped && a.cp == 0)
    for (int cp : sizes) {
      if (cp >= smallest->cp) break;
      const LayoutCase smaller = at_cp(*smallest, cp);
      if ((family && !family_violation(*family, smaller).empty()) || too_short(smaller)) continue;
      const std::optional<Verdict> verdict = ask_verdict(smaller, o, g, folder);
      if (!verdict) {
        stopped = true;
        break;
      }
      if (verdict->kind == Verdict::outside) {
        set_aside(verdict->why);
        continue;
      }
      ++ran;
      if (verdict->kind == Verdict::fail) {
        smallest = smaller, failure = verdict->why;
        break;
      }
    }
  // The contract probed, once the property held (random draws at drawn CP sizes).
  bool probes_ok = true;
  nlohmann::json probes = nlohmann::json::array();
  if (outcome.ok && !stopped && !family && a.cp == 0)
    for (const Probe& p : draw_probes(sizes, plan, limits, a.pad_multiple, a.probes, a.seed.value_or(1))) {
      const std::optional<Verdict> verdict = ask_verdict(p.c, o, g, folder, "probe");
      if (!verdict) {
        stopped = true;
        break;
      }
      const char* what = verdict->partial                      ? "refused on some ranks"
                         : verdict->kind == Verdict::outside ? "refused"
                         : verdict->kind == Verdict::ok      ? "accepted"
                                                             : "wrong";
      probes.push_back({{"contract", p.contract}, {"outcome", what}, {"why", verdict->why}});
      if (verdict->kind == Verdict::fail) {
        probes_ok = false;
        smallest = p.c;
        failure = "outside its contract (" + p.contract +
                  ") the step took the layout and gave a wrong result (it must refuse it, OutsideContract or an "
                  "exception on every rank, or handle it right): " + verdict->why;
        break;
      }
    }
  std::string report = outcome.ok ? std::string("a layout outside the contract") : outcome.report;
  if (outcome.gave_up && !stopped) report = gave_up_report(a.cases, ran, outside, outside_why, too_short_drawn);
  nlohmann::json result{{"ok", outcome.ok && probes_ok && !stopped}, {"stopped", stopped}, {"ran", ran},
                        {"outside", outside}, {"outside_why", nlohmann::json(outside_why)}, {"failure", failure},
                        {"report", report},
                        {"probes", probes}};
  if (smallest && !stopped) result.update(case_json(*smallest));
  finish(a, result);
  return stopped ? kExitAborted : outcome.ok && probes_ok ? kExitOk : kExitFailed;
}

}  // namespace cpsim::cli
