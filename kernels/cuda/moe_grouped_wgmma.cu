// Grouped expert GEMM for tens to hundreds of rows per expert (prefill, chunks) on Hopper's warpgroup MMA: one launch
// for every expert's rows, tiles of 128 rows x 128 or 256 columns, the tile -> (expert, rows) map computed on the
// device from the offsets (moe_tiles.cuh). Contract in include/deepinfer/kernels/cuda/moe_grouped.h
// (run_moe_grouped_gemm_wgmma).
//
// Why. The mma.sync tiled kernel (moe_grouped_tiled.cu) reaches ~210 TFLOPS at large M, a quarter of the bf16 peak,
// so per-expert cuBLAS GEMMs (with a host synchronization per layer and one launch per expert) stayed faster past
// 256 rows per expert. wgmma reads both operands from shared memory itself: no ldmatrix, no fragment registers, and
// one instruction per 64 x N x 16 product instead of N / 2 mma.sync per warp.
//   - 256 threads = two warpgroups, each owning 64 rows of the tile: per k16 step one wgmma m64nNk16 each.
//   - cp.async fills a ring of kStages stages (5 at 128 columns, 4 at 256), kStages - 2 ahead of the MMAs, each stage
//     64 of K (FP8: 128): the tile's x rows and weight rows, 128 bytes per row, 128-byte swizzled (wgmma.cuh),
//     partial tiles and K past the end zero-filled.
//   - One batch of wgmma in flight while the next is issued (wgmma_wait<1>); a stage is refilled two iterations
//     after its MMAs were issued, when every warpgroup has waited for them and passed the barrier.
//   - FP8 weights (128 columns per tile): the activations come quantized per 1 x 128 (run_act_quant: e4m3 values and
//     a scale per row and K group), a stage is one 128-wide K group, four wgmma m64n128k32 e4m3 sum it in float, and
//     the partial sums are added scaled by the row's and the weight block's scales (DeepGEMM's promotion per K
//     group; the semantics of fp8_gemm in gemm.h).
//   - Few rows per expert (a 512-token chunk of V3: ~16): the operands swapped, as TensorRT-LLM and DeepGEMM do at
//     small M. A tile is 128 weight rows (output columns: one FP8 scale block) x 32 or 64 tokens, each warpgroup 64
//     weight rows as wgmma's M and the tokens as its N (m64n32 / m64n64), so an MMA multiplies no rows past the
//     expert's instead of 128 - 16 of 128; 20 or 24 KB a stage, two CTAs an SM. The output is the transpose of the
//     accumulators: each thread stores its bf16 values one by one (the output is ~1% of the weights' bytes).
#include <cuda_bf16.h>

#include <cstdint>

#include "deepinfer/kernels/cuda/moe_grouped.h"
#include "mma_util.cuh"
#include "moe_tiles.cuh"
#include "wgmma.cuh"

namespace deepinfer::kernels::cuda {
namespace {

constexpr int kBM = 128;      // rows (token copies) per tile: two warpgroups of 64
constexpr int kThreads = 256;
constexpr int kRowBytes = 128;  // bytes per row and stage: 64 bf16 or 128 e4m3 of K (one 128-byte swizzled row)

template <int kBN, bool kFp8 = false>
struct Tile {
  static constexpr int kBK = kFp8 ? 128 : 64;  // K per stage
  static constexpr int kStages = kBN == 256 ? 4 : 5;
  static constexpr int kXBytes = kBM * kRowBytes;  // 16 KB
  static constexpr int kWBytes = kBN * kRowBytes;  // 16 or 32 KB
  static constexpr int kStageBytes = kXBytes + kWBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment to 1,024 bytes
  static constexpr int kAccRegs = kBN / 2;
  static_assert(kStageBytes % 1024 == 0 && kXBytes % 1024 == 0, "tiles must stay 1,024-byte aligned");
};

struct Operands {
  const char* x = nullptr;  // the tile's first x row
  int x_rows = 0;           // rows of the tile (the rest are zero-filled)
  const char* w = nullptr;  // the expert's matrix, row n_block
  int w_rows = 0;           // weight rows (output columns) of the tile inside N
  int64_t w_ld_bytes = 0;
  int k = 0;
};

// The tile's operands for expert job.expert: its x rows (the FP8 copy when kFp8) and the weight block at row n_block
// of the expert's matrix, w_rows_max rows at most (both kernels' tiles).
template <bool kFp8>
__device__ __forceinline__ Operands tile_operands(const MoeGroupedGemmParams& p, const MoeTile& job, int64_t n_block,
                                                  int w_rows_max) {
  constexpr int kElems = kFp8 ? 1 : 2;  // bytes per element
  Operands o;
  o.x = kFp8 ? reinterpret_cast<const char*>(p.x_fp8) + static_cast<int64_t>(job.row_begin) * p.k
             : reinterpret_cast<const char*>(p.x + static_cast<int64_t>(job.row_begin) * p.k);
  o.x_rows = job.rows;
  o.w_ld_bytes = p.w_ld * kElems;
  o.w = static_cast<const char*>(p.w) + p.w_matrix_stride * job.expert * kElems + n_block * o.w_ld_bytes;
  o.w_rows = static_cast<int>(min(static_cast<int64_t>(w_rows_max), p.n - n_block));
  o.k = static_cast<int>(p.k);
  return o;
}

// kRows rows of 128 bytes of K from k0 on (64 bf16 or 128 e4m3) into `dst`, 128-byte swizzled, rows past `valid`
// and K past the end zero-filled: the rows at `src` + r * ld_bytes. Both operands of both kernels' stages.
template <int kRows, bool kFp8>
__device__ __forceinline__ void load_rows(uint32_t dst, const char* src, int64_t ld_bytes, int valid, int k_end,
                                          int k0) {
  constexpr int kChunks = kRowBytes / 16, kElems = kFp8 ? 1 : 2;  // 16-byte chunks a row; bytes per element
  constexpr int kAll = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kAll + kThreads - 1) / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    if (kAll % kThreads != 0 && idx >= kAll) break;
    const int r = idx / kChunks, c = idx % kChunks;
    const int k = k0 + c * 16 / kElems;  // a chunk is wholly inside or outside K (k % 8; FP8: k % 128)
    const bool ok = r < valid && k < k_end;
    const char* from = ok ? src + static_cast<int64_t>(r) * ld_bytes + static_cast<int64_t>(k) * kElems : src;
    cp_async_16(dst + swizzle_chunk(r, c, kRowBytes), from, ok ? 16 : 0);
  }
}

// Stage kt: the tile's kBM x rows, then its kBN weight rows.
template <int kBN, bool kFp8>
__device__ __forceinline__ void load_stage(uint32_t stage, const Operands& o, int kt) {
  constexpr int kElems = kFp8 ? 1 : 2;
  const int k0 = kt * Tile<kBN, kFp8>::kBK;
  load_rows<kBM, kFp8>(stage, o.x, static_cast<int64_t>(o.k) * kElems, o.x_rows, o.k, k0);
  load_rows<kBN, kFp8>(stage + Tile<kBN, kFp8>::kXBytes, o.w, o.w_ld_bytes, o.w_rows, o.k, k0);
}

template <int kBN, bool kFp8>
__device__ __forceinline__ void multiply_stage(float (&acc)[Tile<kBN>::kAccRegs], uint32_t stage, int warpgroup) {
  const uint32_t a = stage + static_cast<uint32_t>(warpgroup) * 64 * kRowBytes;  // this warpgroup's 64 rows
  const uint32_t b = stage + Tile<kBN, kFp8>::kXBytes;
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k16 (bf16) or k32 (e4m3) steps: 32 bytes of each 128-byte row
    const uint64_t da = wgmma_descriptor(a + 32 * s), db = wgmma_descriptor(b + 32 * s);
    if constexpr (kFp8) {
      static_assert(kBN == 128, "FP8 tiles are one 128-column scale block wide");
      wgmma_m64n128k32_e4m3(acc, da, db);
    } else if constexpr (kBN == 256) {
      wgmma_m64n256k16_bf16(acc, da, db);
    } else {
      wgmma_m64n128k16_bf16(acc, da, db);
    }
  }
}

template <int kBN, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) moe_grouped_wgmma_kernel(const MoeGroupedGemmParams p) {
  using T = Tile<kBN, kFp8>;
  constexpr int kStages = T::kStages;
  const int num_experts = static_cast<int>(p.num_experts), rows = static_cast<int>(p.rows);
  const MoeTile job = checked_moe_tile<kBM, kThreads>(p.offsets, num_experts, rows, static_cast<int>(blockIdx.y));
  if (job.expert < 0) return;  // past the real tile count (uniform over the CTA)

  extern __shared__ __align__(1024) char smem[];
  const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int64_t n_block = static_cast<int64_t>(blockIdx.x) * kBN;

  const Operands o = tile_operands<kFp8>(p, job, n_block, kBN);

  float acc[T::kAccRegs];
#pragma unroll
  for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.0f;

  // FP8: this thread's rows (16 warp + g, + 8 of its warpgroup's 64) for the activation scales; the weight block's
  // scales along K.
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = (static_cast<int>(threadIdx.x) / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const int my_rows[2] = {warpgroup * 64 + warp * 16 + g, warpgroup * 64 + warp * 16 + g + 8};
  const float* w_scales = nullptr;
  if constexpr (kFp8)
    w_scales = p.w_scale + static_cast<int64_t>(job.expert) * p.w_scale_matrix_stride + n_block / 128 * p.w_scale_ld;

  // The ring: stage kt is loaded kStages - 2 iterations ahead, into the slot whose MMAs (kt - 2) every warpgroup
  // has waited for before the barrier of iteration kt.
  const int k_tiles = (o.k + T::kBK - 1) / T::kBK;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_tiles) load_stage<kBN, kFp8>(smem_base + s * T::kStageBytes, o, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 3>();  // this thread's copies of stage kt landed
    fence_async_shared();          // ... and are visible to wgmma (the async proxy)
    __syncthreads();               // every thread's; and MMAs kt - 2 are done in both warpgroups
    const int next = kt + kStages - 2;
    if (next < k_tiles) load_stage<kBN, kFp8>(smem_base + (next % kStages) * T::kStageBytes, o, next);
    cp_async_commit();
    if constexpr (kFp8) {
      // This K group's sums, then acc += sums · row scale · block scale (the scales of rows past the tile: 0).
      float part[T::kAccRegs];
#pragma unroll
      for (int i = 0; i < T::kAccRegs; ++i) part[i] = 0.0f;
      wgmma_fence();
      multiply_stage<kBN, true>(part, smem_base + (kt % kStages) * T::kStageBytes, warpgroup);
      wgmma_commit();
      const float w_scale = w_scales[kt];
      float scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        scale[h] = my_rows[h] < job.rows ? p.x_scale[static_cast<int64_t>(kt) * p.rows + job.row_begin + my_rows[h]] *
                                               w_scale
                                         : 0.0f;
      wgmma_wait<0>();
      wgmma_fence_operands(part);
#pragma unroll
      for (int i = 0; i < T::kAccRegs; ++i) acc[i] = fmaf(part[i], scale[(i / 2) % 2], acc[i]);
    } else {
      wgmma_fence();
      multiply_stage<kBN, false>(acc, smem_base + (kt % kStages) * T::kStageBytes, warpgroup);
      wgmma_commit();
      wgmma_wait<1>();  // MMAs kt - 1 done: their slot may be refilled after the next barrier
      wgmma_fence_operands(acc);
    }
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  cp_async_wait<0>();

  // Accumulator layout (wgmma.cuh): acc[4j], acc[4j + 1] at row 16w + g, columns 8j + 2t, +1; acc[4j + 2..3] at
  // row 16w + g + 8.
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warpgroup * 64 + warp * 16 + g + half * 8;
    if (r >= job.rows) continue;
    __nv_bfloat16* row = y + static_cast<int64_t>(job.row_begin + r) * p.n;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
      store_bf16_pair(row, n_block + 8 * j + 2 * t, p.n, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
  }
}

// The swapped tiles: 128 weight rows x kBT tokens, 128 bytes of K a stage (64 bf16 or 128 e4m3).
template <int kBT>
struct SwapTile {
  static constexpr int kBW = 128;                    // weight rows (output columns) per tile: one FP8 scale block
  static constexpr int kStages = kBT == 32 ? 5 : 4;  // two CTAs an SM (227 KB)
  static constexpr int kWBytes = kBW * kRowBytes;    // 16 KB
  static constexpr int kXBytes = kBT * kRowBytes;    // 4 or 8 KB
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;
  static constexpr int kAccRegs = kBT / 2;
  static_assert(kStageBytes % 1024 == 0 && kWBytes % 1024 == 0, "tiles must stay 1,024-byte aligned");
  static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs an SM");
};

// Stage kt of the swapped tile: the weight block's 128 rows, then the tokens' kBT rows.
template <int kBT, bool kFp8>
__device__ __forceinline__ void swap_load_stage(uint32_t stage, const Operands& o, int kt) {
  constexpr int kElems = kFp8 ? 1 : 2;
  const int k0 = kt * (kRowBytes / kElems);
  load_rows<SwapTile<kBT>::kBW, kFp8>(stage, o.w, o.w_ld_bytes, o.w_rows, o.k, k0);
  load_rows<kBT, kFp8>(stage + SwapTile<kBT>::kWBytes, o.x, static_cast<int64_t>(o.k) * kElems, o.x_rows, o.k, k0);
}

template <int kBT, bool kFp8>
__device__ __forceinline__ void swap_multiply_stage(float (&acc)[SwapTile<kBT>::kAccRegs], uint32_t stage,
                                                    int warpgroup) {
  const uint32_t a = stage + static_cast<uint32_t>(warpgroup) * 64 * kRowBytes;  // this warpgroup's 64 weight rows
  const uint32_t b = stage + SwapTile<kBT>::kWBytes;                             // the tokens
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k16 (bf16) or k32 (e4m3) steps: 32 bytes of each 128-byte row
    const uint64_t da = wgmma_descriptor(a + 32 * s), db = wgmma_descriptor(b + 32 * s);
    if constexpr (kFp8 && kBT == 32)
      wgmma_m64n32k32_e4m3(acc, da, db);
    else if constexpr (kFp8)
      wgmma_m64n64k32_e4m3(acc, da, db);
    else if constexpr (kBT == 32)
      wgmma_m64n32k16_bf16(acc, da, db);
    else
      wgmma_m64n64k16_bf16(acc, da, db);
  }
}

// Accumulator i of a thread (wgmma.cuh's layout, rows = weight rows, columns = tokens): weight row
// 16 warp + g + 8 ((i / 2) % 2) of its warpgroup's 64, token 8 (i / 4) + 2 t + i % 2.
template <int kBT, bool kFp8>
__global__ void __launch_bounds__(kThreads, 2) moe_grouped_wgmma_swap_kernel(const MoeGroupedGemmParams p) {
  using T = SwapTile<kBT>;
  constexpr int kStages = T::kStages;
  const int num_experts = static_cast<int>(p.num_experts), rows = static_cast<int>(p.rows);
  const MoeTile job = checked_moe_tile<kBT, kThreads>(p.offsets, num_experts, rows, static_cast<int>(blockIdx.y));
  if (job.expert < 0) return;  // past the real tile count (uniform over the CTA)

  extern __shared__ __align__(1024) char smem[];
  const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int64_t n_block = static_cast<int64_t>(blockIdx.x) * T::kBW;

  constexpr int kElems = kFp8 ? 1 : 2;  // bytes per element
  const Operands o = tile_operands<kFp8>(p, job, n_block, T::kBW);
  const float* w_scales = nullptr;
  if constexpr (kFp8)
    w_scales = p.w_scale + static_cast<int64_t>(job.expert) * p.w_scale_matrix_stride + n_block / 128 * p.w_scale_ld;

  const int lane = static_cast<int>(threadIdx.x) % 32, warp = (static_cast<int>(threadIdx.x) / 32) % 4;
  const int g = lane / 4, t = lane % 4;

  float acc[T::kAccRegs];
#pragma unroll
  for (int i = 0; i < T::kAccRegs; ++i) acc[i] = 0.0f;

  // The ring as in moe_grouped_wgmma_kernel: stage kt loaded kStages - 2 iterations ahead.
  const int k_tiles = (o.k + kRowBytes / kElems - 1) / (kRowBytes / kElems);
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < k_tiles) swap_load_stage<kBT, kFp8>(smem_base + s * T::kStageBytes, o, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 3>();
    fence_async_shared();
    __syncthreads();  // stage kt landed for every thread; the MMAs of kt - 2 done in both warpgroups
    const int next = kt + kStages - 2;
    if (next < k_tiles) swap_load_stage<kBT, kFp8>(smem_base + (next % kStages) * T::kStageBytes, o, next);
    cp_async_commit();
    if constexpr (kFp8) {
      // This K group's sums, then acc += sums · token scale · block scale (0 past the tile's tokens).
      float part[T::kAccRegs];
#pragma unroll
      for (int i = 0; i < T::kAccRegs; ++i) part[i] = 0.0f;
      wgmma_fence();
      swap_multiply_stage<kBT, true>(part, smem_base + (kt % kStages) * T::kStageBytes, warpgroup);
      wgmma_commit();
      const float w_scale = w_scales[kt];
      const float* x_scale = p.x_scale + static_cast<int64_t>(kt) * p.rows + job.row_begin;
      float scale[kBT / 4];
#pragma unroll
      for (int j = 0; j < kBT / 8; ++j)
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int token = 8 * j + 2 * t + b;
          scale[2 * j + b] = token < job.rows ? x_scale[token] * w_scale : 0.0f;
        }
      wgmma_wait<0>();
      wgmma_fence_operands(part);
#pragma unroll
      for (int i = 0; i < T::kAccRegs; ++i) acc[i] = fmaf(part[i], scale[(i / 4) * 2 + i % 2], acc[i]);
    } else {
      wgmma_fence();
      swap_multiply_stage<kBT, false>(acc, smem_base + (kt % kStages) * T::kStageBytes, warpgroup);
      wgmma_commit();
      wgmma_wait<1>();  // MMAs kt - 1 done: their slot may be refilled after the next barrier
      wgmma_fence_operands(acc);
    }
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  cp_async_wait<0>();

  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
#pragma unroll
  for (int i = 0; i < T::kAccRegs; ++i) {
    const int64_t column = n_block + warpgroup * 64 + warp * 16 + g + 8 * ((i / 2) % 2);
    const int token = 8 * (i / 4) + 2 * t + i % 2;
    if (token < job.rows && column < p.n)
      y[static_cast<int64_t>(job.row_begin + token) * p.n + column] = __float2bfloat16(acc[i]);
  }
}

// bf16: the tile width asked (wgmma_tile_n), else 256 columns when n >= 1024 (measured: bench/gpu/NOTES.md).
int bf16_tile_n(const MoeGroupedGemmParams& p) {
  if (p.wgmma_tile_n == 128 || p.wgmma_tile_n == 256) return p.wgmma_tile_n;
  return p.n >= 1024 ? 256 : 128;
}

template <int kBN, bool kFp8>
cudaError_t launch(const MoeGroupedGemmParams& p) {
  if (cudaError_t e = init_moe_grouped_gemm_wgmma(); e != cudaSuccess) return e;
  const int64_t row_tiles = moe_grouped_row_tiles(p.rows, p.num_experts, kBM);
  if (row_tiles > kMoeMaxRowTiles) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.n + kBN - 1) / kBN), static_cast<unsigned>(row_tiles));
  moe_grouped_wgmma_kernel<kBN, kFp8><<<grid, kThreads, Tile<kBN, kFp8>::kSmemBytes, p.stream>>>(p);
  return cudaGetLastError();
}

template <int kBT, bool kFp8>
cudaError_t launch_swap(const MoeGroupedGemmParams& p) {
  if (cudaError_t e = init_moe_grouped_gemm_wgmma(); e != cudaSuccess) return e;
  const int64_t row_tiles = moe_grouped_row_tiles(p.rows, p.num_experts, kBT);
  if (row_tiles > kMoeMaxRowTiles) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.n + SwapTile<kBT>::kBW - 1) / SwapTile<kBT>::kBW),
                  static_cast<unsigned>(row_tiles));
  moe_grouped_wgmma_swap_kernel<kBT, kFp8><<<grid, kThreads, SwapTile<kBT>::kSmemBytes, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t init_moe_grouped_gemm_wgmma() {
  static const cudaError_t result = [] {
    // The swapped tiles' two CTAs an SM need the largest shared-memory carveout.
    auto set_smem = [](auto kernel, int bytes) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
      return e;
    };
    cudaError_t e = cudaFuncSetAttribute(moe_grouped_wgmma_kernel<128, false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Tile<128>::kSmemBytes);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(moe_grouped_wgmma_kernel<256, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Tile<256>::kSmemBytes);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(moe_grouped_wgmma_kernel<128, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Tile<128, true>::kSmemBytes);
    if (e == cudaSuccess) e = set_smem(moe_grouped_wgmma_swap_kernel<32, true>, SwapTile<32>::kSmemBytes);
    if (e == cudaSuccess) e = set_smem(moe_grouped_wgmma_swap_kernel<64, true>, SwapTile<64>::kSmemBytes);
    if (e == cudaSuccess) e = set_smem(moe_grouped_wgmma_swap_kernel<32, false>, SwapTile<32>::kSmemBytes);
    if (e == cudaSuccess) e = set_smem(moe_grouped_wgmma_swap_kernel<64, false>, SwapTile<64>::kSmemBytes);
    return e;
  }();
  return result;
}

cudaError_t run_moe_grouped_gemm_wgmma(const MoeGroupedGemmParams& p) {
  const bool fp8 = p.format == MoeWeightFormat::kFP8;
  if (!moe_grouped_params_valid(p) || p.x_rows != nullptr || p.offsets == nullptr || p.x_ld != 0 || p.y_ld != 0 ||
      p.gated || p.y == nullptr || p.y_f32 != nullptr || p.tiled_order || reinterpret_cast<uintptr_t>(p.y) % 4 != 0 ||
      (p.wgmma_tile_n != 0 && p.wgmma_tile_n != 128 && p.wgmma_tile_n != 256) ||
      (p.wgmma_swap_tokens != 0 && p.wgmma_swap_tokens != -1 && p.wgmma_swap_tokens != 32 &&
       p.wgmma_swap_tokens != 64) ||
      (p.wgmma_swap_tokens > 0 && p.wgmma_tile_n == 256))
    return cudaErrorInvalidValue;
  // FP8: quantized activations, whole 128-wide K groups, 128-column tiles.
  if (fp8 && (p.x_fp8 == nullptr || p.x_scale == nullptr || p.k % 128 != 0 || p.wgmma_tile_n == 256 ||
              reinterpret_cast<uintptr_t>(p.x_fp8) % 16 != 0))
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const int swap = moe_wgmma_swap_tokens(p.rows, p.num_experts, fp8, p.wgmma_swap_tokens);
  if (swap == 32) return fp8 ? launch_swap<32, true>(p) : launch_swap<32, false>(p);
  if (swap == 64) return fp8 ? launch_swap<64, true>(p) : launch_swap<64, false>(p);
  if (fp8) return launch<128, true>(p);
  return bf16_tile_n(p) == 256 ? launch<256, false>(p) : launch<128, false>(p);
}

}  // namespace deepinfer::kernels::cuda
