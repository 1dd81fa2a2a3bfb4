// Greedy sampling on the GPU (contract in include/deepinfer/kernels/cuda/sampling.h): one CTA per row, each thread
// scans a strided slice keeping (best value, lowest index), then a shared-memory tree reduction with the same rule.
#include <cmath>

#include "deepinfer/kernels/cuda/sampling.h"

namespace deepinfer::kernels::cuda {
namespace {

constexpr int kThreads = 512;

// Whether (v, i) beats (best, best_i): larger, or equal with a lower index (-1 = nothing yet).
__device__ __forceinline__ bool better(float v, int32_t i, float best, int32_t best_i) {
  return v > best || (v == best && best_i >= 0 && i >= 0 && i < best_i);
}

__global__ void __launch_bounds__(kThreads) argmax_kernel(const float* __restrict__ logits, int32_t* __restrict__ ids,
                                                          int64_t cols) {
  __shared__ float values[kThreads];
  __shared__ int32_t indices[kThreads];
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * cols;
  float best = -INFINITY;
  int32_t best_i = -1;
  bool bad = false;  // a NaN or +inf logit: the row gets -1, as the CPU sampler rejects such logits
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const float v = row[c];
    bad = bad || isnan(v) || v == INFINITY;
    if (v > best) {  // ascending scan: a later equal value never replaces an earlier one
      best = v;
      best_i = static_cast<int32_t>(c);
    }
  }
  if (__syncthreads_or(bad)) {
    if (threadIdx.x == 0) ids[blockIdx.x] = -1;
    return;
  }
  values[threadIdx.x] = best;
  indices[threadIdx.x] = best_i;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const float v = values[threadIdx.x + half];
      const int32_t i = indices[threadIdx.x + half];
      if (i >= 0 && better(v, i, values[threadIdx.x], indices[threadIdx.x])) {
        values[threadIdx.x] = v;
        indices[threadIdx.x] = i;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) ids[blockIdx.x] = indices[0];
}

}  // namespace

cudaError_t run_argmax(const ArgmaxParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || p.cols > INT32_MAX || p.rows > INT32_MAX || !p.logits || !p.ids) return cudaErrorInvalidValue;
  argmax_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, p.stream>>>(p.logits, p.ids, p.cols);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
