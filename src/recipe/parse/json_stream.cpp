// Byte-at-a-time JSON prefix validation (the RFC 8259 grammar as a pushdown automaton) and Python-style
// string escaping for the output parser.
#include "json_stream.h"

#include <cstdio>

namespace deepinfer::recipe {
namespace {

bool is_whitespace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

void JsonPrefixValidator::reset() {
  mode_ = Mode::kValue;
  stack_.clear();
  string_is_key_ = false;
  unicode_left_ = 0;
  literal_rest_ = {};
}

JsonPrefixValidator::Step JsonPrefixValidator::end_value() {
  if (stack_.empty()) {
    mode_ = Mode::kDone;
    return Step::kComplete;
  }
  mode_ = Mode::kAfterValue;
  return Step::kOk;
}

JsonPrefixValidator::Step JsonPrefixValidator::push(char c) {
  switch (mode_) {
    case Mode::kValue:
      if (is_whitespace(c)) return Step::kOk;
      switch (c) {
        case '{':
        case '[':
          if (stack_.size() >= kMaxJsonDepth) return fail();
          stack_.push_back(c);
          mode_ = c == '{' ? Mode::kObjectFirst : Mode::kArrayFirst;
          return Step::kOk;
        case '"':
          string_is_key_ = false;
          mode_ = Mode::kString;
          return Step::kOk;
        case '-':
          mode_ = Mode::kMinus;
          return Step::kOk;
        case '0':
          mode_ = Mode::kZero;
          return Step::kOk;
        case 't':
          literal_rest_ = "rue";
          mode_ = Mode::kLiteral;
          return Step::kOk;
        case 'f':
          literal_rest_ = "alse";
          mode_ = Mode::kLiteral;
          return Step::kOk;
        case 'n':
          literal_rest_ = "ull";
          mode_ = Mode::kLiteral;
          return Step::kOk;
        default:
          if (c >= '1' && c <= '9') {
            mode_ = Mode::kInteger;
            return Step::kOk;
          }
          return fail();
      }
    case Mode::kArrayFirst:
      if (is_whitespace(c)) return Step::kOk;
      if (c == ']') {
        stack_.pop_back();
        return end_value();
      }
      mode_ = Mode::kValue;
      return push(c);
    case Mode::kObjectFirst:
    case Mode::kObjectKey:
      if (is_whitespace(c)) return Step::kOk;
      if (c == '"') {
        string_is_key_ = true;
        mode_ = Mode::kString;
        return Step::kOk;
      }
      if (c == '}' && mode_ == Mode::kObjectFirst) {
        stack_.pop_back();
        return end_value();
      }
      return fail();
    case Mode::kColon:
      if (is_whitespace(c)) return Step::kOk;
      if (c != ':') return fail();
      mode_ = Mode::kValue;
      return Step::kOk;
    case Mode::kAfterValue:
      if (is_whitespace(c)) return Step::kOk;
      if (c == ',') {
        mode_ = stack_.back() == '{' ? Mode::kObjectKey : Mode::kValue;
        return Step::kOk;
      }
      if ((c == '}' && stack_.back() == '{') || (c == ']' && stack_.back() == '[')) {
        stack_.pop_back();
        return end_value();
      }
      return fail();
    case Mode::kString:
      if (c == '"') {
        if (string_is_key_) {
          mode_ = Mode::kColon;
          return Step::kOk;
        }
        return end_value();
      }
      if (c == '\\') {
        mode_ = Mode::kEscape;
        return Step::kOk;
      }
      if (static_cast<unsigned char>(c) < 0x20) return fail();
      return Step::kOk;
    case Mode::kEscape:
      switch (c) {
        case '"':
        case '\\':
        case '/':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          mode_ = Mode::kString;
          return Step::kOk;
        case 'u':
          unicode_left_ = 4;
          mode_ = Mode::kUnicode;
          return Step::kOk;
        default:
          return fail();
      }
    case Mode::kUnicode:
      if (!is_hex(c)) return fail();
      if (--unicode_left_ == 0) mode_ = Mode::kString;
      return Step::kOk;
    case Mode::kMinus:
      if (c == '0') {
        mode_ = Mode::kZero;
        return Step::kOk;
      }
      if (c >= '1' && c <= '9') {
        mode_ = Mode::kInteger;
        return Step::kOk;
      }
      return fail();
    case Mode::kZero:
    case Mode::kInteger:
      if (is_digit(c) && mode_ == Mode::kInteger) return Step::kOk;
      if (c == '.') {
        mode_ = Mode::kFractionStart;
        return Step::kOk;
      }
      if (c == 'e' || c == 'E') {
        mode_ = Mode::kExponentStart;
        return Step::kOk;
      }
      break;  // the number ended before `c`
    case Mode::kFractionStart:
      if (!is_digit(c)) return fail();
      mode_ = Mode::kFraction;
      return Step::kOk;
    case Mode::kFraction:
      if (is_digit(c)) return Step::kOk;
      if (c == 'e' || c == 'E') {
        mode_ = Mode::kExponentStart;
        return Step::kOk;
      }
      break;
    case Mode::kExponentStart:
      if (c == '+' || c == '-') {
        mode_ = Mode::kExponentSign;
        return Step::kOk;
      }
      [[fallthrough]];
    case Mode::kExponentSign:
      if (!is_digit(c)) return fail();
      mode_ = Mode::kExponent;
      return Step::kOk;
    case Mode::kExponent:
      if (is_digit(c)) return Step::kOk;
      break;
    case Mode::kLiteral:
      if (c != literal_rest_.front()) return fail();
      literal_rest_.remove_prefix(1);
      if (literal_rest_.empty()) return end_value();
      return Step::kOk;
    case Mode::kDone:
    case Mode::kFailed:
      return fail();
  }
  // A complete number ended before `c`; `c` continues the enclosing value. A top-level number has no end
  // marker of its own, so it only completes inside a container (callers validate top-level objects).
  if (stack_.empty()) {
    if (is_whitespace(c)) {
      mode_ = Mode::kDone;
      return Step::kComplete;
    }
    return fail();
  }
  mode_ = Mode::kAfterValue;
  return push(c);
}

void append_json_escaped(std::string_view text, std::string& out) {
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
}

}  // namespace deepinfer::recipe
