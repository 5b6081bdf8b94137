// Property throughput: cases per second of the property table, where a case is one
// random layout (S <= 256, C = 8) at one CP size, every row checked forward and
// backward; for the gather + halo rows alone (like-for-like with a PyTorch loop
// that all-gathers shards and halos with autograd), and for every row.
#pragma once

#include <memory>
#include <string>

#include "core/comm/side_channel.hpp"

namespace cpsim::bench {

struct Throughput {
  std::string backend;
  int cp = 2;
  bool gather_halo_only = true;
  int cases = 0;
  int failures = 0;  // cases where a property did not hold (must be 0)
  double seconds = 0;
  double cases_per_second() const { return seconds > 0 ? cases / seconds : 0; }
};

// Checks random cases for about `seconds` (at least 3 cases).
// With `job`, the ranks are the processes of that job.
Throughput property_throughput(const std::string& backend, int cp, bool gather_halo_only, double seconds,
                               std::shared_ptr<Job> job = nullptr);

}  // namespace cpsim::bench
