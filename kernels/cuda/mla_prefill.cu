// MLA prefill attention, expanded form (FlashAttention-2 style, varlen, causal): the fast tensor-core kernel and
// a simple f32 reference kernel. Contracts in include/deepinfer/kernels/cuda/mla_prefill.h.
//
// Fast kernel: CTA = (64-query tile, head, sequence), 128 threads (4 warps), heaviest tiles launched first.
//   - warp w owns query rows [16w, 16w+16) of the tile; its Q fragments (16 x 192 bf16, 48 registers) are loaded
//     once by ldmatrix from shared memory;
//   - key tiles of 64 tokens, 0 .. the diagonal tile: K (64 x 192) and V (64 x 128) stream in by cp.async into the
//     other of two buffers while the current one is computed; rows past the sequence are zero-filled;
//   - S[16, 64] = Q · Kᵀ (K by ldmatrix, one x4 per two MMAs), scale, causal mask on the diagonal tile, online
//     softmax per row (the 4 threads of a quad share a row: two shuffles), P converted in registers from the
//     accumulator layout to the A-operand layout, O[16, 128] += P · V (V by ldmatrix.trans);
//   - shared rows are 384 B (K, Q) and 256 B (V); 16 B chunks XOR-swizzled by (row & 7): conflict-free ldmatrix.
#include "deepinfer/kernels/cuda/mla_prefill.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace deepinfer::kernels::cuda {
namespace {

#include "mma_primitives.cuh"

constexpr int kTileM = 64;                             // query rows per CTA
constexpr int kTileN = 64;                             // keys per tile
constexpr int kThreads = 128;
constexpr int kQkChunks = kMlaPrefillQkDim * 2 / 16;   // 24 sixteen-byte chunks per q/k row
constexpr int kVChunks = kMlaPrefillVDim * 2 / 16;     // 16 per v/out row
constexpr int kQTileBytes = kTileM * kQkChunks * 16;   // 24,576
constexpr int kKTileBytes = kTileN * kQkChunks * 16;   // 24,576
constexpr int kVTileBytes = kTileN * kVChunks * 16;    // 16,384
constexpr int kSmemBytes = kQTileBytes + 2 * (kKTileBytes + kVTileBytes);  // 106,496
// The load loops run a fixed number of rounds of kThreads 16-byte chunks (no remainder handling).
static_assert(kTileM * kQkChunks % kThreads == 0 && kTileN * 16 % kThreads == 0 && kTileN * 8 % kThreads == 0);
constexpr float kLog2e = 1.4426950408889634f;

template <int kChunks>
__device__ __forceinline__ int swz(int row, int chunk) { return (row * kChunks + (chunk ^ (row & 7))) * 16; }


__global__ void __launch_bounds__(kThreads, 2) mla_prefill_fast_kernel(const MlaPrefillParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_k = s_q + kQTileBytes;                 // two K buffers
  uint8_t* s_v = s_k + 2 * kKTileBytes;             // two V buffers

  const int b = static_cast<int>(blockIdx.z);
  const int h = static_cast<int>(blockIdx.y);
  const int seq_begin = p.cu_seqlens[b];
  const int len = p.cu_seqlens[b + 1] - seq_begin;  // query rows
  const int key_begin = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : seq_begin;
  const int key_len = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - key_begin : len;
  const int q_pos0 = (p.q_positions != nullptr ? p.q_positions[b] : 0) - p.key_position;  // relative to key 0
  const int num_tiles = (len + kTileM - 1) / kTileM;
  const int max_tiles = static_cast<int>(gridDim.x);
  const int tile = max_tiles - 1 - static_cast<int>(blockIdx.x);  // heaviest (last) tiles first
  if (tile >= num_tiles) return;
  const int q0 = tile * kTileM;  // first query row of the tile (local to the sequence)

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const size_t H = static_cast<size_t>(p.num_heads);
  const uint8_t* q_base = reinterpret_cast<const uint8_t*>(p.q);
  constexpr size_t kQkRowBytes = kMlaPrefillQkDim * 2;
  constexpr int kNopeChunks = (kMlaPrefillQkDim - 64) * 2 / 16;  // 16 of the 24 chunks of a key row

  // Q tile (rows past the sequence zero-filled).
#pragma unroll
  for (int i = 0; i < kTileM * kQkChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kQkChunks;
    const int chunk = c - row * kQkChunks;
    const bool valid = q0 + row < len;
    const size_t token = static_cast<size_t>(seq_begin) + (valid ? q0 + row : 0);
    cp_async_16(s_q + swz<kQkChunks>(row, chunk), q_base + (token * H + h) * kQkRowBytes + chunk * 16, valid);
  }
  // Keys visible to some row of the tile: positions up to its last row's (relative to the first key).
  const int last_row_pos = q_pos0 + min(q0 + kTileM, len) - 1;
  const int visible = min(key_len, last_row_pos + 1);
  const int num_key_tiles = visible > 0 ? (visible + kTileN - 1) / kTileN : 0;
  const uint16_t* k_nope = p.k_nope + static_cast<int64_t>(h) * p.k_head_stride;
  const uint16_t* k_rope = p.k_rope + static_cast<int64_t>(h) * p.k_rope_head_stride;
  const uint16_t* v_head = p.v + static_cast<int64_t>(h) * p.v_head_stride;
  auto load_kv = [&](int key_tile, int buffer) {
    const int k0 = key_tile * kTileN;
    uint8_t* dk = s_k + buffer * kKTileBytes;
    uint8_t* dv = s_v + buffer * kVTileBytes;
    // Each key row: 16 chunks of k_nope, then 8 of the roped key (separate loops: no divergent select).
#pragma unroll
    for (int i = 0; i < kTileN * kNopeChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / kNopeChunks;
      const int chunk = c % kNopeChunks;
      const bool valid = k0 + row < key_len;
      const int64_t token = static_cast<int64_t>(key_begin) + (valid ? k0 + row : 0);
      cp_async_16(dk + swz<kQkChunks>(row, chunk), k_nope + token * p.k_token_stride + chunk * 8, valid);
    }
#pragma unroll
    for (int i = 0; i < kTileN * (kQkChunks - kNopeChunks) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / (kQkChunks - kNopeChunks);
      const int chunk = c % (kQkChunks - kNopeChunks);
      const bool valid = k0 + row < key_len;
      const int64_t token = static_cast<int64_t>(key_begin) + (valid ? k0 + row : 0);
      cp_async_16(dk + swz<kQkChunks>(row, kNopeChunks + chunk), k_rope + token * p.k_rope_token_stride + chunk * 8,
                  valid);
    }
#pragma unroll
    for (int i = 0; i < kTileN * kVChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / kVChunks;
      const int chunk = c - row * kVChunks;
      const bool valid = k0 + row < key_len;
      const int64_t token = static_cast<int64_t>(key_begin) + (valid ? k0 + row : 0);
      cp_async_16(dv + swz<kVChunks>(row, chunk), v_head + token * p.v_token_stride + chunk * 8, valid);
    }
  };
  if (num_key_tiles > 0) load_kv(0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  // Q fragments of this warp's 16 rows, all 192 dims (12 k-steps x 4 registers).
  uint32_t qf[kMlaPrefillQkDim / 16][4];
#pragma unroll
  for (int ks = 0; ks < kMlaPrefillQkDim / 16; ++ks) {
    ldmatrix_x4(qf[ks], s_q + swz<kQkChunks>(warp * 16 + (lane % 16), ks * 2 + lane / 16));
  }

  const float scale_log2 = p.scale * kLog2e;
  float acc[kMlaPrefillVDim / 8][4];
#pragma unroll
  for (int i = 0; i < kMlaPrefillVDim / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of rows g, g + 8 of the warp
  float l_row[2] = {0.0f, 0.0f};            // this thread's share of the running sum
  const int row_pos[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};  // local query rows of the two rows
  const int row_key[2] = {q_pos0 + row_pos[0], q_pos0 + row_pos[1]};     // the last key each may see
  const int first_row_key = q_pos0 + q0;  // the tile's first row: keys past it need the mask

  const int last_tile = num_key_tiles - 1;
  for (int kt = 0; kt <= last_tile; ++kt) {
    const int buffer = kt & 1;
    if (kt > 0) {
      cp_async_wait_all();
      __syncthreads();  // tile kt visible to all; everyone done with buffer (kt+1)&1 (used by tile kt-1)
    }
    if (kt + 1 <= last_tile) load_kv(kt + 1, buffer ^ 1);
    cp_async_commit();
    const uint8_t* sk = s_k + buffer * kKTileBytes;
    const uint8_t* sv = s_v + buffer * kVTileBytes;

    // S[16 rows, 64 keys] = Q · Kᵀ over 192 dims.
    float s[kTileN / 8][4];
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kMlaPrefillQkDim / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kTileN / 16; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sk + swz<kQkChunks>(np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
        mma_bf16(s[2 * np], qf[ks], bk[0], bk[1]);
        mma_bf16(s[2 * np + 1], qf[ks], bk[2], bk[3]);
      }
    }

    // Scale; causal mask (key > query) and keys past the sequence on the diagonal / last tile.
    const int k0 = kt * kTileN;
    const bool need_mask = k0 + kTileN - 1 > first_row_key || k0 + kTileN > key_len;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * scale_log2;
        if (need_mask) {
          const int key = k0 + j * 8 + 2 * t + (e & 1);
          if (key > row_key[e / 2] || key >= key_len) x = -INFINITY;
        }
        s[j][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
    float alpha[2];
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float mx = fmaxf(m_row[r], tile_max[r]);
      // A row with no valid key so far keeps max -inf: use 0 so exp2(-inf - 0) = 0 and never NaN.
      m_use[r] = mx == -INFINITY ? 0.0f : mx;
      alpha[r] = exp2f(m_row[r] - m_use[r]);  // m_row = -inf: 0
      m_row[r] = mx;
      l_row[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < kMlaPrefillVDim / 8; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }
    // P = exp2(S - m); accumulator layout of n-tiles 2kk, 2kk+1 = A-operand layout of k-step kk.
    uint32_t pf[kTileN / 16][4];
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - m_use[e / 2]);
        l_row[e / 2] += s[j][e];
      }
      pf[j / 2][(j % 2) * 2 + 0] = pack_bf16x2(s[j][0], s[j][1]);
      pf[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[j][2], s[j][3]);
    }

    // O[16 rows, 128] += P[16, 64] · V[64, 128].
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk) {
      const int v_row = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int np = 0; np < kMlaPrefillVDim / 16; ++np) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sv + swz<kVChunks>(v_row, np * 2 + lane / 16));
        mma_bf16(acc[2 * np], pf[kk], bv[0], bv[1]);
        mma_bf16(acc[2 * np + 1], pf[kk], bv[2], bv[3]);
      }
    }
  }
  cp_async_wait_all();  // nothing outstanding at exit (the last commit was an empty group)

  // Row sums across the quad, normalize; store (or merge) the rows inside the sequence.
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 1);
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 2);
    inv[r] = l_row[r] > 0.0f ? 1.0f / l_row[r] : 0.0f;
    lse[r] = l_row[r] > 0.0f ? m_row[r] + log2f(l_row[r]) : -INFINITY;  // log2 domain, scale included
  }
  const bool merging = p.merge == MlaPrefillMerge::kMiddle || p.merge == MlaPrefillMerge::kLast;
  float old_lse[2] = {-INFINITY, -INFINITY};
  if (merging) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (row_pos[r] < len) old_lse[r] = p.lse_acc[(static_cast<size_t>(seq_begin) + row_pos[r]) * H + h];
    __syncwarp();  // every lane read lse_acc before a t == 0 lane writes it (kMiddle)
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_pos[r] >= len) continue;
    const size_t out_row = (static_cast<size_t>(seq_begin) + row_pos[r]) * H + h;
    uint16_t* o = p.out + out_row * kMlaPrefillVDim;
    float w_old = 0.0f, w_new = inv[r];  // the row = o_acc * w_old + acc * w_new
    if (p.merge == MlaPrefillMerge::kFirst) {
      if (t == 0) p.lse_acc[out_row] = lse[r];
    } else if (merging) {
      const float mx = fmaxf(old_lse[r], lse[r]);
      if (mx == -INFINITY) {
        w_new = 0.0f;
      } else {
        const float a = exp2f(old_lse[r] - mx), c = exp2f(lse[r] - mx), sum = a + c;
        w_old = a / sum;
        w_new = inv[r] * (c / sum);
        if (p.merge == MlaPrefillMerge::kMiddle && t == 0) p.lse_acc[out_row] = mx + log2f(sum);
      }
    }
    float* oa = p.o_acc == nullptr ? nullptr : p.o_acc + out_row * kMlaPrefillVDim;
#pragma unroll
    for (int nt = 0; nt < kMlaPrefillVDim / 8; ++nt) {
      float x0 = acc[nt][2 * r] * w_new, x1 = acc[nt][2 * r + 1] * w_new;
      if (merging) {
        const float2 prev = *reinterpret_cast<const float2*>(oa + nt * 8 + 2 * t);
        x0 += prev.x * w_old;
        x1 += prev.y * w_old;
      }
      if (p.merge == MlaPrefillMerge::kNone || p.merge == MlaPrefillMerge::kLast)
        *reinterpret_cast<uint32_t*>(o + nt * 8 + 2 * t) = pack_bf16x2(x0, x1);
      else
        *reinterpret_cast<float2*>(oa + nt * 8 + 2 * t) = make_float2(x0, x1);
    }
  }
}

// Reference: one CTA of 128 threads per (token, head) -- blockIdx.x = packed token, blockIdx.y = head; the
// token's sequence by a search of cu_seqlens. f32 math on CUDA cores.
__global__ void __launch_bounds__(128) mla_prefill_reference_kernel(const MlaPrefillParams p) {
  extern __shared__ float scores[];  // [max_seqlen_k]
  __shared__ float scratch[32];
  const int token = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  int b = 0;
  while (b + 1 < p.num_seqs && p.cu_seqlens[b + 1] <= token) ++b;
  const int seq_begin = p.cu_seqlens[b];
  const int key_begin = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : seq_begin;
  const int key_len = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - key_begin : p.cu_seqlens[b + 1] - seq_begin;
  const int q_pos0 = (p.q_positions != nullptr ? p.q_positions[b] : 0) - p.key_position;
  const int last = min(key_len - 1, q_pos0 + token - seq_begin);  // attends to keys 0..last
  const size_t H = static_cast<size_t>(p.num_heads);
  const __nv_bfloat16* q = reinterpret_cast<const __nv_bfloat16*>(p.q) + (token * H + h) * kMlaPrefillQkDim;
  auto key = [&](int j, int c) {
    const int64_t row = static_cast<int64_t>(key_begin) + j;
    const uint16_t* src = c < kMlaPrefillQkDim - 64
                              ? p.k_nope + row * p.k_token_stride + h * p.k_head_stride + c
                              : p.k_rope + row * p.k_rope_token_stride + h * p.k_rope_head_stride + (c - 128);
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(src));
  };
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int j = warp; j <= last; j += 4) {
    float dot = 0.0f;
    for (int c = lane; c < kMlaPrefillQkDim; c += 32) dot += __bfloat162float(q[c]) * key(j, c);
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) scores[j] = dot * p.scale;
  }
  __syncthreads();
  float local_max = -INFINITY;
  for (int j = static_cast<int>(threadIdx.x); j <= last; j += 128) local_max = fmaxf(local_max, scores[j]);
  const float mx = block_reduce(local_max, true, scratch);
  float local_sum = 0.0f;
  for (int j = static_cast<int>(threadIdx.x); j <= last; j += 128) {
    scores[j] = expf(scores[j] - mx);
    local_sum += scores[j];
  }
  const float sum = block_reduce(local_sum, false, scratch);  // its barriers also publish scores[]
  const int c = static_cast<int>(threadIdx.x);                 // one output column per thread (128)
  float acc = 0.0f;
  for (int j = 0; j <= last; ++j) {
    const int64_t row = static_cast<int64_t>(key_begin) + j;
    acc += scores[j] *
           __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p.v + row * p.v_token_stride + h * p.v_head_stride + c));
  }
  reinterpret_cast<__nv_bfloat16*>(p.out)[(token * H + h) * kMlaPrefillVDim + c] =
      __float2bfloat16(sum > 0.0f ? acc / sum : 0.0f);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool params_valid(const MlaPrefillParams& p, bool fast) {
  const bool merge_ok = p.merge == MlaPrefillMerge::kNone ||
                        (!fast ? false : p.o_acc != nullptr && p.lse_acc != nullptr && aligned16(p.o_acc));
  // 16-byte cp.async rows: bases and strides in multiples of 8 elements.
  const bool strides_ok = p.k_token_stride % 8 == 0 && p.k_head_stride % 8 == 0 && p.k_rope_token_stride % 8 == 0 &&
                          p.k_rope_head_stride % 8 == 0 && p.v_token_stride % 8 == 0 && p.v_head_stride % 8 == 0 &&
                          aligned16(p.k_nope) && aligned16(p.k_rope) && aligned16(p.v) && aligned16(p.q) &&
                          aligned16(p.out);
  return p.num_seqs > 0 && p.num_seqs <= 65535 && p.num_heads > 0 && p.num_heads <= 65535 && p.max_seqlen >= 0 &&
         p.max_seqlen_k >= 0 && p.key_position >= 0 && p.cu_seqlens != nullptr && p.q != nullptr &&
         p.k_nope != nullptr && p.k_rope != nullptr && p.v != nullptr && p.out != nullptr && merge_ok &&
         (!fast || strides_ok);
}

}  // namespace

cudaError_t run_mla_prefill(const MlaPrefillParams& params) {
  const MlaPrefillParams p = mla_prefill_contiguous(params);
  if (!params_valid(p, true)) return cudaErrorInvalidValue;
  if (p.max_seqlen == 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (kSmemBytes > smem_optin) return cudaErrorInvalidConfiguration;
  err = cudaFuncSetAttribute(mla_prefill_fast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((p.max_seqlen + kTileM - 1) / kTileM), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.num_seqs));
  mla_prefill_fast_kernel<<<grid, kThreads, kSmemBytes, p.stream>>>(p);
  return cudaGetLastError();
}

cudaError_t run_mla_prefill_reference(const MlaPrefillParams& params) {
  MlaPrefillParams p = mla_prefill_contiguous(params);
  if (p.max_seqlen_k == 0) p.max_seqlen_k = p.max_seqlen;
  if (!params_valid(p, false)) return cudaErrorInvalidValue;
  if (p.max_seqlen == 0) return cudaSuccess;
  // Total tokens: the grid needs it on the host; read it from the device (synchronous; reference only).
  int32_t total = 0;
  cudaError_t err = cudaMemcpyAsync(&total, p.cu_seqlens + p.num_seqs, sizeof(total), cudaMemcpyDeviceToHost,
                                    p.stream);
  if (err != cudaSuccess) return err;
  err = cudaStreamSynchronize(p.stream);
  if (err != cudaSuccess) return err;
  if (total <= 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(std::max(p.max_seqlen_k, 1)) * sizeof(float);
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (smem + 32 * sizeof(float) > static_cast<size_t>(smem_optin)) return cudaErrorInvalidValue;
  err = cudaFuncSetAttribute(mla_prefill_reference_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  mla_prefill_reference_kernel<<<dim3(static_cast<unsigned>(total), static_cast<unsigned>(p.num_heads)), 128, smem,
                                 p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
