// Fused per-row ops (RMSNorm with optional residual add, SiLU·mul, rope) and MoE routing + token permutation.
// Contracts in include/deepinfer/kernels/cuda/fused_ops.h; checked by tests/gpu/gpu_check_ops.cu.
#include "deepinfer/kernels/cuda/fused_ops.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "launch.cuh"

namespace deepinfer::kernels::cuda {

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float v) { return __float2bfloat16(v); }
// The value as the dtype stores it.
template <typename T>
__device__ __forceinline__ float round_trip(float v) { return to_f(from_f<T>(v)); }

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte access

template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&f)[kVec<T>]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) f[i] = to_f(e[i]);
}
template <typename T>
__device__ __forceinline__ void store16(T* p, const float (&f)[kVec<T>]) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) e[i] = from_f<T>(f[i]);
  *reinterpret_cast<uint4*>(p) = u;
}
// Half a 16-byte vector (8 bytes).
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&f)[kVec<T> / 2]) {
  uint2 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int i = 0; i < kVec<T> / 2; ++i) e[i] = from_f<T>(f[i]);
  *reinterpret_cast<uint2*>(p) = u;
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// ---- RMSNorm ----

// A row-norm kernel's second pass over the VPT vectors a thread holds (vector vi = threadIdx.x + j * blockDim.x):
// y_row = v * inv * weight, each rounded once to T.
template <typename T, int VPT>
__device__ __forceinline__ void scale_rows_vectors(float (&v)[VPT][kVec<T>], float inv, const T* __restrict__ weight,
                                                   T* y_row, int nvec) {
  constexpr int N = kVec<T>;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < nvec) {
      float w[N];
      load16(weight + static_cast<int64_t>(vi) * N, w);
#pragma unroll
      for (int i = 0; i < N; ++i) v[j][i] = v[j][i] * inv * w[i];
      store16(y_row + static_cast<int64_t>(vi) * N, v[j]);
    }
  }
}

// The launch rule of the one-CTA-a-row kernels (the row in registers): 256 threads, fewer (a multiple of 32) for
// rows of fewer vectors, and `launch(threads, std::integral_constant<int, VPT>)` with VPT 1, 2, 4 or 8 vectors a
// thread. One rule, so that rms_norm and the combine with a norm sum their rows alike. REQUIRES nvec <= 8 * 256.
template <typename Launch>
void launch_row_kernel(int64_t nvec, Launch&& launch) {
  const int threads = nvec >= 256 ? 256 : static_cast<int>((nvec + 31) / 32 * 32);
  const int64_t vpt = (nvec + threads - 1) / threads;
  if (vpt <= 1)
    launch(threads, std::integral_constant<int, 1>{});
  else if (vpt <= 2)
    launch(threads, std::integral_constant<int, 2>{});
  else if (vpt <= 4)
    launch(threads, std::integral_constant<int, 4>{});
  else
    launch(threads, std::integral_constant<int, 8>{});
}

// One CTA per row; each thread keeps VPT 16-byte vectors of the row in registers (read once, written once).
template <typename T, int VPT>
__global__ void __launch_bounds__(256) rms_norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* residual, T* y,
                                    int64_t dim, int64_t stride, float eps) {
  pdl_begin();
  constexpr int N = kVec<T>;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * stride;
  const int nvec = static_cast<int>(dim / N);
  float v[VPT][N];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < nvec) {
      load16(x + base + static_cast<int64_t>(vi) * N, v[j]);
      if (residual != nullptr) {
        float r[N];
        load16(residual + base + static_cast<int64_t>(vi) * N, r);
#pragma unroll
        for (int i = 0; i < N; ++i) v[j][i] = round_trip<T>(v[j][i] + r[i]);
        store16(residual + base + static_cast<int64_t>(vi) * N, v[j]);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) ss += v[j][i] * v[j][i];
    }
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(dim) + eps);
  scale_rows_vectors<T, VPT>(v, inv, weight, y + base, nvec);
}

// Any size / alignment: two passes over the row (the second re-reads x, or the residual just written).
template <typename T>
__global__ void rms_norm_scalar_kernel(const T* x, const T* weight, T* residual, T* y, int64_t dim, int64_t stride,
                                       float eps) {
  pdl_begin();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * stride;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = to_f(x[base + i]);
    if (residual != nullptr) {
      v = round_trip<T>(v + to_f(residual[base + i]));
      residual[base + i] = from_f<T>(v);
    }
    ss += v * v;
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = to_f(residual != nullptr ? residual[base + i] : x[base + i]);
    y[base + i] = from_f<T>(v * inv * to_f(weight[i]));
  }
}

template <typename T>
cudaError_t launch_rms_norm(const RmsNormParams& p) {
  constexpr int N = kVec<T>;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  T* r = static_cast<T*>(p.residual);
  T* y = static_cast<T*>(p.y);
  const dim3 grid(static_cast<unsigned>(p.rows));
  const bool vec = p.dim % N == 0 && p.stride % N == 0 && aligned16(p.x) && aligned16(p.weight) &&
                   aligned16(p.residual) && aligned16(p.y);
  const int64_t nvec = p.dim / N;
  if (vec && nvec <= 8 * 256) {  // bf16 dim <= 16384, f32 dim <= 8192 in registers; wider rows: scalar path
    launch_row_kernel(nvec, [&](int threads, auto vpt) {
      launch_pdl(rms_norm_vec_kernel<T, decltype(vpt)::value>, grid, threads, 0, p.stream, x, w, r, y, p.dim, p.stride,
                 p.eps);
    });
  } else {
    launch_pdl(rms_norm_scalar_kernel<T>, grid, 256, 0, p.stream, x, w, r, y, p.dim, p.stride, p.eps);
  }
  return cudaGetLastError();
}

// ---- SiLU * up ----

template <typename T>
__global__ void silu_mul_vec_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t n) {
  pdl_begin();
  constexpr int N = kVec<T>;
  const int64_t per_row = n / N, total = rows * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / per_row, c = (idx % per_row) * N;
    float g[N], u[N];
    load16(gate_up + row * 2 * n + c, g);
    load16(gate_up + row * 2 * n + n + c, u);
#pragma unroll
    for (int i = 0; i < N; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    store16(out + row * n + c, g);
  }
}
template <typename T>
__global__ void silu_mul_scalar_kernel(const T* gate_up, T* out, int64_t rows, int64_t n) {
  pdl_begin();
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / n, c = idx % n;
    const float g = to_f(gate_up[row * 2 * n + c]), u = to_f(gate_up[row * 2 * n + n + c]);
    out[idx] = from_f<T>(g / (1.0f + expf(-g)) * u);
  }
}
int grid_for(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 1 ? 1 : blocks > 132 * 16 ? 132 * 16 : blocks);
}
template <typename T>
cudaError_t launch_silu_mul(const SiluMulParams& p) {
  constexpr int N = kVec<T>;
  const T* gu = static_cast<const T*>(p.gate_up);
  T* out = static_cast<T*>(p.out);
  if (p.n % N == 0 && aligned16(p.gate_up) && aligned16(p.out))
    launch_pdl(silu_mul_vec_kernel<T>, grid_for(p.rows * p.n / N, 256), 256, 0, p.stream, gu, out, p.rows, p.n);
  else
    launch_pdl(silu_mul_scalar_kernel<T>, grid_for(p.rows * p.n, 256), 256, 0, p.stream, gu, out, p.rows, p.n);
  return cudaGetLastError();
}

// ---- rope ----

// cos and sin of pos * inv_freq[i] for i < half, in double, times factor, rounded to float (run_rope's contract),
// into shared memory by the block's threads (the caller syncs before reading).
__device__ __forceinline__ void rope_table(double pos, const float* inv_freq, float factor, int half, float* cs,
                                           float* sn) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(pos * static_cast<double>(inv_freq[i]), &s, &c);
    cs[i] = static_cast<float>(c * factor);
    sn[i] = static_cast<float>(s * factor);
  }
}
// One lane's N interleaved values (pairs part * N/2 ...) rotated: lo[q] = a c - b s, hi[q] = b c + a s.
template <int N>
__device__ __forceinline__ void rope_pairs(const float (&f)[N], int part, const float* cs, const float* sn,
                                           float (&lo)[N / 2], float (&hi)[N / 2]) {
#pragma unroll
  for (int q = 0; q < N / 2; ++q) {
    const int i = part * (N / 2) + q;
    const float a = f[2 * q], b = f[2 * q + 1];
    lo[q] = a * cs[i] - b * sn[i];
    hi[q] = b * cs[i] + a * sn[i];
  }
}

// One CTA per position group (vectors_per_position rows sharing a position): cos/sin for the position once,
// in double, into shared memory. Vector path: L = dim / N lanes per row (L divides 32), each lane 16 bytes =
// N/2 pairs; the whole row is read into registers before __syncwarp, then written de-interleaved (in place).
template <typename T, bool kVector>
__global__ void rope_kernel(T* x, int64_t rows, int dim, int64_t stride, int64_t vpp, const int32_t* positions,
                            const float* inv_freq, float factor) {
  pdl_begin();
  __shared__ float cs[128], sn[128];
  const int half = dim / 2;
  const int64_t group = blockIdx.x;
  rope_table(static_cast<double>(positions[group]), inv_freq, factor, half, cs, sn);
  __syncthreads();
  const int64_t r0 = group * vpp, r1 = r0 + vpp < rows ? r0 + vpp : rows;
  if constexpr (kVector) {
    constexpr int N = kVec<T>;
    const int lanes_per_row = dim / N, rows_per_warp = 32 / lanes_per_row;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int part = lane % lanes_per_row;
    for (int64_t wbase = r0 + static_cast<int64_t>(warp) * rows_per_warp; wbase < r1;
         wbase += static_cast<int64_t>(warps) * rows_per_warp) {
      const int64_t row = wbase + lane / lanes_per_row;
      const bool valid = lane / lanes_per_row < rows_per_warp && row < r1;
      float f[N];
      if (valid) load16(x + row * stride + part * N, f);
      __syncwarp();
      if (valid) {
        float lo[N / 2], hi[N / 2];
        rope_pairs<N>(f, part, cs, sn, lo, hi);
        store8(x + row * stride + part * (N / 2), lo);
        store8(x + row * stride + half + part * (N / 2), hi);
      }
    }
  } else {
    for (int64_t row = r0 + threadIdx.x; row < r1; row += blockDim.x) {
      T* v = x + row * stride;
      float buf[256];
      for (int i = 0; i < dim; ++i) buf[i] = to_f(v[i]);
      for (int i = 0; i < half; ++i) {
        const float a = buf[2 * i], b = buf[2 * i + 1];
        v[i] = from_f<T>(a * cs[i] - b * sn[i]);
        v[i + half] = from_f<T>(b * cs[i] + a * sn[i]);
      }
    }
  }
}
template <typename T>
cudaError_t launch_rope(const RopeParams& p) {
  constexpr int N = kVec<T>;
  if (p.dim % 2 != 0 || p.dim > 256 || p.vectors_per_position < 1) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  T* x = static_cast<T*>(p.x);
  const int64_t groups = (p.rows + p.vectors_per_position - 1) / p.vectors_per_position;
  const int lanes = static_cast<int>(p.dim / N);
  const bool vec = p.dim % N == 0 && lanes <= 32 && 32 % lanes == 0 && p.stride % N == 0 && aligned16(p.x);
  if (vec) {
    const int64_t rows_per_warp = 32 / lanes;
    const int64_t warps = (p.vectors_per_position + rows_per_warp - 1) / rows_per_warp;
    const int threads = static_cast<int>(warps >= 8 ? 256 : warps * 32);
    launch_pdl(rope_kernel<T, true>, static_cast<unsigned>(groups), threads, 0, p.stream, x, p.rows,
               static_cast<int>(p.dim), p.stride, p.vectors_per_position, p.positions, p.inv_freq, p.attention_factor);
  } else {
    const int threads = p.vectors_per_position >= 128 ? 128 : static_cast<int>((p.vectors_per_position + 31) / 32 * 32);
    launch_pdl(rope_kernel<T, false>, static_cast<unsigned>(groups), threads, 0, p.stream, x, p.rows,
               static_cast<int>(p.dim), p.stride, p.vectors_per_position, p.positions, p.inv_freq, p.attention_factor);
  }
  return cudaGetLastError();
}

// ---- MLA preparation: rms_norm + rope + store_kv + rope (+ copy) ----

// One CTA of kMlaPrepareThreads per token. The latent's RMSNorm with run_rms_norm's one-vector-per-thread layout
// (thread j holds 16-byte vector j; the same block_sum), so its bf16 results are the same bits; then the rope rows
// (the key, then the token's q heads) with rope_kernel's vector layout and arithmetic.
constexpr int kMlaPrepareThreads = 256;
__global__ void __launch_bounds__(kMlaPrepareThreads) mla_prepare_kernel(MlaPrepareParams p) {
  pdl_begin();
  constexpr int N = kVec<bf16>;
  __shared__ float cs[128], sn[128];
  const int64_t t = blockIdx.x;
  const int latent = static_cast<int>(p.latent), dim = static_cast<int>(p.rope_dim), half = dim / 2;
  const int entry = latent + dim;
  rope_table(static_cast<double>(p.positions[t]), p.inv_freq, p.attention_factor, half, cs, sn);  // synced below
  const int64_t slot = p.slots[t];
  if (slot >= p.num_slots) __trap();
  bf16* row = reinterpret_cast<bf16*>(p.kv) + t * p.kv_stride;
  bf16* cached = slot >= 0 ? reinterpret_cast<bf16*>(p.cache) + slot * entry : nullptr;
  const int nvec = latent / N;
  float v[N];
  float ss = 0.0f;
  if (static_cast<int>(threadIdx.x) < nvec) {
    load16(row + threadIdx.x * N, v);
#pragma unroll
    for (int i = 0; i < N; ++i) ss += v[i] * v[i];
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(latent) + p.eps);  // syncs: cs/sn are ready
  if (static_cast<int>(threadIdx.x) < nvec) {
    float w[N];
    load16(reinterpret_cast<const bf16*>(p.norm_weight) + threadIdx.x * N, w);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = v[i] * inv * w[i];
    store16(row + threadIdx.x * N, v);
    if (cached != nullptr) store16(cached + threadIdx.x * N, v);
  }
  // Rope rows: 0 is the key (kv[t, latent:]), 1 + h is q head h of the token.
  const int lanes_per_row = dim / N, rows_per_warp = 32 / lanes_per_row;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int part = lane % lanes_per_row;
  const int rope_rows = 1 + static_cast<int>(p.heads);
  for (int base = warp * rows_per_warp; base < rope_rows; base += warps * rows_per_warp) {
    const int k = base + lane / lanes_per_row;
    const bool valid = lane / lanes_per_row < rows_per_warp && k < rope_rows;
    const int64_t q_row = t * p.heads + (k - 1);
    bf16* x = k == 0 ? row + latent : reinterpret_cast<bf16*>(p.q) + q_row * p.q_stride;
    float f[N];
    if (valid) load16(x + part * N, f);
    __syncwarp();
    if (valid) {
      float lo[N / 2], hi[N / 2];
      rope_pairs<N>(f, part, cs, sn, lo, hi);
      store8(x + part * (N / 2), lo);
      store8(x + half + part * (N / 2), hi);
      bf16* also = k == 0 ? (cached != nullptr ? cached + latent : nullptr)
                          : (p.q_copy != nullptr ? reinterpret_cast<bf16*>(p.q_copy) + q_row * p.q_copy_stride : nullptr);
      if (also != nullptr) {
        store8(also + part * (N / 2), lo);
        store8(also + half + part * (N / 2), hi);
      }
    }
  }
}

// ---- MoE routing ----

// a before b in the rule's order: larger value first, equal values -> lower index first (invalid: INT_MAX).
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

constexpr int kRoutingWarps = 4;
constexpr int kRoutingMaxExperts = 512;

// One warp per token; lane l holds experts l + 32 j (j < J). Shared memory per warp: the choices (padded by one
// float per 32 so that lane g scanning group g hits distinct banks when a group is 32 experts).
constexpr int kRoutingSmemPerWarp = kRoutingMaxExperts + kRoutingMaxExperts / 32;

// Token t's routing by one whole warp; `sm`: the warp's kRoutingSmemPerWarp floats of shared memory.
template <int J>
__device__ __forceinline__ void route_token(const MoeRoutingParams& p, int64_t t, float* sm) {
  const int lane = threadIdx.x % 32;
  const int E = static_cast<int>(p.num_experts), k = static_cast<int>(p.top_k);
  const float* logits = p.logits + t * E;
  float score[J], choice[J];
  float lmax = -INFINITY;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    score[j] = e < E ? logits[e] : -INFINITY;
    lmax = fmaxf(lmax, score[j]);
  }
  if (p.sqrt_softplus) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const double v = score[j];
      score[j] = static_cast<float>(sqrt(v > 20.0 ? v : log1p(exp(v))));
    }
  } else if (p.sigmoid) {
#pragma unroll
    for (int j = 0; j < J; ++j) score[j] = 1.0f / (1.0f + expf(-score[j]));
  } else {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffffu, lmax, o));
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (lane + 32 * j < E) sum += exp(static_cast<double>(score[j]) - lmax);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int j = 0; j < J; ++j) score[j] = static_cast<float>(expf(score[j] - lmax) / sum);
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    choice[j] = score[j] + (p.bias != nullptr && e < E ? p.bias[e] : 0.0f);
  }
  if (p.grouping != 0) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < E) sm[e + e / 32] = choice[j];
    }
    __syncwarp();
    const int per_group = E / p.n_group;
    float gs = -INFINITY;
    if (lane < p.n_group) {
      float t1 = -INFINITY, t2 = -INFINITY;  // top-2 as a multiset
      for (int m = 0; m < per_group; ++m) {
        const int e = lane * per_group + m;
        const float v = sm[e + e / 32];
        if (v > t1) {
          t2 = t1;
          t1 = v;
        } else if (v > t2) {
          t2 = v;
        }
      }
      gs = p.grouping == 2 ? t1 + (per_group > 1 ? t2 : 0.0f) : t1;
    }
    // Rank of this group in a stable descending sort: groups ahead = larger score, or equal and lower index.
    int rank = 0;
    for (int g = 0; g < p.n_group; ++g) {
      const float other = __shfl_sync(0xffffffffu, gs, g);
      rank += (other > gs || (other == gs && g < lane)) ? 1 : 0;
    }
    const unsigned keep = __ballot_sync(0xffffffffu, lane < p.n_group && rank < p.topk_group);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !((keep >> (e / per_group)) & 1u)) choice[j] = 0.0f;
    }
  }
  unsigned taken = 0;
  int my_id = 0;
  float my_score = 0.0f;
  if (p.fixed_ids != nullptr) {  // hash routing: the token's experts, their scores from shared memory
    __syncwarp();
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < E) sm[e + e / 32] = score[j];
    }
    __syncwarp();
    if (lane < k) {
      my_id = p.fixed_ids[static_cast<int64_t>(p.token_ids[t]) * k + lane];
      my_score = sm[my_id + my_id / 32];
    }
  }
  for (int s = 0; s < k && p.fixed_ids == nullptr; ++s) {
    float bv = -INFINITY, bs = 0.0f;
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !((taken >> j) & 1u) && better(choice[j], e, bv, bi)) {
        bv = choice[j];
        bi = e;
        bs = score[j];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      if (better(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
        bs = os;
      }
    }
    if (bi % 32 == lane) taken |= 1u << (bi / 32);
    if (lane == s) {
      my_id = bi;
      my_score = bs;
    }
  }
  double sum = 0.0;
  for (int s = 0; s < k; ++s) sum += static_cast<double>(__shfl_sync(0xffffffffu, my_score, s));
  if (lane < k) {
    const bool normalize = p.norm_topk_prob && k > 1;
    float w = my_score;
    if (normalize) w = static_cast<float>(static_cast<double>(w) / (sum + 1e-20));
    if (!normalize || p.scale_after_normalize) w *= static_cast<float>(p.routed_scaling_factor);
    p.ids[t * k + lane] = my_id;
    p.weights[t * k + lane] = w;
  }
}

template <int J>
__global__ void __launch_bounds__(kRoutingWarps * 32) moe_routing_kernel(MoeRoutingParams p) {
  __shared__ float choice_smem[kRoutingWarps][kRoutingSmemPerWarp];
  const int warp = threadIdx.x / 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRoutingWarps + warp;
  if (t >= p.tokens) return;  // warp-uniform
  route_token<J>(p, t, choice_smem[warp]);
}

// Router logits for a few tokens: one warp per (token, expert), the products of bf16 x (exact in float) and float32
// w summed in double and rounded once (closer to the exact dot product than any float order).
constexpr int kRouterWarps = 4;

__global__ void __launch_bounds__(kRouterWarps * 32) moe_router_logits_kernel(MoeRouterLogitsParams p) {
  pdl_begin();
  const int lane = threadIdx.x % 32;
  const int64_t job = static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / 32;
  if (job >= p.tokens * p.num_experts) return;  // warp-uniform
  const int64_t t = job / p.num_experts, e = job % p.num_experts;
  const bf16* x = reinterpret_cast<const bf16*>(p.x) + t * p.x_stride;
  const float* w = p.w + e * p.w_stride;
  double acc = 0.0;
  if (p.vec) {  // 8 values per lane and round (one 16-byte load of x, two of w), 4 rounds' loads in flight at once
    constexpr int kRounds = 4;
    for (int64_t i0 = 8 * lane; i0 < p.hidden; i0 += 256 * kRounds) {
      uint4 xr[kRounds];
      float4 w0[kRounds], w1[kRounds];
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const int64_t i = i0 + 256 * r;
        if (i < p.hidden) {
          xr[r] = *reinterpret_cast<const uint4*>(x + i);
          w0[r] = __ldg(reinterpret_cast<const float4*>(w + i));
          w1[r] = __ldg(reinterpret_cast<const float4*>(w + i + 4));
        }
      }
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        if (i0 + 256 * r >= p.hidden) break;
        const bf16* xe = reinterpret_cast<const bf16*>(&xr[r]);
        const float wv[8] = {w0[r].x, w0[r].y, w0[r].z, w0[r].w, w1[r].x, w1[r].y, w1[r].z, w1[r].w};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          acc = fma(static_cast<double>(__bfloat162float(xe[j])), static_cast<double>(wv[j]), acc);
      }
    }
  } else {
    for (int64_t i = lane; i < p.hidden; i += 32)
      acc = fma(static_cast<double>(__bfloat162float(x[i])), static_cast<double>(w[i]), acc);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) p.logits[t * p.logits_stride + e] = static_cast<float>(acc);
}

// ---- token permutation ----

// Entries are cut into chunks of kPermThreads x items, one CTA each (count, then a stable scatter in `items`
// sub-rounds). Few entries take 1 item a thread, so that a prefill chunk's 3,072 entries (512 tokens x 6) spread
// over 12 CTAs rather than one CTA's 16 sub-rounds (17.6 us a layer on an H100); more take up to kPermMaxItems so
// that the chunk count, which moe_scan_kernel walks serially, stays at kPermTargetChunks until the entries exceed
// kPermTargetChunks x kPermThreads x kPermMaxItems.
constexpr int kPermThreads = 256;
constexpr int kPermMaxItems = 16;
constexpr int64_t kPermTargetChunks = 16;

int perm_items(int64_t entries) {
  int items = 1;
  while (items < kPermMaxItems && entries > kPermTargetChunks * kPermThreads * items) items *= 2;
  return items;
}

int64_t perm_chunks(int64_t entries) {
  const int64_t chunk = static_cast<int64_t>(kPermThreads) * perm_items(entries);
  return (entries + chunk - 1) / chunk;
}

__global__ void moe_chunk_count_kernel(const int32_t* ids, int64_t entries, int E, int chunk,
                                       int32_t* chunk_counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * chunk;
  for (int i = threadIdx.x; i < chunk; i += blockDim.x)
    if (base + i < entries) atomicAdd(&hist[ids[base + i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) chunk_counts[static_cast<int64_t>(blockIdx.x) * E + e] = hist[e];
}

// One CTA, one thread per expert: chunk counts -> each chunk's first position per expert; counts; offsets.
__global__ void moe_scan_kernel(int32_t* chunk_base, int chunks, int E, int32_t* counts, int32_t* offsets) {
  __shared__ int warp_total[32];
  const int e = threadIdx.x, lane = e % 32, warp = e / 32;
  int running = 0;
  if (e < E) {  // four chunks' loads issued before their stores (the compiler cannot prove they do not alias)
    constexpr int kBatch = 4;
    for (int c0 = 0; c0 < chunks; c0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) v[i] = c0 + i < chunks ? chunk_base[static_cast<int64_t>(c0 + i) * E + e] : 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (c0 + i < chunks) chunk_base[static_cast<int64_t>(c0 + i) * E + e] = running;
        running += v[i];
      }
    }
  }
  int incl = running;  // inclusive scan over experts
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < static_cast<int>(blockDim.x / 32) ? warp_total[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += v;
    }
    warp_total[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int excl = incl - running + (warp > 0 ? warp_total[warp - 1] : 0);
  if (e < E) {
    counts[e] = running;
    offsets[e] = excl;
    if (e == E - 1) offsets[E] = excl + running;
    for (int c = 0; c < chunks; ++c) chunk_base[static_cast<int64_t>(c) * E + e] += excl;
  }
}

// Stable scatter of one chunk: kItems sub-rounds of 256 consecutive entries; within a warp, equal experts are ranked
// by __match_any_sync; across the 8 warps by their per-expert counts in shared memory; across sub-rounds by a
// running per-expert counter.
template <int kItems>
__global__ void __launch_bounds__(kPermThreads) moe_chunk_scatter_kernel(const int32_t* ids, int64_t entries, int E,
                                                                          const int32_t* chunk_base,
                                                                          int32_t* sorted_entries,
                                                                          int32_t* entry_position) {
  extern __shared__ int smem[];
  constexpr int kWarps = kPermThreads / 32;
  int* running = smem;               // [E]
  int* warp_counts = smem + E;       // [kWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kPermThreads * kItems;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    running[e] = chunk_base[static_cast<int64_t>(blockIdx.x) * E + e];
    for (int w = 0; w < kWarps; ++w) warp_counts[w * E + e] = 0;
  }
  int item[kItems];
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int64_t j = base + r * kPermThreads + threadIdx.x;
    item[r] = j < entries ? ids[j] : -1;
  }
  __syncthreads();
  const unsigned lower = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < kItems; ++r) {
    const int e = item[r];
    const int64_t j = base + r * kPermThreads + threadIdx.x;
    const unsigned peers = __match_any_sync(0xffffffffu, e >= 0 ? e : -1 - lane);
    const int rank = __popc(peers & lower);
    if (e >= 0 && lane == 31 - __clz(peers)) warp_counts[warp * E + e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int pos = running[e] + rank;
      for (int w = 0; w < warp; ++w) pos += warp_counts[w * E + e];
      sorted_entries[pos] = static_cast<int32_t>(j);
      entry_position[j] = pos;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
      int total = 0;
      for (int w = 0; w < kWarps; ++w) {
        total += warp_counts[w * E + x];
        warp_counts[w * E + x] = 0;
      }
      running[x] += total;
    }
    __syncthreads();
  }
}

// The permutation of at most kSmallPermuteEntries entries by one CTA of kSmallPermuteThreads threads, one entry per
// thread: per-expert counts in shared memory, their exclusive scan by one warp, and each entry's rank among the
// earlier entries of its expert counted directly. The same result as the chunked kernels (stable by entry), in one
// launch instead of three. `ids` may have been written by this CTA before a __syncthreads (plain loads, not the
// read-only path).
constexpr int kSmallPermuteEntries = 256;
constexpr int kSmallPermuteThreads = 256;
constexpr int kSmallPermuteMaxExperts = 1024;

__device__ __forceinline__ void small_permute(const int32_t* ids, int entries, int E, int32_t* counts,
                                              int32_t* offsets, int32_t* sorted_entries, int32_t* entry_position) {
  __shared__ int s_ids[kSmallPermuteEntries];
  __shared__ int s_base[kSmallPermuteMaxExperts];  // counts, then each expert's first position
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  for (int e = tid; e < E; e += kSmallPermuteThreads) s_base[e] = 0;
  const int mine = tid < entries ? ids[tid] : -1;
  if (tid < entries) s_ids[tid] = mine;
  __syncthreads();
  if (mine >= 0) atomicAdd(&s_base[mine], 1);
  __syncthreads();
  if (tid < 32) {  // lane l scans experts [l * per, (l + 1) * per)
    const int per = (E + 31) / 32, lo = lane * per, hi = min(E, lo + per);
    int sum = 0;
    for (int e = lo; e < hi; ++e) sum += s_base[e];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    int run = incl - sum;
    for (int e = lo; e < hi; ++e) {
      const int c = s_base[e];
      counts[e] = c;
      offsets[e] = run;
      s_base[e] = run;
      run += c;
    }
    if (lane == 31) offsets[E] = incl;
  }
  __syncthreads();
  if (mine >= 0) {
    int rank = 0;
    for (int i = 0; i < tid; ++i) rank += s_ids[i] == mine ? 1 : 0;
    const int pos = s_base[mine] + rank;
    sorted_entries[pos] = tid;
    entry_position[tid] = pos;
  }
}

__global__ void __launch_bounds__(kSmallPermuteThreads) moe_small_permute_kernel(const MoePermuteParams p) {
  pdl_begin();
  small_permute(p.ids, static_cast<int>(p.tokens * p.top_k), static_cast<int>(p.num_experts), p.counts, p.offsets,
                p.sorted_entries, p.entry_position);
}

// Routing and permutation of a few tokens in one CTA: each warp routes tokens warp, warp + 8, ...; then the CTA
// permutes the ids it has just written.
template <int J>
__global__ void __launch_bounds__(kSmallPermuteThreads) moe_route_permute_small_kernel(const MoeRoutingParams r,
                                                                                      const MoePermuteParams p) {
  pdl_begin();
  constexpr int kWarps = kSmallPermuteThreads / 32;
  __shared__ float choice_smem[kWarps][kRoutingSmemPerWarp];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  for (int64_t t = warp; t < r.tokens; t += kWarps) route_token<J>(r, t, choice_smem[warp]);
  __syncthreads();  // the ids in global memory are visible to the whole CTA
  small_permute(r.ids, static_cast<int>(r.tokens * r.top_k), static_cast<int>(r.num_experts), p.counts, p.offsets,
                p.sorted_entries, p.entry_position);
}

__global__ void moe_gather_kernel(const uint16_t* x, const int32_t* sorted_entries, uint16_t* permuted,
                                  int64_t entries, int64_t top_k, int64_t hidden, bool vec) {
  pdl_begin();
  const int64_t per_row = vec ? hidden / 8 : hidden, total = entries * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = idx / per_row, c = idx % per_row;
    const int64_t src = sorted_entries[p] / top_k;
    if (vec)
      reinterpret_cast<uint4*>(permuted + p * hidden)[c] = reinterpret_cast<const uint4*>(x + src * hidden)[c];
    else
      permuted[p * hidden + c] = x[src * hidden + c];
  }
}

// One 8-value vector of a combined row: acc = (base ? base : 0) + Σ_slot weight · expert row, in float, slot order.
// Slots in groups of 8: the group's positions and weights, then its rows, all loads in flight together (a
// slot-by-slot loop waited for each position before loading its row). Both combine kernels call it, so they agree
// bit for bit.
__device__ __forceinline__ void combine_vec(const bf16* expert_out, const int32_t* entry_position, const float* weights,
                                            const bf16* base, int64_t t, int64_t c, int64_t top_k, int64_t hidden,
                                            float (&acc)[8]) {
  constexpr int N = 8;
  if (base != nullptr) {
    load16(base + t * hidden + c * N, acc);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.0f;
  }
  constexpr int kGroup = 8;
  for (int64_t s0 = 0; s0 < top_k; s0 += kGroup) {
    int64_t pos[kGroup];
    float w[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const bool in = s0 + g < top_k;
      pos[g] = in ? entry_position[t * top_k + s0 + g] : 0;
      w[g] = in ? weights[t * top_k + s0 + g] : 0.0f;
    }
    float v[kGroup][N];
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
      if (s0 + g < top_k) load16(expert_out + pos[g] * hidden + c * N, v[g]);
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
      if (s0 + g < top_k)
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += w[g] * v[g][i];
  }
}

__global__ void moe_combine_kernel(const bf16* expert_out, const int32_t* entry_position, const float* weights,
                                   const bf16* base, bf16* out, int64_t tokens, int64_t top_k, int64_t hidden,
                                   bool vec) {
  pdl_begin();
  constexpr int N = 8;
  const int64_t per_row = vec ? hidden / N : hidden, total = tokens * per_row;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_row, c = idx % per_row;
    if (vec) {
      float acc[N];
      combine_vec(expert_out, entry_position, weights, base, t, c, top_k, hidden, acc);
      store16(out + t * hidden + c * N, acc);
    } else {
      float acc = base != nullptr ? __bfloat162float(base[t * hidden + c]) : 0.0f;
      for (int64_t s = 0; s < top_k; ++s)
        acc += weights[t * top_k + s] * __bfloat162float(expert_out[entry_position[t * top_k + s] * hidden + c]);
      out[t * hidden + c] = __float2bfloat16(acc);
    }
  }
}

// The combine, then the next layer's residual add and input norm (run_moe_combine with a residual): one CTA per
// token row, the thread layout and arithmetic of rms_norm_vec_kernel (VPT vectors of 8 a thread, the same
// block_sum), so out, residual and normed are bit for bit what moe_combine_kernel and then the fused add + RMSNorm
// write.
template <int VPT>
__global__ void __launch_bounds__(256) moe_combine_rms_norm_kernel(const bf16* expert_out, const int32_t* entry_position,
                                                                   const float* weights, const bf16* base, bf16* out,
                                                                   bf16* residual, const bf16* __restrict__ norm_weight,
                                                                   bf16* normed, int64_t top_k, int64_t hidden,
                                                                   float eps) {
  pdl_begin();
  constexpr int N = 8;
  const int64_t t = blockIdx.x, row = t * hidden;
  const int nvec = static_cast<int>(hidden / N);
  float v[VPT][N];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < nvec) {
      combine_vec(expert_out, entry_position, weights, base, t, vi, top_k, hidden, v[j]);
      store16(out + row + static_cast<int64_t>(vi) * N, v[j]);
      float r[N];
      load16(residual + row + static_cast<int64_t>(vi) * N, r);
#pragma unroll
      for (int i = 0; i < N; ++i) v[j][i] = round_trip<bf16>(round_trip<bf16>(v[j][i]) + r[i]);
      store16(residual + row + static_cast<int64_t>(vi) * N, v[j]);
#pragma unroll
      for (int i = 0; i < N; ++i) ss += v[j][i] * v[j][i];
    }
  }
  const float inv = 1.0f / sqrtf(block_sum(ss) / static_cast<float>(hidden) + eps);
  scale_rows_vectors<bf16, VPT>(v, inv, norm_weight, normed + row, nvec);
}

}  // namespace

cudaError_t run_rms_norm(const RmsNormParams& p) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.dim <= 0 || p.stride < p.dim) return cudaErrorInvalidValue;
  return p.dtype == DType::kBF16 ? launch_rms_norm<bf16>(p) : launch_rms_norm<float>(p);
}

cudaError_t run_silu_mul(const SiluMulParams& p) {
  if (p.rows <= 0 || p.n <= 0) return cudaSuccess;
  return p.dtype == DType::kBF16 ? launch_silu_mul<bf16>(p) : launch_silu_mul<float>(p);
}

cudaError_t run_rope(const RopeParams& p) {
  return p.dtype == DType::kBF16 ? launch_rope<bf16>(p) : launch_rope<float>(p);
}

bool mla_prepare_takes(const MlaPrepareParams& p) {
  constexpr int N = kVec<bf16>;
  const int64_t lanes = p.rope_dim / N;
  return p.latent > 0 && p.latent % N == 0 && p.latent / N <= kMlaPrepareThreads && p.rope_dim % N == 0 &&
         lanes >= 1 && lanes <= 32 && 32 % lanes == 0 && p.heads >= 0 && p.kv_stride % N == 0 &&
         p.q_stride % N == 0 && (p.q_copy == nullptr || p.q_copy_stride % N == 0) && aligned16(p.kv) &&
         aligned16(p.norm_weight) && aligned16(p.q) && aligned16(p.q_copy) && aligned16(p.cache) && p.positions &&
         p.inv_freq && p.slots;
}

cudaError_t run_mla_prepare(const MlaPrepareParams& p) {
  if (p.tokens <= 0) return cudaSuccess;
  if (!mla_prepare_takes(p)) return cudaErrorInvalidValue;
  launch_pdl(mla_prepare_kernel, static_cast<unsigned>(p.tokens), kMlaPrepareThreads, 0, p.stream, p);
  return cudaGetLastError();
}

cudaError_t run_moe_routing(const MoeRoutingParams& p) {
  if (p.tokens <= 0) return cudaSuccess;
  const int64_t E = p.num_experts;
  if (E <= 0 || E > kRoutingMaxExperts || p.top_k < 1 || p.top_k > 32 || p.top_k > E) return cudaErrorInvalidValue;
  if (p.grouping != 0 && (p.n_group < 1 || p.n_group > 32 || E % p.n_group != 0 || p.topk_group < 1 ||
                          p.topk_group > p.n_group))
    return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>((p.tokens + kRoutingWarps - 1) / kRoutingWarps);
  const int threads = kRoutingWarps * 32;
  if (E <= 64) moe_routing_kernel<2><<<blocks, threads, 0, p.stream>>>(p);
  else if (E <= 128) moe_routing_kernel<4><<<blocks, threads, 0, p.stream>>>(p);
  else if (E <= 256) moe_routing_kernel<8><<<blocks, threads, 0, p.stream>>>(p);
  else moe_routing_kernel<16><<<blocks, threads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_moe_router_logits(const MoeRouterLogitsParams& params) {
  MoeRouterLogitsParams p = params;
  if (p.tokens <= 0 || p.num_experts <= 0) return cudaSuccess;
  if (p.hidden <= 0 || p.x == nullptr || p.w == nullptr || p.logits == nullptr || p.x_stride < p.hidden ||
      p.w_stride < p.hidden || p.logits_stride < p.num_experts)
    return cudaErrorInvalidValue;
  p.vec = p.hidden % 8 == 0 && p.x_stride % 8 == 0 && p.w_stride % 4 == 0 && aligned16(p.x) && aligned16(p.w);
  const int64_t jobs = p.tokens * p.num_experts;
  launch_pdl(moe_router_logits_kernel, static_cast<unsigned>((jobs + kRouterWarps - 1) / kRouterWarps),
             kRouterWarps * 32, 0, p.stream, p);
  return cudaGetLastError();
}

size_t moe_permute_workspace_bytes(int64_t entries, int64_t num_experts) {
  const int64_t chunks = perm_chunks(entries);
  return static_cast<size_t>((chunks < 1 ? 1 : chunks) * num_experts) * sizeof(int32_t);
}

cudaError_t run_moe_permute(const MoePermuteParams& p) {
  const int64_t entries = p.tokens * p.top_k;
  const int E = static_cast<int>(p.num_experts);
  if (E <= 0 || E > 1024 || p.tokens < 0 || p.top_k < 1) return cudaErrorInvalidValue;
  if (entries <= kSmallPermuteEntries) {
    launch_pdl(moe_small_permute_kernel, 1, kSmallPermuteThreads, 0, p.stream, p);
    return cudaGetLastError();
  }
  const int items = perm_items(entries);
  const int chunks = static_cast<int>(perm_chunks(entries));
  int32_t* chunk_base = static_cast<int32_t*>(p.workspace);
  if (chunks > 0) {
    moe_chunk_count_kernel<<<chunks, kPermThreads, E * sizeof(int), p.stream>>>(p.ids, entries, E,
                                                                               kPermThreads * items, chunk_base);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  moe_scan_kernel<<<1, (E + 31) / 32 * 32, 0, p.stream>>>(chunk_base, chunks, E, p.counts, p.offsets);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (chunks > 0) {
    const size_t smem = static_cast<size_t>(E) * (1 + kPermThreads / 32) * sizeof(int);  // <= 36 KB
    auto scatter = [&](auto kernel) {
      kernel<<<chunks, kPermThreads, smem, p.stream>>>(p.ids, entries, E, chunk_base, p.sorted_entries,
                                                       p.entry_position);
    };
    switch (items) {
      case 1: scatter(moe_chunk_scatter_kernel<1>); break;
      case 2: scatter(moe_chunk_scatter_kernel<2>); break;
      case 4: scatter(moe_chunk_scatter_kernel<4>); break;
      case 8: scatter(moe_chunk_scatter_kernel<8>); break;
      default: scatter(moe_chunk_scatter_kernel<16>); break;
    }
  }
  return cudaGetLastError();
}

cudaError_t run_moe_route_and_permute(const MoeRoutingParams& r, const MoePermuteParams& p) {
  if (r.tokens != p.tokens || r.top_k != p.top_k || r.num_experts != p.num_experts || r.ids != p.ids)
    return cudaErrorInvalidValue;
  const int64_t entries = r.tokens * r.top_k;
  if (entries == 0 || entries > kSmallPermuteEntries) {
    if (cudaError_t err = run_moe_routing(r); err != cudaSuccess) return err;
    return run_moe_permute(p);
  }
  const int64_t E = r.num_experts;
  if (E <= 0 || E > kRoutingMaxExperts || r.top_k < 1 || r.top_k > 32 || r.top_k > E) return cudaErrorInvalidValue;
  if (r.grouping != 0 && (r.n_group < 1 || r.n_group > 32 || E % r.n_group != 0 || r.topk_group < 1 ||
                          r.topk_group > r.n_group))
    return cudaErrorInvalidValue;
  if (E <= 64)
    launch_pdl(moe_route_permute_small_kernel<2>, 1, kSmallPermuteThreads, 0, r.stream, r, p);
  else if (E <= 128)
    launch_pdl(moe_route_permute_small_kernel<4>, 1, kSmallPermuteThreads, 0, r.stream, r, p);
  else if (E <= 256)
    launch_pdl(moe_route_permute_small_kernel<8>, 1, kSmallPermuteThreads, 0, r.stream, r, p);
  else
    launch_pdl(moe_route_permute_small_kernel<16>, 1, kSmallPermuteThreads, 0, r.stream, r, p);
  return cudaGetLastError();
}

cudaError_t run_moe_gather(const MoeGatherParams& p) {
  if (p.entries <= 0 || p.hidden <= 0) return cudaSuccess;
  const bool vec = p.hidden % 8 == 0 && aligned16(p.x) && aligned16(p.permuted);
  launch_pdl(moe_gather_kernel, grid_for(p.entries * (vec ? p.hidden / 8 : p.hidden), 256), 256, 0, p.stream, p.x,
             p.sorted_entries, p.permuted, p.entries, p.top_k, p.hidden, vec);
  return cudaGetLastError();
}

bool moe_combine_norm_fits(const MoeCombineParams& p) {
  return p.hidden % 8 == 0 && p.hidden / 8 <= 8 * 256 && p.tokens <= 0x7fffffff && aligned16(p.expert_out) &&
         aligned16(p.base) && aligned16(p.out) && aligned16(p.residual) && aligned16(p.norm_weight) &&
         aligned16(p.normed) && p.normed != nullptr && p.norm_weight != nullptr;
}

cudaError_t run_moe_combine(const MoeCombineParams& p) {
  if (p.tokens <= 0 || p.hidden <= 0) return cudaSuccess;
  const bool vec = p.hidden % 8 == 0 && aligned16(p.expert_out) && aligned16(p.base) && aligned16(p.out);
  if (p.residual != nullptr) {
    if (!moe_combine_norm_fits(p)) return cudaErrorInvalidValue;
    const auto* eo = reinterpret_cast<const bf16*>(p.expert_out);
    const auto* base = reinterpret_cast<const bf16*>(p.base);
    auto* out = reinterpret_cast<bf16*>(p.out);
    auto* residual = reinterpret_cast<bf16*>(p.residual);
    const auto* w = reinterpret_cast<const bf16*>(p.norm_weight);
    auto* normed = reinterpret_cast<bf16*>(p.normed);
    // rms_norm's launch rule, so the block sums match it.
    const dim3 grid(static_cast<unsigned>(p.tokens));
    launch_row_kernel(p.hidden / 8, [&](int threads, auto vpt) {
      launch_pdl(moe_combine_rms_norm_kernel<decltype(vpt)::value>, grid, threads, 0, p.stream, eo, p.entry_position,
                 p.weights, base, out, residual, w, normed, p.top_k, p.hidden, p.eps);
    });
    return cudaGetLastError();
  }
  launch_pdl(moe_combine_kernel, grid_for(p.tokens * (vec ? p.hidden / 8 : p.hidden), 256), 256, 0, p.stream,
             reinterpret_cast<const bf16*>(p.expert_out), p.entry_position, p.weights,
             reinterpret_cast<const bf16*>(p.base), reinterpret_cast<bf16*>(p.out), p.tokens, p.top_k, p.hidden, vec);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
