// Every property must be able to fail: each is run against a deliberately broken
// variant of the code it checks, and must find (and shrink) a counterexample.
#include <gmock/gmock.h>

#include "core/gather.hpp"
#include "tests/property_harness.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using cpsim::testing::expect_counterexample;
using ::testing::HasSubstr;

namespace {

// Doc ids decided from token ids: PAD tokens end documents and count as padding.
Tensor doc_ids_from_token_ids(const Batch& b, std::int64_t pad) {
  const Tensor& ids = b.at("input_ids");
  Tensor out(ids.shape(), DType::i64);
  const std::int64_t B = ids.dim(0), S = ids.dim(1);
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t doc = 1;
    for (std::int64_t s = 0; s < S; ++s) {
      const bool is_pad = ids.get_int(r * S + s) == pad;
      out.data<std::int64_t>()[r * S + s] = is_pad ? 0 : doc;
      if (is_pad && s > 0 && ids.get_int(r * S + s - 1) != pad) ++doc;
    }
  }
  return out;
}

// Each rank keeps [r*L + 1, (r+1)*L + 1): one token too far right.
ShardedBatch off_by_one_shard(int rank, int cp, const Batch& b, std::int64_t pad, bool primary) {
  ShardedBatch mine = shard_batch_at(rank, cp, b, std::nullopt, pad, primary);
  if (rank + 1 >= cp) return mine;
  const ShardedBatch next = shard_batch_at(rank + 1, cp, b, std::nullopt, pad, primary);
  for (auto& [key, t] : mine.local) {
    if (!next.local.count(key) || t.ndim() != 2 || t.dim(1) != mine.context.local_seq_len()) continue;
    t = narrow(cat({t, next.local.at(key)}, 1), 1, 1, t.dim(1));
  }
  return mine;
}

// Shards concatenated in reverse rank order.
Var gather_reversed(const Var& x, Communicator* comm, bool differentiable) {
  if (!is_distributed(comm)) return x;
  const Tensor g = all_gather_sequence_tensor(x.value(), *comm);
  const std::int64_t L = x.value().dim(1);
  std::vector<Tensor> blocks;
  for (int q = comm->size() - 1; q >= 0; --q) blocks.push_back(narrow(g, 1, q * L, L));
  return Var(cat(blocks, 1), false);
}

// Backward keeps only this rank's own slice instead of summing every rank's.
Var gather_backward_slices(const Var& x, Communicator* comm, bool differentiable) {
  if (!is_distributed(comm)) return x;
  const std::int64_t L = x.value().dim(1);
  const int r = comm->rank();
  return record(all_gather_sequence_tensor(x.value(), *comm), "gather_backward_slices", {x},
                [L, r](const Tensor& g) { return std::vector<Tensor>{narrow(g, 1, r * L, L)}; });
}

// A zero with no backward edge: ranks that ignore the gather skip its backward again.
Var anchor_without_edge(const Var& gathered) { return constant_scalar(0.0, gathered.value().dtype()); }

void expect_found(const std::string& report) {
  EXPECT_FALSE(report.empty()) << "the property passed every case against a broken implementation";
  EXPECT_THAT(report, HasSubstr("cp=")) << "the counterexample is not printed as a batch";
  if (std::getenv("CPSIM_SHOW_COUNTEREXAMPLES")) std::cout << report << "\n";
}

}  // namespace

TEST(NegativeControls, LayoutCatchesDocIdsBuiltFromTokenIds) {
  expect_found(expect_counterexample("layout vs doc ids from token ids", [](const LayoutCase& c) {
    const auto r = check_layout(c, doc_ids_from_token_ids);
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, ShardCatchesAnOffByOneShard) {
  expect_found(expect_counterexample("shard vs off-by-one shard", [](const LayoutCase& c) {
    const auto r = check_shard(c, off_by_one_shard);
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, GatherForwardCatchesTheWrongRankOrder) {
  expect_found(expect_counterexample("gather_forward vs reversed ranks", [](const LayoutCase& c) {
    const auto r = check_gather_forward(c, CheckOptions{}, gather_reversed);
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, GatherBackwardCatchesABackwardThatSlicesInsteadOfSumming) {
  expect_found(expect_counterexample("gather_backward vs slicing backward", [](const LayoutCase& c) {
    const auto r = check_gather_backward(c, CheckOptions{}, gather_backward_slices);
    RC_ASSERT(r.ok);
  }));
}

TEST(NegativeControls, AnchorCatchesAnAnchorWithoutABackwardEdge) {
  expect_found(expect_counterexample("anchor vs anchor without edge", [](const LayoutCase& c) {
    const auto r = check_anchor(c, CheckOptions{}, default_gather(), anchor_without_edge);
    RC_ASSERT(r.ok);
  }));
}
