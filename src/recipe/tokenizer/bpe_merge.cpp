// Merge-rank table, merge loop and word cache of the byte-level BPE model (see bpe_merge.h).
// Reference for the merge order: `tokenizers` models/bpe/word.rs (Word::merge_all).
#include "bpe_merge.h"

#include <algorithm>
#include <bit>

namespace deepinfer::recipe::bpe {
namespace {

// Up to this many symbols the loop rescans an array for the lowest rank: for typical pre-tokens (a few
// to a few dozen bytes) that beats a heap. Longer ones (runs of CJK text or spaces) use the heap.
constexpr size_t kLinearScanMaxSymbols = 48;

void merge_by_scan(const MergeTable& table, std::vector<TokenId>& symbols, MergeScratch& scratch) {
  std::vector<uint32_t>& ranks = scratch.ranks;
  std::vector<TokenId>& merged = scratch.merged;
  const auto look_up = [&](size_t pair) {
    const MergeTable::Entry* entry = table.find(symbols[pair], symbols[pair + 1]);
    ranks[pair] = entry != nullptr ? entry->rank : kNoRank;
    merged[pair] = entry != nullptr ? entry->merged : -1;
  };
  ranks.resize(symbols.size() - 1);
  merged.resize(symbols.size() - 1);
  // The first lookups are independent: let their cache misses overlap.
  for (size_t pair = 0; pair + 1 < symbols.size(); ++pair) table.prefetch(symbols[pair], symbols[pair + 1]);
  for (size_t pair = 0; pair + 1 < symbols.size(); ++pair) look_up(pair);

  while (!ranks.empty()) {
    size_t best = 0;
    for (size_t pair = 1; pair < ranks.size(); ++pair) {
      if (ranks[pair] < ranks[best]) best = pair;
    }
    if (ranks[best] == kNoRank) break;
    // Pair `best` becomes one symbol; the pairs on either side of it change.
    symbols[best] = merged[best];
    symbols.erase(symbols.begin() + static_cast<ptrdiff_t>(best) + 1);
    ranks.erase(ranks.begin() + static_cast<ptrdiff_t>(best));
    merged.erase(merged.begin() + static_cast<ptrdiff_t>(best));
    if (best > 0) look_up(best - 1);
    if (best < ranks.size()) look_up(best);
  }
}

void merge_by_heap(const MergeTable& table, std::vector<TokenId>& symbols, MergeScratch& scratch) {
  using Node = MergeScratch::Node;
  using Candidate = MergeScratch::Candidate;
  std::vector<Node>& nodes = scratch.nodes;
  std::vector<Candidate>& heap = scratch.heap;
  const size_t count = symbols.size();
  nodes.resize(count);
  for (size_t i = 0; i < count; ++i) {
    nodes[i] = Node{symbols[i], static_cast<int32_t>(i) - 1, i + 1 < count ? static_cast<int32_t>(i) + 1 : -1};
  }
  // std heap functions build a max-heap; "greater" puts the lowest (rank, position) on top.
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
  };
  heap.clear();
  const auto push_pair = [&](int32_t left) {
    const int32_t right = nodes[left].next;
    if (right < 0) return;
    const MergeTable::Entry* entry = table.find(nodes[left].id, nodes[right].id);
    if (entry == nullptr) return;
    heap.push_back(Candidate{entry->rank, static_cast<uint32_t>(left)});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < count; ++i) push_pair(static_cast<int32_t>(i));

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    Node& left = nodes[top.position];
    if (left.id < 0 || left.next < 0) continue;
    Node& right = nodes[left.next];
    // A candidate is stale when either side has changed since it was pushed; the pair now there has its
    // own candidate. Ranks are unique per pair, so comparing ranks detects the change.
    const MergeTable::Entry* entry = table.find(left.id, right.id);
    if (entry == nullptr || entry->rank != top.rank) continue;
    left.id = entry->merged;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) nodes[left.next].prev = static_cast<int32_t>(top.position);
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(static_cast<int32_t>(top.position));
  }

  symbols.clear();
  for (int32_t i = 0; i >= 0; i = nodes[i].next) symbols.push_back(nodes[i].id);
}

}  // namespace

void MergeTable::reserve(size_t merges) {
  // Load factor at most 1/2 keeps probe sequences short.
  const size_t capacity = std::bit_ceil(std::max<size_t>(16, merges * 2));
  if (capacity <= slots_.size()) return;
  std::vector<Entry> old = std::move(slots_);
  slots_.assign(capacity, Entry{kEmptyKey, 0, 0});
  mask_ = capacity - 1;
  size_ = 0;
  for (const Entry& entry : old) {
    if (entry.key != kEmptyKey) {
      insert(static_cast<TokenId>(entry.key >> 32), static_cast<TokenId>(entry.key & 0xFFFFFFFFu), entry.rank,
             entry.merged);
    }
  }
}

void MergeTable::grow() { reserve(std::max<size_t>(16, slots_.size())); }

void MergeTable::insert(TokenId left, TokenId right, uint32_t rank, TokenId merged) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint64_t key = pack(left, right);
  for (size_t slot = hash(key) & mask_;; slot = (slot + 1) & mask_) {
    Entry& entry = slots_[slot];
    if (entry.key == key) {
      entry.rank = rank;
      entry.merged = merged;
      return;
    }
    if (entry.key == kEmptyKey) {
      entry = Entry{key, rank, merged};
      ++size_;
      return;
    }
  }
}

void merge_symbols(const MergeTable& table, std::vector<TokenId>& symbols, MergeScratch& scratch) {
  if (symbols.size() < 2) return;
  if (symbols.size() <= kLinearScanMaxSymbols) {
    merge_by_scan(table, symbols, scratch);
  } else {
    merge_by_heap(table, symbols, scratch);
  }
}

WordCache::WordCache(size_t max_entries)
    : max_entries_(max_entries), mask_(kInitialSlots - 1), slots_(kInitialSlots, Slot{0, 0, 0, 0, 0}) {}

bool WordCache::lookup(std::string_view word, uint64_t hash, std::span<const TokenId>& ids) const {
  for (size_t slot = hash & mask_;; slot = (slot + 1) & mask_) {
    const Slot& entry = slots_[slot];
    if (entry.key_length == 0) return false;
    if (entry.hash == hash && entry.key_length == word.size() &&
        std::memcmp(keys_.data() + entry.key_offset, word.data(), word.size()) == 0) {
      ids = std::span<const TokenId>(values_.data() + entry.value_offset, entry.value_length);
      return true;
    }
  }
}

void WordCache::insert(std::string_view word, uint64_t hash, std::span<const TokenId> ids) {
  if (entries_ >= max_entries_) {
    clear();
  } else if ((entries_ + 1) * 2 > slots_.size()) {
    grow();
  }
  for (size_t slot = hash & mask_;; slot = (slot + 1) & mask_) {
    Slot& entry = slots_[slot];
    if (entry.key_length == 0) {
      entry = Slot{hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(values_.size()),
                   static_cast<uint16_t>(word.size()), static_cast<uint16_t>(ids.size())};
      keys_.append(word);
      values_.insert(values_.end(), ids.begin(), ids.end());
      ++entries_;
      return;
    }
    if (entry.hash == hash && entry.key_length == word.size() &&
        std::memcmp(keys_.data() + entry.key_offset, word.data(), word.size()) == 0) {
      return;
    }
  }
}

void WordCache::grow() {
  std::vector<Slot> old(slots_.size() * 2, Slot{0, 0, 0, 0, 0});
  old.swap(slots_);
  mask_ = slots_.size() - 1;
  for (const Slot& entry : old) {
    if (entry.key_length == 0) continue;
    size_t slot = entry.hash & mask_;
    while (slots_[slot].key_length != 0) slot = (slot + 1) & mask_;
    slots_[slot] = entry;
  }
}

void WordCache::clear() {
  std::fill(slots_.begin(), slots_.end(), Slot{0, 0, 0, 0, 0});
  keys_.clear();
  values_.clear();
  entries_ = 0;
}

}  // namespace deepinfer::recipe::bpe
