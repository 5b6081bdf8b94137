// cpsim check: every property on batch files at each CP size.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <limits>
#include <set>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "core/comm/registry.hpp"
#include "verify/batch_io.hpp"
#include "verify/memory.hpp"
#include "verify/properties.hpp"

namespace cpsim::cli {

using namespace cpsim::verify;

namespace {

std::string with_commas(std::int64_t n);

// Progress on long work, on standard error: on a terminal one line rewritten in
// place (the batch, the CP size, the row, rows done of all, elapsed and about how
// long is left, from the time estimate scaled by how the run keeps to it); else
// a plain line every 5 seconds. Nothing until a second has passed, so a short
// check prints nothing.
class CheckProgress {
 public:
  using Clock = std::chrono::steady_clock;
  CheckProgress(bool on, double estimated_total) : on_(on), tty_(isatty(STDERR_FILENO) != 0), total_(estimated_total) {}
  // Before `row` of `batch` at `cp`, whose estimated seconds are `row_estimate`.
  void row(const std::string& batch, int cp, const std::string& row, int done, int total, double row_estimate) {
    if (!row_done_.empty()) estimated_done_ += last_estimate_;
    row_done_ = row;
    last_estimate_ = row_estimate;
    if (!on_ || row.empty()) return;
    const double elapsed = seconds(Clock::now() - start_);
    if (elapsed < 1.0) return;
    if (!tty_ && seconds(Clock::now() - last_) < 5.0) return;
    last_ = Clock::now();
    // What is left of the estimate, at the pace the run has kept so far.
    const double pace = estimated_done_ > 0.5 ? elapsed / estimated_done_ : 1.0;
    const double left = std::max(0.0, total_ - estimated_done_) * pace;
    char line[512];
    std::snprintf(line, sizeof line, "%s cp=%d: %s (row %d of %d), %.0f s elapsed, about %.0f s left", batch.c_str(),
                  cp, row.c_str(), done + 1, total, elapsed, left);
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", line);
      shown_ = true;
    } else {
      std::fprintf(stderr, "cpsim check: %s\n", line);
    }
    std::fflush(stderr);
  }
  // The line ends before anything else is printed.
  void finish() {
    if (shown_) std::fprintf(stderr, "\r\033[K");
    shown_ = false;
  }

 private:
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  bool on_, tty_, shown_ = false;
  double total_, estimated_done_ = 0, last_estimate_ = 0;
  std::string row_done_;  // the row running now ("" after a case's last)
  Clock::time_point start_ = Clock::now(), last_ = Clock::now();
};

// "31 s", "4 min", "2.5 h".
std::string format_seconds(double s) {
  char out[32];
  if (s < 90) std::snprintf(out, sizeof out, "%.0f s", s);
  else if (s < 5400) std::snprintf(out, sizeof out, "%.0f min", s / 60);
  else std::snprintf(out, sizeof out, "%.1f h", s / 3600);
  return out;
}

void print_table(const std::string& name, const std::vector<PropertyResult>& results, const std::vector<int>& cps) {
  std::cout << name << "\n";
  // The property column fits the longest name, and a space.
  std::size_t width = 9;
  for (const auto& r : results) width = std::max(width, r.property.size() + 2);
  const int w = static_cast<int>(width);
  std::cout << "  " << std::left << std::setw(w) << "property";
  for (int cp : cps) std::cout << std::setw(16) << ("cp=" + std::to_string(cp));
  std::cout << "\n";
  std::vector<std::string> order;
  for (const auto& r : results)
    if (std::find(order.begin(), order.end(), r.property) == order.end()) order.push_back(r.property);
  for (const auto& prop : order) {
    std::cout << "  " << std::setw(w) << prop;
    for (int cp : cps)
      for (const auto& r : results)
        if (r.property == prop && r.cp == cp) {
          std::ostringstream cell;
          if (r.aborted) cell << "ABORTED";
          else cell << (r.ok ? "pass " : "FAIL ") << std::setprecision(2) << r.error;
          std::cout << std::setw(16) << cell.str();
        }
    std::cout << "\n";
  }
  for (const auto& r : results)
    if (!r.ok) std::cout << (r.aborted ? "  ABORTED " : "  FAIL ") << r.property << " at cp=" << r.cp << ": " << r.detail << "\n";
  // The attention rows of a long document evaluate a chosen set of queries: say how many.
  for (const auto& r : results)
    if (r.queries_evaluated >= 0 && r.queries_evaluated < r.queries)
      std::cout << "  " << r.property << " at cp=" << r.cp << ": " << with_commas(r.queries_evaluated) << " of "
                << with_commas(r.queries) << " queries evaluated (chosen where CP goes wrong, and a seeded sample)\n";
}

// 1234567 -> "1,234,567".
std::string with_commas(std::int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

// What the report says about a batch before its table: stand-in token ids, and
// the keys read as token streams.
std::vector<std::string> notes_of(const BatchFile& f) {
  std::vector<std::string> notes;
  if (f.stand_in_ids)
    notes.push_back("no input_ids in the file: stand-in token ids (padding comes from the lengths and masks, never "
                    "from token ids)");
  // Keys with a meaning of their own (SPEC §1); any other is a token stream.
  static const std::set<std::string> meaning = {"input_ids", "labels", "position_ids", "padding_mask",
                                                "attention_mask", "loss_mask"};
  std::string streams;
  for (const auto& [key, t] : f.batch)
    if (!meaning.count(key) && !is_length_key(key)) streams += (streams.empty() ? "" : ", ") + key;
  if (!streams.empty()) notes.push_back("read as token streams (padded with 0, sharded like labels): " + streams);
  // A THD key is one packed row's boundaries [D+1]; written nested ([[0, 3, 7]]),
  // it is read as that row's, and the report says so.
  for (const char* key : {"cu_seqlens", "cu_seqlens_padded"}) {
    const auto it = f.given.find(key);
    if (it != f.given.end() && it->second.shape.size() == 2)
      notes.push_back(std::string(key) + " given as " + shape_str(it->second.shape) + ": read as one packed row's " +
                      "boundaries " + shape_str({it->second.shape[1]}) + " (the THD form)");
  }
  return notes;
}

int run_check(CheckArgs a) {
  CheckOptions o = check_options(a.model);
  o.row_memory = a.row_memory;
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  if (!plan) throw UsageError("--plan random draws plans for fuzz; check takes equal, balanced or a plan file");
  // A plan file fixes the CP size.
  if (plan->kind == PlanChoice::Kind::cuts && !a.cp_given && !a.job.multi)
    a.cp_sizes = {static_cast<int>(plan->cuts.size()) - 1};
  // Memory, from the batch's shape as soon as the file gives it, before any
  // stand-in is built or any layout derived: a batch whose estimated peak at
  // some CP size is over the limit is refused at once, naming the estimate.
  const MemoryLimit limit = a.max_memory.empty()
                                ? default_memory_limit()
                                : MemoryLimit{static_cast<std::int64_t>(parse_bytes(a.max_memory)), "--max-memory"};
  CheckOptions on_backend = o;
  on_backend.backend = a.job.backend;
  const auto fits = [&](const std::string& path) {
    return [&, path](std::int64_t B, std::int64_t S, int keys) {
      for (int cp : a.cp_sizes) {
        const MemoryEstimate e = estimate_check_memory(B, S, keys, cp, on_backend);
        if (e.bytes > limit.bytes)
          throw InvalidInput(path + ": needs about " + format_bytes(e.bytes) + " at cp " + std::to_string(cp) + " (" +
                             std::to_string(B) + " x " + std::to_string(reference_geometry(S, cp).padded_len) +
                             " tokens, " + std::to_string(static_cast<std::int64_t>(e.per_token)) + " bytes each at " +
                             e.largest_row + "'s peak), over the limit of " + format_bytes(limit.bytes) + " (" +
                             limit.source + "); check a smaller batch or CP size, or raise --max-memory");
      }
    };
  };
  // Load and validate every batch first, before any work: an invalid one is
  // reported (one line naming the file) and the others still run; exit 2 overall.
  std::vector<BatchFile> files;
  std::vector<std::string> paths, invalid;
  if (!a.rows.empty() || !a.skip.empty()) o.rows = choose_rows(a.rows, a.skip);
  on_backend.rows = o.rows;
  // CPU time, from the layout (the attention rows' work depends on the documents'
  // lengths): each batch's estimate at every CP size, refused over --max-time.
  std::vector<std::vector<TimeEstimate>> times;
  for (const auto& path : a.batches) {
    try {
      const MappedFile file(path);
      fingerprint_bytes(file.bytes());
      BatchFile f = parse_batch(file.bytes(), path, fits(path));
      const Layout layout = derive_layout(f.batch);
      std::vector<TimeEstimate> mine;
      double total = 0;
      for (int cp : a.cp_sizes) {
        const ReferenceGeometry g = reference_geometry(layout.doc_ids.dim(1), cp);
        const std::int64_t pairs = attention_work(layout.doc_ids, layout.padding, g, a.model.seed).pairs;
        mine.push_back(estimate_check_time(layout.doc_ids.dim(0) * g.padded_len, pairs, cp, on_backend));
        total += mine.back().seconds;
      }
      if (a.max_time > 0 && total > a.max_time)
        throw InvalidInput(path + ": needs about " + format_seconds(total) + " of CPU at cp " +
                           [&] {
                             std::string cps;
                             for (int cp : a.cp_sizes) cps += (cps.empty() ? "" : ",") + std::to_string(cp);
                             return cps;
                           }() +
                           ", over --max-time " + format_seconds(a.max_time) +
                           "; check fewer CP sizes or rows (--rows, --skip), or raise --max-time");
      times.push_back(std::move(mine));
      files.push_back(std::move(f));
      paths.push_back(path);
    } catch (const InvalidInput& e) {
      const std::string what = e.what();
      const std::string line = what.rfind(path, 0) == 0 ? what : path + ": " + what;
      report_error("invalid input: " + line);
      invalid.push_back(line);
    }
  }
  if (files.empty()) return kExitUsage;
  // Rows reuse what earlier rows freed: the cache gives blocks back before any
  // fresh one is mapped, so it needs no limit of its own.
  set_host_cache_limit(std::numeric_limits<std::size_t>::max());
  join_job(a.job);
  o.backend = a.job.backend;
  o.timeout = milliseconds_of(a.job.timeout);
  o.job = a.job.joined;
  if (a.job.multi) {
    if (!a.cp_given) a.cp_sizes = {a.job.size};
    for (int cp : a.cp_sizes)
      if (cp > a.job.size)
        throw UsageError("--cp " + std::to_string(cp) + " needs " + std::to_string(cp) + " processes; this job has " +
                         std::to_string(a.job.size));
  }
  if (!a.job.multi) {
    const auto [most, why] = find_backend(o.backend).max_ranks();
    for (int cp : a.cp_sizes)
      if (most > 0 && cp > most) throw UsageError("--cp " + std::to_string(cp) + " on --backend " + o.backend + ": " + why);
  }
  for (std::size_t i = 0; i < files.size(); ++i)
    for (int cp : a.cp_sizes) expect_plan_fits(*plan, sequence_length(files[i].batch), cp, paths[i]);
  nlohmann::json out = {{"ok", true}, {"results", nlohmann::json::array()}}, notes = nlohmann::json::object();
  bool failed = false, aborted = false;
  // The estimates, said before the run when it is long enough to matter.
  double estimated = 0;
  for (const auto& per_file : times)
    for (const auto& e : per_file) estimated += e.seconds;
  if (!a.quiet && estimated >= 1)
    for (std::size_t i = 0; i < files.size(); ++i) {
      std::string cps;
      for (std::size_t k = 0; k < a.cp_sizes.size(); ++k)
        cps += (k ? ", " : "") + ("cp " + std::to_string(a.cp_sizes[k]) + " " + format_seconds(times[i][k].seconds));
      std::cerr << "cpsim check: " << paths[i] << ": about " << format_seconds([&] {
        double t = 0;
        for (const auto& e : times[i]) t += e.seconds;
        return t;
      }()) << " of CPU (" << cps << ")\n";
    }
  CheckProgress progress(!a.quiet && !a.job.multi, estimated);
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::vector<PropertyResult> all;
    for (std::size_t k = 0; k < a.cp_sizes.size(); ++k) {
      const int cp = a.cp_sizes[k];
      if (job_broken(a.job)) break;  // every later property would fail the same way
      LayoutCase c{files[i].batch, files[i].pad_token_id, cp, a.model.seed, std::nullopt, *plan};
      CheckOptions with_progress = o;
      with_progress.on_row = [&, i, k, cp](const std::string& row, int done, int total) {
        double row_estimate = 0;
        for (const auto& [name, sec] : times[i][k].rows)
          if (name == row) row_estimate = sec;
        progress.row(paths[i], cp, row, done, total, row_estimate);
      };
      for (auto& r : check_all(c, with_progress)) all.push_back(r);
    }
    progress.finish();
    for (const auto& r : all) {
      failed = failed || (!r.ok && !r.aborted);
      aborted = aborted || r.aborted;
      nlohmann::json j = {{"batch", paths[i]}, {"cp", r.cp},    {"property", r.property},
                          {"ok", r.ok},            {"error", r.error}, {"aborted", r.aborted},
                          {"cpu_seconds", r.cpu_seconds}};
      if (a.row_memory) j["peak_bytes"] = r.peak_bytes;
      if (!r.ok) j["detail"] = r.detail;
      if (r.queries_evaluated >= 0)
        j["queries_evaluated"] = r.queries_evaluated, j["queries"] = r.queries, j["attention_pairs"] = r.pairs;
      out["results"].push_back(j);
    }
    const std::vector<std::string> said = notes_of(files[i]);
    notes[paths[i]] = said;
    if (!a.json) {
      for (const auto& note : said) std::cout << paths[i] << ": " << note << "\n";
      print_table(paths[i], all, a.cp_sizes);
    }
  }
  out["ok"] = !failed && !aborted && invalid.empty();
  out["aborted"] = aborted;
  out["invalid"] = invalid;
  out["notes"] = notes;
  if (a.json) std::cout << out.dump(1) << "\n";
  else if (failed) std::cout << "some properties FAILED\n";
  else if (aborted) std::cout << "the run could not complete (ABORTED: no verdict on those properties)\n";
  else if (!invalid.empty()) std::cout << "every property holds on the valid batches; " << invalid.size() << " invalid\n";
  else std::cout << "all properties hold\n";
  // A failed property is a finding whatever else happened; then invalid input;
  // an aborted run alone is exit 3.
  return finish_job(a.job, failed ? kExitFailed : !invalid.empty() ? kExitUsage : aborted ? kExitAborted : kExitOk);
}

}  // namespace cpsim::cli
