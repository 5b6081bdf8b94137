#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/autograd.hpp"
#include "core/bytes.hpp"
#include "core/error.hpp"

using namespace cpsim;

// One size convention, binary both ways: what --max-memory reads is what the
// estimate prints.
TEST(Bytes, SizesReadAndPrintInOneBinaryConvention) {
  EXPECT_EQ(parse_bytes("8"), 8);
  EXPECT_EQ(parse_bytes("64K"), 64 << 10);
  EXPECT_EQ(parse_bytes("64KiB"), 64 << 10);
  EXPECT_EQ(parse_bytes("16m"), 16 << 20);
  EXPECT_EQ(parse_bytes("8G"), 8ll << 30);
  EXPECT_EQ(parse_bytes("1T"), 1ll << 40);
  for (const char* bad : {"", "G", "8X", "-1", "0", "2T", "1.5G", "99999999999999999999"})
    EXPECT_THROW(parse_bytes(bad), InvalidInput) << bad;
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(parse_bytes("64M")), "64.0 MiB");
  EXPECT_EQ(format_bytes(parse_bytes("8G")), "8.0 GiB");
  EXPECT_EQ(format_bytes(3ll << 29), "1.5 GiB");
  for (const char* text : {"1K", "320M", "8G", "1T"})
    EXPECT_EQ(format_bytes(parse_bytes(text)), std::to_string(std::stoi(text)) + ".0 " + text[std::string(text).size() - 1] + "iB");
}

TEST(Tensor, NarrowAndCatAreInverseAlongAnyDimension) {
  Tensor t({2, 5, 3}, DType::f32);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(i));
  for (int dim = 0; dim < 3; ++dim) {
    const std::int64_t n = t.dim(dim), cut = n / 2;
    EXPECT_TRUE(cat({narrow(t, dim, 0, cut), narrow(t, dim, cut, n - cut)}, dim).bitwise_equal(t)) << dim;
  }
}

TEST(Tensor, AContiguousSliceSharesStorageAndReadsAsNarrow) {
  Tensor t({1, 6, 2}, DType::f64);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<double>(i));
  const Tensor s = t.contiguous_slice(1, 2, 3);
  EXPECT_EQ(s.shape(), (Shape{1, 3, 2}));
  EXPECT_TRUE(s.bitwise_equal(narrow(t, 1, 2, 3)));
  EXPECT_TRUE(s.clone().bitwise_equal(narrow(t, 1, 2, 3)));
  EXPECT_EQ(static_cast<const double*>(s.raw()), static_cast<const double*>(t.raw()) + 4);
  EXPECT_FALSE(s.sole_owner());
  EXPECT_TRUE(t.contiguous_slice(1, 6, 0).clone().numel() == 0);
  EXPECT_THROW((void)Tensor({2, 6}, DType::f64).contiguous_slice(1, 0, 3), Error);  // rows apart: not one run
  EXPECT_THROW((void)t.contiguous_slice(1, 4, 3), Error);
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

// Accumulation adopts an op's fresh gradient and adds into it, but never writes a
// tensor an op still holds: an input, a capture, or a gradient given twice.
TEST(Autograd, AccumulationNeverWritesATensorSomeoneElseHolds) {
  const Tensor w1 = Tensor::full({3}, DType::f64, 3.0), w2 = Tensor::full({3}, DType::f64, 0.5);
  Var a(Tensor::full({3}, DType::f64, 1.0), true);
  // dot hands back its weights as the gradient: captured, so copied before any add.
  Var fresh = record(a.value().clone(), "fresh", {a}, [](const Tensor& g) {
    Tensor out = g.clone();  // a new tensor only this op made
    return std::vector<Tensor>{out};
  });
  backward(add(add(dot(a, w1), dot(a, w2)), dot(fresh, w1)));
  EXPECT_EQ(w1.get(0), 3.0);
  EXPECT_EQ(w2.get(0), 0.5);
  EXPECT_EQ(a.grad().get(2), 6.5);
  backward(dot(a, w2));  // leaves accumulate across calls
  EXPECT_EQ(a.grad().get(0), 7.0);
  EXPECT_EQ(w2.get(0), 0.5);
  // The same tensor given for two inputs.
  Var b(Tensor::full({2}, DType::f64, 1.0), true);
  const Tensor g2 = Tensor::full({2}, DType::f64, 2.0);
  Var twice = record(Tensor::full({1}, DType::f64, 0.0), "twice", {b, b}, [g2](const Tensor&) {
    return std::vector<Tensor>{g2, g2};
  });
  backward(twice);
  EXPECT_EQ(b.grad().get(1), 4.0);
  EXPECT_EQ(g2.get(1), 2.0);
}

TEST(Tensor, FullFillsEveryDtypeAndToCopiesEverything) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::b8}) {
    const Tensor z = Tensor::full({5, 3}, dt, 0.0), o = Tensor::full({5, 3}, dt, 1.0), m = Tensor::full({2}, dt, -0.0);
    for (std::int64_t i = 0; i < z.numel(); ++i) {
      EXPECT_EQ(z.get(i), 0.0);
      EXPECT_EQ(o.get(i), 1.0);
    }
    if (dt == DType::f64) EXPECT_TRUE(std::signbit(m.get(1)));
    EXPECT_TRUE(o.to(Device::host()).bitwise_equal(o));
  }
  const Tensor big = Tensor::full({1 << 20}, DType::f32, 2.5);  // a mapped block
  EXPECT_EQ(big.get((1 << 20) - 1), 2.5);
  EXPECT_TRUE(big.clone().bitwise_equal(big));
}

TEST(Tensor, AddZeroIsExactlyAnAddOfZeros) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> values{-0.0, 0.0, 1.5, -2.0, nan, -inf, -0.0};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    Tensor t({static_cast<std::int64_t>(values.size())}, dt);
    for (std::size_t i = 0; i < values.size(); ++i) t.set(static_cast<std::int64_t>(i), values[i]);
    Tensor added = t.clone();
    add_inplace(added, Tensor(t.shape(), dt));
    add_zero_inplace(t);
    EXPECT_TRUE(t.bitwise_equal(added)) << dtype_name(dt);
    EXPECT_FALSE(std::signbit(t.get(0))) << dtype_name(dt);
  }
  Tensor ints = Tensor::from<std::int64_t>({2}, {-1, 0});
  add_zero_inplace(ints);
  EXPECT_EQ(ints.get_int(0), -1);
}

// An anchor's zero gradient reaches its input (whose backward then runs) and adds
// as +0, whichever arrives first, without writing a sparse gradient's pages.
TEST(Autograd, ZeroGradientsReachTheirInputsAndAddAsPlusZero) {
  for (bool anchor_first : {true, false}) {
    Var a(Tensor::full({4}, DType::f64, 1.0), true);
    Var op = record(a.value().clone(), "op", {a}, [](const Tensor&) {
      return std::vector<Tensor>{Tensor::from<double>({4}, {-0.0, 3.0, -0.0, 0.0})};
    });
    Var anchor = record(Tensor::full({1}, DType::f64, 0.0), "anchor", {a},
                        [](const Tensor&) { return std::vector<Tensor>{Tensor({4}, DType::f64)}; }, true);
    const Var term = dot(op, Tensor::full({4}, DType::f64, 1.0));
    backward(anchor_first ? add(anchor, term) : add(term, anchor));
    ASSERT_TRUE(a.grad().defined());
    EXPECT_TRUE(a.grad().bitwise_equal(Tensor::from<double>({4}, {0.0, 3.0, 0.0, 0.0}))) << anchor_first;
  }
  // Only an anchor: a defined zero gradient, so the input's own backward runs.
  Var b(Tensor::full({2}, DType::f64, 1.0), true);
  int calls = 0;
  Var mid = record(b.value().clone(), "mid", {b}, [&](const Tensor& g) { ++calls; return std::vector<Tensor>{g}; });
  backward(record(Tensor::full({1}, DType::f64, 0.0), "anchor", {mid},
                  [](const Tensor&) { return std::vector<Tensor>{Tensor({2}, DType::f64)}; }, true));
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(b.grad().defined());
  EXPECT_EQ(b.grad().get(1), 0.0);
  // A sparse gradient (64 MiB, one element written) stays sparse: the process's
  // resident memory grows by far less than its size.
  auto resident_bytes = [] {
    std::ifstream statm("/proc/self/statm");
    std::size_t size = 0, resident = 0;
    statm >> size >> resident;
    return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  };
  const std::int64_t n = std::int64_t{8} << 20;
  Var c(Tensor({n}, DType::f64), true);
  Var sparse = record(Tensor({1}, DType::f64), "sparse", {c}, [n](const Tensor&) {
    Tensor g({n}, DType::f64);
    g.set(0, 2.0);
    return std::vector<Tensor>{g};
  });
  const Var loss = add(sparse, record(Tensor({1}, DType::f64), "anchor", {c}, [n](const Tensor&) {
    return std::vector<Tensor>{Tensor({n}, DType::f64)};
  }, true));
  const std::size_t before = resident_bytes();
  backward(loss);
  const std::size_t grown = resident_bytes() - std::min(before, resident_bytes());
  EXPECT_EQ(c.grad().get(0), 2.0);
  EXPECT_LT(grown, c.grad().nbytes() / 4) << grown << " bytes more resident";
}

// A gradient held elsewhere (dot hands back its weights) reaches an inner node
// without a copy; it is copied only when something is added to it, and a leaf's
// gradient is always its own.
TEST(Autograd, AHeldGradientIsBorrowedByInnerNodesUntilAddedTo) {
  const Tensor w = Tensor::from<double>({3}, {1.0, -0.0, 2.0}), w2 = Tensor::full({3}, DType::f64, 0.5);
  Var a(Tensor::full({3}, DType::f64, 1.0), true);
  const void* seen = nullptr;
  Var mid = record(a.value().clone(), "mid", {a}, [&](const Tensor& g) {
    seen = g.raw();
    return std::vector<Tensor>{g};
  });
  backward(dot(mid, w));
  EXPECT_EQ(seen, w.raw());  // borrowed, not copied
  EXPECT_NE(a.grad().raw(), w.raw());  // a leaf's own copy
  EXPECT_TRUE(a.grad().bitwise_equal(w));
  // Added to: copied first, the weights untouched.
  a.zero_grad();
  backward(add(dot(mid, w), dot(mid, w2)));
  EXPECT_NE(seen, w.raw());
  EXPECT_TRUE(a.grad().bitwise_equal(Tensor::from<double>({3}, {1.5, 0.5, 2.5})));
  EXPECT_TRUE(std::signbit(w.get(1)));
  // A zero gradient on a borrowed slot: +0 where the weights hold -0, in a copy.
  for (bool anchor_first : {true, false}) {
    a.zero_grad();
    const Var anchor = record(Tensor::full({1}, DType::f64, 0.0), "anchor", {mid},
                              [](const Tensor&) { return std::vector<Tensor>{Tensor({3}, DType::f64)}; }, true);
    backward(anchor_first ? add(anchor, dot(mid, w)) : add(dot(mid, w), anchor));
    EXPECT_TRUE(a.grad().bitwise_equal(Tensor::from<double>({3}, {1.0, 0.0, 2.0}))) << anchor_first;
    EXPECT_TRUE(std::signbit(w.get(1))) << anchor_first;
  }
  // Without a negative zero the borrowed slot is not copied.
  backward(add(dot(mid, w2), record(Tensor::full({1}, DType::f64, 0.0), "anchor", {mid}, [](const Tensor&) {
    return std::vector<Tensor>{Tensor({3}, DType::f64)};
  }, true)));
  EXPECT_EQ(seen, w2.raw());
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

namespace {
// A stand-in device runtime: host memory behind a cuda tag, counting what it holds,
// so storage can be followed through allocation, copies and frees without a GPU.
struct FakeCudaRuntime final : DeviceRuntime {
  int live = 0, copies = 0;
  void* allocate(Device d, std::size_t bytes) override {
    EXPECT_EQ(d.kind, DeviceKind::cuda);
    ++live;
    return std::malloc(bytes ? bytes : 1);
  }
  void deallocate(Device, void* p, std::size_t) noexcept override {
    --live;
    std::free(p);
  }
  void zero(Device, void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, Device, const void* src, Device, std::size_t bytes) override {
    ++copies;
    std::memmove(dst, src, bytes);
  }
};
}  // namespace

TEST(Tensor, StorageKnowsItsDeviceAndGoesThroughItsRuntime) {
  FakeCudaRuntime fake;
  register_device_runtime(DeviceKind::cuda, &fake);
  {
    const Tensor host = Tensor::from<std::int64_t>({2, 3}, {1, 2, 3, 4, 5, 6});
    EXPECT_EQ(host.device(), Device::host());
    const Tensor dev = host.to(Device::cuda(0));
    EXPECT_EQ(dev.device(), Device::cuda(0));
    EXPECT_EQ(dev.device().str(), "cuda:0");
    EXPECT_EQ(fake.live, 1);
    EXPECT_THROW(dev.get(0), Error);  // element access is for host tensors
    EXPECT_THROW(dev.data<std::int64_t>(), Error);
    const Tensor cols = narrow(dev, 1, 1, 2);
    EXPECT_EQ(cols.device(), Device::cuda(0));
    const Tensor back = cols.to(Device::host());
    EXPECT_EQ(std::vector<std::int64_t>(back.data<std::int64_t>(), back.data<std::int64_t>() + 4),
              (std::vector<std::int64_t>{2, 3, 5, 6}));
    const Tensor both = cat({dev, dev.clone()}, 0);
    EXPECT_EQ(both.shape(), (Shape{4, 3}));
    EXPECT_TRUE(both.to(Device::host()).bitwise_equal(cat({host, host}, 0)));
    EXPECT_TRUE(dev.bitwise_equal(host.to(Device::cuda(0))));
    EXPECT_THROW(cat({dev, host}, 0), Error);  // one device per cat
    EXPECT_GT(fake.copies, 0);
  }
  EXPECT_EQ(fake.live, 0) << "device storage was not freed through its runtime";
  register_device_runtime(DeviceKind::cuda, nullptr);
  EXPECT_THROW(Tensor({1}, DType::f32, Device::cuda(0)), Unavailable);
}
