// DSpark's host heads on the GPU (the draft module's Markov head, greedy, and its confidence head), over the base
// logits a block pass left on the device: what DeepSeekModel::DsparkHeads::greedy_chain computes on the host
// (include/deepinfer/model/deepseek_model.h), without moving [chains * gamma, draft vocabulary] float32 logits to
// the host (2 MB per chain on the demo model) or running the heads there (0.6 ms per chain on the H100 machine's
// host, against a 0.3 ms target pass).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deepinfer::kernels::cuda {

// Per chain c (rows c * gamma .. c * gamma + lengths[c] - 1 of `logits` and `h`), in order k = 0, 1, ...:
//   e = w1[previous_k] (previous_0 = previous[c], then the chain's own last draft),
//   draft_k = the first index of the largest of logits[row][i] + sum_j w2_rows[i][j] * e[j] (summed from the base
//             logit in j order, in float), mapped to its id (active[i], or i) with the ids outside the draft
//             vocabulary counting as logit 0 (`outside`: the lowest such id; >= vocab: none), as finish_argmax,
//   confidence_k = sigmoid(sum_j confidence[j] * h[row][j] + sum_j confidence[hidden + j] * e[j]) (double sums).
// With w2_norm, only entries whose base logit plus |w2_rows[i]| |e| reaches the value of the base row's own first
// maximum get the Markov term (greedy_draft's bound, same result); a row whose base maximum, that value or |e| is
// not finite, or holding a NaN after the term, or with no entry left, takes every entry (one CTA, ~100 us), as the
// host's whole_row: the first largest value after the term unless entry 0 is NaN; -1 when that value is NaN or
// infinite. Without w2_norm every entry gets its term. A chain stops at a -1 (later rows -1 too); rows k >=
// lengths[c] are not written.
struct DsparkGreedyParams {
  int64_t chains = 0, gamma = 0;  // logits / h rows: chains * gamma
  int64_t n = 0;                  // the draft vocabulary: logits' columns
  int64_t vocab = 0;              // the model's vocabulary: w1's rows, the ids
  int32_t rank = 0;               // <= kDsparkMaxRank
  int32_t hidden = 0;
  const float* logits = nullptr;  // [chains * gamma, n] contiguous, device
  const uint16_t* h = nullptr;    // bf16 [chains * gamma, hidden] at h_stride elements per row, device
  int64_t h_stride = 0;
  const float* w1 = nullptr;        // [vocab, rank], device
  const float* w2_rows = nullptr;   // [n, rank], device
  const float* w2_norm = nullptr;   // [n] row norms rounded up, device; or null (no pruning)
  float w2_norm_max = 0.0f;         // their largest
  const float* confidence = nullptr;  // [hidden + rank], device
  const int32_t* active = nullptr;    // [n] the ids of the draft vocabulary, device; or null (ids 0..n-1)
  int32_t outside = 0;
  const int32_t* previous = nullptr;  // [chains], device
  const int32_t* lengths = nullptr;   // [chains] in 0..gamma, device
  int32_t* drafts = nullptr;          // [chains * gamma] out, device
  double* confidences = nullptr;      // [chains * gamma] out, device
  void* scratch = nullptr;            // dspark_greedy_scratch_bytes(chains, gamma, n), device
  cudaStream_t stream = nullptr;
};
constexpr int32_t kDsparkMaxRank = 256;
size_t dspark_greedy_scratch_bytes(int64_t chains, int64_t gamma, int64_t n);
// 1 + 2 * gamma kernels on `stream`, no host synchronization (capturable).
cudaError_t run_dspark_greedy_chains(const DsparkGreedyParams& params);

}  // namespace deepinfer::kernels::cuda
