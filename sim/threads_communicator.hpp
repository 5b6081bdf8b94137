// The `threads` backend: ranks are threads of one process and collectives move
// bytes through shared memory, one copy per byte (each rank pulls what it needs
// straight from its peers' buffers, found through the rendezvous). Reductions add
// in rank order, so results are bitwise deterministic. Every call goes through
// core/comm/rendezvous.hpp, which checks it against the peers' calls and turns
// distributed bugs into CollectiveErrors on every rank. Registered as "threads".
#pragma once

#include <memory>

#include "core/comm/communicator.hpp"
#include "core/comm/rendezvous.hpp"

namespace cpsim::sim {

// Rank `rank` of the group that meets at `rendezvous`.
std::unique_ptr<Communicator> threads_communicator(std::shared_ptr<Rendezvous> rendezvous, int rank);

}  // namespace cpsim::sim
