// gpu_check_common.h: the host-side helpers the GPU check programs (gpu_check_mla/gemm/ops/prefill.cu) share —
// CUDA_TRY / CUBLAS_TRY, DeviceBuffer<T> (one cudaMalloc, RAII), bf16 bits -> float and the bf16 NaN, splitmix64,
// CUDA-event timing (time_events), Stats / stats_of, and the two ceilings: device-to-device copy and cuBLAS bf16
// GEMM 8192³. Header-only; each program keeps its own input generators, references, tolerances and output.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define CUDA_TRY(expr)                                                                                    \
  do {                                                                                                    \
    cudaError_t err_ = (expr);                                                                            \
    if (err_ != cudaSuccess)                                                                              \
      throw std::runtime_error(std::string(#expr) + " -> " + cudaGetErrorName(err_) + ": " +             \
                               cudaGetErrorString(err_) + " (line " + std::to_string(__LINE__) + ")");    \
  } while (0)
#define CUBLAS_TRY(expr)                                                                                  \
  do {                                                                                                    \
    cublasStatus_t st_ = (expr);                                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                     \
      throw std::runtime_error(std::string(#expr) + " -> cublas status " + std::to_string(static_cast<int>(st_))); \
  } while (0)

namespace deepinfer::gpu_check {

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline constexpr uint16_t kBf16NaN = 0x7fc0;

template <typename T>
struct DeviceBuffer {  // owns one cudaMalloc
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) { CUDA_TRY(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T))); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr) cudaFree(ptr);
      ptr = o.ptr;
      count = o.count;
      o.ptr = nullptr;
      o.count = 0;
    }
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void upload(const std::vector<T>& v) {
    CUDA_TRY(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(count);
    CUDA_TRY(cudaMemcpy(v.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  std::vector<T> download_range(size_t offset, size_t n) const {
    std::vector<T> v(n);
    CUDA_TRY(cudaMemcpy(v.data(), ptr + offset, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() { CUDA_TRY(cudaMemset(ptr, 0xff, count * sizeof(T))); }  // NaN for floats/bf16, -1 for ints
};

// Counter-based hashing for the programs' random-input kernels: splitmix64 of (seed, index).
__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// `warmup` untimed launches launch(0 .. warmup-1), then `reps` launches launch(warmup .. warmup+reps-1), each
// between two CUDA events on the default stream; returns the reps' times in ms.
template <typename F>
std::vector<float> time_events(F&& launch, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) launch(i);
  CUDA_TRY(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CUDA_TRY(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    CUDA_TRY(cudaEventRecord(ev[2 * i]));
    launch(warmup + i);
    CUDA_TRY(cudaEventRecord(ev[2 * i + 1]));
  }
  CUDA_TRY(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) CUDA_TRY(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  return ms;
}
struct Stats {
  double median_us, min_us, max_us;
};
inline Stats stats_of(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return {1e3 * ms[ms.size() / 2], 1e3 * ms.front(), 1e3 * ms.back()};
}

// Device-to-device copy ceiling: two buffers of `bytes`, init(src, bytes) fills the source, then the copy is
// timed (warmup, reps). GB/s read + written = 2 * bytes / median.
template <typename Init>
Stats time_d2d_copy(size_t bytes, Init&& init, int warmup, int reps) {
  DeviceBuffer<uint8_t> a(bytes), b(bytes);
  init(a.ptr, bytes);
  return stats_of(time_events(
      [&](int) { CUDA_TRY(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); }, warmup, reps));
}

// cuBLAS bf16 GEMM 8192³ ceiling (f32 accumulation; A, B from fill(ptr, count, seed) with seeds 11, 12), timed
// (warmup, reps). Prints the {"kind":"ceiling","name":"cublas_bf16_gemm_8192",...} line; returns TFLOPS.
template <typename Fill>
double measure_cublas_bf16_gemm_ceiling(Fill&& fill, int warmup, int reps) {
  const int n = 8192;
  DeviceBuffer<uint16_t> a(size_t{1} * n * n), b(size_t{1} * n * n), c(size_t{1} * n * n);
  fill(a.ptr, a.count, 11);
  fill(b.ptr, b.count, 12);
  cublasHandle_t handle;
  CUBLAS_TRY(cublasCreate(&handle));
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<float> ms;
  try {
    ms = time_events(
        [&](int) {
          CUBLAS_TRY(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF, n, b.ptr,
                                  CUDA_R_16BF, n, &beta, c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
        },
        warmup, reps);
  } catch (...) {
    cublasDestroy(handle);
    throw;
  }
  cublasDestroy(handle);
  const Stats s = stats_of(ms);
  const double tflops = 2.0 * n * n * static_cast<double>(n) / (s.median_us * 1e-6) / 1e12;
  std::printf("{\"kind\":\"ceiling\",\"name\":\"cublas_bf16_gemm_8192\",\"median_us\":%.1f,\"min_us\":%.1f,"
              "\"max_us\":%.1f,\"tflops\":%.1f}\n",
              s.median_us, s.min_us, s.max_us, tflops);
  return tflops;
}

}  // namespace deepinfer::gpu_check
