#include "core/comm/rendezvous.hpp"

#include <sstream>

namespace cpsim {

Rendezvous::Rendezvous(int size, std::chrono::milliseconds timeout) : timeout_(timeout), ranks_(size) {
  CPSIM_ENFORCE(size >= 1, "a group needs at least one rank");
}

std::string Rendezvous::states_locked() const {
  std::ostringstream os;
  for (std::size_t q = 0; q < ranks_.size(); ++q) {
    const RankState& s = ranks_[q];
    os << "\n  rank " << q << ": ";
    switch (s.phase) {
      case Phase::waiting: os << "in " << describe_call(s.call); break;
      case Phase::idle: os << "not in a collective (last completed: " << s.last << ")"; break;
      case Phase::exited: os << "returned (last completed: " << s.last << ")"; break;
      case Phase::failed: os << "threw: " << s.failure << " (last completed: " << s.last << ")"; break;
    }
  }
  return os.str();
}

void Rendezvous::poison_locked(const std::string& why) {
  if (!poison_) poison_ = why + states_locked();
  cv_.notify_all();
  throw CollectiveError(*poison_);
}

void Rendezvous::run(int rank, CallRecord call, std::chrono::milliseconds timeout,
                       const std::function<void(const std::vector<CallRecord>&)>& read,
                       const std::function<void()>& after) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (poison_) throw CollectiveError(*poison_);
  RankState& me = ranks_[rank];
  call.seq = me.posted + 1;
  me.call = call;
  me.posted = call.seq;
  me.phase = Phase::waiting;
  cv_.notify_all();

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto all_arrived = [&] {
    for (const auto& s : ranks_)
      if (s.posted < call.seq) return false;
    return true;
  };
  while (!all_arrived()) {
    if (poison_) throw CollectiveError(*poison_);
    for (std::size_t q = 0; q < ranks_.size(); ++q) {
      const RankState& s = ranks_[q];
      if (s.posted < call.seq && (s.phase == Phase::exited || s.phase == Phase::failed))
        poison_locked("rank " + std::to_string(q) + (s.phase == Phase::exited ? " returned" : " threw") +
                      " without joining " + collective_name(call.kind) + " #" + std::to_string(call.seq) +
                      " that rank " + std::to_string(rank) + " waits in");
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !all_arrived() && !poison_)
      poison_locked("timeout: rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                    " ms in " + describe_call(call) + " for ranks that never arrived");
  }
  std::vector<CallRecord> calls;
  for (const auto& s : ranks_) calls.push_back(s.call);
  if (auto why = find_mismatch(calls)) poison_locked("collective mismatch: " + *why);
  lock.unlock();
  read(calls);
  lock.lock();
  // Peers may still read this rank's buffers: wait until all have finished reading.
  me.done = call.seq;
  cv_.notify_all();
  cv_.wait(lock, [&] {
    for (const auto& s : ranks_)
      if (s.done < call.seq) return false;
    return true;
  });
  me.phase = Phase::idle;
  me.last = describe_call(call);
  lock.unlock();
  if (after) after();
}

void Rendezvous::finish(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::exited;
  cv_.notify_all();
}

void Rendezvous::fail(int rank, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranks_[rank].phase = Phase::failed;
  ranks_[rank].failure = what;
  if (!poison_) poison_ = "rank " + std::to_string(rank) + " threw: " + what + states_locked();
  cv_.notify_all();
}

}  // namespace cpsim
