// Added-token matching (see bpe_added_tokens.h): a byte trie walked from each position that can start a
// token, which gives the leftmost-longest semantics of the reference's Aho-Corasick automaton.
#include "bpe_added_tokens.h"

#include <algorithm>

namespace deepinfer::recipe::bpe {
namespace {

// Unicode White_Space, what `\s` means to the Rust regex crate the reference strips with.
bool is_white_space(uint32_t code_point) {
  return (code_point >= 0x09 && code_point <= 0x0D) || code_point == 0x20 || code_point == 0x85 || code_point == 0xA0 ||
         code_point == 0x1680 || (code_point >= 0x2000 && code_point <= 0x200A) || code_point == 0x2028 ||
         code_point == 0x2029 || code_point == 0x202F || code_point == 0x205F || code_point == 0x3000;
}

// The code point of the valid UTF-8 sequence text[begin, begin + length), else UINT32_MAX.
uint32_t code_point_at(std::string_view text, size_t begin, size_t length) {
  const auto byte = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[begin + k])); };
  switch (length) {
    case 1:
      return byte(0) < 0x80 ? byte(0) : UINT32_MAX;
    case 2:
      return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3:
      return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    case 4:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) | (byte(3) & 0x3F);
    default:
      return UINT32_MAX;
  }
}

// Start of the character that ends at `end` (end > 0).
size_t previous_char_begin(std::string_view text, size_t end) {
  size_t begin = end - 1;
  while (begin > 0 && end - begin < 4 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  return utf8_char_length(text, begin) == end - begin ? begin : end - 1;
}

// Where the run of whitespace that ends at `end` begins.
size_t trailing_space_begin(std::string_view text, size_t end) {
  while (end > 0) {
    const size_t begin = previous_char_begin(text, end);
    if (!is_white_space(code_point_at(text, begin, end - begin))) break;
    end = begin;
  }
  return end;
}

// Where the run of whitespace that starts at `begin` ends.
size_t leading_space_end(std::string_view text, size_t begin) {
  while (begin < text.size()) {
    const size_t length = utf8_char_length(text, begin);
    if (!is_white_space(code_point_at(text, begin, length))) break;
    begin += length;
  }
  return begin;
}

}  // namespace

Status AddedTokenMatcher::build(const std::vector<const AddedToken*>& tokens) {
  nodes_.assign(1, Node{});
  infos_.clear();
  first_byte_.fill(false);
  bool any_single_word = false;
  for (const AddedToken* token : tokens) {
    if (token->content.empty()) continue;  // the reference ignores empty added tokens
    uint32_t node = 0;
    for (const char c : token->content) {
      const auto byte = static_cast<uint8_t>(c);
      auto& children = nodes_[node].children;
      auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, uint32_t{0}),
                                 [](const auto& a, const auto& b) { return a.first < b.first; });
      if (it != children.end() && it->first == byte) {
        node = it->second;
        continue;
      }
      const auto child = static_cast<uint32_t>(nodes_.size());
      children.insert(it, {byte, child});
      nodes_.emplace_back();
      node = child;
    }
    if (nodes_[node].token >= 0) continue;  // same content listed twice: the first one wins
    nodes_[node].token = static_cast<int32_t>(infos_.size());
    infos_.push_back(TokenInfo{token->id, token->single_word, token->lstrip, token->rstrip});
    first_byte_[static_cast<uint8_t>(token->content[0])] = true;
    any_single_word = any_single_word || token->single_word;
  }
  if (any_single_word) {
    auto regex = Regex::compile("\\w");
    if (!regex.ok()) return regex.status();
    word_char_ = std::move(regex).value();
  }
  return Status::ok_status();
}

size_t AddedTokenMatcher::longest_at(std::string_view text, size_t start, int32_t& token) const {
  size_t longest = 0;
  uint32_t node = 0;
  for (size_t i = start; i < text.size(); ++i) {
    const auto byte = static_cast<uint8_t>(text[i]);
    const auto& children = nodes_[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, uint32_t{0}),
                               [](const auto& a, const auto& b) { return a.first < b.first; });
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (nodes_[node].token >= 0) {
      longest = i + 1 - start;
      token = nodes_[node].token;
    }
  }
  return longest;
}

bool AddedTokenMatcher::is_word_boundary(std::string_view text, size_t begin, size_t end) const {
  const auto is_word_char = [&](size_t char_begin, size_t char_length) {
    size_t match_begin = 0;
    size_t match_end = 0;
    const std::string_view one_char = text.substr(char_begin, char_length);
    return word_char_->find(one_char, 0, /*newer_code_points=*/true, match_begin, match_end) && match_begin == 0;
  };
  if (begin > 0) {
    const size_t previous = previous_char_begin(text, begin);
    if (is_word_char(previous, begin - previous)) return false;
  }
  if (end < text.size() && is_word_char(end, utf8_char_length(text, end))) return false;
  return true;
}

void AddedTokenMatcher::find(std::string_view text, std::vector<AddedMatch>& matches) const {
  matches.clear();
  if (infos_.empty()) return;
  size_t covered = 0;  // end of the last accepted match, stripped whitespace included
  size_t i = 0;
  while (i < text.size()) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    int32_t token = -1;
    const size_t length = longest_at(text, i, token);
    if (length == 0) {
      ++i;
      continue;
    }
    size_t begin = i;
    size_t end = i + length;
    // The automaton resumes after the match whether or not the checks below keep it.
    i = end;
    const TokenInfo& info = infos_[static_cast<size_t>(token)];
    if (begin < covered) continue;  // inside whitespace an rstrip token already took
    if (info.single_word && !is_word_boundary(text, begin, end)) continue;
    if (info.lstrip) begin = std::max(trailing_space_begin(text, begin), covered);
    if (info.rstrip) end = leading_space_end(text, end);
    matches.push_back(AddedMatch{begin, end, info.id});
    covered = end;
  }
}

}  // namespace deepinfer::recipe::bpe
