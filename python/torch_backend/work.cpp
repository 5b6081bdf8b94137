#include "python/torch_backend/work.hpp"

#include "core/error.hpp"

namespace cpsim::torch_backend {

std::shared_ptr<Request> Ledger::open(std::string what, std::vector<at::Tensor> outputs) {
  auto r = std::make_shared<Request>(Request{std::move(what), std::move(outputs)});
  std::lock_guard<std::mutex> lock(mutex_);
  open_.push_back(r);
  return r;
}

void Ledger::close(const std::shared_ptr<Request>& r) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_.remove(r);
}

std::vector<std::pair<at::Tensor, std::string>> Ledger::outstanding() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<at::Tensor, std::string>> out;
  for (const auto& r : open_)
    for (const at::Tensor& t : r->outputs) out.emplace_back(t, r->what);
  return out;
}

std::size_t Ledger::size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_.size();
}

std::string Ledger::unwaited(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string out;
  for (const auto& r : open_)
    out += (out.empty() ? "" : "\n  ") + std::string("rank ") + std::to_string(rank) + ": its " + r->what +
           " was never waited on (wait() on the request before using its output, and before the rank returns)";
  open_.clear();
  return out;
}

CpsimWork::CpsimWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
                     std::shared_ptr<Ledger> ledger, std::shared_ptr<Mailbox> mailbox, std::shared_ptr<PostedRecv> recv,
                     std::shared_ptr<PostedSend> send)
    : c10d::Work(rank, type),
      outputs_(outputs),
      ledger_(std::move(ledger)),
      request_(ledger_ ? ledger_->open(std::move(what), std::move(outputs)) : nullptr),
      mailbox_(std::move(mailbox)),
      recv_(std::move(recv)),
      send_(std::move(send)) {}

// (torch's binding of wait releases the GIL.)
bool CpsimWork::wait(std::chrono::milliseconds timeout) {
  if (!waited_) {
    waited_ = true;
    if (ledger_) ledger_->close(request_);
    if (recv_) mailbox_->wait(*recv_, timeout);
    if (send_) mailbox_->wait(*send_, timeout);
  }
  return true;
}

int CpsimWork::sourceRank() const {
  if (recv_ == nullptr || !recv_->done) throw InvalidInput("sourceRank: the receive has not completed");
  return recv_->source;
}

c10::intrusive_ptr<c10::ivalue::Future> CpsimWork::getFuture() {
  wait(kNoTimeout);
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  future->markCompleted(c10::IValue(outputs_));
  return future;
}

}  // namespace cpsim::torch_backend
