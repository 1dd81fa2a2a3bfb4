// DeepSeek V2/V3 forward pass over the backend interface. Attention runs in MLA's absorbed form for prefill
// and decode alike: queries are mapped into the latent space with W_UK, attention reads only the cached
// latent + rope key, and W_UV maps the result back (DeepSeek-V2 paper §2.1.3, "absorbed" inference).
#include "deepinfer/model/deepseek_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>

#include "deepinfer/model/moe_routing.h"
#include "deepinfer/model/safetensors.h"

namespace deepinfer::model {

using backend::WeightMatrix;
using Precision = backend::WeightMatrix::Precision;

namespace {
constexpr int64_t kBlockTokens = 64;
}

struct Mlp {
  WeightMatrix gate_up;  // [2 * intermediate, hidden]: gate rows then up rows
  WeightMatrix down;     // [hidden, intermediate]
};

struct Layer {
  std::vector<float> input_layernorm, post_attention_layernorm;
  // Attention.
  WeightMatrix q_proj;  // V2-Lite: [H * qk_head_dim, hidden]
  WeightMatrix q_a_proj, q_b_proj;
  std::vector<float> q_a_layernorm;
  WeightMatrix kv_a_proj_with_mqa;  // [C + R, hidden]
  std::vector<float> kv_a_layernorm;
  std::vector<WeightMatrix> w_uk_t;  // per head [C, qk_nope]: maps q_nope into the latent space
  std::vector<WeightMatrix> w_uv;    // per head [v_head, C]
  WeightMatrix o_proj;
  // Feed-forward: dense, or MoE.
  bool moe = false;
  Mlp dense;
  WeightMatrix gate;                   // router [n_routed, hidden], float32 always (as the reference)
  std::vector<float> gate_bias;        // e_score_correction_bias [n_routed] (noaux_tc)
  std::vector<Mlp> experts;
  Mlp shared;
  bool has_shared = false;
};

struct MtpLayer {
  std::vector<float> enorm, hnorm;
  WeightMatrix eh_proj;
  Layer layer;
};

struct DeepSeekModel::Weights {
  WeightMatrix embed_tokens;  // kept as [vocab, hidden]
  std::vector<Layer> layers;
  std::vector<MtpLayer> mtp_layers;
  std::vector<float> norm;
  WeightMatrix lm_head;
  std::vector<float> inv_freq;  // [R / 2]
  float rope_attention_factor = 1.0f;
  float softmax_scale = 0.0f;
  size_t bytes = 0;
};

namespace {

// YaRN (arXiv:2309.00071) as transformers' _compute_yarn_parameters computes it; plain rope without scaling.
void compute_rope(const ModelConfig& c, std::vector<float>& inv_freq, float& attention_factor) {
  const int64_t dim = c.qk_rope_head_dim;
  const double base = c.rope_theta;
  inv_freq.resize(static_cast<size_t>(dim / 2));
  attention_factor = 1.0f;
  for (int64_t i = 0; i < dim / 2; ++i) inv_freq[i] = static_cast<float>(1.0 / std::pow(base, (2.0 * i) / dim));
  if (!c.rope_scaling) return;
  const RopeScaling& y = *c.rope_scaling;
  auto get_mscale = [](double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; };
  attention_factor = static_cast<float>(y.mscale != 0 && y.mscale_all_dim != 0
                                            ? get_mscale(y.factor, y.mscale) / get_mscale(y.factor, y.mscale_all_dim)
                                            : get_mscale(y.factor, 1.0));
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(y.original_max_position_embeddings / (rotations * 2 * M_PI))) / (2 * std::log(base));
  };
  double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < dim / 2; ++i) {
    // The float32 ramp of the reference.
    float ramp = std::clamp(static_cast<float>((static_cast<float>(i) - low) / (high - low)), 0.0f, 1.0f);
    float extrapolation_factor = 1.0f - ramp;
    float pos_freq = static_cast<float>(std::pow(base, (2.0 * i) / dim));
    float extrapolation = 1.0f / pos_freq;
    float interpolation = 1.0f / (static_cast<float>(y.factor) * pos_freq);
    inv_freq[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
}

float softmax_scale(const ModelConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()));
  // YaRN's mscale(factor, mscale_all_dim)² multiplies the softmax scale (DeepSeek-V2 App. B; the fixtures'
  // reference does this for both architectures).
  if (c.rope_scaling && c.rope_scaling->mscale_all_dim != 0 &&
      c.rope_scaling->factor > 1) {
    double m = 0.1 * c.rope_scaling->mscale_all_dim * std::log(c.rope_scaling->factor) + 1.0;
    scale *= m * m;
  }
  return static_cast<float>(scale);
}

class Loader {
 public:
  Loader(const Checkpoint& checkpoint, const ModelConfig& config, Precision precision, LoadProgress progress)
      : checkpoint_(checkpoint), config_(config), precision_(precision), progress_(std::move(progress)),
        total_(checkpoint.total_bytes()) {}

  // Tensors the model does not use (an MTP layer's own embedding copy, say) still count as read.
  void finish() {
    done_ = total_;
    report();
  }

  Status vector(const std::string& name, std::vector<int64_t> shape, std::vector<float>& out) {
    Result<std::vector<float>> values = load(name, shape);
    if (!values.ok()) return values.status();
    out = std::move(values).value();
    return Status();
  }

  Status matrix(const std::string& name, int64_t rows, int64_t cols, WeightMatrix& out) {
    Result<std::vector<float>> values = load(name, {rows, cols});
    if (!values.ok()) return values.status();
    out = WeightMatrix::from_f32(std::move(values).value(), rows, cols, precision_);
    bytes_ += out.bytes();
    return Status();
  }

  // gate_proj and up_proj fused into one [2 * inter, hidden] matrix.
  Status mlp(const std::string& prefix, int64_t inter, Mlp& out) {
    const int64_t hidden = config_.hidden_size;
    Result<std::vector<float>> gate = load(prefix + ".gate_proj.weight", {inter, hidden});
    if (!gate.ok()) return gate.status();
    Result<std::vector<float>> up = load(prefix + ".up_proj.weight", {inter, hidden});
    if (!up.ok()) return up.status();
    std::vector<float> fused = std::move(gate).value();
    fused.insert(fused.end(), up->begin(), up->end());
    out.gate_up = WeightMatrix::from_f32(std::move(fused), 2 * inter, hidden, precision_);
    bytes_ += out.gate_up.bytes();
    return matrix(prefix + ".down_proj.weight", hidden, inter, out.down);
  }

  Status layer(int64_t index, Layer& out) {
    const ModelConfig& c = config_;
    const std::string p = "model.layers." + std::to_string(index);
    const int64_t hidden = c.hidden_size, heads = c.num_attention_heads, rank = c.kv_lora_rank;
    Status s;
    if (!(s = vector(p + ".input_layernorm.weight", {hidden}, out.input_layernorm)).ok()) return s;
    if (!(s = vector(p + ".post_attention_layernorm.weight", {hidden}, out.post_attention_layernorm)).ok()) return s;
    if (c.q_lora_rank) {
      if (!(s = matrix(p + ".self_attn.q_a_proj.weight", *c.q_lora_rank, hidden, out.q_a_proj)).ok()) return s;
      if (!(s = vector(p + ".self_attn.q_a_layernorm.weight", {*c.q_lora_rank}, out.q_a_layernorm)).ok()) return s;
      if (!(s = matrix(p + ".self_attn.q_b_proj.weight", heads * c.qk_head_dim(), *c.q_lora_rank, out.q_b_proj)).ok()) {
        return s;
      }
    } else if (!(s = matrix(p + ".self_attn.q_proj.weight", heads * c.qk_head_dim(), hidden, out.q_proj)).ok()) {
      return s;
    }
    if (!(s = matrix(p + ".self_attn.kv_a_proj_with_mqa.weight", rank + c.qk_rope_head_dim, hidden,
                     out.kv_a_proj_with_mqa)).ok()) {
      return s;
    }
    if (!(s = vector(p + ".self_attn.kv_a_layernorm.weight", {rank}, out.kv_a_layernorm)).ok()) return s;
    // kv_b_proj [H * (nope + v), C] split into per-head absorbed matrices.
    const int64_t nope = c.qk_nope_head_dim, v = c.v_head_dim;
    Result<std::vector<float>> kv_b = load(p + ".self_attn.kv_b_proj.weight", {heads * (nope + v), rank});
    if (!kv_b.ok()) return kv_b.status();
    for (int64_t h = 0; h < heads; ++h) {
      const float* head = kv_b->data() + h * (nope + v) * rank;
      std::vector<float> uk_t(static_cast<size_t>(rank * nope));  // transpose of W_UK[h] ([nope, C])
      for (int64_t n = 0; n < nope; ++n) {
        for (int64_t r = 0; r < rank; ++r) uk_t[r * nope + n] = head[n * rank + r];
      }
      out.w_uk_t.push_back(WeightMatrix::from_f32(std::move(uk_t), rank, nope, precision_));
      out.w_uv.push_back(WeightMatrix::from_f32(std::vector<float>(head + nope * rank, head + (nope + v) * rank), v,
                                                rank, precision_));
      bytes_ += out.w_uk_t.back().bytes() + out.w_uv.back().bytes();
    }
    if (!(s = matrix(p + ".self_attn.o_proj.weight", hidden, heads * v, out.o_proj)).ok()) return s;
    out.moe = c.is_moe_layer(index);
    if (!out.moe) return mlp(p + ".mlp", c.intermediate_size, out.dense);
    Result<std::vector<float>> gate = load(p + ".mlp.gate.weight", {c.n_routed_experts, hidden});
    if (!gate.ok()) return gate.status();
    out.gate = WeightMatrix::from_f32(std::move(gate).value(), c.n_routed_experts, hidden, Precision::kF32);
    bytes_ += out.gate.bytes();
    if (c.topk_method == "noaux_tc") {
      if (!(s = vector(p + ".mlp.gate.e_score_correction_bias", {c.n_routed_experts}, out.gate_bias)).ok()) return s;
    }
    out.experts.resize(static_cast<size_t>(c.n_routed_experts));
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      if (!(s = mlp(p + ".mlp.experts." + std::to_string(e), c.moe_intermediate_size, out.experts[e])).ok()) return s;
    }
    out.has_shared = c.n_shared_experts > 0;
    if (out.has_shared) return mlp(p + ".mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts, out.shared);
    return Status();
  }

  size_t bytes() const { return bytes_; }

 private:
  Result<std::vector<float>> load(const std::string& name, std::vector<int64_t> shape) {
    const TensorView* view = checkpoint_.find(name);
    Result<std::vector<float>> values = checkpoint_.load_f32(name, shape, block(0), block(1));
    if (values.ok() && view != nullptr) {
      done_ += view->size_bytes;
      report();
    }
    return values;
  }
  int64_t block(size_t i) const {
    return config_.weight_block_size.size() == 2 ? config_.weight_block_size[i] : 128;
  }
  void report() {
    if (progress_) progress_(done_, total_);
  }

  const Checkpoint& checkpoint_;
  const ModelConfig& config_;
  Precision precision_;
  LoadProgress progress_;
  size_t total_;
  size_t done_ = 0;
  size_t bytes_ = 0;
};

}  // namespace

DeepSeekModel::DeepSeekModel(ModelConfig config, backend::Backend& backend)
    : config_(std::move(config)), backend_(backend), weights_(std::make_unique<Weights>()) {}
DeepSeekModel::~DeepSeekModel() = default;
const ModelConfig& DeepSeekModel::config() const { return config_; }
size_t DeepSeekModel::weight_bytes() const { return weights_->bytes; }

Result<std::unique_ptr<DeepSeekModel>> DeepSeekModel::load(const std::filesystem::path& dir, backend::Backend& backend,
                                                           Precision precision, bool progress) {
  Result<ModelConfig> config = load_model_config(dir);
  if (!config.ok()) return config.status();
  if (config->qk_rope_head_dim > 256 || config->qk_rope_head_dim % 2 != 0) {
    return Status::unsupported(dir.string() + "/config.json: qk_rope_head_dim " +
                               std::to_string(config->qk_rope_head_dim) + " (must be even and <= 256)");
  }
  Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  std::unique_ptr<DeepSeekModel> model(new DeepSeekModel(std::move(config).value(), backend));
  const ModelConfig& c = model->config_;
  Weights& w = *model->weights_;
  Loader loader(**checkpoint, c, precision, progress ? terminal_progress_bar("loading " + dir.filename().string()) : LoadProgress());
  Status s;
  if (!(s = loader.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size, w.embed_tokens)).ok()) return s;
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!(s = loader.layer(l, w.layers[l])).ok()) return s;
  }
  for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
    MtpLayer mtp;
    const int64_t index = c.num_hidden_layers + i;
    const std::string p = "model.layers." + std::to_string(index);
    if (!(s = loader.vector(p + ".enorm.weight", {c.hidden_size}, mtp.enorm)).ok()) return s;
    if (!(s = loader.vector(p + ".hnorm.weight", {c.hidden_size}, mtp.hnorm)).ok()) return s;
    if (!(s = loader.matrix(p + ".eh_proj.weight", c.hidden_size, 2 * c.hidden_size, mtp.eh_proj)).ok()) return s;
    if (!(s = loader.layer(index, mtp.layer)).ok()) return s;
    w.mtp_layers.push_back(std::move(mtp));
  }
  if (!(s = loader.vector("model.norm.weight", {c.hidden_size}, w.norm)).ok()) return s;
  const char* head = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  if (!(s = loader.matrix(head, c.vocab_size, c.hidden_size, w.lm_head)).ok()) return s;
  compute_rope(c, w.inv_freq, w.rope_attention_factor);
  w.softmax_scale = softmax_scale(c);
  w.bytes = loader.bytes();
  loader.finish();
  return model;
}

namespace {

// Router of one MoE layer for one token: the config's rule through route_token (src/model/moe_routing.cpp,
// shared with the GPU routing kernel's checks).
MoeRoutingRule routing_rule(const ModelConfig& c) {
  MoeRoutingRule rule;
  rule.scoring = c.scoring_func == "sigmoid" ? MoeRoutingRule::Scoring::kSigmoid : MoeRoutingRule::Scoring::kSoftmax;
  rule.topk = c.topk_method == "noaux_tc"               ? MoeRoutingRule::TopK::kNoauxTc
              : c.topk_method == "group_limited_greedy" ? MoeRoutingRule::TopK::kGroupLimitedGreedy
                                                        : MoeRoutingRule::TopK::kGreedy;
  rule.num_experts = c.n_routed_experts;
  rule.top_k = c.num_experts_per_tok;
  rule.n_group = c.n_group;
  rule.topk_group = c.topk_group;
  rule.norm_topk_prob = c.norm_topk_prob;
  rule.scale_after_normalize = c.model_type == "deepseek_v3";
  rule.routed_scaling_factor = c.routed_scaling_factor;
  return rule;
}

}  // namespace

Status DeepSeekModel::forward(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<float>& logits) {
  const ModelConfig& c = config_;
  const Weights& w = *weights_;
  const int64_t T = static_cast<int64_t>(batch.token_ids.size());
  const int64_t hidden = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t nope = c.qk_nope_head_dim, qk = c.qk_head_dim(), V = c.v_head_dim, entry = C + R;
  if (static_cast<int64_t>(layer_caches.size()) < c.num_hidden_layers) {
    return Status::invalid_argument("forward: " + std::to_string(layer_caches.size()) + " layer caches for " +
                                    std::to_string(c.num_hidden_layers) + " layers");
  }
  // Row bookkeeping: each row's position, sequence, and cache slot.
  std::vector<int32_t> positions(static_cast<size_t>(T)), row_sequence(static_cast<size_t>(T)),
      row_context(static_cast<size_t>(T));
  std::vector<int64_t> slot(static_cast<size_t>(T));
  std::vector<std::vector<int32_t>> block_tables;
  int64_t row = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& chunk = batch.sequences[s];
    block_tables.push_back(chunk.block_table);
    for (int32_t i = 0; i < chunk.num_tokens; ++i, ++row) {
      if (row >= T) return Status::invalid_argument("forward: sequence chunks cover more rows than token_ids");
      int32_t position = chunk.start_position + i;
      size_t block_index = static_cast<size_t>(position / kBlockTokens);
      if (block_index >= chunk.block_table.size()) {
        return Status::invalid_argument("forward: sequence " + std::to_string(s) + " has no cache block for position " +
                                        std::to_string(position));
      }
      positions[row] = position;
      row_sequence[row] = static_cast<int32_t>(s);
      row_context[row] = position + 1;
      slot[row] = chunk.block_table[block_index] * kBlockTokens + position % kBlockTokens;
    }
  }
  if (row != T) return Status::invalid_argument("forward: sequence chunks do not cover token_ids");

  // Embedding.
  std::vector<float> x(static_cast<size_t>(T * hidden)), normed(x.size());
  for (int64_t t = 0; t < T; ++t) {
    int32_t id = batch.token_ids[t];
    if (id < 0 || id >= c.vocab_size) {
      return Status::invalid_argument("forward: token id " + std::to_string(id) + " outside the vocabulary of " +
                                      std::to_string(c.vocab_size));
    }
    float* out = x.data() + t * hidden;
    if (w.embed_tokens.precision == Precision::kF32) {
      std::copy_n(w.embed_tokens.f32.data() + id * hidden, hidden, out);
    } else {
      for (int64_t i = 0; i < hidden; ++i) {
        uint32_t bits = static_cast<uint32_t>(w.embed_tokens.bf16[id * hidden + i]) << 16;
        std::memcpy(out + i, &bits, sizeof(float));
      }
    }
  }

  std::vector<float> q, q_a, kv_a, q_nope_h, q_latent(static_cast<size_t>(T * H * C)), q_rope(static_cast<size_t>(T * H * R)),
      head_latent, head_out, out_latent(static_cast<size_t>(T * H * C)), attn(static_cast<size_t>(T * H * V)),
      projected(static_cast<size_t>(T * hidden)), gate_up, act, ffn(static_cast<size_t>(T * hidden)), router;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = w.layers[l];
    float* cache = layer_caches[l];
    backend_.rms_norm(x.data(), T, hidden, hidden, L.input_layernorm.data(), static_cast<float>(c.rms_norm_eps),
                      normed.data());
    // Queries [T, H, qk].
    q.resize(static_cast<size_t>(T * H * qk));
    if (c.q_lora_rank) {
      q_a.resize(static_cast<size_t>(T * *c.q_lora_rank));
      backend_.linear(normed.data(), T, L.q_a_proj, q_a.data());
      backend_.rms_norm(q_a.data(), T, *c.q_lora_rank, *c.q_lora_rank, L.q_a_layernorm.data(),
                        static_cast<float>(c.rms_norm_eps), q_a.data());
      backend_.linear(q_a.data(), T, L.q_b_proj, q.data());
    } else {
      backend_.linear(normed.data(), T, L.q_proj, q.data());
    }
    // Latent and rope key [T, C + R]: normalize the latent, rope the key, store both in the cache.
    kv_a.resize(static_cast<size_t>(T * entry));
    backend_.linear(normed.data(), T, L.kv_a_proj_with_mqa, kv_a.data());
    backend_.rms_norm(kv_a.data(), T, C, entry, L.kv_a_layernorm.data(), static_cast<float>(c.rms_norm_eps),
                      kv_a.data());
    backend_.rope(kv_a.data() + C, T, R, entry, 1, positions.data(), w.inv_freq.data(), w.rope_attention_factor);
    for (int64_t t = 0; t < T; ++t) std::copy_n(kv_a.data() + t * entry, entry, cache + slot[t] * entry);
    // q_rope: roped copy of each head's rope part; q_latent: W_UK[h]ᵀ q_nope per head.
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) std::copy_n(q.data() + (t * H + h) * qk + nope, R, q_rope.data() + (t * H + h) * R);
    }
    backend_.rope(q_rope.data(), T * H, R, R, H, positions.data(), w.inv_freq.data(), w.rope_attention_factor);
    q_nope_h.resize(static_cast<size_t>(T * nope));
    head_latent.resize(static_cast<size_t>(T * C));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) std::copy_n(q.data() + (t * H + h) * qk, nope, q_nope_h.data() + t * nope);
      backend_.linear(q_nope_h.data(), T, L.w_uk_t[h], head_latent.data());
      for (int64_t t = 0; t < T; ++t) std::copy_n(head_latent.data() + t * C, C, q_latent.data() + (t * H + h) * C);
    }
    backend::MlaAttentionParams params;
    params.num_tokens = T;
    params.num_heads = H;
    params.kv_lora_rank = C;
    params.rope_dim = R;
    params.scale = w.softmax_scale;
    params.q_latent = q_latent.data();
    params.q_rope = q_rope.data();
    params.out_latent = out_latent.data();
    params.row_sequence = row_sequence.data();
    params.row_context = row_context.data();
    params.block_tables = block_tables;
    params.cache = cache;
    backend_.mla_attention(params);
    // Values per head with W_UV, then o_proj.
    head_out.resize(static_cast<size_t>(T * V));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) std::copy_n(out_latent.data() + (t * H + h) * C, C, head_latent.data() + t * C);
      backend_.linear(head_latent.data(), T, L.w_uv[h], head_out.data());
      for (int64_t t = 0; t < T; ++t) std::copy_n(head_out.data() + t * V, V, attn.data() + (t * H + h) * V);
    }
    backend_.linear(attn.data(), T, L.o_proj, projected.data());
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += projected[i];

    // Feed-forward.
    backend_.rms_norm(x.data(), T, hidden, hidden, L.post_attention_layernorm.data(),
                      static_cast<float>(c.rms_norm_eps), normed.data());
    auto run_mlp = [&](const Mlp& mlp, const float* input, int64_t rows, float* output) {
      const int64_t inter = mlp.down.cols;
      gate_up.resize(static_cast<size_t>(rows * 2 * inter));
      act.resize(static_cast<size_t>(rows * inter));
      backend_.linear(input, rows, mlp.gate_up, gate_up.data());
      backend_.silu_mul(gate_up.data(), rows, inter, act.data());
      backend_.linear(act.data(), rows, mlp.down, output);
    };
    if (!L.moe) {
      run_mlp(L.dense, normed.data(), T, ffn.data());
    } else {
      const int64_t n = c.n_routed_experts;
      router.resize(static_cast<size_t>(T * n));
      // Router logits in float32 from float32 weights, as the reference computes them.
      backend_.linear(normed.data(), T, L.gate, router.data());
      std::vector<std::vector<std::pair<int32_t, float>>> by_expert(static_cast<size_t>(n));
      std::vector<int32_t> ids;
      std::vector<float> weights;
      const MoeRoutingRule rule = routing_rule(c);
      for (int64_t t = 0; t < T; ++t) {
        route_token(rule, router.data() + t * n, L.gate_bias, ids, weights);
        for (size_t i = 0; i < ids.size(); ++i) by_expert[ids[i]].push_back({static_cast<int32_t>(t), weights[i]});
      }
      if (L.has_shared) {
        run_mlp(L.shared, normed.data(), T, ffn.data());
      } else {
        std::fill(ffn.begin(), ffn.end(), 0.0f);
      }
      std::vector<float> gathered, expert_out;
      for (int64_t e = 0; e < n; ++e) {
        const auto& tokens = by_expert[e];
        if (tokens.empty()) continue;
        const int64_t rows = static_cast<int64_t>(tokens.size());
        gathered.resize(static_cast<size_t>(rows * hidden));
        expert_out.resize(static_cast<size_t>(rows * hidden));
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(normed.data() + tokens[r].first * hidden, hidden, gathered.data() + r * hidden);
        }
        run_mlp(L.experts[e], gathered.data(), rows, expert_out.data());
        for (int64_t r = 0; r < rows; ++r) {
          float* out = ffn.data() + tokens[r].first * hidden;
          const float* in = expert_out.data() + r * hidden;
          for (int64_t i = 0; i < hidden; ++i) out[i] += tokens[r].second * in[i];
        }
      }
    }
    for (int64_t i = 0; i < T * hidden; ++i) x[i] += ffn[i];
  }

  // Final norm and lm_head for the requested rows only.
  const int64_t rows = static_cast<int64_t>(batch.logits_rows.size());
  std::vector<float> selected(static_cast<size_t>(rows * hidden));
  for (int64_t r = 0; r < rows; ++r) {
    int32_t source = batch.logits_rows[r];
    if (source < 0 || source >= T) return Status::invalid_argument("forward: logits row outside the batch");
    std::copy_n(x.data() + source * hidden, hidden, selected.data() + r * hidden);
  }
  backend_.rms_norm(selected.data(), rows, hidden, hidden, w.norm.data(), static_cast<float>(c.rms_norm_eps),
                    selected.data());
  logits.resize(static_cast<size_t>(rows * c.vocab_size));
  backend_.linear(selected.data(), rows, w.lm_head, logits.data());
  return Status();
}

}  // namespace deepinfer::model
