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

PackedContext::PackedContext(Tensor doc_ids, std::int64_t seq_start, int cp_size, std::int64_t original_seq_len)
    : doc_ids_(std::move(doc_ids)), seq_start_(seq_start), cp_size_(cp_size), original_seq_len_(original_seq_len) {
  CPSIM_ENFORCE(doc_ids_.ndim() == 2 && doc_ids_.dtype() == DType::i64 && doc_ids_.dim(1) % cp_size_ == 0,
                "packed context needs int64 doc ids [B, P] with P divisible by cp_size");
}

PackedContext::PackedContext(const PackedContext& o)
    : doc_ids_(o.doc_ids_), seq_start_(o.seq_start_), cp_size_(o.cp_size_), original_seq_len_(o.original_seq_len_) {}

PackedContext& PackedContext::operator=(const PackedContext& o) {
  if (this != &o) {
    doc_ids_ = o.doc_ids_;
    seq_start_ = o.seq_start_;
    cp_size_ = o.cp_size_;
    original_seq_len_ = o.original_seq_len_;
    std::lock_guard<std::mutex> lock(mutex_);
    cu_cache_.clear();
  }
  return *this;
}

Tensor PackedContext::local_doc_ids() const { return slice_sequence(doc_ids_, seq_start_, local_seq_len(), 0); }

const std::vector<std::int64_t>& PackedContext::row_cu_seqlens(int row) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = cu_cache_.find(row);
  if (it != cu_cache_.end()) return it->second;
  CPSIM_ENFORCE(row >= 0 && row < doc_ids_.dim(0), "row ", row, " of ", doc_ids_.dim(0));
  const std::int64_t* ids = doc_ids_.data<std::int64_t>() + row * doc_ids_.dim(1) + seq_start_;
  return cu_cache_.emplace(row, segment_cu_seqlens(ids, local_seq_len())).first->second;
}

ShardedBatch shard_batch_at(int rank, int cp_size, Batch batch, std::optional<Tensor> loss_mask,
                            std::int64_t pad_token_id, bool shard_primary, std::int64_t pad_multiple) {
  normalize_batch_axis(batch);
  const std::int64_t S = sequence_length(batch);
  const ShardGeometry g = shard_geometry(S, cp_size, pad_multiple);
  if (rank < 0 || rank >= cp_size) CPSIM_INVALID("rank: ", rank, " outside a CP group of ", cp_size);
  // The layout, derived once: the document map, then the packing metadata replaced
  // by the padding and positions it gives.
  const Layout layout = derive_layout(batch);
  Tensor doc_ids = slice_sequence(layout.doc_ids, 0, g.padded_len, kPadDocId);
  unpack_row_layout(batch, layout);
  if (loss_mask) batch["loss_mask"] = *loss_mask;
  sequence_length(batch);  // loss_mask shape check

  // SPEC §2 fill values; every other [B, S] key (token_type_ids, say) is padded with 0.
  const std::map<std::string, std::int64_t> fill = {
      {"input_ids", pad_token_id}, {"labels", kIgnoreLabel}, {"padding_mask", 1}, {"loss_mask", 0}, {"attention_mask", 0}};
  for (auto& [key, t] : batch) {
    const bool global = key == "input_ids" && !shard_primary;  // padded to P, kept whole
    const std::int64_t start = global ? 0 : g.start(rank), len = global ? g.padded_len : g.local_len;
    const auto f = fill.find(key);
    Tensor local = slice_sequence(t, start, len, f == fill.end() ? 0 : f->second);
    if (key == "position_ids") {
      // Position ids continue last+1, ... into the padded tail (derive_layout made them int64).
      auto* p = local.data<std::int64_t>();
      const auto* src = t.data<std::int64_t>();
      for (std::int64_t r = 0; r < t.dim(0); ++r)
        for (std::int64_t j = std::max<std::int64_t>(0, S - start); j < len; ++j)
          p[r * len + j] = src[r * S + S - 1] + (start + j - S + 1);
    }
    t = std::move(local);
  }
  return {std::move(batch), PackedContext(std::move(doc_ids), g.start(rank), cp_size, S)};
}

ShardedBatch shard_batch(const Communicator* comm, Batch batch, std::optional<Tensor> loss_mask,
                         std::int64_t pad_token_id, bool shard_primary, std::int64_t pad_multiple) {
  const int rank = comm ? comm->rank() : 0, size = comm ? comm->size() : 1;
  return shard_batch_at(rank, size, std::move(batch), std::move(loss_mask), pad_token_id, shard_primary,
                        pad_multiple);
}

FlaCpContext cp_context_from_global_cu(const std::vector<std::int64_t>& cu, int cp_size, int rank) {
  CPSIM_ENFORCE(cu.size() >= 2 && cu.front() == 0 && cu.back() % cp_size == 0, "bad global cu_seqlens");
  const std::int64_t L = cu.back() / cp_size, lo = rank * L, hi = lo + L;
  FlaCpContext c;
  c.cu_seqlens = {0};
  std::size_t first = 0, last = 0;  // segments holding lo and hi-1
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s] <= lo && lo < cu[s + 1]) first = s;
    if (cu[s] <= hi - 1 && hi - 1 < cu[s + 1]) last = s;
  }
  for (std::size_t s = first; s <= last; ++s) c.cu_seqlens.push_back(std::min(cu[s + 1], hi) - lo);
  c.pre_num_conv_tokens = lo - cu[first];
  c.pre_num_ranks = rank - static_cast<int>(cu[first] / L);
  c.post_num_ranks = static_cast<int>((cu[last + 1] - 1) / L) - rank;
  c.is_first_rank = c.pre_num_ranks == 0;
  c.is_last_rank = c.post_num_ranks == 0;
  return c;
}

FlaCpContext build_fla_cp_context(const PackedContext& context, int row) {
  const std::int64_t P = context.doc_ids().dim(1);
  const auto cu = segment_cu_seqlens(context.doc_ids().data<std::int64_t>() + row * P, P);
  return cp_context_from_global_cu(cu, context.cp_size(), static_cast<int>(context.seq_start() / context.local_seq_len()));
}

}  // namespace cpsim
