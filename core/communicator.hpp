// The one interface every CP operator talks to (SPEC §4). Backends (sim/threads,
// sim/gloo, gpu/...) implement it; operators never learn which one runs them.
// Buffers are raw bytes of `count` elements of a DType, so no backend type leaks here.
// Every call is a collective: all ranks of the group make it, in the same order.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "core/tensor.hpp"

namespace cpsim {

enum class CollectiveKind { all_gather, reduce_scatter, all_reduce, send_recv, broadcast, barrier };
const char* collective_name(CollectiveKind kind);

// Per-call options; a zero timeout means the communicator's default.
struct CallOptions {
  std::chrono::milliseconds timeout{0};
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual std::string backend_name() const = 0;

  // recv[q*count .. (q+1)*count) = rank q's send, for every q. No aliasing.
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                          CallOptions opts = {}) = 0;
  // recv = sum over q, in rank order, of rank q's send[rank()*count .. +count).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                              CallOptions opts = {}) = 0;
  // buf = sum over q, in rank order, of rank q's buf. In place.
  virtual void all_reduce(void* buf, std::size_t count, DType dtype, CallOptions opts = {}) = 0;
  // Paired point-to-point step in which every rank takes part: this rank sends
  // send_count elements to `dst` and receives recv_count elements from `src`;
  // -1 means no peer. The pairing must agree on both sides.
  virtual void send_recv(const void* send, std::size_t send_count, int dst, void* recv,
                         std::size_t recv_count, int src, DType dtype, CallOptions opts = {}) = 0;
  // buf on every rank = buf on `root`.
  virtual void broadcast(void* buf, std::size_t count, DType dtype, int root,
                         CallOptions opts = {}) = 0;
  virtual void barrier(CallOptions opts = {}) = 0;
};

// One rank of a group, or none: the identity cases of SPEC §3.
inline bool is_distributed(const Communicator* comm) { return comm != nullptr && comm->size() > 1; }

}  // namespace cpsim
