// DeepSeek-V4's kernels (include/deepinfer/kernels/cuda/v4_ops.h). Straightforward first versions: one CTA or warp
// per row / entry, float32 arithmetic on CUDA cores; the attention shares each key tile among 4 heads of a row.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "deepinfer/kernels/cuda/v4_ops.h"

namespace deepinfer::kernels::cuda {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float ld(const uint16_t* p) { return __bfloat162float(*reinterpret_cast<const bf16*>(p)); }
__device__ __forceinline__ void st(uint16_t* p, float v) { *reinterpret_cast<bf16*>(p) = __float2bfloat16(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the CTA (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ float block_sum(float v, float* smem32) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem32[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += smem32[w];
  return total;
}

// ---- mHC ----

constexpr int kMaxHc = 8;

// mix value o of row r: the sum of its p.mix_splits partial dot products, in order.
__device__ __forceinline__ float mix_value(const V4HcPreParams& p, int64_t r, int mix, int o) {
  const float* part = p.mixes + (r * mix + o) * p.mix_splits;
  double v = 0.0;
  for (int s = 0; s < p.mix_splits; ++s) v += part[s];
  return static_cast<float>(v);
}

// Grid (rows, column chunks of y): every CTA derives the mix (pre) itself; chunk 0 also writes post and comb.
__global__ void hc_pre_kernel(V4HcPreParams p) {
  __shared__ float red[32];
  __shared__ float pre[kMaxHc];
  const int64_t r = blockIdx.x;
  const int hc = static_cast<int>(p.hc);
  const int64_t n = p.hc * p.d;
  const uint16_t* x = p.x + r * p.x_stride;
  float total = 0.0f;
  if (p.sumsq != nullptr) {  // the mixes kernel's partial sums of squares, in order
    double v = 0.0;
    for (int s = 0; s < p.mix_splits; ++s) v += p.sumsq[r * p.mix_splits + s];
    total = static_cast<float>(v);
  } else {
    float sq = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = ld(x + i);
      sq += v * v;
    }
    total = block_sum(sq, red);
  }
  const bool first_chunk = blockIdx.y == 0;
  // float: the CPU reference's double agrees to ~1e-7 here (gpu_check_backend)
  const float rs = static_cast<float>(1.0 / sqrt(static_cast<double>(total) / static_cast<double>(n) + p.norm_eps));
  const int mix = p.head ? hc : (2 + hc) * hc;
  const float eps = static_cast<float>(p.hc_eps);
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < hc) {
    const int j = threadIdx.x;
    pre[j] = 1.0f / (1.0f + __expf(-(mix_value(p, r, mix, j) * rs * p.scale[0] + p.base[j]))) + eps;
    if (!p.head && first_chunk) {
      p.post[r * p.post_stride + j] =
          2.0f / (1.0f + __expf(-(mix_value(p, r, mix, hc + j) * rs * p.scale[1] + p.base[hc + j])));
    }
  }
  if (!first_chunk) {
    // pre only
  } else if (!p.head && hc == 4 && threadIdx.x < 32) {
    // The 4x4 Sinkhorn on warp 0, lane i * 4 + j holding entry (i, j): row sums over lanes xor 1, 2, column sums over
    // lanes xor 4, 8 (lanes 16..31 compute on zeros among themselves).
    const bool mine = lane < 16;
    const int i = lane / 4, j = lane % 4;
    float v = mine ? mix_value(p, r, mix, 2 * hc + i * hc + j) * rs * p.scale[2] + p.base[2 * hc + i * hc + j] : 0.0f;
    auto sum_over = [](float value, int a, int b) {
      value += __shfl_xor_sync(0xffffffffu, value, a);
      return value + __shfl_xor_sync(0xffffffffu, value, b);
    };
    float mx = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    v = __expf(v - mx);
    v = v / sum_over(v, 1, 2) + eps;  // row softmax + eps
    for (int it = 0; it < p.sinkhorn_iters; ++it) {
      if (it > 0) v = v / (sum_over(v, 1, 2) + eps);
      v = v / (sum_over(v, 4, 8) + eps);
    }
    if (mine) p.comb[r * p.comb_stride + lane] = v;
  } else if (!p.head && threadIdx.x == 0) {  // any other hc (<= 8): one thread
    float cm[kMaxHc * kMaxHc];
    for (int i = 0; i < hc; ++i) {
      float mx = -INFINITY;
      for (int j = 0; j < hc; ++j) {
        cm[i * hc + j] = mix_value(p, r, mix, 2 * hc + i * hc + j) * rs * p.scale[2] + p.base[2 * hc + i * hc + j];
        mx = fmaxf(mx, cm[i * hc + j]);
      }
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += (cm[i * hc + j] = __expf(cm[i * hc + j] - mx));
      for (int j = 0; j < hc; ++j) cm[i * hc + j] = cm[i * hc + j] / s + eps;
    }
    for (int it = 0; it < p.sinkhorn_iters; ++it) {
      if (it > 0) {
        for (int i = 0; i < hc; ++i) {
          float s = 0.0f;
          for (int j = 0; j < hc; ++j) s += cm[i * hc + j];
          for (int j = 0; j < hc; ++j) cm[i * hc + j] /= s + eps;
        }
      }
      for (int j = 0; j < hc; ++j) {
        float s = 0.0f;
        for (int i = 0; i < hc; ++i) s += cm[i * hc + j];
        for (int i = 0; i < hc; ++i) cm[i * hc + j] /= s + eps;
      }
    }
    for (int k = 0; k < hc * hc; ++k) p.comb[r * p.comb_stride + k] = cm[k];
  }
  __syncthreads();
  const int64_t per_chunk = (p.d + gridDim.y - 1) / gridDim.y;
  const int64_t k_end = min(p.d, (blockIdx.y + 1) * per_chunk);
  for (int64_t k = blockIdx.y * per_chunk + threadIdx.x; k < k_end; k += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < hc; ++j) acc += pre[j] * ld(x + j * p.d + k);
    st(p.y + r * p.y_stride + k, acc);
  }
}

// mixes[r][o] = Σ_i x[r][i] · fn[o][i]: one CTA per (row, output), products summed in double per thread.
__global__ void mixes_kernel(V4MixesParams p) {
  __shared__ double red[32];
  const int64_t r = blockIdx.x, o = blockIdx.y, split = blockIdx.z;
  const uint16_t* x = p.x + r * p.x_stride;
  const float* w = p.fn + o * p.fn_stride;
  const int64_t per_split = (p.cols + p.splits - 1) / p.splits;
  const int64_t begin = split * per_split, end = min(p.cols, begin + per_split);
  double acc = 0.0, sq = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = ld(x + i);
    acc += v * w[i];
    sq += v * v;
  }
  if (o == 0 && p.sumsq != nullptr) {  // the row's sum of squares over this range, for hc_pre
    __shared__ double red_sq[32];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    if (threadIdx.x % 32 == 0) red_sq[threadIdx.x / 32] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int k = 0; k < static_cast<int>(blockDim.x / 32); ++k) total += red_sq[k];
      p.sumsq[r * p.splits + split] = static_cast<float>(total);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int k = 0; k < static_cast<int>(blockDim.x / 32); ++k) total += red[k];
    p.mixes[(r * p.outputs + o) * p.splits + split] = static_cast<float>(total);
  }
}

template <int HC>
__global__ void hc_post_kernel(V4HcPostParams p, int64_t chunks) {
  __shared__ float post[HC], comb[HC * HC];
  const int64_t r = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  if (threadIdx.x < HC) post[threadIdx.x] = p.post[r * p.post_stride + threadIdx.x];
  if (threadIdx.x < HC * HC) comb[threadIdx.x] = p.comb[r * p.comb_stride + threadIdx.x];
  __syncthreads();
  uint16_t* x = p.x + r * p.x_stride;
  const int64_t per_chunk = (p.d + chunks - 1) / chunks, end = min(p.d, (chunk + 1) * per_chunk);
  for (int64_t k = chunk * per_chunk + threadIdx.x; k < end; k += blockDim.x) {
    float in[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) in[i] = ld(x + i * p.d + k);
    const float o = ld(p.out + r * p.out_stride + k);
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      float acc = post[j] * o;
#pragma unroll
      for (int i = 0; i < HC; ++i) acc += comb[i * HC + j] * in[i];
      st(x + j * p.d + k, acc);
    }
  }
}

// ---- per-row norm and rotary ----

constexpr int kNormRopeWarps = 4;

__global__ void norm_rope_kernel(V4NormRopeParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kNormRopeWarps + threadIdx.x / 32;
  if (r >= p.rows) return;  // warp-uniform
  uint16_t* x = p.x + r * p.stride;
  const int64_t n = p.cols, R = p.inv_freq != nullptr ? p.rope_dim : 0;
  float inv = 1.0f;
  if (p.norm) {
    float sq = 0.0f;
    for (int64_t i = lane; i < n; i += 32) {
      const float v = ld(x + i);
      sq += v * v;
    }
    sq = warp_sum(sq);
    inv = static_cast<float>(1.0 / sqrt(static_cast<double>(sq) / static_cast<double>(n) + p.eps));
  }
  auto scaled = [&](int64_t i) {
    float v = ld(x + i);
    if (p.norm) v *= inv;
    if (p.norm && p.weight != nullptr) v *= p.weight[i];
    return v;
  };
  float pair[2][2];  // this lane's rope pairs (R / 2 <= 64: two per lane), read before any write
  int64_t position = 0;
  if (R > 0) {
    position = p.positions[r / p.vectors_per_position];
    for (int q = 0; q < 2; ++q) {
      const int64_t i = lane + 32 * q;
      if (i < R / 2) {
        pair[q][0] = scaled(n - R + 2 * i);
        pair[q][1] = scaled(n - R + 2 * i + 1);
      }
    }
  }
  if (p.norm) {
    for (int64_t i = lane; i < n - R; i += 32) st(x + i, scaled(i));
  }
  for (int q = 0; q < 2 && R > 0; ++q) {
    const int64_t i = lane + 32 * q;
    if (i >= R / 2) continue;
    double s, c;
    sincos(static_cast<double>(position) * p.inv_freq[i], &s, &c);
    if (p.inverse) s = -s;
    const double a = pair[q][0], b = pair[q][1];
    st(x + n - R + 2 * i, static_cast<float>(a * c - b * s));
    st(x + n - R + 2 * i + 1, static_cast<float>(a * s + b * c));
  }
}

// ---- compressors ----

constexpr int kCompressThreads = 256;

struct RowSource {
  const V4CompressParams& p;
  const V4CompressWorkDevice& w;
  int64_t width;
  __device__ float kv(int64_t position, int64_t c) const {
    if (position >= w.start) return ld(p.kv + (w.row_first + position - w.start) * p.kv_stride + c);
    return ld(w.ring_kv + (position % (2 * p.ratio)) * width + c);
  }
  __device__ float score(int64_t position, int64_t c) const {
    if (position >= w.start) {
      return ld(p.score + (w.row_first + position - w.start) * p.score_stride + c) + p.ape[(position % p.ratio) * width + c];
    }
    return ld(w.ring_score + (position % (2 * p.ratio)) * width + c);
  }
};

__global__ void __launch_bounds__(kCompressThreads) compress_kernel(V4CompressParams p) {
  __shared__ float entry[1024];
  __shared__ float red[32];
  const V4CompressEntry e = p.entries[blockIdx.x];
  const V4CompressWorkDevice& w = p.work[e.work];
  const int64_t m = p.ratio, dim = p.dim, j = e.j;
  const RowSource src{p, w, p.coff * dim};
  const bool previous = p.coff == 2 && j > 0;
  float sq = 0.0f;
  for (int64_t ch = threadIdx.x; ch < dim; ch += blockDim.x) {
    const int64_t own = p.coff == 2 ? dim + ch : ch;
    float mx = -INFINITY;
    for (int64_t t = 0; t < m; ++t) {
      mx = fmaxf(mx, src.score(j * m + t, own));
      if (previous) mx = fmaxf(mx, src.score((j - 1) * m + t, ch));
    }
    float sum = 0.0f, acc = 0.0f;
    for (int64_t t = 0; t < m; ++t) {
      const float a = __expf(src.score(j * m + t, own) - mx);
      sum += a;
      acc += a * src.kv(j * m + t, own);
      if (previous) {
        const float b = __expf(src.score((j - 1) * m + t, ch) - mx);
        sum += b;
        acc += b * src.kv((j - 1) * m + t, ch);
      }
    }
    entry[ch] = acc / sum;
    sq += entry[ch] * entry[ch];
  }
  const float total = block_sum(sq, red);  // synchronizes: entry[] complete
  const float inv = static_cast<float>(1.0 / sqrt(static_cast<double>(total) / static_cast<double>(dim) + p.eps));
  uint16_t* out = w.entries + j * dim;
  const int64_t R = p.rope_dim;
  for (int64_t ch = threadIdx.x; ch < dim - R; ch += blockDim.x) st(out + ch, entry[ch] * inv * p.norm[ch]);
  for (int64_t i = threadIdx.x; i < R / 2; i += blockDim.x) {
    const int64_t c0 = dim - R + 2 * i;
    const double a = entry[c0] * inv * p.norm[c0], b = entry[c0 + 1] * inv * p.norm[c0 + 1];
    double s, c;
    sincos(static_cast<double>(j * m) * p.inv_freq[i], &s, &c);
    st(out + c0, static_cast<float>(a * c - b * s));
    st(out + c0 + 1, static_cast<float>(a * s + b * c));
  }
}

__global__ void compress_rows_kernel(V4CompressParams p) {
  const V4CompressRowTask task = p.tasks[blockIdx.x];
  const V4CompressWorkDevice& w = p.work[task.work];
  const int64_t width = p.coff * p.dim;
  const RowSource src{p, w, width};
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    st(task.kv_dst + c, src.kv(task.position, c));
    st(task.score_dst + c, src.score(task.position, c));
  }
}

// ---- lightning indexer ----

constexpr int kIndexerThreads = 256, kIndexerKeysPerCta = 16;

__global__ void __launch_bounds__(kIndexerThreads) indexer_scores_kernel(V4IndexerParams p) {
  extern __shared__ float smem[];  // q [heads * dim], then weights [heads]
  const int64_t r = blockIdx.x;
  const V4IndexRowDevice row = p.row_keys[r];
  if (row.visible <= p.topk) return;
  const int64_t s0 = static_cast<int64_t>(blockIdx.y) * kIndexerKeysPerCta;
  if (s0 >= row.visible) return;
  const int64_t H = p.heads, D = p.dim;
  float* q = smem;
  float* wt = smem + H * D;
  for (int64_t i = threadIdx.x; i < H * D; i += blockDim.x) q[i] = ld(p.q + r * p.q_stride + i);
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    wt[h] = static_cast<float>(ld(p.weights + r * p.weights_stride + h) * p.weight_scale);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t s = s0 + warp; s < s0 + kIndexerKeysPerCta && s < row.visible; s += warps) {
    const uint16_t* k = row.keys + s * D;
    float key[8];  // D <= 256: lane holds dims lane + 32 i
    const int per_lane = static_cast<int>((D + 31) / 32);
    for (int i = 0; i < per_lane && i < 8; ++i) {
      const int64_t c = lane + 32 * i;
      key[i] = c < D ? ld(k + c) : 0.0f;
    }
    float score = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      float dot = 0.0f;
      for (int i = 0; i < per_lane && i < 8; ++i) {
        const int64_t c = lane + 32 * i;
        if (c < D) dot += q[h * D + c] * key[i];
      }
      dot = warp_sum(dot);
      score += fmaxf(dot, 0.0f) * wt[h];
    }
    if (lane == 0) p.scores[r * p.max_visible + s] = score;
  }
}

// Order-preserving key of a float: larger float, larger key.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kSelectThreads = 1024;

// Per row: the topk largest scores (equal: lower index first) by a 4-pass radix select, then the ties in index order.
__global__ void __launch_bounds__(kSelectThreads) indexer_select_kernel(V4IndexerParams p) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int histogram[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ int s_remaining, s_written, s_ties_taken;
  const int64_t r = blockIdx.x;
  const int64_t visible = p.row_keys[r].visible;
  if (visible <= p.topk) return;
  const float* scores = p.scores + r * p.max_visible;
  int32_t* ids = p.ids + r * p.topk;
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_remaining = static_cast<int>(p.topk);
    s_written = 0;
    s_ties_taken = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    for (int64_t s = threadIdx.x; s < visible; s += blockDim.x) {
      const uint32_t key = order_key(scores[s]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int remaining = s_remaining;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (histogram[digit] >= remaining) break;
        remaining -= histogram[digit];
      }
      s_remaining = remaining;
      s_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
      s_mask = mask | (0xffu << shift);
    }
    __syncthreads();
  }
  const uint32_t threshold = s_prefix;
  const int ties = s_remaining;  // how many of the keys equal to threshold are taken (the lowest indices)
  for (int64_t base = 0; base < visible; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    uint32_t key = 0;
    if (s < visible) key = order_key(scores[s]);
    const int tie = (s < visible && key == threshold) ? 1 : 0;
    int rank = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(tie, rank, total);
    const int taken_before = s_ties_taken;
    if (s < visible && key > threshold) ids[atomicAdd(&s_written, 1)] = static_cast<int32_t>(s);
    if (tie && taken_before + rank < ties) ids[atomicAdd(&s_written, 1)] = static_cast<int32_t>(s);
    __syncthreads();
    if (threadIdx.x == 0) s_ties_taken = taken_before + total;
    __syncthreads();
  }
}

// ---- sparse attention with sinks ----

constexpr int kAttnHeads = 4;  // heads per CTA = warps per CTA
constexpr int kAttnThreads = 32 * kAttnHeads;
constexpr int kAttnKeys = 32;  // keys per tile

struct KeySource {
  const V4AttentionParams& p;
  const V4AttentionRowDevice& row;
  int64_t t, window_keys;
  __device__ const uint16_t* key(int64_t kk) const {
    if (kk < window_keys) {
      const int64_t s = row.window_first + kk;
      if (s >= row.step_start) return p.kv + (row.row_first + s - row.step_start) * p.kv_stride;
      return row.ring + (s % p.window) * p.head_dim;
    }
    const int64_t i = kk - window_keys;
    const int64_t entry = row.indexed ? p.ids[t * p.topk + i] : i;
    return row.entries + entry * p.head_dim;
  }
};

__global__ void __launch_bounds__(kAttnThreads) attention_kernel(V4AttentionParams p) {
  extern __shared__ float smem[];
  const int64_t D = p.head_dim;
  float* q = smem;                                   // [4][D]
  uint16_t* keys = reinterpret_cast<uint16_t*>(q + kAttnHeads * D);  // [32][D] bf16
  __shared__ float prob[kAttnHeads][kAttnKeys];
  __shared__ float alpha[kAttnHeads], running_max[kAttnHeads], running_sum[kAttnHeads];
  const int64_t t = blockIdx.x, h0 = static_cast<int64_t>(blockIdx.y) * kAttnHeads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const V4AttentionRowDevice row = p.row_keys[t];
  const int64_t window_keys = row.position - row.window_first + 1;
  const int64_t total = window_keys + row.entry_count;
  // This CTA's share of the keys (split z of p.splits).
  const int64_t split = blockIdx.z, per_split = (total + p.splits - 1) / p.splits;
  const int64_t k_begin = min(total, split * per_split), k_end = min(total, k_begin + per_split);
  const KeySource src{p, row, t, window_keys};
  for (int64_t i = threadIdx.x; i < kAttnHeads * D; i += blockDim.x) q[i] = ld(p.q + t * p.q_stride + h0 * D + i);
  if (threadIdx.x < kAttnHeads) {
    // The sink, once (split 0): a key of value 0 and score sink.
    running_max[threadIdx.x] = split == 0 ? p.sinks[h0 + threadIdx.x] : -INFINITY;
    running_sum[threadIdx.x] = split == 0 ? 1.0f : 0.0f;
  }
  // Accumulation: thread i owns dims i, i + 128, ... (at most 8) of all 4 heads.
  float acc[kAttnHeads][8];
#pragma unroll
  for (int h = 0; h < kAttnHeads; ++h)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  __syncthreads();
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kAttnKeys) {
    const int64_t n = k_end - k0 < kAttnKeys ? k_end - k0 : kAttnKeys;
    // Load the tile's keys (16-byte chunks).
    const int64_t chunks = D / 8;
    for (int64_t i = threadIdx.x; i < n * chunks; i += blockDim.x) {
      const int64_t k = i / chunks, c = i % chunks;
      reinterpret_cast<uint4*>(keys + k * D)[c] = reinterpret_cast<const uint4*>(src.key(k0 + k))[c];
    }
    __syncthreads();
    // Scores: warp w computes head w's scores of the tile's keys.
    {
      const float* qh = q + warp * D;
      for (int64_t k = 0; k < kAttnKeys; ++k) {
        float dot = 0.0f;
        if (k < n) {
          for (int64_t c = lane; c < D; c += 32) dot += qh[c] * __bfloat162float(reinterpret_cast<const bf16*>(keys)[k * D + c]);
        }
        dot = warp_sum(dot);
        if (lane == k) prob[warp][k] = k < n ? dot * p.scale : -INFINITY;
      }
      __syncwarp();
      const float v = prob[warp][lane];
      const float m_old = running_max[warp];
      const float m_new = fmaxf(m_old, warp_max(v));
      const float e = lane < n ? __expf(v - m_new) : 0.0f;
      const float tile_sum = warp_sum(e);
      prob[warp][lane] = e;
      __syncwarp();
      if (lane == 0) {
        const float a = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        alpha[warp] = a;
        running_sum[warp] = running_sum[warp] * a + tile_sum;
        running_max[warp] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < kAttnHeads; ++h) {
      const float a = alpha[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= a;
    }
    for (int64_t k = 0; k < n; ++k) {
      const bf16* kr = reinterpret_cast<const bf16*>(keys) + k * D;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t c = threadIdx.x + kAttnThreads * i;
        if (c >= D) break;
        const float kv = __bfloat162float(kr[c]);
#pragma unroll
        for (int h = 0; h < kAttnHeads; ++h) acc[h][i] += prob[h][k] * kv;
      }
    }
    __syncthreads();
  }
  if (p.splits == 1) {
#pragma unroll
    for (int h = 0; h < kAttnHeads; ++h) {
      const float inv = 1.0f / running_sum[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t c = threadIdx.x + kAttnThreads * i;
        if (c < D) st(p.out + t * p.out_stride + (h0 + h) * D + c, acc[h][i] * inv);
      }
    }
    return;
  }
  // Split: the unnormalized sums and (max, sum) of this share, for attention_combine_kernel.
#pragma unroll
  for (int h = 0; h < kAttnHeads; ++h) {
    const int64_t part = ((t * p.heads + h0 + h) * p.splits + split);
    float* out = p.partial_acc + part * D;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t c = threadIdx.x + kAttnThreads * i;
      if (c < D) out[c] = acc[h][i];
    }
    if (threadIdx.x == 0) {
      p.partial_ml[2 * part] = running_max[h];
      p.partial_ml[2 * part + 1] = running_sum[h];
    }
  }
}

// Merges the splits of every (row, head): out = Σ_s e^(m_s - M) acc_s / Σ_s e^(m_s - M) l_s.
__global__ void attention_combine_kernel(V4AttentionParams p) {
  const int64_t t = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int64_t base = (t * p.heads + h) * p.splits;
  float M = -INFINITY;
  for (int s = 0; s < p.splits; ++s) M = fmaxf(M, p.partial_ml[2 * (base + s)]);
  float L = 0.0f;
  for (int s = 0; s < p.splits; ++s) {
    const float m = p.partial_ml[2 * (base + s)];
    if (m != -INFINITY) L += __expf(m - M) * p.partial_ml[2 * (base + s) + 1];
  }
  const float inv = 1.0f / L;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
      const float m = p.partial_ml[2 * (base + s)];
      if (m != -INFINITY) sum += __expf(m - M) * p.partial_acc[(base + s) * D + c];
    }
    st(p.out + t * p.out_stride + h * D + c, sum * inv);
  }
}

// ---- copies, SwiGLU ----

__global__ void copy_spans_kernel(const CopySpanDevice* spans) {
  const CopySpanDevice s = spans[blockIdx.x];
  const uintptr_t a = reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) | s.bytes;
  if ((a & 15) == 0) {
    for (uint64_t i = threadIdx.x; i < s.bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(s.dst)[i] = reinterpret_cast<const uint4*>(s.src)[i];
  } else if ((a & 1) == 0) {
    for (uint64_t i = threadIdx.x; i < s.bytes / 2; i += blockDim.x)
      reinterpret_cast<uint16_t*>(s.dst)[i] = reinterpret_cast<const uint16_t*>(s.src)[i];
  } else {
    for (uint64_t i = threadIdx.x; i < s.bytes; i += blockDim.x)
      reinterpret_cast<uint8_t*>(s.dst)[i] = reinterpret_cast<const uint8_t*>(s.src)[i];
  }
}

__global__ void silu_mul_clamped_kernel(const uint16_t* gate_up, int64_t gate_up_stride, uint16_t* out,
                                        int64_t out_stride, int64_t n, float limit) {
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float g = ld(gate_up + r * gate_up_stride + i), u = ld(gate_up + r * gate_up_stride + n + i);
    if (limit > 0.0f) {
      u = fminf(fmaxf(u, -limit), limit);
      g = fminf(g, limit);
    }
    st(out + r * out_stride + i, g / (1.0f + __expf(-g)) * u);
  }
}

}  // namespace

cudaError_t run_v4_hc_pre(const V4HcPreParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.hc < 1 || p.hc > kMaxHc) return cudaErrorInvalidValue;
  const unsigned chunks = p.rows <= 64 ? static_cast<unsigned>(std::max<int64_t>(1, (p.d + 1023) / 1024)) : 1u;
  hc_pre_kernel<<<dim3(static_cast<unsigned>(p.rows), chunks), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_mixes(const V4MixesParams& p) {
  if (p.rows <= 0 || p.outputs <= 0) return cudaSuccess;
  if (p.outputs > 65535 || p.splits < 1 || p.splits > 64) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.outputs), static_cast<unsigned>(p.splits));
  mixes_kernel<<<grid, 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_hc_post(const V4HcPostParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.hc < 1 || p.hc > kMaxHc) return cudaErrorInvalidValue;
  const int64_t chunks = (p.d + 1023) / 1024;  // 1,024 columns per CTA
  const unsigned blocks = static_cast<unsigned>(p.rows * chunks);
  switch (p.hc) {
#define DEEPINFER_HC_POST(n) \
  case n:                    \
    hc_post_kernel<n><<<blocks, 256, 0, p.stream>>>(p, chunks); \
    break;
    DEEPINFER_HC_POST(1)
    DEEPINFER_HC_POST(2)
    DEEPINFER_HC_POST(3)
    DEEPINFER_HC_POST(4)
    DEEPINFER_HC_POST(5)
    DEEPINFER_HC_POST(6)
    DEEPINFER_HC_POST(7)
    DEEPINFER_HC_POST(8)
#undef DEEPINFER_HC_POST
  }
  return cudaGetLastError();
}

cudaError_t run_v4_norm_rope(const V4NormRopeParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.inv_freq != nullptr && (p.rope_dim % 2 != 0 || p.rope_dim > 128 || p.rope_dim > p.cols))
    return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((p.rows + kNormRopeWarps - 1) / kNormRopeWarps);
  norm_rope_kernel<<<blocks, kNormRopeWarps * 32, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_compress(const V4CompressParams& p) {
  if (p.num_entries <= 0) return cudaSuccess;
  if (p.dim > 1024 || p.rope_dim > p.dim) return cudaErrorInvalidValue;
  compress_kernel<<<static_cast<unsigned>(p.num_entries), kCompressThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_compress_rows(const V4CompressParams& p) {
  if (p.num_tasks <= 0) return cudaSuccess;
  compress_rows_kernel<<<static_cast<unsigned>(p.num_tasks), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_indexer_topk(const V4IndexerParams& p) {
  if (p.rows <= 0 || p.max_visible <= p.topk) return cudaSuccess;
  if (p.dim > 256 || p.heads * p.dim > 16384 || p.topk <= 0) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(p.heads * p.dim + p.heads) * sizeof(float);
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(indexer_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess)
      return e;
  }
  const dim3 grid(static_cast<unsigned>(p.rows),
                  static_cast<unsigned>((p.max_visible + kIndexerKeysPerCta - 1) / kIndexerKeysPerCta));
  indexer_scores_kernel<<<grid, kIndexerThreads, smem, p.stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  indexer_select_kernel<<<static_cast<unsigned>(p.rows), kSelectThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_v4_attention(const V4AttentionParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.heads % kAttnHeads != 0 || p.head_dim % 8 != 0 || p.head_dim > 8 * kAttnThreads) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(kAttnHeads * p.head_dim) * sizeof(float) +
                      static_cast<size_t>(kAttnKeys * p.head_dim) * sizeof(uint16_t);
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess)
      return e;
  }
  if (p.splits < 1 || p.splits > 64 || (p.splits > 1 && (p.partial_acc == nullptr || p.partial_ml == nullptr)))
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.heads / kAttnHeads),
                  static_cast<unsigned>(p.splits));
  attention_kernel<<<grid, kAttnThreads, smem, p.stream>>>(p);
  if (p.splits > 1) {
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    attention_combine_kernel<<<dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.heads)), 128, 0, p.stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t run_copy_spans(const CopySpanDevice* spans, int64_t count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  copy_spans_kernel<<<static_cast<unsigned>(count), 256, 0, stream>>>(spans);
  return cudaGetLastError();
}

cudaError_t run_silu_mul_clamped(const uint16_t* gate_up, int64_t gate_up_stride, uint16_t* out, int64_t out_stride,
                                 int64_t rows, int64_t n, float limit, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  silu_mul_clamped_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(gate_up, gate_up_stride, out, out_stride, n,
                                                                           limit);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
