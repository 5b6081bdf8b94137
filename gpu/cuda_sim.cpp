// The `cuda-sim` backend: n ranks on one GPU, one host thread per rank with its
// own stream. The calls are the shared-memory body threads has too (core/comm/
// shared_memory.hpp): the rendezvous checks them exactly as on threads; data moves
// as device-to-device copies on the reader's stream, ordered after the writer's
// work by an event the writer records before it posts; sums run the rank-order sum
// kernel, so results are bitwise those of `threads`.
#include <memory>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/comm/shared_memory.hpp"
#include "gpu/cuda.hpp"

namespace cpsim::gpu {

namespace {

constexpr Capabilities kCudaSimCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/true,
                                            /*stream_ordered=*/true};

// One group's shared state: the rendezvous, and each rank's stream and "ready"
// event (recorded after the work that wrote its buffers, before it posts a call).
struct SimState {
  SimState(int n, std::chrono::milliseconds timeout, int device, const RankNames& names)
      : rendezvous(std::make_shared<Rendezvous>(n, timeout, names)), device(device), streams(n), ready(n) {
    for (int r = 0; r < n; ++r) {
      streams[r] = rank_stream(device, r);
      CPSIM_CUDA(cudaEventCreateWithFlags(&ready[r], cudaEventDisableTiming));
    }
  }
  ~SimState() {
    for (cudaEvent_t e : ready) (void)cudaEventDestroy(e);
  }
  std::shared_ptr<Rendezvous> rendezvous;
  int device;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> ready;
};

class CudaSimCommunicator final : public SharedMemoryCommunicator {
 public:
  CudaSimCommunicator(std::shared_ptr<SimState> state, int rank)
      : SharedMemoryCommunicator(state->rendezvous, rank), s_(std::move(state)) {}
  std::string backend_name() const override { return "cuda-sim"; }
  Capabilities capabilities() const override { return kCudaSimCapabilities; }
  Device device() const override { return Device::cuda(s_->device); }

 private:
  cudaStream_t stream() const { return s_->streams[rank()]; }

  // "My buffers are written", on this rank's stream, before it posts a call.
  void publish(CallRecord&, std::size_t) override { CPSIM_CUDA(cudaEventRecord(s_->ready[rank()], stream())); }

  // bytes of peer q's buffer src into dst, after q's writes.
  void copy(int q, void* dst, const void* src, std::size_t bytes) override {
    if (!bytes) return;
    if (q != rank()) CPSIM_CUDA(cudaStreamWaitEvent(stream(), s_->ready[q], 0));
    CPSIM_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  }

  // dst = srcs[0] + srcs[1] + ..., in rank order, by the sum kernel.
  void sum(const std::vector<const void*>& srcs, void* dst, std::size_t count, DType dt) override {
    for (int q = 0; q < static_cast<int>(srcs.size()); ++q)
      if (q != rank()) CPSIM_CUDA(cudaStreamWaitEvent(stream(), s_->ready[q], 0));
    void* table = nullptr;  // the pointer list, on the device
    const std::size_t table_bytes = srcs.size() * sizeof(void*);
    CPSIM_CUDA(cudaMallocAsync(&table, table_bytes, stream()));
    CPSIM_CUDA(cudaMemcpyAsync(table, srcs.data(), table_bytes, cudaMemcpyHostToDevice, stream()));
    kernels::kernels_for(device()).sum_in_order({static_cast<const void* const*>(table), dst, srcs.size(), count}, dt,
                                                stream());
    CPSIM_CUDA(cudaFreeAsync(table, stream()));
  }

  // Reads are complete before the second phase, so no peer reuses a buffer
  // another rank still reads.
  void reads_issued() override { CPSIM_CUDA(cudaStreamSynchronize(stream())); }

  void* scratch(std::size_t bytes) override {
    void* p = nullptr;
    CPSIM_CUDA(cudaMallocAsync(&p, bytes, stream()));
    return p;
  }
  void release(void* p) noexcept override { (void)cudaFreeAsync(p, stream()); }

  std::shared_ptr<SimState> s_;
};

class CudaSimGroup final : public Group {
 public:
  CudaSimGroup(int n, std::chrono::milliseconds timeout, const RankNames& names) {
    activate_cuda();
    state_ = std::make_shared<SimState>(n, timeout, 0, names);
  }
  std::unique_ptr<Communicator> communicator(int rank) override {
    bind_rank_thread(state_->device, state_->streams.at(rank));
    return std::make_unique<CudaSimCommunicator>(state_, rank);
  }
  void finish(int rank) override {
    // The rank's queued work completes before it counts as returned.
    const cudaError_t e = cudaStreamSynchronize(state_->streams[rank]);
    kernels::current_stream() = nullptr;
    if (e != cudaSuccess)  // run_ranks reports it and fails the rank (fail below)
      throw Aborted(std::string("CUDA error at the end of the run: ") + cudaGetErrorString(e));
    state_->rendezvous->finish(rank);
  }
  void fail(int rank, const std::string& what) override {
    (void)cudaStreamSynchronize(state_->streams[rank]);
    kernels::current_stream() = nullptr;
    state_->rendezvous->fail(rank, what);
  }

 private:
  std::shared_ptr<SimState> state_;
};

const BackendRegistrar registrar{Backend{
    "cuda-sim", "ranks as threads sharing one GPU, a stream each; device-to-device copies, sums in rank order",
    kCudaSimCapabilities,
    [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
      return std::make_shared<CudaSimGroup>(n, timeout, names);
    },
    [] { return cuda_unavailable(); }}};

}  // namespace

}  // namespace cpsim::gpu
