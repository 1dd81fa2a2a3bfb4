// Chained block hashes over an explicit little-endian byte layout (block_hash.h), so the same tokens give
// the same hash on every machine and in every process: the disk tier and the router depend on that.
#include "deepinfer/core/check.h"
#include "deepinfer/kvcache/block_hash.h"

#include <xxhash.h>

#include <cstring>

namespace deepinfer::kvcache {
namespace {

void put_u64(unsigned char* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(value >> (8 * i));
}

void put_u32(unsigned char* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>(value >> (8 * i));
}

BlockHash from_xxh(XXH128_hash_t hash) { return BlockHash{hash.low64, hash.high64}; }

}  // namespace

std::string BlockHash::to_hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[static_cast<size_t>(i)] = kDigits[(high >> (60 - 4 * i)) & 0xF];
    out[static_cast<size_t>(16 + i)] = kDigits[(low >> (60 - 4 * i)) & 0xF];
  }
  return out;
}

ModelFingerprint model_fingerprint(std::string_view config_json, std::string_view weights_identity) {
  static constexpr char kDomain[] = "deepinfer-kv-v1";  // 15 chars + the terminating NUL below
  XXH3_state_t* state = XXH3_createState();
  DEEPINFER_CHECK(state != nullptr);
  XXH3_128bits_reset(state);
  XXH3_128bits_update(state, kDomain, sizeof(kDomain));
  for (std::string_view part : {config_json, weights_identity}) {
    unsigned char length[8];
    put_u64(length, part.size());
    XXH3_128bits_update(state, length, sizeof(length));
    XXH3_128bits_update(state, part.data(), part.size());
  }
  BlockHash result = from_xxh(XXH3_128bits_digest(state));
  XXH3_freeState(state);
  return result;
}

BlockHash hash_block(const BlockHash& parent, std::span<const int32_t> tokens, const ModelFingerprint& fingerprint) {
  // Stack buffer for the engine's 64-token blocks; larger blocks (the 512-token trace blocks) use the heap.
  constexpr size_t kInline = 16 + 4 * static_cast<size_t>(kBlockTokens) + 16;
  const size_t size = 16 + 4 * tokens.size() + 16;
  unsigned char inline_buffer[kInline];
  std::vector<unsigned char> heap_buffer;
  unsigned char* bytes = inline_buffer;
  if (size > kInline) {
    heap_buffer.resize(size);
    bytes = heap_buffer.data();
  }
  put_u64(bytes, parent.low);
  put_u64(bytes + 8, parent.high);
  unsigned char* cursor = bytes + 16;
  for (int32_t token : tokens) {
    put_u32(cursor, static_cast<uint32_t>(token));
    cursor += 4;
  }
  put_u64(cursor, fingerprint.low);
  put_u64(cursor + 8, fingerprint.high);
  return from_xxh(XXH3_128bits(bytes, size));
}

std::vector<BlockHash> block_hash_chain(std::span<const int32_t> token_ids, const ModelFingerprint& fingerprint,
                                        int32_t block_tokens) {
  std::vector<BlockHash> chain;
  extend_block_hash_chain(chain, token_ids, fingerprint, block_tokens);
  return chain;
}

void extend_block_hash_chain(std::vector<BlockHash>& chain, std::span<const int32_t> token_ids,
                             const ModelFingerprint& fingerprint, int32_t block_tokens) {
  DEEPINFER_CHECK(block_tokens > 0);
  const size_t block = static_cast<size_t>(block_tokens);
  const size_t num_full = token_ids.size() / block;
  DEEPINFER_CHECK(chain.size() <= num_full);
  chain.reserve(num_full);
  for (size_t i = chain.size(); i < num_full; ++i) {
    const BlockHash parent = i == 0 ? kRootBlockHash : chain[i - 1];
    chain.push_back(hash_block(parent, token_ids.subspan(i * block, block), fingerprint));
  }
}

}  // namespace deepinfer::kvcache
