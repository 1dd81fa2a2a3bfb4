// Grouped expert GEMMs: every expert's rows times that expert's weight in one launch, with the per-expert row ranges
// read on the device, so the MoE layer needs no device-to-host copy and no stream synchronization (the per-expert
// cuBLAS loop needs both, and one launch per expert). Three kernels by rows per expert: streaming (decode: each
// weight streamed once per chunk of <= 8 rows at memory speed), tiled (64-row tiles, mma.sync) and wgmma (128-row
// tiles, Hopper's warpgroup MMA; at few rows per expert swapped tiles of 128 weight rows x 32 or 64 tokens); past
// ~500 rows per expert per-expert cuBLAS is still faster (the backend's choice: src/backend/cuda/cuda_moe.cpp).
// Checked through the backend by tests/gpu/gpu_check_backend.cpp, the kernels' variants against each other by
// tests/gpu/gpu_check_gemm.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace deepinfer::kernels::cuda {

// How the stacked expert weights are stored.
//   kBF16: bf16 [E][N][w_ld].
//   kFP8:  float8_e4m3fn [E][N][w_ld] with float32 128x128 block scales [E][ceil(N/128)][w_scale_ld] (the layout of
//          gemm.h and CudaWeight): value = e4m3 * w_scale[e][n / 128][k / 128]. The streaming and tiled kernels
//          widen the 8-bit values exactly to bf16 and multiply them with the bf16 activations (not quantized, unlike
//          act_quant + run_fp8_gemm), so the result is the exact product of the dequantized weight, rounded once to
//          bf16; the wgmma kernel takes quantized activations instead (see it below).
//          The NaN codes (S.1111.111) read as +-480 (checkpoints hold none).
enum class MoeWeightFormat : int { kBF16 = 0, kFP8 = 1 };

// For each expert e < E and each row r in [offsets[e], offsets[e+1]):
//   y[r, n] = bf16( Σ_k x[r, k] · W[e][n, k] )   for n < N, k < K, float32 accumulation.
// Rows are the token copies grouped by expert (run_moe_permute + run_moe_gather in fused_ops.h).
//
// REQUIRES (the launcher returns cudaErrorInvalidValue otherwise):
//   1 <= E <= 65535; n >= 1; k >= 1 and k % 8 == 0 (16-byte rows of x); rows >= 0;
//   x, w 16-byte aligned; kBF16: w_ld >= k, w_ld % 8 == 0, w_matrix_stride >= n * w_ld and % 8 == 0;
//   kFP8: w_ld >= round_up(k, 16), w_ld % 16 == 0, w_matrix_stride >= n * w_ld and % 16 == 0,
//         w_scale_ld >= ceil(k / 128), w_scale_matrix_stride >= ceil(n / 128) * w_scale_ld.
// Offsets (device memory, written by an earlier kernel on the stream): offsets[0] == 0, non-decreasing,
// offsets[E] == rows. Then every row of y is written exactly once. A violation traps (the stream reports an
// error) instead of computing garbage: offsets[e+1] < offsets[e], or an expert's range outside [0, rows], or
// offsets[0] != 0, or offsets[E] != rows.
// x, w, w_scale, offsets are only read; y must not overlap them. Asynchronous on params.stream; returns the launch
// error. Thread-safe (no state besides the launch).
//
// Shape of the work: CTAs of 4 warps; a warp owns 16 output columns (the M side of mma.sync m16n8k16, weights as
// A, so the <= 8 rows of a chunk are the N = 8 side) and streams those 16 weight rows with 16-byte loads; grid.y
// = min(E, rows) slots, slot j serving the j-th non-empty expert (empty experts cost nothing). When the rows are
// too few to occupy the GPU, the warps of a CTA also split K (k_split 2 or 4) and add their partial sums
// through shared memory.
struct MoeGroupedGemmParams {
  MoeWeightFormat format = MoeWeightFormat::kBF16;
  int64_t rows = 0;                  // P: rows of x and y (token copies)
  int64_t num_experts = 0;           // E
  int64_t n = 0, k = 0;              // output columns N, reduction length K
  const int32_t* offsets = nullptr;  // [E + 1] row ranges per expert; the streaming and tiled kernels take null with
                                     // num_experts 1: one matrix over all rows (a dense GEMM at a few rows)
  int64_t x_ld = 0;                  // streaming, tiled: elements between x rows (0: k); >= k, % 8 == 0
  int64_t y_ld = 0;                  // streaming, tiled: elements between y rows (0: n); >= n
  const uint16_t* x = nullptr;       // bf16 [rows, k], contiguous (with x_rows: [any rows, k])
  // run_moe_grouped_gemm only (the tiled kernel refuses it): row r of the product reads x row
  // x_rows[r] / x_rows_divisor, the MoE gather folded into the loads (x_rows = the permutation's sorted_entries,
  // divisor = top_k); null: row r reads x row r.
  const int32_t* x_rows = nullptr;
  int64_t x_rows_divisor = 1;
  const void* w = nullptr;           // [E][n][w_ld]: bf16 or e4m3 bytes (elements past k are never used)
  int64_t w_ld = 0;                  // elements per stored weight row
  int64_t w_matrix_stride = 0;       // elements from one expert's matrix to the next
  const float* w_scale = nullptr;    // kFP8: [E][ceil(n/128)][w_scale_ld]
  int64_t w_scale_ld = 0;
  int64_t w_scale_matrix_stride = 0;  // floats from one expert's scales to the next
  uint16_t* y = nullptr;              // bf16 [rows, n], contiguous (with y_ld: rows y_ld apart)
  // Streaming and tiled kernels: float32 output instead of y (y is then not used and may be null): the float sums
  // before their rounding to bf16, at y_f32[r * y_ld + n] (y_ld 0: n).
  float* y_f32 = nullptr;
  // Streaming kernel: sum each row's products in the tiled kernel's order (every mma one natural k16 block, the
  // blocks in k order, one warp per row's sum: k_split 1; the lanes of a group exchange their loaded words first),
  // so that a row's result is bit for bit the tiled kernel's whatever the rows beside it or the kernel chosen. The
  // batch-invariant mode's GEMMs (cuda_backend.h). k_split must be 0 or 1. The wgmma kernel refuses it.
  bool tiled_order = false;
  // Streaming kernel only (the tiled and wgmma kernels refuse it): the MoE's gate_up GEMM with SwiGLU in its epilogue.
  // w holds [E][n][w_ld] with n = 2 * I, the gate rows first, then the up rows (the checkpoint's gate_up layout); y is
  // bf16 [rows, I] (y_ld: its row stride, >= I; 0: I): y[r][j] = silu(g) * u with g and u the bf16 roundings of the
  // products of gate row j and up row I + j, computed as run_silu_mul does (fused_ops.h), so that the result is bit
  // for bit the unfused pair's (tiled_order included). Requires n % 16 == 0, y set and y_f32 null.
  bool gated = false;
  int num_sms = 0;                    // the device's SMs, for choosing k_split (0: 132, an H100/H200)
  int k_split = 0;                    // 0: automatic; 1, 2 or 4: forced (checks, benchmarks)
  // Streaming kernel: how a warp keeps its weight loads in flight. 4 or 6: a ring of that many stages in shared memory
  // (cp.async; 32 or 48 KB a CTA, 3 or 5 stages in flight); -1: registers (one stage in flight; the path before
  // 2026-12-06, for comparison); 0: automatic (the ring of 4). The sums do not depend on it (DEEPINFER_MOE_STREAM
  // chooses it in the CUDA backend).
  int stream_ring = 0;
  // Streaming kernel on a ring: read the expert ranges (offsets) and start copying the weights before waiting for the
  // previous kernel in the stream (programmatic dependent launch, kernels/cuda/launch.cuh), so that the copies overlap
  // its tail; x, x_rows and y are touched only after. Set it only when nothing the previous kernel may still be
  // running writes the offsets or the weights: offsets null (the weights are constant), or offsets written at least
  // two kernels earlier (the MoE's down GEMM: the routing wrote them before the gate_up kernel ran; a kernel starts
  // early only after every CTA of the one before it has passed its own wait, so by then the routing has finished).
  bool weights_before_wait = false;
  int wgmma_tile_n = 0;               // run_moe_grouped_gemm_wgmma: columns per tile, 0 automatic, 128 or 256 forced
  // run_moe_grouped_gemm_wgmma: the swapped tiles (128 weight rows x 32 or 64 tokens, the weights as wgmma's M) for
  // few rows per expert. 0 automatic (FP8: by the rows per expert on average; bf16: never), -1 never (128-row tiles),
  // 32 or 64 forced (with wgmma_tile_n 0 or 128).
  int wgmma_swap_tokens = 0;
  // run_moe_grouped_gemm_wgmma with kFP8 weights: the activations quantized by run_act_quant (gemm.h) instead of x:
  // e4m3 [rows, k] (16-byte aligned) and float32 scales [k / 128][rows] ("M-major"); x's values are not read (x must
  // still be set and valid: moe_grouped_params_valid checks it).
  const uint8_t* x_fp8 = nullptr;
  const float* x_scale = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t run_moe_grouped_gemm(const MoeGroupedGemmParams& params);

// The row-tile grid of the tiled (tile_rows 64) and wgmma (128; swapped tiles 32 or 64) kernels: an upper bound of
// the tile count,
// ceil(rows / tile_rows) + min(E, rows) (each expert's last tile may be partial). The launchers refuse more than
// kMoeMaxRowTiles (CUDA's grid.y); a caller choosing a kernel asks the same.
inline constexpr int64_t kMoeMaxRowTiles = 65535;
inline int64_t moe_grouped_row_tiles(int64_t rows, int64_t num_experts, int64_t tile_rows) {
  return (rows + tile_rows - 1) / tile_rows + (num_experts < rows ? num_experts : rows);
}

// Tokens per swapped tile that run_moe_grouped_gemm_wgmma takes for `rows` token copies over `num_experts` (32 or
// 64), or 0 for its 128-row tiles: `forced` (MoeGroupedGemmParams::wgmma_swap_tokens) when not 0 (-1: 0), else by
// the rows per expert on average: FP8 up to 24: 32, up to 64: 64 (bench/gpu/NOTES.md, "the operands swapped");
// bf16 from 24 to 64: 64, else 0 (NOTES, "The first H200 run in five sessions"; below 24 bf16 experts take the
// tiled kernel, not this one). Host arithmetic; a caller checks the grid with moe_grouped_row_tiles at the tile's
// rows.
inline int moe_wgmma_swap_tokens(int64_t rows, int64_t num_experts, bool fp8, int forced) {
  if (forced != 0) return forced < 0 ? 0 : forced;
  if (!fp8) return rows >= 24 * num_experts && rows <= 64 * num_experts ? 64 : 0;
  if (rows <= 24 * num_experts) return 32;
  if (rows <= 64 * num_experts) return 64;
  return 0;
}

// Whether `params` meet the REQUIRES above (the three launchers check it first; rows <= INT32_MAX / 2,
// k <= INT32_MAX / 4).
bool moe_grouped_params_valid(const MoeGroupedGemmParams& params);

// The same product (same contract, same parameters, including a null offsets with E == 1, x_ld, y_ld and y_f32;
// num_sms, k_split and tiled_order are not used) for many rows per expert:
// tiles of 64 rows x 128 columns on the tensor cores, each expert's weights read once per 64 of its rows (the
// streaming kernel above: once per 8). One launch, the tile -> expert map computed on the device from the offsets:
// no host synchronization, capturable in a CUDA graph. y must be 4-byte aligned (pairs of outputs are stored
// together; y_f32 instead: any float alignment). Shape of the work: grid (ceil(n / 128),
// ceil(rows / 64) + min(E, rows)), 256 threads, 72 KB (bf16) or 96 KB (FP8) of dynamic shared memory; CTAs past the
// real tile count return at once. FP8: each 128-wide K group's products are summed in float and multiplied by the
// block scale, the weights widened exactly (the streaming kernel's arithmetic). Also returns
// cudaErrorInvalidValue when ceil(rows / 64) + min(E, rows) > 65535.
cudaError_t run_moe_grouped_gemm_tiled(const MoeGroupedGemmParams& params);
// Raises the tiled kernel's dynamic shared-memory limit (cudaFuncSetAttribute), once per process; the launcher calls
// it too, but a backend calls it at creation so that the first launch may be inside a CUDA graph capture.
// Thread-safe; returns the first call's result.
cudaError_t init_moe_grouped_gemm_tiled();

// The same product (same contract) for tens to hundreds of rows per expert, on Hopper's warpgroup MMA (wgmma):
// tiles of 128 rows x 128 or 256 columns (wgmma_tile_n; automatic: 256 when n >= 1024), each expert's weights read
// once per 128 of its rows, one launch, the tile map from the device offsets (no host synchronization, capturable
// in a CUDA graph). kFP8 weights take quantized activations (x_fp8, x_scale above; k % 128 == 0; 128-column tiles)
// and compute fp8_gemm's formula of gemm.h per expert: y[r, n] = bf16(Σ_g x_scale[g][r] · w_scale[e][n/128][g] ·
// Σ_{k in g} x_fp8[r, k] · W[e][n, k]) (e4m3 products on the tensor cores, the activations' rounding to e4m3 as
// the per-expert cuBLASLt path). Returns cudaErrorInvalidValue for x_rows, x_ld, y_ld, y_f32, tiled_order, a null
// offsets, y not 4-byte aligned, wgmma_tile_n other than 0, 128 or 256, ceil(rows / tile rows) + min(E, rows) > 65535,
// and FP8 without x_fp8 / x_scale, with x_fp8 not 16-byte aligned, with k % 128 != 0 or with wgmma_tile_n 256; also for
// wgmma_swap_tokens other than 0, -1, 32 or 64 (or > 0 with wgmma_tile_n 256). Shape of the work: grid (ceil(n /
// tile_n), ceil(rows / 128) + min(E, rows)), 256 threads (two warpgroups of 64 rows), 161 KB (128 columns) or 193 KB
// (256) of dynamic shared memory; CTAs past the real tile count return at once. At few rows per expert
// (wgmma_swap_tokens; automatic for FP8: up to 24 on average 32-token tiles, up to 64 64-token ones) the operands swap:
// grid (ceil(n / 128), ceil(rows / tokens) + min(E, rows)), 256 threads (two warpgroups of 64 weight rows), 101 or 97
// KB (two CTAs an SM); the same formula, the same sums per K group, the products in another order inside a group.
cudaError_t run_moe_grouped_gemm_wgmma(const MoeGroupedGemmParams& params);
// As init_moe_grouped_gemm_tiled, for the wgmma kernel.
cudaError_t init_moe_grouped_gemm_wgmma();

}  // namespace deepinfer::kernels::cuda
