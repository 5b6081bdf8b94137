// Convolution halos (SPEC §3): the W-1 global positions before a rank's shard,
// fetched from however many earlier ranks hold them (a shard may be shorter than
// W-1), with a backward that returns each history gradient to its owner.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"

namespace cpsim {

// How the history travels. Both give identical results; the benchmark picks.
enum class HaloExchange {
  all_gather,  // one all-gather of every rank's last min(L, W-1) positions (reduce-scatter back)
  send_recv,   // ceil((W-1)/L) neighbour hops r-k -> r (and back in backward)
};
const char* halo_exchange_name(HaloExchange e);

// [B, L, C] (invalid positions already zeroed) -> [B, L+W-1, C]: the W-1 global
// positions before r*L, then the shard. Positions before global 0 are zeros.
// nullptr or one rank: zeros then the shard. W = 1 returns x itself.
Var convolution_history(const Var& x_masked, Communicator* comm, int width,
                        HaloExchange exchange = HaloExchange::send_recv);

}  // namespace cpsim
