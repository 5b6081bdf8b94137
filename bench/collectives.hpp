// Collectives timed the nccl-tests way, each against the hardware's limit in the
// same run, and checked: every timed call's result is compared with what it must
// be (#wrong counts the elements that differ).
//
// `bytes` is the message of one rank: an all_gather sends it and receives n of
// them, a reduce_scatter receives it and sends n, a send_recv (a ring: rank r sends
// to r+1, receives from r-1) sends and receives it. As in nccl-tests, `size` is the
// larger buffer (n * bytes for all_gather and reduce_scatter), algbw = size / time,
// busbw = algbw * (n-1)/n for all_gather and reduce_scatter and = algbw for send_recv.
//
// The reference ("ref"), measured in the same run: as many threads as ranks, each
// copying (memcpy) the bytes its rank's call moves (n * bytes, or bytes for
// send_recv) and then meeting at a std::barrier, the same number of times. For
// small messages that is a barrier round. "vs ref" = ref / time: above 1, the call
// was faster than the reference (a barrier round costs more than a staged copy;
// memcpy through caches may be beaten by a copy that skips them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/side_channel.hpp"

namespace cpsim::bench {

// The collectives the table times: CollectiveKind's all_gather, reduce_scatter, send_recv.
using Op = CollectiveKind;
inline constexpr Op kTimedOps[] = {Op::all_gather, Op::reduce_scatter, Op::send_recv};
Op op_from_name(const std::string& name);  // one of kTimedOps; throws InvalidInput

struct Point {
  std::string backend;
  Op op = Op::all_gather;
  int ranks = 2;
  std::size_t bytes = 0;  // per rank
  std::size_t size = 0;   // nccl-tests size
  std::size_t count = 0;  // float32 elements per rank
  int iterations = 0;
  double time_us = 0;     // one call
  double algbw = 0, busbw = 0;  // GB/s
  std::int64_t wrong = 0;
  double ref_us = 0;      // the same-run reference of one call
  double vs_ref() const { return time_us > 0 ? ref_us / time_us : 0; }
};

// Iterations that keep a point near `budget_bytes` of traffic (at least 5, at most 2000).
int iterations_for(Op op, int ranks, std::size_t bytes);

// Times `iterations` calls of `op` on `backend` after warm-up and checks the last
// result, and the reference right after (one thread per rank, also in a
// multi-process job, where every process measures it in itself). Points that move
// under 1 MiB a call repeat both 5 times and keep each one's median (small calls
// are at the mercy of the scheduler); larger ones alternate them 3 times and keep
// the best of each.
// With `job`, the ranks are the processes of that job.
Point measure(const std::string& backend, Op op, int ranks, std::size_t bytes, int iterations,
              std::shared_ptr<Job> job = nullptr);

// Microseconds of one round of the reference: `threads` threads each memcpy `bytes`
// and meet at a std::barrier.
double ref_us(int threads, std::size_t bytes, int iterations);

// The nccl-tests table of points (one header per backend, op and rank count).
std::string table(const std::vector<Point>& points);
// The points as JSON (an array of objects).
std::string json(const std::vector<Point>& points);
// Bus bandwidth against size, one panel per op and rank count, one line per
// backend and its reference dashed.
std::string svg(const std::vector<Point>& points);

// "8", "64K", "16M", "1G" (binary units) to bytes; throws InvalidInput.
std::size_t parse_size(const std::string& text);
std::string size_text(std::size_t bytes);

}  // namespace cpsim::bench
