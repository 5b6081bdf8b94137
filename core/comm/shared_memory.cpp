#include "core/comm/shared_memory.hpp"

namespace cpsim {

void SharedMemoryCommunicator::run(CallRecord c, std::size_t bytes, CallOptions o,
                                   const std::function<void(const std::vector<CallRecord>&)>& reads,
                                   const std::function<void()>& after) {
  c.label = o.label;
  publish(c, bytes);
  rendezvous_->run(
      rank_, c, o.timeout_or(timeout()),
      [&](const std::vector<CallRecord>& all) {
        reads(all);
        reads_issued();
      },
      after);
}

void SharedMemoryCommunicator::all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) {
  CallRecord c = call_record(CollectiveKind::all_gather, count, dt);
  c.send = send;
  c.recv = recv;
  const std::size_t bytes = count * dtype_size(dt);
  run(c, bytes, o, [&](const std::vector<CallRecord>& all) {
    for (std::size_t q = 0; q < all.size(); ++q)
      copy(static_cast<int>(q), static_cast<std::byte*>(recv) + q * bytes, all[q].send, bytes);
  });
}

void SharedMemoryCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType dt,
                                              CallOptions o) {
  CallRecord c = call_record(CollectiveKind::reduce_scatter, count, dt);
  c.send = send;
  c.recv = recv;
  const std::size_t bytes = count * dtype_size(dt), offset = rank_ * bytes;
  run(c, size() * bytes, o, [&](const std::vector<CallRecord>& all) {
    std::vector<const void*> srcs;
    for (const auto& peer : all) srcs.push_back(static_cast<const std::byte*>(peer.send) + offset);
    if (count) sum(srcs, recv, count, dt);
  });
}

void SharedMemoryCommunicator::all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) {
  CallRecord c = call_record(CollectiveKind::all_reduce, count, dt);
  c.send = buf;
  c.recv = buf;
  // In place: sum into scratch, written back once every peer has read (at once
  // when every rank's data was staged).
  const std::size_t bytes = count * dtype_size(dt);
  struct Scratch {
    SharedMemoryCommunicator& owner;
    void* p;
    ~Scratch() {
      if (p) owner.release(p);
    }
  } tmp{*this, bytes ? scratch(bytes) : nullptr};
  run(
      c, bytes, o,
      [&](const std::vector<CallRecord>& all) {
        std::vector<const void*> srcs;
        for (const auto& peer : all) srcs.push_back(peer.send);
        if (count) sum(srcs, tmp.p, count, dt);
      },
      [&] { copy(rank_, buf, tmp.p, bytes); });
}

void SharedMemoryCommunicator::send_recv(const SendRecv& step, DType dt, CallOptions o) {
  const CallRecord c = send_recv_record(step, dt);
  run(c, c.count * dtype_size(dt), o, [&](const std::vector<CallRecord>& all) {
    if (step.src >= 0) copy(step.src, step.recv, all[step.src].send, c.recv_count * dtype_size(dt));
  });
}

void SharedMemoryCommunicator::broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) {
  CallRecord c = call_record(CollectiveKind::broadcast, count, dt);
  c.root = root;
  c.send = buf;
  c.recv = buf;
  run(c, count * dtype_size(dt), o, [&](const std::vector<CallRecord>& all) {
    if (rank_ != root) copy(root, buf, all[root].send, count * dtype_size(dt));
  });
}

void SharedMemoryCommunicator::barrier(CallOptions o) {
  run(call_record(CollectiveKind::barrier), 0, o, [](const std::vector<CallRecord>&) {});
}

}  // namespace cpsim
