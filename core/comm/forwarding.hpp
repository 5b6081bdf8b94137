// One base for every communicator that wraps another (as c10d's
// ProcessGroupWrapper forwards to its inner backend): the call check
// (core/comm/call_check.hpp), and the tests' decorators. Every call is forwarded to
// the inner communicator after `before` has seen its record; a wrapper overrides
// `before` (and whatever else it changes), not the six operations.
#pragma once

#include <memory>
#include <utility>

#include "core/comm/call_check.hpp"

namespace cpsim {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  Capabilities capabilities() const override { return inner_->capabilities(); }
  Device device() const override { return inner_->device(); }
  void finish_run() override { inner_->finish_run(); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    before(call_record(CollectiveKind::all_gather, count, dt), o);
    inner_->all_gather(send, recv, count, dt, o);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    before(call_record(CollectiveKind::reduce_scatter, count, dt), o);
    inner_->reduce_scatter(send, recv, count, dt, o);
  }
  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    before(call_record(CollectiveKind::all_reduce, count, dt), o);
    inner_->all_reduce(buf, count, dt, o);
  }
  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    before(send_recv_record(step, dt), o);
    inner_->send_recv(step, dt, o);
  }
  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    CallRecord r = call_record(CollectiveKind::broadcast, count, dt);
    r.root = root;
    before(r, o);
    inner_->broadcast(buf, count, dt, root, o);
  }
  void barrier(CallOptions o) override {
    before(call_record(CollectiveKind::barrier), o);
    inner_->barrier(o);
  }

 protected:
  // Sees every call before the inner communicator runs it (seq left 0).
  virtual void before(const CallRecord& /*call*/, CallOptions /*opts*/) {}
  Communicator& inner() { return *inner_; }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace cpsim
