// Point to point between the ranks of one spawn (threads) or of one process of a
// job, in any order, with tags and any-source receives: what torch's send, recv
// and irecv need beside the collectives (the communicator's). A send is posted at
// once (isend); waiting on it (a blocking send) returns when a receive took its
// message, as on Gloo and NCCL, whatever its size (Sends::rendezvous, the
// default; Sends::eager: at once, as MPI's small sends). A receive is posted and
// completes when a message with its source (or any source: the earliest to
// arrive) and tag comes, whichever of the two came first, so a ring that posts
// its irecv first is fine. What would hang is a named error: ranks that all wait
// in point to point with nothing to take (a deadlock, named at once with each
// rank's call), a wait nothing ends within the timeout (with every rank's pending
// messages and receives, and what each rank is doing), a size or dtype that
// differs, a peer that returned without sending or receiving, and at the end a
// message nobody received. Between the processes of a job the same holds: the
// process wire carries the message, the receipt a receive sends back to its
// sender, each rank's end, and while a rank waits in point to point its state
// (what it waits for, and how many messages and receipts it sent to and took
// from each rank: sim/gloo/process_wire.hpp). A process names a deadlock when
// its own rank and every other running one wait and the counts agree pairwise
// (nothing is on its way: a rank that was waiting and stopped can only have
// been woken by a message some rank counts as sent and its receiver does not).
//
// The payload is typed bytes (a dtype name and an element count, as the caller
// names them): this layer knows no tensor library.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace cpsim {

// What each rank of a group is doing, for reports: a collective, a wait for a
// receive, or nothing; with the call site.
class ActivityBoard {
 public:
  explicit ActivityBoard(int ranks) : doing_(ranks) {}
  // group: a collective of that group (its label, RankNames::group; "" the
  // world), which its communicator sees too (its reports name it already).
  void set(int rank, std::string what, std::optional<std::string> group = std::nullopt);
  // "\n  rank q: waits for its recv from rank 0 (tag 3) at step.py:12", for every
  // rank doing something (outside_collectives: only what the communicator does
  // not see, the waits in point to point).
  // `except`: a rank left out (the one whose report this is: its first line says it).
  std::string lines(bool outside_collectives = false, int except = -1) const;
  // What `rank` does when it is in a collective of a group other than `group`, or "".
  std::string in_another_group(int rank, const std::string& group) const;

 private:
  struct Doing {
    std::string what;
    std::optional<std::string> group;  // set: in a collective of that group
  };
  mutable std::mutex mutex_;
  std::vector<Doing> doing_;
};

// The typed bytes of one message.
struct Payload {
  std::vector<std::uint8_t> bytes;
  std::string dtype;  // the caller's name of the element type ("float32")
  std::int64_t numel = 0;
  std::string shape() const { return dtype + " x " + std::to_string(numel); }
};

// One posted receive: what it takes, where a matching message's bytes go, and
// how it ended.
struct PostedRecv {
  std::string group;
  int dst = -1, src = -1, tag = 0;  // src -1: any source
  std::string dtype;
  std::int64_t numel = 0;
  // Called with the bytes of the message it takes (under the mailbox's lock).
  std::function<void(const std::vector<std::uint8_t>&)> write;
  std::string site;
  bool done = false;
  int source = -1;  // who sent it, once done
  std::string error;
  std::string what() const;
};

// One posted send: taken once a receive took its message (at once when sends are
// eager, or when it left for another process).
struct PostedSend {
  int src = -1, dst = -1, tag = 0;
  std::string shape, site;
  bool taken = false;
  std::string what() const;  // "send to rank 1 (tag 0, float32 x 3) at ring.py:5"
};

// How a blocking send completes: when its receive takes it, or at once.
enum class Sends { rendezvous, eager };

class Mailbox {
 public:
  struct Message {
    Payload payload;
    int seq = 0;
    std::string site;
    std::uint64_t arrival = 0;  // the order messages came to this mailbox in
    std::shared_ptr<PostedSend> receipt{};  // its sender's, until a receive takes it
    bool remote = false;  // from another process: its receive sends the sender a receipt
  };
  // How a message leaves this process for rank dst of another (a job's
  // processes: the process wire); it returns once the message is on its way.
  using Remote = std::function<void(int src, int dst, int tag, const Message& m)>;
  // How a receipt leaves: this process's rank took rank src's send #seq (called
  // under the mailbox's lock, before the receive returns: it must only queue it,
  // and a later end of this rank queued after it cannot overtake it).
  using Receipt = std::function<void(int src, int seq)>;
  // What this process's rank does in point to point, as its peers see it:
  // whether it waits (and for what), and its counts of messages and receipts
  // sent to and taken from each rank.
  struct State {
    bool waiting = false;
    std::string doing;  // "waits for its send to rank 1 ... to be received"
    std::vector<std::int64_t> sent, got;
  };
  // How this process's state reaches its peers (called under the mailbox's
  // lock: it must only queue it).
  using Publish = std::function<void(const State&)>;
  using Clock = std::chrono::steady_clock;

  Mailbox(int ranks, std::chrono::milliseconds timeout, std::shared_ptr<ActivityBoard> board,
          Sends sends = Sends::rendezvous);
  // The mailbox of one process of a job: its receives are rank `local`'s; sends
  // to any other rank go through `remote`, and the receipts of what its receives
  // took from them through `receipt`.
  // `members`: the ranks of the group of processes (all when empty).
  void set_remote(int local, Remote remote, Receipt receipt, Publish publish = nullptr,
                  std::vector<int> members = {});
  // The state a rank of another process published.
  void remote_state(int rank, State state);

  // Posts a send; wait() on what it returns is a blocking send.
  std::shared_ptr<PostedSend> send(const std::string& group, int src, int dst, int tag, Payload payload,
                                   const std::string& site);
  // A message from another process for this one's rank.
  void arrive(const std::string& group, int src, int dst, int tag, Message m);
  // Rank dst of another process took this process's send #seq.
  void taken(int dst, int seq);
  // Posts a receive of `numel` elements of `dtype` for rank dst from src (-1:
  // any source); it takes the earliest queued message that matches, if any.
  std::shared_ptr<PostedRecv> post(const std::string& group, int dst, int src, int tag, std::string dtype,
                                   std::int64_t numel, std::function<void(const std::vector<std::uint8_t>&)> write,
                                   const std::string& site);
  // Waits for a posted receive, at most `limit` when it is set and shorter than
  // the group's timeout (Work.wait(timeout)); throws what went wrong.
  void wait(PostedRecv& p, std::chrono::milliseconds limit = std::chrono::milliseconds(0));
  // Waits until a receive took the send's message (a blocking send), likewise.
  void wait(PostedSend& s, std::chrono::milliseconds limit = std::chrono::milliseconds(0));
  // A rank stopped: returned, or threw (then every waiting receive stops too).
  void stopped(int rank, const std::string& how, bool failed);
  // The messages no receive took, as one report ("" when none).
  std::string unreceived();
  // Every rank's pending point to point: "; pending point-to-point:\n  rank 0:
  // sent rank 1 ... not received yet" ("" when none).
  std::string pending();

 private:
  void arrive_locked(const std::string& group, int src, int dst, int tag, Message m);
  void deliver(PostedRecv& p, int src, const Message& m);
  void forget(PostedRecv& p);
  void check_peer(int me, int peer, const char* op) const;
  // A rank's wait, while it lasts: what it waits for, and whether that came.
  struct Waiting {
    int rank;
    std::string what;      // "recv from rank 0 (tag 3, float32 x 2) at step.py:12"
    std::string doing;     // "waits for its recv from ..."
    std::string not_came;  // how a timeout ends it: "and nothing came"
    std::function<bool()> over;
  };
  // Waits until over() (or throws what ended the wait: `stopped` says why a
  // peer's end ends it, "" while it does not).
  void wait_locked(std::unique_lock<std::mutex>& lock, const Waiting& w, std::chrono::milliseconds limit,
                   const std::function<std::string()>& stopped);
  // The messages not received and the receives nothing came for, but `w`'s own
  // (the report it ends begins with it).
  std::string pending_locked(const Waiting* w = nullptr) const;
  // Every rank still running waits in point to point for what cannot come.
  bool deadlocked_locked() const;
  // Between processes: this rank and every other running one wait, their
  // published counts agree pairwise.
  bool processes_deadlocked_locked() const;
  // This rank's state to its peers, when it waits or just stopped waiting.
  void publish_locked();
  // This process's rank's wait that is not over, or null.
  const Waiting* local_wait_locked() const;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<std::string, int, int, int>, std::deque<Message>> queues_;
  std::list<std::shared_ptr<PostedRecv>> posted_;
  std::vector<std::string> state_;
  std::vector<int> sent_;
  std::string failure_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<ActivityBoard> board_;
  int local_ = -1;
  Remote remote_;
  Receipt receipt_;
  std::map<std::pair<int, int>, std::shared_ptr<PostedSend>> remote_sends_;  // (dst, seq), until taken
  Publish publish_;
  std::vector<std::int64_t> wire_sent_, wire_got_;  // messages and receipts, to and from each rank
  std::map<int, State> remote_states_;              // the latest each rank of another process published
  std::vector<int> members_;                        // the ranks of the group of processes
  bool published_waiting_ = false;                  // what its peers last heard
  std::uint64_t arrivals_ = 0;
  Sends sends_;
  std::list<const Waiting*> waiting_;
  std::string deadlock_;
};

}  // namespace cpsim
