// The exception family of cpsim. Every failure a user can cause or meet is one of
// these, thrown with the source location so a report points at the check that fired.
//   Error            base class
//   InvalidInput     a batch or argument breaks SPEC §1/§2 (names key, row, index)
//   CollectiveError  a distributed bug: mismatch, timeout, a rank that failed or left
//   Unsupported      a backend that does not implement an operation
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace cpsim {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class InvalidInput : public Error {
 public:
  explicit InvalidInput(const std::string& what) : Error(what) {}
};

class CollectiveError : public Error {
 public:
  explicit CollectiveError(const std::string& what) : Error(what) {}
};

class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& what) : Error(what) {}
};

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
