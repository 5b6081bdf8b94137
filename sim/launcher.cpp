#include "sim/launcher.hpp"

#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "sim/gloo_communicator.hpp"
#include "sim/threads_communicator.hpp"
#include "sim/world.hpp"

namespace cpsim::sim {

namespace {

// What a backend provides to the launcher: a communicator per rank and the
// lifecycle hooks that let it fail peers fast.
struct GroupHandle {
  std::function<std::unique_ptr<Communicator>(int)> make;
  std::function<void(int)> finish;
  std::function<void(int, const std::string&)> fail;
  std::function<void()> done = [] {};  // after every rank has stopped
};

GroupHandle make_group(const std::string& backend, int n, std::chrono::milliseconds timeout) {
  if (backend == "threads") {
    auto group = std::make_shared<ThreadsGroup>(n, timeout);
    return {[group](int r) { return group->communicator(r); }, [group](int r) { group->finish(r); },
            [group](int r, const std::string& w) { group->fail(r, w); }};
  }
  if (backend == "gloo") {
    auto group = acquire_gloo_group(n, timeout);
    return {[group, timeout](int r) { return group->communicator(r, timeout); },
            [group](int r) { group->finish(r); }, [group](int r, const std::string& w) { group->fail(r, w); },
            [group] { release_gloo_group(group); }};
  }
  throw Unsupported("backend '" + backend + "' is not available for in-process ranks (have: threads, gloo)");
}

}  // namespace

std::vector<std::string> simulated_backends() { return {"threads", "gloo"}; }

void run_ranks(int n, const RankFn& fn, const RunOptions& options, const RankOutputs& outputs) {
  CPSIM_ENFORCE(n >= 1, "run_ranks needs at least one rank");
  if (options.backend == "gloo" && current_world()) return run_in_world(n, fn, options.timeout, outputs);
  GroupHandle group = make_group(options.backend, n, options.timeout);
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = group.make(r);
        fn(*comm);
        group.finish(r);
      } catch (...) {
        std::string what = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first) first = std::current_exception();
        }
        group.fail(r, what);
      }
    });
  }
  for (auto& t : threads) t.join();
  group.done();
  if (first) std::rethrow_exception(first);
}

}  // namespace cpsim::sim
