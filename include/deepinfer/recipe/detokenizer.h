// Incremental detokenizer for streaming: turns a token stream into UTF-8 text deltas, never splitting a
// character. A multi-byte character spread over several tokens is held back until complete.
#pragma once

#include <memory>
#include <string>

#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

// Not thread-safe: one per stream. Holds a shared reference to the tokenizer.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer);

  // Appends `id`'s bytes and returns the longest prefix of pending bytes that is complete UTF-8.
  // Bytes that can never become valid UTF-8 are emitted as U+FFFD (one per maximal invalid subpart, as
  // the reference decoders do); an incomplete trailing sequence (at most 3 bytes) stays pending.
  std::string push(TokenId id);
  // End of stream: emits whatever is pending, an incomplete tail as U+FFFD.
  std::string flush();
  // Bytes held back now (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::string pending_;
};

// Appends `bytes` to `out`, replacing each maximal invalid UTF-8 subpart with U+FFFD (the WHATWG /
// Unicode "substitution of maximal subparts" rule, which Rust's String::from_utf8_lossy follows).
// When `keep_incomplete_tail` is set, a trailing truncated-but-valid prefix is not replaced; its length is
// returned so the caller can hold it back. Returns 0 otherwise.
size_t append_utf8_lossy(std::string_view bytes, std::string& out, bool keep_incomplete_tail);

}  // namespace deepinfer::recipe
