// cpsim bench: the nccl-tests table of every backend, rank count, collective and
// size, each point checked and set against the same-run limit; optionally the
// property table's throughput.
#include <fstream>
#include <iomanip>
#include <iostream>

#include "bench/collectives.hpp"
#include "bench/throughput.hpp"
#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "cli/options.hpp"
#include "core/comm/registry.hpp"
#include "core/error.hpp"

namespace cpsim::cli {

int run_bench(BenchArgs a) {
  if (a.quick) {
    if (a.backends.empty()) a.backends = {"threads"};
    a.ranks = {2, 4};
    a.sizes = {"8", "64K", "1M"};
    if (a.properties == 0) a.properties = 0.5;
  }
  std::vector<std::string> backends = a.backends.empty() ? available_backends() : a.backends;
  for (const auto& name : backends)
    if (auto why = find_backend(name).unavailable()) throw UsageError("--backend " + name + ": " + *why);
  // In a multi-process job (cpsim launch): one backend (gloo or nccl), one rank a process.
  if (sim::job_from_environment()) {
    if (backends.size() != 1 || a.backends.empty()) backends = {a.backends.empty() ? "gloo" : a.backends[0]};
    a.job.backend = backends[0];
    a.job.backend_given = true;
    join_job(a.job);
    a.ranks = {a.job.size};
  }
  std::vector<std::size_t> sizes;
  for (const auto& s : a.sizes) sizes.push_back(bench::parse_size(s));
  std::vector<bench::Point> points;
  bool wrong = false;
  for (const auto& backend : backends)
    for (const auto& op_text : a.ops)
      for (int n : a.ranks) {
        const auto [most, why] = find_backend(backend).max_ranks();
        if (most > 0 && n > most) {
          std::cerr << "cpsim bench: skipping " << backend << " at " << n << " ranks: " << why << "\n";
          continue;
        }
        for (std::size_t bytes : sizes) {
          const bench::Op op = bench::op_from_name(op_text);
          const int iters = a.iterations > 0 ? a.iterations : bench::iterations_for(op, n, bytes);
          points.push_back(bench::measure(backend, op, n, bytes, iters, a.job.joined));
          wrong = wrong || points.back().wrong != 0;
          if (!a.json) std::cerr << "." << std::flush;
        }
      }
  if (!a.json) std::cerr << "\n";
  std::vector<bench::Throughput> throughput;
  if (a.properties > 0)
    for (const auto& backend : backends)
      for (int n : a.ranks)
        for (bool gh : {true, false}) {
          const auto [most, why] = find_backend(backend).max_ranks();
          if (most > 0 && n > most) continue;
          throughput.push_back(bench::property_throughput(backend, n, gh, a.properties, a.job.joined));
          wrong = wrong || throughput.back().failures != 0;
        }
  if (a.json) {
    std::cout << bench::json(points);
  } else {
    std::cout << bench::table(points);
    if (!throughput.empty()) {
      std::cout << "\n# property throughput: random layouts (S <= 256, C = 8), every row forward and backward, checked\n"
                << "#" << std::setw(9) << "backend" << std::setw(6) << "cp" << std::setw(14) << "rows" << std::setw(8)
                << "cases" << std::setw(10) << "cases/s" << std::setw(10) << "failed" << "\n";
      for (const auto& t : throughput)
        std::cout << std::setw(10) << t.backend << std::setw(6) << t.cp << std::setw(14)
                  << (t.gather_halo_only ? "gather+halo" : "all") << std::setw(8) << t.cases << std::fixed
                  << std::setprecision(1) << std::setw(10) << t.cases_per_second() << std::setw(10) << t.failures
                  << "\n";
    }
  }
  if (!a.svg.empty()) {
    std::ofstream out(a.svg);
    if (!out) throw UsageError("--svg " + a.svg + ": cannot write");
    out << bench::svg(points);
  }
  if (wrong) std::cerr << "cpsim bench: some results were wrong (#wrong or failed above)\n";
  return finish_job(a.job, wrong ? kExitFailed : kExitOk);
}

}  // namespace cpsim::cli
