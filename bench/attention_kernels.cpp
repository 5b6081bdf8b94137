// The attention kernels alone (one rank, no gathers): the host's tiled kernels
// (core/kernels/attention_host.hpp, what the CPU backends run) beside the one
// kernel source's functors run on the host (what a GPU runs, a query a thread),
// forward and backward, dense and top-k sparse, against a same-run bound:
//
//   bound = exps * (one std::exp of this run) + flops * (one flop of this run)
//
// where the exp's time is that of std::exp over an array (the call the kernels
// make) and a flop's that of `acc[i] += x[i] * c` over arrays in the L1 cache
// (the kernels' inner loops at the widest this build vectorises, without masks,
// indices or strided reads). A visible (query, key) pair of one head costs at
// least one exp and, forward, 2D flops for its score and 3Dv for the output's
// update; backward, 2D + 2Dv for the score and dO.v, 3D each for dq and dk, 2Dv
// for dv. vs_bound = time / bound (1: at the bound). Every host result is
// compared with the functors' bitwise (wrong must be 0).
#include "bench/attention_kernels.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "core/kernels/attention_host.hpp"
#include "verify/random.hpp"

namespace cpsim::bench {

namespace {

using Clock = std::chrono::steady_clock;
using kernels::Attention;

struct Rates {
  double exp_ns = 0, flop_ns = 0;
};

// The best of five rounds of each, measured once per run.
const Rates& same_run_rates() {
  static const Rates rates = [] {
    Rates r;
    std::vector<double> x(4096), y(4096), acc(1024, 0.0), w(1024);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = -30.0 * static_cast<double>(i) / x.size();
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = 1e-9 * static_cast<double>(i);
    double best_exp = 1e30, best_flop = 1e30;
    for (int round = 0; round < 5; ++round) {
      auto t0 = Clock::now();
      for (int rep = 0; rep < 100; ++rep) {
        for (std::size_t i = 0; i < x.size(); ++i) y[i] = std::exp(x[i]);
        benchmark::DoNotOptimize(y.data());
        benchmark::ClobberMemory();
      }
      best_exp = std::min(best_exp, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / (100.0 * x.size()));
      t0 = Clock::now();
      for (int rep = 0; rep < 2000; ++rep) {
        const double c = 1.0 + 1e-12 * rep;
        for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += w[i] * c;
        benchmark::DoNotOptimize(acc.data());
        benchmark::ClobberMemory();
      }
      best_flop =
          std::min(best_flop, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / (2000.0 * 2 * acc.size()));
    }
    r.exp_ns = best_exp, r.flop_ns = best_flop;
    return r;
  }();
  return rates;
}

// One document of L tokens: every query sees every key up to itself, or, with
// topk, the keys a random indexer keeps.
struct Case {
  std::int64_t L = 0, H = 0, D = 0, Dv = 0, topk = 0;
  Tensor q, k, v, d_o, ids, next, first, kept;
  std::int64_t pairs = 0;  // visible (query, key) pairs, per head
};

Case make_case(std::int64_t L, std::int64_t H, std::int64_t D, std::int64_t topk) {
  Case c;
  c.L = L, c.H = H, c.D = c.Dv = D, c.topk = topk;
  c.q = verify::random_tensor({1, L, H, D}, DType::f64, 1);
  c.k = verify::random_tensor({1, L, H, D}, DType::f64, 2);
  c.v = verify::random_tensor({1, L, H, D}, DType::f64, 3);
  c.d_o = verify::random_tensor({1, L, H, D}, DType::f64, 4);
  c.ids = Tensor::full({1, L}, DType::i64, 1.0);
  c.next = Tensor({1, L}, DType::i64);
  c.first = Tensor({1, L}, DType::i64);
  for (std::int64_t t = 0; t < L; ++t) c.next.data<std::int64_t>()[t] = t;
  if (topk > 0) {
    const Tensor iq = verify::random_tensor({1, L, 4}, DType::f64, 5), ik = verify::random_tensor({1, L, 4}, DType::f64, 6);
    c.kept = Tensor({1, L, topk}, DType::i64);
    kernels::TopK s;
    s.q = iq.raw(), s.k = ik.raw(), s.q_ids = c.ids.data<std::int64_t>(), s.k_ids = c.ids.data<std::int64_t>();
    s.k_first = c.first.data<std::int64_t>(), s.kept = c.kept.data<std::int64_t>();
    s.rows = 1, s.q_len = L, s.k_len = L, s.dim = 4, s.topk = topk;
    kernels::kernels_for(Device::host()).topk_select(s, DType::f64, nullptr);
    for (std::int64_t t = 0; t < L; ++t) c.pairs += std::min<std::int64_t>(t + 1, topk);
  } else {
    c.pairs = L * (L + 1) / 2;
  }
  return c;
}

struct Buffers {
  Tensor o, lse, delta, dq, dk, dv;
};

Attention args(const Case& c, Buffers& b) {
  Attention a;
  a.q = c.q.raw(), a.k = c.k.raw(), a.v = c.v.raw(), a.d_o = c.d_o.raw();
  a.q_ids = a.k_ids = c.ids.data<std::int64_t>();
  a.next_query = c.next.data<std::int64_t>(), a.k_first = c.first.data<std::int64_t>();
  a.kept = c.topk > 0 ? c.kept.data<std::int64_t>() : nullptr;
  a.topk = c.topk > 0 ? c.topk : 0;
  a.rows = 1, a.q_len = a.k_len = c.L, a.heads = c.H, a.dim = c.D, a.v_dim = c.Dv;
  a.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  a.o = b.o.raw(), a.lse = b.lse.raw(), a.delta = b.delta.raw();
  a.dq = b.dq.raw(), a.dk = b.dk.raw(), a.dv = b.dv.raw();
  return a;
}

Buffers buffers(const Case& c) {
  return {Tensor({1, c.L, c.H, c.Dv}, DType::f64), Tensor({1, c.L, c.H}, DType::f64), Tensor({1, c.L, c.H}, DType::f64),
          Tensor({1, c.L, c.H, c.D}, DType::f64),  Tensor({1, c.L, c.H, c.D}, DType::f64),
          Tensor({1, c.L, c.H, c.Dv}, DType::f64)};
}

void run(const Attention& a, bool host, bool forward) {
  if (host) {
    const auto& table = kernels::kernels_for(Device::host());
    (forward ? table.attention_forward : table.attention_backward)(a, DType::f64, nullptr);
  } else if (forward) {
    kernels::attention_forward(thrust::host, a, DType::f64);
  } else {
    kernels::attention_backward(thrust::host, a, DType::f64);
  }
}

}  // namespace

void register_attention_kernels(bool smoke, std::atomic<std::int64_t>& wrong) {
  struct Shape {
    std::int64_t L, H, D;
  };
  // The check's shapes (H 2, D 4) and a model's head (H 4, D 64).
  const std::vector<Shape> shapes = smoke ? std::vector<Shape>{{64, 2, 4}} : std::vector<Shape>{{2048, 2, 4}, {1024, 4, 64}};
  for (const Shape& sh : shapes)
    for (std::int64_t topk : {std::int64_t{0}, std::int64_t{16}})
      for (bool forward : {true, false})
        for (bool host : {false, true}) {
          const std::string name = std::string("attention_kernel/") + (topk ? "sparse" : "dense") + "/" +
                                   (forward ? "forward" : "backward") + "/" + (host ? "host_tiled" : "functors") +
                                   "/L:" + std::to_string(topk ? 4 * sh.L : sh.L) + "/H:" + std::to_string(sh.H) +
                                   "/D:" + std::to_string(sh.D) + (topk ? "/topk:16" : "");
          benchmark::RegisterBenchmark(name.c_str(), [=, &wrong](benchmark::State& state) {
            const Case c = make_case(topk ? 4 * sh.L : sh.L, sh.H, sh.D, topk);
            Buffers mine = buffers(c), other = buffers(c);
            Attention a = args(c, mine), b = args(c, other);
            run(a, true, true);  // the backward reads the forward's o and lse
            run(b, false, true);
            const int reps = smoke ? 1 : 3;
            double best = 1e30;
            for (auto _ : state) {
              for (int r = 0; r < reps; ++r) {
                if (!forward) {  // dk and dv arrive zeroed
                  for (Tensor* t : {&mine.dk, &mine.dv, &other.dk, &other.dv}) std::fill_n(t->data<double>(), t->numel(), 0.0);
                }
                const auto t0 = Clock::now();
                run(host ? a : b, host, forward);
                best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
              }
              state.SetIterationTime(best);
            }
            run(host ? b : a, !host, forward);  // the other side, for the comparison
            const bool same = forward ? mine.o.bitwise_equal(other.o) && mine.lse.bitwise_equal(other.lse)
                                      : mine.dq.bitwise_equal(other.dq) && mine.dk.bitwise_equal(other.dk) &&
                                            mine.dv.bitwise_equal(other.dv);
            if (!same) ++wrong;
            const Rates& r = same_run_rates();
            const double units = static_cast<double>(c.pairs * c.H);
            const double flops = forward ? 2.0 * c.D + 3.0 * c.Dv : 8.0 * c.D + 4.0 * c.Dv;
            const double bound = units * (r.exp_ns + flops * r.flop_ns) * 1e-9;
            state.counters["pairs"] = units;
            state.counters["ns_per_pair"] = best * 1e9 / units;
            state.counters["bound_ns_per_pair"] = bound * 1e9 / units;
            state.counters["vs_bound"] = best / bound;
            state.counters["wrong"] = same ? 0 : 1;
          })
              ->UseManualTime()
              ->Iterations(1);
        }
}

}  // namespace cpsim::bench
