#include "core/comm/rendezvous.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <thread>

namespace cpsim {

namespace {
// One spin-wait step: lets the sibling hyperthread run.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}
constexpr int kSpins = 20000;  // about 20-50 us of pause instructions
constexpr int kYields = 64;
// Spinning and yielding end after this long, whatever the count: on a machine
// busy with other processes one yield can give the core away for a whole time
// slice (milliseconds), and 64 of them made each collective wait ~100 ms; past it
// the waiter sleeps on the futex, and the last arrival's wake ends the sleep.
constexpr std::chrono::microseconds kBusyWait{50};

// Sleeps while *word == expected, at most `limit` (a wake or a change ends it early).
void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected, std::chrono::nanoseconds limit) {
  const auto ns = std::max<std::int64_t>(limit.count(), 0);
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<std::uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
}  // namespace

void Rendezvous::wake_all() {
  event_.fetch_add(1, std::memory_order_release);
  futex_wake_all(event_);
}

Rendezvous::Rendezvous(int size, std::chrono::milliseconds timeout, RankNames names)
    : timeout_(timeout),
      names_(std::move(names)),
      spin_(size > 1 && static_cast<unsigned>(size) <= std::thread::hardware_concurrency()),
      ranks_(size),
      calls_(size) {
  CPSIM_ENFORCE(size >= 1, "a group needs at least one rank");
}

std::string Rendezvous::states_locked(int cause) const {
  std::vector<RankActivity> activities(ranks_.size());
  for (std::size_t q = 0; q < ranks_.size(); ++q) {
    const RankState& s = ranks_[q];
    using P = RankActivity::Phase;
    const P phase = s.phase == Phase::waiting ? P::calling
                    : s.phase == Phase::idle  ? P::idle
                    : s.phase == Phase::exited ? P::returned
                                               : P::threw;
    activities[q] = {phase, s.phase == Phase::waiting ? s.call : s.last.value_or(CallRecord{}),
                     static_cast<int>(q) == cause ? std::string() : s.failure};
  }
  return describe_ranks(activities, names_);
}

void Rendezvous::poison_locked(const std::string& why, bool aborted) {
  if (!poison_) {
    poison_ = why + states_locked();
    poison_aborted_ = aborted;
  }
  poisoned_ = true;
  wake_all();
  rethrow_poison_locked();
}

void Rendezvous::rethrow_poison_locked() const {
  if (poison_aborted_) throw Aborted(*poison_);
  throw CollectiveError(*poison_);
}

std::vector<int> Rendezvous::behind_locked(std::uint64_t RankState::*field, std::uint64_t seq) const {
  std::vector<int> out;
  for (std::size_t q = 0; q < ranks_.size(); ++q)
    if (ranks_[q].*field < seq) out.push_back(static_cast<int>(q));
  return out;
}

void Rendezvous::timeout_locked(int rank, const CallRecord& call, std::chrono::steady_clock::time_point start,
                                std::chrono::milliseconds timeout, const std::vector<int>& who, const char* what) {
  poison_locked(call_timeout(rank, call, start, timeout, names_) + " for " + names_.ranks(who) + what, true);
}

template <class Stop>
bool Rendezvous::wait_for(const std::atomic<std::uint64_t>& reached, std::uint64_t seq,
                          std::chrono::steady_clock::time_point deadline, Stop stop) {
  // A core for every rank: spin. Fewer cores: yield a few times, which lets the
  // ranks that have not arrived yet run, before sleeping.
  const auto busy_until = std::chrono::steady_clock::now() + kBusyWait;
  if (spin_) {
    for (int i = 0; i < kSpins && reached.load(std::memory_order_acquire) < seq && !poisoned_.load(); ++i) {
      relax();
      if (i % 256 == 255 && std::chrono::steady_clock::now() >= busy_until) break;
    }
  } else {
    for (int i = 0; i < kYields && reached.load(std::memory_order_acquire) < seq && !poisoned_.load(); ++i) {
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() >= busy_until) break;
    }
  }
  for (;;) {
    const std::uint32_t event = event_.load(std::memory_order_acquire);
    if (reached.load(std::memory_order_acquire) >= seq) return true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop()) return false;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    // Bounded sleeps: a wake is never lost (the word changes first), but a bound
    // keeps a deadline honest whatever the scheduler does.
    futex_wait(event_, event, std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(100)));
  }
}

void Rendezvous::run(int rank, CallRecord call, std::chrono::milliseconds timeout,
                     const std::function<void(const std::vector<CallRecord>&)>& read,
                     const std::function<void()>& after) {
  const int n = size();
  RankState& me = ranks_[rank];
  std::uint64_t seq = 0;
  bool last = false;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (poison_) rethrow_poison_locked();
    seq = call.seq = me.posted + 1;
    me.call = call;
    me.posted = seq;
    me.phase = Phase::waiting;
    if ((last = ++arrivals_ == n)) {
      // The last to arrive checks the calls once for everybody and wakes them once.
      arrivals_ = 0;
      for (int q = 0; q < n; ++q) calls_[q] = ranks_[q].call;
      if (auto why = find_mismatch(calls_, names_)) poison_locked("collective mismatch: " + *why);
      arrived_.store(seq, std::memory_order_release);
    }
  }
  if (last) {
    wake_all();
  } else {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    const bool arrived = wait_for(arrived_, seq, deadline, [&] {
      if (poison_) return true;
      for (const RankState& s : ranks_)
        if (s.posted < seq && (s.phase == Phase::exited || s.phase == Phase::failed)) return true;
      return false;
    });
    if (!arrived) {
      std::unique_lock<std::mutex> lock(mutex_);
      if (arrived_.load() < seq) {
        if (poison_) rethrow_poison_locked();
        for (std::size_t q = 0; q < ranks_.size(); ++q) {
          const RankState& s = ranks_[q];
          if (s.posted < seq && (s.phase == Phase::exited || s.phase == Phase::failed))
            poison_locked(names_.rank(static_cast<int>(q)) + (s.phase == Phase::exited ? " returned" : " threw") +
                          " without joining " + call_name(call) + " #" + std::to_string(seq) + names_.on() +
                          " that " + names_.rank(rank) + " waits in");
        }
        timeout_locked(rank, call, start, timeout, behind_locked(&RankState::posted, seq), ", which never arrived");
      }
    }
  }
  // calls_ stays as it is until every rank has read: the next call's arrival
  // cannot complete before then. Every rank sees the same records, so every rank
  // makes the same choice of a second rendezvous.
  read(calls_);
  bool wait_for_readers = false;
  for (const CallRecord& c : calls_) wait_for_readers = wait_for_readers || !c.staged;
  // Peers may still read this rank's buffers: wait until all have finished reading
  // (or one of them threw while reading, and reads no more), within the timeout.
  if (wait_for_readers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      me.done = seq;
      if ((last = ++readers_ == n)) {
        readers_ = 0;
        read_.store(seq, std::memory_order_release);
      }
    }
    if (last) {
      wake_all();
    } else {
      const auto start = std::chrono::steady_clock::now();
      const bool all_read = wait_for(read_, seq, start + timeout, [&] {
        for (const RankState& s : ranks_)
          if (s.done < seq && s.phase == Phase::failed) return true;
        return false;
      });
      if (!all_read) {
        std::unique_lock<std::mutex> lock(mutex_);
        if (read_.load() < seq) {
          if (poison_) rethrow_poison_locked();
          timeout_locked(rank, call, start, timeout, behind_locked(&RankState::done, seq),
                         " to finish reading its buffers");
        }
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    me.done = seq;
    me.phase = Phase::idle;
    me.last = call;
  }
  if (after) after();
}

void Rendezvous::finish(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::exited;
  wake_all();
}

void Rendezvous::fail(int rank, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::failed;
  ranks_[rank].failure = what;
  if (!poison_) poison_ = names_.rank(rank) + " threw: " + what + states_locked(rank);
  poisoned_ = true;
  wake_all();
}

namespace {

class RendezvousChannel final : public CallChannel {
 public:
  RendezvousChannel(std::shared_ptr<Rendezvous> rendezvous, int rank) : rv_(std::move(rendezvous)), rank_(rank) {}
  std::vector<CallRecord> exchange(const CallRecord& mine, std::chrono::milliseconds timeout) override {
    std::vector<CallRecord> all;
    rv_->run(rank_, mine, timeout, [&](const std::vector<CallRecord>& calls) { all = calls; });
    return all;
  }
  [[noreturn]] void stop(const std::string& why) override { throw CollectiveError(why); }
  bool checks() const override { return true; }
  RankNames names() const override { return rv_->names(); }

 private:
  std::shared_ptr<Rendezvous> rv_;
  int rank_;
};

}  // namespace

std::shared_ptr<CallChannel> rendezvous_channel(std::shared_ptr<Rendezvous> rendezvous, int rank) {
  return std::make_shared<RendezvousChannel>(std::move(rendezvous), rank);
}

}  // namespace cpsim
