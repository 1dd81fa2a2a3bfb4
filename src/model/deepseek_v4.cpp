// DeepSeek-V4 on the CPU: loading the release layout and the forward pass (see deepseek_v4.h). Each step below
// names the part of DeepSeek's V4-Flash-0731 inference/model.py it computes (spec: deepseek-v4-spec.md §2-§3).
#include "deepinfer/model/deepseek_v4.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
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

// One compressor's weights (model.py Compressor): ratio m, output dim, coff = 2 when overlapped (m == 4).
struct CompressorWeights {
  int64_t ratio = 0, dim = 0, coff = 1;
  backend::Buffer ape;   // [m][coff * dim]
  Linear wkv, wgate;     // [coff * dim][d]
  backend::Buffer norm;  // [dim]
};

struct LayerWeights {
  int64_t ratio = 0;
  backend::Buffer rope;  // float64 inverse frequencies [R / 2]
  backend::Buffer attn_norm, ffn_norm;
  Linear hc_attn_fn, hc_ffn_fn;  // [(2 + hc) * hc][hc * d], float32
  backend::Buffer hc_attn_base, hc_attn_scale, hc_ffn_base, hc_ffn_scale;
  Linear wq_a, wq_b, wkv, wo_a, wo_b;  // wo_a: o_groups stacked [L][H * D / G]
  backend::Buffer q_norm, kv_norm, attn_sink;
  CompressorWeights compressor, index_compressor;
  Linear index_wq_b, index_weights_proj;
  Linear gate;                // [E][d], float32 (the router)
  backend::Buffer gate_bias;  // [E] (learned routing)
  backend::Buffer tid2eid;    // int32 [vocab][k] (hash routing)
  Linear experts_gate_up, experts_down;  // routed experts: E stacked [2I][d] (w1 rows, then w3) and [d][I] (w2)
  Linear shared_gate_up, shared_down;    // the shared expert, the same way
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
  Linear embed;            // [vocab][d]
  Linear head;             // [vocab][d]
  backend::Buffer norm;    // [d]
  Linear hc_head_fn;       // [hc][hc * d], float32
  backend::Buffer hc_head_base, hc_head_scale;
  std::vector<LayerWeights> layers;
  std::optional<PayloadLayout> payload;
  backend::Precision precision = backend::Precision::kF32;  // the large matrices' (CPU: float32, exact)
  int64_t fp8_matrices = 0;                                 // weights kept in FP8 (Loader::linear, experts)
  std::vector<backend::Buffer> scratch;  // the forward pass's activations (V4Forward), grown on demand
};

namespace {

constexpr float kFp4E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

class Loader {
 public:
  // `keep_fp8`: FP8 was asked for (the CUDA backend's default): tensors stored in FP8 128x128 blocks stay FP8 and
  // FP4 routed experts become FP8 where that is exact (fp8_experts); everything else is kept at `precision`.
  Loader(const V4Config& config, const Checkpoint& checkpoint, Backend& backend, backend::Precision precision,
         bool keep_fp8)
      : config_(config), checkpoint_(checkpoint), backend_(backend), precision_(precision), keep_fp8_(keep_fp8) {
    // e4m3 code of each FP4 value times 2^k, k in [-8, 6] (all exact: see expert_fp8).
    std::map<float, uint8_t> code_of;
    for (int i = 255; i >= 0; --i) {  // +0 (code 0) wins over -0 (the map's keys compare them equal)
      const float v = f8_e4m3_to_f32(static_cast<uint8_t>(i));
      if (!std::isnan(v)) code_of[v] = static_cast<uint8_t>(i);
    }
    for (int n = 0; n < 16; ++n) {
      for (int k = -8; k <= 6; ++k) fp4_as_fp8_[n][k + 8] = code_of.at(std::ldexp(kFp4E2M1[n], k));
    }
  }
  Backend& backend() const { return backend_; }
  backend::Precision precision() const { return precision_; }
  int64_t fp8_matrices() const { return fp8_matrices_; }

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
  // A float32 vector (norms, biases, ape) in backend memory.
  Status buffer(const std::string& name, std::vector<int64_t> shape, backend::Buffer& out) {
    Result<std::vector<float>> values = vector(name, std::move(shape));
    if (!values.ok()) return values.status();
    Result<backend::Buffer> b = backend_.make_vector(*values);
    if (!b.ok()) return b.status();
    out = std::move(*b);
    return Status();
  }
  // A matrix [rows][cols] as `count` stacked matrices [rows / count][cols] (count > 1: o_groups of wo_a), kept at
  // `precision` (the model's for the large matrices; float32 where the reference computes in float32).
  // A tensor stored in FP8 (with 128x128 blocks, stacked parts of whole blocks) stays FP8 when keep_fp8 (and no
  // `precision` is forced): its bytes and block scales go to the backend as stored.
  Status linear(const std::string& name, int64_t rows, int64_t cols, Linear& out, int64_t count = 1,
                std::optional<backend::Precision> precision = std::nullopt) {
    const int64_t part = rows / count;
    if (!precision && stays_fp8(name, part, cols, count)) {
      Fp8Matrix m;
      DEEPINFER_RETURN_IF_ERROR(fp8_as_stored(name, rows, cols, m));
      Result<std::unique_ptr<backend::Weight>> weight = backend_.make_weight(count, part, cols, backend::Precision::kFP8);
      if (!weight.ok()) return weight.status();
      const int64_t scale_cols = (cols + 127) / 128;
      for (int64_t i = 0; i < count; ++i) {
        DEEPINFER_RETURN_IF_ERROR(set_fp8(**weight, i, part, cols,
                                          std::span<const uint8_t>(m.codes.data() + i * part * cols,
                                                                   static_cast<size_t>(part * cols)),
                                          std::span<const float>(m.scales.data() + i * (part / 128) * scale_cols,
                                                                 static_cast<size_t>(((part + 127) / 128) * scale_cols))));
      }
      ++fp8_matrices_;
      out.weight = std::move(*weight);
      out.rows = part;
      out.cols = cols;
      return Status();
    }
    Result<std::vector<float>> values = vector(name, {rows, cols});
    if (!values.ok()) return values.status();
    Result<std::unique_ptr<backend::Weight>> weight =
        backend_.make_weight(count, part, cols, precision.value_or(precision_));
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
  // Experts stacked as the backend's moe op takes them: gate_up [count][2I][d] (w1 then w3 of each) and down
  // [count][d][I] (w2); `prefixes` name each expert ("...experts.E." or "...shared_experts.").
  // With keep_fp8, the experts are kept in FP8 when every one of their tensors is FP8 in 128x128 blocks, or packed
  // FP4 whose ue8m0 scales within each 128x128 block span at most 2^14 (then every FP4 value times its scale is an
  // e4m3 value times one power-of-two block scale: exact); else at the loader's precision.
  Status experts(const std::vector<std::string>& prefixes, int64_t inter, int64_t hidden, Linear& gate_up, Linear& down) {
    const int64_t count = static_cast<int64_t>(prefixes.size());
    bool fp8 = keep_fp8_ && inter % 128 == 0 && hidden % 128 == 0;
    for (size_t e = 0; e < prefixes.size() && fp8; ++e) {
      fp8 = fits_fp8(prefixes[e] + "w1.weight", inter, hidden) && fits_fp8(prefixes[e] + "w3.weight", inter, hidden) &&
            fits_fp8(prefixes[e] + "w2.weight", hidden, inter);
    }
    if (fp8) return fp8_experts(prefixes, inter, hidden, gate_up, down);
    Result<std::unique_ptr<backend::Weight>> gu = backend_.make_weight(count, 2 * inter, hidden, precision_);
    if (!gu.ok()) return gu.status();
    Result<std::unique_ptr<backend::Weight>> dn = backend_.make_weight(count, hidden, inter, precision_);
    if (!dn.ok()) return dn.status();
    for (int64_t e = 0; e < count; ++e) {
      const std::string& q = prefixes[static_cast<size_t>(e)];
      Result<std::vector<float>> w1 = vector(q + "w1.weight", {inter, hidden});
      if (!w1.ok()) return w1.status();
      Result<std::vector<float>> w3 = vector(q + "w3.weight", {inter, hidden});
      if (!w3.ok()) return w3.status();
      w1->insert(w1->end(), w3->begin(), w3->end());
      backend::HostMatrix host;
      host.rows = 2 * inter;
      host.cols = hidden;
      host.f32 = *w1;
      DEEPINFER_RETURN_IF_ERROR(backend_.set_matrix(**gu, e, host));
      Result<std::vector<float>> w2 = vector(q + "w2.weight", {hidden, inter});
      if (!w2.ok()) return w2.status();
      host.rows = hidden;
      host.cols = inter;
      host.f32 = *w2;
      DEEPINFER_RETURN_IF_ERROR(backend_.set_matrix(**dn, e, host));
    }
    return stacked(std::move(*gu), std::move(*dn), inter, hidden, gate_up, down);
  }
  // The experts' two stacks as Linears (gate_up [2I][d], down [d][I]).
  static Status stacked(std::unique_ptr<backend::Weight> gu, std::unique_ptr<backend::Weight> dn, int64_t inter,
                        int64_t hidden, Linear& gate_up, Linear& down) {
    gate_up.weight = std::move(gu);
    gate_up.rows = 2 * inter;
    gate_up.cols = hidden;
    down.weight = std::move(dn);
    down.rows = hidden;
    down.cols = inter;
    return Status();
  }
  Status missing(const std::string& name) const {
    return Status::invalid_argument("DeepSeek-V4 checkpoint: missing tensor '" + name + "'");
  }
  const Checkpoint& checkpoint() const { return checkpoint_; }

 private:
  // FP8 codes [rows][cols] and float32 block scales [ceil(rows / 128)][ceil(cols / 128)] (value = code * scale).
  struct Fp8Matrix {
    std::vector<uint8_t> codes;
    std::vector<float> scales;
  };

  const TensorView* stored(const std::string& name, DType dtype) const {
    const TensorView* t = checkpoint_.find(name);
    return t != nullptr && t->dtype == dtype ? t : nullptr;
  }
  bool fp8_blocks_128() const {
    return config_.weight_block_size == std::vector<int64_t>{128, 128};
  }
  // Whether `name` [count * part][cols] stays FP8: stored so in 128x128 blocks, cols a multiple of 128 (the FP8
  // GEMM's K) and stacked parts ending on block boundaries.
  bool stays_fp8(const std::string& name, int64_t part, int64_t cols, int64_t count) const {
    const TensorView* t = stored(name, DType::kF8E4M3);
    return keep_fp8_ && t != nullptr && fp8_blocks_128() && cols % 128 == 0 && (count == 1 || part % 128 == 0) &&
           t->shape == std::vector<int64_t>{count * part, cols};
  }
  // Whether an expert tensor [rows][cols] can be kept in FP8 exactly: FP8 in 128x128 blocks, or packed FP4 whose
  // scales are powers of two (ue8m0) spanning at most 2^14 within each 128x128 block.
  bool fits_fp8(const std::string& name, int64_t rows, int64_t cols) const {
    if (stays_fp8(name, rows, cols, 1)) return true;
    const TensorView* t = checkpoint_.find(name);
    if (t == nullptr || (t->dtype != DType::kI8 && t->dtype != DType::kU8) || config_.expert_dtype != "fp4" ||
        t->shape != std::vector<int64_t>{rows, cols / 2}) {
      return false;
    }
    Result<std::vector<float>> scales = checkpoint_.load_f32(scale_name(name), std::vector<int64_t>{rows, cols / 32});
    if (!scales.ok()) return false;
    for (int64_t br = 0; br < rows; br += 128) {
      for (int64_t bc = 0; bc < cols / 32; bc += 4) {
        float lo = INFINITY, hi = 0.0f;
        for (int64_t r = br; r < std::min(rows, br + 128); ++r) {
          for (int64_t g = bc; g < bc + 4; ++g) {
            const float s = (*scales)[r * (cols / 32) + g];
            int exponent = 0;
            if (!(s > 0.0f) || std::isinf(s) || std::frexp(s, &exponent) != 0.5f) return false;  // a power of two
            lo = std::min(lo, s);
            hi = std::max(hi, s);
          }
        }
        if (hi > lo * 16384.0f) return false;
      }
    }
    return true;
  }
  // Matrix `index` of `w` from FP8 codes and 128x128 block scales: as they are when the backend keeps the weight in
  // FP8; else (a backend that widens FP8, the CPU's: make_weight reports another precision) dequantized here.
  Status set_fp8(backend::Weight& w, int64_t index, int64_t rows, int64_t cols, std::span<const uint8_t> codes,
                 std::span<const float> scales) {
    backend::HostMatrix host;
    host.rows = rows;
    host.cols = cols;
    std::vector<float> values;
    if (w.precision == backend::Precision::kFP8) {
      host.fp8 = codes;
      host.fp8_scales = scales;
    } else {
      const int64_t sc = (cols + 127) / 128;
      values.resize(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          values[r * cols + c] = f8_e4m3_to_f32(codes[r * cols + c]) * scales[(r / 128) * sc + c / 128];
        }
      }
      host.f32 = values;
    }
    return backend_.set_matrix(w, index, host);
  }
  // An FP8 tensor's bytes and block scales as stored (128x128 blocks).
  Status fp8_as_stored(const std::string& name, int64_t rows, int64_t cols, Fp8Matrix& out) {
    const TensorView* t = stored(name, DType::kF8E4M3);
    if (t == nullptr || t->shape != std::vector<int64_t>{rows, cols}) {
      return bad(name, "expected F8_E4M3 " + shape_text({rows, cols}));
    }
    const std::string scale = scale_name(name);
    if (checkpoint_.find(scale) == nullptr) return bad(name, "F8_E4M3 without its block scales '" + scale + "'");
    Result<std::vector<float>> scales =
        checkpoint_.load_f32(scale, std::vector<int64_t>{(rows + 127) / 128, (cols + 127) / 128});
    if (!scales.ok()) return scales.status();
    const uint8_t* q = reinterpret_cast<const uint8_t*>(t->data);
    out.codes.assign(q, q + rows * cols);
    out.scales = std::move(*scales);
    return Status();
  }
  // An expert tensor in FP8 with 128x128 blocks: as stored, or packed FP4 re-expressed exactly (fits_fp8): each
  // block's scale is its largest FP4 scale / 64, and each value e2m1 * 2^k (k = log2(its scale / block scale)) is
  // an e4m3 value.
  // Reads the packed codes directly (fits_fp8 checked the layout and the scales' spread).
  Status expert_fp8(const std::string& name, int64_t rows, int64_t cols, Fp8Matrix& out) {
    if (stays_fp8(name, rows, cols, 1)) return fp8_as_stored(name, rows, cols, out);
    const TensorView* t = checkpoint_.find(name);
    Result<std::vector<float>> scales =
        checkpoint_.load_f32(scale_name(name), std::vector<int64_t>{rows, cols / 32});
    if (!scales.ok()) return scales.status();
    const int64_t sr = (rows + 127) / 128, sc = cols / 128;
    out.scales.assign(static_cast<size_t>(sr * sc), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < cols / 32; ++g) {
        float& block = out.scales[(r / 128) * sc + g / 4];
        block = std::max(block, (*scales)[r * (cols / 32) + g] / 64.0f);
      }
    }
    const uint8_t* q = reinterpret_cast<const uint8_t*>(t->data);
    out.codes.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < cols / 32; ++g) {
        const int k = std::ilogb((*scales)[r * (cols / 32) + g]) - std::ilogb(out.scales[(r / 128) * sc + g / 4]);
        if (k < -8 || k > 6) return Status::internal(name + ": an FP4 scale has no exact FP8 form");
        for (int64_t c = g * 32; c < g * 32 + 32; ++c) {
          const uint8_t byte = q[r * (cols / 2) + c / 2];
          const uint8_t code = (c % 2 == 0) ? (byte & 0x0f) : (byte >> 4);  // the first value in the low nibble
          out.codes[static_cast<size_t>(r * cols + c)] = fp4_as_fp8_[code][k + 8];
        }
      }
    }
    return Status();
  }
  Status fp8_experts(const std::vector<std::string>& prefixes, int64_t inter, int64_t hidden, Linear& gate_up,
                     Linear& down) {
    const int64_t count = static_cast<int64_t>(prefixes.size());
    Result<std::unique_ptr<backend::Weight>> gu = backend_.make_weight(count, 2 * inter, hidden, backend::Precision::kFP8);
    if (!gu.ok()) return gu.status();
    Result<std::unique_ptr<backend::Weight>> dn = backend_.make_weight(count, hidden, inter, backend::Precision::kFP8);
    if (!dn.ok()) return dn.status();
    for (int64_t e = 0; e < count; ++e) {
      const std::string& q = prefixes[static_cast<size_t>(e)];
      Fp8Matrix w1, w3, w2;
      DEEPINFER_RETURN_IF_ERROR(expert_fp8(q + "w1.weight", inter, hidden, w1));
      DEEPINFER_RETURN_IF_ERROR(expert_fp8(q + "w3.weight", inter, hidden, w3));
      DEEPINFER_RETURN_IF_ERROR(expert_fp8(q + "w2.weight", hidden, inter, w2));
      w1.codes.insert(w1.codes.end(), w3.codes.begin(), w3.codes.end());
      w1.scales.insert(w1.scales.end(), w3.scales.begin(), w3.scales.end());
      DEEPINFER_RETURN_IF_ERROR(set_fp8(**gu, e, 2 * inter, hidden, w1.codes, w1.scales));
      DEEPINFER_RETURN_IF_ERROR(set_fp8(**dn, e, hidden, inter, w2.codes, w2.scales));
    }
    fp8_matrices_ += 2;
    return stacked(std::move(*gu), std::move(*dn), inter, hidden, gate_up, down);
  }

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
  backend::Precision precision_;
  bool keep_fp8_ = false;
  uint8_t fp4_as_fp8_[16][15] = {};  // [FP4 code][k + 8]: the e4m3 code of e2m1 * 2^k
  int64_t fp8_matrices_ = 0;
};

// A rotary table in backend memory (float64, the V4 ops' form).
Status upload_rope(Backend& backend, const Rope& rope, backend::Buffer& out) {
  const size_t bytes = rope.inv_freq.size() * sizeof(double);
  Result<backend::Buffer> b = backend.alloc(bytes);
  if (!b.ok()) return b.status();
  DEEPINFER_RETURN_IF_ERROR(backend.upload(rope.inv_freq.data(), bytes, *b, 0));
  out = std::move(*b);
  return Status();
}

Status load_compressor(Loader& l, const V4Config& c, const std::string& prefix, int64_t ratio, int64_t dim,
                       CompressorWeights& w) {
  w.ratio = ratio;
  w.dim = dim;
  w.coff = ratio == 4 ? 2 : 1;
  DEEPINFER_RETURN_IF_ERROR(l.buffer(prefix + "ape", {ratio, w.coff * dim}, w.ape));
  DEEPINFER_RETURN_IF_ERROR(l.linear(prefix + "wkv.weight", w.coff * dim, c.hidden_size, w.wkv));
  DEEPINFER_RETURN_IF_ERROR(l.linear(prefix + "wgate.weight", w.coff * dim, c.hidden_size, w.wgate));
  return l.buffer(prefix + "norm.weight", {dim}, w.norm);
}

Status load_layer(Loader& l, const V4Config& c, int64_t i, LayerWeights& w) {
  const std::string p = "layers." + std::to_string(i) + ".";
  const int64_t d = c.hidden_size, H = c.num_attention_heads, D = c.head_dim, hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  constexpr auto kF32 = backend::Precision::kF32;
  w.ratio = c.compress_ratios[i];
  DEEPINFER_RETURN_IF_ERROR(upload_rope(l.backend(),
                                        w.ratio == 0 ? make_rope(c.qk_rope_head_dim, c.rope_theta, nullptr)
                                                     : make_rope(c.qk_rope_head_dim, c.compress_rope_theta, &c.rope_scaling),
                                        w.rope));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "attn_norm.weight", {d}, w.attn_norm));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "ffn_norm.weight", {d}, w.ffn_norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear(p + "hc_attn_fn", mix, hc * d, w.hc_attn_fn, 1, kF32));
  DEEPINFER_RETURN_IF_ERROR(l.linear(p + "hc_ffn_fn", mix, hc * d, w.hc_ffn_fn, 1, kF32));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "hc_attn_base", {mix}, w.hc_attn_base));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "hc_ffn_base", {mix}, w.hc_ffn_base));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "hc_attn_scale", {3}, w.hc_attn_scale));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(p + "hc_ffn_scale", {3}, w.hc_ffn_scale));

  const std::string a = p + "attn.";
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wq_a.weight", c.q_lora_rank, d, w.wq_a));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(a + "q_norm.weight", {c.q_lora_rank}, w.q_norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wq_b.weight", H * D, c.q_lora_rank, w.wq_b));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wkv.weight", D, d, w.wkv));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(a + "kv_norm.weight", {D}, w.kv_norm));
  // wo_a is dequantized (to bf16 on CUDA) even when FP8 is kept, as SGLang does by default: its grouped GEMM has no
  // FP8 form here.
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wo_a.weight", c.o_groups * c.o_lora_rank, H * D / c.o_groups, w.wo_a,
                                     c.o_groups, l.precision()));
  DEEPINFER_RETURN_IF_ERROR(l.linear(a + "wo_b.weight", d, c.o_groups * c.o_lora_rank, w.wo_b));
  DEEPINFER_RETURN_IF_ERROR(l.buffer(a + "attn_sink", {H}, w.attn_sink));
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
  DEEPINFER_RETURN_IF_ERROR(l.linear(f + "gate.weight", E, d, w.gate, 1, kF32));
  if (i < c.num_hash_layers) {
    const std::string name = f + "gate.tid2eid";
    if (l.checkpoint().find(name) == nullptr) return l.missing(name);
    std::vector<int64_t> shape = {c.vocab_size, c.num_experts_per_tok};
    Result<std::vector<int64_t>> table = l.checkpoint().load_i64(name, shape);
    if (!table.ok()) return table.status();
    std::vector<int32_t> ids;
    ids.reserve(table->size());
    for (int64_t e : *table) {
      if (e < 0 || e >= E) {
        return Status::invalid_argument("DeepSeek-V4 checkpoint: tensor '" + name + "' holds expert " +
                                        std::to_string(e) + ", outside 0.." + std::to_string(E - 1));
      }
      ids.push_back(static_cast<int32_t>(e));
    }
    Result<backend::Buffer> b = l.backend().alloc(ids.size() * sizeof(int32_t));
    if (!b.ok()) return b.status();
    DEEPINFER_RETURN_IF_ERROR(l.backend().upload(ids.data(), ids.size() * sizeof(int32_t), *b, 0));
    w.tid2eid = std::move(*b);
  } else {
    DEEPINFER_RETURN_IF_ERROR(l.buffer(f + "gate.bias", {E}, w.gate_bias));
  }
  std::vector<std::string> routed;
  for (int64_t e = 0; e < E; ++e) routed.push_back(f + "experts." + std::to_string(e) + ".");
  DEEPINFER_RETURN_IF_ERROR(l.experts(routed, I, d, w.experts_gate_up, w.experts_down));
  return l.experts({f + "shared_experts."}, I, d, w.shared_gate_up, w.shared_down);
}

}  // namespace

DeepSeekV4Model::DeepSeekV4Model(V4Config config, Backend& backend)
    : config_(std::move(config)), backend_(backend), w_(std::make_unique<Weights>()) {}

DeepSeekV4Model::~DeepSeekV4Model() = default;

Result<std::unique_ptr<DeepSeekV4Model>> DeepSeekV4Model::load(const std::filesystem::path& dir, Backend& backend,
                                                                std::optional<backend::Precision> precision) {
  if (!backend.has_v4_ops()) {
    return Status::unsupported("DeepSeek-V4: the " + std::string(backend.name()) + " backend has no V4 kernels");
  }
  Result<V4Config> config = load_v4_config(dir);
  if (!config.ok()) return config.status();
  Result<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  const V4Config& c = *config;
  std::unique_ptr<DeepSeekV4Model> model(new DeepSeekV4Model(c, backend));
  Weights& w = *model->w_;
  w.precision = precision.value_or(backend.activation_dtype() == backend::DType::kF32 ? backend::Precision::kF32
                                                                                        : backend::Precision::kBF16);
  const bool keep_fp8 = w.precision == backend::Precision::kFP8;
  if (keep_fp8) w.precision = backend::Precision::kBF16;  // what is not stored in FP8
  Loader l(c, **checkpoint, backend, w.precision, keep_fp8);
  const int64_t d = c.hidden_size, hc = c.hc_mult;
  DEEPINFER_RETURN_IF_ERROR(l.linear("embed.weight", c.vocab_size, d, w.embed));
  DEEPINFER_RETURN_IF_ERROR(l.linear("head.weight", c.vocab_size, d, w.head));
  DEEPINFER_RETURN_IF_ERROR(l.buffer("norm.weight", {d}, w.norm));
  DEEPINFER_RETURN_IF_ERROR(l.linear("hc_head_fn", hc, hc * d, w.hc_head_fn, 1, backend::Precision::kF32));
  DEEPINFER_RETURN_IF_ERROR(l.buffer("hc_head_base", {hc}, w.hc_head_base));
  DEEPINFER_RETURN_IF_ERROR(l.buffer("hc_head_scale", {1}, w.hc_head_scale));
  w.payload.emplace(c);
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) DEEPINFER_RETURN_IF_ERROR(load_layer(l, c, i, w.layers[i]));
  w.fp8_matrices = l.fp8_matrices();
  return model;
}

namespace {

// create_random's weights: each made on the backend and filled from the next seed.
class RandomMaker {
 public:
  RandomMaker(Backend& backend, backend::Precision precision, uint64_t seed, bool fp8)
      : backend_(backend), precision_(precision), seed_(seed), fp8_(fp8) {}
  // A matrix the release stores in FP8: FP8 when asked for and its shape allows (as Loader::stays_fp8).
  Status release_fp8(int64_t rows, int64_t cols, Linear& out, int64_t count = 1) {
    const bool fp8 = fp8_ && cols % 128 == 0 && (count == 1 || rows % 128 == 0);
    if (fp8) ++fp8_matrices_;
    return linear(rows, cols, out, count, fp8 ? std::optional(backend::Precision::kFP8) : std::nullopt);
  }
  int64_t fp8_matrices() const { return fp8_matrices_; }
  Status linear(int64_t rows, int64_t cols, Linear& out, int64_t count = 1,
                std::optional<backend::Precision> precision = std::nullopt) {
    Result<std::unique_ptr<backend::Weight>> w = backend_.make_weight(count, rows, cols, precision.value_or(precision_));
    if (!w.ok()) return w.status();
    backend_.fill_random(**w, seed_++, static_cast<float>(1.0 / std::sqrt(static_cast<double>(cols))));
    out.weight = std::move(*w);
    out.rows = rows;
    out.cols = cols;
    return Status();
  }
  Status vector(int64_t n, float value, backend::Buffer& out) { return values(std::vector<float>(static_cast<size_t>(n), value), out); }
  // Uniform in [-scale, scale).
  Status random_vector(int64_t n, float scale, backend::Buffer& out) {
    std::vector<float> v(static_cast<size_t>(n));
    uint64_t x = seed_++ * 0x9e3779b97f4a7c15ull;
    for (float& f : v) {
      x ^= x >> 12;
      x ^= x << 25;
      x ^= x >> 27;
      f = (static_cast<float>((x * 0x2545f4914f6cdd1dull) >> 40) / 8388608.0f - 1.0f) * scale;
    }
    return values(v, out);
  }
  Status values(const std::vector<float>& v, backend::Buffer& out) {
    Result<backend::Buffer> b = backend_.make_vector(v);
    if (!b.ok()) return b.status();
    out = std::move(*b);
    return Status();
  }
  Backend& backend() { return backend_; }

 private:
  Backend& backend_;
  backend::Precision precision_;
  uint64_t seed_;
  bool fp8_ = false;
  int64_t fp8_matrices_ = 0;
};

}  // namespace

Result<std::unique_ptr<DeepSeekV4Model>> DeepSeekV4Model::create_random(const V4Config& c, Backend& backend,
                                                                          uint64_t seed,
                                                                          std::optional<backend::Precision> precision) {
  if (!backend.has_v4_ops()) {
    return Status::unsupported("DeepSeek-V4: the " + std::string(backend.name()) + " backend has no V4 kernels");
  }
  std::unique_ptr<DeepSeekV4Model> model(new DeepSeekV4Model(c, backend));
  Weights& w = *model->w_;
  w.precision = precision.value_or(backend.activation_dtype() == backend::DType::kF32 ? backend::Precision::kF32
                                                                                        : backend::Precision::kBF16);
  const bool fp8 = w.precision == backend::Precision::kFP8;
  if (fp8) w.precision = backend::Precision::kBF16;
  constexpr auto kF32 = backend::Precision::kF32;
  RandomMaker r(backend, w.precision, seed, fp8);
  const int64_t d = c.hidden_size, hc = c.hc_mult, H = c.num_attention_heads, D = c.head_dim;
  const int64_t mix = (2 + hc) * hc, E = c.n_routed_experts, I = c.moe_intermediate_size, K = c.num_experts_per_tok;
  DEEPINFER_RETURN_IF_ERROR(r.linear(c.vocab_size, d, w.embed));
  DEEPINFER_RETURN_IF_ERROR(r.linear(c.vocab_size, d, w.head));
  DEEPINFER_RETURN_IF_ERROR(r.vector(d, 1.0f, w.norm));
  DEEPINFER_RETURN_IF_ERROR(r.linear(hc, hc * d, w.hc_head_fn, 1, kF32));
  DEEPINFER_RETURN_IF_ERROR(r.random_vector(hc, 0.5f, w.hc_head_base));
  DEEPINFER_RETURN_IF_ERROR(r.vector(1, 1.0f, w.hc_head_scale));
  w.payload.emplace(c);
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  auto compressor = [&](int64_t ratio, int64_t dim, CompressorWeights& cw) -> Status {
    cw.ratio = ratio;
    cw.dim = dim;
    cw.coff = ratio == 4 ? 2 : 1;
    DEEPINFER_RETURN_IF_ERROR(r.random_vector(ratio * cw.coff * dim, 0.5f, cw.ape));
    DEEPINFER_RETURN_IF_ERROR(r.linear(cw.coff * dim, d, cw.wkv));
    DEEPINFER_RETURN_IF_ERROR(r.linear(cw.coff * dim, d, cw.wgate));
    return r.vector(dim, 1.0f, cw.norm);
  };
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    l.ratio = c.compress_ratios[static_cast<size_t>(i)];
    DEEPINFER_RETURN_IF_ERROR(upload_rope(backend,
                                          l.ratio == 0 ? make_rope(c.qk_rope_head_dim, c.rope_theta, nullptr)
                                                       : make_rope(c.qk_rope_head_dim, c.compress_rope_theta, &c.rope_scaling),
                                          l.rope));
    DEEPINFER_RETURN_IF_ERROR(r.vector(d, 1.0f, l.attn_norm));
    DEEPINFER_RETURN_IF_ERROR(r.vector(d, 1.0f, l.ffn_norm));
    DEEPINFER_RETURN_IF_ERROR(r.linear(mix, hc * d, l.hc_attn_fn, 1, kF32));
    DEEPINFER_RETURN_IF_ERROR(r.linear(mix, hc * d, l.hc_ffn_fn, 1, kF32));
    DEEPINFER_RETURN_IF_ERROR(r.random_vector(mix, 0.5f, l.hc_attn_base));
    DEEPINFER_RETURN_IF_ERROR(r.random_vector(mix, 0.5f, l.hc_ffn_base));
    DEEPINFER_RETURN_IF_ERROR(r.vector(3, 1.0f, l.hc_attn_scale));
    DEEPINFER_RETURN_IF_ERROR(r.vector(3, 1.0f, l.hc_ffn_scale));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(c.q_lora_rank, d, l.wq_a));
    DEEPINFER_RETURN_IF_ERROR(r.vector(c.q_lora_rank, 1.0f, l.q_norm));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(H * D, c.q_lora_rank, l.wq_b));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(D, d, l.wkv));
    DEEPINFER_RETURN_IF_ERROR(r.vector(D, 1.0f, l.kv_norm));
    DEEPINFER_RETURN_IF_ERROR(r.linear(c.o_lora_rank, H * D / c.o_groups, l.wo_a, c.o_groups));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(d, c.o_groups * c.o_lora_rank, l.wo_b));
    DEEPINFER_RETURN_IF_ERROR(r.vector(H, 0.0f, l.attn_sink));
    if (l.ratio != 0) DEEPINFER_RETURN_IF_ERROR(compressor(l.ratio, D, l.compressor));
    if (l.ratio == 4) {
      DEEPINFER_RETURN_IF_ERROR(r.release_fp8(c.index_n_heads * c.index_head_dim, c.q_lora_rank, l.index_wq_b));
      DEEPINFER_RETURN_IF_ERROR(r.linear(c.index_n_heads, d, l.index_weights_proj));
      DEEPINFER_RETURN_IF_ERROR(compressor(4, c.index_head_dim, l.index_compressor));
    }
    DEEPINFER_RETURN_IF_ERROR(r.linear(E, d, l.gate, 1, kF32));
    if (i < c.num_hash_layers) {
      std::vector<int32_t> ids(static_cast<size_t>(c.vocab_size * K));
      for (int64_t t = 0; t < c.vocab_size; ++t) {
        for (int64_t k = 0; k < K; ++k) ids[static_cast<size_t>(t * K + k)] = static_cast<int32_t>((t * 7 + k * (E / K + 1)) % E);
      }
      Result<backend::Buffer> b = backend.alloc(ids.size() * sizeof(int32_t));
      if (!b.ok()) return b.status();
      DEEPINFER_RETURN_IF_ERROR(backend.upload(ids.data(), ids.size() * sizeof(int32_t), *b, 0));
      l.tid2eid = std::move(*b);
    } else {
      DEEPINFER_RETURN_IF_ERROR(r.vector(E, 0.0f, l.gate_bias));
    }
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(2 * I, d, l.experts_gate_up, E));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(d, I, l.experts_down, E));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(2 * I, d, l.shared_gate_up));
    DEEPINFER_RETURN_IF_ERROR(r.release_fp8(d, I, l.shared_down));
  }
  w.fp8_matrices = r.fp8_matrices();
  return model;
}

namespace {
// Sums `of` over the weights one forward reads besides the routed experts.
int64_t sum_dense(const std::vector<LayerWeights>& layers, const Linear& head, const Linear& hc_head_fn,
                  const std::function<int64_t(const backend::Weight&)>& of) {
  int64_t total = of(*head.weight) + of(*hc_head_fn.weight);
  for (const LayerWeights& l : layers) {
    for (const Linear* m : {&l.hc_attn_fn, &l.hc_ffn_fn, &l.wq_a, &l.wq_b, &l.wkv, &l.wo_a, &l.wo_b, &l.compressor.wkv,
                            &l.compressor.wgate, &l.index_compressor.wkv, &l.index_compressor.wgate, &l.index_wq_b,
                            &l.index_weights_proj, &l.gate, &l.shared_gate_up, &l.shared_down}) {
      if (m->weight) total += of(*m->weight);
    }
  }
  return total;
}
}  // namespace

int64_t DeepSeekV4Model::dense_weight_bytes() const {
  return sum_dense(w_->layers, w_->head, w_->hc_head_fn,
                   [](const backend::Weight& w) { return static_cast<int64_t>(w.bytes); });
}

int64_t DeepSeekV4Model::dense_weight_params() const {
  return sum_dense(w_->layers, w_->head, w_->hc_head_fn,
                   [](const backend::Weight& w) { return w.count * w.rows * w.cols; });
}

int64_t DeepSeekV4Model::fp8_weights() const { return w_->fp8_matrices; }

int64_t DeepSeekV4Model::expert_bytes() const {
  if (w_->layers.empty()) return 0;
  const LayerWeights& l = w_->layers.front();
  return static_cast<int64_t>((l.experts_gate_up.weight->bytes + l.experts_down.weight->bytes) /
                              static_cast<size_t>(config_.n_routed_experts));
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
  return config_.num_hidden_layers * config_.sliding_window * config_.head_dim *
         static_cast<int64_t>(backend::dtype_size(backend_.activation_dtype()));
}

int64_t DeepSeekV4Model::block_payload_floats() const { return w_->payload->total; }

int64_t DeepSeekV4Model::payload_element_bytes() const {
  return static_cast<int64_t>(backend::dtype_size(backend_.activation_dtype()));
}

int64_t DeepSeekV4Model::window_payload_floats() const { return w_->payload->window_total; }

int64_t DeepSeekV4Model::window_blocks() const { return (config_.sliding_window + 63) / 64; }

namespace detail {

// The V4 cache's buffers and the step's scratch: backend memory the forward pass and restore() use.
class V4Memory {
 public:
  V4Memory(const V4Config& c, Backend& backend)
      : c_(c), backend_(backend), esize_(static_cast<int64_t>(backend::dtype_size(backend.activation_dtype()))) {}
  int64_t esize() const { return esize_; }
  // `elements` activation-dtype elements past p.
  char* at(const void* p, int64_t elements) const {
    return static_cast<char*>(const_cast<void*>(p)) + elements * esize_;
  }

  // The sequence's fixed buffers (window ring, compressor rings), on first use.
  Status allocate(V4Sequence& sequence) const {
    if (!sequence.layers_.empty()) return Status();
    std::vector<V4Sequence::Layer> layers(static_cast<size_t>(c_.num_hidden_layers));
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      V4Sequence::Layer& layer = layers[static_cast<size_t>(l)];
      DEEPINFER_RETURN_IF_ERROR(alloc(c_.sliding_window * c_.head_dim, layer.window));
      const int64_t m = c_.compress_ratios[l];
      if (m != 0) DEEPINFER_RETURN_IF_ERROR(rings(layer.attention, m, (m == 4 ? 2 : 1) * c_.head_dim));
      if (m == 4) DEEPINFER_RETURN_IF_ERROR(rings(layer.indexer, 4, 2 * c_.index_head_dim));
    }
    sequence.layers_ = std::move(layers);
    return Status();
  }
  // Room for `needed` entries of `dim` (the made ones kept).
  Status reserve(V4Sequence::Compressor& state, int64_t needed, int64_t dim) const {
    if (needed <= state.capacity) return Status();
    const int64_t capacity = std::max({needed, 2 * state.capacity, int64_t{64}});
    backend::Buffer grown;
    DEEPINFER_RETURN_IF_ERROR(alloc(capacity * dim, grown));
    if (state.made > 0) {
      backend::CopySpan span{state.entries.data(), grown.data(), static_cast<size_t>(state.made * dim * esize_)};
      backend_.copy_spans({&span, 1});
    }
    state.entries = std::move(grown);
    state.capacity = capacity;
    return Status();
  }

 private:
  Status alloc(int64_t elements, backend::Buffer& out) const {
    Result<backend::Buffer> b = backend_.alloc(static_cast<size_t>(elements * esize_));
    if (!b.ok()) return b.status();
    out = std::move(*b);
    return Status();
  }
  Status rings(V4Sequence::Compressor& state, int64_t m, int64_t width) const {
    DEEPINFER_RETURN_IF_ERROR(alloc(2 * m * width, state.ring_kv));
    return alloc(2 * m * width, state.ring_score);
  }

  const V4Config& c_;
  Backend& backend_;
  int64_t esize_;
};

}  // namespace detail

Status DeepSeekV4Model::restore(V4Sequence& sequence, std::span<const float* const> blocks,
                                std::span<const float* const> windows) const {
  const V4Config& c = config_;
  const int64_t D = c.head_dim, DI = c.index_head_dim, W = c.sliding_window;
  const int64_t P = 64 * static_cast<int64_t>(blocks.size());
  const bool replay = windows.empty() && P > 0;
  DEEPINFER_CHECK(replay || static_cast<int64_t>(windows.size()) == std::min<int64_t>(window_blocks(), P / 64),
                  "restore takes the window payloads of the last window's blocks, or none");
  DEEPINFER_CHECK(!replay || P > W, "a bounded replay restores a prefix longer than the window");
  detail::V4Memory memory(c, backend_);
  sequence.layers_.clear();
  DEEPINFER_RETURN_IF_ERROR(memory.allocate(sequence));
  const int64_t first_window_block = P / 64 - static_cast<int64_t>(windows.size());
  const size_t es = static_cast<size_t>(memory.esize());
  std::vector<backend::CopySpan> spans;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const PayloadLayout::Layer& part = w_->payload->layers[l];
    V4Sequence::Layer& layer = sequence.layers_[l];
    for (int64_t p = replay ? P : std::max<int64_t>(0, P - W); p < P; ++p) {
      const float* rows = windows[static_cast<size_t>(p / 64 - first_window_block)];
      spans.push_back({memory.at(rows, part.window_offset + (p % 64) * D), memory.at(layer.window.data(), (p % W) * D),
                       D * es});
    }
    const int64_t m = c.compress_ratios[l];
    // The compressor's raw rows at P (from the last window payload), into its rings; a replay feeds them again.
    auto rows = [&](V4Sequence::Compressor& state, int64_t at, int64_t width, int64_t capacity, int64_t ratio) {
      if (replay || P == 0) return;
      const int64_t count = kept_rows(ratio, P);
      const float* in = windows.back();
      for (int64_t i = 0; i < count; ++i) {
        const int64_t slot = (P - count + i) % (2 * ratio);
        spans.push_back({memory.at(in, part.window_offset + at + i * width), memory.at(state.ring_kv.data(), slot * width),
                         width * es});
        spans.push_back({memory.at(in, part.window_offset + at + (capacity + i) * width),
                         memory.at(state.ring_score.data(), slot * width), width * es});
      }
    };
    if (m != 0) {
      DEEPINFER_RETURN_IF_ERROR(memory.reserve(layer.attention, P / m, D));
      for (int64_t j = 0; j < P / m; ++j) {
        const int64_t block = (j * m) / 64 + (m > 64 ? 1 : 0);  // the block whose end finishes entry j
        const int64_t slot = m > 64 ? 0 : j - (block * 64) / m;
        spans.push_back({memory.at(blocks[static_cast<size_t>(block)], part.offset + part.entries + slot * D),
                         memory.at(layer.attention.entries.data(), j * D), D * es});
      }
      layer.attention.made = P / m;
      rows(layer.attention, part.rows, part.row_width, std::min<int64_t>(m, 64), m);
    }
    if (m == 4) {
      DEEPINFER_RETURN_IF_ERROR(memory.reserve(layer.indexer, P / 4, DI));
      for (size_t b = 0; b < blocks.size(); ++b) {
        spans.push_back({memory.at(blocks[b], part.offset + part.index_entries),
                         memory.at(layer.indexer.entries.data(), static_cast<int64_t>(b) * 16 * DI), 16 * DI * es});
      }
      layer.indexer.made = P / 4;
      rows(layer.indexer, part.index_rows, part.index_width, 4, 4);
    }
  }
  backend_.copy_spans(spans);
  // A bounded replay feeds the last W tokens again (forward() computes their window rows only).
  sequence.length_ = replay ? P - W : P;
  sequence.window_start_ = replay ? P - W : 0;
  sequence.replay_end_ = replay ? P : 0;
  return Status();
}

std::unique_ptr<V4Sequence> DeepSeekV4Model::new_sequence() const { return std::make_unique<V4Sequence>(); }

namespace detail {

// The forward pass over one batch on the backend's ops; member functions are its steps.
class V4Forward {
 public:
  struct Row {
    int32_t token = 0;
    int64_t position = 0;
    size_t chunk = 0;
  };
  // `scratch`: the step's activations, one buffer per use, grown to the step's rows.
  V4Forward(const V4Config& c, Backend& backend, const PayloadLayout* payload, std::vector<backend::Buffer>& scratch)
      : c_(c), backend_(backend), payload_(payload), memory_(c, backend), scratch_(scratch) {}

  // Scratch buffer `slot`, at least `bytes` long.
  Result<const backend::Buffer*> buffer(size_t slot, size_t bytes) {
    if (scratch_.size() <= slot) scratch_.resize(slot + 1);
    backend::Buffer& b = scratch_[slot];
    if (b.bytes < bytes) {
      Result<backend::Buffer> grown = backend_.alloc(bytes);
      if (!grown.ok()) return grown.status();
      b = std::move(*grown);
    }
    return &b;
  }
  // Tensor `slot` of the scratch: [rows, cols] of `dtype`, contiguous.
  Result<Tensor> tensor(size_t slot, int64_t rows, int64_t cols, backend::DType dtype) {
    Result<const backend::Buffer*> b =
        buffer(slot, static_cast<size_t>(std::max<int64_t>(1, rows * cols)) * backend::dtype_size(dtype));
    if (!b.ok()) return b.status();
    return Tensor{(*b)->data(), dtype, rows, cols, cols};
  }

  // The forward pass of `chunks` (validated) over `rows`; the head's input (the final mix) in `head_in`.
  Status run(std::span<const DeepSeekV4Model::Chunk> chunks, const std::vector<Row>& rows,
             const std::vector<LayerWeights>& layers, const Linear& embed, const Linear& hc_head_fn,
             const backend::Buffer& hc_head_base, const backend::Buffer& hc_head_scale, Tensor& head_in) {
    const int64_t T = static_cast<int64_t>(rows.size()), d = c_.hidden_size, hc = c_.hc_mult;
    const backend::DType act = backend_.activation_dtype(), f32 = backend::DType::kF32;
    for (const DeepSeekV4Model::Chunk& chunk : chunks) DEEPINFER_RETURN_IF_ERROR(memory_.allocate(*chunk.sequence));
    DEEPINFER_RETURN_IF_ERROR(assign(X_, tensor(kX, T, hc * d, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(y_, tensor(kY, T, d, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(out_, tensor(kOut, T, d, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(post_, tensor(kPost, T, hc, f32)));
    DEEPINFER_RETURN_IF_ERROR(assign(comb_, tensor(kComb, T, hc * hc, f32)));
    // Embedding, copied into every stream.
    backend_.embed(*embed.weight, y_, 0);
    for (int64_t j = 0; j < hc; ++j) backend_.copy(y_, X_.cols_slice(j * d, d));
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const LayerWeights& w = layers[static_cast<size_t>(l)];
      mix(w.hc_attn_fn, w.hc_attn_base, w.hc_attn_scale, false);
      backend_.rms_norm(y_, w.attn_norm, static_cast<float>(c_.rms_norm_eps), y_);
      DEEPINFER_RETURN_IF_ERROR(attention(w, l, chunks, rows));
      backend_.v4_hc_post(X_, out_, post_, comb_);
      mix(w.hc_ffn_fn, w.hc_ffn_base, w.hc_ffn_scale, false);
      backend_.rms_norm(y_, w.ffn_norm, static_cast<float>(c_.rms_norm_eps), y_);
      DEEPINFER_RETURN_IF_ERROR(moe(w, l));
      backend_.v4_hc_post(X_, out_, post_, comb_);
    }
    // model.py Block.hc_head: sigmoid pre-weights, no Sinkhorn.
    mix(hc_head_fn, hc_head_base, hc_head_scale, true);
    head_in = y_;
    return Status();
  }

 private:
  enum Slot : size_t { kX, kY, kOut, kPost, kComb, kQr, kQ, kKv, kIndexQ, kIndexW, kCkv, kCscore, kIkv, kIscore, kO, kZ,
                       kIds, kGateUp, kAct };

  static Status assign(Tensor& t, Result<Tensor> r) {
    if (!r.ok()) return r.status();
    t = *r;
    return Status();
  }
  void mix(const Linear& fn, const backend::Buffer& base, const backend::Buffer& scale, bool head) {
    backend::V4HyperMix m;
    m.fn = fn.weight.get();
    m.base = &base;
    m.scale = &scale;
    m.hc = c_.hc_mult;
    m.sinkhorn_iters = c_.hc_sinkhorn_iters;
    m.norm_eps = c_.rms_norm_eps;
    m.hc_eps = c_.hc_eps;
    m.head = head;
    backend_.v4_hc_pre(X_, m, y_, post_, comb_);
  }
  void linear(const Linear& w, const Tensor& x, Tensor y) { backend_.linear(x, *w.weight, y); }
  backend::V4Compressor compressor(const CompressorWeights& w, const LayerWeights& layer) const {
    backend::V4Compressor c;
    c.ratio = w.ratio;
    c.dim = w.dim;
    c.coff = w.coff;
    c.ape = &w.ape;
    c.norm = &w.norm;
    c.eps = c_.rms_norm_eps;
    c.inv_freq = &layer.rope;
    c.rope_dim = c_.qk_rope_head_dim;
    return c;
  }

  // model.py Attention.forward (with Indexer.forward on CSA layers) for every row, into out_.
  Status attention(const LayerWeights& w, int64_t layer, std::span<const DeepSeekV4Model::Chunk> chunks,
                   const std::vector<Row>& rows) {
    const int64_t T = static_cast<int64_t>(rows.size()), H = c_.num_attention_heads;
    const int64_t D = c_.head_dim, R = c_.qk_rope_head_dim, W = c_.sliding_window;
    const int64_t HI = c_.index_n_heads, DI = c_.index_head_dim;
    const backend::DType act = backend_.activation_dtype();
    const size_t es = static_cast<size_t>(memory_.esize());
    Tensor qr, q, kv, o, z;
    DEEPINFER_RETURN_IF_ERROR(assign(qr, tensor(kQr, T, c_.q_lora_rank, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(q, tensor(kQ, T, H * D, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(kv, tensor(kKv, T, D, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(o, tensor(kO, T, H * D, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(z, tensor(kZ, T, c_.o_groups * c_.o_lora_rank, act)));
    linear(w.wq_a, y_, qr);
    backend_.rms_norm(qr, w.q_norm, static_cast<float>(c_.rms_norm_eps), qr);
    linear(w.wq_b, qr, q);
    linear(w.wkv, y_, kv);
    backend::V4NormRope qn;
    qn.norm = true;
    qn.eps = c_.rms_norm_eps;
    qn.inv_freq = &w.rope;
    qn.rope_dim = R;
    qn.vectors_per_position = H;
    backend_.v4_norm_rope(q.reshaped(D), qn);
    backend::V4NormRope kn = qn;
    kn.weight = &w.kv_norm;
    kn.vectors_per_position = 1;
    backend_.v4_norm_rope(kv, kn);
    Tensor index_q, index_w;
    if (w.ratio == 4) {
      DEEPINFER_RETURN_IF_ERROR(assign(index_q, tensor(kIndexQ, T, HI * DI, act)));
      DEEPINFER_RETURN_IF_ERROR(assign(index_w, tensor(kIndexW, T, HI, act)));
      linear(w.index_wq_b, qr, index_q);
      linear(w.index_weights_proj, y_, index_w);
      backend::V4NormRope in;
      in.inv_freq = &w.rope;
      in.rope_dim = R;
      in.vectors_per_position = HI;
      backend_.v4_norm_rope(index_q.reshaped(DI), in);
    }

    // Per chunk: the compressors' work, the payloads of the blocks it finishes (copies), the window rows it leaves.
    std::vector<backend::V4CompressWork> work, index_work;
    std::vector<std::vector<backend::V4RowSnapshot>> snapshots(chunks.size()), index_snapshots(chunks.size());
    std::vector<backend::CopySpan> payload_copies, window_copies;
    const PayloadLayout::Layer& part = payload_->layers[static_cast<size_t>(layer)];
    int64_t r0 = 0;
    for (size_t ci = 0; ci < chunks.size(); ++ci) {
      const DeepSeekV4Model::Chunk& chunk = chunks[ci];
      const int64_t n = static_cast<int64_t>(chunk.token_ids.size());
      V4Sequence::Layer& state = chunk.sequence->layers_[static_cast<size_t>(layer)];
      const int64_t start = chunk.sequence->length_, end = start + n;
      // A bounded replay's rows (positions before replay_end_) rebuild the window and the compressors' rows only:
      // the entries and indexer keys were restored as of replay_end_.
      const bool replaying = start < chunk.sequence->replay_end_;
      const bool writes = !chunk.completed_blocks.empty();
      auto window_destination = [&](int64_t boundary) -> float* {
        const size_t index = static_cast<size_t>(boundary / 64 - start / 64 - 1);
        if (!writes || index >= chunk.completed_windows.size()) return nullptr;
        return chunk.completed_windows[index];
      };
      auto add_work = [&](const CompressorWeights& cw, V4Sequence::Compressor& cs, int64_t at, int64_t capacity,
                          std::vector<backend::V4RowSnapshot>& shots, std::vector<backend::V4CompressWork>& list) -> Status {
        const int64_t m = cw.ratio, width = cw.coff * cw.dim;
        const int64_t first = std::max(start / m, cs.made), last = end / m;
        DEEPINFER_RETURN_IF_ERROR(memory_.reserve(cs, std::max(first, last), cw.dim));
        for (int64_t b = (start / 64 + 1) * 64; b <= end; b += 64) {
          if (float* out = window_destination(b)) {
            shots.push_back({b, memory_.at(out, part.window_offset + at),
                             memory_.at(out, part.window_offset + at + capacity * width)});
          }
        }
        backend::V4CompressWork item;
        item.row_first = r0;
        item.start = start;
        item.count = n;
        item.ring_kv = cs.ring_kv.data();
        item.ring_score = cs.ring_score.data();
        item.entries = cs.entries.data();
        item.first_entry = first;
        item.end_entry = std::max(first, last);
        list.push_back(item);
        cs.made = std::max(cs.made, last);
        return Status();
      };
      if (w.ratio != 0) {
        DEEPINFER_RETURN_IF_ERROR(add_work(w.compressor, state.attention, part.rows, std::min<int64_t>(w.ratio, 64),
                                           snapshots[ci], work));
      }
      if (w.ratio == 4) {
        DEEPINFER_RETURN_IF_ERROR(add_work(w.index_compressor, state.indexer, part.index_rows, 4, index_snapshots[ci],
                                           index_work));
      }
      for (int64_t b = (start / 64 + 1) * 64; b <= end; b += 64) {
        if (float* window_out = window_destination(b)) {
          // The block's raw rows: earlier positions from the ring, the chunk's from its kv rows.
          for (int64_t p = b - 64; p < b; ++p) {
            const void* src = p >= start ? memory_.at(kv.data, (r0 + p - start) * kv.stride)
                                         : memory_.at(state.window.data(), (p % W) * D);
            window_copies.push_back({src, memory_.at(window_out, part.window_offset + (p - b + 64) * D), D * es});
          }
        }
        if (!writes || replaying) continue;
        float* out = chunk.completed_blocks[static_cast<size_t>(b / 64 - start / 64 - 1)];
        if (w.ratio != 0) {
          // The entries finished inside block [b - 64, b): indices [(b - 64) / m, b / m).
          const int64_t j0 = (b - 64) / w.ratio, j1 = b / w.ratio;
          if (j1 > j0) {
            payload_copies.push_back({memory_.at(state.attention.entries.data(), j0 * D),
                                      memory_.at(out, part.offset + part.entries), static_cast<size_t>((j1 - j0) * D) * es});
          }
        }
        if (w.ratio == 4) {
          payload_copies.push_back({memory_.at(state.indexer.entries.data(), ((b - 64) / 4) * DI),
                                    memory_.at(out, part.offset + part.index_entries), 16 * DI * es});
        }
      }
      r0 += n;
    }
    for (size_t ci = 0; ci < work.size(); ++ci) work[ci].snapshots = snapshots[ci];
    for (size_t ci = 0; ci < index_work.size(); ++ci) index_work[ci].snapshots = index_snapshots[ci];
    // The window payloads read the ring before this step's rows go into it.
    backend_.copy_spans(window_copies);
    if (w.ratio != 0) {
      const CompressorWeights& cw = w.compressor;
      Tensor ckv, cscore;
      DEEPINFER_RETURN_IF_ERROR(assign(ckv, tensor(kCkv, T, cw.coff * cw.dim, act)));
      DEEPINFER_RETURN_IF_ERROR(assign(cscore, tensor(kCscore, T, cw.coff * cw.dim, act)));
      linear(cw.wkv, y_, ckv);
      linear(cw.wgate, y_, cscore);
      backend_.v4_compress(ckv, cscore, compressor(cw, w), work);
    }
    if (w.ratio == 4) {
      const CompressorWeights& cw = w.index_compressor;
      Tensor ikv, iscore;
      DEEPINFER_RETURN_IF_ERROR(assign(ikv, tensor(kIkv, T, cw.coff * cw.dim, act)));
      DEEPINFER_RETURN_IF_ERROR(assign(iscore, tensor(kIscore, T, cw.coff * cw.dim, act)));
      linear(cw.wkv, y_, ikv);
      linear(cw.wgate, y_, iscore);
      backend_.v4_compress(ikv, iscore, compressor(cw, w), index_work);
    }
    backend_.copy_spans(payload_copies);

    // The rows' keys: window rows, then every visible compressed entry or the indexer's top-k of them.
    std::vector<backend::V4AttentionRow> attention_rows(static_cast<size_t>(T));
    std::vector<backend::V4IndexRow> index_rows(static_cast<size_t>(T));
    bool any_indexed = false;
    for (int64_t t = 0; t < T; ++t) {
      const Row& row = rows[static_cast<size_t>(t)];
      const DeepSeekV4Model::Chunk& chunk = chunks[row.chunk];
      V4Sequence::Layer& state = chunk.sequence->layers_[static_cast<size_t>(layer)];
      const int64_t p = row.position, start = chunk.sequence->length_;
      backend::V4AttentionRow& a = attention_rows[static_cast<size_t>(t)];
      a.position = p;
      a.window_first = std::max<int64_t>(chunk.sequence->window_start_, p - (W - 1));
      a.step_start = start;
      a.row_first = t - (p - start);
      a.ring = state.window.data();
      if (w.ratio != 0) {
        const int64_t visible = (p + 1) / w.ratio;
        a.entries = state.attention.entries.data();
        a.entry_count = visible;
        if (w.ratio == 4 && visible > c_.index_topk) {
          a.indexed = true;
          a.entry_count = c_.index_topk;
          index_rows[static_cast<size_t>(t)] = {state.indexer.entries.data(), visible};
          any_indexed = true;
        }
      }
    }
    backend::V4Attention spec;
    spec.heads = H;
    spec.head_dim = D;
    spec.window = W;
    spec.scale = 1.0 / std::sqrt(static_cast<double>(D));
    spec.sinks = &w.attn_sink;
    spec.topk = c_.index_topk;
    if (any_indexed) {
      Result<const backend::Buffer*> ids = buffer(kIds, static_cast<size_t>(T * c_.index_topk) * sizeof(int32_t));
      if (!ids.ok()) return ids.status();
      backend_.v4_indexer_topk(index_q, index_w, 1.0 / std::sqrt(static_cast<double>(DI)) / std::sqrt(static_cast<double>(HI)),
                               index_rows, c_.index_topk, **ids);
      spec.ids = *ids;
    }
    backend_.v4_attention(spec, q, kv, attention_rows, o);
    backend::V4NormRope inverse;
    inverse.inv_freq = &w.rope;
    inverse.rope_dim = R;
    inverse.inverse = true;
    inverse.vectors_per_position = H;
    backend_.v4_norm_rope(o.reshaped(D), inverse);
    // The chunks' last W rows into their window rings.
    std::vector<backend::CopySpan> ring_copies;
    r0 = 0;
    for (const DeepSeekV4Model::Chunk& chunk : chunks) {
      const int64_t n = static_cast<int64_t>(chunk.token_ids.size()), start = chunk.sequence->length_;
      V4Sequence::Layer& state = chunk.sequence->layers_[static_cast<size_t>(layer)];
      for (int64_t p = std::max(start, start + n - W); p < start + n; ++p) {
        ring_copies.push_back({memory_.at(kv.data, (r0 + p - start) * kv.stride),
                               memory_.at(state.window.data(), (p % W) * D), D * es});
      }
      r0 += n;
    }
    backend_.copy_spans(ring_copies);
    // Grouped low-rank output: per group g, z_g = wo_a[g] · o_g; then wo_b.
    const int64_t G = c_.o_groups, L = c_.o_lora_rank;
    backend_.linear_heads(o, H * D / G, *w.wo_a.weight, z, L);
    linear(w.wo_b, z, out_);
    return Status();
  }

  // model.py MoE.forward with Gate and Expert: the shared expert, plus the routed experts by hash table or top-k of
  // score + bias (the backend's moe op); SwiGLU clamped at swiglu_limit. Into out_.
  Status moe(const LayerWeights& w, int64_t layer) {
    const int64_t T = y_.rows, I = c_.moe_intermediate_size;
    const backend::DType act = backend_.activation_dtype();
    Tensor gate_up, activation;
    DEEPINFER_RETURN_IF_ERROR(assign(gate_up, tensor(kGateUp, T, 2 * I, act)));
    DEEPINFER_RETURN_IF_ERROR(assign(activation, tensor(kAct, T, I, act)));
    linear(w.shared_gate_up, y_, gate_up);
    backend_.silu_mul_clamped(gate_up, static_cast<float>(c_.swiglu_limit), activation);
    linear(w.shared_down, activation, out_);
    backend::MoeWeights m;
    m.rule.scoring = c_.scoring_func == "softmax"   ? backend::MoeRoutingRule::Scoring::kSoftmax
                     : c_.scoring_func == "sigmoid" ? backend::MoeRoutingRule::Scoring::kSigmoid
                                                    : backend::MoeRoutingRule::Scoring::kSqrtSoftplus;
    m.rule.topk = backend::MoeRoutingRule::TopK::kGreedy;
    m.rule.num_experts = c_.n_routed_experts;
    m.rule.top_k = c_.num_experts_per_tok;
    // The weights: softmax scores as they are; the others normalized over the chosen experts; then scaled.
    m.rule.norm_topk_prob = c_.scoring_func != "softmax";
    m.rule.scale_after_normalize = true;
    m.rule.routed_scaling_factor = c_.routed_scaling_factor;
    m.router = w.gate.weight.get();
    if (layer < c_.num_hash_layers) {
      m.hash_ids = &w.tid2eid;
    } else {
      m.bias = &w.gate_bias;
    }
    m.gate_up = w.experts_gate_up.weight.get();
    m.down = w.experts_down.weight.get();
    m.swiglu_limit = static_cast<float>(c_.swiglu_limit);
    backend_.moe(y_, m, out_);
    return Status();
  }

  const V4Config& c_;
  Backend& backend_;
  const PayloadLayout* payload_;
  V4Memory memory_;
  std::vector<backend::Buffer>& scratch_;
  Tensor X_, y_, out_, post_, comb_;
};

}  // namespace detail

Status DeepSeekV4Model::run_layers(std::span<const Chunk> chunks, backend::Tensor& head_in, size_t& wanted_rows) {
  const V4Config& c = config_;
  std::set<const V4Sequence*> seen;
  std::vector<detail::V4Forward::Row> rows;
  std::vector<int32_t> wanted;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& chunk = chunks[i];
    if (chunk.sequence == nullptr || chunk.token_ids.empty()) {
      return Status::invalid_argument("DeepSeek-V4 forward: chunk " + std::to_string(i) + " has no sequence or no tokens");
    }
    if (!seen.insert(chunk.sequence).second) {
      return Status::invalid_argument("DeepSeek-V4 forward: a sequence appears twice in one batch");
    }
    if (!chunk.sequence->layers_.empty() &&
        chunk.sequence->layers_.size() != static_cast<size_t>(c.num_hidden_layers)) {
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
      if (chunk.logits == Logits::kAll || (chunk.logits == Logits::kLast && k == n - 1)) {
        wanted.push_back(static_cast<int32_t>(rows.size()));
      }
      rows.push_back({id, chunk.sequence->length_ + k, i});
    }
  }
  std::vector<int32_t> token_ids, positions, row_sequence;
  for (const detail::V4Forward::Row& row : rows) {
    token_ids.push_back(row.token);
    positions.push_back(static_cast<int32_t>(row.position));
    row_sequence.push_back(static_cast<int32_t>(row.chunk));
  }
  backend::StepLayout layout;
  layout.token_ids = token_ids;
  layout.positions = positions;
  layout.row_sequence = row_sequence;
  layout.logits_rows = wanted;
  DEEPINFER_RETURN_IF_ERROR(backend_.begin_step(layout));
  detail::V4Forward f(c, backend_, &*w_->payload, w_->scratch);
  DEEPINFER_RETURN_IF_ERROR(f.run(chunks, rows, w_->layers, w_->embed, w_->hc_head_fn, w_->hc_head_base,
                                  w_->hc_head_scale, head_in));
  for (const Chunk& chunk : chunks) chunk.sequence->length_ += static_cast<int64_t>(chunk.token_ids.size());
  wanted_rows = wanted.size();
  return Status();
}

Status DeepSeekV4Model::forward(std::span<const Chunk> chunks, std::vector<float>& logits) {
  backend::Tensor head_in;
  size_t wanted = 0;
  DEEPINFER_RETURN_IF_ERROR(run_layers(chunks, head_in, wanted));
  // The final norm and the head on the wanted rows.
  logits.clear();
  if (wanted == 0) return backend_.synchronize();
  return backend_.logits(head_in, w_->norm, static_cast<float>(config_.rms_norm_eps), *w_->head.weight, logits);
}

Status DeepSeekV4Model::forward_on_device(std::span<const Chunk> chunks,
                                          std::span<const backend::Backend::DeviceSampling> sampling,
                                          std::span<const backend::Backend::LogitAdjustment> adjustments,
                                          std::vector<int32_t>& ids,
                                          std::vector<backend::Backend::SampledLogprobs>* logprobs) {
  if (!sampling.empty() && !samples_on_device()) {
    return Status::unsupported("DeepSeek-V4 forward_on_device: the " + std::string(backend_.name()) +
                               " backend does not sample on the device");
  }
  size_t expected = 0;  // checked before the layers run: an error leaves the sequences unchanged
  for (const Chunk& chunk : chunks) {
    expected += chunk.logits == Logits::kAll ? chunk.token_ids.size() : chunk.logits == Logits::kLast ? 1 : 0;
  }
  if (!sampling.empty() && sampling.size() != expected) {
    return Status::invalid_argument("DeepSeek-V4 forward_on_device: " + std::to_string(sampling.size()) +
                                    " rows' sampling for " + std::to_string(expected) + " logits rows");
  }
  backend::Tensor head_in;
  size_t wanted = 0;
  DEEPINFER_RETURN_IF_ERROR(run_layers(chunks, head_in, wanted));
  ids.clear();
  if (wanted == 0) return backend_.synchronize();
  backend_.compute_logits(head_in, w_->norm, static_cast<float>(config_.rms_norm_eps), *w_->head.weight,
                          sampling.empty());
  if (sampling.empty()) return backend_.read_greedy_tokens(ids);
  DEEPINFER_RETURN_IF_ERROR(backend_.read_sampled_tokens(sampling, adjustments, ids));
  return logprobs != nullptr ? backend_.read_sampled_logprobs(*logprobs) : Status();
}

}  // namespace deepinfer::model
