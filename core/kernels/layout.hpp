// Layout kernels of the one kernel source: document ids and padding from the
// documents' start offsets, run starts (segment starts per position, by a scan),
// derived positions, and segment boundaries (by a stream compaction).
#pragma once

#include <thrust/binary_search.h>
#include <thrust/copy.h>
#include <thrust/functional.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/scan.h>

#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

// Token t of row b lies in document i when starts[i] <= t < starts[i+1] (the last
// such i: zero-length documents hold no token); real iff t - starts[i] < real[i].
struct DocIdsFromStarts {
  const std::int64_t* starts;  // [B][D+1]
  const std::int64_t* real;    // [B][D]
  std::int64_t* ids;           // [B][S]
  bool* padding;               // [B][S]
  index_t S, D;
  CPSIM_HD void operator()(index_t i) const {
    const index_t b = i / S, t = i - b * S;
    const std::int64_t* s = starts + b * (D + 1);
    // Binary search: the last document whose start is <= t.
    index_t lo = 0, hi = D + 1;  // s[lo] <= t < s[hi] (s[D+1] taken as infinity)
    while (hi - lo > 1) {
      const index_t mid = (lo + hi) / 2;
      if (s[mid] <= t) lo = mid;
      else hi = mid;
    }
    if (lo >= D) {  // past the last document
      ids[i] = 0;
      padding[i] = true;
      return;
    }
    ids[i] = lo + 1;
    padding[i] = t - s[lo] >= real[b * D + lo];
  }
};

// The host's doc_ids_from_starts: each document's run filled in one loop (the
// functor binary-searches the starts for every position); bitwise the same.
inline void doc_ids_from_start_runs(const DocIds& a) {
  for (index_t b = 0; b < a.rows; ++b) {
    const std::int64_t* s = a.starts + b * (a.docs + 1);
    std::int64_t* ids = a.ids + b * a.seq_len;
    bool* padding = a.padding + b * a.seq_len;
    index_t t = 0;
    for (index_t d = 0; d < a.docs; ++d) {
      // Positions [s[d], s[d+1]) belong to document d (the functor's last start
      // <= t); its first real[d] are real.
      const index_t end = s[d + 1] < a.seq_len ? s[d + 1] : a.seq_len;
      for (; t < end; ++t) {
        ids[t] = d + 1;
        padding[t] = t - s[d] >= a.real[b * a.docs + d];
      }
    }
    for (; t < a.seq_len; ++t) ids[t] = 0, padding[t] = true;  // past the last document
  }
}

// Row of a flat position.
struct RowOf {
  index_t len;
  CPSIM_HD index_t operator()(index_t i) const { return i / len; }
};

// i where a run starts, else 0 (a scan with maximum then gives each position its
// run's start). With `tails`, the padding run that ends a row after a document
// continues that document's run (SPEC §1 derived positions).
struct RunStartFlag {
  const std::int64_t* ids;
  const std::int64_t* tails;  // [B]: first position of the row's trailing padding run, or nullptr
  index_t len;
  CPSIM_HD index_t operator()(index_t i) const {
    const index_t b = i / len, t = i - b * len;
    if (t == 0) return t;
    const bool boundary = ids[i] != ids[i - 1] && !(tails && t == tails[b]);
    return boundary ? t : 0;
  }
};

// The trailing padding run of row b starts at tails[b] (len when there is none).
struct TrailingPadding {
  const std::int64_t* ids;
  std::int64_t* tails;
  index_t len;
  CPSIM_HD void operator()(index_t b) const {
    index_t t = len;
    while (t > 0 && ids[b * len + t - 1] == 0) --t;
    tails[b] = t;
  }
};

struct PositionFromStart {
  std::int64_t* positions;  // holds run starts on entry
  index_t len;
  CPSIM_HD void operator()(index_t i) const { positions[i] = (i % len) - positions[i]; }
};

struct IsBoundary {
  const std::int64_t* ids;
  CPSIM_HD bool operator()(index_t t) const { return t == 0 || ids[t] != ids[t - 1]; }
};

template <class Policy>
void doc_ids_from_starts(Policy&& policy, const DocIds& a) {
  for_each_index(policy, a.rows * a.seq_len, DocIdsFromStarts{a.starts, a.real, a.ids, a.padding, a.seq_len, a.docs});
}

// out[b][t] = first position of the run of equal ids holding (b, t).
template <class Policy>
void run_starts(Policy&& policy, const std::int64_t* ids, const std::int64_t* tails, std::int64_t* out, index_t rows,
                index_t len) {
  if (rows * len == 0) return;
  const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), RowOf{len});
  const auto flags = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), RunStartFlag{ids, tails, len});
  thrust::inclusive_scan_by_key(policy, keys, keys + rows * len, flags, out, thrust::equal_to<index_t>(),
                                thrust::maximum<index_t>());
}

// Offsets inside each run; a row's trailing padding continues its last document.
template <class Policy>
void derived_positions(Policy&& policy, const std::int64_t* ids, std::int64_t* tails, std::int64_t* positions,
                       index_t rows, index_t len) {
  for_each_index(policy, rows, TrailingPadding{ids, tails, len});
  run_starts(policy, ids, tails, positions, rows, len);
  for_each_index(policy, rows * len, PositionFromStart{positions, len});
}

// Starts of the runs of equal ids in one row; returns how many.
template <class Policy>
index_t segment_starts(Policy&& policy, const std::int64_t* ids, index_t len, std::int64_t* out) {
  const auto first = thrust::counting_iterator<index_t>(0);
  return thrust::copy_if(policy, first, first + len, out, IsBoundary{ids}) - out;
}

}  // namespace cpsim::kernels
