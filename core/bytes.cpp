#include "core/bytes.hpp"

#include <cctype>
#include <cstdio>

#include "core/error.hpp"

namespace cpsim {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t at = 0;
  while (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at]))) ++at;
  if (at == 0 || at > 13) CPSIM_INVALID("size '", text, "' is not a number of bytes (8, 64K, 16M, 1G)");
  const long long v = std::stoll(text.substr(0, at));
  std::string unit;
  for (char ch : text.substr(at)) unit += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (unit.size() > 1 && (unit.substr(1) == "IB" || unit.substr(1) == "B")) unit = unit.substr(0, 1);
  int shift = 0;
  if (unit == "K") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  else if (!unit.empty() && unit != "B") CPSIM_INVALID("size '", text, "': unit '", text.substr(at), "' (K, M, G or T: binary, K = 1024)");
  if (v == 0 || v > (1ll << 40) >> shift) CPSIM_INVALID("size '", text, "' out of range (1 byte to 1T)");
  return static_cast<std::int64_t>(v) << shift;
}

std::string format_bytes(std::int64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (u < 4 && v >= 1024) v /= 1024, ++u;
  char out[32];
  if (u == 0) std::snprintf(out, sizeof out, "%lld B", static_cast<long long>(bytes));
  else std::snprintf(out, sizeof out, "%.1f %s", v, units[u]);
  return out;
}

}  // namespace cpsim
