// The one interface every CP operator talks to (SPEC §4). Backends (sim/threads,
// sim/gloo, gpu/...) implement it and register in core/comm/registry.hpp;
// operators never learn which one runs them. Buffers are raw bytes of `count`
// elements of a DType, so no backend type leaks here. Every call is a
// collective: all ranks of the group make it, in the same order.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>

#include "core/tensor.hpp"

namespace cpsim {

enum class CollectiveKind { all_gather, reduce_scatter, all_reduce, send_recv, broadcast, barrier };
const char* collective_name(CollectiveKind kind);

// What a caller names a call that another collective carries (the torch
// backend's all_reduce with MAX is an all_gather and a reduction): reports show
// `name` and `args` in place of cpsim's collective and sizes, and the call check
// compares them across ranks as it compares those. `site` says where the caller
// made the call ("step.py:12"); it is shown, never compared. Fixed size, so a
// record crosses processes as bytes; longer texts are cut.
struct CallLabel {
  char name[32] = {};
  char args[96] = {};
  char site[96] = {};
  bool empty() const { return name[0] == 0; }
  static CallLabel of(const std::string& name, const std::string& args, const std::string& site = "");
};

// Per-call options; a zero timeout means the communicator's default.
struct CallOptions {
  std::chrono::milliseconds timeout{0};
  CallLabel label;
  // This call's timeout, given the communicator's default: the one place the
  // zero-means-default rule lives.
  std::chrono::milliseconds timeout_or(std::chrono::milliseconds fallback) const {
    return timeout.count() > 0 ? timeout : fallback;
  }
};

// What a backend promises, so callers choose how to compare and where buffers live.
struct Capabilities {
  // Reductions add contributions in rank order: results are bitwise those of
  // `threads`. Otherwise (NCCL's rings and trees) compare with a tolerance.
  bool rank_order_sums = true;
  // Buffers passed to calls live on the backend's device (cuda:N), not the host.
  bool device_buffers = false;
  // Calls are queued on a stream and complete in stream order, not on return.
  bool stream_ordered = false;
};

// One paired point-to-point step: send `send_count` elements to `dst`, receive
// `recv_count` elements from `src`; -1 means no peer on that side.
struct SendRecv {
  const void* send = nullptr;
  std::size_t send_count = 0;
  int dst = -1;
  void* recv = nullptr;
  std::size_t recv_count = 0;
  int src = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  virtual std::string backend_name() const = 0;
  virtual Capabilities capabilities() const = 0;
  // Where this rank's buffers and tensors live (capabilities().device_buffers:
  // cuda:N; otherwise the host). Callers put a rank's inputs there.
  virtual Device device() const { return Device::host(); }

  // recv[q*count .. (q+1)*count) = rank q's send, for every q. No aliasing.
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                          CallOptions opts = {}) = 0;
  // recv = sum over q, in rank order, of rank q's send[rank()*count .. +count).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype,
                              CallOptions opts = {}) = 0;
  // buf = sum over q, in rank order, of rank q's buf. In place.
  virtual void all_reduce(void* buf, std::size_t count, DType dtype, CallOptions opts = {}) = 0;
  // Paired point-to-point step in which every rank takes part (see SendRecv).
  // The pairing must agree on both sides.
  virtual void send_recv(const SendRecv& step, DType dtype, CallOptions opts = {}) = 0;
  // buf on every rank = buf on `root`.
  virtual void broadcast(void* buf, std::size_t count, DType dtype, int root,
                         CallOptions opts = {}) = 0;
  virtual void barrier(CallOptions opts = {}) = 0;
  // The rank's function returned: a backend that queues work (a device stream)
  // waits for it here and reports an error that came late (throws Aborted).
  virtual void finish_run() {}
};

// One rank of a group, or none: the identity cases of SPEC §3.
inline bool is_distributed(const Communicator* comm) { return comm != nullptr && comm->size() > 1; }

}  // namespace cpsim
