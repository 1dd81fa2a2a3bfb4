// The tensors a DeepSeek V2/V3 checkpoint holds, derived from its ModelConfig: canonical Hugging Face names
// ([out_features, in_features] for Linear weights), shapes, and which are FP8 block-quantized in DeepSeek's
// native FP8 release. The forward pass reads weights by these names; tests check checkpoints against them.
// Reference: transformers' modeling_deepseek_v2/v3 module tree, and DeepSeek-V3's model.safetensors.index.json
// for the multi-token-prediction layers (model.layers.{num_hidden_layers + i}.*).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/model/config.h"
#include "deepinfer/model/safetensors.h"

namespace deepinfer::model {

struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
  // A Linear weight of attention or MLP/experts: stored F8_E4M3 plus `name + "_scale_inv"` ([ceil(rows / block),
  // ceil(cols / block)] float32) when config.quant_method == "fp8". Embeddings, norms, the router
  // (mlp.gate.*), lm_head and the MTP layer's eh_proj / shared_head stay bf16 in DeepSeek's release.
  bool fp8_quantizable = false;
  // False for tensors a checkpoint may leave out: the MTP layers' own embed_tokens and shared_head.{norm,head}
  // (the real V3 release has them; they equal the main model's, so converters sometimes drop them).
  bool required = true;
};

// Every tensor the config implies, in model order: model.embed_tokens, then per decoder layer (attention,
// norms, dense MLP or MoE), model.norm, lm_head (absent when tie_word_embeddings), then the
// num_nextn_predict_layers MTP layers. Scale tensors are not listed (see fp8_quantizable).
// REQUIRES: a config that load_model_config accepted.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& config);

// "<weight>_scale_inv": the name of an FP8 weight's block scales.
std::string scale_inv_name(std::string_view weight_name);

// Loads each of `expected` as float32 with Checkpoint::load_f32 (FP8 dequantized with the config's
// weight_block_size, 128x128 when the config has none), checking shapes. The result is parallel to `expected`;
// an absent tensor with required == false gives an empty vector. `progress` (may be empty) is called after
// each tensor with the checkpoint bytes read so far (weights plus scales) out of the total of the tensors
// present. Errors: the first load_f32 error, or NotFound naming the missing required tensor.
// Memory: every tensor in float32 at once; meant for small models and the CPU reference backend.
Result<std::vector<std::vector<float>>> load_all_f32(const Checkpoint& checkpoint, const ModelConfig& config,
                                                     std::span<const ExpectedTensor> expected,
                                                     const LoadProgress& progress = {});

}  // namespace deepinfer::model
