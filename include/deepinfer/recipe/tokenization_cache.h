// TokenizationCache: token ids of text the tokenizer already encoded, so that a conversation that grows by a
// turn re-tokenizes only its new text. What is cached is exactly the unit tokenize_prompt() encodes on its
// own: one maximal run of non-control text between two control ids, with its trust mode. The ids of such a
// run depend on nothing but (tokenizer, trust, text) — control ids split the prompt, and the tokenizer
// never merges across them — so a hit is identical to encoding the run again, whatever the renderer does
// to later or earlier turns (V3's never-closed tool block, thinking dropped from history, merged V4 user
// turns): a run whose text changed is simply a miss.
//
// Keyed by XXH3-128 of the text (seeded with the tokenizer's instance id and the trust mode); every hit is
// confirmed by comparing the stored text byte for byte, so a hash collision can only cost a miss, never
// wrong ids. The stored text roughly doubles the memory per token (about 3.4 bytes of text + 4 bytes of
// ids per DeepSeek token) and is what makes the result exact by construction rather than by probability.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

// Internally synchronized: one cache may be shared by every thread and coroutine of a process (the server
// keeps one for all its HTTP threads). The lock is held only for the hash-map lookup, the LRU update and
// insertion; hashing, the text comparison, copying ids out and encoding a miss all run outside it.
// Entries of several tokenizers may share one cache: the tokenizer's instance id is part of the key.
class TokenizationCache {
 private:
  struct Key {
    uint64_t low = 0;
    uint64_t high = 0;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHasher {
    size_t operator()(const Key& key) const noexcept {
      return static_cast<size_t>(key.low ^ (key.high * 0x9E3779B97F4A7C15ull));
    }
  };
  struct Entry;  // immutable once inserted; shared with readers copying its ids out of the lock

 public:
  // Runs shorter than this are encoded directly by default: for them a lookup costs about what encoding
  // does, and each entry carries ~150 bytes of bookkeeping.
  static constexpr size_t kDefaultMinCachedBytes = 64;

  // `capacity_bytes`: the most bytes the entries may account for (text + ids + bookkeeping each); the least
  // recently used entries are evicted past it. 0 keeps nothing (every cached encode() is a miss).
  // Texts shorter than `min_cached_bytes` bypass the cache (encoded directly, not counted in stats()).
  explicit TokenizationCache(size_t capacity_bytes, size_t min_cached_bytes = kDefaultMinCachedBytes);
  ~TokenizationCache();
  TokenizationCache(const TokenizationCache&) = delete;
  TokenizationCache& operator=(const TokenizationCache&) = delete;

  // Misses held back from the cache until the caller decides the text is worth keeping (the server commits a
  // prompt's runs only once the prompt fits the model, so a rejected prompt never evicts others' entries).
  // Owned by one caller; not thread-safe itself. Dropping it without commit() inserts nothing.
  class PendingInserts {
   public:
    size_t size() const { return entries_.size(); }

   private:
    friend class TokenizationCache;
    std::vector<std::pair<Key, std::shared_ptr<const Entry>>> entries_;
  };

  // Appends to `out` exactly the ids `tokenizer.encode(text, trust, out)` appends: from the cache when it
  // holds this tokenizer's entry for this trust mode and exactly this text (the entry becomes most recently
  // used), else by encoding, then inserting the result (evicting as needed; a run larger than the whole
  // capacity is not inserted) — or, with `pending`, recording it there instead (hits and counters the same).
  // Thread-safe. `text` is not retained.
  void encode(const Tokenizer& tokenizer, std::string_view text, TextTrust trust, std::vector<TokenId>& out,
              PendingInserts* pending = nullptr);
  // Inserts what `pending` holds (as encode() would have) and empties it. Thread-safe.
  void commit(PendingInserts& pending);

  // Cumulative counters since construction (or clear()). Texts below min_cached_bytes are not counted.
  struct Stats {
    uint64_t hits = 0;
    uint64_t misses = 0;
    uint64_t hit_tokens = 0;   // ids appended from the cache
    uint64_t miss_tokens = 0;  // ids encoded on a miss
    uint64_t evictions = 0;
    size_t entries = 0;
    size_t bytes = 0;  // accounted bytes of the live entries, <= capacity_bytes()
  };
  Stats stats() const;  // thread-safe; a consistent snapshot of entries/bytes, counters may be mid-update
  size_t capacity_bytes() const { return capacity_bytes_; }
  // Drops every entry and resets the counters. Thread-safe; encode() calls in flight finish correctly.
  void clear();

 private:
  struct Slot {
    std::shared_ptr<const Entry> entry;
    std::list<Key>::iterator lru;  // position in lru_
  };

  std::shared_ptr<const Entry> find(const Key& key);
  void insert(const Key& key, std::shared_ptr<const Entry> entry);
  void evict_to(size_t limit_bytes);  // REQUIRES: mu_ held

  const size_t capacity_bytes_;
  const size_t min_cached_bytes_;
  mutable std::mutex mu_;
  std::unordered_map<Key, Slot, KeyHasher> slots_;  // GUARDED_BY(mu_)
  std::list<Key> lru_;                              // GUARDED_BY(mu_); most recently used first
  size_t bytes_ = 0;                                // GUARDED_BY(mu_)
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
  std::atomic<uint64_t> hit_tokens_{0};
  std::atomic<uint64_t> miss_tokens_{0};
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace deepinfer::recipe
