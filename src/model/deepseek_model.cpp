// DeepSeek V2/V3 forward pass over the backend interface. Attention runs in MLA's absorbed form: queries are
// mapped into the latent space with W_UK, attention reads only the cached latent + rope key, and W_UV maps the
// result back (DeepSeek-V2 paper §2.1.3, "absorbed" inference). A backend with an expanded-form kernel may take a
// step whose sequences all start at position 0 (a prefill with nothing cached) in the expanded form instead.
#include "deepinfer/model/deepseek_model.h"

#include "deepinfer/core/types.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <span>
#include <string>

#include "deepinfer/backend/kv_block_copy.h"
#include "deepinfer/backend/moe_routing.h"
#include "deepinfer/core/check.h"
#include "deepinfer/model/expert_placement.h"
#include "deepinfer/model/safetensors.h"

namespace deepinfer::model {

using backend::Buffer;
using backend::MoeRoutingRule;
using backend::Precision;
using backend::Tensor;
using backend::Weight;
using WeightPtr = std::unique_ptr<Weight>;

namespace {
constexpr int64_t kBlockTokens = ::deepinfer::kBlockTokens;  // core/types.h
// Decode steps pad their block tables to a power of two of at least this many blocks (1024 tokens), so that a
// growing context keeps its CUDA graph until it doubles (one graph per bucket, not per block).
constexpr int64_t kMinGraphBlocks = 16;
// Steps of at most this many rows run the shared experts on the backend's side lane (Backend::begin_side_lane),
// beside the routed ones, and the latent's projection (kv_a) beside the queries'. The bound was measured for the
// shared experts on an H100 with the lane up to 1,024 rows (bench/gpu/NOTES.md, 2026-12-05):
// V2-Lite decode -0.2 ms at batch 1, 8 and 64, but +0.35 ms at 256, the V3 slice +0.15 ms at 64 and its 512-token
// chunks +2%: where both paths fill the GPU they compete. Then on an H200 with the lane up to 32 rows (2026-12-06):
// V2-Lite -0.19 ms at batch 1 and -0.17 at 8, but +0.62 ms at 32, the V3 slice +0.17 ms at 32; and on an H100 up
// to 16 rows: V2-Lite -0.21 / -0.20 / -0.13 ms at 1 / 8 / 16, the V3 slice (one 2,048-wide shared expert) even at
// 1 and 8 but +0.11 ms (+2.8%) at 16. So 8 rows. SGLang's alt_stream threshold is 1,024 tokens.
constexpr int64_t kSideLaneMaxRows = 8;
// Steps recorded as graphs (DeepSeekModel::set_use_graphs): few rows, few per sequence.
bool graph_sized(int64_t rows, std::span<const SequenceChunk> sequences) {
  return rows <= DeepSeekModel::kGraphMaxRows &&
         std::all_of(sequences.begin(), sequences.end(), [](const SequenceChunk& chunk) {
           return chunk.num_tokens <= DeepSeekModel::kGraphMaxRowsPerSequence;
         });
}
// Their block tables' stride: the power-of-two bucket (from kMinGraphBlocks) of the longest table.
int64_t graph_table_stride(std::span<const SequenceChunk> sequences) {
  int64_t stride = kMinGraphBlocks;
  for (const SequenceChunk& chunk : sequences) {
    while (stride < static_cast<int64_t>(chunk.block_table.size())) stride *= 2;
  }
  return stride;
}
// GraphKey::owner of each model: distinct for every model ever made, so that a new model at a dead one's address
// never replays the dead one's graphs.
std::atomic<uint64_t> next_graph_owner{1};
}

struct Mlp {
  WeightPtr gate_up;  // [2 * intermediate, hidden]: gate rows then up rows
  WeightPtr down;     // [hidden, intermediate]
};

struct Layer {
  Buffer input_layernorm, post_attention_layernorm;
  // Attention.
  WeightPtr q_proj;  // V2-Lite: [H * qk_head_dim, hidden]
  WeightPtr q_a_proj, q_b_proj;
  Buffer q_a_layernorm;
  WeightPtr kv_a_proj_with_mqa;  // [C + R, hidden]
  Buffer kv_a_layernorm;
  WeightPtr w_uk_t;  // H stacked [C, qk_nope]: maps q_nope into the latent space
  WeightPtr w_uv;    // H stacked [v_head, C]
  WeightPtr kv_b;    // [H * (nope + v), C], kept only for a backend with the expanded form
  WeightPtr o_proj;
  // Feed-forward: dense, or MoE.
  bool moe = false;
  Mlp dense;
  WeightPtr gate;  // router [n_routed, hidden], float32 always (as the reference)
  Buffer gate_bias;  // e_score_correction_bias [n_routed] (noaux_tc)
  bool has_gate_bias = false;
  std::vector<float> gate_bias_host;  // expert parallel: the same on the host (routing runs there); empty: none
  Mlp experts;  // n_routed stacked (expert parallel: this rank's slots of the placement, in slot order)
  Mlp shared;
  bool has_shared = false;
};

struct MtpLayer {
  Buffer enorm, hnorm;
  WeightPtr eh_proj;
  Buffer shared_head_norm;  // shared_head.norm; model.norm's values when the checkpoint leaves it out
  Layer layer;
};

// The DSpark draft module's backend half (config.h's DsparkDraftConfig); its Markov and confidence heads are on the
// host (DeepSeekModel::DsparkHeads), and also on the device where the backend runs them (Weights::dspark_device).
struct DsparkModule {
  std::vector<Layer> stages;
  WeightPtr main_proj;  // [hidden, hidden * S]
  Buffer main_norm, norm;
  // The draft's head over the rows of lm_head that are not all zero (their ids: DsparkHeads::active), when some are
  // (the demo's compact vocabulary): a zero row's logit is exactly 0, so skipping it changes no value. Null: lm_head.
  WeightPtr head;
};

struct DeepSeekModel::Weights {
  WeightPtr embed_tokens;  // [vocab, hidden]
  std::vector<Layer> layers;
  std::vector<MtpLayer> mtp_layers;
  std::unique_ptr<DsparkModule> dspark;
  DeepSeekModel::DsparkHeads dspark_heads;
  // Device copies of dspark_heads' weights where the backend runs the heads (build: the rank it takes, the whole
  // draft vocabulary on this rank); w1 empty otherwise.
  backend::Backend::DsparkHeadsOnDevice dspark_device;
  Buffer norm;
  WeightPtr lm_head;
  Buffer inv_freq;  // [R / 2]
  float rope_attention_factor = 1.0f;
  float softmax_scale = 0.0f;
  MoeRoutingRule rule;
  size_t bytes = 0;
};

// Activations of one step, grown to the largest step seen (rows), in the backend's activation dtype.
struct DeepSeekModel::Scratch {
  int64_t capacity = 0;
  Buffer x, normed, q, q_a, kv, q_absorbed, out_latent, attn, projected, gate_up, act, ffn;
  // Speculative decoding (models with MTP layers only): the hidden state a pass keeps for the next MTP pass
  // [capacity, hidden], the MTP pass's gathered copy of it, and its [enorm(embed) | hnorm(h)] input [capacity, 2 hidden].
  Buffer kept_hidden, mtp_hidden, mtp_concat;
  // DSpark draft module (models with one only): the target layers' residuals a pass keeps [capacity, hidden * S], and
  // the injection pass's gathered copy of them.
  Buffer dspark_context, dspark_gathered;
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


// The part of a checkpoint matrix [rows, cols] a tensor-parallel rank holds: rows [row0, row0 + rows), columns
// [col0, col0 + cols); -1: all of them.
struct Slice {
  int64_t row0 = 0, rows = -1, col0 = 0, cols = -1;
  int64_t rows_of(int64_t full) const { return rows < 0 ? full : rows; }
  int64_t cols_of(int64_t full) const { return cols < 0 ? full : cols; }
  bool whole(int64_t full_rows, int64_t full_cols) const {
    return row0 == 0 && col0 == 0 && rows_of(full_rows) == full_rows && cols_of(full_cols) == full_cols;
  }
  // Whether it cuts the matrix on 128 x 128 FP8 block boundaries (so that the stored bytes and scales slice).
  bool on_blocks(int64_t full_rows, int64_t full_cols) const {
    auto edge = [](int64_t at, int64_t full) { return at % 128 == 0 || at == full; };
    return edge(row0, full_rows) && edge(row0 + rows_of(full_rows), full_rows) && edge(col0, full_cols) &&
           edge(col0 + cols_of(full_cols), full_cols);
  }
};

// This rank's shard of a dimension split over the tensor-parallel ranks.
struct Shard {
  int64_t rank = 0, size = 1;
  int64_t part(int64_t n) const { return n / size; }
  int64_t first(int64_t n) const { return rank * (n / size); }
  Slice rows(int64_t n) const { return Slice{first(n), part(n), 0, -1}; }
  Slice cols(int64_t n) const { return Slice{0, -1, first(n), part(n)}; }
};

// Copies the block [slice] of a row-major [rows, cols] matrix.
template <typename T>
std::vector<T> cut(const T* data, int64_t cols, const Slice& slice, int64_t rows) {
  const int64_t r = slice.rows_of(rows), c = slice.cols_of(cols);
  std::vector<T> out(static_cast<size_t>(r * c));
  for (int64_t i = 0; i < r; ++i) {
    std::copy_n(data + (slice.row0 + i) * cols + slice.col0, c, out.data() + i * c);
  }
  return out;
}

// Fills backend weights from a checkpoint, or with random values when there is none (benchmarks of real configs).
class Loader {
 public:
  Loader(backend::Backend& backend, const Checkpoint* checkpoint, const ModelConfig& config, Precision precision,
         LoadProgress progress, uint64_t seed)
      : backend_(backend), checkpoint_(checkpoint), config_(config), precision_(precision),
        progress_(std::move(progress)), total_(checkpoint ? checkpoint->total_bytes() : 0), seed_(seed) {}

  // Tensors the model does not use (an MTP layer's own embedding copy, say) still count as read.
  void finish() {
    done_ = total_;
    report();
  }
  size_t bytes() const { return bytes_; }
  bool random() const { return checkpoint_ == nullptr; }
  // Whether the checkpoint holds `name` (with no checkpoint: every name).
  bool has(const std::string& name) const { return random() || checkpoint_->find(name) != nullptr; }

  // Per row of the checkpoint matrix `name` ([rows, ...]): whether its stored bytes are all zero (a value of exactly
  // 0 in every dtype). Empty without a checkpoint or the tensor.
  std::vector<bool> zero_rows(const std::string& name, int64_t rows) const {
    const TensorView* view = random() ? nullptr : checkpoint_->find(name);
    if (view == nullptr || rows <= 0 || view->size_bytes % static_cast<size_t>(rows) != 0) return {};
    const size_t row_bytes = view->size_bytes / static_cast<size_t>(rows);
    std::vector<bool> zero(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const std::byte* begin = view->data + static_cast<size_t>(r) * row_bytes;
      zero[static_cast<size_t>(r)] =
          std::all_of(begin, begin + row_bytes, [](std::byte b) { return b == std::byte{0}; });
    }
    return zero;
  }

  // A float32 vector; `random_value` fills it when there is no checkpoint.
  Status vector(const std::string& name, int64_t n, float random_value, Buffer& out) {
    std::vector<float> values(static_cast<size_t>(n), random_value);
    if (!random()) {
      Result<std::vector<float>> loaded = load(name, {n});
      if (!loaded.ok()) return loaded.status();
      values = std::move(loaded).value();
    }
    Result<Buffer> buffer = backend_.make_vector(values);
    if (!buffer.ok()) return buffer.status();
    out = std::move(buffer).value();
    bytes_ += out.bytes;
    return Status();
  }

  // `count` stacked [rows, cols] matrices; `fill(weight)` sets them from the checkpoint.
  template <typename Fill>
  Status weight(int64_t count, int64_t rows, int64_t cols, Precision precision, WeightPtr& out, Fill fill) {
    Result<WeightPtr> w = backend_.make_weight(count, rows, cols, precision);
    if (!w.ok()) return w.status();
    out = std::move(w).value();
    bytes_ += out->bytes;
    if (random()) {
      backend_.fill_random(*out, seed_++, 1.0f / std::sqrt(static_cast<float>(cols)));
      return Status();
    }
    return fill(*out);
  }

  // A checkpoint matrix [rows, cols], or the `slice` of it.
  Status matrix(const std::string& name, int64_t rows, int64_t cols, Precision precision, WeightPtr& out,
                const Slice& slice = {}) {
    return weight(1, slice.rows_of(rows), slice.cols_of(cols), precision, out,
                  [&](Weight& w) { return set(w, 0, {name}, rows, cols, slice); });
  }

  // Sets slot `index` of `w` from the checkpoint tensors `names` stacked by rows (gate_proj then up_proj, say):
  // their FP8 bytes and block scales as stored when w is FP8 (then each part's rows are a multiple of 128), else
  // float32 values (FP8 dequantized with its scales).
  // With `slice`, each part contributes its block [slice] (FP8: only when the slice is on block boundaries, as
  // linear_precision() decides).
  Status set(Weight& w, int64_t index, std::vector<std::string> names, int64_t part_rows, int64_t cols,
             const Slice& slice = {}) {
    std::vector<float> values;
    std::vector<uint8_t> fp8;
    std::vector<float> scales;
    const bool whole = slice.whole(part_rows, cols);
    for (const std::string& name : names) {
      if (w.precision == Precision::kFP8) {
        std::vector<uint8_t> part_fp8;
        std::vector<float> part_scales;
        Status s = load_fp8(name, part_rows, cols, part_fp8, part_scales);
        if (!s.ok()) return s;
        if (!whole) {
          const int64_t scale_cols = (cols + 127) / 128;
          const Slice blocks{slice.row0 / 128, (slice.rows_of(part_rows) + 127) / 128, slice.col0 / 128,
                             (slice.cols_of(cols) + 127) / 128};
          part_fp8 = cut(part_fp8.data(), cols, slice, part_rows);
          part_scales = cut(part_scales.data(), scale_cols, blocks, (part_rows + 127) / 128);
        }
        fp8.insert(fp8.end(), part_fp8.begin(), part_fp8.end());
        scales.insert(scales.end(), part_scales.begin(), part_scales.end());
      } else {
        Result<std::vector<float>> part = load(name, {part_rows, cols});
        if (!part.ok()) return part.status();
        if (!whole) *part = cut(part->data(), cols, slice, part_rows);
        values.insert(values.end(), part->begin(), part->end());
      }
    }
    backend::HostMatrix host;
    host.rows = slice.rows_of(part_rows) * static_cast<int64_t>(names.size());
    host.cols = slice.cols_of(cols);
    host.f32 = values;
    host.fp8 = fp8;
    host.fp8_scales = scales;
    return backend_.set_matrix(w, index, host);
  }

  Result<std::vector<float>> load(const std::string& name, std::vector<int64_t> shape) {
    const TensorView* view = checkpoint_->find(name);
    Result<std::vector<float>> values = checkpoint_->load_f32(name, shape, block(0), block(1));
    if (values.ok() && view != nullptr) {
      done_ += view->size_bytes;
      report();
    }
    return values;
  }

  // The precision of a linear weight made of `parts` checkpoint tensors [part_rows, cols] stacked by rows, the
  // first named `name`: FP8 only when asked for, the checkpoint stores it as FP8 in 128x128 blocks, cols is a
  // multiple of 128 (the FP8 GEMM's K) and stacked parts end on block boundaries; else bf16 when FP8 was asked for.
  // A slice (tensor parallel) keeps FP8 only when it cuts on block boundaries and its parts end on them.
  Precision linear_precision(const std::string& name, int64_t part_rows, int64_t cols, int64_t parts = 1,
                             const Slice& slice = {}) const {
    if (precision_ != Precision::kFP8) return precision_;
    const int64_t local_rows = slice.rows_of(part_rows), local_cols = slice.cols_of(cols);
    const bool shape_ok = local_cols % 128 == 0 && (parts == 1 || local_rows % 128 == 0) &&
                          slice.on_blocks(part_rows, cols);
    if (random()) return shape_ok ? Precision::kFP8 : Precision::kBF16;
    const TensorView* view = checkpoint_->find(name);
    const bool fp8 = shape_ok && view != nullptr && view->dtype == DType::kF8E4M3 && block(0) == 128 && block(1) == 128;
    return fp8 ? Precision::kFP8 : Precision::kBF16;
  }
  Precision dense_precision() const { return precision_ == Precision::kFP8 ? Precision::kBF16 : precision_; }

 private:
  Status load_fp8(const std::string& name, int64_t rows, int64_t cols, std::vector<uint8_t>& fp8,
                  std::vector<float>& scales) {
    const TensorView* view = checkpoint_->find(name);
    if (view == nullptr || view->dtype != DType::kF8E4M3 || view->shape != std::vector<int64_t>{rows, cols}) {
      return Status::invalid_argument(name + ": expected a float8_e4m3fn tensor of " + std::to_string(rows) + " x " +
                                      std::to_string(cols));
    }
    const std::byte* data = view->data;
    fp8.insert(fp8.end(), reinterpret_cast<const uint8_t*>(data), reinterpret_cast<const uint8_t*>(data) + rows * cols);
    Result<std::vector<float>> s = load(name + "_scale_inv", {(rows + 127) / 128, (cols + 127) / 128});
    if (!s.ok()) return s.status();
    scales.insert(scales.end(), s->begin(), s->end());
    done_ += view->size_bytes;
    report();
    return Status();
  }
  int64_t block(size_t i) const {
    return config_.weight_block_size.size() == 2 ? config_.weight_block_size[i] : 128;
  }
  void report() {
    if (progress_) progress_(done_, total_);
  }

  backend::Backend& backend_;
  const Checkpoint* checkpoint_;
  const ModelConfig& config_;
  Precision precision_;
  LoadProgress progress_;
  size_t total_;
  size_t done_ = 0;
  size_t bytes_ = 0;
  uint64_t seed_;
};

// An MLP (count 1, tensors under `prefix`) or `count` routed experts stacked (tensors under prefix.<e>); with a
// tensor-parallel `shard`, this rank's part of the intermediate dimension (gate/up rows, down columns).
Status load_mlp(Loader& loader, const std::string& prefix, bool experts, int64_t count, int64_t inter, int64_t hidden,
                const Shard& shard, Mlp& out, std::span<const int32_t> expert_ids = {}) {
  auto name = [&](int64_t e, const char* part) {
    const int64_t id = expert_ids.empty() ? e : expert_ids[static_cast<size_t>(e)];
    return (experts ? prefix + "." + std::to_string(id) : prefix) + "." + part + ".weight";
  };
  const int64_t local = shard.part(inter);
  const Slice rows = shard.rows(inter), cols = shard.cols(inter);
  Status s = loader.weight(count, 2 * local, hidden,
                           loader.linear_precision(name(0, "gate_proj"), inter, hidden, 2, rows), out.gate_up,
                           [&](Weight& w) {
                             for (int64_t e = 0; e < count; ++e) {
                               Status st =
                                   loader.set(w, e, {name(e, "gate_proj"), name(e, "up_proj")}, inter, hidden, rows);
                               if (!st.ok()) return st;
                             }
                             return Status();
                           });
  if (!s.ok()) return s;
  return loader.weight(count, hidden, local, loader.linear_precision(name(0, "down_proj"), hidden, inter, 1, cols),
                       out.down, [&](Weight& w) {
                         for (int64_t e = 0; e < count; ++e) {
                           Status st = loader.set(w, e, {name(e, "down_proj")}, hidden, inter, cols);
                           if (!st.ok()) return st;
                         }
                         return Status();
                       });
}

// The decoder layer whose tensors are under `p` ("model.layers.3", "mtp.0"), with routed experts when `moe`.
// With a tensor-parallel `shard`, this rank's heads and intermediate slices (TensorParallel in the header).
// With `expert_ids` (expert parallel: this rank's slots), those routed experts stacked in that order; else all.
// `expert_shard`: the routed experts' own split of the intermediate dimension (default: `shard`; whole experts when
// the expert-parallel ranks are the tensor-parallel ones).
Status load_layer(Loader& loader, backend::Backend& backend, const ModelConfig& c, const std::string& p, bool moe,
                  const Shard& shard, Layer& out, std::span<const int32_t> expert_ids = {},
                  const Shard* expert_shard = nullptr) {
  const int64_t all_heads = c.num_attention_heads, heads = shard.part(all_heads), first_head = shard.first(all_heads);
  const int64_t hidden = c.hidden_size, rank = c.kv_lora_rank;
  const int64_t nope = c.qk_nope_head_dim, v = c.v_head_dim, R = c.qk_rope_head_dim;
  Status s;
  if (!(s = loader.vector(p + ".input_layernorm.weight", hidden, 1.0f, out.input_layernorm)).ok()) return s;
  if (!(s = loader.vector(p + ".post_attention_layernorm.weight", hidden, 1.0f, out.post_attention_layernorm)).ok()) {
    return s;
  }
  auto linear = [&](const std::string& name, int64_t rows, int64_t cols, WeightPtr& w, const Slice& slice = {}) {
    return loader.matrix(name, rows, cols, loader.linear_precision(name, rows, cols, 1, slice), w, slice);
  };
  const Slice head_rows{first_head * c.qk_head_dim(), heads * c.qk_head_dim(), 0, -1};
  if (c.q_lora_rank) {
    if (!(s = linear(p + ".self_attn.q_a_proj.weight", *c.q_lora_rank, hidden, out.q_a_proj)).ok()) return s;
    if (!(s = loader.vector(p + ".self_attn.q_a_layernorm.weight", *c.q_lora_rank, 1.0f, out.q_a_layernorm)).ok()) {
      return s;
    }
    if (!(s = linear(p + ".self_attn.q_b_proj.weight", all_heads * c.qk_head_dim(), *c.q_lora_rank, out.q_b_proj,
                     head_rows)).ok()) {
      return s;
    }
  } else if (!(s = linear(p + ".self_attn.q_proj.weight", all_heads * c.qk_head_dim(), hidden, out.q_proj, head_rows))
                  .ok()) {
    return s;
  }
  if (!(s = linear(p + ".self_attn.kv_a_proj_with_mqa.weight", rank + R, hidden, out.kv_a_proj_with_mqa)).ok()) {
    return s;
  }
  if (!(s = loader.vector(p + ".self_attn.kv_a_layernorm.weight", rank, 1.0f, out.kv_a_layernorm)).ok()) return s;
  // kv_b_proj [H * (nope + v), C] split into per-head absorbed matrices (and kept whole for the expanded form).
  const Precision dense = loader.dense_precision();
  std::vector<float> kv_b;
  if (!loader.random()) {
    Result<std::vector<float>> loaded = loader.load(p + ".self_attn.kv_b_proj.weight", {all_heads * (nope + v), rank});
    if (!loaded.ok()) return loaded.status();
    kv_b = std::move(loaded).value();
    // This rank's heads only (each head's rows are contiguous: nope key rows, then v value rows).
    kv_b.erase(kv_b.begin() + (first_head + heads) * (nope + v) * rank, kv_b.end());
    kv_b.erase(kv_b.begin(), kv_b.begin() + first_head * (nope + v) * rank);
  }
  s = loader.weight(heads, rank, nope, dense, out.w_uk_t, [&](Weight& w) {
    std::vector<float> uk_t(static_cast<size_t>(rank * nope));  // transpose of W_UK[h] ([nope, C])
    for (int64_t h = 0; h < heads; ++h) {
      const float* head = kv_b.data() + h * (nope + v) * rank;
      for (int64_t n = 0; n < nope; ++n) {
        for (int64_t r = 0; r < rank; ++r) uk_t[static_cast<size_t>(r * nope + n)] = head[n * rank + r];
      }
      backend::HostMatrix m{rank, nope, uk_t, {}, {}};
      if (Status st = backend.set_matrix(w, h, m); !st.ok()) return st;
    }
    return Status();
  });
  if (!s.ok()) return s;
  s = loader.weight(heads, v, rank, dense, out.w_uv, [&](Weight& w) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* head = kv_b.data() + h * (nope + v) * rank;
      backend::HostMatrix m{v, rank, std::span<const float>(head + nope * rank, static_cast<size_t>(v * rank)), {}, {}};
      if (Status st = backend.set_matrix(w, h, m); !st.ok()) return st;
    }
    return Status();
  });
  if (!s.ok()) return s;
  backend::MlaExpanded expanded{heads, rank, R, nope, v, 0.0f, nullptr};
  if (backend.has_mla_expanded(expanded)) {
    s = loader.weight(1, heads * (nope + v), rank, dense, out.kv_b, [&](Weight& w) {
      return backend.set_matrix(w, 0, backend::HostMatrix{heads * (nope + v), rank, kv_b, {}, {}});
    });
    if (!s.ok()) return s;
  }
  if (!(s = linear(p + ".self_attn.o_proj.weight", hidden, all_heads * v, out.o_proj,
                   Slice{0, -1, first_head * v, heads * v})).ok()) {
    return s;
  }
  out.moe = moe;
  if (!out.moe) return load_mlp(loader, p + ".mlp", false, 1, c.intermediate_size, hidden, shard, out.dense);
  if (!(s = loader.matrix(p + ".mlp.gate.weight", c.n_routed_experts, hidden, Precision::kF32, out.gate)).ok()) {
    return s;
  }
  out.has_gate_bias = c.topk_method == "noaux_tc";
  if (out.has_gate_bias) {
    if (!(s = loader.vector(p + ".mlp.gate.e_score_correction_bias", c.n_routed_experts, 0.0f, out.gate_bias)).ok()) {
      return s;
    }
    if (!expert_ids.empty()) {
      out.gate_bias_host.assign(static_cast<size_t>(c.n_routed_experts), 0.0f);
      if (!loader.random()) {
        Result<std::vector<float>> bias = loader.load(p + ".mlp.gate.e_score_correction_bias", {c.n_routed_experts});
        if (!bias.ok()) return bias.status();
        out.gate_bias_host = std::move(bias).value();
      }
    }
  }
  const int64_t held = expert_ids.empty() ? c.n_routed_experts : static_cast<int64_t>(expert_ids.size());
  if (!(s = load_mlp(loader, p + ".mlp.experts", true, held, c.moe_intermediate_size, hidden,
                     expert_shard != nullptr ? *expert_shard : shard, out.experts, expert_ids)).ok()) {
    return s;
  }
  out.has_shared = c.n_shared_experts > 0;
  if (out.has_shared) {
    return load_mlp(loader, p + ".mlp.shared_experts", false, 1, c.moe_intermediate_size * c.n_shared_experts, hidden,
                    shard, out.shared);
  }
  return Status();
}

// Everything but the checkpoint: the layers, MTP layers, final norm, head and rope tables through `loader`.
Status build(Loader& loader, backend::Backend& backend, const ModelConfig& c, const Shard& shard,
             DeepSeekModel::Weights& w, const ExpertPlacement* placement = nullptr, int64_t ep_rank = 0,
             bool whole_experts = false) {
  const Shard whole;
  Status s;
  if (!(s = loader.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size, loader.dense_precision(),
                          w.embed_tokens, shard.rows(c.vocab_size))).ok()) {
    return s;
  }
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0, moe_index = 0; l < c.num_hidden_layers; ++l) {
    std::span<const int32_t> slots;  // expert parallel: this rank's slots of the layer
    if (placement != nullptr && c.is_moe_layer(l)) {
      const int64_t per_rank = placement->slots_per_rank();
      slots = std::span<const int32_t>(placement->phy2log[static_cast<size_t>(moe_index++)])
                  .subspan(static_cast<size_t>(ep_rank * per_rank), static_cast<size_t>(per_rank));
    }
    if (!(s = load_layer(loader, backend, c, "model.layers." + std::to_string(l), c.is_moe_layer(l), shard,
                         w.layers[static_cast<size_t>(l)], slots, whole_experts ? &whole : nullptr)).ok()) {
      return s;
    }
  }
  for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
    MtpLayer mtp;
    const int64_t index = c.num_hidden_layers + i;
    const std::string p = "model.layers." + std::to_string(index);
    if (!(s = loader.vector(p + ".enorm.weight", c.hidden_size, 1.0f, mtp.enorm)).ok()) return s;
    if (!(s = loader.vector(p + ".hnorm.weight", c.hidden_size, 1.0f, mtp.hnorm)).ok()) return s;
    if (!(s = loader.matrix(p + ".eh_proj.weight", c.hidden_size, 2 * c.hidden_size,
                            loader.linear_precision(p + ".eh_proj.weight", c.hidden_size, 2 * c.hidden_size),
                            mtp.eh_proj)).ok()) {
      return s;
    }
    if (!(s = load_layer(loader, backend, c, p, c.is_moe_layer(index), shard, mtp.layer)).ok()) return s;
    const std::string head_norm = loader.has(p + ".shared_head.norm.weight") ? p + ".shared_head.norm.weight"
                                                                             : "model.norm.weight";
    if (!(s = loader.vector(head_norm, c.hidden_size, 1.0f, mtp.shared_head_norm)).ok()) return s;
    w.mtp_layers.push_back(std::move(mtp));
  }
  if (c.dspark) {
    // The DSpark draft module (config.h): dense stages mtp.{s}, main_proj / main_norm on stage 0, the last stage's
    // norm and heads. The heads are read to the host (the Markov head and the confidence run there).
    const DsparkDraftConfig& d = *c.dspark;
    const int64_t S = d.num_stages(), hidden = c.hidden_size, r = d.markov_rank;
    auto module = std::make_unique<DsparkModule>();
    module->stages.resize(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) {
      if (!(s = load_layer(loader, backend, c, "mtp." + std::to_string(i), false, shard,
                           module->stages[static_cast<size_t>(i)]))
               .ok()) {
        return s;
      }
    }
    const std::string main_proj = "mtp.0.main_proj.weight";
    if (!(s = loader.matrix(main_proj, hidden, hidden * S, loader.linear_precision(main_proj, hidden, hidden * S),
                            module->main_proj)).ok()) {
      return s;
    }
    if (!(s = loader.vector("mtp.0.main_norm.weight", hidden, 1.0f, module->main_norm)).ok()) return s;
    const std::string last = "mtp." + std::to_string(S - 1) + ".";
    if (!(s = loader.vector(last + "norm.weight", hidden, 1.0f, module->norm)).ok()) return s;
    DeepSeekModel::DsparkHeads& heads = w.dspark_heads;
    heads.vocab = c.vocab_size;
    heads.hidden = hidden;
    heads.rank = r;
    if (loader.random()) {  // benchmarks: a Markov head adding nothing, confidence 0.5
      heads.markov_w1.assign(static_cast<size_t>(c.vocab_size * r), 0.0f);
      heads.markov_w2_t.assign(static_cast<size_t>(c.vocab_size * r), 0.0f);
      heads.confidence.assign(static_cast<size_t>(hidden + r), 0.0f);
    } else {
      Result<std::vector<float>> w1 = loader.load(last + "markov_head.markov_w1.weight", {c.vocab_size, r});
      if (!w1.ok()) return w1.status();
      Result<std::vector<float>> w2 = loader.load(last + "markov_head.markov_w2.weight", {c.vocab_size, r});
      if (!w2.ok()) return w2.status();
      Result<std::vector<float>> proj = loader.load(last + "confidence_head.proj.weight", {1, hidden + r});
      if (!proj.ok()) return proj.status();
      heads.markov_w1 = std::move(w1).value();
      heads.markov_w2_t = std::move(w2).value();  // [vocab, rank] until the head's vocabulary is known (below)
      heads.confidence = std::move(proj).value();
    }
    w.dspark = std::move(module);
  }
  if (!(s = loader.vector("model.norm.weight", c.hidden_size, 1.0f, w.norm)).ok()) return s;
  const char* head = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  if (!(s = loader.matrix(head, c.vocab_size, c.hidden_size, loader.dense_precision(), w.lm_head,
                          shard.rows(c.vocab_size))).ok()) {
    return s;
  }
  if (w.dspark && !loader.random()) {
    // The draft's vocabulary (DsparkHeads): the ids where lm_head or markov_w2 is non-zero; then its own head
    // (DsparkModule::head) when that leaves some out, and markov_w2 transposed over it.
    std::vector<bool> zero = loader.zero_rows(head, c.vocab_size);
    DeepSeekModel::DsparkHeads& heads = w.dspark_heads;
    const size_t r = static_cast<size_t>(heads.rank);
    const std::vector<float> w2 = std::move(heads.markov_w2_t);
    std::vector<int32_t> active;
    for (int64_t v = 0; v < c.vocab_size; ++v) {
      const float* row = w2.data() + static_cast<size_t>(v) * r;
      const bool markov = std::any_of(row, row + r, [](float x) { return x != 0.0f; });
      if (zero.empty() || !zero[static_cast<size_t>(v)] || markov) active.push_back(static_cast<int32_t>(v));
    }
    if (static_cast<int64_t>(active.size()) < c.vocab_size) {
      Result<std::vector<float>> full = loader.load(head, {c.vocab_size, c.hidden_size});
      if (!full.ok()) return full.status();
      std::vector<float> rows(active.size() * static_cast<size_t>(c.hidden_size));
      for (size_t i = 0; i < active.size(); ++i) {
        std::copy_n(full->data() + static_cast<size_t>(active[i]) * static_cast<size_t>(c.hidden_size), c.hidden_size,
                    rows.data() + i * static_cast<size_t>(c.hidden_size));
      }
      const int64_t n = static_cast<int64_t>(active.size());
      s = loader.weight(1, n, c.hidden_size, loader.dense_precision(), w.dspark->head, [&](Weight& weight) {
        return backend.set_matrix(weight, 0, backend::HostMatrix{n, c.hidden_size, rows, {}, {}});
      });
      if (!s.ok()) return s;
      heads.active = std::move(active);
    }
    const size_t n = static_cast<size_t>(heads.draft_vocab());
    heads.markov_w2_t.assign(r * n, 0.0f);
    heads.markov_w2_norm.assign(n, 0.0f);
    heads.markov_w2_rows.assign(r * n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
      double squares = 0.0;
      for (size_t j = 0; j < r; ++j) {
        const float x = w2[static_cast<size_t>(heads.id_of(static_cast<int64_t>(i))) * r + j];
        heads.markov_w2_t[j * n + i] = x;
        heads.markov_w2_rows[i * r + j] = x;
        squares += static_cast<double>(x) * x;
      }
      heads.markov_w2_norm[i] = static_cast<float>(std::sqrt(squares) * (1.0 + 1e-6));
      heads.markov_w2_norm_max = std::max(heads.markov_w2_norm_max, heads.markov_w2_norm[i]);
    }
  }
  // Device copies where the backend runs the heads, and each rank's block pass has the whole draft vocabulary's
  // logits (one rank, or the compact head, which is whole on every rank).
  if (w.dspark && w.dspark_heads.rank <= backend.max_device_dspark_rank() && (shard.size == 1 || w.dspark->head)) {
    const DeepSeekModel::DsparkHeads& heads = w.dspark_heads;
    backend::Backend::DsparkHeadsOnDevice& d = w.dspark_device;
    d.vocab = heads.vocab;
    d.draft_vocab = heads.draft_vocab();
    d.rank = heads.rank;
    d.hidden = heads.hidden;
    d.w2_norm_max = heads.markov_w2_norm_max;
    d.outside = heads.first_outside();
    auto upload = [&](const void* data, size_t bytes, Buffer& buffer) -> Status {
      if (bytes == 0) return Status();
      Result<Buffer> made = backend.alloc(bytes);
      if (!made.ok()) return made.status();
      buffer = std::move(made).value();
      return backend.upload(data, bytes, buffer, 0);
    };
    // Random weights keep no untransposed rows: theirs are zeros, like the transposed copy.
    const std::vector<float> zeros =
        heads.markov_w2_rows.empty() ? std::vector<float>(static_cast<size_t>(d.draft_vocab * d.rank), 0.0f)
                                     : std::vector<float>();
    const std::vector<float>& rows = heads.markov_w2_rows.empty() ? zeros : heads.markov_w2_rows;
    for (Status u : {upload(heads.markov_w1.data(), heads.markov_w1.size() * 4, d.w1),
                     upload(rows.data(), rows.size() * 4, d.w2_rows),
                     upload(heads.markov_w2_norm.data(), heads.markov_w2_norm.size() * 4, d.w2_norm),
                     upload(heads.confidence.data(), heads.confidence.size() * 4, d.confidence),
                     upload(heads.active.data(), heads.active.size() * 4, d.active)}) {
      if (!u.ok()) return u;
    }
  }
  std::vector<float> inv_freq;
  compute_rope(c, inv_freq, w.rope_attention_factor);
  Result<Buffer> inv_freq_buffer = backend.make_vector(inv_freq);
  if (!inv_freq_buffer.ok()) return inv_freq_buffer.status();
  w.inv_freq = std::move(inv_freq_buffer).value();
  w.softmax_scale = softmax_scale(c);
  w.rule = routing_rule(c);
  w.bytes = loader.bytes();
  loader.finish();
  return Status();
}

Status check_supported(const ModelConfig& c, const backend::Backend& backend, const std::string& where) {
  backend::ModelShapes shapes;
  shapes.num_heads = c.num_attention_heads;
  shapes.kv_lora_rank = c.kv_lora_rank;
  shapes.rope_dim = c.qk_rope_head_dim;
  shapes.nope_dim = c.qk_nope_head_dim;
  shapes.v_dim = c.v_head_dim;
  shapes.hidden = c.hidden_size;
  bool has_moe = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) has_moe = has_moe || c.is_moe_layer(l);
  if (has_moe) {
    shapes.num_experts = c.n_routed_experts;
    shapes.top_k = c.num_experts_per_tok;
    shapes.n_group = c.topk_method == "greedy" ? 1 : c.n_group;
  }
  if (Status s = backend.check_model_shapes(shapes); !s.ok()) return Status::unsupported(where + ": " + s.message());
  if (c.qk_rope_head_dim > 256 || c.qk_rope_head_dim % 2 != 0) {
    return Status::unsupported(where + ": qk_rope_head_dim " + std::to_string(c.qk_rope_head_dim) +
                               " (must be even and <= 256)");
  }
  return Status();
}

}  // namespace

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


// Expert parallel's dispatch and combine of one MoE layer (ExpertParallel in the header), over backend buffers that
// grow to the largest exchange seen. The routing runs on the host (route_token, as the CPU backend's own MoE), so the
// ranks agree on it bit for bit: the owner's choice of replica (physical slot) travels with each row. It also counts
// each logical expert's tokens per MoE layer (this rank's tokens), the load EPLB rebalances by. The rows move over
// `comm` (backend memory), the counts and the routing over `host` (host memory; the same group as comm on the CPU).
class ExpertDispatch {
 public:
  // replicated: every rank holds the same tokens (ExpertParallel::replicated_tokens): no exchange.
  ExpertDispatch(backend::Backend& backend, backend::Communicator& comm, backend::Communicator& host,
                 ExpertPlacement placement, bool replicated, double capacity_factor)
      : b_(backend), comm_(comm), host_(host), placement_(std::move(placement)), replicated_(replicated),
        capacity_factor_(capacity_factor) {
    load_.assign(placement_.phy2log.size(), std::vector<double>(static_cast<size_t>(placement_.num_logical), 0.0));
    total_load_ = load_;
  }
  bool replicated() const { return replicated_; }
  int64_t capacity_dropped() const { return capacity_dropped_; }
  double dispatch_seconds() const { return dispatch_seconds_; }
  double combine_seconds() const { return combine_seconds_; }
  const std::vector<std::vector<double>>& total_load() const { return total_load_; }

  const ExpertPlacement& placement() const { return placement_; }
  void set_placement(ExpertPlacement placement) { placement_ = std::move(placement); }
  std::vector<std::vector<double>>& load() { return load_; }
  const std::vector<std::vector<double>>& load() const { return load_; }

  // normed: the MoE layer's (index `moe_layer` among the MoE layers) post-attention-norm rows [T, hidden] (T may be 0:
  // an idle rank still serves others' rows); ffn += the routed experts' output for each row.
  void run(const MoeRoutingRule& rule, const Layer& L, int64_t moe_layer, const Tensor& normed, Tensor ffn) {
    const int64_t T = normed.rows, hidden = normed.cols, E = rule.num_experts, k = rule.top_k;
    const int size = comm_.size(), me = comm_.rank();
    const std::vector<int32_t>& phy2log = placement_.phy2log[static_cast<size_t>(moe_layer)];
    const int64_t P = placement_.num_physical, per_rank = placement_.slots_per_rank();
    // Each logical expert's slots; a token takes the one on its own rank if there is one, else slot t mod replicas.
    replicas_.assign(static_cast<size_t>(E), {});
    for (int64_t p = 0; p < P; ++p) replicas_[static_cast<size_t>(phy2log[static_cast<size_t>(p)])].push_back(p);
    // Routing of this rank's tokens, as physical slots.
    ids_.assign(static_cast<size_t>(T * k), 0);
    weights_.assign(static_cast<size_t>(T * k), 0.0f);
    if (T > 0) {
      Tensor logits = grow(router_, T, E, backend::DType::kF32);
      b_.linear(normed, *L.gate, logits);
      host_logits_.resize(static_cast<size_t>(T * E));
      if (Status s = b_.download(router_, 0, host_logits_.size() * sizeof(float), host_logits_.data()); !s.ok()) {
        error_ = s;
        return;
      }
      std::vector<int32_t> ids;
      std::vector<float> weights;
      std::vector<double>& load = load_[static_cast<size_t>(moe_layer)];
      std::vector<double>& total = total_load_[static_cast<size_t>(moe_layer)];
      for (int64_t t = 0; t < T; ++t) {
        route_token(rule, host_logits_.data() + t * E, L.gate_bias_host, ids, weights);
        for (int64_t i = 0; i < k; ++i) {
          const std::vector<int64_t>& slots = replicas_[static_cast<size_t>(ids[i])];
          int64_t slot = slots[static_cast<size_t>(t) % slots.size()];
          // A slot on this rank saves the exchange (not with replicated tokens: every rank must choose alike).
          for (int64_t candidate : slots) {
            if (!replicated_ && candidate / per_rank == me) slot = candidate;
          }
          ids_[static_cast<size_t>(t * k + i)] = static_cast<int32_t>(slot);
          weights_[static_cast<size_t>(t * k + i)] = weights[i];
          load[static_cast<size_t>(ids[i])] += 1.0;
          total[static_cast<size_t>(ids[i])] += 1.0;
        }
      }
    }
    if (replicated_) {  // this rank's slots over every token; the tensor-parallel all-reduce sums the ranks' parts
      if (T == 0) return;
      apply_capacity(T, k, P, me * per_rank, per_rank, ids_, weights_);
      MoeRoutingRule physical = rule;
      physical.num_experts = P;
      backend::MoeWeights moe{physical, L.gate.get(), nullptr, L.experts.gate_up.get(), L.experts.down.get(),
                              me * per_rank, ids_, weights_};
      b_.moe(normed, moe, ffn);
      return;
    }
    // Each token once to every rank holding one of its slots, in rank order.
    send_rows_.assign(static_cast<size_t>(size), 0);
    recv_rows_.assign(static_cast<size_t>(size), 0);
    send_tokens_.clear();
    for (int q = 0; q < size; ++q) {
      for (int64_t t = 0; t < T; ++t) {
        bool held = false;
        for (int64_t i = 0; i < k; ++i) held = held || ids_[static_cast<size_t>(t * k + i)] / per_rank == q;
        if (!held) continue;
        send_tokens_.push_back(static_cast<int32_t>(t));
        ++send_rows_[static_cast<size_t>(q)];
      }
    }
    auto started = std::chrono::steady_clock::now();
    auto seconds_since = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    };
    host_.all_to_all_counts(send_rows_, recv_rows_);
    dispatch_seconds_ += seconds_since();
    const int64_t S = static_cast<int64_t>(send_tokens_.size());
    int64_t R = 0;
    for (int64_t n : recv_rows_) R += n;
    // Dispatch: the rows, and their routing as floats (slot ids < 2^24 are exact) [rows, 2k].
    Tensor send = grow(send_, S, hidden, normed.dtype), recv = grow(recv_, R, hidden, normed.dtype);
    meta_send_.resize(static_cast<size_t>(S * 2 * k));
    // The rows in one batched copy: a span per run of consecutive tokens (with every token going to every rank, one
    // span per rank), or per row when normed's rows are not contiguous.
    const size_t element = backend::dtype_size(normed.dtype), row_bytes = static_cast<size_t>(hidden) * element;
    const bool contiguous = normed.stride == hidden;
    spans_.clear();
    for_each_run([&](int64_t j, int64_t t, int64_t n) {
      for (int64_t r = 0; r < n; r += contiguous ? n : 1) {
        const int64_t rows = contiguous ? n : 1;
        const size_t from = static_cast<size_t>((t + r) * normed.stride) * element;
        spans_.push_back({static_cast<const char*>(normed.data) + from,
                          static_cast<char*>(send.data) + static_cast<size_t>(j + r) * row_bytes,
                          static_cast<size_t>(rows) * row_bytes});
      }
    });
    if (!spans_.empty()) b_.copy_spans(spans_);
    for (int64_t j = 0; j < S; ++j) {
      const int64_t t = send_tokens_[static_cast<size_t>(j)];
      for (int64_t i = 0; i < k; ++i) {
        meta_send_[static_cast<size_t>(j * 2 * k + i)] = static_cast<float>(ids_[static_cast<size_t>(t * k + i)]);
        meta_send_[static_cast<size_t>(j * 2 * k + k + i)] = weights_[static_cast<size_t>(t * k + i)];
      }
    }
    meta_recv_.resize(static_cast<size_t>(R * 2 * k));
    started = std::chrono::steady_clock::now();
    comm_.all_to_all_rows(send, send_rows_, recv, recv_rows_);
    host_.all_to_all_rows(Tensor{meta_send_.data(), backend::DType::kF32, S, 2 * k, 2 * k}, send_rows_,
                          Tensor{meta_recv_.data(), backend::DType::kF32, R, 2 * k, 2 * k}, recv_rows_);
    dispatch_seconds_ += seconds_since();
    // This rank's slots on what it received.
    recv_ids_.resize(static_cast<size_t>(R * k));
    recv_weights_.resize(static_cast<size_t>(R * k));
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < k; ++i) {
        recv_ids_[static_cast<size_t>(r * k + i)] = static_cast<int32_t>(meta_recv_[static_cast<size_t>(r * 2 * k + i)]);
        recv_weights_[static_cast<size_t>(r * k + i)] = meta_recv_[static_cast<size_t>(r * 2 * k + k + i)];
      }
    }
    if (capacity_factor_ > 0.0) {
      // Every rank's tokens count toward the capacity.
      float tokens = static_cast<float>(T);
      host_.all_reduce_sum(Tensor{&tokens, backend::DType::kF32, 1, 1, 1});
      apply_capacity(static_cast<int64_t>(tokens), k, P, me * per_rank, per_rank, recv_ids_, recv_weights_);
    }
    Tensor computed = grow(computed_, R, hidden, normed.dtype), back = grow(back_, S, hidden, normed.dtype);
    if (R > 0) {
      b_.fill_zero(computed);
      MoeRoutingRule physical = rule;
      physical.num_experts = P;
      backend::MoeWeights moe{physical, L.gate.get(), nullptr, L.experts.gate_up.get(), L.experts.down.get(),
                              me * per_rank, recv_ids_, recv_weights_};
      b_.moe(recv, moe, computed);
    }
    // Combine: the sums back to their owners, added to each token's output.
    started = std::chrono::steady_clock::now();
    comm_.all_to_all_rows(computed, recv_rows_, back, send_rows_);
    combine_seconds_ += seconds_since();
    for_each_run([&](int64_t j, int64_t t, int64_t n) { b_.add(ffn.rows_slice(t, n), back.rows_slice(j, n)); });
  }

  // The first failure of a host copy (the collectives keep theirs).
  Status status() const { return error_; }

 private:
  // The capacity factor over pairs (ids[r * k + i], weights[...]) in order: a slot in [first, first + held) past
  // ceil(factor * tokens * k / P) pairs gets weight 0 (dropped: the residual path for that expert).
  void apply_capacity(int64_t tokens, int64_t k, int64_t P, int64_t first, int64_t held, std::vector<int32_t>& ids,
                      std::vector<float>& weights) {
    if (capacity_factor_ <= 0.0) return;
    const double capacity = std::ceil(capacity_factor_ * static_cast<double>(tokens * k) / static_cast<double>(P));
    std::vector<int64_t> used(static_cast<size_t>(held), 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t slot = ids[i] - first;
      if (slot < 0 || slot >= held) continue;
      if (static_cast<double>(++used[static_cast<size_t>(slot)]) > capacity) {
        weights[i] = 0.0f;
        ++capacity_dropped_;
      }
    }
  }

  // f(j, t, n) for each run of send_tokens_ [j, j + n) holding consecutive tokens t, t + 1, ..., t + n - 1.
  template <typename F>
  void for_each_run(F&& f) const {
    const int64_t S = static_cast<int64_t>(send_tokens_.size());
    for (int64_t j = 0; j < S;) {
      int64_t n = 1;
      while (j + n < S && send_tokens_[static_cast<size_t>(j + n)] == send_tokens_[static_cast<size_t>(j)] + n) ++n;
      f(j, send_tokens_[static_cast<size_t>(j)], n);
      j += n;
    }
  }

  // A [rows, cols] view of `buffer`, grown to hold it.
  Tensor grow(Buffer& buffer, int64_t rows, int64_t cols, backend::DType dtype) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * backend::dtype_size(dtype);
    if (buffer.bytes < bytes) {
      buffer = Buffer();
      Result<Buffer> made = b_.alloc(bytes * 2);
      if (!made.ok()) {
        error_ = made.status();
        return Tensor{nullptr, dtype, 0, cols, cols};
      }
      buffer = std::move(made).value();
    }
    return Tensor{buffer.data(), dtype, rows, cols, cols};
  }

  backend::Backend& b_;
  backend::Communicator& comm_;
  backend::Communicator& host_;
  ExpertPlacement placement_;
  bool replicated_ = false;
  double capacity_factor_ = 0.0;
  double dispatch_seconds_ = 0.0, combine_seconds_ = 0.0;
  int64_t capacity_dropped_ = 0;
  std::vector<std::vector<double>> load_;  // [MoE layers][E] tokens routed to each logical expert, this rank's
  std::vector<std::vector<double>> total_load_;  // the same, never reset
  Status error_;
  Buffer router_, send_, recv_, computed_, back_;
  std::vector<std::vector<int64_t>> replicas_;
  std::vector<float> host_logits_, weights_, meta_send_, meta_recv_, recv_weights_;
  std::vector<int32_t> ids_, send_tokens_, recv_ids_;
  std::vector<int64_t> send_rows_, recv_rows_;
  std::vector<backend::CopySpan> spans_;
};

DeepSeekModel::DeepSeekModel(ModelConfig config, backend::Backend& backend, const TensorParallel& tp,
                             const ExpertParallel& ep)
    : config_(std::move(config)), local_(config_), tp_(tp), ep_(ep), backend_(backend),
      weights_(std::make_unique<Weights>()),
      scratch_(std::make_unique<Scratch>()), graph_owner_(next_graph_owner.fetch_add(1)) {
  local_.num_attention_heads /= tp.size;
  local_.intermediate_size /= tp.size;
  local_.moe_intermediate_size /= tp.size;
  if (ep.size > 1 || ep.comm != nullptr) {
    int64_t moe_layers = 0;
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) moe_layers += config_.is_moe_layer(l) ? 1 : 0;
    dispatch_ = std::make_unique<ExpertDispatch>(
        backend, *ep.comm, ep.host(),
        ExpertPlacement::contiguous(moe_layers, config_.n_routed_experts, ep.num_redundant_experts, ep.size),
        ep.replicated_tokens, ep.capacity_factor);
  }
}

Status check_tensor_parallel_shapes(const ModelConfig& c, int size) {
  if (size < 1) return Status::invalid_argument("tensor parallel: size " + std::to_string(size));
  const std::pair<const char*, int64_t> dims[] = {{"num_attention_heads", c.num_attention_heads},
                                                  {"intermediate_size", c.intermediate_size},
                                                  {"moe_intermediate_size", c.moe_intermediate_size},
                                                  {"vocab_size", c.vocab_size}};
  for (const auto& [name, value] : dims) {
    if (value % size != 0) {
      return Status::invalid_argument("--tensor-parallel-size " + std::to_string(size) + " does not divide the " +
                                      "model's " + name + " (" + std::to_string(value) + ")");
    }
  }
  return Status();
}

namespace {
Status check_expert_parallel(const ModelConfig& c, const TensorParallel& tp, const ExpertParallel& ep,
                             const backend::Backend& backend) {
  if (ep.size < 1 || ep.rank < 0 || ep.rank >= ep.size) {
    return Status::invalid_argument("expert parallel: rank " + std::to_string(ep.rank) + " of " +
                                    std::to_string(ep.size));
  }
  if (ep.num_redundant_experts < 0) return Status::invalid_argument("--num-redundant-experts must be at least 0");
  if (!(ep.capacity_factor >= 0.0)) return Status::invalid_argument("--moe-capacity-factor must be at least 0");
  if (ep.capacity_factor > 0.0 && ep.size == 1 && ep.comm == nullptr) {
    return Status::invalid_argument("--moe-capacity-factor needs expert parallel (--expert-parallel-size > 1)");
  }
  if (ep.size == 1 && ep.comm == nullptr) {
    if (ep.num_redundant_experts > 0) {
      return Status::invalid_argument("--num-redundant-experts needs expert parallel (--expert-parallel-size > 1)");
    }
    return Status();
  }
  if ((c.n_routed_experts + ep.num_redundant_experts) % ep.size != 0) {
    return Status::invalid_argument("--expert-parallel-size " + std::to_string(ep.size) + " does not divide the " +
                                    "model's n_routed_experts (" + std::to_string(c.n_routed_experts) + ") plus " +
                                    std::to_string(ep.num_redundant_experts) + " redundant experts");
  }
  if (ep.replicated_tokens && (tp.size != ep.size || tp.rank != ep.rank || tp.comm != ep.comm)) {
    return Status::invalid_argument("expert parallel over the tensor-parallel ranks: --expert-parallel-size " +
                                    std::to_string(ep.size) + " must equal --tensor-parallel-size " +
                                    std::to_string(tp.size));
  }
  if (backend.name() != "cpu" && backend.name() != "cuda") {
    return Status::unsupported("expert parallel on the " + std::string(backend.name()) +
                               " backend: its MoE op does not take given routing (the CPU and CUDA backends do)");
  }
  if (ep.comm == nullptr || ep.comm->size() != ep.size || ep.comm->rank() != ep.rank) {
    return Status::invalid_argument("expert parallel: the communicator is not this rank's group of " +
                                    std::to_string(ep.size));
  }
  // The counts, the routing and EPLB's weights are host memory: a device backend needs a host group beside.
  if (backend.name() != "cpu" &&
      (ep.host_comm == nullptr || ep.host_comm->size() != ep.size || ep.host_comm->rank() != ep.rank)) {
    return Status::invalid_argument("expert parallel on the " + std::string(backend.name()) +
                                    " backend: no host-memory group of " + std::to_string(ep.size) +
                                    " ranks beside the device's (ExpertParallel::host_comm)");
  }
  return Status();
}

// Whether `c` splits over `tp` (TensorParallel's requirements) and the communicator is tp's group.
Status check_tensor_parallel(const ModelConfig& c, const TensorParallel& tp) {
  if (tp.size < 1 || tp.rank < 0 || tp.rank >= tp.size) {
    return Status::invalid_argument("tensor parallel: rank " + std::to_string(tp.rank) + " of " +
                                    std::to_string(tp.size));
  }
  if (tp.size == 1) return Status();
  if (Status s = check_tensor_parallel_shapes(c, tp.size); !s.ok()) return s;
  if (tp.comm == nullptr || tp.comm->size() != tp.size || tp.comm->rank() != tp.rank) {
    return Status::invalid_argument("tensor parallel: the communicator is not this rank's group of " +
                                    std::to_string(tp.size));
  }
  return Status();
}
}  // namespace
DeepSeekModel::~DeepSeekModel() {
  if (leading_) send_command(kStopCommand, {});
}

namespace {
// A ForwardBatch as int64 values: T, token ids, S, per sequence (num_tokens, start_position, table length, table),
// the logits rows' count and rows, keep_hidden, keep_dspark_context.
std::vector<int64_t> encode_batch(const ForwardBatch& b) {
  std::vector<int64_t> out;
  out.push_back(static_cast<int64_t>(b.token_ids.size()));
  out.insert(out.end(), b.token_ids.begin(), b.token_ids.end());
  out.push_back(static_cast<int64_t>(b.sequences.size()));
  for (const SequenceChunk& s : b.sequences) {
    out.push_back(s.num_tokens);
    out.push_back(s.start_position);
    out.push_back(static_cast<int64_t>(s.block_table.size()));
    out.insert(out.end(), s.block_table.begin(), s.block_table.end());
  }
  out.push_back(static_cast<int64_t>(b.logits_rows.size()));
  out.insert(out.end(), b.logits_rows.begin(), b.logits_rows.end());
  out.push_back(b.keep_hidden ? 1 : 0);
  out.push_back(b.keep_dspark_context ? 1 : 0);
  return out;
}

Result<ForwardBatch> decode_batch(std::span<const int64_t> in) {
  size_t at = 0;
  auto next = [&]() -> int64_t { return at < in.size() ? in[at++] : -1; };
  auto ints = [&](std::vector<int32_t>& out) {
    const int64_t n = next();
    if (n < 0 || at + static_cast<size_t>(n) > in.size()) return false;
    out.assign(in.begin() + static_cast<std::ptrdiff_t>(at), in.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += static_cast<size_t>(n);
    return true;
  };
  ForwardBatch b;
  bool ok = ints(b.token_ids);
  const int64_t sequences = ok ? next() : -1;
  ok = ok && sequences >= 0;
  for (int64_t s = 0; ok && s < sequences; ++s) {
    SequenceChunk chunk;
    chunk.num_tokens = static_cast<int32_t>(next());
    chunk.start_position = static_cast<int32_t>(next());
    ok = ints(chunk.block_table);
    b.sequences.push_back(std::move(chunk));
  }
  ok = ok && ints(b.logits_rows);
  b.keep_hidden = next() == 1;
  b.keep_dspark_context = next() == 1;
  if (!ok || at != in.size()) return Status::internal("tensor parallel: a malformed step command from rank 0");
  return b;
}
}  // namespace

void DeepSeekModel::send_command(uint64_t kind, std::vector<int64_t> payload) const {
  int64_t header[2] = {static_cast<int64_t>(kind), static_cast<int64_t>(payload.size())};
  tp_.host().broadcast_host_waiting(std::as_writable_bytes(std::span(header)), 0);
  tp_.host().broadcast_host(std::as_writable_bytes(std::span(payload)), 0);
}

backend::Precision DeepSeekModel::expert_precision() const {
  for (const Layer& L : weights_->layers) {
    if (L.moe && L.experts.gate_up) return L.experts.gate_up->precision;
  }
  return backend::Precision::kF32;
}

const ExpertPlacement* DeepSeekModel::expert_placement() const {
  return dispatch_ ? &dispatch_->placement() : nullptr;
}

std::vector<std::vector<double>> DeepSeekModel::expert_load() const {
  return dispatch_ ? dispatch_->load() : std::vector<std::vector<double>>();
}

Status DeepSeekModel::rebalance_experts(EplbPolicy policy, int64_t num_groups, int64_t num_nodes,
                                        std::vector<double>* before, std::vector<double>* after) {
  if (!dispatch_) return Status::invalid_argument("rebalance_experts: the model is not expert-parallel");
  const ExpertPlacement old = dispatch_->placement();
  const int64_t layers = static_cast<int64_t>(old.phy2log.size()), E = old.num_logical, P = old.num_physical;
  const int64_t per_rank = old.slots_per_rank();
  const int size = ep_.size, me = ep_.rank;
  backend::Communicator& comm = ep_.host();  // host floats: the load and the experts' weights
  // 1. The group's load.
  std::vector<float> summed(static_cast<size_t>(layers * E));
  for (int64_t m = 0; m < layers; ++m) {
    for (int64_t e = 0; e < E; ++e) summed[m * E + e] = static_cast<float>(dispatch_->load()[m][e]);
  }
  // Replicated tokens: every rank counted the same tokens already.
  if (!summed.empty() && !dispatch_->replicated()) {
    comm.all_reduce_sum(Tensor{summed.data(), backend::DType::kF32, layers, E, E});
  }
  if (Status s = comm.status(); !s.ok()) return s;
  std::vector<std::vector<double>> load(static_cast<size_t>(layers), std::vector<double>(static_cast<size_t>(E)));
  for (int64_t m = 0; m < layers; ++m) {
    for (int64_t e = 0; e < E; ++e) load[m][e] = summed[m * E + e];
  }
  // 2. The new placement (the same on every rank).
  ExpertPlacement next = model::rebalance_experts(load, P, size, policy, num_groups, num_nodes);
  std::vector<double> imbalance_before, imbalance_after;
  for (int64_t m = 0; m < layers; ++m) {
    imbalance_before.push_back(rank_imbalance(load[m], old.phy2log[m], size));
    imbalance_after.push_back(rank_imbalance(load[m], next.phy2log[m], size));
  }
  if (before) *before = imbalance_before;
  if (after) *after = imbalance_after;
  // 3. Each MoE layer's experts to their new slots: a slot's expert comes from its own rank when that rank held it,
  // else from the lowest rank that did.
  auto source_of = [&](int64_t m, int64_t slot) {
    const int32_t e = next.phy2log[m][slot];
    const int64_t q = slot / per_rank;
    for (int64_t j = 0; j < per_rank; ++j) {
      if (old.phy2log[m][q * per_rank + j] == e) return std::pair<int64_t, int64_t>{q, j};
    }
    for (int64_t p = 0; p < P; ++p) {
      if (old.phy2log[m][p] == e) return std::pair<int64_t, int64_t>{p / per_rank, p % per_rank};
    }
    return std::pair<int64_t, int64_t>{-1, -1};  // unreachable: every expert has a slot
  };
  // Every rank learns whether any rank failed (an all-reduce of a flag), so that all return together instead of some
  // waiting in the next collective; the failing rank returns its own error, the others an Internal naming this.
  auto agree = [&](Status s) -> Status {
    float failed = s.ok() ? 0.0f : 1.0f;
    comm.all_reduce_sum(Tensor{&failed, backend::DType::kF32, 1, 1, 1});
    if (Status c = comm.status(); !c.ok()) return c;
    if (!s.ok()) return s;
    return failed > 0.0f ? Status::internal("rebalance_experts: another rank failed to move its experts") : Status();
  };
  // One matrix of an expert in its all-to-all row, as float32 words moved as bits: bf16 / f32 weights as their
  // values (bf16 widened exactly); FP8 ones as their e4m3 bytes, four to a word, then their 128 x 128 block scales.
  auto byte_words = [](const Weight& w) { return (w.rows * w.cols + 3) / 4; };
  auto scale_count = [](const Weight& w) { return ((w.rows + 127) / 128) * ((w.cols + 127) / 128); };
  auto fp8 = [](const Weight& w) { return w.precision == backend::Precision::kFP8; };
  auto words_of = [&](const Weight& w) { return fp8(w) ? byte_words(w) + scale_count(w) : w.rows * w.cols; };
  auto read_into = [&](const Weight& w, int64_t local, float* out) -> Status {
    if (fp8(w)) {
      Result<backend::Backend::Fp8Matrix> a = backend_.read_matrix_fp8(w, local);
      if (!a.ok()) return a.status();
      auto* bytes = reinterpret_cast<uint8_t*>(out);
      std::fill(bytes, bytes + byte_words(w) * 4, uint8_t{0});
      std::copy(a->values.begin(), a->values.end(), bytes);
      std::copy(a->scales.begin(), a->scales.end(), out + byte_words(w));
      return Status();
    }
    Result<std::vector<float>> a = backend_.read_matrix(w, local);
    if (!a.ok()) return a.status();
    std::copy(a->begin(), a->end(), out);
    return Status();
  };
  auto set_from = [&](Weight& w, int64_t j, const float* in) -> Status {
    const auto n = static_cast<size_t>(w.rows * w.cols);
    if (fp8(w)) {
      const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(in), n);
      const std::span<const float> scales(in + byte_words(w), static_cast<size_t>(scale_count(w)));
      return backend_.set_matrix(w, j, backend::HostMatrix{w.rows, w.cols, {}, bytes, scales});
    }
    return backend_.set_matrix(w, j, backend::HostMatrix{w.rows, w.cols, std::span<const float>(in, n), {}, {}});
  };
  // The placement as installed so far: a failure after some layers were moved leaves each layer routed to the
  // experts it now holds.
  ExpertPlacement installed = old;
  auto fail = [&](Status s) {
    backend_.reset_graphs();
    dispatch_->set_placement(std::move(installed));
    return s;
  };
  for (int64_t l = 0, m = 0; l < config_.num_hidden_layers; ++l) {
    Layer& L = weights_->layers[static_cast<size_t>(l)];
    if (!L.moe) continue;
    const Weight& gate_up = *L.experts.gate_up;
    const Weight& down = *L.experts.down;
    const int64_t gate_up_words = words_of(gate_up), row = gate_up_words + words_of(down);
    auto read_expert = [&](int64_t local, float* out) -> Status {
      if (Status s = read_into(gate_up, local, out); !s.ok()) return s;
      return read_into(down, local, out + gate_up_words);
    };
    std::vector<int64_t> send_rows(static_cast<size_t>(size), 0), recv_rows(static_cast<size_t>(size), 0);
    std::vector<float> send, recv;
    Status read = Status();
    for (int64_t q = 0; q < size; ++q) {
      for (int64_t j = 0; j < per_rank; ++j) {
        const auto [rank, local] = source_of(m, q * per_rank + j);
        if (q != me && rank == me) {
          send.resize(send.size() + static_cast<size_t>(row));
          if (read.ok()) read = read_expert(local, send.data() + send.size() - row);
          ++send_rows[q];
        }
        if (q == me && rank != me) ++recv_rows[rank];
      }
    }
    if (Status s = agree(read); !s.ok()) return fail(s);
    int64_t received = 0;
    for (int64_t n : recv_rows) received += n;
    recv.resize(static_cast<size_t>(received * row));
    const int64_t sent = static_cast<int64_t>(send.size()) / row;
    comm.all_to_all_rows(Tensor{send.empty() ? nullptr : send.data(), backend::DType::kF32, sent, row, row}, send_rows,
                         Tensor{recv.empty() ? nullptr : recv.data(), backend::DType::kF32, received, row, row},
                         recv_rows);
    if (Status s = comm.status(); !s.ok()) return fail(s);
    // The received rows come by source rank, each source's in slot order.
    std::vector<int64_t> next_from(static_cast<size_t>(size), 0);
    for (int64_t q = 0, at = 0; q < size; ++q) {
      next_from[q] = at;
      at += recv_rows[q];
    }
    Status made = Status();
    Result<WeightPtr> new_gate_up = backend_.make_weight(per_rank, gate_up.rows, gate_up.cols, gate_up.precision);
    Result<WeightPtr> new_down = backend_.make_weight(per_rank, down.rows, down.cols, down.precision);
    if (!new_gate_up.ok()) made = new_gate_up.status();
    if (made.ok() && !new_down.ok()) made = new_down.status();
    std::vector<float> values(static_cast<size_t>(row));
    for (int64_t j = 0; made.ok() && j < per_rank; ++j) {
      const auto [rank, local] = source_of(m, me * per_rank + j);
      const float* expert = nullptr;
      if (rank == me) {
        made = read_expert(local, values.data());
        expert = values.data();
      } else {
        expert = recv.data() + next_from[rank]++ * row;
      }
      if (made.ok()) made = set_from(**new_gate_up, j, expert);
      if (made.ok()) made = set_from(**new_down, j, expert + gate_up_words);
    }
    if (Status s = agree(made); !s.ok()) return fail(s);
    L.experts.gate_up = std::move(new_gate_up).value();
    L.experts.down = std::move(new_down).value();
    installed.phy2log[static_cast<size_t>(m)] = next.phy2log[static_cast<size_t>(m)];
    ++m;
  }
  backend_.reset_graphs();
  dispatch_->set_placement(std::move(next));
  for (std::vector<double>& layer : dispatch_->load()) std::fill(layer.begin(), layer.end(), 0.0);
  ++eplb_stats_.rebalances;
  eplb_stats_.imbalance_before = std::move(imbalance_before);
  eplb_stats_.imbalance_after = std::move(imbalance_after);
  return Status();
}

EplbStats DeepSeekModel::eplb_stats() const {
  EplbStats stats = eplb_stats_;
  if (dispatch_) {
    stats.expert_tokens = dispatch_->total_load();
    stats.capacity_dropped = dispatch_->capacity_dropped();
    stats.dispatch_seconds = dispatch_->dispatch_seconds();
    stats.combine_seconds = dispatch_->combine_seconds();
  }
  return stats;
}

void DeepSeekModel::lead() {
  DEEPINFER_CHECK(tp_.size > 1 && tp_.rank == 0, "lead(): rank 0 of a tensor-parallel group");
  leading_ = true;
}

Status DeepSeekModel::follow() {
  DEEPINFER_CHECK(tp_.size > 1 && tp_.rank > 0, "follow(): a rank other than 0 of a tensor-parallel group");
  std::vector<Buffer> caches;
  std::vector<float> logits;
  std::vector<int32_t> ids;
  while (true) {
    int64_t header[2] = {0, 0};
    tp_.host().broadcast_host_waiting(std::as_writable_bytes(std::span(header)), 0);
    if (Status s = tp_.host().status(); !s.ok()) return s;
    if (header[1] < 0 || header[1] > (int64_t{1} << 32)) return Status::internal("tensor parallel: bad command size");
    std::vector<int64_t> payload(static_cast<size_t>(header[1]));
    tp_.host().broadcast_host(std::as_writable_bytes(std::span(payload)), 0);
    if (Status s = tp_.host().status(); !s.ok()) return s;
    switch (header[0]) {
      case kStopCommand:
        return Status();
      case kRebalanceCommand:
        if (payload.size() != 3) return Status::internal("tensor parallel: a malformed rebalance command");
        if (Status s = rebalance_experts(static_cast<EplbPolicy>(payload[0]), payload[1], payload[2]); !s.ok()) return s;
        break;
      case kWriteBlocksCommand: {
        // payload: num_layers, then the block ids; then the blocks' bytes (block after block, layer-major).
        if (payload.empty() || payload[0] != static_cast<int64_t>(caches.size())) {  // the main and draft layers'
          return Status::internal("tensor parallel: a block write for " + std::to_string(payload.empty() ? 0 : payload[0]) +
                                  " layers on a rank with " + std::to_string(caches.size()) + " layer caches");
        }
        const size_t block_bytes = layer_block_bytes() * caches.size();
        std::vector<int32_t> blocks(payload.begin() + 1, payload.end());
        std::vector<std::byte> bytes(block_bytes * blocks.size());
        tp_.host().broadcast_host(bytes, 0);
        if (Status s = tp_.host().status(); !s.ok()) return s;
        std::vector<const std::byte*> in(blocks.size());
        for (size_t i = 0; i < blocks.size(); ++i) in[i] = bytes.data() + i * block_bytes;
        if (Status s = backend::upload_kv_blocks(backend_, caches, layer_block_bytes(), blocks, in); !s.ok()) return s;
        break;
      }
      case kDraftCacheCommand: {  // appended after the main layers' (the engine's order)
        if (payload.size() != 1) return Status::internal("tensor parallel: a malformed draft cache command");
        Result<Buffer> made = make_layer_cache(payload[0]);
        if (!made.ok()) return made.status();
        caches.push_back(std::move(made).value());
        break;
      }
      case kForwardMtpCommand: {
        // payload: MTP layer, draft cache index, hidden rows (count, rows), then the rows as a ForwardBatch.
        const size_t head = payload.size() >= 3 ? 3 + static_cast<size_t>(std::max<int64_t>(payload[2], 0)) : 0;
        if (head == 0 || payload.size() < head || payload[1] < 0 ||
            config_.num_hidden_layers + payload[1] >= static_cast<int64_t>(caches.size())) {
          return Status::internal("tensor parallel: a malformed MTP pass command");
        }
        Result<ForwardBatch> rows = decode_batch(std::span<const int64_t>(payload).subspan(head));
        if (!rows.ok()) return rows.status();
        MtpBatch mtp{std::move(rows->token_ids), std::move(rows->sequences),
                     std::vector<int32_t>(payload.begin() + 3, payload.begin() + static_cast<std::ptrdiff_t>(head)),
                     std::move(rows->logits_rows)};
        const Status s = forward_mtp(payload[0], mtp, caches[static_cast<size_t>(config_.num_hidden_layers + payload[1])],
                                     &logits, nullptr);
        if (Status group = tp_.comm->status(); !group.ok()) return group;
        if (Status group = tp_.host().status(); !group.ok()) return group;
        (void)s;  // as a forward pass's: it failed on rank 0 too
        break;
      }
      case kDsparkInjectCommand:
      case kDsparkBlockCommand: {
        // payload: the first stage cache's draft index, then the rows as a ForwardBatch (the context rows or the
        // block's token ids as its token ids).
        const int64_t stages = config_.dspark ? config_.dspark->num_stages() : 0;
        if (payload.empty() || payload[0] < 0 ||
            config_.num_hidden_layers + payload[0] + stages > static_cast<int64_t>(caches.size())) {
          return Status::internal("tensor parallel: a malformed DSpark pass command");
        }
        Result<ForwardBatch> rows = decode_batch(std::span<const int64_t>(payload).subspan(1));
        if (!rows.ok()) return rows.status();
        const LayerCaches stage_caches = std::span<const Buffer>(caches).subspan(
            static_cast<size_t>(config_.num_hidden_layers + payload[0]), static_cast<size_t>(stages));
        std::vector<float> hidden;
        DsparkBlockBatch block{std::move(rows->token_ids), std::move(rows->sequences)};
        // A compact head is whole on every rank: no gather to join, so the logits stay where they are. A shared
        // lm_head's slices are gathered (forward_dspark_block's read).
        const Status s =
            header[0] == kDsparkInjectCommand
                ? forward_dspark_inject(DsparkInjectBatch{std::move(block.token_ids), std::move(block.sequences)},
                                        stage_caches)
            : weights_->dspark && weights_->dspark->head ? run_dspark_block(block, stage_caches)
                                                         : forward_dspark_block(block, stage_caches, logits, hidden);
        if (Status group = tp_.comm->status(); !group.ok()) return group;
        if (Status group = tp_.host().status(); !group.ok()) return group;
        (void)s;  // as a forward pass's: it failed on rank 0 too
        break;
      }
      case kCachesCommand: {
        if (payload.size() != 1) return Status::internal("tensor parallel: a malformed caches command");
        caches.clear();
        Result<std::vector<Buffer>> made = make_layer_caches(payload[0]);
        if (!made.ok()) return made.status();
        caches = std::move(made).value();
        break;
      }
      case kForwardCommand:
      case kForwardGreedyCommand: {
        Result<ForwardBatch> batch = decode_batch(payload);
        if (!batch.ok()) return batch.status();
        // A pass that fails here fails on rank 0 too (the same checks, or the same collective); only a broken group
        // ends the loop.
        const Status s = header[0] == kForwardCommand ? run(*batch, caches, &logits, nullptr)
                                                      : run(*batch, caches, nullptr, &ids);
        if (Status group = tp_.comm->status(); !group.ok()) return group;
        if (Status group = tp_.host().status(); !group.ok()) return group;
        (void)s;
        break;
      }
      default:
        return Status::internal("tensor parallel: unknown command " + std::to_string(header[0]));
    }
  }
}
Status DeepSeekModel::replicate_cache_blocks(std::span<const int32_t> blocks, std::span<const std::byte* const> in,
                                             int64_t num_layers) {
  if (!leading_ || blocks.empty()) return Status();
  if (in.size() != blocks.size()) return Status::invalid_argument("replicate_cache_blocks: one payload per block");
  const int64_t layers = config_.num_hidden_layers + static_cast<int64_t>(draft_caches_.size());
  if (num_layers != layers) {
    return Status::invalid_argument("replicate_cache_blocks: " + std::to_string(num_layers) + " layers, the ranks keep " +
                                    std::to_string(layers));
  }
  std::vector<int64_t> payload{num_layers};
  payload.insert(payload.end(), blocks.begin(), blocks.end());
  send_command(kWriteBlocksCommand, std::move(payload));
  const size_t block_bytes = layer_block_bytes() * static_cast<size_t>(num_layers);
  std::vector<std::byte> bytes(block_bytes * blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) std::memcpy(bytes.data() + i * block_bytes, in[i], block_bytes);
  tp_.host().broadcast_host(bytes, 0);
  return group_failure(tp_.host().status());
}

const ModelConfig& DeepSeekModel::config() const { return config_; }
size_t DeepSeekModel::weight_bytes() const { return weights_->bytes; }

size_t DeepSeekModel::layer_block_bytes() const {
  return static_cast<size_t>(kBlockTokens * config_.kv_cache_dim()) * backend::dtype_size(backend_.cache_dtype());
}

std::vector<DeepSeekModel::CachedKind> DeepSeekModel::cached_kinds(int32_t mtp_layers) const {
  return {CachedKind{"latent", static_cast<int32_t>(config_.num_hidden_layers) + mtp_layers,
                     static_cast<int64_t>(config_.kv_cache_dim()) *
                         static_cast<int64_t>(backend::dtype_size(backend_.cache_dtype())),
                     0}};
}

Result<Buffer> DeepSeekModel::make_layer_cache(int64_t num_blocks) const {
  return backend_.alloc(layer_block_bytes() * static_cast<size_t>(num_blocks));
}

Result<Buffer> DeepSeekModel::make_draft_layer_cache(int64_t num_blocks) {
  if (leading_) send_command(kDraftCacheCommand, {num_blocks});
  Result<Buffer> cache = make_layer_cache(num_blocks);
  if (cache.ok()) draft_caches_.push_back(cache->data());
  return cache;
}

Result<std::vector<Buffer>> DeepSeekModel::make_layer_caches(int64_t num_blocks) const {
  draft_caches_.clear();
  if (leading_) send_command(kCachesCommand, {num_blocks});
  std::vector<Buffer> caches;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    Result<Buffer> layer = make_layer_cache(num_blocks);
    if (!layer.ok()) return layer.status();
    caches.push_back(std::move(layer).value());
  }
  return caches;
}

Result<std::unique_ptr<DeepSeekModel>> DeepSeekModel::load(const std::filesystem::path& dir, backend::Backend& backend,
                                                           Precision precision, bool progress,
                                                           const TensorParallel& tp, const ExpertParallel& ep) {
  Result<ModelConfig> config = load_model_config(dir);
  if (!config.ok()) return config.status();
  if (Status s = check_supported(*config, backend, dir.string() + "/config.json"); !s.ok()) return s;
  if (Status s = check_tensor_parallel(*config, tp); !s.ok()) return s;
  if (Status s = check_expert_parallel(*config, tp, ep, backend); !s.ok()) return s;
  Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  std::unique_ptr<DeepSeekModel> model(new DeepSeekModel(std::move(config).value(), backend, tp, ep));
  Loader loader(backend, checkpoint->get(), model->config_, precision,
                progress ? terminal_progress_bar("loading " + dir.filename().string()) : LoadProgress(), 0);
  if (Status s = build(loader, backend, model->config_, Shard{tp.rank, tp.size}, *model->weights_,
                       model->dispatch_ ? &model->dispatch_->placement() : nullptr, ep.rank, ep.replicated_tokens);
      !s.ok()) {
    return s;
  }
  return model;
}

Result<std::unique_ptr<DeepSeekModel>> DeepSeekModel::create_random(const ModelConfig& config,
                                                                    backend::Backend& backend, Precision precision,
                                                                    uint64_t seed, const TensorParallel& tp,
                                                                    const ExpertParallel& ep) {
  if (Status s = check_supported(config, backend, "config"); !s.ok()) return s;
  if (Status s = check_tensor_parallel(config, tp); !s.ok()) return s;
  if (Status s = check_expert_parallel(config, tp, ep, backend); !s.ok()) return s;
  std::unique_ptr<DeepSeekModel> model(new DeepSeekModel(config, backend, tp, ep));
  Loader loader(backend, nullptr, model->config_, precision, LoadProgress(), seed);
  if (Status s = build(loader, backend, model->config_, Shard{tp.rank, tp.size}, *model->weights_,
                       model->dispatch_ ? &model->dispatch_->placement() : nullptr, ep.rank, ep.replicated_tokens);
      !s.ok()) {
    return s;
  }
  return model;
}

Status DeepSeekModel::reserve_scratch(int64_t rows) {
  Scratch& s = *scratch_;
  if (rows <= s.capacity) return Status();
  const ModelConfig& c = local_;
  const int64_t capacity = std::max<int64_t>(rows, 2 * s.capacity);
  // Nothing is usable until every buffer is regrown: a failed allocation part way leaves capacity 0, so the next
  // step allocates again instead of writing through a freed buffer.
  s.capacity = 0;
  const int64_t H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  int64_t inter = c.moe_intermediate_size * std::max<int64_t>(c.n_shared_experts, 1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) inter = std::max(inter, c.intermediate_size);
  }
  const size_t element = backend::dtype_size(backend_.activation_dtype());
  // The backend's graphs bake in the old buffers' addresses: drop them before the buffers go.
  backend_.reset_graphs();
  struct Want {
    Buffer* buffer;
    int64_t cols;
  };
  for (int64_t i = 0; i < c.num_nextn_predict_layers; ++i) {
    if (!c.is_moe_layer(c.num_hidden_layers + i)) inter = std::max(inter, c.intermediate_size);
  }
  if (c.dspark) inter = std::max(inter, c.intermediate_size);  // dense stages
  const int64_t mtp_cols = c.num_nextn_predict_layers > 0 ? c.hidden_size : 0;
  const int64_t dspark_cols = c.dspark ? c.hidden_size * c.dspark->num_stages() : 0;
  const Want wants[] = {{&s.x, c.hidden_size},          {&s.normed, c.hidden_size},
                        {&s.q, H * c.qk_head_dim()},    {&s.q_a, c.q_lora_rank.value_or(1)},
                        {&s.kv, C + R},                 {&s.q_absorbed, H * (C + R)},
                        {&s.out_latent, H * C},         {&s.attn, H * c.v_head_dim},
                        {&s.projected, c.hidden_size},  {&s.gate_up, 2 * inter},
                        {&s.act, inter},                {&s.ffn, c.hidden_size},
                        {&s.kept_hidden, mtp_cols},     {&s.mtp_hidden, mtp_cols},
                        {&s.mtp_concat, 2 * mtp_cols},  {&s.dspark_context, dspark_cols},
                        {&s.dspark_gathered, dspark_cols}};
  kept_hidden_rows_ = 0;  // the kept hidden state goes with its buffer
  kept_context_rows_ = 0;
  for (const Want& want : wants) {
    if (want.cols == 0) continue;
    *want.buffer = Buffer();  // free before allocating the larger one
    Result<Buffer> b = backend_.alloc(static_cast<size_t>(capacity * want.cols) * element);
    if (!b.ok()) return b.status();
    *want.buffer = std::move(b).value();
  }
  s.capacity = capacity;
  return Status();
}

Status DeepSeekModel::group_failure(Status pass) const {
  if (pass.ok()) return pass;
  for (backend::Communicator* comm : {tp_.comm, tp_.host_comm, ep_.comm, ep_.host_comm}) {
    if (comm != nullptr && comm->failed()) {
      return Status::shutting_down("the server is stopping: its " +
                                   std::string(comm == ep_.comm || comm == ep_.host_comm ? "expert" : "tensor") +
                                   "-parallel group failed (" +
                                   comm->status().message() + ")");
    }
  }
  return pass;
}

Status DeepSeekModel::finish_pass(Status pass, std::chrono::steady_clock::time_point started) {
  if (dispatch_) eplb_stats_.pass_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return group_failure(std::move(pass));
}

Status DeepSeekModel::forward(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<float>& logits) {
  const auto started = std::chrono::steady_clock::now();
  return finish_pass(run(batch, layer_caches, &logits, nullptr), started);
}

Status DeepSeekModel::forward_greedy(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<int32_t>& ids) {
  const auto started = std::chrono::steady_clock::now();
  return finish_pass(run(batch, layer_caches, nullptr, &ids), started);
}

bool DeepSeekModel::samples_on_device() const { return tp_.size == 1 && backend_.has_device_sampling(); }

Status DeepSeekModel::forward_sampled(const ForwardBatch& batch, LayerCaches layer_caches,
                                      std::span<const backend::Backend::DeviceSampling> sampling,
                                      std::span<const backend::Backend::LogitAdjustment> adjustments,
                                      std::vector<int32_t>& ids,
                                      std::vector<backend::Backend::SampledLogprobs>* logprobs) {
  if (!samples_on_device())
    return Status::unsupported("forward_sampled: the " + std::string(backend_.name()) +
                               " backend does not sample on the device" + (tp_.size > 1 ? " with tensor parallel" : ""));
  if (sampling.size() != batch.logits_rows.size())
    return Status::invalid_argument("forward_sampled: " + std::to_string(sampling.size()) + " rows' sampling for " +
                                    std::to_string(batch.logits_rows.size()) + " logits rows");
  return run(batch, layer_caches, nullptr, &ids, sampling, adjustments, logprobs);
}

namespace {

// Each row's position, sequence and cache slot, from a step's chunks; validates ids, tables and logits rows.
struct RowLayout {
  std::vector<int32_t> positions, row_sequence;
  std::vector<int64_t> slot;
  std::vector<std::vector<int32_t>> block_tables;
  bool rows_start_at_zero = true;
};

// The backend's view of a step laid out by layout_rows (block_table_stride left 0: the caller's choice).
backend::StepLayout step_layout(std::span<const int32_t> token_ids, std::span<const int32_t> logits_rows,
                                const RowLayout& rows) {
  backend::StepLayout layout;
  layout.token_ids = token_ids;
  layout.positions = rows.positions;
  layout.row_sequence = rows.row_sequence;
  layout.slots = rows.slot;
  layout.block_tables = rows.block_tables;
  layout.logits_rows = logits_rows;
  layout.rows_start_at_zero = rows.rows_start_at_zero;
  return layout;
}

Status layout_rows(const char* what, std::span<const int32_t> token_ids, std::span<const SequenceChunk> sequences,
                   std::span<const int32_t> logits_rows, int64_t vocab_size, RowLayout& out) {
  const int64_t T = static_cast<int64_t>(token_ids.size());
  out.positions.assign(static_cast<size_t>(T), 0);
  out.row_sequence.assign(static_cast<size_t>(T), 0);
  out.slot.assign(static_cast<size_t>(T), 0);
  out.block_tables.clear();
  out.rows_start_at_zero = true;
  int64_t row = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    const SequenceChunk& chunk = sequences[s];
    out.block_tables.push_back(chunk.block_table);
    out.rows_start_at_zero = out.rows_start_at_zero && chunk.start_position == 0;
    for (int32_t i = 0; i < chunk.num_tokens; ++i, ++row) {
      if (row >= T) return Status::invalid_argument(std::string(what) + ": sequence chunks cover more rows than token_ids");
      int32_t position = chunk.start_position + i;
      size_t block_index = static_cast<size_t>(position / kBlockTokens);
      if (block_index >= chunk.block_table.size()) {
        return Status::invalid_argument(std::string(what) + ": sequence " + std::to_string(s) +
                                        " has no cache block for position " + std::to_string(position));
      }
      out.positions[row] = position;
      out.row_sequence[row] = static_cast<int32_t>(s);
      out.slot[row] = chunk.block_table[block_index] * kBlockTokens + position % kBlockTokens;
    }
  }
  if (row != T) return Status::invalid_argument(std::string(what) + ": sequence chunks do not cover token_ids");
  for (int32_t id : token_ids) {
    if (id < 0 || id >= vocab_size) {
      return Status::invalid_argument(std::string(what) + ": token id " + std::to_string(id) +
                                      " outside the vocabulary of " + std::to_string(vocab_size));
    }
  }
  for (int32_t r : logits_rows) {
    if (r < 0 || r >= T) return Status::invalid_argument(std::string(what) + ": logits row outside the batch");
  }
  return Status();
}

// The step's activations over the scratch buffers, [T, cols] each.
struct StepTensors {
  Tensor x, normed, q, q_a, kv, q_absorbed, out_latent, attn, projected, ffn;
  const Buffer* gate_up = nullptr;
  const Buffer* act = nullptr;
  backend::DType dtype = backend::DType::kF32;
  int64_t rows = 0;
  Tensor rows_of(const Buffer& b, int64_t cols) const { return Tensor{b.data(), dtype, rows, cols, cols}; }
};

StepTensors step_tensors(const DeepSeekModel::Scratch& S, const ModelConfig& c, backend::DType dtype, int64_t T) {
  StepTensors t;
  t.dtype = dtype;
  t.rows = T;
  const int64_t H = c.num_attention_heads, entry = c.kv_cache_dim();
  t.x = t.rows_of(S.x, c.hidden_size);
  t.normed = t.rows_of(S.normed, c.hidden_size);
  t.q = t.rows_of(S.q, H * c.qk_head_dim());
  t.q_a = t.rows_of(S.q_a, c.q_lora_rank.value_or(1));
  t.kv = t.rows_of(S.kv, entry);
  t.q_absorbed = t.rows_of(S.q_absorbed, H * entry);
  t.out_latent = t.rows_of(S.out_latent, H * c.kv_lora_rank);
  t.attn = t.rows_of(S.attn, H * c.v_head_dim);
  t.projected = t.rows_of(S.projected, c.hidden_size);
  t.ffn = t.rows_of(S.ffn, c.hidden_size);
  t.gate_up = &S.gate_up;
  t.act = &S.act;
  return t;
}

// One decoder layer on t.normed (its input, already normalized by input_layernorm): attention over `cache`
// (writing the rows' KV entries), whose output is added into the residual t.x, then the feed-forward of the
// post-attention norm into t.ffn (the caller adds it to t.x). `c` holds this rank's shapes (heads and intermediate
// sizes divided by the tensor-parallel size); with `tp`, the partial sums of o_proj and of the feed-forward are
// all-reduced over it.
// `next_norm` (optional): the next layer's input norm. Where the layer's MoE can take them (no expert or tensor
// parallel), the residual add (t.x += t.ffn) and that norm (into t.normed) run with it (moe_add_rms_norm), and the
// layer returns true; false: the caller adds and norms.
bool decoder_layer(backend::Backend& b, const ModelConfig& c, const DeepSeekModel::Weights& w, const Layer& L,
                   const Buffer& cache, const StepTensors& t, bool use_expanded, backend::Communicator* tp,
                   ExpertDispatch* ep = nullptr, int64_t moe_layer = 0, const Buffer* next_norm = nullptr) {
  const int64_t H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t nope = c.qk_nope_head_dim, qk = c.qk_head_dim(), V = c.v_head_dim, entry = C + R;
  const float eps = static_cast<float>(c.rms_norm_eps);
  // Per-head views: head h's rope part of q, and of the absorbed query, as rows of R values.
  Tensor q_rope = t.q.reshaped(qk).cols_slice(nope, R);
  Tensor q_absorbed_rope = t.q_absorbed.reshaped(entry).cols_slice(C, R);
  // Latent and rope key [T, C + R] (kv_a), on the backend's side lane beside the queries' projections up to
  // kSideLaneMaxRows rows (at decode two small weight reads, one launch fewer on the step's critical path).
  const bool kv_lane = b.has_side_lane() && t.normed.rows <= kSideLaneMaxRows;
  if (kv_lane) {
    b.begin_side_lane();
    b.linear(t.normed, *L.kv_a_proj_with_mqa, t.kv);
    b.end_side_lane();
  }
  // Queries [T, H * qk].
  if (c.q_lora_rank) {
    b.linear(t.normed, *L.q_a_proj, t.q_a);
    b.rms_norm(t.q_a, L.q_a_layernorm, eps, t.q_a);
    b.linear(t.q_a, *L.q_b_proj, t.q);
  } else {
    b.linear(t.normed, *L.q_proj, t.q);
  }
  if (kv_lane) {
    b.join_side_lane();
  } else {
    b.linear(t.normed, *L.kv_a_proj_with_mqa, t.kv);
  }
  // Normalize the latent, rope the key, store both in the cache; rope the queries' rope parts (for the absorbed
  // form also into the absorbed query, whose latent part linear_heads writes below).
  b.mla_prepare(t.kv, C, L.kv_a_layernorm, eps, q_rope, H, w.inv_freq, w.rope_attention_factor, cache,
                use_expanded ? Tensor{} : q_absorbed_rope);
  if (use_expanded) {
    backend::MlaExpanded expanded{H, C, R, nope, V, w.softmax_scale, L.kv_b.get()};
    b.mla_expanded(expanded, t.q, t.kv, cache, t.attn);
  } else {
    // Absorbed query per head: [W_UK[h]ᵀ q_nope | roped q_rope]; attention over the latent; W_UV per head.
    backend::MlaAttention attention{H, C, R, w.softmax_scale};
    b.linear_heads(t.q, qk, *L.w_uk_t, t.q_absorbed, entry);
    b.mla_attention(attention, t.q_absorbed, cache, t.out_latent);
    b.linear_heads(t.out_latent, C, *L.w_uv, t.attn, V);
  }
  b.linear(t.attn, *L.o_proj, t.projected);
  if (tp) tp->all_reduce_sum(t.projected);
  b.add_rms_norm(t.x, t.projected, L.post_attention_layernorm, eps, t.normed);

  // Feed-forward.
  auto run_mlp = [&](const Mlp& mlp, Tensor output) {
    const int64_t inter = mlp.down->cols;
    Tensor gate_up = t.rows_of(*t.gate_up, 2 * inter), act = t.rows_of(*t.act, inter);
    b.linear(t.normed, *mlp.gate_up, gate_up);
    b.silu_mul(gate_up, act);
    b.linear(act, *mlp.down, output);
  };
  if (!L.moe) {
    run_mlp(L.dense, t.ffn);
  } else {
    // The shared experts on the backend's side lane, beside the routed ones up to kSideLaneMaxRows rows:
    // moe() joins it before its combine adds the routed experts into t.ffn.
    const bool side_lane =
        L.has_shared && ep == nullptr && b.has_side_lane() && t.normed.rows <= kSideLaneMaxRows;
    if (side_lane) b.begin_side_lane();
    if (L.has_shared) {
      run_mlp(L.shared, t.ffn);
    } else {
      b.fill_zero(t.ffn);
    }
    if (side_lane) b.end_side_lane();
    if (ep != nullptr) {
      ep->run(w.rule, L, moe_layer, t.normed, t.ffn);
    } else {
      backend::MoeWeights moe{w.rule, L.gate.get(), L.has_gate_bias ? &L.gate_bias : nullptr,
                              L.experts.gate_up.get(), L.experts.down.get()};
      if (next_norm != nullptr && tp == nullptr) {
        b.moe_add_rms_norm(t.normed, moe, t.ffn, t.x, *next_norm, eps, t.normed);
        return true;
      }
      b.moe(t.normed, moe, t.ffn);
    }
  }
  if (tp) tp->all_reduce_sum(t.ffn);
  return false;
}

// Per row of host logits [rows, vocab]: the argmax (lowest id among equal maxima), -1 for a row holding a NaN or
// +inf or nothing above -inf: the rule of Backend::compute_logits(greedy).
void greedy_ids(const std::vector<float>& logits, int64_t vocab, std::vector<int32_t>& ids) {
  const int64_t rows = static_cast<int64_t>(logits.size()) / vocab;
  ids.assign(static_cast<size_t>(rows), -1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * vocab;
    float best = -INFINITY;
    bool bad = false;
    for (int64_t i = 0; i < vocab; ++i) {
      bad = bad || std::isnan(row[i]) || row[i] == INFINITY;
      if (row[i] > best) {
        best = row[i];
        ids[static_cast<size_t>(r)] = static_cast<int32_t>(i);
      }
    }
    if (bad) ids[static_cast<size_t>(r)] = -1;
  }
}

// The softmax probability of each row's id in `ids` (0 where the id is -1), as Backend::read_top_probabilities.
void greedy_probabilities(const std::vector<float>& logits, int64_t vocab, const std::vector<int32_t>& ids,
                          std::vector<float>& probabilities) {
  probabilities.assign(ids.size(), 0.0f);
  for (size_t r = 0; r < ids.size(); ++r) {
    if (ids[r] < 0) continue;
    probabilities[r] = backend::softmax_probability_of(
        std::span<const float>(logits).subspan(r * static_cast<size_t>(vocab), static_cast<size_t>(vocab)), ids[r]);
  }
}

}  // namespace

Status DeepSeekModel::read_gathered_logits(std::vector<float>* logits, std::vector<int32_t>* greedy) {
  std::vector<float>& gathered = logits != nullptr ? *logits : tp_logits_;
  Status read = backend_.read_logits(gathered);
  if (read.ok()) read = tp_.comm->status();
  if (read.ok()) read = gather_vocab(gathered);
  if (read.ok() && greedy != nullptr) greedy_ids(gathered, config_.vocab_size, *greedy);
  return read;
}

Status DeepSeekModel::run(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<float>* logits,
                          std::vector<int32_t>* greedy, std::span<const backend::Backend::DeviceSampling> sampling,
                          std::span<const backend::Backend::LogitAdjustment> adjustments,
                          std::vector<backend::Backend::SampledLogprobs>* logprobs) {
  const ModelConfig& c = local_;  // this rank's shapes (config_ without tensor parallel)
  backend::Communicator* tp = tp_.size > 1 ? tp_.comm : nullptr;
  // With tensor parallel the head's logits are gathered over the ranks before the argmax (on the host).
  const bool device_greedy = greedy != nullptr && tp == nullptr && sampling.empty();
  // With tensor parallel rank 0 decides and commands; without (data-parallel ranks in lock step, each with the
  // same schedule), every rank counts the same passes and rebalances before the same one.
  if ((leading_ || tp_.size == 1) && dispatch_ && eplb_schedule_.interval_passes > 0 &&
      ++passes_since_rebalance_ >= eplb_schedule_.interval_passes) {
    passes_since_rebalance_ = 0;
    const EplbSchedule& e = eplb_schedule_;
    if (leading_) send_command(kRebalanceCommand, {static_cast<int64_t>(e.policy), e.num_groups, e.num_nodes});
    if (Status s = rebalance_experts(e.policy, e.num_groups, e.num_nodes); !s.ok()) return s;
  }
  if (leading_) send_command(greedy != nullptr ? kForwardGreedyCommand : kForwardCommand, encode_batch(batch));
  const Weights& w = *weights_;
  const int64_t T = static_cast<int64_t>(batch.token_ids.size());
  const int64_t H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t nope = c.qk_nope_head_dim, V = c.v_head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  kept_hidden_rows_ = 0;
  kept_context_rows_ = 0;
  if (static_cast<int64_t>(layer_caches.size()) < c.num_hidden_layers) {
    return Status::invalid_argument("forward: " + std::to_string(layer_caches.size()) + " layer caches for " +
                                    std::to_string(c.num_hidden_layers) + " layers");
  }
  if (batch.keep_hidden && c.num_nextn_predict_layers == 0) {
    return Status::invalid_argument("forward: keep_hidden asks for the MTP layers' input, but the model has none");
  }
  if (batch.keep_dspark_context && !c.dspark) {
    return Status::invalid_argument("forward: keep_dspark_context, but the model has no DSpark draft module");
  }
  // Which column slice of the kept DSpark context each layer's residual goes to (-1: none).
  std::vector<int64_t> context_slot(static_cast<size_t>(c.num_hidden_layers), -1);
  if (batch.keep_dspark_context) {
    for (size_t j = 0; j < c.dspark->target_layer_ids.size(); ++j)
      context_slot[static_cast<size_t>(c.dspark->target_layer_ids[j])] = static_cast<int64_t>(j);
  }
  RowLayout rows;
  if (Status s = layout_rows("forward", batch.token_ids, batch.sequences, batch.logits_rows, c.vocab_size, rows);
      !s.ok()) {
    return s;
  }
  if (T == 0 || c.num_hidden_layers == 0) {
    if (logits) logits->clear();
    if (greedy) greedy->clear();
    if (dispatch_ && T == 0) {
      // An idle expert-parallel rank still takes part in every MoE layer's exchange: others' tokens need its experts.
      const Tensor none{nullptr, backend_.activation_dtype(), 0, c.hidden_size, c.hidden_size};
      for (int64_t l = 0, moe_layer = 0; l < c.num_hidden_layers; ++l) {
        const Layer& L = w.layers[static_cast<size_t>(l)];
        if (L.moe) dispatch_->run(w.rule, L, moe_layer++, none, none);
      }
      if (Status s = dispatch_->status(); !s.ok()) return s;
      if (Status s = ep_.comm->status(); !s.ok()) return s;
      return ep_.host().status();
    }
    return Status();
  }
  if (Status s = reserve_scratch(T); !s.ok()) return s;
  backend::MlaExpanded expanded{H, C, R, nope, V, w.softmax_scale, nullptr};
  const bool expanded_capable = backend_.has_mla_expanded(expanded);
  bool use_expanded = rows.rows_start_at_zero && expanded_capable;
  // A decode step (few rows per sequence: one, or a verify's last token and drafts; few rows in all) may run as a
  // recorded graph; its block tables are padded to a power-of-two bucket whether or not graphs are on, so that both
  // ways compute the same values (the attention kernel's split count follows the table's stride).
  const bool decode_step = !use_expanded && graph_sized(T, batch.sequences);
  const int64_t table_stride = decode_step ? graph_table_stride(batch.sequences) : 0;
  backend::StepLayout layout = step_layout(batch.token_ids, batch.logits_rows, rows);
  layout.block_table_stride = table_stride;
  if (Status s = backend_.begin_step(layout); !s.ok()) return s;
  // A chunk over a cached prefix (not a decode step): the expanded form when the backend's cost model says so.
  if (!use_expanded && !decode_step && expanded_capable) use_expanded = backend_.mla_expanded_pays(expanded);

  const StepTensors t = step_tensors(*scratch_, c, backend_.activation_dtype(), T);

  // The step's device work, from the embedding to the head's logits (and argmax ids) in backend memory: what
  // run_graph may record. No host decision inside depends on the step's values, only on its shapes.
  auto device_work = [&] {
    backend_.embed(*w.embed_tokens, t.x, tp_.rank * (c.vocab_size / tp_.size));
    if (tp) tp->all_reduce_sum(t.x);
    backend_.rms_norm(t.x, w.layers[0].input_layernorm, eps, t.normed);
    for (int64_t l = 0, moe_layer = 0; l < c.num_hidden_layers; ++l) {
      const bool moe = w.layers[static_cast<size_t>(l)].moe;
      const bool last = l + 1 == c.num_hidden_layers;
      const bool added = decoder_layer(
          backend_, c, w, w.layers[static_cast<size_t>(l)], layer_caches[static_cast<size_t>(l)], t, use_expanded, tp,
          dispatch_.get(), moe_layer, last ? nullptr : &w.layers[static_cast<size_t>(l + 1)].input_layernorm);
      moe_layer += moe ? 1 : 0;
      // The residual add, fused with the next layer's input norm (unless the MoE's combine took them).
      if (!added && !last) {
        backend_.add_rms_norm(t.x, t.ffn, w.layers[static_cast<size_t>(l + 1)].input_layernorm, eps, t.normed);
      } else if (last) {
        backend_.add(t.x, t.ffn);
      }
      if (const int64_t j = context_slot[static_cast<size_t>(l)]; j >= 0) {
        backend_.copy(t.x, t.rows_of(scratch_->dspark_context, c.hidden_size * c.dspark->num_stages())
                               .cols_slice(j * c.hidden_size, c.hidden_size));
      }
    }
    // The MTP layers' input: every row's hidden state after the final norm.
    if (batch.keep_hidden) backend_.rms_norm(t.x, w.norm, eps, t.rows_of(scratch_->kept_hidden, c.hidden_size));
    // Final norm and lm_head for the requested rows only.
    backend_.compute_logits(t.x, w.norm, eps, *w.lm_head, device_greedy);
  };
  // Not with expert parallel: its dispatch reads the routing on the host mid-step.
  if (decode_step && use_graphs_ && !dispatch_) {
    track_graph_caches(graph_cache_layers_, layer_caches.first(static_cast<size_t>(c.num_hidden_layers)));
    backend::GraphKey key;
    key.rows = T;
    key.sequences = static_cast<int64_t>(batch.sequences.size());
    key.max_blocks_per_sequence = table_stride;
    key.logits_rows = static_cast<int64_t>(batch.logits_rows.size());
    key.variant = (device_greedy ? 1 : 0) + (batch.keep_hidden ? 2 : 0) + (batch.keep_dspark_context ? 4 : 0);
    key.owner = graph_owner_;
    if (Status s = backend_.run_graph(key, device_work); !s.ok()) return s;
  } else {
    device_work();
  }
  Status read;
  if (tp != nullptr) {
    read = read_gathered_logits(logits, greedy);
  } else {
    read = !sampling.empty()   ? backend_.read_sampled_tokens(sampling, adjustments, *greedy)
           : greedy != nullptr ? backend_.read_greedy_tokens(*greedy)
                               : backend_.read_logits(*logits);
    if (read.ok() && !sampling.empty() && logprobs != nullptr) read = backend_.read_sampled_logprobs(*logprobs);
  }
  if (read.ok() && dispatch_) read = dispatch_->status();
  if (read.ok() && dispatch_) read = ep_.comm->status();
  if (read.ok() && dispatch_) read = ep_.host().status();
  if (read.ok() && batch.keep_hidden) kept_hidden_rows_ = T;
  if (read.ok() && batch.keep_dspark_context) kept_context_rows_ = T;
  return read;
}

Status DeepSeekModel::gather_vocab(std::vector<float>& logits) {
  const int64_t size = tp_.size, local = config_.vocab_size / size;
  const int64_t rows = static_cast<int64_t>(logits.size()) / local;
  // A pass that wants no logits (a prefill chunk before the prompt's end): every rank has none. Regression: Gloo's
  // all-gather of nothing divided by zero (SIGFPE) on the first prompt longer than --max-num-batched-tokens.
  if (rows == 0) return Status();
  tp_gather_.resize(static_cast<size_t>(size * rows * local));
  tp_.host().all_gather_rows(backend::Tensor{logits.data(), backend::DType::kF32, rows, local, local},
                             backend::Tensor{tp_gather_.data(), backend::DType::kF32, size * rows, local, local});
  if (Status s = tp_.host().status(); !s.ok()) return s;
  // Rank q's block [rows, local] holds columns [q local, (q + 1) local) of every row.
  logits.resize(static_cast<size_t>(rows * config_.vocab_size));
  for (int64_t q = 0; q < size; ++q) {
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(tp_gather_.data() + (q * rows + r) * local, local,
                  logits.data() + r * config_.vocab_size + q * local);
    }
  }
  return Status();
}

void DeepSeekModel::track_graph_caches(std::vector<const void*>& recorded, LayerCaches caches) {
  // The graphs write into these caches: another set (another engine's, a test's second run) needs new graphs.
  bool same = recorded.size() == caches.size();
  for (size_t l = 0; l < caches.size() && same; ++l) same = recorded[l] == caches[l].data();
  if (same) return;
  backend_.reset_graphs();
  recorded.clear();
  for (const backend::Buffer& cache : caches) recorded.push_back(cache.data());
}

Status DeepSeekModel::forward_mtp(int64_t mtp_layer, const MtpBatch& batch, const backend::Buffer& mtp_cache,
                                  std::vector<float>* logits, std::vector<int32_t>* greedy,
                                  std::vector<float>* greedy_probability) {
  const ModelConfig& c = local_;  // this rank's shapes (config_ without tensor parallel)
  backend::Communicator* tp = tp_.size > 1 ? tp_.comm : nullptr;
  const Weights& w = *weights_;
  const int64_t T = static_cast<int64_t>(batch.token_ids.size());
  const int64_t hidden = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (mtp_layer < 0 || mtp_layer >= static_cast<int64_t>(w.mtp_layers.size())) {
    return Status::invalid_argument("forward_mtp: MTP layer " + std::to_string(mtp_layer) + " of " +
                                    std::to_string(w.mtp_layers.size()));
  }
  if ((logits == nullptr) == (greedy == nullptr)) {
    return Status::invalid_argument("forward_mtp: exactly one of logits and greedy must be given");
  }
  if (static_cast<int64_t>(batch.hidden_rows.size()) != T) {
    return Status::invalid_argument("forward_mtp: " + std::to_string(batch.hidden_rows.size()) + " hidden rows for " +
                                    std::to_string(T) + " rows");
  }
  for (int32_t r : batch.hidden_rows) {
    if (r < 0 || r >= kept_hidden_rows_) {
      return Status::invalid_argument("forward_mtp: hidden row " + std::to_string(r) + " but the previous pass kept " +
                                      std::to_string(kept_hidden_rows_) + " rows");
    }
  }
  RowLayout rows;
  if (Status s = layout_rows("forward_mtp", batch.token_ids, batch.sequences, batch.logits_rows, c.vocab_size, rows);
      !s.ok()) {
    return s;
  }
  if (T == 0) {
    if (logits) logits->clear();
    if (greedy) greedy->clear();
    if (greedy_probability) greedy_probability->clear();
    kept_hidden_rows_ = 0;
    return Status();
  }
  // The kept hidden state came from a pass of at least as many rows, so the scratch is large enough: growing it
  // here would drop that state.
  if (T > scratch_->capacity) {
    return Status::invalid_argument("forward_mtp: " + std::to_string(T) + " rows, more than the scratch's " +
                                    std::to_string(scratch_->capacity));
  }
  if (leading_) {
    // The followers run the same pass over their draft cache of the same index (make_draft_layer_cache).
    const auto cache = std::find(draft_caches_.begin(), draft_caches_.end(), mtp_cache.data());
    if (cache == draft_caches_.end()) {
      return Status::invalid_argument("forward_mtp: with tensor parallel the MTP cache must come from "
                                      "make_draft_layer_cache (the other ranks keep their own copy)");
    }
    std::vector<int64_t> payload{mtp_layer, cache - draft_caches_.begin(), static_cast<int64_t>(T)};
    payload.insert(payload.end(), batch.hidden_rows.begin(), batch.hidden_rows.end());
    const std::vector<int64_t> encoded = encode_batch(ForwardBatch{batch.token_ids, batch.sequences, batch.logits_rows});
    payload.insert(payload.end(), encoded.begin(), encoded.end());
    send_command(kForwardMtpCommand, std::move(payload));
  }
  backend::StepLayout layout = step_layout(batch.token_ids, batch.logits_rows, rows);
  layout.rows_start_at_zero = false;  // the absorbed form always (the MTP cache may hold earlier positions)
  if (Status s = backend_.begin_step(layout); !s.ok()) return s;

  const MtpLayer& M = w.mtp_layers[static_cast<size_t>(mtp_layer)];
  const StepTensors t = step_tensors(*scratch_, c, backend_.activation_dtype(), T);
  const Tensor kept = t.rows_of(scratch_->kept_hidden, hidden);
  const Tensor gathered = t.rows_of(scratch_->mtp_hidden, hidden);
  const Tensor concat = t.rows_of(scratch_->mtp_concat, 2 * hidden);
  // Gather the rows' hidden states (runs of consecutive rows, one copy each) before this pass overwrites them.
  for (int64_t begin = 0; begin < T;) {
    int64_t end = begin + 1;
    while (end < T && batch.hidden_rows[end] == batch.hidden_rows[end - 1] + 1) ++end;
    backend_.copy(kept.rows_slice(batch.hidden_rows[begin], end - begin), gathered.rows_slice(begin, end - begin));
    begin = end;
  }
  // x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]) (embedding first: vLLM's DeepSeekMTP, tools/demo_model.py).
  backend_.embed(*w.embed_tokens, t.x, tp_.rank * (c.vocab_size / tp_.size));
  if (tp) tp->all_reduce_sum(t.x);
  backend_.rms_norm(t.x, M.enorm, eps, concat.cols_slice(0, hidden));
  backend_.rms_norm(gathered, M.hnorm, eps, concat.cols_slice(hidden, hidden));
  backend_.linear(concat, *M.eh_proj, t.x);
  backend_.rms_norm(t.x, M.layer.input_layernorm, eps, t.normed);
  decoder_layer(backend_, c, w, M.layer, mtp_cache, t, /*use_expanded=*/false, tp);
  backend_.add(t.x, t.ffn);
  // What the next chained pass reads: this pass's hidden state after shared_head.norm.
  backend_.rms_norm(t.x, M.shared_head_norm, eps, kept);
  backend_.compute_logits(t.x, M.shared_head_norm, eps, *w.lm_head, greedy != nullptr && tp == nullptr);
  kept_hidden_rows_ = 0;
  Status read;
  if (tp != nullptr) {  // this rank's vocabulary slice: gathered, then the argmax and its probability on the host
    read = read_gathered_logits(logits, greedy);
    if (read.ok() && greedy != nullptr && greedy_probability != nullptr) {
      greedy_probabilities(logits != nullptr ? *logits : tp_logits_, c.vocab_size, *greedy, *greedy_probability);
    }
  } else {
    read = greedy != nullptr ? backend_.read_greedy_tokens(*greedy) : backend_.read_logits(*logits);
    if (read.ok() && greedy != nullptr && greedy_probability != nullptr) {
      read = backend_.read_top_probabilities(*greedy_probability);
    }
  }
  if (read.ok()) kept_hidden_rows_ = T;
  return group_failure(read);
}

namespace {
constexpr size_t kMarkovChunk = 1024;  // floats of a row the heads keep in L1 at once
}  // namespace

void DeepSeekModel::DsparkHeads::markov(std::span<const float> base, int32_t previous, std::span<float> logits) const {
  const float* e = markov_w1.data() + static_cast<size_t>(previous) * static_cast<size_t>(rank);
  const size_t n = static_cast<size_t>(draft_vocab());
  // In chunks that stay in L1: the base row once in, rank passes over the chunk (a local array: nothing aliases it,
  // so the passes vectorize), once out. Each logit sums base + e_0 w_0 + e_1 w_1 ... in that order, as a plain loop.
  constexpr size_t kChunk = kMarkovChunk;
  float sum[kChunk];
  for (size_t begin = 0; begin < n; begin += kChunk) {
    const size_t count = std::min(kChunk, n - begin);
    std::copy_n(base.data() + begin, count, sum);
    for (size_t j = 0; j < static_cast<size_t>(rank); ++j) {
      const float* w2 = markov_w2_t.data() + j * n + begin;
      const float ej = e[j];
      if (count == kChunk) {  // a fixed trip count: -O2's cost model vectorizes only loops without a scalar tail
        for (size_t i = 0; i < kChunk; ++i) sum[i] += w2[i] * ej;
      } else {
        for (size_t i = 0; i < count; ++i) sum[i] += w2[i] * ej;
      }
    }
    std::copy_n(sum, count, logits.data() + begin);
  }
}

int32_t DeepSeekModel::DsparkHeads::greedy_draft(std::span<const float> base, int32_t previous) const {
  const size_t n = static_cast<size_t>(draft_vocab());
  const float* e = markov_w1.data() + static_cast<size_t>(previous) * static_cast<size_t>(rank);
  // Entry i after the Markov term, as markov() computes it (the same additions in the same order), from the
  // untransposed copy: one cache line per entry instead of rank.
  auto value = [&](size_t i) {
    float sum = base[i];
    const float* w2 = markov_w2_rows.data() + i * static_cast<size_t>(rank);
    for (size_t j = 0; j < static_cast<size_t>(rank); ++j) sum += w2[j] * e[j];
    return sum;
  };
  auto whole_row = [&] {
    std::vector<float> row(n);
    markov(base, previous, row);
    return argmax(row);
  };
  if (n == 0 || markov_w2_norm.size() != n || markov_w2_rows.size() != n * static_cast<size_t>(rank)) {
    return whole_row();  // random weights: no norms
  }
  // Any entry of base's largest value will do (its value after the term is a floor, not the answer): 8 running
  // maxima break the loop's dependency chain, then the first entry equal to their maximum.
  float lane_max[8];
  std::fill(lane_max, lane_max + 8, base[0]);
  size_t i8 = 0;
  for (; i8 + 8 <= n; i8 += 8) {
    for (size_t k = 0; k < 8; ++k) lane_max[k] = base[i8 + k] > lane_max[k] ? base[i8 + k] : lane_max[k];
  }
  float largest = lane_max[0];
  for (size_t k = 1; k < 8; ++k) largest = lane_max[k] > largest ? lane_max[k] : largest;
  for (; i8 < n; ++i8) largest = base[i8] > largest ? base[i8] : largest;
  size_t top = 0;
  while (top < n && !(base[top] == largest)) ++top;
  if (top == n) return whole_row();  // NaN somewhere
  double e_norm = 0.0;
  for (size_t j = 0; j < static_cast<size_t>(rank); ++j) e_norm += static_cast<double>(e[j]) * e[j];
  e_norm = std::sqrt(e_norm) * (1.0 + 1e-6);
  const float floor_value = value(top);  // the winner's value is at least this
  if (!std::isfinite(base[top]) || !std::isfinite(floor_value) || !std::isfinite(e_norm)) return whole_row();
  // An entry can win only if base[i] + norm[i] |e| >= floor_value. The bounds are summed in float32 (in chunks of a
  // fixed length, so that they vectorize); their rounding (~1e-7 of |base[i]| + norm[i] |e|, itself within reach of
  // floor_value for any entry that passes) stays far below the slack.
  const float e_norm_f = static_cast<float>(e_norm);
  const double reach = std::fabs(static_cast<double>(floor_value)) + std::fabs(static_cast<double>(base[top])) +
                       static_cast<double>(markov_w2_norm_max) * e_norm;
  const float threshold = static_cast<float>(static_cast<double>(floor_value) - 1e-5 * reach - 1e-30);
  constexpr size_t kChunk = kMarkovChunk;
  float bound[kChunk];
  size_t best = n;
  float best_value = 0.0f;
  for (size_t begin = 0; begin < n; begin += kChunk) {
    const size_t count = std::min(kChunk, n - begin);
    const float* b = base.data() + begin;
    const float* w = markov_w2_norm.data() + begin;
    if (count == kChunk) {
      for (size_t i = 0; i < kChunk; ++i) bound[i] = b[i] + w[i] * e_norm_f;
    } else {
      for (size_t i = 0; i < count; ++i) bound[i] = b[i] + w[i] * e_norm_f;
    }
    for (size_t i = 0; i < count; ++i) {
      if (bound[i] < threshold) continue;  // NaN and infinities fall through to value()
      const float v = value(begin + i);
      if (std::isnan(v)) return whole_row();
      if (best == n || v > best_value) {
        best = begin + i;
        best_value = v;
      }
    }
  }
  if (best == n) return whole_row();
  return finish_argmax(best, best_value);
}

size_t DeepSeekModel::DsparkHeads::greedy_chain(std::span<const float> base, std::span<const float> h,
                                                int32_t previous, std::span<int32_t> drafts,
                                                std::span<double> confidences) const {
  const size_t n = static_cast<size_t>(draft_vocab()), width = static_cast<size_t>(hidden);
  for (size_t k = 0; k < drafts.size(); ++k) {
    confidences[k] = confidence_of(h.subspan(k * width, width), previous);
    drafts[k] = greedy_draft(base.subspan(k * n, n), previous);
    if (drafts[k] < 0) return k + 1;
    previous = drafts[k];
  }
  return drafts.size();
}

int32_t DeepSeekModel::DsparkHeads::argmax(std::span<const float> logits) const {
  const size_t n = static_cast<size_t>(draft_vocab());
  const size_t best = static_cast<size_t>(std::max_element(logits.data(), logits.data() + n) - logits.data());
  return finish_argmax(best, logits[best]);
}

int32_t DeepSeekModel::DsparkHeads::finish_argmax(size_t best, float best_value) const {
  if (!std::isfinite(best_value)) return -1;
  const int32_t id = id_of(static_cast<int64_t>(best));
  if (active.empty() || best_value > 0.0f) return id;
  // The ids outside the draft's vocabulary hold 0: the lowest of them competes.
  const int32_t outside = first_outside();
  if (outside >= vocab) return id;
  return best_value < 0.0f ? outside : std::min(id, outside);
}

int32_t DeepSeekModel::DsparkHeads::first_outside() const {
  int32_t outside = 0;
  for (int32_t a : active) {
    if (a != outside) break;
    ++outside;
  }
  return active.empty() ? static_cast<int32_t>(vocab) : outside;
}

void DeepSeekModel::DsparkHeads::expand(std::span<const float> logits, std::span<float> full) const {
  if (active.empty()) {
    std::copy_n(logits.data(), static_cast<size_t>(vocab), full.data());
    return;
  }
  std::fill(full.begin(), full.begin() + vocab, 0.0f);
  for (size_t i = 0; i < active.size(); ++i) full[static_cast<size_t>(active[i])] = logits[i];
}

double DeepSeekModel::DsparkHeads::confidence_of(std::span<const float> h, int32_t previous) const {
  const float* e = markov_w1.data() + static_cast<size_t>(previous) * static_cast<size_t>(rank);
  double z = 0.0;
  for (size_t j = 0; j < static_cast<size_t>(hidden); ++j) z += static_cast<double>(confidence[j]) * h[j];
  for (size_t j = 0; j < static_cast<size_t>(rank); ++j) {
    z += static_cast<double>(confidence[static_cast<size_t>(hidden) + j]) * e[j];
  }
  return 1.0 / (1.0 + std::exp(-z));
}

const DeepSeekModel::DsparkHeads* DeepSeekModel::dspark_heads() const {
  return weights_->dspark ? &weights_->dspark_heads : nullptr;
}

bool DeepSeekModel::has_device_dspark_heads() const {
  return weights_->dspark && weights_->dspark_device.w1.bytes > 0;  // uploaded only where usable (load_weights)
}

Status DeepSeekModel::forward_dspark_block_greedy(const DsparkBlockBatch& batch, LayerCaches stage_caches,
                                                  std::span<const int32_t> previous, std::span<const int32_t> lengths,
                                                  std::vector<int32_t>& drafts, std::vector<double>& confidences) {
  drafts.clear();
  confidences.clear();
  if (!has_device_dspark_heads()) {
    return Status::unsupported("forward_dspark_block_greedy: the " + std::string(backend_.name()) +
                               " backend has no DSpark heads on the device for this model");
  }
  const int64_t gamma = local_.dspark->block_size;
  bool blocks = previous.size() == batch.sequences.size() && lengths.size() == previous.size() &&
                static_cast<int64_t>(previous.size()) <= backend::Backend::kMaxDeviceDsparkChains &&
                static_cast<int64_t>(batch.token_ids.size()) == static_cast<int64_t>(previous.size()) * gamma;
  for (const SequenceChunk& sequence : batch.sequences) blocks = blocks && sequence.num_tokens == gamma;
  if (!blocks) {
    return Status::invalid_argument("forward_dspark_block_greedy: " + std::to_string(batch.sequences.size()) +
                                    " blocks of " + std::to_string(batch.token_ids.size()) + " rows for " +
                                    std::to_string(previous.size()) + " chains (block size " +
                                    std::to_string(gamma) + ", at most " +
                                    std::to_string(backend::Backend::kMaxDeviceDsparkChains) + " chains)");
  }
  if (Status s = run_dspark_block(batch, stage_caches); !s.ok() || batch.token_ids.empty()) return s;
  const StepTensors t = step_tensors(*scratch_, local_, backend_.activation_dtype(),
                                     static_cast<int64_t>(batch.token_ids.size()));
  if (Status s = backend_.read_dspark_greedy_chains(weights_->dspark_device, t.projected, static_cast<int32_t>(gamma),
                                                   previous, lengths, drafts, confidences);
      !s.ok()) {
    return group_failure(s);
  }
  return Status();
}

Status DeepSeekModel::send_dspark_command(uint64_t kind, const char* where, LayerCaches stage_caches,
                                         std::span<const int32_t> rows, std::span<const SequenceChunk> sequences) {
  if (!leading_) return Status();
  Result<int64_t> first = stage_cache_index(where, stage_caches);
  if (!first.ok()) return first.status();
  std::vector<int64_t> payload{*first};
  const std::vector<int64_t> encoded = encode_batch(ForwardBatch{std::vector<int32_t>(rows.begin(), rows.end()),
                                                                 std::vector<SequenceChunk>(sequences.begin(),
                                                                                            sequences.end()),
                                                                 {}});
  payload.insert(payload.end(), encoded.begin(), encoded.end());
  send_command(kind, std::move(payload));
  return Status();
}

Result<int64_t> DeepSeekModel::stage_cache_index(const char* where, LayerCaches stage_caches) const {
  const auto first = stage_caches.empty()
                         ? draft_caches_.end()
                         : std::find(draft_caches_.begin(), draft_caches_.end(), stage_caches[0].data());
  const int64_t index = first - draft_caches_.begin();
  bool consecutive = first != draft_caches_.end() &&
                     index + static_cast<int64_t>(stage_caches.size()) <= static_cast<int64_t>(draft_caches_.size());
  for (size_t s = 1; consecutive && s < stage_caches.size(); ++s) {
    consecutive = draft_caches_[static_cast<size_t>(index) + s] == stage_caches[s].data();
  }
  if (!consecutive) {
    return Status::invalid_argument(std::string(where) + ": with tensor parallel the stage caches must be consecutive "
                                    "caches from make_draft_layer_cache (the other ranks keep their own copies)");
  }
  return index;
}

Status DeepSeekModel::forward_dspark_inject(const DsparkInjectBatch& batch, LayerCaches stage_caches) {
  const ModelConfig& c = local_;  // this rank's shapes (config_ without tensor parallel)
  const Weights& w = *weights_;
  if (!w.dspark) return Status::invalid_argument("forward_dspark_inject: the model has no DSpark draft module");
  const int64_t S = c.dspark->num_stages(), hidden = c.hidden_size, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t T = static_cast<int64_t>(batch.context_rows.size());
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (static_cast<int64_t>(stage_caches.size()) != S) {
    return Status::invalid_argument("forward_dspark_inject: " + std::to_string(stage_caches.size()) + " caches for " +
                                    std::to_string(S) + " stages");
  }
  for (int32_t r : batch.context_rows) {
    if (r < 0 || r >= kept_context_rows_) {
      return Status::invalid_argument("forward_dspark_inject: context row " + std::to_string(r) +
                                      " but the previous pass kept " + std::to_string(kept_context_rows_) + " rows");
    }
  }
  if (T > scratch_->capacity) {
    return Status::invalid_argument("forward_dspark_inject: " + std::to_string(T) + " rows, more than the scratch's " +
                                    std::to_string(scratch_->capacity));
  }
  // The step's token ids are the kept rows to gather (no embedding: the rows are the context), checked against the
  // rows the previous pass kept.
  const std::span<const int32_t> token_ids = batch.context_rows;
  RowLayout rows;
  if (Status s = layout_rows("forward_dspark_inject", token_ids, batch.sequences, {}, kept_context_rows_, rows);
      !s.ok()) {
    return s;
  }
  if (T == 0) return Status();
  // The followers write the same entries into their copies of the stage caches (the latent is replicated).
  if (Status s = send_dspark_command(kDsparkInjectCommand, "forward_dspark_inject", stage_caches, batch.context_rows,
                                     batch.sequences);
      !s.ok()) {
    return s;
  }
  // Recorded as a graph where a decode step would be (the next block pass reads these entries on the same stream:
  // nothing to wait for here).
  const bool graphed = use_graphs_ && graph_sized(T, batch.sequences);
  const int64_t table_stride = graph_table_stride(batch.sequences);
  backend::StepLayout layout = step_layout(token_ids, {}, rows);
  layout.rows_start_at_zero = false;
  layout.block_table_stride = table_stride;
  if (Status s = backend_.begin_step(layout); !s.ok()) return s;
  const DsparkModule& M = *w.dspark;
  const StepTensors t = step_tensors(*scratch_, c, backend_.activation_dtype(), T);
  // Every row the scratch holds is a valid source (the ids were checked against the kept ones): a recording does
  // not depend on how many the previous pass kept.
  const Tensor kept{scratch_->dspark_context.data(), backend_.activation_dtype(), scratch_->capacity, hidden * S,
                    hidden * S};
  const Tensor gathered = t.rows_of(scratch_->dspark_gathered, hidden * S);
  auto device_work = [&] {
    backend_.gather_step_rows(kept, gathered);
    // c_t = main_norm(main_proj([h_l1 | h_l2 ...])); each stage's latent entry and rope key from c_t (no input norm).
    backend_.linear(gathered, *M.main_proj, t.x);
    backend_.rms_norm(t.x, M.main_norm, eps, t.normed);
    for (int64_t s = 0; s < S; ++s) {
      const Layer& L = M.stages[static_cast<size_t>(s)];
      backend_.linear(t.normed, *L.kv_a_proj_with_mqa, t.kv);
      backend_.rms_norm(t.kv.cols_slice(0, C), L.kv_a_layernorm, eps, t.kv.cols_slice(0, C));
      backend_.rope(t.kv.cols_slice(C, R), 1, w.inv_freq, w.rope_attention_factor);
      backend_.store_kv(t.kv, stage_caches[static_cast<size_t>(s)]);
    }
  };
  if (!graphed) {
    device_work();
    return Status();
  }
  track_graph_caches(graph_stage_layers_, stage_caches);
  backend::GraphKey key;
  key.rows = T;
  key.sequences = static_cast<int64_t>(batch.sequences.size());
  key.max_blocks_per_sequence = table_stride;
  key.logits_rows = 0;
  key.variant = 9;  // forward()'s are 0..7, the block pass's 8
  key.owner = graph_owner_;
  return backend_.run_graph(key, device_work);
}

Status DeepSeekModel::run_dspark_block(const DsparkBlockBatch& batch, LayerCaches stage_caches) {
  const ModelConfig& c = local_;  // this rank's shapes (config_ without tensor parallel)
  backend::Communicator* tp = tp_.size > 1 ? tp_.comm : nullptr;
  const Weights& w = *weights_;
  if (!w.dspark) return Status::invalid_argument("forward_dspark_block: the model has no DSpark draft module");
  const int64_t S = c.dspark->num_stages();
  const int64_t T = static_cast<int64_t>(batch.token_ids.size());
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (static_cast<int64_t>(stage_caches.size()) != S) {
    return Status::invalid_argument("forward_dspark_block: " + std::to_string(stage_caches.size()) + " caches for " +
                                    std::to_string(S) + " stages");
  }
  std::vector<int32_t> logits_rows(static_cast<size_t>(T));
  std::iota(logits_rows.begin(), logits_rows.end(), 0);
  RowLayout rows;
  if (Status s = layout_rows("forward_dspark_block", batch.token_ids, batch.sequences, logits_rows, c.vocab_size, rows);
      !s.ok()) {
    return s;
  }
  if (T == 0) return Status();
  if (Status s = send_dspark_command(kDsparkBlockCommand, "forward_dspark_block", stage_caches, batch.token_ids,
                                     batch.sequences);
      !s.ok()) {
    return s;
  }
  if (Status s = reserve_scratch(T); !s.ok()) return s;
  kept_hidden_rows_ = 0;
  kept_context_rows_ = 0;  // the pass overwrites the scratch the kept states live in
  // A block pass is a decode step of γ rows per drafting request: recorded as one (same padding of the tables).
  const bool graphed = use_graphs_ && graph_sized(T, batch.sequences);
  const int64_t table_stride = graph_table_stride(batch.sequences);
  backend::StepLayout layout = step_layout(batch.token_ids, logits_rows, rows);
  layout.rows_start_at_zero = false;
  layout.block_table_stride = table_stride;
  if (Status s = backend_.begin_step(layout); !s.ok()) return s;
  const DsparkModule& M = *w.dspark;
  const StepTensors t = step_tensors(*scratch_, c, backend_.activation_dtype(), T);
  auto device_work = [&] {
    backend_.embed(*w.embed_tokens, t.x, tp_.rank * (c.vocab_size / tp_.size));
    if (tp) tp->all_reduce_sum(t.x);
    for (int64_t s = 0; s < S; ++s) {
      const Layer& L = M.stages[static_cast<size_t>(s)];
      backend_.rms_norm(t.x, L.input_layernorm, eps, t.normed);
      decoder_layer(backend_, c, w, L, stage_caches[static_cast<size_t>(s)], t, /*use_expanded=*/false, tp);
      backend_.add(t.x, t.ffn);
    }
    backend_.rms_norm(t.x, M.norm, eps, t.projected);  // h_k, what the head and the confidence see
    backend_.compute_logits(t.x, M.norm, eps, M.head ? *M.head : *w.lm_head, false);
  };
  if (graphed) {
    track_graph_caches(graph_stage_layers_, stage_caches);
    backend::GraphKey key;
    key.rows = T;
    key.sequences = static_cast<int64_t>(batch.sequences.size());
    key.max_blocks_per_sequence = table_stride;
    key.logits_rows = T;
    key.variant = 8;  // forward()'s variants are 0..7
    key.owner = graph_owner_;
    if (Status s = backend_.run_graph(key, device_work); !s.ok()) return s;
  } else {
    device_work();
  }
  return Status();
}

Status DeepSeekModel::forward_dspark_block(const DsparkBlockBatch& batch, LayerCaches stage_caches,
                                           std::vector<float>& logits, std::vector<float>& hidden) {
  logits.clear();
  hidden.clear();
  if (Status s = run_dspark_block(batch, stage_caches); !s.ok() || batch.token_ids.empty()) return s;
  const int64_t T = static_cast<int64_t>(batch.token_ids.size()), d = local_.hidden_size;
  backend::Communicator* tp = tp_.size > 1 ? tp_.comm : nullptr;
  // The compact head is whole on every rank; a shared lm_head is this rank's vocabulary slice: gathered.
  if (Status s = tp != nullptr && !weights_->dspark->head ? read_gathered_logits(&logits, nullptr)
                                                          : backend_.read_logits(logits);
      !s.ok()) {
    return group_failure(s);
  }
  const size_t count = static_cast<size_t>(T * d);
  hidden.resize(count);
  if (backend_.activation_dtype() == backend::DType::kF32) {
    return backend_.download(scratch_->projected, 0, count * sizeof(float), hidden.data());
  }
  std::vector<uint16_t> bf16(count);
  if (Status s = backend_.download(scratch_->projected, 0, count * sizeof(uint16_t), bf16.data()); !s.ok()) return s;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(bf16[i]) << 16;
    std::memcpy(&hidden[i], &bits, sizeof(float));
  }
  return Status();
}

}  // namespace deepinfer::model
