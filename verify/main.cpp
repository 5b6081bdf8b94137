// The cpsim command line (SPEC §6). Exit status: 0 every property holds,
// 1 a property failed, 2 bad usage or invalid input (one line naming key, row, index).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/launcher.hpp"
#include "verify/batch_io.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {

constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2;

struct CheckArgs {
  std::vector<std::string> batches;
  std::vector<int> cp_sizes{1, 2, 3, 4, 8};
  std::string backend = "threads";
  int conv_width = 4, channels = 8;
  int heads = 2, key_dim = 4, value_dim = 4;
  std::uint64_t seed = 0;
  bool json = false;
};

void print_table(const std::string& name, const std::vector<PropertyResult>& results, const std::vector<int>& cps) {
  std::cout << name << "\n";
  std::cout << "  " << std::left << std::setw(21) << "property";
  for (int cp : cps) std::cout << std::setw(16) << ("cp=" + std::to_string(cp));
  std::cout << "\n";
  std::vector<std::string> order;
  for (const auto& r : results)
    if (std::find(order.begin(), order.end(), r.property) == order.end()) order.push_back(r.property);
  for (const auto& prop : order) {
    std::cout << "  " << std::setw(21) << prop;
    for (int cp : cps)
      for (const auto& r : results)
        if (r.property == prop && r.cp == cp) {
          std::ostringstream cell;
          cell << (r.ok ? "pass " : "FAIL ") << std::setprecision(2) << r.error;
          std::cout << std::setw(16) << cell.str();
        }
    std::cout << "\n";
  }
  for (const auto& r : results)
    if (!r.ok) std::cout << "  FAIL " << r.property << " at cp=" << r.cp << ": " << r.detail << "\n";
}

int run_check(const CheckArgs& a) {
  CheckOptions o;
  o.backend = a.backend;
  o.conv_width = a.conv_width;
  o.channels = a.channels;
  o.heads = a.heads;
  o.key_dim = a.key_dim;
  o.value_dim = a.value_dim;
  // Load and validate every batch first: invalid input is exit 2 before any work.
  std::vector<BatchFile> files;
  for (const auto& path : a.batches) {
    BatchFile f = read_batch_file(path);
    derive_layout(f.batch);
    files.push_back(std::move(f));
  }
  nlohmann::json out = {{"ok", true}, {"results", nlohmann::json::array()}};
  bool ok = true;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::vector<PropertyResult> all;
    for (int cp : a.cp_sizes) {
      LayoutCase c{files[i].batch, files[i].pad_token_id, cp, a.seed, std::nullopt};
      for (auto& r : check_all(c, o)) all.push_back(r);
    }
    for (const auto& r : all) {
      ok = ok && r.ok;
      nlohmann::json j = {{"batch", a.batches[i]}, {"cp", r.cp}, {"property", r.property}, {"ok", r.ok}, {"error", r.error}};
      if (!r.ok) j["detail"] = r.detail;
      out["results"].push_back(j);
    }
    if (!a.json) print_table(a.batches[i], all, a.cp_sizes);
  }
  out["ok"] = ok;
  if (a.json) std::cout << out.dump(1) << "\n";
  else std::cout << (ok ? "all properties hold\n" : "some properties FAILED\n");
  return ok ? kExitOk : kExitFailed;
}

struct FuzzArgs {
  int cases = 200;
  std::uint64_t seed = 1;
  int max_cp = 16;
  std::string backend = "threads";
  int conv_width = 4;
  std::string out = "cpsim-counterexample.json";
};

// Progress bar on a terminal; silent otherwise.
struct Progress : rc::detail::TestListener {
  int total, done = 0;
  bool tty = isatty(STDERR_FILENO) != 0;
  explicit Progress(int n) : total(n) {}
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {
    ++done;
    if (!tty) return;
    const int width = 40, fill = total ? std::min(width, done * width / total) : width;
    std::fprintf(stderr, "\r[%s%s] %d/%d", std::string(fill, '#').c_str(), std::string(width - fill, ' ').c_str(),
                 std::min(done, total), total);
  }
  void onShrinkTried(const rc::detail::CaseDescription&, bool accepted) override {
    if (tty && accepted) std::fprintf(stderr, "\rshrinking...%40s", "");
  }
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {
    if (tty) std::fprintf(stderr, "\n");
  }
};

int run_fuzz(const FuzzArgs& a) {
  CheckOptions o;
  o.backend = a.backend;
  o.conv_width = a.conv_width;
  std::optional<LayoutCase> smallest;
  std::string failure;
  std::map<std::string, int> passed;
  auto property = [&](const LayoutCase& c) {
    for (const auto& r : check_all(c, o)) {
      if (!r.ok) {
        smallest = c;  // the last failure seen is the most shrunk one
        failure = r.property + " at cp=" + std::to_string(r.cp) + ": " + r.detail;
        RC_FAIL(failure);
      }
      passed[r.property]++;
    }
  };
  rc::detail::TestParams params;
  params.seed = a.seed;
  params.maxSuccess = a.cases;
  rc::detail::TestMetadata meta;
  meta.id = meta.description = "cpsim fuzz";
  Progress progress(a.cases);
  const auto gen = gen_layout_case(a.max_cp);
  const auto result = rc::detail::checkProperty(
      rc::detail::toProperty([&] { property(*gen); }), meta, params, progress);
  if (result.is<rc::detail::SuccessResult>()) {
    std::cout << "fuzz: " << a.cases << " random layouts (seed " << a.seed << ", cp 1-" << a.max_cp << ", backend "
              << a.backend << "): every property holds\n";
    for (const auto& [name, n] : passed) std::cout << "  " << std::left << std::setw(18) << name << n << " cases\n";
    return kExitOk;
  }
  std::cout << "fuzz: property failed: " << failure << "\n";
  if (smallest) {
    write_batch_json(a.out, smallest->batch, smallest->pad_token_id);
    std::cout << "smallest failing layout (cp=" << smallest->cp << "): " << *smallest << "\n"
              << "saved to " << a.out << "; replay with: cpsim check " << a.out << " --cp " << smallest->cp
              << " --seed " << smallest->seed << "\n";
  }
  return kExitFailed;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cpsim: verify contiguous context parallelism over packed sequences"};
  app.require_subcommand(1);
  CheckArgs check;
  auto* c = app.add_subcommand("check", "verify every property on batch files at each CP size");
  c->add_option("batch", check.batches, "BATCH files (JSON)")->required()->check(CLI::ExistingFile);
  c->add_option("--cp", check.cp_sizes, "CP sizes")->delimiter(',')->check(CLI::Range(1, 1024));
  c->add_option("--backend", check.backend, "threads")->check(CLI::IsMember(sim::simulated_backends()));
  c->add_option("--conv-width", check.conv_width, "convolution taps W")->check(CLI::Range(1, 64));
  c->add_option("--channels", check.channels, "activation channels")->check(CLI::Range(1, 4096));
  c->add_option("--heads", check.heads, "recurrence heads H")->check(CLI::Range(1, 64));
  c->add_option("--key-dim", check.key_dim, "recurrence key size K")->check(CLI::Range(1, 256));
  c->add_option("--value-dim", check.value_dim, "recurrence value size V")->check(CLI::Range(1, 256));
  c->add_option("--seed", check.seed, "seed of the activations");
  c->add_flag("--json", check.json, "one JSON object instead of a table");
  FuzzArgs fuzz;
  auto* f = app.add_subcommand("fuzz", "random layouts, shrunk to the smallest failing one");
  f->add_option("--cases", fuzz.cases, "random layouts")->check(CLI::Range(1, 10000000));
  f->add_option("--seed", fuzz.seed, "generator seed");
  f->add_option("--max-cp", fuzz.max_cp, "largest CP size drawn")->check(CLI::Range(1, 64));
  f->add_option("--backend", fuzz.backend, "threads")->check(CLI::IsMember(sim::simulated_backends()));
  f->add_option("--conv-width", fuzz.conv_width, "convolution taps W")->check(CLI::Range(1, 64));
  f->add_option("--out", fuzz.out, "where the smallest failing batch is saved");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  try {
    if (c->parsed()) return run_check(check);
    if (f->parsed()) return run_fuzz(fuzz);
  } catch (const InvalidInput& e) {
    std::cerr << "cpsim: invalid input: " << e.what() << "\n";
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "cpsim: error: " << e.what() << "\n";
    return kExitFailed;
  }
  return kExitUsage;
}
