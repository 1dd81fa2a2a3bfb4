// Dense GEMMs: bf16 through cuBLAS, FP8 block-scaled through cuBLASLt (with a simple CUDA-core fallback), and
// DeepSeek's per-token 1x128 activation quantization. Contracts in include/deepinfer/kernels/cuda/gemm.h.
#include "deepinfer/kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <map>
#include <tuple>

namespace deepinfer::kernels::cuda {

namespace {

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool supported = false;
  const float* a_scale = nullptr;  // the scale pointers baked into desc (updated when they change)
  const float* b_scale = nullptr;
};

}  // namespace

struct GemmLibrary {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<std::tuple<int, int, int>, LtPlan> fp8_plans;
};

namespace {

GemmStatus cublas_status(cublasStatus_t st, const char* where) {
  GemmStatus s;
  if (st != CUBLAS_STATUS_SUCCESS) {
    s.cublas = static_cast<int>(st);
    s.where = where;
  }
  return s;
}
GemmStatus cuda_status(cudaError_t err, const char* where) {
  GemmStatus s;
  if (err != cudaSuccess) {
    s.cuda = err;
    s.where = where;
  }
  return s;
}

#define GEMM_TRY_BLAS(expr)                                       \
  do {                                                            \
    GemmStatus s_ = cublas_status((expr), #expr);                 \
    if (!s_.ok()) return s_;                                      \
  } while (0)

void destroy_plan(LtPlan& p) {
  if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  p = LtPlan{};
}

// cuBLASLt plan for y[M, N] = x_fp8 · W_fp8ᵀ in cuBLASLt's column-major terms: D[N, M] = op(A) · B with
// A = W viewed as column-major [K, N] (ld K), TRANSA = T; B = x viewed as column-major [K, M] (ld K), TRANSB = N;
// D = y viewed as column-major [N, M] (ld N). A carries the 128x128 weight scales, B the 1x128 token scales.
GemmStatus build_fp8_plan(GemmLibrary* lib, int m, int n, int k, LtPlan& p) {
  GEMM_TRY_BLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
  // Placeholder scale pointers for the heuristic query (the real ones are set per call); must be non-null.
  const void* dummy = lib->workspace;
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy, sizeof(dummy)));
  GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy, sizeof(dummy)));
  GEMM_TRY_BLAS(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, n, k));
  GEMM_TRY_BLAS(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, m, k));
  GEMM_TRY_BLAS(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
  cublasLtMatmulPreference_t pref = nullptr;
  GEMM_TRY_BLAS(cublasLtMatmulPreferenceCreate(&pref));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &lib->workspace_bytes, sizeof(lib->workspace_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(lib->lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED / no result: this shape (or this cuBLASLt) has no block-scaled algorithm; the caller falls back.
  p.supported = st == CUBLAS_STATUS_SUCCESS && returned > 0;
  if (p.supported) p.algo = result.algo;
  return GemmStatus{};
}

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

// act_quant: one warp per (token, 128-column group); each lane handles 4 consecutive values (8 bytes of bf16).
__global__ void act_quant_kernel(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ x_fp8,
                                 float* __restrict__ x_scale, int m, int k) {
  const int groups = k / kFp8GroupSize;
  const long warp = (static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= static_cast<long>(m) * groups) return;
  const int row = static_cast<int>(warp / groups);
  const int g = static_cast<int>(warp % groups);
  const size_t base = static_cast<size_t>(row) * k + static_cast<size_t>(g) * kFp8GroupSize + lane * 4;
  const uint2 raw = *reinterpret_cast<const uint2*>(x + base);
  const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  float v[4] = {__low2float(p0), __high2float(p0), __low2float(p1), __high2float(p1)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3);
    packed |= static_cast<uint32_t>(q) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(x_fp8 + base) = packed;
  if (lane == 0) x_scale[static_cast<size_t>(g) * m + row] = s;
}

// The simple FP8 kernel: 64x64 outputs per 256-thread block, 4x4 per thread, f32 CUDA-core FMAs over operands
// converted from e4m3 in shared memory; per 128-wide K group, the partial sums are scaled by
// x_scale[g, m] * w_scale[n / 128, g] and added to the f32 accumulators (the same formula as cuBLASLt's).
constexpr int kSimtTile = 64;
constexpr int kSimtK = 32;
__global__ void __launch_bounds__(256) fp8_gemm_simt_kernel(const uint8_t* __restrict__ xq,
                                                            const float* __restrict__ xs,
                                                            const uint8_t* __restrict__ wq,
                                                            const float* __restrict__ ws, __nv_bfloat16* __restrict__ y,
                                                            int m, int n, int k, int ws_ld) {
  __shared__ float sx[kSimtK][kSimtTile + 1];
  __shared__ float sw[kSimtK][kSimtTile + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int m0 = blockIdx.y * kSimtTile, n0 = blockIdx.x * kSimtTile;
  float acc[4][4] = {};
  const int groups = k / kFp8GroupSize;
  for (int g = 0; g < groups; ++g) {
    float part[4][4] = {};
    for (int kk = 0; kk < kFp8GroupSize; kk += kSimtK) {
      const int k0 = g * kFp8GroupSize + kk;
      // 64 rows x 32 bytes per operand: each thread loads 8 consecutive bytes of one row.
      const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 8;
      const int gm = m0 + r, gn = n0 + r;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sx[c + i][r] = gm < m ? fp8_to_float(xq[static_cast<size_t>(gm) * k + k0 + c + i]) : 0.0f;
        sw[c + i][r] = gn < n ? fp8_to_float(wq[static_cast<size_t>(gn) * k + k0 + c + i]) : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int kq = 0; kq < kSimtK; ++kq) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[i] = sx[kq][ty * 4 + i];
          b[i] = sw[kq][tx * 4 + i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] = fmaf(a[i], b[j], part[i][j]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int gm = m0 + ty * 4 + i;
      const float sa = gm < m ? xs[static_cast<size_t>(g) * m + gm] : 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int gn = n0 + tx * 4 + j;
        const float sb = gn < n ? ws[static_cast<size_t>(gn / kFp8GroupSize) * ws_ld + g] : 0.0f;
        acc[i][j] = fmaf(part[i][j], sa * sb, acc[i][j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int gm = m0 + ty * 4 + i;
    if (gm >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int gn = n0 + tx * 4 + j;
      if (gn < n) y[static_cast<size_t>(gm) * n + gn] = __float2bfloat16(acc[i][j]);
    }
  }
}

}  // namespace

GemmLibrary* gemm_library_create(size_t workspace_bytes, GemmStatus* status) {
  GemmStatus s;
  auto* lib = new GemmLibrary;
  lib->workspace_bytes = workspace_bytes;
  if (cublasStatus_t st = cublasCreate(&lib->blas); st != CUBLAS_STATUS_SUCCESS) {
    s = cublas_status(st, "cublasCreate");
  } else if (st = cublasLtCreate(&lib->lt); st != CUBLAS_STATUS_SUCCESS) {
    s = cublas_status(st, "cublasLtCreate");
  } else if (cudaError_t err = cudaMalloc(&lib->workspace, workspace_bytes > 0 ? workspace_bytes : 256);
             err != cudaSuccess) {
    s = cuda_status(err, "cudaMalloc(workspace)");
  }
  if (status) *status = s;
  if (!s.ok()) {
    gemm_library_destroy(lib);
    return nullptr;
  }
  return lib;
}

void gemm_library_destroy(GemmLibrary* lib) {
  if (!lib) return;
  for (auto& [key, plan] : lib->fp8_plans) destroy_plan(plan);
  if (lib->workspace) cudaFree(lib->workspace);
  if (lib->lt) cublasLtDestroy(lib->lt);
  if (lib->blas) cublasDestroy(lib->blas);
  delete lib;
}

GemmStatus run_bf16_gemm(GemmLibrary* lib, const Bf16GemmParams& p) {
  if (!lib || p.m <= 0 || p.n <= 0 || p.k <= 0 || !p.x || !p.w || !p.y)
    return cuda_status(cudaErrorInvalidValue, "run_bf16_gemm: parameters");
  GEMM_TRY_BLAS(cublasSetStream(lib->blas, p.stream));
  GEMM_TRY_BLAS(cublasSetWorkspace(lib->blas, lib->workspace, lib->workspace_bytes));
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: yᵀ[N, M] = W[N, K] (stored as column-major [K, N], so op T) · xᵀ (column-major [K, M]).
  GEMM_TRY_BLAS(cublasGemmEx(lib->blas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, p.w, CUDA_R_16BF, p.k, p.x,
                             CUDA_R_16BF, p.k, &beta, p.y, CUDA_R_16BF, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return GemmStatus{};
}

cudaError_t run_act_quant(const ActQuantParams& p) {
  if (p.m <= 0 || p.k <= 0 || p.k % kFp8GroupSize != 0 || !p.x || !p.x_fp8 || !p.x_scale) return cudaErrorInvalidValue;
  const long warps = static_cast<long>(p.m) * (p.k / kFp8GroupSize);
  const int threads = 256;
  const long blocks = (warps * 32 + threads - 1) / threads;
  act_quant_kernel<<<static_cast<unsigned>(blocks), threads, 0, p.stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(p.x), p.x_fp8, p.x_scale, p.m, p.k);
  return cudaGetLastError();
}

GemmStatus run_fp8_gemm(GemmLibrary* lib, const Fp8GemmParams& p, Fp8GemmPath* used) {
  if (!lib || p.m <= 0 || p.n <= 0 || p.k <= 0 || p.k % kFp8GroupSize != 0 || !p.x_fp8 || !p.x_scale || !p.w_fp8 ||
      !p.w_scale || !p.y)
    return cuda_status(cudaErrorInvalidValue, "run_fp8_gemm: parameters");
  if (p.path != Fp8GemmPath::kSimt && p.n % 16 == 0) {
    auto key = std::make_tuple(p.m, p.n, p.k);
    auto it = lib->fp8_plans.find(key);
    if (it == lib->fp8_plans.end()) {
      LtPlan plan;
      GemmStatus s = build_fp8_plan(lib, p.m, p.n, p.k, plan);
      if (!s.ok()) {
        destroy_plan(plan);
        return s;
      }
      it = lib->fp8_plans.emplace(key, plan).first;
    }
    LtPlan& plan = it->second;
    if (plan.supported) {
      if (plan.a_scale != p.w_scale) {
        const void* ptr = p.w_scale;
        GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ptr, sizeof(ptr)));
        plan.a_scale = p.w_scale;
      }
      if (plan.b_scale != p.x_scale) {
        const void* ptr = p.x_scale;
        GEMM_TRY_BLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ptr, sizeof(ptr)));
        plan.b_scale = p.x_scale;
      }
      const float alpha = 1.0f, beta = 0.0f;
      const cublasStatus_t st = cublasLtMatmul(lib->lt, plan.desc, &alpha, p.w_fp8, plan.a, p.x_fp8, plan.b, &beta,
                                               p.y, plan.c, p.y, plan.c, &plan.algo, lib->workspace,
                                               lib->workspace_bytes, p.stream);
      if (st == CUBLAS_STATUS_SUCCESS) {
        if (used) *used = Fp8GemmPath::kCublasLt;
        return GemmStatus{};
      }
      // Rejected at run time (e.g. an alignment the heuristic did not check): remember, and fall back below.
      if (p.path == Fp8GemmPath::kCublasLt || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE))
        return cublas_status(st, "cublasLtMatmul (fp8 block-scaled)");
      plan.supported = false;
    }
  }
  if (p.path == Fp8GemmPath::kCublasLt)
    return cublas_status(CUBLAS_STATUS_NOT_SUPPORTED, "run_fp8_gemm: no cuBLASLt block-scaled algorithm");
  const dim3 grid((p.n + kSimtTile - 1) / kSimtTile, (p.m + kSimtTile - 1) / kSimtTile);
  fp8_gemm_simt_kernel<<<grid, 256, 0, p.stream>>>(p.x_fp8, p.x_scale, p.w_fp8, p.w_scale,
                                                   reinterpret_cast<__nv_bfloat16*>(p.y), p.m, p.n, p.k,
                                                   fp8_weight_scale_ld(p.k));
  if (used) *used = Fp8GemmPath::kSimt;
  return cuda_status(cudaGetLastError(), "fp8_gemm_simt_kernel launch");
}

}  // namespace deepinfer::kernels::cuda
