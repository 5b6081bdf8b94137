#include "verify/safetensors.hpp"

#include "verify/strict_json.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

namespace cpsim::verify {

using nlohmann::json;

namespace {

std::uint64_t le64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

struct DtypeInfo {
  std::size_t bytes;
  bool integer, is_signed, boolean;
};

bool dtype_info(const std::string& name, DtypeInfo& out) {
  static const std::pair<const char*, DtypeInfo> table[] = {
      {"I64", {8, true, true, false}},   {"I32", {4, true, true, false}},  {"I16", {2, true, true, false}},
      {"I8", {1, true, true, false}},    {"U8", {1, true, false, false}},  {"BOOL", {1, true, false, true}},
      {"U16", {2, true, false, false}},  {"U32", {4, true, false, false}}, {"U64", {8, true, false, false}},
      {"F64", {8, false, true, false}},  {"F32", {4, false, true, false}}, {"F16", {2, false, true, false}},
      {"BF16", {2, false, true, false}}, {"F8_E4M3", {1, false, true, false}}, {"F8_E5M2", {1, false, true, false}}};
  for (const auto& [n, info] : table)
    if (name == n) {
      out = info;
      return true;
    }
  return false;
}

std::int64_t read_integer(const char* p, const DtypeInfo& d, const std::string& key, std::int64_t index) {
  switch (d.bytes) {
    case 1:
      return d.is_signed ? std::int64_t{static_cast<std::int8_t>(*p)} : std::int64_t{static_cast<std::uint8_t>(*p)};
    case 2: {
      std::uint16_t u;
      std::memcpy(&u, p, 2);
      return d.is_signed ? std::int64_t{static_cast<std::int16_t>(u)} : std::int64_t{u};
    }
    case 4: {
      std::uint32_t u;
      std::memcpy(&u, p, 4);
      return d.is_signed ? std::int64_t{static_cast<std::int32_t>(u)} : std::int64_t{u};
    }
    default: {
      std::uint64_t u;
      std::memcpy(&u, p, 8);
      if (!d.is_signed && u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        CPSIM_INVALID(key, " index ", index, ": value ", u, " does not fit in int64");
      return static_cast<std::int64_t>(u);
    }
  }
}

}  // namespace

bool looks_like_safetensors(std::string_view bytes) {
  if (bytes.size() < 10) return false;
  const std::uint64_t n = le64(bytes.data());
  return n >= 2 && n <= bytes.size() - 8 && bytes[8] == '{';
}

SafetensorsFile parse_safetensors(std::string_view bytes, const std::string& source, bool allow_floating) {
  if (bytes.size() < 8)
    CPSIM_INVALID(source, ": truncated safetensors file: ", bytes.size(), " bytes, the 8-byte header length is missing");
  const std::uint64_t n = le64(bytes.data());
  // The format's reference implementation refuses headers over 100 MB; so does cpsim,
  // before reading any of it.
  constexpr std::uint64_t kMaxHeader = 100'000'000;
  if (n > kMaxHeader)
    CPSIM_INVALID(source, ": safetensors header length ", n, " exceeds the format's limit of ", kMaxHeader, " bytes");
  if (n > bytes.size() - 8)
    CPSIM_INVALID(source, ": safetensors header length ", n, " exceeds the ", bytes.size() - 8, " bytes after it");
  const std::string_view header = bytes.substr(8, n);
  const std::string_view data = bytes.substr(8 + n);
  json doc;
  try {
    doc = parse_strict_json(header, source + " (safetensors header)", 16);
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    if (what.find("malformed JSON") != std::string::npos)
      CPSIM_INVALID(source, ": safetensors header is not JSON (", what.substr(what.find("byte")), ")");
    throw;
  }
  if (!doc.is_object()) CPSIM_INVALID(source, ": safetensors header is not a JSON object");
  SafetensorsFile out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  std::vector<std::string> range_keys;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& key = it.key();
    const json& e = *it;
    check_key_name(key, source);
    if (key == "__metadata__") {
      if (!e.is_object()) CPSIM_INVALID("__metadata__: expected an object of strings");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m->is_string()) CPSIM_INVALID("__metadata__ ", m.key(), ": expected a string, as safetensors stores metadata");
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      CPSIM_INVALID(key, ": expected {\"dtype\", \"shape\", \"data_offsets\"} in the safetensors header");
    if (!e.at("dtype").is_string()) CPSIM_INVALID(key, ": dtype must be a string");
    const std::string dtype = e.at("dtype").get<std::string>();
    DtypeInfo d{};
    if (!dtype_info(dtype, d)) CPSIM_INVALID(key, ": unknown safetensors dtype '", dtype.substr(0, 32), "'");
    const bool readable_float = dtype == "F64" || dtype == "F32" || dtype == "BF16";
    if (!d.integer && !allow_floating) CPSIM_INVALID(key, ": dtype ", dtype, " is floating; batch keys are integer tensors");
    if (!d.integer && !readable_float) CPSIM_INVALID(key, ": dtype ", dtype, " is not read by cpsim (F64, F32, BF16 are)");
    const json& shape = e.at("shape");
    if (!shape.is_array() || shape.size() > 8)
      CPSIM_INVALID(key, ": shape must be an array of at most 8 dimensions");
    Shape dims;
    std::uint64_t numel = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (!shape[i].is_number_unsigned()) CPSIM_INVALID(key, ": shape dimension ", i, " is not a non-negative integer");
      const std::uint64_t v = shape[i].get<std::uint64_t>();
      if (v != 0 && numel > (data.size() + 1) / v) CPSIM_INVALID(key, ": shape holds more elements than the file has bytes");
      numel *= v;
      dims.push_back(static_cast<std::int64_t>(v));
    }
    const json& off = e.at("data_offsets");
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      CPSIM_INVALID(key, ": data_offsets must be [begin, end], non-negative integers");
    const std::uint64_t begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end) CPSIM_INVALID(key, ": data_offsets [", begin, ", ", end, "] end before they begin");
    if (end > data.size())
      CPSIM_INVALID(key, ": data_offsets end at ", end, ", past the ", data.size(), " data bytes of the file");
    if (end - begin != numel * d.bytes)
      CPSIM_INVALID(key, ": shape ", shape_str(dims), " of ", dtype, " needs ", numel * d.bytes, " bytes, data_offsets give ",
                    end - begin);
    ranges.push_back({begin, end});
    range_keys.push_back(key);
    const char* p = data.data() + begin;
    out.dtypes[key] = dtype;
    if (!d.integer) {  // floating: kept as they are (little-endian, like cpsim's tensors)
      Tensor t(dims, dtype == "F64" ? DType::f64 : dtype == "F32" ? DType::f32 : DType::bf16);
      if (numel) std::memcpy(t.raw(), p, numel * d.bytes);
      out.tensors[key] = t;
      continue;
    }
    Tensor t(dims, d.boolean ? DType::b8 : DType::i64);
    for (std::uint64_t i = 0; i < numel; ++i) {
      if (d.boolean) t.data<bool>()[i] = p[i] != 0;
      else t.data<std::int64_t>()[i] = read_integer(p + i * d.bytes, d, key, static_cast<std::int64_t>(i));
    }
    out.tensors[key] = t;
  }
  // Tensors may not share bytes.
  std::vector<std::size_t> order(ranges.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ranges[a] < ranges[b]; });
  for (std::size_t i = 1; i < order.size(); ++i) {
    const auto& prev = ranges[order[i - 1]];
    const auto& cur = ranges[order[i]];
    if (cur.first < prev.second && cur.first != cur.second && prev.first != prev.second)
      CPSIM_INVALID(range_keys[order[i]], ": data_offsets [", cur.first, ", ", cur.second, ") overlap those of ",
                    range_keys[order[i - 1]], " [", prev.first, ", ", prev.second, ")");
  }
  return out;
}

BatchFile parse_batch_safetensors(std::string_view bytes, const std::string& source, const BatchSized& sized) {
  SafetensorsFile f = parse_safetensors(bytes, source, false);
  BatchFile out;
  for (auto& [key, t] : f.tensors) {
    const bool planes = key == "position_ids" && t.ndim() == 3 && t.dim(0) == 3;  // mRoPE's [3, B, S]
    if ((t.ndim() < 1 || t.ndim() > 2) && !planes)
      CPSIM_INVALID(key, ": shape must be [S] or [B, S]", key == "position_ids" ? " (mRoPE's: [3, B, S])" : "", " (got ",
                    shape_str(t.shape()), ")");
    out.batch[key] = t;
    out.given[key] = {f.dtypes.at(key), t.shape()};
  }
  if (f.metadata.count("pad_token_id")) {
    const std::string& v = f.metadata.at("pad_token_id");
    std::size_t used = 0;
    try {
      out.pad_token_id = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size())
      CPSIM_INVALID("__metadata__ pad_token_id: expected an integer as a string, as safetensors stores metadata");
  }
  finish_batch(out, sized);
  return out;
}

namespace {
const char* safetensors_dtype(DType dt) {
  switch (dt) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::b8: return "BOOL";
  }
  return "?";
}
}  // namespace

RawTensor raw_tensor(const Tensor& t0) {
  const Tensor t = t0.is_cpu() ? t0 : t0.to(Device::host());
  return {safetensors_dtype(t.dtype()), t.shape(), std::string(static_cast<const char*>(t.raw()), t.nbytes())};
}

RawTensor raw_tensor(const Tensor& t, const BatchFile::Form& given) {
  DtypeInfo d{};
  if (!dtype_info(given.dtype, d) || !d.integer) return raw_tensor(t);
  RawTensor out{given.dtype, given.shape, std::string()};
  const Tensor host = t.is_cpu() ? t : t.to(Device::host());
  for (std::int64_t i = 0; i < host.numel(); ++i) {
    const auto v = static_cast<std::uint64_t>(host.get_int(i));
    for (std::size_t b = 0; b < d.bytes; ++b) out.bytes.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
  }
  return out;
}

std::string write_safetensors(const std::map<std::string, Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::map<std::string, RawTensor> raw;
  for (const auto& [key, t] : tensors) raw[key] = raw_tensor(t);
  return write_safetensors(raw, metadata);
}

std::string write_safetensors(const std::map<std::string, RawTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  // Widest elements first, then by name: every tensor's data starts at a multiple
  // of its element size (the data starts 8-byte aligned), so a reader can view the
  // file's bytes in place (torch.frombuffer, numpy) without a copy.
  const auto width = [](const RawTensor& t) {
    DtypeInfo d{};
    return dtype_info(t.dtype, d) ? d.bytes : std::size_t{1};
  };
  std::vector<const std::pair<const std::string, RawTensor>*> order;
  for (const auto& entry : tensors) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(), [&](auto* a, auto* b) { return width(a->second) > width(b->second); });
  std::uint64_t at = 0;
  std::string data;
  for (const auto* entry : order) {
    const RawTensor& t = entry->second;
    header[entry->first] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    data += t.bytes;
    at += t.bytes.size();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as safetensors writes it
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h.size() >> (8 * i)) & 0xFF));
  return out + h + data;
}

}  // namespace cpsim::verify
