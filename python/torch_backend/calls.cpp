// One call on the communicator and its reports; point to point on the mailbox.
#include "python/torch_backend/backend.hpp"

#include "core/comm/call_check.hpp"
#include "python/torch_backend/call_site.hpp"
#include "python/torch_backend/tensors.hpp"

namespace cpsim::torch_backend {

c10::intrusive_ptr<c10d::Work> BackendCpsim::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  expect_one(tensors.size(), "send");
  const at::Tensor& t = tensors[0];
  expect_cpu(t, "send");
  const std::string site = python_call_site();
  std::shared_ptr<PostedSend> posted;
  point_to_point(
      [&] { posted = ctx_.mailbox->send(ctx_.group, global(getRank()), global(dst), tag, payload_of(t), site); });
  // Its wait (a blocking send) returns when a receive took the message.
  return c10::make_intrusive<CpsimWork>(getRank(), c10d::OpType::SEND, posted->what(), std::vector<at::Tensor>{},
                                        ctx_.ledger, ctx_.mailbox, nullptr, posted);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return post_recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return post_recv(tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::post_recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  expect_one(tensors.size(), "recv");
  at::Tensor& t = tensors[0];
  expect_cpu(t, "recv");
  const std::string site = python_call_site();
  std::shared_ptr<PostedRecv> p;
  point_to_point([&] {
    p = ctx_.mailbox->post(ctx_.group, global(getRank()), src < 0 ? -1 : global(src), tag, dtype_text(t), t.numel(),
                           writer_of(t), site);
  });
  return c10::make_intrusive<CpsimWork>(getRank(), c10d::OpType::RECV, p->what(), std::vector<at::Tensor>{t},
                                        ctx_.ledger, ctx_.mailbox, p);
}

int BackendCpsim::global(int group_rank) const {
  return ctx_.names.number(group_rank);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::work(c10d::OpType type, const std::string& what,
                                                  std::vector<at::Tensor> outputs, const std::string& site) {
  const std::string where = site.empty() ? last_site_ : site;
  return c10::make_intrusive<CpsimWork>(getRank(), type, what + (where.empty() ? "" : " at " + where),
                                        std::move(outputs), ctx_.ledger);
}

void BackendCpsim::run(const std::string& name, const std::string& args,
                       const std::function<void(Communicator&, CallOptions)>& f) {
  ++seq_;
  last_site_ = python_call_site();
  CallOptions o;
  o.label = CallLabel::of(name, args, last_site_);
  // The board says where this rank is for the reports of its other groups; a
  // call that failed stays on it (the rank is unwinding from it, not idle).
  const std::string call = name + (last_site_.empty() ? "" : " at " + last_site_) + ctx_.names.on();
  ctx_.board->set(global(getRank()), "in " + call, ctx_.names.group);
  try {
    f(*ctx_.comm, o);
  } catch (const CollectiveError& e) {
    ctx_.board->set(global(getRank()), "failed in " + call, ctx_.names.group);
    throw CollectiveError(told(e));
  } catch (const Aborted& e) {
    ctx_.board->set(global(getRank()), "failed in " + call, ctx_.names.group);
    throw Aborted(told(e));
  }
  ctx_.board->set(global(getRank()), "");
}

std::string BackendCpsim::told(const Error& e) {
  collective_failed_ = true;
  std::string out = e.what();
  const std::string doing = ctx_.board->lines(/*outside_collectives=*/true);
  if (!doing.empty()) out += "\n outside collectives:" + doing;
  const std::string p2p = ctx_.mailbox->pending();
  if (!p2p.empty()) out += "\n" + p2p.substr(2);
  return out;
}

void BackendCpsim::point_to_point(const std::function<void()>& f) {
  try {
    f();
  } catch (const CollectiveError&) {
    collective_failed_ = true;
    throw;
  }
}

}  // namespace cpsim::torch_backend
