// The property driver: prepares a case once (its reference layout and every
// rank's packed context) and runs the table, whose rows live by family in
// verify/rows/ (layout and shard, gather, halo and conv, recurrence).
#include "verify/properties.hpp"

#include <algorithm>

#include <cstdio>

#include <sys/resource.h>

#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/recurrence.hpp"
#include "verify/rows/common.hpp"

namespace cpsim::verify {

using namespace rows;



Prepared::Prepared(LayoutCase c_in) : c(std::move(c_in)), runs(std::make_shared<Runs>()) {
  shape = reference_shape(c.batch);
  g = reference_geometry(shape.seq_len, c.cp);
  truth = reference_layout(c.batch);
  g.cuts = reference_cuts(truth, g.padded_len, c.cp, c.plan);
  padded_ids = reference_padded_doc_ids(truth, g.padded_len);
  // Every rank's packed context, as a training step makes it (shard_batch).
  try {
    for (int r = 0; r < c.cp; ++r)
      contexts.push_back(shard_batch_at(r, c.cp, c.batch, std::nullopt, c.pad_token_id, false, 1, c.plan).context);
  } catch (...) {
    contexts.clear();
    shard_failure = std::current_exception();
  }
}

const PackedContext& Prepared::context(int rank) const {
  if (contexts.empty()) {
    const FailureReport report = classify_failure(shard_failure);
    if (report.kind == FailureKind::aborted) throw Aborted(report.what);
    throw Error("shard_batch threw: " + report.what);
  }
  return contexts.at(rank);
}

// ---------------------------------------------------------------------------
// Running a row: the one place that names verdicts and catches what a check throws.

namespace {
// The run ended in `failure`: the code under test failed (its exception is the
// property's failure), or the run could not complete (a timeout, a lost rank,
// memory: aborted, no verdict on the code).
PropertyResult threw(const std::string& name, int cp, const std::string& doing, const std::exception_ptr& failure) {
  const FailureReport report = classify_failure(failure);
  if (report.kind == FailureKind::aborted) return {name, cp, false, 0.0, report.what, true};
  return {name, cp, false, 1.0, doing + report.what};
}
}  // namespace

namespace rows {

PropertyResult run_row(const std::string& name, int cp, const std::function<PropertyResult()>& check) {
  PropertyResult r;
  try {
    r = check();
  } catch (...) {
    return threw(name, cp, "threw: ", std::current_exception());
  }
  r.property = name;
  r.cp = cp;
  return r;
}

PropertyResult run_on_case(const LayoutCase& c, const std::string& name,
                           const std::function<PropertyResult(Prepared&)>& check) {
  std::optional<Prepared> p;
  try {
    p.emplace(c);
  } catch (...) {
    return threw(name, c.cp, "could not prepare the case: ", std::current_exception());
  }
  return run_row(name, c.cp, [&] { return check(*p); });
}

}  // namespace rows

PropertyResult run_row(const PropertyRow& row, Prepared& p, const CheckOptions& o, const Impl& impl) {
  return rows::run_row(row.name, p.c.cp, [&] { return row.check(p, o, impl); });
}

PropertyResult check_row(const std::string& name, const LayoutCase& c, const CheckOptions& o, const Impl& impl) {
  const auto& table = property_table();
  const auto row = std::find_if(table.begin(), table.end(), [&](const PropertyRow& r) { return r.name == name; });
  if (row == table.end()) choose_rows({name}, {});  // InvalidInput naming the rows
  return rows::run_on_case(c, name, [&](Prepared& p) { return row->check(p, o, impl); });
}

// ---------------------------------------------------------------------------
// The table: every file's rows (verify/rows/table.def), in order.

namespace {

struct TableFile {
  const char* name;
  std::vector<PropertyRow> (*rows)();
};
constexpr TableFile table_files[] = {
#define CPSIM_ROWS(family) {#family, family##_rows},
#include "verify/rows/table.def"
#undef CPSIM_ROWS
};

}  // namespace

const std::vector<PropertyRow>& property_table() {
  static const std::vector<PropertyRow> table = [] {
    std::vector<PropertyRow> t;
    for (const TableFile& file : table_files)
      for (PropertyRow& row : file.rows()) t.push_back(std::move(row));
    return t;
  }();
  return table;
}

const std::vector<RowFile>& property_files() {
  static const std::vector<RowFile> files = [] {
    std::vector<RowFile> out;
    for (const TableFile& file : table_files) {
      RowFile f{file.name, {}, false};
      for (const PropertyRow& row : file.rows()) {
        f.rows.push_back(row.name);
        f.runs_ranks = f.runs_ranks || row.runs_ranks;
      }
      out.push_back(std::move(f));
    }
    return out;
  }();
  return files;
}

namespace {

// Linux's high-water mark of resident memory (VmHWM), and its reset (writing 5 to
// clear_refs): what one row adds to the peak, measured.
void reset_peak_resident() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}
std::int64_t peak_resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  long long kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmHWM: %lld kB", &kb) == 1) break;
  std::fclose(f);
  return static_cast<std::int64_t>(kb) * 1024;
}

}  // namespace

std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o) {
  std::vector<PropertyResult> out;
  std::optional<Prepared> p;
  std::exception_ptr why;
  try {
    p.emplace(c);
  } catch (...) {
    why = std::current_exception();
  }
  const auto cpu_now = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  std::vector<const PropertyRow*> chosen;
  for (const PropertyRow& row : property_table())
    if (o.rows.empty() || std::find(o.rows.begin(), o.rows.end(), row.name) != o.rows.end()) chosen.push_back(&row);
  const int total = static_cast<int>(chosen.size());
  for (int i = 0; i < total; ++i) {
    const PropertyRow& row = *chosen[i];
    if (o.on_row) o.on_row(row.name, i, total);
    const double before = cpu_now();
    if (o.row_memory) reset_peak_resident();
    out.push_back(p ? run_row(row, *p, o) : threw(row.name, c.cp, "could not prepare the case: ", why));
    out.back().cpu_seconds = cpu_now() - before;
    if (o.row_memory) out.back().peak_bytes = peak_resident_bytes();
    // What a row freed stays cached for the next rows (the cache never raises the
    // peak above the largest row's); a row measured alone starts from nothing.
    if (o.row_memory) release_host_cache();
  }
  release_host_cache();  // the next case starts from nothing
  if (o.on_row) o.on_row("", total, total);
  return out;
}

std::vector<std::string> property_row_names() {
  std::vector<std::string> names;
  for (const PropertyRow& row : property_table()) names.push_back(row.name);
  return names;
}

std::vector<std::string> choose_rows(const std::vector<std::string>& only, const std::vector<std::string>& skip) {
  const std::vector<std::string> names = property_row_names();
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  for (const auto* list : {&only, &skip})
    for (const std::string& n : *list)
      if (std::find(names.begin(), names.end(), n) == names.end())
        CPSIM_INVALID(list == &only ? "--rows" : "--skip", ": no property row named '", n.substr(0, 64),
                      "'; the rows are ", all);
  std::vector<std::string> out;
  for (const std::string& n : names)
    if ((only.empty() || std::find(only.begin(), only.end(), n) != only.end()) &&
        std::find(skip.begin(), skip.end(), n) == skip.end())
      out.push_back(n);
  if (out.empty()) CPSIM_INVALID("--rows and --skip leave no property row to run");
  return out;
}

}  // namespace cpsim::verify
