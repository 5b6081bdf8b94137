// The process wire (sim/gloo/process_wire.cpp) and the call exchange over
// Gloo, between ranks on threads of one process, each with its own Gloo context
// as the processes of a job have: notices that wait as a message does (a Gloo
// wait that times out closes every connection of its context), a peer that
// threw taking them until every end came, and a link lost after a rank returned
// named as such.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/point_to_point.hpp"
#include "core/error.hpp"
#include "sim/gloo/rank.hpp"
#include "sim/gloo/process_wire.hpp"
#include "tests/tensor_helpers.hpp"

namespace cpsim {
namespace {

using std::chrono::milliseconds;

Payload floats(std::vector<float> values) {
  Payload p{std::vector<std::uint8_t>(values.size() * sizeof(float)), "float32", static_cast<std::int64_t>(values.size())};
  std::memcpy(p.bytes.data(), values.data(), p.bytes.size());
  return p;
}

std::string error_of(const std::function<void()>& wait) {
  return cpsim::testing::thrown<CollectiveError>(wait, "CollectiveError");
}

// Two ranks of a group over Gloo, on threads, each with the process wire two
// processes of a job have (python/torch_backend/groups.cpp, JobSession). `body`
// runs on each rank with its GlooRank, its wire and its mailbox; what it throws
// is that rank's error.
template <class F>
std::vector<std::string> wired_pair(milliseconds timeout, F&& body) {
  auto store = sim::open_store("memory");
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        auto context = sim::connect_gloo(r, 2, *store, sim::gloo_device("127.0.0.1"), timeout);
        auto rank = std::make_shared<sim::GlooRank>(context, r, 2, store, timeout, false);
        rank->begin(timeout);
        auto box = std::make_shared<Mailbox>(2, timeout, std::make_shared<ActivityBoard>(2), Sends::rendezvous);
        body(r, *rank, box);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  return errors;
}

TEST(ProcessWire, ANoticeTakenLateLeavesTheGroupsConnectionsWhole) {
  // Rank 1's wire takes 3 s after rank 0 told its end: on a slow, lossy link a
  // notice waits that long. Gloo closes every connection of a group when one of
  // its waits times out, so waiting must last as long as a message may (the
  // group's timeout): the all-reduce after it runs on both ranks.
  const auto start = std::chrono::steady_clock::now();
  const auto errors = wired_pair(milliseconds(30000), [](int r, sim::GlooRank& rank, std::shared_ptr<Mailbox> box) {
    if (r == 1) std::this_thread::sleep_for(milliseconds(3000));
    sim::ProcessWire wire(rank, {0, 1}, box, milliseconds(30000));
    if (r == 0) wire.ended("returned", false);
    float x = 1.0f + static_cast<float>(r);
    rank.communicator()->all_reduce(&x, 1, DType::f32);
    if (x != 3.0f) throw std::runtime_error("all_reduce gave " + std::to_string(x));
    if (r == 1) {
      wire.wait_for_ends();
      auto sent = box->send("g", 1, 0, 0, floats({1}), "late.py:1");  // rank 0 returned: named, not waited for
      const std::string what = error_of([&] { box->wait(*sent); });
      if (what.find("but rank 0 returned without receiving it") == std::string::npos)
        throw std::runtime_error("rank 0's end did not come: " + what);
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(20000));
}

TEST(ProcessWire, APeerThatThrewTakesNoticesUntilEveryPeersEndCame) {
  // Rank 1 throws: it tells its end, then waits for every peer's end before its
  // wire goes (as JobSession::fail does), its process (connections) still up.
  // Rank 0's state and end, sent after, are taken: its end returns at once
  // instead of waiting the group's timeout (60 s) for a taker that is gone, and
  // the group's connections stay whole. (A wire that stopped at once left them
  // waiting; aborting such a send half way left Gloo's receive on the other
  // side matched to bytes that never came.)
  const auto errors = wired_pair(milliseconds(60000), [](int r, sim::GlooRank& rank, std::shared_ptr<Mailbox> box) {
    auto wire = std::make_unique<sim::ProcessWire>(rank, std::vector<int>{0, 1}, box, milliseconds(60000));
    float x = 1.0f;
    rank.communicator()->all_reduce(&x, 1, DType::f32);  // both wires are up
    if (r == 1) {
      wire->ended("threw: ValueError", true);
      wire->wait_for_ends();
      wire.reset();
    } else {
      std::this_thread::sleep_for(milliseconds(200));  // rank 1 waits for this rank's end
      const auto start = std::chrono::steady_clock::now();
      wire->state(Mailbox::State{});
      wire->ended("returned", false);
      const auto took = std::chrono::steady_clock::now() - start;
      if (took > milliseconds(10000))
        throw std::runtime_error("rank 0's end waited " +
                                 std::to_string(std::chrono::duration_cast<milliseconds>(took).count()) + " ms");
    }
    rank.communicator()->all_reduce(&x, 1, DType::f32);
    if (x != 4.0f) throw std::runtime_error("all_reduce gave " + std::to_string(x));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(ProcessWire, AMessageAndANoticeSentAtOnceEachArriveWhole) {
  // Rank 0's program sends messages of many sizes while its notifier thread
  // sends states of other sizes to the same peer: two threads post headers and
  // bytes to one connection at once. Each message must arrive with its own
  // bytes (a payload meeting another header's receive aborted the process in
  // Gloo, or delivered another message's bytes).
  constexpr int kMessages = 300;
  const auto errors = wired_pair(milliseconds(30000), [](int r, sim::GlooRank& rank, std::shared_ptr<Mailbox> box) {
    sim::ProcessWire wire(rank, {0, 1}, box, milliseconds(30000));
    box->set_remote(
        r, [&wire](int, int dst, int tag, const Mailbox::Message& m) { wire.send(dst, tag, m); },
        [&wire](int src, int seq) { wire.receipt(src, seq); }, [&wire](const Mailbox::State& s) { wire.state(s); },
        {0, 1});
    if (r == 0) {
      std::thread states([&] {
        // States of many sizes that say the rank does not wait (a state that
        // said it waits, with made-up counts, could read as a deadlock).
        for (int i = 0; i < kMessages; ++i) {
          Mailbox::State s;
          s.sent = {0, 0}, s.got = {0, 0};
          s.doing = std::string(static_cast<std::size_t>(i % 97), 'x');
          wire.state(s);
        }
      });
      for (int i = 0; i < kMessages; ++i) {
        std::vector<float> values(static_cast<std::size_t>(1 + i % 61), static_cast<float>(i));
        auto sent = box->send("", 0, 1, i % 5, floats(values), "both.py:" + std::to_string(i));
        box->wait(*sent);
      }
      states.join();
    } else {
      for (int i = 0; i < kMessages; ++i) {
        std::vector<float> got(static_cast<std::size_t>(1 + i % 61), -1.0f);
        auto recv = box->post("", 1, 0, i % 5, "float32", static_cast<std::int64_t>(got.size()),
                              [&](const std::vector<std::uint8_t>& b) { std::memcpy(got.data(), b.data(), b.size()); },
                              "take.py:1");
        box->wait(*recv);
        for (float v : got)
          if (v != static_cast<float>(i))
            throw std::runtime_error("message " + std::to_string(i) + " came with " + std::to_string(v));
      }
    }
    float x = 1.0f;
    rank.communicator()->all_reduce(&x, 1, DType::f32);  // the connections are whole
    wire.ended("returned", false);
    wire.wait_for_ends();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(ProcessWire, AReceiptAlwaysComesBeforeTheEndOfTheRankThatTookTheMessage) {
  // Rank 0's receive is posted first, so the message is taken on its wire's
  // thread, which queues the receipt; rank 0's program wakes and ends at once.
  // Rank 1's blocking send must see the receipt before rank 0's end (else:
  // "rank 0 returned without receiving it", a false failure of correct code).
  // The thread that takes the message is held up 30 ms as it queues the receipt
  // (a preempted thread on a loaded machine): the end may not overtake it.
  for (int round = 0; round < 8; ++round) {
    const auto errors = wired_pair(milliseconds(30000), [round](int r, sim::GlooRank& rank, std::shared_ptr<Mailbox> box) {
      sim::ProcessWire wire(rank, {0, 1}, box, milliseconds(30000));
      box->set_remote(
          r, [&wire](int, int dst, int tag, const Mailbox::Message& m) { wire.send(dst, tag, m); },
          [&wire](int src, int seq) {
            std::this_thread::sleep_for(milliseconds(30));
            wire.receipt(src, seq);
          },
          [&wire](const Mailbox::State& s) { wire.state(s); }, {0, 1});
      float x = 1.0f;
      rank.communicator()->all_reduce(&x, 1, DType::f32);  // both wires are up
      if (r == 0) {
        float got = 0;
        auto recv = box->post("", 0, 1, 0, "float32", 1,
                              [&](const std::vector<std::uint8_t>& b) { std::memcpy(&got, b.data(), sizeof got); },
                              "take.py:1");
        box->wait(*recv);
      } else {
        std::this_thread::sleep_for(milliseconds(round % 2 ? 0 : 20));  // the receive waits first
        auto sent = box->send("", 1, 0, 0, floats({2.0f}), "give.py:1");
        box->wait(*sent);
      }
      wire.ended("returned", false);
      wire.wait_for_ends();
    });
    ASSERT_EQ(errors[0], "") << "round " << round;
    ASSERT_EQ(errors[1], "") << "round " << round;
  }
}

TEST(Gloo, ALinkLostAfterARankReturnedIsNamedAfterItsEndNotInItsLastCall) {
  // Rank 1's process goes away once both completed an all-reduce; rank 0 then
  // returns, and the exchange that tells its peers so loses the connection.
  // The all-reduce completed: the report says where rank 0 was, after it.
  auto store = sim::open_store("memory");
  const milliseconds timeout(30000);
  std::atomic<bool> gone{false};
  std::string error;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      {
        auto rank = std::make_shared<sim::GlooRank>(
            sim::connect_gloo(r, 2, *store, sim::gloo_device("127.0.0.1"), timeout), r, 2, store, timeout, false);
        rank->begin(timeout);
        float x = 1.0f;
        rank->communicator()->all_reduce(&x, 1, DType::f32);
        if (r == 0) {
          while (!gone) std::this_thread::sleep_for(milliseconds(10));
          error = cpsim::testing::thrown<Aborted>([&] { rank->finish(); }, "Aborted");
        }
      }
      if (r == 1) gone = true;  // its connections are closed
    });
  for (auto& t : ranks) t.join();
  EXPECT_NE(error.find("rank 0 lost its connection to rank 1 after it returned (last completed: all_reduce #1"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find("in all_reduce #1"), std::string::npos) << error;
}


}  // namespace
}  // namespace cpsim
