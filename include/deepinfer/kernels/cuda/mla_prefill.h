// MLA prefill attention on the GPU, non-absorbed (expanded) form, as DeepSeek computes prefill: per-head keys and
// values from the kv up-projection (wkv_b), causal, several sequences of different lengths in one launch
// (FlashAttention-2 varlen layout, cu_seqlens). Math (DeepSeek-V2 paper §2.1.2-2.1.3, "naive" attention in
// DeepSeek-V3's inference/model.py):
//   for sequence b with tokens [s_b, s_{b+1}) of the packed arrays, L_b = s_{b+1} - s_b, local positions i, j:
//   score(i, j, h) = scale * (q[s_b + i, h, :192] · k[s_b + j, h, :192])                       j <= i
//   out[s_b + i, h, :128] = sum_{j <= i} softmax_j(score(i, j, h)) * v[s_b + j, h, :128]
// 192 = 128 (qk_nope_head_dim) + 64 (qk_rope_head_dim); 128 = v_head_dim. Queries and keys of a sequence are
// the same tokens (no cached prefix: key j and query i are both positions of this prompt).
//
// K layout choice: k is given EXPANDED, [T, H, 192] (k_nope of head h | the shared roped k_rope copied into
// every head), the same layout as q; the caller broadcasts k_rope [T, 64] into it (T * H * 128 B extra per
// layer, e.g. 1 MB at T = 4096, H = 128, written once and read once per key tile). A strided k_rope
// (head stride 0) is a later refinement.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deepinfer::kernels::cuda {

inline constexpr int kMlaPrefillQkDim = 192;   // qk_nope_head_dim 128 + qk_rope_head_dim 64 (V2/V3)
inline constexpr int kMlaPrefillVDim = 128;    // v_head_dim (V2/V3)

// All pointers are device pointers owned by the caller; bf16 values are passed as their bit patterns (uint16_t).
// T = cu_seqlens[num_seqs] packed tokens. Nothing is allocated by the launchers.
struct MlaPrefillParams {
  int num_seqs = 0;                  // B sequences
  int num_heads = 0;                 // H (128 for V3 on one GPU, 16 per GPU at TP8)
  int max_seqlen = 0;                // >= max_b L_b (sizes the grid; larger is allowed, only slower)
  float scale = 0.0f;                // softmax scale (1/sqrt(192) * mscale², as the model computes it)
  const int32_t* cu_seqlens = nullptr;  // [B + 1], cu_seqlens[0] = 0, non-decreasing (L_b = 0 allowed)
  const uint16_t* q = nullptr;       // bf16 [T, H, 192] contiguous: q_nope | roped q_rope
  const uint16_t* k = nullptr;       // bf16 [T, H, 192] contiguous: k_nope | roped k_rope (expanded, see above)
  const uint16_t* v = nullptr;       // bf16 [T, H, 128] contiguous
  uint16_t* out = nullptr;           // bf16 [T, H, 128] contiguous, every row written
  cudaStream_t stream = nullptr;
};

// The fast kernel, FlashAttention-2 style: one CTA of 4 warps per (64-query tile, head, sequence), heaviest
// tiles first; each warp owns 16 query rows (Q fragments in registers); loop over 64-key tiles up to the
// diagonal; K/V tiles double-buffered by cp.async into XOR-swizzled shared memory; S = Q·Kᵀ and O += P·V by
// mma.sync m16n8k16 bf16 with f32 accumulation, P kept in registers; online softmax in f32 (exp2).
// Returns cudaErrorInvalidValue on bad parameters, else the launch's error. Asynchronous on params.stream.
cudaError_t run_mla_prefill(const MlaPrefillParams& params);

// The simple kernel: one CTA of 128 threads per (token, head), f32 CUDA-core math, scores in shared memory.
// Slow; the on-GPU reference for the fast one. REQUIRES: max_seqlen * 4 bytes fit in shared memory.
cudaError_t run_mla_prefill_reference(const MlaPrefillParams& params);

// FLOPs of causal prefill attention, the convention of the benchmark: 2 * H * (192 + 128) * L(L+1)/2 per
// sequence (QKᵀ over 192 dims and P·V over 128 for every (i, j <= i) pair; softmax not counted).
inline double mla_prefill_flops(int num_heads, int64_t seqlen) {
  return 2.0 * num_heads * (kMlaPrefillQkDim + kMlaPrefillVDim) * static_cast<double>(seqlen) * (seqlen + 1) / 2.0;
}

}  // namespace deepinfer::kernels::cuda
