#include "sim/job/job.hpp"

#include <algorithm>

#include <gloo/context.h>
#include <gloo/rendezvous/prefix_store.h>

#include <unistd.h>

#include <random>

#include "core/tensor_wire.hpp"
#include "sim/gloo/rank.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;

namespace {

// This process, as a claim on its rank: "host HOST pid PID tag TAG".
std::string claim_token() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::random_device rd;
  return "host " + std::string(host) + " pid " + std::to_string(getpid()) + " tag " + std::to_string(rd());
}

[[noreturn]] void job_in_use(const JobConfig& c, const std::string& holder) {
  CPSIM_INVALID("job id '", c.id, "' is already in use on store ", c.store, ": rank ", c.rank, " is claimed by ",
                holder, " (another job with this id, or an earlier one whose keys remain); give this run its own "
                "CPSIM_JOB_ID or a fresh store (cpsim launch picks both)");
}

}  // namespace

ProcessJob::ProcessJob(const JobConfig& config) : config_(config) {
  if (config.store.empty())
    CPSIM_INVALID("rank ", config.rank, " of ", config.size, " (from ", config.source,
                  ") needs a store to meet in: --store file:DIR or --store redis://HOST:PORT, or CPSIM_STORE");
  limit_store_commands(config.timeout);
  base_ = open_store(config.store);
  job_ = std::make_shared<gloo::rendezvous::PrefixStore>(config.id, *base_);
  // A job id is used once per store: each rank claims its key atomically before
  // it connects, so of two processes that want one rank exactly one gets it, and
  // the other is refused, never joined (two jobs would pair up). Its claim (host,
  // pid) is also what peers read to say whether it is alive when it goes quiet.
  const std::string token = claim_token();
  try {
    if (auto holder = claim_key(config.store, *base_, config.id + "/claim/" + std::to_string(config.rank), token))
      job_in_use(config, *holder);
    job_->set("holder/" + std::to_string(config.rank), std::vector<char>(token.begin(), token.end()));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // The store's own error (Gloo's RedisStore over a lossy link: "Resource
    // temporarily unavailable"): this rank cannot take part, as when it cannot
    // connect, so it ends as an abort (exit 3), not as a failed check.
    throw Aborted("rank " + std::to_string(config.rank) + " of " + std::to_string(config.size) +
                  " could not claim its rank in the store " + config.store + " within " +
                  std::to_string(config.timeout.count()) + " ms: " + e.what());
  }
  all_ = connect(config.size, "all");
}

void ProcessJob::leave() {
  if (failure_.empty() && config_.size > 1) {
    try {
      all_->begin(config_.timeout);
      all_->communicator()->barrier();
    } catch (const std::exception&) {
    }
  }
}

std::shared_ptr<gloo::rendezvous::Store> ProcessJob::prefixed(const std::string& prefix) {
  auto s = std::make_shared<gloo::rendezvous::PrefixStore>(prefix, *job_);
  prefixes_.push_back(s);
  return s;
}

std::shared_ptr<GlooRank> ProcessJob::connect(int n, const std::string& name) {
  std::shared_ptr<gloo::Context> context;
  if (n > 1) context = connect_gloo(config_.rank, n, *prefixed(name), gloo_device(""), config_.timeout, job_.get());
  return std::make_shared<GlooRank>(context, config_.rank, n, job_, config_.timeout, true);
}

std::shared_ptr<GlooRank> ProcessJob::group(int n) {
  if (n == config_.size) return all_;
  auto& g = groups_[n];
  if (!g) g = connect(n, "group" + std::to_string(n));
  return g;
}

void ProcessJob::expect_same(std::uint64_t fingerprint) {
  const int n = config_.size;
  std::vector<std::uint64_t> all(n);
  all_->begin(config_.timeout);
  all_->all_gather_bytes(&fingerprint, all.data(), sizeof fingerprint);
  std::vector<int> differ;
  for (int q = 1; q < n; ++q)
    if (all[q] != all[0]) differ.push_back(q);
  if (!differ.empty())
    CPSIM_INVALID(name_ranks(differ), differ.size() == 1 ? " runs" : " run",
                  " a different job than rank 0: the command line or the batch files differ");
}

ProcessJob::Session::Session(std::shared_ptr<GlooRank> rank, std::unique_ptr<Communicator> comm)
    : rank_(std::move(rank)), comm_(std::move(comm)) {}

ProcessJob::Session::~Session() = default;

void ProcessJob::Session::finish() {
  rank_->finish();
  if (rank_->broken()) throw Aborted(rank_->broken_reason());
}

void ProcessJob::Session::fail(const std::string& what) noexcept { rank_->fail(what); }

std::unique_ptr<ProcessJob::Session> ProcessJob::open_session(const std::string& name,
                                                              std::chrono::milliseconds timeout,
                                                              const JobTransport& transport,
                                                              const std::vector<int>& ranks) {
  if (!failure_.empty()) throw Aborted("the job stopped at an earlier failure: " + failure_);
  std::vector<int> all(config_.size);
  for (int q = 0; q < config_.size; ++q) all[q] = q;
  const bool subset = !ranks.empty() && ranks != all;
  std::shared_ptr<GlooRank> g;
  if (!subset) {
    g = name.empty() ? all_ : connect(config_.size, "session/" + name);
  } else {
    CPSIM_ENFORCE(!name.empty(), "a group of some of the processes needs a name of its own");
    for (std::size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i] < 0 || ranks[i] >= config_.size || (i > 0 && ranks[i] <= ranks[i - 1]))
        CPSIM_INVALID("group ", name, ": ranks must be ascending job ranks below ", config_.size);
    const auto me = std::find(ranks.begin(), ranks.end(), config_.rank);
    if (me == ranks.end()) CPSIM_INVALID("group ", name, ": rank ", config_.rank, " is not one of its ranks");
    const int n = static_cast<int>(ranks.size()), index = static_cast<int>(me - ranks.begin());
    std::shared_ptr<gloo::Context> context;
    if (n > 1)
      context = connect_gloo(index, n, *prefixed("session/" + name), gloo_device(""), config_.timeout, job_.get());
    g = std::make_shared<GlooRank>(context, index, n, job_, config_.timeout, true);
    g->set_names(RankNames::of(ranks, config_.size));
  }
  g->begin(timeout);
  std::unique_ptr<Communicator> comm = transport(g, g->size());
  return std::make_unique<Session>(std::move(g), std::move(comm));
}

[[noreturn]] void ProcessJob::fail(const std::string& why) {
  failure_ = why;
  // Peers that wait on this process (ranks sitting a run out) learn at once.
  if (all_ && all_->context_ptr()) {
    try {
      all_->context_ptr()->closeConnections();
    } catch (const std::exception&) {
    }
  }
  throw Aborted(why);
}

void ProcessJob::run(int n, const RankFn& fn, std::chrono::milliseconds timeout, const RankOutputs& outputs,
                     const JobTransport& transport) {
  if (!failure_.empty())
    throw Aborted("the job stopped at an earlier failure: " + failure_.substr(0, failure_.find('\n')));
  if (n > config_.size)
    CPSIM_INVALID("a group of ", n, " ranks needs ", n, " processes; this job has ", config_.size,
                  " (start it with cpsim launch -n ", n, ")");
  std::optional<FailureReport> failure;  // this rank's, if it failed
  if (config_.rank < n) {
    std::shared_ptr<GlooRank> g;
    try {
      g = group(n);
      g->begin(timeout);
      const std::unique_ptr<Communicator> comm = transport(g, n);
      fn(*comm);
      comm->finish_run();  // what the rank queued is done, and no late error came
      g->finish();
    } catch (...) {
      failure = classify_failure(std::current_exception());
    }
    if (failure && g) g->fail(failure->what);
    if (g && g->broken()) fail(g->broken_reason());
    if (!g && failure) fail(failure->what);  // could not even connect
  }

  // Every process gets every rank's outputs and failure.
  std::vector<Tensor> mine;
  for (auto* slots : outputs) {
    CPSIM_ENFORCE(static_cast<int>(slots->size()) == n, "an output list of ", slots->size(), " slots for ", n,
                  " ranks");
    mine.push_back(config_.rank < n ? (*slots)[config_.rank] : Tensor());
  }
  // The failure travels as one byte (0 none, else its FailureKind + 1) and its text.
  std::vector<std::uint8_t> payload;
  WireWriter out{payload};
  const std::string what = failure ? failure->what : "";
  out.put<std::uint8_t>(failure ? static_cast<std::uint8_t>(static_cast<int>(failure->kind) + 1) : 0);
  out.put<std::uint32_t>(static_cast<std::uint32_t>(what.size()));
  out.put_bytes(what.data(), what.size());
  write_tensors(out, mine);

  const int size = config_.size;
  std::vector<std::int64_t> lengths(size);
  std::vector<std::uint8_t> all;
  std::int64_t longest = 0;
  try {
    // Processes that sat the run out wait here while the group runs, a long wait:
    // an all-to-all exchange, so a peer that breaks (and closes its connections)
    // ends it at once. Once one rank of the group has arrived (its run is over
    // for every rank of it), the run's timeout holds.
    all_->begin(timeout);
    auto comm = all_->communicator();
    if (config_.rank >= n) all_->patience(n, timeout);  // once the group is done, the others get the timeout
    CallOptions wait;
    wait.timeout = config_.rank < n ? timeout : std::max<std::chrono::milliseconds>(timeout, 600s);
    comm->barrier(wait);
    const std::int64_t length = static_cast<std::int64_t>(payload.size());
    all_->all_gather_bytes(&length, lengths.data(), sizeof length);
    for (auto l : lengths) longest = std::max(longest, l);
    payload.resize(longest);
    all.resize(longest * size);
    all_->all_gather_bytes(payload.data(), all.data(), longest);
  } catch (const std::exception& e) {
    fail(all_->broken() ? all_->broken_reason() : e.what());
  }
  int root = -1;
  std::vector<std::optional<FailureReport>> failures(size);
  for (int q = 0; q < size; ++q) {
    WireReader in{all.data() + q * longest, all.data() + q * longest + lengths[q]};
    const auto kind = in.get<std::uint8_t>();
    const auto len = in.get<std::uint32_t>();
    const auto* text = in.bytes(len);
    if (kind != 0) failures[q] = FailureReport{static_cast<FailureKind>(kind - 1), std::string(text, text + len)};
    const auto got = read_tensors(in);
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
