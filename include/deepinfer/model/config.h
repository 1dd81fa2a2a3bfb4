// ModelConfig: a DeepSeek checkpoint's config.json (model_type deepseek_v2 or deepseek_v3), with the field
// names the real releases use. Reference: transformers' DeepseekV2Config / DeepseekV3Config.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::model {

// `rope_scaling` of type "yarn" as DeepSeek writes it (YaRN, arXiv:2309.00071 §3; DeepSeek-V2 paper App. B).
struct RopeScaling {
  std::string type;  // "yarn" (the only type DeepSeek ships); others are rejected at load
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// A DSpark draft module bundled with the checkpoint (deepseek-v4-spec.md §5.1, §5.5; SGLang's dspark_config.py keys),
// in the form this build runs on a V2/V3 target: S = target_layer_ids.size() stages, each a decoder layer of the
// target's attention shapes with a dense SwiGLU MLP of intermediate_size, tensors `mtp.{s}.*` (the target's layer
// names below each prefix), plus mtp.0.main_proj / main_norm, mtp.{S-1}.norm, its markov_head.markov_w1/markov_w2
// [vocab, markov_rank] and confidence_head.proj [1, hidden + markov_rank]. DeepSeekModel documents the forward.
struct DsparkDraftConfig {
  std::vector<int64_t> target_layer_ids;  // dspark_target_layer_ids: the residual after these target layers (0-based)
  int64_t block_size = 0;                 // dspark_block_size (gamma): rows of one block pass = most drafts per step
  int64_t markov_rank = 0;                // dspark_markov_rank (r)
  int64_t noise_token_id = 0;             // dspark_noise_token_id: the MASK rows' token
  int64_t num_stages() const { return static_cast<int64_t>(target_layer_ids.size()); }
};

struct ModelConfig {
  std::string model_type;  // "deepseek_v2" | "deepseek_v3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each routed / shared expert
  int64_t num_hidden_layers = 0;      // excludes the MTP layers that follow them
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t n_shared_experts = 0;
  int64_t n_routed_experts = 0;  // 0: no MoE layers
  double routed_scaling_factor = 1.0;
  int64_t kv_lora_rank = 0;
  std::optional<int64_t> q_lora_rank;  // null: q_proj directly (V2-Lite); must be written (see below)
  int64_t qk_rope_head_dim = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t num_experts_per_tok = 0;
  int64_t first_k_dense_replace = 0;  // layers [0, first_k_dense_replace) are dense
  int64_t moe_layer_freq = 1;         // layer i >= first_k_dense_replace is MoE when i % moe_layer_freq == 0
  bool norm_topk_prob = false;
  std::string scoring_func = "softmax";  // "softmax" (V2) | "sigmoid" (V3)
  std::string topk_method = "greedy";    // "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
  std::string hidden_act = "silu";
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 0;
  std::vector<int64_t> eos_token_ids;    // config's eos_token_id, an int or a list
  int64_t num_nextn_predict_layers = 0;  // MTP layers stored as model.layers.{num_hidden_layers + i}.*
  // config.json's dspark_* keys: a DSpark draft module (mtp.{stage}.* tensors), loaded with the model.
  std::optional<DsparkDraftConfig> dspark;
  // quantization_config (fp8): block size [rows, cols] of weight_scale_inv; empty when not quantized.
  std::string quant_method;
  std::vector<int64_t> weight_block_size;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Values cached per token per layer: the MLA latent plus the rope key (576 for V3).
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
};

// Parses `dir/config.json` (or the file itself). Errors name the file and field: missing required fields,
// wrong types, unsupported model_type / scoring_func / topk_method / rope_scaling type / quant_method, and
// inconsistent values (e.g. num_experts_per_tok > n_routed_experts, n_routed_experts % n_group != 0).
//
// Required (every DeepSeek release writes them; they size the tensors): model_type, vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, kv_lora_rank, q_lora_rank (an integer or null:
// transformers' default 1536 and "absent means q_proj" disagree, so absence is an error), qk_rope_head_dim,
// qk_nope_head_dim, v_head_dim, n_routed_experts (null: dense), and when n_routed_experts > 0 also
// moe_intermediate_size and num_experts_per_tok. Every other field, absent or null, takes the default of
// transformers' DeepseekV2Config / DeepseekV3Config for the model_type (e.g. V3: n_group 8, topk_group 4,
// norm_topk_prob true, bos 0, eos 1; V2: n_group 1, greedy, bos 1, eos 2); fields transformers lacks take
// DeepSeek's own defaults (scoring_func V2 softmax / V3 sigmoid, topk_method V3 noaux_tc, moe_layer_freq 1)
// except num_nextn_predict_layers, 0 when absent. rope_scaling may also come as transformers 5's
// `rope_parameters` ({"rope_type": "yarn" | "default", "rope_theta": ..., ...}). Unknown fields are ignored.
// dspark_* keys (any of them present): dspark_target_layer_ids (a non-empty list of distinct layers < num_hidden_layers),
// dspark_block_size (1..16), dspark_markov_rank (>= 1) and dspark_noise_token_id (< vocab_size) are then required;
// dspark_n_routed_experts (MoE stages, V4's) and a dspark_config object are Unsupported.
// Errors: NotFound (no file), IoError (unreadable), Corruption (not JSON / not an object), InvalidArgument
// (a field's type or value), Unsupported (a valid value this build does not run).
Result<ModelConfig> load_model_config(const std::filesystem::path& path);

}  // namespace deepinfer::model
