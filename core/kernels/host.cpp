// The host instantiation of the one kernel source: Thrust's CPP system, so the
// CPU property suite runs the very functors a GPU runs. Pure data movement
// (rearrangement, position copies) runs as memcpy runs on the host; the functors a
// GPU runs for it are checked against those runs in tests/core/test_kernels.cpp.
#include <array>
#include <atomic>

#include "core/kernels/attention_host.hpp"
#include "core/kernels/conv.hpp"
#include "core/kernels/layers.hpp"
#include "core/kernels/layout.hpp"
#include "core/kernels/movement.hpp"
#include "core/kernels/recurrence.hpp"
#include "core/kernels/reduce.hpp"

namespace cpsim::kernels {

namespace {

const KernelTable host_table{
    [](const Rearrange& a, void*) { rearrange_runs<true>(a); },
    [](const Rearrange& a, void*) { rearrange_runs<false>(a); },
    [](const PositionCopy& a, void*) { copy_position_runs(a); },
    [](const Slice& a, void*) { slice(thrust::host, a); },
    [](const PositionCopy& a, DType dtype, void*) { add_position_runs(a, dtype); },
    [](const DocIds& a, void*) { doc_ids_from_start_runs(a); },
    [](const std::int64_t* ids, std::int64_t* out, std::int64_t rows, std::int64_t len, void*) {
      run_starts(thrust::host, ids, nullptr, out, rows, len);
    },
    [](const std::int64_t* ids, std::int64_t* tails, std::int64_t* positions, std::int64_t rows, std::int64_t len,
       void*) { derived_positions(thrust::host, ids, tails, positions, rows, len); },
    [](const std::int64_t* ids, std::int64_t len, std::int64_t* out, void*) -> std::int64_t {
      return segment_starts(thrust::host, ids, len, out);
    },
    [](const Conv& a, DType dtype, void*) { conv_forward_host(a, dtype); },
    [](const Conv& a, DType dtype, void*) { conv_backward_host(a, dtype); },
    [](const RecurrenceArgs& a, RecurrenceStep pass, void*) { recurrence_pass(thrust::host, a, pass); },
    [](const Sum& a, DType dtype, void*) { sum_in_order_blocks(a, dtype); },
    [](const Rope& a, DType dtype, void*) { rope_host(a, dtype); },
    [](const Attention& a, DType dtype, void*) { attention_forward_host(a, dtype); },
    [](const Attention& a, DType dtype, void*) { attention_backward_host(a, dtype); },
    [](const TopK& a, DType dtype, void*) { topk_select_host(a, dtype); },
    [](const CrossEntropy& a, DType dtype, void*) { cross_entropy_forward(thrust::host, a, dtype); },
    [](const CrossEntropy& a, DType dtype, void*) { cross_entropy_backward(thrust::host, a, dtype); },
};

std::atomic<const KernelTable*> cuda_table{nullptr};

}  // namespace

const KernelTable& kernels_for(Device device) {
  if (device.is_cpu()) return host_table;
  const KernelTable* t = cuda_table.load();
  if (!t) throw Unavailable("no CUDA kernels in this process (a build without CUDA, or no usable device)");
  return *t;
}

void register_kernels(DeviceKind kind, const KernelTable* table) {
  CPSIM_ENFORCE(kind != DeviceKind::cpu, "the host kernels are built in");
  cuda_table.store(table);
}

void*& current_stream() {
  thread_local void* stream = nullptr;
  return stream;
}

}  // namespace cpsim::kernels
