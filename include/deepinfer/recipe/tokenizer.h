// Byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (the kind DeepSeek, GPT-2, Llama-3 and
// Qwen ship): Split / ByteLevel pre-tokenizers, a BPE model with ranked merges, added tokens.
// Reference: Hugging Face `tokenizers` (models/bpe, pre_tokenizers/{split,byte_level}, added_vocabulary.rs);
// ids must match `Tokenizer.encode(text, add_special_tokens=False).ids` exactly.
#pragma once

#include "deepinfer/core/types.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::recipe {

using ::deepinfer::TokenId;  // core/types.h

// Whether added-token text inside a string may become an added-token id.
enum class TextTrust {
  // Added tokens (special or not) are matched first, as `tokenizers` does by default. For text we wrote.
  kTrusted,
  // No added-token matching at all: `<｜User｜>` becomes ordinary byte-level tokens. For any text that
  // came from a user, a tool or a document, so it can never become a control id.
  kUntrusted,
};

// Immutable once loaded. Thread-safety: all const methods may be called concurrently.
class Tokenizer {
 public:
  // Loads `path`: a `tokenizer.json` file, or a directory that contains one. Errors name the file and
  // the field (unsupported model type, normalizer or pre-tokenizer; malformed vocab or merges; bad regex).
  static Result<std::shared_ptr<const Tokenizer>> load(const std::filesystem::path& path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Encodes UTF-8 `text` and appends the ids to `out`. Invalid UTF-8 bytes are encoded as their bytes
  // (byte-level BPE covers all 256). Never fails; O(len) with a per-word merge cache.
  void encode(std::string_view text, TextTrust trust, std::vector<TokenId>& out) const;
  std::vector<TokenId> encode(std::string_view text, TextTrust trust) const;

  // Concatenated bytes of the ids (added tokens as their content, byte-level pieces mapped back to bytes),
  // as `decode(ids, skip_special_tokens=False)`. Bytes that do not form valid UTF-8 are replaced with
  // U+FFFD, as the reference does. Unknown ids are skipped.
  std::string decode(std::span<const TokenId> ids) const;
  // Raw bytes of one token (no UTF-8 repair): what the incremental detokenizer accumulates.
  // Empty for an unknown id.
  std::string token_bytes(TokenId id) const;

  // The vocabulary string of `id` (byte-level alphabet for BPE pieces, content for added tokens).
  std::optional<std::string_view> id_to_piece(TokenId id) const;
  // The id of a vocabulary string or added token's content.
  std::optional<TokenId> piece_to_id(std::string_view piece) const;
  // The id of an added token whose content is exactly `content`, else nullopt.
  std::optional<TokenId> added_token_id(std::string_view content) const;
  bool is_added_token(TokenId id) const;
  bool is_special_token(TokenId id) const;  // added and flagged `special`

  // One past the largest id defined (the model's embedding may be larger: DeepSeek-V3 pads to 129,280).
  size_t vocab_size() const;

  // Unique per loaded tokenizer in this process and never reused, not even after this one is destroyed:
  // what caches of encode results (per-thread word caches, TokenizationCache) key on.
  uint64_t instance_id() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepinfer::recipe
