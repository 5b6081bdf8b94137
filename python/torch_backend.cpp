// The torch.distributed backend "cpsim" (issue: run the user's PyTorch CP code on
// cpsim's ranks): a c10d::ProcessGroup that forwards every call to one rank's
// cpsim Communicator, whose call check (SPEC §4) stands in front of every call.
// Calls run synchronously on the caller's thread (torch's bindings release the
// GIL), so a returned Work is complete. Built against the installed libtorch (1.13).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>

#include "core/comm/communicator.hpp"
#include "core/comm/registry.hpp"
#include "core/error.hpp"
#include "sim/job/job.hpp"

namespace cpsim::torch_backend {

namespace {

DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kBFloat16: return DType::bf16;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kBool: return DType::b8;
    default:
      throw Unsupported(std::string("cpsim does not support ") + op + " of dtype " +
                        std::string(c10::toString(t.scalar_type())));
  }
}

void expect_cpu_contiguous(const at::Tensor& t, const char* op) {
  if (!t.device().is_cpu())
    throw Unsupported(std::string("cpsim does not support ") + op + " of " + t.device().str() +
                      " tensors (this build's ranks keep host tensors)");
  if (!t.is_contiguous()) throw InvalidInput(std::string(op) + ": the tensor is not contiguous");
}

void expect_sum(c10d::ReduceOp op, const char* name) {
  if (op != c10d::ReduceOp::SUM)
    throw Unsupported(std::string("cpsim does not support ") + name + " with a reduction other than SUM");
}

void expect_one(std::size_t n, const char* op) {
  if (n != 1) throw Unsupported(std::string("cpsim does not support ") + op + " of " + std::to_string(n) + " tensors per rank");
}

// A call that already ran: complete, or holding what it threw.
class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(int rank) : c10d::Work(rank) { finish(); }
};

}  // namespace

// The point-to-point messages of one spawn: torch's send and recv, which only the
// two ranks call (cpsim's send_recv is a step every rank takes). A send is
// buffered and returns; a recv waits for the next message from its source with
// its tag, and checks its count and dtype. What would hang is a named error: a
// recv whose sender stopped or never sends within the timeout, a size or dtype
// that differs, and (at the end) a message no recv took.
class Mailbox {
 public:
  Mailbox(int ranks, std::chrono::milliseconds timeout) : state_(ranks, "running"), sent_(ranks, 0), timeout_(timeout) {}

  void send(int src, int dst, int tag, const void* data, std::size_t count, DType dtype) {
    std::lock_guard<std::mutex> lock(mutex_);
    check_peer(src, dst, "send to");
    Message m{std::string(static_cast<const char*>(data), count * dtype_size(dtype)), count, dtype, ++sent_[src]};
    queues_[{src, dst, tag}].push_back(std::move(m));
    cv_.notify_all();
  }

  void recv(int dst, int src, int tag, void* data, std::size_t count, DType dtype) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_peer(dst, src, "recv from");
    const std::string what = "rank " + std::to_string(dst) + " waits in recv from rank " + std::to_string(src) +
                             " (tag " + std::to_string(tag) + ", " + std::to_string(count) + " " +
                             dtype_name(dtype) + ")";
    auto& queue = queues_[{src, dst, tag}];
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (queue.empty()) {
      if (!failure_.empty()) throw CollectiveError(what + ", but the group stopped: " + failure_);
      if (state_[src] != "running")
        throw CollectiveError(what + ", but rank " + std::to_string(src) + " " + state_[src] +
                              " without sending it" + pending_of(src, dst));
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && queue.empty())
        throw CollectiveError(what + " and nothing came within " + std::to_string(timeout_.count()) + " ms" +
                              pending_of(src, dst));
    }
    Message m = std::move(queue.front());
    queue.pop_front();
    if (m.count != count || m.dtype != dtype)
      throw CollectiveError("rank " + std::to_string(dst) + "'s recv from rank " + std::to_string(src) + " (tag " +
                            std::to_string(tag) + ") expects " + std::to_string(count) + " " + dtype_name(dtype) +
                            "; rank " + std::to_string(src) + "'s send #" + std::to_string(m.seq) + " holds " +
                            std::to_string(m.count) + " " + dtype_name(m.dtype));
    std::memcpy(data, m.bytes.data(), m.bytes.size());
  }

  // A rank stopped: returned, or threw (then every waiting recv stops too).
  void stopped(int rank, const std::string& how, bool failed) {
    std::lock_guard<std::mutex> lock(mutex_);
    state_[rank] = how;
    if (failed && failure_.empty()) failure_ = "rank " + std::to_string(rank) + " " + how;
    cv_.notify_all();
  }

  // The messages no recv took, as one report ("" when none).
  std::string unreceived() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::ostringstream os;
    for (const auto& [key, queue] : queues_)
      for (const Message& m : queue)
        os << (os.tellp() > 0 ? "\n  " : "a send no recv took:\n  ") << "rank " << std::get<0>(key) << "'s send #"
           << m.seq << " to rank " << std::get<1>(key) << " (tag " << std::get<2>(key) << ", " << m.count << " "
           << dtype_name(m.dtype) << ")";
    return os.str();
  }

 private:
  struct Message {
    std::string bytes;
    std::size_t count;
    DType dtype;
    int seq;
  };
  void check_peer(int me, int peer, const char* op) const {
    if (peer < 0 || peer >= static_cast<int>(state_.size()) || peer == me)
      throw InvalidInput("rank " + std::to_string(me) + ": " + op + " rank " + std::to_string(peer) + " in a group of " +
                         std::to_string(state_.size()));
  }
  // What src did send dst, with other tags (a tag mix-up reads as a hang otherwise).
  std::string pending_of(int src, int dst) const {
    std::string out;
    for (const auto& [key, queue] : queues_)
      if (std::get<0>(key) == src && std::get<1>(key) == dst && !queue.empty())
        out += "; rank " + std::to_string(src) + " sent it " + std::to_string(queue.size()) + " with tag " +
               std::to_string(std::get<2>(key));
    return out;
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, int>, std::deque<Message>> queues_;
  std::vector<std::string> state_;
  std::vector<int> sent_;
  std::string failure_;
  std::chrono::milliseconds timeout_;
};

// One rank's process group over one rank's communicator.
class ProcessGroupCpsim : public c10d::ProcessGroup {
 public:
  ProcessGroupCpsim(std::shared_ptr<Communicator> comm, std::shared_ptr<Mailbox> mailbox)
      : c10d::ProcessGroup(comm->rank(), comm->size()), comm_(std::move(comm)), mailbox_(std::move(mailbox)) {}

  const std::string getBackendName() const override { return "cpsim"; }
  // Whether a call of this rank ended in cpsim's CollectiveError (the report of
  // what the ranks did), as opposed to an error of the rank's own.
  bool collective_failed() const { return collective_failed_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    expect_one(tensors.size(), "broadcast");
    at::Tensor& t = tensors[0];
    expect_cpu_contiguous(t, "broadcast");
    call([&](Communicator& c) { c.broadcast(t.data_ptr(), static_cast<std::size_t>(t.numel()), dtype_of(t, "broadcast"),
                     static_cast<int>(opts.rootRank)); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    expect_one(tensors.size(), "all_reduce");
    expect_sum(opts.reduceOp, "all_reduce");
    at::Tensor& t = tensors[0];
    expect_cpu_contiguous(t, "all_reduce");
    call([&](Communicator& c) { c.all_reduce(t.data_ptr(), static_cast<std::size_t>(t.numel()), dtype_of(t, "all_reduce")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override {
    expect_one(inputs.size(), "all_gather");
    expect_one(outputs.size(), "all_gather");
    const at::Tensor& in = inputs[0];
    expect_cpu_contiguous(in, "all_gather");
    if (static_cast<int>(outputs[0].size()) != getSize())
      throw InvalidInput("all_gather: " + std::to_string(outputs[0].size()) + " output tensors for " +
                         std::to_string(getSize()) + " ranks");
    at::Tensor staged = at::empty({getSize() * in.numel()}, in.options());
    call([&](Communicator& c) { c.all_gather(in.data_ptr(), staged.data_ptr(), static_cast<std::size_t>(in.numel()), dtype_of(in, "all_gather")); });
    for (int q = 0; q < getSize(); ++q) {
      at::Tensor& out = outputs[0][q];
      if (out.numel() != in.numel())
        throw InvalidInput("all_gather: output " + std::to_string(q) + " holds " + std::to_string(out.numel()) +
                           " elements, the input " + std::to_string(in.numel()));
      out.copy_(staged.narrow(0, q * in.numel(), in.numel()).view(out.sizes()));
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    expect_cpu_contiguous(input, "all_gather_into_tensor");
    expect_cpu_contiguous(output, "all_gather_into_tensor");
    if (output.numel() != getSize() * input.numel())
      throw InvalidInput("all_gather_into_tensor: the output holds " + std::to_string(output.numel()) +
                         " elements, not " + std::to_string(getSize()) + " x " + std::to_string(input.numel()));
    call([&](Communicator& c) { c.all_gather(input.data_ptr(), output.data_ptr(), static_cast<std::size_t>(input.numel()),
                      dtype_of(input, "all_gather_into_tensor")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    expect_one(outputs.size(), "reduce_scatter");
    expect_one(inputs.size(), "reduce_scatter");
    expect_sum(opts.reduceOp, "reduce_scatter");
    at::Tensor& out = outputs[0];
    expect_cpu_contiguous(out, "reduce_scatter");
    if (static_cast<int>(inputs[0].size()) != getSize())
      throw InvalidInput("reduce_scatter: " + std::to_string(inputs[0].size()) + " input tensors for " +
                         std::to_string(getSize()) + " ranks");
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : inputs[0]) flat.push_back(t.reshape({-1}));
    at::Tensor staged = at::cat(flat);
    call([&](Communicator& c) { c.reduce_scatter(staged.data_ptr(), out.data_ptr(), static_cast<std::size_t>(out.numel()),
                          dtype_of(out, "reduce_scatter")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    expect_sum(opts.reduceOp, "reduce_scatter_tensor");
    expect_cpu_contiguous(input, "reduce_scatter_tensor");
    expect_cpu_contiguous(output, "reduce_scatter_tensor");
    if (input.numel() != getSize() * output.numel())
      throw InvalidInput("reduce_scatter_tensor: the input holds " + std::to_string(input.numel()) +
                         " elements, not " + std::to_string(getSize()) + " x " + std::to_string(output.numel()));
    call([&](Communicator& c) { c.reduce_scatter(input.data_ptr(), output.data_ptr(), static_cast<std::size_t>(output.numel()),
                          dtype_of(output, "reduce_scatter_tensor")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    expect_mailbox("send");
    expect_one(tensors.size(), "send");
    const at::Tensor& t = tensors[0];
    expect_cpu_contiguous(t, "send");
    point_to_point([&] { mailbox_->send(getRank(), dst, tag, t.data_ptr(), t.numel(), dtype_of(t, "send")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    expect_mailbox("recv");
    expect_one(tensors.size(), "recv");
    at::Tensor& t = tensors[0];
    expect_cpu_contiguous(t, "recv");
    point_to_point([&] { mailbox_->recv(getRank(), src, tag, t.data_ptr(), t.numel(), dtype_of(t, "recv")); });
    return done();
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    call([&](Communicator& c) { c.barrier(); });
    return done();
  }

  // What cpsim's communicators do not have: a typed error (cpsim.torch's
  // Unsupported, a NotImplementedError), never torch's generic one.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>&,
                                                     const c10d::AllreduceCoalescedOptions&) override {
    throw unsupported("all_reduce_coalesced");
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>&, const c10d::ReduceOptions&) override {
    throw unsupported("reduce");
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                                     const c10d::AllgatherOptions&) override {
    throw unsupported("all_gather_coalesced");
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                        const c10d::GatherOptions&) override {
    throw unsupported("gather");
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                                         const c10d::ScatterOptions&) override {
    throw unsupported("scatter");
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    throw unsupported("all_to_all_single");
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                                          const c10d::AllToAllOptions&) override {
    throw unsupported("all_to_all");
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    throw unsupported("recv from any source");
  }

 private:
  c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<DoneWork>(getRank()); }
  static Unsupported unsupported(const char* op) {
    return Unsupported(std::string("cpsim does not support ") + op +
                       " (its communicators have all_gather, reduce_scatter, all_reduce, broadcast, barrier and "
                       "send/recv)");
  }
  void expect_mailbox(const char* op) const {
    if (!mailbox_)
      throw Unsupported(std::string("cpsim does not support ") + op +
                        " between processes (ranks as threads of one process have it: cpsim.torch.spawn)");
  }
  // The communicator, for one call: its CollectiveError is remembered.
  template <class F>
  void call(F&& f) {
    try {
      f(*comm_);
    } catch (const CollectiveError&) {
      collective_failed_ = true;
      throw;
    }
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
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Mailbox> mailbox_;
  bool collective_failed_ = false;
};

// The ranks of one spawn: a group of a registered backend, each rank's process
// group made on that rank's own thread.
class SpawnedGroup {
 public:
  SpawnedGroup(const std::string& backend, int n, double timeout_s)
      : group_(find_backend(backend).make_group(n, milliseconds(timeout_s))),
        mailbox_(std::make_shared<Mailbox>(n, milliseconds(timeout_s))) {
    const Backend& b = find_backend(backend);
    if (auto why = b.unavailable()) throw Unavailable("backend " + backend + ": " + *why);
  }
  c10::intrusive_ptr<ProcessGroupCpsim> process_group(int rank) {
    std::shared_ptr<Communicator> comm = group_->communicator(rank);
    return c10::make_intrusive<ProcessGroupCpsim>(std::move(comm), mailbox_);
  }
  void finish(int rank) {
    mailbox_->stopped(rank, "returned", false);
    group_->finish(rank);
  }
  void fail(int rank, const std::string& what) {
    mailbox_->stopped(rank, "threw: " + what, true);
    group_->fail(rank, what);
  }
  void done() { group_->done(); }
  std::string unreceived() { return mailbox_->unreceived(); }

 private:
  static std::chrono::milliseconds milliseconds(double s) {
    return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000));
  }
  std::shared_ptr<Group> group_;
  std::shared_ptr<Mailbox> mailbox_;
};

// One session of a job (sim::ProcessJob::Session) as a process group: the
// program's own (the job's group) or one case of the harness (a fresh group).
class JobSession {
 public:
  explicit JobSession(std::unique_ptr<sim::ProcessJob::Session> session)
      : session_(std::move(session)), pg_(c10::make_intrusive<ProcessGroupCpsim>(session_->communicator(), nullptr)) {}
  c10::intrusive_ptr<ProcessGroupCpsim> process_group() { return pg_; }
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
  bool collective_failed() const { return collective_failed_ || pg_->collective_failed(); }

 private:
  std::unique_ptr<sim::ProcessJob::Session> session_;
  c10::intrusive_ptr<ProcessGroupCpsim> pg_;
  bool ended_ = false, collective_failed_ = false;
};

// This process's rank of a multi-process job (cpsim launch, torchrun, Slurm, Open
// MPI with CPSIM_STORE): sessions over Gloo between the processes, every call
// checked across them.
class JobGroup {
 public:
  explicit JobGroup(double timeout_s) : timeout_(static_cast<std::int64_t>(timeout_s * 1000)) {
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
  // fresh group every process opens under that name.
  std::shared_ptr<JobSession> session(const std::string& name) {
    return std::make_shared<JobSession>(job_->open_session(name, timeout_, find_backend("gloo").job_transport));
  }
  // The job's last barrier.
  void leave() { job_->leave(); }

 private:
  std::chrono::milliseconds timeout_;
  std::unique_ptr<sim::ProcessJob> job_;
};

}  // namespace cpsim::torch_backend

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using namespace cpsim::torch_backend;
  m.doc() = "cpsim's torch.distributed backend (the ProcessGroup) and its spawned groups";
  py::module::import("torch.distributed");  // c10d::ProcessGroup's Python type first
  // cpsim's error classes as Python exceptions (RuntimeError's when torch's own
  // bindings carry them: the spawn then reads collective_failed()).
  py::register_exception<cpsim::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<cpsim::Aborted>(m, "Aborted", PyExc_RuntimeError);
  py::register_exception<cpsim::Unsupported>(m, "Unsupported", PyExc_NotImplementedError);
  py::register_exception<cpsim::InvalidInput>(m, "InvalidInput", PyExc_ValueError);
  py::class_<ProcessGroupCpsim, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupCpsim>>(m, "ProcessGroupCpsim")
      .def("backend_name", &ProcessGroupCpsim::getBackendName)
      .def("collective_failed", &ProcessGroupCpsim::collective_failed);
  py::class_<SpawnedGroup, std::shared_ptr<SpawnedGroup>>(m, "SpawnedGroup")
      .def(py::init<const std::string&, int, double>(), py::arg("backend"), py::arg("world_size"), py::arg("timeout"))
      .def("process_group", &SpawnedGroup::process_group, py::call_guard<py::gil_scoped_release>())
      .def("finish", &SpawnedGroup::finish, py::call_guard<py::gil_scoped_release>())
      .def("fail", &SpawnedGroup::fail, py::call_guard<py::gil_scoped_release>())
      .def("done", &SpawnedGroup::done, py::call_guard<py::gil_scoped_release>())
      .def("unreceived", &SpawnedGroup::unreceived);
  py::class_<JobSession, std::shared_ptr<JobSession>>(m, "JobSession")
      .def("process_group", &JobSession::process_group)
      .def("finish", &JobSession::finish, py::call_guard<py::gil_scoped_release>())
      .def("fail", &JobSession::fail, py::call_guard<py::gil_scoped_release>())
      .def("collective_failed", &JobSession::collective_failed);
  py::class_<JobGroup, std::shared_ptr<JobGroup>>(m, "JobGroup")
      .def(py::init<double>(), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("rank", &JobGroup::rank)
      .def("size", &JobGroup::size)
      .def("session", &JobGroup::session, py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("leave", &JobGroup::leave, py::call_guard<py::gil_scoped_release>());
  m.def("backends", [] { return cpsim::backend_names(); });
}
