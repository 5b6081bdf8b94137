// The `gloo` backend (sim/gloo/: store.cpp stores and failure records, connect.cpp
// devices and connections, rank.cpp the call exchange, communicator.cpp the
// collectives, pool.cpp in-process groups and the registration). Every
// collective runs over Gloo's TCP transport, between
// threads of one process (in-process mode) or between processes on one or many
// hosts (the side channel of a multi-process job, sim/job/). Both share GlooRank.
//
// Before any byte moves, each call is checked: the ranks exchange a small record
// of the call (kind, sequence number, count, dtype, root, peers) all-to-all, so
// mismatched collectives, mispaired send_recv, a rank that returned or threw and a
// rank that never arrives become the same CollectiveErrors the threads backend
// gives, naming every rank's call, on every rank. That exchange is also what
// barrier() is (an all-to-all barrier).
//
// Reductions gather every rank's contribution (gloo allgather / alltoall) and add
// them in rank order with sum_in_order, so results are bitwise the threads ones.
//
// Two ways a group ends:
//   stopped  a mismatch, or a rank that threw or returned, seen by every rank in
//            the same exchange: the transport is clean, the group is reused;
//   broken   a timeout or a lost connection: this rank records why in the store
//            (key failed/<rank>), closes its connections so its peers fail at
//            once, and every later call throws. Peers that lose a connection read
//            the records to name the rank that failed.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/communicator.hpp"
#include "core/comm/call_check.hpp"
#include "core/comm/job.hpp"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
namespace transport {
class Device;
}
}  // namespace gloo

namespace cpsim::sim {

using Store = gloo::rendezvous::Store;

// A store (where the processes of a job meet and leave failure records) from its spec: "memory" (this process only), "file:DIR"
// (a directory every process can reach) or "redis://HOST:PORT". Throws
// InvalidInput on a malformed spec.
std::shared_ptr<Store> open_store(const std::string& spec);

// The time one command to a Redis store, or one wait for a key, may take, for
// every store of this process (none until set): a job sets its timeout, so a
// store behind a cut link fails its command instead of blocking until TCP gives
// up, and a key that never comes is given up on with the job; a rank that is
// failing shortens it (its records are worth a moment, not another timeout).
void limit_store_commands(std::chrono::milliseconds limit);
void shorten_store_commands(std::chrono::milliseconds limit);  // to at most `limit`

// Failure records (key failed/<rank> of a job) that cpsim launch writes for a
// process that died carry this tag; they are the root cause and are named first.
inline constexpr const char* kLaunchRecordTag = "(seen by cpsim launch)";

// Whether a Gloo exception reports a timeout (rather than a lost connection).
inline bool is_gloo_timeout(const std::string& what) { return what.find("imed out") != std::string::npos; }

// Sets `key` of `store` (opened from `spec`) to `value` unless a value is there:
// atomically, across processes and hosts (Redis SETNX, an exclusive create in a
// file store's directory, the in-memory store's lock). Returns the value that was
// there first when this claim lost.
std::optional<std::string> claim_key(const std::string& spec, Store& store, const std::string& key,
                                     const std::string& value);

// Whether `key` is in the store now (no waiting).
bool store_has(Store& store, const std::string& key, bool* failed = nullptr);  // *failed: the store did not answer

// The failure record of `rank` (key failed/<rank>), if one is in the store now.
std::optional<std::string> failure_record(Store& records, int rank, bool* failed = nullptr);
// Whether a record is one cpsim launch wrote for a process that died.
bool is_launch_record(const std::string& record);
// The records cpsim launch wrote for dead processes among ranks [0, size) other
// than `except`, each on a line of its own ("\n  ..."), or "".
std::string launch_records(Store& records, int size, int except);

// The TCP device ranks listen on. `host` is an address or host name to bind; empty
// means CPSIM_GLOO_HOST, else the interface CPSIM_GLOO_IFNAME, else this host's name.
std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& host);

// Connects rank `rank` of `size` through `store` (every rank calls it with the
// same store contents); throws CollectiveError if peers do not come in time.
// With `records` (the job's failure records, process mode), ranks first announce
// themselves and a peer that cpsim launch saw die is named at once.
// The first call ignores SIGPIPE if nothing handles it, so that a dead peer is
// an error on the write, not the end of this process.
std::shared_ptr<gloo::Context> connect_gloo(int rank, int size, Store& store,
                                            const std::shared_ptr<gloo::transport::Device>& device,
                                            std::chrono::milliseconds timeout, Store* records = nullptr);

// Gloo's threads and the threads that call Gloo run under SCHED_BATCH (Linux),
// which never preempts a running thread when it wakes up. Gloo's TCP loop thread
// handles a socket only when it gets the connection's lock (try_lock), and spins
// on the readable socket while it cannot; when ranks outnumber cores, a wakeup
// that preempted the thread holding that lock (a rank in a send) left the loop
// spinning for the rest of a time slice. Measured on 2 cores, 4 processes, 8-byte
// all_gather: 6.1 ms a call and 1.6 cores of system time; 0.2 ms with every Gloo
// thread under SCHED_BATCH (docs/backends.md).
//
// enter_batch_scheduling: the calling thread runs under SCHED_BATCH from now on
// (a thread under another policy than SCHED_OTHER is left as it is); true when
// this call switched it. A process that is a rank of a job keeps it; an
// in-process rank thread, shared with other backends, leaves it when its run ends
// (leave_batch_scheduling). Switching at every call instead cost half the gain.
bool enter_batch_scheduling();
void leave_batch_scheduling();
// Leaves batch scheduling when it ends, if `leave`.
struct BatchScope {
  bool leave;
  ~BatchScope() {
    if (leave) leave_batch_scheduling();
  }
};

class GlooRank : public SideChannel, public std::enable_shared_from_this<GlooRank> {
 public:
  // `records` holds the failure records of the job (keys failed/<rank>); it may
  // be shared with other groups of the same job. With `processes`, peers are
  // processes that a launcher may report dead: a lost peer waits for that record.
  GlooRank(std::shared_ptr<gloo::Context> context, int rank, int size, std::shared_ptr<Store> records,
           std::chrono::milliseconds timeout, bool processes);
  ~GlooRank();

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  // The side channel's bytes, as checked calls of this rank.
  void broadcast_bytes(void* data, std::size_t bytes, int root) override;
  void all_gather_bytes(const void* in, void* out, std::size_t bytes) override;

  // A run starts: sequence numbers restart at 1 and a stopped group runs again.
  void begin(std::chrono::milliseconds timeout);
  // A view of this rank for the operators; valid while this GlooRank lives.
  std::unique_ptr<Communicator> communicator();
  // The rank's function returned: the last exchange tells waiting peers.
  void finish();
  // The rank's function threw `what` outside any exchange: tells the peers, so
  // each fails with "rank R threw: what". Never throws.
  void fail(const std::string& what) noexcept;

  bool broken() const { return !broken_.empty(); }
  const std::string& broken_reason() const { return broken_; }
  // How this group's reports name its ranks: a group of some of a job's
  // processes (or of a spawn's threads) names group rank q by its global rank,
  // under which its failure record is kept too (default: the same number).
  void set_names(RankNames names) { names_ = std::move(names); }
  RankNames names() const override { return names_; }

  // One call of the protocol: every rank's record and status. A rank that threw
  // or returned while others call stops the run.
  enum class Status : std::uint8_t { call, returned, threw };
  std::vector<CallRecord> exchange(const CallRecord& mine, Status status, const std::string& text,
                                   std::chrono::milliseconds timeout);
  // The CallChannel the checked communicator runs over.
  std::vector<CallRecord> exchange(const CallRecord& mine, std::chrono::milliseconds timeout) override;
  [[noreturn]] void stop(const std::string& why) override;
  // For the next exchange only: once any of ranks [0, first) has arrived (the
  // group's run is over), wait at most `then` for the rest (ranks that sat a run
  // out wait long for the group, but not for a peer that stops answering after
  // the group is done).
  void patience(int first, std::chrono::milliseconds then) {
    patience_first_ = first;
    patience_ = then;
  }
  // `call` with the number of this rank's latest call, for transport errors.
  CallRecord numbered(CallRecord call) const {
    call.seq = seq_;
    return call;
  }
  // Moves data after a successful exchange; a transport failure breaks the group.
  // `f` may narrow down the peers it still waits for (awaiting()), so that a
  // timeout names them; by default every peer is.
  template <class F>
  void transport(const CallRecord& call, F&& f);
  std::vector<int>& awaiting() { return awaiting_; }

  std::chrono::milliseconds pick(CallOptions o) const { return o.timeout_or(timeout_); }
  gloo::Context& context() { return *context_; }
  const std::shared_ptr<gloo::Context>& context_ptr() const { return context_; }

 private:
  [[noreturn]] void break_group(const std::string& why, const std::vector<int>& suspects,
                                std::chrono::milliseconds timeout);
  std::string records_of(const std::vector<int>& suspects, std::chrono::milliseconds timeout);

  std::shared_ptr<gloo::Context> context_;
  int rank_, size_;
  RankNames names_;
  std::shared_ptr<Store> records_;
  std::chrono::milliseconds timeout_;
  bool processes_;
  std::uint64_t seq_ = 0;
  CallRecord current_;
  int patience_first_ = 0;
  std::chrono::milliseconds patience_{0};
  std::vector<int> awaiting_;  // the peers the current transport still waits for
  std::string stopped_;  // why this run stopped (empty: in step)
  std::string broken_;   // why the group is broken (empty: usable)
};

// Runs f; gloo and other transport exceptions break the group with a message
// naming the call.
template <class F>
void GlooRank::transport(const CallRecord& call, F&& f) {
  enter_batch_scheduling();
  const auto start = std::chrono::steady_clock::now();
  awaiting_.clear();
  for (int q = 0; q < size_; ++q)
    if (q != rank_) awaiting_.push_back(q);
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string ranks = names_.ranks(awaiting_);
    break_group(is_gloo_timeout(what)
                    ? call_timeout(rank_, call, start, pick({}), names_) + " for data from " + ranks + " (gloo: " +
                          what + ")"
                    : names_.rank(rank_) + " lost " + ranks + " during " + describe_call(call, names_) + names_.on() +
                          " (gloo: " + what + ")",
                std::vector<int>(awaiting_), timeout_);
  }
}

// In-process groups: n ranks as threads of this process, each with its own Gloo
// context over loopback TCP, rendezvous through an in-memory store. Groups are
// kept per size and reused across runs; a broken group is replaced.
class GlooThreadsGroup {
 public:
  GlooThreadsGroup(int size, std::chrono::milliseconds timeout);
  ~GlooThreadsGroup();
  int size() const { return size_; }
  // Called on rank r's thread: connects it on first use, then begins a run whose
  // reports name the ranks by `names`.
  std::unique_ptr<Communicator> communicator(int rank, std::chrono::milliseconds timeout, const RankNames& names);
  void finish(int rank);
  void fail(int rank, const std::string& what);
  bool broken() const;

 private:
  int size_;
  std::chrono::milliseconds connect_timeout_;
  std::shared_ptr<Store> store_;
  std::vector<std::shared_ptr<GlooRank>> ranks_;
};

// A group of `n` ranks for one run_ranks call, from the pool or new; give it back
// with release_gloo_group once every rank has stopped.
std::shared_ptr<GlooThreadsGroup> acquire_gloo_group(int n, std::chrono::milliseconds timeout);
void release_gloo_group(const std::shared_ptr<GlooThreadsGroup>& group);

}  // namespace cpsim::sim
