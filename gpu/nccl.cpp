// The `nccl` backend: one rank per GPU, data moved by NCCL on each rank's stream.
//   in one process   ranks are threads, rank r on cuda:r (ncclCommInitAll); their
//                    calls are checked in the backend-neutral rendezvous first;
//   in a job         (cpsim launch, RANK/WORLD_SIZE, Slurm) each process is one
//                    rank on cuda:LOCAL_RANK; the job's side channel
//                    (core/comm/side_channel.hpp) shares the unique id and checks every
//                    call first.
// Every call is checked before NCCL sees it (a mismatch is a CollectiveError naming
// each rank's call, and NCCL never runs it). A watchdog then waits for the call:
// an asynchronous NCCL error, or no completion within the timeout, aborts the
// communicator (ncclCommAbort) and fails the call; a hang is never the outcome.
// NCCL's sums follow its rings and trees, not rank order: the capability says so.
// Ranks run on CUDA devices, or on the host device a loaded NCCL library brings
// (gpu/nccl_host_device.h: cpsim's NCCL test double), through one small interface
// (RankDevice): streams, events, synchronisation.
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <map>
#include <optional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/comm/call_check.hpp"
#include "core/comm/registry.hpp"
#include "core/comm/rendezvous.hpp"
#include "core/device.hpp"
#include "gpu/cuda.hpp"
#include "gpu/nccl_host_device.h"
#include "gpu/nccl_loader.hpp"

namespace cpsim::gpu {

namespace {

using Clock = std::chrono::steady_clock;

constexpr Capabilities kNcclCapabilities{/*rank_order_sums=*/false, /*device_buffers=*/true,
                                         /*stream_ordered=*/true};

void nccl_check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) throw Aborted(std::string(call) + ": " + ncclGetErrorString(r));
}
#define CPSIM_NCCL(call) nccl_check((call), #call)

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::b8: return ncclUint8;
  }
  return ncclUint8;
}
// Sums; for bool, or (the max of 0 and 1), as the other backends do.
ncclRedOp_t nccl_sum(DType dt) { return dt == DType::b8 ? ncclMax : ncclSum; }

// Where the ranks run: the streams their NCCL calls go on, the events that say a
// call is done, and the memory and kernels of their tensors.
class RankDevice {
 public:
  virtual ~RankDevice() = default;
  virtual std::optional<std::string> unavailable() const = 0;
  virtual int count() const = 0;
  virtual void activate() = 0;  // registers the device runtime and kernels
  virtual void* stream(int device) = 0;
  virtual void bind(int device, void* stream) = 0;  // this thread's device and stream
  virtual void* event() = 0;
  virtual void record(void* event, void* stream) = 0;
  // True once the stream has reached the event; an error's text goes to `error`.
  virtual bool reached(void* event, std::string& error) = 0;
  virtual std::string synchronize(void* stream) = 0;  // "" or the error
};

class CudaRankDevice final : public RankDevice {
 public:
  std::optional<std::string> unavailable() const override { return cuda_unavailable(); }
  int count() const override { return cuda_device_count(); }
  void activate() override { activate_cuda(); }
  void* stream(int device) override { return rank_stream(device, 0); }
  void bind(int device, void* stream) override { bind_rank_thread(device, static_cast<cudaStream_t>(stream)); }
  void* event() override {
    cudaEvent_t e = nullptr;
    CPSIM_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void record(void* event, void* stream) override {
    CPSIM_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  }
  bool reached(void* event, std::string& error) override {
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (q != cudaSuccess && q != cudaErrorNotReady) error = cudaGetErrorString(q);
    return q == cudaSuccess;
  }
  std::string synchronize(void* stream) override {
    const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    return e == cudaSuccess ? std::string() : cudaGetErrorString(e);
  }
};

// Tensors of cuda:N in host memory, for a host device: its kernels are the host's.
class HostMemory final : public DeviceRuntime {
 public:
  explicit HostMemory(int devices) : devices_(devices) {}
  void* allocate(Device device, std::size_t bytes) override {
    if (device.index < 0 || device.index >= devices_)
      throw InvalidInput("the NCCL library's host device has cuda:0..cuda:" + std::to_string(devices_ - 1) + ", not " +
                         device.str());
    return ::operator new(bytes ? bytes : 1, std::align_val_t{64});
  }
  void deallocate(Device, void* p, std::size_t) noexcept override { ::operator delete(p, std::align_val_t{64}); }
  void zero(Device, void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }
  void copy(void* dst, Device, const void* src, Device, std::size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }

 private:
  int devices_;
};

class HostRankDevice final : public RankDevice {
 public:
  explicit HostRankDevice(const cpsimNcclHostDeviceTable* t) : t_(t), memory_(t->devices) {}
  std::optional<std::string> unavailable() const override { return std::nullopt; }
  int count() const override { return t_->devices; }
  void activate() override {
    static const bool once = [this] {
      register_device_runtime(DeviceKind::cuda, &memory_);
      kernels::register_kernels(DeviceKind::cuda, &kernels::kernels_for(Device::host()));
      return true;
    }();
    (void)once;
  }
  void* stream(int device) override {
    std::lock_guard<std::mutex> lock(m_);
    void*& s = streams_[device];
    if (!s) s = t_->stream_create(device);
    return s;
  }
  void bind(int, void* stream) override { kernels::current_stream() = stream; }
  void* event() override { return t_->event_create(); }
  void record(void* event, void* stream) override { t_->event_record(event, stream); }
  bool reached(void* event, std::string&) override { return t_->event_query(event) != 0; }
  // Every call on the stream is under the watchdog, which aborts a stuck one; the
  // bound is for what is not (a library that never returns).
  std::string synchronize(void* stream) override {
    constexpr long long kLimitMs = 600000;
    if (t_->stream_synchronize(stream, kLimitMs) == 0) return {};
    return "the host device's stream did not drain within " + std::to_string(kLimitMs / 1000) + " s";
  }

 private:
  const cpsimNcclHostDeviceTable* t_;
  HostMemory memory_;
  std::mutex m_;
  std::map<int, void*> streams_;
};

// The host device of the loaded NCCL library when it brings one, else CUDA.
RankDevice& rank_device() {
  static RankDevice* d = []() -> RankDevice* {
    if (auto* f = reinterpret_cast<cpsimNcclHostDeviceFn>(nccl_library_symbol("cpsimNcclHostDevice"))) {
      const cpsimNcclHostDeviceTable* t = f();
      if (t && t->abi == CPSIM_NCCL_HOST_DEVICE_ABI && t->devices > 0) return new HostRankDevice(t);
    }
    return new CudaRankDevice;
  }();
  return *d;
}

// Why the nccl backend cannot run here, or nothing.
std::optional<std::string> nccl_backend_unavailable() {
  // A library that brings its own device needs no CUDA; otherwise CUDA is said first.
  if (!nccl_unavailable() && !rank_device().unavailable()) return std::nullopt;
  if (auto why = cuda_unavailable()) return why;
  return nccl_unavailable();
}

// One rank's NCCL communicator and why it was aborted, if it was.
struct NcclRank {
  ncclComm_t comm = nullptr;
  int device = 0;
  void* stream = nullptr;
  std::string aborted;
  // Recorded around each collective: the watchdog's clock starts when `started`
  // is reached (work queued before the call is not the call), and the call is
  // done when `ended` is (work queued after it is not either).
  void* started = nullptr;
  void* ended = nullptr;
  void events() {
    if (started) return;
    started = rank_device().event();
    ended = rank_device().event();
  }
};

class NcclTransport final : public Communicator {
 public:
  NcclTransport(std::shared_ptr<NcclRank> r, int rank, int size, std::chrono::milliseconds timeout)
      : r_(std::move(r)), rank_(rank), size_(size), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  std::string backend_name() const override { return "nccl"; }
  Capabilities capabilities() const override { return kNcclCapabilities; }
  Device device() const override { return Device::cuda(r_->device); }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    run("all_gather", o, [&] { return ncclAllGather(send, recv, count, nccl_type(dt), r_->comm, stream()); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    run("reduce_scatter", o,
        [&] { return ncclReduceScatter(send, recv, count, nccl_type(dt), nccl_sum(dt), r_->comm, stream()); });
  }
  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    run("all_reduce", o, [&] { return ncclAllReduce(buf, buf, count, nccl_type(dt), nccl_sum(dt), r_->comm, stream()); });
  }
  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    run("send_recv", o, [&] {
      ncclResult_t r = ncclGroupStart();
      if (r == ncclSuccess && step.dst >= 0)
        r = ncclSend(step.send, step.send_count, nccl_type(dt), step.dst, r_->comm, stream());
      if (r == ncclSuccess && step.src >= 0)
        r = ncclRecv(step.recv, step.recv_count, nccl_type(dt), step.src, r_->comm, stream());
      const ncclResult_t end = ncclGroupEnd();
      return r == ncclSuccess ? end : r;
    });
  }
  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    run("broadcast", o, [&] { return ncclBroadcast(buf, buf, count, nccl_type(dt), root, r_->comm, stream()); });
  }
  void barrier(CallOptions) override {}  // the call check before it is the barrier
  // The end of a run in a job: the rank's stream drained, and no asynchronous
  // NCCL error left behind.
  void finish_run() override {
    if (!r_->aborted.empty() || !r_->comm) return;
    const std::string e = rank_device().synchronize(r_->stream);
    if (!e.empty()) abort(std::string("rank ") + std::to_string(rank_) + ": CUDA error at the end of the run: " + e);
    ncclResult_t async = ncclSuccess;
    (void)ncclCommGetAsyncError(r_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress)
      abort(std::string("rank ") + std::to_string(rank_) + ": NCCL error at the end of the run: " + ncclGetErrorString(async));
  }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(r_->stream); }

  template <class F>
  void run(const char* what, CallOptions o, F&& enqueue) {
    if (!r_->aborted.empty()) throw Aborted("the nccl communicator was aborted: " + r_->aborted);
    r_->events();
    rank_device().record(r_->started, r_->stream);
    const ncclResult_t r = enqueue();
    if (r != ncclSuccess && r != ncclInProgress)
      abort(std::string("rank ") + std::to_string(rank_) + ": " + what + " failed to start: " + ncclGetErrorString(r));
    rank_device().record(r_->ended, r_->stream);
    watch(what, o.timeout_or(timeout_));
  }

  // The watchdog: the call completes, or its communicator is aborted and the call
  // fails. The limit counts from the moment the stream reaches the call.
  void watch(const char* what, std::chrono::milliseconds limit) {
    std::optional<Clock::time_point> deadline;
    // Work queued before the call may run long, but not forever.
    const auto reach_by = Clock::now() + 10 * limit;
    for (int spins = 0;; ++spins) {
      if (!deadline && Clock::now() > reach_by)
        abort("timeout: rank " + std::to_string(rank_) + "'s stream did not reach " + what + " within " +
              std::to_string(10 * limit.count()) + " ms: the work queued before it did not finish");
      std::string error;
      if (!deadline) {
        if (rank_device().reached(r_->started, error)) deadline = Clock::now() + limit;
        else if (!error.empty())
          abort(std::string("rank ") + std::to_string(rank_) + ": CUDA error before " + what + ": " + error);
      }
      // The error is read after the completion: a call that fails (or whose peer
      // failed) may still reach its end on the stream, with wrong data.
      const bool done = rank_device().reached(r_->ended, error);
      if (!error.empty()) abort(std::string("rank ") + std::to_string(rank_) + ": CUDA error in " + what + ": " + error);
      ncclResult_t async = ncclSuccess;
      (void)ncclCommGetAsyncError(r_->comm, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        abort(std::string("rank ") + std::to_string(rank_) + ": NCCL error in " + what + ": " + ncclGetErrorString(async));
      if (done) return;
      if (deadline && Clock::now() > *deadline)
        abort("timeout: rank " + std::to_string(rank_) + " waited " + std::to_string(limit.count()) + " ms for " + what +
              " on nccl; every rank had agreed to run it (the call check passed), so a peer stopped inside it");
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void abort(const std::string& why) {
    r_->aborted = why;
    (void)ncclCommAbort(r_->comm);
    r_->comm = nullptr;
    throw Aborted(why + " (the nccl communicator was aborted)");
  }

  std::shared_ptr<NcclRank> r_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
};

std::string too_many_ranks(int n, int devices) {
  return "nccl runs one rank per GPU: " + std::to_string(n) + " ranks need " + std::to_string(n) +
         " GPUs and this process sees " + std::to_string(devices) +
         "; use --backend cuda-sim to run many ranks on one GPU";
}
std::string too_many_ranks(int devices) {
  return "nccl runs one rank per GPU and this process sees " + std::to_string(devices) +
         "; use --backend cuda-sim to run many ranks on one GPU, or cpsim launch for one process per GPU";
}

// ---------------------------------------------------------------------------
// One process over its visible GPUs.

// Communicators are expensive to make: one clique per group size, kept until aborted.
std::mutex cliques_mutex;
std::map<int, std::vector<std::shared_ptr<NcclRank>>> cliques;

std::vector<std::shared_ptr<NcclRank>> clique(int n) {
  std::lock_guard<std::mutex> lock(cliques_mutex);
  auto& ranks = cliques[n];
  bool usable = !ranks.empty();
  for (const auto& r : ranks) usable = usable && r->aborted.empty();
  if (usable) return ranks;
  for (const auto& r : ranks)
    if (r->comm) (void)ncclCommAbort(r->comm);
  std::vector<ncclComm_t> comms(n);
  std::vector<int> devices(n);
  for (int r = 0; r < n; ++r) devices[r] = r;
  CPSIM_NCCL(ncclCommInitAll(comms.data(), n, devices.data()));
  ranks.clear();
  for (int r = 0; r < n; ++r) {
    auto rank = std::make_shared<NcclRank>();
    rank->comm = comms[r];
    rank->device = r;
    rank->stream = rank_device().stream(r);
    ranks.push_back(rank);
  }
  return ranks;
}

class NcclGroup final : public Group {
 public:
  NcclGroup(int n, std::chrono::milliseconds timeout, const RankNames& names) : timeout_(timeout) {
    if (auto why = nccl_backend_unavailable()) throw Unavailable(*why);
    rank_device().activate();
    if (n > rank_device().count()) throw Unavailable(too_many_ranks(n, rank_device().count()));
    ranks_ = clique(n);
    rendezvous_ = std::make_shared<Rendezvous>(n, timeout, names);
  }
  std::unique_ptr<Communicator> communicator(int rank) override {
    const auto& r = ranks_.at(rank);
    rank_device().bind(r->device, r->stream);
    return checked_communicator(std::make_unique<NcclTransport>(r, rank, static_cast<int>(ranks_.size()), timeout_),
                                rendezvous_channel(rendezvous_, rank));
  }
  void finish(int rank) override {
    const std::string e = rank_device().synchronize(ranks_[rank]->stream);
    kernels::current_stream() = nullptr;
    if (!e.empty()) throw Aborted("CUDA error at the end of the run: " + e);
    rendezvous_->finish(rank);
  }
  void fail(int rank, const std::string& what) override {
    kernels::current_stream() = nullptr;
    rendezvous_->fail(rank, what);
  }

 private:
  std::chrono::milliseconds timeout_;
  std::vector<std::shared_ptr<NcclRank>> ranks_;
  std::shared_ptr<Rendezvous> rendezvous_;
};

// ---------------------------------------------------------------------------
// One rank per process of a job.

// This process's GPU: LOCAL_RANK (torchrun, cpsim launch) or SLURM_LOCALID, else
// the job rank modulo the visible devices.
int local_device(int rank) {
  for (const char* key : {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"})
    if (const char* v = std::getenv(key)) return std::atoi(v) % rank_device().count();
  return rank % rank_device().count();
}

std::mutex job_mutex;
std::map<int, std::shared_ptr<NcclRank>> job_ranks;  // by group size

std::unique_ptr<Communicator> job_transport(const std::shared_ptr<SideChannel>& side, int n) {
  if (auto why = nccl_backend_unavailable()) throw Unavailable(*why);
  rank_device().activate();
  std::shared_ptr<NcclRank> r;
  {
    std::lock_guard<std::mutex> lock(job_mutex);
    r = job_ranks[n];
  }
  // Every rank rebuilds, or none: a rank whose own communicator is fine must not
  // keep it while a peer that aborted makes a new one (the two would never meet).
  const std::uint8_t mine = (!r || !r->aborted.empty()) ? 1 : 0;
  std::vector<std::uint8_t> all(static_cast<std::size_t>(n));
  side->all_gather_bytes(&mine, all.data(), 1);
  if (std::find(all.begin(), all.end(), 1) != all.end()) {
    if (r && r->comm) (void)ncclCommAbort(r->comm);
    r = std::make_shared<NcclRank>();
    r->device = local_device(side->rank());
    r->stream = rank_device().stream(r->device);
    rank_device().bind(r->device, r->stream);
    ncclUniqueId id{};
    if (side->rank() == 0) CPSIM_NCCL(ncclGetUniqueId(&id));
    side->broadcast_bytes(&id, sizeof id, 0);
    const ncclResult_t init = ncclCommInitRank(&r->comm, n, id, side->rank());
    if (init != ncclSuccess)
      throw Aborted(std::string("ncclCommInitRank on cuda:") + std::to_string(r->device) + ": " + ncclGetErrorString(init) +
                  " (two ranks of one host on one GPU? nccl needs a GPU per rank; cuda-sim runs many ranks on one)");
    std::lock_guard<std::mutex> lock(job_mutex);
    job_ranks[n] = r;
  }
  rank_device().bind(r->device, r->stream);
  return checked_communicator(std::make_unique<NcclTransport>(r, side->rank(), n, side->timeout()), side);
}

const BackendRegistrar registrar{Backend{
    "nccl", "NCCL, one rank per GPU: threads over this process's GPUs, or one process per GPU (cpsim launch)",
    kNcclCapabilities,
    [](int n, std::chrono::milliseconds timeout, const RankNames& names) {
      return std::make_shared<NcclGroup>(n, timeout, names);
    },
    [] { return nccl_backend_unavailable(); },  // NCCL is looked for on first use, not at start
    job_transport,
    [] {
      const int devices = nccl_backend_unavailable() ? cuda_device_count() : rank_device().count();
      return std::pair<int, std::string>{devices, too_many_ranks(devices) + "; NCCL: " + nccl_library_path()};
    }}};

}  // namespace

}  // namespace cpsim::gpu
