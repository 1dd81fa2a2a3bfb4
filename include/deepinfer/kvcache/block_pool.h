// The paged KV cache's bookkeeping: a pool of fixed-size block ids with reference counts (BlockPool), and
// the float32 storage those ids index for MLA's latent cache (LatentKvStorage). The pool never touches the
// storage; the model's executor reads and writes it through block tables the scheduler hands out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::kvcache {

// Tokens per KV block: FlashMLA's page size (FlashMLA README, "paged kvcache with block size 64").
inline constexpr int32_t kBlockTokens = 64;

// Index of a block in [0, num_total()). Valid in every layer's storage alike.
using BlockId = int32_t;

// Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / kBlockTokens). REQUIRES: num_tokens >= 0.
constexpr int64_t blocks_for_tokens(int64_t num_tokens) { return (num_tokens + kBlockTokens - 1) / kBlockTokens; }

// Block ids with reference counts. A block is free (count 0, on the free list) or in use (count >= 1).
// Several owners may share one block (the radix prefix cache shares a prompt's full blocks between
// requests): each owner retains it once and releases it once; the block is free again after the last release.
//
// The free list is ordered: allocate() takes the least recently freed block and release() appends at the
// tail, so a block freed long ago is reused first. This is the eviction order a prefix cache wants for blocks
// whose content it still indexes; reclaim() lets such a cache take a specific free block back in O(1).
// Everything is deterministic: the same calls give the same ids.
//
// Thread-safety: not thread-safe; the engine thread owns the pool.
class BlockPool {
 public:
  // All `num_blocks` blocks start free, in id order. REQUIRES: num_blocks >= 0.
  explicit BlockPool(int32_t num_blocks);

  // Takes the least recently freed block and sets its count to 1. std::nullopt when no block is free: an
  // expected condition (the scheduler preempts or waits), not an error. O(1).
  std::optional<BlockId> allocate();

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

  int32_t num_free() const { return num_free_; }
  int32_t num_total() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_used() const { return num_total() - num_free(); }

 private:
  static constexpr BlockId kNone = -1;
  Status check_range(BlockId id, const char* operation) const;
  void push_free_tail(BlockId id);
  void unlink_free(BlockId id);

  std::vector<int32_t> ref_counts_;  // [num_blocks]
  // The free list, doubly linked through the block ids: next_free_[id] / prev_free_[id] are meaningful only
  // while block `id` is free.
  std::vector<BlockId> next_free_;
  std::vector<BlockId> prev_free_;
  BlockId free_head_ = kNone;
  BlockId free_tail_ = kNone;
  int32_t num_free_ = 0;
};

// The MLA latent KV cache of one model replica: for every layer and block, kBlockTokens entries of
// `entry_dim` = kv_lora_rank + qk_rope_head_dim float32 values (512 + 64 = 576 for DeepSeek-V3): the
// compressed latent c_KV followed by the rope key k_R (DeepSeek-V2 paper §2.1.2-2.1.3). Layout, row-major:
//   [num_layers][num_blocks][kBlockTokens][entry_dim]
// so one layer's cache is a paged tensor [num_blocks, kBlockTokens, entry_dim] addressed through a block
// table, as FlashMLA's kcache is (there in bf16 and with a head dimension of 1).
// The storage is zero-filled at creation and owned by this object; pointers stay valid while it lives.
// Thread-safety: the object is not synchronised; distinct blocks may be written from distinct threads.
class LatentKvStorage {
 public:
  // Allocates num_layers * num_blocks * kBlockTokens * entry_dim floats.
  // Errors: InvalidArgument when a dimension is not positive or the size overflows size_t.
  static Result<LatentKvStorage> create(int32_t num_layers, int32_t num_blocks, int32_t entry_dim);

  int32_t num_layers() const { return num_layers_; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t entry_dim() const { return entry_dim_; }
  size_t size_bytes() const { return data_.size() * sizeof(float); }
  size_t bytes_per_token() const { return static_cast<size_t>(num_layers_) * entry_dim_ * sizeof(float); }

  // One layer: [num_blocks][kBlockTokens][entry_dim]. REQUIRES: 0 <= layer < num_layers().
  float* layer_data(int32_t layer);
  const float* layer_data(int32_t layer) const;

  // One block of one layer: [kBlockTokens][entry_dim]. REQUIRES: layer and block in range.
  float* block_data(int32_t layer, BlockId block);
  const float* block_data(int32_t layer, BlockId block) const;

  // One token's entry: [entry_dim], at `slot` in [0, kBlockTokens) of `block`. REQUIRES: all in range.
  float* entry(int32_t layer, BlockId block, int32_t slot);
  const float* entry(int32_t layer, BlockId block, int32_t slot) const;

  // The entry of the token at `position` of a sequence whose blocks are `block_table`: block
  // block_table[position / kBlockTokens], slot position % kBlockTokens.
  // REQUIRES: 0 <= position < block_table.size() * kBlockTokens, ids in range.
  float* entry_at(int32_t layer, std::span<const BlockId> block_table, int64_t position);
  const float* entry_at(int32_t layer, std::span<const BlockId> block_table, int64_t position) const;

 private:
  LatentKvStorage(int32_t num_layers, int32_t num_blocks, int32_t entry_dim, size_t num_floats);
  size_t offset(int32_t layer, BlockId block, int32_t slot) const;

  int32_t num_layers_ = 0;
  int32_t num_blocks_ = 0;
  int32_t entry_dim_ = 0;
  std::vector<float> data_;
};

}  // namespace deepinfer::kvcache
