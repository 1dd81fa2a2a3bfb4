// What a model caches per token, by kind (DESIGN.md, "KV cache"): V2/V3 cache the MLA latent of every layer;
// V3.2 adds the DSA indexer keys; V4 adds sliding-window entries (only the last window of tokens is kept) and
// compressed entries. The model declares its layout (DeepSeekModel::cached_kinds()); the prefix cache sizes its
// pools from it, records per cached block which kinds it holds, and decides what a prefix hit is worth.
// Pools: the kinds that keep every token share one block pool (block i of a sequence sits at the same block id
// in each such kind's storage: they are always allocated together); each sliding-window kind has a pool of its
// own, of which a sequence holds only the blocks of its last window (KvCacheManager, Scheduler).
// Reuse:
//   - every kind that keeps all tokens (window_tokens == 0) must be present in every block of the prefix;
//   - a sliding-window kind need only be present in the blocks of the prefix's last window (the window the
//     first recomputed token reads); where it is missing, the hit shrinks to the longest prefix whose last
//     window holds it, and the tokens after it are computed with every kind (usable_blocks(); exact, as vLLM's
//     SlidingWindowManager and SGLang's SWA radix cache do, research/deepseek-v4-spec.md section 7). SGLang's
//     V4.1 "bounded replay" (recompute the last 128 tokens with a truncated window, an approximation) is the
//     V4 issue's option on top of this.
// A value; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/core/types.h"
#include "deepinfer/kvcache/prefix_index.h"

namespace deepinfer::kvcache {

struct CacheKindSpec {
  CacheKind kind = CacheKind::kLatent;
  std::string name;              // "latent", "indexer_key", "sliding_window", "compressed": logs and errors
  int32_t num_layers = 0;        // layers that cache this kind
  int64_t token_bytes = 0;       // bytes per token per layer, in the cache dtype
  int32_t window_tokens = 0;     // 0: every token is kept; > 0: only the last window_tokens tokens
  int64_t block_bytes() const { return token_bytes * num_layers * kBlockTokens; }
};

struct CacheLayout {
  std::vector<CacheKindSpec> kinds;

  // The kind named "latent", "indexer_key", "sliding_window" or "compressed". Errors: InvalidArgument.
  static Result<CacheKind> kind_from_name(const std::string& name);
  // V2/V3: the latent (kv_lora_rank + qk_rope_head_dim values) of `num_layers` layers.
  static CacheLayout latent_only(int32_t num_layers, int64_t token_bytes);
  // Bytes of one block, all kinds.
  int64_t block_bytes() const;
  // Bytes of one block of the kinds that keep every token: a block of the main pool, and of a host or disk copy
  // (window kinds live on the device only).
  int64_t full_block_bytes() const;
  // The sliding-window kinds, in declaration order: the order of the window pools ("slots").
  std::vector<CacheKindSpec> window_specs() const;
  // The kinds that keep every token: a prefix block must hold all of them to be reused.
  CacheKindSet full_kinds() const;
  // The sliding-window kinds.
  CacheKindSet window_kinds() const;
  // Blocks at the end of a prefix that must also hold the window kinds: ceil(largest window / 64); 0 without
  // window kinds.
  int64_t replay_blocks() const;
  // The blocks of a cached prefix of window_present.size() blocks that may be reused: the largest k whose
  // blocks [k - replay_blocks(), k) all hold every window kind (`window_present[i]` for block i); 0 when there
  // is none. Without window kinds, every block.
  int64_t usable_blocks(const std::vector<bool>& window_present) const;
  // InvalidArgument naming the kind: no kinds, a duplicate kind, no layers, no bytes, a negative window, or no
  // kind that keeps every token (some kind must carry the prefix).
  Status validate() const;
};

}  // namespace deepinfer::kvcache
