// The call check, in one place: what every backend checks before it moves a byte
// (the rule), how a failed call is reported (the report), and the check as a
// wrapper around any communicator (the wrapper).
//
// The rule: the calls all ranks made at one sequence number must be the same
// collective with the same sizes, dtypes and roots, and send_recv peers must pair
// up (find_mismatch).
//
// The wrapper (checked_communicator), the way PyTorch's ProcessGroupWrapper
// compares collective fingerprints over a side channel before the real
// collective runs: before each call, every rank's record is exchanged over a
// CallChannel and compared; a mismatch is a CollectiveError naming every rank's
// call, on every rank, and the inner call never runs. gloo runs its calls this
// way over its own exchange, nccl over the in-memory rendezvous (one process) or
// the job's side channel. The in-memory rendezvous (core/comm/rendezvous.hpp)
// compares the records as the ranks meet: a channel over it says so (checks()),
// and the wrapper does not compare again; threads and cuda-sim, which move their
// data in that same rendezvous, need no wrapper at all.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
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
  CallLabel label;  // the caller's name for the call (CallOptions::label), or empty
};

// How a group's reports name its ranks: by the number its user reads (the rank in
// the spawn or the job: `global`), and the group itself where it is not every rank
// (a subgroup: new_group, a DeviceMesh dimension). Every report of a group's call
// goes through its names, on every backend.
struct RankNames {
  std::vector<int> global;  // group rank -> global rank; empty: the same numbers
  std::string group;        // "the group of ranks 1, 3"; empty: the world (every rank)
  // What a global rank does in another group's collective ("in all_reduce at
  // step.py:9 on the group of ranks 1, 3"), where the caller knows (the ranks of
  // a spawn share one board), or "": a rank not in this group's call says it.
  std::function<std::string(int global)> elsewhere;
  // The names of a group of these global ranks in a world of `world` ranks (no
  // group label when it is the whole world, in order).
  static RankNames of(std::vector<int> global, int world);
  int number(int q) const;
  std::string rank(int q) const;                        // "rank 3"
  std::string ranks(const std::vector<int>& qs) const;  // "ranks 1, 3" (global, ascending as given), or "no rank"
  std::string on() const;                               // " on the group of ranks 1, 3", or ""
  bool world() const { return group.empty(); }
};

// The record of one call (seq left 0: the rendezvous numbers calls).
CallRecord call_record(CollectiveKind kind, std::size_t count = 0, DType dtype = DType::f32,
                       const CallLabel& label = {});
CallRecord send_recv_record(const SendRecv& step, DType dtype);

// The call's name: the caller's (its label), else the collective's.
std::string call_name(const CallRecord& call);

// "all_gather #3 (count 8, float64)" (a send_recv's peers and a root named by `names`).
std::string describe_call(const CallRecord& call, const RankNames& names = {});

// "rank 2", or "ranks 0, 3": how every error names a set of ranks (of the world).
std::string name_ranks(const std::vector<int>& ranks);

// "waited 1003 ms (limit 1000 ms)": how every timeout says the real wait (since
// `start`) beside the limit.
std::string waited_since(std::chrono::steady_clock::time_point start, std::chrono::milliseconds limit);
// "timeout: rank 0 waited 1003 ms (limit 1000 ms) in all_gather #1 (...)": how
// every timeout in a call begins, on every backend.
// On a subgroup it names the global rank and the group ("... in all_reduce #1
// (...) on the group of ranks 1, 3").
std::string call_timeout(int rank, const CallRecord& call, std::chrono::steady_clock::time_point start,
                         std::chrono::milliseconds limit, const RankNames& names = {});
// Whether a report (or its first line) begins as call_timeout's do.
bool is_call_timeout(const std::string& report);

// What a rank was doing when its group stopped. Every backend's report of a call
// that cannot complete ends with one line per rank (describe_ranks), so one fault
// reads the same on threads, gloo, cuda-sim and nccl.
struct RankActivity {
  enum class Phase { calling, idle, returned, threw };
  Phase phase = Phase::idle;
  // calling: the call it is in; otherwise the last call it completed (seq 0: none).
  CallRecord call;
  std::string failure;  // threw: what
};
// "\n  rank q: in all_gather #3 (...)", "not in a collective (last completed:
// ...)", "returned (last completed: ...)" or "threw: ... (last completed: ...)",
// one line per rank (index = group rank; each named by `names`). A failure is
// its first line (the rest is its own report); an empty one is "threw" alone
// (the report's first line already says what). On a subgroup, "not in a
// collective" is "not in a call on this group": the rank may be in another's.
std::string describe_ranks(const std::vector<RankActivity>& ranks, const RankNames& names = {});
// The same for ranks that are all in a call: "\n  rank q: in all_gather #3 (...)".
std::string describe_calls(const std::vector<CallRecord>& calls, const RankNames& names = {});

// Why the calls of one sequence number (index = group rank) cannot run together, or nothing.
std::optional<std::string> find_mismatch(const std::vector<CallRecord>& calls, const RankNames& names = {});

class CallChannel {
 public:
  virtual ~CallChannel() = default;
  // Exchanges this rank's record (numbered here) with every peer and returns all
  // of them, index = rank. Throws CollectiveError when a peer never arrives, or
  // threw or returned instead of calling.
  virtual std::vector<CallRecord> exchange(const CallRecord& mine, std::chrono::milliseconds timeout) = 0;
  // The calls cannot run together: every later call fails with `why`.
  [[noreturn]] virtual void stop(const std::string& why) = 0;
  // Whether exchange() already applied the rule (and threw a mismatch itself).
  virtual bool checks() const { return false; }
  // How the reports of this channel's group name its ranks.
  virtual RankNames names() const { return {}; }
};

// `inner` with every call checked over `channel` first.
std::unique_ptr<Communicator> checked_communicator(std::unique_ptr<Communicator> inner,
                                                   std::shared_ptr<CallChannel> channel);

}  // namespace cpsim
