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

// Sampling on the GPU with the engine sampler's semantics (include/deepinfer/engine/sampler.h, steps 3-8; steps 1-2,
// logit_bias and penalties, by run_logit_adjustments first; logprobs by run_logprobs and run_chosen_logprobs): greedy below
// kGreedyTemperature (argmax, lowest id on ties); else weights w = expf((l - max) * (1 / T)) (float, as the CPU's
// formula; CUDA's expf is within 2 ulp, glibc's within 1: a min-p or top-p cut, like the draw, can differ only within
// rounding); top-k (ties at the boundary to the lower id), top-p over
// the top-k set (walking from most likely, lower id first on ties, keep while the mass before a token < top_p * total),
// min-p (w >= min_p); then one draw u = Philox4x32-10 (key seed, counter (counter, 0, stream 0)) as a double in
// [0, 1), the first kept token with positive weight whose cumulative weight in ascending id order exceeds u * total.
// Masses are summed in double (in an order other than the CPU's, and by shared-memory atomics whose order is not
// fixed: a token can differ from the CPU's, or between two runs, only when a cut or u * total lies within rounding of
// a boundary). Top-k and top-p each take one histogram pass over 2,048 bins linear in value (counts, or masses) and a
// scan for the bin where the cut falls. When every token up to that bin fits in shared memory (8,192: a top-k set, a
// peaked row's nucleus) they are compacted and sorted, and the cut, min-p and the draw run on them with no further
// pass over the row; else only that bin's tokens are, which gives the cut's (value, id), and the draw takes one more
// pass. A bin holding more than fit (ties) falls back to radix selection on the logits' bits (4 passes of 8 bits).
// CTAs of 1024 threads, each walking rows blockIdx.x, blockIdx.x + ctas, ... (default one CTA per row; measurements
// in bench/gpu/NOTES.md).
struct SampleRowParams {
  int32_t logprobs = -1;     // run_logprobs / run_chosen_logprobs: -1 none; else 0..kMaxTopLogprobs alternatives
  float temperature = 1.0f;  // < 1e-5: greedy
  int32_t top_k = 0;         // <= 0 or >= cols: all
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  uint64_t seed = 0, counter = 0;
};
struct SampleParams {
  int64_t rows = 0, cols = 0;
  const float* logits = nullptr;               // [rows, cols] contiguous, device
  const SampleRowParams* row_params = nullptr;  // [rows] device
  int32_t* ids = nullptr;  // [rows] device: the sampled id; -1 for a row holding a NaN or +inf, or nothing above -inf
  int64_t ctas = 0;        // CTAs walking the rows; 0: one per row
  int64_t candidate_capacity = 0;  // tokens compacted into shared memory; 0: the most (8,192); tests force the
                                   // other paths with small values
  cudaStream_t stream = nullptr;
};
cudaError_t run_sample(const SampleParams& params);

// Logprobs on the GPU, the host Sampler's fill_logprobs (engine/sampler.cpp) on the RAW logits (run before
// run_logit_adjustments): for each row r with row_params[r].logprobs = n >= 0, normaliser[r] = max + log(sum exp(l -
// max)) (max as float, the sum and log in double), and the n largest logits, ties to the lower id, as top_ids[r *
// kMaxTopLogprobs + j] and float(l - normaliser) in top_logprobs (ids -1 past the row's length). One CTA per row,
// three passes: the maximum, the sum with a count histogram over value bins, and the bins holding the n largest
// compacted into shared memory and sorted (a boundary bin holding more than fit: n passes of a block-wide maximum).
inline constexpr int kMaxTopLogprobs = 20;  // engine/sampling_params.h kMaxLogprobs
struct LogprobsParams {
  int64_t rows = 0, cols = 0;
  const float* logits = nullptr;               // [rows, cols] device, raw
  const SampleRowParams* row_params = nullptr;  // [rows] device
  double* normaliser = nullptr;                 // [rows] device (rows without logprobs: untouched)
  int32_t* top_ids = nullptr;                   // [rows][kMaxTopLogprobs] device
  float* top_logprobs = nullptr;                // [rows][kMaxTopLogprobs] device
  int64_t candidate_capacity = 0;               // as SampleParams' (tests force the fallback with 1)
  cudaStream_t stream = nullptr;
};
cudaError_t run_logprobs(const LogprobsParams& params);


// logit_bias and the penalties, in place, before run_sample: the host Sampler's process_logits (engine/sampler.cpp)
// per listed (row, token), in its order and float arithmetic (no contraction): l += bias; then with a repetition
// penalty r != 1, l = l > 0 ? l / r : l * r; then for a token in the output, l -= frequency (the host's
// frequency_penalty * count product); l -= presence; each step saturating a finite logit at +-FLT_MAX as the host's
// saturate_logit. Entries name distinct (row, token) pairs.
struct LogitAdjustment {
  int32_t row = 0, token = 0;
  float bias = 0.0f;        // added when has_bias (already clamped to [-100, 100])
  float repetition = 1.0f;  // applied when != 1 (the token is in the prompt or the output)
  float frequency = 0.0f;   // subtracted when in_output
  float presence = 0.0f;    // subtracted when in_output
  uint8_t has_bias = 0, in_output = 0;
};
struct LogitAdjustmentParams {
  int64_t count = 0, rows = 0, cols = 0;
  float* logits = nullptr;                     // [rows, cols] device, updated in place
  const LogitAdjustment* adjustments = nullptr;  // [count] device
  float* original = nullptr;  // optional [count] device: each entry's logit before it (run_chosen_logprobs)
  cudaStream_t stream = nullptr;
};
cudaError_t run_logit_adjustments(const LogitAdjustmentParams& params);

// After run_sample: chosen[r] = float(raw logit of ids[r] - normaliser[r]) for rows with logprobs >= 0 (NaN where
// ids[r] < 0), the raw logit read from `original` where an adjustment (row r, token ids[r]) changed it.
struct ChosenLogprobParams {
  int64_t rows = 0, cols = 0, count = 0;  // count: adjustments
  const float* logits = nullptr;          // [rows, cols] device, adjusted in place
  const SampleRowParams* row_params = nullptr;
  const int32_t* ids = nullptr;
  const double* normaliser = nullptr;
  const LogitAdjustment* adjustments = nullptr;  // [count] device
  const float* original = nullptr;                      // [count] device: run_logit_adjustments' `original`
  float* chosen = nullptr;                              // [rows] device
  cudaStream_t stream = nullptr;
};
cudaError_t run_chosen_logprobs(const ChosenLogprobParams& params);

}  // namespace deepinfer::kernels::cuda
