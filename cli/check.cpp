// cpsim check: every property on batch files at each CP size.
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/job.hpp"
#include "core/comm/registry.hpp"
#include "verify/batch_io.hpp"
#include "verify/properties.hpp"

namespace cpsim::cli {

using namespace cpsim::verify;

namespace {

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
          if (r.aborted) cell << "ABORTED";
          else cell << (r.ok ? "pass " : "FAIL ") << std::setprecision(2) << r.error;
          std::cout << std::setw(16) << cell.str();
        }
    std::cout << "\n";
  }
  for (const auto& r : results)
    if (!r.ok) std::cout << (r.aborted ? "  ABORTED " : "  FAIL ") << r.property << " at cp=" << r.cp << ": " << r.detail << "\n";
}

}  // namespace

int run_check(CheckArgs a) {
  CheckOptions o = check_options(a.model);
  // Load and validate every batch first: invalid input is exit 2 before any work.
  std::vector<BatchFile> files;
  for (const auto& path : a.batches) {
    const MappedFile file(path);
    fingerprint_bytes(file.bytes());
    BatchFile f = parse_batch(file.bytes(), path);
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
  if (!a.job.multi) {
    const auto [most, why] = find_backend(o.backend).max_ranks();
    for (int cp : a.cp_sizes)
      if (most > 0 && cp > most) throw UsageError("--cp " + std::to_string(cp) + " on --backend " + o.backend + ": " + why);
  }
  nlohmann::json out = {{"ok", true}, {"results", nlohmann::json::array()}};
  bool failed = false, aborted = false;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::vector<PropertyResult> all;
    for (int cp : a.cp_sizes) {
      if (job_broken()) break;  // every later property would fail the same way
      LayoutCase c{files[i].batch, files[i].pad_token_id, cp, a.model.seed, std::nullopt};
      for (auto& r : check_all(c, o)) all.push_back(r);
    }
    for (const auto& r : all) {
      failed = failed || (!r.ok && !r.aborted);
      aborted = aborted || r.aborted;
      nlohmann::json j = {{"batch", a.batches[i]}, {"cp", r.cp},    {"property", r.property},
                          {"ok", r.ok},            {"error", r.error}, {"aborted", r.aborted}};
      if (!r.ok) j["detail"] = r.detail;
      out["results"].push_back(j);
    }
    if (!a.json) print_table(a.batches[i], all, a.cp_sizes);
  }
  out["ok"] = !failed && !aborted;
  out["aborted"] = aborted;
  if (a.json) std::cout << out.dump(1) << "\n";
  else if (failed) std::cout << "some properties FAILED\n";
  else if (aborted) std::cout << "the run could not complete (ABORTED: no verdict on those properties)\n";
  else std::cout << "all properties hold\n";
  // A failed property is a finding whatever else happened; an aborted run alone is exit 3.
  return finish_job(a.job, failed ? kExitFailed : aborted ? kExitAborted : kExitOk);
}

}  // namespace cpsim::cli
