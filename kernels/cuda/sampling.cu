// Sampling on the GPU (contracts in include/deepinfer/kernels/cuda/sampling.h). Greedy: one CTA per row, each thread
// scans a strided slice keeping (best value, lowest index), then a shared-memory tree reduction with the same rule.
// Sampled: one CTA of 1024 threads per row; the passes over the row are coalesced (thread t reads t, t + 1024, ...)
// except where id order matters (the tie cutoffs and the draw), where warp w owns a contiguous id range and walks it
// 32 ids at a time.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include <cooperative_groups.h>

#include "deepinfer/kernels/cuda/sampling.h"

namespace deepinfer::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

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


// ---- sampled rows -----------------------------------------------------------------------------------------------

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kBins = 256;
constexpr float kGreedyBelow = 1e-5f;  // engine/sampling_params.h kGreedyTemperature

constexpr int kValueBins = 2048;           // the histogram pass's bins, linear in value (2 per thread)
constexpr int kMaxCandidates = 8192;       // values compacted into shared memory (64-bit keys)

struct SampleShared {
  union {
    double hist[kSampleWarps][kBins];  // the radix fallback's per-warp histograms (counts or masses)
    uint64_t candidates[kMaxCandidates];  // compacted (order key, id) keys, see desc_key / id_key
  };
  double bin_mass[kValueBins];
  uint32_t bin_count[kValueBins];
  double bins[kBins];
  double warp_sum[kSampleWarps];
  int warp_count[kSampleWarps];
  int warp_last[kSampleWarps];
  float best_value[kSampleWarps];
  int best_index[kSampleWarps];
  float low_value[kSampleWarps];
  double before;
  uint32_t prefix;
  int chosen;  // a bin, a warp or an id; -1: none
  int last;
  int found_bin, last_bin, upto;  // locate_bin's results
  int count;                       // compacted values
  double walked;                   // walk_candidates: the cumulative weight through the hit
};

// An unsigned key in the order of the float values (-0 and +0 the same key, as they compare equal).
__device__ __forceinline__ uint32_t ordered_key(float v) {
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// engine/sampler.cpp's philox4x32_10 and philox_uniform, bit for bit.
__device__ double philox_uniform(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1, n3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  const uint64_t bits = (static_cast<uint64_t>(c1) << 32) | c0;
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

__device__ __forceinline__ double warp_sum(double x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Radix selection: over the ids with weight(i, v) > 0, ordered by value from the largest, the value at which the
// cumulative weight first reaches `target` (the bin walk: before + bin >= target). Returns false when it never does
// (target above the total); else the value's key and `before`, the weight of the larger values.
template <class Weight>
__device__ bool radix_select(const float* row, int cols, Weight weight, double target, SampleShared& sh,
                             uint32_t& key, double& before) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  uint32_t prefix = 0, mask = 0;
  before = 0.0;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int j = static_cast<int>(threadIdx.x); j < kSampleWarps * kBins; j += kSampleThreads)
      (&sh.hist[0][0])[j] = 0.0;
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < cols; i += kSampleThreads) {
      const float v = row[i];
      const double w = weight(i, v);
      if (!(w > 0.0)) continue;
      const uint32_t k = ordered_key(v);
      if ((k & mask) != prefix) continue;
      atomicAdd(&sh.hist[warp][(k >> shift) & 0xffu], w);
    }
    __syncthreads();
    if (threadIdx.x < kBins) {
      double b = 0.0;
      for (int w = 0; w < kSampleWarps; ++w) b += sh.hist[w][threadIdx.x];
      sh.bins[threadIdx.x] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1, lowest = -1;
      double acc = before, before_lowest = before;
      for (int b = kBins - 1; b >= 0; --b) {
        if (sh.bins[b] > 0.0 && acc + sh.bins[b] >= target) {
          chosen = b;
          break;
        }
        if (sh.bins[b] > 0.0) {
          lowest = b;
          before_lowest = acc;
        }
        acc += sh.bins[b];
      }
      // Past the first pass the crossing lies inside this prefix's bin: when the sub-bins, summed in another order,
      // fall just short of the target, the crossing is at the prefix's smallest value.
      if (chosen < 0 && pass > 0 && lowest >= 0) {
        chosen = lowest;
        acc = before_lowest;
      }
      sh.chosen = chosen;
      sh.before = acc;
      sh.prefix = chosen < 0 ? 0u : prefix | (static_cast<uint32_t>(chosen) << shift);
    }
    __syncthreads();
    const bool found = sh.chosen >= 0;
    prefix = sh.prefix;
    before = sh.before;
    mask |= 0xffu << shift;
    __syncthreads();  // sh.chosen / prefix / before read by all before the next pass's thread 0 writes them
    if (!found) return false;
  }
  key = prefix;
  return true;
}

// ---- passes over a row ----

// f(i, v) for every value of the row; the loads coalesced (thread t takes float4 t, t + 1024, ...) and four float4 in
// flight per thread. Each thread meets its ids in ascending order.
template <class F>
__device__ __forceinline__ void for_each_value(const float* row, int cols, F f) {
  const int t = static_cast<int>(threadIdx.x);
  const int head = min(cols, static_cast<int>((16 - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / 4);
  if (t < head) f(t, row[t]);
  const float4* body = reinterpret_cast<const float4*>(row + head);
  const int quads = (cols - head) / 4;
  auto apply = [&](int q, float4 x) {
    const int i = head + 4 * q;
    f(i, x.x);
    f(i + 1, x.y);
    f(i + 2, x.z);
    f(i + 3, x.w);
  };
  int q = t;
  for (; q + 3 * kSampleThreads < quads; q += 4 * kSampleThreads) {
    const float4 a = __ldg(body + q), b = __ldg(body + q + kSampleThreads), c = __ldg(body + q + 2 * kSampleThreads),
                 d = __ldg(body + q + 3 * kSampleThreads);
    apply(q, a);
    apply(q + kSampleThreads, b);
    apply(q + 2 * kSampleThreads, c);
    apply(q + 3 * kSampleThreads, d);
  }
  for (; q < quads; q += kSampleThreads) apply(q, __ldg(body + q));
  for (int i = head + 4 * quads + t; i < cols; i += kSampleThreads) f(i, row[i]);
}

// Thread t's contiguous range of the row, [t * L, min(cols, (t + 1) * L)), L a multiple of 4: the walks in id order.
__device__ __forceinline__ int range_length(int cols) {
  return ((cols + kSampleThreads - 1) / kSampleThreads + 3) / 4 * 4;
}

// f(i, v) over this thread's range in ascending id order (float4 loads, four in flight, when the row is aligned).
template <class F>
__device__ __forceinline__ void for_each_in_range(const float* row, int cols, F f) {
  const int length = range_length(cols), begin = static_cast<int>(threadIdx.x) * length;
  const int end = min(cols, begin + length);
  int i = begin;
  if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
    for (; i + 16 <= end; i += 16) {
      const float4* q = reinterpret_cast<const float4*>(row + i);
      const float4 a = __ldg(q), b = __ldg(q + 1), c = __ldg(q + 2), d = __ldg(q + 3);
      f(i, a.x), f(i + 1, a.y), f(i + 2, a.z), f(i + 3, a.w);
      f(i + 4, b.x), f(i + 5, b.y), f(i + 6, b.z), f(i + 7, b.w);
      f(i + 8, c.x), f(i + 9, c.y), f(i + 10, c.z), f(i + 11, c.w);
      f(i + 12, d.x), f(i + 13, d.y), f(i + 14, d.z), f(i + 15, d.w);
    }
  }
  for (; i < end; ++i) f(i, row[i]);
}

// In ascending id order, the first id with value(i, v) > 0 whose cumulative value (inclusive) reaches the threshold
// (>=; > when `strict`); the threshold is fraction * total when `fraction` >= 0 (total: the sum of value over the
// row), else `threshold`. One pass: each thread sums its range in id order, a block scan gives each range's prefix,
// and the thread whose range crosses walks it again from the same partial sums (so it finds the crossing). -1 when
// no range crosses; `last` gets the largest id with a positive value (-1: none) and `total` the sum.
template <class Value>
__device__ int first_reaching(const float* row, int cols, Value value, double threshold, double fraction, bool strict,
                              SampleShared& sh, int& last, double& total) {
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  double mine = 0.0;
  int my_last = -1;
  for_each_in_range(row, cols, [&](int i, float v) {
    const double x = value(i, v);
    mine += x;
    if (x > 0.0) my_last = i;
  });
  double c = mine;  // inclusive scan over the warp
  for (int o = 1; o < 32; o *= 2) {
    const double y = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) c += y;
  }
  if (lane == 31) sh.warp_sum[warp] = c;
  if (t == 0) {
    sh.chosen = INT_MAX;
    sh.last = -1;
  }
  __syncthreads();
  double prefix = c - mine, sum = 0.0;
  for (int w = 0; w < kSampleWarps; ++w) {
    if (w < warp) prefix += sh.warp_sum[w];
    sum += sh.warp_sum[w];
  }
  if (fraction >= 0.0) threshold = fraction * sum;
  if (mine > 0.0 && (strict ? prefix + mine > threshold : prefix + mine >= threshold)) atomicMin(&sh.chosen, t);
  if (my_last >= 0) atomicMax(&sh.last, my_last);
  __syncthreads();
  const int chosen = sh.chosen;
  if (t == chosen) {
    double partial = 0.0;
    int found = -1;
    const int length = range_length(cols), begin = t * length, end = min(cols, begin + length);
    for (int i = begin; i < end && found < 0; ++i) {
      const double x = value(i, row[i]);
      partial += x;
      if (x > 0.0 && (strict ? prefix + partial > threshold : prefix + partial >= threshold)) found = i;
    }
    sh.before = prefix;
    sh.prefix = static_cast<uint32_t>(found < 0 ? my_last : found);
  }
  __syncthreads();
  const int result = chosen == INT_MAX ? -1 : static_cast<int>(sh.prefix);
  last = sh.last;
  total = sum;
  __syncthreads();  // sh.chosen / last / prefix read by all before they are reused
  return result;
}

// ---- value bins and candidates in shared memory ----

// The float back from ordered_key (a bijection but for -0, which comes back as +0).
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) != 0 ? (k & 0x7fffffffu) : ~k);
}
// desc_key ascending is the host sampler's "more likely" order: the larger value first, then the lower id.
__device__ __forceinline__ uint64_t desc_key(float v, int i) {
  return (static_cast<uint64_t>(~ordered_key(v)) << 32) | static_cast<uint32_t>(i);
}
__device__ __forceinline__ float desc_value(uint64_t k) { return key_value(~static_cast<uint32_t>(k >> 32)); }
__device__ __forceinline__ int desc_id(uint64_t k) { return static_cast<int>(static_cast<uint32_t>(k)); }
// id_key ascending is the id order (the draw's).
__device__ __forceinline__ uint64_t id_key(float v, int i) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(i)) << 32) | ordered_key(v);
}
__device__ __forceinline__ float id_value(uint64_t k) { return key_value(static_cast<uint32_t>(k)); }
__device__ __forceinline__ int id_id(uint64_t k) { return static_cast<int>(k >> 32); }
constexpr uint64_t kNoCandidate = ~uint64_t{0};  // sorts last

// Bins linear in value from the row's maximum (bin 0) down to its smallest finite value (the last bin). Monotone: a
// larger value is never in a later bin, so the bins up to any bin hold a most-likely prefix of the row.
struct ValueBins {
  float hi, scale;
  __device__ __forceinline__ int operator()(float v) const {
    const float t = (hi - v) * scale;  // >= 0; NaN only for -inf, which no weight keeps
    return t < static_cast<float>(kValueBins) ? static_cast<int>(t) : kValueBins - 1;
  }
};

// One pass: per value bin, the count and (with_mass) the summed weight of the ids with weight(i, v) > 0.
template <class Weight>
__device__ void value_histogram(const float* row, int cols, Weight weight, ValueBins bins, bool with_mass,
                                SampleShared& sh) {
  for (int j = static_cast<int>(threadIdx.x); j < kValueBins; j += kSampleThreads) {
    sh.bin_mass[j] = 0.0;
    sh.bin_count[j] = 0u;
  }
  __syncthreads();
  for_each_value(row, cols, [&](int i, float v) {
    const double w = weight(i, v);
    if (!(w > 0.0)) return;
    const int b = bins(v);
    atomicAdd(&sh.bin_count[b], 1u);
    if (with_mass) atomicAdd(&sh.bin_mass[b], w);
  });
  __syncthreads();
}

// Over value_histogram's bins, from the top: the first bin whose inclusive cumulative measure reaches the target
// (by_mass: the masses and top_p * their total; else the counts and count_target). When rounding leaves every bin
// short (masses), the last bin with a positive mass. Returns the bin (-1: none: fewer counted than count_target)
// and sets `before` (the measure of the bins above it), `upto` (the count through it) and `total` (the whole
// measure). Every thread gets the results.
__device__ int locate_bin(bool by_mass, double count_target, float top_p, SampleShared& sh, double& before, int& upto,
                          double& total) {
  static_assert(kValueBins == 2 * kSampleThreads, "two bins per thread");
  const int t = static_cast<int>(threadIdx.x), warp = t / 32, lane = t % 32;
  const int b0 = 2 * t, b1 = b0 + 1;
  const int c0 = static_cast<int>(sh.bin_count[b0]), c1 = static_cast<int>(sh.bin_count[b1]);
  const double m0 = by_mass ? sh.bin_mass[b0] : c0, m1 = by_mass ? sh.bin_mass[b1] : c1;
  double m = m0 + m1;
  int c = c0 + c1;
  for (int o = 1; o < 32; o *= 2) {  // inclusive scans over the warp's lanes
    const double y = __shfl_up_sync(0xffffffffu, m, o);
    const int z = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) {
      m += y;
      c += z;
    }
  }
  double excl = __shfl_up_sync(0xffffffffu, m, 1);
  int cexcl = __shfl_up_sync(0xffffffffu, c, 1);
  if (lane == 0) {
    excl = 0.0;
    cexcl = 0;
  }
  if (lane == 31) {
    sh.warp_sum[warp] = m;
    sh.warp_count[warp] = c;
  }
  if (t == 0) {
    sh.found_bin = INT_MAX;
    sh.last_bin = -1;
  }
  __syncthreads();
  double base = 0.0;
  int cbase = 0;
  total = 0.0;
  for (int w = 0; w < kSampleWarps; ++w) {
    if (w < warp) {
      base += sh.warp_sum[w];
      cbase += sh.warp_count[w];
    }
    total += sh.warp_sum[w];
  }
  const double target = by_mass ? static_cast<double>(top_p) * total : count_target;
  const double excl0 = base + excl, incl0 = excl0 + m0, incl1 = incl0 + m1;
  if (m0 > 0.0 && incl0 >= target) {
    atomicMin(&sh.found_bin, b0);
  } else if (m1 > 0.0 && incl1 >= target) {
    atomicMin(&sh.found_bin, b1);
  }
  if (m1 > 0.0) {
    atomicMax(&sh.last_bin, b1);
  } else if (m0 > 0.0) {
    atomicMax(&sh.last_bin, b0);
  }
  __syncthreads();
  int bin = sh.found_bin;
  if (bin == INT_MAX) bin = by_mass ? sh.last_bin : -1;
  if (bin >= 0 && (bin == b0 || bin == b1)) {
    sh.before = bin == b0 ? excl0 : incl0;
    sh.upto = cbase + cexcl + c0 + (bin == b1 ? c1 : 0);
  }
  __syncthreads();
  before = sh.before;
  upto = sh.upto;
  __syncthreads();  // sh.before / upto / found_bin read by all before they are reused
  return bin;
}

// Appends desc_key(v, i) of every id with keep(i, v) to sh.candidates (in no order; the first `capacity`). Returns
// how many ids were kept (more than `capacity`: the candidates are incomplete).
template <class Keep>
__device__ int compact(const float* row, int cols, Keep keep, int capacity, SampleShared& sh) {
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for_each_value(row, cols, [&](int i, float v) {
    if (!keep(i, v)) return;
    const cg::coalesced_group group = cg::coalesced_threads();  // one shared atomic per warp's kept values
    int base = 0;
    if (group.thread_rank() == 0) base = atomicAdd(&sh.count, static_cast<int>(group.size()));
    const int position = group.shfl(base, 0) + static_cast<int>(group.thread_rank());
    if (position < capacity) sh.candidates[position] = desc_key(v, i);
  });
  __syncthreads();
  const int n = sh.count;
  __syncthreads();
  return n;
}

// Sorts sh.candidates[0, n) ascending (bitonic, over the next power of two, the padding kNoCandidate); n <=
// kMaxCandidates.
__device__ void sort_candidates(int n, SampleShared& sh) {
  int size = 2;
  while (size < n) size *= 2;
  for (int j = n + static_cast<int>(threadIdx.x); j < size; j += kSampleThreads) sh.candidates[j] = kNoCandidate;
  __syncthreads();
  for (int k = 2; k <= size; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int i = static_cast<int>(threadIdx.x); i < size; i += kSampleThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const uint64_t a = sh.candidates[i], b = sh.candidates[partner];
          if ((a > b) == ((i & k) == 0)) {
            sh.candidates[i] = b;
            sh.candidates[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// The sum of weight(key) over sh.candidates[0, n); every thread gets it.
template <class Weight>
__device__ double candidates_total(int n, Weight weight, SampleShared& sh) {
  double s = 0.0;
  for (int j = static_cast<int>(threadIdx.x); j < n; j += kSampleThreads) s += weight(sh.candidates[j]);
  s = warp_sum(s);
  if (threadIdx.x % 32 == 0) sh.warp_sum[threadIdx.x / 32] = s;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kSampleWarps; ++w) total += sh.warp_sum[w];
  __syncthreads();
  return total;
}

// Warp 0 walks sh.candidates[0, n) in order: the first index with weight(key) > 0 whose cumulative weight from
// `start` (inclusive) reaches `target` (>=; > when strict); when rounding leaves it short, the last index with a
// positive weight (-1: none). `walked` gets the cumulative weight through the returned index. Every thread gets both.
template <class Weight>
__device__ int walk_candidates(int n, Weight weight, double start, double target, bool strict, SampleShared& sh,
                               double& walked) {
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    double base = start, at = start, at_last = start;
    int result = -1, last = -1;
    for (int chunk = 0; chunk < n; chunk += 32) {
      const int j = chunk + lane;
      const double x = j < n ? weight(sh.candidates[j]) : 0.0;
      double c = x;
      for (int o = 1; o < 32; o *= 2) {
        const double y = __shfl_up_sync(0xffffffffu, c, o);
        if (lane >= o) c += y;
      }
      const unsigned hits = __ballot_sync(0xffffffffu, x > 0.0 && (strict ? base + c > target : base + c >= target));
      if (hits != 0u) {
        const int l = __ffs(static_cast<int>(hits)) - 1;
        result = chunk + l;
        at = base + __shfl_sync(0xffffffffu, c, l);
        break;
      }
      const unsigned positive = __ballot_sync(0xffffffffu, x > 0.0);
      if (positive != 0u) {
        const int l = 31 - __clz(static_cast<int>(positive));
        last = chunk + l;
        at_last = base + __shfl_sync(0xffffffffu, c, l);
      }
      base += __shfl_sync(0xffffffffu, c, 31);
    }
    if (result < 0) {
      result = last;
      at = at_last;
    }
    if (lane == 0) {
      sh.chosen = result;
      sh.walked = at;
    }
  }
  __syncthreads();
  const int result = sh.chosen;
  walked = sh.walked;
  __syncthreads();
  return result;
}

// One row of sample_kernel (every exit is taken by the whole CTA).
//
// Top-k and top-p each take one histogram pass over value bins (value_histogram, locate_bin). When every token up to
// the crossing bin fits in shared memory (a top-k set, a peaked row's nucleus), those tokens are compacted and sorted
// and the rest - the cut, min-p and the draw - runs on them. Else only the crossing bin is compacted and sorted, which
// gives the cut's (value, id), and the draw takes a pass over the row. A crossing bin with more tokens than fit (mass
// ties) falls back to radix selection on the logits' bits.
__device__ void sample_row(const SampleParams& p, int64_t r, SampleShared& sh) {
  const int cols = static_cast<int>(p.cols);
  const float* row = p.logits + r * p.cols;
  const SampleRowParams rp = p.row_params[r];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int capacity = p.candidate_capacity > 0 ? static_cast<int>(p.candidate_capacity < kMaxCandidates ? p.candidate_capacity : kMaxCandidates)
                                                 : kMaxCandidates;

  // The maximum and its lowest id, and the smallest finite value; a NaN or +inf anywhere, or no finite value, makes
  // the row -1.
  float best = -INFINITY, low = INFINITY;
  int best_i = -1;
  bool bad = false;
  for_each_value(row, cols, [&](int i, float v) {  // ascending ids per thread: the first of equal values stays
    bad = bad || isnan(v) || v == INFINITY;
    if (v > best) {
      best = v;
      best_i = i;
    }
    if (v != -INFINITY) low = fminf(low, v);
  });
  if (__syncthreads_or(bad)) {
    if (threadIdx.x == 0) p.ids[r] = -1;
    return;
  }
  for (int o = 16; o > 0; o /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, o);
    low = fminf(low, __shfl_xor_sync(0xffffffffu, low, o));
    if (i >= 0 && (v > best || (v == best && (best_i < 0 || i < best_i)))) {
      best = v;
      best_i = i;
    }
  }
  if (lane == 0) {
    sh.best_value[warp] = best;
    sh.best_index[warp] = best_i;
    sh.low_value[warp] = low;
  }
  __syncthreads();
  best = -INFINITY;
  best_i = -1;
  low = INFINITY;
  for (int w = 0; w < kSampleWarps; ++w) {
    const float v = sh.best_value[w];
    const int i = sh.best_index[w];
    low = fminf(low, sh.low_value[w]);
    if (i >= 0 && (v > best || (v == best && (best_i < 0 || i < best_i)))) {
      best = v;
      best_i = i;
    }
  }
  __syncthreads();
  if (best_i < 0 || rp.temperature < kGreedyBelow) {
    if (threadIdx.x == 0) p.ids[r] = best_i;
    return;
  }
  const float max_logit = best;
  const float inverse_temperature = 1.0f / rp.temperature;
  auto weight_of = [&](float v) -> double {
    return v == -INFINITY ? 0.0 : static_cast<double>(expf((v - max_logit) * inverse_temperature));
  };
  auto desc_weight = [&](uint64_t key) { return weight_of(desc_value(key)); };
  float scale = max_logit > low ? static_cast<float>(kValueBins) / (max_logit - low) : 0.0f;
  if (!isfinite(scale)) scale = 0.0f;  // a range that overflows (every value then in bin 0) or is subnormal
  const ValueBins bins{max_logit, scale};
  int n = -1;  // >= 0: sh.candidates[0, n), in desc_key order, are every token that top-k and top-p keep

  // Top-k: the k-th token in the "more likely" order (by count).
  const bool top_k = rp.top_k >= 1 && rp.top_k < cols;
  bool cut_by_k = false;
  uint32_t key_k = 0;
  int cut_k = cols;
  if (top_k) {
    auto finite = [](int, float v) { return v == -INFINITY ? 0.0 : 1.0; };
    value_histogram(row, cols, finite, bins, false, sh);
    double before = 0.0, total = 0.0;
    int upto = 0;
    const int b = locate_bin(false, static_cast<double>(rp.top_k), 1.0f, sh, before, upto, total);
    if (b >= 0) {  // else fewer than k finite tokens: every one is kept
      cut_by_k = true;
      const int in_bin = static_cast<int>(sh.bin_count[b]);
      if (upto <= capacity) {
        const int m = compact(row, cols, [&](int, float v) { return v != -INFINITY && bins(v) <= b; }, capacity, sh);
        sort_candidates(min(m, capacity), sh);
        n = min(rp.top_k, min(m, capacity));
      } else if (in_bin <= capacity) {
        const int m = compact(row, cols, [&](int, float v) { return v != -INFINITY && bins(v) == b; }, capacity, sh);
        sort_candidates(min(m, capacity), sh);
        const int j = min(min(m, capacity) - 1, max(0, rp.top_k - static_cast<int>(before) - 1));
        const uint64_t key = sh.candidates[j];
        key_k = ordered_key(desc_value(key));
        cut_k = desc_id(key);
        __syncthreads();  // the key read by all before the candidates are reused
      } else {  // radix selection, then the ties' id cut by a walk in id order
        double larger = 0.0;
        radix_select(
            row, cols, [](int, float v) { return v == -INFINITY ? 0.0 : 1.0; }, static_cast<double>(rp.top_k), sh,
            key_k, larger);
        int ignored = 0;
        double sum = 0.0;
        const int found = first_reaching(
            row, cols, [&](int, float v) { return v != -INFINITY && ordered_key(v) == key_k ? 1.0 : 0.0; },
            static_cast<double>(rp.top_k) - larger, -1.0, false, sh, ignored, sum);
        cut_k = found < 0 ? cols : found;
      }
    }
  }
  auto keep_k = [&](int i, float v) {
    if (v == -INFINITY) return false;
    if (!cut_by_k) return true;
    const uint32_t k = ordered_key(v);
    return k > key_k || (k == key_k && i <= cut_k);
  };

  // Top-p over the top-k set: the token where the mass from the top reaches top_p * total.
  const bool top_p = rp.top_p < 1.0f;
  bool cut_by_p = false;
  uint32_t key_p = 0;
  int cut_p = cols;
  if (n >= 0) {
    if (top_p) {
      const double total = candidates_total(n, desc_weight, sh);
      double walked = 0.0;
      const int j = walk_candidates(n, desc_weight, 0.0, static_cast<double>(rp.top_p) * total, false, sh, walked);
      if (j >= 0) n = j + 1;
    }
  } else if (top_p) {
    auto mass = [&](int i, float v) { return keep_k(i, v) ? weight_of(v) : 0.0; };
    value_histogram(row, cols, mass, bins, true, sh);
    double before = 0.0, total = 0.0;
    int upto = 0;
    const int b = locate_bin(true, 0.0, rp.top_p, sh, before, upto, total);
    const double target = static_cast<double>(rp.top_p) * total;
    if (b >= 0) {
      const int in_bin = static_cast<int>(sh.bin_count[b]);
      double walked = 0.0;
      if (upto <= capacity) {
        const int m = compact(row, cols, [&](int i, float v) { return bins(v) <= b && mass(i, v) > 0.0; }, capacity,
                              sh);
        sort_candidates(min(m, capacity), sh);
        const int j = walk_candidates(min(m, capacity), desc_weight, 0.0, target, false, sh, walked);
        n = j + 1;
      } else if (in_bin <= capacity) {
        const int m = compact(row, cols, [&](int i, float v) { return bins(v) == b && mass(i, v) > 0.0; }, capacity,
                              sh);
        sort_candidates(min(m, capacity), sh);
        const int j = walk_candidates(min(m, capacity), desc_weight, before, target, false, sh, walked);
        if (j >= 0) {
          const uint64_t key = sh.candidates[j];
          key_p = ordered_key(desc_value(key));
          cut_p = desc_id(key);
          cut_by_p = true;
        }
        __syncthreads();
      } else {
        double larger = 0.0;
        cut_by_p = radix_select(row, cols, mass, target, sh, key_p, larger);
        if (cut_by_p) {
          int ignored = 0;
          double sum = 0.0;
          const int found = first_reaching(
              row, cols, [&](int i, float v) { return keep_k(i, v) && ordered_key(v) == key_p ? weight_of(v) : 0.0; },
              target - larger, -1.0, false, sh, ignored, sum);
          cut_p = found < 0 ? cols : found;
        }
      }
    }
  }
  const double min_p = rp.min_p;
  const double u = philox_uniform(rp.seed, rp.counter);
  int token = -1;
  if (n >= 0) {
    // Min-p, then the draw over the candidates in id order.
    for (int j = static_cast<int>(threadIdx.x); j < n; j += kSampleThreads) {
      const uint64_t key = sh.candidates[j];
      const float v = desc_value(key);
      const double w = weight_of(v);
      sh.candidates[j] = w > 0.0 && !(min_p > 0.0 && w < min_p) ? id_key(v, desc_id(key)) : kNoCandidate;
    }
    __syncthreads();
    sort_candidates(n, sh);
    auto id_weight = [&](uint64_t key) { return key == kNoCandidate ? 0.0 : weight_of(id_value(key)); };
    const double total = candidates_total(n, id_weight, sh);
    double walked = 0.0;
    const int j = walk_candidates(n, id_weight, 0.0, u * total, true, sh, walked);
    token = j >= 0 ? id_id(sh.candidates[j]) : best_i;
  } else {
    auto kept_weight = [&](int i, float v) -> double {
      if (!keep_k(i, v)) return 0.0;
      if (cut_by_p) {
        const uint32_t k = ordered_key(v);
        if (k < key_p || (k == key_p && i > cut_p)) return 0.0;
      }
      const double w = weight_of(v);
      return min_p > 0.0 && w < min_p ? 0.0 : w;
    };
    // The draw: u * total, the first kept id whose cumulative weight in id order exceeds it.
    int last = -1;
    double total = 0.0;
    token = first_reaching(row, cols, kept_weight, 0.0, u, true, sh, last, total);
    if (token < 0) token = last >= 0 ? last : best_i;  // u * total rounded up to total: the last positive weight
  }
  if (threadIdx.x == 0) p.ids[r] = token;
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(SampleParams p) {
  extern __shared__ __align__(16) uint8_t sample_smem[];
  SampleShared& sh = *reinterpret_cast<SampleShared*>(sample_smem);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    sample_row(p, r, sh);
    __syncthreads();  // the shared state is free for the next row
  }
}

// ---- logprobs -----------------------------------------------------------------------------------------------------

constexpr int kLogprobThreads = 1024;
constexpr int kLogprobWarps = kLogprobThreads / 32;

// (v, i) after (pv, pi) in the order of the top list: larger first, then the lower id. pi < 0: everything is after.
__device__ __forceinline__ bool after(float v, int i, float pv, int pi) {
  return pi < 0 || v < pv || (v == pv && i > pi);
}
// (v, i) before (bv, bi) in that order; bi < 0: nothing yet.
__device__ __forceinline__ bool ahead(float v, int i, float bv, int bi) {
  return bi < 0 || v > bv || (v == bv && i < bi);
}

// One CTA per row (rows in turn): the maximum and the smallest finite value; then one pass for the normaliser's sum
// and a count histogram over value bins; the bins holding the `want` largest values are compacted into shared memory
// and sorted (larger first, then the lower id). A boundary bin with more values than fit (ties by the thousand) falls
// back to one block-wide arg-max pass per alternative.
__global__ void __launch_bounds__(kLogprobThreads) logprobs_kernel(LogprobsParams p) {
  static_assert(kLogprobThreads == kSampleThreads, "the sampling helpers stride by kSampleThreads");
  extern __shared__ __align__(16) uint8_t logprobs_smem[];
  SampleShared& sh = *reinterpret_cast<SampleShared*>(logprobs_smem);
  const int cols = static_cast<int>(p.cols);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int want = min(p.row_params[r].logprobs, kMaxTopLogprobs);
    if (want < 0) continue;
    const float* row = p.logits + r * p.cols;
    float m = -INFINITY, low = INFINITY;
    for_each_value(row, cols, [&](int, float v) {
      m = fmaxf(m, v);
      if (v != -INFINITY && !isnan(v)) low = fminf(low, v);
    });
    for (int o = 16; o > 0; o /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      low = fminf(low, __shfl_xor_sync(0xffffffffu, low, o));
    }
    if (lane == 0) {
      sh.best_value[warp] = m;
      sh.low_value[warp] = low;
    }
    for (int j = static_cast<int>(threadIdx.x); j < kValueBins; j += kSampleThreads) sh.bin_count[j] = 0u;
    __syncthreads();
    m = -INFINITY;
    low = INFINITY;
    for (int w = 0; w < kLogprobWarps; ++w) {
      m = fmaxf(m, sh.best_value[w]);
      low = fminf(low, sh.low_value[w]);
    }
    float scale = m > low ? static_cast<float>(kValueBins) / (m - low) : 0.0f;
    if (!isfinite(scale)) scale = 0.0f;
    const ValueBins bins{m, scale};
    double sum = 0.0;
    for_each_value(row, cols, [&](int, float v) {
      sum += exp(static_cast<double>(v) - static_cast<double>(m));
      if (want > 0 && !isnan(v)) atomicAdd(&sh.bin_count[bins(v)], 1u);
    });
    sum = warp_sum(sum);
    if (lane == 0) sh.warp_sum[warp] = sum;
    __syncthreads();
    sum = 0.0;
    for (int w = 0; w < kLogprobWarps; ++w) sum += sh.warp_sum[w];
    const double normaliser = static_cast<double>(m) + log(sum);
    if (threadIdx.x == 0) p.normaliser[r] = normaliser;
    __syncthreads();  // sh.warp_sum read by all before locate_bin reuses it
    auto write = [&](int j, int id, float value) {
      p.top_ids[r * kMaxTopLogprobs + j] = id;
      p.top_logprobs[r * kMaxTopLogprobs + j] =
          id < 0 ? 0.0f : static_cast<float>(static_cast<double>(value) - normaliser);
    };
    bool done = want == 0;
    if (want > 0) {
      double before = 0.0, counted = 0.0;
      int upto = 0;
      int b = locate_bin(false, static_cast<double>(want), 1.0f, sh, before, upto, counted);
      if (b < 0) upto = static_cast<int>(counted);  // fewer than `want` values: every one
      const int capacity = p.candidate_capacity > 0 && p.candidate_capacity < kMaxCandidates
                               ? static_cast<int>(p.candidate_capacity)
                               : kMaxCandidates;
      if (upto <= capacity) {
        const int n = compact(
            row, cols, [&](int, float v) { return !isnan(v) && (b < 0 || bins(v) <= b); }, capacity, sh);
        sort_candidates(n, sh);
        if (threadIdx.x < static_cast<unsigned>(kMaxTopLogprobs)) {
          const int j = static_cast<int>(threadIdx.x);
          if (j < want && j < n) {
            write(j, desc_id(sh.candidates[j]), desc_value(sh.candidates[j]));
          } else {
            write(j, -1, 0.0f);
          }
        }
        done = true;
      }
    }
    float prev = 0.0f;
    int prev_i = -1;
    bool exhausted = false;  // fewer than `want` values in the row (not NaN)
    for (int j = 0; j < kMaxTopLogprobs; ++j) {
      if (done) {
        if (want == 0 && threadIdx.x == 0) write(j, -1, 0.0f);
        continue;
      }
      if (j >= want || exhausted) {
        if (threadIdx.x == 0) write(j, -1, 0.0f);
        continue;
      }
      float best = 0.0f;
      int best_i = -1;
      for (int i = static_cast<int>(threadIdx.x); i < cols; i += kLogprobThreads) {
        const float v = row[i];
        if (after(v, i, prev, prev_i) && !isnan(v) && ahead(v, i, best, best_i)) {
          best = v;
          best_i = i;
        }
      }
      for (int o = 16; o > 0; o /= 2) {
        const float v = __shfl_xor_sync(0xffffffffu, best, o);
        const int i = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (i >= 0 && ahead(v, i, best, best_i)) {
          best = v;
          best_i = i;
        }
      }
      __syncthreads();  // the previous round's warp results are read
      if (lane == 0) {
        sh.best_value[warp] = best;
        sh.best_index[warp] = best_i;
      }
      __syncthreads();
      best_i = -1;
      for (int w = 0; w < kLogprobWarps; ++w) {
        if (sh.best_index[w] >= 0 && ahead(sh.best_value[w], sh.best_index[w], best, best_i)) {
          best = sh.best_value[w];
          best_i = sh.best_index[w];
        }
      }
      if (threadIdx.x == 0) write(j, best_i, best);
      prev = best;
      prev_i = best_i;
      exhausted = best_i < 0;
    }
    __syncthreads();  // shared values are free for the next row
  }
}

__global__ void chosen_logprob_kernel(ChosenLogprobParams p) {
  __shared__ int found;
  const int64_t r = blockIdx.x;
  if (p.row_params[r].logprobs < 0) return;
  const int id = p.ids[r];
  if (threadIdx.x == 0) found = -1;
  __syncthreads();
  if (id >= 0) {
    for (int64_t i = threadIdx.x; i < p.count; i += blockDim.x) {
      if (p.adjustments[i].row == r && p.adjustments[i].token == id) found = static_cast<int>(i);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (id < 0) {
    p.chosen[r] = NAN;
    return;
  }
  const float raw = found >= 0 ? p.original[found] : p.logits[r * p.cols + id];
  p.chosen[r] = static_cast<float>(static_cast<double>(raw) - p.normaliser[r]);
}

__global__ void logit_adjustments_kernel(LogitAdjustmentParams p) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const LogitAdjustment a = p.adjustments[i];
    if (a.row < 0 || a.row >= p.rows || a.token < 0 || a.token >= p.cols) __trap();
    float& slot = p.logits[static_cast<int64_t>(a.row) * p.cols + a.token];
    // Each step saturates as the host's saturate_logit: a finite logit pushed past the float range becomes +-FLT_MAX.
    auto saturate = [](float before, float after) {
      return isfinite(before) && isinf(after) ? (after > 0.0f ? FLT_MAX : -FLT_MAX) : after;
    };
    float l = slot;
    if (p.original != nullptr) p.original[i] = l;
    if (a.has_bias) l = saturate(l, __fadd_rn(l, a.bias));
    if (a.repetition != 1.0f) l = saturate(l, l > 0.0f ? __fdiv_rn(l, a.repetition) : __fmul_rn(l, a.repetition));
    if (a.in_output) {
      l = saturate(l, __fsub_rn(l, a.frequency));
      l = saturate(l, __fsub_rn(l, a.presence));
    }
    slot = l;
  }
}

}  // namespace

cudaError_t run_argmax(const ArgmaxParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || p.cols > INT32_MAX || p.rows > INT32_MAX || !p.logits || !p.ids) return cudaErrorInvalidValue;
  argmax_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, p.stream>>>(p.logits, p.ids, p.top_probability,
                                                                         p.cols);
  return cudaGetLastError();
}

cudaError_t run_sample(const SampleParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || p.cols > INT32_MAX / 2 || p.rows > INT32_MAX || !p.logits || !p.row_params || !p.ids)
    return cudaErrorInvalidValue;
  const int smem = static_cast<int>(sizeof(SampleShared));
  cudaError_t err = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int64_t ctas = p.ctas > 0 ? std::min(p.rows, p.ctas) : p.rows;
  sample_kernel<<<static_cast<unsigned>(ctas), kSampleThreads, smem, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_logprobs(const LogprobsParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || p.cols > INT32_MAX / 2 || !p.logits || !p.row_params || !p.normaliser || !p.top_ids ||
      !p.top_logprobs)
    return cudaErrorInvalidValue;
  const int smem = static_cast<int>(sizeof(SampleShared));
  cudaError_t err = cudaFuncSetAttribute(logprobs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  logprobs_kernel<<<static_cast<unsigned>(p.rows), kLogprobThreads, smem, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_chosen_logprobs(const ChosenLogprobParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.cols <= 0 || !p.logits || !p.row_params || !p.ids || !p.normaliser || !p.chosen ||
      (p.count > 0 && (!p.adjustments || !p.original)))
    return cudaErrorInvalidValue;
  chosen_logprob_kernel<<<static_cast<unsigned>(p.rows), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_logit_adjustments(const LogitAdjustmentParams& p) {
  if (p.count <= 0) return cudaSuccess;
  if (p.rows <= 0 || p.cols <= 0 || !p.logits || !p.adjustments) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((p.count + 255) / 256, 4096);
  logit_adjustments_kernel<<<static_cast<unsigned>(blocks), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
