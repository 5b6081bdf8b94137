// Requests. Every Work a call returns must be waited on before its rank ends,
// and its outputs not used before that (cpsim.torch checks uses: the
// outstanding() list); a receive's Work completes when its message came.
#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/point_to_point.hpp"

namespace cpsim::torch_backend {

// One request as the ledger keeps it (the Work may be gone, unwaited).
struct Request {
  std::string what;
  std::vector<at::Tensor> outputs;
};

// One rank's requests not waited on yet.
class Ledger {
 public:
  std::shared_ptr<Request> open(std::string what, std::vector<at::Tensor> outputs);
  void close(const std::shared_ptr<Request>& r);
  // (output, what) of every open request.
  std::vector<std::pair<at::Tensor, std::string>> outstanding();
  std::size_t size();
  // "rank 1: its irecv ... was never waited on", one line each; "" when none.
  // The requests are forgotten (one report).
  std::string unwaited(int rank);

 private:
  std::mutex mutex_;
  std::list<std::shared_ptr<Request>> open_;
};

// torch's Work of one call: a collective's is complete when it returns, a
// receive's when its message came (recv is the receive the mailbox posted), a
// send's when a receive took its message (send: the mailbox's receipt).
class CpsimWork : public c10d::Work {
 public:
  CpsimWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
            std::shared_ptr<Ledger> ledger, std::shared_ptr<Mailbox> mailbox = nullptr,
            std::shared_ptr<PostedRecv> recv = nullptr, std::shared_ptr<PostedSend> send = nullptr);
  bool isCompleted() override { return (recv_ == nullptr || recv_->done) && (send_ == nullptr || send_->taken); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<Ledger> ledger_;
  std::shared_ptr<Request> request_;
  std::shared_ptr<Mailbox> mailbox_;
  std::shared_ptr<PostedRecv> recv_;
  std::shared_ptr<PostedSend> send_;
  bool waited_ = false;
};

}  // namespace cpsim::torch_backend
