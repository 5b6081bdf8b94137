// The `threads` backend: ranks are threads of one process and collectives move
// bytes through shared memory: large messages one copy per byte (each rank pulls
// what it needs straight from its peers' buffers, found through the rendezvous),
// small ones through two staging slots per rank, which saves the second
// rendezvous. Reductions add in rank order, so results are bitwise deterministic.
// The calls themselves are the shared-memory body (core/comm/shared_memory.hpp):
// the rendezvous checks each against the peers' calls and turns distributed bugs
// into CollectiveErrors on every rank.
// Registered as "threads".

#include <array>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "core/comm/shared_memory.hpp"

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

class ThreadsCommunicator final : public SharedMemoryCommunicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Rendezvous> group, std::shared_ptr<Staging> staging, int rank)
      : SharedMemoryCommunicator(std::move(group), rank), staging_(std::move(staging)) {}
  std::string backend_name() const override { return "threads"; }
  Capabilities capabilities() const override { return kThreadsCapabilities; }

 private:
  // Counts the call; for a small message, copies the `bytes` this rank publishes
  // into this call's slot, points the record there and marks it staged.
  void publish(CallRecord& c, std::size_t bytes) override {
    const std::size_t parity = ++calls_ % 2;
    if (bytes > kStagedBytes) return;
    auto& slot = staging_->slots[rank()][parity];
    if (slot.size() < bytes) slot.resize(bytes);
    if (bytes) std::memcpy(slot.data(), c.send, bytes);
    c.send = slot.data();
    c.staged = true;
  }
  void copy(int, void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void sum(const std::vector<const void*>& srcs, void* dst, std::size_t count, DType dt) override {
    sum_in_order(dt, dst, srcs.data(), srcs.size(), count);
  }
  void* scratch(std::size_t bytes) override {
    void* p = std::malloc(bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }

  std::shared_ptr<Staging> staging_;
  std::uint64_t calls_ = 0;
};

// A run's ranks as threads over one rendezvous.
class ThreadsGroup final : public Group {
 public:
  ThreadsGroup(int n, std::chrono::milliseconds timeout, const RankNames& names)
      : rendezvous_(std::make_shared<Rendezvous>(n, timeout, names)), staging_(std::make_shared<Staging>(n)) {}
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
    [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
      return std::make_shared<ThreadsGroup>(n, timeout, names);
    }}};

}  // namespace


}  // namespace cpsim::sim
