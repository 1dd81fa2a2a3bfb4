// MLA attention for the shapes and steps the fast kernels (mla_decode.h, mla_prefill.h) do not cover: any
// kv_lora_rank C and rope dim R, any number of query rows per sequence (chunked prefill, tiny test models).
// Correctness first: f32
// CUDA-core math. bf16 values travel as their bit patterns (uint16_t); pointers are device memory owned by the
// caller; strides are in elements. Launchers are asynchronous on params.stream and return the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace deepinfer::kernels::cuda {

// Absorbed MLA over the paged latent cache (the math of mla_decode.h, CpuBackend::mla_attention), for every query
// row r and head h, causal by the row's own context length ctx = row_context[r] (its position + 1):
//   score(j) = scale * (q[r, h*(C+R) : h*(C+R)+C+R] · cache_row(r, j)[:C+R])          0 <= j < ctx
//   out[r, h*C : h*C+C] = sum_j softmax_j(score) * cache_row(r, j)[:C]                 (zeros when ctx == 0)
// cache_row(r, j) = cache[(block_table[row_table[r] * max_blocks + j / 64] * 64 + j % 64) * (C+R) ...].
// One CTA of 256 threads per (head, row) walks the context in 64-key tiles with an online softmax (f32 scores,
// f32 accumulators). A cache slot outside [0, num_slots) traps.
// REQUIRES: 0 < C, 0 <= R, C + R <= 1024; num_heads <= 65535 (grid = [rows, H]); q_stride >= H*(C+R),
// out_stride >= H*C.
struct MlaGenericParams {
  int64_t rows = 0, num_heads = 0, kv_lora_rank = 0, rope_dim = 0;
  float scale = 0.0f;
  const uint16_t* q = nullptr;  // bf16 [rows, q_stride]: head h at columns h*(C+R) ...
  int64_t q_stride = 0;
  const uint16_t* cache = nullptr;  // bf16 [num_slots, C+R] contiguous ([num_blocks, 64, C+R])
  int64_t num_slots = 0;
  const int32_t* block_table = nullptr;  // [table_rows, max_blocks]
  int64_t max_blocks = 0;
  const int32_t* row_table = nullptr;    // [rows] which block-table row each query row reads
  const int32_t* row_context = nullptr;  // [rows] keys each query row attends to (position + 1)
  uint16_t* out = nullptr;               // bf16 [rows, out_stride]: head h at columns h*C ...
  int64_t out_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_mla_generic(const MlaGenericParams& params);

}  // namespace deepinfer::kernels::cuda
