// One rank of a multi-process job for tests/sim/test_launch.cpp (run under cpsim
// launch): checks that run_ranks across processes hands every rank's outputs to
// every process, rethrows the root cause of a failed run on every process, turns a
// mismatch into the same CollectiveError everywhere, and keeps the job usable after
// it. Prints "probe ok rank R" and exits 0, or prints what went wrong and exits 1.
#include <iostream>
#include <string>

#include "core/comm/run_ranks.hpp"
#include "sim/job/job.hpp"

using namespace cpsim;

namespace {

int failures = 0;
int rank = -1;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  std::cerr << "probe rank " << rank << ": " << what << "\n";
  ++failures;
}

template <class E, class F>
std::string caught(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "nothing thrown";
}

}  // namespace

int main() {
  auto config = sim::job_from_environment();
  if (!config) {
    std::cerr << "probe: run me under cpsim launch\n";
    return 2;
  }
  config->timeout = std::chrono::milliseconds(10000);
  auto job = std::make_shared<sim::ProcessJob>(*config);
  rank = config->rank;
  const RunOptions gloo{"gloo", std::chrono::milliseconds(10000), job};

  // Outputs: a group of 2 (ranks 0, 1); every process, rank 2 included, gets both slots.
  std::vector<Tensor> slots(2), grads(2);
  run_ranks(2, [&](Communicator& comm) {
    slots[comm.rank()] = Tensor::full({2, 3}, DType::f64, 10.0 * comm.rank() + 1);
    if (comm.rank() == 1) grads[1] = Tensor::full({1}, DType::i64, 7);  // rank 0 leaves its slot undefined
  }, gloo, {&slots, &grads});
  for (int q = 0; q < 2; ++q)
    expect(slots[q].defined() && slots[q].shape() == Shape({2, 3}) && slots[q].get(5) == 10.0 * q + 1,
           "slot " + std::to_string(q) + " did not arrive");
  expect(!grads[0].defined() && grads[1].defined() && grads[1].get_int(0) == 7, "undefined/defined slots mixed up");

  // A rank's own failure is the root cause every process rethrows.
  const std::string thrown = caught<InvalidInput>([&] {
    run_ranks(3, [](Communicator& comm) {
      if (comm.rank() == 1) throw InvalidInput("bad batch on rank 1");
      comm.barrier();
    }, gloo);
  });
  expect(thrown == "bad batch on rank 1", "root cause: " + thrown);

  // A mismatch: the same report on every process, and the job goes on.
  const std::string mismatch = caught<CollectiveError>([&] {
    run_ranks(3, [](Communicator& comm) {
      double x = 1, y[3];
      if (comm.rank() == 2) comm.all_gather(&x, y, 1, DType::f64);
      else comm.reduce_scatter(y, &x, 1, DType::f64);
    }, gloo);
  });
  expect(mismatch.find("different collectives at #1") != std::string::npos &&
             mismatch.find("rank 2: in all_gather #1") != std::string::npos,
         "mismatch report: " + mismatch);
  std::vector<Tensor> sums(3);
  run_ranks(3, [&](Communicator& comm) {
    std::int64_t v = comm.rank() + 1;
    comm.all_reduce(&v, 1, DType::i64);
    sums[comm.rank()] = Tensor::full({1}, DType::i64, static_cast<double>(v));
  }, gloo, {&sums});
  for (const auto& s : sums) expect(s.defined() && s.get_int(0) == 6, "all_reduce after the mismatch");

  expect(job->failure().empty(), "the job broke");
  job->leave();
  if (failures) return 1;
  std::cout << "probe ok rank " << rank << std::endl;
  return 0;
}
