#include <gtest/gtest.h>

#include "core/autograd.hpp"

using namespace cpsim;

TEST(Tensor, NarrowAndCatAreInverseAlongAnyDimension) {
  Tensor t({2, 5, 3}, DType::f32);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(i));
  for (int dim = 0; dim < 3; ++dim) {
    const std::int64_t n = t.dim(dim), cut = n / 2;
    EXPECT_TRUE(cat({narrow(t, dim, 0, cut), narrow(t, dim, cut, n - cut)}, dim).bitwise_equal(t)) << dim;
  }
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16::from_float(1.0f).to_float(), 1.0f);
  EXPECT_EQ(bf16::from_float(1.00390625f).to_float(), 1.0f);      // halfway, rounds to even
  EXPECT_EQ(bf16::from_float(1.01171875f).to_float(), 1.015625f);  // halfway, rounds to even (up)
}

TEST(Tensor, PadSequenceDimFillsTheTail) {
  Tensor t = Tensor::from<std::int64_t>({1, 2}, {7, 8});
  Tensor p = pad_sequence_dim(t, 4, -100);
  EXPECT_EQ(p.shape(), (Shape{1, 4}));
  EXPECT_EQ(p.get_int(2), -100);
  EXPECT_EQ(p.get_int(3), -100);
  EXPECT_EQ(p.get_int(1), 8);
}

TEST(Autograd, BackwardRunsOnlyReachableNodesAndLeavesUnreachedGradientsUndefined) {
  Var a(Tensor::full({3}, DType::f64, 2.0), true);
  Var b(Tensor::full({3}, DType::f64, 5.0), true);
  int calls_a = 0, calls_b = 0;
  Var ya = record(a.value().clone(), "id_a", {a}, [&](const Tensor& g) { ++calls_a; return std::vector<Tensor>{g}; });
  Var yb = record(b.value().clone(), "id_b", {b}, [&](const Tensor& g) { ++calls_b; return std::vector<Tensor>{g}; });
  (void)yb;
  backward(dot(ya, Tensor::full({3}, DType::f64, 4.0)));
  EXPECT_EQ(calls_a, 1);
  EXPECT_EQ(calls_b, 0);
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().get(1), 4.0);
  EXPECT_FALSE(b.grad().defined());
}

TEST(Autograd, GradientsAccumulateOverEveryUse) {
  Var a(Tensor::full({2}, DType::f64, 1.0), true);
  Var loss = add(dot(a, Tensor::full({2}, DType::f64, 3.0)), dot(a, Tensor::full({2}, DType::f64, 0.5)));
  backward(loss);
  EXPECT_EQ(a.grad().get(0), 3.5);
  backward(loss);  // leaves accumulate across calls, as in PyTorch
  EXPECT_EQ(a.grad().get(0), 7.0);
}

TEST(Autograd, SharedSubgraphRunsOnce) {
  Var a(Tensor::full({2}, DType::f64, 1.0), true);
  int calls = 0;
  Var mid = record(a.value().clone(), "mid", {a}, [&](const Tensor& g) { ++calls; return std::vector<Tensor>{g}; });
  backward(add(dot(mid, Tensor::full({2}, DType::f64, 1.0)), dot(mid, Tensor::full({2}, DType::f64, 2.0))));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(a.grad().get(0), 3.0);
}

TEST(Autograd, ConstantLossRunsNothing) {
  Var a(Tensor::full({2}, DType::f64, 1.0), true);
  backward(constant_scalar(1.0));
  EXPECT_FALSE(a.grad().defined());
}
