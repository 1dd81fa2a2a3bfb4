// Byte-level BPE tokenizer from a Hugging Face tokenizer.json: the encode pipeline (added tokens -> Split
// pre-tokenizers -> ByteLevel -> BPE, with a per-thread word cache), decode and lookups. Loading lives in
// bpe_loader.cpp. Reference: `tokenizers` tokenizer/mod.rs, normalizer.rs (split), pre_tokenizers/.
#include "deepinfer/recipe/tokenizer.h"

#include <array>
#include <atomic>
#include <boost/json.hpp>
#include <fstream>
#include <sstream>

#include "bpe_tokenizer_impl.h"
#include "deepinfer/recipe/detokenizer.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;
using Impl = Tokenizer::Impl;
using bpe::kAdded;
using bpe::kByteAlphabet;
using bpe::kKnown;
using bpe::kSpecial;
using bpe::SplitBehavior;
using bpe::SplitStep;

// The byte-level spelling of raw bytes (for ignore_merges' whole-word lookup).
std::string byte_level_spelling(std::string_view bytes) {
  std::string spelling;
  for (const char c : bytes) bpe::append_utf8(kByteAlphabet.char_of_byte[static_cast<uint8_t>(c)], spelling);
  return spelling;
}

// A stretch of a piece: a regex match (after `invert`) or the text between two matches.
struct Segment {
  size_t begin;
  size_t end;
  bool is_match;
};

// Regroups a piece's segments for the Split behaviors other than Isolated (normalizer.rs split()). In
// place: the write position never passes the read position (forward) or falls below it (backward).
void regroup(SplitBehavior behavior, std::vector<Segment>& segments) {
  bool previous_match = false;
  if (behavior == SplitBehavior::kMergedWithNext) {
    // A match joins the segment after it; scanned from the back, as the reference does.
    size_t write = segments.size();
    for (size_t read = segments.size(); read-- > 0;) {
      const Segment segment = segments[read];
      if (segment.is_match && !previous_match && write < segments.size()) {
        segments[write].begin = segment.begin;
      } else {
        segments[--write] = segment;
      }
      previous_match = segment.is_match;
    }
    segments.erase(segments.begin(), segments.begin() + static_cast<ptrdiff_t>(write));
    return;
  }
  size_t write = 0;
  for (const Segment segment : segments) {
    bool merge = false;
    bool keep = true;
    if (behavior == SplitBehavior::kRemoved) keep = !segment.is_match;
    if (behavior == SplitBehavior::kMergedWithPrevious) merge = segment.is_match && !previous_match && write > 0;
    if (behavior == SplitBehavior::kContiguous) merge = segment.is_match == previous_match && write > 0;
    if (merge) {
      segments[write - 1].end = segment.end;
    } else if (keep) {
      segments[write++] = segment;
    }
    previous_match = segment.is_match;
  }
  segments.resize(write);
}

std::atomic<uint64_t> next_instance_id{1};

// Scratch state of one thread encoding with one tokenizer.
struct ThreadState {
  explicit ThreadState(const Impl& impl)
      : owner(impl.instance_id), cache(kCacheEntries), segments(impl.splits.size()) {}

  static constexpr size_t kCacheEntries = 16384;
  uint64_t owner;
  bpe::WordCache cache;
  bpe::MergeScratch merge;
  std::vector<TokenId> symbols;
  std::vector<bpe::AddedMatch> raw_matches;
  std::vector<bpe::AddedMatch> normalized_matches;
  std::vector<std::vector<Segment>> segments;  // per Split level, for the behaviors other than Isolated
  std::string prefixed;                        // a piece with ByteLevel's prefix space
};

// Each thread keeps the state of the few tokenizers it used last. A tokenizer's state lives on in a
// thread until evicted or the thread ends; ids are never reused, so a stale state is never picked up.
ThreadState& thread_state(const Impl& impl) {
  constexpr size_t kTokenizersPerThread = 4;
  thread_local std::array<std::unique_ptr<ThreadState>, kTokenizersPerThread> states;
  thread_local size_t next_victim = 0;
  for (auto& state : states) {
    if (state != nullptr && state->owner == impl.instance_id) return *state;
  }
  auto& slot = states[next_victim];
  next_victim = (next_victim + 1) % kTokenizersPerThread;
  slot = std::make_unique<ThreadState>(impl);
  return *slot;
}

// One encode call: text in, ids appended to `out`.
class Encoder {
 public:
  Encoder(const Impl& impl, ThreadState& state, std::vector<TokenId>& out) : impl_(impl), state_(state), out_(out) {}

  void encode(std::string_view text, TextTrust trust) {
    newer_code_points_ = bpe::has_newer_code_points(text);
    if (trust == TextTrust::kUntrusted) {
      pre_tokenize(0, text);
      return;
    }
    // Added tokens on the raw text first; the gaps between them go on to the normalized pass.
    impl_.raw_matcher.find(text, state_.raw_matches);
    for_each_gap(text, state_.raw_matches, [&](std::string_view gap) {
      impl_.normalized_matcher.find(gap, state_.normalized_matches);
      for_each_gap(gap, state_.normalized_matches, [&](std::string_view piece) { pre_tokenize(0, piece); });
    });
  }

 private:
  // Calls on_gap for the text between matches, and emits the matched ids, in order.
  template <class OnGap>
  void for_each_gap(std::string_view text, const std::vector<bpe::AddedMatch>& matches, OnGap&& on_gap) {
    if (matches.empty()) {
      on_gap(text);
      return;
    }
    size_t previous = 0;
    for (const bpe::AddedMatch& match : matches) {
      if (match.begin > previous) on_gap(text.substr(previous, match.begin - previous));
      out_.push_back(match.id);
      previous = match.end;
    }
    if (previous < text.size()) on_gap(text.substr(previous));
  }

  // Applies Split step `level` and the ones after it to `piece`; the resulting pieces go to ByteLevel.
  void pre_tokenize(size_t level, std::string_view piece) {
    if (piece.empty()) return;
    if (level == impl_.splits.size()) {
      byte_level(piece);
      return;
    }
    const SplitStep& step = impl_.splits[level];
    if (step.behavior == SplitBehavior::kIsolated) {
      // Matches and the text between them are all pieces; stream them without collecting.
      size_t previous = 0;
      step.regex->for_each_match(piece, newer_code_points_, [&](size_t begin, size_t end) {
        if (begin > previous) pre_tokenize(level + 1, piece.substr(previous, begin - previous));
        pre_tokenize(level + 1, piece.substr(begin, end - begin));
        previous = end;
      });
      if (previous < piece.size()) pre_tokenize(level + 1, piece.substr(previous));
      return;
    }
    // The other behaviors regroup the (segment, is_match) list first, as normalizer.rs split() does.
    std::vector<Segment>& segments = state_.segments[level];
    segments.clear();
    size_t previous = 0;
    step.regex->for_each_match(piece, newer_code_points_, [&](size_t begin, size_t end) {
      if (begin > previous) segments.push_back(Segment{previous, begin, step.invert});
      segments.push_back(Segment{begin, end, !step.invert});
      previous = end;
    });
    if (previous < piece.size()) segments.push_back(Segment{previous, piece.size(), step.invert});
    regroup(step.behavior, segments);
    for (const Segment& segment : segments) {
      pre_tokenize(level + 1, piece.substr(segment.begin, segment.end - segment.begin));
    }
  }

  void byte_level(std::string_view piece) {
    if (impl_.add_prefix_space && piece.front() != ' ') {
      state_.prefixed.assign(1, ' ');
      state_.prefixed.append(piece);
      piece = state_.prefixed;
    }
    if (impl_.byte_level_regex == nullptr) {
      bpe_word(piece);
      return;
    }
    size_t previous = 0;
    impl_.byte_level_regex->for_each_match(piece, newer_code_points_, [&](size_t begin, size_t end) {
      if (begin > previous) bpe_word(piece.substr(previous, begin - previous));
      if (end > begin) bpe_word(piece.substr(begin, end - begin));
      previous = end;
    });
    if (previous < piece.size()) bpe_word(piece.substr(previous));
  }

  // BPE on one pre-token, given as raw bytes (its byte-level spelling is implied).
  void bpe_word(std::string_view word) {
    const TokenId single = word.size() == 1 ? impl_.byte_symbol[static_cast<uint8_t>(word[0])] : -1;
    if (single >= 0) {
      out_.push_back(single);
      return;
    }
    const bool cacheable = word.size() <= bpe::WordCache::kMaxWordBytes;
    const uint64_t hash = cacheable ? bpe::hash_bytes(word) : 0;
    std::span<const TokenId> cached;
    if (cacheable && state_.cache.lookup(word, hash, cached)) {
      out_.insert(out_.end(), cached.begin(), cached.end());
      return;
    }
    std::vector<TokenId>& symbols = state_.symbols;
    symbols.clear();
    if (!(impl_.ignore_merges && whole_word(word, symbols))) {
      initial_symbols(word, symbols);
      bpe::merge_symbols(impl_.merges, symbols, state_.merge);
    }
    out_.insert(out_.end(), symbols.begin(), symbols.end());
    if (cacheable) state_.cache.insert(word, hash, symbols);
  }

  // ignore_merges: a pre-token that is itself in the vocabulary is one token.
  bool whole_word(std::string_view word, std::vector<TokenId>& symbols) const {
    auto it = impl_.vocab.find(byte_level_spelling(word));
    if (it == impl_.vocab.end()) return false;
    symbols.push_back(it->second);
    return true;
  }

  // One symbol per byte; a byte missing from the vocabulary takes its "<0xXX>" fallback or the unknown
  // token (consecutive ones fused when fuse_unk), or is dropped, as models/bpe/model.rs merge_word does.
  void initial_symbols(std::string_view word, std::vector<TokenId>& symbols) const {
    bool previous_unknown = false;
    for (const char c : word) {
      const auto byte = static_cast<uint8_t>(c);
      if (impl_.byte_symbol[byte] >= 0) {
        symbols.push_back(impl_.byte_symbol[byte]);
        previous_unknown = false;
      } else if (!impl_.byte_fallback_ids[byte].empty()) {
        symbols.insert(symbols.end(), impl_.byte_fallback_ids[byte].begin(), impl_.byte_fallback_ids[byte].end());
        previous_unknown = false;
      } else if (impl_.unk_id) {
        if (!(impl_.fuse_unk && previous_unknown)) symbols.push_back(*impl_.unk_id);
        previous_unknown = true;
      }
    }
  }

  const Impl& impl_;
  ThreadState& state_;
  std::vector<TokenId>& out_;
  bool newer_code_points_ = false;  // which compiled form of the regexes applies (see bpe::Regex)
};

Result<std::string> read_file(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return Status::not_found(path.string() + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) return Status::io_error(path.string() + ": cannot open");
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return Status::io_error(path.string() + ": cannot read");
  return std::move(contents).str();
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

Result<std::shared_ptr<const Tokenizer>> Tokenizer::load(const std::filesystem::path& path) {
  try {
    std::error_code error;
    const std::filesystem::path file = std::filesystem::is_directory(path, error) ? path / "tokenizer.json" : path;
    auto text = read_file(file);
    if (!text.ok()) return text.status();
    json::error_code parse_error;
    const json::value root = json::parse(*text, parse_error);
    if (parse_error) return Status::corruption(file.string() + ": not valid JSON: " + parse_error.message());
    if (!root.is_object()) return Status::corruption(file.string() + ": the top level is not a JSON object");
    auto impl = std::make_unique<Impl>();
    impl->path = file.string();
    impl->instance_id = next_instance_id.fetch_add(1);
    if (Status s = bpe::load_tokenizer_json(impl->path, root.get_object(), *impl); !s.ok()) return s;
    return std::shared_ptr<const Tokenizer>(new Tokenizer(std::move(impl)));
  } catch (const std::exception& e) {
    // Out of memory, or a filesystem error the checks above did not foresee.
    return Status::internal(path.string() + ": loading the tokenizer failed: " + e.what());
  }
}

void Tokenizer::encode(std::string_view text, TextTrust trust, std::vector<TokenId>& out) const {
  Encoder(*impl_, thread_state(*impl_), out).encode(text, trust);
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, TextTrust trust) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  encode(text, trust, out);
  return out;
}

std::string Tokenizer::decode(std::span<const TokenId> ids) const {
  std::string bytes;
  for (const TokenId id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= impl_->piece_of_id.size()) continue;
    bytes.append(impl_->bytes_arena, impl_->bytes_offset[id], impl_->bytes_offset[id + 1] - impl_->bytes_offset[id]);
  }
  std::string text;
  text.reserve(bytes.size());
  append_utf8_lossy(bytes, text, /*keep_incomplete_tail=*/false);
  return text;
}

std::string Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->piece_of_id.size()) return {};
  return impl_->bytes_arena.substr(impl_->bytes_offset[id], impl_->bytes_offset[id + 1] - impl_->bytes_offset[id]);
}

std::optional<std::string_view> Tokenizer::id_to_piece(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->piece_of_id.size() || !(impl_->id_flags[id] & kKnown)) {
    return std::nullopt;
  }
  return impl_->piece_of_id[id];
}

std::optional<TokenId> Tokenizer::piece_to_id(std::string_view piece) const {
  if (auto added = added_token_id(piece)) return added;
  auto it = impl_->vocab.find(std::string(piece));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::optional<TokenId> Tokenizer::added_token_id(std::string_view content) const {
  auto it = impl_->added_by_content.find(std::string(content));
  if (it == impl_->added_by_content.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_added_token(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() && (impl_->id_flags[id] & kAdded);
}

bool Tokenizer::is_special_token(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() && (impl_->id_flags[id] & kSpecial);
}

size_t Tokenizer::vocab_size() const { return impl_->piece_of_id.size(); }

uint64_t Tokenizer::instance_id() const { return impl_->instance_id; }

}  // namespace deepinfer::recipe
