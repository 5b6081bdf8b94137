// The packed batch layout of SPEC §1: document ids, segments, padding and
// positions derived from seq_lens / cu_seqlens / masks, and the validation that
// turns every malformed layout into an InvalidInput naming key, row and index.
// Padding is decided from lengths, never from token ids.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace cpsim {

// Keys as PyTorch training stacks name them; values are integer (or bool) tensors.
using Batch = std::map<std::string, Tensor>;

inline constexpr std::int64_t kSeqLensSentinel = -1000;
inline constexpr std::int64_t kPadDocId = 0;
inline constexpr std::int64_t kIgnoreLabel = -100;

// The per-token layout of a batch, every tensor [B, S].
struct Layout {
  Tensor doc_ids;    // int64: i+1 over document i's occupied span, 0 beyond
  Tensor padding;    // bool: true = padding
  Tensor positions;  // int64 [B, S]: given position_ids, else derived; or mRoPE's [3, B, S] as given
};

// The keys cpsim reads by name (SPEC §1, and token_type_ids). Any other key is a
// [B, S] token stream: padded with 0 and sharded like labels.
const std::vector<std::string>& known_batch_keys();
// A known key one or two edits from `key` (a misspelling: attention_masks), unless
// `key` is itself known.
std::optional<std::string> near_known_key(const std::string& key);
// InvalidInput for a key that looks like a misspelled known key ("did you mean").
void check_batch_keys(const Batch& batch);

// 1-D tensors ([S], THD collators) become [1, S]; cu_seqlens stay 1-D (a nested
// one-row [[0, 3, 7]] becomes [0, 3, 7]).
void normalize_batch_axis(Batch& batch);

// The packing lengths (seq_lens, seq_lens_padded, cu_seqlens, cu_seqlens_padded);
// every other key of a batch is a [B, S] token stream.
bool is_length_key(const std::string& key);

// S of a batch: the common second dimension of its [B, S] keys (checked: every
// key but the packing lengths must be [B, S]; S and B at least 1).
std::int64_t sequence_length(const Batch& batch);
std::int64_t batch_rows(const Batch& batch);

// lengths [B, D] (occupied lengths) -> doc ids [B, S]; `key` names the input in errors.
Tensor doc_ids_from_seq_lens(const Tensor& lengths, std::int64_t seq_len,
                             std::int64_t padding_value = kSeqLensSentinel,
                             const std::string& key = "seq_lens");
// cu [D+1] -> doc ids [1, S].
Tensor doc_ids_from_cu_seqlens(const Tensor& cu_seqlens, std::int64_t seq_len,
                               const std::string& key = "cu_seqlens");

// Boundaries of consecutive equal-id runs covering the whole row, padding runs included.
std::vector<std::int64_t> segment_cu_seqlens(const std::int64_t* doc_ids_row, std::int64_t n);
std::vector<std::int64_t> segment_cu_seqlens(const Tensor& doc_ids_row);  // [S] or [1, S]

// The global document map of a (normalised) batch, before packing metadata is removed.
Tensor global_doc_ids(const Batch& batch);
// Doc ids, padding and positions; validates everything SPEC §1 lists.
Layout derive_layout(const Batch& batch);

// Replaces seq_lens / seq_lens_padded / cu_seqlens* with padding_mask and
// position_ids (given position ids are kept), in place. Ids and labels untouched.
void unpack_row_layout(Batch& batch);
// The same with the batch's layout already derived (derive_layout of this batch).
void unpack_row_layout(Batch& batch, const Layout& layout);

// SPEC §1 position rule over kept tokens, per row; throws InvalidInput. mRoPE's
// [3, B, S] planes (temporal, height, width) follow their own rule
// (docs/files.md): (0, 0, 0) at a document's start, then text one past the
// document's largest position in all three planes, or an image grid's next
// token keeping the temporal plane.
void validate_document_positions(const Tensor& keep, const Tensor& positions);
// Whether position_ids are mRoPE's [3, B, S] planes.
bool is_mrope(const Tensor& positions);

}  // namespace cpsim
