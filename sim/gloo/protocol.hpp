// What the parts of the gloo backend share: its capabilities and the slots its
// own messages use (outside the ranges of Gloo's collectives).
#pragma once

#include <cstdint>

#include "core/comm/communicator.hpp"

namespace cpsim::sim {

// Every sum is a rank-order sum over gathered contributions: bitwise threads.
inline constexpr Capabilities kGlooCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/false,
                                         /*stream_ordered=*/false};

// Slots outside the ranges Gloo's own collectives use (prefix << 56 | tag).
inline constexpr std::uint64_t kCallSlot = 0xC5ull << 56 | 1;
inline constexpr std::uint64_t kPointToPointSlot = 0xC5ull << 56 | 2;
inline constexpr std::uint64_t kGatherSlot = 0xC5ull << 56 | 3;

}  // namespace cpsim::sim
