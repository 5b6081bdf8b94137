#include "core/comm/checked.hpp"

#include "core/comm/forwarding.hpp"

namespace cpsim {

std::string describe_calls(const std::vector<CallRecord>& calls) {
  std::string out;
  for (std::size_t q = 0; q < calls.size(); ++q) out += "\n  rank " + std::to_string(q) + ": in " + describe_call(calls[q]);
  return out;
}

namespace {

class CheckedCommunicator final : public ForwardingCommunicator {
 public:
  CheckedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CallChannel> channel)
      : ForwardingCommunicator(std::move(inner)), channel_(std::move(channel)) {}
  // The exchange is an all-to-all barrier: the inner call is not needed.
  void barrier(CallOptions o) override { before(call_record(CollectiveKind::barrier), o); }

 private:
  void before(const CallRecord& mine, CallOptions o) override {
    const auto calls = channel_->exchange(mine, o.timeout_or(timeout()));
    if (auto why = find_mismatch(calls)) channel_->stop("collective mismatch: " + *why + describe_calls(calls));
  }
  std::shared_ptr<CallChannel> channel_;
};

}  // namespace

std::unique_ptr<Communicator> checked_communicator(std::unique_ptr<Communicator> inner,
                                                   std::shared_ptr<CallChannel> channel) {
  return std::make_unique<CheckedCommunicator>(std::move(inner), std::move(channel));
}

}  // namespace cpsim
