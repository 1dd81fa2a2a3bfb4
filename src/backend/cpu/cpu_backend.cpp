// CPU backend: OpenBLAS sgemm for linear layers, split over OpenMP threads by output columns (bf16 weights
// are widened tile by tile into a per-thread buffer, so they stay half-size in memory), OpenMP over rows and
// heads for the rest. Numerics: float32
// storage; reductions (RMS, softmax sums) accumulate in double to stay close to the float64 reference.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/types.h"
#include "cpu_v4.h"

namespace deepinfer::backend {
namespace {

constexpr int64_t kBlockTokens = ::deepinfer::kBlockTokens;  // core/types.h
constexpr int64_t kBf16TileRows = 256;

// Widening bf16 -> float32 is the bf16 path's inner loop: an AVX-512 build of it is chosen at run time when
// the CPU has AVX-512 (the generic build is vectorized for the baseline ISA).
void widen_bf16_generic(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

__attribute__((target("avx512f,avx512bw"))) void widen_bf16_avx512(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

using WidenFn = void (*)(const uint16_t*, float*, int64_t);
WidenFn select_widen() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? widen_bf16_avx512
                                                                                  : widen_bf16_generic;
}
const WidenFn widen_bf16 = select_widen();

uint16_t f32_to_bf16(float value) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// y[m, n] (row stride ldy) = x[m, k] (row stride ldx) · w[n, k]ᵀ, single-threaded.
void gemm(const float* x, int64_t ldx, int64_t m, const float* w, int64_t n, int64_t k, float* y, int64_t ldy) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              1.0f, x, static_cast<int>(ldx), w, static_cast<int>(k), 0.0f, y, static_cast<int>(ldy));
}

// splitmix64: the random weights' counter-based generator (benchmarks), so a value depends on (seed, index) only.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Stacked matrices in host memory: float32 values (kF32) or bf16 bit patterns (kBF16). kFP8 is kept as bf16
// here (make_weight reports kBF16, so the model hands over dequantized float32 values).
struct CpuWeight final : Weight {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  const float* f32_matrix(int64_t i) const { return f32.data() + i * rows * cols; }
  const uint16_t* bf16_matrix(int64_t i) const { return bf16.data() + i * rows * cols; }
};

const CpuWeight& cpu(const Weight& w) { return static_cast<const CpuWeight&>(w); }
float* f32(const Tensor& t) { return static_cast<float*>(t.data); }
const float* f32(const Buffer& b) { return static_cast<const float*>(b.data()); }

class CpuBackend final : public Backend {
 public:
  CpuBackend() { openblas_set_num_threads(1); }

  std::string_view name() const override { return "cpu"; }
  DType activation_dtype() const override { return DType::kF32; }
  DType cache_dtype() const override { return DType::kF32; }

  Result<Buffer> alloc(size_t bytes) override {
    void* p = std::calloc(std::max<size_t>(bytes, 1), 1);
    if (p == nullptr) return Status::resource_exhausted("host memory: cannot allocate " + std::to_string(bytes) + " bytes");
    return Buffer{std::shared_ptr<void>(p, std::free), bytes};
  }
  Status upload(const void* host, size_t bytes, const Buffer& dst, size_t dst_offset) override {
    std::memcpy(static_cast<char*>(dst.data()) + dst_offset, host, bytes);
    return Status();
  }
  Status download(const Buffer& src, size_t src_offset, size_t bytes, void* host) override {
    std::memcpy(host, static_cast<const char*>(src.data()) + src_offset, bytes);
    return Status();
  }
  // Any DeepSeek shape: the CPU ops take any size (rope dims up to 256, checked by the model).
  Status check_model_shapes(const ModelShapes&) const override { return Status(); }
  Status synchronize() override { return Status(); }

  Result<std::unique_ptr<Weight>> make_weight(int64_t count, int64_t rows, int64_t cols, Precision precision) override {
    auto w = std::make_unique<CpuWeight>();
    w->precision = precision == Precision::kF32 ? Precision::kF32 : Precision::kBF16;
    w->count = count;
    w->rows = rows;
    w->cols = cols;
    const size_t n = static_cast<size_t>(count * rows * cols);
    try {
      if (w->precision == Precision::kF32) {
        w->f32.resize(n);
      } else {
        w->bf16.resize(n);
      }
    } catch (const std::bad_alloc&) {
      return Status::resource_exhausted("host memory: cannot allocate a " + std::to_string(count) + " x " +
                                        std::to_string(rows) + " x " + std::to_string(cols) + " weight");
    }
    w->bytes = w->f32.size() * sizeof(float) + w->bf16.size() * sizeof(uint16_t);
    return std::unique_ptr<Weight>(std::move(w));
  }

  Status set_matrix(Weight& weight, int64_t index, const HostMatrix& host) override {
    CpuWeight& w = static_cast<CpuWeight&>(weight);
    const size_t n = static_cast<size_t>(w.rows * w.cols);
    if (index < 0 || index >= w.count || host.rows != w.rows || host.cols != w.cols || host.f32.size() != n) {
      return Status::invalid_argument("set_matrix: a " + std::to_string(host.rows) + " x " + std::to_string(host.cols) +
                                      " float32 matrix (" + std::to_string(host.f32.size()) + " values) for slot " +
                                      std::to_string(index) + " of a " + std::to_string(w.count) + " x " +
                                      std::to_string(w.rows) + " x " + std::to_string(w.cols) + " weight");
    }
    if (w.precision == Precision::kF32) {
      std::copy(host.f32.begin(), host.f32.end(), w.f32.begin() + static_cast<ptrdiff_t>(index * n));
    } else {
      uint16_t* out = w.bf16.data() + index * n;
      for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(host.f32[i]);
    }
    return Status();
  }

  Result<std::vector<float>> read_matrix(const Weight& weight, int64_t index) override {
    const CpuWeight& w = cpu(weight);
    if (index < 0 || index >= w.count) {
      return Status::invalid_argument("read_matrix: slot " + std::to_string(index) + " of " + std::to_string(w.count));
    }
    const size_t n = static_cast<size_t>(w.rows * w.cols);
    std::vector<float> values(n);
    if (w.precision == Precision::kF32) {
      std::copy_n(w.f32_matrix(index), n, values.data());
    } else {
      widen_bf16(w.bf16_matrix(index), values.data(), static_cast<int64_t>(n));
    }
    return values;
  }

  void fill_random(Weight& weight, uint64_t seed, float scale) override {
    CpuWeight& w = static_cast<CpuWeight&>(weight);
    const int64_t n = w.count * w.rows * w.cols;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      // 24 random bits -> [-1, 1).
      float u = static_cast<float>(splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i))) >> 40) *
                    (2.0f / 16777216.0f) - 1.0f;
      if (w.precision == Precision::kF32) {
        w.f32[static_cast<size_t>(i)] = u * scale;
      } else {
        w.bf16[static_cast<size_t>(i)] = f32_to_bf16(u * scale);
      }
    }
  }

  Result<Buffer> make_vector(std::span<const float> values) override {
    Result<Buffer> b = alloc(values.size() * sizeof(float));
    if (!b.ok()) return b.status();
    if (!values.empty()) std::memcpy(b->data(), values.data(), values.size() * sizeof(float));
    return b;
  }

  Status begin_step(const StepLayout& layout) override {
    token_ids_.assign(layout.token_ids.begin(), layout.token_ids.end());
    positions_.assign(layout.positions.begin(), layout.positions.end());
    row_sequence_.assign(layout.row_sequence.begin(), layout.row_sequence.end());
    slots_.assign(layout.slots.begin(), layout.slots.end());
    block_tables_.assign(layout.block_tables.begin(), layout.block_tables.end());
    logits_rows_.assign(layout.logits_rows.begin(), layout.logits_rows.end());
    head_has_ids_ = false;
    return Status();
  }

  void embed(const Weight& table, Tensor out, int64_t first_id) override {
    const CpuWeight& w = cpu(table);
    for (int64_t t = 0; t < out.rows; ++t) {
      const int64_t id = token_ids_[static_cast<size_t>(t)] - first_id;
      float* o = f32(out) + t * out.stride;
      if (id < 0 || id >= w.rows) {  // another rank's shard of the vocabulary
        std::fill_n(o, w.cols, 0.0f);
      } else if (w.precision == Precision::kF32) {
        std::copy_n(w.f32.data() + id * w.cols, w.cols, o);
      } else {
        widen_bf16(w.bf16.data() + id * w.cols, o, w.cols);
      }
    }
  }

  void gather_step_rows(const Tensor& src, Tensor out) override {
    for (int64_t t = 0; t < out.rows; ++t) {
      std::copy_n(f32(src) + token_ids_[static_cast<size_t>(t)] * src.stride, out.cols, f32(out) + t * out.stride);
    }
  }

  void linear(const Tensor& x, const Weight& w, Tensor y) override { linear_matrix(x, cpu(w), 0, y); }

  void linear_heads(const Tensor& x, int64_t x_head_stride, const Weight& w, Tensor y, int64_t y_head_stride) override {
    for (int64_t h = 0; h < w.count; ++h) {
      Tensor xh{f32(x) + h * x_head_stride, DType::kF32, x.rows, w.cols, x.stride};
      Tensor yh{f32(y) + h * y_head_stride, DType::kF32, y.rows, w.rows, y.stride};
      linear_matrix(xh, cpu(w), h, yh);
    }
  }

  void rms_norm(const Tensor& x, const Buffer& weight, float eps, Tensor y) override {
    const float* wt = f32(weight);
#pragma omp parallel for schedule(static) if (x.rows > 4)
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* in = f32(x) + r * x.stride;
      double sum = 0.0;
      for (int64_t i = 0; i < x.cols; ++i) sum += static_cast<double>(in[i]) * in[i];
      float inv = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(x.cols) + eps));
      float* out = f32(y) + r * y.stride;
      for (int64_t i = 0; i < x.cols; ++i) out[i] = in[i] * inv * wt[i];
    }
  }

  void add_rms_norm(Tensor residual, const Tensor& delta, const Buffer& weight, float eps, Tensor y) override {
    add(residual, delta);
    rms_norm(residual, weight, eps, y);
  }

  void add(Tensor x, const Tensor& delta) override {
    for (int64_t r = 0; r < x.rows; ++r) {
      float* a = f32(x) + r * x.stride;
      const float* b = f32(delta) + r * delta.stride;
      for (int64_t i = 0; i < x.cols; ++i) a[i] += b[i];
    }
  }

  void fill_zero(Tensor x) override {
    for (int64_t r = 0; r < x.rows; ++r) std::fill_n(f32(x) + r * x.stride, x.cols, 0.0f);
  }

  void copy(const Tensor& src, Tensor dst) override {
    for (int64_t r = 0; r < src.rows; ++r) std::copy_n(f32(src) + r * src.stride, src.cols, f32(dst) + r * dst.stride);
  }

  void silu_mul(const Tensor& gate_up, Tensor out) override {
    const int64_t n = out.cols;
#pragma omp parallel for schedule(static) if (out.rows > 4)
    for (int64_t r = 0; r < out.rows; ++r) {
      const float* gate = f32(gate_up) + r * gate_up.stride;
      const float* up = gate + n;
      float* o = f32(out) + r * out.stride;
      for (int64_t i = 0; i < n; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }

  void rope(Tensor x, int64_t vectors_per_position, const Buffer& inv_freq_buffer, float attention_factor) override {
    const int64_t dim = x.cols, half = dim / 2;
    const float* inv_freq = f32(inv_freq_buffer);
#pragma omp parallel for schedule(static) if (x.rows > 16)
    for (int64_t r = 0; r < x.rows; ++r) {
      float* v = f32(x) + r * x.stride;
      double position = positions_[static_cast<size_t>(r / vectors_per_position)];
      float rotated[256];  // rope dims <= 256 (DeepSeek: 64); checked when the model loads
      for (int64_t i = 0; i < half; ++i) {
        double angle = position * static_cast<double>(inv_freq[i]);
        double c = std::cos(angle) * attention_factor;
        double s = std::sin(angle) * attention_factor;
        double a = v[2 * i];
        double b = v[2 * i + 1];
        rotated[i] = static_cast<float>(a * c - b * s);
        rotated[i + half] = static_cast<float>(b * c + a * s);
      }
      std::memcpy(v, rotated, static_cast<size_t>(dim) * sizeof(float));
    }
  }

  void store_kv(const Tensor& kv, const Buffer& cache_layer) override {
    float* cache = static_cast<float*>(cache_layer.data());
    for (int64_t t = 0; t < kv.rows; ++t) {
      std::copy_n(f32(kv) + t * kv.stride, kv.cols, cache + slots_[static_cast<size_t>(t)] * kv.cols);
    }
  }

  void mla_attention(const MlaAttention& a, const Tensor& q, const Buffer& cache_layer, Tensor out) override {
    const int64_t C = a.kv_lora_rank, R = a.rope_dim, entry = C + R, H = a.num_heads;
    const float* cache = f32(cache_layer);
    // A team only for work worth its start-up (as linear_matrix): small steps (a speculative draft pass's one row per
    // sequence, short contexts) run on this thread, which also spares them waiting on a descheduled team member.
    int64_t work = 0;
    for (int64_t t = 0; t < q.rows; ++t) work += (positions_[static_cast<size_t>(t)] + 1) * H * entry;
    const bool parallel = work >= (1 << 18);
#pragma omp parallel if (parallel)
    {
      std::vector<double> scores;
      std::vector<double> accumulator(static_cast<size_t>(C));
#pragma omp for schedule(dynamic) collapse(2)
      for (int64_t t = 0; t < q.rows; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          const std::vector<int32_t>& blocks = block_tables_[static_cast<size_t>(row_sequence_[static_cast<size_t>(t)])];
          const int64_t context = positions_[static_cast<size_t>(t)] + 1;
          const float* q_latent = f32(q) + t * q.stride + h * entry;
          const float* q_rope = q_latent + C;
          scores.resize(static_cast<size_t>(context));
          double max_score = -INFINITY;
          for (int64_t j = 0; j < context; ++j) {
            const float* kv = cache + (blocks[static_cast<size_t>(j / kBlockTokens)] * kBlockTokens +
                                       j % kBlockTokens) * entry;
            float dot = 0.0f;
            for (int64_t c = 0; c < C; ++c) dot += q_latent[c] * kv[c];
            for (int64_t c = 0; c < R; ++c) dot += q_rope[c] * kv[C + c];
            scores[static_cast<size_t>(j)] = static_cast<double>(dot) * a.scale;
            max_score = std::max(max_score, scores[static_cast<size_t>(j)]);
          }
          double sum = 0.0;
          for (double& s : scores) {
            s = std::exp(s - max_score);
            sum += s;
          }
          std::fill(accumulator.begin(), accumulator.end(), 0.0);
          for (int64_t j = 0; j < context; ++j) {
            const float* kv = cache + (blocks[static_cast<size_t>(j / kBlockTokens)] * kBlockTokens +
                                       j % kBlockTokens) * entry;
            double weight = scores[static_cast<size_t>(j)] / sum;
            for (int64_t c = 0; c < C; ++c) accumulator[static_cast<size_t>(c)] += weight * kv[c];
          }
          float* o = f32(out) + t * out.stride + h * C;
          for (int64_t c = 0; c < C; ++c) o[c] = static_cast<float>(accumulator[static_cast<size_t>(c)]);
        }
      }
    }
  }

  // The CPU path stays in the absorbed form everywhere: one attention code path, exact against the reference.
  bool has_mla_expanded(const MlaExpanded&) const override { return false; }
  void mla_expanded(const MlaExpanded&, const Tensor&, const Tensor&, const Buffer&, Tensor) override {
    std::fprintf(stderr, "cpu backend: mla_expanded called although has_mla_expanded() is false\n");
    std::abort();
  }

  void moe(const Tensor& x, const MoeWeights& w, Tensor out) override {
    const int64_t T = x.rows, hidden = x.cols, n = w.rule.num_experts, k = w.rule.top_k;
    const int64_t first = w.first_expert, held = w.gate_up->count;
    std::vector<std::vector<std::pair<int32_t, float>>> by_expert(static_cast<size_t>(n));
    if (!w.routed_ids.empty()) {  // expert parallel: the owner's routing
      if (static_cast<int64_t>(w.routed_ids.size()) != T * k || w.routed_weights.size() != w.routed_ids.size()) {
        std::fprintf(stderr, "cpu backend: moe: routed ids/weights must be [T * top_k]\n");
        std::abort();
      }
      for (int64_t i = 0; i < T * k; ++i) {
        by_expert[static_cast<size_t>(w.routed_ids[i])].push_back({static_cast<int32_t>(i / k), w.routed_weights[i]});
      }
    } else {
      router_.resize(static_cast<size_t>(T * n));
      // Router logits in float32 from float32 weights, as the reference computes them.
      linear(x, *w.router, Tensor{router_.data(), DType::kF32, T, n, n});
      std::vector<float> bias;
      if (w.bias != nullptr) bias.assign(f32(*w.bias), f32(*w.bias) + n);
      std::vector<int32_t> ids;
      std::vector<float> weights;
      const int32_t* hash = w.hash_ids == nullptr ? nullptr : static_cast<const int32_t*>(w.hash_ids->data());
      for (int64_t t = 0; t < T; ++t) {
        if (hash != nullptr) {
          route_token_fixed(w.rule, router_.data() + t * n, hash + static_cast<int64_t>(token_ids_[t]) * k, ids, weights);
        } else {
          route_token(w.rule, router_.data() + t * n, bias, ids, weights);
        }
        for (size_t i = 0; i < ids.size(); ++i) by_expert[ids[i]].push_back({static_cast<int32_t>(t), weights[i]});
      }
    }
    const int64_t inter = w.down->cols;
    for (int64_t e = first; e < first + held; ++e) {
      const auto& tokens = by_expert[static_cast<size_t>(e)];
      if (tokens.empty()) continue;
      const int64_t rows = static_cast<int64_t>(tokens.size());
      gathered_.resize(static_cast<size_t>(rows * hidden));
      gate_up_.resize(static_cast<size_t>(rows * 2 * inter));
      act_.resize(static_cast<size_t>(rows * inter));
      expert_out_.resize(static_cast<size_t>(rows * hidden));
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(f32(x) + tokens[r].first * x.stride, hidden, gathered_.data() + r * hidden);
      }
      linear_matrix(Tensor{gathered_.data(), DType::kF32, rows, hidden, hidden}, cpu(*w.gate_up), e - first,
                    Tensor{gate_up_.data(), DType::kF32, rows, 2 * inter, 2 * inter});
      if (w.swiglu_limit > 0.0f || w.hash_ids != nullptr || w.rule.scoring == MoeRoutingRule::Scoring::kSqrtSoftplus) {
        // DeepSeek-V4's experts: the activation in double as its reference computes it, clamped where it says.
        cpu_v4::silu_mul_clamped(Tensor{gate_up_.data(), DType::kF32, rows, 2 * inter, 2 * inter}, w.swiglu_limit,
                                 Tensor{act_.data(), DType::kF32, rows, inter, inter});
      } else {
        silu_mul(Tensor{gate_up_.data(), DType::kF32, rows, 2 * inter, 2 * inter},
                 Tensor{act_.data(), DType::kF32, rows, inter, inter});
      }
      linear_matrix(Tensor{act_.data(), DType::kF32, rows, inter, inter}, cpu(*w.down), e - first,
                    Tensor{expert_out_.data(), DType::kF32, rows, hidden, hidden});
      for (int64_t r = 0; r < rows; ++r) {
        float* o = f32(out) + tokens[r].first * out.stride;
        const float* in = expert_out_.data() + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) o[i] += tokens[r].second * in[i];
      }
    }
  }

  bool has_v4_ops() const override { return true; }
  void v4_hc_pre(const Tensor& X, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb) override {
    const int64_t mix = m.fn->rows;
    hc_mixes_.resize(static_cast<size_t>(X.rows * mix));
    linear(X, *m.fn, Tensor{hc_mixes_.data(), DType::kF32, X.rows, mix, mix});
    cpu_v4::hc_pre(X, hc_mixes_.data(), m, y, post, comb);
  }
  void v4_hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb) override {
    cpu_v4::hc_post(X, out, post, comb);
  }
  void v4_norm_rope(Tensor x, const V4NormRope& p) override { cpu_v4::norm_rope(x, p, positions_); }
  void v4_compress(const Tensor& kv, const Tensor& score, const V4Compressor& c,
                   std::span<const V4CompressWork> work) override {
    cpu_v4::compress(kv, score, c, work);
  }
  void v4_indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale, std::span<const V4IndexRow> rows,
                       int64_t topk, const Buffer& ids) override {
    cpu_v4::indexer_topk(q, weights, weight_scale, rows, topk, ids);
  }
  void v4_attention(const V4Attention& a, const Tensor& q, const Tensor& kv, std::span<const V4AttentionRow> rows,
                    Tensor out) override {
    cpu_v4::attention(a, q, kv, rows, out);
  }
  void copy_spans(std::span<const CopySpan> spans) override {
    for (const CopySpan& s : spans) std::memmove(s.dst, s.src, s.bytes);
  }
  void silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out) override {
    cpu_v4::silu_mul_clamped(gate_up, limit, out);
  }

  // Plain host memory: nothing to record, so graphs are the ops themselves.
  Status run_graph(const GraphKey& /*key*/, const std::function<void()>& ops) override {
    ops();
    return Status();
  }

  void compute_logits(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head, bool greedy) override {
    const int64_t rows = static_cast<int64_t>(logits_rows_.size()), hidden = x.cols, vocab = lm_head.rows;
    selected_.resize(static_cast<size_t>(rows * hidden));
    Tensor selected{selected_.data(), DType::kF32, rows, hidden, hidden};
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(f32(x) + logits_rows_[static_cast<size_t>(r)] * x.stride, hidden, selected_.data() + r * hidden);
    }
    rms_norm(selected, norm, eps, selected);
    head_logits_.resize(static_cast<size_t>(rows * vocab));
    linear(selected, lm_head, Tensor{head_logits_.data(), DType::kF32, rows, vocab, vocab});
    head_has_ids_ = greedy;
    if (!greedy) return;
    head_ids_.assign(static_cast<size_t>(rows), -1);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = head_logits_.data() + r * vocab;
      float best = -INFINITY;
      bool bad = false;  // NaN or +inf: the row has no token, as the sampler rejects such logits
      for (int64_t i = 0; i < vocab; ++i) {
        bad = bad || std::isnan(row[i]) || row[i] == INFINITY;
        if (row[i] > best) {  // strict: the lowest id wins ties
          best = row[i];
          head_ids_[static_cast<size_t>(r)] = static_cast<int32_t>(i);
        }
      }
      if (bad) head_ids_[static_cast<size_t>(r)] = -1;
    }
  }

  // A swap, not a copy: a step's logits can be 100 MB, and the caller's vector keeps its capacity for the next step.
  Status read_logits(std::vector<float>& host_logits) override {
    host_logits.swap(head_logits_);
    head_logits_.clear();
    return Status();
  }

  Status read_greedy_tokens(std::vector<int32_t>& host_ids) override {
    if (!head_has_ids_) {
      std::fprintf(stderr, "cpu backend: read_greedy_tokens without compute_logits(greedy) for this step\n");
      std::abort();
    }
    host_ids = head_ids_;
    return Status();
  }

  Status read_top_probabilities(std::vector<float>& host_probabilities) override {
    if (!head_has_ids_) {
      std::fprintf(stderr, "cpu backend: read_top_probabilities without compute_logits(greedy) for this step\n");
      std::abort();
    }
    const int64_t rows = static_cast<int64_t>(head_ids_.size());
    const int64_t vocab = rows > 0 ? static_cast<int64_t>(head_logits_.size()) / rows : 0;
    host_probabilities.assign(static_cast<size_t>(rows), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t id = head_ids_[static_cast<size_t>(r)];
      if (id < 0) continue;
      host_probabilities[static_cast<size_t>(r)] =
          softmax_probability_of(std::span<const float>(head_logits_).subspan(static_cast<size_t>(r * vocab),
                                                                               static_cast<size_t>(vocab)),
                                 id);
    }
    return Status();
  }

 private:
  // y = x · w[index]ᵀ. One OpenMP team splits the output columns; each thread runs a single-threaded sgemm on
  // its slice (bf16 slices are widened tile by tile into the thread's own buffer). One thread pool for
  // everything: OpenBLAS's own threads spinning beside OpenMP's cost 4x at small batch on 2 cores.
  void linear_matrix(const Tensor& x, const CpuWeight& w, int64_t index, Tensor y) {
    const int64_t m = x.rows;
    if (m == 0) return;
    const bool parallel = m * w.rows * w.cols >= (1 << 18);
    const float* xp = f32(x);
    float* yp = f32(y);
#pragma omp parallel if (parallel)
    {
      const int64_t threads = omp_get_num_threads();
      const int64_t per_thread = ((w.rows + threads - 1) / threads + 15) / 16 * 16;
      const int64_t begin = std::min<int64_t>(w.rows, per_thread * omp_get_thread_num());
      const int64_t end = std::min<int64_t>(w.rows, begin + per_thread);
      if (w.precision == Precision::kF32) {
        if (end > begin) {
          gemm(xp, x.stride, m, w.f32_matrix(index) + begin * w.cols, end - begin, w.cols, yp + begin, y.stride);
        }
      } else {
        thread_local std::vector<float> tile;
        tile.resize(static_cast<size_t>(kBf16TileRows * w.cols));
        for (int64_t row0 = begin; row0 < end; row0 += kBf16TileRows) {
          const int64_t rows = std::min(kBf16TileRows, end - row0);
          widen_bf16(w.bf16_matrix(index) + row0 * w.cols, tile.data(), rows * w.cols);
          gemm(xp, x.stride, m, tile.data(), rows, w.cols, yp + row0, y.stride);
        }
      }
    }
  }

  std::vector<int32_t> token_ids_, positions_, row_sequence_, logits_rows_;
  std::vector<int64_t> slots_;
  std::vector<std::vector<int32_t>> block_tables_;
  std::vector<float> router_, gathered_, gate_up_, act_, expert_out_, selected_, hc_mixes_;
  // compute_logits' results, until read: logits [logits_rows, vocab] and, after a greedy one, the argmax ids.
  std::vector<float> head_logits_;
  std::vector<int32_t> head_ids_;
  bool head_has_ids_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

std::string cpu_features() {
  __builtin_cpu_init();
  std::string features = "baseline";
  if (__builtin_cpu_supports("avx2")) features += ",avx2";
  if (__builtin_cpu_supports("avx512f")) features += ",avx512f";
  if (__builtin_cpu_supports("avx512bw")) features += ",avx512bw";
  if (__builtin_cpu_supports("avx512bf16")) features += ",avx512bf16";
  return features;
}

}  // namespace deepinfer::backend
