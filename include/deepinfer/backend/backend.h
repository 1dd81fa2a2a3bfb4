// The backend interface: the few batched operations the DeepSeek forward pass is made of. Model code sees
// only this header; the CPU implementation lives in src/backend/cpu, the CUDA one will sit behind the same
// calls (ggml's narrow backend interface). Every operation is batch-first: rows are tokens of one step, from
// any number of sequences; attention reads the paged latent KV cache through per-sequence block tables.
//
// Conventions: float32 activations, row-major, contiguous unless a stride is given. A call never allocates
// what it returns; outputs are caller-owned and must not alias inputs unless stated.
// Thread-safety: a Backend is used by one engine thread; it may use threads internally.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace deepinfer::backend {

// A linear layer's weight [rows = out_features, cols = in_features], as checkpoints store it, in the
// precision it is kept in memory. kF32 is the reference-exact path; kBF16 keeps half the bytes and
// accumulates in float32 (values converted exactly from the checkpoint's bf16 or rounded from FP8 x scale).
struct WeightMatrix {
  enum class Precision { kF32, kBF16 };
  Precision precision = Precision::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> f32;      // kF32: rows * cols
  std::vector<uint16_t> bf16;  // kBF16: rows * cols, bfloat16 bit patterns

  static WeightMatrix from_f32(std::vector<float> values, int64_t rows, int64_t cols, Precision precision);
  size_t bytes() const { return f32.size() * sizeof(float) + bf16.size() * sizeof(uint16_t); }
};

// MLA attention in the absorbed form over a paged latent cache (DeepSeek-V2 paper §2.1.2-2.1.3; FlashMLA's
// layout): for each head h and query token t,
//   score(t, j) = scale * (q_latent[t, h, :] · latent[j, :kv_lora_rank] + q_rope[t, h, :] · latent[j, kv_lora_rank:])
// over the cached tokens j <= position(t) of t's sequence (causal), softmax over j, then
//   out_latent[t, h, :] = sum_j p(t, j) * latent[j, :kv_lora_rank].
// The caller turns out_latent into values with W_UV and projects with o_proj.
struct MlaAttentionParams {
  int64_t num_tokens = 0;      // T query rows in this step
  int64_t num_heads = 0;       // H
  int64_t kv_lora_rank = 0;    // C (512 for V3)
  int64_t rope_dim = 0;        // R (64 for V3); a cache entry holds C + R floats
  float scale = 0.0f;          // softmax scale, mscale included
  const float* q_latent = nullptr;  // [T, H, C]
  const float* q_rope = nullptr;    // [T, H, R], rope already applied
  float* out_latent = nullptr;      // [T, H, C]
  // Per query row: which sequence it belongs to and how many cached tokens it sees (position + 1).
  const int32_t* row_sequence = nullptr;  // [T] index into block_tables
  const int32_t* row_context = nullptr;   // [T]
  // Per sequence: its block table (block ids, 64 tokens each) into `cache`.
  std::span<const std::vector<int32_t>> block_tables;
  const float* cache = nullptr;  // this layer's cache: [num_blocks, 64, C + R]
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // y[m, w.rows] = x[m, w.cols] · wᵀ.
  virtual void linear(const float* x, int64_t m, const WeightMatrix& w, float* y) = 0;
  // y[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) * weight, for `rows` rows of `dim` values with a row
  // stride of `stride` (>= dim) in x and y; y may alias x.
  virtual void rms_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight,
                        float eps, float* y) = 0;
  // out[r, :] = silu(gate_up[r, :n]) * gate_up[r, n:2n]: the SwiGLU of a fused gate|up projection.
  virtual void silu_mul(const float* gate_up, int64_t rows, int64_t n, float* out) = 0;
  // Rotary embedding in place on `rows` vectors of `dim` values at row stride `stride`, vector r at
  // position positions[r / vectors_per_position]. Pairs (x[2i], x[2i+1]) rotate by angle pos * inv_freq[i]
  // and the result is written de-interleaved (first halves, then second halves), as DeepSeek's checkpoints
  // expect (transformers' apply_rotary_pos_emb_interleave); cos/sin are multiplied by `attention_factor`.
  virtual void rope(float* x, int64_t rows, int64_t dim, int64_t stride, int64_t vectors_per_position,
                    const int32_t* positions, const float* inv_freq, float attention_factor) = 0;
  virtual void mla_attention(const MlaAttentionParams& params) = 0;
};

// The CPU backend: OpenBLAS GEMMs, OpenMP loops, AVX-512 bf16 widening where the CPU has it (detected at
// run time).
std::unique_ptr<Backend> make_cpu_backend();
// The SIMD features the CPU backend found, e.g. "baseline,avx2,avx512f,avx512bw,avx512bf16".
std::string cpu_features();

}  // namespace deepinfer::backend
