// The model fingerprint of a checkpoint directory (kvcache::model_fingerprint): what makes cached KV blocks
// of one checkpoint never match another's, also on disk across restarts.
#pragma once

#include <filesystem>
#include <string_view>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"

namespace deepinfer::engine {

// model_fingerprint(config.json's bytes, identity) where identity lists, for every *.safetensors file in `dir`
// (sorted by name): its name, size, the XXH3-64 of its header, and the XXH3-64 of 16 evenly spaced 64 KiB
// samples of its data; then `compute_mode` (whatever else changes the KV bytes: the weight precision the
// backend computes with, the KV dtype). Reads about 1 MiB per file, so it is cheap for a 700 GB checkpoint; two
// checkpoints that agree on every sampled byte, size and header collide (a fine-tune that changed no sampled
// byte) — accepted: the samples cover every shard. Deterministic across machines.
// Errors: IOError naming the file when config.json or a shard cannot be read; NotFound when there is no shard.
Result<kvcache::ModelFingerprint> checkpoint_fingerprint(const std::filesystem::path& dir, std::string_view compute_mode);

}  // namespace deepinfer::engine
