// The body the backends whose ranks share one address space have in common
// (threads on the host, cuda-sim on one GPU): every call posts this rank's record
// in the in-memory rendezvous (core/comm/rendezvous.hpp), which checks it against
// the peers' calls as they meet, then each rank reads what it needs straight from
// its peers' buffers. A backend says only how its bytes move: how a call's data
// is published, how a peer's bytes are copied and summed, and where scratch lives.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/comm/rendezvous.hpp"

namespace cpsim {

class SharedMemoryCommunicator : public Communicator {
 public:
  SharedMemoryCommunicator(std::shared_ptr<Rendezvous> rendezvous, int rank)
      : rendezvous_(std::move(rendezvous)), rank_(rank) {}
  int rank() const final { return rank_; }
  int size() const final { return rendezvous_->size(); }
  std::chrono::milliseconds timeout() const final { return rendezvous_->timeout(); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) final;
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) final;
  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) final;
  void send_recv(const SendRecv& step, DType dt, CallOptions o) final;
  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) final;
  void barrier(CallOptions o) final;

 protected:
  // Before this rank posts `c`, whose send buffer holds the `bytes` its peers
  // will read: a backend may copy them elsewhere (then points c.send there and
  // marks it staged) or record that they are written.
  virtual void publish(CallRecord& c, std::size_t bytes) = 0;
  // `bytes` of rank q's buffer `src` into `dst` (q may be this rank).
  virtual void copy(int q, void* dst, const void* src, std::size_t bytes) = 0;
  // dst = srcs[0] + srcs[1] + ... (one per rank), added in rank order.
  virtual void sum(const std::vector<const void*>& srcs, void* dst, std::size_t count, DType dt) = 0;
  // This rank's reads of a call are issued; they must be complete on return.
  virtual void reads_issued() {}
  // Scratch of `bytes` where this rank's buffers live, and its release.
  virtual void* scratch(std::size_t bytes) = 0;
  virtual void release(void* scratch) noexcept = 0;

 private:
  void run(CallRecord c, std::size_t bytes, CallOptions o,
           const std::function<void(const std::vector<CallRecord>&)>& reads, const std::function<void()>& after = {});

  std::shared_ptr<Rendezvous> rendezvous_;
  int rank_;
};

}  // namespace cpsim
