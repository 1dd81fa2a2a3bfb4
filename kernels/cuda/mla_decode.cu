// MLA decode kernels (absorbed form, paged bf16 latent cache): a simple f32 reference kernel and the fast
// tensor-core kernel with split-KV and its combine kernel. Contracts in include/deepinfer/kernels/cuda/mla_decode.h.
//
// Fast kernel v1 (kernel_version 1), one CTA = (head block of 16*G heads, sequence, split), 4*G warps:
//   - m-group g (4 warps) owns heads [16g, 16g+16) of the block; warp w of the group computes the scores of
//     tokens [16w, 16w+16) of the current 64-token page over all 576 dims (mma m16n8k16, Q and K from shared
//     memory by ldmatrix), and the output columns [128w, 128w+128) of P·V (V = the page's first 512 dims,
//     ldmatrix.trans). Row maxima and P (bf16) are exchanged through shared memory within the group.
//   - pages are double-buffered: page i+1 streams in by cp.async (16 B per thread-copy, rows past the context
//     zero-filled so garbage or NaN in unused rows never reaches the MMA) while page i is computed.
//   - shared rows are 1152 B; 16 B chunks are XOR-swizzled by (row & 7) so ldmatrix is bank-conflict free.
// Fast kernel v2 (kernel_version 2 / 3, 64 heads per CTA): Q kept in registers, the 576-dim reduction of QK^T
// split across the warps of an m-group, partial scores summed through shared memory (see mla_decode_v2_kernel).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "deepinfer/kernels/cuda/mla_decode.h"
#include "launch.cuh"

namespace deepinfer::kernels::cuda {
namespace {

#include "mma_primitives.cuh"

constexpr int kChunksPerRow = kMlaEntryDim * 2 / 16;            // 72 sixteen-byte chunks per cached token
constexpr int kRowBytes = kMlaEntryDim * 2;                     // 1152
constexpr int kPageBytes = kMlaBlockTokens * kRowBytes;         // 73,728
constexpr int kPStride = kMlaBlockTokens + 8;                   // bf16 row stride of P in shared memory (pad)
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int swizzle(int row, int chunk) { return row * kChunksPerRow + (chunk ^ (row & 7)); }

template <int kGroups>
constexpr int fast_smem_bytes() {
  return kGroups * 16 * kRowBytes            // Q: the CTA's heads
         + 2 * kPageBytes                    // two page buffers
         + kGroups * 16 * kPStride * 2       // P per m-group
         + kGroups * 4 * 16 * 4;             // per-warp row maxima / row sums
}

template <int kGroups>
__global__ void __launch_bounds__(128 * kGroups, 1) mla_decode_fast_kernel(const MlaDecodeParams p) {
  pdl_begin();
  constexpr int kThreads = 128 * kGroups;
  constexpr int kHeadsPerCta = 16 * kGroups;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_kv = s_q + kHeadsPerCta * kRowBytes;
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(s_kv + 2 * kPageBytes);
  float* s_red = reinterpret_cast<float*>(s_p + kGroups * 16 * kPStride);

  const int tid = static_cast<int>(threadIdx.x);
  const int head0 = static_cast<int>(blockIdx.x) * kHeadsPerCta;
  const int split = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int ctx = p.context_lens[b];
  const int num_pages = (ctx + kMlaBlockTokens - 1) / kMlaBlockTokens;
  const int pages_per_split = p.split_pages > 0 ? p.split_pages : (num_pages + p.num_splits - 1) / p.num_splits;
  const int page_begin = split * pages_per_split;
  const int page_end = min(num_pages, page_begin + pages_per_split);

  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = warp / 4;   // m-group: heads [16 group, 16 group + 16) of the block
  const int wn = warp % 4;      // tokens [16 wn, +16) for scores, columns [128 wn, +128) for the output
  const int g = lane / 4;
  const int t = lane % 4;
  const size_t row0 = static_cast<size_t>(b) * p.num_heads + head0 + group * 16 + g;  // rows g and g + 8

  if (page_begin >= page_end) {  // empty split (or empty context): zeros, and lse -inf for the combine
    for (int nt = 0; nt < 16; ++nt) {
      const int col = wn * 128 + nt * 8 + 2 * t;
      for (int half = 0; half < 2; ++half) {
        const size_t row = row0 + 8 * half;
        if (p.num_splits == 1) {
          *reinterpret_cast<uint32_t*>(p.out + row * kMlaLatentDim + col) = 0u;
        } else {
          float* o = p.workspace + (row * p.num_splits + split) * kMlaLatentDim + col;
          o[0] = 0.0f;
          o[1] = 0.0f;
          if (wn == 0 && nt == 0 && t == 0) {
            float* lse = p.workspace + static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * kMlaLatentDim;
            lse[row * p.num_splits + split] = -INFINITY;
          }
        }
      }
    }
    return;
  }

  const int32_t* table = p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
  auto load_page = [&](int page, int buffer) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.kv_cache) +
                         static_cast<size_t>(table[page]) * kPageBytes;
    uint8_t* dst = s_kv + buffer * kPageBytes;
    const int valid_rows = min(kMlaBlockTokens, ctx - page * kMlaBlockTokens);
#pragma unroll 4
    for (int c = tid; c < kMlaBlockTokens * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow;
      const int chunk = c - row * kChunksPerRow;
      cp_async_16(dst + swizzle(row, chunk) * 16, src + c * 16, row < valid_rows);
    }
  };

  {  // Q of the CTA's heads, in the same group as the first page
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.q) +
                         (static_cast<size_t>(b) * p.num_heads + head0) * kRowBytes;
    for (int c = tid; c < kHeadsPerCta * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow;
      const int chunk = c - row * kChunksPerRow;
      cp_async_16(s_q + swizzle(row, chunk) * 16, src + c * 16, true);
    }
  }
  load_page(page_begin, 0);
  cp_async_commit();

  const float scale_log2 = p.scale * kLog2e;
  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of rows g, g + 8
  float l_row[2] = {0.0f, 0.0f};            // this thread's share of the running sum

  float* s_max = s_red + group * 64;
  __nv_bfloat16* s_pg = s_p + group * 16 * kPStride;
  const int barrier_id = 1 + group;

  for (int page = page_begin; page < page_end; ++page) {
    const int buffer = (page - page_begin) & 1;
    cp_async_wait_all();
    __syncthreads();  // page visible to all; everyone is done with the other buffer and with s_max / s_p
    if (page + 1 < page_end) load_page(page + 1, buffer ^ 1);
    cp_async_commit();
    const uint8_t* kv = s_kv + buffer * kPageBytes;

    // S[16 heads, 16 tokens] = Q · Kᵀ over 576 dims.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const int q_row = group * 16 + (lane % 16);
    const int k_row = wn * 16 + (lane % 8) + (lane / 16) * 8;
#pragma unroll 6
    for (int ks = 0; ks < kMlaEntryDim / 16; ++ks) {
      uint32_t a[4];
      uint32_t bk[4];
      ldmatrix_x4(a, s_q + swizzle(q_row, ks * 2 + lane / 16) * 16);
      ldmatrix_x4(bk, kv + swizzle(k_row, ks * 2 + (lane / 8) % 2) * 16);
      mma_bf16(s[0], a, bk[0], bk[1]);
      mma_bf16(s[1], a, bk[2], bk[3]);
    }

    // Scale, mask past the context, row maxima across the group's 4 warps.
    const int token_base = page * kMlaBlockTokens + wn * 16;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = token_base + j * 8 + 2 * t + (e & 1);
        s[j][e] = token < ctx ? s[j][e] * scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    }
    if (t == 0) {
      s_max[wn * 16 + g] = tile_max[0];
      s_max[wn * 16 + g + 8] = tile_max[1];
    }
    named_barrier(barrier_id, 128);
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m_row[r];
#pragma unroll
      for (int w = 0; w < 4; ++w) mx = fmaxf(mx, s_max[w * 16 + g + 8 * r]);
      alpha[r] = exp2f(m_row[r] - mx);  // m_row = -inf on the first page: 0; mx is finite (token 0 of the page is valid)
      m_row[r] = mx;
      l_row[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - m_row[e / 2]);
        l_row[e / 2] += s[j][e];
      }
      const int col = wn * 16 + j * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(s_pg + g * kPStride + col) = pack_bf16x2(s[j][0], s[j][1]);
      *reinterpret_cast<uint32_t*>(s_pg + (g + 8) * kPStride + col) = pack_bf16x2(s[j][2], s[j][3]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }
    named_barrier(barrier_id, 128);  // P of all 64 tokens visible to the group

    // O[16 heads, 128 columns] += P[16, 64] · V[64, 128 columns of this warp].
#pragma unroll
    for (int ks = 0; ks < kMlaBlockTokens / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, s_pg + (lane % 16) * kPStride + ks * 16 + (lane / 16) * 8);
      const int v_row = ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, kv + swizzle(v_row, (wn * 128 + np * 16) / 8 + lane / 16) * 16);
        mma_bf16(acc[2 * np], a, bv[0], bv[1]);
        mma_bf16(acc[2 * np + 1], a, bv[2], bv[3]);
      }
    }
  }

  // Row sums across the group's warps (all warps used the same running maxima).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 1);
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 2);
  }
  if (t == 0) {
    s_max[wn * 16 + g] = l_row[0];
    s_max[wn * 16 + g + 8] = l_row[1];
  }
  named_barrier(barrier_id, 128);
  float total[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    total[r] = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) total[r] += s_max[w * 16 + g + 8 * r];
  }
  const float inv[2] = {1.0f / total[0], 1.0f / total[1]};

  if (p.num_splits == 1) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int col = wn * 128 + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(p.out + row0 * kMlaLatentDim + col) =
          pack_bf16x2(acc[nt][0] * inv[0], acc[nt][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(p.out + (row0 + 8) * kMlaLatentDim + col) =
          pack_bf16x2(acc[nt][2] * inv[1], acc[nt][3] * inv[1]);
    }
  } else {
    float* o0 = p.workspace + (row0 * p.num_splits + split) * kMlaLatentDim;
    float* o1 = p.workspace + ((row0 + 8) * p.num_splits + split) * kMlaLatentDim;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int col = wn * 128 + nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(o0 + col) = make_float2(acc[nt][0] * inv[0], acc[nt][1] * inv[0]);
      *reinterpret_cast<float2*>(o1 + col) = make_float2(acc[nt][2] * inv[1], acc[nt][3] * inv[1]);
    }
    if (wn == 0 && t == 0) {
      float* lse = p.workspace + static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * kMlaLatentDim;
      lse[row0 * p.num_splits + split] = m_row[0] + log2f(total[0]);
      lse[(row0 + 8) * p.num_splits + split] = m_row[1] + log2f(total[1]);
    }
  }
}

// ---- v2: Q in registers, 64 heads per CTA (kernel_version 2: kWN = 4 warps per 16 heads, 512 threads;
// kernel_version 3: kWN = 2, 256 threads). m-group g (warps [g kWN, g kWN + kWN)) owns heads [16g, 16g+16).
// Warp wn of a group holds the mma A fragments of its 16 heads x dims [wn 576/kWN, +576/kWN) in registers for
// the whole sequence (loaded once from global memory). Per page: partial S[16 heads, 64 tokens] over those dims
// (K by ldmatrix, one x4 per two MMAs), stored as f32 to shared memory; after a group barrier each warp sums the
// kWN partials of its tokens [wn 64/kWN, +64/kWN) and continues exactly as v1 (online softmax, P in shared
// memory, P.V for output columns [wn 512/kWN, +512/kWN)).
constexpr int kSStride = kMlaBlockTokens + 8;  // f32 row stride of the partial scores (conflict-free float2)

template <int kWN>
constexpr int v2_smem_bytes() {
  return 2 * kPageBytes                  // two page buffers
         + 4 * kWN * 16 * kSStride * 4   // partial scores [group][warp][16][kSStride] f32
         + 4 * 16 * kPStride * 2         // P per m-group
         + 4 * kWN * 16 * 4;             // per-warp row maxima / row sums
}

template <int kWN>
__global__ void __launch_bounds__(128 * kWN, 1) mla_decode_v2_kernel(const MlaDecodeParams p) {
  constexpr int kGroups = 4;
  constexpr int kThreads = 32 * kWN * kGroups;
  constexpr int kHeadsPerCta = 16 * kGroups;
  constexpr int kKS = kMlaEntryDim / 16 / kWN;  // k-steps of QK per warp: 9 or 18
  constexpr int kTokW = kMlaBlockTokens / kWN;  // tokens per warp for the softmax: 16 or 32
  constexpr int kNT = kTokW / 8;                // score n-tiles per warp
  constexpr int kColW = kMlaLatentDim / kWN;    // output columns per warp: 128 or 256
  constexpr int kOT = kColW / 8;                // output n-tiles per warp
  static_assert(kMlaEntryDim % (16 * kWN) == 0 && kMlaBlockTokens % (8 * kWN) == 0, "layout");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_kv = smem;
  float* s_part = reinterpret_cast<float*>(s_kv + 2 * kPageBytes);
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(s_part + kGroups * kWN * 16 * kSStride);
  float* s_red = reinterpret_cast<float*>(s_p + kGroups * 16 * kPStride);

  const int tid = static_cast<int>(threadIdx.x);
  const int head0 = static_cast<int>(blockIdx.x) * kHeadsPerCta;
  const int split = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int ctx = p.context_lens[b];
  const int num_pages = (ctx + kMlaBlockTokens - 1) / kMlaBlockTokens;
  const int pages_per_split = p.split_pages > 0 ? p.split_pages : (num_pages + p.num_splits - 1) / p.num_splits;
  const int page_begin = split * pages_per_split;
  const int page_end = min(num_pages, page_begin + pages_per_split);

  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group = warp / kWN;
  const int wn = warp % kWN;
  const int g = lane / 4;
  const int t = lane % 4;
  const size_t row0 = static_cast<size_t>(b) * p.num_heads + head0 + group * 16 + g;  // rows g and g + 8

  if (page_begin >= page_end) {  // empty split (or empty context): zeros, and lse -inf for the combine
    for (int nt = 0; nt < kOT; ++nt) {
      const int col = wn * kColW + nt * 8 + 2 * t;
      for (int half = 0; half < 2; ++half) {
        const size_t row = row0 + 8 * half;
        if (p.num_splits == 1) {
          *reinterpret_cast<uint32_t*>(p.out + row * kMlaLatentDim + col) = 0u;
        } else {
          float* o = p.workspace + (row * p.num_splits + split) * kMlaLatentDim + col;
          o[0] = 0.0f;
          o[1] = 0.0f;
          if (wn == 0 && nt == 0 && t == 0) {
            float* lse = p.workspace + static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * kMlaLatentDim;
            lse[row * p.num_splits + split] = -INFINITY;
          }
        }
      }
    }
    return;
  }

  const int32_t* table = p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
  auto load_page = [&](int page, int buffer) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.kv_cache) +
                         static_cast<size_t>(table[page]) * kPageBytes;
    uint8_t* dst = s_kv + buffer * kPageBytes;
    const int valid_rows = min(kMlaBlockTokens, ctx - page * kMlaBlockTokens);
#pragma unroll 4
    for (int c = tid; c < kMlaBlockTokens * kChunksPerRow; c += kThreads) {
      const int row = c / kChunksPerRow;
      const int chunk = c - row * kChunksPerRow;
      cp_async_16(dst + swizzle(row, chunk) * 16, src + c * 16, row < valid_rows);
    }
  };

  load_page(page_begin, 0);
  cp_async_commit();

  // This warp's Q fragments (mma m16n8k16 A layout: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..),
  // a3 = (g+8, 2t+8..) of each 16 x 16 tile), kept in registers for every page.
  uint32_t qf[kKS][4];
  {
    const uint16_t* q0 = p.q + row0 * kMlaEntryDim + wn * kKS * 16 + 2 * t;
    const uint16_t* q1 = q0 + 8 * kMlaEntryDim;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      qf[ks][0] = __ldg(reinterpret_cast<const unsigned int*>(q0 + ks * 16));
      qf[ks][1] = __ldg(reinterpret_cast<const unsigned int*>(q1 + ks * 16));
      qf[ks][2] = __ldg(reinterpret_cast<const unsigned int*>(q0 + ks * 16 + 8));
      qf[ks][3] = __ldg(reinterpret_cast<const unsigned int*>(q1 + ks * 16 + 8));
    }
  }

  const float scale_log2 = p.scale * kLog2e;
  float acc[kOT][4];
#pragma unroll
  for (int i = 0; i < kOT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of rows g, g + 8
  float l_row[2] = {0.0f, 0.0f};            // this thread's share of the running sum

  float* s_max = s_red + group * kWN * 16;
  __nv_bfloat16* s_pg = s_p + group * 16 * kPStride;
  float* part_group = s_part + group * kWN * 16 * kSStride;
  float* part_mine = part_group + wn * 16 * kSStride;
  const int barrier_id = 1 + group;
  // Swizzled byte offsets within a page. The XOR touches only the low 3 bits of the chunk index, so
  // swizzle(row, c + 8m) = swizzle(row, c) + 8m: four per-thread offsets cover every k-step (ks = 4m + k'),
  // the rest are immediates (keeps the address registers out of the register budget).
  const int k_row_lane = (lane % 8) + (lane / 16) * 8;
  const int k_chunk0 = wn * kKS * 2 + (lane / 8) % 2;
  uint32_t k_off[4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) k_off[kk] = static_cast<uint32_t>(swizzle(k_row_lane, k_chunk0 + 2 * kk) * 16);
  const int v_row_lane = (lane % 8) + ((lane / 8) % 2) * 8;
  uint32_t v_off[4];  // chunk wn kColW / 8 (a multiple of 8) + 2 np' + lane / 16, np' = 0..3
#pragma unroll
  for (int nn = 0; nn < 4; ++nn)
    v_off[nn] = static_cast<uint32_t>(swizzle(v_row_lane, wn * kColW / 8 + 2 * nn + lane / 16) * 16);
  const uint32_t s_kv_addr = smem_addr(s_kv);

  for (int page = page_begin; page < page_end; ++page) {
    const int buffer = (page - page_begin) & 1;
    cp_async_wait_all();
    __syncthreads();  // page visible to all; everyone is done with the other buffer, s_part, s_max and s_p
    if (page + 1 < page_end) load_page(page + 1, buffer ^ 1);
    cp_async_commit();
    const uint32_t kv_addr = s_kv_addr + static_cast<uint32_t>(buffer * kPageBytes);

    // Partial S[16 heads, 64 tokens] over this warp's dims, 16 tokens at a time.
#pragma unroll 1
    for (int np = 0; np < kMlaBlockTokens / 16; ++np) {
      float sp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int ks = 0; ks < kKS; ++ks) {
        uint32_t bk[4];
        ldmatrix_x4_a(bk, kv_addr + k_off[ks % 4] + (ks / 4) * 128 + np * 16 * kRowBytes);
        mma_bf16(sp[0], qf[ks], bk[0], bk[1]);
        mma_bf16(sp[1], qf[ks], bk[2], bk[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = np * 16 + j * 8 + 2 * t;
        *reinterpret_cast<float2*>(part_mine + g * kSStride + col) = make_float2(sp[j][0], sp[j][1]);
        *reinterpret_cast<float2*>(part_mine + (g + 8) * kSStride + col) = make_float2(sp[j][2], sp[j][3]);
      }
    }
    named_barrier(barrier_id, 32 * kWN);  // all partials of the group written

    // S of this warp's tokens: the sum of the group's kWN partials.
    float s[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int col = wn * kTokW + j * 8 + 2 * t;
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int src = 0; src < kWN; ++src) {
        const float* pp = part_group + src * 16 * kSStride;
        const float2 lo = *reinterpret_cast<const float2*>(pp + g * kSStride + col);
        const float2 hi = *reinterpret_cast<const float2*>(pp + (g + 8) * kSStride + col);
        s[j][0] += lo.x;
        s[j][1] += lo.y;
        s[j][2] += hi.x;
        s[j][3] += hi.y;
      }
    }

    // Scale, mask past the context, row maxima across the group's warps.
    const int token_base = page * kMlaBlockTokens + wn * kTokW;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = token_base + j * 8 + 2 * t + (e & 1);
        s[j][e] = token < ctx ? s[j][e] * scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    }
    if (t == 0) {
      s_max[wn * 16 + g] = tile_max[0];
      s_max[wn * 16 + g + 8] = tile_max[1];
    }
    named_barrier(barrier_id, 32 * kWN);
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m_row[r];
#pragma unroll
      for (int w = 0; w < kWN; ++w) mx = fmaxf(mx, s_max[w * 16 + g + 8 * r]);
      alpha[r] = exp2f(m_row[r] - mx);  // m_row = -inf on the first page: 0; mx is finite (token 0 of the page is valid)
      m_row[r] = mx;
      l_row[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - m_row[e / 2]);
        l_row[e / 2] += s[j][e];
      }
      const int col = wn * kTokW + j * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(s_pg + g * kPStride + col) = pack_bf16x2(s[j][0], s[j][1]);
      *reinterpret_cast<uint32_t*>(s_pg + (g + 8) * kPStride + col) = pack_bf16x2(s[j][2], s[j][3]);
    }
#pragma unroll
    for (int i = 0; i < kOT; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }
    named_barrier(barrier_id, 32 * kWN);  // P of all 64 tokens visible to the group

    // O[16 heads, kColW columns] += P[16, 64] . V[64, this warp's columns].
#pragma unroll 1
    for (int ks = 0; ks < kMlaBlockTokens / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, s_pg + (lane % 16) * kPStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < kOT / 2; ++np) {
        uint32_t bv[4];
        ldmatrix_x4_trans_a(bv, kv_addr + v_off[np % 4] + (np / 4) * 128 + ks * 16 * kRowBytes);
        mma_bf16(acc[2 * np], a, bv[0], bv[1]);
        mma_bf16(acc[2 * np + 1], a, bv[2], bv[3]);
      }
    }
  }

  // Row sums across the group's warps (all warps used the same running maxima).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 1);
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 2);
  }
  if (t == 0) {
    s_max[wn * 16 + g] = l_row[0];
    s_max[wn * 16 + g + 8] = l_row[1];
  }
  named_barrier(barrier_id, 32 * kWN);
  float total[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    total[r] = 0.0f;
#pragma unroll
    for (int w = 0; w < kWN; ++w) total[r] += s_max[w * 16 + g + 8 * r];
  }
  const float inv[2] = {1.0f / total[0], 1.0f / total[1]};

  if (p.num_splits == 1) {
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt) {
      const int col = wn * kColW + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(p.out + row0 * kMlaLatentDim + col) =
          pack_bf16x2(acc[nt][0] * inv[0], acc[nt][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(p.out + (row0 + 8) * kMlaLatentDim + col) =
          pack_bf16x2(acc[nt][2] * inv[1], acc[nt][3] * inv[1]);
    }
  } else {
    float* o0 = p.workspace + (row0 * p.num_splits + split) * kMlaLatentDim;
    float* o1 = p.workspace + ((row0 + 8) * p.num_splits + split) * kMlaLatentDim;
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt) {
      const int col = wn * kColW + nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(o0 + col) = make_float2(acc[nt][0] * inv[0], acc[nt][1] * inv[0]);
      *reinterpret_cast<float2*>(o1 + col) = make_float2(acc[nt][2] * inv[1], acc[nt][3] * inv[1]);
    }
    if (wn == 0 && t == 0) {
      float* lse = p.workspace + static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * kMlaLatentDim;
      lse[row0 * p.num_splits + split] = m_row[0] + log2f(total[0]);
      lse[(row0 + 8) * p.num_splits + split] = m_row[1] + log2f(total[1]);
    }
  }
}

// out[row] = sum_s 2^(lse_s - max) O_s / sum_s 2^(lse_s - max); one CTA of 128 threads per (sequence, head).
// The split weights are computed once into shared memory (up to kCombineSmemSplits splits), so the loop over the
// splits issues its partial-output loads back to back instead of waiting on each split's lse first (a 16-split
// combine took 10 us at batch 1). Same sums in the same order as a plain loop.
constexpr int kCombineSmemSplits = 1024;

template <int kGroup>
__global__ void __launch_bounds__(128) mla_decode_combine_kernel(const MlaDecodeParams p) {
  pdl_begin();
  __shared__ float s_weight[kCombineSmemSplits];
  const size_t row = static_cast<size_t>(blockIdx.y) * p.num_heads + blockIdx.x;
  const float* lse = p.workspace + static_cast<size_t>(p.batch) * p.num_heads * p.num_splits * kMlaLatentDim +
                     row * p.num_splits;
  const int splits = p.num_splits;
  const bool staged = splits <= kCombineSmemSplits;
  if (staged) {
    for (int s = static_cast<int>(threadIdx.x); s < splits; s += 128) s_weight[s] = lse[s];
    __syncthreads();
  }
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, staged ? s_weight[s] : lse[s]);
  const int col = static_cast<int>(threadIdx.x) * 4;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (mx != -INFINITY) {
    if (staged) {
      __syncthreads();  // every thread has read the lse values
      for (int s = static_cast<int>(threadIdx.x); s < splits; s += 128) s_weight[s] = exp2f(s_weight[s] - mx);
      __syncthreads();
    }
    float weight_sum = 0.0f;
    // kGroup splits' partial outputs loaded together (an empty split's partial is written as zeros, so every load
    // is of written memory), then added in split order, skipping zero weights as before.
    for (int s0 = 0; s0 < splits; s0 += kGroup) {
      float4 o[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
        if (s0 + g < splits)
          o[g] = *reinterpret_cast<const float4*>(p.workspace + (row * p.num_splits + s0 + g) * kMlaLatentDim + col);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (s0 + g >= splits) break;
        const float w = staged ? s_weight[s0 + g] : exp2f(lse[s0 + g] - mx);
        if (w == 0.0f) continue;
        sum.x += w * o[g].x;
        sum.y += w * o[g].y;
        sum.z += w * o[g].z;
        sum.w += w * o[g].w;
        weight_sum += w;
      }
    }
    const float inv = 1.0f / weight_sum;
    sum.x *= inv;
    sum.y *= inv;
    sum.z *= inv;
    sum.w *= inv;
  }
  uint2 packed = make_uint2(pack_bf16x2(sum.x, sum.y), pack_bf16x2(sum.z, sum.w));
  *reinterpret_cast<uint2*>(p.out + row * kMlaLatentDim + col) = packed;
}

// Reference: one CTA of 256 threads per (head, sequence); f32 math on CUDA cores.
__global__ void __launch_bounds__(256) mla_decode_reference_kernel(const MlaDecodeParams p) {
  extern __shared__ float scores[];  // [64 * max_blocks_per_seq]
  __shared__ float scratch[32];
  const int h = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  const int ctx = p.context_lens[b];
  const size_t row = static_cast<size_t>(b) * p.num_heads + h;
  const __nv_bfloat16* q = reinterpret_cast<const __nv_bfloat16*>(p.q) + row * kMlaEntryDim;
  const __nv_bfloat16* cache = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
  const int32_t* table = p.block_table + static_cast<size_t>(b) * p.max_blocks_per_seq;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  auto entry = [&](int j) {
    return cache + (static_cast<size_t>(table[j / kMlaBlockTokens]) * kMlaBlockTokens + j % kMlaBlockTokens) *
                       kMlaEntryDim;
  };
  for (int j = warp; j < ctx; j += 8) {
    const __nv_bfloat16* kv = entry(j);
    float dot = 0.0f;
    for (int c = lane; c < kMlaEntryDim; c += 32) dot += __bfloat162float(q[c]) * __bfloat162float(kv[c]);
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) scores[j] = dot * p.scale;
  }
  __syncthreads();
  float local_max = -INFINITY;
  for (int j = static_cast<int>(threadIdx.x); j < ctx; j += 256) local_max = fmaxf(local_max, scores[j]);
  const float mx = block_reduce(local_max, true, scratch);
  float local_sum = 0.0f;
  for (int j = static_cast<int>(threadIdx.x); j < ctx; j += 256) {
    scores[j] = expf(scores[j] - mx);
    local_sum += scores[j];
  }
  const float sum = block_reduce(local_sum, false, scratch);  // its barriers also publish scores[]
  const float inv = ctx > 0 ? 1.0f / sum : 0.0f;
  for (int c = static_cast<int>(threadIdx.x); c < kMlaLatentDim; c += 256) {
    float acc = 0.0f;
    for (int j = 0; j < ctx; ++j) acc += scores[j] * __bfloat162float(entry(j)[c]);
    reinterpret_cast<__nv_bfloat16*>(p.out)[row * kMlaLatentDim + c] = __float2bfloat16(acc * inv);
  }
}

bool common_params_valid(const MlaDecodeParams& p) {
  return p.batch > 0 && p.num_heads > 0 && p.max_blocks_per_seq > 0 && p.q != nullptr && p.kv_cache != nullptr &&
         p.block_table != nullptr && p.context_lens != nullptr && p.out != nullptr && p.batch <= 65535;
}

cudaError_t launch_combine(const MlaDecodeParams& p) {
  const dim3 grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  // Automatic: all of up to 32 splits' partials in flight at once past 16 splits (batch 1: one round trip to L2
  // instead of four; V2-Lite decode at batch 1 -0.015 ms on an H100), else 8 (fewer registers).
  const int loads = p.combine_loads != 0 ? p.combine_loads : p.num_splits > 16 ? 32 : kMlaCombineLoads;
  switch (loads) {
    case 8: launch_pdl(mla_decode_combine_kernel<8>, grid, 128, 0, p.stream, p); break;
    case 16: launch_pdl(mla_decode_combine_kernel<16>, grid, 128, 0, p.stream, p); break;
    case 32: launch_pdl(mla_decode_combine_kernel<32>, grid, 128, 0, p.stream, p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <int kGroups>
cudaError_t launch_fast(const MlaDecodeParams& p) {
  constexpr int kSmem = fast_smem_bytes<kGroups>();
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (kSmem > smem_optin) return cudaErrorInvalidConfiguration;
  err = cudaFuncSetAttribute(mla_decode_fast_kernel<kGroups>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_heads / (16 * kGroups)), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(p.batch));
  launch_pdl(mla_decode_fast_kernel<kGroups>, grid, 128 * kGroups, kSmem, p.stream, p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_combine(p);
}

template <int kWN>
cudaError_t launch_v2(const MlaDecodeParams& p) {
  constexpr int kSmem = v2_smem_bytes<kWN>();
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (kSmem > smem_optin) return cudaErrorInvalidConfiguration;
  err = cudaFuncSetAttribute(mla_decode_v2_kernel<kWN>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_heads / 64), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(p.batch));
  mla_decode_v2_kernel<kWN><<<grid, 128 * kWN, kSmem, p.stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_combine(p);
}

}  // namespace

size_t mla_decode_workspace_floats(int batch, int num_heads, int num_splits) {
  if (num_splits <= 1) return 0;
  return static_cast<size_t>(batch) * num_heads * num_splits * (kMlaLatentDim + 1);
}

int mla_decode_num_splits(int batch, int num_heads, int max_context, int num_sms, int min_pages_per_split) {
  const int heads_per_cta = num_heads % 64 == 0 ? 64 : 16;
  const int ctas = batch * std::max(1, num_heads / heads_per_cta);
  // One split once the grid nearly fills the chip: on an H200 (132 SMs), batch 128 x H=16 (128 CTAs) ran
  // 158.5 us with 1 split vs 180.5 us with 3 at ctx 4096 (304.0 vs 321.2 us at ctx 8192) -- one page in flight
  // per SM already saturates HBM; the split workspace and combine pass are pure overhead there.
  if (10 * ctas >= 9 * num_sms) return 1;
  const int pages = (max_context + kMlaBlockTokens - 1) / kMlaBlockTokens;
  // One wave: the kernel's shared memory (two 72 KB pages) leaves room for one CTA an SM, so splits past
  // num_sms / ctas queue a second wave. H100, V2-Lite decode at context 4,096 (bench/gpu/NOTES.md, 2026-12-06):
  // batch 8 with 16 splits (128 CTAs) 7.63 ms against 7.83 with 32 (256 CTAs, the old rule of two CTAs an SM).
  // Rounded down: at batch 32, 5 splits (160 CTAs: a second wave of 28) ran 0.32 ms slower than the old rule's 9
  // (288 CTAs, 8 of them empty). Between half and 0.9 of the SMs (one split would leave the rest idle; not measured
  // with one wave) the old rule stays: about two CTAs an SM (batch 80 x H = 16: 4 splits).
  const int target = 2 * ctas > num_sms ? (2 * num_sms + ctas - 1) / ctas : num_sms / ctas;
  // At least `min_pages_per_split` pages a split (default 2: at batch 1, H = 16, context 4,096, 32 splits of 2
  // pages ran the step as fast as 64 of 1 and 0.09 ms faster than 16 of 4), then the fewest splits at that size.
  const int per_split = std::max({1, min_pages_per_split, (pages + target - 1) / target});
  return std::clamp((pages + per_split - 1) / per_split, 1, 64);
}

int mla_decode_invariant_splits(int max_context) {
  const int pages = (std::max(max_context, 1) + kMlaBlockTokens - 1) / kMlaBlockTokens;
  return (pages + kMlaInvariantSplitPages - 1) / kMlaInvariantSplitPages;
}

cudaError_t run_mla_decode(const MlaDecodeParams& p) {
  if (!common_params_valid(p) || p.num_heads % 16 != 0 || p.num_splits < 1 || p.num_splits > 65535 ||
      p.split_pages < 0 ||
      (p.split_pages > 0 && static_cast<int64_t>(p.num_splits) * p.split_pages < p.max_blocks_per_seq)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_splits > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  if (p.combine_loads != 0 && p.combine_loads != 8 && p.combine_loads != 16 && p.combine_loads != 32)
    return cudaErrorInvalidValue;
  int heads_per_cta = p.heads_per_cta;
  if (heads_per_cta == 0) heads_per_cta = p.num_heads % 64 == 0 ? 64 : 16;
  if (p.num_heads % heads_per_cta != 0) return cudaErrorInvalidValue;
  int version = p.kernel_version;
  // Automatic: v2 with 2 warps per 16 heads (Q in registers, 16 B spill) where it applies; v2 with 4 warps
  // spills ~120 B at its 128-register cap (bench/gpu/NOTES.md).
  if (version == 0) version = heads_per_cta == 64 ? 3 : 1;
  if (version == 2 || version == 3) {
    if (heads_per_cta != 64) return cudaErrorInvalidValue;
    return version == 2 ? launch_v2<4>(p) : launch_v2<2>(p);
  }
  if (version != 1) return cudaErrorInvalidValue;
  switch (heads_per_cta) {
    case 16: return launch_fast<1>(p);
    case 32: return launch_fast<2>(p);
    case 64: return launch_fast<4>(p);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run_mla_decode_reference(const MlaDecodeParams& p) {
  if (!common_params_valid(p)) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(p.max_blocks_per_seq) * kMlaBlockTokens * sizeof(float);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (smem + 32 * sizeof(float) > static_cast<size_t>(smem_optin)) return cudaErrorInvalidValue;
  err = cudaFuncSetAttribute(mla_decode_reference_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  mla_decode_reference_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), 256, smem,
                                p.stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
