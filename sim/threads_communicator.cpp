// The `threads` backend: ranks are threads of one process and collectives move
// bytes through shared memory: large messages one copy per byte (each rank pulls
// what it needs straight from its peers' buffers, found through the rendezvous),
// small ones through two staging slots per rank, which saves the second
// rendezvous. Reductions add in rank order, so results are bitwise deterministic.
// Every call goes through core/comm/rendezvous.hpp, which checks it against the
// peers' calls and turns distributed bugs into CollectiveErrors on every rank.
// Registered as "threads".

#include "core/comm/communicator.hpp"
#include "core/comm/rendezvous.hpp"

#include <array>
#include <cstring>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/reduce.hpp"

namespace cpsim::sim {

namespace {

constexpr Capabilities kThreadsCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/false,
                                            /*stream_ordered=*/false};

// Small messages go through two staging slots per rank (alternating by call): a
// rank copies what it publishes there, and its peers read the slot instead of its
// buffer, so no rank waits for its peers to finish reading (one rendezvous a call
// instead of two). A slot is rewritten two calls later, after every rank has
// arrived at the call between, so after every reader is done with it. Large
// messages are read straight from the buffers (one copy per byte).
constexpr std::size_t kStagedBytes = 64 << 10;

struct Staging {
  explicit Staging(int n) : slots(n) {}
  std::vector<std::array<std::vector<std::byte>, 2>> slots;  // [rank][call parity]
};

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Rendezvous> group, std::shared_ptr<Staging> staging, int rank)
      : group_(std::move(group)), staging_(std::move(staging)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::chrono::milliseconds timeout() const override { return group_->timeout(); }
  std::string backend_name() const override { return "threads"; }
  Capabilities capabilities() const override { return kThreadsCapabilities; }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::all_gather, 0, count, dt};
    c.send = send;
    c.recv = recv;
    const std::size_t bytes = count * dtype_size(dt);
    stage(c, bytes);
    group_->run(
        rank_, c, pick(o),
        [&](const std::vector<CallRecord>& all) {
          for (std::size_t q = 0; q < all.size(); ++q)
            if (bytes) std::memcpy(static_cast<std::byte*>(recv) + q * bytes, all[q].send, bytes);
        },
        {});
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::reduce_scatter, 0, count, dt};
    c.send = send;
    c.recv = recv;
    const std::size_t offset = rank_ * count * dtype_size(dt);
    stage(c, size() * count * dtype_size(dt));
    group_->run(
        rank_, c, pick(o),
        [&](const std::vector<CallRecord>& all) {
          std::vector<const void*> srcs;
          for (const auto& peer : all) srcs.push_back(static_cast<const std::byte*>(peer.send) + offset);
          if (count) sum_in_order(dt, recv, srcs.data(), srcs.size(), count);
        },
        {});
  }

  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::all_reduce, 0, count, dt};
    c.send = buf;
    c.recv = buf;
    // In place: sum into a private copy, write back once every peer has read
    // (when every rank staged, peers read the slots, so at once).
    std::vector<std::byte> sum(count * dtype_size(dt));
    stage(c, sum.size());
    group_->run(
        rank_, c, pick(o),
        [&](const std::vector<CallRecord>& all) {
          std::vector<const void*> srcs;
          for (const auto& peer : all) srcs.push_back(peer.send);
          if (count) sum_in_order(dt, sum.data(), srcs.data(), srcs.size(), count);
        },
        [&] {
          if (!sum.empty()) std::memcpy(buf, sum.data(), sum.size());
        });
  }

  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    CallRecord c = send_recv_record(step, dt);
    stage(c, c.count * dtype_size(dt));
    group_->run(
        rank_, c, pick(o),
        [&](const std::vector<CallRecord>& all) {
          if (step.src >= 0 && c.recv_count) std::memcpy(step.recv, all[step.src].send, c.recv_count * dtype_size(dt));
        },
        {});
  }

  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    CallRecord c{CollectiveKind::broadcast, 0, count, dt};
    c.root = root;
    c.send = buf;
    c.recv = buf;
    stage(c, count * dtype_size(dt));
    group_->run(
        rank_, c, pick(o),
        [&](const std::vector<CallRecord>& all) {
          if (rank_ != root && count) std::memcpy(buf, all[root].send, count * dtype_size(dt));
        },
        {});
  }

  void barrier(CallOptions o) override {
    ++calls_;
    CallRecord c{CollectiveKind::barrier};
    c.staged = true;  // nothing to read
    group_->run(rank_, c, pick(o), [](const std::vector<CallRecord>&) {});
  }

 private:
  // Counts the call; for a small message, copies the `bytes` this rank publishes
  // into this call's slot, points the record there and marks it staged.
  void stage(CallRecord& c, std::size_t bytes) {
    const std::size_t parity = ++calls_ % 2;
    if (bytes > kStagedBytes) return;
    auto& slot = staging_->slots[rank_][parity];
    if (slot.size() < bytes) slot.resize(bytes);
    if (bytes) std::memcpy(slot.data(), c.send, bytes);
    c.send = slot.data();
    c.staged = true;
  }

  std::chrono::milliseconds pick(CallOptions o) const { return o.timeout_or(group_->timeout()); }
  std::shared_ptr<Rendezvous> group_;
  std::shared_ptr<Staging> staging_;
  int rank_;
  std::uint64_t calls_ = 0;
};

// A run's ranks as threads over one rendezvous.
class ThreadsGroup final : public Group {
 public:
  ThreadsGroup(int n, std::chrono::milliseconds timeout)
      : rendezvous_(std::make_shared<Rendezvous>(n, timeout)), staging_(std::make_shared<Staging>(n)) {}
  std::unique_ptr<Communicator> communicator(int rank) override {
    CPSIM_ENFORCE(rank >= 0 && rank < rendezvous_->size(), "rank ", rank, " of ", rendezvous_->size());
    return std::make_unique<ThreadsCommunicator>(rendezvous_, staging_, rank);
  }
  void finish(int rank) override { rendezvous_->finish(rank); }
  void fail(int rank, const std::string& what) override { rendezvous_->fail(rank, what); }

 private:
  std::shared_ptr<Rendezvous> rendezvous_;
  std::shared_ptr<Staging> staging_;
};

const BackendRegistrar registrar{Backend{
    "threads", "ranks as threads of this process, shared memory, sums in rank order", kThreadsCapabilities,
    [](int n, std::chrono::milliseconds timeout) { return std::make_shared<ThreadsGroup>(n, timeout); }}};

}  // namespace


}  // namespace cpsim::sim
