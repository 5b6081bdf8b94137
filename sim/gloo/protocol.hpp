// What the parts of the gloo backend share: its capabilities and the slots its
// own messages use (outside the ranges of Gloo's collectives).
#pragma once

#include <cstdint>

#include "core/comm/communicator.hpp"

namespace cpsim::sim {

// Every sum is a rank-order sum over gathered contributions: bitwise threads.
inline constexpr Capabilities kGlooCapabilities{/*rank_order_sums=*/true, /*device_buffers=*/false,
                                         /*stream_ordered=*/false};

// Every slot of cpsim's own messages, outside the ranges Gloo's collectives use
// (prefix << 56 | tag): one table, so that no two uses share one.
inline constexpr std::uint64_t kCallSlot = 0xC5ull << 56 | 1;          // the call check's records
inline constexpr std::uint64_t kPointToPointSlot = 0xC5ull << 56 | 2;  // the communicator's send / recv
inline constexpr std::uint64_t kGatherSlot = 0xC5ull << 56 | 3;        // the communicator's gathers
inline constexpr std::uint64_t kWireHeaderSlot = 0xC5ull << 56 | 8;    // the process wire (torch's point to point): headers
inline constexpr std::uint64_t kWirePayloadSlot = 0xC5ull << 56 | 9;   // and their bytes: see wire_payload_slot

// The slot of a sender's n-th payload of the process wire: every payload its own
// slot, named in its header, so that a payload can only meet the receive posted
// for it (two threads of one process sending to one peer, a message and a
// notice, may post their headers and payloads interleaved). 40 bits of n, above
// the table's low byte: it wraps after 10^12 messages of one sender.
inline constexpr std::uint64_t wire_payload_slot(std::uint64_t n) {
  return kWirePayloadSlot | (n & ((1ull << 40) - 1)) << 8;
}

}  // namespace cpsim::sim
