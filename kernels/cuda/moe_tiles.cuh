// The tile -> (expert, rows) map of the grouped expert GEMMs over many rows per expert (moe_grouped_tiled.cu,
// moe_grouped_wgmma.cu; private to kernels/cuda). Rows are sorted by expert (DeepGEMM's "contiguous grouped" layout
// without padding); each expert's range is cut into kRows-row tiles, the last one partial. The tile count is at most
// ceil(P / kRows) + min(E, P); a grid sized by that bound has CTAs past the real count, which find_moe_tile tells
// by expert < 0.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

namespace deepinfer::kernels::cuda {

struct MoeTile {
  int expert = -1;
  int row_begin = 0, rows = 0;  // the tile's rows of x / y
};

// Which expert and rows row-tile `tile` serves: the experts' tile counts ceil(count / kRows) scanned in rounds of
// kThreads. Also checks the offsets (a decreasing pair traps). Contains __syncthreads: every thread of the CTA
// (kThreads of them) calls it; the result is the same in every thread.
template <int kRows, int kThreads>
__device__ MoeTile find_moe_tile(const int32_t* offsets, int num_experts, int tile) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ MoeTile job;
  if (threadIdx.x == 0) job = MoeTile{};
  __syncthreads();
  int carry = 0;  // tiles of the experts before this round (the same in every thread)
  for (int base = 0; base < num_experts; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    int tiles = 0, begin = 0, end = 0;
    if (e < num_experts) {
      begin = offsets[e];
      end = offsets[e + 1];
      if (end < begin) __trap();  // offsets must not decrease
      tiles = (end - begin + kRows - 1) / kRows;
    }
    int before = 0, total = 0;
    Scan(scan).ExclusiveSum(tiles, before, total);
    const int first = carry + before;
    if (tiles > 0 && tile >= first && tile < first + tiles) {
      const int row_begin = begin + (tile - first) * kRows;
      job = MoeTile{e, row_begin, min(kRows, end - row_begin)};
    }
    carry += total;
    __syncthreads();  // job published; scan storage free for the next round
    if (job.expert >= 0 || carry > tile) break;
  }
  const MoeTile found = job;
  return found;
}

// The tile of CTA row `tile`, after the checks every tiled grouped GEMM makes: offsets[0] == 0 and offsets[E] == rows
// (else some rows of y would be left unwritten), and the tile inside [0, rows). A violation traps. Every thread of
// the CTA calls it (find_moe_tile's barriers).
template <int kRows, int kThreads>
__device__ MoeTile checked_moe_tile(const int32_t* offsets, int num_experts, int rows, int tile) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && (offsets[0] != 0 || offsets[num_experts] != rows))
    __trap();
  const MoeTile job = find_moe_tile<kRows, kThreads>(offsets, num_experts, tile);
  if (job.expert >= 0 && (job.row_begin < 0 || job.row_begin + job.rows > rows)) __trap();
  return job;
}

// Byte offset of 16-byte chunk c of row r in a shared tile of `row_bytes` per row, the chunks XOR-swizzled by r % 8
// (the 8 row addresses of an ldmatrix hit 8 bank groups; with 128-byte rows in a 1,024-byte aligned tile it is
// PTX's 128-byte swizzle, the layout wgmma's descriptors read).
__device__ __forceinline__ uint32_t swizzle_chunk(int r, int c, int row_bytes) {
  return static_cast<uint32_t>(r * row_bytes + ((c ^ (r & 7)) << 4));
}

// y[n], y[n + 1] of one bf16 output row (n < n_total; n + 1 may be past it): one 4-byte store when n_total is even
// (then n, n + 1 is 4-byte aligned: n is even, and the row starts at a multiple of n_total), else one or two 2-byte.
__device__ __forceinline__ void store_bf16_pair(__nv_bfloat16* row, int64_t n, int64_t n_total, float v0, float v1) {
  if (n_total % 2 == 0 && n + 1 < n_total) {
    *reinterpret_cast<__nv_bfloat162*>(row + n) = __floats2bfloat162_rn(v0, v1);
  } else {
    if (n < n_total) row[n] = __float2bfloat16(v0);
    if (n + 1 < n_total) row[n + 1] = __float2bfloat16(v1);
  }
}

}  // namespace deepinfer::kernels::cuda
