// BATCH files (SPEC §6): JSON with the keys of SPEC §1 as nested integer arrays,
// an optional "pad_token_id", and "seq_len" standing in for token tensors when only
// lengths are given. Errors are InvalidInput naming the key, row and index.
#pragma once

#include <cstdint>
#include <string>

#include "core/layout.hpp"

namespace cpsim::verify {

struct BatchFile {
  Batch batch;
  std::int64_t pad_token_id = 0;
};

BatchFile parse_batch_json(const std::string& text, const std::string& source = "batch");
// The bytes of a batch file; InvalidInput when it cannot be opened.
std::string read_batch_text(const std::string& path);
BatchFile read_batch_file(const std::string& path);
std::string batch_to_json(const Batch& batch, std::int64_t pad_token_id, bool pretty = false);
void write_batch_json(const std::string& path, const Batch& batch, std::int64_t pad_token_id);

}  // namespace cpsim::verify
