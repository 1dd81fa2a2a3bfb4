// PCRE2 wrapper for the pre-tokenizer patterns, and the rewrite of Oniguruma's shorthand classes into
// explicit Unicode sets so that PCRE2 splits exactly where Hugging Face `tokenizers` does.
#include "bpe_regex.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace deepinfer::recipe::bpe {
namespace {

// Per-thread match state. One match-data block of one pair serves every pattern: only the whole match is
// read. The JIT stack grows past PCRE2's 32 KiB default for long runs of whitespace or letters.
struct ThreadMatchState {
  ThreadMatchState()
      : match_data(pcre2_match_data_create(1, nullptr)),
        match_context(pcre2_match_context_create(nullptr)),
        jit_stack(pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr)) {
    if (match_context != nullptr && jit_stack != nullptr) {
      pcre2_jit_stack_assign(match_context, nullptr, jit_stack);
    }
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(match_context);
    pcre2_match_data_free(match_data);
  }
  ThreadMatchState(const ThreadMatchState&) = delete;
  ThreadMatchState& operator=(const ThreadMatchState&) = delete;

  pcre2_match_data* match_data;
  pcre2_match_context* match_context;
  pcre2_jit_stack* jit_stack;
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

// Code points that Unicode 15.0 to 16.0 assigned to a general category and that PCRE2 10.42 (Unicode 14)
// still treats as unassigned. The reference (tokenizers 0.23.2 on Oniguruma 6.9.10) knows Unicode 16.0, so
// without these a new emoji such as U+1FAE8 would fall out of \p{S} and split differently. Derived by
// running every code point through the reference's Split pre-tokenizer with \p{Xx} patterns and
// subtracting PCRE2's classes; with a newer PCRE2 the ranges are redundant, never wrong. (One character
// moved the other way, U+1171E Mn -> Mc, and is not corrected.)
struct CategoryRange {
  std::string_view category;
  uint32_t first;
  uint32_t last;
};
constexpr CategoryRange kUnicode16Additions[] = {
    {"Mn", 0x897, 0x897},     {"Mc", 0xCF3, 0xCF3},     {"Mn", 0xECE, 0xECE},     {"Po", 0x1B4E, 0x1B4F},
    {"Po", 0x1B7F, 0x1B7F},   {"Lu", 0x1C89, 0x1C89},   {"Ll", 0x1C8A, 0x1C8A},   {"So", 0x2427, 0x2429},
    {"So", 0x2FFC, 0x2FFF},   {"So", 0x31E4, 0x31E5},   {"So", 0x31EF, 0x31EF},   {"Lu", 0xA7CB, 0xA7CC},
    {"Ll", 0xA7CD, 0xA7CD},   {"Lu", 0xA7DA, 0xA7DA},   {"Ll", 0xA7DB, 0xA7DB},   {"Lu", 0xA7DC, 0xA7DC},
    {"Lo", 0x105C0, 0x105F3}, {"Nd", 0x10D40, 0x10D49}, {"Lo", 0x10D4A, 0x10D4D}, {"Lm", 0x10D4E, 0x10D4E},
    {"Lo", 0x10D4F, 0x10D4F}, {"Lu", 0x10D50, 0x10D65}, {"Mn", 0x10D69, 0x10D6D}, {"Pd", 0x10D6E, 0x10D6E},
    {"Lm", 0x10D6F, 0x10D6F}, {"Ll", 0x10D70, 0x10D85}, {"Sm", 0x10D8E, 0x10D8F}, {"Lo", 0x10EC2, 0x10EC4},
    {"Mn", 0x10EFC, 0x10EFF}, {"Lo", 0x1123F, 0x11240}, {"Mn", 0x11241, 0x11241}, {"Lo", 0x11380, 0x11389},
    {"Lo", 0x1138B, 0x1138B}, {"Lo", 0x1138E, 0x1138E}, {"Lo", 0x11390, 0x113B5}, {"Lo", 0x113B7, 0x113B7},
    {"Mc", 0x113B8, 0x113BA}, {"Mn", 0x113BB, 0x113C0}, {"Mc", 0x113C2, 0x113C2}, {"Mc", 0x113C5, 0x113C5},
    {"Mc", 0x113C7, 0x113CA}, {"Mc", 0x113CC, 0x113CD}, {"Mn", 0x113CE, 0x113CE}, {"Mc", 0x113CF, 0x113CF},
    {"Mn", 0x113D0, 0x113D0}, {"Lo", 0x113D1, 0x113D1}, {"Mn", 0x113D2, 0x113D2}, {"Lo", 0x113D3, 0x113D3},
    {"Po", 0x113D4, 0x113D5}, {"Po", 0x113D7, 0x113D8}, {"Mn", 0x113E1, 0x113E2}, {"Nd", 0x116D0, 0x116E3},
    {"Mc", 0x1171E, 0x1171E}, {"Po", 0x11B00, 0x11B09}, {"Lo", 0x11BC0, 0x11BE0}, {"Po", 0x11BE1, 0x11BE1},
    {"Nd", 0x11BF0, 0x11BF9}, {"Mn", 0x11F00, 0x11F01}, {"Lo", 0x11F02, 0x11F02}, {"Mc", 0x11F03, 0x11F03},
    {"Lo", 0x11F04, 0x11F10}, {"Lo", 0x11F12, 0x11F33}, {"Mc", 0x11F34, 0x11F35}, {"Mn", 0x11F36, 0x11F3A},
    {"Mc", 0x11F3E, 0x11F3F}, {"Mn", 0x11F40, 0x11F40}, {"Mc", 0x11F41, 0x11F41}, {"Mn", 0x11F42, 0x11F42},
    {"Po", 0x11F43, 0x11F4F}, {"Nd", 0x11F50, 0x11F59}, {"Mn", 0x11F5A, 0x11F5A}, {"Lo", 0x1342F, 0x1342F},
    {"Mn", 0x13440, 0x13440}, {"Lo", 0x13441, 0x13446}, {"Mn", 0x13447, 0x13455}, {"Lo", 0x13460, 0x143FA},
    {"Lo", 0x16100, 0x1611D}, {"Mn", 0x1611E, 0x16129}, {"Mc", 0x1612A, 0x1612C}, {"Mn", 0x1612D, 0x1612F},
    {"Nd", 0x16130, 0x16139}, {"Lm", 0x16D40, 0x16D42}, {"Lo", 0x16D43, 0x16D6A}, {"Lm", 0x16D6B, 0x16D6C},
    {"Po", 0x16D6D, 0x16D6F}, {"Nd", 0x16D70, 0x16D79}, {"Lo", 0x18CFF, 0x18CFF}, {"Lo", 0x1B132, 0x1B132},
    {"Lo", 0x1B155, 0x1B155}, {"So", 0x1CC00, 0x1CCEF}, {"Nd", 0x1CCF0, 0x1CCF9}, {"So", 0x1CD00, 0x1CEB3},
    {"No", 0x1D2C0, 0x1D2D3}, {"Ll", 0x1DF25, 0x1DF2A}, {"Lm", 0x1E030, 0x1E06D}, {"Mn", 0x1E08F, 0x1E08F},
    {"Lo", 0x1E4D0, 0x1E4EA}, {"Lm", 0x1E4EB, 0x1E4EB}, {"Mn", 0x1E4EC, 0x1E4EF}, {"Nd", 0x1E4F0, 0x1E4F9},
    {"Lo", 0x1E5D0, 0x1E5ED}, {"Mn", 0x1E5EE, 0x1E5EF}, {"Lo", 0x1E5F0, 0x1E5F0}, {"Nd", 0x1E5F1, 0x1E5FA},
    {"Po", 0x1E5FF, 0x1E5FF}, {"So", 0x1F6DC, 0x1F6DC}, {"So", 0x1F774, 0x1F776}, {"So", 0x1F77B, 0x1F77F},
    {"So", 0x1F7D9, 0x1F7D9}, {"So", 0x1F8B2, 0x1F8BB}, {"So", 0x1F8C0, 0x1F8C1}, {"So", 0x1FA75, 0x1FA77},
    {"So", 0x1FA87, 0x1FA89}, {"So", 0x1FA8F, 0x1FA8F}, {"So", 0x1FAAD, 0x1FAAF}, {"So", 0x1FABB, 0x1FABF},
    {"So", 0x1FAC6, 0x1FAC6}, {"So", 0x1FACE, 0x1FACF}, {"So", 0x1FADA, 0x1FADC}, {"So", 0x1FADF, 0x1FADF},
    {"So", 0x1FAE8, 0x1FAE9}, {"So", 0x1FAF7, 0x1FAF8}, {"So", 0x1FBCB, 0x1FBEF}, {"Lo", 0x2B739, 0x2B739},
    {"Lo", 0x2EBF0, 0x2EE5D}, {"Lo", 0x31350, 0x323AF},
};

// Oniguruma's \s: U+0009..U+000D, U+0085 and General_Category Z (doc/RE), i.e. Unicode White_Space.
constexpr std::string_view kSpaceSet = "\\t-\\r\\x{85}\\p{Z}";
// Oniguruma's \w, checked against the reference code point by code point: letters, marks, decimal digits,
// connector punctuation, letter numbers, the Latin-1 digits and fractions, and the circled and squared
// Latin letters (symbols that are Other_Alphabetic).
constexpr std::string_view kWordSet =
    "\\p{L}\\p{M}\\p{Nd}\\p{Pc}\\p{Nl}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}\\x{24B6}-\\x{24E9}\\x{1F130}-\\x{1F149}"
    "\\x{1F150}-\\x{1F169}\\x{1F170}-\\x{1F189}";

// Class members for `\p{category}` ("L" or "Lo"): PCRE2's property plus the newer code points.
std::string category_members(std::string_view category, bool newer_code_points) {
  std::string members = "\\p{";
  members += category;
  members += '}';
  char range[32];
  for (const CategoryRange& entry : kUnicode16Additions) {
    if (!newer_code_points) break;
    if (entry.category.substr(0, category.size()) != category) continue;
    std::snprintf(range, sizeof(range), "\\x{%X}-\\x{%X}", entry.first, entry.last);
    members += range;
  }
  return members;
}

bool has_additions(std::string_view category) {
  return std::any_of(std::begin(kUnicode16Additions), std::end(kUnicode16Additions),
                     [&](const CategoryRange& entry) { return entry.category.substr(0, category.size()) == category; });
}

// Class members of a translated shorthand: \p items inside `set` get the newer code points too.
std::string expand_set(std::string_view set, bool newer_code_points) {
  std::string out;
  for (size_t i = 0; i < set.size(); ++i) {
    if (set.substr(i, 3) == "\\p{") {
      const size_t close = set.find('}', i);
      out += category_members(set.substr(i + 3, close - i - 3), newer_code_points);
      i = close;
    } else {
      out += set[i];
    }
  }
  return out;
}

}  // namespace

Status Regex::compile_one(std::string_view source, std::string_view translated, Compiled& out) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    std::string text = "bad regex /";
    text.append(source).append("/ (as PCRE2 /").append(translated).append("/): ");
    text.append(reinterpret_cast<const char*>(message)).append(" at offset ").append(std::to_string(error_offset));
    return Status::invalid_argument(std::move(text));
  }
  out.code = code;
  // Without JIT (a build or CPU that lacks it) the interpreter gives the same matches, only slower.
  out.jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return Status::ok_status();
}

Result<std::unique_ptr<Regex>> Regex::compile(std::string_view pattern) {
  std::unique_ptr<Regex> regex(new Regex());
  const std::string basic = translate_oniguruma_pattern(pattern, /*newer_code_points=*/false);
  if (Status s = compile_one(pattern, basic, regex->basic_); !s.ok()) return s;
  const std::string full = translate_oniguruma_pattern(pattern, /*newer_code_points=*/true);
  if (full != basic) {
    if (Status s = compile_one(pattern, full, regex->full_); !s.ok()) return s;
  }
  return regex;
}

Regex::~Regex() {
  pcre2_code_free(basic_.code);
  pcre2_code_free(full_.code);
}

bool Regex::find(std::string_view subject, size_t start, bool newer_code_points, size_t& match_begin,
                 size_t& match_end) const {
  const Compiled& compiled = newer_code_points && full_.code != nullptr ? full_ : basic_;
  return find_with(compiled, subject, start, match_begin, match_end);
}

bool Regex::find_with(const Compiled& compiled, std::string_view subject, size_t start, size_t& match_begin,
                      size_t& match_end) const {
  ThreadMatchState& state = thread_match_state();
  if (state.match_data == nullptr) return false;
  // PCRE2 10.42 rejects a null subject even when its length is 0.
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.empty() ? "" : subject.data());
  int rc = PCRE2_ERROR_NOMATCH;
  if (compiled.jit) {
    rc = pcre2_jit_match(compiled.code, data, subject.size(), start, 0, state.match_data, state.match_context);
  }
  // The interpreter retries what the JIT could not finish (say, its stack ran out on a huge input).
  if (!compiled.jit || (rc < 0 && rc != PCRE2_ERROR_NOMATCH)) {
    rc = pcre2_match(compiled.code, data, subject.size(), start, PCRE2_NO_JIT, state.match_data, nullptr);
  }
  if (rc < 0) return false;
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.match_data);
  match_begin = ovector[0];
  match_end = ovector[1];
  return true;
}

namespace {

// The code points of kUnicode16Additions: a bitmap for the Basic Multilingual Plane, sorted ranges above.
struct NewerCodePointSet {
  NewerCodePointSet() : bmp(65536 / 64, 0) {
    for (const CategoryRange& entry : kUnicode16Additions) {
      if (entry.first >= 0x10000) {
        astral.emplace_back(entry.first, entry.last);
        continue;
      }
      for (uint32_t c = entry.first; c <= entry.last; ++c) bmp[c / 64] |= uint64_t{1} << (c % 64);
    }
    std::sort(astral.begin(), astral.end());
  }
  bool contains(uint32_t c) const {
    if (c < 0x10000) return (bmp[c / 64] >> (c % 64)) & 1;
    auto it = std::upper_bound(astral.begin(), astral.end(), std::make_pair(c, UINT32_MAX));
    return it != astral.begin() && std::prev(it)->second >= c;
  }
  std::vector<uint64_t> bmp;
  std::vector<std::pair<uint32_t, uint32_t>> astral;
};

}  // namespace

bool has_newer_code_points(std::string_view text) {
  static const NewerCodePointSet kSet;
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = 0;
  while (i < text.size()) {
    if (i + 8 <= text.size()) {
      uint64_t word;
      std::memcpy(&word, bytes + i, 8);
      if ((word & 0x8080808080808080ull) == 0) {  // eight ASCII bytes
        i += 8;
        continue;
      }
    }
    // Everything below U+0800 (one- and two-byte sequences) predates Unicode 15.
    if (bytes[i] < 0xE0) {
      ++i;
      continue;
    }
    const size_t length = utf8_char_length(text, i);
    uint32_t c = 0;
    if (length == 3) {
      c = ((bytes[i] & 0x0Fu) << 12) | ((bytes[i + 1] & 0x3Fu) << 6) | (bytes[i + 2] & 0x3Fu);
    } else if (length == 4) {
      c = ((bytes[i] & 0x07u) << 18) | ((bytes[i + 1] & 0x3Fu) << 12) | ((bytes[i + 2] & 0x3Fu) << 6) |
          (bytes[i + 3] & 0x3Fu);
    }
    if (length > 1 && kSet.contains(c)) return true;
    i += length;
  }
  return false;
}

std::string translate_oniguruma_pattern(std::string_view pattern, bool newer_code_points) {
  const std::string space_set = expand_set(kSpaceSet, newer_code_points);
  const std::string word_set = expand_set(kWordSet, newer_code_points);
  const std::string digit_set = category_members("Nd", newer_code_points);
  std::string out;
  out.reserve(pattern.size() + 256);
  bool in_class = false;
  // Outside a class a set needs brackets; inside one it is spliced in.
  const auto add_set = [&](std::string_view members, bool negated) {
    if (in_class) {
      out += members;
    } else {
      out += negated ? "[^" : "[";
      out += members;
      out += ']';
    }
  };
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[++i];
      if (next == 'p' || next == 'P') {
        // \pL or \p{Name}; categories with newer code points become explicit sets. A negated one inside
        // a class cannot be widened that way and keeps PCRE2's meaning.
        std::string_view name = pattern.substr(i + 1, 1);
        size_t name_end = i + 1;
        if (name == "{") {
          const size_t close = pattern.find('}', i + 2);
          if (close == std::string_view::npos) {
            out += c;
            out += next;
            continue;
          }
          name = pattern.substr(i + 2, close - i - 2);
          name_end = close;
        }
        if (newer_code_points && name.size() <= 2 && has_additions(name) && !(next == 'P' && in_class)) {
          add_set(category_members(name, true), next == 'P');
        } else {
          out.append(pattern.substr(i - 1, name_end - i + 2));
        }
        i = name_end;
        continue;
      }
      switch (next) {
        case 's':
          add_set(space_set, false);
          break;
        case 'S':
          if (in_class) {
            out += "\\S";
          } else {
            add_set(space_set, true);
          }
          break;
        case 'd':
          add_set(digit_set, false);
          break;
        case 'D':
          if (in_class) {
            out += "\\D";
          } else {
            add_set(digit_set, true);
          }
          break;
        case 'w':
          add_set(word_set, false);
          break;
        case 'W':
          if (in_class) {
            out += "\\W";
          } else {
            add_set(word_set, true);
          }
          break;
        default:
          out += c;
          out += next;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == '[' && in_class && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      // A POSIX class such as [:alpha:] inside a bracket expression: copy it whole.
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

std::string escape_literal(std::string_view literal) {
  std::string out;
  out.reserve(literal.size() * 2);
  for (const char c : literal) {
    const auto byte = static_cast<unsigned char>(c);
    // A backslash before ASCII punctuation makes it literal in PCRE2; everything else is literal already.
    if (byte < 0x80 && std::ispunct(byte)) out += '\\';
    out += c;
  }
  return out;
}

size_t utf8_char_length(std::string_view s, size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  size_t length = 1;
  if (lead >= 0xF0) {
    length = 4;
  } else if (lead >= 0xE0) {
    length = 3;
  } else if (lead >= 0xC0) {
    length = 2;
  }
  if (i + length > s.size()) return 1;
  for (size_t k = 1; k < length; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  }
  return length;
}

}  // namespace deepinfer::recipe::bpe
