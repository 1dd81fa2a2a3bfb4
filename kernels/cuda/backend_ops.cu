// The CUDA backend's small data-movement kernels: 2-D copy/convert/add, row gathers, the KV-cache scatter and the
// random weight fill. Contracts in include/deepinfer/kernels/cuda/backend_ops.h. Grid-stride loops, one element per
// thread step: these ops move at most a few rows of activations per call, so simplicity beats vectorization here.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "deepinfer/kernels/cuda/backend_ops.h"
#include "launch.cuh"

namespace deepinfer::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;

unsigned grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > 132 * 32 ? 132 * 32 : blocks);
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(bf16* p, float v) { *p = __float2bfloat16(v); }

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

template <typename S, typename D>
__global__ void convert_2d_kernel(Convert2dParams p) {
  pdl_begin();
  const S* src = static_cast<const S*>(p.src);
  D* dst = static_cast<D*>(p.dst);
  const int64_t total = p.rows * p.dst_cols;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / p.dst_cols, c = i % p.dst_cols;
    store_f(dst + r * p.dst_stride + c, c < p.src_cols ? load_f(src + r * p.src_stride + c) : 0.0f);
  }
}

__global__ void add_2d_kernel(Add2dParams p) {
  pdl_begin();
  bf16* x = reinterpret_cast<bf16*>(p.x);
  const bf16* d = reinterpret_cast<const bf16*>(p.delta);
  const int64_t total = p.rows * p.cols;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / p.cols, c = i % p.cols;
    bf16* xp = x + r * p.x_stride + c;
    *xp = __float2bfloat16(__bfloat162float(*xp) + __bfloat162float(d[r * p.delta_stride + c]));
  }
}

__global__ void gather_rows_kernel(GatherRowsParams p) {
  pdl_begin();
  bf16* dst = reinterpret_cast<bf16*>(p.dst);
  const int64_t total = p.rows * p.cols;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / p.cols, c = i % p.cols;
    const int64_t src_row = p.indices[r] - p.first_index;
    if (src_row < 0 || src_row >= p.table_rows) {
      if (!p.sharded) __trap();
      dst[r * p.dst_stride + c] = __float2bfloat16(0.0f);
      continue;
    }
    const int64_t at = src_row * p.table_stride + c;
    float v;
    switch (p.format) {
      case TableFormat::kBF16:
        v = __bfloat162float(static_cast<const bf16*>(p.table)[at]);
        break;
      case TableFormat::kF32:
        v = static_cast<const float*>(p.table)[at];
        break;
      default:
        v = fp8_to_float(static_cast<const uint8_t*>(p.table)[at]) * p.scales[(src_row / 128) * p.scale_ld + c / 128];
        break;
    }
    dst[r * p.dst_stride + c] = __float2bfloat16(v);
  }
}

__global__ void store_kv_kernel(StoreKvParams p) {
  pdl_begin();
  const int64_t total = p.rows * p.dim;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / p.dim, c = i % p.dim;
    const int64_t slot = p.slots[r];
    if (slot < 0) continue;
    if (slot >= p.num_slots) __trap();
    p.cache[slot * p.dim + c] = p.kv[r * p.kv_stride + c];
  }
}

__global__ void row_block_tables_kernel(RowBlockTablesParams p) {
  const int64_t total = p.rows * p.max_blocks;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / p.max_blocks, b = i % p.max_blocks;
    const int32_t table = p.row_table[r];
    if (table < 0 || table >= p.table_rows) __trap();
    p.row_tables[i] = p.block_table[static_cast<int64_t>(table) * p.max_blocks + b];
  }
}

__global__ void chunk_key_offsets_kernel(ChunkKeyOffsetsParams p) {
  for (int64_t c = global_thread(); c < p.chunks; c += grid_threads()) {
    const int64_t first = c * p.chunk, end = first + p.chunk;
    int32_t* out = p.cu_keys + c * (p.groups + 1);
    int32_t sum = 0;
    out[0] = 0;
    for (int64_t g = 0; g < p.groups; ++g) {
      const int64_t keys = min(static_cast<int64_t>(p.contexts[g]), end) - first;
      sum += keys > 0 ? static_cast<int32_t>(keys) : 0;
      out[g + 1] = sum;
    }
  }
}

__global__ void gather_cache_rows_kernel(GatherCacheRowsParams p) {
  const int64_t chunks_per_row = p.dim / 8;  // 16-byte chunks
  const int64_t total = p.rows * chunks_per_row;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t r = i / chunks_per_row, chunk = i % chunks_per_row;
    int64_t lo = 0, hi = p.groups - 1;  // the group g with cu_keys[g] <= r < cu_keys[g + 1]
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.cu_keys[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const int64_t position = p.key_position + r - p.cu_keys[lo];
    const int32_t block = p.block_table[static_cast<int64_t>(p.tables[lo]) * p.max_blocks + position / 64];
    if (block < 0 || static_cast<int64_t>(block) * 64 >= p.num_slots) __trap();
    const int64_t slot = static_cast<int64_t>(block) * 64 + position % 64;
    reinterpret_cast<uint4*>(p.out + r * p.dim)[chunk] = reinterpret_cast<const uint4*>(p.cache + slot * p.dim)[chunk];
  }
}

// splitmix64 (Steele et al. 2014; the finalizer of Java's SplittableRandom).
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform draw in [-1, 1) from the counter (seed, index): 24 random bits, the CPU backend's exact formula
// (src/backend/cpu/cpu_backend.cpp, fill_random), so that both backends make the same random weights.
__device__ __forceinline__ float uniform_pm1(uint64_t seed, uint64_t index) {
  return static_cast<float>(splitmix64(seed ^ splitmix64(index)) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void fill_random_kernel(FillRandomParams p) {
  const int64_t total = p.count * p.rows * p.cols;
  for (int64_t i = global_thread(); i < total; i += grid_threads()) {
    const int64_t row = i / p.cols, c = i % p.cols;  // row over all count * rows matrices' rows
    const float u = uniform_pm1(p.seed, static_cast<uint64_t>(i));
    const int64_t at = row * p.stride + c;
    switch (p.format) {
      case TableFormat::kBF16:
        static_cast<bf16*>(p.data)[at] = __float2bfloat16(u * p.scale);
        break;
      case TableFormat::kF32:
        static_cast<float*>(p.data)[at] = u * p.scale;
        break;
      default:
        static_cast<uint8_t*>(p.data)[at] =
            static_cast<uint8_t>(__nv_cvt_float_to_fp8(u * 448.0f, __NV_SATFINITE, __NV_E4M3));
        break;
    }
  }
}

__global__ void fill_f32_kernel(FillF32Params p) {
  for (int64_t i = global_thread(); i < p.n; i += grid_threads()) p.data[i] = p.value;
}

template <typename S>
cudaError_t launch_convert_from(const Convert2dParams& p, unsigned grid) {
  if (p.dst_dtype == DType::kF32)
    launch_pdl(convert_2d_kernel<S, float>, grid, kThreads, 0, p.stream, p);
  else
    launch_pdl(convert_2d_kernel<S, bf16>, grid, kThreads, 0, p.stream, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run_convert_2d(const Convert2dParams& p) {
  if (p.rows < 0 || p.src_cols < 0 || p.src_cols > p.dst_cols || p.dst_cols > p.dst_stride || p.src_cols > p.src_stride)
    return cudaErrorInvalidValue;
  if (p.rows == 0 || p.dst_cols == 0) return cudaSuccess;
  const unsigned grid = grid_for(p.rows * p.dst_cols);
  return p.src_dtype == DType::kF32 ? launch_convert_from<float>(p, grid) : launch_convert_from<bf16>(p, grid);
}

cudaError_t run_add_2d(const Add2dParams& p) {
  if (p.rows < 0 || p.cols < 0 || p.cols > p.x_stride || p.cols > p.delta_stride) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  launch_pdl(add_2d_kernel, grid_for(p.rows * p.cols), kThreads, 0, p.stream, p);
  return cudaGetLastError();
}

cudaError_t run_gather_rows(const GatherRowsParams& p) {
  if (p.rows < 0 || p.cols < 0 || p.cols > p.table_stride || p.cols > p.dst_stride ||
      (p.format == TableFormat::kFP8 && p.scales == nullptr))
    return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  launch_pdl(gather_rows_kernel, grid_for(p.rows * p.cols), kThreads, 0, p.stream, p);
  return cudaGetLastError();
}

cudaError_t run_store_kv(const StoreKvParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.dim > p.kv_stride) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  launch_pdl(store_kv_kernel, grid_for(p.rows * p.dim), kThreads, 0, p.stream, p);
  return cudaGetLastError();
}

cudaError_t run_row_block_tables(const RowBlockTablesParams& p) {
  if (p.rows < 0 || p.max_blocks <= 0 || p.table_rows <= 0 || !p.row_table || !p.block_table || !p.row_tables) {
    return cudaErrorInvalidValue;
  }
  if (p.rows == 0) return cudaSuccess;
  row_block_tables_kernel<<<grid_for(p.rows * p.max_blocks), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_chunk_key_offsets(const ChunkKeyOffsetsParams& p) {
  if (p.groups < 0 || p.chunks < 0 || p.chunk <= 0 || !p.contexts || !p.cu_keys) return cudaErrorInvalidValue;
  if (p.chunks == 0) return cudaSuccess;
  chunk_key_offsets_kernel<<<grid_for(p.chunks), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_gather_cache_rows(const GatherCacheRowsParams& p) {
  if (p.groups <= 0 || p.rows < 0 || p.dim <= 0 || p.dim % 8 != 0 || p.max_blocks <= 0 || p.num_slots <= 0 ||
      p.key_position < 0 || !p.cu_keys || !p.tables || !p.block_table || !p.cache || !p.out ||
      reinterpret_cast<uintptr_t>(p.out) % 16 != 0 || reinterpret_cast<uintptr_t>(p.cache) % 16 != 0)
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  gather_cache_rows_kernel<<<grid_for(p.rows * (p.dim / 8)), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_fill_random(const FillRandomParams& p) {
  if (p.count < 0 || p.rows < 0 || p.cols < 0 || p.cols > p.stride) return cudaErrorInvalidValue;
  const int64_t total = p.count * p.rows * p.cols;
  if (total == 0) return cudaSuccess;
  fill_random_kernel<<<grid_for(total), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_fill_f32(const FillF32Params& p) {
  if (p.n < 0) return cudaErrorInvalidValue;
  if (p.n == 0) return cudaSuccess;
  fill_f32_kernel<<<grid_for(p.n), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
