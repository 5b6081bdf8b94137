// safetensors batches, as safetensors.torch.save_file(batch, path) writes them:
// an 8-byte little-endian header length N, N bytes of JSON header
// {"key": {"dtype": "I64", "shape": [B, S], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"pad_token_id": "0"}}, then the data (offsets relative to it).
// Every malformed file is an InvalidInput naming the key and what is wrong: a
// truncated file, a header whose length, offsets or sizes lie, overlapping or
// out-of-range data, an unknown dtype, a shape that disagrees with its byte count.
// Memory is bounded by the file: nothing is allocated before its bytes are found
// inside the file.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "verify/batch_io.hpp"

namespace cpsim::verify {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> dtypes;  // each tensor's dtype as stored ("I32", "U8", ...)
  std::map<std::string, std::string> metadata;
};

// Any safetensors file: integer dtypes (I64, I32, I16, I8, U8, U16, U32, U64) become
// int64 tensors, read exactly; BOOL a bool tensor; F64, F32, BF16 themselves when
// `allow_floating` (other floating dtypes are refused).
SafetensorsFile parse_safetensors(std::string_view bytes, const std::string& source, bool allow_floating);

// A batch: integer keys of shape [S] or [B, S]; floating dtypes are refused
// (batch keys are integer tensors); the pad id from the metadata.
BatchFile parse_batch_safetensors(std::string_view bytes, const std::string& source, const BatchSized& sized = {});

// The bytes of a safetensors file holding `tensors` (host copies of device ones),
// as safetensors.torch.save_file writes them: the widest elements first, then by
// name, so that every tensor's data is aligned to its element size.
std::string write_safetensors(const std::map<std::string, Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});
std::string write_safetensors(const std::map<std::string, RawTensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});
// A tensor's safetensors form (a host copy of a device one); with a form, an
// integer tensor reshaped and narrowed back to the dtype a file gave it in (its
// values came from that dtype, so nothing is lost).
RawTensor raw_tensor(const Tensor& t);
RawTensor raw_tensor(const Tensor& t, const BatchFile::Form& given);

// Whether bytes look like a safetensors file (a plausible header length, then '{').
bool looks_like_safetensors(std::string_view bytes);

}  // namespace cpsim::verify
