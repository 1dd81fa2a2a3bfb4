// Fused element-wise / per-row ops of the DeepSeek forward pass and the MoE routing + token permutation, on the
// device. Semantics are the CPU backend's (include/deepinfer/backend/backend.h, src/backend/cpu/cpu_backend.cpp)
// and the model's routing rule (include/deepinfer/backend/moe_routing.h); tests/gpu/gpu_check_ops.cu checks each
// against them. Storage is bf16 (kBF16) or float32 (kF32); arithmetic is float32 (rope's cos/sin in double).
// Every launcher is asynchronous on params.stream and returns the launch error; pointers are device memory
// owned by the caller. Vectorized (16-byte) paths run when sizes, strides and pointers allow; otherwise a
// scalar path computes the same function.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace deepinfer::kernels::cuda {

enum class DType : int { kF32 = 0, kBF16 = 1 };

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) * weight, rows at row stride `stride` (elements, >= dim) in x
// and y; y may alias x. With `residual` non-null (DeepSeek's / vLLM's fused_add_rms_norm):
//   residual[r, :] = x[r, :] + residual[r, :]   (float sum, stored in the dtype: bf16 rounds once)
//   y[r, :]        = rms_norm(residual[r, :] as stored) * weight
// residual has the same stride as x. x, y, residual, weight all have `dtype`.
struct RmsNormParams {
  DType dtype = DType::kBF16;
  int64_t rows = 0, dim = 0, stride = 0;
  float eps = 1e-6f;
  const void* x = nullptr;
  const void* weight = nullptr;  // [dim]
  void* residual = nullptr;      // optional, updated in place
  void* y = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t run_rms_norm(const RmsNormParams& params);

// out[r, :] = silu(gate_up[r, :n]) * gate_up[r, n:2n], silu(g) = g / (1 + exp(-g)).
struct SiluMulParams {
  DType dtype = DType::kBF16;
  int64_t rows = 0, n = 0;
  const void* gate_up = nullptr;  // [rows, 2n]
  void* out = nullptr;            // [rows, n]
  cudaStream_t stream = nullptr;
};
cudaError_t run_silu_mul(const SiluMulParams& params);

// Rotary embedding in place, as the CPU backend's rope: `rows` vectors of `dim` values at row stride `stride`,
// vector r at position positions[r / vectors_per_position]; pairs (x[2i], x[2i+1]) rotate by
// angle = double(pos) * double(inv_freq[i]), c = cos(angle) * attention_factor, s = sin(angle) * attention_factor
// (double, rounded to float), and are written de-interleaved: x[i] = a c - b s, x[i + dim/2] = b c + a s.
// dim even, <= 256.
struct RopeParams {
  DType dtype = DType::kBF16;
  int64_t rows = 0, dim = 0, stride = 0, vectors_per_position = 1;
  void* x = nullptr;
  const int32_t* positions = nullptr;  // [ceil(rows / vectors_per_position)]
  const float* inv_freq = nullptr;     // [dim / 2]
  float attention_factor = 1.0f;
  cudaStream_t stream = nullptr;
};
cudaError_t run_rope(const RopeParams& params);

// MLA's per-token preparation (Backend::mla_prepare) in one kernel, bf16: for each token t of the step, the latent
// kv[t, :latent] = run_rms_norm's result (the same arithmetic and reduction order as its one-vector-per-thread path),
// the key kv[t, latent:latent+rope_dim] and q rows [t * heads, (t + 1) * heads) roped as run_rope (positions[t]);
// the kv row stored at cache[slots[t]] (slot < 0: skipped; >= num_slots: the kernel traps), the roped q rows also
// into q_copy when given. One CTA of 256 threads per token. REQUIRES (else cudaErrorInvalidValue): latent % 8 == 0,
// latent <= 2048; rope_dim as run_rope's vector path (8 to 256 with 32 % (rope_dim / 8) == 0); every pointer and
// stride 16-byte aligned.
struct MlaPrepareParams {
  int64_t tokens = 0, latent = 0, rope_dim = 0, heads = 0;
  uint16_t* kv = nullptr;  // bf16 [tokens, kv_stride]: latent then rope_dim values per row
  int64_t kv_stride = 0;
  const uint16_t* norm_weight = nullptr;  // bf16 [latent]
  float eps = 0.0f;
  uint16_t* q = nullptr;  // bf16 rope parts: row r = t * heads + h at q + r * q_stride, rope_dim values
  int64_t q_stride = 0;
  uint16_t* q_copy = nullptr;  // optional: the same rows at q_copy + r * q_copy_stride
  int64_t q_copy_stride = 0;
  const int32_t* positions = nullptr;  // [tokens]
  const float* inv_freq = nullptr;     // [rope_dim / 2]
  float attention_factor = 1.0f;
  const int64_t* slots = nullptr;  // [tokens]
  uint16_t* cache = nullptr;       // bf16 [num_slots, latent + rope_dim]
  int64_t num_slots = 0;
  cudaStream_t stream = nullptr;
};
// Whether run_mla_prepare takes these operands (its REQUIRES; host only, reads no device memory).
bool mla_prepare_takes(const MlaPrepareParams& params);
cudaError_t run_mla_prepare(const MlaPrepareParams& params);

// MoE router logits for a few tokens (the CUDA backend takes it up to 64): logits[t, e] = Σ_i x[t, i] · w[e, i], x
// bf16 [T, hidden] at row stride x_stride, w float32 [E, hidden] at row stride w_stride, logits float32 at row
// stride logits_stride. Products and sum in double, rounded once to float (no float summation order to match: the
// result is the exact dot product's nearest float in all but pathological cancellations). One warp per (t, e).
struct MoeRouterLogitsParams {
  int64_t tokens = 0, num_experts = 0, hidden = 0;
  const uint16_t* x = nullptr;
  int64_t x_stride = 0;
  const float* w = nullptr;
  int64_t w_stride = 0;
  float* logits = nullptr;
  int64_t logits_stride = 0;
  bool vec = false;  // set by the launcher (16-byte loads when sizes and alignment allow)
  cudaStream_t stream = nullptr;
};
cudaError_t run_moe_router_logits(const MoeRouterLogitsParams& params);

// MoE routing, the model's rule exactly (include/deepinfer/backend/moe_routing.h: scores, bias, group selection,
// tie rules, weights); one warp per token. logits f32 [T, E]; ids int32 [T, k] in the rule's order (choice
// descending, equal choices -> lower expert index; equal group scores -> lower group index); weights f32 [T, k].
// E <= 512, E % n_group == 0, n_group <= 32, topk_group <= n_group, k <= min(E, 32).
struct MoeRoutingParams {
  int64_t tokens = 0, num_experts = 0, top_k = 0;
  bool sigmoid = false;           // false: softmax (V2); true: sigmoid (V3)
  bool sqrt_softplus = false;     // sqrt(softplus) scores (DeepSeek-V4; overrides sigmoid)
  // DeepSeek-V4's hash-routed layers: ids = fixed_ids[token_ids[t]][0..k) (int32 [vocab][k]) instead of the top-k;
  // the weights from the scores as for top-k.
  const int32_t* fixed_ids = nullptr;
  const int32_t* token_ids = nullptr;  // [T], with fixed_ids
  int grouping = 0;               // 0 greedy, 1 group_limited_greedy (group max), 2 noaux_tc (top-2 sum)
  int n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  bool scale_after_normalize = false;  // V3
  double routed_scaling_factor = 1.0;
  const float* logits = nullptr;  // [T, E]
  const float* bias = nullptr;    // [E] e_score_correction_bias, or null (+0)
  int32_t* ids = nullptr;         // [T, k]
  float* weights = nullptr;       // [T, k]
  cudaStream_t stream = nullptr;
};
cudaError_t run_moe_routing(const MoeRoutingParams& params);

// Token permutation for grouped expert GEMMs. Entry j = t * k + slot of ids [T, k] (ids of one token distinct).
//   counts[e]          number of entries routed to expert e
//   offsets[e]         exclusive prefix sum of counts; offsets[E] = T * k
//   sorted_entries[p]  the entries grouped by expert (expert 0's first), within an expert in token order:
//                      the row p of the permuted activations is token sorted_entries[p] / k
//   entry_position[j]  the inverse: sorted_entries[entry_position[j]] == j
// Workspace: moe_permute_workspace_bytes(T * k, E) bytes of device memory (scratch, contents ignored).
struct MoePermuteParams {
  int64_t tokens = 0, top_k = 0, num_experts = 0;  // E <= 1024
  const int32_t* ids = nullptr;      // [T, k], values in [0, E)
  int32_t* counts = nullptr;         // [E]
  int32_t* offsets = nullptr;        // [E + 1]
  int32_t* sorted_entries = nullptr; // [T * k]
  int32_t* entry_position = nullptr; // [T * k]
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
};
// Up to 256 entries run as one CTA (and one launch; the workspace is not used), more as three launches.
size_t moe_permute_workspace_bytes(int64_t entries, int64_t num_experts);
cudaError_t run_moe_permute(const MoePermuteParams& params);

// run_moe_routing then run_moe_permute on its ids (routing.ids == permute.ids, same tokens, top_k and experts), the
// same results; up to 256 entries both in one launch of one CTA (decode: 7 us of launches per MoE layer fewer).
cudaError_t run_moe_route_and_permute(const MoeRoutingParams& routing, const MoePermuteParams& permute);

// Gather for the grouped GEMM: permuted[p, :] = x[sorted_entries[p] / k, :], rows of `hidden` bf16 values.
struct MoeGatherParams {
  int64_t entries = 0, top_k = 0, hidden = 0;
  const uint16_t* x = nullptr;             // bf16 [T, hidden]
  const int32_t* sorted_entries = nullptr; // [T * k]
  uint16_t* permuted = nullptr;            // bf16 [T * k, hidden]
  cudaStream_t stream = nullptr;
};
cudaError_t run_moe_gather(const MoeGatherParams& params);

// Combine: out[t, :] = (base ? base[t, :] : 0) + Σ_slot weights[t, slot] · expert_out[entry_position[t k + slot], :]
// in float (slot order), rounded once to bf16. base (e.g. the shared experts' output) may alias out.
// With `residual`: then the next layer's residual add and input norm in the same launch (one CTA per row):
// residual[t, :] = bf16(out[t, :] + residual[t, :]), normed[t, :] = rms_norm(residual[t, :]) · norm_weight, bit for
// bit what run_rms_norm with that residual writes after the plain combine. Every matrix contiguous [T, hidden];
// needs moe_combine_norm_fits (hidden % 8 == 0 and <= 16,384, 16-byte aligned pointers), else
// cudaErrorInvalidValue. normed may not alias the others; base may alias out.
struct MoeCombineParams {
  int64_t tokens = 0, top_k = 0, hidden = 0;
  const uint16_t* expert_out = nullptr;    // bf16 [T * k, hidden], permuted order
  const int32_t* entry_position = nullptr; // [T * k]
  const float* weights = nullptr;          // [T, k]
  const uint16_t* base = nullptr;          // bf16 [T, hidden] or null
  uint16_t* out = nullptr;                 // bf16 [T, hidden]
  uint16_t* residual = nullptr;            // bf16 [T, hidden] or null (no norm)
  const uint16_t* norm_weight = nullptr;   // bf16 [hidden]
  uint16_t* normed = nullptr;              // bf16 [T, hidden]
  float eps = 1e-6f;
  cudaStream_t stream = nullptr;
};
bool moe_combine_norm_fits(const MoeCombineParams& params);
cudaError_t run_moe_combine(const MoeCombineParams& params);

}  // namespace deepinfer::kernels::cuda
