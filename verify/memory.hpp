// How much memory `cpsim check` needs for a batch at a CP size, estimated before
// anything is allocated, so that a batch too large for the machine is refused
// with the estimate (exit 2) instead of ending in an allocation failure.
//
// The properties run one after another and free what they held, so the peak is
// the largest row's, on top of what every row shares (the batch, its layout and
// every rank's packed context). Each row's peak is a per-token model of the
// tensors it holds at once (fitted to peak RSS measured with `cpsim check`, and
// kept an upper bound by a test that measures it again): with all ranks in one
// process, the gather rows hold a whole [B, P, C] tensor per rank, so they grow
// with cp x channels; the recurrence holds every token's K x V state per head.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/bytes.hpp"  // format_bytes, for the estimates
#include "verify/properties.hpp"

namespace cpsim::verify {

struct MemoryEstimate {
  std::int64_t bytes = 0;   // peak, for the whole process
  std::string largest_row;  // the row whose peak it is
  double per_token = 0;     // bytes per token of the padded batch (B x P) at that peak
};

// The peak memory of every property on a batch of `rows` x `seq_len` tokens and
// `keys` [B, S] keys at CP size `cp`, with the model shapes and backend of `o`.
MemoryEstimate estimate_check_memory(std::int64_t rows, std::int64_t seq_len, int keys, int cp, const CheckOptions& o);

// Whether every row of the property table has a memory model and a time model (a
// test keeps it so).
bool every_row_has_a_memory_model();

// How much CPU time `cpsim check` takes on a batch at a CP size, estimated before
// it runs, per row (those of o.rows, or every row): each row costs a per-token
// time that grows with cp (fitted to `cpsim check --json`'s cpu_seconds on the
// threads backend at the default model shapes: 128k and 256k tokens of short and
// long documents at CP 1 and 8), scaled by its memory model's bytes at o's shapes
// over those at the defaults; the attention rows add their (query, key) pairs
// (attention_work). Within about a factor of 2 of what it measures.
struct TimeEstimate {
  double seconds = 0;
  std::vector<std::pair<std::string, double>> rows;  // each row's, in the table's order
};
TimeEstimate estimate_check_time(std::int64_t tokens, std::int64_t attention_pairs, int cp, const CheckOptions& o);

// The default limit: 80% of this machine's memory (the smaller of physical memory
// and a cgroup's limit), or half the address-space limit (ulimit -v) when that is
// smaller, and where it came from.
struct MemoryLimit {
  std::int64_t bytes = 0;
  std::string source;
};
MemoryLimit default_memory_limit();


}  // namespace cpsim::verify
