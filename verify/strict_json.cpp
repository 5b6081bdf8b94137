// JSON as cpsim's readers accept it (verify/strict_json.hpp).
#include "verify/strict_json.hpp"

#include <set>

#include "core/error.hpp"

namespace cpsim::verify {

using json = nlohmann::json;

namespace {
// Finds a key repeated at the top level in one linear pass (nlohmann's callback
// parser removes discarded values by scanning the parent object, which is
// quadratic in the number of keys).
struct TopLevelKeys : nlohmann::json_sax<json> {
  int depth = 0;
  std::set<std::string> seen;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    ++depth;
    return true;
  }
  bool end_object() override {
    --depth;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth;
    return true;
  }
  bool end_array() override {
    --depth;
    return true;
  }
  bool key(string_t& k) override {
    if (depth == 1 && duplicate.empty() && !seen.insert(k).second) duplicate = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};
}  // namespace

json parse_strict_json(std::string_view text, const std::string& source, int max_depth) {
  // JSON is text: a NUL byte would end the parse early and hide what follows it.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    CPSIM_INVALID(source, ": a NUL byte at byte ", nul, " (JSON is text; is this a binary file?)");
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_depth) CPSIM_INVALID(source, ": nested deeper than ", max_depth, " levels");
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    if (std::string(e.what()).find("; expected end of input") != std::string::npos)
      CPSIM_INVALID(source, ": more after the JSON value, at byte ", e.byte, " (the file holds one JSON object)");
    CPSIM_INVALID(source, ": malformed JSON at byte ", e.byte);
  } catch (const json::out_of_range&) {
    CPSIM_INVALID(source, ": a number in the JSON is too large to represent");
  } catch (const json::exception& e) {
    CPSIM_INVALID(source, ": unreadable JSON (", e.id, ")");
  }
  TopLevelKeys keys;
  json::sax_parse(text.begin(), text.end(), &keys);
  if (!keys.duplicate.empty()) CPSIM_INVALID(printable(keys.duplicate), ": key appears twice in ", source);
  return doc;
}

}  // namespace cpsim::verify
