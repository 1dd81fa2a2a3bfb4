// Python-compatible JSON serialization (json.dumps with ensure_ascii=False and default separators).
// Float formatting follows CPython's float_repr: shortest round-trip digits, exponent form when the
// decimal exponent is < -4 or >= 16, and always a ".0" on integral values in positional form.
#include "deepinfer/recipe/python_json.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include <boost/json.hpp>

namespace deepinfer::recipe {
namespace {

void append_string(boost::json::string_view s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void append_double(double d, std::string& out) {
  if (std::isnan(d)) { out += "NaN"; return; }
  if (std::isinf(d)) { out += d > 0 ? "Infinity" : "-Infinity"; return; }
  // Shortest round-trip digits in scientific form: "-d.ddde[+-]x".
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  (void)ec;
  std::string sci(buf, end);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e_pos = sci.find('e');
  int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string digits;
  for (size_t i = 0; i < e_pos; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  if (negative) out += '-';
  if (exponent < -4 || exponent >= 16) {
    out += digits[0];
    if (digits.size() > 1) {
      out += '.';
      out.append(digits, 1);
    }
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += ebuf;
    return;
  }
  if (exponent < 0) {
    out += "0.";
    out.append(static_cast<size_t>(-exponent - 1), '0');
    out += digits;
    return;
  }
  size_t int_len = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= int_len) {
    out += digits;
    out.append(int_len - digits.size(), '0');
    out += ".0";
  } else {
    out.append(digits, 0, int_len);
    out += '.';
    out.append(digits, int_len);
  }
}

}  // namespace

void append_python_json(const boost::json::value& value, std::string& out) {
  switch (value.kind()) {
    case boost::json::kind::null: out += "null"; break;
    case boost::json::kind::bool_: out += value.get_bool() ? "true" : "false"; break;
    case boost::json::kind::int64: out += std::to_string(value.get_int64()); break;
    case boost::json::kind::uint64: out += std::to_string(value.get_uint64()); break;
    case boost::json::kind::double_: append_double(value.get_double(), out); break;
    case boost::json::kind::string: append_string(value.get_string(), out); break;
    case boost::json::kind::array: {
      out += '[';
      bool first = true;
      for (const auto& element : value.get_array()) {
        if (!first) out += ", ";
        first = false;
        append_python_json(element, out);
      }
      out += ']';
      break;
    }
    case boost::json::kind::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, element] : value.get_object()) {
        if (!first) out += ", ";
        first = false;
        append_string(key, out);
        out += ": ";
        append_python_json(element, out);
      }
      out += '}';
      break;
    }
  }
}

std::string python_json(const boost::json::value& value) {
  std::string out;
  append_python_json(value, out);
  return out;
}

}  // namespace deepinfer::recipe
