// Contiguous CP sharding (SPEC §2): the padded length, each rank's interval,
// shard_batch, the packed context every layer consults, and the per-row CP
// context recurrent layers need (flash-linear-attention's build_cp_context).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "core/comm/communicator.hpp"
#include "core/layout.hpp"
#include "core/shard_plan.hpp"

namespace cpsim {

// Positions [start, start+len) of a [B, S] tensor, `fill` outside [0, S) (the
// slice kernel): a shard of the padded sequence, or a window before position 0.
Tensor slice_sequence(const Tensor& t, std::int64_t start, std::int64_t len, std::int64_t fill);

// P = roundup(S, c*m); rank r owns [r*L, (r+1)*L) with L = P/c.
struct ShardGeometry {
  std::int64_t seq_len = 0;     // S
  int cp_size = 1;              // c
  std::int64_t padded_len = 0;  // P
  std::int64_t local_len = 0;   // L
  std::int64_t start(int rank) const { return rank * local_len; }
  int owner(std::int64_t position) const { return static_cast<int>(position / local_len); }
};
ShardGeometry shard_geometry(std::int64_t seq_len, int cp_size, std::int64_t pad_multiple = 1);

// Global packed-document layout for one model step, seen from one rank: the doc
// ids of the whole padded row, and the shard plan (every rank's interval).
class PackedContext {
 public:
  PackedContext() = default;
  PackedContext(Tensor doc_ids, ShardPlan plan, int rank, std::int64_t original_seq_len);
  PackedContext(const PackedContext& other);
  PackedContext& operator=(const PackedContext& other);

  const Tensor& doc_ids() const { return doc_ids_; }  // [B, P], global
  const ShardPlan& plan() const { return plan_; }
  int rank() const { return rank_; }
  std::int64_t seq_start() const { return plan_.begin(rank_); }
  int cp_size() const { return plan_.ranks(); }
  std::int64_t original_seq_len() const { return original_seq_len_; }
  bool cp_enabled() const { return cp_size() > 1; }
  std::int64_t local_seq_len() const { return plan_.size(rank_); }
  Tensor local_doc_ids() const;  // [B, L]
  // Segment boundaries of this rank's shard of `row`, clipped, covering [0, L]. Cached.
  const std::vector<std::int64_t>& row_cu_seqlens(int row) const;

 private:
  Tensor doc_ids_;
  ShardPlan plan_{{0, 0}};
  int rank_ = 0;
  std::int64_t original_seq_len_ = 0;
  mutable std::mutex mutex_;
  mutable std::map<int, std::vector<std::int64_t>> cu_cache_;
};

struct ShardedBatch {
  Batch local;
  PackedContext context;
};

// Pads the sequence to P with the SPEC §2 fill values and keeps `rank`'s slice of
// labels, position_ids, padding_mask, loss_mask (and input_ids if shard_primary;
// otherwise input_ids stay global, padded to P); the slice is the rank's interval
// of the plan `plan` chooses (equal intervals by default).
ShardedBatch shard_batch_at(int rank, int cp_size, Batch batch, std::optional<Tensor> loss_mask,
                            std::int64_t pad_token_id, bool shard_primary,
                            std::int64_t pad_multiple = 1, const PlanChoice& plan = {});
// The same for the calling rank of `comm` (nullptr: one rank). With more than one
// rank, the ranks compare their plans (one all-gather of the cuts): ranks that cut
// differently are an InvalidInput naming both plans, before any operator runs.
ShardedBatch shard_batch(Communicator* comm, Batch batch, std::optional<Tensor> loss_mask = {},
                         std::int64_t pad_token_id = 0, bool shard_primary = false,
                         std::int64_t pad_multiple = 1, const PlanChoice& plan = {});
// The agreement check of shard_batch on its own: every rank of `comm` holds `plan`.
void expect_same_plan(Communicator* comm, const ShardPlan& plan);

// CP context of one row for recurrent layers.
// Under any plan, a rank's interval is [a_r, a_{r+1}); the ranks counted are those
// with a non-empty interval (a segment never "reaches" an empty rank). An empty
// rank's context is empty: cu_seqlens [0], everything else 0 (first and last).
struct FlaCpContext {
  std::vector<std::int64_t> cu_seqlens;  // local segment boundaries, [0, ..., L]
  std::int64_t pre_num_conv_tokens = 0;  // a_r - start of the segment holding a_r
  int pre_num_ranks = 0;                 // earlier ranks the first local segment reaches into
  int post_num_ranks = 0;                // later ranks the last local segment reaches into
  bool is_first_rank = true;
  bool is_last_rank = true;
};
// From global segment boundaries over [0, P].
FlaCpContext cp_context_from_global_cu(const std::vector<std::int64_t>& global_cu, const ShardPlan& plan, int rank);
FlaCpContext build_fla_cp_context(const PackedContext& context, int row);

}  // namespace cpsim
