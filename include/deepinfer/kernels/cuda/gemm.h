// Dense GEMMs for the linear layers, y = x · Wᵀ (PyTorch's F.linear; W as checkpoints store it, [out, in]).
//
// bf16:  x bf16 [M, K] row-major, W bf16 [N, K] row-major, y bf16 [M, N] row-major, f32 accumulation (cuBLAS).
//
// FP8 block-scaled (DeepSeek-V3's native checkpoint format; semantics of DeepSeek-V3 inference/kernel.py):
//   act_quant:  for each token m and each 128-column group g of x (K % 128 == 0):
//                 s[m, g] = amax(|x[m, 128g : 128g+128]|) / 448          (448 = largest finite e4m3)
//                 x_fp8[m, k] = e4m3(x[m, k] / s[m, g])                   (round to nearest, saturating)
//               (one deviation: an all-zero group gets s = 1 instead of kernel.py's 0/0.)
//   fp8_gemm:   y[m, n] = bf16( Σ_g  s[m, g] · w_scale_inv[n / 128, g] · Σ_{k in group g} x_fp8[m, k] · W_fp8[n, k] )
//               i.e. the product of the dequantized operands, x ≈ x_fp8 · s and W = W_fp8 · weight_scale_inv
//               (src/model/convert.h: dequantize_f8_block_scaled), accumulated in f32, rounded once to bf16.
//
// Layouts of the FP8 path (all device memory, owned by the caller):
//   x_fp8        e4m3 [M, K] row-major (one byte per value)
//   x_scale      f32 [K/128][M]: the scale of token m, group g at x_scale[g * M + m] — "M-major" (transposed from
//                kernel.py's [M, K/128]), which is what cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and
//                DeepGEMM's sm90 kernels read. run_act_quant writes it this way.
//   w_fp8        e4m3 [N, K] row-major (the checkpoint's `weight`, float8_e4m3fn)
//   w_scale      f32 [ceil(N/128)][w_scale_ld], w_scale_ld = round_up(ceil(K/128), 4): the checkpoint's
//                `weight_scale_inv` [ceil(N/128), ceil(K/128)] row-major, rows padded to a multiple of 4 floats
//                (cuBLASLt CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F). For every DeepSeek-V3 shape K/128 is a
//                multiple of 4 (7168, 1536, 512, 16384, 2048, 18432 ...), so the checkpoint tensor is used as is.
//   y            bf16 [M, N] row-major
//
// Implementation: cuBLASLt (CUDA >= 12.9 offers 1x128 / 128x128 block scaling for FP8 on Hopper, sm_90; the
// weight is cuBLASLt's A with A_SCALE_MODE = BLK128x128_32F, the activation its B with B_SCALE_MODE =
// VEC128_32F, D = yᵀ column-major = y row-major). When cuBLASLt offers no algorithm for a shape, a simple
// CUDA-core kernel (the same formula, f32 FMAs) computes it instead; Fp8GemmParams::path says which, and
// path = kSimt forces the simple kernel (the on-GPU cross-check).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace deepinfer::kernels::cuda {

inline constexpr int kFp8GroupSize = 128;     // 1x128 activation groups, 128x128 weight blocks
inline constexpr float kFp8E4m3Max = 448.0f;  // largest finite float8_e4m3fn

// Floats per row of the weight scale tensor: round_up(ceil(k / 128), 4).
inline int fp8_weight_scale_ld(int k) { return ((k + kFp8GroupSize - 1) / kFp8GroupSize + 3) / 4 * 4; }

// Owns the cuBLAS / cuBLASLt handles, a cuBLASLt workspace and a cache of cuBLASLt plans (one per shape), so
// that repeated calls do no host-side algorithm search. Not thread-safe; one per stream/thread.
struct GemmLibrary;

// Status of a GEMM call: cuda = the CUDA error (launch or runtime), cublas = the cublasStatus_t value (0 = ok).
struct GemmStatus {
  cudaError_t cuda = cudaSuccess;
  int cublas = 0;
  const char* where = "";  // which call failed
  bool ok() const { return cuda == cudaSuccess && cublas == 0; }
};

// workspace_bytes: cuBLASLt workspace (32 MiB is plenty on Hopper). Returns nullptr and fills *status on failure.
GemmLibrary* gemm_library_create(size_t workspace_bytes, GemmStatus* status);
void gemm_library_destroy(GemmLibrary* lib);

struct Bf16GemmParams {
  int m = 0, n = 0, k = 0;
  const uint16_t* x = nullptr;  // bf16 [M, K]
  const uint16_t* w = nullptr;  // bf16 [N, K]
  uint16_t* y = nullptr;        // bf16 [M, N]
  cudaStream_t stream = nullptr;
};
// REQUIRES: m, n, k > 0. Asynchronous on params.stream.
GemmStatus run_bf16_gemm(GemmLibrary* lib, const Bf16GemmParams& params);

struct ActQuantParams {
  int m = 0, k = 0;               // k % 128 == 0
  const uint16_t* x = nullptr;    // bf16 [M, K]
  uint8_t* x_fp8 = nullptr;       // e4m3 [M, K]
  float* x_scale = nullptr;       // f32 [K/128][M] (see above)
  cudaStream_t stream = nullptr;
};
// DeepSeek's act_quant (see above). One warp per (token, group). Asynchronous.
cudaError_t run_act_quant(const ActQuantParams& params);

enum class Fp8GemmPath : int { kAuto = 0, kCublasLt = 1, kSimt = 2 };

struct Fp8GemmParams {
  int m = 0, n = 0, k = 0;          // k % 128 == 0; n % 16 == 0 for cuBLASLt (else the simple kernel runs)
  const uint8_t* x_fp8 = nullptr;   // e4m3 [M, K]
  const float* x_scale = nullptr;   // f32 [K/128][M]
  const uint8_t* w_fp8 = nullptr;   // e4m3 [N, K]
  const float* w_scale = nullptr;   // f32 [ceil(N/128)][fp8_weight_scale_ld(K)]
  uint16_t* y = nullptr;            // bf16 [M, N]
  Fp8GemmPath path = Fp8GemmPath::kAuto;  // kAuto: cuBLASLt, else the simple kernel; kCublasLt: fail if unsupported
  cudaStream_t stream = nullptr;
};
// y = x · Wᵀ with the block scales (see above). *used (optional) receives the path that ran. Asynchronous.
GemmStatus run_fp8_gemm(GemmLibrary* lib, const Fp8GemmParams& params, Fp8GemmPath* used = nullptr);

}  // namespace deepinfer::kernels::cuda
