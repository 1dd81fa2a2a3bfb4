// DSpark's greedy heads on the GPU (contract in include/deepinfer/kernels/cuda/dspark_heads.h). Three kernels:
//   base_top: one CTA per row, the first index of the base row's largest value (independent of the chain);
//   markov_slices (per draft index k): CTAs (chain, slice of 1,024 entries) compute the chain's e = w1[previous]
//     and the bound, give the Markov term to the entries that pass it, and leave their slice's first largest value
//     (or a "whole row" flag);
//   markov_finish (per k): one CTA per chain reduces the slices, falls back to the whole row where the host would,
//     maps the index to an id, computes the confidence, and writes the draft that the next k reads as previous.
// Every Markov value is base + w2[0] e[0] + w2[1] e[1] + ... with each product and sum rounded on its own (no fused
// multiply-add), as the host's baseline x86-64 build computes it, so that the drafts match the host's.
#include <cfloat>
#include <climits>
#include <cmath>

#include "deepinfer/kernels/cuda/dspark_heads.h"

namespace deepinfer::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kSlice = 1024;  // entries per CTA of markov_slices (4 per thread: one wave of CTAs, short loops)

struct Partial {
  float value;
  int32_t index;  // -1: nothing in the slice passed
  int32_t whole;  // 1: the row must take every entry
};

int64_t slices_of(int64_t n) { return (n + kSlice - 1) / kSlice; }

__device__ __forceinline__ float markov_value(const float* __restrict__ base, const float* __restrict__ w2_rows,
                                              const float* e, int32_t rank, int64_t i) {
  float sum = base[i];
  const float* w = w2_rows + i * rank;
  for (int32_t j = 0; j < rank; ++j) sum = __fadd_rn(sum, __fmul_rn(w[j], e[j]));
  return sum;
}

// (v, i) beats (best, best_i): larger, or equal with a lower index; an index < 0 is nothing (never beats, always
// beaten). NaN never beats.
__device__ __forceinline__ bool beats(float v, int32_t i, float best, int32_t best_i) {
  if (i < 0 || isnan(v)) return false;
  return best_i < 0 || v > best || (v == best && i < best_i);
}

// The CTA's best (value, index) into thread 0's; `whole` OR-reduced.
__device__ void reduce_best(float& value, int32_t& index, int32_t& whole) {
  __shared__ float values[kThreads];
  __shared__ int32_t indices[kThreads];
  __shared__ int32_t wholes[kThreads];
  values[threadIdx.x] = value;
  indices[threadIdx.x] = index;
  wholes[threadIdx.x] = whole;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const int other = threadIdx.x + stride;
      if (beats(values[other], indices[other], values[threadIdx.x], indices[threadIdx.x])) {
        values[threadIdx.x] = values[other];
        indices[threadIdx.x] = indices[other];
      }
      wholes[threadIdx.x] |= wholes[other];
    }
    __syncthreads();
  }
  value = values[0];
  index = indices[0];
  whole = wholes[0];
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) base_top_kernel(DsparkGreedyParams p, int32_t* __restrict__ tops) {
  const int64_t row = blockIdx.x;
  const float* base = p.logits + row * p.n;
  float best = 0.0f;
  int32_t best_i = -1, unused = 0;
  for (int64_t i = threadIdx.x; i < p.n; i += kThreads) {  // ascending: a later equal value never replaces
    const float v = base[i];
    if (beats(v, static_cast<int32_t>(i), best, best_i)) {
      best = v;
      best_i = static_cast<int32_t>(i);
    }
  }
  reduce_best(best, best_i, unused);
  // The host's scan starts from entry 0: a NaN there leaves no maximum (-1: the whole row).
  if (threadIdx.x == 0) tops[row] = isnan(base[0]) ? -1 : best_i;
}

// The chain's previous id for draft k: the given one, then its own last draft (-1 after a failed row).
__device__ __forceinline__ int32_t previous_of(const DsparkGreedyParams& p, int64_t chain, int64_t k) {
  return k == 0 ? p.previous[chain] : p.drafts[chain * p.gamma + k - 1];
}

__device__ void load_e(const DsparkGreedyParams& p, int32_t previous, float* e) {
  for (int32_t j = threadIdx.x; j < p.rank; j += kThreads) e[j] = p.w1[static_cast<int64_t>(previous) * p.rank + j];
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) markov_slices_kernel(DsparkGreedyParams p, int64_t k,
                                                                 const int32_t* __restrict__ tops,
                                                                 Partial* __restrict__ partials) {
  const int64_t chain = blockIdx.y, slice = blockIdx.x, slices = gridDim.x;
  if (k >= p.lengths[chain]) return;
  const int32_t previous = previous_of(p, chain, k);
  if (previous < 0) return;  // the chain stopped; markov_finish writes -1
  const int64_t row = chain * p.gamma + k;
  const float* base = p.logits + row * p.n;
  __shared__ float e[kDsparkMaxRank];
  load_e(p, previous, e);
  const int32_t top = tops[row];
  bool prune = p.w2_norm != nullptr;
  int32_t whole = 0;
  float threshold = -INFINITY, e_norm_f = 0.0f;
  if (prune) {
    double e_norm = 0.0;
    for (int32_t j = 0; j < p.rank; ++j) e_norm = __dadd_rn(e_norm, __dmul_rn(e[j], e[j]));
    e_norm = __dmul_rn(sqrt(e_norm), 1.0 + 1e-6);
    const float floor_value = top < 0 ? NAN : markov_value(base, p.w2_rows, e, p.rank, top);
    if (top < 0 || !isfinite(base[top]) || !isfinite(floor_value) || !isfinite(e_norm)) {
      whole = 1;
    } else {
      e_norm_f = static_cast<float>(e_norm);
      // Each operation rounded on its own, as the host computes it (nvcc would fuse these into FMAs).
      const double floor_d = floor_value;
      const double reach = __dadd_rn(__dadd_rn(fabs(floor_d), fabs(static_cast<double>(base[top]))),
                                     __dmul_rn(static_cast<double>(p.w2_norm_max), e_norm));
      threshold = static_cast<float>(__dsub_rn(__dsub_rn(floor_d, __dmul_rn(1e-5, reach)), 1e-30));
    }
  }
  float best = 0.0f;
  int32_t best_i = -1;
  const int64_t end = min(p.n, (slice + 1) * kSlice);
  for (int64_t i = slice * kSlice + threadIdx.x; !whole && i < end; i += kThreads) {
    if (prune) {
      const float bound = __fadd_rn(base[i], __fmul_rn(p.w2_norm[i], e_norm_f));
      if (bound < threshold) continue;  // NaN and infinities fall through to the value
    }
    const float v = markov_value(base, p.w2_rows, e, p.rank, i);
    if (isnan(v)) {
      whole = 1;
      break;
    }
    if (beats(v, static_cast<int32_t>(i), best, best_i)) {
      best = v;
      best_i = static_cast<int32_t>(i);
    }
  }
  reduce_best(best, best_i, whole);
  if (threadIdx.x == 0) partials[chain * slices + slice] = Partial{best, best_i, whole};
}

__global__ void __launch_bounds__(kThreads) markov_finish_kernel(DsparkGreedyParams p, int64_t k, int64_t slices,
                                                                 const Partial* __restrict__ partials) {
  const int64_t chain = blockIdx.x;
  if (k >= p.lengths[chain]) return;
  const int64_t row = chain * p.gamma + k;
  const int32_t previous = previous_of(p, chain, k);
  if (previous < 0) {
    if (threadIdx.x == 0) p.drafts[row] = -1;
    return;
  }
  __shared__ float e[kDsparkMaxRank];
  load_e(p, previous, e);
  const float* base = p.logits + row * p.n;
  float best = 0.0f;
  int32_t best_i = -1, whole = 0;
  for (int64_t s = threadIdx.x; s < slices; s += kThreads) {
    const Partial part = partials[chain * slices + s];
    whole |= part.whole;
    if (beats(part.value, part.index, best, best_i)) {
      best = part.value;
      best_i = part.index;
    }
  }
  reduce_best(best, best_i, whole);
  if (whole || best_i < 0) {
    // The host's whole row: std::max_element over every value after the term (entry 0 first: a NaN there stays
    // the answer; later NaNs never win).
    best = 0.0f;
    best_i = -1;
    for (int64_t i = threadIdx.x; i < p.n; i += kThreads) {
      const float v = markov_value(base, p.w2_rows, e, p.rank, i);
      if (beats(v, static_cast<int32_t>(i), best, best_i)) {
        best = v;
        best_i = static_cast<int32_t>(i);
      }
    }
    int32_t unused = 0;
    reduce_best(best, best_i, unused);
    if (isnan(markov_value(base, p.w2_rows, e, p.rank, 0)) || best_i < 0) {
      best = NAN;
      best_i = 0;
    }
  }
  // The confidence: warp 0's double sums over [h ; e].
  if (threadIdx.x < 32) {
    const uint16_t* h = p.h + row * p.h_stride;
    double z = 0.0;
    for (int32_t j = threadIdx.x; j < p.hidden; j += 32) {
      const float hj = __uint_as_float(static_cast<uint32_t>(h[j]) << 16);
      z += static_cast<double>(p.confidence[j]) * hj;
    }
    for (int32_t j = threadIdx.x; j < p.rank; j += 32) z += static_cast<double>(p.confidence[p.hidden + j]) * e[j];
    for (int offset = 16; offset > 0; offset /= 2) z += __shfl_down_sync(0xffffffffu, z, offset);
    if (threadIdx.x == 0) {
      p.confidences[row] = 1.0 / (1.0 + exp(-z));
      // finish_argmax: -1 unless finite; the id; the ids outside the draft vocabulary hold 0.
      int32_t id = -1;
      if (isfinite(best)) {
        id = p.active != nullptr ? p.active[best_i] : best_i;
        if (p.active != nullptr && !(best > 0.0f) && p.outside < p.vocab) {
          id = best < 0.0f ? p.outside : min(id, p.outside);
        }
      }
      p.drafts[row] = id;
    }
  }
}

}  // namespace

size_t dspark_greedy_scratch_bytes(int64_t chains, int64_t gamma, int64_t n) {
  const size_t tops = static_cast<size_t>(chains * gamma) * sizeof(int32_t);
  return (tops + 15) / 16 * 16 + static_cast<size_t>(chains * slices_of(n)) * sizeof(Partial);
}

cudaError_t run_dspark_greedy_chains(const DsparkGreedyParams& p) {
  if (p.chains <= 0 || p.gamma <= 0) return cudaSuccess;
  if (p.n <= 0 || p.n > INT32_MAX || p.rank <= 0 || p.rank > kDsparkMaxRank || p.hidden <= 0 ||
      p.chains > 65535) {
    return cudaErrorInvalidValue;
  }
  const size_t tops_bytes = static_cast<size_t>(p.chains * p.gamma) * sizeof(int32_t);
  auto* tops = static_cast<int32_t*>(p.scratch);
  auto* partials = reinterpret_cast<Partial*>(static_cast<char*>(p.scratch) + (tops_bytes + 15) / 16 * 16);
  const int64_t slices = slices_of(p.n);
  base_top_kernel<<<static_cast<unsigned>(p.chains * p.gamma), kThreads, 0, p.stream>>>(p, tops);
  for (int64_t k = 0; k < p.gamma; ++k) {
    markov_slices_kernel<<<dim3(static_cast<unsigned>(slices), static_cast<unsigned>(p.chains)), kThreads, 0,
                           p.stream>>>(p, k, tops, partials);
    markov_finish_kernel<<<static_cast<unsigned>(p.chains), kThreads, 0, p.stream>>>(p, k, slices, partials);
  }
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
