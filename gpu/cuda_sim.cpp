// The `cuda-sim` backend: n ranks on one GPU, one host thread per rank with its
// own stream. Ranks meet in the backend-neutral rendezvous (core/comm/
// rendezvous.hpp), which checks their calls exactly as `threads` does; data moves
// as device-to-device copies on the reader's stream, ordered after the writer's
// work by an event the writer records before it posts; sums run the rank-order sum
// kernel, so results are bitwise those of `threads`.
#include <memory>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/comm/rendezvous.hpp"
#include "gpu/cuda.hpp"

namespace cpsim::gpu {

namespace {

constexpr Capabilities kCudaSimCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/true,
                                            /*stream_ordered=*/true};

// One group's shared state: the rendezvous, and each rank's stream and "ready"
// event (recorded after the work that wrote its buffers, before it posts a call).
struct SimState {
  SimState(int n, std::chrono::milliseconds timeout, int device)
      : rendezvous(std::make_shared<Rendezvous>(n, timeout)), device(device), streams(n), ready(n) {
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

class CudaSimCommunicator final : public Communicator {
 public:
  CudaSimCommunicator(std::shared_ptr<SimState> state, int rank) : s_(std::move(state)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->rendezvous->size(); }
  std::chrono::milliseconds timeout() const override { return s_->rendezvous->timeout(); }
  std::string backend_name() const override { return "cuda-sim"; }
  Capabilities capabilities() const override { return kCudaSimCapabilities; }
  Device device() const override { return Device::cuda(s_->device); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::all_gather, 0, count, dt};
    c.send = send;
    c.recv = recv;
    const std::size_t bytes = count * dtype_size(dt);
    run(c, o, [&](const std::vector<CallRecord>& all) {
      for (std::size_t q = 0; q < all.size(); ++q) read(static_cast<int>(q), static_cast<std::byte*>(recv) + q * bytes, all[q].send, bytes);
    });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::reduce_scatter, 0, count, dt};
    c.send = send;
    c.recv = recv;
    const std::size_t offset = rank_ * count * dtype_size(dt);
    run(c, o, [&](const std::vector<CallRecord>& all) {
      std::vector<const void*> srcs;
      for (const auto& peer : all) srcs.push_back(static_cast<const std::byte*>(peer.send) + offset);
      sum(srcs, recv, count, dt);
    });
  }

  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::all_reduce, 0, count, dt};
    c.send = buf;
    c.recv = buf;
    // In place: sum into scratch, written back once every peer has read.
    const std::size_t bytes = count * dtype_size(dt);
    void* scratch = nullptr;
    if (bytes) CPSIM_CUDA(cudaMallocAsync(&scratch, bytes, stream()));
    struct Free {
      void*& p;
      cudaStream_t s;
      ~Free() {
        if (p) (void)cudaFreeAsync(p, s);
      }
    } free_scratch{scratch, stream()};
    run(
        c, o,
        [&](const std::vector<CallRecord>& all) {
          std::vector<const void*> srcs;
          for (const auto& peer : all) srcs.push_back(peer.send);
          sum(srcs, scratch, count, dt);
        },
        [&] {
          if (!bytes) return;
          CPSIM_CUDA(cudaMemcpyAsync(buf, scratch, bytes, cudaMemcpyDeviceToDevice, stream()));
        });
  }

  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    const CallRecord c = send_recv_record(step, dt);
    run(c, o, [&](const std::vector<CallRecord>& all) {
      if (step.src >= 0) read(step.src, step.recv, all[step.src].send, c.recv_count * dtype_size(dt));
    });
  }

  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    CallRecord c{CollectiveKind::broadcast, 0, count, dt};
    c.root = root;
    c.send = buf;
    c.recv = buf;
    run(c, o, [&](const std::vector<CallRecord>& all) {
      if (rank_ != root) read(root, buf, all[root].send, count * dtype_size(dt));
    });
  }

  void barrier(CallOptions o) override {
    run(CallRecord{CollectiveKind::barrier}, o, [](const std::vector<CallRecord>&) {});
  }

 private:
  cudaStream_t stream() const { return s_->streams[rank_]; }

  // Records "my buffers are written" on this rank's stream, then runs the call
  // through the rendezvous. Reads are complete (this stream synchronised) before
  // the second phase, so no peer reuses a buffer another rank still reads.
  void run(const CallRecord& c, CallOptions o, const std::function<void(const std::vector<CallRecord>&)>& reads,
           const std::function<void()>& after = {}) {
    CPSIM_CUDA(cudaEventRecord(s_->ready[rank_], stream()));
    s_->rendezvous->run(
        rank_, c, o.timeout_or(timeout()),
        [&](const std::vector<CallRecord>& all) {
          reads(all);
          CPSIM_CUDA(cudaStreamSynchronize(stream()));
        },
        after);
  }

  // bytes of peer q's buffer src into dst, after q's writes.
  void read(int q, void* dst, const void* src, std::size_t bytes) {
    if (!bytes) return;
    if (q != rank_) CPSIM_CUDA(cudaStreamWaitEvent(stream(), s_->ready[q], 0));
    CPSIM_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  }

  // dst = srcs[0] + srcs[1] + ..., in rank order, by the sum kernel.
  void sum(const std::vector<const void*>& srcs, void* dst, std::size_t count, DType dt) {
    if (!count) return;
    for (int q = 0; q < static_cast<int>(srcs.size()); ++q)
      if (q != rank_) CPSIM_CUDA(cudaStreamWaitEvent(stream(), s_->ready[q], 0));
    void* table = nullptr;  // the pointer list, on the device
    const std::size_t table_bytes = srcs.size() * sizeof(void*);
    CPSIM_CUDA(cudaMallocAsync(&table, table_bytes, stream()));
    CPSIM_CUDA(cudaMemcpyAsync(table, srcs.data(), table_bytes, cudaMemcpyHostToDevice, stream()));
    kernels::kernels_for(device()).sum_in_order({static_cast<const void* const*>(table), dst, srcs.size(), count}, dt,
                                                stream());
    CPSIM_CUDA(cudaFreeAsync(table, stream()));
  }

  std::shared_ptr<SimState> s_;
  int rank_;
};

class CudaSimGroup final : public Group {
 public:
  CudaSimGroup(int n, std::chrono::milliseconds timeout) {
    activate_cuda();
    state_ = std::make_shared<SimState>(n, timeout, 0);
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
    [](int n, std::chrono::milliseconds timeout) { return std::make_shared<CudaSimGroup>(n, timeout); },
    [] { return cuda_unavailable(); }}};

}  // namespace

}  // namespace cpsim::gpu
