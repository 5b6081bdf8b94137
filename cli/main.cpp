// The cpsim command line (SPEC §6). Exit status: 0 every property holds,
// 1 a property failed, 2 bad usage or invalid input (one line naming key, row,
// index), 3 the run could not complete (a rank died or timed out, a resource failed).
#include <csignal>
#include <filesystem>
#include <iostream>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "cli/options.hpp"
#include "core/error.hpp"

using namespace cpsim;
using namespace cpsim::cli;

int main(int argc, char** argv) {
  // A peer that dies closes its sockets; writing to them must be an error, not a signal.
  std::signal(SIGPIPE, SIG_IGN);
  // The job's processes must run one command on the same bytes. A file argument
  // counts by its contents (which the command fingerprints), not its path: the same
  // batch reached by different paths, or mounted elsewhere on another host, is one job.
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    fingerprint_bytes(std::filesystem::is_regular_file(argv[i], ec) ? std::string_view("<file>") : std::string_view(argv[i]));
  }
  const Parsed parsed = parse_options(argc, argv);
  if (!parsed.options) return parsed.exit_status;
  const Options& o = *parsed.options;
  try {
    switch (o.command) {
      case Command::check: return run_check(o.check);
      case Command::fuzz: return run_fuzz(o.fuzz);
      case Command::show: return run_show(o.show);
      case Command::golden: return run_golden(o.golden);
      case Command::plan: return run_plan(o.plan);
      case Command::bench: return run_bench(o.bench);
      case Command::harness: return run_harness(o.harness);
      case Command::launch: {
        sim::LaunchOptions launch = o.launch.launch;
        launch.grace = milliseconds_of(o.launch.grace);
        return sim::launch_processes(launch, std::cerr);
      }
    }
  } catch (const UsageError& e) {
    report_error(e.what());
    return kExitUsage;
  } catch (...) {
    const FailureReport report = classify_failure(std::current_exception());
    switch (report.kind) {
      case FailureKind::invalid_input: report_error("invalid input: " + report.what); return kExitUsage;
      case FailureKind::unsupported:
      case FailureKind::unavailable: report_error(report.what); return kExitUsage;
      case FailureKind::collective: report_error("error: " + report.what); return kExitFailed;
      case FailureKind::aborted: report_error("aborted: " + report.what); return kExitAborted;
      case FailureKind::internal:
        report_error("internal error (" + report.what + "); please report it with the command");
        return kExitAborted;
    }
  }
  return kExitUsage;
}
