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
                                                          float* __restrict__ top_probability, int64_t cols) {
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
    if (threadIdx.x == 0 && top_probability != nullptr) top_probability[blockIdx.x] = 0.0f;
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
  if (top_probability == nullptr) return;
  // The winner's softmax probability: 1 / sum(exp(v - max)), a second pass over the row (in L2 after the first).
  const float max_value = values[0];
  const bool none = indices[0] < 0;
  __syncthreads();  // everyone has read values[0] before it is reused for the sums
  float sum = 0.0f;
  if (!none) {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) sum += __expf(row[c] - max_value);
  }
  values[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) values[threadIdx.x] += values[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) top_probability[blockIdx.x] = none || !(values[0] > 0.0f) ? 0.0f : 1.0f / values[0];
}

}  // namespace

cudaError_t run_argmax(const ArgmaxParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || p.cols > INT32_MAX || p.rows > INT32_MAX || !p.logits || !p.ids) return cudaErrorInvalidValue;
  argmax_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, p.stream>>>(p.logits, p.ids, p.top_probability,
                                                                         p.cols);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
