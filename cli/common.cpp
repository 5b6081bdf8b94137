#include "cli/common.hpp"

#include <unistd.h>

#include <iostream>

#include "core/comm/registry.hpp"

namespace cpsim::cli {

std::chrono::milliseconds milliseconds_of(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

// FNV-1a of the command line (and, for check, the batch files): the processes of
// one job must agree on it.
namespace {
std::uint64_t fingerprint = 14695981039346656037ull;
// "cpsim: ", or "cpsim: rank R: " in a multi-process job.
std::string error_prefix = "cpsim: ";
}  // namespace
void fingerprint_bytes(std::string_view bytes) {
  for (unsigned char ch : bytes) fingerprint = (fingerprint ^ ch) * 1099511628211ull;
  fingerprint = (fingerprint ^ 0xff) * 1099511628211ull;  // separator
}

// One line on stderr in one write, so the lines of several ranks do not interleave.
void report_error(const std::string& what) {
  const std::string line = error_prefix + what + "\n";
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

// Joins the multi-process job the environment describes (cpsim launch, RANK/WORLD_SIZE,
// Slurm, Open MPI), if any. Only rank 0 writes the report; every process computes it.
void join_job(JobArgs& a) {
  auto config = sim::job_from_environment();
  if (config && !a.backend_given) a.backend = "gloo";
  // A backend that cannot run here (cuda-sim or nccl without a GPU) is a usage error, said once.
  if (auto why = find_backend(a.backend).unavailable()) throw UsageError("--backend " + a.backend + ": " + *why);
  if (!config) return;
  if (!find_backend(a.backend).job_transport) {
    std::string across;  // the registry says which backends run in a job
    for (const auto& name : backend_names())
      if (find_backend(name).job_transport) across += (across.empty() ? "" : " or ") + name;
    throw UsageError("this process is rank " + std::to_string(config->rank) + " of " + std::to_string(config->size) +
                     " (from " + config->source + "); a multi-process job runs on --backend " + across + ", not " +
                     a.backend);
  }
  if (!a.store.empty()) config->store = a.store;
  config->timeout = milliseconds_of(a.timeout);
  error_prefix = "cpsim: rank " + std::to_string(config->rank) + ": ";
  a.joined = std::make_shared<sim::ProcessJob>(*config);
  a.joined->expect_same(fingerprint);
  a.multi = true;
  a.rank = config->rank;
  a.size = config->size;
  if (a.rank != 0) std::cout.setstate(std::ios::badbit);  // rank 0 reports
}

// The exit status of a job: a broken job (timeout, lost peer) is an error on every rank.
int finish_job(JobArgs& a, int status) {
  if (!a.multi) return status;
  const std::string failure = a.joined ? a.joined->failure() : "";
  if (a.joined) a.joined->leave();
  a.joined.reset();
  std::cout.clear();
  if (!failure.empty()) {
    report_error("aborted: " + failure);
    return status == kExitFailed ? kExitFailed : kExitAborted;
  }
  return status;
}

verify::CheckOptions check_options(const ModelArgs& m) {
  verify::CheckOptions o;
  static_cast<ModelShape&>(o) = m;
  return o;
}

std::string model_flags(const ModelArgs& m) {
  const ModelArgs d;
  std::string flags;
  const auto flag = [&](const char* name, long long value, long long default_value) {
    if (value != default_value) flags += std::string(" --") + name + " " + std::to_string(value);
  };
  flag("conv-width", m.conv_width, d.conv_width);
  flag("channels", m.channels, d.channels);
  flag("heads", m.heads, d.heads);
  flag("key-dim", m.key_dim, d.key_dim);
  flag("value-dim", m.value_dim, d.value_dim);
  flag("topk", m.topk, d.topk);
  flag("index-dim", m.index_dim, d.index_dim);
  flag("vocab", m.vocab, d.vocab);
  return flags;
}

bool job_broken(const JobArgs& a) { return a.joined && !a.joined->failure().empty(); }

}  // namespace cpsim::cli
