// Finding added tokens (`<｜User｜>`, `<think>`, ...) in raw text before pre-tokenization, as the
// reference's AddedVocabulary does: leftmost-longest matching, then single_word / lstrip / rstrip.
// Reference: `tokenizers` tokenizer/added_vocabulary.rs (find_matches). Private to src/recipe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bpe_regex.h"
#include "deepinfer/core/status.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe::bpe {

// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  std::string content;
  TokenId id = 0;
  bool special = false;
  bool single_word = false;  // match only where no word character touches either end
  bool lstrip = false;       // the match swallows whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool normalized = true;    // matched after the normalizer instead of on the raw text
};

// An added token found in text: bytes [begin, end) become `id`.
struct AddedMatch {
  size_t begin;
  size_t end;
  TokenId id;
};

// A byte trie over a set of added tokens. Immutable after build(); find() is thread-safe.
class AddedTokenMatcher {
 public:
  // `tokens` in priority order: of two tokens with the same content the first wins.
  Status build(const std::vector<const AddedToken*>& tokens);
  bool empty() const { return infos_.empty(); }

  // Replaces `matches` with the non-overlapping added tokens of `text`, left to right. At each position
  // the longest token wins; the leftmost position with any token wins over later ones.
  void find(std::string_view text, std::vector<AddedMatch>& matches) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, uint32_t>> children;  // sorted by byte
    int32_t token = -1;                                  // index into infos_ when a token ends here
  };
  struct TokenInfo {
    TokenId id;
    bool single_word;
    bool lstrip;
    bool rstrip;
  };

  // Length of the longest token starting at text[start] (0 if none); its index goes to `token`.
  size_t longest_at(std::string_view text, size_t start, int32_t& token) const;
  bool is_word_boundary(std::string_view text, size_t begin, size_t end) const;

  std::vector<Node> nodes_;
  std::vector<TokenInfo> infos_;
  std::array<bool, 256> first_byte_{};
  std::unique_ptr<Regex> word_char_;  // only when some token is single_word
};

}  // namespace deepinfer::recipe::bpe
