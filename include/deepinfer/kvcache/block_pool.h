// The paged KV cache's bookkeeping: a pool of fixed-size block ids with reference counts (BlockPool). The pool
// never touches the storage those ids index (per-layer caches on the backend, DeepSeekModel::make_layer_caches);
// the model's forward pass reads and writes it through block tables the scheduler hands out.
#pragma once

#include "deepinfer/core/types.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::kvcache {

// Tokens per KV block: FlashMLA's page size (FlashMLA README, "paged kvcache with block size 64").
using ::deepinfer::kBlockTokens;  // core/types.h

// Index of a block in [0, num_total()). Valid in every layer's storage alike.
using BlockId = int32_t;

// Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / kBlockTokens). REQUIRES: num_tokens >= 0.
constexpr int64_t blocks_for_tokens(int64_t num_tokens) { return (num_tokens + kBlockTokens - 1) / kBlockTokens; }

// Block ids with reference counts. A block is free (count 0, on the free list) or in use (count >= 1).
// Several owners may share one block (the radix prefix cache shares a prompt's full blocks between
// requests): each owner retains it once and releases it once; the block is free again after the last release.
//
// A block may be marked cached (the prefix cache indexes its content, kvcache_manager.h). A free block sits on
// one of two ordered free lists: plain free blocks, which allocate() takes (least recently freed first), and
// free cached ones, which allocate() never takes: the prefix cache decides which of them to evict (unmark, after
// which the block is plainly free) or revives one with reclaim(). Both count in num_free().
// Everything is deterministic: the same calls give the same ids.
//
// Thread-safety: not thread-safe; the engine thread owns the pool.
class BlockPool {
 public:
  // All `num_blocks` blocks start free, in id order. REQUIRES: num_blocks >= 0.
  explicit BlockPool(int32_t num_blocks);

  // Takes the least recently freed block that is not cached and sets its count to 1. std::nullopt when there
  // is none: an expected condition (the cache evicts, the scheduler preempts or waits), not an error. O(1).
  std::optional<BlockId> allocate();

  // Marks a block's content as indexed by the prefix cache (or not). A free block moves to the tail of the
  // other free list. O(1). REQUIRES: 0 <= id < num_total().
  void set_cached(BlockId id, bool cached);
  bool is_cached(BlockId id) const { return cached_[static_cast<size_t>(id)] != 0; }

  // Adds an owner to an in-use block (count + 1). O(1).
  // Errors: InvalidArgument when `id` is out of range; Internal when the block is free (retaining a free
  // block means someone kept an id after releasing it). Nothing changes on error.
  Status retain(BlockId id);

  // Drops one owner (count - 1); at 0 the block goes to the tail of the free list. O(1).
  // Errors: InvalidArgument when `id` is out of range; Internal when the block is already free (a double
  // release). Nothing changes on error.
  Status release(BlockId id);

  // Takes the specific free block `id` off the free list with count 1 (a prefix cache reviving a freed
  // block whose content it still indexes). O(1).
  // Errors: InvalidArgument when out of range; Internal when the block is in use (retain() it instead).
  Status reclaim(BlockId id);

  // Reference count of `id`: 0 when free. REQUIRES: 0 <= id < num_total().
  int32_t ref_count(BlockId id) const;
  bool is_free(BlockId id) const { return ref_count(id) == 0; }

  int32_t num_free() const { return num_free_[0] + num_free_[1]; }
  // The free cached block released longest ago (the head of the cached free list), or nullopt. O(1).
  std::optional<BlockId> oldest_free_cached() const;
  // Free blocks allocate() can take at once (not cached).
  int32_t num_free_uncached() const { return num_free_[0]; }
  int32_t num_total() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_used() const { return num_total() - num_free(); }

 private:
  static constexpr BlockId kNone = -1;
  Status check_range(BlockId id, const char* operation) const;
  void push_free_tail(BlockId id);
  void unlink_free(BlockId id);

  std::vector<int32_t> ref_counts_;  // [num_blocks]
  std::vector<uint8_t> cached_;      // [num_blocks]; selects the free list a free block is on
  // The free lists (0: plain, 1: cached), doubly linked through the block ids: next_free_[id] / prev_free_[id]
  // are meaningful only while block `id` is free.
  std::vector<BlockId> next_free_;
  std::vector<BlockId> prev_free_;
  BlockId free_head_[2] = {kNone, kNone};
  BlockId free_tail_[2] = {kNone, kNone};
  int32_t num_free_[2] = {0, 0};
};

}  // namespace deepinfer::kvcache
