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
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <thread>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>

#include "core/comm/call_check.hpp"
#include "core/comm/communicator.hpp"
#include "core/comm/registry.hpp"
#include "core/error.hpp"
#include "sim/gloo/gloo.hpp"
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
// What each rank of a spawn is doing, for reports: a collective, a wait for a
// receive, or nothing; with the call site.

class Board {
 public:
  explicit Board(int ranks) : doing_(ranks) {}
  // collective: the communicator sees it too (its reports name it already).
  void set(int rank, std::string what, bool collective = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    doing_.at(rank) = {std::move(what), collective};
  }
  // "\n  rank q: waits for its recv from rank 0 (tag 3) at step.py:12", for every
  // rank doing something (outside_collectives: only what the communicator does
  // not see, the waits in point to point).
  std::string lines(bool outside_collectives = false) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    for (std::size_t q = 0; q < doing_.size(); ++q)
      if (!doing_[q].what.empty() && !(outside_collectives && doing_[q].collective))
        out += "\n  rank " + std::to_string(q) + ": " + doing_[q].what;
    return out;
  }

 private:
  struct Doing {
    std::string what;
    bool collective = false;
  };
  mutable std::mutex mutex_;
  std::vector<Doing> doing_;
};

// ---------------------------------------------------------------------------
// Point to point: torch's send and recv between ranks of one spawn. A send is
// buffered and completes at once; a receive is posted and completes when a
// message with its source (or any source) and tag comes, in the order they were
// sent, whichever of the two came first (a ring that posts its irecv first is
// fine). What would hang is a named error: a receive nothing comes for within
// the timeout (with every rank's pending messages and receives, and what each
// rank is doing), a size or dtype that differs, and at the end a message nobody
// received.

struct PostedRecv {
  at::Tensor tensor;
  std::string group;
  int dst = -1, src = -1, tag = 0;  // src -1: any source
  std::string site;
  bool done = false;
  int source = -1;  // who sent it, once done
  std::string error;
  std::string what() const {
    return "recv from " + (src < 0 ? std::string("any rank") : "rank " + std::to_string(src)) + " (tag " +
           std::to_string(tag) + ", " + shape_text(tensor) + ")" + (site.empty() ? "" : " at " + site);
  }
};

class Mailbox {
 public:
  struct Message {
    at::Tensor bytes;
    std::string dtype;
    std::int64_t numel = 0;
    int seq = 0;
    std::string site;
    std::uint64_t arrival = 0;  // the order messages came to this mailbox in
  };
  // How a message leaves this process for rank dst of another (a job's
  // processes: ProcessWire); it returns once the message is on its way.
  using Remote = std::function<void(int src, int dst, int tag, const Message& m)>;

  Mailbox(int ranks, std::chrono::milliseconds timeout, std::shared_ptr<Board> board)
      : state_(ranks, "running"), sent_(ranks, 0), timeout_(timeout), board_(std::move(board)) {}
  // The mailbox of one process of a job: its receives are rank `local`'s; sends
  // to any other rank go through `remote`.
  void set_remote(int local, Remote remote) { local_ = local, remote_ = std::move(remote); }

  void send(const std::string& group, int src, int dst, int tag, const at::Tensor& t, const std::string& site) {
    std::unique_lock<std::mutex> lock(mutex_);
    check_peer(src, dst, "send to");
    const bool remote = remote_ && dst != local_;
    // A message kept here is a copy (the send completes at once); one for
    // another process leaves before the send returns.
    Message m{remote ? as_bytes(t) : as_bytes(t).clone(), dtype_text(t), t.numel(), ++sent_[src], site};
    if (remote) {
      lock.unlock();
      remote_(src, dst, tag, m);
      return;
    }
    arrive_locked(group, src, dst, tag, std::move(m));
  }

  // A message from another process for this one's rank.
  void arrive(const std::string& group, int src, int dst, int tag, Message m) {
    std::lock_guard<std::mutex> lock(mutex_);
    arrive_locked(group, src, dst, tag, std::move(m));
  }

  std::shared_ptr<PostedRecv> post(const std::string& group, int dst, int src, int tag, at::Tensor t,
                                   const std::string& site) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (src >= 0) check_peer(dst, src, "recv from");
    auto p = std::make_shared<PostedRecv>();
    p->tensor = std::move(t), p->group = group, p->dst = dst, p->src = src, p->tag = tag, p->site = site;
    // The earliest message that matches (from any source: whichever came first).
    std::deque<Message>* earliest = nullptr;
    int from = -1;
    for (auto& [key, queue] : queues_) {
      const auto& [g, s, d, tg] = key;
      if (queue.empty() || g != group || d != dst || tg != tag || (src >= 0 && s != src)) continue;
      if (earliest == nullptr || queue.front().arrival < earliest->front().arrival) earliest = &queue, from = s;
    }
    if (earliest != nullptr) {
      Message m = std::move(earliest->front());
      earliest->pop_front();
      deliver(*p, from, m);
      return p;
    }
    posted_.push_back(p);
    return p;
  }

  // Waits for a posted receive, at most `limit` when it is set and shorter than
  // the group's timeout (Work.wait(timeout)); throws what went wrong.
  void wait(PostedRecv& p, std::chrono::milliseconds limit = std::chrono::milliseconds(0)) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto start = Clock::now();
    const std::chrono::milliseconds timeout = limit.count() > 0 ? std::min(limit, timeout_) : timeout_;
    const auto deadline = start + timeout;
    if (!p.done) board_->set(p.dst, "waits for its " + p.what());
    while (!p.done) {
      if (!failure_.empty()) {
        board_->set(p.dst, "");
        throw CollectiveError("rank " + std::to_string(p.dst) + " waits for its " + p.what() +
                              ", but the group stopped: " + failure_);
      }
      if (p.src >= 0 && state_[p.src] != "running") {
        board_->set(p.dst, "");
        throw CollectiveError("rank " + std::to_string(p.dst) + " waits for its " + p.what() + ", but rank " +
                              std::to_string(p.src) + " " + state_[p.src] + " without sending it" +
                              pending_locked());
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !p.done) {
        const std::string report = "timeout: rank " + std::to_string(p.dst) + " " + waited_since(start, timeout) +
                                   " for its " + p.what() + " and nothing came" + pending_locked() +
                                   "\n what the ranks are doing:" + board_->lines();
        board_->set(p.dst, "timed out waiting for its " + p.what());
        failure_ = "rank " + std::to_string(p.dst) + " timed out in its " + p.what();
        cv_.notify_all();
        throw CollectiveError(report);
      }
    }
    board_->set(p.dst, "");
    forget(p);
    if (!p.error.empty()) throw CollectiveError(p.error);
  }

  // A rank stopped: returned, or threw (then every waiting receive stops too).
  void stopped(int rank, const std::string& how, bool failed) {
    std::lock_guard<std::mutex> lock(mutex_);
    state_[rank] = how;
    if (failed && failure_.empty()) failure_ = "rank " + std::to_string(rank) + " " + how;
    cv_.notify_all();
  }

  // The messages no receive took, and the receives nothing came for (none
  // waited: an unwaited request is reported by its rank), as one report.
  std::string unreceived() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::ostringstream os;
    for (const auto& [key, queue] : queues_)
      for (const Message& m : queue)
        os << (os.tellp() > 0 ? "\n  " : "a send no recv took:\n  ") << "rank " << std::get<1>(key) << "'s send #"
           << m.seq << " to rank " << std::get<2>(key) << " (tag " << std::get<3>(key) << ", " << m.dtype << " x "
           << m.numel << ")" << (m.site.empty() ? "" : " at " + m.site);
    return os.str();
  }

  // Every rank's pending point-to-point: "\n  rank 0: sent rank 1 ... (not
  // received); posted recv from ... (nothing came)".
  std::string pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_locked();
  }

 private:
  // The message to the first posted receive it matches, else to its queue.
  void arrive_locked(const std::string& group, int src, int dst, int tag, Message m) {
    m.arrival = ++arrivals_;
    for (auto& p : posted_) {
      if (p->done || p->group != group || p->dst != dst || p->tag != tag || (p->src >= 0 && p->src != src)) continue;
      deliver(*p, src, m);
      cv_.notify_all();
      return;
    }
    queues_[{group, src, dst, tag}].push_back(std::move(m));
  }
  void deliver(PostedRecv& p, int src, const Message& m) {
    p.done = true;
    p.source = src;
    if (m.numel != p.tensor.numel() || m.dtype != dtype_text(p.tensor)) {
      p.error = "rank " + std::to_string(p.dst) + "'s " + p.what() + " got rank " + std::to_string(src) + "'s send #" +
                std::to_string(m.seq) + ", which holds " + m.dtype + " x " + std::to_string(m.numel) +
                (m.site.empty() ? "" : " (sent at " + m.site + ")");
      return;
    }
    write_bytes(p.tensor, m.bytes);
  }
  void forget(PostedRecv& p) {
    posted_.remove_if([&](const std::shared_ptr<PostedRecv>& q) { return q.get() == &p; });
  }
  void check_peer(int me, int peer, const char* op) const {
    if (peer < 0 || peer >= static_cast<int>(state_.size()) || peer == me)
      throw InvalidInput("rank " + std::to_string(me) + ": " + op + " rank " + std::to_string(peer) + " in a group of " +
                         std::to_string(state_.size()));
  }
  std::string pending_locked() const {
    std::string out;
    for (const auto& [key, queue] : queues_)
      for (const Message& m : queue)
        out += "\n  rank " + std::to_string(std::get<1>(key)) + " sent rank " + std::to_string(std::get<2>(key)) +
               " " + m.dtype + " x " + std::to_string(m.numel) + " (tag " + std::to_string(std::get<3>(key)) +
               (m.site.empty() ? "" : ", at " + m.site) + "), not received yet";
    for (const auto& p : posted_)
      if (!p->done) out += "\n  rank " + std::to_string(p->dst) + " posted a " + p->what() + ", nothing came yet";
    return out.empty() ? out : "; pending point-to-point:" + out;
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<std::string, int, int, int>, std::deque<Message>> queues_;
  std::list<std::shared_ptr<PostedRecv>> posted_;
  std::vector<std::string> state_;
  std::vector<int> sent_;
  std::string failure_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Board> board_;
  int local_ = -1;
  Remote remote_;
  std::uint64_t arrivals_ = 0;
};

// ---------------------------------------------------------------------------
// Point to point between the processes of a job, over the group's Gloo context
// (slots of its own): a send writes a header (tag, dtype, count, the sender's
// call site) and the bytes; a thread of each process takes every message that
// comes, from any peer, into the process's mailbox, where its receives match
// them as between threads (any order, sizes checked, timeouts named).

struct WireHeader {
  std::int64_t tag = 0, numel = 0, nbytes = 0, seq = 0;
  char dtype[24] = {};
  char site[96] = {};
};

inline constexpr std::uint64_t kTorchHeaderSlot = 0xC5ull << 56 | 8;
inline constexpr std::uint64_t kTorchPayloadSlot = 0xC5ull << 56 | 9;

class ProcessWire {
 public:
  // ranks: the job ranks of the group's ranks; me: this process's group rank.
  ProcessWire(std::shared_ptr<gloo::Context> context, std::vector<int> ranks, int me, std::shared_ptr<Mailbox> mailbox,
              std::chrono::milliseconds timeout)
      : context_(std::move(context)), ranks_(std::move(ranks)), me_(me), mailbox_(std::move(mailbox)),
        timeout_(timeout) {
    if (context_ && ranks_.size() > 1) thread_ = std::thread([this] { take(); });
  }
  ~ProcessWire() {
    stopping_ = true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (header_) header_->abortWaitRecv();
    }
    if (thread_.joinable()) thread_.join();
  }

  void send(int dst, int tag, const Mailbox::Message& m) {
    const auto it = std::find(ranks_.begin(), ranks_.end(), dst);
    if (it == ranks_.end() || !context_) throw InvalidInput("send to rank " + std::to_string(dst) + ": not in this group");
    const int peer = static_cast<int>(it - ranks_.begin());
    WireHeader h;
    h.tag = tag, h.numel = m.numel, h.nbytes = m.bytes.numel(), h.seq = m.seq;
    std::strncpy(h.dtype, m.dtype.c_str(), sizeof h.dtype - 1);
    std::strncpy(h.site, m.site.c_str(), sizeof h.site - 1);
    try {
      auto header = context_->createUnboundBuffer(&h, sizeof h);
      std::unique_ptr<gloo::transport::UnboundBuffer> payload;
      header->send(peer, kTorchHeaderSlot);
      if (h.nbytes) {
        payload = context_->createUnboundBuffer(m.bytes.data_ptr(), static_cast<std::size_t>(h.nbytes));
        payload->send(peer, kTorchPayloadSlot);
      }
      header->waitSend(timeout_);
      if (payload) payload->waitSend(timeout_);
    } catch (const std::exception& e) {
      throw CollectiveError("rank " + std::to_string(ranks_[me_]) + "'s send to rank " + std::to_string(dst) +
                            " (tag " + std::to_string(tag) + ", " + m.dtype + " x " + std::to_string(m.numel) +
                            ") did not leave within " + std::to_string(timeout_.count()) + " ms: " + e.what());
    }
  }

 private:
  // Every message from any peer, into the mailbox, until the group ends.
  void take() {
    std::vector<int> peers;
    for (int q = 0; q < static_cast<int>(ranks_.size()); ++q)
      if (q != me_) peers.push_back(q);
    while (!stopping_) {
      WireHeader h;
      int src = -1;
      try {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (stopping_) return;
          header_ = context_->createUnboundBuffer(&h, sizeof h);
          header_->recv(peers, kTorchHeaderSlot);
        }
        if (!header_->waitRecv(&src, std::chrono::hours(24 * 365)) || stopping_) return;
        at::Tensor bytes = at::empty({h.nbytes}, at::kByte);
        if (h.nbytes) {
          auto payload = context_->createUnboundBuffer(bytes.data_ptr(), static_cast<std::size_t>(h.nbytes));
          payload->recv(src, kTorchPayloadSlot);
          payload->waitRecv(timeout_);
        }
        h.dtype[sizeof h.dtype - 1] = h.site[sizeof h.site - 1] = 0;
        mailbox_->arrive("", ranks_[src], ranks_[me_], static_cast<int>(h.tag),
                         Mailbox::Message{bytes, h.dtype, h.numel, static_cast<int>(h.seq), h.site});
      } catch (const std::exception&) {
        return;  // the group's connections closed (a peer ended or failed): its calls report that
      }
    }
  }

  std::shared_ptr<gloo::Context> context_;
  std::vector<int> ranks_;
  int me_;
  std::shared_ptr<Mailbox> mailbox_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

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
  std::shared_ptr<Board> board;      // what each rank does (the spawn's ranks, or this process's)
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
    point_to_point([&] { ctx_.mailbox->send(ctx_.group, global(getRank()), global(dst), tag, t, site); });
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
    point_to_point([&] { p = ctx_.mailbox->post(ctx_.group, global(getRank()), src < 0 ? -1 : global(src), tag, t, site); });
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
        board_(std::make_shared<Board>(n)),
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
  std::shared_ptr<Board> board_;
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
    auto board = std::make_shared<Board>(job_size);
    mailbox_ = std::make_shared<Mailbox>(job_size, timeout, board);
    wire_ = std::make_unique<ProcessWire>(session_->gloo()->context_ptr(), ranks, me, mailbox_, timeout);
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
  std::unique_ptr<ProcessWire> wire_;  // after session_: its thread ends before the connections close
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
