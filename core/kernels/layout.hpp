// Layout kernels of the one kernel source: document ids and padding from the
// documents' start offsets, run starts (segment starts per position, by a scan),
// derived positions (by a segmented scan), and segment boundaries (by a stream
// compaction).
#pragma once

#include <thrust/binary_search.h>
#include <thrust/copy.h>
#include <thrust/functional.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/iterator/transform_output_iterator.h>
#include <thrust/scan.h>

#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

// Token t of row b lies in document i when starts[i] <= t < starts[i+1] (the last
// such i: zero-length documents hold no token); real iff t - starts[i] < real[i].
// A thread searches the starts once, then walks: index j is lane j % kLanes of a
// group of kLanes * kSteps positions of a row, and takes the group's positions
// lane, lane + kLanes, ... (at each step neighbouring indices write neighbouring
// positions, which is how a GPU's threads write at the speed of a copy).
struct DocIdsFromStarts {
  static constexpr index_t kLanes = 32, kSteps = 16, kGroup = kLanes * kSteps;
  const std::int64_t* starts;  // [B][D+1]
  const std::int64_t* real;    // [B][D]
  std::int64_t* ids;           // [B][S]
  bool* padding;               // [B][S]
  index_t S, D;
  index_t groups;  // per row: ceil(S / kGroup)
  static CPSIM_HD index_t threads(index_t rows, index_t S) { return rows * ((S + kGroup - 1) / kGroup) * kLanes; }
  CPSIM_HD void operator()(index_t j) const {
    const auto [row_group, lane] = split_index(j, kLanes);
    const auto [b, g] = split_index(row_group, groups);
    index_t t = g * kGroup + lane;
    if (t >= S) return;
    const std::int64_t* s = starts + b * (D + 1);
    // Binary search: the last document whose start is <= t.
    index_t lo = 0, hi = D + 1;  // s[lo] <= t < s[hi] (s[D+1] taken as infinity)
    while (hi - lo > 1) {
      const index_t mid = (lo + hi) / 2;
      if (s[mid] <= t) lo = mid;
      else hi = mid;
    }
    for (index_t k = 0; k < kSteps && t < S; ++k, t += kLanes) {
      while (lo < D && s[lo + 1] <= t) ++lo;  // the same document as a search from t would find
      const index_t i = b * S + t;
      if (lo >= D) {  // past the last document
        ids[i] = 0;
        padding[i] = true;
      } else {
        ids[i] = lo + 1;
        padding[i] = t - s[lo] >= real[b * D + lo];
      }
    }
  }
};

// The host's doc_ids_from_starts: each document's run filled in one loop (the
// functor searches once per thread, then walks); bitwise the same.
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

// Whether (b, t) starts a run of equal ids: a row's first position, or an id
// other than the previous one. With `tails`, the padding run that ends a row
// after a document continues that document's run (SPEC §1 derived positions).
CPSIM_HD inline bool starts_run(const std::int64_t* ids, const std::int64_t* tails, index_t i, RowOffset at) {
  return at.offset == 0 || (ids[i] != ids[i - 1] && !(tails && at.offset == tails[at.row]));
}

// Both run scans carry one 64-bit word: its top bit says "a run starts in here",
// the rest is the scan's payload, read back without the bit.
constexpr std::uint64_t kRunStarts = std::uint64_t{1} << 63;
struct WithoutMark {
  CPSIM_HD std::int64_t operator()(std::uint64_t v) const { return static_cast<std::int64_t>(v & ~kRunStarts); }
};

// Run starts: a marked word holding t where a run starts, else 0; the scan keeps
// the last marked word (every row's first position is marked, so no run reaches
// into the previous row).
struct RunStartStep {
  const std::int64_t* ids;
  const std::int64_t* tails;  // [B]: first position of the row's trailing padding run, or nullptr
  index_t len;
  CPSIM_HD std::uint64_t operator()(index_t i) const {
    const RowOffset at = split_index(i, len);
    return starts_run(ids, tails, i, at) ? kRunStarts | static_cast<std::uint64_t>(at.offset) : 0;
  }
};
struct LastMarked {
  CPSIM_HD std::uint64_t operator()(std::uint64_t a, std::uint64_t b) const { return (b & kRunStarts) ? b : a; }
};

// Derived positions count the positions since the run's start: a segmented sum
// of ones, its segments the runs, the mark where a run starts. combine(a, b) is b
// when b holds a start, else a with b's count added (associative: the standard
// segmented-scan operator).
struct PositionStep {
  const std::int64_t* ids;
  const std::int64_t* tails;
  index_t len;
  CPSIM_HD std::uint64_t operator()(index_t i) const {
    return starts_run(ids, tails, i, split_index(i, len)) ? kRunStarts : 1;
  }
};
struct SegmentedCount {
  CPSIM_HD std::uint64_t operator()(std::uint64_t a, std::uint64_t b) const { return (b & kRunStarts) ? b : a + b; }
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

// A segment boundary of one row: where a run starts (no tail rule).
struct IsBoundary {
  const std::int64_t* ids;
  CPSIM_HD bool operator()(index_t t) const { return starts_run(ids, nullptr, t, RowOffset{0, t}); }
};

template <class Policy>
void doc_ids_from_starts(Policy&& policy, const DocIds& a) {
  const DocIdsFromStarts f{a.starts, a.real, a.ids, a.padding, a.seq_len, a.docs,
                           (a.seq_len + DocIdsFromStarts::kGroup - 1) / DocIdsFromStarts::kGroup};
  for_each_index(policy, DocIdsFromStarts::threads(a.rows, a.seq_len), f);
}

// out[b][t] = first position of the run of equal ids holding (b, t): one scan.
template <class Policy>
void run_starts(Policy&& policy, const std::int64_t* ids, const std::int64_t* tails, std::int64_t* out, index_t rows,
                index_t len) {
  if (rows * len == 0) return;
  const auto steps = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), RunStartStep{ids, tails, len});
  thrust::inclusive_scan(policy, steps, steps + rows * len, thrust::make_transform_output_iterator(out, WithoutMark{}),
                         LastMarked{});
}

// Offsets inside each run; a row's trailing padding continues its last document.
// One pass over the rows' ends, then one scan.
template <class Policy>
void derived_positions(Policy&& policy, const std::int64_t* ids, std::int64_t* tails, std::int64_t* positions,
                       index_t rows, index_t len) {
  if (rows * len == 0) return;
  for_each_index(policy, rows, TrailingPadding{ids, tails, len});
  const auto steps = thrust::make_transform_iterator(thrust::counting_iterator<index_t>(0), PositionStep{ids, tails, len});
  thrust::inclusive_scan(policy, steps, steps + rows * len, thrust::make_transform_output_iterator(positions, WithoutMark{}),
                         SegmentedCount{});
}

// Starts of the runs of equal ids in one row; returns how many.
template <class Policy>
index_t segment_starts(Policy&& policy, const std::int64_t* ids, index_t len, std::int64_t* out) {
  const auto first = thrust::counting_iterator<index_t>(0);
  return thrust::copy_if(policy, first, first + len, out, IsBoundary{ids}) - out;
}

}  // namespace cpsim::kernels
