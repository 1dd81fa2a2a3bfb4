// gpu_check_prefill: checks the MLA prefill attention kernels (kernels/cuda/mla_prefill.cu: the fast
// FlashAttention-2-style kernel and the simple reference kernel) against a float64 CPU reference on sampled
// (token, head) rows of varlen batches, then times the fast kernel at V3 shapes (H = 128; one 4K sequence, one
// 32K sequence, 8 x 4K) next to the run's own cuBLAS bf16 8192³ ceiling. Prints JSON lines, then a short table.
// FLOPs (causal): 2 * H * (192 + 128) * L(L+1)/2 per sequence (QKᵀ + P·V over the pairs j <= i; softmax not
// counted). Exit status: 0 when every check passed, 1 otherwise (timings never fail it).
//   gpu_check_prefill            checks + ceiling + benchmarks
//   gpu_check_prefill --quick    the checks only
#include <cublas_v2.h>
#include <cuda_bf16.h>
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

#include "deepinfer/kernels/cuda/mla_prefill.h"
#include "gpu_check_common.h"

namespace {

namespace k = deepinfer::kernels::cuda;
using namespace deepinfer::gpu_check;
constexpr double kTolerance = 1e-2;
constexpr int kQK = k::kMlaPrefillQkDim;
constexpr int kV = k::kMlaPrefillVDim;

double bf16_to_double(uint16_t bits) { return bf16_to_float(bits); }  // the float64 references compute in double

// Uniform bf16 values in [-amp, amp) from a hash of (seed, index): fresh random data on the device.
__global__ void fill_random_kernel(uint16_t* out, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    const float u = (x >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    __nv_bfloat16 b = __float2bfloat16((2.0f * u - 1.0f) * amp);
    out[i] = *reinterpret_cast<uint16_t*>(&b);
  }
}
void fill_random(uint16_t* p, size_t n, uint32_t seed, float amp) {
  fill_random_kernel<<<1024, 256>>>(p, n, seed, amp);
  CUDA_TRY(cudaGetLastError());
}
void poison(uint16_t* p, size_t n) {  // every element NaN (0x7fc0 -> bytes c0 7f: not a memset pattern)
  std::vector<uint16_t> nan(n, kBf16NaN);
  CUDA_TRY(cudaMemcpy(p, nan.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
}

bool g_all_ok = true;
double g_gemm_tflops = 0.0;
struct Summary {
  std::string name;
  double us, tflops, pct, err;
};
std::vector<Summary> g_summary;

// float64 reference of one output row (local query position i of a sequence starting at packed token s0, head h)
// from host copies: q row [192], keys/values rows 0..i of that head, each `key_stride` / `val_stride` apart.
std::vector<double> reference_row(const uint16_t* q, const uint16_t* keys, size_t key_stride, const uint16_t* vals,
                                  size_t val_stride, int i, double scale) {
  std::vector<double> sc(static_cast<size_t>(i) + 1);
  double mx = -INFINITY;
  for (int j = 0; j <= i; ++j) {
    double dot = 0.0;
    const uint16_t* kr = keys + j * key_stride;
    for (int c = 0; c < kQK; ++c) dot += bf16_to_double(q[c]) * bf16_to_double(kr[c]);
    sc[j] = dot * scale;
    mx = std::max(mx, sc[j]);
  }
  double sum = 0.0;
  for (int j = 0; j <= i; ++j) {
    sc[j] = std::exp(sc[j] - mx);
    sum += sc[j];
  }
  std::vector<double> o(kV, 0.0);
  for (int j = 0; j <= i; ++j) {
    const uint16_t* vr = vals + j * val_stride;
    for (int c = 0; c < kV; ++c) o[c] += sc[j] * bf16_to_double(vr[c]);
  }
  for (double& x : o) x /= sum;
  return o;
}
double row_rel_err(const uint16_t* got, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (int c = 0; c < kV; ++c) {
    const double g = bf16_to_double(got[c]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - ref[c]) * (g - ref[c]);
    den += ref[c] * ref[c];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void check_case(const char* name, int H, const std::vector<int>& lens, float scale, uint32_t seed) {
  const int B = static_cast<int>(lens.size());
  std::vector<int32_t> cu(B + 1, 0);
  for (int b = 0; b < B; ++b) cu[b + 1] = cu[b] + lens[b];
  const int T = cu[B];
  const int max_len = *std::max_element(lens.begin(), lens.end());
  DeviceBuffer<uint16_t> q(size_t{1} * T * H * kQK), kk(size_t{1} * T * H * kQK), v(size_t{1} * T * H * kV);
  DeviceBuffer<uint16_t> out(size_t{1} * T * H * kV), out_ref(size_t{1} * T * H * kV);
  DeviceBuffer<int32_t> d_cu(B + 1);
  CUDA_TRY(cudaMemcpy(d_cu.ptr, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_random(q.ptr, q.count, seed, 1.0f);
  fill_random(kk.ptr, kk.count, seed + 1, 1.0f);
  fill_random(v.ptr, v.count, seed + 2, 1.0f);
  poison(out.ptr, out.count);
  poison(out_ref.ptr, out_ref.count);
  k::MlaPrefillParams p;
  p.num_seqs = B;
  p.num_heads = H;
  p.max_seqlen = max_len;
  p.scale = scale;
  p.cu_seqlens = d_cu.ptr;
  p.q = q.ptr;
  p.k = kk.ptr;
  p.v = v.ptr;
  p.out = out.ptr;
  CUDA_TRY(k::run_mla_prefill(p));
  CUDA_TRY(cudaDeviceSynchronize());
  p.out = out_ref.ptr;
  CUDA_TRY(k::run_mla_prefill_reference(p));
  CUDA_TRY(cudaDeviceSynchronize());
  const std::vector<uint16_t> hq = q.download(), hk = kk.download(), hv = v.download();
  const std::vector<uint16_t> ho = out.download(), hr = out_ref.download();

  // Every element written (no NaN left from the poison), and fast vs the GPU reference kernel over all elements.
  long non_finite = 0, non_finite_ref = 0;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ho.size(); ++i) {
    const double a = bf16_to_double(ho[i]), r = bf16_to_double(hr[i]);
    if (!std::isfinite(a)) ++non_finite;
    if (!std::isfinite(r)) ++non_finite_ref;
    if (std::isfinite(a) && std::isfinite(r)) {
      num += (a - r) * (a - r);
      den += r * r;
    }
  }
  const double fast_vs_ref_kernel = std::sqrt(num / std::max(den, 1e-30));

  // Sampled (token, head) rows vs float64: each sequence's first, last and tile-boundary rows, plus random ones.
  std::mt19937 rng(seed * 7 + 1);
  std::vector<std::pair<int, int>> rows;  // (packed token, head)
  for (int b = 0; b < B; ++b) {
    if (lens[b] == 0) continue;
    for (int pos : {0, lens[b] - 1, 62, 63, 64, 65, 127, 128, lens[b] / 2}) {
      if (pos >= 0 && pos < lens[b]) rows.push_back({cu[b] + pos, static_cast<int>(rng() % H)});
    }
  }
  for (int n = 0; n < 300; ++n) rows.push_back({static_cast<int>(rng() % T), static_cast<int>(rng() % H)});
  double worst = 0.0, worst_ref = 0.0;
  for (const auto& [token, h] : rows) {
    int b = 0;
    while (cu[b + 1] <= token) ++b;
    const int i = token - cu[b];
    const size_t s0 = static_cast<size_t>(cu[b]);
    const std::vector<double> ref =
        reference_row(hq.data() + (static_cast<size_t>(token) * H + h) * kQK, hk.data() + (s0 * H + h) * kQK,
                      static_cast<size_t>(H) * kQK, hv.data() + (s0 * H + h) * kV, static_cast<size_t>(H) * kV, i,
                      scale);
    worst = std::max(worst, row_rel_err(ho.data() + (static_cast<size_t>(token) * H + h) * kV, ref));
    worst_ref = std::max(worst_ref, row_rel_err(hr.data() + (static_cast<size_t>(token) * H + h) * kV, ref));
  }
  const bool ok = non_finite == 0 && non_finite_ref == 0 && worst <= kTolerance && worst_ref <= kTolerance &&
                  fast_vs_ref_kernel <= kTolerance;
  g_all_ok = g_all_ok && ok;
  std::string lens_s;
  for (int b = 0; b < B; ++b) {
    if (b) lens_s.push_back(',');
    lens_s.append(std::to_string(lens[b]));
  }
  std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"heads\":%d,\"lens\":[%s],\"tokens\":%d,\"scale\":%.4f,"
              "\"sampled_rows\":%zu,\"max_row_rel_err_fast\":%.3e,\"max_row_rel_err_reference_kernel\":%.3e,"
              "\"fast_vs_reference_kernel_rel_err\":%.3e,\"non_finite_fast\":%ld,\"non_finite_reference\":%ld,"
              "\"ok\":%s}\n",
              name, H, lens_s.c_str(), T, scale, rows.size(), worst, worst_ref, fast_vs_ref_kernel, non_finite,
              non_finite_ref, ok ? "true" : "false");
  std::fflush(stdout);
  g_summary.push_back({std::string("check ") + name, 0, 0, 0, ok ? worst : INFINITY});
}

void measure_ceiling() {  // cuBLAS bf16 GEMM 8192^3, f32 accumulation, random inputs (as gpu_check_mla)
  g_gemm_tflops = measure_cublas_bf16_gemm_ceiling(
      [](uint16_t* p, size_t n, uint32_t seed) { fill_random(p, n, seed, 1.0f); }, 3, 20);
  std::fflush(stdout);
}

// Times the fast kernel on `batch` sequences of `len` tokens at H heads; checks a few sampled rows (incl. the
// last token) of the timed output against float64 by copying back only the rows they need.
void bench_case(const char* name, int H, int batch, int len, int reps) {
  std::vector<int32_t> cu(batch + 1, 0);
  for (int b = 0; b < batch; ++b) cu[b + 1] = cu[b] + len;
  const size_t T = static_cast<size_t>(cu[batch]);
  DeviceBuffer<uint16_t> q(T * H * kQK), kk(T * H * kQK), v(T * H * kV), out(T * H * kV);
  DeviceBuffer<int32_t> d_cu(batch + 1);
  CUDA_TRY(cudaMemcpy(d_cu.ptr, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_random(q.ptr, q.count, 101 + len, 1.0f);
  fill_random(kk.ptr, kk.count, 202 + len, 1.0f);
  fill_random(v.ptr, v.count, 303 + len, 1.0f);
  poison(out.ptr, out.count);
  const float scale = 0.3f;
  k::MlaPrefillParams p;
  p.num_seqs = batch;
  p.num_heads = H;
  p.max_seqlen = len;
  p.scale = scale;
  p.cu_seqlens = d_cu.ptr;
  p.q = q.ptr;
  p.k = kk.ptr;
  p.v = v.ptr;
  p.out = out.ptr;
  const Stats st = stats_of(time_events([&](int) { CUDA_TRY(k::run_mla_prefill(p)); }, 1, reps));
  const double flops = batch * k::mla_prefill_flops(H, len);
  const double tflops = flops / (st.median_us * 1e-6) / 1e12;
  const double pct = g_gemm_tflops > 0 ? 100.0 * tflops / g_gemm_tflops : 0.0;
  // Sampled rows of the last timed output.
  std::mt19937 rng(len + batch);
  double worst = 0.0;
  std::vector<std::pair<int, int>> rows = {{len - 1, 0}, {len - 1, H - 1}, {0, 1}, {63, 2}, {64, 3}};
  for (int n = 0; n < 3; ++n) rows.push_back({static_cast<int>(rng() % len), static_cast<int>(rng() % H)});
  for (const auto& [i, h] : rows) {
    const int b = static_cast<int>(rng() % batch);
    const size_t token = static_cast<size_t>(cu[b]) + i;
    std::vector<uint16_t> hq(kQK), hk(static_cast<size_t>(i + 1) * kQK), hv(static_cast<size_t>(i + 1) * kV),
        ho(kV);
    CUDA_TRY(cudaMemcpy(hq.data(), q.ptr + (token * H + h) * kQK, kQK * 2, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(ho.data(), out.ptr + (token * H + h) * kV, kV * 2, cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy2D(hk.data(), kQK * 2, kk.ptr + (static_cast<size_t>(cu[b]) * H + h) * kQK,
                          static_cast<size_t>(H) * kQK * 2, kQK * 2, static_cast<size_t>(i) + 1,
                          cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy2D(hv.data(), kV * 2, v.ptr + (static_cast<size_t>(cu[b]) * H + h) * kV,
                          static_cast<size_t>(H) * kV * 2, kV * 2, static_cast<size_t>(i) + 1,
                          cudaMemcpyDeviceToHost));
    const std::vector<double> ref = reference_row(hq.data(), hk.data(), kQK, hv.data(), kV, i, scale);
    worst = std::max(worst, row_rel_err(ho.data(), ref));
  }
  const bool ok = worst <= kTolerance;
  g_all_ok = g_all_ok && ok;
  std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"heads\":%d,\"batch\":%d,\"seqlen\":%d,\"flops\":%.4e,"
              "\"reps\":%d,\"median_us\":%.1f,\"min_us\":%.1f,\"max_us\":%.1f,\"tflops\":%.1f,\"pct_gemm\":%.1f,"
              "\"sampled_rows\":%zu,\"max_row_rel_err\":%.3e,\"ok\":%s}\n",
              name, H, batch, len, flops, reps, st.median_us, st.min_us, st.max_us, tflops, pct, rows.size(), worst,
              ok ? "true" : "false");
  std::fflush(stdout);
  g_summary.push_back({name, st.median_us, tflops, pct, worst});
}

void print_summary() {
  std::printf("\ncase %-36s %11s %8s %7s %10s\n", "", "us", "TFLOPS", "%gemm", "max_err");
  std::printf("case %-36s %11s %8.1f %7s %10s\n", "ceiling cuBLAS bf16 8192^3", "-", g_gemm_tflops, "100", "-");
  for (const Summary& s : g_summary) {
    if (s.us == 0)
      std::printf("case %-36s %11s %8s %7s %10.2e\n", s.name.c_str(), "-", "-", "-", s.err);
    else
      std::printf("case %-36s %11.1f %8.1f %7.1f %10.2e\n", s.name.c_str(), s.us, s.tflops, s.pct, s.err);
  }
  std::printf("all prefill checks: %s\n", g_all_ok ? "PASS" : "FAIL");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  try {
    cudaDeviceProp prop{};
    CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    std::printf("{\"kind\":\"device\",\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d}\n", prop.name, prop.major,
                prop.minor, prop.multiProcessorCount);
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"fatal\",\"error\":\"%s\"}\n", ex.what());
    return 2;
  }
  struct CheckCase {
    const char* name;
    int heads;
    std::vector<int> lens;
    float scale;
  };
  const float v3_scale = 1.0f / std::sqrt(192.0f);
  const std::vector<CheckCase> checks = {
      {"h16_mixed", 16, {1, 63, 64, 65, 300, 1000}, 0.3f},
      {"h128_mixed", 128, {65, 1, 1000, 64, 300, 63}, 0.3f},
      {"h16_v3scale", 16, {1000, 0, 127, 129, 1, 2}, v3_scale},
      {"h128_sharp", 128, {300, 129}, 1.0f},
  };
  int ci = 0;
  for (const CheckCase& c : checks) {
    if (quick && ci++ >= 2) break;
    try {
      check_case(c.name, c.heads, c.lens, c.scale, 1234u + 17u * static_cast<uint32_t>(ci) + c.heads);
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
    struct BenchCase {
      const char* name;
      int batch, len, reps;
    };
    const BenchCase benches[] = {
        {"h128 1x4096", 1, 4096, 20}, {"h128 1x32768", 1, 32768, 5}, {"h128 8x4096", 8, 4096, 10}};
    for (const BenchCase& bc : benches) {
      try {
        bench_case(bc.name, 128, bc.batch, bc.len, bc.reps);
      } catch (const std::exception& ex) {
        std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", bc.name, ex.what());
        g_all_ok = false;
        if (cudaDeviceSynchronize() != cudaSuccess) break;
      }
    }
  }
  print_summary();
  return g_all_ok ? 0 : 1;
}
