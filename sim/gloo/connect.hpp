// Devices and connections of the gloo backend (connect.cpp), and the
// scheduling its threads run under (docs/backends.md, "Gloo").
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sim/gloo/store.hpp"

namespace gloo {
class Context;
namespace transport {
class Device;
}
}  // namespace gloo

namespace cpsim::sim {

// The TCP device ranks listen on. `host` is an address or host name to bind; empty
// means CPSIM_GLOO_HOST, else the interface CPSIM_GLOO_IFNAME, else this host's name.
std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& host);

// Connects rank `rank` of `size` through `store` (every rank calls it with the
// same store contents); throws CollectiveError if peers do not come in time.
// With `records` (the job's failure records, process mode), ranks first announce
// themselves and a peer that cpsim launch saw die is named at once.
// The first call ignores SIGPIPE if nothing handles it, so that a dead peer is
// an error on the write, not the end of this process.
std::shared_ptr<gloo::Context> connect_gloo(int rank, int size, Store& store,
                                            const std::shared_ptr<gloo::transport::Device>& device,
                                            std::chrono::milliseconds timeout, Store* records = nullptr);

// Gloo's threads and the threads that call Gloo run under SCHED_BATCH (Linux),
// which never preempts a running thread when it wakes up. Gloo's TCP loop thread
// handles a socket only when it gets the connection's lock (try_lock), and spins
// on the readable socket while it cannot; when ranks outnumber cores, a wakeup
// that preempted the thread holding that lock (a rank in a send) left the loop
// spinning for the rest of a time slice. Measured on 2 cores, 4 processes, 8-byte
// all_gather: 6.1 ms a call and 1.6 cores of system time; 0.2 ms with every Gloo
// thread under SCHED_BATCH (docs/backends.md).
//
// enter_batch_scheduling: the calling thread runs under SCHED_BATCH from now on
// (a thread under another policy than SCHED_OTHER is left as it is); true when
// this call switched it. A process that is a rank of a job keeps it; an
// in-process rank thread, shared with other backends, leaves it when its run ends
// (leave_batch_scheduling). Switching at every call instead cost half the gain.
bool enter_batch_scheduling();
void leave_batch_scheduling();
// Leaves batch scheduling when it ends, if `leave`.
struct BatchScope {
  bool leave;
  ~BatchScope() {
    if (leave) leave_batch_scheduling();
  }
};

}  // namespace cpsim::sim
