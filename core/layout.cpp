#include "core/layout.hpp"

#include <algorithm>
#include <cctype>
#include <optional>

#include "core/kernels/table.hpp"

namespace cpsim {

namespace {

bool has(const Batch& b, const std::string& key) { return b.count(key) != 0; }

void require_int(const Tensor& t, const std::string& key) {
  if (is_floating(t.dtype())) CPSIM_INVALID(key, ": expected an integer tensor, got ", dtype_name(t.dtype()));
}

// Per-row list of document lengths, sentinels removed, validated.
std::vector<std::vector<std::int64_t>> read_lengths(const Tensor& t, std::int64_t sentinel,
                                                    const std::string& key) {
  require_int(t, key);
  if (t.ndim() != 2) CPSIM_INVALID(key, ": expected shape [batch, documents], got ", shape_str(t.shape()));
  std::vector<std::vector<std::int64_t>> rows(t.dim(0));
  for (std::int64_t r = 0; r < t.dim(0); ++r) {
    bool ended = false;
    for (std::int64_t i = 0; i < t.dim(1); ++i) {
      std::int64_t v = t.get_int(r * t.dim(1) + i);
      if (v == sentinel) {
        ended = true;
      } else if (v < 0) {
        CPSIM_INVALID(key, " row ", r, " index ", i, ": negative length ", v, " (only the sentinel ",
                      sentinel, " may be negative)");
      } else if (ended) {
        CPSIM_INVALID(key, " row ", r, " index ", i, ": real length ", v, " after the sentinel ", sentinel);
      } else {
        rows[r].push_back(v);
      }
    }
  }
  return rows;
}

// cu_seqlens [D+1] -> document lengths, validated.
std::vector<std::int64_t> read_cu(const Tensor& cu, const std::string& key) {
  require_int(cu, key);
  if (cu.ndim() != 1 || cu.dim(0) < 1) CPSIM_INVALID(key, ": expected shape [documents + 1], got ", shape_str(cu.shape()));
  if (cu.get_int(0) != 0) CPSIM_INVALID(key, " row 0 index 0: must start at 0, got ", cu.get_int(0));
  std::vector<std::int64_t> lengths;
  bool ended = false;
  for (std::int64_t i = 1; i < cu.dim(0); ++i) {
    std::int64_t v = cu.get_int(i);
    if (v < 0) {
      ended = true;
    } else if (ended) {
      CPSIM_INVALID(key, " row 0 index ", i, ": boundary ", v, " after a negative sentinel");
    } else if (v < cu.get_int(i - 1)) {
      CPSIM_INVALID(key, " row 0 index ", i, ": decreasing boundary ", v, " < ", cu.get_int(i - 1));
    } else {
      lengths.push_back(v - cu.get_int(i - 1));
    }
  }
  return lengths;
}

// Where document i (0-based) of a row is named in `key`: index i of a lengths key,
// index i + 1 (its end) of a cu_seqlens key. Messages say "KEY row R index I:
// document D ..." with I the index into the key's array and D the document's
// number from 1, as its doc id.
std::int64_t index_in(const std::string& key, std::size_t doc) {
  return static_cast<std::int64_t>(doc) + (key.rfind("cu_", 0) == 0 ? 1 : 0);
}

// Doc ids and padding [B, S] of packed rows from their real and occupied lengths
// (validated here; computed by the layout kernel).
Layout packed_ids(const std::vector<std::vector<std::int64_t>>& real,
                  const std::vector<std::vector<std::int64_t>>& occupied, std::int64_t seq_len, const std::string& key) {
  const std::int64_t B = static_cast<std::int64_t>(occupied.size());
  std::size_t D = 0;
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t pos = 0;
    for (std::size_t i = 0; i < occupied[r].size(); ++i) {
      if (occupied[r][i] > seq_len - pos)
        CPSIM_INVALID(key, " row ", r, " index ", index_in(key, i), ": document ", i + 1, " ends at ",
                      pos + occupied[r][i], ", past the sequence length ", seq_len);
      pos += occupied[r][i];
    }
    D = std::max(D, occupied[r].size());
  }
  // starts [B][D+1]: a row with fewer documents ends in empty ones where its documents end.
  std::vector<std::int64_t> starts(B * (D + 1)), reals(B * D, 0);
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t* s = starts.data() + r * (D + 1);
    for (std::size_t i = 0; i < D; ++i) {
      const bool doc = i < occupied[r].size();
      s[i + 1] = s[i] + (doc ? occupied[r][i] : 0);
      reals[r * D + i] = doc ? real[r][i] : 0;
    }
  }
  Layout out{Tensor({B, seq_len}, DType::i64), Tensor({B, seq_len}, DType::b8), Tensor()};
  kernels::kernels_for(Device::host())
      .doc_ids_from_starts({starts.data(), reals.data(), out.doc_ids.data<std::int64_t>(), out.padding.data<bool>(), B,
                            seq_len, static_cast<std::int64_t>(D)},
                           nullptr);
  return out;
}

Tensor doc_ids_from_rows(const std::vector<std::vector<std::int64_t>>& rows, std::int64_t seq_len,
                         const std::string& key) {
  return packed_ids(rows, rows, seq_len, key).doc_ids;
}

// Real/occupied lengths per row for the packed forms, checked against each other.
struct PackedLengths {
  std::vector<std::vector<std::int64_t>> real, occupied;
  std::string occupied_key;
};

PackedLengths packed_lengths(const Batch& b, std::int64_t rows) {
  PackedLengths out;
  std::string real_key;
  if (has(b, "seq_lens")) {
    real_key = "seq_lens";
    out.real = read_lengths(b.at("seq_lens"), kSeqLensSentinel, real_key);
    out.occupied_key = has(b, "seq_lens_padded") ? "seq_lens_padded" : "seq_lens";
    out.occupied = has(b, "seq_lens_padded") ? read_lengths(b.at("seq_lens_padded"), kSeqLensSentinel, out.occupied_key) : out.real;
    if (has(b, "seq_lens_padded") && b.at("seq_lens_padded").shape() != b.at("seq_lens").shape())
      CPSIM_INVALID("seq_lens_padded: shape ", shape_str(b.at("seq_lens_padded").shape()),
                    " differs from seq_lens ", shape_str(b.at("seq_lens").shape()));
  } else {
    // Either cu_seqlens key alone serves as both the real and the occupied lengths.
    real_key = has(b, "cu_seqlens") ? "cu_seqlens" : "cu_seqlens_padded";
    out.occupied_key = has(b, "cu_seqlens_padded") ? "cu_seqlens_padded" : "cu_seqlens";
    out.real = {read_cu(b.at(real_key), real_key)};
    out.occupied = real_key == out.occupied_key ? out.real
                                                : std::vector<std::vector<std::int64_t>>{read_cu(b.at(out.occupied_key), out.occupied_key)};
  }
  if (static_cast<std::int64_t>(out.real.size()) != rows)
    CPSIM_INVALID(real_key, ": ", out.real.size(), " rows, but the batch has ", rows);
  // Two forms of the same layout must agree; one that disagrees is an error, not a guess.
  if (has(b, "seq_lens"))
    for (const char* key : {"cu_seqlens", "cu_seqlens_padded"}) {
      if (!has(b, key)) continue;
      const bool padded = std::string(key) == "cu_seqlens_padded";
      const auto from_cu = read_cu(b.at(key), key);
      const auto& from_lens = padded ? out.occupied : out.real;
      if (rows != 1 || from_cu != from_lens[0])
        CPSIM_INVALID(key, " row 0: the documents it describes disagree with ",
                      padded ? out.occupied_key : std::string("seq_lens"), " (give one form, or forms that agree)");
    }
  for (std::size_t r = 0; r < out.real.size(); ++r) {
    if (out.real[r].size() != out.occupied[r].size())
      CPSIM_INVALID(out.occupied_key, " row ", r, " index ",
                    index_in(out.occupied_key, std::min(out.real[r].size(), out.occupied[r].size())), ": ",
                    out.occupied[r].size(), " documents, but ", real_key, " has ", out.real[r].size());
    for (std::size_t i = 0; i < out.real[r].size(); ++i)
      if (out.real[r][i] > out.occupied[r][i])
        CPSIM_INVALID(real_key, " row ", r, " index ", index_in(real_key, i), ": document ", i + 1, " has real length ",
                      out.real[r][i], ", more than its padded length ", out.occupied[r][i], " in ", out.occupied_key);
  }
  return out;
}

// The largest position (in magnitude) a batch may give: 2^52, so that every
// position, and the padded tail that continues from the last one, stays below
// 2^53, where a float64 stops holding every integer (RoPE turns a token by its
// position in float64: two positions one float64 cannot tell apart would turn
// alike).
constexpr std::int64_t kMaxPosition = std::int64_t{1} << 52;

// A mask holds 0 or 1 (false or true).
void check_mask_values(const Batch& b) {
  for (const char* key : {"padding_mask", "attention_mask", "loss_mask"}) {
    if (!has(b, key)) continue;
    const Tensor& m = b.at(key);
    require_int(m, key);
    if (m.dtype() == DType::b8) continue;
    const std::int64_t S = m.dim(1);
    for (std::int64_t i = 0; i < m.numel(); ++i) {
      const std::int64_t v = m.get_int(i);
      if (v != 0 && v != 1)
        CPSIM_INVALID(key, " row ", i / S, " index ", i % S, ": value ", v,
                      "; a mask holds 0 or 1 (document indices, as some collators write, are no mask: give "
                      "seq_lens, cu_seqlens or position_ids for the documents)");
    }
  }
}

// Every mask the batch gives must say what its padding is: padding_mask true,
// attention_mask 0 on padding. `source` names what the padding came from.
void check_masks_agree(const Batch& b, const Tensor& padding, const std::string& source) {
  const std::int64_t S = padding.dim(1);
  const bool* pad = padding.data<bool>();
  for (const char* key : {"padding_mask", "attention_mask"}) {
    if (!has(b, key) || source == key) continue;
    const Tensor& m = b.at(key);
    const bool is_padding_mask = std::string(key) == "padding_mask";
    for (std::int64_t i = 0; i < m.numel(); ++i) {
      const bool says_pad = is_padding_mask ? m.get_int(i) != 0 : m.get_int(i) == 0;
      if (says_pad != pad[i])
        CPSIM_INVALID(key, " row ", i / S, " index ", i % S, ": ", m.get_int(i), " says ",
                      says_pad ? "padding" : "a real token", ", but ", source, " makes it ",
                      pad[i] ? "padding" : "a real token", " (give one form, or forms that agree)");
    }
  }
}

bool is_packed(const Batch& b) {
  return has(b, "seq_lens") || has(b, "cu_seqlens") || has(b, "cu_seqlens_padded");
}

// Packing keys that stand only beside another.
void check_packing_keys(const Batch& b, std::int64_t rows) {
  if (has(b, "seq_lens_padded") && !has(b, "seq_lens"))
    CPSIM_INVALID("seq_lens_padded: given without seq_lens (the real lengths); give both, or seq_lens alone");
  const bool thd = !has(b, "seq_lens") && (has(b, "cu_seqlens") || has(b, "cu_seqlens_padded"));
  if (thd && rows != 1)
    CPSIM_INVALID(has(b, "cu_seqlens") ? "cu_seqlens" : "cu_seqlens_padded",
                  ": describes one packed row, but the batch has ", rows, " rows");
}

// Offset inside the run of equal doc ids; the trailing doc-id-0 run continues
// the last position (the layout kernel).
Tensor derive_positions(const Tensor& doc_ids) {
  const std::int64_t rows = doc_ids.dim(0), S = doc_ids.dim(1);
  Tensor pos({rows, S}, DType::i64);
  std::vector<std::int64_t> tails(rows);
  kernels::kernels_for(Device::host())
      .derived_positions(doc_ids.data<std::int64_t>(), tails.data(), pos.data<std::int64_t>(), rows, S, nullptr);
  return pos;
}

}  // namespace

const std::vector<std::string>& known_batch_keys() {
  static const std::vector<std::string> keys = {
      "input_ids",  "labels",         "position_ids", "seq_lens",       "seq_lens_padded", "cu_seqlens",
      "cu_seqlens_padded", "padding_mask", "attention_mask", "loss_mask", "token_type_ids"};
  return keys;
}

namespace {
// Edit distance (insertions, deletions, substitutions), case-insensitive, up to `most` + 1.
std::size_t edit_distance(const std::string& a, const std::string& b, std::size_t most) {
  if (a.size() > b.size() + most || b.size() > a.size() + most) return most + 1;
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) == std::tolower(static_cast<unsigned char>(b[j - 1]));
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}
}  // namespace

std::optional<std::string> near_known_key(const std::string& key) {
  const auto& known = known_batch_keys();
  if (std::find(known.begin(), known.end(), key) != known.end()) return std::nullopt;
  for (const auto& k : known)
    if (edit_distance(key, k, 2) <= 2) return k;
  return std::nullopt;
}

void check_batch_keys(const Batch& batch) {
  for (const auto& [key, t] : batch)
    if (auto near = near_known_key(key))
      CPSIM_INVALID(key, ": not a key cpsim knows; did you mean ", *near,
                    "? (cpsim reads any other [batch, sequence] key as a token stream, padded with 0)");
}

void normalize_batch_axis(Batch& batch) {
  // One row written without its batch axis ([S]): mRoPE's position_ids are then
  // [3, S] (the planes of that row).
  bool one_row = false;
  for (const auto& [key, t] : batch)
    if (t.defined() && !is_length_key(key) && key != "position_ids") one_row = one_row || t.ndim() == 1;
  for (auto& [key, t] : batch) {
    if (!t.defined()) continue;
    if (key == "cu_seqlens" || key == "cu_seqlens_padded") {
      // One packed row's boundaries, also when written nested ([[0, 3, 7]]).
      if (t.ndim() == 2 && t.dim(0) == 1) t = t.reshape({t.dim(1)});
      continue;
    }
    if (t.ndim() == 1) t = t.reshape({1, t.dim(0)});
    else if (key == "position_ids" && one_row && t.ndim() == 2 && t.dim(0) == 3) t = t.reshape({3, 1, t.dim(1)});
  }
}

bool is_mrope(const Tensor& positions) { return positions.defined() && positions.ndim() == 3; }

namespace {
// Whether token i (of B x S) starts a document by its positions: 0, in every
// plane of mRoPE's.
bool position_is_zero(const Tensor& positions, std::int64_t i) {
  if (!is_mrope(positions)) return positions.get_int(i) == 0;
  const std::int64_t plane = positions.dim(1) * positions.dim(2);
  for (std::int64_t k = 0; k < 3; ++k)
    if (positions.get_int(k * plane + i) != 0) return false;
  return true;
}
}  // namespace

bool is_length_key(const std::string& key) {
  return key == "seq_lens" || key == "seq_lens_padded" || key == "cu_seqlens" || key == "cu_seqlens_padded";
}

std::int64_t sequence_length(const Batch& batch) {
  std::int64_t S = -1, B = -1;
  std::string first;
  // input_ids first, so that shape errors name the other key.
  auto visit = [&](const std::string& key, const Tensor& given) {
    if (key == "position_ids" && given.ndim() == 3 && given.dim(0) != 3)
      CPSIM_INVALID(key, ": expected [batch, sequence] or mRoPE's [3, batch, sequence], got ", shape_str(given.shape()));
    // mRoPE's planes: each a [batch, sequence] stream.
    const Tensor t = key == "position_ids" && is_mrope(given) ? given.reshape({given.dim(1), given.dim(2) * 3}) : given;
    const std::int64_t width = key == "position_ids" && is_mrope(given) ? given.dim(2) : t.ndim() == 2 ? t.dim(1) : 0;
    if (t.ndim() != 2)
      CPSIM_INVALID(key, ": expected shape [batch, sequence], got ", shape_str(t.shape()),
                    " (every key but the packing lengths is a [batch, sequence] token stream)");
    if (S < 0) {
      S = width;
      B = t.dim(0);
      first = key;
    } else if (t.dim(0) != B || width != S) {
      CPSIM_INVALID(key, ": shape ", shape_str(t.shape()), " disagrees with ", first, " [", B, ", ", S, "]");
    }
  };
  if (has(batch, "input_ids")) visit("input_ids", batch.at("input_ids"));
  for (const auto& [key, t] : batch)
    if (key != "input_ids" && !is_length_key(key)) visit(key, t);
  if (S < 0)
    CPSIM_INVALID("input_ids: missing, and no other [batch, sequence] key (labels, position_ids, a mask) gives the "
                  "sequence length (a lengths-only JSON batch gives it as \"seq_len\")");
  if (S == 0) CPSIM_INVALID(first, ": empty sequence (shape ", shape_str({B, S}), ")");
  if (B == 0) CPSIM_INVALID(first, ": no rows (shape ", shape_str({B, S}), ")");
  return S;
}

std::int64_t batch_rows(const Batch& batch) {
  sequence_length(batch);
  if (has(batch, "input_ids")) return batch.at("input_ids").dim(0);
  for (const auto& [key, t] : batch)
    if (!is_length_key(key)) return key == "position_ids" && is_mrope(t) ? t.dim(1) : t.dim(0);
  return 0;
}

Tensor doc_ids_from_seq_lens(const Tensor& lengths, std::int64_t seq_len, std::int64_t padding_value,
                             const std::string& key) {
  return doc_ids_from_rows(read_lengths(lengths, padding_value, key), seq_len, key);
}

Tensor doc_ids_from_cu_seqlens(const Tensor& cu_seqlens, std::int64_t seq_len, const std::string& key) {
  return doc_ids_from_rows({read_cu(cu_seqlens, key)}, seq_len, key);
}

std::vector<std::int64_t> segment_cu_seqlens(const std::int64_t* ids, std::int64_t n) {
  if (n <= 0) return {0};
  std::vector<std::int64_t> cu(n + 1);
  cu.resize(kernels::kernels_for(Device::host()).segment_starts(ids, n, cu.data(), nullptr));
  cu.push_back(n);
  return cu;
}

std::vector<std::int64_t> segment_cu_seqlens(const Tensor& doc_ids_row) {
  CPSIM_ENFORCE(doc_ids_row.ndim() == 1 || (doc_ids_row.ndim() == 2 && doc_ids_row.dim(0) == 1),
                "segment_cu_seqlens takes one row, got ", shape_str(doc_ids_row.shape()));
  Tensor ids = doc_ids_row.dtype() == DType::i64 ? doc_ids_row : doc_ids_row.to(DType::i64);
  return segment_cu_seqlens(ids.data<std::int64_t>(), ids.numel());
}

Tensor global_doc_ids(const Batch& batch) {
  const std::int64_t S = sequence_length(batch), B = batch_rows(batch);
  check_packing_keys(batch, B);
  if (is_packed(batch)) {
    const PackedLengths pl = packed_lengths(batch, B);
    return doc_ids_from_rows(pl.occupied, S, pl.occupied_key);
  }
  // Unpacked: padding (from a mask) gets id 0. The real tokens of a row are one
  // document, unless position_ids reset to 0 inside it (a flattening collator's
  // packing): each reset starts the next document.
  Tensor ids({B, S}, DType::i64);
  const Tensor* padding_mask = has(batch, "padding_mask") ? &batch.at("padding_mask") : nullptr;
  const Tensor* attention_mask = has(batch, "attention_mask") ? &batch.at("attention_mask") : nullptr;
  const Tensor* positions = has(batch, "position_ids") ? &batch.at("position_ids") : nullptr;
  for (std::int64_t r = 0; r < B; ++r) {
    std::int64_t doc = 0;
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t i = r * S + s;
      const bool is_pad = padding_mask ? padding_mask->get_int(i) != 0
                          : attention_mask ? attention_mask->get_int(i) == 0
                                           : false;
      if (!is_pad && (doc == 0 || (positions && position_is_zero(*positions, i)))) ++doc;
      ids.data<std::int64_t>()[i] = is_pad ? kPadDocId : (positions ? doc : 1);
    }
  }
  return ids;
}

Layout derive_layout(const Batch& batch) {
  const std::int64_t S = sequence_length(batch), B = batch_rows(batch);
  check_batch_keys(batch);
  for (const char* key : {"input_ids", "labels", "position_ids"})
    if (has(batch, key)) require_int(batch.at(key), key);
  check_mask_values(batch);
  check_packing_keys(batch, B);
  Layout out;
  std::string padding_source;
  if (is_packed(batch)) {
    const PackedLengths pl = packed_lengths(batch, B);
    out = packed_ids(pl.real, pl.occupied, S, pl.occupied_key);
    padding_source = has(batch, "seq_lens") ? "seq_lens" : pl.occupied_key;
  } else {
    out.doc_ids = global_doc_ids(batch);
    out.padding = Tensor({B, S}, DType::b8);
    const auto* id = out.doc_ids.data<std::int64_t>();
    auto* p = out.padding.data<bool>();
    for (std::int64_t i = 0; i < B * S; ++i) p[i] = id[i] == kPadDocId;
    padding_source = has(batch, "padding_mask") ? "padding_mask" : "attention_mask";
  }
  check_masks_agree(batch, out.padding, padding_source);
  const bool* pad = out.padding.data<bool>();
  if (has(batch, "position_ids")) {
    out.positions = batch.at("position_ids").to(DType::i64);
    const auto* given = out.positions.data<std::int64_t>();
    for (std::int64_t i = 0; i < out.positions.numel(); ++i)
      if (given[i] > kMaxPosition || given[i] < -kMaxPosition)
        CPSIM_INVALID("position_ids row ", i / S % B, " index ", i % S, ": position ", given[i],
                      " is beyond 2^52 (4503599627370496): RoPE turns a token by its position in float64, which "
                      "holds integers exactly only below 2^53, and the padded tail continues from the last position");
    if (is_packed(batch) && is_mrope(out.positions)) {
      // mRoPE's planes are all 0 at every document's start, and nowhere else.
      const Tensor offsets = derive_positions(out.doc_ids);
      const auto* k = offsets.data<std::int64_t>();
      for (std::int64_t i = 0; i < B * S; ++i)
        if (!pad[i] && (k[i] == 0) != position_is_zero(out.positions, i))
          CPSIM_INVALID("position_ids row ", i / S, " index ", i % S, ": mRoPE positions ",
                        k[i] == 0 ? "not 0 in every plane at the start of a document of the lengths"
                                  : "0 in every plane inside a document of the lengths (only a document's start is)");
    } else if (is_packed(batch)) {
      // Given positions must agree with the documents: the offset inside the
      // document at every real token (0 at its start, unit steps).
      const Tensor offsets = derive_positions(out.doc_ids);
      const auto* k = offsets.data<std::int64_t>();
      const auto* id = out.doc_ids.data<std::int64_t>();
      for (std::int64_t i = 0; i < B * S; ++i)
        if (!pad[i] && given[i] != k[i])
          CPSIM_INVALID("position_ids row ", i / S, " index ", i % S, ": position ", given[i], ", but the token is ",
                        k[i] == 0 ? std::string("the start") : "offset " + std::to_string(k[i]), " of document ", id[i],
                        " of the lengths (positions restart at 0 at every document and step by 1 inside it)");
    }
  } else {
    out.positions = derive_positions(out.doc_ids);
  }
  Tensor keep({B, S}, DType::b8);
  for (std::int64_t i = 0; i < B * S; ++i) keep.data<bool>()[i] = !pad[i];
  validate_document_positions(keep, out.positions);
  return out;
}

void unpack_row_layout(Batch& batch) {
  normalize_batch_axis(batch);
  unpack_row_layout(batch, derive_layout(batch));
}

void unpack_row_layout(Batch& batch, const Layout& layout) {
  for (const char* key : {"seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded"}) batch.erase(key);
  batch["padding_mask"] = layout.padding;
  batch["position_ids"] = layout.positions;
}

namespace {
// mRoPE (SPEC's RoPE over three planes, as Qwen2-VL's get_rope_index gives
// them): a document starts at (0, 0, 0); each later token is text, the next
// position in all three planes (one past the largest of the document so far;
// an image grid's first token is one too), or the next token of an image grid,
// which keeps the temporal plane and has height and width at least it.
void validate_mrope_positions(const Tensor& keep, const Tensor& positions) {
  const std::int64_t B = keep.dim(0), S = keep.dim(1), plane = B * S;
  for (std::int64_t r = 0; r < B; ++r) {
    bool prev_kept = false, seen = false;
    std::int64_t top = 0, prev_t = 0;  // the document's largest position so far; the last token's temporal one
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t i = r * S + s;
      if (keep.get_int(i) == 0) {
        prev_kept = false;
        continue;
      }
      const std::int64_t t = positions.get_int(i), h = positions.get_int(plane + i), w = positions.get_int(2 * plane + i);
      const auto at = [&] {
        return "position_ids row " + std::to_string(r) + " index " + std::to_string(s) + ": mRoPE position (" +
               std::to_string(t) + ", " + std::to_string(h) + ", " + std::to_string(w) + ")";
      };
      if (t < 0 || h < 0 || w < 0) CPSIM_INVALID(at(), " is negative");
      // The row's first real token may lie inside a document (a row that is one
      // shard of a longer one), as with [B, S] positions.
      const bool starts = (t == 0 && h == 0 && w == 0) || !seen;
      if (!prev_kept && !starts) CPSIM_INVALID(at(), " after a gap must be (0, 0, 0) (a gap never resumes a document)");
      const bool text = t == top + 1 && h == t && w == t;
      const bool grid = prev_kept && t == prev_t && h >= t && w >= t;
      if (!starts && !text && !grid)
        CPSIM_INVALID(at(), " must be (", top + 1, ", ", top + 1, ", ", top + 1,
                      ") (text, or an image grid's first token: one past the document's largest position), keep the "
                      "temporal position ", prev_t, " (the next token of an image grid), or be (0, 0, 0) (a new document)");
      top = starts ? std::max({t, h, w}) : std::max({top, t, h, w});
      prev_t = t;
      prev_kept = seen = true;
    }
  }
}
}  // namespace

void validate_document_positions(const Tensor& keep, const Tensor& positions) {
  if (is_mrope(positions)) {
    if (keep.ndim() != 2 || positions.shape() != Shape({3, keep.dim(0), keep.dim(1)}))
      CPSIM_INVALID("position_ids: shape ", shape_str(positions.shape()), " disagrees with the validity mask ",
                    shape_str(keep.shape()), " (mRoPE's are [3, batch, sequence])");
    validate_mrope_positions(keep, positions);
    return;
  }
  if (keep.shape() != positions.shape() || keep.ndim() != 2)
    CPSIM_INVALID("position_ids: shape ", shape_str(positions.shape()), " disagrees with the validity mask ",
                  shape_str(keep.shape()));
  const std::int64_t B = keep.dim(0), S = keep.dim(1);
  for (std::int64_t r = 0; r < B; ++r) {
    bool seen = false, prev_kept = false;
    std::int64_t prev = 0;
    for (std::int64_t t = 0; t < S; ++t) {
      const bool k = keep.get_int(r * S + t) != 0;
      if (!k) {
        prev_kept = false;
        continue;
      }
      const std::int64_t p = positions.get_int(r * S + t);
      if (p < 0) CPSIM_INVALID("position_ids row ", r, " index ", t, ": negative position ", p);
      if (seen && prev_kept && p != prev + 1 && p != 0)
        CPSIM_INVALID("position_ids row ", r, " index ", t, ": position ", p, " after ", prev,
                      " must be ", prev + 1, " (same document) or 0 (new document)");
      if (seen && !prev_kept && p != 0)
        CPSIM_INVALID("position_ids row ", r, " index ", t, ": position ", p,
                      " after a gap must be 0 (a gap never resumes a document)");
      seen = prev_kept = true;
      prev = p;
    }
  }
}

}  // namespace cpsim
