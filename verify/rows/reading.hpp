// How a run's ranks read the case's global tensors: their slices where each
// rank's packed context puts its shard, in place while a run reads them, and a
// run that writes into one of them fails (verify/rows/reading.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "core/comm/run_ranks.hpp"
#include "verify/properties.hpp"

namespace cpsim::verify::rows {

// The global tensors a run's ranks take their slices of (local()), by name. While
// the run lasts, the ranks of this process read a slice of one of them that is one
// contiguous run (a one-row batch) in place instead of copying it, and after it
// the run throws "a rank wrote into its input NAME" if any of them changed: an
// operator that writes into its input must fail its row, not change what the row
// compares against.
struct Input {
  const char* name;
  const Tensor* tensor;
};
void run_reading(const std::vector<Input>& inputs, int n, const RankFn& fn, const RunOptions& options,
                 const RankOutputs& outputs = {});
// Whether `global` is an input of a run that is reading it now (run_reading).
bool read_in_place(const Tensor& global);
// A fingerprint of a host tensor's bytes (not cryptographic: it finds writes).
std::uint64_t fingerprint(const Tensor& t);

// Rank r's slice of a global [B, P, ...] tensor, where its packed context says its
// shard lies (the model's path: a wrong context is a wrong result, not a crash).
// Shared with the global where run_reading guards it, else a copy.
inline Tensor local(const Tensor& global, const PackedContext& ctx) {
  if (global.dim(0) == 1 && read_in_place(global))
    return global.contiguous_slice(1, ctx.seq_start(), ctx.local_seq_len());
  return narrow(global, 1, ctx.seq_start(), ctx.local_seq_len());
}

// Rank r's slice of the global positions, [B, P] or mRoPE's [3, B, P]: along
// the sequence, each plane's last axis.
inline Tensor local_positions(const Tensor& global, const PackedContext& ctx) {
  return global.ndim() == 3 ? narrow(global, 2, ctx.seq_start(), ctx.local_seq_len()) : local(global, ctx);
}

// A rank's input where its backend keeps tensors (the host, or cuda:N), and a
// result back on the host for the comparison.
inline Tensor on(const Communicator& comm, const Tensor& t) {
  const Device device = comm.device();
  return device.is_cpu() || !t.defined() ? t : t.to(device);
}
inline Tensor host(const Tensor& t) { return !t.defined() || t.is_cpu() ? t : t.to(Device::host()); }

}  // namespace cpsim::verify::rows
