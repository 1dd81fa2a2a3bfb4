// CacheLayout: block sizes, kind sets and the bounded-replay rule of a model's cached kinds.
#include "deepinfer/kvcache/cache_layout.h"

#include <algorithm>

namespace deepinfer::kvcache {

CacheLayout CacheLayout::latent_only(int32_t num_layers, int64_t token_bytes) {
  return CacheLayout{{CacheKindSpec{CacheKind::kLatent, "latent", num_layers, token_bytes, 0}}};
}

Result<CacheKind> CacheLayout::kind_from_name(const std::string& name) {
  if (name == "latent") return CacheKind::kLatent;
  if (name == "indexer_key") return CacheKind::kIndexerKey;
  if (name == "sliding_window") return CacheKind::kSlidingWindow;
  if (name == "compressed") return CacheKind::kCompressed;
  return Status::invalid_argument("unknown cache kind '" + name +
                                  "' (latent, indexer_key, sliding_window, compressed)");
}

int64_t CacheLayout::block_bytes() const {
  int64_t total = 0;
  for (const CacheKindSpec& kind : kinds) total += kind.block_bytes();
  return total;
}

CacheKindSet CacheLayout::full_kinds() const {
  CacheKindSet set;
  for (const CacheKindSpec& kind : kinds) {
    if (kind.window_tokens == 0) set.insert(kind.kind);
  }
  return set;
}

CacheKindSet CacheLayout::window_kinds() const {
  CacheKindSet set;
  for (const CacheKindSpec& kind : kinds) {
    if (kind.window_tokens > 0) set.insert(kind.kind);
  }
  return set;
}

int64_t CacheLayout::replay_blocks() const {
  int64_t window = 0;
  for (const CacheKindSpec& kind : kinds) window = std::max<int64_t>(window, kind.window_tokens);
  return (window + kBlockTokens - 1) / kBlockTokens;
}

int64_t CacheLayout::usable_blocks(int64_t matched, const std::vector<bool>& window_present) const {
  if (window_kinds().empty()) return matched;
  const bool complete = std::all_of(window_present.begin(), window_present.end(), [](bool b) { return b; });
  if (complete) return matched;
  // The window's entries are rebuilt by recomputing the window: the hit ends where it starts.
  return std::max<int64_t>(matched - replay_blocks(), 0);
}

Status CacheLayout::validate() const {
  if (kinds.empty()) return Status::invalid_argument("the cache layout declares no kind");
  CacheKindSet seen;
  for (const CacheKindSpec& kind : kinds) {
    const std::string name = "cache kind '" + kind.name + "'";
    if (seen.has(kind.kind)) return Status::invalid_argument(name + " is declared twice");
    seen.insert(kind.kind);
    if (kind.num_layers < 1) return Status::invalid_argument(name + " has no layers");
    if (kind.token_bytes < 1) return Status::invalid_argument(name + " has no bytes per token");
    if (kind.window_tokens < 0) return Status::invalid_argument(name + " has a negative window");
  }
  if (full_kinds().empty()) {
    return Status::invalid_argument("the cache layout has only sliding-window kinds; one must keep every token");
  }
  return Status::ok_status();
}

}  // namespace deepinfer::kvcache
