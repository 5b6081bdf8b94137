// Test-only backends, registered only in the test binary. `delayed`: the threads backend
// with every call delayed by a random 0-300 µs on each rank. The threads backend
// runs ranks in near lock-step; random delays reorder arrivals and shake out
// ordering bugs it hides (a rank reading a peer's buffer before it is written, a
// result that depends on who arrives first). It is also the proof that a backend
// is one folder and one registration: nothing above core/comm names it.
// `counting` (registered by the tests that use it, so the suites over every backend
// do not run it): threads, counting the groups made, so tests can count simulations.
#include <atomic>
#include <random>
#include <thread>

#include "core/comm/registry.hpp"

namespace cpsim::testing {

std::atomic<std::int64_t> counting_groups{0};

namespace {

class DelayedCommunicator final : public Communicator {
 public:
  DelayedCommunicator(std::unique_ptr<Communicator> inner, std::uint64_t seed) : inner_(std::move(inner)), rng_(seed) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return "delayed"; }
  Capabilities capabilities() const override { return inner_->capabilities(); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    delay();
    inner_->all_gather(send, recv, count, dt, o);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    delay();
    inner_->reduce_scatter(send, recv, count, dt, o);
  }
  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    delay();
    inner_->all_reduce(buf, count, dt, o);
  }
  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    delay();
    inner_->send_recv(step, dt, o);
  }
  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    delay();
    inner_->broadcast(buf, count, dt, root, o);
  }
  void barrier(CallOptions o) override {
    delay();
    inner_->barrier(o);
  }

 private:
  void delay() { std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 300)); }
  std::unique_ptr<Communicator> inner_;
  std::mt19937_64 rng_;
};

class DelayedGroup final : public Group {
 public:
  DelayedGroup(std::shared_ptr<Group> inner, std::uint64_t seed) : inner_(std::move(inner)), seed_(seed) {}
  std::unique_ptr<Communicator> communicator(int rank) override {
    return std::make_unique<DelayedCommunicator>(inner_->communicator(rank), seed_ * 1000003u + rank);
  }
  void finish(int rank) override { inner_->finish(rank); }
  void fail(int rank, const std::string& what) override { inner_->fail(rank, what); }
  void done() override { inner_->done(); }

 private:
  std::shared_ptr<Group> inner_;
  std::uint64_t seed_;
};

std::atomic<std::uint64_t> runs{0};

const BackendRegistrar registrar{Backend{
    "delayed", "test only: threads with every call delayed at random (0-300 us)",
    Capabilities{/*rank_order_sums=*/true, /*device_buffers=*/false, /*stream_ordered=*/false},
    [](int n, std::chrono::milliseconds timeout) {
      return std::make_shared<DelayedGroup>(find_backend("threads").make_group(n, timeout), ++runs);
    }}};

}  // namespace

void register_counting_backend() {
  static const bool once = [] {
    register_backend(Backend{"counting", "test only: threads, counting the groups it makes (one per run_ranks)",
                             Capabilities{/*rank_order_sums=*/true, /*device_buffers=*/false, /*stream_ordered=*/false},
                             [](int n, std::chrono::milliseconds timeout) {
                               ++counting_groups;
                               return find_backend("threads").make_group(n, timeout);
                             }});
    return true;
  }();
  (void)once;
}

}  // namespace cpsim::testing
