#include "verify/memory.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <functional>

namespace cpsim::verify {

namespace {

// The shapes a row's memory depends on.
struct Shapes {
  double cp, C, H, K, V;
  double vocab = 16, Di = 4, topk = 3;
  double in() const { return H * (3 * K + V + 1) * 8; }  // q, k, g (K each), v (V), beta: float64
  double out() const { return H * V * 8; }               // o and its upstream gradient
  double states() const { return H * K * V * 8; }        // one K x V state per token and head
};

// Bytes per token of the padded batch that each row holds at its peak, on top of
// what every row shares. Measured peak RSS (`cpsim check --row-memory` on the
// batches of Cli.TheMemoryEstimateBoundsTheMeasuredPeak: 64k tokens at cp 1 and 8;
// 32k at cp 4 with channels 64; 16k at cp 2 with heads 8, K = V = 16), less the
// process's own, lies within about 0.75-0.95 of these for the rows that can be
// the largest (rows that share another row's simulation peak lower).
const std::map<std::string, std::function<double(const Shapes&)>>& row_models() {
  // Per dtype (float64 the larger): every rank's upstream gradient and gathered
  // tensor are whole [B, P, C] tensors (the upstream gradient is the
  // reduce-scatter's input itself, not a copy), and a few per-rank positions.
  const auto gather_backward = [](const Shapes& s) { return 8 * s.C * (3.3 + 2.2 * s.cp) + 100 + 16 * s.cp; };
  // x, the upstream gradient and both exchanges' results (the reference's y and dx
  // come after the ranks' run): one run serves both conv rows.
  const auto conv = [](const Shapes& s) { return 8 * s.C * 10.5 + 60; };
  // Every token's state (for backward) and the inputs' gradients (a rank reads its
  // inputs in place; the reference, with its states of one head, runs after the
  // ranks): one run serves both rows.
  const auto recurrence = [](const Shapes& s) {
    return s.states() + 0.5 * (s.in() + s.out()) + 8 * s.K * s.V + 600 + 40 * s.cp;
  };
  // Each rank's gathered k and v are resident (half a unit); the gradients of the
  // gathered tensors only where its queries see keys (attention_backward leaves
  // the rest unwritten, and the anchor's zero gradient adds as +0 without writing
  // them), so a rank adds about a unit with its share of the work; the
  // reference's results come after the ranks' run.
  const auto attention = [](const Shapes& s) { return 8 * s.H * (2 * s.K + 2 * s.V) * (2.1 + 0.96 * s.cp) + 200; };
  // The indexer's query and key and the kept lists of the run and the reference.
  const auto sparse = [=](const Shapes& s) { return attention(s) + 24 * s.Di + 16 * s.topk; };
  const auto loss = [](const Shapes& s) { return 8.0 * s.vocab * 4 + 80; };
  static const std::map<std::string, std::function<double(const Shapes&)>> models = {
      {"layout", [](const Shapes&) { return 120.0; }},
      {"shard", [](const Shapes&) { return 150.0; }},
      // Six dtypes of [B, P, ...] (6C + 40 bytes a token), each rank's gathered copy.
      {"gather_forward", [](const Shapes& s) { return (6 * s.C + 40) * (1.2 + 1.3 * s.cp); }},
      {"gather_backward", gather_backward},
      {"anchor", gather_backward},
      {"halo_forward", [](const Shapes& s) { return 8 * s.C * 4.2 + 100; }},
      {"halo_backward", [](const Shapes& s) { return 8 * s.C * 9.3 + 80; }},
      {"conv_forward", conv},
      {"conv_backward", conv},
      {"recurrence_forward", recurrence},
      {"recurrence_backward", recurrence},
      // x, its upstream gradient, every rank's y and dx, the reference's two.
      {"rope", [](const Shapes& s) { return 8 * s.H * s.K * 8 + 40; }},
      // q, k, v and the upstream gradient, their RoPE copies and the reference's
      // outputs and gradients (global), each rank's gathered k and v and their
      // gradients: one run serves both rows of a form.
      {"attention_forward", attention},
      {"attention_backward", attention},
      {"sparse_attention_forward", sparse},
      {"sparse_attention_backward", sparse},
      // Two batches' inputs, three steps' outputs and two forward references, with
      // no backward: within one recurrence run with its backward.
      {"two_steps", recurrence},
      // The logits, the reference's softmax gradient and every rank's gradient.
      {"loss_forward", loss},
      {"loss_backward", loss},
  };
  return models;
}

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

namespace {

// Microseconds of CPU per token of the padded batch (B x P): a + b x cp, and for
// the rows that run an attention simulation, microseconds per (query, key) pair
// evaluated. Rows that share another row's simulation cost only their
// comparison. Measured on 2 cores (cpsim check --json, threads backend).
struct RowTime {
  double a, b, per_pair = 0;
};
const std::map<std::string, RowTime>& row_times() {
  static const std::map<std::string, RowTime> times = {
      {"layout", {0.12, 0}},
      {"shard", {0.11, 0.07}},
      {"gather_forward", {0.05, 0.05}},
      {"gather_backward", {0.02, 0.17}},
      {"anchor", {0.02, 0.12}},
      {"halo_forward", {0.13, 0.015}},
      {"halo_backward", {0.3, 0.02}},
      {"conv_forward", {0.57, 0.03}},
      {"conv_backward", {0.08, 0}},
      {"recurrence_forward", {2.7, 0.15}},
      {"recurrence_backward", {0.12, 0}},
      {"rope", {0.44, 0.015}},
      {"attention_forward", {1.5, 0.075, 0.2}},
      {"attention_backward", {0.09, 0}},
      {"sparse_attention_forward", {1.5, 0.075, 0.1}},
      {"sparse_attention_backward", {0.09, 0}},
      {"loss_forward", {0.85, 0.02}},
      {"loss_backward", {0.06, 0}},
      {"two_steps", {2.0, 0.1}},
  };
  return times;
}

Shapes shapes_of(int cp, const CheckOptions& o) {
  return {static_cast<double>(cp),          static_cast<double>(o.channels), static_cast<double>(o.heads),
          static_cast<double>(o.key_dim),   static_cast<double>(o.value_dim), static_cast<double>(o.vocab),
          static_cast<double>(o.index_dim), static_cast<double>(o.topk)};
}

}  // namespace

bool every_row_has_a_memory_model() {
  for (const PropertyRow& row : property_table())
    if (!row_models().count(row.name) || !row_times().count(row.name)) return false;
  return true;
}

TimeEstimate estimate_check_time(std::int64_t tokens, std::int64_t attention_pairs, int cp, const CheckOptions& o) {
  const Shapes at = shapes_of(cp, o), base = shapes_of(cp, CheckOptions{});
  // A pair's work: every head's q.k (rotated dim) and its value row.
  const double pair_scale = (o.heads * (2.0 * o.rope_dim() + o.value_dim)) / (2.0 * (2 * 4 + 4));
  TimeEstimate e;
  for (const PropertyRow& row : property_table()) {
    if (!o.rows.empty() && std::find(o.rows.begin(), o.rows.end(), row.name) == o.rows.end()) continue;
    const auto t = row_times().find(row.name);
    const auto m = row_models().find(row.name);
    if (t == row_times().end() || m == row_models().end()) continue;
    const double shape_scale = m->second(at) / m->second(base);
    const double us = static_cast<double>(tokens) * (t->second.a + t->second.b * cp) * shape_scale +
                      static_cast<double>(attention_pairs) * t->second.per_pair * pair_scale;
    e.rows.emplace_back(row.name, us * 1e-6);
    e.seconds += us * 1e-6;
  }
  return e;
}

MemoryEstimate estimate_check_memory(std::int64_t rows, std::int64_t seq_len, int keys, int cp, const CheckOptions& o) {
  const ReferenceGeometry g = reference_geometry(seq_len, cp);
  const double tokens = static_cast<double>(rows) * static_cast<double>(g.padded_len);
  const Shapes s{static_cast<double>(cp), static_cast<double>(o.channels), static_cast<double>(o.heads),
                 static_cast<double>(o.key_dim), static_cast<double>(o.value_dim), static_cast<double>(o.vocab),
                 static_cast<double>(o.index_dim), static_cast<double>(o.topk)};
  // Shared by every row: the batch's keys, its layout and reference layout, and
  // each rank's packed context (the global doc ids).
  const double shared = 8.0 * keys + 60 + 8 * cp;
  MemoryEstimate e;
  double largest = -1;
  for (const PropertyRow& row : property_table()) {
    const auto model = row_models().find(row.name);
    const double b = model == row_models().end() ? 0 : model->second(s);
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
