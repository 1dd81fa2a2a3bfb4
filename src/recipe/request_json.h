// Small helpers the request converters share (openai_request.cpp, anthropic_request.cpp,
// responses_request.cpp): JSON field access and the wording of their error messages. Internal to the recipe.
#pragma once

#include <boost/json.hpp>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>

#include "deepinfer/core/status.h"

namespace deepinfer::recipe::request_json {

// "path[index]", the JSON path of an array element in error messages.
inline std::string indexed(const std::string& path, size_t index) { return path + "[" + std::to_string(index) + "]"; }

// The text in double quotes.
inline std::string quoted(std::string_view text) {
  std::string out(1, '"');  // appended, not `"\"" + ...`: GCC 12 at -O3 warns falsely (-Wrestrict) on that
  out.append(text);
  out += '"';
  return out;
}

// The value of `key`, or nullptr when it is absent or JSON null.
inline const boost::json::value* present(const boost::json::object& object, std::string_view key) {
  const boost::json::value* value = object.if_contains(key);
  return value == nullptr || value->is_null() ? nullptr : value;
}

// `out` = the string at `key`; else InvalidArgument "<path>.<key> must be a string".
inline Status required_string(const boost::json::object& object, std::string_view key, const std::string& path,
                              std::string& out) {
  const boost::json::value* value = present(object, key);
  if (value == nullptr || !value->is_string()) {
    return Status::invalid_argument(path + "." + std::string(key) + " must be a string");
  }
  out = value->get_string();
  return Status();
}

// OpenAI's `strict` (a JSON schema the output must follow exactly): absent, or a boolean; `strict` = its value.
inline Status read_strict(const boost::json::object& object, const std::string& path, bool& strict) {
  const boost::json::value* value = present(object, "strict");
  strict = value != nullptr && value->is_bool() && value->get_bool();
  if (value != nullptr && !value->is_bool()) return Status::invalid_argument(path + ".strict must be a boolean");
  return Status();
}

// read_strict, and true refused (response_format.json_schema.strict, tools[].function.strict, text.format.strict):
// enforcing it needs constrained decoding, which this server does not do; accepting it would promise what nothing
// checks (a break-it pass, 2026-12-07).
inline Status refuse_strict(const boost::json::object& object, const std::string& path) {
  bool strict = false;
  if (Status s = read_strict(object, path, strict); !s.ok() || !strict) return s;
  return Status::invalid_argument(path +
                                  ".strict: true needs constrained decoding, which this server does not do; "
                                  "send strict: false or leave it out (the schema is still given to the model)");
}

// A JSON number that is a whole number, as a double (1024, and 1024.0 as Python's json writes a float; int64 and
// uint64 values keep their size, so a range check on the double sees them); nullopt for anything else.
inline std::optional<double> whole_number(const boost::json::value& v) {
  if (!v.is_number()) return std::nullopt;
  const double number = v.to_number<double>();
  if (!std::isfinite(number) || number != std::floor(number)) return std::nullopt;
  return number;
}

// "a string", "an array", ...: what a value is, for "must be X, got Y" messages.
inline std::string kind_name(const boost::json::value& v) {
  switch (v.kind()) {
    case boost::json::kind::null:
      return "null";
    case boost::json::kind::bool_:
      return "a boolean";
    case boost::json::kind::int64:
    case boost::json::kind::uint64:
    case boost::json::kind::double_:
      return "a number";
    case boost::json::kind::string:
      return "a string";
    case boost::json::kind::array:
      return "an array";
    case boost::json::kind::object:
      return "an object";
  }
  return "unknown";
}

}  // namespace deepinfer::recipe::request_json
