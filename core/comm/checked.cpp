#include "core/comm/checked.hpp"

namespace cpsim {

std::string describe_calls(const std::vector<CallRecord>& calls) {
  std::string out;
  for (std::size_t q = 0; q < calls.size(); ++q) out += "\n  rank " + std::to_string(q) + ": in " + describe_call(calls[q]);
  return out;
}

namespace {

class CheckedCommunicator final : public Communicator {
 public:
  CheckedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CallChannel> channel)
      : inner_(std::move(inner)), channel_(std::move(channel)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  Capabilities capabilities() const override { return inner_->capabilities(); }
  Device device() const override { return inner_->device(); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    check(call_record(CollectiveKind::all_gather, count, dt), o);
    inner_->all_gather(send, recv, count, dt, o);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    check(call_record(CollectiveKind::reduce_scatter, count, dt), o);
    inner_->reduce_scatter(send, recv, count, dt, o);
  }
  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    check(call_record(CollectiveKind::all_reduce, count, dt), o);
    inner_->all_reduce(buf, count, dt, o);
  }
  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    check(send_recv_record(step, dt), o);
    inner_->send_recv(step, dt, o);
  }
  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    CallRecord r = call_record(CollectiveKind::broadcast, count, dt);
    r.root = root;
    check(r, o);
    inner_->broadcast(buf, count, dt, root, o);
  }
  // The exchange is an all-to-all barrier: the inner call is not needed.
  void barrier(CallOptions o) override { check(call_record(CollectiveKind::barrier), o); }

 private:
  void check(const CallRecord& mine, CallOptions o) {
    const auto calls = channel_->exchange(mine, o.timeout.count() > 0 ? o.timeout : inner_->timeout());
    if (auto why = find_mismatch(calls)) channel_->stop("collective mismatch: " + *why + describe_calls(calls));
  }
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<CallChannel> channel_;
};

}  // namespace

std::unique_ptr<Communicator> checked_communicator(std::unique_ptr<Communicator> inner,
                                                   std::shared_ptr<CallChannel> channel) {
  return std::make_unique<CheckedCommunicator>(std::move(inner), std::move(channel));
}

}  // namespace cpsim
