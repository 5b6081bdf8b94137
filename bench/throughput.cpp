#include "bench/throughput.hpp"

#include <chrono>

#include "verify/generators.hpp"
#include "verify/properties.hpp"

namespace cpsim::bench {

Throughput property_throughput(const std::string& backend, int cp, bool gather_halo_only, double seconds,
                               std::shared_ptr<Job> job) {
  using Clock = std::chrono::steady_clock;
  verify::CheckOptions o;
  o.backend = backend;
  o.channels = 8;
  o.job = std::move(job);
  const auto gen = verify::gen_layout_case(cp);
  const auto& table = verify::property_table();
  Throughput t;
  t.backend = backend;
  t.cp = cp;
  t.gather_halo_only = gather_halo_only;
  const auto start = Clock::now();
  while (t.cases < 3 || std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    const verify::LayoutCase c = verify::at_cp(gen(rc::Random(1000 + t.cases), 30).value(), cp);
    bool ok = true;
    if (gather_halo_only) {
      verify::Prepared p(c);
      for (const auto& row : table)
        if (row.name == "gather_forward" || row.name == "gather_backward" || row.name == "halo_forward" ||
            row.name == "halo_backward")
          ok = verify::run_row(row, p, o).ok && ok;
    } else {
      for (const auto& r : verify::check_all(c, o)) ok = r.ok && ok;
    }
    t.failures += !ok;
    ++t.cases;
  }
  t.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return t;
}

}  // namespace cpsim::bench
