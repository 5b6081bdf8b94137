#include "core/comm/run_ranks.hpp"

#include <exception>
#include <mutex>
#include <thread>

namespace cpsim {

void run_ranks(int n, const RankFn& fn, const RunOptions& options, const RankOutputs& outputs) {
  CPSIM_ENFORCE(n >= 1, "run_ranks needs at least one rank");
  const Backend& backend = find_backend(options.backend);
  if (auto why = backend.unavailable()) throw Unsupported("backend '" + backend.name + "': " + *why);
  if (backend.run_in_job(n, fn, options.timeout, outputs)) return;
  const std::shared_ptr<Group> group = backend.make_group(n, options.timeout);
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = group->communicator(r);
        fn(*comm);
        group->finish(r);
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
        group->fail(r, what);
      }
    });
  }
  for (auto& t : threads) t.join();
  group->done();
  if (first) std::rethrow_exception(first);
}

}  // namespace cpsim
