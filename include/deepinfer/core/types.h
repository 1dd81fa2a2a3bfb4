// The few numbers and types every layer shares, defined once: a token id, and the KV block size.
#pragma once

#include <cstdint>

namespace deepinfer {

// A token id of the tokenizer's vocabulary (Hugging Face `tokenizers` uses u32; DeepSeek's 129,280 ids fit).
using TokenId = int32_t;

// Tokens per KV cache block: FlashMLA's page size, the unit of the paged latent cache, of the prefix
// cache's chained block hashes, of the host and disk tiers and of KV events.
inline constexpr int32_t kBlockTokens = 64;

}  // namespace deepinfer
