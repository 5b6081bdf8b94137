#include "sim/threads_communicator.hpp"

#include <cstring>

#include "core/comm/registry.hpp"
#include "core/reduce.hpp"

namespace cpsim::sim {

namespace {

constexpr Capabilities kThreadsCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/false,
                                            /*stream_ordered=*/false};

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Rendezvous> group, int rank) : group_(std::move(group)), rank_(rank) {}
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
    group_->run(rank_, c, pick(o), [&](const std::vector<CallRecord>& all) {
      for (std::size_t q = 0; q < all.size(); ++q)
        if (bytes) std::memcpy(static_cast<std::byte*>(recv) + q * bytes, all[q].send, bytes);
    });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::reduce_scatter, 0, count, dt};
    c.send = send;
    c.recv = recv;
    const std::size_t offset = rank_ * count * dtype_size(dt);
    group_->run(rank_, c, pick(o), [&](const std::vector<CallRecord>& all) {
      std::vector<const void*> srcs;
      for (const auto& peer : all) srcs.push_back(static_cast<const std::byte*>(peer.send) + offset);
      if (count) sum_in_order(dt, recv, srcs.data(), srcs.size(), count);
    });
  }

  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::all_reduce, 0, count, dt};
    c.send = buf;
    c.recv = buf;
    // In place: sum into a private copy, write back once every peer has read.
    std::vector<std::byte> sum(count * dtype_size(dt));
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
    const CallRecord c = send_recv_record(step, dt);
    group_->run(rank_, c, pick(o), [&](const std::vector<CallRecord>& all) {
      if (step.src >= 0 && c.recv_count) std::memcpy(step.recv, all[step.src].send, c.recv_count * dtype_size(dt));
    });
  }

  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    CallRecord c{CollectiveKind::broadcast, 0, count, dt};
    c.root = root;
    c.send = buf;
    c.recv = buf;
    group_->run(rank_, c, pick(o), [&](const std::vector<CallRecord>& all) {
      if (rank_ != root && count) std::memcpy(buf, all[root].send, count * dtype_size(dt));
    });
  }

  void barrier(CallOptions o) override {
    group_->run(rank_, CallRecord{CollectiveKind::barrier}, pick(o), [](const std::vector<CallRecord>&) {});
  }

 private:
  std::chrono::milliseconds pick(CallOptions o) const { return o.timeout.count() > 0 ? o.timeout : group_->timeout(); }
  std::shared_ptr<Rendezvous> group_;
  int rank_;
};

// A run's ranks as threads over one rendezvous.
class ThreadsGroup final : public Group {
 public:
  ThreadsGroup(int n, std::chrono::milliseconds timeout) : rendezvous_(std::make_shared<Rendezvous>(n, timeout)) {}
  std::unique_ptr<Communicator> communicator(int rank) override { return threads_communicator(rendezvous_, rank); }
  void finish(int rank) override { rendezvous_->finish(rank); }
  void fail(int rank, const std::string& what) override { rendezvous_->fail(rank, what); }

 private:
  std::shared_ptr<Rendezvous> rendezvous_;
};

const BackendRegistrar registrar{Backend{
    "threads", "ranks as threads of this process, shared memory, sums in rank order", kThreadsCapabilities,
    [](int n, std::chrono::milliseconds timeout) { return std::make_shared<ThreadsGroup>(n, timeout); }}};

}  // namespace

std::unique_ptr<Communicator> threads_communicator(std::shared_ptr<Rendezvous> rendezvous, int rank) {
  CPSIM_ENFORCE(rank >= 0 && rank < rendezvous->size(), "rank ", rank, " of ", rendezvous->size());
  return std::make_unique<ThreadsCommunicator>(std::move(rendezvous), rank);
}

}  // namespace cpsim::sim
