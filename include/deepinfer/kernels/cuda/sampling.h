// Sampling on the GPU: greedy decoding without copying the logits to the host (a step of 256 rows of DeepSeek-V3's
// 129,280-token vocabulary is 132 MB of float32 logits; its argmax is 1 KB).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace deepinfer::kernels::cuda {

struct ArgmaxParams {
  int64_t rows = 0, cols = 0;
  const float* logits = nullptr;  // [rows, cols] contiguous, device
  int32_t* ids = nullptr;         // [rows] device: per row the index of the largest value, the lowest index among
                                  // equal maxima (the CPU sampler's rule); -1 when the row holds a NaN or +inf
                                  // (the CPU sampler rejects those) or nothing above -inf
  float* top_probability = nullptr;  // optional [rows] device: softmax probability of that index, 1 / sum(exp(v -
                                     // max)) (speculative decoding's draft confidence); 0 where ids is -1
  cudaStream_t stream = nullptr;
};
cudaError_t run_argmax(const ArgmaxParams& params);

}  // namespace deepinfer::kernels::cuda
