#include "verify/batch_io.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "verify/safetensors.hpp"
#include "verify/strict_json.hpp"

namespace cpsim::verify {

using nlohmann::json;

namespace {

bool is_bool_key(const std::string& key) { return key == "padding_mask"; }

Tensor tensor_from_json(const json& value, const std::string& key);

// The shape a nested array shows along its first elements ([1, 1, 1, 3] for
// [[[[3, 3, -1000]]]]), for messages.
std::string nested_shape(const json& value) {
  std::vector<std::int64_t> shape;
  for (const json* v = &value; v->is_array(); v = &(*v)[0]) {
    shape.push_back(static_cast<std::int64_t>(v->size()));
    if (v->empty()) break;
  }
  return shape_str(shape);
}

// Three levels of nesting (mRoPE's position_ids [3, B, S]): planes of equal shape.
Tensor planes_from_json(const json& value, const std::string& key) {
  if (!value[0][0].empty() && value[0][0][0].is_array())
    CPSIM_INVALID(key, ": shape ", nested_shape(value), "; a batch key is [sequence], [batch, sequence] or "
                  "(mRoPE's position_ids) [3, batch, sequence]");
  std::vector<Tensor> planes;
  for (std::size_t k = 0; k < value.size(); ++k) {
    if (!value[k].is_array() || value[k].empty() || !value[k][0].is_array())
      CPSIM_INVALID(key, " plane ", k, ": expected a [batch, sequence] array, as plane 0 is");
    planes.push_back(tensor_from_json(value[k], key + " plane " + std::to_string(k)));
    if (planes.back().shape() != planes[0].shape())
      CPSIM_INVALID(key, " plane ", k, ": shape ", shape_str(planes.back().shape()), ", plane 0's ",
                    shape_str(planes[0].shape()), " (shapes must be rectangular)");
  }
  const std::int64_t n = planes[0].numel();
  Tensor t({static_cast<std::int64_t>(planes.size()), planes[0].dim(0), planes[0].dim(1)}, planes[0].dtype());
  for (std::size_t k = 0; k < planes.size(); ++k)
    for (std::int64_t i = 0; i < n; ++i) t.set(static_cast<std::int64_t>(k) * n + i, planes[k].get(i));
  return t;
}

// Nested arrays of integers (or booleans) -> a tensor; the shape must be rectangular.
Tensor tensor_from_json(const json& value, const std::string& key) {
  if (!value.is_array()) CPSIM_INVALID(key, ": expected a nested array of integers");
  if (!value.empty() && value[0].is_array() && !value[0].empty() && value[0][0].is_array())
    return planes_from_json(value, key);
  const bool two_d = !value.empty() && value[0].is_array();
  const std::int64_t rows = two_d ? static_cast<std::int64_t>(value.size()) : 1;
  const std::int64_t cols = two_d ? static_cast<std::int64_t>(value[0].size()) : static_cast<std::int64_t>(value.size());
  Tensor t(two_d ? Shape{rows, cols} : Shape{cols}, is_bool_key(key) ? DType::b8 : DType::i64);
  for (std::int64_t r = 0; r < rows; ++r) {
    const json& row = two_d ? value[r] : value;
    if (!row.is_array()) CPSIM_INVALID(key, " row ", r, ": expected an array");
    if (static_cast<std::int64_t>(row.size()) != cols)
      CPSIM_INVALID(key, " row ", r, " index ", std::min<std::int64_t>(cols, row.size()), ": row has ", row.size(),
                    " entries, row 0 has ", cols, " (shapes must be rectangular)");
    for (std::int64_t i = 0; i < cols; ++i) {
      const json& v = row[i];
      if (v.is_boolean()) t.set(r * cols + i, v.get<bool>() ? 1.0 : 0.0);
      else if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
        CPSIM_INVALID(key, " row ", r, " index ", i, ": ", v.get<std::uint64_t>(), " does not fit in int64");
      else if (v.is_number_integer()) {
        if (t.dtype() == DType::b8) {
          const std::int64_t x = v.get<std::int64_t>();
          if (x != 0 && x != 1) CPSIM_INVALID(key, " row ", r, " index ", i, ": value ", x, "; a mask holds 0 or 1");
          t.set(r * cols + i, x != 0 ? 1.0 : 0.0);
        }
        else t.data<std::int64_t>()[r * cols + i] = v.get<std::int64_t>();
      } else CPSIM_INVALID(key, " row ", r, " index ", i, ": expected an integer, got ", v.type_name());
    }
  }
  return t;
}

json tensor_to_json(const Tensor& t) {
  json out = json::array();
  if (t.ndim() == 3) {  // mRoPE's position_ids: a [B, S] array per plane
    for (std::int64_t k = 0; k < t.dim(0); ++k) out.push_back(tensor_to_json(narrow(t, 0, k, 1).reshape({t.dim(1), t.dim(2)})));
    return out;
  }
  const std::int64_t rows = t.ndim() == 2 ? t.dim(0) : 1, cols = t.ndim() == 2 ? t.dim(1) : t.numel();
  for (std::int64_t r = 0; r < rows; ++r) {
    json row = json::array();
    for (std::int64_t i = 0; i < cols; ++i) {
      if (t.dtype() == DType::b8) row.push_back(t.get_int(r * cols + i) != 0);
      else row.push_back(t.get_int(r * cols + i));
    }
    if (t.ndim() == 2) out.push_back(row);
    else out = row;
  }
  return out;
}

}  // namespace

// Keys are names: no control characters (a NUL would cut a message), not a page long.
void check_key_name(const std::string& key, const std::string& source) {
  constexpr std::size_t kLongestKey = 128;
  bool control = false;
  for (unsigned char c : key) control = control || c < 0x20 || c == 0x7f;
  if (key.empty() || control || key.size() > kLongestKey)
    CPSIM_INVALID(source, ": a key \"", printable(key), "\" is no batch key name (names such as input_ids: 1 to ",
                  kLongestKey, " characters, no control characters)");
}

namespace {
// Stand-in token ids [rows, S] (never used to decide padding, which comes from
// lengths and masks); their memory is bounded here, since no file bounds them.
void check_stand_in_size(std::int64_t rows, std::int64_t S, const std::string& what) {
  if (S > kMaxStandInTokens / std::max<std::int64_t>(rows, 1))
    CPSIM_INVALID(what, ": ", S, " x ", rows, " rows of stand-in tokens exceeds the limit of ", kMaxStandInTokens,
                  " tokens for a batch without input_ids (give input_ids for longer ones)");
}
Tensor stand_in_ids(std::int64_t rows, std::int64_t S, const std::string& what) {
  check_stand_in_size(rows, S, what);
  Tensor ids({rows, S}, DType::i64);
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids.data<std::int64_t>()[i] = 1 + (i * 7) % 31;
  return ids;
}
}  // namespace

void finish_batch(BatchFile& out, const BatchSized& sized, std::int64_t stand_in_rows, std::int64_t stand_in_len) {
  normalize_batch_axis(out.batch);
  int keys = 0;
  for (const auto& [key, t] : out.batch) keys += !is_length_key(key);
  if (stand_in_len > 0) {  // "seq_len" stands in for the token tensors
    check_stand_in_size(stand_in_rows, stand_in_len, "seq_len");
    if (sized) sized(stand_in_rows, stand_in_len, keys + 1);
    out.batch["input_ids"] = stand_in_ids(stand_in_rows, stand_in_len, "seq_len");
    out.stand_in_ids = true;
    return;
  }
  const bool has_ids = out.batch.count("input_ids") > 0;
  if (has_ids && !sized) return;
  // A batch with no [B, S] key at all is invalid (sequence_length says which).
  const std::int64_t S = sequence_length(out.batch), B = batch_rows(out.batch);
  if (sized) sized(B, S, keys + (has_ids ? 0 : 1));
  if (has_ids) return;
  // No input_ids: stand-ins shaped like the batch's other token keys (labels,
  // position_ids, a mask).
  out.batch["input_ids"] = stand_in_ids(B, S, "input_ids (absent)");
  out.stand_in_ids = true;
}

BatchFile parse_batch_json(std::string_view text, const std::string& source, const BatchSized& sized) {
  // Batch keys nest two levels deep.
  const json doc = parse_strict_json(text, source, 8);
  if (!doc.is_object()) CPSIM_INVALID(source, ": expected a JSON object of batch keys");
  BatchFile out;
  std::int64_t seq_len = -1;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& key = it.key();
    check_key_name(key, source);
    if (key == "pad_token_id") {
      if (!it->is_number_integer() || (it->is_number_unsigned() && it->get<std::uint64_t>() > INT64_MAX))
        CPSIM_INVALID("pad_token_id: expected an integer that fits in int64");
      out.pad_token_id = it->get<std::int64_t>();
    } else if (key == "seq_len") {
      if (!it->is_number_integer() || it->get<std::int64_t>() < 1) CPSIM_INVALID("seq_len: expected a positive integer");
      seq_len = it->get<std::int64_t>();
    } else {
      out.batch[key] = tensor_from_json(*it, key);
      out.given[key] = {is_bool_key(key) ? "BOOL" : "I64", out.batch[key].shape()};
    }
  }
  normalize_batch_axis(out.batch);
  if (seq_len >= 0) {
    // "seq_len" stands in for the token tensors when only lengths are given.
    bool tokens = false;
    for (const auto& [key, t] : out.batch) tokens = tokens || !is_length_key(key);
    if (tokens) {
      const std::int64_t S = sequence_length(out.batch);
      if (S != seq_len) CPSIM_INVALID("seq_len: ", seq_len, " disagrees with the batch's sequence length ", S);
    } else {
      const std::int64_t rows = out.batch.count("seq_lens") ? out.batch.at("seq_lens").dim(0) : 1;
      finish_batch(out, sized, rows, seq_len);
      return out;
    }
  }
  finish_batch(out, sized);
  return out;
}

MappedFile::MappedFile(const std::string& path) {
  // A FIFO or a device would block in open or never end: refused before opening.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) CPSIM_INVALID(path, ": cannot open the batch file (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode)) CPSIM_INVALID(path, ": not a regular file (a batch is a JSON or safetensors file)");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) CPSIM_INVALID(path, ": cannot open the batch file (", std::strerror(errno), ")");
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    CPSIM_INVALID(path, ": not a regular file (a batch is a JSON or safetensors file)");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      CPSIM_INVALID(path, ": cannot map the batch file (", std::strerror(errno), ")");
    }
    data_ = static_cast<const char*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<char*>(data_), size_);
}

bool is_safetensors_path(const std::string& path) {
  return path.size() >= 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0;
}

BatchFile parse_batch(std::string_view bytes, const std::string& source, const BatchSized& sized) {
  // By the content: a safetensors header, or JSON text (which may begin with white
  // space); the name decides only which error a file that is neither gets.
  const auto first = bytes.find_first_not_of(" \t\r\n");
  const bool json_text = first != std::string_view::npos && bytes[first] == '{';
  if (looks_like_safetensors(bytes) || (!json_text && is_safetensors_path(source)))
    return parse_batch_safetensors(bytes, source, sized);
  return parse_batch_json(bytes, source, sized);
}

BatchFile read_batch_file(const std::string& path) {
  const MappedFile file(path);
  return parse_batch(file.bytes(), path);
}

std::string batch_to_json(const Batch& batch, std::int64_t pad_token_id, bool pretty) {
  json doc = json::object();
  for (const auto& [key, t] : batch) doc[key] = tensor_to_json(t);
  doc["pad_token_id"] = pad_token_id;
  return pretty ? doc.dump(1) : doc.dump();
}

void write_batch_json(const std::string& path, const Batch& batch, std::int64_t pad_token_id) {
  std::ofstream out(path);
  if (!out) throw Aborted(path + ": cannot write (" + std::string(std::strerror(errno)) + ")");
  out << batch_to_json(batch, pad_token_id, true) << "\n";
}

}  // namespace cpsim::verify
