// Tokenizer::Impl, the loaded form of a tokenizer.json, shared by the loader (bpe_loader.cpp) and the
// encoder (tokenizer.cpp), with the byte-level alphabet both use. Private to src/recipe.
#pragma once

#include <array>
#include <boost/json/object.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bpe_added_tokens.h"
#include "bpe_merge.h"
#include "bpe_regex.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {
namespace bpe {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// U+0100..U+0143 in byte order, so that every byte is a visible character in the vocabulary.
struct ByteAlphabet {
  std::array<uint16_t, 256> char_of_byte{};
  std::array<int16_t, 0x144> byte_of_char{};  // -1: the character is not in the alphabet
};

constexpr ByteAlphabet make_byte_alphabet() {
  ByteAlphabet alphabet;
  for (auto& byte : alphabet.byte_of_char) byte = -1;
  uint16_t next_extra = 0x100;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    const uint16_t c = printable ? static_cast<uint16_t>(byte) : next_extra++;
    alphabet.char_of_byte[byte] = c;
    alphabet.byte_of_char[c] = static_cast<int16_t>(byte);
  }
  return alphabet;
}

inline constexpr ByteAlphabet kByteAlphabet = make_byte_alphabet();

inline void append_utf8(uint32_t code_point, std::string& out) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One Split pre-tokenizer.
struct SplitStep {
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// Bits of Tokenizer::Impl::id_flags.
enum IdFlag : uint8_t { kKnown = 1, kAdded = 2, kSpecial = 4 };

}  // namespace bpe

struct Tokenizer::Impl {
  std::string path;
  uint64_t instance_id = 0;  // keys per-thread caches; unique per process, never reused

  // Model.
  std::unordered_map<std::string, TokenId> vocab;
  bpe::MergeTable merges;
  std::array<TokenId, 256> byte_symbol{};                   // id of each byte's alphabet character, or -1
  std::array<std::vector<TokenId>, 256> byte_fallback_ids;  // "<0xXX>" ids, when byte_fallback is on
  std::optional<TokenId> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;

  // Pre-tokenizer: the Splits in order, then ByteLevel.
  std::vector<bpe::SplitStep> splits;
  bool add_prefix_space = false;
  std::unique_ptr<bpe::Regex> byte_level_regex;  // null when use_regex is false

  // Added tokens.
  std::vector<bpe::AddedToken> added;
  std::unordered_map<std::string, TokenId> added_by_content;
  bpe::AddedTokenMatcher raw_matcher;         // tokens with normalized = false
  bpe::AddedTokenMatcher normalized_matcher;  // tokens with normalized = true

  // Per id, indexed by id: the vocabulary string, the decoded bytes, flags.
  std::vector<std::string_view> piece_of_id;  // views into `vocab` keys or `added` contents
  std::string bytes_arena;
  std::vector<uint32_t> bytes_offset;  // id -> [bytes_offset[id], bytes_offset[id + 1])
  std::vector<uint8_t> id_flags;
};

namespace bpe {

// Fills `impl` from the parsed file at `path`; errors name the file and the field.
Status load_tokenizer_json(const std::string& path, const boost::json::object& root, Tokenizer::Impl& impl);

}  // namespace bpe
}  // namespace deepinfer::recipe
