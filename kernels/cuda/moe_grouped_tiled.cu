// Grouped expert GEMM for many rows per expert (prefill, chunks over a cached prefix, large decode batches): one
// launch for every expert's rows, tiles of 64 rows x 128 columns, the tile -> (expert, rows) map computed on the
// device from the offsets. Contract in include/deepinfer/kernels/cuda/moe_grouped.h (run_moe_grouped_gemm_tiled).
//
// Why this shape. The per-expert cuBLAS loop costs one launch (and its ramp-up and tail) per expert and projection,
// plus a host synchronization per layer for the offsets: V2-Lite's 512-token chunk (48 rows per expert) spent 46 ms
// of a 58 ms step there. The layout is DeepGEMM's "contiguous grouped" one without padding: rows sorted by expert,
// each expert's range cut into 64-row tiles (the last one partial, its missing rows zero-filled and not stored);
// grid.y covers an upper bound of the tile count (ceil(P / 64) + min(E, P)), CTAs past the real count return.
//   - 8 warps in 2 (rows) x 4 (columns), a warp owning 32 x 32 of the tile: per k16 step two ldmatrix.x4 for x, two
//     for the weights (bf16), 8 mma.sync m16n8k16.
//   - 3-stage cp.async pipeline; shared rows of 128 (256) bytes with their 16-byte chunks XOR-swizzled by row % 8,
//     so the 8 row addresses of an ldmatrix hit 8 different bank groups.
//   - FP8 weights: a stage is one 128-wide K group; the e4m3 bytes are widened exactly to bf16 when the fragments
//     are read from shared memory (two bytes per register), the stage's products summed in float and multiplied by
//     the block scale (the tile's 128 columns are one scale block), as the streaming kernel does.
//   - grid.x runs over the column tiles of one row tile first: the CTAs in flight share an expert's weights in L2.
#include <cuda_bf16.h>

#include <cstdint>

#include "deepinfer/kernels/cuda/moe_grouped.h"
#include "mma_util.cuh"
#include "moe_tiles.cuh"

namespace deepinfer::kernels::cuda {
namespace {

constexpr int kBM = 64, kBN = 128;     // tile: rows (token copies) x output columns
constexpr int kThreads = 256;          // 8 warps: 2 along rows x 4 along columns
constexpr int kStages = 3;
constexpr int kWRowBytes = 128;        // weight bytes per row and stage (64 bf16 or 128 e4m3)
constexpr int kFp8Group = 128;

template <bool kFp8>
struct Tile {
  static constexpr int kBK = kFp8 ? 128 : 64;  // K per stage
  static constexpr int kXRowBytes = kBK * 2;   // x is bf16
  static constexpr int kXBytes = kBM * kXRowBytes;
  static constexpr int kWBytes = kBN * kWRowBytes;
  static constexpr int kStageBytes = kXBytes + kWBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

template <bool kFp8>
struct Operands {
  const char* x = nullptr;  // the tile's first x row (bytes)
  int x_rows = 0;           // rows of the tile (the rest are zero-filled)
  const char* w = nullptr;  // the expert's matrix, row n_block (bytes)
  int w_rows = 0;           // columns of the tile inside N
  int64_t w_ld_bytes = 0;
  int64_t x_ld = 0;         // elements between x rows
  int k = 0;
};

// Stage `stage` <- K range [kt * BK, kt * BK + BK) of the tile's x rows and weight rows.
template <bool kFp8>
__device__ __forceinline__ void load_stage(uint32_t stage, const Operands<kFp8>& o, int kt) {
  using T = Tile<kFp8>;
  constexpr int kXChunks = T::kXRowBytes / 16, kWChunks = kWRowBytes / 16;
  const int k0 = kt * T::kBK;
#pragma unroll
  for (int i = 0; i < kBM * kXChunks / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kXChunks, c = idx % kXChunks;
    const int k = k0 + c * 8;  // k % 8 == 0: a chunk is wholly inside or outside K
    const bool ok = r < o.x_rows && k < o.k;
    const char* src = ok ? o.x + (static_cast<int64_t>(r) * o.x_ld + k) * 2 : o.x;
    cp_async_16(stage + swizzle_chunk(r, c, T::kXRowBytes), src, ok ? 16 : 0);
  }
#pragma unroll
  for (int i = 0; i < kBN * kWChunks / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kWChunks, c = idx % kWChunks;
    int bytes = 0;
    int64_t offset = 0;
    if (r < o.w_rows) {
      if constexpr (kFp8) {
        const int k = k0 + c * 16;  // e4m3: a chunk may straddle K (k % 16 == 8); bytes past K are zero-filled
        bytes = max(0, min(16, o.k - k));
        offset = static_cast<int64_t>(r) * o.w_ld_bytes + k;
      } else {
        const int k = k0 + c * 8;
        bytes = k < o.k ? 16 : 0;
        offset = static_cast<int64_t>(r) * o.w_ld_bytes + static_cast<int64_t>(k) * 2;
      }
    }
    cp_async_16(stage + T::kXBytes + swizzle_chunk(r, c, kWRowBytes), bytes > 0 ? o.w + offset : o.w, bytes);
  }
}

// acc[mi][ni] += x rows (warp_m * 32 + mi * 16 ..) · weight rows (warp_n * 32 + ni * 8 ..) over one stage.
template <bool kFp8>
__device__ __forceinline__ void multiply_stage(float (&acc)[2][4][4], uint32_t stage, const char* stage_ptr, int warp_m,
                                               int warp_n, int lane) {
  using T = Tile<kFp8>;
  const uint32_t xs = stage, ws = stage + T::kXBytes;
#pragma unroll
  for (int ks = 0; ks < T::kBK / 16; ++ks) {
    uint32_t a[2][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = warp_m * 32 + mi * 16 + (lane % 16);
      ldmatrix_x4(a[mi], xs + swizzle_chunk(r, ks * 2 + lane / 16, T::kXRowBytes));
    }
    uint32_t b[4][2];
    if constexpr (!kFp8) {
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int r = warp_n * 32 + nj * 16 + (lane % 8) + (lane / 16) * 8;
        uint32_t q[4];
        ldmatrix_x4(q, ws + swizzle_chunk(r, ks * 2 + (lane / 8) % 2, kWRowBytes));
        b[2 * nj][0] = q[0];
        b[2 * nj][1] = q[1];
        b[2 * nj + 1][0] = q[2];
        b[2 * nj + 1][1] = q[3];
      }
    } else {
      // B fragment of m16n8k16: lane (g, t) holds k = 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1) of column g: two bytes each
      // of weight row g, inside 16-byte chunk ks.
      const int g = lane / 4, t = lane % 4;
      const char* wp = stage_ptr + T::kXBytes;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int r = warp_n * 32 + ni * 8 + g;
        const char* chunk = wp + swizzle_chunk(r, ks, kWRowBytes);
        const uint32_t lo = *reinterpret_cast<const uint16_t*>(chunk + 2 * t);
        const uint32_t hi = *reinterpret_cast<const uint16_t*>(chunk + 2 * t + 8);
        b[ni][0] = e4m3x2_to_bf16x2(lo);
        b[ni][1] = e4m3x2_to_bf16x2(hi);
      }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[ni][0], b[ni][1]);
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, kFp8 ? 1 : 2) moe_grouped_tiled_kernel(const MoeGroupedGemmParams p) {
  using T = Tile<kFp8>;
  const int num_experts = static_cast<int>(p.num_experts), rows = static_cast<int>(p.rows);
  // offsets == null (one matrix, E == 1): row tile blockIdx.y of all the rows.
  const MoeTile job =
      p.offsets != nullptr
          ? checked_moe_tile<kBM, kThreads>(p.offsets, num_experts, rows, static_cast<int>(blockIdx.y))
          : MoeTile{static_cast<int>(blockIdx.y) * kBM < rows ? 0 : -1, static_cast<int>(blockIdx.y) * kBM,
                    min(kBM, rows - static_cast<int>(blockIdx.y) * kBM)};
  if (job.expert < 0) return;  // past the real tile count (uniform over the CTA)
  const int64_t x_ld = p.x_ld > 0 ? p.x_ld : p.k, y_ld = p.y_ld > 0 ? p.y_ld : p.n;

  extern __shared__ __align__(128) char smem[];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_m = warp / 4, warp_n = warp % 4;
  const int64_t n_block = static_cast<int64_t>(blockIdx.x) * kBN;
  constexpr int kBytes = kFp8 ? 1 : 2;

  Operands<kFp8> o;
  o.x = reinterpret_cast<const char*>(p.x + static_cast<int64_t>(job.row_begin) * x_ld);
  o.x_ld = x_ld;
  o.x_rows = job.rows;
  o.w_ld_bytes = p.w_ld * kBytes;
  o.w = static_cast<const char*>(p.w) + (static_cast<int64_t>(job.expert) * p.w_matrix_stride) * kBytes +
        n_block * o.w_ld_bytes;
  o.w_rows = static_cast<int>(min(static_cast<int64_t>(kBN), p.n - n_block));
  o.k = static_cast<int>(p.k);
  const float* scales = nullptr;
  if constexpr (kFp8)
    scales = p.w_scale + static_cast<int64_t>(job.expert) * p.w_scale_matrix_stride +
             n_block / kFp8Group * p.w_scale_ld;

  float acc[2][4][4] = {};
  const int k_tiles = (o.k + T::kBK - 1) / T::kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(smem_base + s * T::kStageBytes, o, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is no longer read
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(smem_base + (next % kStages) * T::kStageBytes, o, next);
    cp_async_commit();
    const int slot = kt % kStages;
    if constexpr (kFp8) {
      float part[2][4][4] = {};
      multiply_stage<true>(part, smem_base + slot * T::kStageBytes, smem + slot * T::kStageBytes, warp_m, warp_n,
                           lane);
      const float scale = scales[kt];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[mi][ni][r] = fmaf(scale, part[mi][ni][r], acc[mi][ni][r]);
    } else {
      multiply_stage<false>(acc, smem_base + slot * T::kStageBytes, smem + slot * T::kStageBytes, warp_m, warp_n,
                            lane);
    }
  }
  cp_async_wait<0>();

  // D fragment of m16n8: c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g + 8.
  const int g = lane / 4, t = lane % 4;
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * 32 + mi * 16 + g + half * 8;
      if (r >= job.rows) continue;
      const int64_t row_at = static_cast<int64_t>(job.row_begin + r) * y_ld;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int64_t n = n_block + warp_n * 32 + ni * 8 + 2 * t;
        if (p.y_f32 != nullptr) {
          if (n < p.n) p.y_f32[row_at + n] = acc[mi][ni][2 * half];
          if (n + 1 < p.n) p.y_f32[row_at + n + 1] = acc[mi][ni][2 * half + 1];
        } else if (y_ld % 2 == 0) {
          store_bf16_pair(y + row_at, n, p.n, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
        } else {  // an odd row stride: pairs are not 4-byte aligned in every row
          if (n < p.n) y[row_at + n] = __float2bfloat16(acc[mi][ni][2 * half]);
          if (n + 1 < p.n) y[row_at + n + 1] = __float2bfloat16(acc[mi][ni][2 * half + 1]);
        }
      }
    }
}

template <bool kFp8>
cudaError_t launch(const MoeGroupedGemmParams& p) {
  using T = Tile<kFp8>;
  if (cudaError_t e = init_moe_grouped_gemm_tiled(); e != cudaSuccess) return e;
  const int64_t row_tiles = moe_grouped_row_tiles(p.rows, p.num_experts, kBM);
  if (row_tiles > kMoeMaxRowTiles) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.n + kBN - 1) / kBN), static_cast<unsigned>(row_tiles));
  moe_grouped_tiled_kernel<kFp8><<<grid, kThreads, T::kSmemBytes, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t init_moe_grouped_gemm_tiled() {
  // Once per process (thread-safe static initialization): more than 48 KB of dynamic shared memory.
  static const cudaError_t result = [] {
    cudaError_t e = cudaFuncSetAttribute(moe_grouped_tiled_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Tile<false>::kSmemBytes);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(moe_grouped_tiled_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Tile<true>::kSmemBytes);
    return e;
  }();
  return result;
}

cudaError_t run_moe_grouped_gemm_tiled(const MoeGroupedGemmParams& p) {
  if (!moe_grouped_params_valid(p) || p.x_rows != nullptr || p.gated ||
      (p.y_f32 == nullptr && reinterpret_cast<uintptr_t>(p.y) % 4 != 0))
    return cudaErrorInvalidValue;
  const bool fp8 = p.format == MoeWeightFormat::kFP8;
  if (p.rows == 0) return cudaSuccess;
  return fp8 ? launch<true>(p) : launch<false>(p);
}

}  // namespace deepinfer::kernels::cuda
