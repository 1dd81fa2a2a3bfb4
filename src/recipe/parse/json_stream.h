// Streaming JSON helpers for the output parser: a byte-at-a-time validator that says whether a text is still a
// prefix of one valid JSON value (RFC 8259) and where that value ends, and Python-compatible string escaping
// (json.dumps with ensure_ascii=False), so that synthesised arguments equal the reference encoders' text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace deepinfer::recipe {

// Deepest nesting accepted, here and in the final Boost.JSON parse of a call's arguments.
inline constexpr size_t kMaxJsonDepth = 128;

// Not thread-safe; one per value. O(1) per byte.
class JsonPrefixValidator {
 public:
  enum class Step {
    kOk,        // the byte extends a valid prefix
    kComplete,  // the byte closed the top-level value (an object, array, string or literal)
    kError,     // no valid JSON text starts with the bytes so far (this byte included)
  };

  // Feeds one byte. After kComplete or kError the validator must be reset() before further use.
  Step push(char c);
  void reset();

 private:
  enum class Mode : uint8_t {
    kValue,          // a value must start (whitespace allowed)
    kArrayFirst,     // after '[': a value or ']'
    kObjectFirst,    // after '{': a key or '}'
    kObjectKey,      // after ',' in an object: a key
    kColon,          // after a key
    kAfterValue,     // after a value inside a container: ',' or the closing bracket
    kString,         // inside a string
    kEscape,         // after '\' in a string
    kUnicode,        // inside \uXXXX
    kMinus,          // number: after '-'
    kZero,           // number: a leading 0
    kInteger,        // number: integer digits
    kFractionStart,  // number: after '.'
    kFraction,       // number: fraction digits
    kExponentStart,  // number: after 'e'
    kExponentSign,   // number: after 'e+' / 'e-'
    kExponent,       // number: exponent digits
    kLiteral,        // inside true / false / null
    kDone,           // top-level value complete
    kFailed,
  };

  Step end_value();
  Step fail() {
    mode_ = Mode::kFailed;
    return Step::kError;
  }

  Mode mode_ = Mode::kValue;
  std::vector<char> stack_;  // '{' or '[' per open container
  bool string_is_key_ = false;
  uint8_t unicode_left_ = 0;
  std::string_view literal_rest_;
};

// Appends `text` JSON-escaped as Python's json.dumps(ensure_ascii=False) escapes a string's characters:
// '"', '\\', \n \r \t \b \f by name, other bytes below 0x20 as \u00XX, everything else unchanged. No quotes.
void append_json_escaped(std::string_view text, std::string& out);

}  // namespace deepinfer::recipe
