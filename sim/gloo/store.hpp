// Stores of the gloo backend (store.cpp): where the processes of a job meet
// and leave failure records (docs/backends.md, "Gloo").
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gloo::rendezvous {
class Store;
}

namespace cpsim::sim {

using Store = gloo::rendezvous::Store;

// A store (where the processes of a job meet and leave failure records) from its spec: "memory" (this process only), "file:DIR"
// (a directory every process can reach) or "redis://HOST:PORT". Throws
// InvalidInput on a malformed spec.
std::shared_ptr<Store> open_store(const std::string& spec);

// The time one command to a Redis store, or one wait for a key, may take, for
// every store of this process (none until set): a job sets its timeout, so a
// store behind a cut link fails its command instead of blocking until TCP gives
// up, and a key that never comes is given up on with the job; a rank that is
// failing shortens it (its records are worth a moment, not another timeout).
void limit_store_commands(std::chrono::milliseconds limit);
void shorten_store_commands(std::chrono::milliseconds limit);  // to at most `limit`

// Failure records (key failed/<rank> of a job) that cpsim launch writes for a
// process that died carry this tag; they are the root cause and are named first.
inline constexpr const char* kLaunchRecordTag = "(seen by cpsim launch)";

// Sets `key` of `store` (opened from `spec`) to `value` unless a value is there:
// atomically, across processes and hosts (Redis SETNX, an exclusive create in a
// file store's directory, the in-memory store's lock). Returns the value that was
// there first when this claim lost.
std::optional<std::string> claim_key(const std::string& spec, Store& store, const std::string& key,
                                     const std::string& value);

// Whether `key` is in the store now (no waiting).
bool store_has(Store& store, const std::string& key, bool* failed = nullptr);  // *failed: the store did not answer

// The failure record of `rank` (key failed/<rank>), if one is in the store now.
std::optional<std::string> failure_record(Store& records, int rank, bool* failed = nullptr);
// Whether a record is one cpsim launch wrote for a process that died.
bool is_launch_record(const std::string& record);
// The records cpsim launch wrote for dead processes among ranks [0, size) other
// than `except`, each on a line of its own ("\n  ..."), or "".
std::string launch_records(Store& records, int size, int except);

}  // namespace cpsim::sim
