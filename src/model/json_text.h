// JSON values quoted in error messages: short, and numbers as a person writes them (Boost.JSON's serializer
// writes 7168.5 as 7.1685E3).
#pragma once

#include <boost/json.hpp>
#include <charconv>
#include <string>

namespace deepinfer::model::detail {

inline void append_json_text(const boost::json::value& value, std::string& out) {
  if (value.is_double()) {
    char buffer[32];
    auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value.get_double());
    out.append(buffer, ec == std::errc() ? end : buffer);
  } else if (value.is_array()) {
    out += '[';
    bool first = true;
    for (const boost::json::value& element : value.get_array()) {
      if (!first) out += ',';
      first = false;
      append_json_text(element, out);
      if (out.size() > 200) break;
    }
    out += ']';
  } else {
    out += boost::json::serialize(value);
  }
}

// `value` as JSON text, cut to 80 characters.
inline std::string json_text(const boost::json::value& value) {
  constexpr size_t kMaxChars = 80;
  std::string text;
  append_json_text(value, text);
  if (text.size() > kMaxChars) {
    text.resize(kMaxChars - 3);
    text += "...";
  }
  return text;
}

}  // namespace deepinfer::model::detail
