// Convolution halos (SPEC §3): the W-1 global positions before a rank's shard,
// fetched from however many earlier ranks hold them (a shard may be shorter than
// W-1), with a backward that returns each history gradient to its owner.
#pragma once

#include "core/autograd.hpp"
#include "core/comm/communicator.hpp"
#include "core/shard_plan.hpp"

namespace cpsim {

// How the history travels. Both give identical results; the benchmark picks.
enum class HaloExchange {
  all_gather,  // one all-gather of every rank's last min(L_r, W-1) positions (reduce-scatter back)
  send_recv,   // hops r-k -> r for each distance k some earlier rank's positions lie at (and back)
};
const char* halo_exchange_name(HaloExchange e);

// [B, L_r, C] (invalid positions already zeroed) -> [B, W-1, C]: the history
// alone, the W-1 global positions before the rank's interval a_r (zeros before
// position 0), from however many earlier ranks hold them. Its cost, forward and
// backward, follows the W-1 positions it moves, not L_r (the backward's dx is
// zero but for the last min(L_r, W-1) positions). `plan` as below.
Var convolution_halo(const Var& x_masked, Communicator* comm, int width,
                     HaloExchange exchange = HaloExchange::send_recv, const ShardPlan* plan = nullptr);

// [B, L_r, C] (invalid positions already zeroed) -> [B, L_r+W-1, C]: the W-1
// global positions before the rank's interval a_r, then the shard; positions
// before global 0 are zeros. `plan` gives every rank's interval (nullptr: equal
// intervals of x's length); the history may span several earlier ranks, empty
// ones skipped. nullptr or one rank: zeros then the shard. W = 1 returns x itself.
// The history is convolution_halo's; prepending it copies the shard once.
Var convolution_history(const Var& x_masked, Communicator* comm, int width,
                        HaloExchange exchange = HaloExchange::send_recv, const ShardPlan* plan = nullptr);

}  // namespace cpsim
