// The tile -> (expert, rows) map of the grouped expert GEMMs over many rows per expert (moe_grouped_tiled.cu,
// moe_grouped_wgmma.cu; private to kernels/cuda). Rows are sorted by expert (DeepGEMM's "contiguous grouped" layout
// without padding); each expert's range is cut into kRows-row tiles, the last one partial. The tile count is at most
// ceil(P / kRows) + min(E, P); a grid sized by that bound has CTAs past the real count, which find_moe_tile tells
// by expert < 0.
#pragma once

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

}  // namespace deepinfer::kernels::cuda
