// Streaming detokenizer and the lossy UTF-8 repair it shares with Tokenizer::decode. The repair follows
// Unicode's "substitution of maximal subparts" (Unicode 15, section 3.9, Table 3-7), as Rust's
// String::from_utf8_lossy does, so that streamed text equals the reference's decode.
#include "deepinfer/recipe/detokenizer.h"

#include <cstdint>

namespace deepinfer::recipe {
namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// The well-formed UTF-8 sequences starting with `lead`: total length (0: `lead` never starts one) and
// the allowed range of the second byte; later bytes are always 80..BF.
struct LeadByte {
  uint8_t length;
  uint8_t second_low;
  uint8_t second_high;
};

constexpr LeadByte classify(uint8_t lead) {
  if (lead < 0x80) return {1, 0, 0};
  if (lead >= 0xC2 && lead <= 0xDF) return {2, 0x80, 0xBF};
  if (lead == 0xE0) return {3, 0xA0, 0xBF};  // no overlong forms
  if (lead == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (lead >= 0xE1 && lead <= 0xEF) return {3, 0x80, 0xBF};
  if (lead == 0xF0) return {4, 0x90, 0xBF};  // no overlong forms
  if (lead == 0xF4) return {4, 0x80, 0x8F};  // nothing above U+10FFFF
  if (lead >= 0xF1 && lead <= 0xF3) return {4, 0x80, 0xBF};
  return {0, 0, 0};  // 80..C1, F5..FF
}

}  // namespace

size_t append_utf8_lossy(std::string_view bytes, std::string& out, bool keep_incomplete_tail) {
  size_t copied = 0;  // bytes[copied, i) are valid and not yet appended
  size_t i = 0;
  while (i < bytes.size()) {
    const auto lead = static_cast<uint8_t>(bytes[i]);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    const LeadByte kind = classify(lead);
    // Length of the longest prefix of a well-formed sequence found here (the maximal subpart).
    size_t prefix = 1;
    if (kind.length != 0) {
      while (prefix < kind.length && i + prefix < bytes.size()) {
        const auto next = static_cast<uint8_t>(bytes[i + prefix]);
        const uint8_t low = prefix == 1 ? kind.second_low : 0x80;
        const uint8_t high = prefix == 1 ? kind.second_high : 0xBF;
        if (next < low || next > high) break;
        ++prefix;
      }
      if (prefix == kind.length) {
        i += prefix;
        continue;
      }
      if (keep_incomplete_tail && i + prefix == bytes.size()) {
        // Truncated by the end of input only: the next bytes may complete it.
        out.append(bytes.substr(copied, i - copied));
        return bytes.size() - i;
      }
    }
    out.append(bytes.substr(copied, i - copied));
    out.append(kReplacementCharacter);
    i += prefix;
    copied = i;
  }
  out.append(bytes.substr(copied));
  return 0;
}

IncrementalDetokenizer::IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer)
    : tokenizer_(std::move(tokenizer)) {}

std::string IncrementalDetokenizer::push(TokenId id) {
  pending_ += tokenizer_->token_bytes(id);
  std::string text;
  const size_t held = append_utf8_lossy(pending_, text, /*keep_incomplete_tail=*/true);
  pending_.erase(0, pending_.size() - held);
  return text;
}

std::string IncrementalDetokenizer::flush() {
  std::string text;
  append_utf8_lossy(pending_, text, /*keep_incomplete_tail=*/false);
  pending_.clear();
  return text;
}

}  // namespace deepinfer::recipe
