// MLA prefill attention, expanded form (FlashAttention-2 style, varlen, causal): two fast tensor-core kernels (wgmma
// on sm_90a, the default; mma.sync) and a simple f32 reference kernel. Contracts in
// include/deepinfer/kernels/cuda/mla_prefill.h.
//
// Fast kernels (described here: the mma.sync one; the wgmma one differs in the MMAs, the shared-memory layout and
// 64 or 128 query rows per CTA, see above it): CTA = (64-query tile, head, sequence), 128 threads (4 warps),
// heaviest tiles launched first.
//   - warp w owns query rows [16w, 16w+16) of the tile; its Q fragments (16 x 192 bf16, 48 registers) are loaded
//     once by ldmatrix from shared memory (wgmma: Q stays in shared memory);
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

#include "wgmma.cuh"

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


// What one CTA (query tile `tile` of sequence b, head h) covers; shared by both fast kernels.
struct TileContext {
  int seq_begin = 0, len = 0;       // the sequence's packed query rows
  int key_begin = 0, key_len = 0;   // its keys
  int q_pos0 = 0;                   // position of query row 0 relative to key 0
  int q0 = 0;                       // the tile's first query row (local to the sequence)
  int num_key_tiles = 0;            // key tiles visible to some row of the tile
  int split = 0;                    // which of the key splits (MlaPrefillParams::key_splits) this CTA runs
  int kt_begin = 0, kt_end = 0;     // its key tiles: [kt_begin, kt_end) of the num_key_tiles
};

// False when the CTA has no rows (past the sequence's tiles). Heaviest (last) tiles first. kRows query rows per CTA;
// kSplit: the launch splits the keys (p.key_splits > 1), else the CTA takes all of them (compiled without the split's
// arithmetic: with it in every launch the 128-row kernel measured 5-8% slower, bench/gpu/NOTES.md).
template <int kRows = kTileM, bool kSplit = false>
__device__ __forceinline__ bool tile_context(const MlaPrefillParams& p, TileContext& c) {
  const int b = static_cast<int>(blockIdx.z);
  c.seq_begin = p.cu_seqlens[b];
  c.len = p.cu_seqlens[b + 1] - c.seq_begin;
  c.key_begin = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b] : c.seq_begin;
  c.key_len = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[b + 1] - c.key_begin : c.len;
  c.q_pos0 = (p.q_positions != nullptr ? p.q_positions[b] : 0) - p.key_position;
  const int num_tiles = (c.len + kRows - 1) / kRows;
  // blockIdx.x = query tile (heaviest first) x key split.
  const int splits = kSplit ? max(p.key_splits, 1) : 1;
  const int tile = static_cast<int>(gridDim.x) / splits - 1 - static_cast<int>(blockIdx.x) / splits;
  c.split = static_cast<int>(blockIdx.x) % splits;
  if (tile >= num_tiles) return false;
  c.q0 = tile * kRows;
  // Keys visible to some row of the tile: positions up to its last row's (relative to the first key).
  const int last_row_pos = c.q_pos0 + min(c.q0 + kRows, c.len) - 1;
  const int visible = min(c.key_len, last_row_pos + 1);
  c.num_key_tiles = visible > 0 ? (visible + kTileN - 1) / kTileN : 0;
  c.kt_begin = kSplit ? c.num_key_tiles * c.split / splits : 0;
  c.kt_end = kSplit ? c.num_key_tiles * (c.split + 1) / splits : c.num_key_tiles;
  return true;
}

// The accumulators of both kernels in one flat layout: s[4j + e] is S's n8 block j (keys 8j..8j+7 of the tile),
// acc[4nt + e] O's columns 8nt..8nt+7; e = 0, 1: row g, columns 2t, 2t + 1; e = 2, 3: row g + 8 (mma.sync's D
// fragment, which is also wgmma's accumulator layout per warp).
__device__ __forceinline__ float (&quad(float* a, int j))[4] { return *reinterpret_cast<float(*)[4]>(a + 4 * j); }

// Online softmax over one key tile (keys k0..k0+63): scale (log2 domain), causal mask and keys past the sequence,
// running max/sum per row; alpha = the factor O must be rescaled by before this tile's P · V is added (the caller
// applies it: at once, or after the previous tile's P · V has landed); P = exp2(S - m) packed into pf as the A
// operand of P · V (k16 step kk = S's n8 blocks 2kk, 2kk + 1).
__device__ __forceinline__ void softmax_stats(float (&s)[kTileN / 2], int k0, int key_len, const int (&row_key)[2],
                                              int first_row_key, float scale_log2, float (&m_row)[2],
                                              float (&l_row)[2], float (&alpha)[2], uint32_t (&pf)[kTileN / 16][4],
                                              int t) {
  const bool need_mask = k0 + kTileN - 1 > first_row_key || k0 + kTileN > key_len;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * j + e] * scale_log2;
      if (need_mask) {
        const int key = k0 + j * 8 + 2 * t + (e & 1);
        if (key > row_key[e / 2] || key >= key_len) x = -INFINITY;
      }
      s[4 * j + e] = x;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
    }
  }
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
  for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[4 * j + e] = exp2f(s[4 * j + e] - m_use[e / 2]);
      l_row[e / 2] += s[4 * j + e];
    }
    pf[j / 2][(j % 2) * 2 + 0] = pack_bf16x2(s[4 * j + 0], s[4 * j + 1]);
    pf[j / 2][(j % 2) * 2 + 1] = pack_bf16x2(s[4 * j + 2], s[4 * j + 3]);
  }
}

__device__ __forceinline__ void rescale_rows(float (&acc)[kMlaPrefillVDim / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kMlaPrefillVDim / 8; ++i) {
    acc[4 * i + 0] *= alpha[0];
    acc[4 * i + 1] *= alpha[0];
    acc[4 * i + 2] *= alpha[1];
    acc[4 * i + 3] *= alpha[1];
  }
}

// softmax_stats with O rescaled at once (before this tile's P · V).
__device__ __forceinline__ void softmax_tile(float (&s)[kTileN / 2], int k0, int key_len, const int (&row_key)[2],
                                             int first_row_key, float scale_log2, float (&m_row)[2],
                                             float (&l_row)[2], float (&acc)[kMlaPrefillVDim / 2],
                                             uint32_t (&pf)[kTileN / 16][4], int t) {
  float alpha[2];
  softmax_stats(s, k0, key_len, row_key, first_row_key, scale_log2, m_row, l_row, alpha, pf, t);
  rescale_rows(acc, alpha);
}

// Merging a normalised row with log-sum-exp `lse` into a running one with `old_lse` (log2 domain): the weights of the
// old and new rows, and the merged log-sum-exp. Neither has a visible key (both -inf): weights 0, lse -inf.
struct MergeWeights {
  float w_old = 0.0f, w_new = 0.0f, lse = -INFINITY;
};
__device__ __forceinline__ MergeWeights merge_weights(float old_lse, float lse) {
  MergeWeights m;
  const float mx = fmaxf(old_lse, lse);
  if (mx != -INFINITY) {
    const float a = exp2f(old_lse - mx), cc = exp2f(lse - mx), sum = a + cc;
    m.w_old = a / sum;
    m.w_new = cc / sum;
    m.lse = mx + log2f(sum);
  }
  return m;
}

// Row sums across the quad, normalize; store (or merge) this thread's rows inside the sequence (rows 16 warp + g,
// + 8 of the tile).
template <bool kSplit = false>
__device__ __forceinline__ void write_rows(const MlaPrefillParams& p, const TileContext& c, int h,
                                           const float (&acc)[kMlaPrefillVDim / 2], const float (&m_row)[2],
                                           float (&l_row)[2], const int (&row_pos)[2], int t) {
  const size_t H = static_cast<size_t>(p.num_heads);
  // A CTA of a key split writes its normalised rows and log-sum-exps to its split's slot, as a first merge chunk;
  // the combine pass merges the splits and applies p.merge.
  constexpr bool split = kSplit;
  const MlaPrefillMerge merge = split ? MlaPrefillMerge::kFirst : p.merge;
  float* const o_acc = split ? p.split_o + static_cast<size_t>(c.split) * p.split_rows * H * kMlaPrefillVDim : p.o_acc;
  float* const lse_acc = split ? p.split_lse + static_cast<size_t>(c.split) * p.split_rows * H : p.lse_acc;
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 1);
    l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 2);
    inv[r] = l_row[r] > 0.0f ? 1.0f / l_row[r] : 0.0f;
    lse[r] = l_row[r] > 0.0f ? m_row[r] + log2f(l_row[r]) : -INFINITY;  // log2 domain, scale included
  }
  const bool merging = merge == MlaPrefillMerge::kMiddle || merge == MlaPrefillMerge::kLast;
  float old_lse[2] = {-INFINITY, -INFINITY};
  if (merging) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (row_pos[r] < c.len) old_lse[r] = lse_acc[(static_cast<size_t>(c.seq_begin) + row_pos[r]) * H + h];
    __syncwarp();  // every lane read lse_acc before a t == 0 lane writes it (kMiddle)
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_pos[r] >= c.len) continue;
    const size_t out_row = (static_cast<size_t>(c.seq_begin) + row_pos[r]) * H + h;
    uint16_t* o = p.out + out_row * kMlaPrefillVDim;
    float w_old = 0.0f, w_new = inv[r];  // the row = o_acc * w_old + acc * w_new
    if (merge == MlaPrefillMerge::kFirst) {
      if (t == 0) lse_acc[out_row] = lse[r];
    } else if (merging) {
      const MergeWeights m = merge_weights(old_lse[r], lse[r]);
      w_old = m.w_old;
      w_new = inv[r] * m.w_new;
      if (merge == MlaPrefillMerge::kMiddle && t == 0 && m.lse != -INFINITY) lse_acc[out_row] = m.lse;
    }
    float* oa = o_acc == nullptr ? nullptr : o_acc + out_row * kMlaPrefillVDim;
#pragma unroll
    for (int nt = 0; nt < kMlaPrefillVDim / 8; ++nt) {
      float x0 = acc[4 * nt + 2 * r] * w_new, x1 = acc[4 * nt + 2 * r + 1] * w_new;
      if (merging) {
        const float2 prev = *reinterpret_cast<const float2*>(oa + nt * 8 + 2 * t);
        x0 += prev.x * w_old;
        x1 += prev.y * w_old;
      }
      if (merge == MlaPrefillMerge::kNone || merge == MlaPrefillMerge::kLast)
        *reinterpret_cast<uint32_t*>(o + nt * 8 + 2 * t) = pack_bf16x2(x0, x1);
      else
        *reinterpret_cast<float2*>(oa + nt * 8 + 2 * t) = make_float2(x0, x1);
    }
  }
}

// Shared-memory layout of the two kernels, as byte offsets of 16-byte chunk `chunk` of row `row`:
//   mma.sync kernel: rows of 24 (q, k) or 16 (v) chunks, chunk index XOR (row & 7);
//   wgmma kernel: 64-column atoms ([rows][128 bytes], 128-byte swizzled, wgmma.cuh), atom chunk / 8 at
//   atom_bytes * (chunk / 8).
template <bool kWgmma, int kChunks, int kRows>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  if constexpr (kWgmma) {
    return (chunk / 8) * kRows * 128 + row * 128 + (((chunk % 8) ^ (row & 7)) << 4);
  } else {
    return swz<kChunks>(row, chunk);
  }
}

template <bool kWgmma, int kRows = kTileM, int kCtaThreads = kThreads>
__device__ __forceinline__ void load_q(uint8_t* s_q, const MlaPrefillParams& p, const TileContext& c, int h, int tid) {
  const size_t H = static_cast<size_t>(p.num_heads);
  constexpr size_t kQkRowBytes = kMlaPrefillQkDim * 2;
  const uint8_t* q_base = reinterpret_cast<const uint8_t*>(p.q);
#pragma unroll
  for (int i = 0; i < kRows * kQkChunks / kCtaThreads; ++i) {
    const int ci = tid + i * kCtaThreads;
    const int row = ci / kQkChunks;
    const int chunk = ci - row * kQkChunks;
    const bool valid = c.q0 + row < c.len;
    const size_t token = static_cast<size_t>(c.seq_begin) + (valid ? c.q0 + row : 0);
    cp_async_16(s_q + tile_offset<kWgmma, kQkChunks, kRows>(row, chunk),
                q_base + (token * H + h) * kQkRowBytes + chunk * 16, valid);
  }
}

// Key tile `key_tile` (64 keys) of head h into dk: each key row is 16 chunks of k_nope, then 8 of the roped key
// (separate loops: no divergent select). Rows past the sequence are zero-filled.
template <bool kWgmma, int kCtaThreads = kThreads>
__device__ __forceinline__ void load_k(uint8_t* dk, const MlaPrefillParams& p, const TileContext& c, int h,
                                       int key_tile, int tid) {
  constexpr int kNopeChunks = (kMlaPrefillQkDim - 64) * 2 / 16;  // 16 of the 24 chunks of a key row
  const uint16_t* k_nope = p.k_nope + static_cast<int64_t>(h) * p.k_head_stride;
  const uint16_t* k_rope = p.k_rope + static_cast<int64_t>(h) * p.k_rope_head_stride;
  const int k0 = key_tile * kTileN;
#pragma unroll
  for (int i = 0; i < kTileN * kNopeChunks / kCtaThreads; ++i) {
    const int ci = tid + i * kCtaThreads;
    const int row = ci / kNopeChunks;
    const int chunk = ci % kNopeChunks;
    const bool valid = k0 + row < c.key_len;
    const int64_t token = static_cast<int64_t>(c.key_begin) + (valid ? k0 + row : 0);
    cp_async_16(dk + tile_offset<kWgmma, kQkChunks, kTileN>(row, chunk), k_nope + token * p.k_token_stride + chunk * 8,
                valid);
  }
#pragma unroll
  for (int i = 0; i < kTileN * (kQkChunks - kNopeChunks) / kCtaThreads; ++i) {
    const int ci = tid + i * kCtaThreads;
    const int row = ci / (kQkChunks - kNopeChunks);
    const int chunk = ci % (kQkChunks - kNopeChunks);
    const bool valid = k0 + row < c.key_len;
    const int64_t token = static_cast<int64_t>(c.key_begin) + (valid ? k0 + row : 0);
    cp_async_16(dk + tile_offset<kWgmma, kQkChunks, kTileN>(row, kNopeChunks + chunk),
                k_rope + token * p.k_rope_token_stride + chunk * 8, valid);
  }
}

// Value tile `key_tile` of head h into dv (rows past the sequence zero-filled).
template <bool kWgmma, int kCtaThreads = kThreads>
__device__ __forceinline__ void load_v(uint8_t* dv, const MlaPrefillParams& p, const TileContext& c, int h,
                                       int key_tile, int tid) {
  const uint16_t* v_head = p.v + static_cast<int64_t>(h) * p.v_head_stride;
  const int k0 = key_tile * kTileN;
#pragma unroll
  for (int i = 0; i < kTileN * kVChunks / kCtaThreads; ++i) {
    const int ci = tid + i * kCtaThreads;
    const int row = ci / kVChunks;
    const int chunk = ci - row * kVChunks;
    const bool valid = k0 + row < c.key_len;
    const int64_t token = static_cast<int64_t>(c.key_begin) + (valid ? k0 + row : 0);
    cp_async_16(dv + tile_offset<kWgmma, kVChunks, kTileN>(row, chunk), v_head + token * p.v_token_stride + chunk * 8,
                valid);
  }
}

template <bool kWgmma, int kCtaThreads = kThreads>
__device__ __forceinline__ void load_kv(uint8_t* dk, uint8_t* dv, const MlaPrefillParams& p, const TileContext& c,
                                        int h, int key_tile, int tid) {
  load_k<kWgmma, kCtaThreads>(dk, p, c, h, key_tile, tid);
  load_v<kWgmma, kCtaThreads>(dv, p, c, h, key_tile, tid);
}

// The mma.sync kernel (any sm_80+ tensor core; kept beside the wgmma one for comparison: DEEPINFER_MLA_PREFILL=mma).
__global__ void __launch_bounds__(kThreads, 2) mla_prefill_fast_kernel(const MlaPrefillParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_k = s_q + kQTileBytes;                 // two K buffers
  uint8_t* s_v = s_k + 2 * kKTileBytes;             // two V buffers

  TileContext c;
  if (!tile_context(p, c)) return;
  const int h = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  load_q<false>(s_q, p, c, h, tid);
  if (c.num_key_tiles > 0) load_kv<false>(s_k, s_v, p, c, h, 0, tid);
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
  float acc[kMlaPrefillVDim / 2];
#pragma unroll
  for (int i = 0; i < kMlaPrefillVDim / 2; ++i) acc[i] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of rows g, g + 8 of the warp
  float l_row[2] = {0.0f, 0.0f};            // this thread's share of the running sum
  const int row_pos[2] = {c.q0 + warp * 16 + g, c.q0 + warp * 16 + g + 8};  // local query rows of the two rows
  const int row_key[2] = {c.q_pos0 + row_pos[0], c.q_pos0 + row_pos[1]};     // the last key each may see
  const int first_row_key = c.q_pos0 + c.q0;  // the tile's first row: keys past it need the mask

  const int last_tile = c.num_key_tiles - 1;
  for (int kt = 0; kt <= last_tile; ++kt) {
    const int buffer = kt & 1;
    if (kt > 0) {
      cp_async_wait_all();
      __syncthreads();  // tile kt visible to all; everyone done with buffer (kt+1)&1 (used by tile kt-1)
    }
    if (kt + 1 <= last_tile) load_kv<false>(s_k + (buffer ^ 1) * kKTileBytes, s_v + (buffer ^ 1) * kVTileBytes, p, c, h,
                                            kt + 1, tid);
    cp_async_commit();
    const uint8_t* sk = s_k + buffer * kKTileBytes;
    const uint8_t* sv = s_v + buffer * kVTileBytes;

    // S[16 rows, 64 keys] = Q · Kᵀ over 192 dims.
    float s[kTileN / 2];
#pragma unroll
    for (int j = 0; j < kTileN / 2; ++j) s[j] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kMlaPrefillQkDim / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kTileN / 16; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sk + swz<kQkChunks>(np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
        mma_bf16(quad(s, 2 * np), qf[ks], bk[0], bk[1]);
        mma_bf16(quad(s, 2 * np + 1), qf[ks], bk[2], bk[3]);
      }
    }
    uint32_t pf[kTileN / 16][4];
    softmax_tile(s, kt * kTileN, c.key_len, row_key, first_row_key, scale_log2, m_row, l_row, acc, pf, t);

    // O[16 rows, 128] += P[16, 64] · V[64, 128].
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk) {
      const int v_row = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int np = 0; np < kMlaPrefillVDim / 16; ++np) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sv + swz<kVChunks>(v_row, np * 2 + lane / 16));
        mma_bf16(quad(acc, 2 * np), pf[kk], bv[0], bv[1]);
        mma_bf16(quad(acc, 2 * np + 1), pf[kk], bv[2], bv[3]);
      }
    }
  }
  cp_async_wait_all();  // nothing outstanding at exit (the last commit was an empty group)
  write_rows(p, c, h, acc, m_row, l_row, row_pos, t);
}

// The wgmma kernel (sm_90a): the same tiles and softmax, with S = Q · Kᵀ as 12 wgmma m64n64k16 reading Q and K
// from shared memory, and O += P · V as 4 wgmma m64n128k16 with P from registers and V from shared memory (N-major:
// V's rows as stored). kRows = 64: one warpgroup per CTA, as the mma.sync kernel; kRows = 128: two warpgroups
// sharing each K/V tile (half the shared-memory fill per FLOP), for grids large enough to fill the GPU. Shared
// memory: Q in three 64-dim atoms [kRows][128 B], each K buffer in three [64][128 B], each V buffer in two 64-column
// atoms [64 keys][128 B], all 128-byte swizzled and 1,024-byte aligned.
template <int kRows>
struct WgmmaTile {
  static constexpr int kCtaThreads = kRows * 2;  // a warpgroup (128 threads) per 64 rows
  static constexpr int kQBytes = kRows * kQkChunks * 16;
  static constexpr int kSmemBytes = kQBytes + 2 * (kKTileBytes + kVTileBytes) + 1024;  // + alignment
  // The load loops run a fixed number of rounds of kCtaThreads 16-byte chunks (no remainder handling).
  static_assert(kRows * kQkChunks % kCtaThreads == 0 && kTileN * 16 % kCtaThreads == 0 &&
                kTileN * 8 % kCtaThreads == 0);
};

template <int kRows, bool kOverlap, bool kSplit>
__global__ void __launch_bounds__(kRows * 2, kRows == 64 ? 2 : 1) mla_prefill_wgmma_kernel(const MlaPrefillParams p) {
  using W = WgmmaTile<kRows>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint8_t* s_q = smem;
  uint8_t* s_k = s_q + W::kQBytes;                  // two K buffers
  uint8_t* s_v = s_k + 2 * kKTileBytes;             // two V buffers

  TileContext c;
  if (!tile_context<kRows, kSplit>(p, c)) return;
  const int h = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;  // rows 16 warp .. + 15 of the tile
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const uint32_t warpgroup_rows = static_cast<uint32_t>(tid / 128) * 64 * 128;  // its 64 rows inside a Q atom

  const float scale_log2 = p.scale * kLog2e;
  float acc[kMlaPrefillVDim / 2];
#pragma unroll
  for (int i = 0; i < kMlaPrefillVDim / 2; ++i) acc[i] = 0.0f;
  float m_row[2] = {-INFINITY, -INFINITY};
  float l_row[2] = {0.0f, 0.0f};
  const int row_pos[2] = {c.q0 + warp * 16 + g, c.q0 + warp * 16 + g + 8};
  const int row_key[2] = {c.q_pos0 + row_pos[0], c.q_pos0 + row_pos[1]};
  const int first_row_key = c.q_pos0 + c.q0 + warp / 4 * 64;  // this warpgroup's first row
  const uint32_t q_addr = smem_addr(s_q) + warpgroup_rows;
  // This CTA's key tiles (all of them unless the keys are split); tile kt sits in buffer kt & 1.
  const int first_tile = kSplit ? c.kt_begin : 0, last_tile = c.kt_end - 1;

  // S = Q · K(kt)ᵀ over 192 dims as 12 wgmma m64n64k16 (one batch; s must hold zeros).
  auto issue_scores = [&](float(&s)[kTileN / 2], int kt) {
    const uint32_t k_addr = smem_addr(s_k + (kt & 1) * kKTileBytes);
#pragma unroll
    for (int ks = 0; ks < kMlaPrefillQkDim / 16; ++ks) {
      const uint32_t step = static_cast<uint32_t>(ks % 4) * 32u;
      const uint32_t q_atom = static_cast<uint32_t>(ks / 4) * kRows * 128u, k_atom = (ks / 4) * kTileN * 128u;
      wgmma_m64n64k16_bf16(s, wgmma_descriptor(q_addr + q_atom + step), wgmma_descriptor(k_addr + k_atom + step));
    }
    wgmma_commit();
  };
  // S's accumulators zeroed, the zeros fenced before the next wgmma.fence (PTX: register writes, then the fence).
  auto zero_scores = [](float(&s)[kTileN / 2]) {
#pragma unroll
    for (int j = 0; j < kTileN / 2; ++j) s[j] = 0.0f;
    wgmma_fence_operands(s);
  };
  // O += P · V(kt) as 4 wgmma m64n128k16, P from registers (one batch).
  auto issue_values = [&](const uint32_t(&pf)[kTileN / 16][4], int kt) {
    const uint32_t v_addr = smem_addr(s_v + (kt & 1) * kVTileBytes);
#pragma unroll
    for (int kk = 0; kk < kTileN / 16; ++kk)  // keys 16kk..16kk+15: two 8-row groups of V's atoms
      wgmma_m64n128k16_bf16_rs_tn(acc, pf[kk], wgmma_descriptor_mn(v_addr + kk * 2048u, kTileN * 128u));
    wgmma_commit();
  };

  if constexpr (!kOverlap) {
    // Serial: per tile, S's MMAs, wait, softmax (O rescaled), P · V's MMAs, wait. Tile kt's K and V share buffer
    // kt & 1; the next tile's are loaded while this one computes.
    load_q<true, kRows, W::kCtaThreads>(s_q, p, c, h, tid);
    if (last_tile >= first_tile)
      load_kv<true, W::kCtaThreads>(s_k + (first_tile & 1) * kKTileBytes, s_v + (first_tile & 1) * kVTileBytes, p, c,
                                    h, first_tile, tid);
    cp_async_commit();
    // Every warpgroup runs all the CTA's key tiles (the barrier is shared); a tile past a row's last key is masked.
    for (int kt = first_tile; kt <= last_tile; ++kt) {
      const int buffer = kt & 1;
      cp_async_wait_all();
      fence_async_shared();  // this thread's copies visible to wgmma (the async proxy)
      __syncthreads();       // tile kt (and Q) landed for all; every wgmma of tile kt - 1 finished (waited below)
      if (kt + 1 <= last_tile)
        load_kv<true, W::kCtaThreads>(s_k + (buffer ^ 1) * kKTileBytes, s_v + (buffer ^ 1) * kVTileBytes, p, c, h,
                                      kt + 1, tid);
      cp_async_commit();
      float s[kTileN / 2];
      zero_scores(s);
      wgmma_fence();
      issue_scores(s, kt);
      wgmma_wait<0>();
      wgmma_fence_operands(s);
      uint32_t pf[kTileN / 16][4];
      softmax_tile(s, kt * kTileN, c.key_len, row_key, first_row_key, scale_log2, m_row, l_row, acc, pf, t);
      wgmma_fence_operands(acc);
      wgmma_fence_operands(pf);
      wgmma_fence();  // acc was rescaled and pf written by ordinary instructions
      issue_values(pf, kt);
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
    }
  } else {
    // Overlapped (FlashAttention-3's intra-warpgroup pipelining): at tile kt the scores of tile kt and P · V of tile
    // kt - 1 are issued together; the softmax of tile kt runs while P · V(kt - 1) is on the tensor cores, and O is
    // rescaled once it has landed. The additions and rescales come in the serial order, so the result is the same
    // bit for bit. Loads: K(kt) is needed a tile before V(kt), so the group issued at tile kt is {K(kt + 1), V(kt)}
    // (K(kt + 1) into the K buffer S(kt - 1) read, V(kt) into the V buffer P · V(kt - 2) read; both waited for
    // before the barrier).
    load_q<true, kRows, W::kCtaThreads>(s_q, p, c, h, tid);
    if (last_tile >= first_tile)
      load_k<true, W::kCtaThreads>(s_k + (first_tile & 1) * kKTileBytes, p, c, h, first_tile, tid);
    cp_async_commit();
    uint32_t pf[kTileN / 16][4];  // P of the tile before the current one (its P · V not yet issued)
    // Top of tile kt: K(kt) and V(kt - 1) landed for all, and every wgmma of tile kt - 1 finished (each warpgroup
    // waited for its own before the barrier).
    auto arrive = [] {
      cp_async_wait_all();
      fence_async_shared();
      __syncthreads();
    };
    // The loads of K(kt + 1) and V(kt), issued before tile kt's MMAs (which read neither buffer). Issuing them after
    // the MMAs measured 12% slower at 128 rows and 23% at 64 (H100: 46.9 -> 52.4 ms, 85 -> 105 us; bench/gpu/NOTES.md).
    auto load_next = [&](int kt) {
      if (kt + 1 <= last_tile) load_k<true, W::kCtaThreads>(s_k + ((kt + 1) & 1) * kKTileBytes, p, c, h, kt + 1, tid);
      load_v<true, W::kCtaThreads>(s_v + (kt & 1) * kVTileBytes, p, c, h, kt, tid);
      cp_async_commit();
    };
    if (last_tile >= first_tile) {  // the first tile: its scores and softmax (O is zero: nothing to rescale)
      arrive();
      load_next(first_tile);
      float s[kTileN / 2];
      zero_scores(s);
      wgmma_fence();
      issue_scores(s, first_tile);
      wgmma_wait<0>();
      wgmma_fence_operands(s);
      float alpha[2];
      softmax_stats(s, first_tile * kTileN, c.key_len, row_key, first_row_key, scale_log2, m_row, l_row, alpha, pf, t);
      rescale_rows(acc, alpha);  // 0 * 0, as the serial kernel does
    }
    for (int kt = first_tile + 1; kt <= last_tile; ++kt) {
      arrive();
      load_next(kt);
      float s[kTileN / 2];
      zero_scores(s);  // s zeroed, acc rescaled and pf written by ordinary instructions before the fence
      wgmma_fence_operands(acc);
      wgmma_fence_operands(pf);
      wgmma_fence();
      issue_scores(s, kt);
      issue_values(pf, kt - 1);
      wgmma_wait<1>();  // the scores (the older batch) landed; P · V(kt - 1) may still run
      wgmma_fence_operands(s);
      float alpha[2];
      uint32_t pf_next[kTileN / 16][4];
      softmax_stats(s, kt * kTileN, c.key_len, row_key, first_row_key, scale_log2, m_row, l_row, alpha, pf_next, t);
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
      wgmma_fence_operands(pf);  // P · V(kt - 1)'s A operand: its registers keep their values until it landed
      rescale_rows(acc, alpha);
#pragma unroll
      for (int kk = 0; kk < kTileN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) pf[kk][e] = pf_next[kk][e];
    }
    if (last_tile >= first_tile) {
      arrive();  // V(last) landed for all
      wgmma_fence_operands(acc);
      wgmma_fence_operands(pf);
      wgmma_fence();
      issue_values(pf, last_tile);
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
    }
  }
  cp_async_wait_all();
  write_rows<kSplit>(p, c, h, acc, m_row, l_row, row_pos, t);
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

// The kernel, its shared memory, rows per CTA and threads for `p`. kWgmma picks the rows per CTA by waves: 64-row
// CTAs run two per SM, 128-row ones one per SM at ~1.2x the SM's throughput with the softmax overlapped (H100,
// H = 128: 1 x 32,768 127.8 vs 102.5 ms, 3,080 after 73,920 57.4 vs 47.0, 8 x 4,096 17.0 vs 14.6) and ~1.1x without
// (H200: 133 vs 118.5 ms; 17.6 vs 16.1), so 128 rows win unless their last wave is mostly empty (V2-Lite's 3,080 rows
// at H = 16: 400 CTAs = 3.03 waves at 128 rows against 784 = 2.97 at 64; 285 vs 230 ms at the model level).
struct PrefillLaunch {
  void (*kernel)(MlaPrefillParams);
  int smem, rows, threads;
  int splits;  // key splits (MlaPrefillParams::key_splits as launched)
};
PrefillLaunch prefill_launch(const MlaPrefillParams& p, int num_sms) {
  MlaPrefillKernel k = p.kernel;
  int splits = std::max(p.key_splits, 1);
  if (p.key_splits > 1) k = MlaPrefillKernel::kWgmma128;  // forced splits (validated by the caller)
  if (k == MlaPrefillKernel::kWgmma) {
    const int64_t sms = std::max(num_sms, 1), heads = p.num_heads;
    const int64_t tiles_64 = p.tiles_64 > 0 ? p.tiles_64 : static_cast<int64_t>((p.max_seqlen + 63) / 64) * p.num_seqs;
    const int64_t tiles_128 =
        p.tiles_128 > 0 ? p.tiles_128 : static_cast<int64_t>((p.max_seqlen + 127) / 128) * p.num_seqs;
    const bool can_split = p.key_splits == 0 && p.split_o != nullptr && p.split_lse != nullptr && p.split_rows > 0;
    MlaPrefillGrid g;
    g.tiles_64 = tiles_64;
    g.tiles_128 = tiles_128;
    g.heads = heads;
    g.sms = sms;
    g.max_keys = p.max_seqlen_k > 0 ? p.max_seqlen_k : p.max_seqlen;
    g.overlap = p.wgmma_overlap;
    g.max_splits = can_split ? p.max_key_splits : 1;
    const MlaPrefillShape shape = choose_mla_prefill_shape(g);
    k = shape.rows_per_cta == 128 ? MlaPrefillKernel::kWgmma128 : MlaPrefillKernel::kWgmma64;
    splits = shape.key_splits;
  }
  if (k != MlaPrefillKernel::kWgmma128) splits = 1;
  switch (k) {
    case MlaPrefillKernel::kMma:
      return {mla_prefill_fast_kernel, kSmemBytes, kTileM, kThreads, 1};
    case MlaPrefillKernel::kWgmma128:
      if (splits > 1)
        return {
            p.wgmma_overlap ? mla_prefill_wgmma_kernel<128, true, true> : mla_prefill_wgmma_kernel<128, false, true>,
            WgmmaTile<128>::kSmemBytes, 128, WgmmaTile<128>::kCtaThreads, splits};
      return {
          p.wgmma_overlap ? mla_prefill_wgmma_kernel<128, true, false> : mla_prefill_wgmma_kernel<128, false, false>,
          WgmmaTile<128>::kSmemBytes, 128, WgmmaTile<128>::kCtaThreads, 1};
    default:
      return {p.wgmma_overlap ? mla_prefill_wgmma_kernel<64, true, false> : mla_prefill_wgmma_kernel<64, false, false>,
              WgmmaTile<64>::kSmemBytes, 64, WgmmaTile<64>::kCtaThreads, 1};
  }
}

// Merges the key splits' rows (one warp per query row and head, 4 of the 128 values a lane) by their log-sum-exps,
// then applies the launch's merge as write_rows does: kNone writes out, kFirst o_acc and lse_acc, kMiddle merges into
// them, kLast merges and writes out.
__global__ void __launch_bounds__(256) mla_prefill_split_combine_kernel(const MlaPrefillParams p, int64_t items) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * 8 + static_cast<int64_t>(threadIdx.x) / 32;  // row * H + h
  // Rows past the sequences' (split_rows larger than T) have no partials.
  if (item >= items || item / p.num_heads >= p.cu_seqlens[p.num_seqs]) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t stride = p.split_rows * p.num_heads;
  float m = -INFINITY;
  for (int s = 0; s < p.key_splits; ++s) m = fmaxf(m, p.split_lse[s * stride + item]);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float sum = 0.0f;
  if (m != -INFINITY) {
    for (int s = 0; s < p.key_splits; ++s) {
      const float w = exp2f(p.split_lse[s * stride + item] - m);  // an empty split: lse -inf, w 0
      const float4 x = reinterpret_cast<const float4*>(p.split_o + (s * stride + item) * kMlaPrefillVDim)[lane];
      sum += w;
      o.x += w * x.x;
      o.y += w * x.y;
      o.z += w * x.z;
      o.w += w * x.w;
    }
    const float inv = 1.0f / sum;
    o.x *= inv;
    o.y *= inv;
    o.z *= inv;
    o.w *= inv;
  }
  const float lse = m == -INFINITY ? -INFINITY : m + log2f(sum);
  float4 result = o;
  if (p.merge == MlaPrefillMerge::kMiddle || p.merge == MlaPrefillMerge::kLast) {
    const MergeWeights w = merge_weights(p.lse_acc[item], lse);
    __syncwarp();  // every lane read lse_acc before lane 0 writes it (kMiddle)
    if (p.merge == MlaPrefillMerge::kMiddle && lane == 0 && w.lse != -INFINITY) p.lse_acc[item] = w.lse;
    const float4 prev = reinterpret_cast<const float4*>(p.o_acc + item * kMlaPrefillVDim)[lane];
    result = make_float4(prev.x * w.w_old + o.x * w.w_new, prev.y * w.w_old + o.y * w.w_new,
                         prev.z * w.w_old + o.z * w.w_new, prev.w * w.w_old + o.w * w.w_new);
  } else if (p.merge == MlaPrefillMerge::kFirst && lane == 0) {
    p.lse_acc[item] = lse;
  }
  if (p.merge == MlaPrefillMerge::kNone || p.merge == MlaPrefillMerge::kLast) {
    uint32_t* out = reinterpret_cast<uint32_t*>(p.out + item * kMlaPrefillVDim) + 2 * lane;
    out[0] = pack_bf16x2(result.x, result.y);
    out[1] = pack_bf16x2(result.z, result.w);
  } else {
    reinterpret_cast<float4*>(p.o_acc + item * kMlaPrefillVDim)[lane] = result;
  }
}

}  // namespace

cudaError_t run_mla_prefill(const MlaPrefillParams& params) {
  MlaPrefillParams p = mla_prefill_contiguous(params);
  if (!params_valid(p, true)) return cudaErrorInvalidValue;
  if (p.key_splits < 0) return cudaErrorInvalidValue;
  if (p.key_splits > 1 &&
      (p.key_splits > p.max_key_splits || p.split_o == nullptr || p.split_lse == nullptr || p.split_rows <= 0 ||
       (p.kernel != MlaPrefillKernel::kWgmma && p.kernel != MlaPrefillKernel::kWgmma128)))
    return cudaErrorInvalidValue;
  if (p.split_o != nullptr && reinterpret_cast<uintptr_t>(p.split_o) % 16 != 0) return cudaErrorInvalidValue;
  if (p.max_seqlen == 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int smem_optin = 0, num_sms = 0;
  err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const PrefillLaunch l = prefill_launch(p, num_sms);
  if (l.smem > smem_optin) return cudaErrorInvalidConfiguration;
  err = cudaFuncSetAttribute(l.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem);
  if (err != cudaSuccess) return err;
  p.key_splits = l.splits;
  const int64_t q_tiles = (static_cast<int64_t>(p.max_seqlen) + l.rows - 1) / l.rows;
  if (q_tiles * l.splits > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(q_tiles * l.splits), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.num_seqs));
  l.kernel<<<grid, l.threads, l.smem, p.stream>>>(p);
  if (l.splits > 1) {
    const int64_t items = p.split_rows * p.num_heads;
    mla_prefill_split_combine_kernel<<<static_cast<unsigned>((items + 7) / 8), 256, 0, p.stream>>>(p, items);
  }
  return cudaGetLastError();
}

MlaPrefillShape mla_prefill_shape(const MlaPrefillParams& params) {
  int device = 0, num_sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return {};
  const PrefillLaunch l = prefill_launch(mla_prefill_contiguous(params), num_sms);
  return {l.rows, l.splits};
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
