// Chained block hashes: the identity of a full KV block, shared by the prefix index, the tiers and the
// router. h_i = XXH3_128(h_{i-1} || token ids of block i || model fingerprint) (DESIGN.md, "KV cache"), so
// two sequences share h_i exactly when they share every token of blocks 0..i and the model.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/kvcache/block_pool.h"

namespace deepinfer::kvcache {

// A 128-bit hash value (XXH3-128's output: `low` is XXH128_hash_t::low64, `high` is high64).
// A value type; ordering is (high, low), only for deterministic containers.
struct BlockHash {
  uint64_t low = 0;
  uint64_t high = 0;

  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  friend auto operator<=>(const BlockHash& a, const BlockHash& b) {
    if (auto order = a.high <=> b.high; order != 0) return order;
    return a.low <=> b.low;
  }
  // 32 lowercase hex digits, high half first (the order XXH128's canonical form prints).
  std::string to_hex() const;
};

// For std::unordered_map<BlockHash, ...>. The value is already uniformly distributed, so folding is enough.
struct BlockHashHasher {
  size_t operator()(const BlockHash& hash) const noexcept {
    return static_cast<size_t>(hash.low ^ (hash.high * 0x9E3779B97F4A7C15ull));
  }
};

// The parent of block 0: all zero bits.
inline constexpr BlockHash kRootBlockHash{};

// Identifies the model whose KV a block holds, so blocks of another model (other weights, other config,
// other KV dtype) never match. A BlockHash-shaped value; build it with model_fingerprint().
using ModelFingerprint = BlockHash;

// XXH3-128 (seed 0) of: the bytes "deepinfer-kv-v1\0", then for each of `config_json` and `weights_identity`
// its length as a u64 little-endian followed by its bytes. `config_json` is the checkpoint's config.json text
// (or a canonical serialization of it); `weights_identity` names the weights (for example the safetensors
// index's content hash, or file names + sizes + mtimes) plus anything else that changes the KV bytes (the
// KV dtype). Deterministic across runs and machines.
ModelFingerprint model_fingerprint(std::string_view config_json, std::string_view weights_identity);

// One link of the chain. The bytes hashed (XXH3-128, seed 0), all integers little-endian:
//   offset 0:            parent.low  (u64)
//   offset 8:            parent.high (u64)
//   offset 16:           tokens[0..n) as int32 each (4 * n bytes; n = tokens.size(), kBlockTokens in the engine)
//   offset 16 + 4n:      fingerprint.low  (u64)
//   offset 24 + 4n:      fingerprint.high (u64)
// 288 bytes for a 64-token block. Pure function; thread-safe.
BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens, const ModelFingerprint& fingerprint);

// The chain of the full blocks of `token_ids`: element i is h_i over tokens [i*block_tokens, (i+1)*block_tokens),
// with h_{-1} = kRootBlockHash. A trailing partial block has no hash (it is not cacheable until it fills).
// Returns floor(token_ids.size() / block_tokens) hashes. REQUIRES: block_tokens > 0. Thread-safe.
std::vector<BlockHash> block_hash_chain(std::span<const int32_t> token_ids, const ModelFingerprint& fingerprint,
                                        int32_t block_tokens = kBlockTokens);

// Appends to `chain` the hashes of the full blocks of `token_ids` that `chain` does not cover yet, so a
// sequence that grows during decode hashes each block once. REQUIRES: `chain` is the chain of a prefix of
// `token_ids` under the same fingerprint and block size (chain.size() * block_tokens <= token_ids.size()),
// block_tokens > 0. Mutates `chain` only.
void extend_block_hash_chain(std::vector<BlockHash>& chain, std::span<const int32_t> token_ids,
                             const ModelFingerprint& fingerprint, int32_t block_tokens = kBlockTokens);

}  // namespace deepinfer::kvcache
