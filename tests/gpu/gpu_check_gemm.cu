// gpu_check_gemm: checks the dense GEMMs (kernels/cuda/gemm.cu: bf16 cuBLAS, DeepSeek act_quant, FP8 block-scaled
// cuBLASLt and the simple CUDA-core FP8 kernel) against float64 CPU references, then times bf16 cuBLAS and the FP8
// path on DeepSeek-V3's shapes (DeepGEMM README's table) at M = 64, 128, 4096, next to the run's own cuBLAS bf16
// 8192³ ceiling and DeepGEMM's published H800 numbers. Prints JSON lines, then a short table.
// Exit status: 0 when every check passed, 1 otherwise (timings never fail it).
//   gpu_check_gemm            checks + ceiling + benchmarks
//   gpu_check_gemm --quick    the checks only
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "deepinfer/kernels/cuda/fused_ops.h"
#include "deepinfer/kernels/cuda/gemm.h"
#include "deepinfer/kernels/cuda/moe_grouped.h"
#include "gpu_check_common.h"

namespace {

namespace k = deepinfer::kernels::cuda;
using namespace deepinfer::gpu_check;
constexpr double kTolerance = 1e-2;
constexpr int kG = k::kFp8GroupSize;

#define GEMM_TRY(expr)                                                                                 \
  do {                                                                                                 \
    k::GemmStatus st_ = (expr);                                                                        \
    if (!st_.ok())                                                                                     \
      throw std::runtime_error(std::string(st_.where) + " -> cuda " + cudaGetErrorName(st_.cuda) +    \
                               ", cublas status " + std::to_string(st_.cublas));                       \
  } while (0)

// float8_e4m3fn -> float (bias 7, no infinities, 0x7f/0xff NaN).
double e4m3_to_double(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  if (exp == 0xf && man == 7) return NAN;
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

// Random bf16: uniform in [-1, 1) times a per-128-column-group magnitude 2^e, e in [-3, 3] (varies the scales,
// as real activations and weights do).
__global__ void fill_random_bf16(__nv_bfloat16* dst, size_t n, size_t cols, uint64_t seed, float amplitude) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);
    const size_t row = i / cols, group = (i % cols) / kG;
    const int e = static_cast<int>(splitmix64(seed ^ (row * 7919 + group * 104729)) % 7) - 3;
    dst[i] = __float2bfloat16((2.0f * u - 1.0f) * amplitude * ldexpf(1.0f, e));
  }
}
void fill_random(uint16_t* dst, size_t rows, size_t cols, uint64_t seed, float amplitude) {
  fill_random_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(dst), rows * cols, cols, seed, amplitude);
  CUDA_TRY(cudaGetLastError());
}

// Weight quantization as DeepSeek's checkpoints have it: per 128x128 block, scale_inv = amax / 448,
// w_fp8 = e4m3(w / scale_inv). One 256-thread block per weight block.
__global__ void weight_quant_kernel(const __nv_bfloat16* w, uint8_t* wq, float* ws, int n, int kdim, int ld) {
  const int nb = blockIdx.y, kb = blockIdx.x;
  __shared__ float red[256];
  float amax = 0.0f;
  for (int i = threadIdx.x; i < kG * kG; i += 256) {
    const int r = nb * kG + i / kG, c = kb * kG + i % kG;
    if (r < n && c < kdim) amax = fmaxf(amax, fabsf(__bfloat162float(w[static_cast<size_t>(r) * kdim + c])));
  }
  red[threadIdx.x] = amax;
  __syncthreads();
  for (int s = 128; s > 0; s /= 2) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const float scale = red[0] > 0.0f ? red[0] / k::kFp8E4m3Max : 1.0f;
  for (int i = threadIdx.x; i < kG * kG; i += 256) {
    const int r = nb * kG + i / kG, c = kb * kG + i % kG;
    if (r < n && c < kdim)
      wq[static_cast<size_t>(r) * kdim + c] =
          __nv_cvt_float_to_fp8(__bfloat162float(w[static_cast<size_t>(r) * kdim + c]) / scale, __NV_SATFINITE, __NV_E4M3);
  }
  if (threadIdx.x == 0) ws[static_cast<size_t>(nb) * ld + kb] = scale;
}

// One GEMM problem on the device: bf16 x and W, their FP8 forms (x through run_act_quant), and an output.
struct Problem {
  int m = 0, n = 0, kdim = 0;
  DeviceBuffer<uint16_t> x, w, y;
  DeviceBuffer<uint8_t> xq, wq;
  DeviceBuffer<float> xs, ws;
};
// x's FP8 form (xq, xs) from its current bf16 values, through run_act_quant.
void quantize_x(Problem& p) {
  k::ActQuantParams aq;
  aq.m = p.m;
  aq.k = p.kdim;
  aq.x = p.x.ptr;
  aq.x_fp8 = p.xq.ptr;
  aq.x_scale = p.xs.ptr;
  CUDA_TRY(k::run_act_quant(aq));
}
Problem make_problem(int m, int n, int kdim, uint64_t seed) {
  Problem p;
  p.m = m;
  p.n = n;
  p.kdim = kdim;
  const int ld = k::fp8_weight_scale_ld(kdim);
  const int nblocks = (n + kG - 1) / kG;
  p.x = DeviceBuffer<uint16_t>(static_cast<size_t>(m) * kdim);
  p.w = DeviceBuffer<uint16_t>(static_cast<size_t>(n) * kdim);
  p.y = DeviceBuffer<uint16_t>(static_cast<size_t>(m) * n);
  p.xq = DeviceBuffer<uint8_t>(static_cast<size_t>(m) * kdim);
  p.wq = DeviceBuffer<uint8_t>(static_cast<size_t>(n) * kdim);
  p.xs = DeviceBuffer<float>(static_cast<size_t>(kdim / kG) * m);
  p.ws = DeviceBuffer<float>(static_cast<size_t>(nblocks) * ld);
  fill_random(p.x.ptr, m, kdim, seed * 2 + 1, 1.0f);
  fill_random(p.w.ptr, n, kdim, seed * 2 + 2, 0.05f);
  p.ws.poison();  // NaN in the padding: must never be read
  weight_quant_kernel<<<dim3((kdim + kG - 1) / kG, nblocks), 256>>>(reinterpret_cast<const __nv_bfloat16*>(p.w.ptr),
                                                                     p.wq.ptr, p.ws.ptr, n, kdim, ld);
  CUDA_TRY(cudaGetLastError());
  quantize_x(p);
  CUDA_TRY(cudaDeviceSynchronize());
  return p;
}

k::GemmLibrary* g_lib = nullptr;
bool g_all_ok = true;
double g_gemm_tflops = 0.0;

k::GemmStatus run_bf16(Problem& p) {
  k::Bf16GemmParams b;
  b.m = p.m;
  b.n = p.n;
  b.k = p.kdim;
  b.x = p.x.ptr;
  b.w = p.w.ptr;
  b.y = p.y.ptr;
  return k::run_bf16_gemm(g_lib, b);
}
k::GemmStatus run_fp8(Problem& p, k::Fp8GemmPath path, k::Fp8GemmPath* used) {
  k::Fp8GemmParams f;
  f.m = p.m;
  f.n = p.n;
  f.k = p.kdim;
  f.x_fp8 = p.xq.ptr;
  f.x_scale = p.xs.ptr;
  f.w_fp8 = p.wq.ptr;
  f.w_scale = p.ws.ptr;
  f.y = p.y.ptr;
  f.path = path;
  return k::run_fp8_gemm(g_lib, f, used);
}
const char* path_name(k::Fp8GemmPath p) {
  return p == k::Fp8GemmPath::kCublasLt ? "cublaslt" : p == k::Fp8GemmPath::kSimt ? "simt" : "auto";
}

// Host copies of sampled rows of x / W (bf16 and FP8) and all scales, and float64 references.
struct Sample {
  std::vector<int> rows, cols;  // sampled m and n (all pairs are compared)
  std::vector<std::vector<uint16_t>> x, w;
  std::vector<std::vector<uint8_t>> xq, wq;
  std::vector<float> xs, ws;
  std::vector<double> ref_exact, ref_deq;  // [rows x cols]: bf16 product, dequantized-FP8 product
};
Sample make_sample(const Problem& p, int nrows, int ncols, uint64_t seed) {
  Sample s;
  std::mt19937_64 rng(seed);
  if (nrows >= p.m) {
    for (int i = 0; i < p.m; ++i) s.rows.push_back(i);
  } else {
    s.rows = {0, p.m - 1};
    while (static_cast<int>(s.rows.size()) < nrows) s.rows.push_back(static_cast<int>(rng() % p.m));
  }
  if (ncols >= p.n) {
    for (int i = 0; i < p.n; ++i) s.cols.push_back(i);
  } else {
    s.cols = {0, p.n - 1};
    while (static_cast<int>(s.cols.size()) < ncols) s.cols.push_back(static_cast<int>(rng() % p.n));
  }
  const size_t K = p.kdim;
  for (int r : s.rows) {
    s.x.push_back(p.x.download_range(r * K, K));
    s.xq.push_back(p.xq.download_range(r * K, K));
  }
  for (int c : s.cols) {
    s.w.push_back(p.w.download_range(c * K, K));
    s.wq.push_back(p.wq.download_range(c * K, K));
  }
  s.xs = p.xs.download();
  s.ws = p.ws.download();
  const int ld = k::fp8_weight_scale_ld(p.kdim);
  for (size_t i = 0; i < s.rows.size(); ++i)
    for (size_t j = 0; j < s.cols.size(); ++j) {
      double exact = 0.0, deq = 0.0;
      for (int g = 0; g < p.kdim / kG; ++g) {
        double part = 0.0;
        for (int kk = g * kG; kk < (g + 1) * kG; ++kk) {
          exact += static_cast<double>(bf16_to_float(s.x[i][kk])) * bf16_to_float(s.w[j][kk]);
          part += e4m3_to_double(s.xq[i][kk]) * e4m3_to_double(s.wq[j][kk]);
        }
        deq += part * s.xs[static_cast<size_t>(g) * p.m + s.rows[i]] * s.ws[static_cast<size_t>(s.cols[j] / kG) * ld + g];
      }
      s.ref_exact.push_back(exact);
      s.ref_deq.push_back(deq);
    }
  return s;
}
struct Err {
  double rel = INFINITY;  // ||o - r|| / ||r|| over the sampled elements
  long non_finite = 0;
};
Err compare(const Problem& p, const Sample& s, const std::vector<double>& ref) {
  Err e;
  double num = 0, den = 0;
  size_t idx = 0;
  for (int r : s.rows) {
    const std::vector<uint16_t> row = p.y.download_range(static_cast<size_t>(r) * p.n, p.n);
    for (int c : s.cols) {
      const double o = bf16_to_float(row[c]);
      if (!std::isfinite(o)) ++e.non_finite;
      num += (o - ref[idx]) * (o - ref[idx]);
      den += ref[idx] * ref[idx];
      ++idx;
    }
  }
  e.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (e.non_finite > 0 || !std::isfinite(e.rel)) e.rel = INFINITY;
  return e;
}
long count_non_finite_output(const Problem& p) {
  std::vector<uint16_t> y = p.y.download();
  long n = 0;
  for (uint16_t v : y) n += std::isfinite(bf16_to_float(v)) ? 0 : 1;
  return n;
}

struct Summary {
  std::string name;
  double us = 0, tflops = 0, pct = 0, gbps = 0, deepgemm = 0, err = -1;
};
std::vector<Summary> g_summary;

// act_quant against a CPU float64 recomputation of kernel.py's formula on sampled rows.
void check_act_quant(const Problem& p, const Sample& s, const std::string& name) {
  long mismatches = 0, checked = 0;
  double worst_scale_rel = 0.0;
  for (size_t i = 0; i < s.rows.size(); ++i)
    for (int g = 0; g < p.kdim / kG; ++g) {
      double amax = 0;
      for (int kk = g * kG; kk < (g + 1) * kG; ++kk) amax = std::max(amax, std::fabs(double(bf16_to_float(s.x[i][kk]))));
      const float scale = amax > 0 ? static_cast<float>(amax) / k::kFp8E4m3Max : 1.0f;
      const float got = s.xs[static_cast<size_t>(g) * p.m + s.rows[i]];
      worst_scale_rel = std::max(worst_scale_rel, static_cast<double>(std::fabs(got - scale) / scale));
      for (int kk = g * kG; kk < (g + 1) * kG; ++kk) {
        // The device value must be one of the two e4m3 neighbours of x / s (rounding mode aside), never further.
        const double want = bf16_to_float(s.x[i][kk]) / static_cast<double>(got);
        const double q = e4m3_to_double(s.xq[i][kk]);
        ++checked;
        if (!std::isfinite(q) || std::fabs(q - want) > std::max(std::fabs(want) / 8.0, std::ldexp(1.0, -9)) + 1e-12)
          ++mismatches;
      }
    }
  const bool ok = mismatches == 0 && worst_scale_rel < 1e-6;
  g_all_ok = g_all_ok && ok;
  std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"act_quant\",\"values\":%ld,\"mismatches\":%ld,"
              "\"worst_scale_rel_err\":%.3e,\"ok\":%s}\n",
              name.c_str(), checked, mismatches, worst_scale_rel, ok ? "true" : "false");
}

void check_case(const std::string& name, int m, int n, int kdim, uint64_t seed) {
  Problem p = make_problem(m, n, kdim, seed);
  Sample s = make_sample(p, 48, 256, seed ^ 0x5eed);
  check_act_quant(p, s, name);
  double worst = 0.0;
  struct V {
    const char* name;
    int kind;  // 0 bf16, 1 fp8 auto, 2 fp8 simt
  };
  for (V v : {V{"bf16_cublas", 0}, V{"fp8_auto", 1}, V{"fp8_simt", 2}}) {
    p.y.poison();  // NaN
    k::Fp8GemmPath used = k::Fp8GemmPath::kAuto;
    std::string error;
    try {
      if (v.kind == 0)
        GEMM_TRY(run_bf16(p));
      else
        GEMM_TRY(run_fp8(p, v.kind == 1 ? k::Fp8GemmPath::kAuto : k::Fp8GemmPath::kSimt, &used));
      CUDA_TRY(cudaDeviceSynchronize());
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    if (!error.empty()) {
      std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", name.c_str(),
                  v.name, error.c_str());
      g_all_ok = false;
      worst = INFINITY;
      if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("sticky CUDA error");
      continue;
    }
    const long unwritten = count_non_finite_output(p);
    const Err vs_exact = compare(p, s, s.ref_exact);
    const Err vs_deq = compare(p, s, s.ref_deq);
    // bf16: against the exact product; FP8: against the product of the dequantized operands.
    const double err = v.kind == 0 ? vs_exact.rel : vs_deq.rel;
    const bool ok = unwritten == 0 && err <= kTolerance;
    g_all_ok = g_all_ok && ok;
    worst = std::max(worst, ok ? err : INFINITY);
    std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"%s\",\"path\":\"%s\",\"m\":%d,\"n\":%d,\"k\":%d,"
                "\"sampled\":%zu,\"rel_err\":%.3e,\"rel_err_vs_dequantized\":%.3e,\"rel_err_vs_unquantized\":%.3e,"
                "\"non_finite_outputs\":%ld,\"ok\":%s}\n",
                name.c_str(), v.name, v.kind == 0 ? "cublas" : path_name(used), m, n, kdim,
                s.rows.size() * s.cols.size(), err, vs_deq.rel, vs_exact.rel, unwritten, ok ? "true" : "false");
    std::fflush(stdout);
  }
  g_summary.push_back({"check " + name, 0, 0, 0, 0, 0, worst});
}

void measure_ceiling() {
  const int n = 8192;
  Problem p;
  p.m = p.n = p.kdim = n;
  p.x = DeviceBuffer<uint16_t>(size_t{1} * n * n);
  p.w = DeviceBuffer<uint16_t>(size_t{1} * n * n);
  p.y = DeviceBuffer<uint16_t>(size_t{1} * n * n);
  fill_random(p.x.ptr, n, n, 11, 1.0f);
  fill_random(p.w.ptr, n, n, 12, 1.0f);
  Stats s = stats_of(time_events([&](int) { GEMM_TRY(run_bf16(p)); }, 3, 20));
  g_gemm_tflops = 2.0 * n * n * static_cast<double>(n) / (s.median_us * 1e-6) / 1e12;
  std::printf("{\"kind\":\"ceiling\",\"name\":\"cublas_bf16_gemm_8192\",\"median_us\":%.1f,\"min_us\":%.1f,"
              "\"max_us\":%.1f,\"tflops\":%.1f}\n",
              s.median_us, s.min_us, s.max_us, g_gemm_tflops);
  std::fflush(stdout);
}

// DeepGEMM README (deepseek-ai/DeepGEMM, first release, commit 7a70b43, Feb 2025), "Normal GEMMs for dense
// models", H800 SXM5, NVCC 12.8, FP8 1x128 / 128x128 block scaling, bf16 out. TFLOPS by (M, N, K). Later
// releases report up to 1,550 TFLOPS (README news 2025.04.18) without a per-shape table.
struct Published {
  int m, n, kdim;
  double tflops;
};
constexpr Published kDeepGemmH800[] = {
    {64, 2112, 7168, 206},    {64, 24576, 1536, 289},   {64, 32768, 512, 219},     {64, 7168, 16384, 336},
    {64, 4096, 7168, 287},    {64, 7168, 2048, 295},    {128, 2112, 7168, 352},    {128, 24576, 1536, 535},
    {128, 32768, 512, 358},   {128, 7168, 16384, 645},  {128, 4096, 7168, 533},    {128, 7168, 2048, 510},
    {4096, 2112, 7168, 1058}, {4096, 24576, 1536, 990}, {4096, 32768, 512, 590},   {4096, 7168, 16384, 1358},
    {4096, 4096, 7168, 1304}, {4096, 7168, 2048, 1025},
};
double deepgemm_h800(int m, int n, int kdim) {
  for (const Published& p : kDeepGemmH800)
    if (p.m == m && p.n == n && p.kdim == kdim) return p.tflops;
  return 0.0;
}

// One V3 shape at one M: rotating problem sets (together > 2x the L2) for bf16 and FP8; the FP8 time is the GEMM
// alone (act_quant timed separately, as DeepGEMM's numbers exclude it).
void bench_shape(int m, int n, int kdim, size_t l2_bytes) {
  const double bytes_fp8 = static_cast<double>(m) * kdim + static_cast<double>(n) * kdim + 2.0 * m * n +
                           4.0 * (kdim / kG) * (m + (n + kG - 1) / kG);
  const double bytes_bf16 = 2.0 * m * kdim + 2.0 * n * kdim + 2.0 * m * n;
  // Enough sets that the FP8 operands of all of them (the smaller footprint) exceed 3x the L2.
  const int sets = static_cast<int>(
      std::min<size_t>(16, std::max<size_t>(2, (3 * l2_bytes) / static_cast<size_t>(bytes_fp8) + 1)));
  std::vector<Problem> ps;
  for (int i = 0; i < sets; ++i) ps.push_back(make_problem(m, n, kdim, 1000 + 17 * i + m + n + kdim));
  const double flops = 2.0 * m * static_cast<double>(n) * kdim;
  char cname[64];
  std::snprintf(cname, sizeof(cname), "m%d_n%d_k%d", m, n, kdim);
  Sample s = make_sample(ps[0], 16, 128, m * 31 + n);
  const double published = deepgemm_h800(m, n, kdim);
  struct V {
    const char* name;
    int kind;  // 0 bf16, 1 fp8 (auto), 3 act_quant
  };
  for (V v : {V{"bf16_cublas", 0}, V{"fp8_blockscaled", 1}, V{"act_quant", 3}}) {
    k::Fp8GemmPath used = k::Fp8GemmPath::kAuto;
    auto launch = [&](int i) {
      Problem& p = ps[i % sets];
      if (v.kind == 0) {
        GEMM_TRY(run_bf16(p));
      } else if (v.kind == 1) {
        GEMM_TRY(run_fp8(p, k::Fp8GemmPath::kAuto, &used));
      } else {
        quantize_x(p);
      }
    };
    Stats st{};
    try {
      st = stats_of(time_events(launch, 2 * sets, std::max(30, 2 * sets)));
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"variant\":\"%s\",\"error\":\"%s\"}\n", cname, v.name, ex.what());
      g_all_ok = false;
      if (cudaDeviceSynchronize() != cudaSuccess) throw;
      continue;
    }
    Err e;
    if (v.kind != 3) {  // correctness of this path at this size: poison, run once on set 0, compare the sample
      ps[0].y.poison();
      launch(0);
      CUDA_TRY(cudaDeviceSynchronize());
      e = compare(ps[0], s, v.kind == 0 ? s.ref_exact : s.ref_deq);
      const bool ok = e.non_finite == 0 && e.rel <= kTolerance;
      g_all_ok = g_all_ok && ok;
    } else {
      e.rel = 0;
    }
    const Err vs_exact = v.kind == 1 ? compare(ps[0], s, s.ref_exact) : e;
    const double bytes = v.kind == 0 ? bytes_bf16 : v.kind == 1 ? bytes_fp8 : 3.0 * m * kdim + 4.0 * m * (kdim / kG);
    const double tflops = v.kind == 3 ? 0.0 : flops / (st.median_us * 1e-6) / 1e12;
    const double gbps = bytes / (st.median_us * 1e-6) / 1e9;
    const double pct = g_gemm_tflops > 0 ? 100.0 * tflops / g_gemm_tflops : 0.0;
    const char* path = v.kind == 0 ? "cublas" : v.kind == 1 ? path_name(used) : "kernel";
    std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"variant\":\"%s\",\"path\":\"%s\",\"m\":%d,\"n\":%d,\"k\":%d,"
                "\"sets\":%d,\"median_us\":%.2f,\"min_us\":%.2f,\"max_us\":%.2f,\"tflops\":%.1f,"
                "\"pct_bf16_ceiling\":%.1f,\"gbps\":%.0f,\"deepgemm_h800_tflops\":%.0f,\"rel_err\":%.3e,"
                "\"rel_err_vs_unquantized\":%.3e,\"ok\":%s}\n",
                cname, v.name, path, m, n, kdim, sets, st.median_us, st.min_us, st.max_us, tflops, pct, gbps,
                v.kind == 1 ? published : 0.0, e.rel, vs_exact.rel,
                (e.non_finite == 0 && e.rel <= kTolerance) ? "true" : "false");
    std::fflush(stdout);
    g_summary.push_back({std::string(cname) + " " + v.name + (v.kind == 1 ? std::string("/") + path : ""),
                         st.median_us, tflops, pct, gbps, v.kind == 1 ? published : 0.0, v.kind == 3 ? -1 : e.rel});
  }
}

// One matrix of the problem's weights (bf16 or FP8 with its block scales) over its first `rows` x rows, for the
// grouped GEMM kernels (num_experts 1, no offsets); the output and ordering fields are the caller's.
k::MoeGroupedGemmParams one_matrix(const Problem& p, bool fp8, int rows) {
  k::MoeGroupedGemmParams g;
  g.format = fp8 ? k::MoeWeightFormat::kFP8 : k::MoeWeightFormat::kBF16;
  g.rows = rows;
  g.num_experts = 1;
  g.n = p.n;
  g.k = p.kdim;
  g.x = p.x.ptr;
  g.w = fp8 ? static_cast<const void*>(p.wq.ptr) : static_cast<const void*>(p.w.ptr);
  g.w_ld = p.kdim;
  g.w_matrix_stride = static_cast<int64_t>(p.n) * p.kdim;
  if (fp8) {
    const int scale_ld = k::fp8_weight_scale_ld(p.kdim);
    g.w_scale = p.ws.ptr;
    g.w_scale_ld = scale_ld;
    g.w_scale_matrix_stride = static_cast<int64_t>((p.n + kG - 1) / kG) * scale_ld;
  }
  return g;
}

// The batch-invariant mode's GEMM pair (moe_grouped.h, tiled_order; cuda_backend.h): the streaming kernel summing in
// the tiled kernel's order and the tiled kernel give bit-identical rows, and a row's result does not depend on the
// rows beside it. bf16 and FP8 weights, bf16 and float32 outputs; M in {1, 3, 8, 9, 33, 64, 130} on both kernels
// against the first M rows of the 130-row tiled result (N 320: a column tail). Also prints whether the
// streaming kernel's own order differs (it sums other k's per mma: expected to).
void check_tiled_order() {
  const int m = 130, n = 320, kdim = 384;  // make_problem's act_quant takes whole 128-groups
  Problem p = make_problem(m, n, kdim, 99);
  for (const bool fp8 : {false, true})
    for (const bool f32 : {false, true}) {
      const size_t es = f32 ? 4 : 2;
      auto run = [&](int rows, bool tiled, bool tiled_order, void* out) {
        k::MoeGroupedGemmParams g = one_matrix(p, fp8, rows);
        if (f32)
          g.y_f32 = static_cast<float*>(out);
        else
          g.y = static_cast<uint16_t*>(out);
        g.tiled_order = tiled_order;
        if (!tiled_order) g.k_split = 1;
        CUDA_TRY(tiled ? k::run_moe_grouped_gemm_tiled(g) : k::run_moe_grouped_gemm(g));
        CUDA_TRY(cudaDeviceSynchronize());
      };
      DeviceBuffer<uint8_t> ref(static_cast<size_t>(m) * n * es), out(static_cast<size_t>(m) * n * es);
      run(m, true, true, ref.ptr);
      const std::vector<uint8_t> want = ref.download();
      int bad = 0, runs = 0;
      std::string first;
      for (const int rows : {1, 3, 8, 9, 33, 64, 130})
        for (const bool tiled : {false, true}) {
          CUDA_TRY(cudaMemset(out.ptr, 0xff, out.count));
          run(rows, tiled, true, out.ptr);
          const std::vector<uint8_t> got = out.download();
          ++runs;
          if (std::memcmp(got.data(), want.data(), static_cast<size_t>(rows) * n * es) != 0) {
            if (bad++ == 0) first = (tiled ? "tiled, M " : "streaming, M ") + std::to_string(rows);
          }
        }
      run(8, false, false, out.ptr);
      const std::vector<uint8_t> own = out.download();
      const bool own_differs = std::memcmp(own.data(), want.data(), static_cast<size_t>(8) * n * es) != 0;
      std::printf("{\"kind\":\"check\",\"case\":\"tiled_order_%s_%s\",\"ok\":%s,\"runs\":%d,\"differing\":%d%s%s%s,"
                  "\"streaming_own_order_differs\":%s}\n",
                  fp8 ? "fp8" : "bf16", f32 ? "f32_out" : "bf16_out", bad == 0 ? "true" : "false", runs, bad,
                  bad ? ",\"first\":\"" : "", first.c_str(), bad ? "\"" : "", own_differs ? "true" : "false");
      if (bad != 0) g_all_ok = false;
    }
}

// The wgmma kernel's swapped tiles (moe_grouped.h, wgmma_swap_tokens 32 and 64: the weights as wgmma's M) against its
// 128-row tiles (-1), FP8 and bf16 weights, on three experts (offsets [0, a, b, rows]; their matrices consecutive
// 320-row slices of one quantized 1,280-row matrix, 3 scale blocks each: the two kernels read the same): rows whose
// magnitudes differ by up to 16x (so a token's FP8 scale taken from another row shows), N 320 (a partial 128-column
// block), K 384, rows 1 to 130 (partial and several token tiles an expert). The sums differ only in order inside a K
// group: each output within 1% of the largest |reference| (a bf16 rounding is 0.4%).
void check_wgmma_swap() {
  const int m = 130, n = 320, kdim = 384;
  Problem p = make_problem(m, 4 * n, kdim, 31);  // the experts' scale blocks 3e .. 3e + 2 stay inside its 10
  for (int r = 0; r < m; ++r)
    fill_random(p.x.ptr + static_cast<size_t>(r) * kdim, 1, kdim, 5000 + r, std::ldexp(1.0f, r % 5 - 2));
  quantize_x(p);
  DeviceBuffer<int32_t> offsets(4);
  DeviceBuffer<uint16_t> ref(static_cast<size_t>(m) * n), out(static_cast<size_t>(m) * n);
  for (const bool fp8 : {false, true})
    for (const int rows : {1, 17, 64, 130}) {
      const int a = rows / 5, b = rows / 5 + (rows * 3) / 5;  // experts of rows / 5, 3 rows / 5 and the rest
      offsets.upload({0, a, b, rows});
      auto run = [&](int swap, uint16_t* y) {
        k::MoeGroupedGemmParams g = one_matrix(p, fp8, rows);
        g.num_experts = 3;
        g.offsets = offsets.ptr;
        g.n = n;
        g.w_matrix_stride = static_cast<int64_t>(n) * kdim;
        if (fp8) g.w_scale_matrix_stride = static_cast<int64_t>((n + kG - 1) / kG) * k::fp8_weight_scale_ld(kdim);
        g.y = y;
        g.wgmma_swap_tokens = swap;
        if (fp8) {
          g.x_fp8 = p.xq.ptr;
          g.x_scale = p.xs.ptr;
        }
        CUDA_TRY(cudaMemset(y, 0xff, static_cast<size_t>(m) * n * 2));
        CUDA_TRY(k::run_moe_grouped_gemm_wgmma(g));
        CUDA_TRY(cudaDeviceSynchronize());
      };
      run(-1, ref.ptr);
      const std::vector<uint16_t> want = ref.download();
      double scale = 0.0;
      for (size_t i = 0; i < static_cast<size_t>(rows) * n; ++i)
        scale = std::max(scale, static_cast<double>(std::fabs(bf16_to_float(want[i]))));
      for (const int swap : {32, 64}) {
        run(swap, out.ptr);
        const std::vector<uint16_t> got = out.download();
        double worst = 0.0;
        for (size_t i = 0; i < static_cast<size_t>(rows) * n; ++i) {
          const double d = std::fabs(static_cast<double>(bf16_to_float(got[i])) - bf16_to_float(want[i]));
          worst = std::isfinite(d) ? std::max(worst, d) : 1e30;
        }
        const bool ok = scale > 0.0 && worst <= 1e-2 * scale;
        std::printf(
            "{\"kind\":\"check\",\"case\":\"wgmma_swap%d_%s_m%d\",\"ok\":%s,\"max_abs_diff\":%.3g,"
            "\"max_abs_ref\":%.3g}\n",
            swap, fp8 ? "fp8" : "bf16", rows, ok ? "true" : "false", worst, scale);
        if (!ok) g_all_ok = false;
      }
    }
}

// The MoE's gate_up with SwiGLU in the streaming kernel's epilogue (moe_grouped.h, gated) against the unfused pair
// (the same kernel's gate_up, then run_silu_mul): bit for bit, bf16 and FP8 weights, M in {1, 3, 8, 9, 33, 130}, I
// 160 and 168 (a half-filled last warp; FP8: the up rows start inside a 128-row scale block), each k_split in the
// streaming kernel's own order and the tiled order.
void check_gated_swiglu() {
  const int m = 130, kdim = 384;
  for (const int inter : {160, 168}) {
    const int n = 2 * inter;
    Problem p = make_problem(m, n, kdim, 77 + inter);
    for (const bool fp8 : {false, true}) {
      int bad = 0, runs = 0;
      std::string first;
      DeviceBuffer<uint16_t> gate_up(static_cast<size_t>(m) * n), want(static_cast<size_t>(m) * inter),
          got(static_cast<size_t>(m) * inter);
      for (const bool tiled_order : {false, true})
        for (const int split : {1, 2, 4}) {
          if (tiled_order && split > 1) continue;
          for (const int rows : {1, 3, 8, 9, 33, 130}) {
            k::MoeGroupedGemmParams g = one_matrix(p, fp8, rows);
            g.tiled_order = tiled_order;
            g.k_split = split;
            g.y = gate_up.ptr;
            CUDA_TRY(k::run_moe_grouped_gemm(g));
            k::SiluMulParams sm;
            sm.rows = rows;
            sm.n = inter;
            sm.gate_up = gate_up.ptr;
            sm.out = want.ptr;
            CUDA_TRY(k::run_silu_mul(sm));
            CUDA_TRY(cudaMemset(got.ptr, 0xff, got.count * sizeof(uint16_t)));
            g.gated = true;
            g.y = got.ptr;
            CUDA_TRY(k::run_moe_grouped_gemm(g));
            CUDA_TRY(cudaDeviceSynchronize());
            const std::vector<uint16_t> a = want.download(), b = got.download();
            ++runs;
            if (std::memcmp(a.data(), b.data(), static_cast<size_t>(rows) * inter * sizeof(uint16_t)) != 0 &&
                bad++ == 0)
              first = "M " + std::to_string(rows) + " k_split " + std::to_string(split) +
                      (tiled_order ? " tiled order" : "");
          }
        }
      std::printf("{\"kind\":\"check\",\"case\":\"gated_swiglu_%s_i%d\",\"ok\":%s,\"runs\":%d,\"differing\":%d%s%s%s}\n",
                  fp8 ? "fp8" : "bf16", inter, bad == 0 ? "true" : "false", runs, bad, bad ? ",\"first\":\"" : "",
                  first.c_str(), bad ? "\"" : "");
      if (bad != 0) g_all_ok = false;
    }
  }
}

// The streaming kernel's shared-memory ring (moe_grouped.h, stream_ring): rings of 4 and 6 stages give the register
// path's (stream_ring -1) float32 sums bit for bit, bf16 and FP8 weights, K of 1, 3 and 5 FP8 stages (2, 6 and 10 bf16 ones: rings
// cut short and longer than the stream), M in {1, 3, 8, 9, 33, 130} (several chunks reuse the ring), each k_split in
// the kernel's own order and the tiled order; each ring also with weights_before_wait (its first stages copied before
// the kernel's griddepcontrol.wait).
void check_stream_ring() {
  const int m = 130, n = 320;
  for (const int kdim : {128, 384, 640}) {
    Problem p = make_problem(m, n, kdim, 55 + kdim);
    for (const bool fp8 : {false, true}) {
      int bad = 0, runs = 0;
      std::string first;
      DeviceBuffer<float> off(static_cast<size_t>(m) * n), on(static_cast<size_t>(m) * n);
      for (const bool tiled_order : {false, true})
        for (const int split : {1, 2, 4}) {
          if (tiled_order && split > 1) continue;
          for (const int rows : {1, 3, 8, 9, 33, 130}) {
            k::MoeGroupedGemmParams g = one_matrix(p, fp8, rows);
            g.tiled_order = tiled_order;
            g.k_split = split;
            g.stream_ring = -1;  // registers
            g.y_f32 = off.ptr;
            CUDA_TRY(k::run_moe_grouped_gemm(g));
            const std::vector<float> a = off.download();
            for (const int variant : {4, 6, 4 + 100, 6 + 100}) {  // + 100: the weights copied before the wait
              const int ahead = variant % 100;
              CUDA_TRY(cudaMemset(on.ptr, 0xff, on.count * sizeof(float)));
              g.stream_ring = ahead;
              g.weights_before_wait = variant > 100;
              g.y_f32 = on.ptr;
              CUDA_TRY(k::run_moe_grouped_gemm(g));
              CUDA_TRY(cudaDeviceSynchronize());
              const std::vector<float> b = on.download();
              ++runs;
              if (std::memcmp(a.data(), b.data(), static_cast<size_t>(rows) * n * sizeof(float)) != 0 && bad++ == 0)
                first = "M " + std::to_string(rows) + " k_split " + std::to_string(split) + " ring " +
                        std::to_string(ahead) + (variant > 100 ? " early" : "") + (tiled_order ? " tiled order" : "");
            }
          }
        }
      std::printf("{\"kind\":\"check\",\"case\":\"stream_ring_%s_k%d\",\"ok\":%s,\"runs\":%d,"
                  "\"differing\":%d%s%s%s}\n",
                  fp8 ? "fp8" : "bf16", kdim, bad == 0 ? "true" : "false", runs, bad, bad ? ",\"first\":\"" : "",
                  first.c_str(), bad ? "\"" : "");
      if (bad != 0) g_all_ok = false;
    }
  }
}

void print_summary() {
  std::printf("\n%-40s %9s %8s %7s %8s %9s %10s\n", "case", "us", "TFLOPS", "%bf16", "GB/s", "DG_H800", "rel_err");
  std::printf("%-40s %9s %8.1f %7s %8s %9s %10s\n", "ceiling cuBLAS bf16 8192^3", "-", g_gemm_tflops, "100", "-", "-", "-");
  for (const Summary& s : g_summary) {
    if (s.us == 0)
      std::printf("%-40s %9s %8s %7s %8s %9s %10.2e\n", s.name.c_str(), "-", "-", "-", "-", "-", s.err);
    else
      std::printf("%-40s %9.2f %8.1f %7.1f %8.0f %9.0f %10.2e\n", s.name.c_str(), s.us, s.tflops, s.pct, s.gbps,
                  s.deepgemm, s.err);
  }
  std::printf("all gemm checks: %s\n", g_all_ok ? "PASS" : "FAIL");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  size_t l2_bytes = 0;
  try {
    cudaDeviceProp prop{};
    CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    l2_bytes = prop.l2CacheSize;
    std::printf("{\"kind\":\"device\",\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d,\"l2_bytes\":%d}\n", prop.name,
                prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize);
    k::GemmStatus st;
    g_lib = k::gemm_library_create(size_t{32} << 20, &st);
    GEMM_TRY(st);
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"fatal\",\"error\":\"%s\"}\n", ex.what());
    return 2;
  }
  struct CheckCase {
    const char* name;
    int m, n, kdim;
  };
  // Small and odd shapes (M not a multiple of 4 or 64, N not a multiple of 128), then V3 shapes at small M.
  const CheckCase checks[] = {
      {"m64_n256_k512", 64, 256, 512},          {"m50_n272_k384", 50, 272, 384},
      {"m1_n2112_k7168", 1, 2112, 7168},        {"m128_n7168_k2048", 128, 7168, 2048},
      {"m200_n24576_k1536", 200, 24576, 1536},  {"m96_n4096_k7168", 96, 4096, 7168},
  };
  try {
    check_tiled_order();
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"check\",\"case\":\"tiled_order\",\"ok\":false,\"error\":\"%s\"}\n", ex.what());
    g_all_ok = false;
  }
  try {
    check_wgmma_swap();
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"check\",\"case\":\"wgmma_swap\",\"ok\":false,\"error\":\"%s\"}\n", ex.what());
    g_all_ok = false;
  }
  try {
    check_gated_swiglu();
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"check\",\"case\":\"gated_swiglu\",\"ok\":false,\"error\":\"%s\"}\n", ex.what());
    g_all_ok = false;
  }
  try {
    check_stream_ring();
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"check\",\"case\":\"stream_ring\",\"ok\":false,\"error\":\"%s\"}\n", ex.what());
    g_all_ok = false;
  }
  int ci = 0;
  for (const CheckCase& c : checks) {
    if (quick && ci++ >= 2) break;
    try {
      check_case(c.name, c.m, c.n, c.kdim, 4242 + c.m * 7 + c.n);
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", c.name, ex.what());
      g_all_ok = false;
      if (cudaDeviceSynchronize() != cudaSuccess) break;
    }
  }
  if (!quick) {
    try {
      measure_ceiling();
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"ceiling\",\"error\":\"%s\"}\n", ex.what());
    }
    const int shapes[][2] = {{2112, 7168}, {24576, 1536}, {32768, 512}, {7168, 16384}, {4096, 7168}, {7168, 2048}};
    for (int m : {64, 128, 4096})
      for (const auto& sh : shapes) {
        try {
          bench_shape(m, sh[0], sh[1], l2_bytes);
        } catch (const std::exception& ex) {
          std::printf("{\"kind\":\"bench\",\"case\":\"m%d_n%d_k%d\",\"error\":\"%s\"}\n", m, sh[0], sh[1], ex.what());
          g_all_ok = false;
          if (cudaDeviceSynchronize() != cudaSuccess) break;
        }
      }
  }
  print_summary();
  k::gemm_library_destroy(g_lib);
  return g_all_ok ? 0 : 1;
}
