// Sizes in bytes as cpsim reads and prints them: one convention, binary units
// (K = KiB = 1024 bytes), so that `--max-memory 8G` is reported as "8.0 GiB".
#pragma once

#include <cstdint>
#include <string>

namespace cpsim {

// "8", "64K", "16M", "1G", "2T", also with "iB" ("64KiB") or "B" ("64KB", the
// same binary unit), upper or lower case; 1 byte to 1 TiB. Throws InvalidInput
// naming the text otherwise.
std::int64_t parse_bytes(const std::string& text);
// "512 B", "12.0 KiB", "320.0 MiB", "8.0 GiB": one decimal, the largest unit
// that is at least 1.
std::string format_bytes(std::int64_t bytes);

}  // namespace cpsim
