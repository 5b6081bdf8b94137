// The Google Benchmark suites of cpsim, on every registered backend that can run
// here (threads, gloo, and the GPU backends where a device exists):
//   collectives   all_gather, reduce_scatter, send_recv, 8 B to 256 MiB per rank,
//                 2 to 16 ranks (points over 4 GiB of buffers are left out);
//                 counters algbw, busbw (nccl-tests factors), time_vs_ref (time
//                 over the same-run memcpy + std::barrier reference: 1 = at the
//                 reference, 10 = ten times slower), wrong (must be 0);
//   CP operators  gather_sequence forward and backward, convolution_history and
//                 convolution_halo with both exchanges (forward, and forward and
//                 backward), the packed conv forward and backward, the
//                 recurrence (its state all-gather and fold, forward and
//                 backward), each against a memcpy of the bytes it gathers;
//   layout        derive_layout and shard_batch of a packed batch.
// Times are real (wall) times of rank 0 between two barriers, reported as manual
// time. `--smoke` registers only tiny sizes (CI runs it) and exits 1 when any
// result is wrong.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "bench/attention_kernels.hpp"
#include "bench/collectives.hpp"
#include "core/comm/run_ranks.hpp"
#include "core/attention.hpp"
#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/halo.hpp"
#include "core/layout.hpp"
#include "core/loss.hpp"
#include "core/recurrence.hpp"
#include "core/shard.hpp"
#include "verify/random.hpp"

using namespace cpsim;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<std::int64_t> wrong_results{0};
bool smoke = false;  // tiny sizes, few iterations: every suite runs, every result is checked

void collective(benchmark::State& state, const std::string& backend, bench::Op op, int ranks, std::size_t bytes) {
  for (auto _ : state) {
    const auto p = bench::measure(backend, op, ranks, bytes, smoke ? 3 : bench::iterations_for(op, ranks, bytes));
    state.SetIterationTime(p.time_us / 1e6);
    state.counters["algbw_GBps"] = p.algbw;
    state.counters["busbw_GBps"] = p.busbw;
    state.counters["time_vs_ref"] = p.vs_ref() > 0 ? 1.0 / p.vs_ref() : 0;
    state.counters["wrong"] = static_cast<double>(p.wrong);
    state.SetBytesProcessed(static_cast<std::int64_t>(p.size));
    wrong_results += p.wrong;
  }
}

// A packed batch of `rows` rows of `seq_len` tokens, documents of 1..2*doc tokens.
Batch packed_batch(std::int64_t rows, std::int64_t seq_len, std::int64_t doc) {
  std::vector<std::int64_t> lens, ids(rows * seq_len);
  std::int64_t most = 0;
  std::vector<std::vector<std::int64_t>> per_row(rows);
  std::uint64_t x = 12345;
  for (std::int64_t b = 0; b < rows; ++b) {
    std::int64_t left = seq_len;
    while (left > 0) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const std::int64_t len = std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>((x >> 33) % (2 * doc)));
      per_row[b].push_back(len);
      left -= len;
    }
    most = std::max<std::int64_t>(most, per_row[b].size());
  }
  for (std::int64_t b = 0; b < rows; ++b) {
    per_row[b].resize(most, -1000);
    lens.insert(lens.end(), per_row[b].begin(), per_row[b].end());
  }
  for (std::int64_t i = 0; i < rows * seq_len; ++i) ids[i] = 1 + i % 1000;
  Batch batch;
  batch["input_ids"] = Tensor::from<std::int64_t>({rows, seq_len}, ids);
  batch["seq_lens"] = Tensor::from<std::int64_t>({rows, most}, lens);
  return batch;
}

// Runs body(comm) `iterations` times on every rank between barriers; rank 0's time
// of one iteration, and the limit of copying `bytes` per rank by as many threads.
template <class Body>
void timed_ranks(benchmark::State& state, const std::string& backend, int ranks, std::size_t bytes, Body body) {
  // About 64 MiB of traffic, 3 to 200 iterations.
  const int iterations =
      smoke ? 2 : std::clamp(static_cast<int>(64.0 * (1 << 20) / std::max<std::size_t>(bytes * ranks, 1)), 3, 200);
  for (auto _ : state) {
    double seconds = 0;
    RunOptions o;
    o.backend = backend;
    o.timeout = std::chrono::milliseconds(120000);
    run_ranks(ranks, [&](Communicator& comm) {
      auto step = body(comm);  // set up; returns the step to time
      step();
      comm.barrier();
      const auto t0 = Clock::now();
      for (int i = 0; i < iterations; ++i) step();
      comm.barrier();
      if (comm.rank() == 0) seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iterations;
    }, o);
    const double ref = bench::ref_us(ranks, bytes, iterations) / 1e6;
    state.SetIterationTime(seconds);
    state.counters["time_vs_ref"] = seconds / ref;
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  }
}

// Rank r's slice of a [1, c*L, C] activation, on its device.
Var shard(Communicator& comm, std::int64_t L, std::int64_t C, bool grad) {
  const Tensor x = verify::random_tensor({1, L, C}, DType::f32, 7 + comm.rank());
  return Var(comm.device().is_cpu() ? x : x.to(comm.device()), grad);
}

void register_operators(const std::string& backend) {
  const std::vector<std::int64_t> lengths = smoke ? std::vector<std::int64_t>{16} : std::vector<std::int64_t>{1024, 16384};
  const std::vector<int> rank_counts = smoke ? std::vector<int>{2} : std::vector<int>{2, 4, 8};
  const std::int64_t C = 64;
  for (int n : rank_counts)
    for (std::int64_t L : lengths) {
      const std::string tail = "/" + backend + "/ranks:" + std::to_string(n) + "/L:" + std::to_string(L) + "/C:64";
      const std::size_t gathered = static_cast<std::size_t>(n * L * C * 4);
      benchmark::RegisterBenchmark(("gather_sequence_forward" + tail).c_str(), [=](benchmark::State& s) {
        timed_ranks(s, backend, n, gathered, [=](Communicator& comm) {
          auto x = std::make_shared<Var>(shard(comm, L, C, false));
          return [x, &comm] { gather_sequence(*x, &comm, false); };
        });
      })->UseManualTime()->Iterations(1);
      benchmark::RegisterBenchmark(("gather_sequence_forward_backward" + tail).c_str(), [=](benchmark::State& s) {
        timed_ranks(s, backend, n, 2 * gathered, [=](Communicator& comm) {
          auto x = std::make_shared<Var>(shard(comm, L, C, true));
          auto up = std::make_shared<Tensor>(verify::random_tensor({1, n * L, C}, DType::f32, 99));
          return [x, up, &comm] { backward(dot(gather_sequence(*x, &comm, true), *up)); };
        });
      })->UseManualTime()->Iterations(1);
      for (HaloExchange e : {HaloExchange::all_gather, HaloExchange::send_recv}) {
        const int W = 4;
        benchmark::RegisterBenchmark(
            (std::string("convolution_history_") + halo_exchange_name(e) + "_forward_backward" + tail).c_str(),
            [=](benchmark::State& s) {
              timed_ranks(s, backend, n, static_cast<std::size_t>(2 * (W - 1) * C * 4), [=](Communicator& comm) {
                auto x = std::make_shared<Var>(shard(comm, L, C, true));
                auto up = std::make_shared<Tensor>(verify::random_tensor({1, L + W - 1, C}, DType::f32, 5));
                return [x, up, e, W, &comm] { backward(dot(convolution_history(*x, &comm, W, e), *up)); };
              });
            })
            ->UseManualTime()
            ->Iterations(1);
        // The history alone: what it moves is W-1 positions, whatever L is.
        for (const bool with_backward : {false, true})
          benchmark::RegisterBenchmark((std::string("convolution_halo_") + halo_exchange_name(e) +
                                        (with_backward ? "_forward_backward" : "_forward") + tail)
                                           .c_str(),
                                       [=](benchmark::State& s) {
                                         timed_ranks(s, backend, n,
                                                     static_cast<std::size_t>((with_backward ? 2 : 1) * (W - 1) * C * 4),
                                                     [=](Communicator& comm) {
                                                       auto x = std::make_shared<Var>(shard(comm, L, C, with_backward));
                                                       auto up = std::make_shared<Tensor>(
                                                           verify::random_tensor({1, W - 1, C}, DType::f32, 5));
                                                       return [x, up, e, W, with_backward, &comm] {
                                                         const Var h = convolution_halo(*x, &comm, W, e);
                                                         if (with_backward) backward(dot(h, *up));
                                                       };
                                                     });
                                       })
              ->UseManualTime()
              ->Iterations(1);
      }
      benchmark::RegisterBenchmark(("packed_conv_forward_backward" + tail).c_str(), [=](benchmark::State& s) {
        timed_ranks(s, backend, n, static_cast<std::size_t>(L * C * 8), [=](Communicator& comm) {
          const int W = 4;
          Tensor ids({1, n * L}, DType::i64);
          for (std::int64_t i = 0; i < n * L; ++i) ids.data<std::int64_t>()[i] = 1 + i / 300;
          auto ctx = std::make_shared<PackedContext>(ids, equal_plan(n * L, n), comm.rank(), n * L);
          const Device d = comm.device();
          auto put = [d](Tensor t) { return d.is_cpu() ? t : t.to(d); };
          auto x = std::make_shared<Var>(put(verify::random_tensor({1, L, C}, DType::f64, 3)), true);
          auto w = std::make_shared<Var>(put(verify::random_tensor({C, W}, DType::f64, 4)), true);
          auto b = std::make_shared<Var>(put(verify::random_tensor({C}, DType::f64, 5)), true);
          auto up = std::make_shared<Tensor>(verify::random_tensor({1, L, C}, DType::f64, 6));
          return [=, &comm] { backward(dot(sharded_packed_conv(*x, *ctx, &comm, *w, *b, HaloExchange::send_recv), *up)); };
        });
      })->UseManualTime()->Iterations(1);
    }
  // The recurrence: its state all-gather and fold (H = 4, K = V = 16, short shards).
  for (int n : rank_counts) {
    const std::int64_t L = smoke ? 8 : 64, H = 4, K = 16, V = 16;
    const std::string name = "recurrence_forward_backward/" + backend + "/ranks:" + std::to_string(n) + "/L:" +
                             std::to_string(L) + "/H:4/K:16/V:16";
    benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) {
      timed_ranks(s, backend, n, static_cast<std::size_t>(2 * n * recurrence_state_bytes(1, H, K, V)),
                  [=](Communicator& comm) {
                    Tensor ids({1, n * L}, DType::i64);
                    for (std::int64_t i = 0; i < n * L; ++i) ids.data<std::int64_t>()[i] = 1 + i / (3 * L / 2);
                    auto ctx = std::make_shared<PackedContext>(ids, equal_plan(n * L, n), comm.rank(), n * L);
                    const Device d = comm.device();
                    auto in = [&](Shape sh, std::uint64_t seed, double scale) {
                      Tensor t = verify::random_tensor(sh, DType::f64, seed + comm.rank());
                      for (std::int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] *= scale;
                      return std::make_shared<Var>(d.is_cpu() ? t : t.to(d), true);
                    };
                    auto q = in({1, L, H, K}, 1, 0.3), k = in({1, L, H, K}, 2, 0.3), v = in({1, L, H, V}, 3, 1.0),
                         beta = in({1, L, H}, 4, 0.2), g = in({1, L, H, K}, 5, -0.05);
                    auto up = std::make_shared<Tensor>(verify::random_tensor({1, L, H, V}, DType::f64, 9));
                    return [=, &comm] { backward(dot(gated_delta_rule(*q, *k, *v, *beta, *g, *ctx, &comm), *up)); };
                  });
    })->UseManualTime()->Iterations(1);
  }
}

// The layers that consume the layout: RoPE, then attention over the gathered K/V
// (dense, and top-k sparse), forward and backward; and the token-mean loss. The
// limit is that of copying the gathered k and v (compute dominates: a query reads
// every key of its document up to itself, documents of 256 tokens here).
void register_layers(const std::string& backend) {
  const std::vector<int> rank_counts = smoke ? std::vector<int>{2} : std::vector<int>{2, 4, 8};
  const std::int64_t L = smoke ? 16 : 1024, H = 4, D = 16, doc = smoke ? 8 : 256;
  for (int n : rank_counts)
    for (std::int64_t topk : {std::int64_t{-1}, std::int64_t{16}}) {
      const std::string name = std::string(topk < 0 ? "attention" : "sparse_attention") + "_forward_backward/" +
                               backend + "/ranks:" + std::to_string(n) + "/L:" + std::to_string(L) +
                               "/H:4/D:16/doc:" + std::to_string(doc) + (topk < 0 ? "" : "/topk:16");
      const std::size_t gathered = static_cast<std::size_t>(n * L * H * 2 * D * 8);
      benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) {
        timed_ranks(s, backend, n, 2 * gathered, [=](Communicator& comm) {
          Tensor ids({1, n * L}, DType::i64), pos({1, L}, DType::i64);
          for (std::int64_t i = 0; i < n * L; ++i) ids.data<std::int64_t>()[i] = 1 + i / doc;
          for (std::int64_t i = 0; i < L; ++i) pos.data<std::int64_t>()[i] = (comm.rank() * L + i) % doc;
          const PackedContext ctx(ids, equal_plan(n * L, n), comm.rank(), n * L);
          const Tensor visible = visible_doc_ids(ctx, Tensor::full({1, L}, DType::b8, 0.0));
          const Device d = comm.device();
          auto put = [d](Tensor t) { return d.is_cpu() ? t : t.to(d); };
          auto in = [&](Shape sh, std::uint64_t seed) {
            return std::make_shared<Var>(put(verify::random_tensor(sh, DType::f64, seed + 10 * comm.rank())), true);
          };
          auto q = in({1, L, H, D}, 1), k = in({1, L, H, D}, 2), v = in({1, L, H, D}, 3);
          auto up = std::make_shared<Tensor>(put(verify::random_tensor({1, L, H, D}, DType::f64, 4)));
          auto indexer = std::make_shared<SparseIndexer>(SparseIndexer{
              put(verify::random_tensor({1, L, 4}, DType::f64, 5)), put(verify::random_tensor({1, L, 4}, DType::f64, 6)),
              topk});
          auto plan = std::make_shared<ShardPlan>(ctx.plan());
          return [=, &comm] {
            const CpAttention a = cp_document_attention(rope(*q, pos), rope(*k, pos), *v, visible, plan.get(), &comm,
                                                        topk < 0 ? nullptr : indexer.get());
            backward(add(dot(a.out, *up), a.anchor));
          };
        });
      })->UseManualTime()->Iterations(1);
    }
  for (int n : rank_counts) {
    const std::int64_t vocab = smoke ? 16 : 4096, tokens = smoke ? 16 : 1024;
    const std::string name = "token_mean_loss_forward_backward/" + backend + "/ranks:" + std::to_string(n) +
                             "/L:" + std::to_string(tokens) + "/vocab:" + std::to_string(vocab);
    benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) {
      timed_ranks(s, backend, n, static_cast<std::size_t>(tokens * vocab * 8), [=](Communicator& comm) {
        const Device d = comm.device();
        Tensor targets({1, tokens}, DType::i64);
        for (std::int64_t i = 0; i < tokens; ++i) targets.data<std::int64_t>()[i] = i % 7 == 6 ? -100 : (i * 31) % vocab;
        auto logits = std::make_shared<Var>(verify::random_tensor({1, tokens, vocab}, DType::f64, 8 + comm.rank()), true);
        if (!d.is_cpu()) *logits = Var(logits->value().to(d), true), targets = targets.to(d);
        return [=, &comm] { backward(token_mean_loss(*logits, targets, &comm)); };
      });
    })->UseManualTime()->Iterations(1);
  }
}

void register_layout() {
  for (std::int64_t S : smoke ? std::vector<std::int64_t>{64} : std::vector<std::int64_t>{4096, 262144}) {
    const std::int64_t rows = 8;
    benchmark::RegisterBenchmark(("derive_layout/rows:8/S:" + std::to_string(S)).c_str(), [=](benchmark::State& s) {
      const Batch batch = packed_batch(rows, S, 200);
      for (auto _ : s) benchmark::DoNotOptimize(derive_layout(batch));
      s.SetItemsProcessed(s.iterations() * rows * S);
    });
    benchmark::RegisterBenchmark(("shard_batch/rows:8/S:" + std::to_string(S) + "/cp:8").c_str(), [=](benchmark::State& s) {
      const Batch batch = packed_batch(rows, S, 200);
      for (auto _ : s) benchmark::DoNotOptimize(shard_batch_at(3, 8, batch, std::nullopt, 0, false));
      s.SetItemsProcessed(s.iterations() * rows * S);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) smoke = true;
    else args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  const std::vector<std::size_t> sizes =
      smoke ? std::vector<std::size_t>{8, 4096}
            : std::vector<std::size_t>{8, 4096, 256 << 10, 16 << 20, 256 << 20};
  const std::vector<int> rank_counts = smoke ? std::vector<int>{2} : std::vector<int>{2, 4, 8, 16};
  for (const std::string& backend : available_backends()) {
    for (bench::Op op : bench::kTimedOps)
      for (int r : rank_counts)
        for (std::size_t bytes : sizes) {
          // Every rank's buffers and the limit's: leave out points over 4 GiB in all.
          if (static_cast<double>(bytes) * r * r * 3 > 4.0 * (1ull << 30)) continue;
          const std::string name = std::string(collective_name(op)) + "/" + backend + "/ranks:" + std::to_string(r) +
                                   "/bytes:" + bench::size_text(bytes);
          benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& s) { collective(s, backend, op, r, bytes); })
              ->UseManualTime()
              ->Iterations(1);
        }
    register_operators(backend);
    register_layers(backend);
  }
  register_layout();
  bench::register_attention_kernels(smoke, wrong_results);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (wrong_results > 0) {
    std::fprintf(stderr, "cpsim_bench: %lld wrong results\n", static_cast<long long>(wrong_results.load()));
    return 1;
  }
  return 0;
}
