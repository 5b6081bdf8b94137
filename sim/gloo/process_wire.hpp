// Point to point between the processes of a job, over a group's Gloo context
// (the wire slots of sim/gloo/protocol.hpp): a send writes a header (tag,
// dtype, count, the sender's call site) and the bytes; a thread of each process
// takes every message that comes, from any peer, into the process's mailbox
// (core/comm/point_to_point.hpp), where its receives match them as between
// threads (any order, sizes checked, timeouts named).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/comm/point_to_point.hpp"
#include "sim/gloo/gloo.hpp"

namespace gloo::transport {
class UnboundBuffer;
}

namespace cpsim::sim {

class ProcessWire {
 public:
  // rank: this process's rank of the group; ranks: the job ranks of the group's
  // ranks (what the mailbox numbers them by).
  ProcessWire(const GlooRank& rank, std::vector<int> ranks, std::shared_ptr<Mailbox> mailbox,
              std::chrono::milliseconds timeout);
  ~ProcessWire();
  ProcessWire(const ProcessWire&) = delete;
  ProcessWire& operator=(const ProcessWire&) = delete;

  // To job rank dst; returns once the message left (throws CollectiveError when
  // it does not leave within the timeout).
  void send(int dst, int tag, const Mailbox::Message& m);

 private:
  void take();  // every message from any peer, into the mailbox, until the group ends

  std::shared_ptr<gloo::Context> context_;
  std::vector<int> ranks_;
  int me_;
  std::shared_ptr<Mailbox> mailbox_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace cpsim::sim
