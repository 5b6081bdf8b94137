// A verification case: one packed batch, the CP size to check it at, a seed for
// the activations drawn on it, and (for generated batches) the layout it was built
// from, which the layout property compares against.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <utility>
#include <vector>

#include "core/layout.hpp"
#include "core/shard_plan.hpp"

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
  PlanChoice plan;  // how the ranks cut the padded rows (SPEC §2 shard plans)
};

// The case at another CP size: cuts drawn for the old size do not fit, so a cuts
// plan becomes equal intervals (equal and balanced plans carry over).
LayoutCase at_cp(LayoutCase c, int cp);

// Prints "cp=N seed=N [plan=...] batch=<BATCH JSON>", replayable with `cpsim check`.
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
// The shard plan a generator draws: equal intervals, the balanced plan of a cost
// (attention and linear weights), or cuts in proportion to one weight a rank
// (0 gives an empty interval; all 0: equal).
struct PlanSpec {
  PlanChoice::Kind kind = PlanChoice::Kind::equal;
  int attention = 1, linear = 0;
  std::vector<int> weights;
};
// The plan a spec gives a case of `cp` ranks over P positions.
PlanChoice plan_of_spec(const PlanSpec& spec, std::int64_t padded_len, int cp);
std::ostream& operator<<(std::ostream& os, const PlanSpec& p);

// Image-token spans inside each document's real tokens (vision-language rows),
// placed by the spec's seed: per document a count in [per_document.first,
// .second], each of a length in [length.first, .second].
struct ImageSpans {
  int token_id = 9;
  std::pair<int, int> per_document{0, 2}, length{2, 8};
};

struct LayoutSpec {
  int cp = 1;
  PlanSpec plan;
  LayoutForm form = LayoutForm::seq_lens_padded;
  int seq_len = 1;
  std::vector<std::vector<DocSpec>> rows;      // packed forms
  std::vector<std::pair<int, int>> row_pads;   // unpacked: (left, right) padding per row
  // unpacked: a padding gap inside each row's document, (where it starts after
  // the document's first token, its length); none where 0 long, and none where
  // positions are given (a gap never resumes a document by its positions).
  std::vector<std::pair<int, int>> row_gaps;
  MaskKind mask_kind = MaskKind::padding_mask;  // unpacked, position_resets
  bool absorb_tail = false;   // last document's padded length absorbs the row's tail
  bool give_positions = false;
  bool give_loss_mask = false;
  int pad_token_id = 0;
  int cu_sentinels = 0;       // trailing sentinel entries in cu_seqlens
  bool token_type_ids = false;  // an extra [B, S] key, sharded like labels (fill 0)
  bool one_dimensional = false; // one row given as [S] tensors, as THD collators emit
  bool eos_is_pad = false;      // each document's last real token, and one inside it, is the pad id
  std::optional<ImageSpans> image_spans;
  // position_ids given as mRoPE's [3, B, S] planes ([3, S] one-dimensional),
  // each run of image tokens a grid (every form but position resets; docs/layout.md).
  bool mrope = false;
  std::uint64_t seed = 0;     // token ids and activations
};

// Clamps the spec to the row length and builds the batch and its truth.
LayoutCase build_case(const LayoutSpec& spec);

}  // namespace cpsim::verify
