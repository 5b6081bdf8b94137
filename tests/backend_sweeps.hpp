// What the GPU suites run on a backend to compare it with threads: every
// collective of the Communicator interface over the same random inputs, and the
// property table on random layouts.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/comm/run_ranks.hpp"
#include "verify/generators.hpp"
#include "verify/properties.hpp"
#include "verify/random.hpp"

namespace cpsim::testing {

inline const char* const kSweptCollectives[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "send_recv"};

// The results on `backend` of all_gather, reduce_scatter, all_reduce, broadcast
// (from the last rank) and a ring send_recv, rank by rank, in that order (result
// i is collective i / n on rank i % n), on the host. Each rank's input is n*count
// random elements of `dt`.
inline std::vector<Tensor> every_collective(const std::string& backend, int n, DType dt, std::int64_t count) {
  std::vector<Tensor> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(verify::random_tensor({n * count}, dt, 100 * n + r));
  std::vector<Tensor> gathered(n), scattered(n), reduced(n), cast(n), shifted(n);
  RunOptions o;
  o.backend = backend;
  o.timeout = std::chrono::milliseconds(20000);
  run_ranks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const Device d = comm.device();
    const Tensor in = inputs[r].to(d);
    Tensor g({n * n * count}, dt, d), s({count}, dt, d), a = in.clone(), b = in.clone(), sr({n * count}, dt, d);
    comm.all_gather(in.raw(), g.raw(), n * count, dt);
    comm.reduce_scatter(in.raw(), s.raw(), count, dt);
    comm.all_reduce(a.raw(), n * count, dt);
    comm.broadcast(b.raw(), n * count, dt, n - 1);
    SendRecv step{in.raw(), static_cast<std::size_t>(n * count), (r + 1) % n, sr.raw(),
                  static_cast<std::size_t>(n * count), (r + n - 1) % n};
    comm.send_recv(step, dt);
    gathered[r] = g.to(Device::host()), scattered[r] = s.to(Device::host()), reduced[r] = a.to(Device::host());
    cast[r] = b.to(Device::host()), shifted[r] = sr.to(Device::host());
  }, o);
  std::vector<Tensor> all;
  for (auto* v : {&gathered, &scattered, &reduced, &cast, &shifted}) all.insert(all.end(), v->begin(), v->end());
  return all;
}

// Rank 0 all_gathers while rank 1 broadcasts: a CollectiveError naming both calls.
inline void expect_mismatch_named(const std::string& backend) {
  RunOptions o;
  o.backend = backend;
  o.timeout = std::chrono::milliseconds(5000);
  try {
    run_ranks(2, [](Communicator& comm) {
      Tensor t({4}, DType::f32, comm.device()), out({8}, DType::f32, comm.device());
      if (comm.rank() == 0) comm.all_gather(t.raw(), out.raw(), 4, DType::f32);
      else comm.broadcast(t.raw(), 4, DType::f32, 0);
    }, o);
    ADD_FAILURE() << "no error";
  } catch (const CollectiveError& e) {
    EXPECT_NE(std::string(e.what()).find("all_gather"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("broadcast"), std::string::npos) << e.what();
  }
}

// Every property row holds on `backend` on `cases` random layouts, at CP sizes
// 1..max_cp in turn.
inline void property_table_holds(const std::string& backend, int max_cp, int cases, std::uint64_t seed) {
  const auto gen = verify::gen_layout_case(max_cp);
  verify::CheckOptions o;
  o.backend = backend;
  for (int i = 0; i < cases; ++i) {
    verify::LayoutCase c = gen(rc::Random(seed + i), 40).value();
    c = verify::at_cp(c, 1 + i % max_cp);
    for (const auto& r : verify::check_all(c, o)) EXPECT_TRUE(r.ok) << backend << " " << r.property << ": " << r.detail << "\n" << c;
  }
}

}  // namespace cpsim::testing
