#include "core/error.hpp"

#include <new>

namespace cpsim {

std::string printable(const std::string& text, std::size_t most) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < most; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > most) out += "... (" + std::to_string(text.size()) + " characters)";
  return out;
}

FailureReport classify_failure(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const InvalidInput& e) {
    return {FailureKind::invalid_input, e.what()};
  } catch (const CollectiveError& e) {
    return {FailureKind::collective, e.what()};
  } catch (const Aborted& e) {
    return {FailureKind::aborted, e.what()};
  } catch (const Unsupported& e) {
    return {FailureKind::unsupported, e.what()};
  } catch (const Unavailable& e) {
    return {FailureKind::unavailable, e.what()};
  } catch (const Error& e) {
    return {FailureKind::internal, e.what()};
  } catch (const std::bad_alloc&) {
    return {FailureKind::aborted,
            "out of memory: an allocation failed (a larger batch or CP size than this machine's memory, or an "
            "address-space limit, ulimit -v, holds)"};
  } catch (const std::exception& e) {
    return {FailureKind::internal, e.what()};
  } catch (...) {
    return {FailureKind::internal, "an exception that is not a std::exception"};
  }
}

void rethrow_failure(const FailureReport& failure) {
  switch (failure.kind) {
    case FailureKind::invalid_input: throw InvalidInput(failure.what);
    case FailureKind::collective: throw CollectiveError(failure.what);
    case FailureKind::aborted: throw Aborted(failure.what);
    case FailureKind::unsupported: throw Unsupported(failure.what);
    case FailureKind::unavailable: throw Unavailable(failure.what);
    case FailureKind::internal: break;
  }
  throw Error(failure.what);
}

}  // namespace cpsim
