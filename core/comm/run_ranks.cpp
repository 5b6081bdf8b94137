#include "core/comm/run_ranks.hpp"

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace cpsim {

namespace {

// Rank threads that outlive a run: starting and joining a thread per rank on every
// run_ranks call cost more than the run itself for small cases (the properties
// call it about ten times per case). Rank 0 runs on the calling thread; the others
// take idle threads (or start new ones, so a rank that calls run_ranks itself
// still gets threads) and hand them back.
class RankThreads {
 public:
  ~RankThreads() {
    std::vector<std::unique_ptr<Worker>> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all.swap(all_);
    }
    for (auto& w : all) {
      {
        std::lock_guard<std::mutex> lock(w->mutex);
        w->stop = true;
      }
      w->cv.notify_one();
    }
    for (auto& w : all) w->thread.join();
  }

  // Runs task(r) for every r in [0, n), each on its own thread (rank 0 on the
  // calling one); returns when all did.
  void run(int n, const std::function<void(int)>& task) {
    std::vector<Worker*> workers = take(n - 1);
    std::mutex done_mutex;
    std::condition_variable done_cv;
    int running = n - 1;
    for (int r = 1; r < n; ++r) {
      Worker* w = workers[r - 1];
      {
        std::lock_guard<std::mutex> lock(w->mutex);
        w->job = [&, r] {
          task(r);
          std::lock_guard<std::mutex> done(done_mutex);
          if (--running == 0) done_cv.notify_one();
        };
      }
      w->cv.notify_one();
    }
    task(0);
    {
      std::unique_lock<std::mutex> lock(done_mutex);
      done_cv.wait(lock, [&] { return running == 0; });
    }
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.insert(idle_.end(), workers.begin(), workers.end());
  }

 private:
  struct Worker {
    std::thread thread;
    std::mutex mutex;
    std::condition_variable cv;
    std::function<void()> job;
    bool stop = false;
  };

  std::vector<Worker*> take(int n) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Worker*> out;
    while (static_cast<int>(out.size()) < n && !idle_.empty()) {
      out.push_back(idle_.back());
      idle_.pop_back();
    }
    while (static_cast<int>(out.size()) < n) {
      all_.push_back(std::make_unique<Worker>());
      Worker* w = all_.back().get();
      w->thread = std::thread([w] { loop(*w); });
      out.push_back(w);
    }
    return out;
  }

  static void loop(Worker& w) {
    std::unique_lock<std::mutex> lock(w.mutex);
    for (;;) {
      w.cv.wait(lock, [&] { return w.stop || w.job; });
      if (w.stop) return;
      auto job = std::move(w.job);
      w.job = nullptr;
      lock.unlock();
      job();  // never throws: run_ranks catches every rank's failure
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::vector<std::unique_ptr<Worker>> all_;
  std::vector<Worker*> idle_;
};

RankThreads& rank_threads() {
  static RankThreads threads;
  return threads;
}

}  // namespace

void run_ranks(int n, const RankFn& fn, const RunOptions& options, const RankOutputs& outputs) {
  CPSIM_ENFORCE(n >= 1, "run_ranks needs at least one rank");
  const Backend& backend = find_backend(options.backend);
  if (auto why = backend.unavailable()) throw Unavailable("backend '" + backend.name + "': " + *why);
  if (options.job) {
    if (!backend.job_transport)
      throw Unavailable("backend '" + backend.name + "' runs its ranks as threads of one process, not in a job of " +
                        std::to_string(options.job->size()) + " processes");
    options.job->run(n, fn, options.timeout, outputs, backend.job_transport);
    return;
  }
  const std::shared_ptr<Group> group = backend.make_group(n, options.timeout, {});
  std::mutex mutex;
  std::exception_ptr first;
  std::chrono::steady_clock::time_point first_when;
  rank_threads().run(n, [&](int r) {
    try {
      auto comm = group->communicator(r);
      fn(*comm);
      group->finish(r);
    } catch (...) {
      std::string what = "unknown exception";
      // A cpsim failure says when it was raised; any other, when it reached here
      // (before its peers hear of it, so before any consequence).
      auto when = std::chrono::steady_clock::now();
      try {
        throw;
      } catch (const Error& e) {
        what = e.what();
        when = e.when();
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      {
        // The earliest failure, not the first reported: a rank that fails slowly
        // (waiting for its peers' failure records, say) may report after a peer
        // whose failure is a consequence of its own.
        std::lock_guard<std::mutex> lock(mutex);
        if (!first || when < first_when) {
          first = std::current_exception();
          first_when = when;
        }
      }
      group->fail(r, what);
    }
  });
  group->done();
  if (first) std::rethrow_exception(first);
}

}  // namespace cpsim
