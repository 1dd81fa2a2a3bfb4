// Generic MLA attention (any C, R, any rows per sequence). Contracts in
// include/deepinfer/kernels/cuda/mla_generic.h. The attention kernel is the online-softmax loop of
// FlashAttention (Dao et al. 2022, Algorithm 1) on CUDA cores: one CTA per (row, head), 64-key tiles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "deepinfer/kernels/cuda/mla_generic.h"

namespace deepinfer::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 64;
constexpr int kMaxEntry = 1024;                       // C + R
constexpr int kColsPerThread = kMaxEntry / kThreads;  // output columns (C <= 1024) per thread
constexpr int kBlockTokens = 64;                      // cache page size

__global__ void __launch_bounds__(kThreads) mla_generic_kernel(MlaGenericParams p) {
  __shared__ float s_q[kMaxEntry];
  __shared__ float s_p[kTileKeys];        // scores, then probabilities of the tile
  __shared__ int64_t s_entry[kTileKeys];  // element offset of each key's cache row
  const int64_t r = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t C = p.kv_lora_rank, D = p.kv_lora_rank + p.rope_dim;
  const bf16* q = reinterpret_cast<const bf16*>(p.q) + r * p.q_stride + h * D;
  const bf16* cache = reinterpret_cast<const bf16*>(p.cache);
  for (int64_t c = tid; c < D; c += kThreads) s_q[c] = __bfloat162float(q[c]);
  const int64_t ctx = p.row_context[r];
  const int32_t* table = p.block_table + static_cast<int64_t>(p.row_table[r]) * p.max_blocks;
  __syncthreads();

  float acc[kColsPerThread] = {};
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t j0 = 0; j0 < ctx; j0 += kTileKeys) {
    // Scores of the tile: warp w takes keys w, w + 8, ...; lanes split the C + R dot product.
    for (int jj = warp; jj < kTileKeys; jj += kWarps) {
      const int64_t j = j0 + jj;
      float score = -INFINITY;
      if (j < ctx) {
        if (j / kBlockTokens >= p.max_blocks) __trap();
        const int64_t slot = static_cast<int64_t>(table[j / kBlockTokens]) * kBlockTokens + j % kBlockTokens;
        if (slot < 0 || slot >= p.num_slots) __trap();
        const bf16* kv = cache + slot * D;
        float dot = 0.0f;
        for (int64_t c = lane; c < D; c += 32) dot += s_q[c] * __bfloat162float(kv[c]);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        score = dot * p.scale;
        if (lane == 0) s_entry[jj] = slot * D;
      }
      if (lane == 0) s_p[jj] = score;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int jj = 0; jj < kTileKeys; ++jj) tile_max = fmaxf(tile_max, s_p[jj]);
    const float new_max = fmaxf(running_max, tile_max);    // finite: the tile has at least one key
    const float correction = expf(running_max - new_max);  // 0 on the first tile (running_max = -inf)
    __syncthreads();  // every thread has read the scores before they turn into probabilities
    if (tid < kTileKeys) s_p[tid] = expf(s_p[tid] - new_max);  // exp(-inf) = 0 past the context
    __syncthreads();
    float tile_sum = 0.0f;
    for (int jj = 0; jj < kTileKeys; ++jj) tile_sum += s_p[jj];
    running_sum = running_sum * correction + tile_sum;
    running_max = new_max;
    const int keys = static_cast<int>(ctx - j0 < kTileKeys ? ctx - j0 : kTileKeys);
#pragma unroll
    for (int i = 0; i < kColsPerThread; ++i) {
      const int64_t c = tid + i * kThreads;
      if (c >= C) break;
      float a = acc[i] * correction;
      for (int jj = 0; jj < keys; ++jj) a += s_p[jj] * __bfloat162float(cache[s_entry[jj] + c]);
      acc[i] = a;
    }
    __syncthreads();  // s_p and s_entry are rewritten by the next tile
  }
  bf16* out = reinterpret_cast<bf16*>(p.out) + r * p.out_stride + h * C;
  const float inv = running_sum > 0.0f ? 1.0f / running_sum : 0.0f;
#pragma unroll
  for (int i = 0; i < kColsPerThread; ++i) {
    const int64_t c = tid + i * kThreads;
    if (c < C) out[c] = __float2bfloat16(acc[i] * inv);
  }
}

}  // namespace

cudaError_t run_mla_generic(const MlaGenericParams& p) {
  const int64_t D = p.kv_lora_rank + p.rope_dim;
  if (p.rows < 0 || p.num_heads <= 0 || p.num_heads > 65535 || p.kv_lora_rank <= 0 || p.rope_dim < 0 || D > kMaxEntry ||
      p.q_stride < p.num_heads * D || p.out_stride < p.num_heads * p.kv_lora_rank || p.max_blocks <= 0 ||
      p.rows > 0x7fffffff)
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_heads));
  mla_generic_kernel<<<grid, kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
