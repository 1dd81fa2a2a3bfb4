// Grouped expert GEMM for small row counts (MoE decode): weights streamed once per chunk of <= 8 rows, expert
// row ranges read on the device. Contract in include/deepinfer/kernels/cuda/moe_grouped.h.
//
// Why this shape. At decode an expert sees 1-8 rows, so the GEMM is a matrix-vector product bound by reading the
// weights (DeepSeek-V3: 44 MB of FP8 per expert and layer). mma.sync m16n8k16 with the weights as A (16 output
// columns) and the chunk's rows as B (8 rows) keeps the arithmetic off the critical path even for FP8 (16 values
// per 16-byte load, 8 rows each), where CUDA-core FMAs would not keep up with HBM at 8 rows.
//   - A lane (group g = lane / 4, t = lane % 4) loads 16 bytes of weight row n0 + g and of row n0 + g + 8 at
//     k + t * (elements per 16 bytes), and 16 bytes of x row g at the same k: the order of k inside an mma does
//     not matter as long as A and B agree, so the fragments come straight from global memory, no shared memory
//     and no barriers in the streaming loop (weights: ld.global.nc.L1::no_allocate, used once; x: the read-only
//     path, L1-resident and shared by every warp working on the same chunk).
//   - Stages of 2 loads per row: by default each warp keeps the next 3 (or 5) stages of weights in flight as cp.async
//     copies into its own ring of shared memory and takes one stage at a time into registers (stream_k_ring); the
//     register path (stream_ring -1) double-buffers them in registers, one stage in flight, which left the kernel
//     latency-bound at 55-63% of DRAM bandwidth (registers cap it at 16 warps an SM).
//   - FP8: e4m3 bytes become bf16 exactly by bit moves (sign, then exponent/mantissa shifted into bf16's fields,
//     which leaves the value scaled by 2^-120, undone by one bf16x2 multiply that is exact, subnormals included),
//     one 128-wide K group per stage; the group's f32 partial sum is multiplied by its block scale and added.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "deepinfer/kernels/cuda/moe_grouped.h"
#include "launch.cuh"
#include "mma_util.cuh"

namespace deepinfer::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpCols = 16;      // output columns per warp: the mma's M
constexpr int kChunkRows = 8;      // rows per pass over the weights: the mma's N
constexpr int kStepsPerStage = 2;  // 16-byte loads per weight row and stage
constexpr int kFp8Group = 128;

// Per format: weight elements per 16-byte load, K covered by one load of the 4 lanes of a group, K per stage.
template <bool kFp8>
struct Format {
  static constexpr int kElems = kFp8 ? 16 : 8;
  static constexpr int kStepK = 4 * kElems;
  static constexpr int kStageK = kStepsPerStage * kStepK;  // FP8: one 128-wide scale group
  static constexpr int kXLoads = kElems / 8;               // 16-byte x loads per weight load
  static constexpr int kBytes = kFp8 ? 1 : 2;
};
static_assert(Format<true>::kStageK == kFp8Group, "an FP8 stage is one block-scale group");

// Columns of y: n, or gated, I = n / 2 (the activation's).
__host__ __device__ __forceinline__ int64_t output_cols(const MoeGroupedGemmParams& p) {
  return p.gated ? p.n / 2 : p.n;
}

// Weights are read once per chunk: keep them out of L1 so that x stays there (DeepEP's ld_nc_global idiom).
__device__ __forceinline__ uint4 load_weight(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// v[j] <- lane j's v[t] among the four lanes of a group (t = lane % 4): a 4 x 4 transpose in two exchanges (lanes
// t ^ 1, then t ^ 2), four shuffles. Every lane of the warp calls it.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4]) {
  const int t = static_cast<int>(threadIdx.x) & 3;
#pragma unroll
  for (int j = 0; j < 4; j += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, (t & 1) ? v[j] : v[j + 1], 1);
    if (t & 1)
      v[j] = got;
    else
      v[j + 1] = got;
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, (t & 2) ? v[j] : v[j + 2], 2);
    if (t & 2)
      v[j] = got;
    else
      v[j + 2] = got;
  }
}

template <bool kFp8>
struct Stage {
  uint4 wa[kStepsPerStage], wb[kStepsPerStage];     // weight rows n0 + g and n0 + g + 8
  uint4 x[kStepsPerStage * Format<kFp8>::kXLoads];  // x row g at the same k
  float scale, scale_b;                             // FP8: the stage's block scales of rows a and of rows b
};

// What one warp streams: its two weight rows of one expert, x row g of the current chunk.
struct WarpView {
  const char* wa = nullptr;  // weight row n0 + g (bytes), valid when row_a
  const char* wb = nullptr;  // weight row n0 + g + 8
  bool row_a = false, row_b = false;
  const uint16_t* x = nullptr;  // x row g of the chunk, valid when x_row
  bool x_row = false;
  const float* scales = nullptr;    // FP8: the block-scale row of this warp's rows a (n0 + g)
  const float* scales_b = nullptr;  // and of its rows b (n0 + g + 8; gated: the up rows): the same row unless gated
  int k = 0, t = 0;
};

// x (and the FP8 block scales) of the stage at k0 into s: the register path's load_stage and the ring's, whose
// weights come from shared memory.
template <bool kFp8>
__device__ __forceinline__ void load_stage_x(Stage<kFp8>& s, const WarpView& v, int k0) {
  using F = Format<kFp8>;
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int i = 0; i < kStepsPerStage; ++i) {
    const int k = k0 + i * F::kStepK + v.t * F::kElems;
#pragma unroll
    for (int j = 0; j < F::kXLoads; ++j) {
      const int kx = k + 8 * j;  // k % 8 == 0: a 16-byte x vector is wholly inside or outside K
      s.x[i * F::kXLoads + j] = v.x_row && kx < v.k ? __ldg(reinterpret_cast<const uint4*>(v.x + kx)) : zero;
    }
  }
  if constexpr (kFp8) {
    s.scale = v.scales[k0 / kFp8Group];
    s.scale_b = v.scales_b[k0 / kFp8Group];
  }
}

// The stage at k0, weights and x, into s (the register path).
template <bool kFp8>
__device__ __forceinline__ void load_stage(Stage<kFp8>& s, const WarpView& v, int k0) {
  using F = Format<kFp8>;
#pragma unroll
  for (int i = 0; i < kStepsPerStage; ++i) {
    const int k = k0 + i * F::kStepK + v.t * F::kElems;
    const bool in_k = k < v.k;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // load_weight is an asm statement the compiler may execute whatever the condition (it if-converts the select
    // around the quad shuffles of the tiled order): its address stays inside the row (k 0 when past K or N), and the
    // select keeps zeros. Regression: K = 32 (the demo's per-head weights in batch-invariant mode) read the 64 bytes
    // after the last row.
    const bool a_ok = in_k && v.row_a, b_ok = in_k && v.row_b;
    const uint4 wa = load_weight(v.wa + static_cast<int64_t>(a_ok ? k : 0) * F::kBytes);
    const uint4 wb = load_weight(v.wb + static_cast<int64_t>(b_ok ? k : 0) * F::kBytes);
    s.wa[i] = a_ok ? wa : zero;
    s.wb[i] = b_ok ? wb : zero;
  }
  load_stage_x(s, v, k0);
}

// Fragments: a lane's 16-byte load of row n0 + g holds consecutive k; pairs (0,1) (2,3) go to one mma as
// (k = 2t, 2t+1) and (2t+8, 2t+9), the B fragment taking x's pairs at the same positions (see the file comment).
// kTiledOrder: the four lanes of a group first exchange their words (quad_transpose) so that each mma sums the k16
// block the tiled kernel's mma sums, in the same order: a row's result is then bit for bit the tiled kernel's.
template <bool kFp8, bool kTiledOrder>
__device__ __forceinline__ void multiply_stage(float (&acc)[4], const Stage<kFp8>& s) {
  if constexpr (!kFp8) {
#pragma unroll
    for (int i = 0; i < kStepsPerStage; ++i) {
      const uint4 a = s.wa[i], b = s.wb[i], x = s.x[i];
      if constexpr (kTiledOrder) {
        // Lane t held physical pairs 4t..4t+3 of the 32-wide step; after the exchange word j is pair 4j + t, so
        // the k16 block m is words 2m (k = 16m + 2t) and 2m + 1 (k = 16m + 2t + 8).
        uint32_t qa[4] = {a.x, a.y, a.z, a.w}, qb[4] = {b.x, b.y, b.z, b.w}, qx[4] = {x.x, x.y, x.z, x.w};
        quad_transpose(qa);
        quad_transpose(qb);
        quad_transpose(qx);
        mma_bf16(acc, qa[0], qb[0], qa[1], qb[1], qx[0], qx[1]);
        mma_bf16(acc, qa[2], qb[2], qa[3], qb[3], qx[2], qx[3]);
      } else {
        mma_bf16(acc, a.x, b.x, a.y, b.y, x.x, x.y);
        mma_bf16(acc, a.z, b.z, a.w, b.w, x.z, x.w);
      }
    }
  } else {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kStepsPerStage; ++i) {
      uint32_t pa[8], pb[8];
      const uint32_t qa[4] = {s.wa[i].x, s.wa[i].y, s.wa[i].z, s.wa[i].w};
      const uint32_t qb[4] = {s.wb[i].x, s.wb[i].y, s.wb[i].z, s.wb[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        e4m3x4_to_bf16x2(qa[j], pa[2 * j], pa[2 * j + 1]);
        e4m3x4_to_bf16x2(qb[j], pb[2 * j], pb[2 * j + 1]);
      }
      const uint4 x0 = s.x[2 * i], x1 = s.x[2 * i + 1];
      const uint32_t xp[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      if constexpr (kTiledOrder) {
        // Lane t held physical pairs 8t..8t+7 of the 64-wide step; after exchanging the low and the high four
        // words, k16 block j is lo[j] (k = 16j + 2t) and hi[j] (k = 16j + 2t + 8).
        uint32_t alo[4], ahi[4], blo[4], bhi[4], xlo[4], xhi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          alo[j] = pa[j], ahi[j] = pa[4 + j], blo[j] = pb[j], bhi[j] = pb[4 + j], xlo[j] = xp[j], xhi[j] = xp[4 + j];
        }
        quad_transpose(alo);
        quad_transpose(ahi);
        quad_transpose(blo);
        quad_transpose(bhi);
        quad_transpose(xlo);
        quad_transpose(xhi);
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(part, alo[j], blo[j], ahi[j], bhi[j], xlo[j], xhi[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          mma_bf16(part, pa[2 * j], pb[2 * j], pa[2 * j + 1], pb[2 * j + 1], xp[2 * j], xp[2 * j + 1]);
      }
    }
    // D fragment: acc[0..1] come from the rows a, acc[2..3] from the rows b.
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[r] = fmaf(r < 2 ? s.scale : s.scale_b, part[r], acc[r]);
  }
}

// Stages [first, last) of K for one chunk, stage s + 1 loading while s multiplies (two named buffers, unrolled
// by two: an indexed pair would live in local memory).
template <bool kFp8, bool kTiledOrder>
__device__ __forceinline__ void stream_k(float (&acc)[4], const WarpView& v, int first, int last) {
  constexpr int kStageK = Format<kFp8>::kStageK;
  if (first >= last) return;
  Stage<kFp8> even, odd;
  load_stage(even, v, first * kStageK);
  for (int s = first; s < last; s += 2) {
    if (s + 1 < last) load_stage(odd, v, (s + 1) * kStageK);
    multiply_stage<kFp8, kTiledOrder>(acc, even);
    if (s + 1 >= last) break;
    if (s + 2 < last) load_stage(even, v, (s + 2) * kStageK);
    multiply_stage<kFp8, kTiledOrder>(acc, odd);
  }
}

// ---- the shared-memory ring (kRing > 0) ----
// Each warp keeps its next kRing - 1 stages of weights in flight as cp.async copies into its own slots of shared
// memory (2 KB a stage: 4 cells of 32 lanes x 16 bytes), so the bytes in flight no longer cost registers: ncu put
// the register path at 63% of DRAM bandwidth with 72% of its stalls waiting on loads, 16 warps an SM (occupancy
// limited by registers), one stage in flight each. A lane copies and reads only its own cells: no barrier is needed,
// only cp.async.wait_group. x (and the FP8 scales) stay on the register path, one stage ahead (Stage's x fields).
constexpr int kRingCells = 2 * kStepsPerStage;  // wa[0..1], wb[0..1]

__device__ __forceinline__ void ring_copy(uint4* cell, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(cell))),
               "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void ring_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void ring_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Stage s's weights into `slot` (kRingCells x 32 cells), zeros past K or N, as load_stage reads them.
template <bool kFp8>
__device__ __forceinline__ void ring_issue(uint4* slot, const WarpView& v, int k0, int lane) {
  using F = Format<kFp8>;
#pragma unroll
  for (int i = 0; i < kStepsPerStage; ++i) {
    const int k = k0 + i * F::kStepK + v.t * F::kElems;
    const bool a_ok = k < v.k && v.row_a, b_ok = k < v.k && v.row_b;
    ring_copy(slot + i * 32 + lane, v.wa + static_cast<int64_t>(a_ok ? k : 0) * F::kBytes, a_ok);
    ring_copy(slot + (kStepsPerStage + i) * 32 + lane, v.wb + static_cast<int64_t>(b_ok ? k : 0) * F::kBytes, b_ok);
  }
}

// Stage s: wait for its copies, take its weights from the ring into st, refill the slot freed one stage ago with
// stage s + kRing - 1, multiply.
template <bool kFp8, bool kTiledOrder, int kRing>
__device__ __forceinline__ void ring_consume(float (&acc)[4], Stage<kFp8>& st, const WarpView& v, uint4* ring, int s,
                                             int first, int last, int lane) {
  constexpr int kStageK = Format<kFp8>::kStageK;
  ring_wait<kRing - 2>();
  const uint4* slot = ring + ((s - first) % kRing) * kRingCells * 32;
#pragma unroll
  for (int i = 0; i < kStepsPerStage; ++i) {
    st.wa[i] = slot[i * 32 + lane];
    st.wb[i] = slot[(kStepsPerStage + i) * 32 + lane];
  }
  const int ahead = s + kRing - 1;
  if (ahead < last) ring_issue<kFp8>(ring + ((ahead - first) % kRing) * kRingCells * 32, v, ahead * kStageK, lane);
  ring_commit();  // empty past the last stage: the wait above counts one group a stage
  multiply_stage<kFp8, kTiledOrder>(acc, st);
}

// The ring's first kRing - 1 stages, one commit group each (empty past the last stage).
template <bool kFp8, int kRing>
__device__ __forceinline__ void ring_prime(const WarpView& v, int first, int last, uint4* ring) {
  constexpr int kStageK = Format<kFp8>::kStageK;
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int j = 0; j < kRing - 1; ++j) {
    if (first + j < last) ring_issue<kFp8>(ring + j * kRingCells * 32, v, (first + j) * kStageK, lane);
    ring_commit();
  }
}

// stream_k through the ring: the same multiplies in the same order, so the same sums bit for bit. `primed`: the
// caller has run ring_prime for these stages already (the weights copied before waiting for the previous kernel).
template <bool kFp8, bool kTiledOrder, int kRing>
__device__ __forceinline__ void stream_k_ring(float (&acc)[4], const WarpView& v, int first, int last, uint4* ring,
                                              bool primed) {
  constexpr int kStageK = Format<kFp8>::kStageK;
  if (first >= last) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (!primed) ring_prime<kFp8, kRing>(v, first, last, ring);
  Stage<kFp8> even, odd;
  load_stage_x(even, v, first * kStageK);
  for (int s = first; s < last; s += 2) {
    if (s + 1 < last) load_stage_x(odd, v, (s + 1) * kStageK);
    ring_consume<kFp8, kTiledOrder, kRing>(acc, even, v, ring, s, first, last, lane);
    if (s + 1 >= last) break;
    if (s + 2 < last) load_stage_x(even, v, (s + 2) * kStageK);
    ring_consume<kFp8, kTiledOrder, kRing>(acc, odd, v, ring, s + 1, first, last, lane);
  }
  ring_wait<0>();  // the ring is free for the next chunk
}

// Slot blockIdx.y serves the blockIdx.y-th non-empty expert (in expert order); -1 when there are fewer. Also
// checks the offsets it reads. Contains __syncthreads: every thread of the CTA calls it.
__device__ int find_expert(const int32_t* offsets, int num_experts, int slot) {
  __shared__ int found;
  __shared__ int warp_count[kWarps];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (threadIdx.x == 0) found = -1;
  int seen = 0;  // non-empty experts before `base` (the same in every thread)
  for (int base = 0; base < num_experts && seen <= slot; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    bool non_empty = false;
    if (e < num_experts) {
      const int32_t begin = offsets[e], end = offsets[e + 1];
      if (end < begin) __trap();  // offsets must not decrease
      non_empty = end > begin;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, non_empty);
    if (lane == 0) warp_count[warp] = __popc(mask);
    __syncthreads();
    int before = seen;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += warp_count[w];
      seen += warp_count[w];
    }
    if (non_empty && before + __popc(mask & ((1u << lane) - 1u)) == slot) found = e;
    __syncthreads();  // `found` published; warp_count free for the next round
  }
  return found;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// 4 CTAs (16 warps) per SM: at most 128 registers per thread.
// kRing 0: the register path (stream_k); otherwise the shared-memory ring of kRing stages a warp (dynamic shared
// memory: kWarps x kRing x kRingCells x 32 cells of 16 bytes).
template <bool kFp8, bool kTiledOrder, int kRing>
__global__ void __launch_bounds__(kThreads, 4) moe_grouped_gemm_kernel(const MoeGroupedGemmParams p, int split) {
  // weights_before_wait (ring only): the expert ranges and the weights are read before the previous kernel has
  // finished, x and y only after (moe_grouped.h says when a caller may ask it).
  const bool early = kRing > 0 && p.weights_before_wait;
  if (!early) pdl_begin();
  using F = Format<kFp8>;
  const int num_experts = static_cast<int>(p.num_experts), rows = static_cast<int>(p.rows);
  const int64_t x_ld = p.x_ld > 0 ? p.x_ld : p.k, y_ld = p.y_ld > 0 ? p.y_ld : output_cols(p);
  int e = 0, begin = 0, end = rows;  // offsets == null: one matrix over every row, one slot
  if (p.offsets != nullptr) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 &&
        (p.offsets[0] != 0 || p.offsets[num_experts] != rows))
      __trap();  // some rows of y would be left unwritten
    e = find_expert(p.offsets, num_experts, static_cast<int>(blockIdx.y));
    if (e < 0) return;  // fewer non-empty experts than slots (uniform over the CTA)
    begin = p.offsets[e];
    end = p.offsets[e + 1];
    if (begin < 0 || end > rows) __trap();
  }

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int col_warps = kWarps / split;  // warps side by side over N; `split` warps share K for each
  const int part = warp % split;
  // A warp's 16 weight rows: n0 .. n0 + 15 (rows a: n0 + g, rows b: n0 + g + 8), or gated, the gate rows n0 .. n0 + 7
  // and the up rows n_out + n0 .. + 7, for the 8 output columns n0 .. n0 + 7.
  const bool gated = p.gated;
  const int64_t n_out = output_cols(p);
  const int warp_cols = gated ? kWarpCols / 2 : kWarpCols;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * col_warps + warp / split) * warp_cols;
  const int64_t n_a = n0 + g, n_b = gated ? n_out + n0 + g : n0 + g + 8;
  const bool active = n0 < n_out;

  WarpView v;
  v.k = static_cast<int>(p.k);
  v.t = t;
  v.row_a = n_a < n_out;
  v.row_b = gated ? v.row_a : n_b < p.n;
  const char* w = static_cast<const char*>(p.w) + static_cast<int64_t>(e) * p.w_matrix_stride * F::kBytes;
  // Rows past N are never dereferenced; clamping keeps even the pointer arithmetic inside the matrix.
  v.wa = w + min64(n_a, p.n - 1) * p.w_ld * F::kBytes;
  v.wb = w + min64(n_b, p.n - 1) * p.w_ld * F::kBytes;
  if constexpr (kFp8) {
    // 16 | 128: a warp's rows a share a block, and so do its rows b (gated: n_out % 8 == 0, so 8 up rows do).
    const float* scales = p.w_scale + static_cast<int64_t>(e) * p.w_scale_matrix_stride;
    v.scales = scales + min64(n0, p.n - 1) / kFp8Group * p.w_scale_ld;
    v.scales_b = gated ? scales + min64(n_out + n0, p.n - 1) / kFp8Group * p.w_scale_ld : v.scales;
  }

  const int stages = (v.k + F::kStageK - 1) / F::kStageK;
  const int first = part * stages / split, last = (part + 1) * stages / split;
  __shared__ float partial[kWarps][4][32];  // split > 1: each warp's sums, [value][lane] (conflict-free)
  extern __shared__ uint4 ring_cells[];
  uint4* ring = ring_cells + warp * kRing * kRingCells * 32;
  bool primed = false;  // the first chunk's first stages already copied
  if constexpr (kRing > 0) {
    if (early) {
      if (active && begin < end && first < last) {
        ring_prime<kFp8, kRing>(v, first, last, ring);
        primed = true;
      }
      pdl_begin();
    }
  }

  for (int c0 = begin; c0 < end; c0 += kChunkRows) {
    const int chunk_rows = min(kChunkRows, end - c0);
    v.x_row = g < chunk_rows;  // rows past the chunk multiply zeros and are not stored
    const int r = c0 + (v.x_row ? g : 0);
    v.x = p.x + (p.x_rows != nullptr ? static_cast<int64_t>(p.x_rows[r]) / p.x_rows_divisor : r) * x_ld;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (kRing > 0) {
      if (active) stream_k_ring<kFp8, kTiledOrder, kRing>(acc, v, first, last, ring, primed);
      primed = false;
    } else {
      if (active) stream_k<kFp8, kTiledOrder>(acc, v, first, last);
    }
    if (split > 1) {  // uniform over the CTA, as is the chunk loop
      if (part > 0)
        for (int r = 0; r < 4; ++r) partial[warp][r][lane] = acc[r];
      __syncthreads();
      if (part == 0)
        for (int q = 1; q < split; ++q)
          for (int r = 0; r < 4; ++r) acc[r] += partial[warp + q][r][lane];
      __syncthreads();  // partial free for the next chunk
    }
    if (!active || part != 0) continue;
    if (gated) {
      // acc[0..1]: the gate column n0 + g of rows 2t, 2t + 1; acc[2..3]: its up column. Each rounded to bf16 as
      // the unfused path stores them, then silu_mul's arithmetic (kernels/cuda/fused_ops.cu), rounded once more.
      __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        if (!v.row_a || r >= chunk_rows) continue;
        const float gate = __bfloat162float(__float2bfloat16(acc[i]));
        const float up = __bfloat162float(__float2bfloat16(acc[i + 2]));
        y[(c0 + r) * y_ld + n_a] = __float2bfloat16(gate / (1.0f + expf(-gate)) * up);
      }
      continue;
    }
    // D fragment: acc[0..1] = rows 2t, 2t+1 of column n0 + g; acc[2..3] the same rows of column n0 + g + 8.
    const int r0 = 2 * t, r1 = 2 * t + 1;
    const bool ok[4] = {v.row_a && r0 < chunk_rows, v.row_a && r1 < chunk_rows, v.row_b && r0 < chunk_rows,
                        v.row_b && r1 < chunk_rows};
    const int64_t at[4] = {(c0 + r0) * y_ld + n_a, (c0 + r1) * y_ld + n_a, (c0 + r0) * y_ld + n_b,
                           (c0 + r1) * y_ld + n_b};
    if (p.y_f32 != nullptr) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (ok[i]) p.y_f32[at[i]] = acc[i];
    } else {
      __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (ok[i]) y[at[i]] = __float2bfloat16(acc[i]);
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Warps along K per column tile: enough warps to keep ~16 per SM streaming (about 2-4 KB of loads in flight each,
// which covers HBM latency x bandwidth per SM), counting every slot as a non-empty expert (an upper bound), but never
// so many that the CTAs no longer fit one wave (4 resident per SM): a second wave of short streams waits for the
// first (V2-Lite's down GEMM at batch 1: split 4 made 768 CTAs for 528 places, 1.45 waves of 5-6 stages a warp).
int choose_split(const MoeGroupedGemmParams& p, int64_t slots, int stages) {
  if (p.k_split != 0) return p.k_split;
  if (p.tiled_order) return 1;  // a row's sum in one warp, in the tiled kernel's order
  const int64_t sms = p.num_sms > 0 ? p.num_sms : 132;
  const int64_t column_warps = (p.n + kWarpCols - 1) / kWarpCols * slots;
  int split = 1;
  while (split < kWarps && column_warps * split < 16 * sms && stages >= 4 * split &&
         column_warps * split * 2 <= static_cast<int64_t>(kWarps) * 4 * sms)
    split *= 2;
  return split;
}

template <bool kFp8, bool kTiledOrder, int kRing>
void launch_ring(dim3 grid, int split, const MoeGroupedGemmParams& p) {
  constexpr size_t kSmem = static_cast<size_t>(kWarps) * kRing * kRingCells * 32 * sizeof(uint4);
  // Past 48 KB of shared memory in all (the split's partial sums are static) a kernel must opt in; once for each.
  static const cudaError_t opted = cudaFuncSetAttribute(moe_grouped_gemm_kernel<kFp8, kTiledOrder, kRing>,
                                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  (void)opted;  // a failure shows as the launch's error
  launch_pdl(moe_grouped_gemm_kernel<kFp8, kTiledOrder, kRing>, grid, kThreads, kSmem, p.stream, p, split);
}

template <bool kFp8, bool kTiledOrder>
void launch_streaming(int ring, dim3 grid, int split, const MoeGroupedGemmParams& p) {
  if (ring == -1)
    launch_pdl(moe_grouped_gemm_kernel<kFp8, kTiledOrder, 0>, grid, kThreads, 0, p.stream, p, split);
  else if (ring == 6)
    launch_ring<kFp8, kTiledOrder, 6>(grid, split, p);
  else
    launch_ring<kFp8, kTiledOrder, 4>(grid, split, p);
}

}  // namespace

bool moe_grouped_params_valid(const MoeGroupedGemmParams& p) {
  const bool fp8 = p.format == MoeWeightFormat::kFP8;
  if (p.format != MoeWeightFormat::kBF16 && !fp8) return false;
  if (p.num_experts < 1 || p.num_experts > 65535 || p.n < 1 || p.k < 1 || p.k % 8 != 0 || p.rows < 0 ||
      p.rows > INT32_MAX / 2 || p.k > INT32_MAX / 4 || (p.offsets == nullptr && p.num_experts != 1) ||
      p.x == nullptr || p.w == nullptr ||
      (p.y == nullptr && p.y_f32 == nullptr) || !aligned16(p.x) || !aligned16(p.w))
    return false;
  if (p.k_split != 0 && p.k_split != 1 && p.k_split != 2 && p.k_split != 4) return false;
  if (p.stream_ring != -1 && p.stream_ring != 0 && p.stream_ring != 4 && p.stream_ring != 6) return false;
  if (p.tiled_order && p.k_split > 1) return false;
  if (p.x_rows != nullptr && p.x_rows_divisor < 1) return false;
  if (p.x_ld != 0 && (p.x_ld < p.k || p.x_ld % 8 != 0)) return false;
  if (p.y_ld != 0 && p.y_ld < output_cols(p)) return false;
  if (p.gated && (p.n % 16 != 0 || p.y == nullptr || p.y_f32 != nullptr)) return false;
  if (fp8) {
    const int64_t groups = (p.k + kFp8Group - 1) / kFp8Group, scale_rows = (p.n + kFp8Group - 1) / kFp8Group;
    return p.w_ld >= (p.k + 15) / 16 * 16 && p.w_ld % 16 == 0 && p.w_matrix_stride >= p.n * p.w_ld &&
           p.w_matrix_stride % 16 == 0 && p.w_scale != nullptr && p.w_scale_ld >= groups &&
           p.w_scale_matrix_stride >= scale_rows * p.w_scale_ld;
  }
  return p.w_ld >= p.k && p.w_ld % 8 == 0 && p.w_matrix_stride >= p.n * p.w_ld && p.w_matrix_stride % 8 == 0;
}

cudaError_t run_moe_grouped_gemm(const MoeGroupedGemmParams& p) {
  if (!moe_grouped_params_valid(p)) return cudaErrorInvalidValue;
  const bool fp8 = p.format == MoeWeightFormat::kFP8;
  if (p.rows == 0) return cudaSuccess;

  const int64_t slots = std::min(p.num_experts, p.rows);  // at most this many experts have rows
  const int stage_k = fp8 ? Format<true>::kStageK : Format<false>::kStageK;
  const int stages = static_cast<int>((p.k + stage_k - 1) / stage_k);
  const int split = choose_split(p, slots, stages);
  const int64_t cta_cols = (p.gated ? kWarpCols / 2 : kWarpCols) * (kWarps / split);  // output columns
  const dim3 grid(static_cast<unsigned>((output_cols(p) + cta_cols - 1) / cta_cols), static_cast<unsigned>(slots));
  const int ring = p.stream_ring;
  if (fp8 && p.tiled_order)
    launch_streaming<true, true>(ring, grid, split, p);
  else if (fp8)
    launch_streaming<true, false>(ring, grid, split, p);
  else if (p.tiled_order)
    launch_streaming<false, true>(ring, grid, split, p);
  else
    launch_streaming<false, false>(ring, grid, split, p);
  return cudaGetLastError();
}

}  // namespace deepinfer::kernels::cuda
