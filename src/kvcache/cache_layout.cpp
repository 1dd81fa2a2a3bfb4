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

int64_t CacheLayout::full_block_bytes() const {
  int64_t total = 0;
  for (const CacheKindSpec& kind : kinds) {
    if (kind.window_tokens == 0) total += kind.block_bytes();
  }
  return total;
}

std::vector<CacheKindSpec> CacheLayout::window_specs() const {
  std::vector<CacheKindSpec> out;
  for (const CacheKindSpec& kind : kinds) {
    if (kind.window_tokens > 0) out.push_back(kind);
  }
  return out;
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

int64_t CacheLayout::usable_blocks(const std::vector<bool>& window_present) const {
  const auto matched = static_cast<int64_t>(window_present.size());
  if (window_kinds().empty()) return matched;
  // k is usable when the run of present blocks ending at k - 1 is at least min(k, replay) long.
  const int64_t replay = replay_blocks();
  for (int64_t k = matched; k > 0; --k) {
    int64_t run = 0;
    while (run < std::min(k, replay) && window_present[static_cast<size_t>(k - 1 - run)]) ++run;
    if (run == std::min(k, replay)) return k;
  }
  return 0;
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
