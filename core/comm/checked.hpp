// The call check as a wrapper around any communicator, the way PyTorch's
// ProcessGroupWrapper compares collective fingerprints over a side channel before
// the real collective runs: before each call, every rank's call record is
// exchanged over a CallChannel and compared (find_mismatch); a mismatch is a
// CollectiveError naming every rank's call, on every rank, and the inner call
// never runs. The gloo backend runs its calls this way over its own exchange; the
// nccl backend does over a Gloo side channel. Backends whose ranks share memory
// (threads, cuda-sim) compare the same records with the same check inside their
// rendezvous (core/comm/rendezvous.hpp), which also moves their data.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"

namespace cpsim {

class CallChannel {
 public:
  virtual ~CallChannel() = default;
  // Exchanges this rank's record (numbered here) with every peer and returns all
  // of them, index = rank. Throws CollectiveError when a peer never arrives, or
  // threw or returned instead of calling.
  virtual std::vector<CallRecord> exchange(const CallRecord& mine, std::chrono::milliseconds timeout) = 0;
  // The calls cannot run together: every later call fails with `why`.
  [[noreturn]] virtual void stop(const std::string& why) = 0;
};

// "\n  rank q: in all_gather #3 (count 8, float64)" for every rank.
std::string describe_calls(const std::vector<CallRecord>& calls);

// `inner` with every call checked over `channel` first.
std::unique_ptr<Communicator> checked_communicator(std::unique_ptr<Communicator> inner,
                                                   std::shared_ptr<CallChannel> channel);

}  // namespace cpsim
