// What the property rows share (verify/rows/*.cpp): a row's head and how it
// takes an operator, the driver's entry points, the global rows the layers read,
// and the simulations rows share; how a row compares (tally.hpp) and how its
// ranks read the case (reading.hpp). Each family of rows is one file there: its
// rows' heads (the name, written once, and the claim), their checks (file-local)
// and the family's descriptors. verify/properties.cpp is the driver: it prepares
// a case, runs each row's check, names the verdict and catches what a check
// throws (adding a row is one head, one check and one descriptor).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/run_ranks.hpp"
#include "verify/properties.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"
#include "verify/rows/reading.hpp"
#include "verify/rows/tally.hpp"

namespace cpsim::verify::rows {

inline std::vector<std::int64_t> row_of(const Tensor& t, std::int64_t row) {
  const std::int64_t S = t.dim(1);
  std::vector<std::int64_t> v(S);
  for (std::int64_t s = 0; s < S; ++s) v[s] = t.get_int(row * S + s);
  return v;
}

inline Batch normalized(const Batch& b) {
  Batch out = b;
  normalize_batch_axis(out);
  return out;
}

inline RunOptions run_options(const CheckOptions& o) { return {o.backend, o.timeout, o.job}; }
// How results of this backend compare: bitwise, or within a tolerance for sums.
inline Capabilities capabilities_of(const CheckOptions& o) { return find_backend(o.backend).capabilities; }

// The driver (verify/properties.cpp): runs one row's check, names its verdict with
// the row's name and CP size, and turns what it throws into a failure (or, when
// the run could not complete, an aborted result).
PropertyResult run_row(const std::string& name, int cp, const std::function<PropertyResult()>& check);
// Prepares the case, then run_row; a case that cannot be prepared fails the row.
PropertyResult run_on_case(const LayoutCase& c, const std::string& name,
                           const std::function<PropertyResult(Prepared&)>& check);

// A row's description: its name (written only here), how it compares and what it
// costs; with the bytes it moves and its check, one row of the table.
struct RowHead {
  const char* name;
  const char* claim;
  Comparison comparison;
  double tolerance;
  bool runs_ranks;
  RowCost cost;
  PropertyRow with(std::function<std::int64_t(const Prepared&, const CheckOptions&)> bytes,
                   std::function<PropertyResult(Prepared&, const CheckOptions&, const Impl&)> check,
                   std::function<void(GoldenBuild&)> golden = {}) const {
    return {name, claim, comparison, tolerance, runs_ranks, cost, std::move(bytes), std::move(check), std::move(golden)};
  }
};
inline std::int64_t no_bytes(const Prepared&, const CheckOptions&) { return 0; }
// An operator of the implementation under test, or the model's own where it is empty.
template <class Fn>
Fn or_default(const Fn& given, Fn (*model)()) {
  return given ? given : model();
}

// The batch's padded global rows [B, P] the layers read, as the shards carry them.
struct LayerRows {
  Tensor positions, padding, doc_ids, input_ids;
};
inline LayerRows layer_rows(const Prepared& s) {
  const Batch padded = reference_padded_global(s.c, s.g.padded_len);
  return {padded.at("position_ids"), padded.at("padding_mask"), s.padded_ids, padded.at("input_ids")};
}

// Gathers rank parts along the sequence; undefined when a rank's part is.
inline Tensor joined(const std::vector<Tensor>& parts) {
  for (const Tensor& t : parts)
    if (!t.defined()) return Tensor();
  return cat(parts, 1);
}

// A recurrence run's peak, bytes per token (recurrence.cpp; two_steps runs within it).
double recurrence_bytes(const RowShapes& s);

// The rows of each file, in the table's order (verify/rows/table.def).
#define CPSIM_ROWS(family) std::vector<PropertyRow> family##_rows();
#include "verify/rows/table.def"
#undef CPSIM_ROWS

}  // namespace cpsim::verify::rows

namespace cpsim::verify {

struct ConvRun;
struct RecurrenceRun;
struct AttentionRun;
struct LossRun;

// Simulations several rows share, run once per case (default implementations only).
struct Prepared::Runs {
  std::shared_ptr<const ConvRun> conv;
  std::shared_ptr<const RecurrenceRun> recurrence;
  std::shared_ptr<const AttentionRun> attention, sparse_attention;
  std::shared_ptr<const LossRun> loss;
};

}  // namespace cpsim::verify
