// The unsharded gated delta rule reference is itself checked: its backward
// against central finite differences, its reset at segment starts, and the
// known answer of one step.
#include <gtest/gtest.h>

#include <cmath>

#include "verify/random.hpp"
#include "verify/reference.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {
double loss(const RecurrenceInputs& in, const Tensor& ids, const Tensor& d_o) {
  const Tensor o = reference_recurrence(in, ids, Tensor()).o;
  double s = 0;
  for (std::int64_t i = 0; i < o.numel(); ++i) s += o.get(i) * d_o.get(i);
  return s;
}
}  // namespace

TEST(RecurrenceReference, BackwardMatchesCentralFiniteDifferences) {
  const Tensor ids = Tensor::from<std::int64_t>({1, 7}, {1, 1, 1, 2, 2, 2, 0});
  RecurrenceInputs in = random_recurrence_inputs(1, 7, 2, 3, 2, 7);
  const Tensor d_o = random_tensor({1, 7, 2, 2}, DType::f64, 8);
  const RecurrenceReference ref = reference_recurrence(in, ids, d_o);
  const double h = 1e-6;
  const std::pair<Tensor*, const Tensor*> pairs[] = {
      {&in.q, &ref.dq}, {&in.k, &ref.dk}, {&in.v, &ref.dv}, {&in.beta, &ref.dbeta}, {&in.g, &ref.dg}};
  for (const auto& [x, grad] : pairs)
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      const double keep = x->get(i);
      x->set(i, keep + h);
      const double up = loss(in, ids, d_o);
      x->set(i, keep - h);
      const double down = loss(in, ids, d_o);
      x->set(i, keep);
      EXPECT_NEAR(grad->get(i), (up - down) / (2 * h), 1e-7) << "element " << i;
    }
}

TEST(RecurrenceReference, StateResetsAtEverySegmentStart) {
  // The same tokens after a different history give the same output once a segment starts.
  const RecurrenceInputs in = random_recurrence_inputs(1, 4, 1, 2, 2, 3);
  const Tensor split = Tensor::from<std::int64_t>({1, 4}, {1, 1, 2, 2});
  const Tensor o = reference_recurrence(in, split, Tensor()).o;
  RecurrenceInputs tail{narrow(in.q, 1, 2, 2), narrow(in.k, 1, 2, 2), narrow(in.v, 1, 2, 2), narrow(in.beta, 1, 2, 2),
                        narrow(in.g, 1, 2, 2)};
  const Tensor o_tail = reference_recurrence(tail, Tensor::from<std::int64_t>({1, 2}, {2, 2}), Tensor()).o;
  EXPECT_TRUE(narrow(o, 1, 2, 2).bitwise_equal(o_tail));
}

TEST(RecurrenceReference, OneStepKnownAnswer) {
  // S_1 = beta k v^T from a zero state, so o = beta (k . q) v.
  RecurrenceInputs in{Tensor::from<double>({1, 1, 1, 2}, {1.0, 2.0}), Tensor::from<double>({1, 1, 1, 2}, {0.6, 0.8}),
                      Tensor::from<double>({1, 1, 1, 1}, {3.0}), Tensor::from<double>({1, 1, 1}, {0.5}),
                      Tensor::from<double>({1, 1, 1, 2}, {-0.1, -0.2})};
  const Tensor o = reference_recurrence(in, Tensor::from<std::int64_t>({1, 1}, {1}), Tensor()).o;
  EXPECT_NEAR(o.get(0), 0.5 * (0.6 * 1.0 + 0.8 * 2.0) * 3.0, 1e-15);
}
