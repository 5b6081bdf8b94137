// The cpsim command line (SPEC §6). Exit status: 0 every property holds,
// 1 a property failed, 2 bad usage or invalid input (one line naming key, row, index).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/comm/run_ranks.hpp"
#include "sim/process_launch.hpp"
#include "sim/world.hpp"
#include "verify/batch_io.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {

constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2;

// Options of every command that runs ranks.
struct JobArgs {
  std::string backend = "threads";
  bool backend_given = false;
  std::string store;     // process mode: overrides CPSIM_STORE
  double timeout = 20;   // seconds a rank waits for its peers
  int rank = 0, size = 1;  // this process in a multi-process job
  bool multi = false;
};

std::chrono::milliseconds milliseconds_of(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

// FNV-1a of the command line (and, for check, the batch files): the processes of
// one job must agree on it.
std::uint64_t fingerprint = 14695981039346656037ull;
void fingerprint_bytes(const std::string& bytes) {
  for (unsigned char ch : bytes) fingerprint = (fingerprint ^ ch) * 1099511628211ull;
  fingerprint = (fingerprint ^ 0xff) * 1099511628211ull;  // separator
}

// "cpsim: ", or "cpsim: rank R: " in a multi-process job.
std::string error_prefix = "cpsim: ";

// One line on stderr in one write, so the lines of several ranks do not interleave.
void report_error(const std::string& what) {
  const std::string line = error_prefix + what + "\n";
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Joins the multi-process job the environment describes (cpsim launch, RANK/WORLD_SIZE,
// Slurm, Open MPI), if any. Only rank 0 writes the report; every process computes it.
void join_job(JobArgs& a) {
  auto world = sim::world_from_environment();
  if (!world) return;
  if (!a.backend_given) a.backend = "gloo";
  if (a.backend != "gloo")
    throw UsageError("this process is rank " + std::to_string(world->rank) + " of " + std::to_string(world->size) +
                     " (from " + world->source + "); a multi-process job runs on --backend gloo, not " + a.backend);
  if (!a.store.empty()) world->store = a.store;
  world->timeout = milliseconds_of(a.timeout);
  error_prefix = "cpsim: rank " + std::to_string(world->rank) + ": ";
  sim::join_world(*world);
  sim::expect_same_job(fingerprint);
  a.multi = true;
  a.rank = world->rank;
  a.size = world->size;
  if (a.rank != 0) std::cout.setstate(std::ios::badbit);  // rank 0 reports
}

// The exit status of a job: a broken job (timeout, lost peer) is an error on every rank.
int finish_job(const JobArgs& a, int status) {
  if (!a.multi) return status;
  const auto world = sim::current_world();
  sim::leave_world();
  std::cout.clear();
  if (world && !world->failure.empty()) {
    report_error("error: " + world->failure);
    return kExitFailed;
  }
  return status;
}

bool job_broken() {
  const auto world = sim::current_world();
  return world && !world->failure.empty();
}

struct CheckArgs {
  std::vector<std::string> batches;
  std::vector<int> cp_sizes{1, 2, 3, 4, 8};
  bool cp_given = false;
  JobArgs job;
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

int run_check(CheckArgs a) {
  CheckOptions o;
  o.conv_width = a.conv_width;
  o.channels = a.channels;
  o.heads = a.heads;
  o.key_dim = a.key_dim;
  o.value_dim = a.value_dim;
  // Load and validate every batch first: invalid input is exit 2 before any work.
  std::vector<BatchFile> files;
  for (const auto& path : a.batches) {
    const std::string text = read_batch_text(path);
    fingerprint_bytes(text);
    BatchFile f = parse_batch_json(text, path);
    derive_layout(f.batch);
    files.push_back(std::move(f));
  }
  join_job(a.job);
  o.backend = a.job.backend;
  o.timeout = milliseconds_of(a.job.timeout);
  if (a.job.multi) {
    if (!a.cp_given) a.cp_sizes = {a.job.size};
    for (int cp : a.cp_sizes)
      if (cp > a.job.size)
        throw UsageError("--cp " + std::to_string(cp) + " needs " + std::to_string(cp) + " processes; this job has " +
                         std::to_string(a.job.size));
  }
  nlohmann::json out = {{"ok", true}, {"results", nlohmann::json::array()}};
  bool ok = true;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::vector<PropertyResult> all;
    for (int cp : a.cp_sizes) {
      if (job_broken()) break;  // every later property would fail the same way
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
  return finish_job(a.job, ok ? kExitOk : kExitFailed);
}

struct FuzzArgs {
  int cases = 200;
  std::uint64_t seed = 1;
  int max_cp = 16;
  JobArgs job;
  int conv_width = 4;
  std::string out = "cpsim-counterexample.json";
};

// Progress bar on a terminal; silent otherwise.
struct Progress : rc::detail::TestListener {
  int total, done = 0;
  bool tty;
  Progress(int n, bool report) : total(n), tty(report && isatty(STDERR_FILENO) != 0) {}
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

int run_fuzz(FuzzArgs a) {
  {
    // RapidCheck announces its own configuration on first use; fuzz runs on --seed, so
    // that line would only mislead.
    std::streambuf* err = std::cerr.rdbuf(nullptr);
    rc::detail::configuration();
    std::cerr.rdbuf(err);
  }
  join_job(a.job);
  CheckOptions o;
  o.backend = a.job.backend;
  o.timeout = milliseconds_of(a.job.timeout);
  o.conv_width = a.conv_width;
  if (a.job.multi) a.max_cp = std::min(a.max_cp, a.job.size);
  std::optional<LayoutCase> smallest;
  std::string failure;
  std::map<std::string, int> passed;
  auto property = [&](const LayoutCase& c) {
    if (job_broken()) RC_FAIL("the job stopped");
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
  Progress progress(a.cases, a.job.rank == 0);
  const auto gen = gen_layout_case(a.max_cp);
  const auto result = rc::detail::checkProperty(
      rc::detail::toProperty([&] { property(*gen); }), meta, params, progress);
  if (result.is<rc::detail::SuccessResult>()) {
    std::cout << "fuzz: " << a.cases << " random layouts (seed " << a.seed << ", cp 1-" << a.max_cp << ", backend "
              << a.job.backend << (a.job.multi ? ", " + std::to_string(a.job.size) + " processes" : std::string())
              << "): every property holds\n";
    for (const auto& [name, n] : passed) std::cout << "  " << std::left << std::setw(21) << name << n << " cases\n";
    return finish_job(a.job, kExitOk);
  }
  if (job_broken()) return finish_job(a.job, kExitFailed);  // the job failed, not a layout
  std::cout << "fuzz: property failed: " << failure << "\n";
  if (smallest && a.job.rank == 0) {
    write_batch_json(a.out, smallest->batch, smallest->pad_token_id);
    std::cout << "smallest failing layout (cp=" << smallest->cp << "): " << *smallest << "\n"
              << "saved to " << a.out << "; replay with: cpsim check " << a.out << " --cp " << smallest->cp
              << " --seed " << smallest->seed << "\n";
  }
  return finish_job(a.job, kExitFailed);
}

// Options every rank-running command takes.
void add_job_options(CLI::App* cmd, JobArgs& job) {
  cmd->add_option("--backend", job.backend, "threads | gloo (default: threads; gloo in a multi-process job)")
      ->check(CLI::IsMember(backend_names()))
      ->each([&job](const std::string&) { job.backend_given = true; });
  cmd->add_option("--store", job.store, "rendezvous of a multi-process job: file:DIR or redis://HOST:PORT "
                                        "(default: $CPSIM_STORE, which cpsim launch sets)");
  cmd->add_option("--timeout", job.timeout, "seconds a rank waits for its peers before it reports them")
      ->check(CLI::Range(0.05, 86400.0));
}

}  // namespace

int main(int argc, char** argv) {
  // A peer that dies closes its sockets; writing to them must be an error, not a signal.
  std::signal(SIGPIPE, SIG_IGN);
  for (int i = 1; i < argc; ++i) fingerprint_bytes(argv[i]);
  CLI::App app{"cpsim: verify contiguous context parallelism over packed sequences"};
  app.require_subcommand(1);
  CheckArgs check;
  auto* c = app.add_subcommand("check", "verify every property on batch files at each CP size");
  c->add_option("batch", check.batches, "BATCH files (JSON)")->required()->check(CLI::ExistingFile);
  c->add_option("--cp", check.cp_sizes, "CP sizes (default 1,2,3,4,8; in a multi-process job, its size)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024))
      ->each([&check](const std::string&) { check.cp_given = true; });
  add_job_options(c, check.job);
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
  add_job_options(f, fuzz.job);
  f->add_option("--conv-width", fuzz.conv_width, "convolution taps W")->check(CLI::Range(1, 64));
  f->add_option("--out", fuzz.out, "where the smallest failing batch is saved");
  sim::LaunchOptions launch;
  double grace = 30;
  auto* l = app.add_subcommand("launch", "start N processes of one Gloo job on this host: launch -n N -- cpsim ...");
  l->add_option("-n,--nproc", launch.processes, "processes (ranks)")->required()->check(CLI::Range(1, 1024));
  l->add_option("--store", launch.store, "rendezvous: file:DIR or redis://HOST:PORT (default: a fresh temporary directory)");
  l->add_option("--grace", grace, "seconds the others get to exit after one process fails, before they are killed")
      ->check(CLI::Range(0.0, 86400.0));
  l->add_option("command", launch.command, "the command each process runs, after --")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  try {
    if (c->parsed()) return run_check(check);
    if (f->parsed()) return run_fuzz(fuzz);
    if (l->parsed()) {
      launch.grace = milliseconds_of(grace);
      return sim::launch_processes(launch, std::cerr);
    }
  } catch (const UsageError& e) {
    report_error(e.what());
    return kExitUsage;
  } catch (const InvalidInput& e) {
    report_error(std::string("invalid input: ") + e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    report_error(std::string("error: ") + e.what());
    return kExitFailed;
  }
  return kExitUsage;
}
