// The CUDA device runtime (stream-ordered allocation from each device's memory
// pool, copies and fills on the calling thread's stream) and its registration.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>
#include <utility>

#include "core/device.hpp"
#include "gpu/cuda.hpp"

namespace cpsim::gpu {

void cuda_fail(cudaError_t error, const char* call, const char* file, int line) {
  throw Aborted(detail::concat(file, ":", line, ": ", call, ": ", cudaGetErrorName(error), " (",
                             cudaGetErrorString(error), ")"));
}

namespace {

struct Probe {
  int count = 0;
  std::string why;
};

const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    const cudaError_t e = cudaGetDeviceCount(&r.count);
    if (e != cudaSuccess) {
      r.count = 0;
      r.why = std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
    } else if (r.count == 0) {
      r.why = "no CUDA device (cudaGetDeviceCount found none)";
    }
    return r;
  }();
  return p;
}

// Switches this thread to `device` when it is on another one.
void use_device(int device) {
  int now = -1;
  CPSIM_CUDA(cudaGetDevice(&now));
  if (now != device) CPSIM_CUDA(cudaSetDevice(device));
}

// Memory comes from each device's default pool, in the order of the calling
// thread's stream (cudaMallocAsync): a freed block is reused by later work on any
// stream once the free is reached, without a device-wide synchronisation. The pool
// keeps what it holds (release threshold: everything), as PyTorch's caching
// allocator does.
class CudaRuntime final : public DeviceRuntime {
 public:
  // From the pool of the tensor's own device (cudaMallocAsync would take the pool
  // of the stream's device, which is another one when a rank thread allocates for
  // a peer).
  void* allocate(Device device, std::size_t bytes) override {
    use_device(device.index);
    cudaMemPool_t pool;
    CPSIM_CUDA(cudaDeviceGetDefaultMemPool(&pool, device.index));
    void* p = nullptr;
    CPSIM_CUDA(cudaMallocFromPoolAsync(&p, bytes ? bytes : 1, pool, current_cuda_stream()));
    return p;
  }
  void deallocate(Device device, void* ptr, std::size_t) noexcept override {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != device.index) cudaSetDevice(device.index);
    (void)cudaFreeAsync(ptr, current_cuda_stream());
  }
  void zero(Device device, void* ptr, std::size_t bytes) override {
    if (bytes) CPSIM_CUDA(cudaMemsetAsync(ptr, 0, bytes, current_cuda_stream()));
  }
  // Device-to-device copies stay queued on the stream; a copy that touches host
  // memory completes before it returns (the host reads or reuses that memory next).
  void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) override {
    if (!bytes) return;
    const cudaStream_t s = current_cuda_stream();
    if (!dst_device.is_cpu() && !src_device.is_cpu() && dst_device.index != src_device.index)
      CPSIM_CUDA(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, bytes, s));
    else
      CPSIM_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    if (dst_device.is_cpu() || src_device.is_cpu()) CPSIM_CUDA(cudaStreamSynchronize(s));
  }
};

std::mutex streams_mutex;
std::map<std::pair<int, int>, cudaStream_t> streams;

}  // namespace

std::optional<std::string> cuda_unavailable() {
  if (probe().count > 0) return std::nullopt;
  return probe().why;
}

int cuda_device_count() { return probe().count; }

void activate_cuda() {
  if (auto why = cuda_unavailable()) throw Unavailable(*why);
  static const bool once = [] {
    for (int d = 0; d < probe().count; ++d) {
      cudaMemPool_t pool;
      CPSIM_CUDA(cudaDeviceGetDefaultMemPool(&pool, d));
      std::uint64_t keep = UINT64_MAX;
      CPSIM_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
      // Peers read these tensors directly (in-process NCCL's P2P, peer copies), and a
      // pool's memory does not follow cudaDeviceEnablePeerAccess: open the pool to
      // every device that can reach this one. Devices that cannot go through
      // NCCL's own staging (and cudaMemcpyPeerAsync's), which needs no access.
      std::vector<cudaMemAccessDesc> access;
      for (int peer = 0; peer < probe().count; ++peer) {
        int can = 0;
        if (peer == d || cudaDeviceCanAccessPeer(&can, peer, d) != cudaSuccess || !can) continue;
        cudaMemAccessDesc a{};
        a.location.type = cudaMemLocationTypeDevice;
        a.location.id = peer;
        a.flags = cudaMemAccessFlagsProtReadWrite;
        access.push_back(a);
      }
      if (!access.empty()) CPSIM_CUDA(cudaMemPoolSetAccess(pool, access.data(), access.size()));
    }
    static CudaRuntime runtime;
    register_device_runtime(DeviceKind::cuda, &runtime);
    kernels::register_kernels(DeviceKind::cuda, &cuda_kernel_table());
    return true;
  }();
  (void)once;
}

cudaStream_t rank_stream(int device, int slot) {
  std::lock_guard<std::mutex> lock(streams_mutex);
  cudaStream_t& s = streams[{device, slot}];
  if (!s) {
    use_device(device);
    // A blocking stream: work on the legacy default stream (frees from threads
    // without a rank stream) stays ordered after it.
    CPSIM_CUDA(cudaStreamCreate(&s));
  }
  return s;
}

void bind_rank_thread(int device, cudaStream_t stream) {
  use_device(device);
  kernels::current_stream() = stream;
}

}  // namespace cpsim::gpu
