// In-process Gloo groups (pool.cpp): ranks as threads of this process, each
// with its own context, kept per size and reused (docs/backends.md, "Gloo").
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/communicator.hpp"
#include "sim/gloo/rank.hpp"


namespace cpsim::sim {

// In-process groups: n ranks as threads of this process, each with its own Gloo
// context over loopback TCP, rendezvous through an in-memory store. Groups are
// kept per size and reused across runs; a broken group is replaced.
class GlooThreadsGroup {
 public:
  GlooThreadsGroup(int size, std::chrono::milliseconds timeout);
  ~GlooThreadsGroup();
  int size() const { return size_; }
  // Called on rank r's thread: connects it on first use, then begins a run whose
  // reports name the ranks by `names`.
  std::unique_ptr<Communicator> communicator(int rank, std::chrono::milliseconds timeout, const RankNames& names);
  void finish(int rank);
  void fail(int rank, const std::string& what);
  bool broken() const;

 private:
  int size_;
  std::chrono::milliseconds connect_timeout_;
  std::shared_ptr<Store> store_;
  std::vector<std::shared_ptr<GlooRank>> ranks_;
};

// A group of `n` ranks for one run_ranks call, from the pool or new; give it back
// with release_gloo_group once every rank has stopped.
std::shared_ptr<GlooThreadsGroup> acquire_gloo_group(int n, std::chrono::milliseconds timeout);
void release_gloo_group(const std::shared_ptr<GlooThreadsGroup>& group);

}  // namespace cpsim::sim
