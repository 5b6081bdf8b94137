// Test-only backends, registered only in the test binary. `delayed`: the threads backend
// with every call delayed by a random 0-300 µs on each rank. The threads backend
// runs ranks in near lock-step; random delays reorder arrivals and shake out
// ordering bugs it hides (a rank reading a peer's buffer before it is written, a
// result that depends on who arrives first). It is also the proof that a backend
// is one folder and one registration: nothing above core/comm names it.
// `host-device` (registered by the tests that use it): threads whose ranks keep
// their tensors on "cuda:0", a device whose runtime is host memory and whose
// kernels are the host's. It drives every operator and property through the
// device paths (inputs moved to the rank's device, results moved back, plans and
// layouts copied over) on a machine without a GPU.
// `stalling` (registered by the tests that use it): threads whose last rank stalls
// past the timeout before every call, so every run that moves data times out.
// `counting` (registered by the tests that use it, so the suites over every backend
// do not run it): threads, counting the groups made, so tests can count simulations.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <thread>

#include "core/comm/forwarding.hpp"
#include "core/comm/registry.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::testing {

using namespace std::chrono_literals;

std::atomic<std::int64_t> counting_groups{0};
std::atomic<std::int64_t> host_device_allocations{0};

namespace {

class DelayedCommunicator final : public ForwardingCommunicator {
 public:
  DelayedCommunicator(std::unique_ptr<Communicator> inner, std::uint64_t seed)
      : ForwardingCommunicator(std::move(inner)), rng_(seed) {}
  std::string backend_name() const override { return "delayed"; }

 private:
  void before(const CallRecord&, CallOptions) override {
    std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 300));
  }
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
    [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
      return std::make_shared<DelayedGroup>(find_backend("threads").make_group(n, timeout, names), ++runs);
    }}};

}  // namespace

namespace {

class HostMemoryDevice final : public DeviceRuntime {
 public:
  void* allocate(Device device, std::size_t bytes) override {
    CPSIM_ENFORCE(device == Device::cuda(0), "host-device has one device, cuda:0");
    ++host_device_allocations;
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0xA5, bytes);  // garbage, as fresh device memory is: zero() must clear it
    return p;
  }
  void deallocate(Device, void* p, std::size_t) noexcept override { std::free(p); }
  void zero(Device, void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, Device, const void* src, Device, std::size_t bytes) override { std::memmove(dst, src, bytes); }
};

class OnDevice final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  std::string backend_name() const override { return "host-device"; }
  Capabilities capabilities() const override { return kCapabilities; }
  Device device() const override { return Device::cuda(0); }
  static constexpr Capabilities kCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/true,
                                              /*stream_ordered=*/false};
};

// The ranks of `inner`, each wrapped in a W.
template <class W>
class WrappedGroup final : public Group {
 public:
  explicit WrappedGroup(std::shared_ptr<Group> inner) : inner_(std::move(inner)) {}
  std::unique_ptr<Communicator> communicator(int rank) override { return std::make_unique<W>(inner_->communicator(rank)); }
  void finish(int rank) override { inner_->finish(rank); }
  void fail(int rank, const std::string& what) override { inner_->fail(rank, what); }
  void done() override { inner_->done(); }

 private:
  std::shared_ptr<Group> inner_;
};

}  // namespace

void register_host_device_backend() {
  static const bool once = [] {
    static HostMemoryDevice runtime;
    register_device_runtime(DeviceKind::cuda, &runtime);
    kernels::register_kernels(DeviceKind::cuda, &kernels::kernels_for(Device::host()));
    register_backend(Backend{"host-device", "test only: threads with tensors on a cuda:0 made of host memory",
                             OnDevice::kCapabilities, [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
                               return std::make_shared<WrappedGroup<OnDevice>>(find_backend("threads").make_group(n, timeout, names));
                             }});
    return true;
  }();
  (void)once;
}

namespace {
class Stalling final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;

 private:
  void before(const CallRecord&, CallOptions o) override {
    // Well past the peers' timeout even when they reach the call late (a loaded machine).
    if (rank() == size() - 1) std::this_thread::sleep_for(2 * o.timeout_or(timeout()) + 300ms);
  }
};
}  // namespace

void register_stalling_backend() {
  static const bool once = [] {
    register_backend(Backend{"stalling", "test only: threads whose last rank stalls past the timeout at every call",
                             Capabilities{/*rank_order_sums=*/true, /*device_buffers=*/false, /*stream_ordered=*/false},
                             [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
                               return std::make_shared<WrappedGroup<Stalling>>(find_backend("threads").make_group(n, timeout, names));
                             }});
    return true;
  }();
  (void)once;
}

void register_counting_backend() {
  static const bool once = [] {
    register_backend(Backend{"counting", "test only: threads, counting the groups it makes (one per run_ranks)",
                             Capabilities{/*rank_order_sums=*/true, /*device_buffers=*/false, /*stream_ordered=*/false},
                             [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
                               ++counting_groups;
                               return find_backend("threads").make_group(n, timeout, names);
                             }});
    return true;
  }();
  (void)once;
}

}  // namespace cpsim::testing
