// The inputs each property row draws from its case's seed, one function each,
// and the only place their seeds are written (every draw of a row is
// mix_seed(case seed, stream) in inputs.cpp; a helper that draws several tensors
// from one stream mixes it further; Golden.EveryRowSeedIsWrittenInInputsCpp
// holds the rule): the rows (verify/rows/) and
// `cpsim golden` (verify/golden.cpp) both call these, so a golden folder holds
// exactly the inputs `cpsim check` compares on (tests/verify/test_golden.cpp holds
// them equal).
#pragma once

#include <cstdint>
#include <vector>

#include "verify/properties.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"
#include "verify/reference_layers.hpp"

namespace cpsim::verify::inputs {

// The conv layer's: the activation [B, P, C] (zero at padding), the depthwise
// weight [C, W], the bias [C] and the upstream gradient of its output [B, P, C].
struct Conv {
  Tensor x, weight, bias, grad_y;
};
Conv conv(const LayoutTruth& truth, std::int64_t rows, std::int64_t padded_len, const CheckOptions& o,
          std::uint64_t seed);

// The halo rows': the activation [B, P, C] each exchange carries (forward, and
// backward), and rank q's upstream gradient of its window [B, L_q + W - 1, C].
Tensor halo_forward_x(const LayoutTruth& truth, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed);
Tensor halo_backward_x(const LayoutTruth& truth, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed);
Tensor halo_upstream(const Shape& window, int rank, std::uint64_t seed);

// The gather rows': the gathered tensor of each dtype the forward row runs, the
// backward row's global tensor and rank q's upstream gradient of what it
// gathered (both of `shape`, in `dtype`).
Tensor gather_forward_global(const Shape& shape, DType dtype, std::uint64_t seed);
Tensor gather_backward_global(const Shape& shape, DType dtype, std::uint64_t seed);
Tensor gather_upstream(const Shape& shape, DType dtype, int rank, std::uint64_t seed);

// The anchor row's: the gathered tensor [B, P, C], rank q's upstream gradient,
// and whether rank q's loss uses the gathered tensor at all (drawn per rank).
struct Anchor {
  Tensor global;
  std::vector<Tensor> upstream;
  std::vector<bool> uses;
};
Anchor anchor(const Shape& shape, int cp, std::uint64_t seed);

// The recurrence layer's: q, k, v, beta, g over the padded sequence, and the
// upstream gradient of its output o [B, P, H, V].
struct Recurrence {
  RecurrenceInputs in;
  Tensor grad_o;
};
Recurrence recurrence(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed);
// Whether the case of `seed` draws live gates (CheckOptions::live_gates_every).
bool live_gates(const CheckOptions& o, std::uint64_t seed);

// The two_steps row's recurrence inputs of step k (0, 1) of a training loop.
RecurrenceInputs step_recurrence(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, int step,
                                 std::uint64_t seed);

// RoPE's: x [B, P, H, D] (D: key_dim rounded up to even) and the upstream gradient.
struct Rope {
  Tensor x, grad_y;
};
Rope rope(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed);

// The attention layer's (dense and sparse: one set): q, k, v before RoPE, the
// upstream gradient, and the indexer's query and key.
AttentionInputs attention(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed);

// The loss's: the padded input ids folded into the vocabulary, and logits.
LossInputs loss(const Tensor& padded_input_ids, const CheckOptions& o, std::uint64_t seed);
// The token shift's: the activation [B, P, C] (zero at padding) and the upstream
// gradient of its output.
struct TokenShift {
  Tensor x, grad_y;
};
TokenShift token_shift(const LayoutTruth& truth, std::int64_t rows, std::int64_t padded_len, const CheckOptions& o,
                       std::uint64_t seed);
// The attention rows' sampler of queries beyond the chosen ones.
SplitMix64 query_sampler(std::uint64_t seed);

}  // namespace cpsim::verify::inputs
