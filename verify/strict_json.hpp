// JSON as the batch readers accept it: nesting no deeper than `max_depth` (checked
// before parsing, so hostile input cannot exhaust the stack) and no key twice at
// the top level. Errors are InvalidInput naming `source` (or the repeated key).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace cpsim::verify {

nlohmann::json parse_strict_json(std::string_view text, const std::string& source, int max_depth);

}  // namespace cpsim::verify
