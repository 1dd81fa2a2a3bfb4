// MLA decode attention on the GPU, absorbed form, over the paged latent KV cache in FlashMLA's layout.
// One query token per sequence (decode). Math (DeepSeek-V2 paper §2.1.2-2.1.3; FlashMLA csrc/.../splitkv_mla.cu;
// the CPU reference is CpuBackend::mla_attention in src/backend/cpu/cpu_backend.cpp):
//   score(b, h, j) = scale * (q[b, h, :576] · cache_row(b, j)[:576])        j < context_lens[b]
//   out[b, h, :512] = sum_j softmax_j(score(b, h, j)) * cache_row(b, j)[:512]
// where cache_row(b, j) = kv_cache[block_table[b, j / 64], j % 64, :] and the 576 values of a row are the
// 512-value latent (kv_lora_rank) followed by the 64-value rope key (qk_rope_head_dim). q is q_latent | q_rope.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deepinfer::kernels::cuda {

inline constexpr int kMlaLatentDim = 512;                       // C = kv_lora_rank (V2/V3)
inline constexpr int kMlaRopeDim = 64;                          // R = qk_rope_head_dim
inline constexpr int kMlaEntryDim = kMlaLatentDim + kMlaRopeDim;  // 576 bf16 values per cached token
inline constexpr int kMlaBlockTokens = 64;                      // tokens per cache page (FlashMLA's page size)

// All pointers are device pointers, owned by the caller; bf16 values are passed as their bit patterns
// (uint16_t) so that plain C++ code can include this header. Nothing is allocated by the launchers.
struct MlaDecodeParams {
  int batch = 0;                   // B sequences, one query token each
  int num_heads = 0;               // H query heads (128 for V3 on one GPU, 16 per GPU at TP8)
  int max_blocks_per_seq = 0;      // row stride of block_table
  float scale = 0.0f;              // softmax scale (1/sqrt(qk_head_dim) * mscale², as the model computes it)
  const uint16_t* q = nullptr;          // bf16 [B, H, 576], contiguous: q_latent (absorbed) | q_rope (roped)
  const uint16_t* kv_cache = nullptr;   // bf16 [num_blocks, 64, 576], contiguous: latent | rope key
  const int32_t* block_table = nullptr;   // [B, max_blocks_per_seq]; entries past ceil(ctx/64) are never read
  const int32_t* context_lens = nullptr;  // [B] tokens each query attends to (position + 1), 0 <= ctx <= 64*max_blocks
  uint16_t* out = nullptr;              // bf16 [B, H, 512], written entirely (zeros where ctx == 0)
  // Split-KV (flash-decoding): num_splits > 1 splits each sequence's pages into that many contiguous ranges,
  // computed by separate CTAs and merged by a combine kernel through this float workspace.
  int num_splits = 1;                   // >= 1; see mla_decode_num_splits()
  float* workspace = nullptr;           // mla_decode_workspace_floats() floats when num_splits > 1, else unused
  int heads_per_cta = 0;                // 0 = automatic; else 16, 32 or 64 (must divide H); the fast kernel only
  // > 0: split s covers pages [s * split_pages, (s + 1) * split_pages) of every sequence, whatever the batch
  // (num_splits * split_pages >= max_blocks_per_seq: mla_decode_invariant_splits); a row's result is then bit for
  // bit the same in any batch and with any num_splits (the combine skips empty splits, and with one split it adds
  // the split's output times 1). 0: each sequence's own pages cut into num_splits ranges (faster; a row's sums then
  // depend on num_splits, which depends on the batch).
  int split_pages = 0;
  // Kernel version of the fast path: 0 = automatic (v2 with 2 warps per 16 heads when 64 heads/CTA are used,
  // else v1); 1 = v1 (Q and K from shared memory); 2 = v2, 4 warps per 16 heads (512 threads); 3 = v2, 2 warps
  // per 16 heads (256 threads). v2 keeps Q in registers and needs 64 heads per CTA (H % 64 == 0, heads_per_cta
  // 0 or 64).
  int kernel_version = 0;
  // Partial outputs the combine kernel loads together per thread before adding them (in split order, so the sums
  // are the same for any value): 0 = automatic (32 past 16 splits, else kMlaCombineLoads), else 8, 16 or 32. More
  // loads in flight cut the combine's round trips to L2 when there are many splits (batch 1: 32 to 64 splits).
  int combine_loads = 0;
  cudaStream_t stream = nullptr;
};

// Floats of workspace run_mla_decode needs: B * H * num_splits * (512 + 1); 0 when num_splits == 1.
size_t mla_decode_workspace_floats(int batch, int num_heads, int num_splits);

// The split count the fast kernel should use so that batch x head-blocks x splits fills `num_sms`
// multiprocessors once: 1 when the grid already nearly fills them (batch x head-blocks >= 0.9 x num_sms; measured
// on an H200 at batch 128, H=16, 128 CTAs on 132 SMs: 1 split 158.5 us vs 3 splits 180.5 us at ctx 4096), else
// about one wave of CTAs (one CTA an SM fits), splits of at least `min_pages_per_split` pages of `max_context`,
// at most 64 splits.
int mla_decode_num_splits(int batch, int num_heads, int max_context, int num_sms, int min_pages_per_split = 2);
inline constexpr int kMlaCombineLoads = 8;

// The batch-invariant split: kMlaInvariantSplitPages pages per split (512 keys), and the splits that cover
// `max_context` keys (at least 1).
inline constexpr int kMlaInvariantSplitPages = 8;
int mla_decode_invariant_splits(int max_context);

// The fast kernel: tensor cores (mma.sync m16n8k16 bf16, f32 accumulation), online softmax in f32, each page
// of a sequence's cache read once per CTA for the 16/32/64 heads of that CTA, double-buffered with cp.async.
// REQUIRES: H % 16 == 0; the pointers as documented above. Returns cudaErrorInvalidValue on bad parameters,
// else the launch's error. Asynchronous on params.stream; no host synchronization.
cudaError_t run_mla_decode(const MlaDecodeParams& params);

// The simple kernel: one CTA per (sequence, head), f32 CUDA-core math, scores in shared memory. Slow; the
// on-GPU reference for the fast one. REQUIRES: 64 * max_blocks_per_seq * 4 bytes fit in shared memory.
// Ignores num_splits, workspace and heads_per_cta.
cudaError_t run_mla_decode_reference(const MlaDecodeParams& params);

}  // namespace deepinfer::kernels::cuda
