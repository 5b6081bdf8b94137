// BATCH files (SPEC §6): JSON with the keys of SPEC §1 as nested integer arrays,
// an optional "pad_token_id", and "seq_len" standing in for token tensors when only
// lengths are given; or safetensors as a training step writes them
// (verify/safetensors.hpp). Errors are InvalidInput naming the key, row and index.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "core/layout.hpp"

namespace cpsim::verify {

// A lengths-only JSON batch ("seq_len" instead of token tensors) gets stand-in
// token ids; at most this many (512 MiB of int64), since the file does not bound them.
inline constexpr std::int64_t kMaxStandInTokens = std::int64_t{1} << 26;

// A tensor exactly as a file stored it: its safetensors dtype name ("I32", "U8",
// "I64", "BOOL", ...), its shape and its little-endian bytes.
struct RawTensor {
  std::string dtype;
  Shape shape;
  std::string bytes;
};

struct BatchFile {
  Batch batch;
  // How the file gave each key (before 1-D keys are normalised and integer dtypes
  // widened to int64): a JSON file's keys are I64 (BOOL for bool keys).
  struct Form {
    std::string dtype;
    Shape shape;
  };
  std::map<std::string, Form> given;
  std::int64_t pad_token_id = 0;
  // The file gave no input_ids: the batch holds stand-ins (token ids never decide
  // padding, so every property still checks the layout the file gives).
  bool stand_in_ids = false;
};

// InvalidInput unless `key` is a name: 1 to 128 characters, no control characters.
// Every reader checks each key as it reads it, before any message quotes it.
void check_key_name(const std::string& key, const std::string& source);

// Told a batch's size once it is known from the file (rows, sequence length, and
// how many [B, S] keys it will hold, stand-ins included), before any stand-in is
// built or any layout derived: it may throw to refuse the batch (cpsim check's
// memory estimate), so that a batch too large to check costs nothing to refuse.
using BatchSized = std::function<void(std::int64_t rows, std::int64_t seq_len, int token_keys)>;

// What every reader does last: 1-D tensors normalised, `sized` told, stand-in
// input_ids when the file has none ([stand_in_rows, stand_in_len] when given,
// else shaped like the batch's other token keys).
void finish_batch(BatchFile& out, const BatchSized& sized = {}, std::int64_t stand_in_rows = 0,
                  std::int64_t stand_in_len = 0);

// A batch file mapped read-only into memory; InvalidInput when it cannot be opened.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::string_view bytes() const { return {data_ ? data_ : "", size_}; }

 private:
  const char* data_ = nullptr;
  std::size_t size_ = 0;
};

// JSON: duplicate keys, nesting deeper than a batch, and integers that do not fit
// int64 are invalid input.
BatchFile parse_batch_json(std::string_view text, const std::string& source = "batch", const BatchSized& sized = {});
// JSON or safetensors, by the content (the name only picks the error for neither).
BatchFile parse_batch(std::string_view bytes, const std::string& source, const BatchSized& sized = {});
BatchFile read_batch_file(const std::string& path);
std::string batch_to_json(const Batch& batch, std::int64_t pad_token_id, bool pretty = false);
void write_batch_json(const std::string& path, const Batch& batch, std::int64_t pad_token_id);

}  // namespace cpsim::verify
