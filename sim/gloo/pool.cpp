// In-process groups, their pool, and the backend's registration.
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>

#include "core/comm/registry.hpp"
#include "sim/gloo/pool.hpp"
#include "sim/gloo/protocol.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// In-process groups and their pool.

GlooThreadsGroup::GlooThreadsGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), connect_timeout_(timeout), store_(open_store("memory")), ranks_(size) {
  CPSIM_ENFORCE(size >= 1, "a group needs at least one rank");
}

GlooThreadsGroup::~GlooThreadsGroup() = default;

std::unique_ptr<Communicator> GlooThreadsGroup::communicator(int rank, std::chrono::milliseconds timeout,
                                                            const RankNames& names) {
  CPSIM_ENFORCE(rank >= 0 && rank < size_, "rank ", rank, " of ", size_);
  if (!ranks_[rank]) {
    std::shared_ptr<gloo::Context> context;
    if (size_ > 1) context = connect_gloo(rank, size_, *store_, gloo_device("127.0.0.1"), connect_timeout_);
    ranks_[rank] = std::make_shared<GlooRank>(context, rank, size_, store_, timeout, false);
  }
  ranks_[rank]->set_names(names);
  ranks_[rank]->begin(timeout);
  return ranks_[rank]->communicator();
}

// The rank threads go back to other backends' runs: back to SCHED_OTHER.
void GlooThreadsGroup::finish(int rank) {
  const BatchScope run_ends{true};
  if (ranks_[rank]) ranks_[rank]->finish();
}

void GlooThreadsGroup::fail(int rank, const std::string& what) {
  const BatchScope run_ends{true};
  if (ranks_[rank]) ranks_[rank]->fail(what);
}

bool GlooThreadsGroup::broken() const {
  for (const auto& r : ranks_)
    if (!r || r->broken()) return true;
  return false;
}

namespace {

// Idle groups, most recently used last. An in-process group of n ranks holds
// n(n-1) socket descriptors (both ends of every pair live here), so the pool keeps
// at most a quarter of this process's descriptor limit and closes the least
// recently used groups beyond it.
std::mutex pool_mutex;
std::vector<std::shared_ptr<GlooThreadsGroup>> pool;

std::size_t descriptors(const GlooThreadsGroup& g) { return static_cast<std::size_t>(g.size()) * (g.size() - 1) + 1; }

// The descriptors this process may open (RLIMIT_NOFILE), raised to the hard limit
// on first use: groups of 16 ranks need 240 each.
std::size_t descriptor_limit() {
  static const std::size_t limit = [] {
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return std::size_t{1024};
    if (lim.rlim_cur < lim.rlim_max) {
      rlimit raised = lim;
      raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? std::max<rlim_t>(lim.rlim_cur, 65536) : lim.rlim_max;
      if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
    }
    return static_cast<std::size_t>(std::min<rlim_t>(lim.rlim_cur, 1 << 20));
  }();
  return limit;
}

std::size_t descriptor_budget() { return descriptor_limit() / 4; }

// Descriptors kept free for everything else the process opens (files, stores, pipes).
constexpr std::size_t kSpareDescriptors = 64;
// From this many ranks, connecting an in-process group takes seconds: said first.
constexpr int kLargeGroup = 24;

}  // namespace

static int max_gloo_threads_ranks() {
  const std::size_t usable = descriptor_limit() > kSpareDescriptors ? descriptor_limit() - kSpareDescriptors : 0;
  int n = 1;
  while (static_cast<std::size_t>(n + 1) * n <= usable) ++n;
  return n;
}

static std::string gloo_threads_limit_reason() {
  const int most = max_gloo_threads_ranks();
  return "an in-process gloo group of n ranks holds n(n-1) sockets, and this process may open " +
         std::to_string(descriptor_limit()) + " descriptors (RLIMIT_NOFILE, ulimit -n), enough for " +
         std::to_string(most) + " ranks; raise the limit, run one process per rank (cpsim launch), or use --backend threads";
}

std::shared_ptr<GlooThreadsGroup> acquire_gloo_group(int n, std::chrono::milliseconds timeout) {
  // Too many ranks for the descriptors: a resource error now, not a hang in connect.
  if (n > max_gloo_threads_ranks()) throw Unavailable("gloo with " + std::to_string(n) + " ranks: " + gloo_threads_limit_reason());
  std::vector<std::shared_ptr<GlooThreadsGroup>> closing;  // closed outside the lock
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    for (auto it = pool.rbegin(); it != pool.rend(); ++it) {
      if ((*it)->size() != n) continue;
      auto group = *it;
      pool.erase(std::next(it).base());
      return group;
    }
    // Idle groups give their descriptors back when a new group needs them.
    std::size_t held = 0;
    for (const auto& g : pool) held += descriptors(*g);
    const std::size_t needed = static_cast<std::size_t>(n) * (n - 1) + kSpareDescriptors;
    while (!pool.empty() && held + needed > descriptor_limit()) {
      held -= descriptors(*pool.front());
      closing.push_back(pool.front());
      pool.erase(pool.begin());
    }
  }
  closing.clear();
  // Connecting is quadratic in the ranks (about 3 ms a rank pair here, on two
  // cores): a large group says so before the wait instead of going quiet.
  if (n >= kLargeGroup) {
    const double seconds = 3.3e-3 * n * n;
    const std::string line = "cpsim: gloo: connecting an in-process group of " + std::to_string(n) + " ranks (" +
                             std::to_string(n * (n - 1) / 2) + " loopback connections, about " +
                             std::to_string(static_cast<int>(seconds + 0.5)) +
                             " s); --backend threads runs the same checks without sockets\n";
    (void)!write(STDERR_FILENO, line.data(), line.size());
  }
  return std::make_shared<GlooThreadsGroup>(n, timeout);
}

void release_gloo_group(const std::shared_ptr<GlooThreadsGroup>& group) {
  if (group->broken()) return;  // its contexts close with it; the next run connects anew
  std::vector<std::shared_ptr<GlooThreadsGroup>> closing;  // closed outside the lock
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool.push_back(group);
  std::size_t held = 0;
  for (const auto& g : pool) held += descriptors(*g);
  while (held > descriptor_budget() && pool.size() > 1) {
    held -= descriptors(*pool.front());
    closing.push_back(pool.front());
    pool.erase(pool.begin());
  }
}

namespace {

// The pool hands a group to one run and takes it back when the run is done.
class PooledGlooGroup final : public Group {
 public:
  PooledGlooGroup(int n, std::chrono::milliseconds timeout, RankNames names)
      : group_(acquire_gloo_group(n, timeout)), timeout_(timeout), names_(std::move(names)) {}
  std::unique_ptr<Communicator> communicator(int rank) override { return group_->communicator(rank, timeout_, names_); }
  void finish(int rank) override { group_->finish(rank); }
  void fail(int rank, const std::string& what) override { group_->fail(rank, what); }
  void done() override { release_gloo_group(group_); }

 private:
  std::shared_ptr<GlooThreadsGroup> group_;
  std::chrono::milliseconds timeout_;
  RankNames names_;
};

const BackendRegistrar registrar{Backend{
    "gloo", "real Gloo over TCP: ranks as threads on loopback, or processes of a job (cpsim launch)",
    kGlooCapabilities,
    [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
      return std::make_shared<PooledGlooGroup>(n, timeout, names);
    },
    [] { return std::optional<std::string>(); },
    // In a job, gloo's ranks are the job's own Gloo side channel (sim/job/).
    [](const std::shared_ptr<SideChannel>& side, int) {
      const auto rank = std::dynamic_pointer_cast<GlooRank>(side);
      CPSIM_ENFORCE(rank, "a job's side channel that is not a Gloo rank");
      return rank->communicator();
    },
    [] { return std::pair<int, std::string>{max_gloo_threads_ranks(), gloo_threads_limit_reason()}; }}};

}  // namespace

}  // namespace cpsim::sim
