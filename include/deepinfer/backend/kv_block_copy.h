// Whole KV blocks between a backend's per-layer caches and host memory, in the layout of
// kvcache/transfer/block_mover.h (a block's payload is layer-major: layer l's bytes of the block at
// [l * layer_bytes, (l + 1) * layer_bytes)). One backend batch (Backend::download_batch / upload_batch) carries every
// layer of every block named, so on CUDA the copies go through pinned staging with one wait per staging round, not
// a pageable copy and a synchronization per layer and block. The engine's tier copies (the mover), the KV
// handoffs of prefill/decode disaggregation (export after a prefill step, import before admission) and, with tensor
// parallel, the followers' copies of the blocks rank 0 writes (DeepSeekModel::replicate_cache_blocks) go through here.
// Block ids are kvcache::BlockId (int32_t). Thread-safety: the backend's (the engine serializes its backend calls;
// see Engine::StepGate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"

namespace deepinfer::backend {

// Copies blocks[i] of every layer cache into out[i] (layer_caches.size() * layer_bytes bytes each). REQUIRES
// out.size() == blocks.size(); each block within every cache. Errors: the backend's (Internal).
Status download_kv_blocks(Backend& backend, std::span<const Buffer> layer_caches,
                          size_t layer_bytes, std::span<const int32_t> blocks,
                          std::span<std::byte* const> out);
// Copies in[i] (layer_caches.size() * layer_bytes bytes each) into blocks[i] of every layer cache. REQUIRES
// in.size() == blocks.size(). Errors: the backend's (Internal).
Status upload_kv_blocks(Backend& backend, std::span<const Buffer> layer_caches, size_t layer_bytes,
                        std::span<const int32_t> blocks, std::span<const std::byte* const> in);

}  // namespace deepinfer::backend
