// The nccl backend (gpu/nccl.cpp) run through cpsim's NCCL test double
// (tests/doubles/nccl_double.cpp), loaded as NCCL, on the host device it brings: the calls,
// the dtype and op mapping, group calls, the call check before NCCL, the watchdog
// and abort, the rebuild after an abort, and job mode, on every CI run without a GPU.
// Its own binary: the double replaces CUDA's device in the process that loads it.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>

#include "tests/backend_sweeps.hpp"
#include "tests/subprocess.hpp"

#include "core/comm/run_ranks.hpp"
#include "gpu/nccl_loader.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/random.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using namespace std::chrono_literals;

namespace {

// Before anything looks for NCCL (static initialisation, ahead of every test).
const bool kDoubleLoaded = (setenv("CPSIM_NCCL_LIBRARY", CPSIM_NCCL_DOUBLE, 1), true);
const std::string kCpsim = CPSIM_BINARY;
const std::string& kExample = cpsim::testing::kSpecExample;

void inject(const char* spec) {
  auto* f = reinterpret_cast<void (*)(const char*)>(gpu::nccl_library_symbol("cpsimNcclDoubleInject"));
  ASSERT_NE(f, nullptr) << "the loaded NCCL is not the test double: " << gpu::nccl_library_path();
  f(spec);
}
long long double_calls() {
  auto* f = reinterpret_cast<long long (*)()>(gpu::nccl_library_symbol("cpsimNcclDoubleCalls"));
  return f ? f() : -1;
}

RunOptions on_nccl(std::chrono::milliseconds timeout = 20s) {
  RunOptions o;
  o.backend = "nccl";
  o.timeout = timeout;
  return o;
}

}  // namespace

TEST(NcclDouble, TheNcclBackendRunsOnTheHostDeviceTheLoadedLibraryBrings) {
  ASSERT_TRUE(kDoubleLoaded);
  const Backend& b = find_backend("nccl");
  EXPECT_FALSE(b.unavailable().has_value()) << *b.unavailable();
  EXPECT_NE(gpu::nccl_library_path().find("cpsim_nccl_double"), std::string::npos) << gpu::nccl_library_path();
  EXPECT_EQ(b.max_ranks().first, 8);
  RunOptions o = on_nccl();
  run_ranks(3, [](Communicator& comm) { EXPECT_EQ(comm.device(), Device::cuda(comm.rank())); }, o);
}

// Every collective, every dtype cpsim maps, payloads of one and of many chunks
// (the double moves 64 KiB a round): what threads gives. The double sums in rank
// order, so every result matches bitwise but bf16 sums, which NCCL rounds at
// every step.
TEST(NcclDouble, CollectivesAreThoseOfThreadsForEveryDtypeAndSize) {
  for (int n : {2, 3, 8}) {
    for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::b8}) {
      for (std::int64_t count : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{40000}}) {
        if (n == 8 && count == 40000 && dt != DType::f32) continue;  // one big case at 8 ranks is enough
        const auto threads = cpsim::testing::every_collective("threads", n, dt, count);
        const auto nccl = cpsim::testing::every_collective("nccl", n, dt, count);
        for (std::size_t i = 0; i < threads.size(); ++i) {
          const std::string what = cpsim::testing::kSweptCollectives[i / n];
          const std::string where = "n=" + std::to_string(n) + " " + dtype_name(dt) + " count=" + std::to_string(count) +
                                    " " + what + " rank " + std::to_string(i % n);
          if (dt == DType::bf16 && (what == "reduce_scatter" || what == "all_reduce")) {
            // NCCL (and the double) rounds bf16 at every step of a sum; cpsim's
            // host kernels add in float and round once: n roundings apart at most.
            const Tensor a = threads[i].to(DType::f64), b = nccl[i].to(DType::f64);
            for (std::int64_t k = 0; k < a.numel(); ++k) {
              const double x = a.data<double>()[k], y = b.data<double>()[k];
              ASSERT_LE(std::abs(x - y), n * std::ldexp(1.0, -8) * std::max(1.0, std::abs(x))) << where << " element " << k;
            }
          } else {
            EXPECT_TRUE(threads[i].bitwise_equal(nccl[i])) << where;
          }
        }
      }
    }
  }
}

// A send to one neighbour only (the last rank sends nothing, the first receives
// nothing): point to point, so ranks outside a pair are not involved.
TEST(NcclDouble, SendRecvInvolvesOnlyThePairs) {
  const int n = 4;
  const std::int64_t count = 70000;  // several chunks
  std::vector<Tensor> got(n);
  RunOptions o = on_nccl();
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const Tensor in = random_tensor({count}, DType::i64, 7 + r).to(comm.device());
    Tensor out({count}, DType::i64, comm.device());
    SendRecv step{in.raw(), static_cast<std::size_t>(r + 1 < n ? count : 0), r + 1 < n ? r + 1 : -1, out.raw(),
                  static_cast<std::size_t>(r > 0 ? count : 0), r > 0 ? r - 1 : -1};
    comm.send_recv(step, DType::i64);
    got[r] = out.to(Device::host());
  }, o);
  EXPECT_TRUE(got[0].bitwise_equal(Tensor({count}, DType::i64)));
  for (int r = 1; r < n; ++r) EXPECT_TRUE(got[r].bitwise_equal(random_tensor({count}, DType::i64, 7 + r - 1))) << r;
}

// The property table through gpu/nccl.cpp at every group size 1..8.
TEST(NcclDouble, EveryPropertyHoldsAtEveryGroupSizeToEight) { cpsim::testing::property_table_holds("nccl", 8, 24, 777); }

TEST(NcclDouble, MismatchedCallsAreCollectiveErrorsAndNeverReachNccl) {
  RunOptions o = on_nccl(5s);
  run_ranks(2, [](Communicator&) {}, o);  // the communicators exist before counting
  const long long before = double_calls();
  ASSERT_GE(before, 0);
  cpsim::testing::expect_mismatch_named("nccl");
  EXPECT_EQ(double_calls(), before) << "a mismatched call reached NCCL";
}

// A peer that stops inside a collective (every rank agreed to run it): the
// watchdog aborts the communicator within the timeout, the call fails on every
// rank, and the next run makes a new communicator and is right again.
TEST(NcclDouble, APeerStalledInsideACallIsAbortedByTheWatchdogAndTheNextRunRebuilds) {
  RunOptions o = on_nccl(1500ms);
  for (int n : {2, 4}) {
    run_ranks(n, [](Communicator&) {}, o);
    inject(("stall@" + std::to_string(n - 1) + ":2").c_str());  // its second call
    const auto t0 = std::chrono::steady_clock::now();
    try {
      run_ranks(n, [&](Communicator& comm) {
        Tensor t({1000}, DType::f32, comm.device()), out({1000 * n}, DType::f32, comm.device());
        for (int k = 0; k < 3; ++k) comm.all_gather(t.raw(), out.raw(), 1000, DType::f32);
      }, o);
      FAIL() << "no error";
    } catch (const Aborted& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("aborted"), std::string::npos) << what;
      EXPECT_TRUE(what.find("timeout") != std::string::npos || what.find("NCCL error") != std::string::npos) << what;
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_LT(took, 10s) << "the watchdog did not end the stalled call";
    inject("");
    std::vector<Tensor> got(n);
    run_ranks(n, [&](Communicator& comm) {
      Tensor t = Tensor::full({5}, DType::i64, comm.rank() + 1.0).to(comm.device()), out({5 * n}, DType::i64, comm.device());
      comm.all_gather(t.raw(), out.raw(), 5, DType::i64);
      got[comm.rank()] = out.to(Device::host());
    }, o);
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < 5 * n; ++k) EXPECT_EQ(got[r].data<std::int64_t>()[k], k / 5 + 1) << "after the rebuild";
  }
}

// An asynchronous NCCL error on one rank: that rank's call fails with it, the
// peers' with NCCL's remote error, long before the timeout.
TEST(NcclDouble, AnAsynchronousErrorFailsTheCallOnEveryRankWithoutWaitingForTheTimeout) {
  RunOptions o = on_nccl(30s);
  run_ranks(3, [](Communicator&) {}, o);
  inject("fail@1:1");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> errors(3);
  try {
    run_ranks(3, [&](Communicator& comm) {
      Tensor t({64}, DType::f32, comm.device());
      try {
        comm.all_reduce(t.raw(), 64, DType::f32);
      } catch (const Aborted& e) {
        errors[comm.rank()] = e.what();
        throw;
      }
    }, o);
    FAIL() << "no error";
  } catch (const Aborted&) {
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_NE(errors[1].find("NCCL error in all_reduce"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("a call failed"), std::string::npos) << errors[1];
  for (int r : {0, 2}) {
    if (!errors[r].empty()) {
      EXPECT_NE(errors[r].find("a peer failed"), std::string::npos) << errors[r];
    }
  }
  inject("");
}

// Job mode: one process a rank (cpsim launch), the unique id over the job's side
// channel, ncclCommInitRank; then a rank killed inside a call.
TEST(NcclDouble, AJobOfFourProcessesChecksABatch) {
  const auto r = cpsim::testing::run_process(
      {kCpsim, "launch", "-n", "4", "--", "cpsim", "check", kExample, "--backend", "nccl"}, 180s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("all properties hold"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cp=4"), std::string::npos) << r.out;
}

TEST(NcclDouble, ARankKilledInsideACallFailsTheOthersWithinTheTimeout) {
  const auto r = cpsim::testing::run_process(
      {"/usr/bin/env", "CPSIM_NCCL_DOUBLE_FAULT=exit@2:5", kCpsim, "launch", "-n", "3", "--", "cpsim", "check", kExample,
       "--backend", "nccl", "--timeout", "3"},
      120s);
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("rank 2 (pid"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exited with status 9"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("cpsim: rank 0: aborted:"), std::string::npos) << r.err;
  // A survivor's NCCL watchdog ended the call the dead rank never joined.
  EXPECT_NE(r.err.find("on nccl; every rank had agreed to run it"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("did not exit in time"), std::string::npos) << r.err;
}
