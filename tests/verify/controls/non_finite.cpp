// A NaN or an inf never passes a comparison. Every family of property rows is run
// against the model's own operator with one non-finite value planted in one
// rank's sharded output (forward rows) or in the gradient one rank returns for an
// input (backward rows); each row must FAIL and name the element.
#include <gmock/gmock.h>

#include <cmath>
#include <limits>

#include "core/attention.hpp"
#include "core/autograd.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/reference.hpp"
#include "tests/verify/controls/controls.hpp"

namespace {

constexpr int kPlantedRank = 1;

bool planted_here(const Communicator* comm) { return comm && comm->rank() == kPlantedRank; }

// A copy of t with its last element set to `bad` (t itself when it is empty, or
// of an integer dtype: no integer holds NaN or inf).
Tensor with_bad(const Tensor& t, double bad) {
  if (t.numel() == 0 || !is_floating(t.dtype())) return t;
  Tensor c = t.to(Device::host()).clone();
  c.set(c.numel() - 1, bad);
  return c;
}

// The forward value with `bad` planted; the backward passes the gradient on.
Var bad_forward(const Var& y, double bad) {
  return record(with_bad(y.value(), bad), "planted_forward", {y}, [](const Tensor& g) { return std::vector<Tensor>{g}; });
}
// The forward value unchanged; the gradient passed on has `bad` planted.
Var bad_backward(const Var& x, double bad) {
  return record(x.value(), "planted_backward", {x},
                [bad](const Tensor& g) { return std::vector<Tensor>{with_bad(g, bad)}; });
}

// Generated cases at CP 2-4 under equal intervals: every rank's shard is non-empty.
std::vector<LayoutCase> cases() {
  std::vector<LayoutCase> out;
  const auto gen = gen_layout_case(4, PlanChoice{});
  for (int i = 0; out.size() < 4 && i < 200; ++i) {
    LayoutCase c = gen(rc::Random(911 + i), 20).value();
    c = at_cp(c, 2 + static_cast<int>(out.size()) % 3);
    out.push_back(c);
  }
  return out;
}

const char* name_of(double bad) { return std::isnan(bad) ? "nan" : "inf"; }

void expect_fails(const std::string& row, double bad, const std::function<PropertyResult(const LayoutCase&)>& check) {
  for (const LayoutCase& c : cases()) {
    const PropertyResult r = check(c);
    EXPECT_FALSE(r.ok) << row << " passed with a planted " << name_of(bad) << ": " << c;
    // (an inf planted before a multiplication by 0 arrives as a NaN)
    EXPECT_THAT(r.detail, AnyOf(HasSubstr(name_of(bad)), HasSubstr("nan"))) << row << ": " << c;
    EXPECT_THAT(r.detail, AnyOf(HasSubstr("element ["), HasSubstr("wrong elements"))) << row << ": " << c;
  }
}

const double kBad[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()};

}  // namespace

TEST(NonFiniteControls, TheComparisonsNameTheFirstNonFiniteElementAndNeverPassIt) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const Tensor ref = Tensor::from<double>({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(relative_rmse(ref, ref), 0);
  for (const double bad : {nan, inf, -inf}) {
    Tensor got = ref.clone();
    got.set(3, bad);
    EXPECT_FALSE(relative_rmse(ref, got) <= 1e300) << bad;
    EXPECT_FALSE(relative_rmse(got, ref) <= 1e300) << bad;
    EXPECT_FALSE(relative_rmse(ref, got, ref) <= 1e300) << bad;
    EXPECT_EQ(first_nonfinite_mismatch(ref, got), 3);
    EXPECT_THAT(describe_element(ref, got, 3), HasSubstr("element [1, 1] is"));
    // The same non-finite value on both sides agrees; the rest is measured.
    EXPECT_EQ(relative_rmse(got, got), 0);
    EXPECT_EQ(first_nonfinite_mismatch(got, got), -1);
  }
  Tensor pos = ref.clone(), neg = ref.clone();
  pos.set(0, inf), neg.set(0, -inf);
  EXPECT_FALSE(relative_rmse(pos, neg) <= 1e300);
  // Two finite values too far apart for a double's difference.
  const Tensor big = Tensor::from<double>({1}, {1.7e308}), small = Tensor::from<double>({1}, {-1.7e308});
  EXPECT_FALSE(relative_rmse(big, small) <= 1e300);
}

TEST(NonFiniteControls, APlantedValueFailsTheGatherAndHaloRows) {
  const CheckOptions o;
  for (const double bad : kBad) {
    expect_fails("gather_forward", bad, [&](const LayoutCase& c) {
      return check_row("gather_forward", c, o, {.gather = [bad](const Var& x, Communicator* comm, bool d, const ShardPlan* plan) {
        const Var y = default_gather()(x, comm, d, plan);
        return planted_here(comm) ? bad_forward(y, bad) : y;
      }});
    });
    expect_fails("gather_backward", bad, [&](const LayoutCase& c) {
      return check_row("gather_backward", c, o, {.gather = [bad](const Var& x, Communicator* comm, bool d, const ShardPlan* plan) {
        return default_gather()(planted_here(comm) ? bad_backward(x, bad) : x, comm, d, plan);
      }});
    });
    expect_fails("halo_forward", bad, [&](const LayoutCase& c) {
      return check_row("halo_forward", c, o, {.halo = [bad](const Var& x, Communicator* comm, int w, HaloExchange e,
                                           const ShardPlan* plan) {
        const Var y = default_halo()(x, comm, w, e, plan);
        return planted_here(comm) ? bad_forward(y, bad) : y;
      }});
    });
    expect_fails("halo_backward", bad, [&](const LayoutCase& c) {
      return check_row("halo_backward", c, o, {.halo = [bad](const Var& x, Communicator* comm, int w, HaloExchange e,
                                            const ShardPlan* plan) {
        return default_halo()(planted_here(comm) ? bad_backward(x, bad) : x, comm, w, e, plan);
      }});
    });
  }
}

TEST(NonFiniteControls, APlantedValueFailsTheConvRows) {
  const CheckOptions o;
  // The conv sees no communicator: every rank plants one value in its own output.
  for (const double bad : kBad) {
    expect_fails("conv_forward", bad, [&](const LayoutCase& c) {
      return check_row("conv_forward", c, o, {.halo = default_halo(), .conv = [bad](const Var& x, const Tensor& ids, const Var& w, const Var& b) {
        return bad_forward(default_conv()(x, ids, w, b), bad);
      }});
    });
    expect_fails("conv_backward", bad, [&](const LayoutCase& c) {
      return check_row("conv_backward", c, o, {.halo = default_halo(), .conv = [bad](const Var& x, const Tensor& ids, const Var& w,
                                                             const Var& b) {
        return default_conv()(bad_backward(x, bad), ids, w, b);
      }});
    });
  }
}

TEST(NonFiniteControls, APlantedValueFailsTheRecurrenceRows) {
  const CheckOptions o;
  for (const double bad : kBad) {
    const RecurrenceFn forward = [bad](const Var& q, const Var& k, const Var& v, const Var& b, const Var& g,
                                       const PackedContext& ctx, Communicator* comm) {
      const Var o = default_recurrence()(q, k, v, b, g, ctx, comm);
      return planted_here(comm) ? bad_forward(o, bad) : o;
    };
    const RecurrenceFn backward = [bad](const Var& q, const Var& k, const Var& v, const Var& b, const Var& g,
                                        const PackedContext& ctx, Communicator* comm) {
      return default_recurrence()(q, planted_here(comm) ? bad_backward(k, bad) : k, v, b, g, ctx, comm);
    };
    expect_fails("recurrence_forward", bad, [&](const LayoutCase& c) { return check_row("recurrence_forward", c, o, {.recurrence = forward}); });
    expect_fails("recurrence_backward", bad,
                 [&](const LayoutCase& c) { return check_row("recurrence_backward", c, o, {.recurrence = backward}); });
    expect_fails("two_steps", bad, [&](const LayoutCase& c) { return check_row("two_steps", c, o, {.recurrence = forward}); });
  }
}

TEST(NonFiniteControls, APlantedValueFailsTheLayerRows) {
  const CheckOptions o;
  for (const double bad : kBad) {
    // RoPE sees no communicator: every rank plants one value.
    expect_fails("rope", bad, [&](const LayoutCase& c) {
      return check_row("rope", c, o, {.rope = [bad](const Var& x, const Tensor& pos) { return bad_forward(default_rope()(x, pos), bad); }});
    });
    const AttentionFn forward = [bad](const Var& q, const Var& k, const Var& v, const PackedContext& ctx,
                                      const Tensor& padding, Communicator* comm, const SparseIndexer* indexer,
                                      const Tensor& probe) {
      CpAttention a = default_attention()(q, k, v, ctx, padding, comm, indexer, probe);
      if (planted_here(comm)) a.out = bad_forward(a.out, bad);
      return a;
    };
    const AttentionFn backward = [bad](const Var& q, const Var& k, const Var& v, const PackedContext& ctx,
                                       const Tensor& padding, Communicator* comm, const SparseIndexer* indexer,
                                       const Tensor& probe) {
      return default_attention()(planted_here(comm) ? bad_backward(q, bad) : q, k, v, ctx, padding, comm, indexer,
                                 probe);
    };
    for (const std::int64_t topk : {std::int64_t{-1}, std::int64_t{o.topk}}) {
      const std::string form = topk < 0 ? "attention" : "sparse_attention";
      expect_fails(form + "_forward", bad,
                   [&](const LayoutCase& c) { return check_row((topk >= 0 ? "sparse_attention_forward" : "attention_forward"), c, o, {.attention = forward}); });
      expect_fails(form + "_backward", bad,
                   [&](const LayoutCase& c) { return check_row((topk >= 0 ? "sparse_attention_backward" : "attention_backward"), c, o, {.attention = backward}); });
    }
    expect_fails("loss_forward", bad, [&](const LayoutCase& c) {
      return check_row("loss_forward", c, o, {.loss = [bad](const Var& logits, const Tensor& targets, Communicator* comm) {
        const Var l = default_loss()(logits, targets, comm);
        return planted_here(comm) ? bad_forward(l, bad) : l;
      }});
    });
    expect_fails("loss_backward", bad, [&](const LayoutCase& c) {
      return check_row("loss_backward", c, o, {.loss = [bad](const Var& logits, const Tensor& targets, Communicator* comm) {
        return default_loss()(planted_here(comm) ? bad_backward(logits, bad) : logits, targets, comm);
      }});
    });
  }
}
