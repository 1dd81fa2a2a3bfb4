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
  bool has_dspark_draft = false;  // config.json has a DSpark draft module's keys (dspark_config, dspark_*): not loaded
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
// Errors: NotFound (no file), IoError (unreadable), Corruption (not JSON / not an object), InvalidArgument
// (a field's type or value), Unsupported (a valid value this build does not run).
Result<ModelConfig> load_model_config(const std::filesystem::path& path);

}  // namespace deepinfer::model
