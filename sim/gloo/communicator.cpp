// The gloo transport: Gloo's own collectives, run after the checked communicator
// (core/comm/call_check.hpp) has compared every rank's call over the exchange. The
// transport reads nothing the check left: each call's record comes from its own
// arguments (only its number, for messages, is the one the exchange gave it).
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstring>

#include "core/reduce.hpp"
#include "sim/gloo/rank.hpp"
#include "sim/gloo/protocol.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// The communicator.

namespace {

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<GlooRank> g) : g_(std::move(g)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  std::chrono::milliseconds timeout() const override { return g_->timeout(); }
  std::string backend_name() const override { return "gloo"; }
  Capabilities capabilities() const override { return kGlooCapabilities; }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = g_->numbered(call_record(CollectiveKind::all_gather, count, dt, o.label));
    const std::size_t bytes = count * dtype_size(dt);
    if (without_peers(send, recv, bytes)) return;
    g_->transport(c, [&] { gather_bytes(send, recv, bytes, t); });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = g_->numbered(call_record(CollectiveKind::reduce_scatter, count, dt, o.label));
    const std::size_t bytes = count * dtype_size(dt);
    if (without_peers(send, recv, bytes)) return;
    // Every rank's slice for this rank arrives (alltoall), then adds up in rank order.
    std::vector<std::uint8_t> parts(bytes * size());
    g_->transport(c, [&] {
      gloo::AlltoallOptions opts(g_->context_ptr());
      opts.setInput(const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(send)), bytes * size());
      opts.setOutput(parts.data(), parts.size());
      opts.setTimeout(t);
      gloo::alltoall(opts);
    });
    sum_parts(parts, recv, count, dt);
  }

  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = g_->numbered(call_record(CollectiveKind::all_reduce, count, dt, o.label));
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0 || size() == 1) return;
    std::vector<std::uint8_t> parts(bytes * size());
    g_->transport(c, [&] { gather_bytes(buf, parts.data(), bytes, t); });
    sum_parts(parts, buf, count, dt);
  }

  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    CallRecord c = send_recv_record(step, dt);
    c.label = o.label;
    c = g_->numbered(c);
    const void* send = step.send;
    void* recv = step.recv;
    const int dst = step.dst, src = step.src;
    const std::size_t send_bytes = c.count * dtype_size(dt), recv_bytes = c.recv_count * dtype_size(dt);
    if (size() == 1) {  // the only pairing with one rank is with itself
      if (recv_bytes) std::memcpy(recv, send, recv_bytes);
      return;
    }
    g_->transport(c, [&] {
      std::unique_ptr<gloo::transport::UnboundBuffer> out, in;
      if (dst >= 0 && send_bytes) {
        out = g_->context().createUnboundBuffer(const_cast<void*>(send), send_bytes);
        out->send(dst, kPointToPointSlot);
      }
      if (src >= 0 && recv_bytes) {
        in = g_->context().createUnboundBuffer(recv, recv_bytes);
        in->recv(src, kPointToPointSlot);
      }
      g_->awaiting() = {src};
      if (in) in->waitRecv(t);
      g_->awaiting() = {dst};
      if (out) out->waitSend(t);
    });
  }

  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    const auto t = g_->pick(o);
    CallRecord c = call_record(CollectiveKind::broadcast, count, dt, o.label);
    c.root = root;
    c = g_->numbered(c);
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0 || size() == 1) return;
    g_->transport(c, [&] {
      gloo::BroadcastOptions opts(g_->context_ptr());
      opts.setOutput(static_cast<std::uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTimeout(t);
      gloo::broadcast(opts);
    });
  }

  // The exchange is an all-to-all barrier (under the checked communicator, its
  // own exchange is, and this is not called).
  void barrier(CallOptions o) override { g_->exchange(call_record(CollectiveKind::barrier, 0, DType::f32, o.label), g_->pick(o)); }

 private:
  // Nothing to move, or a group of one (where each rank's result is its own
  // input): done without the transport.
  bool without_peers(const void* send, void* recv, std::size_t bytes) {
    if (bytes != 0 && size() == 1) std::memcpy(recv, send, bytes);
    return bytes == 0 || size() == 1;
  }
  // Every rank's block straight to every peer, all at once: one round of latency
  // instead of the ring's n-1 (after the call check's round, that is what keeps
  // small and medium gathers across processes quick), and the same bytes per rank.
  // Larger blocks take Gloo's ring, which pipelines.
  void gather_bytes(const void* send, void* recv, std::size_t bytes, std::chrono::milliseconds t) {
    auto* out = static_cast<std::uint8_t*>(recv);
    const int n = size(), me = rank();
    if (bytes > kDirectGatherBytes) {
      gloo::AllgatherOptions opts(g_->context_ptr());
      opts.setInput(const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(send)), bytes);
      opts.setOutput(out, bytes * n);
      opts.setTimeout(t);
      gloo::allgather(opts);
      return;
    }
    auto in = g_->context().createUnboundBuffer(out, bytes * n);
    auto mine = g_->context().createUnboundBuffer(const_cast<void*>(send), bytes);
    for (int q = 0; q < n; ++q)
      if (q != me) in->recv(q, kGatherSlot, q * bytes, bytes);
    for (int q = 0; q < n; ++q)
      if (q != me) mine->send(q, kGatherSlot);
    std::memcpy(out + me * bytes, send, bytes);
    // One deadline for the whole call, not one per peer.
    const auto deadline = Clock::now() + t;
    auto left = [&] {
      return std::max(1ms, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    };
    for (int i = 1; i < n; ++i) {
      int src = -1;
      in->waitRecv(&src, left());
      std::erase(g_->awaiting(), src);
    }
    g_->awaiting().clear();
    for (int q = 0; q < n; ++q)
      if (q != me) g_->awaiting().push_back(q);
    for (int i = 1; i < n; ++i) mine->waitSend(left());
  }
  static constexpr std::size_t kDirectGatherBytes = 1 << 20;
  void sum_parts(const std::vector<std::uint8_t>& parts, void* out, std::size_t count, DType dt) {
    const std::size_t bytes = count * dtype_size(dt);
    std::vector<const void*> srcs;
    for (int q = 0; q < size(); ++q) srcs.push_back(parts.data() + q * bytes);
    sum_in_order(dt, out, srcs.data(), srcs.size(), count);
  }
  std::shared_ptr<GlooRank> g_;
};

}  // namespace

std::unique_ptr<Communicator> GlooRank::communicator() {
  return checked_communicator(std::make_unique<GlooCommunicator>(shared_from_this()), shared_from_this());
}

void GlooRank::broadcast_bytes(void* data, std::size_t bytes, int root) {
  communicator()->broadcast(data, bytes, DType::b8, root);
}

void GlooRank::all_gather_bytes(const void* in, void* out, std::size_t bytes) {
  communicator()->all_gather(in, out, bytes, DType::b8);
}

}  // namespace cpsim::sim
