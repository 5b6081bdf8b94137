#include <cstdlib>

#include "core/error.hpp"
#include "sim/job/job.hpp"

namespace cpsim::sim {

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

std::optional<JobConfig> job_from_environment() {
  static const struct {
    const char *rank, *size, *source;
  } kSources[] = {{"RANK", "WORLD_SIZE", "RANK/WORLD_SIZE"},
                  {"SLURM_PROCID", "SLURM_NTASKS", "Slurm"},
                  {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"}};
  for (const auto& s : kSources) {
    const auto rank = env(s.rank), size = env(s.size);
    if (!rank || !size) continue;
    JobConfig c;
    c.rank = parse_int(*rank, s.rank);
    c.size = parse_int(*size, s.size);
    c.source = s.source;
    if (c.size < 1 || c.rank < 0 || c.rank >= c.size)
      CPSIM_INVALID(s.rank, "=", c.rank, " and ", s.size, "=", c.size, " do not name a rank of the job");
    c.store = env("CPSIM_STORE").value_or("");
    if (auto job = env("CPSIM_JOB_ID")) c.id = *job;
    else if (auto slurm = env("SLURM_JOB_ID")) c.id = "slurm-" + *slurm + "." + env("SLURM_STEP_ID").value_or("0");
    else if (auto ompi = env("OMPI_MCA_ess_base_jobid")) c.id = "ompi-" + *ompi;
    else c.id = "cpsim";
    return c;
  }
  return std::nullopt;
}

}  // namespace cpsim::sim
