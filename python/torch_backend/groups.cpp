#include "python/torch_backend/groups.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/error.hpp"
#include "python/torch_backend/backend.hpp"
#include "sim/gloo/process_wire.hpp"
#include "sim/job/job.hpp"

namespace cpsim::torch_backend {

namespace {

// "rendezvous" (a blocking send returns when a receive took it) or "eager" (at once).
Sends sends_of(const std::string& name) {
  if (name == "rendezvous") return Sends::rendezvous;
  if (name == "eager") return Sends::eager;
  throw InvalidInput("sends: rendezvous or eager, not " + name);
}

// The ranks of one spawn (cpsim.torch.spawn), each a thread, with one mailbox
// for the point to point of all of them.

class SpawnedGroup {
 public:
  // sends: "rendezvous" (a blocking send returns when a receive took it) or "eager".
  SpawnedGroup(const std::string& backend, int n, double timeout_s, const std::string& sends)
      : backend_(backend),
        timeout_(milliseconds(timeout_s)),
        board_(std::make_shared<ActivityBoard>(n)),
        mailbox_(std::make_shared<Mailbox>(n, timeout_, board_, sends_of(sends))),
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
    RankNames names;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& entry = groups_[name];
      if (!entry.group) {
        // Its reports name global ranks, and where a rank not in its call is
        // in another group's collective, which (the spawn's ranks share a board).
        entry.names = RankNames::of(ranks, static_cast<int>(ledgers_.size()));
        entry.names.elsewhere = [board = board_, group = entry.names.group](int rank) {
          return board->in_another_group(rank, group);
        };
        entry.group = find_backend(backend_).make_group(static_cast<int>(ranks.size()), timeout_, entry.names);
        entry.ranks = ranks;
      } else if (entry.ranks != ranks) {
        throw CollectiveError("ranks disagree on the members of group " + name);
      }
      group = entry.group;
      names = entry.names;
      memberships_[rank].emplace_back(group, group_rank);
    }
    RankContext ctx{
        std::shared_ptr<Communicator>(group->communicator(group_rank)), mailbox_, board_, ledgers_[rank], name, names};
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
    RankNames names;
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
  JobSession(std::unique_ptr<sim::ProcessJob::Session> session, std::shared_ptr<Ledger> ledger, std::vector<int> ranks,
             int job_size, std::chrono::milliseconds timeout, Sends sends)
      : session_(std::move(session)) {
    const int me = session_->gloo()->rank();
    auto board = std::make_shared<ActivityBoard>(job_size);
    mailbox_ = std::make_shared<Mailbox>(job_size, timeout, board, sends);
    wire_ = std::make_unique<sim::ProcessWire>(*session_->gloo(), ranks, mailbox_, timeout);
    sim::ProcessWire* wire = wire_.get();
    mailbox_->set_remote(
        ranks.at(me), [wire](int, int dst, int tag, const Mailbox::Message& m) { wire->send(dst, tag, m); },
        [wire](int src, int seq) { wire->receipt(src, seq); }, [wire](const Mailbox::State& s) { wire->state(s); },
        ranks);
    backend_ = c10::make_intrusive<BackendCpsim>(
        RankContext{session_->communicator(), mailbox_, board, std::move(ledger), "", RankNames::of(ranks, job_size)});
  }
  // The messages that came and no receive took (at the end of the program,
  // once every peer's end came: then every message sent here came too). ""
  // after the program raised: its report says why they were not received.
  std::string unreceived() {
    if (failed_) return "";
    wire_->wait_for_ends();
    return mailbox_->unreceived();
  }
  c10::intrusive_ptr<BackendCpsim> backend() { return backend_; }
  // The program returned: a peer still in a call learns it; a peer's call that
  // this rank did not join is reported here.
  void finish() {
    if (ended_) return;
    ended_ = true;
    wire_->ended("returned", false);  // after every message of this rank: its peers' receives from it end
    try {
      session_->finish();
    } catch (const CollectiveError&) {
      collective_failed_ = true;
      settle();
      throw;
    } catch (...) {
      settle();
      throw;
    }
  }
  // The program raised: every peer fails with this rank's error.
  void fail(const std::string& what) {
    if (ended_) return;
    ended_ = failed_ = true;
    wire_->ended("threw: " + what, true);
    session_->fail(what);
    settle();
  }
  bool collective_failed() const { return collective_failed_ || backend_->collective_failed(); }

 private:
  // A group that failed in its calls: the wire takes the peers' last notices
  // before it goes (a peer's notices come before its end; once every end came,
  // bounded by the timeout, none waits for a taker that is gone). A broken
  // group (a timeout, a lost connection) closed its connections: nothing more
  // comes, and a frozen or cut-off peer would hold this rank its whole timeout.
  void settle() {
    if (!session_->gloo()->broken()) wire_->wait_for_ends();
  }
  std::unique_ptr<sim::ProcessJob::Session> session_;
  std::shared_ptr<Mailbox> mailbox_;
  std::unique_ptr<sim::ProcessWire> wire_;  // after session_: its thread ends before the connections close
  c10::intrusive_ptr<BackendCpsim> backend_;
  bool ended_ = false, failed_ = false, collective_failed_ = false;
};

// This process's rank of a multi-process job (cpsim launch, torchrun, Slurm, Open
// MPI with CPSIM_STORE): sessions over Gloo between the processes, every call
// checked across them.
class JobGroup {
 public:
  JobGroup(double timeout_s, const std::string& sends)
      : timeout_(static_cast<std::int64_t>(timeout_s * 1000)), sends_(sends_of(sends)),
        ledger_(std::make_shared<Ledger>()) {
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
    return std::make_shared<JobSession>(job_->open_session(name, timeout_, find_backend("gloo").job_transport, ranks),
                                        ledger_, ranks, size(), timeout_, sends_);
  }
  std::shared_ptr<Ledger> ledger() { return ledger_; }
  // The job's last barrier.
  void leave() { job_->leave(); }

 private:
  std::chrono::milliseconds timeout_;
  Sends sends_;
  std::shared_ptr<Ledger> ledger_;
  std::unique_ptr<sim::ProcessJob> job_;
};

}  // namespace

void bind_groups(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<SpawnedGroup, std::shared_ptr<SpawnedGroup>>(m, "SpawnedGroup")
      .def(py::init<const std::string&, int, double, const std::string&>(), py::arg("backend"), py::arg("world_size"),
           py::arg("timeout"), py::arg("sends") = "rendezvous")
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
      .def(py::init<double, const std::string&>(), py::arg("timeout"), py::arg("sends") = "rendezvous",
           py::call_guard<py::gil_scoped_release>())
      .def("rank", &JobGroup::rank)
      .def("size", &JobGroup::size)
      .def("ledger", &JobGroup::ledger)
      .def("session", &JobGroup::session, py::arg("name"), py::arg("ranks") = std::vector<int>{},
           py::call_guard<py::gil_scoped_release>())
      .def("leave", &JobGroup::leave, py::call_guard<py::gil_scoped_release>());
}

}  // namespace cpsim::torch_backend
