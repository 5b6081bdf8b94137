// One rank of a Gloo group (call_exchange.cpp: the call check over the wire;
// communicator.cpp: the collectives), in a process of a job or on a thread
// (docs/backends.md, "Gloo": the call check, and how a group ends).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"
#include "core/comm/communicator.hpp"
#include "core/comm/side_channel.hpp"
#include "sim/gloo/connect.hpp"
#include "sim/gloo/store.hpp"

namespace gloo {
class Context;
}

namespace cpsim::sim {

// Whether a Gloo exception reports a timeout (rather than a lost connection).
inline bool is_gloo_timeout(const std::string& what) { return what.find("imed out") != std::string::npos; }

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

}  // namespace cpsim::sim
