// The comm layer's point to point (core/comm/point_to_point.hpp) on its own, as
// torch's send, recv and irecv use it: any order, tags, any source (the earliest
// arrival), sizes and dtypes checked, blocking sends that return when a receive
// takes them, and every way a send or a receive would hang named.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <tuple>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/point_to_point.hpp"
#include "core/error.hpp"
#include "sim/gloo/rank.hpp"
#include "tests/tensor_helpers.hpp"

namespace cpsim {
namespace {

using std::chrono::milliseconds;

Payload floats(std::vector<float> values) {
  Payload p{std::vector<std::uint8_t>(values.size() * sizeof(float)), "float32",
            static_cast<std::int64_t>(values.size())};
  std::memcpy(p.bytes.data(), values.data(), p.bytes.size());
  return p;
}

struct Inbox {
  std::vector<float> values;
  std::shared_ptr<PostedRecv> post(Mailbox& box, int dst, int src, int tag, std::int64_t n = 2,
                                   const std::string& dtype = "float32") {
    values.assign(static_cast<std::size_t>(n), 0.0f);
    return box.post("g", dst, src, tag, dtype, n,
                    [this](const std::vector<std::uint8_t>& bytes) { std::memcpy(values.data(), bytes.data(), bytes.size()); },
                    "step.py:7");
  }
};

// What a wait that must fail threw (a CollectiveError's text).
template <class F>
std::string error_of(F wait) {
  return cpsim::testing::thrown<CollectiveError>(wait, "CollectiveError");
}

Mailbox mailbox(int ranks, milliseconds timeout = milliseconds(5000)) {
  return Mailbox(ranks, timeout, std::make_shared<ActivityBoard>(ranks));
}

TEST(PointToPoint, SendsAndReceivesMatchInEitherOrder) {
  Mailbox box = mailbox(2);
  Inbox early, late;
  auto posted = early.post(box, 1, 0, 0);  // a ring that posts its irecv first
  EXPECT_FALSE(posted->done);
  box.send("g", 0, 1, 0, floats({1, 2}), "a.py:1");
  box.wait(*posted);
  EXPECT_EQ(early.values, (std::vector<float>{1, 2}));
  box.send("g", 0, 1, 0, floats({3, 4}), "a.py:2");  // posted at once (an isend): queued until a receive takes it
  auto queued = late.post(box, 1, 0, 0);
  EXPECT_TRUE(queued->done);
  box.wait(*queued);
  EXPECT_EQ(late.values, (std::vector<float>{3, 4}));
  EXPECT_EQ(box.unreceived(), "");
}

TEST(PointToPoint, MessagesFromOneSenderArriveInTheOrderSent) {
  Mailbox box = mailbox(2);
  box.send("g", 0, 1, 0, floats({1, 1}), "");
  box.send("g", 0, 1, 0, floats({2, 2}), "");
  Inbox first, second;
  auto a = first.post(box, 1, 0, 0);
  auto b = second.post(box, 1, 0, 0);
  box.wait(*a), box.wait(*b);
  EXPECT_EQ(first.values[0], 1);
  EXPECT_EQ(second.values[0], 2);
}

TEST(PointToPoint, AnySourceTakesTheEarliestArrivalNotTheLowestRank) {
  Mailbox box = mailbox(3);
  box.send("g", 2, 0, 5, floats({2, 2}), "");
  box.send("g", 1, 0, 5, floats({1, 1}), "");
  Inbox in;
  auto p = in.post(box, 0, -1, 5);
  box.wait(*p);
  EXPECT_EQ(p->source, 2);
  EXPECT_EQ(in.values[0], 2);
}

TEST(PointToPoint, AReceiveTakesOnlyAMessageWithItsTag) {
  Mailbox box = mailbox(2);
  box.send("g", 0, 1, 1, floats({1, 1}), "");
  Inbox in;
  auto p = in.post(box, 1, 0, 2);
  EXPECT_FALSE(p->done);  // tag 1 waits for a receive of tag 1
  box.send("g", 0, 1, 2, floats({2, 2}), "");
  box.wait(*p);
  EXPECT_EQ(in.values[0], 2);
  EXPECT_NE(box.unreceived().find("tag 1"), std::string::npos) << box.unreceived();
}

TEST(PointToPoint, AReceiveTakesOnlyAMessageOfItsGroup) {
  Mailbox box = mailbox(2);
  box.send("other", 0, 1, 0, floats({1, 1}), "");
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  EXPECT_FALSE(p->done);
}

TEST(PointToPoint, ASizeOrDtypeThatDiffersIsNamed) {
  Mailbox box = mailbox(2);
  box.send("g", 0, 1, 0, floats({1, 2, 3}), "a.py:3");
  Inbox in;
  auto p = in.post(box, 1, 0, 0, 2);
  {
    const std::string what = error_of([&] { box.wait(*p); });
    EXPECT_NE(what.find("rank 1's recv from rank 0 (tag 0, float32 x 2) at step.py:7 got rank 0's send #1, which "
                        "holds float32 x 3 (sent at a.py:3)"),
              std::string::npos)
        << what;
  }
  Inbox typed;
  box.send("g", 0, 1, 0, floats({1, 2}), "");
  auto q = typed.post(box, 1, 0, 0, 2, "int32");
  EXPECT_THROW(box.wait(*q), CollectiveError);
}

TEST(PointToPoint, APeerThatReturnedWithoutSendingIsNamedAtOnce) {
  Mailbox box = mailbox(2, milliseconds(60000));
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  box.stopped(0, "returned", false);
  const auto start = std::chrono::steady_clock::now();
  {
    const std::string what = error_of([&] { box.wait(*p); });
    EXPECT_NE(what.find("but rank 0 returned without sending it"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
}

TEST(PointToPoint, AReceiveNothingComesForTimesOutNamingWhatIsPending) {
  Mailbox box = mailbox(3, milliseconds(100));
  box.send("g", 2, 0, 9, floats({1, 1}), "b.py:4");
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  {
    const std::string what = error_of([&] { box.wait(*p); });
    EXPECT_NE(what.find("timeout: rank 1"), std::string::npos) << what;
    EXPECT_NE(what.find("and nothing came"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 2 sent rank 0 float32 x 2 (tag 9, at b.py:4), not received yet"), std::string::npos)
        << what;
    // The receive is named once, in the first line: not again as pending, nor
    // as what rank 1 is doing.
    EXPECT_EQ(what.find("recv from rank 0", what.find("recv from rank 0") + 1), std::string::npos) << what;
  }
}

TEST(PointToPoint, AWaitLimitShorterThanTheTimeoutIsHonoured) {
  Mailbox box = mailbox(2, milliseconds(60000));
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(box.wait(*p, milliseconds(50)), CollectiveError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
}

TEST(PointToPoint, AReceiveWaitedOnAnotherThreadCompletesWhenTheSendComes) {
  Mailbox box = mailbox(2);
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  std::thread sender([&] {
    std::this_thread::sleep_for(milliseconds(20));
    box.send("g", 0, 1, 0, floats({7, 8}), "");
  });
  box.wait(*p);
  sender.join();
  EXPECT_EQ(in.values, (std::vector<float>{7, 8}));
}

TEST(PointToPoint, AFailedRankStopsEveryWaitingReceive) {
  Mailbox box = mailbox(3, milliseconds(60000));
  Inbox in;
  auto p = in.post(box, 1, 0, 0);
  box.stopped(2, "threw: boom", true);
  {
    const std::string what = error_of([&] { box.wait(*p); });
    EXPECT_NE(what.find("but the group stopped: rank 2 threw: boom"), std::string::npos) << what;
  }
}

TEST(PointToPoint, ASendToAnotherProcessLeavesThroughTheRemote) {
  Mailbox box = mailbox(2);
  int remote_dst = -1;
  std::int64_t remote_numel = 0;
  box.set_remote(
      0,
      [&](int, int dst, int, const Mailbox::Message& m) {
        remote_dst = dst;
        remote_numel = m.payload.numel;
      },
      [](int, int) {});
  box.send("g", 0, 1, 0, floats({1, 2, 3}), "");
  EXPECT_EQ(remote_dst, 1);
  EXPECT_EQ(remote_numel, 3);
  EXPECT_EQ(box.unreceived(), "");  // it left: nothing kept here
}

// N processes of a job, one rank each, their mailboxes wired as the process
// wire wires them (sim/gloo/process_wire.cpp): a send arrives at the other
// mailbox, and a receive's receipt and a waiting rank's state are carried, in
// the order they were queued, from a thread of their own (a receipt and a
// publish come under the mailbox's lock: they must only queue). A rank's end
// is told by the test (Mailbox::stopped), as the wire's end message tells it.
struct Processes {
  explicit Processes(int n, Sends sends = Sends::rendezvous, milliseconds timeout = milliseconds(60000)) {
    for (int q = 0; q < n; ++q)
      boxes.push_back(std::make_unique<Mailbox>(n, timeout, std::make_shared<ActivityBoard>(n), sends));
    for (int me = 0; me < n; ++me)
      boxes[me]->set_remote(
          me,
          [this](int src, int dst, int tag, const Mailbox::Message& m) {
            Mailbox::Message copy{m.payload, m.seq, m.site};
            copy.remote = true;
            boxes[dst]->arrive("g", src, dst, tag, std::move(copy));
          },
          [this, me](int src, int seq) {
            ++receipts;
            std::lock_guard<std::mutex> lock(mutex);
            notices.push_back([this, me, src, seq] { boxes[src]->taken(me, seq); });
            cv.notify_all();
          },
          [this, me, n](const Mailbox::State& s) {
            std::lock_guard<std::mutex> lock(mutex);
            for (int q = 0; q < n; ++q)
              if (q != me) notices.push_back([this, me, q, s] { boxes[q]->remote_state(me, s); });
            cv.notify_all();
          });
    carrier = std::thread([this] {
      std::unique_lock<std::mutex> lock(mutex);
      while (true) {
        cv.wait(lock, [&] { return stop || !notices.empty(); });
        if (stop) return;
        auto notice = std::move(notices.front());
        notices.pop_front();
        lock.unlock();
        notice();
        lock.lock();
      }
    });
  }
  ~Processes() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      cv.notify_all();
    }
    carrier.join();
  }
  std::vector<std::unique_ptr<Mailbox>> boxes;
  std::atomic<int> receipts{0};
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::function<void()>> notices;
  bool stop = false;
  std::thread carrier;
};

TEST(PointToPoint, ARingOfProcessesThatSendFirstIsADeadlockNamedAtOnce) {
  Processes job(3);  // a 60 s timeout: named long before it
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&, r] {
      try {
        auto sent = job.boxes[r]->send("g", r, (r + 1) % 3, 0, floats({1, 2, 3}), "ring.py:" + std::to_string(r));
        job.boxes[r]->wait(*sent);
      } catch (const CollectiveError& e) {
        errors[r] = e.what();
        for (int q = 0; q < 3; ++q)  // what the wire's end message does
          if (q != r) job.boxes[q]->stopped(r, std::string("threw: ") + e.what(), true);
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(30000));
  int named = 0;
  for (const std::string& e : errors) {
    if (e.find("deadlock: every rank still running waits in point to point") == std::string::npos) continue;
    ++named;
    for (int r = 0; r < 3; ++r)
      EXPECT_NE(e.find("rank " + std::to_string(r) + ": waits for its send to rank " + std::to_string((r + 1) % 3) +
                       " (tag 0, float32 x 3) at ring.py:" + std::to_string(r) + " to be received"),
                std::string::npos)
          << e;
  }
  EXPECT_GE(named, 1);  // the others may stop first: a process that named it ends its wait
}

TEST(PointToPoint, ProcessesThatWaitWhileMessagesAreOnTheirWayAreNoDeadlock) {
  // A ring of three processes, 200 rounds: each posts its receive, then its
  // blocking send, then waits for its receive. Every rank waits often while
  // a message or a receipt is on its way: none may be named a deadlock.
  Processes job(3, Sends::rendezvous, milliseconds(20000));
  std::vector<std::string> errors(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&, r] {
      try {
        for (int round = 0; round < 200; ++round) {
          Inbox in;
          auto posted = in.post(*job.boxes[r], r, (r + 2) % 3, 0, 3);
          auto sent = job.boxes[r]->send("g", r, (r + 1) % 3, 0, floats({1, 2, float(round)}), "");
          job.boxes[r]->wait(*sent);
          job.boxes[r]->wait(*posted);
          if (in.values[2] != float(round)) throw CollectiveError("round " + std::to_string(round) + " got another");
        }
      } catch (const CollectiveError& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

TEST(PointToPoint, ABlockingSendToAnotherProcessReturnsWhenItsReceiptComes) {
  Processes job(2);
  auto sent = job.boxes[0]->send("g", 0, 1, 0, floats({1, 2}), "a.py:1");
  EXPECT_FALSE(sent->taken);  // it left; no receive took it yet
  EXPECT_NE(job.boxes[0]->pending().find("rank 0 sent rank 1 float32 x 2 (tag 0, at a.py:1), not received yet"),
            std::string::npos)
      << job.boxes[0]->pending();
  Inbox in;
  std::thread receiver([&] {
    std::this_thread::sleep_for(milliseconds(50));
    job.boxes[1]->wait(*in.post(*job.boxes[1], 1, 0, 0));  // takes the queued message: its receipt goes back
  });
  job.boxes[0]->wait(*sent);
  receiver.join();
  EXPECT_TRUE(sent->taken);
  EXPECT_EQ(in.values, (std::vector<float>{1, 2}));
  // A receive posted first takes the message as it arrives: the receipt is sent then.
  auto posted = in.post(*job.boxes[1], 1, 0, 5);
  auto second = job.boxes[0]->send("g", 0, 1, 5, floats({3, 4}), "a.py:2");
  job.boxes[0]->wait(*second);
  job.boxes[1]->wait(*posted);
  EXPECT_EQ(in.values, (std::vector<float>{3, 4}));
  EXPECT_EQ(job.receipts, 2);
  EXPECT_EQ(job.boxes[0]->pending(), "");
}

TEST(PointToPoint, EagerSendsToAnotherProcessReturnAtOnce) {
  Processes job(2, Sends::eager);
  auto sent = job.boxes[0]->send("g", 0, 1, 0, floats({1, 2}), "");
  EXPECT_TRUE(sent->taken);
  job.boxes[0]->wait(*sent);
  EXPECT_NE(job.boxes[1]->unreceived().find("rank 0's send #1 to rank 1 (tag 0, float32 x 2)"), std::string::npos);
}

TEST(PointToPoint, AProcessToldItsPeerEndedStopsWaitingAtOnce) {
  Processes job(2);
  auto sent = job.boxes[0]->send("g", 0, 1, 0, floats({1, 2}), "a.py:1");
  Inbox in;
  auto posted = in.post(*job.boxes[0], 0, 1, 3);
  const auto start = std::chrono::steady_clock::now();
  job.boxes[0]->stopped(1, "returned", false);  // rank 1's end came over the wire
  {
    const std::string what = error_of([&] { job.boxes[0]->wait(*sent); });
    EXPECT_NE(what.find("rank 0 waits for its send to rank 1 (tag 0, float32 x 2) at a.py:1 to be "
                        "received, but rank 1 returned without receiving it"),
              std::string::npos)
        << what;
  }
  {
    const std::string what = error_of([&] { job.boxes[0]->wait(*posted); });
    EXPECT_NE(what.find("rank 1 returned without sending it"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(30000));  // told, not timed out (60 s)
}

TEST(PointToPoint, APeerOutsideTheGroupIsInvalid) {
  Mailbox box = mailbox(2);
  EXPECT_THROW(box.send("g", 0, 2, 0, floats({1}), ""), InvalidInput);
  EXPECT_THROW(box.send("g", 0, 0, 0, floats({1}), ""), InvalidInput);
  Inbox in;
  EXPECT_THROW(in.post(box, 1, 5, 0), InvalidInput);
}

TEST(PointToPoint, AMessageNobodyReceivedIsReported) {
  Mailbox box = mailbox(2);
  box.send("g", 0, 1, 3, floats({1, 2}), "c.py:9");
  EXPECT_EQ(box.unreceived(), "a send no recv took:\n  rank 0's send #1 to rank 1 (tag 3, float32 x 2) at c.py:9");
}

TEST(PointToPoint, ABlockingSendReturnsWhenAReceiveTakesItsMessage) {
  Mailbox box = mailbox(2);
  auto sent = box.send("g", 0, 1, 0, floats({5, 6}), "a.py:3");
  EXPECT_FALSE(sent->taken);
  Inbox in;
  std::thread receiver([&] {
    std::this_thread::sleep_for(milliseconds(100));
    box.wait(*in.post(box, 1, 0, 0));
  });
  const auto start = std::chrono::steady_clock::now();
  box.wait(*sent);
  EXPECT_TRUE(sent->taken);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(90));
  receiver.join();
  EXPECT_EQ(in.values, (std::vector<float>{5, 6}));
  // Eager sends complete at once, as MPI's small sends do.
  Mailbox eager(2, milliseconds(5000), std::make_shared<ActivityBoard>(2), Sends::eager);
  EXPECT_TRUE(eager.send("g", 0, 1, 0, floats({1}), "")->taken);
}

// Every rank sends to the next before it receives: on Gloo and NCCL each send
// waits for a receive that is never posted. Named at once, with every rank's call.
TEST(PointToPoint, ARingThatSendsBeforeItReceivesIsADeadlockNamedAtOnce) {
  const int n = 3;
  Mailbox box = mailbox(n, milliseconds(60000));
  std::vector<std::string> errors(n);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      try {
        box.wait(*box.send("g", r, (r + 1) % n, 0, floats({1, 2, 3}), "ring.py:" + std::to_string(10 + r)));
        Inbox in;
        box.wait(*in.post(box, r, (r + n - 1) % n, 0, 3));
      } catch (const CollectiveError& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5000));
  for (int r = 0; r < n; ++r) {
    EXPECT_NE(errors[r].find("deadlock: every rank still running waits in point to point"), std::string::npos)
        << errors[r];
    for (int q = 0; q < n; ++q)
      EXPECT_NE(errors[r].find("rank " + std::to_string(q) + ": waits for its send to rank " +
                               std::to_string((q + 1) % n) + " (tag 0, float32 x 3) at ring.py:" +
                               std::to_string(10 + q) + " to be received"),
                std::string::npos)
          << errors[r];
  }
}

TEST(PointToPoint, ASendToARankThatReturnedWithoutReceivingIsNamed) {
  Mailbox box = mailbox(2, milliseconds(60000));
  auto sent = box.send("g", 0, 1, 4, floats({1, 2}), "d.py:2");
  box.stopped(1, "returned", false);
  {
    const std::string what = error_of([&] { box.wait(*sent); });
    EXPECT_NE(what.find("rank 0 waits for its send to rank 1 (tag 4, float32 x 2) at d.py:2 to be "
                        "received, but rank 1 returned without receiving it"),
              std::string::npos)
        << what;
  }
}

TEST(PointToPoint, ASendWaitNothingTakesTimesOut) {
  Mailbox box = mailbox(3, milliseconds(100));  // rank 2 runs on: no deadlock, the timeout ends it
  auto sent = box.send("g", 0, 1, 0, floats({1}), "e.py:1");
  {
    const std::string what = error_of([&] { box.wait(*sent); });
    EXPECT_NE(what.find("timeout: rank 0 waited"), std::string::npos) << what;
    EXPECT_NE(what.find("for its send to rank 1 (tag 0, float32 x 1) at e.py:1 and no receive took it"),
              std::string::npos)
        << what;
  }
}

}  // namespace
}  // namespace cpsim
