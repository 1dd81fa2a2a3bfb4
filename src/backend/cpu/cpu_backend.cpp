// CPU backend: OpenBLAS sgemm for linear layers, split over OpenMP threads by output columns (bf16 weights
// are widened tile by tile into a per-thread buffer, so they stay half-size in memory), OpenMP over rows and
// heads for the rest. Numerics: float32
// storage; reductions (RMS, softmax sums) accumulate in double to stay close to the float64 reference.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "deepinfer/backend/backend.h"

namespace deepinfer::backend {
namespace {

constexpr int64_t kBlockTokens = 64;  // tokens per KV cache block (FlashMLA's page size)
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

// y[m, n] (row stride ldy) = x[m, k] · w[n, k]ᵀ, single-threaded.
void gemm(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* y, int64_t ldy) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              1.0f, x, static_cast<int>(k), w, static_cast<int>(k), 0.0f, y, static_cast<int>(ldy));
}

class CpuBackend final : public Backend {
 public:
  CpuBackend() { openblas_set_num_threads(1); }

  std::string_view name() const override { return "cpu"; }

  // One OpenMP team splits the output columns; each thread runs a single-threaded sgemm on its slice (bf16
  // slices are widened tile by tile into the thread's own buffer). One thread pool for everything: OpenBLAS's
  // own threads spinning beside OpenMP's cost 4x at small batch on 2 cores.
  void linear(const float* x, int64_t m, const WeightMatrix& w, float* y) override {
    if (m == 0) return;
    const bool parallel = m * w.rows * w.cols >= (1 << 18);
#pragma omp parallel if (parallel)
    {
      const int64_t threads = omp_get_num_threads();
      const int64_t per_thread = ((w.rows + threads - 1) / threads + 15) / 16 * 16;
      const int64_t begin = std::min<int64_t>(w.rows, per_thread * omp_get_thread_num());
      const int64_t end = std::min<int64_t>(w.rows, begin + per_thread);
      if (w.precision == WeightMatrix::Precision::kF32) {
        if (end > begin) gemm(x, m, w.f32.data() + begin * w.cols, end - begin, w.cols, y + begin, w.rows);
      } else {
        thread_local std::vector<float> tile;
        tile.resize(static_cast<size_t>(kBf16TileRows * w.cols));
        for (int64_t row0 = begin; row0 < end; row0 += kBf16TileRows) {
          const int64_t rows = std::min(kBf16TileRows, end - row0);
          const uint16_t* src = w.bf16.data() + row0 * w.cols;
          widen_bf16(src, tile.data(), rows * w.cols);
          gemm(x, m, tile.data(), rows, w.cols, y + row0, w.rows);
        }
      }
    }
  }

  void rms_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, float eps,
                float* y) override {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = x + r * stride;
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(in[i]) * in[i];
      float inv = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(dim) + eps));
      float* out = y + r * stride;
      for (int64_t i = 0; i < dim; ++i) out[i] = in[i] * inv * weight[i];
    }
  }

  void silu_mul(const float* gate_up, int64_t rows, int64_t n, float* out) override {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up + r * 2 * n;
      const float* up = gate + n;
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }

  void rope(float* x, int64_t rows, int64_t dim, int64_t stride, int64_t vectors_per_position,
            const int32_t* positions, const float* inv_freq, float attention_factor) override {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; ++r) {
      float* v = x + r * stride;
      double position = positions[r / vectors_per_position];
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

  void mla_attention(const MlaAttentionParams& p) override {
    const int64_t entry = p.kv_lora_rank + p.rope_dim;
#pragma omp parallel
    {
      std::vector<double> scores;
      std::vector<double> accumulator(static_cast<size_t>(p.kv_lora_rank));
#pragma omp for schedule(dynamic) collapse(2)
      for (int64_t t = 0; t < p.num_tokens; ++t) {
        for (int64_t h = 0; h < p.num_heads; ++h) {
          const std::vector<int32_t>& blocks = p.block_tables[static_cast<size_t>(p.row_sequence[t])];
          const int64_t context = p.row_context[t];
          const float* q_latent = p.q_latent + (t * p.num_heads + h) * p.kv_lora_rank;
          const float* q_rope = p.q_rope + (t * p.num_heads + h) * p.rope_dim;
          scores.resize(static_cast<size_t>(context));
          double max_score = -INFINITY;
          for (int64_t j = 0; j < context; ++j) {
            const float* kv = p.cache + (blocks[static_cast<size_t>(j / kBlockTokens)] * kBlockTokens +
                                         j % kBlockTokens) * entry;
            float dot = 0.0f;
            for (int64_t c = 0; c < p.kv_lora_rank; ++c) dot += q_latent[c] * kv[c];
            for (int64_t c = 0; c < p.rope_dim; ++c) dot += q_rope[c] * kv[p.kv_lora_rank + c];
            scores[static_cast<size_t>(j)] = static_cast<double>(dot) * p.scale;
            max_score = std::max(max_score, scores[static_cast<size_t>(j)]);
          }
          double sum = 0.0;
          for (double& s : scores) {
            s = std::exp(s - max_score);
            sum += s;
          }
          std::fill(accumulator.begin(), accumulator.end(), 0.0);
          for (int64_t j = 0; j < context; ++j) {
            const float* kv = p.cache + (blocks[static_cast<size_t>(j / kBlockTokens)] * kBlockTokens +
                                         j % kBlockTokens) * entry;
            double weight = scores[static_cast<size_t>(j)] / sum;
            for (int64_t c = 0; c < p.kv_lora_rank; ++c) accumulator[static_cast<size_t>(c)] += weight * kv[c];
          }
          float* out = p.out_latent + (t * p.num_heads + h) * p.kv_lora_rank;
          for (int64_t c = 0; c < p.kv_lora_rank; ++c) out[c] = static_cast<float>(accumulator[static_cast<size_t>(c)]);
        }
      }
    }
  }

};

}  // namespace

WeightMatrix WeightMatrix::from_f32(std::vector<float> values, int64_t rows, int64_t cols, Precision precision) {
  WeightMatrix w;
  w.precision = precision;
  w.rows = rows;
  w.cols = cols;
  if (precision == Precision::kF32) {
    w.f32 = std::move(values);
  } else {
    w.bf16.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) w.bf16[i] = f32_to_bf16(values[i]);
  }
  return w;
}

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
