// DeepSeek-V4 on the CPU: loading the release layout and the forward pass (see deepseek_v4.h). Each step below
// names the part of DeepSeek's V4-Flash-0731 inference/model.py it computes (spec: deepseek-v4-spec.md §2-§3).
#include "deepinfer/model/deepseek_v4.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "deepinfer/core/check.h"
#include "deepinfer/model/safetensors.h"

namespace deepinfer::model {
namespace {

using backend::Backend;
using backend::Tensor;

// A linear layer [rows = out features][cols = in features] on the backend, float32.
struct Linear {
  std::unique_ptr<backend::Weight> weight;
  int64_t rows = 0, cols = 0;
};

// Rotary table of one layer: inverse frequencies of the R/2 pairs (YaRN-blended on compressed layers), in double
// as the fixture's reference computed them. Pairs are interleaved (x[2i], x[2i+1]).
struct Rope {
  std::vector<double> inv_freq;

  // Rotates the R values at v by position * inv_freq (inverse: by -position).
  void apply(float* v, int64_t position, bool inverse = false) const {
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      double angle = static_cast<double>(position) * inv_freq[i];
      double c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
      double x0 = v[2 * i], x1 = v[2 * i + 1];
      v[2 * i] = static_cast<float>(x0 * c - x1 * s);
      v[2 * i + 1] = static_cast<float>(x0 * s + x1 * c);
    }
  }
};

// inference/model.py precompute_freqs_cis: base^(-2i/R), and with original_len > 0 YaRN's blend of the
// interpolated (freq / factor) and extrapolated frequencies over the ramp between the beta_fast and beta_slow
// correction dims.
Rope make_rope(int64_t rope_dim, double base, const RopeScaling* yarn) {
  Rope rope;
  const int64_t half = rope_dim / 2;
  rope.inv_freq.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    rope.inv_freq[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(rope_dim));
  }
  if (yarn == nullptr) return rope;
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(rope_dim) *
           std::log(static_cast<double>(yarn->original_max_position_embeddings) / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(base));
  };
  double low = std::max(std::floor(correction_dim(yarn->beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(yarn->beta_slow)), static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    double smooth = 1.0 - ramp;
    rope.inv_freq[i] = rope.inv_freq[i] / yarn->factor * (1.0 - smooth) + rope.inv_freq[i] * smooth;
  }
  return rope;
}

// y = x * rsqrt(mean(x²) + eps) * weight over `n` values (weight null: none). y may alias x.
void rms_norm(const float* x, int64_t n, const float* weight, double eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  double inv = 1.0 / std::sqrt(sum / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    double v = static_cast<double>(x[i]) * inv;
    y[i] = static_cast<float>(weight != nullptr ? v * weight[i] : v);
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// One compressor's weights (model.py Compressor): ratio m, output dim, coff = 2 when overlapped (m == 4).
struct CompressorWeights {
  int64_t ratio = 0, dim = 0, coff = 1;
  std::vector<float> ape;  // [m][coff * dim]
  Linear wkv, wgate;       // [coff * dim][d]
  std::vector<float> norm;  // [dim]
};

struct LayerWeights {
  int64_t ratio = 0;
  Rope rope;
  std::vector<float> attn_norm, ffn_norm;
  Linear hc_attn_fn, hc_ffn_fn;  // [(2 + hc) * hc][hc * d]
  std::vector<float> hc_attn_base, hc_attn_scale, hc_ffn_base, hc_ffn_scale;
  Linear wq_a, wq_b, wkv, wo_a, wo_b;  // wo_a: o_groups stacked [L][H * D / G]
  std::vector<float> q_norm, kv_norm, attn_sink;
  CompressorWeights compressor, index_compressor;
  Linear index_wq_b, index_weights_proj;
  Linear gate;                    // [E][d]
  std::vector<float> gate_bias;   // [E] (learned routing)
  std::vector<int32_t> tid2eid;   // [vocab][k] (hash routing)
  std::vector<Linear> w1, w2, w3;  // per expert; index E is the shared expert
};

// Where each part of a layer's block payload (DeepSeekV4Model::block_payload_floats: the entries and indexer keys a
// block finishes) and of its window payload (window_payload_floats: the block's raw rows, then the compressors' rows
// at its end - state only a prefix's last block needs) lives, in floats.
struct PayloadLayout {
  struct Layer {
    int64_t offset = 0;                    // the layer's first float in the block payload
    int64_t entries = 0, entry_slots = 0;  // block payload: [slots][D]
    int64_t index_entries = 0;             // block payload: [16][DI]
    int64_t window_offset = 0;             // the layer's first float in the window payload: raw rows [64][D]
    int64_t rows = 0, row_width = 0;       // window payload: compressor rows, kv [rows][width] then score [rows][width]
    int64_t index_rows = 0, index_width = 0;  // window payload: the indexer compressor's rows, the same way
  };
  std::vector<Layer> layers;
  int64_t total = 0, window_total = 0;

  explicit PayloadLayout(const V4Config& c) {
    const int64_t D = c.head_dim, DI = c.index_head_dim;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const int64_t m = c.compress_ratios[l];
      Layer layer;
      layer.offset = total;
      layer.window_offset = window_total;
      int64_t at = 0, window_at = 64 * D;
      if (m != 0) {
        layer.entries = at;
        layer.entry_slots = std::max<int64_t>(1, 64 / m);
        at += layer.entry_slots * D;
        layer.row_width = (m == 4 ? 2 : 1) * D;
        layer.rows = window_at;
        window_at += 2 * std::min<int64_t>(m, 64) * layer.row_width;
      }
      if (m == 4) {
        layer.index_entries = at;
        at += 16 * DI;
        layer.index_width = 2 * DI;
        layer.index_rows = window_at;
        window_at += 2 * 4 * layer.index_width;
      }
      total += at;
      window_total += window_at;
      layers.push_back(layer);
    }
    total = std::max<int64_t>(total, 1);  // every layer a window layer: one unused float (a block has bytes)
  }
};

// Rows a compressor keeps after a block boundary B (a multiple of 64): the overlapped one the last finished block
// (m rows), the plain one its unfinished block (B mod m rows).
int64_t kept_rows(int64_t m, int64_t boundary) {
  const int64_t keep = m == 4 ? std::max<int64_t>(0, (boundary / m) * m - m) : (boundary / m) * m;
  return boundary - keep;
}

}  // namespace

struct DeepSeekV4Model::Weights {
  std::vector<float> embed;  // [vocab][d]
  Linear head;               // [vocab][d]
  std::vector<float> norm;   // [d]
  Linear hc_head_fn;         // [hc][hc * d]
  std::vector<float> hc_head_base, hc_head_scale;
  std::vector<LayerWeights> layers;
  std::optional<PayloadLayout> payload;
};

namespace {

constexpr float kFp4E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

class Loader {
 public:
  Loader(const V4Config& config, const Checkpoint& checkpoint, Backend& backend)
      : config_(config), checkpoint_(checkpoint), backend_(backend) {}

  // Float32 values of `name` (shape `shape`), dequantized when stored as FP8 (with `<base>.scale` over
  // weight_block_size blocks) or as packed FP4 experts (with `<base>.scale` per 32 inputs).
  Result<std::vector<float>> vector(const std::string& name, std::vector<int64_t> shape) {
    const TensorView* t = checkpoint_.find(name);
    if (t == nullptr) return missing(name);
    if (t->dtype == DType::kF8E4M3) return fp8(name, *t, shape);
    if (t->dtype == DType::kI8 || t->dtype == DType::kU8) return fp4(name, *t, shape);
    return checkpoint_.load_f32(name, shape);
  }
  Status vector(const std::string& name, std::vector<int64_t> shape, std::vector<float>& out) {
    Result<std::vector<float>> values = vector(name, std::move(shape));
    if (!values.ok()) return values.status();
    out = std::move(*values);
    return Status();
  }
  // A matrix [rows][cols] as `count` stacked matrices [rows / count][cols] (count > 1: o_groups of wo_a).
  Status linear(const std::string& name, int64_t rows, int64_t cols, Linear& out, int64_t count = 1) {
    Result<std::vector<float>> values = vector(name, {rows, cols});
    if (!values.ok()) return values.status();
    const int64_t part = rows / count;
    Result<std::unique_ptr<backend::Weight>> weight =
        backend_.make_weight(count, part, cols, backend::Precision::kF32);
    if (!weight.ok()) return weight.status();
    for (int64_t i = 0; i < count; ++i) {
      backend::HostMatrix host;
      host.rows = part;
      host.cols = cols;
      host.f32 = std::span<const float>(values->data() + i * part * cols, static_cast<size_t>(part * cols));
      DEEPINFER_RETURN_IF_ERROR(backend_.set_matrix(**weight, i, host));
    }
    out.weight = std::move(*weight);
    out.rows = part;
    out.cols = cols;
    return Status();
  }
  Status missing(const std::string& name) const {
    return Status::invalid_argument("DeepSeek-V4 checkpoint: missing tensor '" + name + "'");
  }
  const Checkpoint& checkpoint() const { return checkpoint_; }

 private:
  static std::string scale_name(const std::string& name) {
    const std::string suffix = ".weight";
    return (name.ends_with(suffix) ? name.substr(0, name.size() - suffix.size()) : name) + ".scale";
  }
  Status bad(const std::string& name, const std::string& problem) const {
    return Status::invalid_argument("DeepSeek-V4 checkpoint: tensor '" + name + "': " + problem);
  }
  static std::string shape_text(const std::vector<int64_t>& shape) {
    std::string text = "[";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
  }

  Result<std::vector<float>> fp8(const std::string& name, const TensorView& t, const std::vector<int64_t>& shape) {
    if (config_.weight_block_size.size() != 2) {
      return bad(name, "F8_E4M3 but config.json has no quantization_config (its weight_block_size)");
    }
    if (t.shape != shape || shape.size() != 2) {
      return bad(name, "F8_E4M3 shape " + shape_text(t.shape) + " differs from the expected " + shape_text(shape));
    }
    const int64_t rows = shape[0], cols = shape[1];
    const int64_t bn = config_.weight_block_size[0], bk = config_.weight_block_size[1];
    const std::string scale = scale_name(name);
    if (checkpoint_.find(scale) == nullptr) return bad(name, "F8_E4M3 without its block scales '" + scale + "'");
    std::vector<int64_t> scale_shape = {(rows + bn - 1) / bn, (cols + bk - 1) / bk};
    Result<std::vector<float>> scales = checkpoint_.load_f32(scale, scale_shape);
    if (!scales.ok()) return scales.status();
    std::vector<float> values(static_cast<size_t>(rows * cols));
    const uint8_t* q = reinterpret_cast<const uint8_t*>(t.data);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        values[r * cols + c] = f8_e4m3_to_f32(q[r * cols + c]) * (*scales)[(r / bn) * scale_shape[1] + c / bk];
      }
    }
    return values;
  }

  Result<std::vector<float>> fp4(const std::string& name, const TensorView& t, const std::vector<int64_t>& shape) {
    if (config_.expert_dtype != "fp4" || name.find(".experts.") == std::string::npos) {
      return bad(name, std::string(dtype_name(t.dtype)) +
                           ": packed FP4 is read only for routed experts of a checkpoint with expert_dtype \"fp4\"");
    }
    const int64_t rows = shape[0], cols = shape[1];
    if (shape.size() != 2 || cols % 32 != 0 || t.shape != std::vector<int64_t>{rows, cols / 2}) {
      return bad(name, "packed FP4 shape " + shape_text(t.shape) + " is not [out, in / 2] of the expected " +
                           shape_text(shape));
    }
    const std::string scale = scale_name(name);
    if (checkpoint_.find(scale) == nullptr) return bad(name, "packed FP4 without its scales '" + scale + "'");
    Result<std::vector<float>> scales = checkpoint_.load_f32(scale, std::vector<int64_t>{rows, cols / 32});
    if (!scales.ok()) return scales.status();
    std::vector<float> values(static_cast<size_t>(rows * cols));
    const uint8_t* q = reinterpret_cast<const uint8_t*>(t.data);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = q[r * (cols / 2) + c / 2];
        const uint8_t code = (c % 2 == 0) ? (byte & 0x0f) : (byte >> 4);  // the first value in the low nibble
        values[r * cols + c] = kFp4E2M1[code] * (*scales)[r * (cols / 32) + c / 32];
      }
    }
    return values;
  }

  const V4Config& config_;
  const Checkpoint& checkpoint_;
  Backend& backend_;
};

Status load_compressor(Loader& l, const V4Config& c, const std::string& prefix, int64_t ratio, int64_t dim,
                       CompressorWeights& w) {
  w.ratio = ratio;
  w.dim = dim;
  w.coff = ratio == 4 ? 2 : 1;
  DEEPINFER_RETURN_IF_ERROR(l.vector(prefix + "ape", {ratio, w.coff * dim}, w.ape));
  DEEPINFER_RETURN_IF_ERROR(l.linear(prefix + "wkv.weight", w.coff * dim, c.hidden_size, w.wkv));
  DEEPINFER_RETURN_IF_ERROR(l.linear(prefix + "wgate.weight", w.coff * dim, c.hidden_size, w.wgate));
  return l.vector(prefix + "norm.weight", {dim}, w.norm);
}

Status load_layer(Loader& l, const V4Config& c, int64_t i, LayerWeights& w) {
  const std::string p = "layers." + std::to_string(i) + ".";
  const int64_t d = c.hidden_size, H = c.num_attention_heads, D = c.head_dim, hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  w.ratio = c.compress_ratios[i];
  w.rope = w.ratio == 0 ? make_rope(c.qk_rope_head_dim, c.rope_theta, nullptr)
                        : make_rope(c.qk_rope_head_dim, c.compress_rope_theta, &c.rope_scaling);
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "attn_norm.weight", {d}, w.attn_norm));
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "ffn_norm.weight", {d}, w.ffn_norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear(p + "hc_attn_fn", mix, hc * d, w.hc_attn_fn));
  DEEPINFER_RETURN_IF_ERROR(l.linear(p + "hc_ffn_fn", mix, hc * d, w.hc_ffn_fn));
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "hc_attn_base", {mix}, w.hc_attn_base));
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "hc_ffn_base", {mix}, w.hc_ffn_base));
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "hc_attn_scale", {3}, w.hc_attn_scale));
  DEEPINFER_RETURN_IF_ERROR(l.vector(p + "hc_ffn_scale", {3}, w.hc_ffn_scale));

  const std::string a = p + "attn.";
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wq_a.weight", c.q_lora_rank, d, w.wq_a));
  DEEPINFER_RETURN_IF_ERROR(l.vector(a + "q_norm.weight", {c.q_lora_rank}, w.q_norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wq_b.weight", H * D, c.q_lora_rank, w.wq_b));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wkv.weight", D, d, w.wkv));
  DEEPINFER_RETURN_IF_ERROR(l.vector(a + "kv_norm.weight", {D}, w.kv_norm));
  DEEPINFER_RETURN_IF_ERROR(
      l.linear(a + "wo_a.weight", c.o_groups * c.o_lora_rank, H * D / c.o_groups, w.wo_a, c.o_groups));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wo_b.weight", d, c.o_groups * c.o_lora_rank, w.wo_b));
  DEEPINFER_RETURN_IF_ERROR(l.vector(a + "attn_sink", {H}, w.attn_sink));
  if (w.ratio != 0) {
    DEEPINFER_RETURN_IF_ERROR(load_compressor(l, c, a + "compressor.", w.ratio, D, w.compressor));
  }
  if (w.ratio == 4) {
    const int64_t hi = c.index_n_heads, di = c.index_head_dim;
    DEEPINFER_RETURN_IF_ERROR(l.linear(a + "indexer.wq_b.weight", hi * di, c.q_lora_rank, w.index_wq_b));
    DEEPINFER_RETURN_IF_ERROR(l.linear(a + "indexer.weights_proj.weight", hi, d, w.index_weights_proj));
    DEEPINFER_RETURN_IF_ERROR(load_compressor(l, c, a + "indexer.compressor.", 4, di, w.index_compressor));
  }

  const std::string f = p + "ffn.";
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
  DEEPINFER_RETURN_IF_ERROR(l.linear(f + "gate.weight", E, d, w.gate));
  if (i < c.num_hash_layers) {
    const std::string name = f + "gate.tid2eid";
    if (l.checkpoint().find(name) == nullptr) return l.missing(name);
    std::vector<int64_t> shape = {c.vocab_size, c.num_experts_per_tok};
    Result<std::vector<int64_t>> table = l.checkpoint().load_i64(name, shape);
    if (!table.ok()) return table.status();
    w.tid2eid.reserve(table->size());
    for (int64_t e : *table) {
      if (e < 0 || e >= E) {
        return Status::invalid_argument("DeepSeek-V4 checkpoint: tensor '" + name + "' holds expert " +
                                        std::to_string(e) + ", outside 0.." + std::to_string(E - 1));
      }
      w.tid2eid.push_back(static_cast<int32_t>(e));
    }
  } else {
    DEEPINFER_RETURN_IF_ERROR(l.vector(f + "gate.bias", {E}, w.gate_bias));
  }
  w.w1.resize(E + 1);
  w.w2.resize(E + 1);
  w.w3.resize(E + 1);
  for (int64_t e = 0; e <= E; ++e) {
    const std::string q = e < E ? f + "experts." + std::to_string(e) + "." : f + "shared_experts.";
    DEEPINFER_RETURN_IF_ERROR(l.linear(q + "w1.weight", I, d, w.w1[e]));
    DEEPINFER_RETURN_IF_ERROR(l.linear(q + "w2.weight", d, I, w.w2[e]));
    DEEPINFER_RETURN_IF_ERROR(l.linear(q + "w3.weight", I, d, w.w3[e]));
  }
  return Status();
}

}  // namespace

DeepSeekV4Model::DeepSeekV4Model(V4Config config, Backend& backend)
    : config_(std::move(config)), backend_(backend), w_(std::make_unique<Weights>()) {}

DeepSeekV4Model::~DeepSeekV4Model() = default;

Result<std::unique_ptr<DeepSeekV4Model>> DeepSeekV4Model::load(const std::filesystem::path& dir, Backend& backend) {
  if (backend.name() != "cpu") {
    return Status::unsupported("DeepSeek-V4 runs on the CPU backend only in this build (the " +
                               std::string(backend.name()) + " backend has no V4 kernels yet)");
  }
  Result<V4Config> config = load_v4_config(dir);
  if (!config.ok()) return config.status();
  Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  const V4Config& c = *config;
  std::unique_ptr<DeepSeekV4Model> model(new DeepSeekV4Model(c, backend));
  Weights& w = *model->w_;
  Loader l(c, **checkpoint, backend);
  const int64_t d = c.hidden_size, hc = c.hc_mult;
  DEEPINFER_RETURN_IF_ERROR(l.vector("embed.weight", {c.vocab_size, d}, w.embed));
  DEEPINFER_RETURN_IF_ERROR(l.linear("head.weight", c.vocab_size, d, w.head));
  DEEPINFER_RETURN_IF_ERROR(l.vector("norm.weight", {d}, w.norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear("hc_head_fn", hc, hc * d, w.hc_head_fn));
  DEEPINFER_RETURN_IF_ERROR(l.vector("hc_head_base", {hc}, w.hc_head_base));
  DEEPINFER_RETURN_IF_ERROR(l.vector("hc_head_scale", {1}, w.hc_head_scale));
  w.payload.emplace(c);
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) DEEPINFER_RETURN_IF_ERROR(load_layer(l, c, i, w.layers[i]));
  return model;
}

Result<ModelConfig> load_engine_model_config(const std::filesystem::path& path) {
  Result<std::string> type = read_model_type(path);
  if (!type.ok()) return type.status();
  if (*type != "deepseek_v4") return load_model_config(path);
  Result<V4Config> config = load_v4_config(path);
  if (!config.ok()) return config.status();
  return v4_engine_view(*config);
}

ModelConfig v4_engine_view(const V4Config& v) {
  ModelConfig c;
  c.model_type = v.model_type;
  c.vocab_size = v.vocab_size;
  c.hidden_size = v.hidden_size;
  c.moe_intermediate_size = v.moe_intermediate_size;
  c.num_hidden_layers = v.num_hidden_layers;
  c.num_attention_heads = v.num_attention_heads;
  c.num_key_value_heads = 1;
  c.n_routed_experts = v.n_routed_experts;
  c.num_experts_per_tok = v.num_experts_per_tok;
  c.n_shared_experts = v.n_shared_experts;
  c.routed_scaling_factor = v.routed_scaling_factor;
  c.q_lora_rank = v.q_lora_rank;
  c.qk_rope_head_dim = v.qk_rope_head_dim;
  c.max_position_embeddings = v.max_position_embeddings;
  c.rope_theta = v.rope_theta;
  c.rms_norm_eps = v.rms_norm_eps;
  c.bos_token_id = v.bos_token_id;
  c.eos_token_ids = v.eos_token_ids;
  c.num_nextn_predict_layers = 0;
  c.scoring_func = v.scoring_func;
  c.topk_method = "noaux_tc";
  return c;
}

std::vector<V4TensorSpec> v4_tensors(const V4Config& c) {
  const int64_t d = c.hidden_size, H = c.num_attention_heads, D = c.head_dim, hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc, E = c.n_routed_experts, I = c.moe_intermediate_size;
  std::vector<V4TensorSpec> t = {{"embed.weight", {c.vocab_size, d}},
                                 {"head.weight", {c.vocab_size, d}},
                                 {"norm.weight", {d}},
                                 {"hc_head_fn", {hc, hc * d}},
                                 {"hc_head_base", {hc}},
                                 {"hc_head_scale", {1}}};
  auto compressor = [&](const std::string& prefix, int64_t ratio, int64_t dim) {
    const int64_t width = (ratio == 4 ? 2 : 1) * dim;
    t.push_back({prefix + "ape", {ratio, width}});
    t.push_back({prefix + "wkv.weight", {width, d}});
    t.push_back({prefix + "wgate.weight", {width, d}});
    t.push_back({prefix + "norm.weight", {dim}});
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    for (const char* norm : {"attn_norm.weight", "ffn_norm.weight"}) t.push_back({p + norm, {d}});
    for (const char* kind : {"attn", "ffn"}) {
      t.push_back({p + "hc_" + kind + "_fn", {mix, hc * d}});
      t.push_back({p + "hc_" + kind + "_base", {mix}});
      t.push_back({p + "hc_" + kind + "_scale", {3}});
    }
    const std::string a = p + "attn.";
    t.push_back({a + "wq_a.weight", {c.q_lora_rank, d}});
    t.push_back({a + "q_norm.weight", {c.q_lora_rank}});
    t.push_back({a + "wq_b.weight", {H * D, c.q_lora_rank}});
    t.push_back({a + "wkv.weight", {D, d}});
    t.push_back({a + "kv_norm.weight", {D}});
    t.push_back({a + "wo_a.weight", {c.o_groups * c.o_lora_rank, H * D / c.o_groups}});
    t.push_back({a + "wo_b.weight", {d, c.o_groups * c.o_lora_rank}});
    t.push_back({a + "attn_sink", {H}});
    const int64_t ratio = c.compress_ratios[i];
    if (ratio != 0) compressor(a + "compressor.", ratio, D);
    if (ratio == 4) {
      t.push_back({a + "indexer.wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank}});
      t.push_back({a + "indexer.weights_proj.weight", {c.index_n_heads, d}});
      compressor(a + "indexer.compressor.", 4, c.index_head_dim);
    }
    const std::string f = p + "ffn.";
    t.push_back({f + "gate.weight", {E, d}});
    if (i < c.num_hash_layers) {
      t.push_back({f + "gate.tid2eid", {c.vocab_size, c.num_experts_per_tok}, true});
    } else {
      t.push_back({f + "gate.bias", {E}});
    }
    for (int64_t e = 0; e <= E; ++e) {
      const std::string q = e < E ? f + "experts." + std::to_string(e) + "." : f + "shared_experts.";
      t.push_back({q + "w1.weight", {I, d}});
      t.push_back({q + "w2.weight", {d, I}});
      t.push_back({q + "w3.weight", {I, d}});
    }
  }
  return t;
}

int64_t DeepSeekV4Model::window_bytes_per_sequence() const {
  return config_.num_hidden_layers * config_.sliding_window * config_.head_dim * 4;
}

int64_t DeepSeekV4Model::block_payload_floats() const { return w_->payload->total; }

int64_t DeepSeekV4Model::window_payload_floats() const { return w_->payload->window_total; }

int64_t DeepSeekV4Model::window_blocks() const { return (config_.sliding_window + 63) / 64; }

void DeepSeekV4Model::restore(V4Sequence& sequence, std::span<const float* const> blocks,
                              std::span<const float* const> windows) const {
  const V4Config& c = config_;
  const int64_t D = c.head_dim, DI = c.index_head_dim, W = c.sliding_window;
  const int64_t P = 64 * static_cast<int64_t>(blocks.size());
  const bool replay = windows.empty() && P > 0;
  DEEPINFER_CHECK(replay || static_cast<int64_t>(windows.size()) == std::min<int64_t>(window_blocks(), P / 64),
                  "restore takes the window payloads of the last window's blocks, or none");
  DEEPINFER_CHECK(!replay || P > W, "a bounded replay restores a prefix longer than the window");
  sequence.layers_.assign(static_cast<size_t>(c.num_hidden_layers), V4Sequence::Layer{});
  const int64_t first_window_block = P / 64 - static_cast<int64_t>(windows.size());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const PayloadLayout::Layer& part = w_->payload->layers[l];
    V4Sequence::Layer& layer = sequence.layers_[l];
    layer.window.assign(static_cast<size_t>(W * D), 0.0f);
    for (int64_t p = replay ? P : std::max<int64_t>(0, P - W); p < P; ++p) {
      const float* rows = windows[static_cast<size_t>(p / 64 - first_window_block)] + part.window_offset;
      std::copy_n(rows + (p % 64) * D, D, layer.window.data() + (p % W) * D);
    }
    const int64_t m = c.compress_ratios[l];
    auto rows = [&](V4Sequence::Compressor& state, int64_t at, int64_t width, int64_t capacity, int64_t ratio) {
      if (replay) {
        state.first_row = P - W;  // the replay feeds the compressor its rows again (no entries: they are restored)
        return;
      }
      const int64_t count = P == 0 ? 0 : kept_rows(ratio, P);
      state.first_row = P - count;
      if (count == 0) return;
      const float* in = windows.back() + part.window_offset + at;
      state.kv.assign(in, in + count * width);
      state.score.assign(in + capacity * width, in + capacity * width + count * width);
    };
    if (m != 0) {
      for (int64_t j = 0; j < P / m; ++j) {
        const int64_t block = (j * m) / 64 + (m > 64 ? 1 : 0);  // the block whose end finishes entry j
        const int64_t slot = m > 64 ? 0 : j - (block * 64) / m;
        const float* entry = blocks[static_cast<size_t>(block)] + part.offset + part.entries + slot * D;
        layer.attention.entries.insert(layer.attention.entries.end(), entry, entry + D);
      }
      rows(layer.attention, part.rows, part.row_width, std::min<int64_t>(m, 64), m);
    }
    if (m == 4) {
      for (size_t b = 0; b < blocks.size(); ++b) {
        const float* keys = blocks[b] + part.offset + part.index_entries;
        layer.indexer.entries.insert(layer.indexer.entries.end(), keys, keys + 16 * DI);
      }
      rows(layer.indexer, part.index_rows, part.index_width, 4, 4);
    }
  }
  // A bounded replay feeds the last W tokens again (forward() computes their window rows only).
  sequence.length_ = replay ? P - W : P;
  sequence.window_start_ = replay ? P - W : 0;
  sequence.replay_end_ = replay ? P : 0;
}

std::unique_ptr<V4Sequence> DeepSeekV4Model::new_sequence() const {
  auto sequence = std::make_unique<V4Sequence>();
  sequence->layers_.resize(static_cast<size_t>(config_.num_hidden_layers));
  for (V4Sequence::Layer& layer : sequence->layers_) {
    layer.window.assign(static_cast<size_t>(config_.sliding_window * config_.head_dim), 0.0f);
  }
  return sequence;
}

namespace detail {

// The forward pass over one batch; member functions are its steps.
class V4Forward {
 public:
  struct Row {
    int32_t token = 0;
    int64_t position = 0;
    size_t chunk = 0;
  };
  V4Forward(const V4Config& c, Backend& backend, const PayloadLayout* payload) : c_(c), backend_(backend), payload_(payload) {}

  // y[T][w.rows] = x[T][w.cols] · wᵀ (x row stride x_stride).
  void linear(const Linear& w, const float* x, int64_t rows, int64_t x_stride, float* y) {
    if (rows == 0) return;
    Tensor xt{const_cast<float*>(x), backend::DType::kF32, rows, w.cols, x_stride};
    Tensor yt{y, backend::DType::kF32, rows, w.rows, w.rows};
    backend_.linear(xt, *w.weight, yt);
  }
  std::vector<float> linear(const Linear& w, const std::vector<float>& x, int64_t rows) {
    std::vector<float> y(static_cast<size_t>(rows * w.rows));
    linear(w, x.data(), rows, w.cols, y.data());
    return y;
  }

  // model.py Block.hc_pre + hc_split_sinkhorn: from the streams X [T][hc][d], the sublayer input y [T][d], and the
  // post [T][hc] and comb [T][hc][hc] weights hc_post needs.
  void hc_pre(const std::vector<float>& X, int64_t T, const Linear& fn, const std::vector<float>& scale,
              const std::vector<float>& base, std::vector<float>& y, std::vector<float>& post,
              std::vector<float>& comb) {
    const int64_t hc = c_.hc_mult, d = c_.hidden_size, mix = (2 + hc) * hc;
    std::vector<float> mixes = linear(fn, X, T);
    y.assign(static_cast<size_t>(T * d), 0.0f);
    post.resize(static_cast<size_t>(T * hc));
    comb.resize(static_cast<size_t>(T * hc * hc));
    const double eps = c_.hc_eps;
    for (int64_t t = 0; t < T; ++t) {
      const float* x = X.data() + t * hc * d;
      double sum = 0.0;
      for (int64_t i = 0; i < hc * d; ++i) sum += static_cast<double>(x[i]) * x[i];
      const double rs = 1.0 / std::sqrt(sum / static_cast<double>(hc * d) + c_.rms_norm_eps);
      const float* m = mixes.data() + t * mix;
      std::vector<double> pre(hc), cm(hc * hc);
      for (int64_t j = 0; j < hc; ++j) {
        pre[j] = sigmoid(m[j] * rs * scale[0] + base[j]) + eps;
        post[t * hc + j] = static_cast<float>(2.0 * sigmoid(m[hc + j] * rs * scale[1] + base[hc + j]));
      }
      for (int64_t i = 0; i < hc; ++i) {  // row softmax + eps
        double mx = -INFINITY;
        for (int64_t j = 0; j < hc; ++j) {
          cm[i * hc + j] = m[2 * hc + i * hc + j] * rs * scale[2] + base[2 * hc + i * hc + j];
          mx = std::max(mx, cm[i * hc + j]);
        }
        double s = 0.0;
        for (int64_t j = 0; j < hc; ++j) s += (cm[i * hc + j] = std::exp(cm[i * hc + j] - mx));
        for (int64_t j = 0; j < hc; ++j) cm[i * hc + j] = cm[i * hc + j] / s + eps;
      }
      auto normalize_columns = [&] {
        for (int64_t j = 0; j < hc; ++j) {
          double s = 0.0;
          for (int64_t i = 0; i < hc; ++i) s += cm[i * hc + j];
          for (int64_t i = 0; i < hc; ++i) cm[i * hc + j] /= s + eps;
        }
      };
      normalize_columns();
      for (int64_t it = 1; it < c_.hc_sinkhorn_iters; ++it) {
        for (int64_t i = 0; i < hc; ++i) {
          double s = 0.0;
          for (int64_t j = 0; j < hc; ++j) s += cm[i * hc + j];
          for (int64_t j = 0; j < hc; ++j) cm[i * hc + j] /= s + eps;
        }
        normalize_columns();
      }
      for (int64_t k = 0; k < hc * hc; ++k) comb[t * hc * hc + k] = static_cast<float>(cm[k]);
      float* out = y.data() + t * d;
      for (int64_t k = 0; k < d; ++k) {
        double acc = 0.0;
        for (int64_t j = 0; j < hc; ++j) acc += pre[j] * x[j * d + k];
        out[k] = static_cast<float>(acc);
      }
    }
  }

  // model.py Block.hc_post: X'[j] = post[j] · out + Σ_i comb[i][j] · X[i].
  void hc_post(std::vector<float>& X, int64_t T, const std::vector<float>& out, const std::vector<float>& post,
               const std::vector<float>& comb) {
    const int64_t hc = c_.hc_mult, d = c_.hidden_size;
    std::vector<float> next(static_cast<size_t>(hc * d));
    for (int64_t t = 0; t < T; ++t) {
      float* x = X.data() + t * hc * d;
      const float* cm = comb.data() + t * hc * hc;
      for (int64_t j = 0; j < hc; ++j) {
        for (int64_t k = 0; k < d; ++k) {
          double acc = static_cast<double>(post[t * hc + j]) * out[t * d + k];
          for (int64_t i = 0; i < hc; ++i) acc += static_cast<double>(cm[i * hc + j]) * x[i * d + k];
          next[j * d + k] = static_cast<float>(acc);
        }
      }
      std::copy(next.begin(), next.end(), x);
    }
  }

  // model.py Compressor.forward for one sequence's chunk: appends the chunk's raw rows to the state and finishes
  // every block the chunk completes (entry j = block j: softmax over the block's tokens per channel of score + ape,
  // weighted sum of kv; overlapped: block j-1's first half of the channels with block j's second half), then
  // RMSNorm and rope at position j * m.
  // `snapshot(boundary, kv_rows, score_rows, count)`: called for each multiple of 64 in (start, start + n] with the
  // rows kept there (a block payload's compressor rows).
  using Snapshot = std::function<void(int64_t, const float*, const float*, int64_t)>;
  void compress(const CompressorWeights& w, const Rope& rope, V4Sequence::Compressor& state, const float* x,
                int64_t n, int64_t start, const Snapshot& snapshot = {}) {
    const int64_t m = w.ratio, dim = w.dim, width = w.coff * dim, R = c_.qk_rope_head_dim;
    std::vector<float> kv(static_cast<size_t>(n * width)), score(static_cast<size_t>(n * width));
    linear(w.wkv, x, n, c_.hidden_size, kv.data());
    linear(w.wgate, x, n, c_.hidden_size, score.data());
    for (int64_t i = 0; i < n; ++i) {
      const float* ape = w.ape.data() + ((start + i) % m) * width;
      for (int64_t k = 0; k < width; ++k) score[i * width + k] += ape[k];
    }
    state.kv.insert(state.kv.end(), kv.begin(), kv.end());
    state.score.insert(state.score.end(), score.begin(), score.end());
    const int64_t end = start + n;
    auto row = [&](const std::vector<float>& rows, int64_t position) {
      return rows.data() + (position - state.first_row) * width;
    };
    std::vector<float> entry(static_cast<size_t>(dim));
    // From the first entry not made yet: start / m, except in a bounded replay, whose entries were restored.
    const int64_t made = static_cast<int64_t>(state.entries.size()) / dim;
    for (int64_t j = std::max(start / m, made); (j + 1) * m <= end; ++j) {
      for (int64_t ch = 0; ch < dim; ++ch) {
        double mx = -INFINITY;
        const bool previous = w.coff == 2 && j > 0;
        const int64_t own = w.coff == 2 ? dim + ch : ch;
        for (int64_t t = 0; t < m; ++t) {
          mx = std::max<double>(mx, row(state.score, j * m + t)[own]);
          if (previous) mx = std::max<double>(mx, row(state.score, (j - 1) * m + t)[ch]);
        }
        double sum = 0.0, acc = 0.0;
        for (int64_t t = 0; t < m; ++t) {
          double e = std::exp(row(state.score, j * m + t)[own] - mx);
          sum += e;
          acc += e * row(state.kv, j * m + t)[own];
          if (previous) {
            double ep = std::exp(row(state.score, (j - 1) * m + t)[ch] - mx);
            sum += ep;
            acc += ep * row(state.kv, (j - 1) * m + t)[ch];
          }
        }
        entry[ch] = static_cast<float>(acc / sum);
      }
      rms_norm(entry.data(), dim, w.norm.data(), c_.rms_norm_eps, entry.data());
      rope.apply(entry.data() + dim - R, j * m);
      state.entries.insert(state.entries.end(), entry.begin(), entry.end());
    }
    if (snapshot) {
      for (int64_t b = (start / 64 + 1) * 64; b <= end; b += 64) {
        const int64_t count = kept_rows(m, b);
        snapshot(b, row(state.kv, b - count), row(state.score, b - count), count);
      }
    }
    // Keep the unfinished block's rows, and (overlapped) the last finished block's.
    int64_t keep = (end / m) * m;
    if (w.coff == 2) keep = std::max<int64_t>(0, keep - m);
    keep = std::max(keep, state.first_row);
    state.kv.erase(state.kv.begin(), state.kv.begin() + (keep - state.first_row) * width);
    state.score.erase(state.score.begin(), state.score.begin() + (keep - state.first_row) * width);
    state.first_row = keep;
  }

  // model.py Attention.forward (with Indexer.forward on CSA layers) for every row; returns [T][d].
  std::vector<float> attention(const LayerWeights& w, int64_t layer, const std::vector<float>& x,
                               std::span<const DeepSeekV4Model::Chunk> chunks, const std::vector<Row>& rows) {
    const int64_t T = static_cast<int64_t>(rows.size()), d = c_.hidden_size, H = c_.num_attention_heads;
    const int64_t D = c_.head_dim, R = c_.qk_rope_head_dim, W = c_.sliding_window;
    const double eps = c_.rms_norm_eps;
    std::vector<float> qr = linear(w.wq_a, x, T);
    for (int64_t t = 0; t < T; ++t) {
      rms_norm(qr.data() + t * c_.q_lora_rank, c_.q_lora_rank, w.q_norm.data(), eps, qr.data() + t * c_.q_lora_rank);
    }
    std::vector<float> q = linear(w.wq_b, qr, T);
    std::vector<float> kv = linear(w.wkv, x, T);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float* qh = q.data() + (t * H + h) * D;
        rms_norm(qh, D, nullptr, eps, qh);
        w.rope.apply(qh + D - R, rows[t].position);
      }
      float* k = kv.data() + t * D;
      rms_norm(k, D, w.kv_norm.data(), eps, k);
      w.rope.apply(k + D - R, rows[t].position);
    }
    // Indexer queries and head weights (CSA layers).
    const int64_t HI = c_.index_n_heads, DI = c_.index_head_dim;
    std::vector<float> index_q, index_weight;
    if (w.ratio == 4) {
      index_q = linear(w.index_wq_b, qr, T);
      index_weight = linear(w.index_weights_proj, x, T);
      const double head_scale = 1.0 / std::sqrt(static_cast<double>(DI)) / std::sqrt(static_cast<double>(HI));
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < HI; ++h) w.rope.apply(index_q.data() + (t * HI + h) * DI + DI - R, rows[t].position);
        for (int64_t h = 0; h < HI; ++h) index_weight[t * HI + h] = static_cast<float>(index_weight[t * HI + h] * head_scale);
      }
    }

    std::vector<float> o(static_cast<size_t>(T * H * D), 0.0f);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    int64_t r0 = 0;
    for (const DeepSeekV4Model::Chunk& chunk : chunks) {
      const int64_t n = static_cast<int64_t>(chunk.token_ids.size());
      V4Sequence::Layer& state = chunk.sequence->layers_[layer];
      const int64_t start = chunk.sequence->length_;
      // A bounded replay's rows (positions before replay_end_) rebuild the window and the compressors' rows only:
      // the entries and indexer keys were restored as of replay_end_. Its window starts at window_start_.
      const bool replaying = start < chunk.sequence->replay_end_;
      const int64_t window_start = chunk.sequence->window_start_;
      // The raw KV rows the chunk's windows reach: positions [lo, start + n).
      const int64_t lo = std::max<int64_t>(window_start, start - (W - 1));
      std::vector<float> raw(static_cast<size_t>((start + n - lo) * D));
      for (int64_t p = lo; p < start; ++p) {
        std::copy_n(state.window.data() + (p % W) * D, D, raw.data() + (p - lo) * D);
      }
      std::copy_n(kv.data() + r0 * D, n * D, raw.data() + (start - lo) * D);
      // Payloads of the blocks this chunk finishes: this layer's part (a replay writes only window payloads: the
      // block payloads are the cached ones).
      const PayloadLayout::Layer* part = chunk.completed_blocks.empty() ? nullptr : &payload_->layers[layer];
      auto destination = [&](int64_t boundary) {
        return chunk.completed_blocks[static_cast<size_t>(boundary / 64 - start / 64 - 1)] + part->offset;
      };
      // The block's window payload (this layer's part), or null when it is not written.
      auto window_destination = [&](int64_t boundary) -> float* {
        const size_t index = static_cast<size_t>(boundary / 64 - start / 64 - 1);
        if (index >= chunk.completed_windows.size() || chunk.completed_windows[index] == nullptr) return nullptr;
        return chunk.completed_windows[index] + part->window_offset;
      };
      auto rows_to = [&](int64_t at, int64_t width, int64_t capacity) -> Snapshot {
        if (part == nullptr) return {};
        return [=, &window_destination](int64_t boundary, const float* kv_rows, const float* score_rows, int64_t count) {
          float* out = window_destination(boundary);
          if (out == nullptr) return;
          out += at;
          std::copy_n(kv_rows, count * width, out);
          std::copy_n(score_rows, count * width, out + capacity * width);
        };
      };
      if (w.ratio != 0) {
        compress(w.compressor, w.rope, state.attention, x.data() + r0 * d, n, start,
                 rows_to(part ? part->rows : 0, w.compressor.coff * D, std::min<int64_t>(w.ratio, 64)));
      }
      if (w.ratio == 4) {
        compress(w.index_compressor, w.rope, state.indexer, x.data() + r0 * d, n, start,
                 rows_to(part ? part->index_rows : 0, 2 * DI, 4));
      }
      if (part != nullptr) {
        for (int64_t b = (start / 64 + 1) * 64; b <= start + n; b += 64) {
          if (float* window_out = window_destination(b)) {
            std::copy_n(raw.data() + (b - 64 - lo) * D, 64 * D, window_out);
          }
          if (replaying) continue;
          float* out = destination(b);
          if (w.ratio != 0) {
            // The entries finished inside block [b - 64, b): indices [(b - 64) / m, b / m).
            for (int64_t j = (b - 64) / w.ratio; j < b / w.ratio; ++j) {
              std::copy_n(state.attention.entries.data() + j * D, D, out + part->entries + (j - (b - 64) / w.ratio) * D);
            }
          }
          if (w.ratio == 4) {
            std::copy_n(state.indexer.entries.data() + ((b - 64) / 4) * DI, 16 * DI, out + part->index_entries);
          }
        }
      }

      std::vector<const float*> keys;
      std::vector<double> scores, acc(static_cast<size_t>(D));
      std::vector<std::pair<double, int64_t>> ranked;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = r0 + i, p = start + i;
        keys.clear();
        for (int64_t s = std::max<int64_t>(window_start, p - (W - 1)); s <= p; ++s) {
          keys.push_back(raw.data() + (s - lo) * D);
        }
        if (w.ratio != 0) {
          const int64_t visible = (p + 1) / w.ratio;
          const float* entries = state.attention.entries.data();
          if (w.ratio == 4 && visible > c_.index_topk) {
            // Lightning indexer: score[s] = Σ_h relu(q_h · k_s) · weight_h over visible entries; top index_topk.
            ranked.clear();
            const float* index_keys = state.indexer.entries.data();
            for (int64_t s = 0; s < visible; ++s) {
              double score = 0.0;
              for (int64_t h = 0; h < HI; ++h) {
                const float* qh = index_q.data() + (t * HI + h) * DI;
                double dot = 0.0;
                for (int64_t k = 0; k < DI; ++k) dot += static_cast<double>(qh[k]) * index_keys[s * DI + k];
                score += std::max(dot, 0.0) * index_weight[t * HI + h];
              }
              ranked.emplace_back(score, s);
            }
            std::partial_sort(ranked.begin(), ranked.begin() + c_.index_topk, ranked.end(),
                              [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
            for (int64_t k = 0; k < c_.index_topk; ++k) keys.push_back(entries + ranked[k].second * D);
          } else {
            for (int64_t s = 0; s < visible; ++s) keys.push_back(entries + s * D);
          }
        }
        // sparse_attn: softmax over the keys' scores with the head's sink in the denominator; V = K.
        scores.resize(keys.size());
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = q.data() + (t * H + h) * D;
          double mx = w.attn_sink[h];
          for (size_t s = 0; s < keys.size(); ++s) {
            double dot = 0.0;
            for (int64_t k = 0; k < D; ++k) dot += static_cast<double>(qh[k]) * keys[s][k];
            scores[s] = dot * scale;
            mx = std::max(mx, scores[s]);
          }
          double sum = std::exp(w.attn_sink[h] - mx);
          std::fill(acc.begin(), acc.end(), 0.0);
          for (size_t s = 0; s < keys.size(); ++s) {
            double e = std::exp(scores[s] - mx);
            sum += e;
            for (int64_t k = 0; k < D; ++k) acc[k] += e * keys[s][k];
          }
          float* oh = o.data() + (t * H + h) * D;
          for (int64_t k = 0; k < D; ++k) oh[k] = static_cast<float>(acc[k] / sum);
          w.rope.apply(oh + D - R, p, /*inverse=*/true);
        }
      }
      for (int64_t p = std::max(start, start + n - W); p < start + n; ++p) {
        std::copy_n(kv.data() + (r0 + p - start) * D, D, state.window.data() + (p % W) * D);
      }
      r0 += n;
    }
    // Grouped low-rank output: per group g, z_g = wo_a[g] · o_g; then wo_b.
    const int64_t G = c_.o_groups, L = c_.o_lora_rank;
    std::vector<float> z(static_cast<size_t>(T * G * L));
    Tensor ot{o.data(), backend::DType::kF32, T, H * D, H * D};
    Tensor zt{z.data(), backend::DType::kF32, T, G * L, G * L};
    backend_.linear_heads(ot, H * D / G, *w.wo_a.weight, zt, L);
    return linear(w.wo_b, z, T);
  }

  // model.py MoE.forward with Gate and Expert: routed experts by hash table or top-k of score + bias, plus the
  // shared expert; SwiGLU clamped at swiglu_limit.
  std::vector<float> moe(const LayerWeights& w, int64_t layer, const std::vector<float>& x, const std::vector<Row>& rows) {
    const int64_t T = static_cast<int64_t>(rows.size()), d = c_.hidden_size, E = c_.n_routed_experts;
    const int64_t K = c_.num_experts_per_tok;
    std::vector<float> logits = linear(w.gate, x, T);
    std::vector<std::vector<std::pair<int64_t, double>>> routed(static_cast<size_t>(E));  // per expert: (row, weight)
    std::vector<double> scores(static_cast<size_t>(E));
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t t = 0; t < T; ++t) {
      const float* g = logits.data() + t * E;
      if (c_.scoring_func == "softmax") {
        double mx = *std::max_element(g, g + E), sum = 0.0;
        for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(g[e] - mx));
        for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
      } else if (c_.scoring_func == "sigmoid") {
        for (int64_t e = 0; e < E; ++e) scores[e] = sigmoid(g[e]);
      } else {  // sqrt(softplus), softplus as torch computes it (linear above 20)
        for (int64_t e = 0; e < E; ++e) scores[e] = std::sqrt(g[e] > 20.0f ? g[e] : std::log1p(std::exp(static_cast<double>(g[e]))));
      }
      std::vector<int64_t> chosen(static_cast<size_t>(K));
      if (layer < c_.num_hash_layers) {
        for (int64_t k = 0; k < K; ++k) chosen[k] = w.tid2eid[static_cast<size_t>(rows[t].token) * K + k];
      } else {
        std::iota(order.begin(), order.end(), 0);
        auto biased = [&](int64_t e) { return scores[e] + w.gate_bias[e]; };
        std::partial_sort(order.begin(), order.begin() + K, order.end(),
                          [&](int64_t a, int64_t b) { return biased(a) > biased(b) || (biased(a) == biased(b) && a < b); });
        std::copy_n(order.begin(), K, chosen.begin());
      }
      double total = 0.0;
      for (int64_t e : chosen) total += scores[e];
      for (int64_t e : chosen) {
        double weight = c_.scoring_func == "softmax" ? scores[e] : scores[e] / total;
        routed[e].emplace_back(t, weight * c_.routed_scaling_factor);
      }
    }
    std::vector<float> y(static_cast<size_t>(T * d), 0.0f);
    auto expert = [&](int64_t e, const std::vector<std::pair<int64_t, double>>& members) {
      const int64_t n = static_cast<int64_t>(members.size());
      if (n == 0) return;
      const int64_t I = c_.moe_intermediate_size;
      std::vector<float> in(static_cast<size_t>(n * d));
      for (int64_t i = 0; i < n; ++i) std::copy_n(x.data() + members[i].first * d, d, in.data() + i * d);
      std::vector<float> gate = linear(w.w1[e], in, n), up = linear(w.w3[e], in, n);
      const double limit = c_.swiglu_limit;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t k = 0; k < I; ++k) {
          double gv = gate[i * I + k], uv = up[i * I + k];
          if (limit > 0.0) {
            uv = std::clamp(uv, -limit, limit);
            gv = std::min(gv, limit);
          }
          gate[i * I + k] = static_cast<float>(gv / (1.0 + std::exp(-gv)) * uv * members[i].second);
        }
      }
      std::vector<float> out = linear(w.w2[e], gate, n);
      for (int64_t i = 0; i < n; ++i) {
        float* dst = y.data() + members[i].first * d;
        for (int64_t k = 0; k < d; ++k) dst[k] += out[i * d + k];
      }
    };
    for (int64_t e = 0; e < E; ++e) expert(e, routed[e]);
    std::vector<std::pair<int64_t, double>> everyone(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) everyone[t] = {t, 1.0};
    expert(E, everyone);
    return y;
  }

 private:
  const V4Config& c_;
  Backend& backend_;
  const PayloadLayout* payload_;
};

}  // namespace detail

Status DeepSeekV4Model::forward(std::span<const Chunk> chunks, std::vector<float>& logits) {
  const V4Config& c = config_;
  std::set<const V4Sequence*> seen;
  std::vector<detail::V4Forward::Row> rows;
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& chunk = chunks[i];
    if (chunk.sequence == nullptr || chunk.token_ids.empty()) {
      return Status::invalid_argument("DeepSeek-V4 forward: chunk " + std::to_string(i) + " has no sequence or no tokens");
    }
    if (!seen.insert(chunk.sequence).second) {
      return Status::invalid_argument("DeepSeek-V4 forward: a sequence appears twice in one batch");
    }
    if (chunk.sequence->layers_.size() != static_cast<size_t>(c.num_hidden_layers)) {
      return Status::invalid_argument("DeepSeek-V4 forward: the sequence was not made by this model's new_sequence()");
    }
    const int64_t n = static_cast<int64_t>(chunk.token_ids.size());
    const int64_t replay_end = chunk.sequence->replay_end_;
    if (chunk.sequence->length_ < replay_end && chunk.sequence->length_ + n != replay_end) {
      return Status::invalid_argument("DeepSeek-V4 forward: a sequence restored for a bounded replay takes the " +
                                      std::to_string(chunk.sequence->replay_end_ - chunk.sequence->length_) +
                                      " replayed tokens as one chunk, got " + std::to_string(n));
    }
    if (chunk.sequence->length_ + n > c.max_position_embeddings) {
      return Status::invalid_argument("DeepSeek-V4 forward: positions up to " +
                                      std::to_string(chunk.sequence->length_ + n) + " exceed max_position_embeddings " +
                                      std::to_string(c.max_position_embeddings));
    }
    for (int64_t k = 0; k < n; ++k) {
      int32_t id = chunk.token_ids[k];
      if (id < 0 || id >= c.vocab_size) {
        return Status::invalid_argument("DeepSeek-V4 forward: token id " + std::to_string(id) +
                                        " is outside the vocabulary (" + std::to_string(c.vocab_size) + ")");
      }
      if (chunk.logits == Logits::kAll || (chunk.logits == Logits::kLast && k == n - 1)) wanted.push_back(static_cast<int64_t>(rows.size()));
      rows.push_back({id, chunk.sequence->length_ + k, i});
    }
  }
  const int64_t T = static_cast<int64_t>(rows.size()), d = c.hidden_size, hc = c.hc_mult;
  detail::V4Forward f(c, backend_, &*w_->payload);
  // Embedding, copied into every stream.
  std::vector<float> X(static_cast<size_t>(T * hc * d));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < hc; ++j) std::copy_n(w_->embed.data() + rows[t].token * d, d, X.data() + (t * hc + j) * d);
  }
  std::vector<float> y, post, comb;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& w = w_->layers[l];
    f.hc_pre(X, T, w.hc_attn_fn, w.hc_attn_scale, w.hc_attn_base, y, post, comb);
    for (int64_t t = 0; t < T; ++t) rms_norm(y.data() + t * d, d, w.attn_norm.data(), c.rms_norm_eps, y.data() + t * d);
    std::vector<float> out = f.attention(w, l, y, chunks, rows);
    f.hc_post(X, T, out, post, comb);
    f.hc_pre(X, T, w.hc_ffn_fn, w.hc_ffn_scale, w.hc_ffn_base, y, post, comb);
    for (int64_t t = 0; t < T; ++t) rms_norm(y.data() + t * d, d, w.ffn_norm.data(), c.rms_norm_eps, y.data() + t * d);
    out = f.moe(w, l, y, rows);
    f.hc_post(X, T, out, post, comb);
  }
  for (const Chunk& chunk : chunks) chunk.sequence->length_ += static_cast<int64_t>(chunk.token_ids.size());

  // model.py Block.hc_head (sigmoid pre-weights, no Sinkhorn), the final norm and the head, on the wanted rows.
  const int64_t n = static_cast<int64_t>(wanted.size());
  std::vector<float> streams(static_cast<size_t>(n * hc * d));
  for (int64_t i = 0; i < n; ++i) std::copy_n(X.data() + wanted[i] * hc * d, hc * d, streams.data() + i * hc * d);
  std::vector<float> mixes = f.linear(w_->hc_head_fn, streams, n);
  std::vector<float> h(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n; ++i) {
    const float* x = streams.data() + i * hc * d;
    double sum = 0.0;
    for (int64_t k = 0; k < hc * d; ++k) sum += static_cast<double>(x[k]) * x[k];
    const double rs = 1.0 / std::sqrt(sum / static_cast<double>(hc * d) + c.rms_norm_eps);
    std::vector<double> pre(static_cast<size_t>(hc));
    for (int64_t j = 0; j < hc; ++j) {
      pre[j] = sigmoid(mixes[i * hc + j] * rs * w_->hc_head_scale[0] + w_->hc_head_base[j]) + c.hc_eps;
    }
    for (int64_t k = 0; k < d; ++k) {
      double acc = 0.0;
      for (int64_t j = 0; j < hc; ++j) acc += pre[j] * x[j * d + k];
      h[i * d + k] = static_cast<float>(acc);
    }
    rms_norm(h.data() + i * d, d, w_->norm.data(), c.rms_norm_eps, h.data() + i * d);
  }
  logits = f.linear(w_->head, h, n);
  return Status();
}

}  // namespace deepinfer::model

