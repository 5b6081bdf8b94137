#include "sim/threads_communicator.hpp"

#include <cstring>
#include <sstream>

#include "core/reduce.hpp"

namespace cpsim::sim {

namespace {

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<ThreadsGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::chrono::milliseconds timeout() const override { return group_->timeout(); }
  std::string backend_name() const override { return "threads"; }

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

  void send_recv(const void* send, std::size_t send_count, int dst, void* recv, std::size_t recv_count, int src,
                 DType dt, CallOptions o) override {
    CallRecord c{CollectiveKind::send_recv, 0, dst < 0 ? 0 : send_count, dt};
    c.dst = dst;
    c.src = src;
    c.recv_count = src < 0 ? 0 : recv_count;
    c.send = send;
    c.recv = recv;
    group_->run(rank_, c, pick(o), [&](const std::vector<CallRecord>& all) {
      if (src >= 0 && c.recv_count) std::memcpy(recv, all[src].send, c.recv_count * dtype_size(dt));
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
  std::shared_ptr<ThreadsGroup> group_;
  int rank_;
};

}  // namespace

ThreadsGroup::ThreadsGroup(int size, std::chrono::milliseconds timeout) : timeout_(timeout), ranks_(size) {
  CPSIM_ENFORCE(size >= 1, "a group needs at least one rank");
}

std::unique_ptr<Communicator> ThreadsGroup::communicator(int rank) {
  CPSIM_ENFORCE(rank >= 0 && rank < size(), "rank ", rank, " of ", size());
  return std::make_unique<ThreadsCommunicator>(shared_from_this(), rank);
}

std::string ThreadsGroup::states_locked() const {
  std::ostringstream os;
  for (std::size_t q = 0; q < ranks_.size(); ++q) {
    const RankState& s = ranks_[q];
    os << "\n  rank " << q << ": ";
    switch (s.phase) {
      case Phase::waiting: os << "in " << describe_call(s.call); break;
      case Phase::idle: os << "not in a collective (last completed: " << s.last << ")"; break;
      case Phase::exited: os << "returned (last completed: " << s.last << ")"; break;
      case Phase::failed: os << "threw: " << s.failure << " (last completed: " << s.last << ")"; break;
    }
  }
  return os.str();
}

void ThreadsGroup::poison_locked(const std::string& why) {
  if (!poison_) poison_ = why + states_locked();
  cv_.notify_all();
  throw CollectiveError(*poison_);
}

void ThreadsGroup::run(int rank, CallRecord call, std::chrono::milliseconds timeout,
                       const std::function<void(const std::vector<CallRecord>&)>& read,
                       const std::function<void()>& after) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (poison_) throw CollectiveError(*poison_);
  RankState& me = ranks_[rank];
  call.seq = me.posted + 1;
  me.call = call;
  me.posted = call.seq;
  me.phase = Phase::waiting;
  cv_.notify_all();

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto all_arrived = [&] {
    for (const auto& s : ranks_)
      if (s.posted < call.seq) return false;
    return true;
  };
  while (!all_arrived()) {
    if (poison_) throw CollectiveError(*poison_);
    for (std::size_t q = 0; q < ranks_.size(); ++q) {
      const RankState& s = ranks_[q];
      if (s.posted < call.seq && (s.phase == Phase::exited || s.phase == Phase::failed))
        poison_locked("rank " + std::to_string(q) + (s.phase == Phase::exited ? " returned" : " threw") +
                      " without joining " + collective_name(call.kind) + " #" + std::to_string(call.seq) +
                      " that rank " + std::to_string(rank) + " waits in");
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !all_arrived() && !poison_)
      poison_locked("timeout: rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                    " ms in " + describe_call(call) + " for ranks that never arrived");
  }
  std::vector<CallRecord> calls;
  for (const auto& s : ranks_) calls.push_back(s.call);
  if (auto why = find_mismatch(calls)) poison_locked("collective mismatch: " + *why);
  lock.unlock();
  read(calls);
  lock.lock();
  // Peers may still read this rank's buffers: wait until all have finished reading.
  me.done = call.seq;
  cv_.notify_all();
  cv_.wait(lock, [&] {
    for (const auto& s : ranks_)
      if (s.done < call.seq) return false;
    return true;
  });
  me.phase = Phase::idle;
  me.last = describe_call(call);
  lock.unlock();
  if (after) after();
}

void ThreadsGroup::finish(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::exited;
  cv_.notify_all();
}

void ThreadsGroup::fail(int rank, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::failed;
  ranks_[rank].failure = what;
  if (!poison_) poison_ = "rank " + std::to_string(rank) + " threw: " + what + states_locked();
  cv_.notify_all();
}

}  // namespace cpsim::sim
