// Every registered backend (threads, gloo, and the test-only delayed), one parameterised suite: exact
// collectives on rank-distinct inputs, and every distributed bug turned into a
// CollectiveError on every rank, never a hang.
#include <gmock/gmock.h>

#include <sched.h>

#include <atomic>
#include <barrier>
#include <thread>

#include "core/gather.hpp"
#include "core/comm/call_check.hpp"
#include "core/comm/rendezvous.hpp"
#include "core/comm/run_ranks.hpp"
#include "tests/tensor_helpers.hpp"

using namespace cpsim;
using namespace std::chrono_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

namespace {
// What a run of `n` ranks threw: a CollectiveError (a distributed bug), or with
// E = Aborted a run that could not complete (a timeout).
template <class E = CollectiveError, class F>
std::string collective_error(const std::string& backend, int n, F f, std::chrono::milliseconds t) {
  return cpsim::testing::thrown<E>([&] { run_ranks(n, f, {backend, t}); },
                                   std::is_same_v<E, Aborted> ? "Aborted" : "CollectiveError");
}
}  // namespace

// The parameter is the backend name.
class BackendCalls : public ::testing::TestWithParam<std::string> {
 protected:
  RunOptions fast(std::chrono::milliseconds t = 5000ms) const { return {GetParam(), t}; }
  template <class E = CollectiveError, class F>
  std::string collective_error(int n, F f, std::chrono::milliseconds t = 5000ms) const {
    return ::collective_error<E>(GetParam(), n, f, t);
  }
  template <class F>
  std::string timeout_error(int n, F f, std::chrono::milliseconds t) const {
    return collective_error<Aborted>(n, f, t);
  }
};
INSTANTIATE_TEST_SUITE_P(Registered, BackendCalls, ::testing::ValuesIn(backend_names()),
                         [](const auto& info) { return info.param; });

class Collectives : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(Collectives, AreExactOnRankDistinctInputs) {
  const auto [backend, n, count] = GetParam();
  run_ranks(n, [&, n = n, count = count](Communicator& comm) {
    const int r = comm.rank();
    std::vector<double> send(count * n), recv(count * n);
    for (int i = 0; i < count * n; ++i) send[i] = r * 1000 + i;
    comm.all_gather(send.data(), recv.data(), count, DType::f64);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < count; ++i) ASSERT_EQ(recv[q * count + i], q * 1000 + i);
    std::vector<double> mine(count);
    comm.reduce_scatter(send.data(), mine.data(), count, DType::f64);
    for (int i = 0; i < count; ++i) ASSERT_EQ(mine[i], 1000.0 * n * (n - 1) / 2 + n * (r * count + i));
    std::vector<std::int64_t> sum(count, r + 1);
    comm.all_reduce(sum.data(), count, DType::i64);
    for (int i = 0; i < count; ++i) ASSERT_EQ(sum[i], n * (n + 1) / 2);
    std::vector<std::int32_t> b(count, r == n - 1 ? 42 : -1);
    comm.broadcast(b.data(), count, DType::i32, n - 1);
    for (int i = 0; i < count; ++i) ASSERT_EQ(b[i], 42);
    // Ring shift to the right; the last rank sends to nobody, rank 0 receives from nobody.
    std::vector<float> out(count, static_cast<float>(r)), in(count, -1.0f);
    const auto m = static_cast<std::size_t>(count);
    comm.send_recv({out.data(), m, r + 1 < n ? r + 1 : -1, in.data(), m, r > 0 ? r - 1 : -1}, DType::f32);
    for (int i = 0; i < count; ++i) ASSERT_EQ(in[i], r > 0 ? static_cast<float>(r - 1) : -1.0f);
    comm.barrier();
  }, {backend, 5000ms});
}

// Counts on both sides of the size thresholds (threads stages up to 64 KiB, gloo
// gathers directly up to 1 MiB per rank): 8192 float64 = 64 KiB, 131072 = 1 MiB.
INSTANTIATE_TEST_SUITE_P(Thresholds, Collectives,
                         ::testing::Combine(::testing::ValuesIn(backend_names()), ::testing::Values(2, 3),
                                            ::testing::Values(8191, 8193, 16385, 131071, 131073)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) +
                                  "ranks_count" + std::to_string(std::get<2>(info.param));
                         });

// A send of one size and a receive of another, on every rank, around the
// thresholds: a rank whose own message is staged may still receive a large one.
TEST_P(BackendCalls, SendRecvOfUnequalSizesAroundTheThresholdsCompletes) {
  const std::size_t sizes[] = {0, 1, 16383, 16385, 262145};  // float32: 0 B to just over 1 MiB
  for (int n : {2, 3}) {
    for (std::size_t shift = 0; shift < std::size(sizes); ++shift) {
      run_ranks(n, [&](Communicator& comm) {
        const int r = comm.rank();
        // Rank r sends sizes[(r + shift) % 5] elements to r + 1 (ring, the last to nobody).
        auto count_of = [&](int q) { return sizes[(q + shift) % std::size(sizes)]; };
        std::vector<float> out(count_of(r), static_cast<float>(r + 1)), in(r > 0 ? count_of(r - 1) : 0, -1.0f);
        comm.send_recv({out.data(), r + 1 < n ? out.size() : 0, r + 1 < n ? r + 1 : -1, in.data(), in.size(),
                        r > 0 ? r - 1 : -1},
                       DType::f32);
        for (float v : in) ASSERT_EQ(v, static_cast<float>(r));
        comm.barrier();
      }, fast());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SizesAndCounts, Collectives,
                         ::testing::Combine(::testing::ValuesIn(backend_names()),
                                            ::testing::Values(1, 2, 3, 5, 16), ::testing::Values(0, 1, 7)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) +
                                  "ranks_count" + std::to_string(std::get<2>(info.param));
                         });

TEST_P(BackendCalls, ReduceScatterSumsInRankOrderDeterministically) {
  // (1e16 + 1) - 1e16 depends on order; rank order gives 0 + ... consistently.
  std::vector<double> first, second;
  for (auto* out : {&first, &second}) {
    std::mutex m;
    run_ranks(3, [&](Communicator& comm) {
      const double v[3] = {1e16, 1.0, -1e16};
      std::vector<double> send(3, v[comm.rank()]);
      double got = 0;
      comm.reduce_scatter(send.data(), &got, 1, DType::f64);
      std::lock_guard<std::mutex> lock(m);
      if (comm.rank() == 0) out->push_back(got);
    }, fast());
  }
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first, second);
  EXPECT_EQ(first[0], (1e16 + 1.0) + -1e16);
}

TEST_P(BackendCalls, DifferentCollectivesAtOneSequenceNumberAreReported) {
  const std::string why = collective_error(3, [](Communicator& comm) {
    comm.barrier();
    double x = 1, y[3];
    if (comm.rank() == 1) comm.reduce_scatter(y, &x, 1, DType::f64);
    else comm.all_gather(&x, y, 1, DType::f64);
  });
  EXPECT_THAT(why, AllOf(HasSubstr("different collectives at #2"), HasSubstr("rank 0: in all_gather #2"),
                         HasSubstr("rank 1: in reduce_scatter #2"), HasSubstr("rank 2: in all_gather #2")));
}

TEST_P(BackendCalls, DifferentSizesOrDtypesAreReported) {
  EXPECT_THAT(collective_error(2, [](Communicator& comm) {
    double buf[4] = {};
    comm.all_reduce(buf, comm.rank() == 0 ? 4 : 3, DType::f64);
  }), AllOf(HasSubstr("different sizes"), HasSubstr("count 4"), HasSubstr("count 3")));
  EXPECT_THAT(collective_error(2, [](Communicator& comm) {
    double buf[4] = {};
    comm.all_reduce(buf, 2, comm.rank() == 0 ? DType::f64 : DType::i64);
  }), AllOf(HasSubstr("different dtypes"), HasSubstr("float64"), HasSubstr("int64")));
}

// A caller's name for a call (CallOptions::label: the torch backend's all_reduce
// carried by an all_gather) is compared and reported in place of the collective's:
// the same collective under two names is a mismatch, and so are other arguments;
// the call site is shown, never compared.
TEST_P(BackendCalls, TheCallersNameAndArgumentsAreCheckedAndReported) {
  auto labelled = [](const std::string& name, const std::string& args, const std::string& site) {
    CallOptions o;
    o.label = CallLabel::of(name, args, site);
    return o;
  };
  EXPECT_THAT(collective_error(2, [&](Communicator& comm) {
    double x = 1, y[2];
    comm.all_gather(&x, y, 1, DType::f64,
                    labelled(comm.rank() == 0 ? "all_reduce" : "all_gather", "float64 x 1", "step.py:" +
                             std::to_string(7 + comm.rank())));
  }), AllOf(HasSubstr("different collectives at #1"), HasSubstr("rank 0: in all_reduce #1 (float64 x 1) at step.py:7"),
            HasSubstr("rank 1: in all_gather #1 (float64 x 1) at step.py:8")));
  EXPECT_THAT(collective_error(2, [&](Communicator& comm) {
    double x = 1, y[2];
    comm.all_gather(&x, y, 1, DType::f64, labelled("all_reduce", comm.rank() == 0 ? "float64 x 1, MAX" : "float64 x 1, SUM", ""));
  }), AllOf(HasSubstr("all_reduce #1 with different arguments"), HasSubstr("MAX"), HasSubstr("SUM")));
  // The same name, arguments and sizes at other sites: one call, it runs.
  run_ranks(2, [&](Communicator& comm) {
    double x = comm.rank(), y[2] = {};
    comm.all_gather(&x, y, 1, DType::f64, labelled("all_reduce", "float64 x 1, SUM", "site" + std::to_string(comm.rank())));
    EXPECT_EQ(y[1], 1.0);
  }, fast());
}

TEST_P(BackendCalls, MispairedSendRecvIsReported) {
  EXPECT_THAT(collective_error(3, [](Communicator& comm) {
    float out = 1, in = 0;
    // Rank 0 sends to 1, but rank 1 expects data from rank 2.
    const int dst = comm.rank() == 0 ? 1 : -1, src = comm.rank() == 1 ? 2 : -1;
    comm.send_recv({&out, 1, dst, &in, 1, src}, DType::f32);
  }), HasSubstr("send_recv #1"));
}

TEST_P(BackendCalls, ARankThatNeverArrivesTimesOutOnEveryRank) {
  std::atomic<bool> release{false};
  const auto start = std::chrono::steady_clock::now();
  const std::string why = timeout_error(3, [&](Communicator& comm) {
    if (comm.rank() == 2) {
      while (!release) std::this_thread::sleep_for(1ms);  // stuck in user code
      comm.barrier();
      return;
    }
    try {
      comm.barrier();
    } catch (...) {
      release = true;
      throw;
    }
  }, 200ms);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_THAT(why, AllOf(HasSubstr("timeout"), HasSubstr("barrier #1"), HasSubstr("rank 2: not in a collective")));
}

TEST_P(BackendCalls, ARankThatThrowsFailsItsPeersAndIsRethrown) {
  std::atomic<int> peers_failed{0};
  try {
    run_ranks(4, [&](Communicator& comm) {
      if (comm.rank() == 3) throw InvalidInput("bad batch on rank 3");
      try {
        comm.barrier();
      } catch (const CollectiveError& e) {
        if (std::string(e.what()).find("rank 3 threw: bad batch on rank 3") != std::string::npos) ++peers_failed;
        throw;
      }
    }, fast());
    FAIL() << "no exception";
  } catch (const InvalidInput& e) {
    EXPECT_THAT(e.what(), HasSubstr("bad batch on rank 3"));  // the root cause, not a consequence
  }
  EXPECT_EQ(peers_failed, 3);
}

TEST_P(BackendCalls, ARankThatReturnsEarlyIsReportedImmediately) {
  const auto start = std::chrono::steady_clock::now();
  const std::string why = collective_error(2, [](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == 0) comm.barrier();
  }, 60000ms);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_THAT(why, AllOf(HasSubstr("rank 1 returned without joining barrier #2"), HasSubstr("rank 0: in barrier #2")));
}

TEST_P(BackendCalls, PerCallTimeoutOverridesTheDefault) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<bool> release{false};
  timeout_error(2, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      while (!release) std::this_thread::sleep_for(1ms);
      return;
    }
    try {
      CallOptions quick;
      quick.timeout = 50ms;
      comm.barrier(quick);
    } catch (...) {
      release = true;
      throw;
    }
  }, 60000ms);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

// Gloo's threads run under SCHED_BATCH so that a wakeup never preempts a rank
// that holds a connection's lock while Gloo's loop thread spins for it (the cause
// of milliseconds per call when ranks outnumber cores, sim/gloo/connect.hpp); the
// in-process rank threads, shared with the other backends, go back to
// SCHED_OTHER when the run ends.
TEST(Gloo, RanksWaitUnderBatchSchedulingAndGoBackAfterTheRun) {
  ASSERT_EQ(sched_getscheduler(0), SCHED_OTHER);
  std::atomic<int> batch{0}, other_before{0};
  run_ranks(3, [&](Communicator& comm) {
    if (sched_getscheduler(0) == SCHED_OTHER) ++other_before;
    std::int64_t mine = comm.rank(), all[3];
    comm.all_gather(&mine, all, 1, DType::i64);
    if (sched_getscheduler(0) == SCHED_BATCH) ++batch;
  }, {"gloo", 5000ms});
  EXPECT_EQ(other_before, 3);
  EXPECT_EQ(batch, 3);
  EXPECT_EQ(sched_getscheduler(0), SCHED_OTHER);  // rank 0 ran on this thread
  std::atomic<int> other_after{0};
  run_ranks(3, [&](Communicator&) {
    if (sched_getscheduler(0) == SCHED_OTHER) ++other_after;
  }, {"threads", 5000ms});
  EXPECT_EQ(other_after, 3);
}

TEST(Gather, NullOrOneRankCommunicatorIsTheIdentity) {
  Var x(Tensor::full({1, 3}, DType::f32, 1.0), true);
  EXPECT_EQ(gather_sequence(x, nullptr, true).impl(), x.impl());
  run_ranks(1, [&](Communicator& comm) { EXPECT_EQ(gather_sequence(x, &comm, true).impl(), x.impl()); });
}

// The call check wraps any communicator: here a stub that only counts its calls,
// checked over a channel of its own (an in-memory rendezvous). Matching calls reach
// the stub; a mismatch is reported on every rank and never reaches it.
namespace {
struct CountingStub final : Communicator {
  int r, n;
  std::atomic<int>* calls;
  CountingStub(int rank, int size, std::atomic<int>* c) : r(rank), n(size), calls(c) {}
  int rank() const override { return r; }
  int size() const override { return n; }
  std::chrono::milliseconds timeout() const override { return 2000ms; }
  std::string backend_name() const override { return "stub"; }
  Capabilities capabilities() const override { return {}; }
  void all_gather(const void*, void*, std::size_t, DType, CallOptions) override { ++*calls; }
  void reduce_scatter(const void*, void*, std::size_t, DType, CallOptions) override { ++*calls; }
  void all_reduce(void*, std::size_t, DType, CallOptions) override { ++*calls; }
  void send_recv(const SendRecv&, DType, CallOptions) override { ++*calls; }
  void broadcast(void*, std::size_t, DType, int, CallOptions) override { ++*calls; }
  void barrier(CallOptions) override { ++*calls; }
};
// A channel that only exchanges the records (it applies no rule): every rank
// writes its slot, all meet, all read every slot, all meet again.
struct Slots {
  explicit Slots(int n) : records(n), meet(n) {}
  std::vector<CallRecord> records;
  std::barrier<> meet;
};
struct ExchangeOnly final : CallChannel {
  std::shared_ptr<Slots> slots;
  int rank;
  std::uint64_t seq = 0;
  ExchangeOnly(std::shared_ptr<Slots> s, int q) : slots(std::move(s)), rank(q) {}
  std::vector<CallRecord> exchange(const CallRecord& call, std::chrono::milliseconds) override {
    slots->records[rank] = call;
    slots->records[rank].seq = ++seq;  // the channel numbers the calls
    slots->meet.arrive_and_wait();
    std::vector<CallRecord> out = slots->records;
    slots->meet.arrive_and_wait();
    return out;
  }
  [[noreturn]] void stop(const std::string& why) override { throw CollectiveError(why); }
};
}  // namespace

TEST(CheckedCommunicator, ChecksEveryCallOverItsChannelBeforeTheInnerCall) {
  auto slots = std::make_shared<Slots>(2);
  std::atomic<int> inner_calls{0};
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      auto comm = checked_communicator(std::make_unique<CountingStub>(r, 2, &inner_calls),
                                       std::make_shared<ExchangeOnly>(slots, r));
      double x = 0;
      comm->all_reduce(&x, 1, DType::f64);  // matching: reaches the stub
      try {
        if (r == 0) comm->all_reduce(&x, 1, DType::f64);
        else comm->broadcast(&x, 1, DType::f64, 0);
      } catch (const CollectiveError& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(inner_calls, 2) << "only the matching call may reach the inner communicator";
  for (const auto& e : errors)
    EXPECT_THAT(e, AllOf(HasSubstr("collective mismatch"), HasSubstr("rank 0: in all_reduce #2"),
                         HasSubstr("rank 1: in broadcast #2")));
}
