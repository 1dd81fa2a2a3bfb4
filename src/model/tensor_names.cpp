// Expected tensor names and shapes of DeepSeek V2/V3 checkpoints, and loading them all as float32.
#include "deepinfer/model/tensor_names.h"

namespace deepinfer::model {
namespace {

class TensorListBuilder {
 public:
  explicit TensorListBuilder(const ModelConfig& config) : c_(config) {}

  void add(std::string name, std::vector<int64_t> shape, bool fp8_quantizable = false, bool required = true) {
    out_.push_back({std::move(name), std::move(shape), fp8_quantizable, required});
  }
  void linear(const std::string& name, int64_t out_features, int64_t in_features) {
    add(name, {out_features, in_features}, /*fp8_quantizable=*/true);
  }
  void mlp(const std::string& prefix, int64_t intermediate) {
    linear(prefix + "gate_proj.weight", intermediate, c_.hidden_size);
    linear(prefix + "up_proj.weight", intermediate, c_.hidden_size);
    linear(prefix + "down_proj.weight", c_.hidden_size, intermediate);
  }

  // model.layers.{layer}.*: MLA attention, two norms, and a dense MLP or an MoE block.
  void decoder_layer(const std::string& prefix, int64_t layer) {
    const int64_t hidden = c_.hidden_size;
    const int64_t heads = c_.num_attention_heads;
    add(prefix + "input_layernorm.weight", {hidden});
    add(prefix + "post_attention_layernorm.weight", {hidden});
    const std::string attn = prefix + "self_attn.";
    if (c_.q_lora_rank) {
      linear(attn + "q_a_proj.weight", *c_.q_lora_rank, hidden);
      add(attn + "q_a_layernorm.weight", {*c_.q_lora_rank});
      linear(attn + "q_b_proj.weight", heads * c_.qk_head_dim(), *c_.q_lora_rank);
    } else {
      linear(attn + "q_proj.weight", heads * c_.qk_head_dim(), hidden);
    }
    linear(attn + "kv_a_proj_with_mqa.weight", c_.kv_lora_rank + c_.qk_rope_head_dim, hidden);
    add(attn + "kv_a_layernorm.weight", {c_.kv_lora_rank});
    linear(attn + "kv_b_proj.weight", heads * (c_.qk_nope_head_dim + c_.v_head_dim), c_.kv_lora_rank);
    linear(attn + "o_proj.weight", hidden, heads * c_.v_head_dim);

    const std::string mlp_prefix = prefix + "mlp.";
    if (!c_.is_moe_layer(layer)) {
      mlp(mlp_prefix, c_.intermediate_size);
      return;
    }
    add(mlp_prefix + "gate.weight", {c_.n_routed_experts, hidden});
    if (c_.topk_method == "noaux_tc") add(mlp_prefix + "gate.e_score_correction_bias", {c_.n_routed_experts});
    for (int64_t expert = 0; expert < c_.n_routed_experts; ++expert) {
      mlp(mlp_prefix + "experts." + std::to_string(expert) + ".", c_.moe_intermediate_size);
    }
    if (c_.n_shared_experts > 0) mlp(mlp_prefix + "shared_experts.", c_.moe_intermediate_size * c_.n_shared_experts);
  }

  std::vector<ExpectedTensor> build() {
    const int64_t hidden = c_.hidden_size;
    const int64_t vocab = c_.vocab_size;
    add("model.embed_tokens.weight", {vocab, hidden});
    for (int64_t layer = 0; layer < c_.num_hidden_layers; ++layer) {
      decoder_layer("model.layers." + std::to_string(layer) + ".", layer);
    }
    add("model.norm.weight", {hidden});
    if (!c_.tie_word_embeddings) add("lm_head.weight", {vocab, hidden});
    // Multi-token prediction (DeepSeek-V3 §2.2): h' = eh_proj([enorm(embed(t)); hnorm(h)]), then a decoder layer.
    for (int64_t i = 0; i < c_.num_nextn_predict_layers; ++i) {
      const int64_t layer = c_.num_hidden_layers + i;
      const std::string prefix = "model.layers." + std::to_string(layer) + ".";
      add(prefix + "enorm.weight", {hidden});
      add(prefix + "hnorm.weight", {hidden});
      add(prefix + "eh_proj.weight", {hidden, 2 * hidden});
      add(prefix + "embed_tokens.weight", {vocab, hidden}, false, /*required=*/false);
      add(prefix + "shared_head.norm.weight", {hidden}, false, /*required=*/false);
      add(prefix + "shared_head.head.weight", {vocab, hidden}, false, /*required=*/false);
      decoder_layer(prefix, layer);
    }
    return std::move(out_);
  }

 private:
  const ModelConfig& c_;
  std::vector<ExpectedTensor> out_;
};

}  // namespace

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& config) { return TensorListBuilder(config).build(); }

std::string scale_inv_name(std::string_view weight_name) { return std::string(weight_name) + "_scale_inv"; }

Result<std::vector<std::vector<float>>> load_all_f32(const Checkpoint& checkpoint, const ModelConfig& config,
                                                     std::span<const ExpectedTensor> expected,
                                                     const LoadProgress& progress) {
  const int64_t block_rows = config.weight_block_size.size() == 2 ? config.weight_block_size[0] : 128;
  const int64_t block_cols = config.weight_block_size.size() == 2 ? config.weight_block_size[1] : 128;
  auto bytes_of = [&](const ExpectedTensor& spec) -> size_t {
    const TensorView* tensor = checkpoint.find(spec.name);
    if (tensor == nullptr) return 0;
    size_t bytes = tensor->size_bytes;
    if (tensor->dtype == DType::kF8E4M3) {
      if (const TensorView* scale = checkpoint.find(scale_inv_name(spec.name))) bytes += scale->size_bytes;
    }
    return bytes;
  };
  size_t total_bytes = 0;
  for (const ExpectedTensor& spec : expected) total_bytes += bytes_of(spec);

  std::vector<std::vector<float>> out;
  out.reserve(expected.size());
  size_t done_bytes = 0;
  if (progress) progress(0, total_bytes);
  for (const ExpectedTensor& spec : expected) {
    if (checkpoint.find(spec.name) == nullptr && !spec.required) {
      out.emplace_back();
      continue;
    }
    Result<std::vector<float>> values = checkpoint.load_f32(spec.name, spec.shape, block_rows, block_cols);
    if (!values.ok()) return values.status();
    out.push_back(std::move(values).value());
    done_bytes += bytes_of(spec);
    if (progress) progress(done_bytes, total_bytes);
  }
  return out;
}

}  // namespace deepinfer::model
