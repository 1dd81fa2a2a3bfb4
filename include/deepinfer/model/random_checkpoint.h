// Writes a DeepSeek checkpoint with random weights (config.json + model.safetensors, bf16): the built-in
// default model that exists to try the API, and random-weight models for benchmarks. Deterministic: the same
// config and seed give the same bytes on every machine (own generator, no std distributions).
#pragma once

#include <cstdint>
#include <filesystem>

#include <boost/json/object.hpp>

#include "deepinfer/core/status.h"

namespace deepinfer::model {

// Writes `config` as dir/config.json and every tensor it implies (expected_tensors) as bf16 into
// dir/model.safetensors: weights ~ uniform with standard deviation `stddev`, norms 1, routing biases 0.
// Creates `dir`. Errors: the config is invalid (as load_model_config reports), or a write fails (IoError).
Status write_random_checkpoint(const std::filesystem::path& dir, const boost::json::object& config, uint64_t seed,
                               float stddev = 0.02f);

// The same for a deepseek_v4 config (DeepSeek-V4's release layout, v4_tensors): weights uniform as above, norms
// 1, routing biases 0, and each hash-routed layer's tid2eid row t = experts (t + j) mod E, j < top-k (I64).
Status write_random_v4_checkpoint(const std::filesystem::path& dir, const boost::json::object& config, uint64_t seed,
                                  float stddev = 0.02f);

// A DeepSeek-V4 architecture at demo size: the real vocabulary (129,280), three layers (window, compressed-sparse
// with the indexer, heavily compressed), mHC, a hash-routed first layer: for serving tests and benchmarks.
boost::json::object random_v4_model_config();

// The built-in default model: DeepSeek-V3's architecture (MLA with q-LoRA, a dense first layer, sigmoid
// noaux_tc MoE with shared expert, YaRN, one MTP layer) at a size a laptop CPU serves quickly, with the real
// DeepSeek-V3 vocabulary (129,280) so the real tokenizer applies.
boost::json::object random_model_config();

}  // namespace deepinfer::model
