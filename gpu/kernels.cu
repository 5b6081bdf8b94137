// The CUDA instantiation of the one kernel source: the very functors the host
// table runs (core/kernels/*.hpp), built by nvcc and launched by Thrust on the
// caller's stream (kernels::current_stream()).
#include <thrust/system/cuda/execution_policy.h>

#include "core/kernels/conv.hpp"
#include "core/kernels/layers.hpp"
#include "core/kernels/layout.hpp"
#include "core/kernels/movement.hpp"
#include "core/kernels/recurrence.hpp"
#include "core/kernels/reduce.hpp"
#include "gpu/cuda.hpp"

namespace cpsim::gpu {

namespace {

using kernels::index_t;

// Thrust's scratch (scans, compaction) from the device's pool in stream order,
// not cudaMalloc/cudaFree (which would synchronise the device on every scan).
struct StreamAllocator {
  using value_type = char;
  cudaStream_t stream = nullptr;
  char* allocate(std::ptrdiff_t bytes) {
    void* p = nullptr;
    CPSIM_CUDA(cudaMallocAsync(&p, static_cast<std::size_t>(bytes), stream));
    return static_cast<char*>(p);
  }
  void deallocate(char* p, std::size_t) { (void)cudaFreeAsync(p, stream); }
};
// Policies keep a reference to their allocator: one per thread, pointed at the stream.
StreamAllocator& allocator_for(void* stream) {
  thread_local StreamAllocator allocator;
  allocator.stream = static_cast<cudaStream_t>(stream);
  return allocator;
}

// Kernels are queued on the stream; nothing waits for them here.
auto on(void* stream) {
  return thrust::cuda::par_nosync(allocator_for(stream)).on(static_cast<cudaStream_t>(stream));
}
// For the one entry whose result the host needs (a count).
auto on_sync(void* stream) { return thrust::cuda::par(allocator_for(stream)).on(static_cast<cudaStream_t>(stream)); }

const kernels::KernelTable table{
    [](const kernels::Rearrange& a, void* s) { kernels::rearrange<true>(on(s), a); },
    [](const kernels::Rearrange& a, void* s) { kernels::rearrange<false>(on(s), a); },
    [](const kernels::PositionCopy& a, void* s) { kernels::copy_positions(on(s), a); },
    [](const kernels::Slice& a, void* s) { kernels::slice(on(s), a); },
    [](const kernels::PositionCopy& a, DType dtype, void* s) { kernels::add_positions(on(s), a, dtype); },
    [](const kernels::DocIds& a, void* s) { kernels::doc_ids_from_starts(on(s), a); },
    [](const std::int64_t* ids, std::int64_t* out, std::int64_t rows, std::int64_t len, void* s) {
      kernels::run_starts(on(s), ids, nullptr, out, rows, len);
    },
    [](const std::int64_t* ids, std::int64_t* tails, std::int64_t* positions, std::int64_t rows, std::int64_t len,
       void* s) { kernels::derived_positions(on(s), ids, tails, positions, rows, len); },
    [](const std::int64_t* ids, std::int64_t len, std::int64_t* out, void* s) -> std::int64_t {
      return kernels::segment_starts(on_sync(s), ids, len, out);
    },
    [](const kernels::Conv& a, DType dtype, void* s) { kernels::conv_forward(on(s), a, dtype); },
    [](const kernels::Conv& a, DType dtype, void* s) { kernels::conv_backward(on(s), a, dtype); },
    [](const kernels::RecurrenceArgs& a, kernels::RecurrenceStep pass, void* s) { kernels::recurrence_pass(on(s), a, pass); },
    [](const kernels::Sum& a, DType dtype, void* s) { kernels::sum_in_order(on(s), a, dtype); },
    [](const kernels::Rope& a, DType dtype, void* s) { kernels::rope(on(s), a, dtype); },
    [](const kernels::Attention& a, DType dtype, void* s) { kernels::attention_forward(on(s), a, dtype); },
    [](const kernels::Attention& a, DType dtype, void* s) { kernels::attention_backward(on(s), a, dtype); },
    [](const kernels::TopK& a, DType dtype, void* s) { kernels::topk_select(on(s), a, dtype); },
    [](const kernels::CrossEntropy& a, DType dtype, void* s) { kernels::cross_entropy_forward(on(s), a, dtype); },
    [](const kernels::CrossEntropy& a, DType dtype, void* s) { kernels::cross_entropy_backward(on(s), a, dtype); },
};

}  // namespace

const kernels::KernelTable& cuda_kernel_table() { return table; }

}  // namespace cpsim::gpu
