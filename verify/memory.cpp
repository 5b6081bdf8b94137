#include "verify/memory.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace cpsim::verify {

namespace {

constexpr double kFixedBytes = 16.0 * (1 << 20);  // the process itself: code, libraries, stacks
constexpr double kSafety = 1.1;                   // the models' spread, and the allocator's slack

std::int64_t read_cgroup_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string v;
    if (in >> v && v != "max") {
      try {
        const long long n = std::stoll(v);
        if (n > 0 && n < (1LL << 60)) return n;
      } catch (const std::exception&) {
      }
    }
  }
  return 0;
}

}  // namespace

RowShapes RowShapes::of(int cp, const CheckOptions& o) {
  return {static_cast<double>(cp),          static_cast<double>(o.channels), static_cast<double>(o.heads),
          static_cast<double>(o.key_dim),   static_cast<double>(o.value_dim), static_cast<double>(o.vocab),
          static_cast<double>(o.index_dim), static_cast<double>(o.topk)};
}

bool every_row_has_a_memory_model() {
  for (const PropertyRow& row : property_table())
    if (!row.cost.bytes_per_token || !(row.cost.us_per_token > 0)) return false;
  return true;
}

TimeEstimate estimate_check_time(std::int64_t tokens, std::int64_t attention_pairs, int cp, const CheckOptions& o) {
  const RowShapes at = RowShapes::of(cp, o), base = RowShapes::of(cp, CheckOptions{});
  // A pair's work: every head's q.k (rotated dim) and its value row.
  const double pair_scale = (o.heads * (2.0 * o.rope_dim() + o.value_dim)) / (2.0 * (2 * 4 + 4));
  TimeEstimate e;
  for (const PropertyRow& row : property_table()) {
    if (!o.rows.empty() && std::find(o.rows.begin(), o.rows.end(), row.name) == o.rows.end()) continue;
    const RowCost& cost = row.cost;
    if (!cost.bytes_per_token) continue;
    const double shape_scale = cost.bytes_per_token(at) / cost.bytes_per_token(base);
    const double us = static_cast<double>(tokens) * (cost.us_per_token + cost.us_per_token_per_rank * cp) * shape_scale +
                      static_cast<double>(attention_pairs) * cost.us_per_pair * pair_scale;
    e.rows.emplace_back(row.name, us * 1e-6);
    e.seconds += us * 1e-6;
  }
  return e;
}

MemoryEstimate estimate_check_memory(std::int64_t rows, std::int64_t seq_len, int keys, int cp, const CheckOptions& o) {
  const ReferenceGeometry g = reference_geometry(seq_len, cp);
  const double tokens = static_cast<double>(rows) * static_cast<double>(g.padded_len);
  const RowShapes s = RowShapes::of(cp, o);
  // Shared by every row: the batch's keys, its layout and reference layout, and
  // each rank's packed context (the global doc ids).
  const double shared = 8.0 * keys + 60 + 8 * cp;
  MemoryEstimate e;
  double largest = -1;
  for (const PropertyRow& row : property_table()) {
    const double b = row.cost.bytes_per_token ? row.cost.bytes_per_token(s) : 0;
    if (b > largest) {
      largest = b;
      e.largest_row = row.name;
    }
  }
  double per_token = shared + largest;
  double fixed = kFixedBytes;
  // Gloo in one process: a connection pair (and its buffers) per two ranks, and
  // the transport's own copies of what moves.
  if (o.backend == "gloo") {
    per_token *= 1.15;
    fixed += 0.35 * (1 << 20) * cp * cp;
  }
  e.per_token = per_token * kSafety;
  e.bytes = static_cast<std::int64_t>(fixed + tokens * e.per_token);
  return e;
}

MemoryLimit default_memory_limit() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  std::int64_t bytes = pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : (std::int64_t{8} << 30);
  std::string source = "this machine's memory";
  if (const std::int64_t cg = read_cgroup_limit(); cg > 0 && cg < bytes) {
    bytes = cg;
    source = "this cgroup's memory limit";
  }
  // Address space holds more than memory (each rank thread's stack and allocator
  // arena): half of it.
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
      static_cast<std::int64_t>(as.rlim_cur) / 10 * 8 / 2 < bytes / 10 * 8)
    return {static_cast<std::int64_t>(as.rlim_cur) / 2, "half of the address-space limit (ulimit -v)"};
  return {bytes / 10 * 8, "80% of " + source};
}


}  // namespace cpsim::verify
