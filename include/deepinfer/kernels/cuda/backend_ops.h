// The small data-movement kernels the CUDA backend (src/backend/cuda) needs around the big ones: strided 2-D
// copy / dtype conversion / add, row gathers (embedding lookup, logits rows), the KV-cache scatter, and the
// random weight fill of benchmarks. Every launcher is asynchronous on params.stream and returns the launch error;
// pointers are device memory owned by the caller; strides are in elements. bf16 values travel as their bit
// patterns (uint16_t) so that host C++ code can include this header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "deepinfer/kernels/cuda/fused_ops.h"  // DType

namespace deepinfer::kernels::cuda {

// dst[r, c] = convert(src[r, c]) for c < src_cols, 0 for src_cols <= c < dst_cols (zero padding, e.g. to a
// multiple of 128 columns for act_quant). bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even. Any pair of
// {kF32, kBF16}. REQUIRES: src_cols <= dst_cols <= dst_stride, src_cols <= src_stride; src and dst do not overlap.
struct Convert2dParams {
  int64_t rows = 0, src_cols = 0, dst_cols = 0;
  DType src_dtype = DType::kBF16, dst_dtype = DType::kBF16;
  const void* src = nullptr;  // [rows, src_stride]
  int64_t src_stride = 0;
  void* dst = nullptr;  // [rows, dst_stride]
  int64_t dst_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_convert_2d(const Convert2dParams& params);

// x[r, c] = bf16(float(x[r, c]) + float(delta[r, c])) for c < cols: one rounding, as the CPU backend's float add
// followed by the activation's storage. x and delta may be the same memory only when identical (x = 2x).
struct Add2dParams {
  int64_t rows = 0, cols = 0;
  uint16_t* x = nullptr;  // bf16 [rows, x_stride]
  int64_t x_stride = 0;
  const uint16_t* delta = nullptr;  // bf16 [rows, delta_stride]
  int64_t delta_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_add_2d(const Add2dParams& params);

// How a gathered table is stored: bf16, float32, or float8_e4m3fn with 128x128 block scales (value = fp8 * scale).
enum class TableFormat : int { kBF16 = 0, kF32 = 1, kFP8 = 2 };

// dst[r, :cols] = bf16(table[indices[r], :cols]) (embedding lookup; selecting the rows of the logits). An index
// outside [0, table_rows) traps (a bug above: token ids are validated before they get here).
struct GatherRowsParams {
  int64_t rows = 0, cols = 0;
  const int32_t* indices = nullptr;  // [rows]
  // The table holds ids [first_index, first_index + table_rows) (a vocabulary-parallel shard): other ids get zeros
  // when sharded is set, else trap.
  int64_t first_index = 0;
  bool sharded = false;
  TableFormat format = TableFormat::kBF16;
  const void* table = nullptr;  // [table_rows, table_stride] elements of the format
  int64_t table_rows = 0, table_stride = 0;
  const float* scales = nullptr;  // kFP8 only: [ceil(table_rows/128)][scale_ld]
  int64_t scale_ld = 0;
  uint16_t* dst = nullptr;  // bf16 [rows, dst_stride]
  int64_t dst_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_gather_rows(const GatherRowsParams& params);

// The KV-cache scatter: cache[slots[r], :dim] = kv[r, :dim] (bf16). Rows with a negative slot are skipped (padding
// rows); a slot >= num_slots traps.
struct StoreKvParams {
  int64_t rows = 0, dim = 0;
  const uint16_t* kv = nullptr;  // bf16 [rows, kv_stride]
  int64_t kv_stride = 0;
  const int64_t* slots = nullptr;  // [rows]
  uint16_t* cache = nullptr;       // bf16 [num_slots, dim] contiguous (the [num_blocks, 64, dim] cache layer)
  int64_t num_slots = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_store_kv(const StoreKvParams& params);

// Per-row block tables: row_tables[r, :] = block_table[row_table[r], :] for `rows` rows of `max_blocks` ids, so
// that a kernel indexing block tables by its batch index (run_mla_decode) can take one query row per batch entry.
// REQUIRES: 0 <= row_table[r] < table_rows (else the kernel traps).
struct RowBlockTablesParams {
  int64_t rows = 0, max_blocks = 0, table_rows = 0;
  const int32_t* row_table = nullptr;    // [rows]
  const int32_t* block_table = nullptr;  // [table_rows, max_blocks]
  int32_t* row_tables = nullptr;         // [rows, max_blocks]
  cudaStream_t stream = nullptr;
};
cudaError_t run_row_block_tables(const RowBlockTablesParams& params);

// Key offsets of a step's context chunks (the expanded MLA form over a cached prefix): group g's keys in chunk c are
// positions [c * chunk, min(contexts[g], (c + 1) * chunk)), packed in group order:
//   cu_keys[c * (groups + 1) + g] = sum over g' < g of max(0, min(contexts[g'], (c + 1) * chunk) - c * chunk).
struct ChunkKeyOffsetsParams {
  int64_t groups = 0, chunks = 0, chunk = 0;
  const int32_t* contexts = nullptr;  // [groups]
  int32_t* cu_keys = nullptr;         // [chunks, groups + 1]
  cudaStream_t stream = nullptr;
};
cudaError_t run_chunk_key_offsets(const ChunkKeyOffsetsParams& params);

// The cache rows of one context chunk, packed: for packed row r of group g (cu_keys[g] <= r < cu_keys[g + 1]) at
// position p = key_position + r - cu_keys[g], out[r, :dim] = cache[block_table[tables[g], p / 64] * 64 + p % 64, :dim]
// (bf16; dim a multiple of 8: 16-byte copies). A block id outside [0, num_slots / 64) traps.
struct GatherCacheRowsParams {
  int64_t groups = 0, rows = 0, dim = 0, max_blocks = 0, num_slots = 0;
  int64_t key_position = 0;
  const int32_t* cu_keys = nullptr;      // [groups + 1], cu_keys[groups] == rows
  const int32_t* tables = nullptr;       // [groups] block-table row of each group
  const int32_t* block_table = nullptr;  // [*, max_blocks]
  const uint16_t* cache = nullptr;       // bf16 [num_slots, dim]
  uint16_t* out = nullptr;               // bf16 [rows, dim] contiguous, 16-byte aligned
  cudaStream_t stream = nullptr;
};
cudaError_t run_gather_cache_rows(const GatherCacheRowsParams& params);

// Random weights for benchmarks, a pure function of (seed, logical index i = (m * rows + r) * cols + c for
// element (m, r, c) of `count` matrices [rows][cols]): u = (splitmix64(seed ^ splitmix64(i)) >> 40) * 2^-23 - 1,
// uniform in [-1, 1) (the CPU backend's fill_random, bit for bit), then
//   kBF16 / kF32:  u * scale                  (bf16 rounds to nearest even: the same bits as the CPU backend)
//   kFP8:          e4m3(u * 448) (saturating); the caller sets the block scales to scale / 448
// Storage rows are `stride` elements apart (stride >= cols; FP8 weights pad cols to a multiple of 128); the
// padding columns are not written.
struct FillRandomParams {
  TableFormat format = TableFormat::kBF16;
  int64_t count = 1, rows = 0, cols = 0, stride = 0;
  uint64_t seed = 0;
  float scale = 1.0f;
  void* data = nullptr;  // [count * rows, stride] elements of the format
  cudaStream_t stream = nullptr;
};
cudaError_t run_fill_random(const FillRandomParams& params);

// data[i] = value for i < n (FP8 block scales of random weights).
struct FillF32Params {
  int64_t n = 0;
  float value = 0.0f;
  float* data = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t run_fill_f32(const FillF32Params& params);

}  // namespace deepinfer::kernels::cuda
