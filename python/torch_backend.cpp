// The torch.distributed backend "cpsim" (torch 2.x): a c10d::Backend whose every
// call runs on one rank's cpsim Communicator, so the call check (SPEC §4) stands
// in front of it: a rank that skips a call, calls another one, other sizes,
// dtypes, reductions or roots, raises, or never comes ends every rank with one
// report naming each rank's call and where in the program it made it.
//
// One mechanism carries every torch call: the communicator moves the bytes (an
// all_gather, a broadcast or a barrier), and this file does the rest on the
// caller's thread in rank order (the reduction, the root's share, the split of
// an all_to_all). The call's torch name and arguments travel in the record
// (CallLabel), so reports and the check speak of torch's all_reduce(MAX), not of
// the all_gather that carried it. Collectives complete before they return; a
// receive completes when its message comes, so receives and sends match in any
// order (NCCL's and Gloo's semantics). Every request must be waited on, and its
// output not used before (cpsim.torch checks both).
//
// Built by python/setup.py with torch's own build helper (pip install
// --no-build-isolation ./python), against the torch that is installed.
#include <Python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <functional>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>

#include "core/comm/call_check.hpp"
#include "core/comm/communicator.hpp"
#include "core/comm/point_to_point.hpp"
#include "core/comm/registry.hpp"
#include "core/error.hpp"
#include "sim/gloo/gloo.hpp"
#include "sim/gloo/process_wire.hpp"
#include "sim/job/job.hpp"

namespace cpsim::torch_backend {

namespace {

using Clock = std::chrono::steady_clock;

// torch's Python name of the dtype ("float16", "int32").
std::string dtype_text(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: break;
  }
  std::string s = c10::toString(t.scalar_type());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// "float16 x 8": what every rank's tensor must agree on.
std::string shape_text(const at::Tensor& t) { return dtype_text(t) + " x " + std::to_string(t.numel()); }

std::string reduce_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

void expect_cpu(const at::Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    throw Unsupported(std::string("cpsim does not support ") + op + " of " + t.device().str() +
                      " tensors (this build's ranks keep host tensors)");
  if (t.is_sparse()) throw Unsupported(std::string("cpsim does not support ") + op + " of sparse tensors");
}

void expect_one(std::size_t n, const char* op) {
  if (n != 1)
    throw Unsupported(std::string("cpsim does not support ") + op + " of " + std::to_string(n) +
                      " tensors per rank (one device per rank)");
}

// The bytes of a tensor (a contiguous copy when it is not contiguous).
at::Tensor as_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (c.numel() == 0) return at::empty({0}, at::kByte);
  return c.view({-1}).view(at::kByte);
}

// Copies flat bytes into a tensor of any layout.
void write_bytes(at::Tensor& out, const at::Tensor& bytes) {
  if (out.numel() == 0) return;
  at::Tensor typed = bytes.view(out.scalar_type()).view(out.sizes());
  out.copy_(typed);
}

// The folders of torch's and cpsim's own Python files (cpsim.torch sets them).
std::vector<std::string>& internal_paths() {
  static std::vector<std::string> paths;
  return paths;
}

// What a call made under cpsim's own Python code is part of (the harness's
// backward of a step's output), per thread; "" when unset. The frames outside
// that code (the program that called the harness) are not the call's site.
std::string& site_context() {
  thread_local std::string context;
  return context;
}
// The folder of cpsim's own Python files.
std::string& own_path() {
  static std::string path;
  return path;
}

// Where the program made the call: the innermost Python frame outside torch and
// cpsim ("step.py:12"), else the thread's site context, or "" (a call from C++).
std::string python_call_site() {
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();
  if (frame == nullptr) return "";
  Py_INCREF(frame);
  std::string site;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const std::string path = file ? file : "";
    bool inside = path.rfind("<", 0) == 0;
    for (const std::string& p : internal_paths()) inside = inside || path.rfind(p, 0) == 0;
    if (!site_context().empty() && !own_path().empty() && path.rfind(own_path(), 0) == 0) {
      Py_DECREF(code);
      Py_DECREF(frame);
      return site_context();
    }
    if (!inside) {
      const std::size_t slash = path.rfind('/');
      site = (slash == std::string::npos ? path : path.substr(slash + 1)) + ":" +
             std::to_string(PyFrame_GetLineNumber(frame));
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
    if (!site.empty()) break;
  }
  Py_XDECREF(frame);
  return site.empty() ? site_context() : site;
}

}  // namespace

// ---------------------------------------------------------------------------
// Point to point between the ranks of a spawn or of one process of a job: the
// comm layer's Mailbox (core/comm/point_to_point.hpp), with its ActivityBoard of
// what each rank does; a tensor travels as its bytes, dtype name and count.

Payload payload_of(const at::Tensor& t) {
  const at::Tensor bytes = as_bytes(t);
  Payload p{std::vector<std::uint8_t>(static_cast<std::size_t>(bytes.numel())), dtype_text(t), t.numel()};
  if (bytes.numel()) std::memcpy(p.bytes.data(), bytes.data_ptr(), p.bytes.size());
  return p;
}

// Where a matching message's bytes go: the receive's tensor, of any layout.
std::function<void(const std::vector<std::uint8_t>&)> writer_of(at::Tensor t) {
  return [t](const std::vector<std::uint8_t>& bytes) mutable {
    if (bytes.empty()) return;
    at::Tensor view = at::from_blob(const_cast<std::uint8_t*>(bytes.data()), {static_cast<std::int64_t>(bytes.size())},
                                    at::kByte);
    write_bytes(t, view);
  };
}

// ---------------------------------------------------------------------------
// Requests. Every Work a call returns must be waited on before its rank ends,
// and its outputs not used before that (cpsim.torch checks uses: the
// outstanding() list); a receive's Work completes when its message came.

// One request as the ledger keeps it (the Work may be gone, unwaited).
struct Request {
  std::string what;
  std::vector<at::Tensor> outputs;
};

// One rank's requests not waited on yet.
class Ledger {
 public:
  std::shared_ptr<Request> open(std::string what, std::vector<at::Tensor> outputs) {
    auto r = std::make_shared<Request>(Request{std::move(what), std::move(outputs)});
    std::lock_guard<std::mutex> lock(mutex_);
    open_.push_back(r);
    return r;
  }
  void close(const std::shared_ptr<Request>& r) {
    std::lock_guard<std::mutex> lock(mutex_);
    open_.remove(r);
  }
  // (output, what) of every open request.
  std::vector<std::pair<at::Tensor, std::string>> outstanding() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<at::Tensor, std::string>> out;
    for (const auto& r : open_)
      for (const at::Tensor& t : r->outputs) out.emplace_back(t, r->what);
    return out;
  }
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_.size();
  }
  // "rank 1: its irecv ... was never waited on", one line each; "" when none.
  // The requests are forgotten (one report).
  std::string unwaited(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    for (const auto& r : open_)
      out += (out.empty() ? "" : "\n  ") + std::string("rank ") + std::to_string(rank) + ": its " + r->what +
             " was never waited on (wait() on the request before using its output, and before the rank returns)";
    open_.clear();
    return out;
  }

 private:
  std::mutex mutex_;
  std::list<std::shared_ptr<Request>> open_;
};

class CpsimWork : public c10d::Work {
 public:
  CpsimWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
            std::shared_ptr<Ledger> ledger, std::shared_ptr<Mailbox> mailbox = nullptr,
            std::shared_ptr<PostedRecv> recv = nullptr);
  bool isCompleted() override { return recv_ == nullptr || recv_->done; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override {
    if (recv_ == nullptr || !recv_->done) throw InvalidInput("sourceRank: the receive has not completed");
    return recv_->source;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait(kNoTimeout);
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(outputs_));
    return future;
  }

 private:
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<Ledger> ledger_;
  std::shared_ptr<Request> request_;
  std::shared_ptr<Mailbox> mailbox_;
  std::shared_ptr<PostedRecv> recv_;
  bool waited_ = false;
};

CpsimWork::CpsimWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
                     std::shared_ptr<Ledger> ledger, std::shared_ptr<Mailbox> mailbox,
                     std::shared_ptr<PostedRecv> recv)
    : c10d::Work(rank, type),
      outputs_(outputs),
      ledger_(std::move(ledger)),
      request_(ledger_ ? ledger_->open(std::move(what), std::move(outputs)) : nullptr),
      mailbox_(std::move(mailbox)),
      recv_(std::move(recv)) {}

// (torch's binding of wait releases the GIL.)
bool CpsimWork::wait(std::chrono::milliseconds timeout) {
  if (!waited_) {
    waited_ = true;
    if (ledger_) ledger_->close(request_);
    if (recv_) mailbox_->wait(*recv_, timeout);
  }
  return true;
}

// ---------------------------------------------------------------------------
// One rank of one group: torch's calls on the rank's communicator.

struct RankContext {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Mailbox> mailbox;  // the ranks' point to point (a spawn's, or one process's of a job)
  std::shared_ptr<ActivityBoard> board;      // what each rank does (the spawn's ranks, or this process's)
  std::shared_ptr<Ledger> ledger;
  std::string group;                 // torch's group name
  std::vector<int> global_ranks;     // group rank -> rank of the spawn or job
};

class BackendCpsim : public c10d::Backend {
 public:
  explicit BackendCpsim(RankContext ctx)
      : c10d::Backend(ctx.comm->rank(), ctx.comm->size()), ctx_(std::move(ctx)) {}

  const std::string getBackendName() const override { return "cpsim"; }
  // Whether a call of this rank ended in cpsim's CollectiveError (the report of
  // what the ranks did), as opposed to an error of the rank's own.
  bool collective_failed() const { return collective_failed_; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  bool supportsCoalescing() const override { return false; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    expect_one(tensors.size(), "broadcast");
    at::Tensor& t = tensors[0];
    expect_cpu(t, "broadcast");
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor bytes = as_bytes(t).clone();
    run("broadcast", shape_text(t) + ", root " + std::to_string(root), [&](Communicator& c, CallOptions o) {
      c.broadcast(bytes.data_ptr(), bytes.numel(), DType::b8, root, o);
    });
    if (getRank() != root) write_bytes(t, bytes);
    return work(c10d::OpType::BROADCAST, "broadcast", {t});
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    expect_one(tensors.size(), "all_reduce");
    reduce_into(tensors[0], opts.reduceOp, "all_reduce", -1);
    return work(c10d::OpType::ALLREDUCE, "all_reduce", {tensors[0]});
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    for (at::Tensor& t : tensors) reduce_into(t, opts.reduceOp, "all_reduce_coalesced", -1);
    return work(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    expect_one(tensors.size(), "reduce");
    reduce_into(tensors[0], opts.reduceOp, "reduce", static_cast<int>(opts.rootRank));
    return work(c10d::OpType::REDUCE, "reduce", {tensors[0]});
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override {
    expect_one(inputs.size(), "all_gather");
    expect_one(outputs.size(), "all_gather");
    gather_into_list(outputs[0], inputs[0], "all_gather");
    return work(c10d::OpType::ALLGATHER, "all_gather", outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    gather_into_tensor(output, input, "all_gather_into_tensor");
    return work(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output});
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions&) override {
    if (outputs.size() != inputs.size())
      throw InvalidInput("all_gather_coalesced: " + std::to_string(outputs.size()) + " output lists for " +
                         std::to_string(inputs.size()) + " inputs");
    std::vector<at::Tensor> all;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      gather_into_list(outputs[i], inputs[i], "all_gather_coalesced");
      all.insert(all.end(), outputs[i].begin(), outputs[i].end());
    }
    return work(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", all);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) override {
    if (outputs.size() != inputs.size())
      throw InvalidInput("all_gather_into_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
                         std::to_string(inputs.size()) + " inputs");
    for (std::size_t i = 0; i < inputs.size(); ++i)
      gather_into_tensor(outputs[i], inputs[i], "all_gather_into_tensor_coalesced");
    return work(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override {
    expect_one(inputs.size(), "gather");
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor& in = inputs[0];
    expect_cpu(in, "gather");
    at::Tensor all = exchange(in, "gather", shape_text(in) + ", root " + std::to_string(root));
    if (getRank() == root) {
      expect_one(outputs.size(), "gather");
      expect_list(outputs[0], in, "gather");
      for (int q = 0; q < getSize(); ++q) write_bytes(outputs[0][q], all[q]);
      return work(c10d::OpType::GATHER, "gather", outputs[0]);
    }
    if (!outputs.empty() && !outputs[0].empty())
      throw InvalidInput("gather: rank " + std::to_string(getRank()) + " is not the root (" + std::to_string(root) +
                         ") and passes a gather_list");
    return work(c10d::OpType::GATHER, "gather", {});
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    expect_one(outputs.size(), "scatter");
    const int root = static_cast<int>(opts.rootRank);
    at::Tensor& out = outputs[0];
    expect_cpu(out, "scatter");
    const std::int64_t n = as_bytes(out).numel();
    at::Tensor all = at::empty({getSize() * n}, at::kByte);
    if (getRank() == root) {
      expect_one(inputs.size(), "scatter");
      expect_list(inputs[0], out, "scatter");
      for (int q = 0; q < getSize(); ++q) all.narrow(0, q * n, n).copy_(as_bytes(inputs[0][q]));
    } else if (!inputs.empty() && !inputs[0].empty()) {
      throw InvalidInput("scatter: rank " + std::to_string(getRank()) + " is not the root (" + std::to_string(root) +
                         ") and passes a scatter_list");
    }
    run("scatter", shape_text(out) + ", root " + std::to_string(root), [&](Communicator& c, CallOptions o) {
      c.broadcast(all.data_ptr(), all.numel(), DType::b8, root, o);
    });
    write_bytes(out, all.narrow(0, getRank() * n, n));
    return work(c10d::OpType::SCATTER, "scatter", {out});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    expect_one(outputs.size(), "reduce_scatter");
    expect_one(inputs.size(), "reduce_scatter");
    at::Tensor& out = outputs[0];
    expect_list(inputs[0], out, "reduce_scatter");
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : inputs[0]) flat.push_back(t.reshape({-1}));
    scatter_reduced(out, at::cat(flat), opts.reduceOp, "reduce_scatter");
    return work(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {out});
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    scatter_reduced(output, input, opts.reduceOp, "reduce_scatter_tensor");
    return work(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    if (outputs.size() != inputs.size())
      throw InvalidInput("reduce_scatter_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
                         std::to_string(inputs.size()) + " inputs");
    for (std::size_t i = 0; i < inputs.size(); ++i)
      scatter_reduced(outputs[i], inputs[i], opts.reduceOp, "reduce_scatter_tensor_coalesced");
    return work(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    expect_cpu(input, "all_to_all_single");
    expect_cpu(output, "all_to_all_single");
    const int n = getSize();
    auto splits = [&](const at::Tensor& t, std::vector<int64_t> s, const char* side) {
      if (s.empty()) {
        if (t.size(0) % n != 0)
          throw InvalidInput(std::string("all_to_all_single: the ") + side + " has " + std::to_string(t.size(0)) +
                             " rows, not a multiple of " + std::to_string(n) + " ranks (give split sizes)");
        s.assign(n, t.size(0) / n);
      }
      if (static_cast<int>(s.size()) != n)
        throw InvalidInput(std::string("all_to_all_single: ") + std::to_string(s.size()) + " " + side +
                           " split sizes for " + std::to_string(n) + " ranks");
      return s;
    };
    const std::vector<int64_t> in_rows = splits(input, input_splits, "input");
    const std::vector<int64_t> out_rows = splits(output, output_splits, "output");
    std::vector<at::Tensor> parts;
    std::int64_t offset = 0;
    for (int q = 0; q < n; ++q) {
      parts.push_back(input.narrow(0, offset, in_rows[q]));
      offset += in_rows[q];
    }
    std::vector<at::Tensor> received = all_to_all(parts, "all_to_all_single", row_text(input));
    offset = 0;
    for (int q = 0; q < n; ++q) {
      at::Tensor slot = output.narrow(0, offset, out_rows[q]);
      offset += out_rows[q];
      if (received[q].numel() != slot.numel())
        throw InvalidInput("all_to_all_single: rank " + std::to_string(getRank()) + " expects " +
                           std::to_string(out_rows[q]) + " rows from rank " + std::to_string(q) + ", which sends " +
                           std::to_string(received[q].numel() / std::max<std::int64_t>(1, row_numel(input))));
      write_bytes(slot, as_bytes(received[q]));
    }
    return work(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    const int n = getSize();
    if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n)
      throw InvalidInput("all_to_all: " + std::to_string(inputs.size()) + " inputs and " +
                         std::to_string(outputs.size()) + " outputs for " + std::to_string(n) + " ranks");
    std::vector<at::Tensor> received = all_to_all(inputs, "all_to_all", inputs.empty() ? "" : dtype_text(inputs[0]));
    for (int q = 0; q < n; ++q) {
      if (received[q].numel() != outputs[q].numel())
        throw InvalidInput("all_to_all: rank " + std::to_string(getRank()) + "'s output " + std::to_string(q) +
                           " holds " + std::to_string(outputs[q].numel()) + " elements; rank " + std::to_string(q) +
                           " sends " + std::to_string(received[q].numel()));
      write_bytes(outputs[q], as_bytes(received[q]));
    }
    return work(c10d::OpType::ALLTOALL, "all_to_all", outputs);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    run("barrier", "", [&](Communicator& c, CallOptions o) { c.barrier(o); });
    return work(c10d::OpType::BARRIER, "barrier", {});
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool) override {
    run("monitored_barrier", "", [&](Communicator& c, CallOptions o) {
      if (opts.timeout.count() > 0) o.timeout = opts.timeout;
      c.barrier(o);
    });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    expect_one(tensors.size(), "send");
    const at::Tensor& t = tensors[0];
    expect_cpu(t, "send");
    const std::string site = python_call_site();
    point_to_point([&] { ctx_.mailbox->send(ctx_.group, global(getRank()), global(dst), tag, payload_of(t), site); });
    return work(c10d::OpType::SEND,
                "send to rank " + std::to_string(global(dst)) + " (tag " + std::to_string(tag) + ", " + shape_text(t) + ")",
                {}, site);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return post_recv(tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return post_recv(tensors, -1, tag);
  }

 private:
  c10::intrusive_ptr<c10d::Work> post_recv(std::vector<at::Tensor>& tensors, int src, int tag) {
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

  int global(int group_rank) const {
    if (group_rank < 0 || group_rank >= static_cast<int>(ctx_.global_ranks.size())) return group_rank;
    return ctx_.global_ranks[group_rank];
  }

  c10::intrusive_ptr<c10d::Work> work(c10d::OpType type, const std::string& what, std::vector<at::Tensor> outputs,
                                      const std::string& site = "") {
    const std::string where = site.empty() ? last_site_ : site;
    return c10::make_intrusive<CpsimWork>(getRank(), type, what + (where.empty() ? "" : " at " + where),
                                          std::move(outputs), ctx_.ledger);
  }

  // One communicator call under torch's name for it; its CollectiveError is
  // remembered (and told what ranks wait in point to point).
  template <class F>
  void run(const std::string& name, const std::string& args, F&& f) {
    ++seq_;
    last_site_ = python_call_site();
    CallOptions o;
    o.label = CallLabel::of(name, args, last_site_);
    ctx_.board->set(global(getRank()), "in " + name + (last_site_.empty() ? "" : " at " + last_site_), true);
    try {
      f(*ctx_.comm, o);
    } catch (const CollectiveError& e) {
      throw CollectiveError(told(e));
    } catch (const Aborted& e) {
      throw Aborted(told(e));
    }
    ctx_.board->set(global(getRank()), "");
  }
  // A report of the communicator's, with what the peers wait for in point to
  // point (the communicator sees only collectives).
  std::string told(const Error& e) {
    collective_failed_ = true;
    std::string out = e.what();
    ctx_.board->set(global(getRank()), "");
    const std::string doing = ctx_.board->lines(/*outside_collectives=*/true);
    if (!doing.empty()) out += "\n outside collectives:" + doing;
    const std::string p2p = ctx_.mailbox->pending();
    if (!p2p.empty()) out += "\n" + p2p.substr(2);
    return out;
  }
  template <class F>
  void point_to_point(F&& f) {
    try {
      f();
    } catch (const CollectiveError&) {
      collective_failed_ = true;
      throw;
    }
  }


  // Every rank's bytes of `t` (the same size on every rank): [ranks, bytes].
  at::Tensor exchange(const at::Tensor& t, const std::string& name, const std::string& args) {
    at::Tensor mine = as_bytes(t);
    at::Tensor all = at::empty({getSize(), mine.numel()}, at::kByte);
    run(name, args, [&](Communicator& c, CallOptions o) {
      c.all_gather(mine.data_ptr(), all.data_ptr(), mine.numel(), DType::b8, o);
    });
    return all;
  }

  // The reduction of every rank's t, in rank order, into t (root -1: on every
  // rank; else only on the root).
  void reduce_into(at::Tensor& t, const c10d::ReduceOp& op, const std::string& name, int root) {
    expect_cpu(t, name.c_str());
    expect_reduction(op, t, name);
    at::Tensor all = exchange(t, name, shape_text(t) + ", " + reduce_name(op) +
                                           (root >= 0 ? ", root " + std::to_string(root) : ""));
    if (root >= 0 && getRank() != root) return;
    t.copy_(reduced(all, t, op, name).view(t.sizes()));
  }

  // Every rank's block of `input` reduced, this rank's share into `out`.
  void scatter_reduced(at::Tensor& out, const at::Tensor& input, const c10d::ReduceOp& op, const std::string& name) {
    expect_cpu(out, name.c_str());
    expect_cpu(input, name.c_str());
    expect_reduction(op, input, name);
    if (input.numel() != getSize() * out.numel())
      throw InvalidInput(name + ": the input holds " + std::to_string(input.numel()) + " elements, not " +
                         std::to_string(getSize()) + " x " + std::to_string(out.numel()));
    at::Tensor all = exchange(input, name, shape_text(input) + ", " + reduce_name(op));
    at::Tensor sum = reduced(all, input, op, name);
    out.copy_(sum.narrow(0, getRank() * out.numel(), out.numel()).view(out.sizes()));
  }

  // What cpsim does not reduce, refused before a byte moves (at every group size).
  static void expect_reduction(const c10d::ReduceOp& op, const at::Tensor& like, const std::string& name) {
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::AVG:
      case c10d::ReduceOp::PRODUCT:
      case c10d::ReduceOp::MIN:
      case c10d::ReduceOp::MAX:
      case c10d::ReduceOp::BAND:
      case c10d::ReduceOp::BOR:
      case c10d::ReduceOp::BXOR: break;
      default: throw Unsupported("cpsim does not support " + name + " with " + reduce_name(op));
    }
    if (op.op_ == c10d::ReduceOp::AVG && !at::isFloatingType(like.scalar_type()) &&
        !at::isComplexType(like.scalar_type()))
      throw InvalidInput(name + " with AVG of " + dtype_text(like) + " (torch: floating types only)");
    const bool bitwise =
        op.op_ == c10d::ReduceOp::BAND || op.op_ == c10d::ReduceOp::BOR || op.op_ == c10d::ReduceOp::BXOR;
    if (bitwise && (at::isFloatingType(like.scalar_type()) || at::isComplexType(like.scalar_type())))
      throw InvalidInput(name + " with " + reduce_name(op) + " of " + dtype_text(like) +
                         " (torch: integer and bool types only)");
  }

  // rows [ranks, bytes] of `like`'s dtype reduced by `op` (one expect_reduction
  // accepts) in rank order: a flat tensor.
  at::Tensor reduced(const at::Tensor& all, const at::Tensor& like, const c10d::ReduceOp& op,
                     const std::string& name) {
    const std::int64_t n = like.numel();
    auto part = [&](int q) { return all[q].view(like.scalar_type()).view({n}); };
    at::Tensor acc = part(0).clone();
    try {
      for (int q = 1; q < getSize(); ++q) {
        const at::Tensor x = part(q);
        switch (op.op_) {
          case c10d::ReduceOp::SUM:
          case c10d::ReduceOp::AVG: acc.add_(x); break;
          case c10d::ReduceOp::PRODUCT: acc.mul_(x); break;
          case c10d::ReduceOp::MIN: acc = at::minimum(acc, x); break;
          case c10d::ReduceOp::MAX: acc = at::maximum(acc, x); break;
          case c10d::ReduceOp::BAND: acc.bitwise_and_(x); break;
          case c10d::ReduceOp::BOR: acc.bitwise_or_(x); break;
          case c10d::ReduceOp::BXOR: acc.bitwise_xor_(x); break;
          default: break;  // refused by expect_reduction
        }
      }
      if (op.op_ == c10d::ReduceOp::AVG) acc.div_(getSize());
    } catch (const c10::Error& e) {
      throw InvalidInput(name + " with " + reduce_name(op) + " of " + dtype_text(like) + ": " + e.what_without_backtrace());
    }
    return acc;
  }

  void gather_into_list(std::vector<at::Tensor>& outputs, const at::Tensor& in, const std::string& name) {
    expect_cpu(in, name.c_str());
    expect_list(outputs, in, name.c_str());
    at::Tensor all = exchange(in, name, shape_text(in));
    for (int q = 0; q < getSize(); ++q) write_bytes(outputs[q], all[q]);
  }

  void gather_into_tensor(at::Tensor& output, const at::Tensor& input, const std::string& name) {
    expect_cpu(input, name.c_str());
    expect_cpu(output, name.c_str());
    if (output.numel() != getSize() * input.numel() || output.scalar_type() != input.scalar_type())
      throw InvalidInput(name + ": the output is " + shape_text(output) + ", not " + std::to_string(getSize()) +
                         " x the input (" + shape_text(input) + ")");
    at::Tensor all = exchange(input, name, shape_text(input));
    write_bytes(output, all.view({-1}));
  }

  void expect_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* op) const {
    if (static_cast<int>(list.size()) != getSize())
      throw InvalidInput(std::string(op) + ": " + std::to_string(list.size()) + " tensors in the list for " +
                         std::to_string(getSize()) + " ranks");
    for (std::size_t q = 0; q < list.size(); ++q)
      if (list[q].numel() != like.numel() || list[q].scalar_type() != like.scalar_type())
        throw InvalidInput(std::string(op) + ": tensor " + std::to_string(q) + " of the list is " +
                           shape_text(list[q]) + ", not " + shape_text(like));
  }

  static std::int64_t row_numel(const at::Tensor& t) { return t.dim() == 0 || t.size(0) == 0 ? 1 : t.numel() / t.size(0); }
  static std::string row_text(const at::Tensor& t) {
    return dtype_text(t) + ", rows of " + std::to_string(row_numel(t));
  }

  // parts[q] goes to rank q; returns what each rank sent this one (as bytes of
  // the parts' dtype): two all_gathers, of the sizes and of the padded parts.
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& parts, const std::string& name,
                                     const std::string& args) {
    const int n = getSize();
    at::Tensor sizes = at::empty({n}, at::kLong);
    for (int q = 0; q < n; ++q) sizes[q] = static_cast<std::int64_t>(as_bytes(parts[q]).numel());
    at::Tensor all_sizes = exchange(sizes, name, args + " (sizes)").view(at::kLong).view({n, n});
    const std::int64_t longest = all_sizes.sum(1).max().item<std::int64_t>();
    at::Tensor mine = at::zeros({longest}, at::kByte);
    std::int64_t offset = 0;
    for (int q = 0; q < n; ++q) {
      at::Tensor b = as_bytes(parts[q]);
      mine.narrow(0, offset, b.numel()).copy_(b);
      offset += b.numel();
    }
    at::Tensor all = exchange(mine, name, args);
    std::vector<at::Tensor> out;
    const at::ScalarType type = parts.empty() ? at::kByte : parts[0].scalar_type();
    for (int q = 0; q < n; ++q) {
      std::int64_t start = 0;
      for (int k = 0; k < getRank(); ++k) start += all_sizes[q][k].item<std::int64_t>();
      const std::int64_t bytes = all_sizes[q][getRank()].item<std::int64_t>();
      out.push_back(all[q].narrow(0, start, bytes).clone().view(type));
    }
    return out;
  }

  RankContext ctx_;
  bool collective_failed_ = false;
  std::uint64_t seq_ = 0;
  std::string last_site_;
};

// ---------------------------------------------------------------------------
// The ranks of one spawn: a group of a registered backend per torch group (the
// default one and every new_group), each rank's Backend made on that rank's own
// thread, one mailbox for the point to point of all of them.

class SpawnedGroup {
 public:
  SpawnedGroup(const std::string& backend, int n, double timeout_s)
      : backend_(backend),
        timeout_(milliseconds(timeout_s)),
        board_(std::make_shared<ActivityBoard>(n)),
        mailbox_(std::make_shared<Mailbox>(n, timeout_, board_)),
        ledgers_(n),
        memberships_(n) {
    const Backend& b = find_backend(backend);
    if (auto why = b.unavailable()) throw Unavailable("backend " + backend + ": " + *why);
    for (auto& l : ledgers_) l = std::make_shared<Ledger>();
  }

  // This rank's Backend of torch's group `name` of these ranks (spawn ranks).
  c10::intrusive_ptr<BackendCpsim> backend(const std::string& name, const std::vector<int>& ranks, int rank) {
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    if (it == ranks.end()) throw InvalidInput("rank " + std::to_string(rank) + " is not in group " + name);
    const int group_rank = static_cast<int>(it - ranks.begin());
    std::shared_ptr<Group> group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& entry = groups_[name];
      if (!entry.group) {
        entry.group = find_backend(backend_).make_group(static_cast<int>(ranks.size()), timeout_);
        entry.ranks = ranks;
      } else if (entry.ranks != ranks) {
        throw CollectiveError("ranks disagree on the members of group " + name);
      }
      group = entry.group;
      memberships_[rank].emplace_back(group, group_rank);
    }
    RankContext ctx{std::shared_ptr<Communicator>(group->communicator(group_rank)), mailbox_, board_, ledgers_[rank],
                    name, ranks};
    return c10::make_intrusive<BackendCpsim>(std::move(ctx));
  }

  void finish(int rank) {
    mailbox_->stopped(rank, "returned", false);
    for (auto& [group, group_rank] : memberships(rank)) group->finish(group_rank);
  }
  void fail(int rank, const std::string& what) {
    mailbox_->stopped(rank, "threw: " + what, true);
    for (auto& [group, group_rank] : memberships(rank)) group->fail(group_rank, what);
  }
  void done() {
    std::vector<std::shared_ptr<Group>> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [name, entry] : groups_) all.push_back(entry.group);
    }
    for (auto& g : all) g->done();
  }
  std::string unreceived() { return mailbox_->unreceived(); }
  std::shared_ptr<Ledger> ledger(int rank) { return ledgers_.at(rank); }

 private:
  struct Entry {
    std::shared_ptr<Group> group;
    std::vector<int> ranks;
  };
  std::vector<std::pair<std::shared_ptr<Group>, int>> memberships(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    return memberships_.at(rank);
  }
  static std::chrono::milliseconds milliseconds(double s) {
    return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000));
  }
  std::string backend_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<ActivityBoard> board_;
  std::shared_ptr<Mailbox> mailbox_;
  std::vector<std::shared_ptr<Ledger>> ledgers_;
  std::mutex mutex_;
  std::map<std::string, Entry> groups_;
  std::vector<std::vector<std::pair<std::shared_ptr<Group>, int>>> memberships_;
};

// One session of a job (sim::ProcessJob::Session) as a Backend: the program's
// own (the job's group) or one case of the harness (a fresh group).
class JobSession {
 public:
  // ranks: the job ranks of the group's ranks, in group rank order.
  JobSession(std::unique_ptr<sim::ProcessJob::Session> session, std::shared_ptr<Ledger> ledger,
             std::vector<int> ranks, int job_size, std::chrono::milliseconds timeout)
      : session_(std::move(session)) {
    const int me = session_->gloo()->rank();
    auto board = std::make_shared<ActivityBoard>(job_size);
    mailbox_ = std::make_shared<Mailbox>(job_size, timeout, board);
    wire_ = std::make_unique<sim::ProcessWire>(*session_->gloo(), ranks, mailbox_, timeout);
    mailbox_->set_remote(ranks.at(me), [wire = wire_.get()](int, int dst, int tag, const Mailbox::Message& m) {
      wire->send(dst, tag, m);
    });
    backend_ = c10::make_intrusive<BackendCpsim>(
        RankContext{session_->communicator(), mailbox_, board, std::move(ledger), "", std::move(ranks)});
  }
  // The messages that came and no receive took (at the end of the program).
  std::string unreceived() { return mailbox_->unreceived(); }
  c10::intrusive_ptr<BackendCpsim> backend() { return backend_; }
  // The program returned: a peer still in a call learns it; a peer's call that
  // this rank did not join is reported here.
  void finish() {
    if (ended_) return;
    ended_ = true;
    try {
      session_->finish();
    } catch (const CollectiveError&) {
      collective_failed_ = true;
      throw;
    }
  }
  // The program raised: every peer fails with this rank's error.
  void fail(const std::string& what) {
    if (ended_) return;
    ended_ = true;
    session_->fail(what);
  }
  bool collective_failed() const { return collective_failed_ || backend_->collective_failed(); }

 private:
  std::unique_ptr<sim::ProcessJob::Session> session_;
  std::shared_ptr<Mailbox> mailbox_;
  std::unique_ptr<sim::ProcessWire> wire_;  // after session_: its thread ends before the connections close
  c10::intrusive_ptr<BackendCpsim> backend_;
  bool ended_ = false, collective_failed_ = false;
};

// This process's rank of a multi-process job (cpsim launch, torchrun, Slurm, Open
// MPI with CPSIM_STORE): sessions over Gloo between the processes, every call
// checked across them.
class JobGroup {
 public:
  explicit JobGroup(double timeout_s)
      : timeout_(static_cast<std::int64_t>(timeout_s * 1000)), ledger_(std::make_shared<Ledger>()) {
    auto config = sim::job_from_environment();
    if (!config)
      throw InvalidInput(
          "cpsim.torch.init_process_group: no rank in the environment; start the ranks with "
          "cpsim launch -n N -- python3 SCRIPT (or a launcher that sets RANK and WORLD_SIZE, with CPSIM_STORE)");
    config->timeout = timeout_;
    job_ = std::make_unique<sim::ProcessJob>(*config);
  }
  int rank() const { return job_->rank(); }
  int size() const { return job_->size(); }
  // name "": the job's own group (the program's default group); another name: a
  // fresh group every process opens under that name, or with `ranks` (ascending
  // job ranks), a group of those processes only, which only they open.
  std::shared_ptr<JobSession> session(const std::string& name, std::vector<int> ranks) {
    if (ranks.empty())
      for (int q = 0; q < size(); ++q) ranks.push_back(q);
    return std::make_shared<JobSession>(
        job_->open_session(name, timeout_, find_backend("gloo").job_transport, ranks), ledger_, ranks, size(), timeout_);
  }
  std::shared_ptr<Ledger> ledger() { return ledger_; }
  // The job's last barrier.
  void leave() { job_->leave(); }

 private:
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Ledger> ledger_;
  std::unique_ptr<sim::ProcessJob> job_;
};

}  // namespace cpsim::torch_backend

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using namespace cpsim::torch_backend;
  m.doc() = "cpsim's torch.distributed backend (a c10d Backend) and its spawned groups";
  py::module::import("torch.distributed");  // c10d::Backend's Python type first
  // cpsim's error classes as Python exceptions (RuntimeError's when torch's own
  // bindings carry them: the spawn then reads collective_failed()).
  py::register_exception<cpsim::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<cpsim::Aborted>(m, "Aborted", PyExc_RuntimeError);
  py::register_exception<cpsim::Unsupported>(m, "Unsupported", PyExc_NotImplementedError);
  py::register_exception<cpsim::InvalidInput>(m, "InvalidInput", PyExc_ValueError);
  py::class_<BackendCpsim, c10d::Backend, c10::intrusive_ptr<BackendCpsim>>(m, "BackendCpsim")
      .def("backend_name", &BackendCpsim::getBackendName)
      .def("collective_failed", &BackendCpsim::collective_failed);
  py::class_<Ledger, std::shared_ptr<Ledger>>(m, "Ledger")
      .def("outstanding", &Ledger::outstanding)
      .def("size", &Ledger::size)
      .def("unwaited", &Ledger::unwaited);
  py::class_<SpawnedGroup, std::shared_ptr<SpawnedGroup>>(m, "SpawnedGroup")
      .def(py::init<const std::string&, int, double>(), py::arg("backend"), py::arg("world_size"), py::arg("timeout"))
      .def("backend", &SpawnedGroup::backend, py::call_guard<py::gil_scoped_release>())
      .def("finish", &SpawnedGroup::finish, py::call_guard<py::gil_scoped_release>())
      .def("fail", &SpawnedGroup::fail, py::call_guard<py::gil_scoped_release>())
      .def("done", &SpawnedGroup::done, py::call_guard<py::gil_scoped_release>())
      .def("unreceived", &SpawnedGroup::unreceived)
      .def("ledger", &SpawnedGroup::ledger);
  py::class_<JobSession, std::shared_ptr<JobSession>>(m, "JobSession")
      .def("backend", &JobSession::backend)
      .def("finish", &JobSession::finish, py::call_guard<py::gil_scoped_release>())
      .def("fail", &JobSession::fail, py::call_guard<py::gil_scoped_release>())
      .def("collective_failed", &JobSession::collective_failed)
      .def("unreceived", &JobSession::unreceived);
  py::class_<JobGroup, std::shared_ptr<JobGroup>>(m, "JobGroup")
      .def(py::init<double>(), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("rank", &JobGroup::rank)
      .def("size", &JobGroup::size)
      .def("ledger", &JobGroup::ledger)
      .def("session", &JobGroup::session, py::arg("name"), py::arg("ranks") = std::vector<int>{},
           py::call_guard<py::gil_scoped_release>())
      .def("leave", &JobGroup::leave, py::call_guard<py::gil_scoped_release>());
  m.def("backends", [] { return cpsim::backend_names(); });
  m.def("set_site_context", [](std::string context) { site_context() = std::move(context); });
  m.def("set_own_path", [](std::string path) { own_path() = std::move(path); });
  m.def("set_internal_paths", [](std::vector<std::string> paths) { internal_paths() = std::move(paths); },
        "folders whose frames are not a call's site (torch's and cpsim's own)");
}
