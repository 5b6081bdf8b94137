// What the property rows share (verify/rows/*.cpp): how a row tallies its
// mismatches into a verdict, where a rank's slice of a global tensor lies, and the
// driver's entry points. Each family of rows is one file there: its rows' heads
// (the name, written once, and the claim), their checks, the public check_*
// functions and the family's descriptors. verify/properties.cpp is the driver:
// it prepares a case, runs each row's check, names the verdict and catches what
// a check throws (adding a row is one head, one check and one descriptor).
#pragma once

#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/comm/run_ranks.hpp"
#include "verify/properties.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"

namespace cpsim::verify::rows {


// What a failed comparison says: the first element holding a NaN or an inf that
// the other side does not, else the measure.
inline std::string misfit(const Tensor& ref, const Tensor& got, double e, const char* measure) {
  if (got.defined()) {
    const std::int64_t at = first_nonfinite_mismatch(ref, got);
    if (at >= 0) return describe_element(ref, got, at) + " (non-finite on one side only)";
  }
  std::ostringstream out;
  out << measure << " " << e;
  return out.str();
}

// Accumulates mismatches for one property run. A row's check returns its verdict
// (result()); the driver (run_row) names it, and turns an exception into one.
struct Tally {
  std::int64_t wrong = 0;
  std::ostringstream why;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    if (wrong == 0) why << what;
    ++wrong;
  }
  void expect_equal(const Tensor& ref, const Tensor& got, const std::string& what) {
    const std::int64_t w = count_wrong(ref, got);
    if (w && wrong == 0) {
      why << what << ": " << w << " wrong elements";
      const std::int64_t at = first_nonfinite_mismatch(ref, got);
      if (at >= 0) why << "; " << describe_element(ref, got, at) << " (non-finite on one side only)";
    }
    wrong += w;
  }
  // A sum over ranks: bitwise where the backend sums in rank order, else within
  // a relative RMSE of a few units in the last place of the dtype.
  void expect_sum(const Tensor& ref, const Tensor& got, const Capabilities& caps, const std::string& what) {
    if (caps.rank_order_sums) return expect_equal(ref, got, what);
    const double tol = ref.dtype() == DType::f64 ? 1e-12 : 1e-5;
    const double e = relative_rmse(ref, got);
    if (e <= tol) return;
    if (wrong == 0) why << what << ": " << misfit(ref, got, e, "relative RMSE") << " (tolerance " << tol << ")";
    wrong += std::max<std::int64_t>(1, count_wrong(ref, got));
  }
  PropertyResult result() const { return {"", 0, wrong == 0, static_cast<double>(wrong), why.str()}; }
};

inline PropertyResult failed(const std::string& why) { return {"", 0, false, 1.0, why}; }

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



// The global tensors a run's ranks take their slices of (local()), by name. While
// the run lasts, the ranks of this process read a slice of one of them that is one
// contiguous run (a one-row batch) in place instead of copying it, and after it
// the run throws "a rank wrote into its input NAME" if any of them changed: an
// operator that writes into its input must fail its row, not change what the row
// compares against.
struct Input {
  const char* name;
  const Tensor* tensor;
};
void run_reading(const std::vector<Input>& inputs, int n, const RankFn& fn, const RunOptions& options,
                 const RankOutputs& outputs = {});
// Whether `global` is an input of a run that is reading it now (run_reading).
bool read_in_place(const Tensor& global);
// A fingerprint of a host tensor's bytes (not cryptographic: it finds writes).
std::uint64_t fingerprint(const Tensor& t);

// Rank r's slice of a global [B, P, ...] tensor, where its packed context says its
// shard lies (the model's path: a wrong context is a wrong result, not a crash).
// Shared with the global where run_reading guards it, else a copy.
inline Tensor local(const Tensor& global, const PackedContext& ctx) {
  if (global.dim(0) == 1 && read_in_place(global))
    return global.contiguous_slice(1, ctx.seq_start(), ctx.local_seq_len());
  return narrow(global, 1, ctx.seq_start(), ctx.local_seq_len());
}

// A rank's input where its backend keeps tensors (the host, or cuda:N), and a
// result back on the host for the comparison.
inline Tensor on(const Communicator& comm, const Tensor& t) {
  const Device device = comm.device();
  return device.is_cpu() || !t.defined() ? t : t.to(device);
}
inline Tensor host(const Tensor& t) { return !t.defined() || t.is_cpu() ? t : t.to(Device::host()); }


// Relative RMSE against a tolerance; tracks the worst error of a property. A NaN
// or an inf on one side only is a failure naming its element (the measure is
// inf), and a NaN measure is never "within" a tolerance: every test is
// !(e <= tol), and the worst error keeps a NaN.
struct ErrorTally {
  double worst = 0;
  std::string why;
  void expect_close(const Tensor& ref, const Tensor& got, double tol, const std::string& what) {
    const double e = got.defined() ? relative_rmse(ref, got) : std::numeric_limits<double>::infinity();
    note(ref, got, e, tol, what, "relative RMSE");
  }
  // A sum over tokens (and ranks), whose order may differ from the reference's:
  // the RMSE of the difference relative to that of `terms`, the sums of the
  // absolute terms (the scale a reordered sum's rounding follows; a sum that
  // cancels to near zero is not held to its own tiny magnitude).
  void expect_close_sum(const Tensor& ref, const Tensor& got, const Tensor& terms, double tol, const std::string& what) {
    const double e = got.defined() ? relative_rmse(ref, got, terms) : std::numeric_limits<double>::infinity();
    note(ref, got, e, tol, what, "RMSE relative to the summed terms");
  }
  PropertyResult result(double tol) const { return {"", 0, worst <= tol && why.empty(), worst, why}; }

 private:
  void note(const Tensor& ref, const Tensor& got, double e, double tol, const std::string& what, const char* measure) {
    if (!(e <= tol) && why.empty()) why = what + ": " + misfit(ref, got, e, measure);
    if (!(e <= worst)) worst = e;  // NaN stays
  }
};
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

// Each row's check on a prepared case, with the implementation under test (an
// empty function: the model's own). Defined by family in verify/rows/.
PropertyResult gather_forward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather);
PropertyResult gather_backward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather);
PropertyResult anchor_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather, const AnchorFn& anchor);
PropertyResult halo_forward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo);
PropertyResult halo_backward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo);
PropertyResult conv_forward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv);
PropertyResult conv_backward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv);
PropertyResult recurrence_forward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding);
PropertyResult recurrence_backward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding);
PropertyResult two_steps_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn);
PropertyResult rope_of(const Prepared& s, const CheckOptions& o, const RopeFn& fn);
PropertyResult attention_forward_of(Prepared& s, const CheckOptions& o, const AttentionFn& fn, const RopeFn& rope_fn,
                                    std::int64_t topk);
PropertyResult attention_backward_of(Prepared& s, const CheckOptions& o, const AttentionFn& fn,
                                     const RopeFn& rope_fn, std::int64_t topk);
PropertyResult loss_forward_of(Prepared& s, const CheckOptions& o, const TargetsFn& targets_fn, const LossFn& loss_fn);
PropertyResult loss_backward_of(Prepared& s, const CheckOptions& o, const TargetsFn& targets_fn,
                                const LossFn& loss_fn);

}  // namespace cpsim::verify
