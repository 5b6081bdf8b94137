// Devices and connections: the TCP device ranks listen on, and the full mesh of a
// group, after every rank has announced itself.
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include <sched.h>
#include <signal.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "core/comm/call_check.hpp"
#include "core/error.hpp"
#include "sim/gloo/connect.hpp"
#include "sim/gloo/store.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {
// This thread's choice, made at its first Gloo call (no system call after it).
enum class Batch : unsigned char { undecided, entered, left_alone };
thread_local Batch batch = Batch::undecided;
}  // namespace

bool enter_batch_scheduling() {
  if (batch != Batch::undecided) return false;
  batch = Batch::left_alone;
#ifdef SCHED_BATCH
  const sched_param none{};
  if (sched_getscheduler(0) == SCHED_OTHER && sched_setscheduler(0, SCHED_BATCH, &none) == 0) batch = Batch::entered;
#endif
  return batch == Batch::entered;
}

void leave_batch_scheduling() {
#ifdef SCHED_BATCH
  const sched_param none{};
  if (batch == Batch::entered) sched_setscheduler(0, SCHED_OTHER, &none);
#endif
  batch = Batch::undecided;
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
      // The device's loop thread inherits the policy; this thread goes back to its own.
      const BatchScope inherit{enter_batch_scheduling()};
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw Aborted("cannot open a Gloo TCP device on '" + (key.empty() ? "this host's name" : key) +
                            "' (set CPSIM_GLOO_HOST or CPSIM_GLOO_IFNAME): " + e.what());
    }
  }
  return device;
}

namespace {
// Every rank announces itself, then waits for the others, watching the failure
// records: a peer that died before it came is named at once, not after the timeout.
void await_peers(int rank, int size, Store& store, Store& records, std::chrono::milliseconds timeout) {
  const std::string me = "present/" + std::to_string(rank);
  store.set(me, std::vector<char>{'1'});
  const auto start = Clock::now(), deadline = start + timeout;
  std::vector<bool> here(size, false);
  here[rank] = true;
  for (;;) {
    std::vector<int> missing;
    for (int q = 0; q < size; ++q)
      if (!here[q] && !(here[q] = store_has(store, "present/" + std::to_string(q)))) missing.push_back(q);
    if (missing.empty()) return;
    const std::string died = launch_records(records, size, rank);
    if (!died.empty())
      throw Aborted("rank " + std::to_string(rank) + " of " + std::to_string(size) + " could not connect: " +
                    name_ranks(missing) + " never came" + died);
    if (Clock::now() >= deadline)
      throw Aborted("rank " + std::to_string(rank) + " of " + std::to_string(size) + " " + waited_since(start, timeout) +
                    " to connect: " + name_ranks(missing) + " never came");
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
  const auto start = Clock::now();
  try {
    if (records) await_peers(rank, size, store, *records, timeout);
    context->connectFullMesh(store, dev);
  } catch (const Aborted&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const bool stale = what.find("already set") != std::string::npos;
    throw Aborted("rank " + std::to_string(rank) + " of " + std::to_string(size) +
                          (stale ? " found the keys of an earlier run in the store; give every run its own "
                                   "CPSIM_JOB_ID or store directory"
                                 : " could not connect to its peers: " + waited_since(start, timeout)) +
                          " (gloo: " + what + ")" + (records ? launch_records(*records, size, rank) : ""));
  }
  return context;
}

}  // namespace cpsim::sim
