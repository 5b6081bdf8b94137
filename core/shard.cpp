#include "core/shard.hpp"

#include <algorithm>
#include <cstring>

#include "core/kernels/table.hpp"

namespace cpsim {

Tensor slice_sequence(const Tensor& t, std::int64_t start, std::int64_t len, std::int64_t fill) {
  CPSIM_ENFORCE(t.ndim() == 2, "slice_sequence takes [B, S], got ", shape_str(t.shape()));
  std::uint64_t bits = 0;
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T v;
    if constexpr (std::is_integral_v<T>) v = static_cast<T>(fill);
    else v = from_f64<T>(static_cast<double>(fill));
    std::memcpy(&bits, &v, sizeof(T));
  });
  Tensor out({t.dim(0), len}, t.dtype(), t.device());
  kernels::kernels_for(t.device())
      .slice({t.raw(), out.raw(), t.dim(0), t.dim(1), start, len, dtype_size(t.dtype()), bits}, kernels::current_stream());
  return out;
}

ShardGeometry shard_geometry(std::int64_t seq_len, int cp_size, std::int64_t pad_multiple) {
  if (cp_size < 1) CPSIM_INVALID("cp_size: must be >= 1, got ", cp_size);
  if (pad_multiple < 1) CPSIM_INVALID("pad_multiple: must be >= 1, got ", pad_multiple);
  ShardGeometry g;
  g.seq_len = seq_len;
  g.cp_size = cp_size;
  const std::int64_t unit = cp_size * pad_multiple;
  g.padded_len = std::max<std::int64_t>(unit, (seq_len + unit - 1) / unit * unit);
  g.local_len = g.padded_len / cp_size;
  return g;
}

PackedContext::PackedContext(Tensor doc_ids, ShardPlan plan, int rank, std::int64_t original_seq_len)
    : doc_ids_(std::move(doc_ids)), plan_(std::move(plan)), rank_(rank), original_seq_len_(original_seq_len) {
  CPSIM_ENFORCE(doc_ids_.ndim() == 2 && doc_ids_.dtype() == DType::i64, "packed context needs int64 doc ids [B, P]");
  validate_plan(plan_, doc_ids_.dim(1), plan_.ranks());
  CPSIM_ENFORCE(rank_ >= 0 && rank_ < plan_.ranks(), "packed context: rank ", rank_, " outside a plan of ",
                plan_.ranks());
}

PackedContext::PackedContext(const PackedContext& o)
    : doc_ids_(o.doc_ids_), plan_(o.plan_), rank_(o.rank_), original_seq_len_(o.original_seq_len_) {}

PackedContext& PackedContext::operator=(const PackedContext& o) {
  if (this != &o) {
    doc_ids_ = o.doc_ids_;
    plan_ = o.plan_;
    rank_ = o.rank_;
    original_seq_len_ = o.original_seq_len_;
    std::lock_guard<std::mutex> lock(mutex_);
    cu_cache_.clear();
  }
  return *this;
}

Tensor PackedContext::local_doc_ids() const { return slice_sequence(doc_ids_, seq_start(), local_seq_len(), 0); }

const std::vector<std::int64_t>& PackedContext::row_cu_seqlens(int row) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = cu_cache_.find(row);
  if (it != cu_cache_.end()) return it->second;
  CPSIM_ENFORCE(row >= 0 && row < doc_ids_.dim(0), "row ", row, " of ", doc_ids_.dim(0));
  const std::int64_t* ids = doc_ids_.data<std::int64_t>() + row * doc_ids_.dim(1) + seq_start();
  return cu_cache_.emplace(row, segment_cu_seqlens(ids, local_seq_len())).first->second;
}

ShardedBatch shard_batch_at(int rank, int cp_size, Batch batch, std::optional<Tensor> loss_mask,
                            std::int64_t pad_token_id, bool shard_primary, std::int64_t pad_multiple,
                            const PlanChoice& choice) {
  normalize_batch_axis(batch);
  const std::int64_t S = sequence_length(batch);
  const ShardGeometry g = shard_geometry(S, cp_size, pad_multiple);
  if (rank < 0 || rank >= cp_size) CPSIM_INVALID("rank: ", rank, " outside a CP group of ", cp_size);
  // The layout, derived once: the document map, then the packing metadata replaced
  // by the padding and positions it gives.
  const Layout layout = derive_layout(batch);
  Tensor doc_ids = slice_sequence(layout.doc_ids, 0, g.padded_len, kPadDocId);
  ShardPlan plan = resolve_plan(choice, layout, g.padded_len, cp_size);
  unpack_row_layout(batch, layout);
  if (loss_mask) batch["loss_mask"] = *loss_mask;
  sequence_length(batch);  // loss_mask shape check

  // SPEC §2 fill values; every other [B, S] key (token_type_ids, say) is padded with 0.
  const std::map<std::string, std::int64_t> fill = {
      {"input_ids", pad_token_id}, {"labels", kIgnoreLabel}, {"padding_mask", 1}, {"loss_mask", 0}, {"attention_mask", 0}};
  for (auto& [key, t] : batch) {
    const bool global = key == "input_ids" && !shard_primary;  // padded to P, kept whole
    const std::int64_t start = global ? 0 : plan.begin(rank), len = global ? g.padded_len : plan.size(rank);
    const auto f = fill.find(key);
    // mRoPE's position_ids [3, B, S]: each plane's rows are sliced along the
    // sequence, as [3 B, S] rows.
    const bool planes = key == "position_ids" && is_mrope(t);
    const Tensor rows = planes ? t.reshape({3 * t.dim(1), S}) : t;
    Tensor local = slice_sequence(rows, start, len, f == fill.end() ? 0 : f->second);
    if (key == "position_ids") {
      // Position ids continue last+1, ... into the padded tail (derive_layout made them int64), in every plane.
      auto* p = local.data<std::int64_t>();
      const auto* src = rows.data<std::int64_t>();
      for (std::int64_t r = 0; r < rows.dim(0); ++r)
        for (std::int64_t j = std::max<std::int64_t>(0, S - start); j < len; ++j)
          p[r * len + j] = src[r * S + S - 1] + (start + j - S + 1);
    }
    t = planes ? local.reshape({3, t.dim(1), len}) : std::move(local);
  }
  return {std::move(batch), PackedContext(std::move(doc_ids), std::move(plan), rank, S)};
}

void expect_same_plan(Communicator* comm, const ShardPlan& plan) {
  if (!is_distributed(comm)) return;
  const int c = comm->size();
  const auto n = static_cast<std::int64_t>(plan.cuts.size());
  CPSIM_ENFORCE(n == c + 1, "a plan of ", n - 1, " ranks in a group of ", c);
  Tensor mine({n}, DType::i64);
  std::copy(plan.cuts.begin(), plan.cuts.end(), mine.data<std::int64_t>());
  Tensor all({c * n}, DType::i64, comm->device());
  const Tensor sent = comm->device().is_cpu() ? mine : mine.to(comm->device());
  comm->all_gather(sent.raw(), all.raw(), static_cast<std::size_t>(n), DType::i64);
  const Tensor got = all.is_cpu() ? all : all.to(Device::host());
  for (int q = 0; q < c; ++q) {
    ShardPlan theirs;
    theirs.cuts.assign(got.data<std::int64_t>() + q * n, got.data<std::int64_t>() + (q + 1) * n);
    if (theirs != plan)
      CPSIM_INVALID("shard plan: ranks disagree on the cuts: rank ", comm->rank(), " has ", plan_text(plan).substr(0, 200),
                    ", rank ", q, " has ", plan_text(theirs).substr(0, 200),
                    " (every rank must cut the batch the same way: a plan computed from rank-local data differs)");
  }
}

ShardedBatch shard_batch(Communicator* comm, Batch batch, std::optional<Tensor> loss_mask,
                         std::int64_t pad_token_id, bool shard_primary, std::int64_t pad_multiple,
                         const PlanChoice& plan) {
  const int rank = comm ? comm->rank() : 0, size = comm ? comm->size() : 1;
  ShardedBatch out = shard_batch_at(rank, size, std::move(batch), std::move(loss_mask), pad_token_id, shard_primary,
                                    pad_multiple, plan);
  expect_same_plan(comm, out.context.plan());
  return out;
}

FlaCpContext cp_context_from_global_cu(const std::vector<std::int64_t>& cu, const ShardPlan& plan, int rank) {
  CPSIM_ENFORCE(cu.size() >= 2 && cu.front() == 0 && cu.back() == plan.padded_len(), "bad global cu_seqlens");
  FlaCpContext c;
  c.cu_seqlens = {0};
  if (plan.size(rank) == 0) return c;  // an empty rank: no segments, reaches nobody
  const std::int64_t lo = plan.begin(rank), hi = plan.end(rank);
  std::size_t first = 0, last = 0;  // segments holding lo and hi-1
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s] <= lo && lo < cu[s + 1]) first = s;
    if (cu[s] <= hi - 1 && hi - 1 < cu[s + 1]) last = s;
  }
  for (std::size_t s = first; s <= last; ++s) c.cu_seqlens.push_back(std::min(cu[s + 1], hi) - lo);
  c.pre_num_conv_tokens = lo - cu[first];
  // Non-empty ranks holding a position of the first (last) segment, before (after) this one.
  for (int q = 0; q < rank; ++q) c.pre_num_ranks += plan.size(q) > 0 && plan.end(q) > cu[first];
  for (int q = rank + 1; q < plan.ranks(); ++q) c.post_num_ranks += plan.size(q) > 0 && plan.begin(q) < cu[last + 1];
  c.is_first_rank = c.pre_num_ranks == 0;
  c.is_last_rank = c.post_num_ranks == 0;
  return c;
}

FlaCpContext build_fla_cp_context(const PackedContext& context, int row) {
  const std::int64_t P = context.doc_ids().dim(1);
  const auto cu = segment_cu_seqlens(context.doc_ids().data<std::int64_t>() + row * P, P);
  return cp_context_from_global_cu(cu, context.plan(), context.rank());
}

}  // namespace cpsim
