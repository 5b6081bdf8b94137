// Internals of the GPU backends (gpu/): CUDA error checks, the device runtime
// and kernel table registration, per-rank streams. Nothing outside gpu/ (and the
// GPU tests and benchmarks) includes CUDA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "core/error.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::gpu {

[[noreturn]] void cuda_fail(cudaError_t error, const char* call, const char* file, int line);

#define CPSIM_CUDA(call)                                                               \
  do {                                                                                 \
    const cudaError_t cpsim_cuda_error_ = (call);                                      \
    if (cpsim_cuda_error_ != cudaSuccess)                                              \
      ::cpsim::gpu::cuda_fail(cpsim_cuda_error_, #call, __FILE__, __LINE__);           \
  } while (0)

// Why no GPU backend can run in this process ("no CUDA device: ..."), or nothing.
std::optional<std::string> cuda_unavailable();
// Visible CUDA devices (0 when there is no usable one).
int cuda_device_count();
// Registers the CUDA device runtime and kernel table once; throws Unavailable
// (with cuda_unavailable()'s reason) when there is no device.
void activate_cuda();

// A stream of `device` for rank slot `slot`, created on first use and kept for
// the life of the process (so no thread ever holds a dangling stream).
cudaStream_t rank_stream(int device, int slot);
// Makes `device` current on this thread and `stream` the stream its kernels,
// allocations and copies run on.
void bind_rank_thread(int device, cudaStream_t stream);
inline cudaStream_t current_cuda_stream() { return static_cast<cudaStream_t>(kernels::current_stream()); }

// The one kernel source built by nvcc (gpu/kernels.cu).
const kernels::KernelTable& cuda_kernel_table();

}  // namespace cpsim::gpu
