// What every command shares (the commands: cli/commands.hpp): joining the multi-process job the
// environment describes, the job fingerprint, one-line errors, exit statuses.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cli/options.hpp"
#include "verify/properties.hpp"

namespace cpsim::cli {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::chrono::milliseconds milliseconds_of(double seconds);
// Adds bytes to the fingerprint every process of a job must agree on.
void fingerprint_bytes(std::string_view bytes);
// One line on stderr in one write ("cpsim: " or "cpsim: rank R: " first).
void report_error(const std::string& what);
// Joins the job the environment describes, if any (only rank 0 then writes).
void join_job(JobArgs& a);
// The exit status of a job: a broken job is an error on every rank.
// Leaves the job.
int finish_job(JobArgs& a, int status);
bool job_broken(const JobArgs& a);

// The property options of the model arguments (backend and timeout left as defaults).
verify::CheckOptions check_options(const ModelArgs& m);
// The model options that differ from the defaults, as flags (" --conv-width 6"):
// what a replay command line must repeat.
std::string model_flags(const ModelArgs& m);

}  // namespace cpsim::cli
