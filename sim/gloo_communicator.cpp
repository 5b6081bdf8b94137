#include "sim/gloo_communicator.hpp"

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/comm/registry.hpp"
#include "core/reduce.hpp"
#include "sim/world.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Stores and devices.

std::shared_ptr<Store> open_store(const std::string& spec) {
  if (spec == "memory") return std::make_shared<gloo::rendezvous::HashStore>();
  if (spec.rfind("file:", 0) == 0) {
    const std::string dir = spec.substr(5);
    if (dir.empty()) CPSIM_INVALID("store '", spec, "': file: needs a directory, as in file:/shared/cpsim-job");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (!std::filesystem::is_directory(dir)) CPSIM_INVALID("store '", spec, "': cannot create directory ", dir);
    return std::make_shared<gloo::rendezvous::FileStore>(dir);
  }
  if (spec.rfind("redis://", 0) == 0) {
    const std::string rest = spec.substr(8);
    const auto colon = rest.rfind(':');
    std::string host = rest;
    int port = 6379;
    if (colon != std::string::npos) {
      host = rest.substr(0, colon);
      try {
        std::size_t used = 0;
        port = std::stoi(rest.substr(colon + 1), &used);
        if (used != rest.size() - colon - 1 || port <= 0 || port > 65535) throw std::invalid_argument("port");
      } catch (const std::exception&) {
        CPSIM_INVALID("store '", spec, "': the port must be a number from 1 to 65535");
      }
    }
    if (host.empty()) CPSIM_INVALID("store '", spec, "': redis:// needs a host, as in redis://10.0.0.1:6379");
    try {
      return std::make_shared<gloo::rendezvous::RedisStore>(host, port);
    } catch (const std::exception& e) {
      throw CollectiveError("cannot reach the Redis store at " + host + ":" + std::to_string(port) + ": " + e.what());
    }
  }
  CPSIM_INVALID("store '", spec, "': expected file:DIR or redis://HOST:PORT");
}

bool store_has(Store& store, const std::string& key) {
  try {
    store.wait({key}, 1ms);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& host) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<gloo::transport::Device>> devices;
  gloo::transport::tcp::attr attr;
  std::string key = host;
  if (!host.empty()) {
    attr.hostname = host;
  } else if (const char* h = std::getenv("CPSIM_GLOO_HOST"); h && *h) {
    attr.hostname = h;
    key = h;
  } else if (const char* i = std::getenv("CPSIM_GLOO_IFNAME"); i && *i) {
    attr.iface = i;
    key = std::string("iface:") + i;
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto& device = devices[key];
  if (!device) {
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw CollectiveError("cannot open a Gloo TCP device on '" + (key.empty() ? "this host's name" : key) +
                            "' (set CPSIM_GLOO_HOST or CPSIM_GLOO_IFNAME): " + e.what());
    }
  }
  return device;
}

namespace {

// The records cpsim launch wrote for dead processes among ranks [0, size), one per line.
std::string launch_records(Store& records, int size, int except) {
  std::string died;
  for (int q = 0; q < size; ++q) {
    if (q == except || !store_has(records, "failed/" + std::to_string(q))) continue;
    try {
      const auto v = records.get("failed/" + std::to_string(q));
      const std::string line(v.begin(), v.end());
      if (line.find(kLaunchRecordTag) != std::string::npos) died += "\n  " + line;
    } catch (const std::exception&) {
    }
  }
  return died;
}

// Every rank announces itself, then waits for the others, watching the failure
// records: a peer that died before it came is named at once, not after the timeout.
void await_peers(int rank, int size, Store& store, Store& records, std::chrono::milliseconds timeout) {
  const std::string me = "present/" + std::to_string(rank);
  store.set(me, std::vector<char>{'1'});
  const auto deadline = Clock::now() + timeout;
  std::vector<bool> here(size, false);
  here[rank] = true;
  for (;;) {
    std::vector<int> missing;
    for (int q = 0; q < size; ++q)
      if (!here[q] && !(here[q] = store_has(store, "present/" + std::to_string(q)))) missing.push_back(q);
    if (missing.empty()) return;
    const std::string died = launch_records(records, size, rank);
    std::string names;
    for (int q : missing) names += (names.empty() ? "" : ", ") + std::to_string(q);
    if (!died.empty())
      throw CollectiveError("rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " could not connect: rank" + (missing.size() > 1 ? "s " : " ") + names +
                            " never came" + died);
    if (Clock::now() >= deadline)
      throw CollectiveError("rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " could not connect to its peers within " + std::to_string(timeout.count()) +
                            " ms: rank" + (missing.size() > 1 ? "s " : " ") + names + " never came");
    std::this_thread::sleep_for(10ms);
  }
}

}  // namespace

std::shared_ptr<gloo::Context> connect_gloo(int rank, int size, Store& store,
                                            const std::shared_ptr<gloo::transport::Device>& device,
                                            std::chrono::milliseconds timeout, Store* records) {
  // Writing to a peer that died must fail the write, not kill this process.
  static std::once_flag sigpipe;
  std::call_once(sigpipe, [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
  });
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  auto dev = device;
  try {
    if (records) await_peers(rank, size, store, *records, timeout);
    context->connectFullMesh(store, dev);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const bool stale = what.find("already set") != std::string::npos;
    throw CollectiveError("rank " + std::to_string(rank) + " of " + std::to_string(size) +
                          (stale ? " found the keys of an earlier run in the store; give every run its own "
                                   "CPSIM_JOB_ID or store directory"
                                 : " could not connect to its peers within " + std::to_string(timeout.count()) + " ms") +
                          " (gloo: " + what + ")" + (records ? launch_records(*records, size, rank) : ""));
  }
  return context;
}

// ---------------------------------------------------------------------------
// The call exchange.

namespace {

// Every sum is a rank-order sum over gathered contributions: bitwise threads.
constexpr Capabilities kGlooCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/false,
                                         /*stream_ordered=*/false};

// Slots outside the ranges Gloo's own collectives use (prefix << 56 | tag).
constexpr std::uint64_t kCallSlot = 0xC5ull << 56 | 1;
constexpr std::uint64_t kPointToPointSlot = 0xC5ull << 56 | 2;

// A call record as it travels: fixed size, no pointers.
struct Wire {
  std::uint8_t status = 0, kind = 0, dtype = 0, pad = 0;
  std::int32_t root = -1, dst = -1, src = -1;
  std::uint64_t seq = 0, count = 0, recv_count = 0;
  char text[200] = {};
};
static_assert(std::is_trivially_copyable_v<Wire>);

Wire to_wire(const CallRecord& c, GlooRank::Status status, const std::string& text) {
  Wire w;
  w.status = static_cast<std::uint8_t>(status);
  w.kind = static_cast<std::uint8_t>(c.kind);
  w.dtype = static_cast<std::uint8_t>(c.dtype);
  w.root = c.root, w.dst = c.dst, w.src = c.src;
  w.seq = c.seq, w.count = c.count, w.recv_count = c.recv_count;
  std::strncpy(w.text, text.c_str(), sizeof(w.text) - 1);
  return w;
}

CallRecord from_wire(const Wire& w) {
  CallRecord c;
  c.kind = static_cast<CollectiveKind>(w.kind);
  c.dtype = static_cast<DType>(w.dtype);
  c.root = w.root, c.dst = w.dst, c.src = w.src;
  c.seq = w.seq, c.count = w.count, c.recv_count = w.recv_count;
  return c;
}

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  return std::max(1ms, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

// "in all_gather #3 (...)", "returned (after 2 calls)" or "threw: ...".
std::string state_of(const CallRecord& c, GlooRank::Status status, const std::string& text) {
  switch (status) {
    case GlooRank::Status::call: return "in " + describe_call(c);
    case GlooRank::Status::returned: return "returned (after " + std::to_string(c.seq - 1) + " calls)";
    case GlooRank::Status::threw: return "threw: " + text;
  }
  return "?";
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int q : ranks) s += (s.empty() ? "" : ", ") + std::to_string(q);
  return s;
}

}  // namespace

GlooRank::GlooRank(std::shared_ptr<gloo::Context> context, int rank, int size, std::shared_ptr<Store> records,
                   std::chrono::milliseconds timeout, bool processes)
    : context_(std::move(context)),
      rank_(rank),
      size_(size),
      records_(std::move(records)),
      timeout_(timeout),
      processes_(processes) {
  CPSIM_ENFORCE(size_ == 1 || context_, "a Gloo group of ", size_, " ranks needs a context");
}

GlooRank::~GlooRank() = default;

void GlooRank::begin(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  seq_ = 0;
  stopped_.clear();
}

std::string GlooRank::records_of(const std::vector<int>& suspects, std::chrono::milliseconds timeout) {
  if (!records_ || suspects.empty()) return "";
  // A peer writes its record before it closes its connections, and cpsim launch
  // writes one for a process that died; give them a moment to land, and wait the
  // whole moment for launch's record, which names the process that died.
  //
  // The rank that died need not be a suspect: this rank may have heard from it
  // before it died and lost only a peer that lost it too (whose record says so).
  // So launch's records are read for every rank of the group, the suspects'
  // own records only for them.
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(timeout, 2000ms);
  for (;;) {
    std::string died, lost;  // records cpsim launch wrote for dead processes come first
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const bool suspect = std::find(suspects.begin(), suspects.end(), q) != suspects.end();
      if (!suspect && !processes_) continue;  // in-process ranks are never killed alone
      const std::string key = "failed/" + std::to_string(q);
      if (!store_has(*records_, key)) continue;
      try {
        const auto v = records_->get(key);
        const std::string line(v.begin(), v.end());
        if (line.find(kLaunchRecordTag) != std::string::npos) died += "\n  " + line;
        else if (suspect) lost += "\n  " + line;
      } catch (const std::exception&) {
      }
    }
    // Peers' records only say they lost someone too; the root cause is worth the wait.
    if (!died.empty() || (!lost.empty() && (!processes_ || Clock::now() >= deadline))) return died + lost;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(20ms);
  }
  return "\n  no failure record from rank" + std::string(suspects.size() > 1 ? "s " : " ") + rank_list(suspects) +
         " (killed, crashed, or stuck outside cpsim)";
}

void GlooRank::break_group(const std::string& why, const std::vector<int>& suspects,
                           std::chrono::milliseconds timeout) {
  // Record first, so peers that lose their connection to this rank can name it.
  if (records_) {
    try {
      const std::string line = why.substr(0, why.find('\n'));
      records_->set("failed/" + std::to_string(rank_), std::vector<char>(line.begin(), line.end()));
    } catch (const std::exception&) {
    }
  }
  broken_ = why + records_of(suspects, timeout);
  if (context_) {
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
    }
  }
  throw CollectiveError(broken_);
}

std::vector<CallRecord> GlooRank::exchange(const CallRecord& mine, Status status, const std::string& text,
                                           std::chrono::milliseconds timeout) {
  if (!broken_.empty()) throw CollectiveError("group broken by an earlier failure: " + broken_);
  if (!stopped_.empty()) throw CollectiveError(stopped_);
  CallRecord me = mine;
  me.seq = ++seq_;
  std::vector<CallRecord> calls(size_);
  std::vector<Status> statuses(size_, Status::call);
  std::vector<std::string> texts(size_);
  calls[rank_] = me;
  statuses[rank_] = status;
  texts[rank_] = text;
  if (size_ > 1) {
    Wire out = to_wire(me, status, text);
    std::vector<Wire> in(size_);
    std::vector<bool> arrived(size_, false);
    arrived[rank_] = true;
    auto send = context_->createUnboundBuffer(&out, sizeof(Wire));
    auto recv = context_->createUnboundBuffer(in.data(), sizeof(Wire) * size_);
    const auto deadline = Clock::now() + timeout;
    try {
      for (int q = 0; q < size_; ++q)
        if (q != rank_) recv->recv(q, kCallSlot, q * sizeof(Wire), sizeof(Wire));
      for (int q = 0; q < size_; ++q)
        if (q != rank_) send->send(q, kCallSlot);
      for (int i = 1; i < size_; ++i) {
        int src = -1;
        recv->waitRecv(&src, remaining(deadline));
        if (src >= 0 && src < size_) arrived[src] = true;
      }
      for (int i = 1; i < size_; ++i) send->waitSend(remaining(deadline));
    } catch (const std::exception& e) {
      std::vector<int> missing;
      std::ostringstream states;
      for (int q = 0; q < size_; ++q) {
        states << "\n  rank " << q << ": ";
        if (q == rank_) states << state_of(me, status, text);
        else if (arrived[q])
          states << state_of(from_wire(in[q]), static_cast<Status>(in[q].status),
                             std::string(in[q].text, strnlen(in[q].text, sizeof(in[q].text))));
        else {
          missing.push_back(q);
          states << "not in a collective (never arrived at " << collective_name(me.kind) << " #" << me.seq << ")";
        }
      }
      const std::string what = e.what();
      const bool timed_out = is_gloo_timeout(what) || Clock::now() >= deadline;
      std::string why;
      if (timed_out)
        why = "timeout: rank " + std::to_string(rank_) + " waited " + std::to_string(timeout.count()) + " ms in " +
              describe_call(me) + " for ranks that never arrived: " + rank_list(missing);
      else
        why = "rank " + std::to_string(rank_) + " lost its connection to rank" + (missing.size() > 1 ? "s " : " ") +
              rank_list(missing) + " in " + describe_call(me) + " (gloo: " + what + ")";
      break_group(why + states.str(), missing, timeout);
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      calls[q] = from_wire(in[q]);
      statuses[q] = static_cast<Status>(in[q].status);
      texts[q] = std::string(in[q].text, strnlen(in[q].text, sizeof(in[q].text)));
    }
  }
  int threw = -1, returned = -1, waiting = -1;
  for (int q = 0; q < size_; ++q) {
    if (statuses[q] == Status::threw && threw < 0) threw = q;
    if (statuses[q] == Status::returned && returned < 0) returned = q;
    if (statuses[q] == Status::call && waiting < 0) waiting = q;
  }
  auto states = [&] {
    std::ostringstream os;
    for (int q = 0; q < size_; ++q) {
      os << "\n  rank " << q << ": " << state_of(calls[q], statuses[q], texts[q]);
    }
    return os.str();
  };
  std::string why;
  if (threw >= 0 || returned >= 0) {
    if (waiting < 0) return calls;  // every rank has stopped: nobody waits
    const CallRecord& w = calls[waiting];
    const std::string joining = std::string(collective_name(w.kind)) + " #" + std::to_string(w.seq) +
                                " that rank " + std::to_string(waiting) + " waits in";
    why = threw >= 0 ? "rank " + std::to_string(threw) + " threw: " + texts[threw] + " (instead of joining " + joining + ")"
                     : "rank " + std::to_string(returned) + " returned without joining " + joining;
  } else if (auto mismatch = find_mismatch(calls)) {
    why = "collective mismatch: " + *mismatch;
  } else {
    return calls;
  }
  stopped_ = why + states();
  throw CollectiveError(stopped_);
}

void GlooRank::finish() {
  if (!broken_.empty() || !stopped_.empty()) return;
  exchange(CallRecord{}, Status::returned, "", timeout_);
}

void GlooRank::fail(const std::string& what) noexcept {
  if (!broken_.empty() || !stopped_.empty()) return;
  try {
    exchange(CallRecord{}, Status::threw, what, timeout_);
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------
// The communicator.

namespace {

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<GlooRank> g) : g_(std::move(g)) {}
  int rank() const override { return g_->rank(); }
  int size() const override { return g_->size(); }
  std::chrono::milliseconds timeout() const override { return g_->timeout(); }
  std::string backend_name() const override { return "gloo"; }
  Capabilities capabilities() const override { return kGlooCapabilities; }

  void all_gather(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = checked({CollectiveKind::all_gather, 0, count, dt}, t);
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0) return;
    if (size() == 1) {
      std::memcpy(recv, send, bytes);
      return;
    }
    g_->transport(c, [&] { gather_bytes(send, recv, bytes, t); });
  }

  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = checked({CollectiveKind::reduce_scatter, 0, count, dt}, t);
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0) return;
    if (size() == 1) {
      std::memcpy(recv, send, bytes);
      return;
    }
    // Every rank's slice for this rank arrives (alltoall), then adds up in rank order.
    std::vector<std::uint8_t> parts(bytes * size());
    g_->transport(c, [&] {
      gloo::AlltoallOptions opts(g_->context_ptr());
      opts.setInput(const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(send)), bytes * size());
      opts.setOutput(parts.data(), parts.size());
      opts.setTimeout(t);
      gloo::alltoall(opts);
    });
    sum_parts(parts, recv, count, dt);
  }

  void all_reduce(void* buf, std::size_t count, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = checked({CollectiveKind::all_reduce, 0, count, dt}, t);
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0 || size() == 1) return;
    std::vector<std::uint8_t> parts(bytes * size());
    g_->transport(c, [&] { gather_bytes(buf, parts.data(), bytes, t); });
    sum_parts(parts, buf, count, dt);
  }

  void send_recv(const SendRecv& step, DType dt, CallOptions o) override {
    const auto t = g_->pick(o);
    const CallRecord c = checked(send_recv_record(step, dt), t);
    const void* send = step.send;
    void* recv = step.recv;
    const int dst = step.dst, src = step.src;
    const std::size_t send_bytes = c.count * dtype_size(dt), recv_bytes = c.recv_count * dtype_size(dt);
    if (size() == 1) {  // the only pairing with one rank is with itself
      if (recv_bytes) std::memcpy(recv, send, recv_bytes);
      return;
    }
    g_->transport(c, [&] {
      std::unique_ptr<gloo::transport::UnboundBuffer> out, in;
      if (dst >= 0 && send_bytes) {
        out = g_->context().createUnboundBuffer(const_cast<void*>(send), send_bytes);
        out->send(dst, kPointToPointSlot);
      }
      if (src >= 0 && recv_bytes) {
        in = g_->context().createUnboundBuffer(recv, recv_bytes);
        in->recv(src, kPointToPointSlot);
      }
      if (in) in->waitRecv(t);
      if (out) out->waitSend(t);
    });
  }

  void broadcast(void* buf, std::size_t count, DType dt, int root, CallOptions o) override {
    const auto t = g_->pick(o);
    CallRecord r{CollectiveKind::broadcast, 0, count, dt};
    r.root = root;
    const CallRecord c = checked(r, t);
    const std::size_t bytes = count * dtype_size(dt);
    if (bytes == 0 || size() == 1) return;
    g_->transport(c, [&] {
      gloo::BroadcastOptions opts(g_->context_ptr());
      opts.setOutput(static_cast<std::uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTimeout(t);
      gloo::broadcast(opts);
    });
  }

  // The call exchange is an all-to-all barrier.
  void barrier(CallOptions o) override { checked(CallRecord{CollectiveKind::barrier}, g_->pick(o)); }

 private:
  CallRecord checked(const CallRecord& c, std::chrono::milliseconds t) {
    return g_->exchange(c, GlooRank::Status::call, "", t)[g_->rank()];
  }
  void gather_bytes(const void* send, void* recv, std::size_t bytes, std::chrono::milliseconds t) {
    gloo::AllgatherOptions opts(g_->context_ptr());
    opts.setInput(const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(send)), bytes);
    opts.setOutput(static_cast<std::uint8_t*>(recv), bytes * size());
    opts.setTimeout(t);
    gloo::allgather(opts);
  }
  void sum_parts(const std::vector<std::uint8_t>& parts, void* out, std::size_t count, DType dt) {
    const std::size_t bytes = count * dtype_size(dt);
    std::vector<const void*> srcs;
    for (int q = 0; q < size(); ++q) srcs.push_back(parts.data() + q * bytes);
    sum_in_order(dt, out, srcs.data(), srcs.size(), count);
  }
  std::shared_ptr<GlooRank> g_;
};

}  // namespace

std::unique_ptr<Communicator> GlooRank::communicator() {
  return std::make_unique<GlooCommunicator>(shared_from_this());
}

// ---------------------------------------------------------------------------
// In-process groups and their pool.

GlooThreadsGroup::GlooThreadsGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), connect_timeout_(timeout), store_(open_store("memory")), ranks_(size) {
  CPSIM_ENFORCE(size >= 1, "a group needs at least one rank");
}

GlooThreadsGroup::~GlooThreadsGroup() = default;

std::unique_ptr<Communicator> GlooThreadsGroup::communicator(int rank, std::chrono::milliseconds timeout) {
  CPSIM_ENFORCE(rank >= 0 && rank < size_, "rank ", rank, " of ", size_);
  if (!ranks_[rank]) {
    std::shared_ptr<gloo::Context> context;
    if (size_ > 1) context = connect_gloo(rank, size_, *store_, gloo_device("127.0.0.1"), connect_timeout_);
    ranks_[rank] = std::make_shared<GlooRank>(context, rank, size_, store_, timeout, false);
  }
  ranks_[rank]->begin(timeout);
  return ranks_[rank]->communicator();
}

void GlooThreadsGroup::finish(int rank) {
  if (ranks_[rank]) ranks_[rank]->finish();
}

void GlooThreadsGroup::fail(int rank, const std::string& what) {
  if (ranks_[rank]) ranks_[rank]->fail(what);
}

bool GlooThreadsGroup::broken() const {
  for (const auto& r : ranks_)
    if (!r || r->broken()) return true;
  return false;
}

namespace {

// Idle groups, most recently used last. An in-process group of n ranks holds
// n(n-1) socket descriptors (both ends of every pair live here), so the pool keeps
// at most a quarter of this process's descriptor limit and closes the least
// recently used groups beyond it.
std::mutex pool_mutex;
std::vector<std::shared_ptr<GlooThreadsGroup>> pool;

std::size_t descriptors(const GlooThreadsGroup& g) { return static_cast<std::size_t>(g.size()) * (g.size() - 1) + 1; }

std::size_t descriptor_budget() {
  static const std::size_t budget = [] {
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return std::size_t{256};
    if (lim.rlim_cur < lim.rlim_max) {  // take what the system allows: groups of 16 ranks need 240 each
      rlimit raised = lim;
      raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? std::max<rlim_t>(lim.rlim_cur, 65536) : lim.rlim_max;
      if (setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
    }
    return static_cast<std::size_t>(std::min<rlim_t>(lim.rlim_cur, 1 << 20) / 4);
  }();
  return budget;
}

}  // namespace

std::shared_ptr<GlooThreadsGroup> acquire_gloo_group(int n, std::chrono::milliseconds timeout) {
  descriptor_budget();
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    for (auto it = pool.rbegin(); it != pool.rend(); ++it) {
      if ((*it)->size() != n) continue;
      auto group = *it;
      pool.erase(std::next(it).base());
      return group;
    }
  }
  return std::make_shared<GlooThreadsGroup>(n, timeout);
}

void release_gloo_group(const std::shared_ptr<GlooThreadsGroup>& group) {
  if (group->broken()) return;  // its contexts close with it; the next run connects anew
  std::vector<std::shared_ptr<GlooThreadsGroup>> closing;  // closed outside the lock
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool.push_back(group);
  std::size_t held = 0;
  for (const auto& g : pool) held += descriptors(*g);
  while (held > descriptor_budget() && pool.size() > 1) {
    held -= descriptors(*pool.front());
    closing.push_back(pool.front());
    pool.erase(pool.begin());
  }
}

namespace {

// The pool hands a group to one run and takes it back when the run is done.
class PooledGlooGroup final : public Group {
 public:
  PooledGlooGroup(int n, std::chrono::milliseconds timeout) : group_(acquire_gloo_group(n, timeout)), timeout_(timeout) {}
  std::unique_ptr<Communicator> communicator(int rank) override { return group_->communicator(rank, timeout_); }
  void finish(int rank) override { group_->finish(rank); }
  void fail(int rank, const std::string& what) override { group_->fail(rank, what); }
  void done() override { release_gloo_group(group_); }

 private:
  std::shared_ptr<GlooThreadsGroup> group_;
  std::chrono::milliseconds timeout_;
};

const BackendRegistrar registrar{Backend{
    "gloo", "real Gloo over TCP: ranks as threads on loopback, or processes of a job (cpsim launch)",
    kGlooCapabilities,
    [](int n, std::chrono::milliseconds timeout) { return std::make_shared<PooledGlooGroup>(n, timeout); },
    [] { return std::optional<std::string>(); },
    [](int n, const RankFn& fn, std::chrono::milliseconds timeout, const RankOutputs& outputs) {
      if (!current_world()) return false;
      run_in_world(n, fn, timeout, outputs);
      return true;
    }}};

}  // namespace

}  // namespace cpsim::sim
