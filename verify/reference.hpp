// Unsharded references for every property, written plainly (token-by-token loops)
// and separately from the sharded code in core/, so a shared bug cannot hide.
#pragma once

#include <cstdint>
#include <vector>

#include "core/shard.hpp"
#include "verify/cases.hpp"

namespace cpsim::verify {

// The layout SPEC §1 gives a batch, read from its raw keys by plain code of its
// own (1-D tensors read as one row; either cu_seqlens key alone serves as both).
// It never calls core/: a reference built from the code it checks would share
// its bugs. It assumes valid input (validation is the code under test's job).
LayoutTruth reference_layout(const Batch& raw);

// B and S of a raw batch: the rows and columns of input_ids (1-D: one row).
struct ReferenceShape {
  std::int64_t rows = 0, seq_len = 0;
};
ReferenceShape reference_shape(const Batch& raw);

// SPEC §2: P = roundup(S, c*m); rank r owns [a_r, a_{r+1}) of the plan's cuts
// (equal intervals: a_r = r*P/c).
struct ReferenceGeometry {
  std::int64_t seq_len = 0, padded_len = 0;
  int cp = 1;
  std::vector<std::int64_t> cuts;  // c + 1
  std::int64_t start(int rank) const { return cuts[rank]; }
  std::int64_t end(int rank) const { return cuts[rank + 1]; }
  std::int64_t size(int rank) const { return cuts[rank + 1] - cuts[rank]; }
  std::int64_t largest() const;
};
// Equal intervals.
ReferenceGeometry reference_geometry(std::int64_t seq_len, int cp, std::int64_t pad_multiple = 1);
// The cuts of SPEC §2's plans, by plain loops: equal; balanced (per-token cost
// `attention * (t - first position of t's document + 1) + linear` for a real token, 0 for
// padding; a_r the smallest t with c * cost[0, t) >= r * total, summed over rows;
// total 0: equal); given cuts as they are.
std::vector<std::int64_t> reference_cuts(const LayoutTruth& layout, std::int64_t padded_len, int cp,
                                         const PlanChoice& plan);

// Segment boundaries by a direct scan.
std::vector<std::int64_t> reference_segments(const std::vector<std::int64_t>& ids);

// The padded global tensors of SPEC §2 ([B, P]) that the shards must concatenate to:
// every key but the packing lengths, with its fill value (0 for keys SPEC §2 does
// not name), plus padding_mask and position_ids from the reference layout.
Batch reference_padded_global(const LayoutCase& c, std::int64_t padded_len);
std::vector<std::int64_t> reference_padded_doc_ids_row(const LayoutTruth& t, int row, std::int64_t padded_len);

// FLA CP context by walking tokens one at a time (ranks with empty intervals are
// never counted; an empty rank's context is empty).
FlaCpContext reference_cp_context(const std::vector<std::int64_t>& padded_ids_row, const ReferenceGeometry& g,
                                  int rank);

// Relative RMSE in float64: rms(ref - got) / rms(ref); 0 when both are 0, inf on
// a shape mismatch, and inf when one side holds a NaN or an inf where the other
// does not (the same non-finite value on both sides agrees). Compare it with
// !(e <= tol): a NaN measure must never pass.
double relative_rmse(const Tensor& ref, const Tensor& got);
// rms(ref - got) / rms(scale): for a sum, `scale` the sums of its absolute terms
// (the scale its rounding follows in any order); 0 when ref and got agree, inf on
// a shape mismatch, a zero scale or a non-finite mismatch.
double relative_rmse(const Tensor& ref, const Tensor& got, const Tensor& scale);
// The first element (flat index, in element order) where one side holds a NaN or
// an inf that the other does not; -1 when there is none (or the shapes differ).
std::int64_t first_nonfinite_mismatch(const Tensor& ref, const Tensor& got);
// "element [i, j, ...] is nan, expected 0.25": what a comparison says of such an
// element (flat index `at` into `ref`'s shape).
std::string describe_element(const Tensor& ref, const Tensor& got, std::int64_t at);
// A tensor's values on the host as `dtype`: the tensor itself when it already is,
// else a converted copy (the references read through typed pointers).
Tensor host_values(const Tensor& t, DType dtype);
// Number of elements whose bytes differ (inf-like large on shape/dtype mismatch).
std::int64_t count_wrong(const Tensor& ref, const Tensor& got);

}  // namespace cpsim::verify

namespace cpsim::verify {

// The masked global activation [B, P, C] a case convolves: seeded, zero at padding.
Tensor masked_activation(const LayoutTruth& layout, std::int64_t padded_len, std::int64_t channels, std::uint64_t seed);
// Global doc ids [B, P] of a layout, padded with 0.
Tensor reference_padded_doc_ids(const LayoutTruth& layout, std::int64_t padded_len);

// Halo of rank `rank`: the W-1 positions before rank*L (zeros before 0), then the shard.
Tensor reference_history(const Tensor& global, std::int64_t rank_start, std::int64_t L, int width);

struct ConvReference {
  Tensor y, dx, dw, dbias;
  // The sums of the absolute terms of dw and dbias (sum |x g|, sum |g|): the scale
  // their rounding errors follow in any summation order, however much they cancel.
  Tensor dw_terms, dbias_terms;
};
// Unsharded packed causal conv over [B, P, C], taps cut at segment starts found by
// scanning back; backward for upstream gy (may be undefined: forward only).
ConvReference reference_conv(const Tensor& x, const Tensor& doc_ids, const Tensor& w, const Tensor& bias,
                             const Tensor& gy);

}  // namespace cpsim::verify

namespace cpsim::verify {

// Inputs of one recurrence layer over the whole (padded) sequence, float64.
struct RecurrenceInputs {
  Tensor q, k, v, beta, g;  // [B,P,H,K], [B,P,H,K], [B,P,H,V], [B,P,H], [B,P,H,K]
};
// Live gates: each head's log-decay scaled by its own factor, 1, 0.01, 0.1 or 0
// in a drawn rotation (heads differ; one in two or more keeps a state alive over
// a 64-token chunk: e^(-0.32) a chunk at 0.01, none at 0); else every head's in
// [-1, 0] (a state all but gone within a chunk).
RecurrenceInputs random_recurrence_inputs(std::int64_t B, std::int64_t P, std::int64_t H, std::int64_t K,
                                          std::int64_t V, std::uint64_t seed, bool live_gates = false);

struct RecurrenceReference {
  Tensor o, dq, dk, dv, dbeta, dg;
};
// Token-by-token gated delta rule with a reset at every segment start of `doc_ids`
// [B, P]; backward for upstream d_o (undefined: forward only).
RecurrenceReference reference_recurrence(const RecurrenceInputs& in, const Tensor& doc_ids, const Tensor& d_o);

// What the CP recurrence passes between ranks, for the rank whose shard is
// [start, start + L) ([B, H, ...], per row and head, from the unsharded run):
// the state its first token starts from (the state after token start-1, or 0
// where a segment starts at `start`); the state after its last token; and the
// transition of its last local segment (from that segment's first local token to
// the shard's end, from a zero state): S_out = M S_in + S_ext, M [K, K]. A rank
// with an empty interval (L = 0) has none of these: all four are zero.
struct RecurrenceStates {
  Tensor initial, final_state, m, s_ext;
};
RecurrenceStates reference_recurrence_states(const RecurrenceInputs& in, const Tensor& doc_ids, std::int64_t start,
                                             std::int64_t L);

// The gather's backward, unsharded: rank `rank`'s gradient is the rank-order sum,
// over the ranks q with contributes[q], of upstream[q][:, start(rank) : +L]
// (float32 or float64, added in that type).
Tensor reference_gather_backward(DType dt, const std::vector<Tensor>& upstream, const std::vector<bool>& contributes,
                                 const ReferenceGeometry& g, int rank);

}  // namespace cpsim::verify
