// A verification case: one packed batch, the CP size to check it at, a seed for
// the activations drawn on it, and (for generated batches) the layout it was built
// from, which the layout property compares against.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "core/layout.hpp"

namespace cpsim::verify {

// Per-token truth [B, S], known by construction.
struct LayoutTruth {
  Tensor doc_ids, padding, positions;
};

struct LayoutCase {
  Batch batch;
  std::int64_t pad_token_id = 0;
  int cp = 1;
  std::uint64_t seed = 0;
  std::optional<LayoutTruth> truth;
};

// Prints "cp=N seed=N batch=<BATCH JSON>", replayable with `cpsim check`.
std::ostream& operator<<(std::ostream& os, const LayoutCase& c);

// The plain description a generator draws, before it becomes a batch.
struct DocSpec {
  int real = 0;   // seq_lens entry
  int extra = 0;  // seq_lens_padded - seq_lens
};
// Which SPEC §1 keys carry the layout: seq_lens with seq_lens_padded, seq_lens
// alone, both cu_seqlens keys, none (unpacked: a mask or nothing, maybe
// position_ids), cu_seqlens alone, cu_seqlens_padded alone, or position_ids whose
// resets start the documents of `rows` (a flattening collator's packing; their
// padding, and the row's tail, marked by the mask of mask_kind, or none).
enum class LayoutForm {
  seq_lens_padded = 0,
  seq_lens = 1,
  cu_seqlens = 2,
  unpacked = 3,
  cu_seqlens_only = 4,
  cu_seqlens_padded_only = 5,
  position_resets = 6
};
inline constexpr int kLayoutForms = 7;
// Which mask marks an unpacked (or position_resets) row's padding.
enum class MaskKind { padding_mask = 0, attention_mask = 1, none = 2 };
inline constexpr int kMaskKinds = 3;
struct LayoutSpec {
  int cp = 1;
  LayoutForm form = LayoutForm::seq_lens_padded;
  int seq_len = 1;
  std::vector<std::vector<DocSpec>> rows;      // packed forms
  std::vector<std::pair<int, int>> row_pads;   // unpacked: (left, right) padding per row
  MaskKind mask_kind = MaskKind::padding_mask;  // unpacked, position_resets
  bool absorb_tail = false;   // last document's padded length absorbs the row's tail
  bool give_positions = false;
  bool give_loss_mask = false;
  int pad_token_id = 0;
  int cu_sentinels = 0;       // trailing sentinel entries in cu_seqlens
  bool token_type_ids = false;  // an extra [B, S] key, sharded like labels (fill 0)
  bool one_dimensional = false; // one row given as [S] tensors, as THD collators emit
  bool eos_is_pad = false;      // each document's last real token, and one inside it, is the pad id
  std::uint64_t seed = 0;     // token ids and activations
};

// Clamps the spec to the row length and builds the batch and its truth.
LayoutCase build_case(const LayoutSpec& spec);

}  // namespace cpsim::verify
