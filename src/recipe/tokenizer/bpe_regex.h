// Pre-tokenizer regexes of a tokenizer.json, on PCRE2 (JIT, UTF + UCP). Hugging Face `tokenizers` runs these
// patterns on Oniguruma, whose \s, \d and \w differ slightly from PCRE2's; patterns are rewritten so that
// both engines split text identically. Private to src/recipe.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "deepinfer/core/status.h"

struct pcre2_real_code_8;

namespace deepinfer::recipe::bpe {

// A compiled pattern. Immutable; find() may be called from any number of threads at once (each thread
// matches with its own match data).
//
// The reference knows Unicode 16.0, PCRE2 10.42 Unicode 14.0. Each pattern is compiled twice: `full`
// widens every general category with the code points assigned since, `basic` keeps PCRE2's tables and is
// faster (fewer ranges to test per character). Both split text alike unless it has such a code point;
// has_newer_code_points() tells which to use.
class Regex {
 public:
  // `pattern` is in the tokenizer.json (Oniguruma) dialect. Errors carry PCRE2's message and the offset.
  static Result<std::unique_ptr<Regex>> compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Leftmost match in `subject` starting the search at byte `start` (lookarounds see all of `subject`
  // and nothing outside it). Invalid UTF-8 in `subject` never matches anything. Returns false on no match.
  // `newer_code_points`: has_newer_code_points() of the subject (true is always correct, only slower).
  bool find(std::string_view subject, size_t start, bool newer_code_points, size_t& match_begin,
            size_t& match_end) const;

  // Calls `on_match(begin, end)` for each successive non-overlapping match, as Rust's find_iter does.
  template <class OnMatch>
  void for_each_match(std::string_view subject, bool newer_code_points, OnMatch&& on_match) const;

 private:
  struct Compiled {
    pcre2_real_code_8* code = nullptr;
    bool jit = false;
  };
  Regex() = default;
  static Status compile_one(std::string_view source, std::string_view translated, Compiled& out);
  bool find_with(const Compiled& compiled, std::string_view subject, size_t start, size_t& match_begin,
                 size_t& match_end) const;

  Compiled basic_;
  Compiled full_;  // code is null when the pattern names no widened class: basic_ serves both
};

// Whether `text` holds a code point that Unicode 15.0 to 16.0 assigned to a category (see Regex).
bool has_newer_code_points(std::string_view text);

// Rewrites the pattern for PCRE2: \s \S \d \D \w \W become the sets Oniguruma gives them (\s: White_Space,
// including U+0085), and with `newer_code_points` each \p{category} gains the code points Unicode 15-16
// assigned to it. Negated forms inside a class keep PCRE2's meaning (off by those code points and U+0085).
std::string translate_oniguruma_pattern(std::string_view pattern, bool newer_code_points);

// A pattern matching `literal` exactly (for Split's {"String": ...} patterns).
std::string escape_literal(std::string_view literal);

// Length of the UTF-8 sequence starting at s[i] (1 for an invalid byte), never past the end.
size_t utf8_char_length(std::string_view s, size_t i);

template <class OnMatch>
void Regex::for_each_match(std::string_view subject, bool newer_code_points, OnMatch&& on_match) const {
  size_t position = 0;
  size_t match_begin = 0;
  size_t match_end = 0;
  while (position <= subject.size() && find(subject, position, newer_code_points, match_begin, match_end)) {
    on_match(match_begin, match_end);
    // An empty match must not be found again at the same place.
    if (match_end == match_begin) {
      if (match_end == subject.size()) break;
      position = match_end + utf8_char_length(subject, match_end);
    } else {
      position = match_end;
    }
  }
}

}  // namespace deepinfer::recipe::bpe
