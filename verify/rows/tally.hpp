// How a property row compares: a bitwise tally of wrong elements, or the worst
// relative RMSE against a tolerance (Comparison::bitwise and ::tolerance). A NaN
// or an inf on one side only always fails, naming its element.
#pragma once

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "core/comm/registry.hpp"
#include "verify/properties.hpp"
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
struct BitwiseTally {
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

// Relative RMSE against a tolerance; tracks the worst error of a property. A NaN
// or an inf on one side only is a failure naming its element (the measure is
// inf), and a NaN measure is never "within" a tolerance: every test is
// !(e <= tol), and the worst error keeps a NaN.
struct ToleranceTally {
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
}  // namespace cpsim::verify::rows
