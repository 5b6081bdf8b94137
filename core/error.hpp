// The exception family of cpsim. Every failure a user can cause or meet is one of
// these, thrown with the source location so a report points at the check that fired.
//   Error            base class
//   InvalidInput     a batch or argument breaks SPEC §1/§2 (names key, row, index)
//   CollectiveError  a distributed bug: ranks whose calls do not match, a rank that
//                    threw or returned while its peers wait in a collective
//   Aborted          the run could not complete, whatever the code under test does:
//                    a rank timed out, died or lost its peers, memory ran out, a
//                    store or another resource failed (the command line's exit 3)
//   Unsupported      a backend that does not implement an operation ("backend X
//                    does not support Y")
//   Unavailable      what cannot run here: a backend not built in or without its
//                    device, more ranks than this machine can hold
#pragma once

#include <chrono>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace cpsim {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  // When the failure was raised: of the failures of one run, the earliest is the
  // root cause (run_ranks rethrows it), whichever rank's thread reports first.
  std::chrono::steady_clock::time_point when() const { return when_; }

 private:
  std::chrono::steady_clock::time_point when_ = std::chrono::steady_clock::now();
};

class InvalidInput : public Error {
 public:
  explicit InvalidInput(const std::string& what) : Error(what) {}
};

class CollectiveError : public Error {
 public:
  explicit CollectiveError(const std::string& what) : Error(what) {}
};

class Aborted : public Error {
 public:
  explicit Aborted(const std::string& what) : Error(what) {}
};

class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& what) : Error(what) {}
};

class Unavailable : public Error {
 public:
  explicit Unavailable(const std::string& what) : Error(what) {}
};

// How a failure is reported and what the command line exits with: the classes
// above, and the standard library's own exceptions in cpsim's words (running out
// of memory aborts a run; anything else escaping cpsim is an internal error,
// `what` being its own text).
enum class FailureKind : unsigned char { invalid_input, collective, aborted, unsupported, unavailable, internal };
struct FailureReport {
  FailureKind kind = FailureKind::internal;
  std::string what;
};
FailureReport classify_failure(const std::exception_ptr& failure);
// The inverse: throws the class of `failure` (a failure that travelled from
// another process, say).
[[noreturn]] void rethrow_failure(const FailureReport& failure);

// `text` as a message may quote it: control characters escaped (\x00), at most
// `most` characters, then "..." and the full length.
std::string printable(const std::string& text, std::size_t most = 48);

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace cpsim

// Invariant check for programming errors inside cpsim (not user input).
#define CPSIM_ENFORCE(cond, ...)                                                \
  do {                                                                          \
    if (!(cond))                                                                \
      throw ::cpsim::Error(::cpsim::detail::concat(__FILE__, ":", __LINE__,     \
                                                   ": ", #cond, ": ", __VA_ARGS__)); \
  } while (0)

// A user-facing input error; the message must name the key, row and index.
#define CPSIM_INVALID(...) \
  throw ::cpsim::InvalidInput(::cpsim::detail::concat(__VA_ARGS__))
