// What every backend checks before it moves a byte: the calls all ranks made at
// one sequence number must be the same collective with the same sizes, dtypes
// and roots, and send_recv peers must pair up. Backends in one process compare
// the records in shared memory (core/comm/rendezvous.hpp); the gloo backend
// exchanges them over the wire, and nccl over a Gloo side channel.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/communicator.hpp"

namespace cpsim {

// One rank's call as the rendezvous sees it.
struct CallRecord {
  CollectiveKind kind = CollectiveKind::barrier;
  std::uint64_t seq = 0;  // 1-based sequence number of this rank's calls
  std::size_t count = 0;  // elements (for send_recv: elements sent)
  DType dtype = DType::f32;
  int root = -1;
  int dst = -1, src = -1;
  std::size_t recv_count = 0;
  const void* send = nullptr;
  void* recv = nullptr;
  // In-process backends: `send` points at a staged copy that stays valid after
  // this rank returns, so peers need not finish reading before it does. A call
  // skips the wait for readers only when every rank's record is staged (a group
  // decision: one rank may stage a small send while it receives a large one).
  bool staged = false;
};

// The record of one call (seq left 0: the rendezvous numbers calls).
CallRecord call_record(CollectiveKind kind, std::size_t count = 0, DType dtype = DType::f32);
CallRecord send_recv_record(const SendRecv& step, DType dtype);

// "all_gather #3 (count 8, float64)".
std::string describe_call(const CallRecord& call);

// "rank 2", or "ranks 0, 3": how every error names a set of ranks.
std::string name_ranks(const std::vector<int>& ranks);

// "waited 1003 ms (limit 1000 ms)": how every timeout says the real wait (since
// `start`) beside the limit.
std::string waited_since(std::chrono::steady_clock::time_point start, std::chrono::milliseconds limit);
// "timeout: rank 0 waited 1003 ms (limit 1000 ms) in all_gather #1 (...)": how
// every timeout in a call begins, on every backend.
std::string call_timeout(int rank, const CallRecord& call, std::chrono::steady_clock::time_point start,
                         std::chrono::milliseconds limit);

// Why the calls of one sequence number (index = rank) cannot run together, or nothing.
std::optional<std::string> find_mismatch(const std::vector<CallRecord>& calls);

}  // namespace cpsim
