#include "sim/world.hpp"

#include <gloo/context.h>
#include <gloo/rendezvous/prefix_store.h>

#include <unistd.h>

#include <cstdlib>
#include <random>
#include <cstring>
#include <map>
#include <memory>

#include "sim/gloo/gloo.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;

// ---------------------------------------------------------------------------
// Environment.

namespace {

std::optional<std::string> env(const char* key) {
  const char* v = std::getenv(key);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& value, const char* key) {
  try {
    std::size_t used = 0;
    const int v = std::stoi(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  CPSIM_INVALID("environment variable ", key, "='", value, "' is not a whole number");
}

}  // namespace

std::optional<WorldConfig> world_from_environment() {
  static const struct {
    const char *rank, *size, *source;
  } kSources[] = {{"RANK", "WORLD_SIZE", "RANK/WORLD_SIZE"},
                  {"SLURM_PROCID", "SLURM_NTASKS", "Slurm"},
                  {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"}};
  for (const auto& s : kSources) {
    const auto rank = env(s.rank), size = env(s.size);
    if (!rank || !size) continue;
    WorldConfig c;
    c.rank = parse_int(*rank, s.rank);
    c.size = parse_int(*size, s.size);
    c.source = s.source;
    if (c.size < 1 || c.rank < 0 || c.rank >= c.size)
      CPSIM_INVALID(s.rank, "=", c.rank, " and ", s.size, "=", c.size, " do not name a rank of the job");
    c.store = env("CPSIM_STORE").value_or("");
    if (auto job = env("CPSIM_JOB_ID")) c.job = *job;
    else if (auto slurm = env("SLURM_JOB_ID")) c.job = "slurm-" + *slurm + "." + env("SLURM_STEP_ID").value_or("0");
    else if (auto ompi = env("OMPI_MCA_ess_base_jobid")) c.job = "ompi-" + *ompi;
    else c.job = "cpsim";
    return c;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// The joined job.

namespace {

struct World {
  WorldConfig config;
  std::shared_ptr<Store> base;
  std::shared_ptr<Store> job;  // base, under the job's prefix: rendezvous and failure records
  std::vector<std::shared_ptr<Store>> prefixes;
  std::shared_ptr<GlooRank> all;                    // every process
  std::map<int, std::shared_ptr<GlooRank>> groups;  // ranks 0..n-1, for n < size
  std::string failure;

  std::shared_ptr<Store> prefixed(const std::string& prefix) {
    auto s = std::make_shared<gloo::rendezvous::PrefixStore>(prefix, *job);
    prefixes.push_back(s);
    return s;
  }
  std::shared_ptr<GlooRank> connect(int n, const std::string& name) {
    std::shared_ptr<gloo::Context> context;
    if (n > 1) context = connect_gloo(config.rank, n, *prefixed(name), gloo_device(""), config.timeout, job.get());
    return std::make_shared<GlooRank>(context, config.rank, n, job, config.timeout, true);
  }
  std::shared_ptr<GlooRank> group(int n) {
    if (n == config.size) return all;
    auto& g = groups[n];
    if (!g) g = connect(n, "group" + std::to_string(n));
    return g;
  }
};

std::unique_ptr<World> world;

// This process, as a claim on its rank: "host HOST pid PID tag TAG".
std::string claim_token() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::random_device rd;
  return "host " + std::string(host) + " pid " + std::to_string(getpid()) + " tag " + std::to_string(rd());
}

[[noreturn]] void job_in_use(const WorldConfig& c, const std::string& holder) {
  CPSIM_INVALID("job id '", c.job, "' is already in use on store ", c.store, ": rank ", c.rank, " is claimed by ",
                holder, " (another job with this id, or an earlier one whose keys remain); give this run its own "
                "CPSIM_JOB_ID or a fresh store (cpsim launch picks both)");
}

}  // namespace

void join_world(const WorldConfig& config) {
  CPSIM_ENFORCE(!world, "this process already joined a job");
  if (config.store.empty())
    CPSIM_INVALID("rank ", config.rank, " of ", config.size, " (from ", config.source,
                  ") needs a rendezvous store: --store file:DIR or --store redis://HOST:PORT, or CPSIM_STORE");
  auto w = std::make_unique<World>();
  w->config = config;
  w->base = open_store(config.store);
  w->job = std::make_shared<gloo::rendezvous::PrefixStore>(config.job, *w->base);
  // A job id is used once per store: each rank claims its key atomically before
  // it connects, so of two processes that want one rank exactly one gets it, and
  // the other is refused, never joined (two jobs would pair up). Its claim (host,
  // pid) is also what peers read to say whether it is alive when it goes quiet.
  const std::string token = claim_token();
  if (auto holder = claim_key(config.store, *w->base, config.job + "/claim/" + std::to_string(config.rank), token))
    job_in_use(config, *holder);
  w->job->set("holder/" + std::to_string(config.rank), std::vector<char>(token.begin(), token.end()));
  w->all = w->connect(config.size, "world");
  world = std::move(w);
}

void leave_world() {
  if (!world) return;
  if (world->failure.empty() && world->config.size > 1) {
    // Nobody closes a connection a peer still reads from: one last barrier.
    try {
      world->all->begin(world->config.timeout);
      world->all->communicator()->barrier();
    } catch (const std::exception&) {
    }
  }
  world.reset();
}

void expect_same_job(std::uint64_t fingerprint) {
  CPSIM_ENFORCE(world, "expect_same_job before join_world");
  const int n = world->config.size;
  std::vector<std::uint64_t> all(n);
  world->all->begin(world->config.timeout);
  world->all->communicator()->all_gather(&fingerprint, all.data(), 1, DType::i64);
  std::string differ;
  for (int q = 1; q < n; ++q)
    if (all[q] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(q);
  if (!differ.empty())
    CPSIM_INVALID(differ.find(',') == std::string::npos ? "rank " : "ranks ", differ,
                  differ.find(',') == std::string::npos ? " runs" : " run",
                  " a different job than rank 0: the command line or the batch files differ");
}

std::optional<WorldInfo> current_world() {
  if (!world) return std::nullopt;
  return WorldInfo{world->config.rank, world->config.size, world->failure};
}

// ---------------------------------------------------------------------------
// Outputs on the wire.

namespace {

template <class T>
void put(std::vector<std::uint8_t>& out, T v) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

struct Reader {
  const std::uint8_t* p;
  const std::uint8_t* end;
  template <class T>
  T get() {
    CPSIM_ENFORCE(p + sizeof(T) <= end, "truncated tensor message");
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  const std::uint8_t* bytes(std::size_t n) {
    CPSIM_ENFORCE(p + n <= end, "truncated tensor message");
    const std::uint8_t* at = p;
    p += n;
    return at;
  }
};

}  // namespace

std::vector<std::uint8_t> serialize_tensors(const std::vector<Tensor>& tensors) {
  std::vector<std::uint8_t> out;
  put<std::uint32_t>(out, static_cast<std::uint32_t>(tensors.size()));
  for (const Tensor& t : tensors) {
    put<std::uint8_t>(out, t.defined());
    if (!t.defined()) continue;
    put<std::uint8_t>(out, static_cast<std::uint8_t>(t.dtype()));
    put<std::uint32_t>(out, static_cast<std::uint32_t>(t.ndim()));
    for (std::int64_t d : t.shape()) put<std::int64_t>(out, d);
    const Tensor c = t.clone();  // contiguous bytes of exactly this view
    const auto* p = static_cast<const std::uint8_t*>(c.raw());
    out.insert(out.end(), p, p + c.nbytes());
  }
  return out;
}

std::vector<Tensor> deserialize_tensors(const std::uint8_t* data, std::size_t size) {
  Reader r{data, data + size};
  std::vector<Tensor> out(r.get<std::uint32_t>());
  for (Tensor& t : out) {
    if (!r.get<std::uint8_t>()) continue;
    const auto dtype = static_cast<DType>(r.get<std::uint8_t>());
    Shape shape(r.get<std::uint32_t>());
    for (auto& d : shape) d = r.get<std::int64_t>();
    t = Tensor(shape, dtype);
    if (t.nbytes()) std::memcpy(t.raw(), r.bytes(t.nbytes()), t.nbytes());
  }
  return out;
}

// ---------------------------------------------------------------------------
// run_ranks across processes.

namespace {

[[noreturn]] void fail_job(const std::string& why) {
  world->failure = why;
  // Peers that wait on this process (ranks sitting a run out) learn at once.
  if (world->all && world->all->context_ptr()) {
    try {
      world->all->context_ptr()->closeConnections();
    } catch (const std::exception&) {
    }
  }
  throw Aborted(why);
}

}  // namespace

void run_in_world(int n, const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout,
                  const RankOutputs& outputs, const RankTransport& transport) {
  CPSIM_ENFORCE(world, "run_in_world before join_world");
  World& w = *world;
  if (!w.failure.empty())
    throw Aborted("the job stopped at an earlier failure: " + w.failure.substr(0, w.failure.find('\n')));
  if (n > w.config.size)
    CPSIM_INVALID("a group of ", n, " ranks needs ", n, " processes; this job has ", w.config.size,
                  " (start it with cpsim launch -n ", n, ")");
  std::optional<FailureReport> failure;  // this rank's, if it failed
  if (w.config.rank < n) {
    std::shared_ptr<GlooRank> g;
    try {
      g = w.group(n);
      g->begin(timeout);
      const std::unique_ptr<Communicator> comm = transport ? transport(g, n) : g->communicator();
      fn(*comm);
      g->finish();
    } catch (...) {
      failure = classify_failure(std::current_exception());
    }
    if (failure && g) g->fail(failure->what);
    if (g && g->broken()) fail_job(g->broken_reason());
    if (!g && failure) fail_job(failure->what);  // could not even connect
  }

  // Every process gets every rank's outputs and failure.
  std::vector<Tensor> mine;
  for (auto* slots : outputs) {
    CPSIM_ENFORCE(static_cast<int>(slots->size()) == n, "an output list of ", slots->size(), " slots for ", n,
                  " ranks");
    mine.push_back(w.config.rank < n ? (*slots)[w.config.rank] : Tensor());
  }
  // The failure travels as one byte (0 none, else its FailureKind + 1) and its text.
  std::vector<std::uint8_t> payload;
  const std::string what = failure ? failure->what : "";
  put<std::uint8_t>(payload, failure ? static_cast<std::uint8_t>(static_cast<int>(failure->kind) + 1) : 0);
  put<std::uint32_t>(payload, static_cast<std::uint32_t>(what.size()));
  payload.insert(payload.end(), what.begin(), what.end());
  const auto tensors = serialize_tensors(mine);
  payload.insert(payload.end(), tensors.begin(), tensors.end());

  const int size = w.config.size;
  std::vector<std::int64_t> lengths(size);
  std::vector<std::uint8_t> all;
  std::int64_t longest = 0;
  try {
    // Processes that sat the run out wait here while the group runs, a long wait:
    // an all-to-all exchange, so a peer that breaks (and closes its connections)
    // ends it at once. Once every process has arrived, the run's timeout holds.
    w.all->begin(timeout);
    auto comm = w.all->communicator();
    if (w.config.rank >= n) w.all->patience(n, timeout);  // once the group is in, the others get the timeout
    comm->barrier(CallOptions{w.config.rank < n ? timeout : std::max<std::chrono::milliseconds>(timeout, 600s)});
    const std::int64_t length = static_cast<std::int64_t>(payload.size());
    comm->all_gather(&length, lengths.data(), 1, DType::i64);
    for (auto l : lengths) longest = std::max(longest, l);
    payload.resize(longest);
    all.resize(longest * size);
    comm->all_gather(payload.data(), all.data(), longest, DType::b8);
  } catch (const std::exception& e) {
    fail_job(w.all->broken() ? w.all->broken_reason() : e.what());
  }
  int root = -1;
  std::vector<std::optional<FailureReport>> failures(size);
  for (int q = 0; q < size; ++q) {
    Reader r{all.data() + q * longest, all.data() + q * longest + lengths[q]};
    const auto kind = r.get<std::uint8_t>();
    const auto len = r.get<std::uint32_t>();
    const auto* text = r.bytes(len);
    if (kind != 0) failures[q] = FailureReport{static_cast<FailureKind>(kind - 1), std::string(text, text + len)};
    const auto got = deserialize_tensors(r.p, static_cast<std::size_t>(r.end - r.p));
    if (q < n)
      for (std::size_t i = 0; i < outputs.size(); ++i) (*outputs[i])[q] = got.at(i);
    // The root cause: a rank's own failure before the CollectiveErrors it caused.
    if (failures[q] && (root < 0 || (failures[root]->kind == FailureKind::collective &&
                                     failures[q]->kind != FailureKind::collective)))
      root = q;
  }
  if (root >= 0) rethrow_failure(*failures[root]);
}

}  // namespace cpsim::sim
