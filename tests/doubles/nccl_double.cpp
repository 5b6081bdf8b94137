// A test double of NCCL: the entry points the nccl backend calls, over host memory,
// with NCCL's semantics where cpsim relies on them, plus a host device
// (gpu/nccl_host_device.h) so gpu/nccl.cpp runs on a machine without a GPU.
// Loaded as NCCL: CPSIM_NCCL_LIBRARY=.../libcpsim_nccl_double.so.
//
//   streams      each stream is a thread that runs its queue in order; NCCL calls
//                enqueue there and return at once (ncclSuccess), as NCCL's do; a
//                call then completes when its stream reaches and finishes it.
//   communicators  ranks meet in a shared segment: anonymous shared memory for
//                ncclCommInitAll (threads of one process), a POSIX shared-memory
//                object named by the unique id for ncclCommInitRank (one process a
//                rank: cpsim launch). Collectives move data through one slot per
//                rank in rounds of kChunk bytes, separated by a barrier; sums go in
//                rank order. ncclSend/ncclRecv are point to point: one channel per
//                ordered pair of ranks, so a rank that sends nothing is not
//                involved; ncclGroupStart/End make a rank's sends and receives of
//                one group progress together (a ring shift never deadlocks).
//   errors       ncclCommGetAsyncError reports a failed call (ncclSystemError) or
//                a peer that failed or aborted (ncclRemoteError). ncclCommAbort,
//                from any thread, stops the communicator's queued and running calls
//                and tells the peers.
//   faults       CPSIM_NCCL_DOUBLE_FAULT (or cpsimNcclDoubleInject) lists
//                KIND@RANK:CALL, comma separated: the CALL-th call (1-based, every
//                communicator of this process counted) of communicator rank RANK
//                stalls (until aborted: a peer that stopped inside a collective),
//                fails (an asynchronous error), or exits the process (a killed
//                rank; status 9). Each fault fires once.
//   devices      CPSIM_NCCL_DOUBLE_DEVICES (default 8) host devices, cuda:0..N-1.
#include <fcntl.h>
#include <nccl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu/nccl_host_device.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kChunk = 64 * 1024;

// ---------------------------------------------------------------------------
// Streams and events.

struct HostStream {
  std::mutex m;
  std::condition_variable cv, idle;
  std::deque<std::function<void()>> queue;
  std::uint64_t enqueued = 0;
  std::atomic<std::uint64_t> completed{0};

  HostStream() {
    std::thread([this] { run(); }).detach();  // streams live as long as the process
  }
  void push(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(m);
    queue.push_back(std::move(task));
    ++enqueued;
    cv.notify_one();
  }
  std::uint64_t position() {
    std::lock_guard<std::mutex> lock(m);
    return enqueued;
  }
  bool synchronize(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(m);
    const std::uint64_t target = enqueued;
    return idle.wait_for(lock, limit, [&] { return completed.load() >= target; });
  }
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return !queue.empty(); });
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
      {
        std::lock_guard<std::mutex> lock(m);
        completed.fetch_add(1);
        idle.notify_all();
      }
    }
  }
};

struct HostEvent {
  std::atomic<HostStream*> stream{nullptr};
  std::atomic<std::uint64_t> target{0};
};

int device_count() {
  static const int n = [] {
    const char* v = std::getenv("CPSIM_NCCL_DOUBLE_DEVICES");
    const int d = v && *v ? std::atoi(v) : 8;
    return d > 0 ? d : 8;
  }();
  return n;
}

const cpsimNcclHostDeviceTable kTable{
    CPSIM_NCCL_HOST_DEVICE_ABI, 0,
    [](int) -> void* { return new HostStream; },
    [](void* s, long long timeout_ms) {
      return static_cast<HostStream*>(s)->synchronize(std::chrono::milliseconds(timeout_ms)) ? 0 : 1;
    },
    []() -> void* { return new HostEvent; },
    [](void* e, void* s) {
      auto* ev = static_cast<HostEvent*>(e);
      auto* st = static_cast<HostStream*>(s);
      ev->target.store(st->position());
      ev->stream.store(st);
    },
    [](void* e) -> int {
      auto* ev = static_cast<HostEvent*>(e);
      HostStream* s = ev->stream.load();
      return !s || s->completed.load() >= ev->target.load() ? 1 : 0;
    }};

// ---------------------------------------------------------------------------
// Faults.

enum class Fault { none, stall, fail, exit };
struct FaultSpec {
  Fault kind;
  int rank;
  std::int64_t call;
};

std::mutex faults_mutex;
std::vector<FaultSpec> faults;
std::map<int, std::int64_t> calls_by_rank;
std::atomic<std::int64_t> total_calls{0};

void parse_faults(const char* spec) {
  faults.clear();
  calls_by_rank.clear();
  if (!spec) return;
  std::string s(spec);
  std::size_t at = 0;
  while (at < s.size()) {
    std::size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(at, end - at);
    at = end + 1;
    const std::size_t a = item.find('@'), c = item.find(':');
    if (a == std::string::npos || c == std::string::npos || c < a) {
      std::fprintf(stderr, "nccl double: ignoring fault '%s' (KIND@RANK:CALL)\n", item.c_str());
      continue;
    }
    const std::string kind = item.substr(0, a);
    const Fault f = kind == "stall" ? Fault::stall : kind == "fail" ? Fault::fail : kind == "exit" ? Fault::exit : Fault::none;
    if (f == Fault::none) {
      std::fprintf(stderr, "nccl double: unknown fault kind '%s' (stall, fail, exit)\n", kind.c_str());
      continue;
    }
    faults.push_back({f, std::atoi(item.substr(a + 1, c - a - 1).c_str()), std::atoll(item.substr(c + 1).c_str())});
  }
}

// The environment's faults, read when the library is loaded.
[[maybe_unused]] const bool faults_from_env = (parse_faults(std::getenv("CPSIM_NCCL_DOUBLE_FAULT")), true);

// The fault this call of `rank` carries (counted when it is enqueued).
Fault next_call(int rank) {
  total_calls.fetch_add(1);
  std::lock_guard<std::mutex> lock(faults_mutex);
  const std::int64_t n = ++calls_by_rank[rank];
  for (auto it = faults.begin(); it != faults.end(); ++it)
    if (it->rank == rank && it->call == n) {
      const Fault f = it->kind;
      faults.erase(it);
      return f;
    }
  return Fault::none;
}

// ---------------------------------------------------------------------------
// The shared segment of one communicator.

struct Header {
  std::atomic<std::uint64_t> arrive;  // barrier arrivals, never reset
  std::atomic<std::uint32_t> joined;
  std::atomic<std::int32_t> failed;  // 0, or 1 + the first rank that failed or aborted
};
struct Channel {  // one ordered pair of ranks: at most one chunk in flight
  std::atomic<std::uint64_t> written, read;
  std::uint64_t bytes;
};

std::size_t align(std::size_t n) { return (n + 63) / 64 * 64; }
std::size_t segment_bytes(int n) {
  return align(sizeof(Header)) + n * kChunk + static_cast<std::size_t>(n) * n * (align(sizeof(Channel)) + kChunk);
}

struct Mapping {
  void* base = nullptr;
  std::size_t bytes = 0;
  ~Mapping() {
    if (base) munmap(base, bytes);
  }
};

struct CommState {
  std::shared_ptr<Mapping> map;
  int rank = 0, n = 1;
  std::atomic<bool> aborted{false};
  std::atomic<int> async{ncclSuccess};
  std::uint64_t barriers = 0;  // this rank's barriers so far (its stream's thread only)

  Header* header() const { return static_cast<Header*>(map->base); }
  char* slot(int r) const { return static_cast<char*>(map->base) + align(sizeof(Header)) + r * kChunk; }
  Channel* channel(int from, int to) const {
    char* c = slot(n) + (static_cast<std::size_t>(from) * n + to) * (align(sizeof(Channel)) + kChunk);
    return reinterpret_cast<Channel*>(c);
  }
  char* channel_data(int from, int to) const { return reinterpret_cast<char*>(channel(from, to)) + align(sizeof(Channel)); }

  bool broken() const { return aborted.load() || async.load() != ncclSuccess; }
  void fail(ncclResult_t why) {
    int expected = ncclSuccess;
    async.compare_exchange_strong(expected, why);
    std::int32_t none = 0;
    header()->failed.compare_exchange_strong(none, 1 + rank);
  }

  // Waits for `ready`; false when the communicator is aborted or a peer failed.
  template <class Ready>
  bool wait(Ready ready) {
    for (int spins = 0;; ++spins) {
      if (ready()) return true;
      if (aborted.load()) return false;
      const std::int32_t f = header()->failed.load();
      if (f != 0 && f != 1 + rank) {
        int expected = ncclSuccess;
        async.compare_exchange_strong(expected, ncclRemoteError);
        return false;
      }
      if (spins < 200) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  bool barrier() {
    const std::uint64_t k = ++barriers;
    header()->arrive.fetch_add(1);
    return wait([&] { return header()->arrive.load() >= k * static_cast<std::uint64_t>(n); });
  }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> s;
};

namespace {

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}

template <class T>
void combine(T* acc, const T* x, std::size_t count, ncclRedOp_t op) {
  for (std::size_t i = 0; i < count; ++i) {
    switch (op) {
      case ncclSum: acc[i] = static_cast<T>(acc[i] + x[i]); break;
      case ncclProd: acc[i] = static_cast<T>(acc[i] * x[i]); break;
      case ncclMax: acc[i] = acc[i] < x[i] ? x[i] : acc[i]; break;
      case ncclMin: acc[i] = x[i] < acc[i] ? x[i] : acc[i]; break;
      default: break;
    }
  }
}

// acc op= x over `count` elements of `t`.
bool reduce(void* acc, const void* x, std::size_t count, ncclDataType_t t, ncclRedOp_t op) {
  if (op != ncclSum && op != ncclProd && op != ncclMax && op != ncclMin) return false;
  switch (t) {
    case ncclInt8: combine(static_cast<std::int8_t*>(acc), static_cast<const std::int8_t*>(x), count, op); return true;
    case ncclUint8: combine(static_cast<std::uint8_t*>(acc), static_cast<const std::uint8_t*>(x), count, op); return true;
    case ncclInt32: combine(static_cast<std::int32_t*>(acc), static_cast<const std::int32_t*>(x), count, op); return true;
    case ncclUint32: combine(static_cast<std::uint32_t*>(acc), static_cast<const std::uint32_t*>(x), count, op); return true;
    case ncclInt64: combine(static_cast<std::int64_t*>(acc), static_cast<const std::int64_t*>(x), count, op); return true;
    case ncclUint64: combine(static_cast<std::uint64_t*>(acc), static_cast<const std::uint64_t*>(x), count, op); return true;
    case ncclFloat32: combine(static_cast<float*>(acc), static_cast<const float*>(x), count, op); return true;
    case ncclFloat64: combine(static_cast<double*>(acc), static_cast<const double*>(x), count, op); return true;
    case ncclBfloat16: {
      auto* a = static_cast<std::uint16_t*>(acc);
      const auto* b = static_cast<const std::uint16_t*>(x);
      for (std::size_t i = 0; i < count; ++i) {
        float fa = bf16_to_float(a[i]);
        const float fb = bf16_to_float(b[i]);
        combine(&fa, &fb, 1, op);
        a[i] = float_to_bf16(fa);
      }
      return true;
    }
    default: return false;
  }
}

// Runs `body` on `stream` for communicator `s`, with the fault its call carries.
ncclResult_t enqueue(ncclComm_t comm, cudaStream_t stream, std::function<bool(CommState&)> body) {
  if (!comm || !comm->s) return ncclInvalidArgument;
  if (!stream) return ncclInvalidUsage;  // cpsim always passes its rank stream
  std::shared_ptr<CommState> s = comm->s;
  const Fault fault = next_call(s->rank);
  reinterpret_cast<HostStream*>(stream)->push([s, fault, body = std::move(body)] {
    if (s->broken()) return;
    switch (fault) {
      case Fault::stall:
        while (!s->aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      case Fault::fail: s->fail(ncclSystemError); return;
      case Fault::exit: std::fflush(nullptr); _exit(9);
      case Fault::none: break;
    }
    if (!body(*s) && !s->aborted.load()) {
      int expected = ncclSuccess;
      s->async.compare_exchange_strong(expected, ncclRemoteError);
    }
  });
  return ncclSuccess;
}

// Collectives in rounds of one chunk per rank; `round(s, offset, bytes)` moves
// `bytes` at `offset` of the per-rank payload, between two barriers.
template <class Round>
bool rounds(CommState& s, std::size_t total, std::size_t unit, Round round) {
  const std::size_t step = kChunk / unit * unit;
  for (std::size_t off = 0; off < total || (total == 0 && off == 0); off += step) {
    const std::size_t len = total - off < step ? total - off : step;
    if (!round(off, len, /*phase=*/0) || !s.barrier()) return false;
    if (!round(off, len, /*phase=*/1) || !s.barrier()) return false;
    if (total == 0) break;
  }
  return true;
}

struct P2p {
  bool send;
  void* buf;
  std::size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};
thread_local int group_depth = 0;
thread_local std::vector<P2p> group_ops;

// One rank's sends and receives of a group, progressing together.
bool run_p2p(CommState& s, const std::vector<P2p>& ops) {
  std::vector<std::size_t> done(ops.size(), 0);
  for (const P2p& op : ops)
    if (op.peer < 0 || op.peer >= s.n) return false;
  auto progress = [&] {
    bool all = true, moved = false;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const P2p& op = ops[i];
      if (done[i] == op.bytes) continue;
      all = false;
      Channel* ch = op.send ? s.channel(s.rank, op.peer) : s.channel(op.peer, s.rank);
      char* data = op.send ? s.channel_data(s.rank, op.peer) : s.channel_data(op.peer, s.rank);
      if (op.send && ch->written.load() == ch->read.load()) {
        const std::size_t len = std::min(kChunk, op.bytes - done[i]);
        std::memcpy(data, static_cast<char*>(op.buf) + done[i], len);
        ch->bytes = len;
        ch->written.fetch_add(1);
        done[i] += len;
        moved = true;
      } else if (!op.send && ch->written.load() > ch->read.load()) {
        const std::size_t len = ch->bytes;
        if (len > op.bytes - done[i]) return std::pair{false, false};  // longer than the receive
        std::memcpy(static_cast<char*>(op.buf) + done[i], data, len);
        ch->read.fetch_add(1);
        done[i] += len;
        moved = true;
      }
    }
    return std::pair{all, moved};
  };
  bool failed = false;
  const bool ok = s.wait([&] {
    for (;;) {
      const auto [all, moved] = progress();
      if (all) return true;
      if (moved) continue;
      // A chunk longer than what is left of its receive: invalid usage, not a hang.
      for (std::size_t i = 0; i < ops.size(); ++i) {
        const P2p& op = ops[i];
        if (op.send || done[i] == op.bytes) continue;
        Channel* ch = s.channel(op.peer, s.rank);
        if (ch->written.load() > ch->read.load() && ch->bytes > op.bytes - done[i]) failed = true;
      }
      return failed;
    }
  });
  if (failed) s.fail(ncclInvalidUsage);
  return ok || failed;
}

std::string shm_name(const ncclUniqueId& id) { return std::string("/") + (id.internal + 1); }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const cpsimNcclHostDeviceTable* cpsimNcclHostDevice(void) {
  static const cpsimNcclHostDeviceTable t = [] {
    cpsimNcclHostDeviceTable x = kTable;
    x.devices = device_count();
    return x;
  }();
  return &t;
}

// Replaces the fault list (CPSIM_NCCL_DOUBLE_FAULT's syntax) and restarts the call counts.
__attribute__((visibility("default"))) void cpsimNcclDoubleInject(const char* spec) {
  std::lock_guard<std::mutex> lock(faults_mutex);
  parse_faults(spec);
}
// Every NCCL call enqueued in this process so far.
__attribute__((visibility("default"))) long long cpsimNcclDoubleCalls(void) { return total_calls.load(); }

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (nccl double)";
    case ncclSystemError: return "unhandled system error (nccl double: a call failed)";
    case ncclInternalError: return "internal error (nccl double)";
    case ncclInvalidArgument: return "invalid argument (nccl double)";
    case ncclInvalidUsage: return "invalid usage (nccl double)";
    case ncclRemoteError: return "remote process exited or there was a network error (nccl double: a peer failed or aborted)";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::memset(id, 0, sizeof *id);
  std::random_device rd;
  std::snprintf(id->internal, sizeof id->internal, "!cpsim-nccl-double-%d-%08x%08x", static_cast<int>(getpid()), rd(), rd());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (!comm || nranks < 1 || rank < 0 || rank >= nranks || id.internal[0] != '!') return ncclInvalidArgument;
  const std::string name = shm_name(id);
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return ncclSystemError;
  auto map = std::make_shared<Mapping>();
  map->bytes = segment_bytes(nranks);
  if (ftruncate(fd, static_cast<off_t>(map->bytes)) != 0) {
    close(fd);
    return ncclSystemError;
  }
  map->base = mmap(nullptr, map->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map->base == MAP_FAILED) {
    map->base = nullptr;
    return ncclSystemError;
  }
  auto s = std::make_shared<CommState>();
  s->map = map;
  s->rank = rank;
  s->n = nranks;
  // Blocks until every rank has joined, as NCCL's init does (bounded: a rank that
  // never comes is an error, not a hang).
  const std::uint32_t now = s->header()->joined.fetch_add(1) + 1;
  if (now == static_cast<std::uint32_t>(nranks)) shm_unlink(name.c_str());
  const char* limit_env = std::getenv("CPSIM_NCCL_DOUBLE_INIT_TIMEOUT");
  const auto deadline = Clock::now() + std::chrono::seconds(limit_env && *limit_env ? std::atoi(limit_env) : 300);
  while (s->header()->joined.load() < static_cast<std::uint32_t>(nranks)) {
    if (Clock::now() > deadline) {
      shm_unlink(name.c_str());
      return ncclSystemError;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  *comm = new ncclComm{std::move(s)};
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1 || ndev > device_count()) return ndev > device_count() ? ncclInvalidUsage : ncclInvalidArgument;
  for (int i = 0; devlist && i < ndev; ++i)
    if (devlist[i] < 0 || devlist[i] >= device_count()) return ncclInvalidArgument;
  auto map = std::make_shared<Mapping>();
  map->bytes = segment_bytes(ndev);
  map->base = mmap(nullptr, map->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (map->base == MAP_FAILED) {
    map->base = nullptr;
    return ncclSystemError;
  }
  for (int r = 0; r < ndev; ++r) {
    auto s = std::make_shared<CommState>();
    s->map = map;
    s->rank = r;
    s->n = ndev;
    comms[r] = new ncclComm{std::move(s)};
  }
  static_cast<Header*>(map->base)->joined.store(static_cast<std::uint32_t>(ndev));
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (comm->s) {
    comm->s->aborted.store(true);
    std::int32_t none = 0;
    comm->s->header()->failed.compare_exchange_strong(none, 1 + comm->s->rank);
  }
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (!comm || !comm->s || !error) return ncclInvalidArgument;
  *error = static_cast<ncclResult_t>(comm->s->async.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm || !comm->s || !count) return ncclInvalidArgument;
  *count = comm->s->n;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm || !comm->s || !rank) return ncclInvalidArgument;
  *rank = comm->s->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size) return ncclInvalidArgument;
  const std::size_t bytes = count * size;
  return enqueue(comm, stream, [=](CommState& s) {
    return rounds(s, bytes, 1, [&](std::size_t off, std::size_t len, int phase) {
      if (phase == 0) std::memcpy(s.slot(s.rank), static_cast<const char*>(send) + off, len);
      else
        for (int r = 0; r < s.n; ++r) std::memcpy(static_cast<char*>(recv) + r * bytes + off, s.slot(r), len);
      return true;
    });
  });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size) return ncclInvalidArgument;
  return enqueue(comm, stream, [=](CommState& s) {
    // Each round: elements [i, i+e) of every rank's block d go to slot offset d*e.
    const std::size_t per = kChunk / (static_cast<std::size_t>(s.n) * size);
    if (per == 0) return false;
    std::vector<char> acc;
    for (std::size_t i = 0; i < count; i += per) {
      const std::size_t e = std::min(per, count - i);
      for (int d = 0; d < s.n; ++d)
        std::memcpy(s.slot(s.rank) + d * e * size, static_cast<const char*>(send) + (d * count + i) * size, e * size);
      if (!s.barrier()) return false;
      acc.assign(s.slot(0) + s.rank * e * size, s.slot(0) + (s.rank + 1) * e * size);
      for (int k = 1; k < s.n; ++k)
        if (!reduce(acc.data(), s.slot(k) + s.rank * e * size, e, type, op)) return false;
      std::memcpy(static_cast<char*>(recv) + i * size, acc.data(), e * size);
      if (!s.barrier()) return false;
    }
    return true;
  });
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size) return ncclInvalidArgument;
  return enqueue(comm, stream, [=](CommState& s) {
    std::vector<char> acc;
    bool ok = true;
    return rounds(s, count * size, size, [&](std::size_t off, std::size_t len, int phase) {
             if (phase == 0) {
               std::memcpy(s.slot(s.rank), static_cast<const char*>(send) + off, len);
             } else {
               acc.assign(s.slot(0), s.slot(0) + len);
               for (int k = 1; k < s.n; ++k) ok = ok && reduce(acc.data(), s.slot(k), len / size, type, op);
               // (recv may be send: this chunk of it is already in the slot.)
               if (ok) std::memcpy(static_cast<char*>(recv) + off, acc.data(), len);
             }
             return ok;
           }) && ok;
  });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size) return ncclInvalidArgument;
  return enqueue(comm, stream, [=](CommState& s) {
    if (root < 0 || root >= s.n) return false;
    return rounds(s, count * size, 1, [&](std::size_t off, std::size_t len, int phase) {
      if (phase == 0 && s.rank == root) std::memcpy(s.slot(root), static_cast<const char*>(send) + off, len);
      if (phase == 1) std::memmove(static_cast<char*>(recv) + off, s.slot(root), len);
      return true;
    });
  });
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  std::vector<P2p> ops;
  ops.swap(group_ops);
  // One task per communicator, on the stream of its first call.
  while (!ops.empty()) {
    const ncclComm_t comm = ops.front().comm;
    const cudaStream_t stream = ops.front().stream;
    std::vector<P2p> mine, rest;
    for (const P2p& op : ops) (op.comm == comm ? mine : rest).push_back(op);
    ops.swap(rest);
    const ncclResult_t r = enqueue(comm, stream, [mine](CommState& s) { return run_p2p(s, mine); });
    if (r != ncclSuccess) return r;
  }
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size || !comm) return ncclInvalidArgument;
  const P2p op{true, const_cast<void*>(send), count * size, peer, comm, stream};
  if (group_depth > 0) {
    group_ops.push_back(op);
    return ncclSuccess;
  }
  return enqueue(comm, stream, [op](CommState& s) { return run_p2p(s, {op}); });
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t size = type_size(type);
  if (!size || !comm) return ncclInvalidArgument;
  const P2p op{false, recv, count * size, peer, comm, stream};
  if (group_depth > 0) {
    group_ops.push_back(op);
    return ncclSuccess;
  }
  return enqueue(comm, stream, [op](CommState& s) { return run_p2p(s, {op}); });
}

}  // extern "C"
