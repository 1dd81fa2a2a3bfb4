// MLA prefill attention on the GPU, non-absorbed (expanded) form, as DeepSeek computes prefill: per-head keys and
// values from the kv up-projection (wkv_b), causal, several sequences of different lengths in one launch
// (FlashAttention-2 varlen layout, cu_seqlens). Math (DeepSeek-V2 paper §2.1.2-2.1.3, "naive" attention in
// DeepSeek-V3's inference/model.py):
//   for sequence b with query rows [s_b, s_{b+1}) of the packed q (L_b = s_{b+1} - s_b rows at absolute positions
//   P_b, P_b + 1, ...: P_b = q_positions[b], 0 when null) and key rows [u_b, u_{b+1}) of the packed k/v (cu_seqlens_k;
//   the same rows as the queries when null) at absolute positions K0, K0 + 1, ... (K0 = key_position):
//   score(i, j, h) = scale * (q[s_b + i, h, :192] · k[u_b + j, h, :192])          over keys with K0 + j <= P_b + i
//   out[s_b + i, h, :128] = sum_j softmax_j(score(i, j, h)) * v[u_b + j, h, :128]
// 192 = 128 (qk_nope_head_dim) + 64 (qk_rope_head_dim); 128 = v_head_dim. With nothing cached the keys are the
// queries' own tokens (cu_seqlens_k null, P_b = K0 = 0); over a cached prefix the keys are the prefix and the new
// tokens, up-projected from the latent cache by the caller (vLLM's "MLA chunked context"), optionally in chunks of
// key positions whose partial results merge by log-sum-exp (`merge`).
//
// K layout: k_nope (the first 128 dims of each head's key), k_rope (the last 64) and v each come as a base pointer
// with a token stride and a head stride in elements, so the caller can pass kv_b's output [T, H * (128 + 128)]
// (k_nope | v per head) and the latent cache's roped key [T, 64 of 576] shared by every head (head stride 0) as
// they are. Leaving the strides 0 means the contiguous layouts k [T, H, 192] (k_rope = k + 128) and v [T, H, 128].
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "deepinfer/kernels/cuda/mla_prefill_shape.h"

namespace deepinfer::kernels::cuda {

inline constexpr int kMlaPrefillQkDim = 192;   // qk_nope_head_dim 128 + qk_rope_head_dim 64 (V2/V3)
inline constexpr int kMlaPrefillVDim = 128;    // v_head_dim (V2/V3)

// How a launch's partial result over one chunk of key positions combines with the others (the caller launches the
// chunks in order, on one stream): kNone writes `out` (all keys in this launch); kFirst writes o_acc (normalised) and
// lse_acc; kMiddle merges into them; kLast merges and writes `out`. A row with no visible key in a chunk leaves the
// merge unchanged (the first chunk must hold key position 0, which every query sees).
enum class MlaPrefillMerge { kNone, kFirst, kMiddle, kLast };

// Which fast kernel run_mla_prefill launches: kWgmma (Hopper's warpgroup MMA; the default: 64 or 128 query rows per
// CTA, whichever the grid's waves favour), kWgmma64 / kWgmma128 (forced), or kMma (mma.sync, the
// earlier kernel, kept for comparison). All compute the same thing with the same key tiles and softmax.
enum class MlaPrefillKernel { kWgmma, kWgmma64, kWgmma128, kMma };

// All pointers are device pointers owned by the caller; bf16 values are passed as their bit patterns (uint16_t).
// T = cu_seqlens[num_seqs] packed query rows, Tk = cu_seqlens_k[num_seqs] packed keys. Nothing is allocated by the
// launchers. Element offsets: k_nope[t * k_token_stride + h * k_head_stride + d], likewise k_rope and v.
struct MlaPrefillParams {
  int num_seqs = 0;                  // B sequences
  int num_heads = 0;                 // H (128 for V3 on one GPU, 16 per GPU at TP8)
  int max_seqlen = 0;                // >= max_b L_b (sizes the grid; larger is allowed, only slower)
  int max_seqlen_k = 0;              // >= max_b keys of a sequence (the reference kernel's scores); 0: max_seqlen
  float scale = 0.0f;                // softmax scale (1/sqrt(192) * mscale², as the model computes it)
  const int32_t* cu_seqlens = nullptr;    // [B + 1], cu_seqlens[0] = 0, non-decreasing (L_b = 0 allowed)
  const int32_t* cu_seqlens_k = nullptr;  // [B + 1] like cu_seqlens; null: the keys are the query rows
  const int32_t* q_positions = nullptr;   // [B] absolute position of each sequence's first query row; null: 0
  int key_position = 0;                   // absolute position of every sequence's first key row (K0 >= 0)
  const uint16_t* q = nullptr;       // bf16 [T, H, 192] contiguous: q_nope | roped q_rope
  const uint16_t* k_nope = nullptr;  // bf16, 128 per (key, head); 16-byte aligned rows
  int64_t k_token_stride = 0, k_head_stride = 0;
  const uint16_t* k_rope = nullptr;  // bf16, 64 per (key, head); null: k_nope + 128 (contiguous k)
  int64_t k_rope_token_stride = 0, k_rope_head_stride = 0;
  const uint16_t* v = nullptr;       // bf16, 128 per (key, head)
  int64_t v_token_stride = 0, v_head_stride = 0;
  uint16_t* out = nullptr;           // bf16 [T, H, 128] contiguous; every row written by kNone and kLast
  MlaPrefillMerge merge = MlaPrefillMerge::kNone;
  float* o_acc = nullptr;            // f32 [T, H, 128] (merges other than kNone)
  float* lse_acc = nullptr;          // f32 [T, H], log2 domain (merges other than kNone)
  MlaPrefillKernel kernel = MlaPrefillKernel::kWgmma;
  // The wgmma kernels: each tile's softmax runs while the previous tile's P · V is on the tensor cores
  // (FlashAttention-3's intra-warpgroup pipelining; the default), or false: serially, as before it (comparisons).
  // The same additions in the same order either way: the outputs are equal bit for bit.
  bool wgmma_overlap = true;
  // Key splits (the wgmma kernel at 128 query rows a CTA): each CTA's visible key tiles are cut into key_splits
  // equal ranges run by separate CTAs, which write their normalised rows and log-sum-exps to their split's slot of
  // split_o / split_lse; a combine pass then merges the splits and applies `merge` (the same result as one CTA, up to
  // the order of f32 sums). For grids whose last wave of 128-row CTAs would be mostly empty (few heads: V2-Lite's 16,
  // V3's 16 a GPU at TP8). 0: run_mla_prefill chooses 1 to max_key_splits by waves (1 when the workspace is not
  // given or kernel is not kWgmma); >= 1: forced (> 1 takes the 128-row kernel; kernel must be kWgmma or kWgmma128).
  int key_splits = 0;
  int max_key_splits = 0;        // splits the workspace holds
  int64_t split_rows = 0;        // its rows per split: T
  float* split_o = nullptr;      // f32 [max_key_splits, split_rows, H, 128], 16-byte aligned
  float* split_lse = nullptr;    // f32 [max_key_splits, split_rows, H]
  // kWgmma's choice of rows per CTA counts the CTAs with work: Σ_b ceil(L_b / 64) and Σ_b ceil(L_b / 128) when the
  // caller knows the lengths on the host (a chunk beside a few decode rows is not num_seqs chunks); 0: estimated as
  // ceil(max_seqlen / 64) * num_seqs (resp. 128).
  int64_t tiles_64 = 0, tiles_128 = 0;
  cudaStream_t stream = nullptr;
};

// Floats of the key-split workspace (split_o and split_lse) for `splits` splits of `rows` query rows at `heads` heads.
inline int64_t mla_prefill_split_floats(int64_t rows, int64_t heads, int64_t splits) {
  return splits * rows * heads * (kMlaPrefillVDim + 1);
}

// Fills in the contiguous layout's strides where the params leave them 0 (k [T, H, 192], v [T, H, 128]).
inline MlaPrefillParams mla_prefill_contiguous(MlaPrefillParams p) {
  if (p.k_token_stride == 0) p.k_token_stride = static_cast<int64_t>(p.num_heads) * kMlaPrefillQkDim;
  if (p.k_head_stride == 0) p.k_head_stride = kMlaPrefillQkDim;
  if (p.k_rope == nullptr) {
    p.k_rope = p.k_nope == nullptr ? nullptr : p.k_nope + (kMlaPrefillQkDim - 64);
    p.k_rope_token_stride = p.k_token_stride;
    p.k_rope_head_stride = p.k_head_stride;
  }
  if (p.v_token_stride == 0) p.v_token_stride = static_cast<int64_t>(p.num_heads) * kMlaPrefillVDim;
  if (p.v_head_stride == 0) p.v_head_stride = kMlaPrefillVDim;
  return p;
}

// The fast kernels, FlashAttention-2 style: one CTA of 4 warps (one warpgroup) per (64-query tile, head, sequence)
// (kWgmma128: 8 warps, two warpgroups, per 128-query tile),
// heaviest tiles first; each warp owns 16 query rows; loop over 64-key tiles up to the diagonal; K/V tiles
// double-buffered by cp.async into swizzled shared memory; online softmax in f32 (exp2), P kept in registers.
// kWgmma: S = Q·Kᵀ by wgmma m64n64k16 from shared memory, O += P·V by wgmma m64n128k16 with P from registers;
// kMma: both by mma.sync m16n8k16 with Q fragments in registers. bf16 inputs, f32 accumulation.
// Returns cudaErrorInvalidValue on bad parameters, else the launch's error. Asynchronous on params.stream.
cudaError_t run_mla_prefill(const MlaPrefillParams& params);

// What run_mla_prefill launches for `params` on the current device (choose_mla_prefill_shape for kWgmma).
MlaPrefillShape mla_prefill_shape(const MlaPrefillParams& params);

// The simple kernel: one CTA of 128 threads per (token, head), f32 CUDA-core math, scores in shared memory.
// Slow; the on-GPU reference for the fast one; merge kNone only. REQUIRES: max_seqlen_k * 4 bytes fit in shared
// memory.
cudaError_t run_mla_prefill_reference(const MlaPrefillParams& params);

// FLOPs of causal prefill attention, the convention of the benchmark: 2 * H * (192 + 128) * L(L+1)/2 per
// sequence (QKᵀ over 192 dims and P·V over 128 for every (i, j <= i) pair; softmax not counted).
inline double mla_prefill_flops(int num_heads, int64_t seqlen) {
  return 2.0 * num_heads * (kMlaPrefillQkDim + kMlaPrefillVDim) * static_cast<double>(seqlen) * (seqlen + 1) / 2.0;
}

}  // namespace deepinfer::kernels::cuda
