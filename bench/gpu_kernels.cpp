// The GPU kernels against the hardware's limit: every benchmark times its kernel
// and a device-to-device copy of the same bytes in the same run (CUDA events,
// manual time) and reports the ratio as `vs_copy`. The last lines are the goals
// of the GPU issue, each a measured ratio: rearrangement, tail packing and
// history assembly >= 0.8 of the copy at 256 MiB and more, layout kernels >= 0.5,
// a cuda-sim all_gather at 8 ranks >= 0.7.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/comm/run_ranks.hpp"
#include "core/kernels/table.hpp"
#include "gpu/cuda.hpp"

using namespace cpsim;

namespace {

constexpr std::int64_t MiB = 1 << 20;

struct Buffer {
  void* p = nullptr;
  explicit Buffer(std::size_t bytes) { CPSIM_CUDA(cudaMalloc(&p, bytes ? bytes : 1)); CPSIM_CUDA(cudaMemset(p, 1, bytes)); }
  ~Buffer() { cudaFree(p); }
  template <class T = void>
  T* as() const { return static_cast<T*>(p); }
};

// Milliseconds of f on the stream, by events.
template <class F>
double time_ms(cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  CPSIM_CUDA(cudaEventCreate(&a));
  CPSIM_CUDA(cudaEventCreate(&b));
  CPSIM_CUDA(cudaEventRecord(a, s));
  f();
  CPSIM_CUDA(cudaEventRecord(b, s));
  CPSIM_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  CPSIM_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

// The goals' rows: kernel -> (size, ratio), the best ratio seen at each size.
struct Goal {
  double need;
  std::int64_t from_bytes;
  std::map<std::int64_t, double> ratio;
};
std::map<std::string, Goal>& goals() {
  static std::map<std::string, Goal> g{
      {"rearrange", {0.8, 256 * MiB, {}}},     {"tail_pack", {0.8, 256 * MiB, {}}},
      {"history", {0.8, 256 * MiB, {}}},       {"doc_ids", {0.5, 256 * MiB, {}}},
      {"run_starts", {0.5, 256 * MiB, {}}},    {"derived_positions", {0.5, 256 * MiB, {}}},
      {"cuda_sim_all_gather_8", {0.7, 256 * MiB, {}}}};
  return g;
}

// Times `kernel` (moving `bytes`) and a copy of `bytes` alternately, once per
// iteration; manual time is the kernel's, vs_copy the ratio of the medians' speeds.
template <class Kernel>
void against_copy(benchmark::State& state, const std::string& name, std::int64_t bytes, Kernel kernel) {
  gpu::activate_cuda();
  const cudaStream_t s = gpu::rank_stream(0, 0);
  gpu::bind_rank_thread(0, s);
  Buffer a(bytes), b(bytes);
  kernel(s);  // warm up
  std::vector<double> k, c;
  for (auto _ : state) {
    const double kt = time_ms(s, [&] { kernel(s); });
    c.push_back(time_ms(s, [&] { CPSIM_CUDA(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s)); }));
    k.push_back(kt);
    state.SetIterationTime(kt / 1e3);
  }
  std::sort(k.begin(), k.end());
  std::sort(c.begin(), c.end());
  const double ratio = c[c.size() / 2] / k[k.size() / 2];
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["vs_copy"] = ratio;
  auto& g = goals()[name];
  g.ratio[bytes] = std::max(g.ratio[bytes], ratio);
}

// Bytes moved by the benchmark = reads + writes / 2 (a copy of N bytes reads N and writes N).
void Rearrange(benchmark::State& state) {
  const std::int64_t bytes = state.range(0), c = 8, B = 2;
  Buffer src(bytes), dst(bytes);
  against_copy(state, "rearrange", bytes, [&](cudaStream_t s) {
    kernels::kernels_for(Device::cuda(0))
        .blocks_to_sequence({src.p, dst.p, B, c, static_cast<std::size_t>(bytes / (c * B))}, s);
  });
}

void TailPack(benchmark::State& state) {  // the last half of every row's positions
  const std::int64_t bytes = state.range(0), rows = 4, P = 256, L = 2 * bytes / (rows * P * 4);
  Buffer src(2 * bytes), dst(bytes);
  against_copy(state, "tail_pack", bytes, [&](cudaStream_t s) {
    kernels::PositionCopy a;
    a.src = src.p, a.dst = dst.p, a.rows = rows, a.src_len = L, a.dst_len = L / 2, a.from = L / 2, a.to = 0, a.n = L / 2;
    a.position_bytes = P * 4;
    kernels::kernels_for(Device::cuda(0)).copy_positions(a, s);
  });
}

// Layout kernels: bytes are what each token writes (ids: 8 + padding: 1) plus reads.
void DocIds(benchmark::State& state) {
  const std::int64_t bytes = state.range(0), S = bytes / 9, D = 1000;
  Buffer starts((D + 1) * 8), real(D * 8), ids(S * 8), pad(S);
  {
    std::vector<std::int64_t> st(D + 1), re(D);
    for (std::int64_t i = 0; i <= D; ++i) st[i] = i * (S / D);
    for (std::int64_t i = 0; i < D; ++i) re[i] = S / D - 3;
    CPSIM_CUDA(cudaMemcpy(starts.p, st.data(), st.size() * 8, cudaMemcpyHostToDevice));
    CPSIM_CUDA(cudaMemcpy(real.p, re.data(), re.size() * 8, cudaMemcpyHostToDevice));
  }
  against_copy(state, "doc_ids", bytes, [&](cudaStream_t s) {
    kernels::kernels_for(Device::cuda(0))
        .doc_ids_from_starts({starts.as<std::int64_t>(), real.as<std::int64_t>(), ids.as<std::int64_t>(), pad.as<bool>(), 1, S, D}, s);
  });
}

void RunStarts(benchmark::State& state) {  // reads ids, writes starts: 16 B a token, counted as 8 (copy-equivalent)
  const std::int64_t bytes = state.range(0), S = bytes / 8;
  Buffer ids(S * 8), out(S * 8);
  against_copy(state, "run_starts", bytes, [&](cudaStream_t s) {
    kernels::kernels_for(Device::cuda(0)).run_starts(ids.as<std::int64_t>(), out.as<std::int64_t>(), 4, S / 4, s);
  });
}

void DerivedPositions(benchmark::State& state) {
  const std::int64_t bytes = state.range(0), S = bytes / 8;
  Buffer ids(S * 8), tails(64), out(S * 8);
  against_copy(state, "derived_positions", bytes, [&](cudaStream_t s) {
    kernels::kernels_for(Device::cuda(0))
        .derived_positions(ids.as<std::int64_t>(), tails.as<std::int64_t>(), out.as<std::int64_t>(), 4, S / 4, s);
  });
}

// A cuda-sim all_gather of `bytes` per rank at 8 ranks (each rank writes 8x that),
// against one copy of all the bytes every rank writes.
void CudaSimAllGather(benchmark::State& state) {
  const std::int64_t bytes = state.range(0), n = 8;
  gpu::activate_cuda();
  const cudaStream_t s = gpu::rank_stream(0, 0);
  gpu::bind_rank_thread(0, s);
  double copy_ms;
  {
    Buffer a(n * n * bytes), b(n * n * bytes);
    time_ms(s, [&] { CPSIM_CUDA(cudaMemcpyAsync(b.p, a.p, n * n * bytes, cudaMemcpyDeviceToDevice, s)); });
    copy_ms = time_ms(s, [&] { CPSIM_CUDA(cudaMemcpyAsync(b.p, a.p, n * n * bytes, cudaMemcpyDeviceToDevice, s)); });
  }
  RunOptions o;
  o.backend = "cuda-sim";
  std::vector<double> times;
  const int reps = 5;
  run_ranks(n, [&](Communicator& comm) {
    Buffer send(bytes), recv(n * bytes);
    comm.all_gather(send.p, recv.p, bytes, DType::b8);  // warm up
    for (int i = 0; i < reps; ++i) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      comm.all_gather(send.p, recv.p, bytes, DType::b8);
      comm.barrier();
      if (comm.rank() == 0) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }, o);
  for (auto _ : state) state.SetIterationTime(*std::min_element(times.begin(), times.end()) / 1e3);
  std::sort(times.begin(), times.end());
  const double ratio = copy_ms / times[times.size() / 2];
  state.SetBytesProcessed(state.iterations() * n * n * bytes);
  state.counters["vs_copy"] = ratio;
  auto& g = goals()["cuda_sim_all_gather_8"];
  g.ratio[bytes * n] = std::max(g.ratio[bytes * n], ratio);
}

const std::vector<std::int64_t> kSizes{1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB};

void sizes(benchmark::internal::Benchmark* b) {
  for (auto s : kSizes) b->Arg(s);
  b->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(10);
}

BENCHMARK(Rearrange)->Apply(sizes);
BENCHMARK(TailPack)->Apply(sizes);
BENCHMARK(DocIds)->Apply(sizes);
BENCHMARK(RunStarts)->Apply(sizes);
BENCHMARK(DerivedPositions)->Apply(sizes);
BENCHMARK(CudaSimAllGather)->Arg(1 * MiB)->Arg(32 * MiB)->Arg(128 * MiB)->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(1);

}  // namespace

int main(int argc, char** argv) {
  if (auto why = gpu::cuda_unavailable()) {
    std::fprintf(stderr, "cpsim_gpu_bench: %s\n", why->c_str());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // The goals, each a ratio to the same-run device-to-device copy.
  std::printf("\n%-24s %8s %10s %8s  %s\n", "kernel", "needs", "size", "vs_copy", "goal");
  bool all = true;
  for (const auto& [name, g] : goals()) {
    for (const auto& [bytes, ratio] : g.ratio) {
      if (bytes < g.from_bytes) continue;
      const bool ok = ratio >= g.need;
      all = all && ok;
      std::printf("%-24s %8.2f %7lld MiB %8.2f  %s\n", name.c_str(), g.need, static_cast<long long>(bytes / MiB), ratio,
                  ok ? "met" : "BELOW");
    }
  }
  std::printf("gpu kernels: %s\n", all ? "every goal met" : "some goals not met");
  return 0;
}
