// Stores (memory, file:DIR, redis://HOST:PORT) and the failure records in them.
#include <fcntl.h>
#include <unistd.h>

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <hiredis/hiredis.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "core/error.hpp"
#include "sim/gloo/connect.hpp"
#include "sim/gloo/store.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Stores and devices.

namespace {
// Gloo's FileStore and RedisStore wait in whole seconds (they compare the time
// waited, cut to seconds, with the limit): a wait of 1 ms for a key that is not
// there took a second, so every probe of a missing key (a peer not yet present,
// a failure record not written) overran its deadline, by seconds where a rank
// probes several. Waits under a second look at the keys themselves, every
// millisecond, until their own deadline.
std::atomic<long long> command_limit_ms{0};  // limit_store_commands (0: none)

// A short wait's key is not there (the store answered); any other exception from
// a store is the store failing.
struct KeyMissing : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A wait is also held to the process's limit: Gloo's get waits 60 s for its key,
// whatever the job's timeout.
template <class Base>
class ShortWaits : public Base {
 public:
  using Base::Base;
  using Base::wait;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& asked) override {
    const long long limit = command_limit_ms.load();
    const auto timeout = limit > 0 ? std::min(asked, std::chrono::milliseconds(limit)) : asked;
    if (timeout >= 1s) return Base::wait(keys, timeout);
    const auto deadline = Clock::now() + timeout;
    while (!this->check(keys)) {
      if (Clock::now() >= deadline) throw KeyMissing("Wait timeout for key(s) in the store");
      std::this_thread::sleep_for(1ms);
    }
  }
};
using FileStore = ShortWaits<gloo::rendezvous::FileStore>;

// Gloo's RedisStore sends its commands with no time limit: over a cut link one
// blocks until TCP gives up, minutes later. Each command here is bounded by the
// process's limit (a socket timeout; after one expires, the connection's later
// commands fail at once).
class RedisStore final : public ShortWaits<gloo::rendezvous::RedisStore> {
 public:
  using ShortWaits::ShortWaits;
  using ShortWaits::wait;
  void set(const std::string& key, const std::vector<char>& data) override {
    bound();
    ShortWaits::set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    bound();
    return ShortWaits::get(key);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    bound();
    ShortWaits::wait(keys, timeout);
  }

 private:
  void bound() {
    const long long ms = command_limit_ms.load();
    if (ms <= 0 || ms == applied_ms_) return;
    const timeval limit{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>(ms % 1000 * 1000)};
    redisSetTimeout(redis_, limit);
    applied_ms_ = ms;
  }
  long long applied_ms_ = 0;
};
}  // namespace

void limit_store_commands(std::chrono::milliseconds limit) { command_limit_ms = limit.count(); }

void shorten_store_commands(std::chrono::milliseconds limit) {
  long long now = command_limit_ms.load();
  while ((now <= 0 || now > limit.count()) && !command_limit_ms.compare_exchange_weak(now, limit.count())) {
  }
}

std::shared_ptr<Store> open_store(const std::string& spec) {
  if (spec == "memory") return std::make_shared<gloo::rendezvous::HashStore>();
  if (spec.rfind("file:", 0) == 0) {
    const std::string dir = spec.substr(5);
    if (dir.empty()) CPSIM_INVALID("store '", spec, "': file: needs a directory, as in file:/shared/cpsim-job");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (!std::filesystem::is_directory(dir))
      throw Aborted("store '" + spec + "': cannot create the directory " + dir + (ec ? " (" + ec.message() + ")" : ""));
    return std::make_shared<FileStore>(dir);
  }
  if (spec.rfind("redis://", 0) == 0) {
    const std::string rest = spec.substr(8);
    const auto colon = rest.rfind(':');
    std::string host = rest;
    int port = 6379;
    if (colon != std::string::npos) {
      host = rest.substr(0, colon);
      try {
        std::size_t used = 0;
        port = std::stoi(rest.substr(colon + 1), &used);
        if (used != rest.size() - colon - 1 || port <= 0 || port > 65535) throw std::invalid_argument("port");
      } catch (const std::exception&) {
        CPSIM_INVALID("store '", spec, "': the port must be a number from 1 to 65535");
      }
    }
    if (host.empty()) CPSIM_INVALID("store '", spec, "': redis:// needs a host, as in redis://10.0.0.1:6379");
    // Gloo's RedisStore leaks its connection when it cannot connect: see first. It
    // gives a connection 2 s; on a lossy link (a SYN lost twice) that is not
    // enough: tried again until the process's limit (a job's timeout), if any.
    const long long limit = command_limit_ms.load();
    const auto deadline = Clock::now() + std::chrono::milliseconds(limit);
    for (;;) {
      const timeval connect_timeout{5, 0};
      redisContext* probe = redisConnectWithTimeout(host.c_str(), port, connect_timeout);
      std::string why = !probe ? "out of memory" : probe->err ? probe->errstr : "";
      if (probe) redisFree(probe);
      if (why.empty()) {
        try {
          return std::make_shared<RedisStore>(host, port);
        } catch (const std::exception& e) {
          why = e.what();
        }
      }
      if (limit <= 0 || Clock::now() >= deadline)
        throw Aborted("cannot reach the Redis store at " + host + ":" + std::to_string(port) + ": " + why);
      std::this_thread::sleep_for(100ms);
    }
  }
  CPSIM_INVALID("store '", spec, "': expected file:DIR or redis://HOST:PORT");
}

std::optional<std::string> claim_key(const std::string& spec, Store& store, const std::string& key,
                                     const std::string& value) {
  if (spec.rfind("file:", 0) == 0) {
    // Gloo's FileStore checks, then renames: two processes can both win. An
    // exclusive create cannot (also on NFS v3+). The name is the key, made a file name.
    std::string name = "cpsim-claim-";
    for (unsigned char c : key) name += std::isalnum(c) || c == '-' || c == '.' ? static_cast<char>(c) : '_';
    const std::string path = spec.substr(5) + "/" + name;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const bool written = ::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
      ::close(fd);
      if (!written) throw Aborted("store '" + spec + "': cannot write " + path + " (" + std::strerror(errno) + ")");
      return std::nullopt;
    }
    if (errno != EEXIST) throw Aborted("store '" + spec + "': cannot create " + path + " (" + std::strerror(errno) + ")");
    std::string holder;
    for (int attempt = 0; attempt < 100 && holder.empty(); ++attempt) {  // the winner may be writing it now
      std::ifstream in(path);
      std::getline(in, holder, '\0');
      if (holder.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return holder.empty() ? std::string("another process") : holder;
  }
  // Redis (SETNX) and the in-memory store refuse a key that is set.
  try {
    store.set(key, std::vector<char>(value.begin(), value.end()));
    return std::nullopt;
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("already set") == std::string::npos) throw Aborted("store '" + spec + "': " + e.what());
  }
  try {
    const auto v = store.get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    return std::string("another process");
  }
}

bool store_has(Store& store, const std::string& key, bool* failed) {
  try {
    store.wait({key}, 1ms);
    return true;
  } catch (const KeyMissing&) {
    return false;
  } catch (const std::exception&) {
    if (failed) *failed = true;
    return false;
  }
}

std::optional<std::string> failure_record(Store& records, int rank, bool* failed) {
  const std::string key = "failed/" + std::to_string(rank);
  if (!store_has(records, key, failed)) return std::nullopt;
  try {
    const auto v = records.get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    if (failed) *failed = true;
    return std::nullopt;
  }
}

bool is_launch_record(const std::string& record) { return record.find(kLaunchRecordTag) != std::string::npos; }

std::string launch_records(Store& records, int size, int except) {
  std::string died;
  for (int q = 0; q < size; ++q) {
    if (q == except) continue;
    if (const auto record = failure_record(records, q); record && is_launch_record(*record)) died += "\n  " + *record;
  }
  return died;
}

}  // namespace cpsim::sim
