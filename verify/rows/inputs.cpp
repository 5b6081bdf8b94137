#include "verify/rows/inputs.hpp"

#include "verify/random.hpp"

namespace cpsim::verify::inputs {

Conv conv(const LayoutTruth& truth, std::int64_t rows, std::int64_t padded_len, const CheckOptions& o,
          std::uint64_t seed) {
  const std::int64_t P = padded_len, C = o.channels, W = o.conv_width;
  return {masked_activation(truth, P, C, mix_seed(seed, 41)), random_tensor({C, W}, DType::f64, mix_seed(seed, 42)),
          random_tensor({C}, DType::f64, mix_seed(seed, 43)), random_tensor({rows, P, C}, DType::f64, mix_seed(seed, 44))};
}

Tensor halo_forward_x(const LayoutTruth& truth, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed) {
  return masked_activation(truth, padded_len, o.channels, mix_seed(seed, 31));
}

Tensor halo_backward_x(const LayoutTruth& truth, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed) {
  return masked_activation(truth, padded_len, o.channels, mix_seed(seed, 32));
}

Tensor halo_upstream(const Shape& window, int rank, std::uint64_t seed) {
  return random_tensor(window, DType::f64, mix_seed(seed, 300 + rank));
}

Tensor gather_forward_global(const Shape& shape, DType dtype, std::uint64_t seed) {
  return random_tensor(shape, dtype, mix_seed(seed, static_cast<int>(dtype)));
}

Tensor gather_backward_global(const Shape& shape, DType dtype, std::uint64_t seed) {
  return random_tensor(shape, dtype, mix_seed(seed, 11));
}

Tensor gather_upstream(const Shape& shape, DType dtype, int rank, std::uint64_t seed) {
  return random_tensor(shape, dtype, mix_seed(seed, 100 + rank));
}

Anchor anchor(const Shape& shape, int cp, std::uint64_t seed) {
  Anchor a{random_tensor(shape, DType::f64, mix_seed(seed, 21)), {}, std::vector<bool>(cp)};
  SplitMix64 rng(mix_seed(seed, 22));
  for (int q = 0; q < cp; ++q) {
    a.upstream.push_back(random_tensor(shape, DType::f64, mix_seed(seed, 200 + q)));
    a.uses[q] = rng.below(2) == 1;
  }
  return a;
}

bool live_gates(const CheckOptions& o, std::uint64_t seed) {
  return o.live_gates_every > 0 && SplitMix64(mix_seed(seed, 53)).below(o.live_gates_every) == 0;
}

RecurrenceInputs step_recurrence(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, int step,
                                 std::uint64_t seed) {
  return random_recurrence_inputs(rows, padded_len, o.heads, o.key_dim, o.value_dim, mix_seed(seed, 101 + step),
                                  live_gates(o, seed));
}

Recurrence recurrence(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed) {
  return {random_recurrence_inputs(rows, padded_len, o.heads, o.key_dim, o.value_dim, mix_seed(seed, 51),
                                   live_gates(o, seed)),
          random_tensor({rows, padded_len, o.heads, o.value_dim}, DType::f64, mix_seed(seed, 52))};
}

Rope rope(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed) {
  const Shape shape{rows, padded_len, o.heads, o.rope_dim()};
  return {random_tensor(shape, DType::f64, mix_seed(seed, 61)), random_tensor(shape, DType::f64, mix_seed(seed, 62))};
}

AttentionInputs attention(std::int64_t rows, std::int64_t padded_len, const CheckOptions& o, std::uint64_t seed) {
  return random_attention_inputs(rows, padded_len, o.heads, o.rope_dim(), o.value_dim, o.index_dim, mix_seed(seed, 70));
}

LossInputs loss(const Tensor& padded_input_ids, const CheckOptions& o, std::uint64_t seed) {
  return random_loss_inputs(padded_input_ids, o.vocab, mix_seed(seed, 91));
}

TokenShift token_shift(const LayoutTruth& truth, std::int64_t rows, std::int64_t padded_len, const CheckOptions& o,
                       std::uint64_t seed) {
  return {masked_activation(truth, padded_len, o.channels, mix_seed(seed, 81)),
          random_tensor({rows, padded_len, o.channels}, DType::f64, mix_seed(seed, 82))};
}

SplitMix64 query_sampler(std::uint64_t seed) { return SplitMix64(mix_seed(seed, 75)); }

}  // namespace cpsim::verify::inputs
