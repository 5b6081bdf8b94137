// The host runs data movement and the rank-order sum as contiguous runs (memcpy,
// loops vectorised across elements), the conv along its channels and its weight
// gradient in one pass over the tokens, the doc ids a document at a time; a GPU
// runs the one kernel source's functors, an element (or a weight) a thread. Both
// are run here, on the host, over random shapes, and must agree bitwise: so the
// functors a GPU runs stay proven on every CI run.
#include <gtest/gtest.h>

#include <random>

#include "core/kernels/attention_host.hpp"
#include "core/kernels/conv.hpp"
#include "core/kernels/layers.hpp"
#include "core/kernels/layout.hpp"
#include "core/kernels/movement.hpp"
#include "core/kernels/reduce.hpp"
#include "verify/random.hpp"

using namespace cpsim;
using namespace cpsim::kernels;

namespace {

const KernelTable& host() { return kernels_for(Device::host()); }

std::vector<std::uint8_t> random_bytes(std::size_t n, std::mt19937_64& rng) {
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

}  // namespace

TEST(HostKernels, RearrangementRunsAreTheFunctorsBitwise) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t rows = 1 + rng() % 4, ranks = 1 + rng() % 8;
    const std::size_t row_bytes = 1 + rng() % 300;
    const auto src = random_bytes(rows * ranks * row_bytes, rng);
    for (bool to_sequence : {true, false}) {
      std::vector<std::uint8_t> runs(src.size(), 0xEE), functor(src.size(), 0xEE);
      Rearrange a{src.data(), runs.data(), rows, ranks, row_bytes};
      (to_sequence ? host().blocks_to_sequence : host().sequence_to_blocks)(a, nullptr);
      a.dst = functor.data();
      if (to_sequence) rearrange<true>(thrust::host, a);
      else rearrange<false>(thrust::host, a);
      ASSERT_EQ(runs, functor) << "rows " << rows << " ranks " << ranks << " row_bytes " << row_bytes;
    }
  }
}

TEST(HostKernels, PositionCopiesAndAddsAreTheFunctorsBitwise) {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 300; ++trial) {
    const DType dt = std::vector<DType>{DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::b8}[rng() % 6];
    const std::int64_t rows = 1 + rng() % 3, src_len = 1 + rng() % 40, dst_len = 1 + rng() % 40;
    const std::int64_t n = rng() % (1 + std::min(src_len, dst_len));
    const std::int64_t from = rng() % (src_len - n + 1), to = rng() % (dst_len - n + 1), inner = 1 + rng() % 5;
    const Tensor src = verify::random_tensor({rows, src_len, inner}, dt, rng());
    const Tensor dst = verify::random_tensor({rows, dst_len, inner}, dt, rng());
    for (bool add : {false, true}) {
      Tensor runs = dst.clone(), functor = dst.clone();
      PositionCopy a{src.raw(), runs.raw(), rows, src_len, dst_len, from, to, n,
                     static_cast<std::size_t>(inner) * dtype_size(dt)};
      if (add) host().add_positions(a, dt, nullptr);
      else host().copy_positions(a, nullptr);
      a.dst = functor.raw();
      if (add) add_positions(thrust::host, a, dt);
      else copy_positions(thrust::host, a);
      ASSERT_TRUE(runs.bitwise_equal(functor)) << dtype_name(dt) << (add ? " add" : " copy") << " rows " << rows
                                               << " n " << n << " from " << from << " to " << to;
    }
  }
}

TEST(HostKernels, TheBlockedRankOrderSumIsTheFunctorBitwise) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 60; ++trial) {
    const DType dt = std::vector<DType>{DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::b8}[rng() % 6];
    const std::int64_t count = rng() % 5000;  // across the host's 2048-element blocks
    const int n = 1 + static_cast<int>(rng() % 8);
    std::vector<Tensor> inputs;
    std::vector<const void*> srcs;
    for (int s = 0; s < n; ++s) {
      inputs.push_back(verify::random_tensor({count}, dt, rng()));
      srcs.push_back(inputs.back().raw());
    }
    Tensor blocked({count}, dt), functor({count}, dt);
    Sum a{srcs.data(), blocked.raw(), static_cast<std::size_t>(n), static_cast<std::size_t>(count)};
    host().sum_in_order(a, dt, nullptr);
    a.dst = functor.raw();
    sum_in_order(thrust::host, a, dt);
    ASSERT_TRUE(blocked.bitwise_equal(functor)) << dtype_name(dt) << " n " << n << " count " << count;
  }
}

TEST(HostKernels, TheConvAlongChannelsIsTheFunctorsBitwise) {
  std::mt19937_64 rng(14);
  for (int trial = 0; trial < 40; ++trial) {
    const DType dt = rng() % 2 ? DType::f32 : DType::f64;
    const std::int64_t B = 1 + rng() % 3, W = 1 + rng() % 5, N = 1 + rng() % 60, C = 1 + rng() % 9, NW = N + W - 1;
    Tensor ids({B, NW}, DType::i64), start({B, NW}, DType::i64);
    for (std::int64_t i = 0; i < B * NW; ++i) ids.data<std::int64_t>()[i] = static_cast<std::int64_t>(i / (1 + rng() % 7));
    host().run_starts(ids.data<std::int64_t>(), start.data<std::int64_t>(), B, NW, nullptr);
    const Tensor x = verify::random_tensor({B, NW, C}, dt, rng()), w = verify::random_tensor({C, W}, dt, rng());
    const Tensor gy = verify::random_tensor({B, N, C}, dt, rng()), bias = verify::random_tensor({C}, dt, rng());
    const bool with_bias = rng() % 2;
    std::vector<Tensor> out;
    for (int side = 0; side < 2; ++side) {
      Tensor y = Tensor::full({B, N, C}, dt, 7.0), gx = Tensor::full({B, NW, C}, dt, 7.0), gw({C, W}, dt), gb({C}, dt);
      Conv a;
      a.x = x.raw(), a.run_start = start.data<std::int64_t>(), a.w = w.raw(), a.gy = gy.raw();
      a.bias = with_bias ? bias.raw() : nullptr, a.y = y.raw();
      a.gx = gx.raw(), a.gw = gw.raw(), a.gbias = gb.raw();
      a.rows = B, a.outputs = N, a.channels = C, a.width = W;
      if (side == 0) {
        host().conv_forward(a, dt, nullptr);
        host().conv_backward(a, dt, nullptr);
      } else {
        conv_forward(thrust::host, a, dt);
        conv_backward(thrust::host, a, dt);
      }
      out.insert(out.end(), {y, gx, gw, gb});
    }
    for (int k = 0; k < 4; ++k)
      ASSERT_TRUE(out[k].bitwise_equal(out[4 + k])) << "result " << k << " " << dtype_name(dt) << " B " << B << " W " << W;
  }
}

TEST(HostKernels, DocIdRunsAreTheFunctorBitwise) {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 300; ++trial) {
    // Rows shorter and longer than a thread's group of positions (512).
    const std::int64_t rows = 1 + rng() % 3, S = 1 + rng() % (trial % 3 ? 60 : 1800), D = rng() % 12;
    const std::int64_t longest = trial % 3 ? 10 : 300;
    // Each row: documents of 0 to longest-1 positions (empty ones too) packed from 0, then padding.
    std::vector<std::int64_t> starts(rows * (D + 1)), real(rows * std::max<std::int64_t>(D, 1));
    for (std::int64_t b = 0; b < rows; ++b) {
      std::int64_t* s = starts.data() + b * (D + 1);
      for (std::int64_t d = 0; d < D; ++d) {
        s[d + 1] = std::min(S, s[d] + static_cast<std::int64_t>(rng() % longest));
        real[b * D + d] = static_cast<std::int64_t>(rng() % (s[d + 1] - s[d] + 1));
      }
    }
    std::vector<std::int64_t> ids_runs(rows * S, 77), ids_functor(rows * S, 77);
    std::unique_ptr<bool[]> pad_runs(new bool[rows * S]), pad_functor(new bool[rows * S]);
    DocIds a{starts.data(), real.data(), ids_runs.data(), pad_runs.get(), rows, S, D};
    host().doc_ids_from_starts(a, nullptr);
    a.ids = ids_functor.data(), a.padding = pad_functor.get();
    doc_ids_from_starts(thrust::host, a);
    ASSERT_EQ(ids_runs, ids_functor) << "rows " << rows << " S " << S << " D " << D;
    for (std::int64_t i = 0; i < rows * S; ++i) ASSERT_EQ(pad_runs[i], pad_functor[i]) << i;
  }
}

// Run starts and derived positions are scans (a maximum, a segmented count over
// one 64-bit word): against the loop that says what they mean, over random rows
// with runs of every length, padding runs inside and at the end of a row.
TEST(HostKernels, RunStartsAndDerivedPositionsAreTheirLoops) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t rows = 1 + rng() % 4, len = 1 + rng() % 80;
    std::vector<std::int64_t> ids(rows * len);
    for (std::int64_t b = 0; b < rows; ++b) {
      std::int64_t id = 1 + rng() % 3;
      const std::int64_t real_end = len - static_cast<std::int64_t>(rng() % 3 == 0 ? rng() % (len + 1) : 0);
      for (std::int64_t t = 0; t < len; ++t) {
        if (rng() % 6 == 0) id = rng() % 4 == 0 ? 0 : id + 1;  // a new run, some of padding
        ids[b * len + t] = t < real_end ? id : 0;
      }
    }
    // The loops: a run starts at a row's first position or where the id changes;
    // for positions, a row's trailing padding continues the run before it.
    std::vector<std::int64_t> want_starts(rows * len), want_positions(rows * len), want_tails(rows);
    for (std::int64_t b = 0; b < rows; ++b) {
      const std::int64_t* r = ids.data() + b * len;
      std::int64_t tail = len;
      while (tail > 0 && r[tail - 1] == 0) --tail;
      want_tails[b] = tail;
      std::int64_t start = 0, pos_start = 0;
      for (std::int64_t t = 0; t < len; ++t) {
        if (t > 0 && r[t] != r[t - 1]) start = t;
        if (t > 0 && r[t] != r[t - 1] && t != tail) pos_start = t;
        want_starts[b * len + t] = start;
        want_positions[b * len + t] = t - pos_start;
      }
    }
    std::vector<std::int64_t> starts(rows * len, -1), positions(rows * len, -1), tails(rows, -1);
    host().run_starts(ids.data(), starts.data(), rows, len, nullptr);
    host().derived_positions(ids.data(), tails.data(), positions.data(), rows, len, nullptr);
    ASSERT_EQ(starts, want_starts) << "rows " << rows << " len " << len;
    ASSERT_EQ(tails, want_tails) << "rows " << rows << " len " << len;
    ASSERT_EQ(positions, want_positions) << "rows " << rows << " len " << len;
  }
}

// The index split the kernels use is i / len and i % len on both sides of 2^32.
TEST(HostKernels, IndexSplitIsDivisionOnBothSidesOfThe32BitPath) {
  std::mt19937_64 rng(18);
  for (int trial = 0; trial < 20000; ++trial) {
    const int bits = 1 + static_cast<int>(rng() % 62);
    const index_t len = 1 + static_cast<index_t>(rng() % (std::uint64_t{1} << (1 + rng() % 40)));
    const index_t i = static_cast<index_t>(rng() >> (64 - bits));
    const RowOffset r = split_index(i, len);
    ASSERT_EQ(r.row, i / len) << i << " / " << len;
    ASSERT_EQ(r.offset, i % len) << i << " % " << len;
  }
}

TEST(HostKernels, RopeByTokenIsTheFunctorBitwise) {
  std::mt19937_64 rng(16);
  for (int trial = 0; trial < 60; ++trial) {
    const DType dt = rng() % 2 ? DType::f32 : DType::f64;
    const std::int64_t B = 1 + rng() % 3, L = 1 + rng() % 40, H = 1 + rng() % 4, D = 2 * (1 + rng() % 6);
    Tensor pos({B, L}, DType::i64);
    for (std::int64_t i = 0; i < B * L; ++i) pos.data<std::int64_t>()[i] = static_cast<std::int64_t>(rng() % 5000);
    const Tensor x = verify::random_tensor({B, L, H, D}, dt, rng());
    for (int sign : {1, -1}) {
      Tensor by_token = Tensor::empty(x.shape(), dt), functor = Tensor::empty(x.shape(), dt);
      Rope a;
      a.x = x.raw(), a.pos = pos.data<std::int64_t>(), a.y = by_token.raw();
      a.rows = B, a.len = L, a.heads = H, a.dim = D, a.sign = sign;
      host().rope(a, dt, nullptr);
      a.y = functor.raw();
      rope(thrust::host, a, dt);
      ASSERT_TRUE(by_token.bitwise_equal(functor)) << dtype_name(dt) << " D " << D << " sign " << sign;
    }
  }
}

// The host's tiled attention (core/kernels/attention_host.hpp) against the
// functors a GPU runs, bitwise: random rows of documents, padding (id 0) inside
// and between them, a random query shard (q_start), queries left out (a probe),
// kept lists from the top-k selection (itself compared), values with NaN and inf.
TEST(HostKernels, TiledAttentionAndTopKAreTheFunctorsBitwise) {
  std::mt19937_64 rng(17);
  int tiles_of_many = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const DType dt = rng() % 2 ? DType::f32 : DType::f64;
    const std::int64_t B = 1 + rng() % 2, Lk = 1 + rng() % 70, H = 1 + rng() % 3, D = 1 + rng() % 5,
                       Dv = 1 + rng() % 5, Di = 1 + rng() % 3;
    const std::int64_t q_start = static_cast<std::int64_t>(rng() % Lk), Lq = 1 + rng() % (Lk - q_start);
    Tensor k_ids({B, Lk}, DType::i64), q_ids({B, Lq}, DType::i64), next({B, Lq}, DType::i64),
        first({B, Lk}, DType::i64);
    auto* kid = k_ids.data<std::int64_t>();
    for (std::int64_t b = 0; b < B; ++b) {
      std::int64_t doc = 1;
      for (std::int64_t j = 0; j < Lk; ++j) {
        if (rng() % 12 == 0) ++doc;
        kid[b * Lk + j] = rng() % 7 == 0 ? 0 : doc;
      }
      for (std::int64_t j = 0; j < Lk; ++j)  // the run start of j's own document
        first.data<std::int64_t>()[b * Lk + j] = kid[b * Lk + j] ? first_key(kid + b * Lk, j, kid[b * Lk + j]) : j;
      const bool probe = rng() % 3 == 0;
      for (std::int64_t t = 0; t < Lq; ++t)
        q_ids.data<std::int64_t>()[b * Lq + t] = probe && rng() % 3 ? 0 : kid[b * Lk + q_start + t];
      std::int64_t after = Lq;
      for (std::int64_t t = Lq - 1; t >= 0; --t) {
        if (q_ids.data<std::int64_t>()[b * Lq + t] != 0) after = t;
        next.data<std::int64_t>()[b * Lq + t] = after;
      }
    }
    auto values = [&](Shape shape, std::uint64_t seed) {
      Tensor t = verify::random_tensor(shape, dt, seed);
      if (rng() % 10 == 0) t.set(static_cast<std::int64_t>(rng() % t.numel()), rng() % 2 ? NAN : INFINITY);
      return t;
    };
    const Tensor q = values({B, Lq, H, D}, rng()), k = values({B, Lk, H, D}, rng()), v = values({B, Lk, H, Dv}, rng()),
                 d_o = values({B, Lq, H, Dv}, rng());
    const bool sparse = rng() % 2;
    // Past 32 the functor scores kept keys again instead of holding their scores.
    const std::int64_t topk = rng() % 5 == 0 ? 33 + rng() % 8 : 1 + rng() % 6;
    Tensor kept_host({B, Lq, topk}, DType::i64), kept_functor({B, Lq, topk}, DType::i64);
    if (sparse) {
      Tensor iq = verify::random_tensor({B, Lq, Di}, dt, rng()), ik = verify::random_tensor({B, Lk, Di}, dt, rng());
      for (Tensor* t : {&iq, &ik})  // ties: small integers
        for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, std::round(t->get(i) * 2));
      TopK s;
      s.q = iq.raw(), s.k = ik.raw(), s.q_ids = q_ids.data<std::int64_t>(), s.k_ids = kid;
      s.k_first = rng() % 2 ? first.data<std::int64_t>() : nullptr;
      s.rows = B, s.q_len = Lq, s.k_len = Lk, s.dim = Di, s.q_start = q_start, s.topk = topk;
      s.kept = kept_host.data<std::int64_t>();
      host().topk_select(s, dt, nullptr);
      s.kept = kept_functor.data<std::int64_t>();
      topk_select(thrust::host, s, dt);
      ASSERT_TRUE(kept_host.bitwise_equal(kept_functor)) << "trial " << trial;
    }
    Attention a;
    a.q = q.raw(), a.k = k.raw(), a.v = v.raw(), a.d_o = d_o.raw();
    a.q_ids = q_ids.data<std::int64_t>(), a.k_ids = kid, a.next_query = next.data<std::int64_t>();
    a.k_first = rng() % 2 ? first.data<std::int64_t>() : nullptr;
    a.kept = sparse ? kept_host.data<std::int64_t>() : nullptr;
    a.topk = sparse ? topk : 0;
    a.rows = B, a.q_len = Lq, a.k_len = Lk, a.heads = H, a.dim = D, a.v_dim = Dv, a.q_start = q_start;
    a.scale = 1.0 / std::sqrt(static_cast<double>(D));
    struct Out {
      Tensor o, lse, delta, dq, dk, dv;
    };
    auto run = [&](bool tiled) {
      Out r{Tensor({B, Lq, H, Dv}, dt), Tensor({B, Lq, H}, dt), Tensor({B, Lq, H}, dt),
            Tensor({B, Lq, H, D}, dt), Tensor({B, Lk, H, D}, dt), Tensor({B, Lk, H, Dv}, dt)};
      for (Tensor* t : {&r.o, &r.lse, &r.dq})  // written in full: must not rely on zeros
        for (std::int64_t i = 0; i < t->numel(); ++i) t->set(i, 7.0);
      Attention x = a;
      x.o = r.o.raw(), x.lse = r.lse.raw(), x.delta = r.delta.raw();
      x.dq = r.dq.raw(), x.dk = r.dk.raw(), x.dv = r.dv.raw();
      if (tiled) {
        host().attention_forward(x, dt, nullptr);
        host().attention_backward(x, dt, nullptr);
      } else {
        attention_forward(thrust::host, x, dt);
        attention_backward(thrust::host, x, dt);
      }
      return r;
    };
    const Out tiled = run(true), functor = run(false);
    const std::string where = "trial " + std::to_string(trial) + (sparse ? " sparse" : " dense") + " " + dtype_name(dt);
    EXPECT_TRUE(tiled.o.bitwise_equal(functor.o)) << where;
    EXPECT_TRUE(tiled.lse.bitwise_equal(functor.lse)) << where;
    EXPECT_TRUE(tiled.dq.bitwise_equal(functor.dq)) << where;
    EXPECT_TRUE(tiled.dk.bitwise_equal(functor.dk)) << where;
    EXPECT_TRUE(tiled.dv.bitwise_equal(functor.dv)) << where;
    if (!sparse && Lq > kAttentionTile) ++tiles_of_many;
  }
  EXPECT_GT(tiles_of_many, 30);  // many trials had full tiles and more than one
}
