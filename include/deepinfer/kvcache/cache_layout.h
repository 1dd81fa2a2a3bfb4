// What a model caches per token, by kind (DESIGN.md, "KV cache"): V2/V3 cache the MLA latent of every layer;
// V3.2 adds the DSA indexer keys; V4 adds sliding-window entries (only the last window of tokens is kept) and
// compressed entries. The model declares its layout (DeepSeekModel::cache_layout()); the prefix cache sizes
// blocks from it, records per cached block which kinds it holds, and decides what a prefix hit is worth:
//   - every kind that keeps all tokens (window_tokens == 0) must be present in every block of the prefix;
//   - a sliding-window kind need only be present in the blocks of the prefix's last window; when it is
//     missing there, the hit ends before that window and those tokens are recomputed ("bounded replay":
//     replay_blocks(), the hook the V4 work refines to recompute the window kind alone).
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
  // The kinds that keep every token: a prefix block must hold all of them to be reused.
  CacheKindSet full_kinds() const;
  // The sliding-window kinds.
  CacheKindSet window_kinds() const;
  // Blocks at the end of a prefix that must also hold the window kinds: ceil(largest window / 64); 0 without
  // window kinds. When one is missing there, this many blocks are recomputed instead of reused.
  int64_t replay_blocks() const;
  // The blocks of a prefix of `matched` blocks that may be reused, given which of the last replay_blocks()
  // blocks hold every window kind (`window_present[i]` for block matched - replay + i). REQUIRES:
  // window_present.size() == min(matched, replay_blocks()).
  int64_t usable_blocks(int64_t matched, const std::vector<bool>& window_present) const;
  // InvalidArgument naming the kind: no kinds, a duplicate kind, no layers, no bytes, a negative window, or no
  // kind that keeps every token (some kind must carry the prefix).
  Status validate() const;
};

}  // namespace deepinfer::kvcache
