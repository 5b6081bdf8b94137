// The attention kernels against a same-run bound (bench/attention_kernels.cpp).
#pragma once

#include <atomic>
#include <cstdint>

namespace cpsim::bench {

// Registers the attention_kernel/... benchmarks; a host result that differs from
// the functors' bitwise adds to `wrong`. `smoke`: one small shape.
void register_attention_kernels(bool smoke, std::atomic<std::int64_t>& wrong);

}  // namespace cpsim::bench
