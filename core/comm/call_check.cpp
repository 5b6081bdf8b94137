#include "core/comm/call_check.hpp"

#include "core/comm/forwarding.hpp"

#include <cstring>
#include <sstream>

namespace cpsim {

CallRecord call_record(CollectiveKind kind, std::size_t count, DType dtype, const CallLabel& label) {
  CallRecord c;
  c.kind = kind;
  c.count = count;
  c.dtype = dtype;
  c.label = label;
  return c;
}

CallLabel CallLabel::of(const std::string& name, const std::string& args, const std::string& site) {
  CallLabel l;
  std::strncpy(l.name, name.c_str(), sizeof(l.name) - 1);
  std::strncpy(l.args, args.c_str(), sizeof(l.args) - 1);
  std::strncpy(l.site, site.c_str(), sizeof(l.site) - 1);
  return l;
}

CallRecord send_recv_record(const SendRecv& step, DType dtype) {
  CallRecord c = call_record(CollectiveKind::send_recv, step.dst < 0 ? 0 : step.send_count, dtype);
  c.dst = step.dst;
  c.src = step.src;
  c.recv_count = step.src < 0 ? 0 : step.recv_count;
  c.send = step.send;
  c.recv = step.recv;
  return c;
}

RankNames RankNames::of(std::vector<int> global, int world) {
  RankNames names;
  bool everyone = static_cast<int>(global.size()) == world;
  for (std::size_t q = 0; q < global.size(); ++q) everyone = everyone && global[q] == static_cast<int>(q);
  if (!everyone) names.group = "the group of " + name_ranks(global);
  names.global = std::move(global);
  return names;
}

int RankNames::number(int q) const {
  return q >= 0 && q < static_cast<int>(global.size()) ? global[q] : q;
}

std::string RankNames::rank(int q) const { return "rank " + std::to_string(number(q)); }

std::string RankNames::ranks(const std::vector<int>& qs) const {
  std::vector<int> numbers;
  for (int q : qs) numbers.push_back(number(q));
  return name_ranks(numbers);
}

std::string RankNames::on() const { return group.empty() ? "" : " on " + group; }

std::string describe_ranks(const std::vector<RankActivity>& ranks, const RankNames& names) {
  std::string out;
  for (std::size_t q = 0; q < ranks.size(); ++q) {
    const RankActivity& a = ranks[q];
    const int rank = static_cast<int>(q);
    const std::string elsewhere =
        a.phase == RankActivity::Phase::idle && names.elsewhere ? names.elsewhere(names.number(rank)) : "";
    const bool here = names.world() && elsewhere.empty();
    // A line that already names another group (elsewhere) says which group its
    // last call was on: this report's.
    const std::string on = !elsewhere.empty() ? (names.world() ? "the world group" : names.group) : "this group";
    const std::string last = (here ? "(last completed: " : "(last completed on " + on + ": ") +
                             (a.call.seq > 0 ? describe_call(a.call, names) : "nothing") + ")";
    out += "\n  " + names.rank(rank) + ": ";
    switch (a.phase) {
      case RankActivity::Phase::calling: out += "in " + describe_call(a.call, names); break;
      case RankActivity::Phase::idle:
        out += (!elsewhere.empty() ? elsewhere + " "
                : names.world()    ? std::string("not in a collective ")
                                   : std::string("not in a call on this group ")) +
               last;
        break;
      case RankActivity::Phase::returned: out += "returned " + last; break;
      case RankActivity::Phase::threw: {
        const std::string first = a.failure.substr(0, a.failure.find('\n'));
        out += "threw" + (first.empty() ? std::string() : ": " + first) + " " + last;
        break;
      }
    }
  }
  return out;
}

std::string describe_calls(const std::vector<CallRecord>& calls, const RankNames& names) {
  std::vector<RankActivity> ranks(calls.size());
  for (std::size_t q = 0; q < calls.size(); ++q) ranks[q] = {RankActivity::Phase::calling, calls[q], ""};
  return describe_ranks(ranks, names);
}

std::string call_name(const CallRecord& c) { return c.label.empty() ? collective_name(c.kind) : c.label.name; }

std::string describe_call(const CallRecord& c, const RankNames& names) {
  std::ostringstream os;
  const std::string site = c.label.site[0] ? std::string(" at ") + c.label.site : "";
  if (!c.label.empty()) {
    os << c.label.name << " #" << c.seq;
    if (c.label.args[0]) os << " (" << c.label.args << ")";
    return os.str() + site;
  }
  os << collective_name(c.kind) << " #" << c.seq << " (";
  switch (c.kind) {
    case CollectiveKind::send_recv:
      os << "send " << c.count << " to " << (c.dst < 0 ? std::string("nobody") : names.rank(c.dst)) << ", recv "
         << c.recv_count << " from " << (c.src < 0 ? std::string("nobody") : names.rank(c.src)) << ", "
         << dtype_name(c.dtype);
      break;
    case CollectiveKind::barrier: os << "no data"; break;
    case CollectiveKind::broadcast:
      os << "count " << c.count << ", " << dtype_name(c.dtype) << ", root " << names.number(c.root);
      break;
    default: os << "count " << c.count << ", " << dtype_name(c.dtype);
  }
  os << ")";
  return os.str() + site;
}

std::string name_ranks(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

std::string waited_since(std::chrono::steady_clock::time_point start, std::chrono::milliseconds limit) {
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  return "waited " + std::to_string(waited.count()) + " ms (limit " + std::to_string(limit.count()) + " ms)";
}

std::string call_timeout(int rank, const CallRecord& call, std::chrono::steady_clock::time_point start,
                         std::chrono::milliseconds limit, const RankNames& names) {
  return "timeout: " + names.rank(rank) + " " + waited_since(start, limit) + " in " + describe_call(call, names) +
         names.on();
}

bool is_call_timeout(const std::string& report) { return report.rfind("timeout: rank ", 0) == 0; }

std::optional<std::string> find_mismatch(const std::vector<CallRecord>& calls, const RankNames& names) {
  const CallRecord& a = calls.at(0);
  const int n = static_cast<int>(calls.size());
  const std::string at = " #" + std::to_string(a.seq) + names.on();
  for (int q = 1; q < n; ++q) {
    const CallRecord& b = calls[q];
    if (b.kind != a.kind || std::strcmp(b.label.name, a.label.name) != 0)
      return "ranks entered different collectives at" + at;
    if (std::strcmp(b.label.args, a.label.args) != 0)
      return std::string(a.label.name) + at + " with different arguments";
    if (b.kind == CollectiveKind::barrier) continue;
    if (b.dtype != a.dtype) return call_name(a) + at + " with different dtypes";
    if (b.kind != CollectiveKind::send_recv && b.count != a.count)
      return call_name(a) + at + " with different sizes";
    if (b.kind == CollectiveKind::broadcast && b.root != a.root) return "broadcast" + at + " with different roots";
  }
  if (a.kind == CollectiveKind::broadcast && (a.root < 0 || a.root >= n))
    return "broadcast" + at + " from root " + std::to_string(a.root) + ", outside the group";
  if (a.kind == CollectiveKind::send_recv) {
    for (int q = 0; q < n; ++q) {
      const CallRecord& c = calls[q];
      if (c.dst >= n || c.src >= n || c.dst < -1 || c.src < -1)
        return "send_recv" + at + ": " + names.rank(q) + " names a peer outside the group";
      if (c.src >= 0 && (calls[c.src].dst != q || calls[c.src].count != c.recv_count))
        return "send_recv" + at + ": " + names.rank(q) + " receives " + std::to_string(c.recv_count) + " from " +
               names.rank(c.src) + ", which does not send that to it";
      if (c.dst >= 0 && calls[c.dst].src != q)
        return "send_recv" + at + ": " + names.rank(q) + " sends to " + names.rank(c.dst) +
               ", which does not receive from it";
    }
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// The wrapper.

namespace {

class CheckedCommunicator final : public ForwardingCommunicator {
 public:
  CheckedCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<CallChannel> channel)
      : ForwardingCommunicator(std::move(inner)), channel_(std::move(channel)) {}
  // The exchange is an all-to-all barrier: the inner call is not needed.
  void barrier(CallOptions o) override { before(call_record(CollectiveKind::barrier), o); }

 private:
  void before(const CallRecord& call, CallOptions o) override {
    CallRecord mine = call;
    mine.label = o.label;
    const auto calls = channel_->exchange(mine, o.timeout_or(timeout()));
    if (channel_->checks()) return;
    const RankNames names = channel_->names();
    if (auto why = find_mismatch(calls, names)) channel_->stop("collective mismatch: " + *why + describe_calls(calls, names));
  }
  std::shared_ptr<CallChannel> channel_;
};

}  // namespace

std::unique_ptr<Communicator> checked_communicator(std::unique_ptr<Communicator> inner,
                                                   std::shared_ptr<CallChannel> channel) {
  return std::make_unique<CheckedCommunicator>(std::move(inner), std::move(channel));
}

}  // namespace cpsim
