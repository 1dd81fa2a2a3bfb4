// The BPE model's hot path: the merge-rank table, the merge loop over one pre-token's symbols, and the
// per-thread cache of already merged pre-tokens. Private to src/recipe.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe::bpe {

inline constexpr uint32_t kNoRank = UINT32_MAX;

// (left id, right id) -> (rank, merged id), open addressing with linear probing: one cache line per probe
// instead of a node-based map's pointer chase. Immutable after loading.
class MergeTable {
 public:
  struct Entry {
    uint64_t key;
    uint32_t rank;
    TokenId merged;
  };

  void reserve(size_t merges);
  // A pair listed twice keeps the later rank, as `tokenizers` does (its map is filled in order).
  void insert(TokenId left, TokenId right, uint32_t rank, TokenId merged);
  size_t size() const { return size_; }

  // Starts loading the slot of (left, right) into cache, so that a later find() of it need not wait.
  void prefetch(TokenId left, TokenId right) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[hash(pack(left, right)) & mask_]);
  }

  const Entry* find(TokenId left, TokenId right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    for (size_t slot = hash(key) & mask_;; slot = (slot + 1) & mask_) {
      const Entry& entry = slots_[slot];
      if (entry.key == key) return &entry;
      if (entry.key == kEmptyKey) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmptyKey = UINT64_MAX;  // ids are >= 0, so no real pair packs to this
  static uint64_t pack(TokenId left, TokenId right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  static uint64_t hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 20; }
  void grow();

  std::vector<Entry> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// Reusable buffers of the merge loop, one set per thread.
struct MergeScratch {
  std::vector<uint32_t> ranks;
  std::vector<TokenId> merged;
  struct Node {
    TokenId id;  // -1 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  std::vector<Node> nodes;
  struct Candidate {
    uint32_t rank;
    uint32_t position;
  };
  std::vector<Candidate> heap;
};

// Applies merges to `symbols` in place until none applies: each step merges the adjacent pair of lowest
// rank, the leftmost one on a tie, as `tokenizers`' Word::merge_all does.
void merge_symbols(const MergeTable& table, std::vector<TokenId>& symbols, MergeScratch& scratch);

// A fast 64-bit hash of a short byte string (the pre-token cache key).
inline uint64_t hash_bytes(std::string_view bytes) {
  constexpr uint64_t kMultiplier = 0xBF58476D1CE4E5B9ull;
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (bytes.size() * kMultiplier);
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    h = (h ^ word) * kMultiplier;
    h ^= h >> 31;
  }
  if (i < bytes.size()) {
    uint64_t word = 0;
    std::memcpy(&word, bytes.data() + i, bytes.size() - i);
    h = (h ^ word) * kMultiplier;
    h ^= h >> 31;
  }
  return (h ^ (h >> 29)) * 0x94D049BB133111EBull;
}

// Pre-token bytes -> ids, for one thread and one tokenizer. Starts small (a thread that encodes one string
// pays little) and doubles up to `max_entries`; when full it starts over, which keeps memory flat under
// adversarial input and costs one re-merge per word afterwards.
class WordCache {
 public:
  static constexpr size_t kMaxWordBytes = 64;  // longer pre-tokens are rare; merging them is not cached

  explicit WordCache(size_t max_entries);
  // Ids cached for `word` (whose hash_bytes is `hash`), or false.
  bool lookup(std::string_view word, uint64_t hash, std::span<const TokenId>& ids) const;
  // REQUIRES: word.size() <= kMaxWordBytes, !word.empty().
  void insert(std::string_view word, uint64_t hash, std::span<const TokenId> ids);

 private:
  struct Slot {
    uint64_t hash;
    uint32_t key_offset;
    uint32_t value_offset;
    uint16_t key_length;  // 0 marks an empty slot (words are never empty)
    uint16_t value_length;
  };
  static constexpr size_t kInitialSlots = 256;
  void grow();
  void clear();

  size_t max_entries_;
  size_t entries_ = 0;
  size_t mask_;
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<TokenId> values_;
};

}  // namespace deepinfer::recipe::bpe
