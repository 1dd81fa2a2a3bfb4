// Device helpers shared by the tensor-core kernels of this directory (private to kernels/cuda).
#pragma once

#include <cstdint>

namespace deepinfer::kernels::cuda {

// d += a · b, m16n8k16, bf16 inputs, f32 accumulators (PTX ISA, "mma.m16n8k16" fragment layouts).
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four e4m3 bytes (lowest byte first) -> two bf16x2 words of the same values, in order. The byte's 7
// exponent/mantissa bits land in bf16's exponent/mantissa (bias 127 instead of 7: value * 2^-120, subnormals
// becoming bf16 subnormals); the multiply by 2^120 (bf16 0x7b80) is exact. Checked for all 256 codes on the host.
__device__ __forceinline__ void e4m3x4_to_bf16x2(uint32_t q, uint32_t& lo, uint32_t& hi) {
  const uint32_t a = __byte_perm(q, 0u, 0x1404), b = __byte_perm(q, 0u, 0x3424);  // bytes at bits 8-15, 24-31
  const uint32_t ra = (a & 0x80008000u) | ((a >> 4) & 0x07f007f0u);
  const uint32_t rb = (b & 0x80008000u) | ((b >> 4) & 0x07f007f0u);
  constexpr uint32_t kTwoPow120 = 0x7b807b80u;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(ra), "r"(kTwoPow120));
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(rb), "r"(kTwoPow120));
}

// Two e4m3 bytes (lowest byte first) -> one bf16x2 word of the same values (as e4m3x4_to_bf16x2).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t q) {
  const uint32_t a = __byte_perm(q, 0u, 0x1404);
  const uint32_t r = (a & 0x80008000u) | ((a >> 4) & 0x07f007f0u);
  constexpr uint32_t kTwoPow120 = 0x7b807b80u;
  uint32_t out;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(out) : "r"(r), "r"(kTwoPow120));
  return out;
}

// Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i (PTX "ldmatrix").
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address));
}

// 16 bytes global -> shared, asynchronous; only the first src_bytes (0..16) are read, the rest is zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t smem_address, const void* global, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address), "l"(global), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace deepinfer::kernels::cuda
