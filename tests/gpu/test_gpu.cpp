// The GPU backends and the CUDA build of the one kernel source. Every test that
// needs a device skips, with the reason, where there is none; the first test runs
// everywhere and pins down what a machine without a GPU gets.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "tests/backend_sweeps.hpp"
#include "tests/subprocess.hpp"

#include "core/attention.hpp"
#include "core/comm/run_ranks.hpp"
#include "core/loss.hpp"
#include "core/kernels/table.hpp"
#include "gpu/cuda.hpp"
#include "gpu/nccl_loader.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {

#define CPSIM_NEEDS_GPU()                                                   \
  do {                                                                      \
    if (auto why = gpu::cuda_unavailable()) GTEST_SKIP() << *why;           \
    gpu::activate_cuda();                                                   \
  } while (0)

const Device kGpu = Device::cuda(0);

// Runs one kernel entry on the host and on the GPU over the same inputs and
// returns both outputs (on the host). `inputs` are copied to each side; `run`
// gets the table, the inputs and the (zeroed) output on that side.
template <class Run>
std::pair<Tensor, Tensor> both_sides(const std::vector<Tensor>& inputs, const Tensor& out_like, Run run) {
  std::vector<Tensor> result;
  for (Device d : {Device::host(), kGpu}) {
    std::vector<Tensor> in;
    for (const auto& t : inputs) in.push_back(t.to(d));
    Tensor out = out_like.to(d);
    run(kernels::kernels_for(d), in, out);
    result.push_back(out.to(Device::host()));
  }
  return {result[0], result[1]};
}

void* stream() { return kernels::current_stream(); }

// The binary and the examples: where the build put them, or (in the GPU bundle)
// where CPSIM_BINARY and CPSIM_EXAMPLES say.
std::string from_env(const char* key, const std::string& fallback) {
  const char* v = std::getenv(key);
  return v && *v ? v : fallback;
}
const std::string kCpsim = from_env("CPSIM_BINARY", CPSIM_BINARY);
const std::string kExamples = from_env("CPSIM_EXAMPLES", std::string(CPSIM_SOURCE_DIR) + "/examples");

}  // namespace

TEST(GpuBackends, SayWhyTheyCannotRunOrRunWhereTheyCan) {
  for (const std::string name : {"cuda-sim", "nccl"}) {
    const Backend& b = find_backend(name);
    EXPECT_TRUE(b.capabilities.device_buffers) << name;
    if (auto why = gpu::cuda_unavailable()) {
      ASSERT_TRUE(b.unavailable().has_value()) << name;
      EXPECT_NE(b.unavailable()->find("no CUDA device"), std::string::npos) << *b.unavailable();
      RunOptions o;
      o.backend = name;
      EXPECT_THROW(run_ranks(2, [](Communicator&) {}, o), Unavailable) << name;
    } else {
      EXPECT_FALSE(b.unavailable().has_value()) << name;
    }
  }
  EXPECT_FALSE(find_backend("nccl").capabilities.rank_order_sums) << "NCCL's sums are not in rank order";
  EXPECT_TRUE(find_backend("cuda-sim").capabilities.rank_order_sums);
}

// The command line: without a device, one line and exit 2; with one, the examples hold.
TEST(GpuBackends, TheCommandLineRunsThemOrSaysWhyInOneLine) {
  using namespace std::chrono_literals;
  const std::string example = (std::filesystem::path(kExamples) / "agreeing_forms.json").string();
  for (const std::string name : {"cuda-sim", "nccl"}) {
    const auto r = cpsim::testing::run_process({kCpsim, "check", example, "--backend", name, "--cp", "1"}, 120s);
    if (auto why = gpu::cuda_unavailable()) {
      EXPECT_EQ(r.status, 2) << name << "\n" << r.out << r.err;
      EXPECT_NE(r.err.find("no CUDA device"), std::string::npos) << r.err;
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    } else {
      EXPECT_EQ(r.status, 0) << name << "\n" << r.out << r.err;
    }
  }
  if (!gpu::cuda_unavailable()) {  // more nccl ranks than GPUs: exit 2, pointing to cuda-sim
    const auto r = cpsim::testing::run_process(
        {kCpsim, "check", example, "--backend", "nccl", "--cp", std::to_string(gpu::cuda_device_count() + 1)}, 60s);
    EXPECT_EQ(r.status, 2) << r.out << r.err;
    EXPECT_NE(r.err.find("cuda-sim"), std::string::npos) << r.err;
  }
}

TEST(CudaKernels, MovementAndSumsAreBitwiseTheHostKernels) {
  CPSIM_NEEDS_GPU();
  const std::int64_t B = 3, c = 4, L = 37, C = 5;
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::b8}) {
    const Tensor blocks = random_tensor({c * B, L, C}, dt, 1 + static_cast<int>(dt));
    const std::size_t row = static_cast<std::size_t>(L * C) * dtype_size(dt);
    auto [h, g] = both_sides({blocks}, Tensor({B, c * L, C}, dt), [&](const auto& k, auto& in, Tensor& out) {
      k.blocks_to_sequence({in[0].raw(), out.raw(), B, c, row}, stream());
    });
    EXPECT_TRUE(h.bitwise_equal(g)) << "blocks_to_sequence " << dtype_name(dt);
    auto [h2, g2] = both_sides({h}, Tensor({c * B, L, C}, dt), [&](const auto& k, auto& in, Tensor& out) {
      k.sequence_to_blocks({in[0].raw(), out.raw(), B, c, row}, stream());
    });
    EXPECT_TRUE(h2.bitwise_equal(g2) && h2.bitwise_equal(blocks)) << "sequence_to_blocks " << dtype_name(dt);

    const Tensor a = random_tensor({B, L, C}, dt, 50), b = random_tensor({B, L, C}, dt, 51);
    // Each positions kernel compared on its own (a copy after an add would hide the add).
    const auto positions = [&](const auto& k, auto& in, Tensor& out) {
      kernels::PositionCopy p;
      p.src = in[1].raw(), p.dst = out.raw(), p.rows = B, p.src_len = p.dst_len = L, p.from = 3, p.to = 5, p.n = 20;
      p.position_bytes = static_cast<std::size_t>(C) * dtype_size(dt);
      return p;
    };
    auto [h3, g3] = both_sides({a, b}, a, [&](const auto& k, auto& in, Tensor& out) {
      k.add_positions(positions(k, in, out), dt, stream());
    });
    EXPECT_TRUE(h3.bitwise_equal(g3)) << "add_positions " << dtype_name(dt);
    auto [h3c, g3c] = both_sides({a, b}, a, [&](const auto& k, auto& in, Tensor& out) {
      k.copy_positions(positions(k, in, out), stream());
    });
    EXPECT_TRUE(h3c.bitwise_equal(g3c)) << "copy_positions " << dtype_name(dt);

    // slice: inside the source, before it and past its end (the fill).
    const Tensor rows = random_tensor({B, L}, dt, 52);
    for (const std::int64_t start : {std::int64_t{0}, std::int64_t{-3}, L - 10}) {
      const std::int64_t len = 25;
      auto [h5, g5] = both_sides({rows}, Tensor({B, len}, dt), [&](const auto& k, auto& in, Tensor& out) {
        kernels::Slice sl;
        sl.src = in[0].raw(), sl.dst = out.raw(), sl.rows = B, sl.src_len = L, sl.start = start, sl.len = len;
        sl.element_bytes = dtype_size(dt), sl.fill = 1;
        k.slice(sl, stream());
      });
      EXPECT_TRUE(h5.bitwise_equal(g5)) << "slice from " << start << " " << dtype_name(dt);
    }

    auto [h4, g4] = both_sides({a, b, blocks}, a, [&](const auto& k, auto& in, Tensor& out) {
      // The pointer list lives on the side that sums.
      const void* ptrs[3] = {in[0].raw(), in[1].raw(), in[2].raw()};
      Tensor list = Tensor({3}, DType::i64);
      std::memcpy(list.raw(), ptrs, sizeof ptrs);
      const Tensor here = list.to(out.device());
      k.sum_in_order({static_cast<const void* const*>(here.raw()), out.raw(), 3, static_cast<std::size_t>(a.numel())}, dt,
                     stream());
    });
    EXPECT_TRUE(h4.bitwise_equal(g4)) << "sum_in_order " << dtype_name(dt);
  }
}

TEST(CudaKernels, LayoutKernelsAreBitwiseTheHostKernels) {
  CPSIM_NEEDS_GPU();
  // Small rows, and rows long enough that the scans cross hundreds of tiles.
  for (const auto& [B, S] : {std::pair<std::int64_t, std::int64_t>{4, 1000}, {3, 250007}}) {
    SCOPED_TRACE("rows " + std::to_string(B) + " of " + std::to_string(S));
    Tensor ids({B, S}, DType::i64);
    for (std::int64_t i = 0; i < B * S; ++i) ids.data<std::int64_t>()[i] = (i % S) / 37 % 3 == 2 ? 0 : 1 + (i % S) / 37;
    auto [h, g] = both_sides({ids}, Tensor({B, S}, DType::i64), [&](const auto& k, auto& in, Tensor& out) {
      k.run_starts(static_cast<const std::int64_t*>(in[0].raw()), static_cast<std::int64_t*>(out.raw()), B, S, stream());
    });
    EXPECT_TRUE(h.bitwise_equal(g)) << "run_starts";
    auto [h2, g2] = both_sides({ids, Tensor({B}, DType::i64)}, Tensor({B, S}, DType::i64),
                               [&](const auto& k, auto& in, Tensor& out) {
                                 k.derived_positions(static_cast<const std::int64_t*>(in[0].raw()),
                                                     static_cast<std::int64_t*>(in[1].raw()),
                                                     static_cast<std::int64_t*>(out.raw()), B, S, stream());
                               });
    EXPECT_TRUE(h2.bitwise_equal(g2)) << "derived_positions";
    std::int64_t counts[2];
    auto [h3, g3] = both_sides({ids}, Tensor({S}, DType::i64), [&](const auto& k, auto& in, Tensor& out) {
      counts[out.is_cpu() ? 0 : 1] = k.segment_starts(static_cast<const std::int64_t*>(in[0].raw()), S,
                                                      static_cast<std::int64_t*>(out.raw()), stream());
    });
    EXPECT_EQ(counts[0], counts[1]);
    EXPECT_TRUE(h3.bitwise_equal(g3)) << "segment_starts";
  }

  // doc_ids_from_starts: ids and padding, each compared on its own; rows shorter
  // than a thread's group of positions, and rows of many groups.
  for (const std::int64_t scale : {1, 200}) {
    const std::int64_t R = 3, D = 4, len = 50 * scale;
    SCOPED_TRACE("doc ids, rows of " + std::to_string(len));
    Tensor starts({R, D + 1}, DType::i64), real({R, D}, DType::i64);
    for (std::int64_t b = 0; b < R; ++b) {
      const std::int64_t occupied[4] = {7 + b, 5, 9, 3}, used[4] = {5 + b, 5, 2, 0};
      std::int64_t at = 0;
      for (std::int64_t d = 0; d < D; ++d) {
        starts.set(b * (D + 1) + d, at);
        real.set(b * D + d, used[d] * scale);
        at += occupied[d] * scale;
      }
      starts.set(b * (D + 1) + D, at);
    }
    const auto doc_ids = [&](bool want_padding, const Tensor& like) {
      return both_sides({starts, real, Tensor({R, len}, DType::i64), Tensor({R, len}, DType::b8)}, like,
                        [&](const auto& k, auto& in, Tensor& out) {
                          kernels::DocIds a;
                          a.starts = static_cast<const std::int64_t*>(in[0].raw());
                          a.real = static_cast<const std::int64_t*>(in[1].raw());
                          a.ids = want_padding ? static_cast<std::int64_t*>(in[2].raw())
                                               : static_cast<std::int64_t*>(out.raw());
                          a.padding = want_padding ? static_cast<bool*>(out.raw()) : static_cast<bool*>(in[3].raw());
                          a.rows = R, a.seq_len = len, a.docs = D;
                          k.doc_ids_from_starts(a, stream());
                        });
    };
    auto [h4, g4] = doc_ids(false, Tensor({R, len}, DType::i64));
    EXPECT_TRUE(h4.bitwise_equal(g4)) << "doc_ids_from_starts ids";
    auto [h5, g5] = doc_ids(true, Tensor({R, len}, DType::b8));
    EXPECT_TRUE(h5.bitwise_equal(g5)) << "doc_ids_from_starts padding";
  }
}

TEST(CudaKernels, ConvMatchesTheHostKernels) {
  CPSIM_NEEDS_GPU();
  const std::int64_t B = 2, N = 300, C = 8, W = 4, NW = N + W - 1;
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor x = random_tensor({B, NW, C}, dt, 7), w = random_tensor({C, W}, dt, 8), bias = random_tensor({C}, dt, 9),
                 gy = random_tensor({B, N, C}, dt, 10);
    Tensor starts({B, NW}, DType::i64);
    for (std::int64_t i = 0; i < B * NW; ++i) starts.data<std::int64_t>()[i] = (i % NW) / 50 * 50;
    auto [h, g] = both_sides({x, starts, w, bias}, Tensor({B, N, C}, dt), [&](const auto& k, auto& in, Tensor& out) {
      kernels::Conv a;
      a.x = in[0].raw(), a.run_start = static_cast<const std::int64_t*>(in[1].raw()), a.w = in[2].raw(),
      a.bias = in[3].raw(), a.y = out.raw(), a.rows = B, a.outputs = N, a.channels = C, a.width = W;
      k.conv_forward(a, dt, stream());
    });
    EXPECT_LT(relative_rmse(h, g), dt == DType::f32 ? 1e-6 : 1e-13) << "conv_forward " << dtype_name(dt);
    // The backward's three outputs, each compared on its own: the one under test is
    // `out`, the other two land in scratch inputs.
    enum class Grad { x, w, bias };
    const auto backward = [&](Grad which, const Tensor& like) {
      return both_sides({x, starts, w, gy, Tensor({B, NW, C}, dt), Tensor({C, W}, dt), Tensor({C}, dt)}, like,
                        [&](const auto& k, auto& in, Tensor& out) {
                          kernels::Conv a;
                          a.x = in[0].raw(), a.run_start = static_cast<const std::int64_t*>(in[1].raw()),
                          a.w = in[2].raw(), a.gy = in[3].raw(), a.gx = in[4].raw(), a.gw = in[5].raw(),
                          a.gbias = in[6].raw(), a.rows = B, a.outputs = N, a.channels = C, a.width = W;
                          (which == Grad::x ? a.gx : which == Grad::w ? a.gw : a.gbias) = out.raw();
                          k.conv_backward(a, dt, stream());
                        });
    };
    const double tol = dt == DType::f32 ? 1e-6 : 1e-13;
    auto [hx, gx] = backward(Grad::x, Tensor({B, NW, C}, dt));
    EXPECT_LT(relative_rmse(hx, gx), tol) << "conv_backward gx " << dtype_name(dt);
    auto [hw, gw] = backward(Grad::w, Tensor({C, W}, dt));
    EXPECT_LT(relative_rmse(hw, gw), tol) << "conv_backward gw " << dtype_name(dt);
    auto [hb, gb] = backward(Grad::bias, Tensor({C}, dt));
    EXPECT_LT(relative_rmse(hb, gb), tol) << "conv_backward gbias " << dtype_name(dt);
    // And each is not trivially zero (a kernel that wrote nothing would agree with itself).
    EXPECT_GT(relative_rmse(hw, Tensor({C, W}, dt)), 0.5) << "gw on the host is all zeros";
    EXPECT_GT(relative_rmse(hb, Tensor({C}, dt)), 0.5) << "gbias on the host is all zeros";
  }
}

// The layers (RoPE, attention with and without a top-k indexer, the loss) through
// their operators on the host and on the GPU: the same kernels, the same results.
TEST(CudaKernels, LayersMatchTheHostKernels) {
  CPSIM_NEEDS_GPU();
  const std::int64_t B = 2, L = 96, H = 2, D = 4, V = 16;
  const Tensor q = random_tensor({B, L, H, D}, DType::f64, 21), k = random_tensor({B, L, H, D}, DType::f64, 22),
               v = random_tensor({B, L, H, D}, DType::f64, 23), up = random_tensor({B, L, H, D}, DType::f64, 24),
               logits = random_tensor({B, L, V}, DType::f64, 25);
  Tensor ids({B, L}, DType::i64), pos({B, L}, DType::i64), iq({B, L, 4}, DType::f64), ik({B, L, 4}, DType::f64),
      targets({B, L}, DType::i64);
  for (std::int64_t i = 0; i < B * L; ++i) {
    const std::int64_t t = i % L;
    ids.set(i, t >= L - 5 ? 0 : 1 + t / 20);  // documents of 20, then padding
    pos.set(i, t % 20);
    targets.set(i, t % 7 == 3 ? -100 : t % V);
  }
  for (std::int64_t i = 0; i < iq.numel(); ++i) iq.set(i, static_cast<double>(i * 7 % 11 % 7) - 3), ik.set(i, static_cast<double>(i * 5 % 13 % 7) - 3);
  std::vector<std::vector<Tensor>> got;
  for (Device d : {Device::host(), kGpu}) {
    for (bool sparse : {false, true}) {
      Var vq(q.to(d), true), vk(k.to(d), true), vv(v.to(d), true), vl(logits.to(d), true);
      const Tensor kept = sparse ? topk_keep(iq.to(d), ik.to(d), ids, ids, 0, 3) : Tensor();
      const Var o = document_attention(rope(vq, pos), rope(vk, pos), vv, ids, ids, 0, 0, kept);
      backward(dot(o, up));
      const Var loss = token_mean_loss(vl, targets, nullptr);
      backward(loss);
      std::vector<Tensor> out{o.value(), vq.grad(), vk.grad(), vv.grad(), loss.value(), vl.grad()};
      if (sparse) out.push_back(kept);
      for (auto& t : out) t = t.to(Device::host());
      got.push_back(out);
    }
  }
  const char* names[] = {"o", "dq", "dk", "dv", "loss", "d logits", "kept"};
  for (std::size_t form = 0; form < 2; ++form)
    for (std::size_t i = 0; i < got[form].size(); ++i) {
      if (i == 6) {
        EXPECT_TRUE(got[form][i].bitwise_equal(got[2 + form][i])) << names[i];
      } else {
        EXPECT_LT(relative_rmse(got[form][i], got[2 + form][i]), 1e-12) << names[i] << (form ? " (sparse)" : "");
      }
    }
}


TEST(CudaSim, EveryPropertyHoldsOnRandomLayouts) {
  CPSIM_NEEDS_GPU();
  cpsim::testing::property_table_holds("cuda-sim", 8, 40, 4242);
}

TEST(Nccl, EveryPropertyHoldsAtEveryGroupSizeTheGpusAllow) {
  CPSIM_NEEDS_GPU();
  cpsim::testing::property_table_holds("nccl", gpu::cuda_device_count(), 10, 4242);
}

// cuda-sim sums in rank order on the device: bitwise what threads gives.
TEST(CudaSim, CollectivesAreBitwiseThoseOfThreads) {
  CPSIM_NEEDS_GPU();
  for (int n : {2, 3, 8}) {
    for (DType dt : {DType::f32, DType::bf16, DType::i64, DType::b8}) {
      const auto threads = cpsim::testing::every_collective("threads", n, dt, 1000);
      const auto sim = cpsim::testing::every_collective("cuda-sim", n, dt, 1000);
      for (std::size_t i = 0; i < threads.size(); ++i)
        EXPECT_TRUE(threads[i].bitwise_equal(sim[i]))
            << "n=" << n << " " << dtype_name(dt) << " " << cpsim::testing::kSweptCollectives[i / n] << " rank " << i % n;
    }
  }
}

TEST(CudaSim, MismatchedCallsAreCollectiveErrorsNamingEachRanksCall) {
  CPSIM_NEEDS_GPU();
  RunOptions o;
  o.backend = "cuda-sim";
  o.timeout = std::chrono::milliseconds(5000);
  try {
    run_ranks(2, [](Communicator& comm) {
      Tensor t({4}, DType::f32, comm.device()), out({8}, DType::f32, comm.device());
      if (comm.rank() == 0) comm.all_gather(t.raw(), out.raw(), 4, DType::f32);
      else comm.reduce_scatter(out.raw(), t.raw(), 4, DType::f32);
    }, o);
    FAIL() << "no error";
  } catch (const CollectiveError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_gather"), std::string::npos) << what;
    EXPECT_NE(what.find("reduce_scatter"), std::string::npos) << what;
  }
}

TEST(Nccl, MoreRanksThanGpusIsRefusedPointingToCudaSim) {
  CPSIM_NEEDS_GPU();
  RunOptions o;
  o.backend = "nccl";
  try {
    run_ranks(gpu::cuda_device_count() + 1, [](Communicator&) {}, o);
    FAIL() << "no error";
  } catch (const Unavailable& e) {
    EXPECT_NE(std::string(e.what()).find("cuda-sim"), std::string::npos) << e.what();
  }
}

TEST(Nccl, MismatchedCallsNeverReachNccl) {
  CPSIM_NEEDS_GPU();
  if (gpu::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << gpu::cuda_device_count();
  cpsim::testing::expect_mismatch_named("nccl");
}

// NCCL is loaded on the nccl backend's first use: no binary needs libnccl.so.2 to
// start, and one that cannot find it says where it looked. (No device needed.)
TEST(NcclLoader, NoBinaryNeedsNcclToStartAndAMissingOneIsNamedWithWhereItLooked) {
  using namespace std::chrono_literals;
  // (this very binary too, wherever it runs from: the bundle moves it; a GPU machine
  // without binutils skips this part.)
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const std::string& binary : {kCpsim, self}) {
    if (!std::filesystem::exists("/usr/bin/readelf")) break;
    const auto needed = cpsim::testing::run_process({"/usr/bin/readelf", "-d", binary}, 60s);
    ASSERT_EQ(needed.status, 0) << needed.err;
    EXPECT_EQ(needed.out.find("libnccl"), std::string::npos) << binary << " needs NCCL at start:\n" << needed.out;
  }
  const auto version = cpsim::testing::run_process(
      {"/usr/bin/env", "LD_LIBRARY_PATH=", "CPSIM_NCCL_LIBRARY=/nowhere/libnccl.so.2", kCpsim, "--version"}, 60s);
  EXPECT_EQ(version.status, 0) << version.err;

  const gpu::NcclLibrary missing = gpu::load_nccl({"/nowhere/libnccl.so.2", "libnccl-not-a-library.so.9"});
  EXPECT_EQ(missing.handle, nullptr);
  for (const char* said : {"/nowhere/libnccl.so.2", "libnccl-not-a-library.so.9", "CPSIM_NCCL_LIBRARY", "LD_LIBRARY_PATH"})
    EXPECT_NE(missing.error.find(said), std::string::npos) << missing.error;
  // Where the toolkit keeps it (this build found its header there), it loads.
  for (const char* path : {"/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2"}) {
    if (!std::filesystem::exists(path)) continue;
    const gpu::NcclLibrary found = gpu::load_nccl({"/nowhere/libnccl.so.2", path});
    EXPECT_NE(found.handle, nullptr) << found.error;
    EXPECT_NE(found.path.find("libnccl.so.2"), std::string::npos) << found.path;
  }
}
