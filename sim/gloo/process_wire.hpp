// Point to point between the processes of a job, over a group's Gloo context
// (the wire slots of sim/gloo/protocol.hpp). Three kinds of message, each a
// header and maybe bytes: a send (tag, dtype, count, the sender's call site, the
// bytes); a receipt (a receive took send #seq: the sender's blocking send
// returns, as on Gloo and NCCL); a rank's end (it returned, or threw: its
// peers' receives from it end at once, and a peer that has every end knows every
// message came); and a rank's state while it waits in point to point (what for,
// and its counts: the mailbox names a deadlock between processes from them). A thread of each process takes whatever comes, from any peer,
// into the process's mailbox (core/comm/point_to_point.hpp), where receives
// match as between threads (any order, sizes checked, timeouts named). Messages
// of one peer come in the order it sent them (one connection each), so its end
// comes after its last message.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/point_to_point.hpp"
#include "sim/gloo/rank.hpp"

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
  // Tells job rank dst that a receive here took its send #seq.
  void receipt(int dst, int seq);
  // Tells every peer this rank's program ended: "returned", or "threw: ..." (failed).
  void ended(const std::string& how, bool failed);
  // Tells every peer what this rank does in point to point (Mailbox::Publish).
  void state(const Mailbox::State& s);
  // Waits until every peer's end came (or the timeout, or the connections
  // closed): every message and notice sent here has then been taken. A rank
  // calls it before its wire goes (the wire takes until then), so that no
  // peer's notice waits for a taker that is gone.
  void wait_for_ends();

 private:
  void take();  // every message from any peer, into the mailbox, until the group ends
  // What comes first of every message: its kind, its numbers, and the slot its
  // bytes come on (wire_payload_slot(payload), when nbytes > 0).
  enum class Kind : std::int64_t { send = 0, receipt = 1, end = 2, state = 3 };
  struct Header {
    Kind kind = Kind::send;
    std::int64_t tag = 0, numel = 0, nbytes = 0, seq = 0, payload = 0;
    char dtype[24] = {};
    char site[96] = {};
  };
  // One header, and `bytes` when there are any, to group rank `peer`, each
  // send waited for at most the timeout (a message and a notice alike). The
  // header and its bytes are posted together (one lock), the bytes on a slot of
  // their own.
  void put(int peer, Header header, const std::uint8_t* bytes, std::size_t nbytes);
  // Receipts and ends leave from a thread of their own: take() never waits on a
  // send (three processes whose take threads each sent a receipt round a ring,
  // each waiting for the next to take it, would wait in a circle).
  struct Notice {
    int peer;
    Header header;
    std::vector<std::uint8_t> bytes;
  };
  void notify(Notice n);  // queues it
  void notify_peers(const Header& header, const std::vector<std::uint8_t>& bytes);
  int peer_of(int rank) const;  // the group rank of job rank `rank`, or -1
  void send_notices();

  std::shared_ptr<gloo::Context> context_;
  std::vector<int> ranks_;
  int me_;
  std::shared_ptr<Mailbox> mailbox_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::unique_ptr<gloo::transport::UnboundBuffer> header_;
  std::mutex post_mutex_;          // one message's header and bytes posted together
  std::uint64_t payloads_ = 0;     // payloads this rank posted (under post_mutex_)
  std::atomic<bool> stopping_{false};
  std::mutex ends_mutex_;
  std::condition_variable ends_cv_;
  int ends_ = 0;        // peers whose end came
  bool taking_ = true;  // false once take() returned
  std::mutex notices_mutex_;
  std::condition_variable notices_cv_;
  std::deque<Notice> notices_;
  std::int64_t notices_queued_ = 0, notices_sent_ = 0;
  bool notices_stop_ = false;
  std::thread notifier_;
  std::thread thread_;
};

}  // namespace cpsim::sim
