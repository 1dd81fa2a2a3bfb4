// Weights and vectors of the CUDA backend: allocation in the layouts the GEMMs read (CudaWeight in
// cuda_backend.h), conversion of host matrices (float32 or the checkpoint's FP8 form) on the host, and the random
// fill of benchmarks on the device.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/backend_ops.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t element_bytes(Precision p) { return p == Precision::kF32 ? 4 : p == Precision::kBF16 ? 2 : 1; }

uint16_t f32_to_bf16(float value) {  // round to nearest even; NaN stays a quiet NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities; S.1111.111 is NaN).
float e4m3_to_f32(uint8_t byte) {
  const int exponent = (byte >> 3) & 15, mantissa = byte & 7;
  float magnitude;
  if (exponent == 15 && mantissa == 7)
    magnitude = NAN;
  else if (exponent == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa) / 8.0f, -6);
  else
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return (byte & 0x80) ? -magnitude : magnitude;
}

std::string shape(int64_t rows, int64_t cols) { return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]"; }

}  // namespace

MatrixRef matrix_of(const Weight& weight, int64_t index) {
  const auto* w = dynamic_cast<const CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  BACKEND_CHECK(index >= 0 && index < w->count,
                "matrix " + std::to_string(index) + " of a stack of " + std::to_string(w->count));
  MatrixRef m;
  m.precision = w->precision;
  m.rows = w->rows;
  m.cols = w->cols;
  m.stride = w->stride;
  m.values = static_cast<const char*>(w->values.data()) +
             static_cast<size_t>(index * w->rows * w->stride) * element_bytes(w->precision);
  if (w->precision == Precision::kFP8) {
    m.scales = static_cast<const float*>(w->scales.data()) + index * w->scale_rows * w->scale_ld;
    m.scale_ld = w->scale_ld;
  }
  return m;
}

Result<std::unique_ptr<Weight>> CudaBackend::make_weight(int64_t count, int64_t rows, int64_t cols,
                                                         Precision precision) {
  if (count < 1 || rows < 1 || cols < 1)
    return Status::invalid_argument("make_weight: " + std::to_string(count) + " matrices of " + shape(rows, cols) +
                                    " (every size must be positive)");
  auto w = std::make_unique<CudaWeight>();
  w->precision = precision;
  w->count = count;
  w->rows = rows;
  w->cols = cols;
  w->stride = precision == Precision::kFP8 ? ceil_div(cols, kc::kFp8GroupSize) * kc::kFp8GroupSize : cols;
  Result<Buffer> values = alloc(static_cast<size_t>(count * rows * w->stride) * element_bytes(precision));
  if (!values.ok()) return values.status();
  w->values = std::move(*values);
  w->bytes = w->values.bytes;
  if (precision == Precision::kFP8) {
    w->scale_rows = ceil_div(rows, kc::kFp8GroupSize);
    w->scale_ld = kc::fp8_weight_scale_ld(static_cast<int>(w->stride));
    Result<Buffer> scales = alloc(static_cast<size_t>(count * w->scale_rows * w->scale_ld) * sizeof(float));
    if (!scales.ok()) return scales.status();
    w->scales = std::move(*scales);
    w->bytes += w->scales.bytes;
  }
  return std::unique_ptr<Weight>(std::move(w));
}

Status CudaBackend::set_matrix(Weight& weight, int64_t index, const HostMatrix& host) {
  auto* w = dynamic_cast<CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  activate();
  const int64_t rows = w->rows, cols = w->cols;
  if (index < 0 || index >= w->count)
    return Status::invalid_argument("set_matrix: matrix " + std::to_string(index) + " of a stack of " +
                                    std::to_string(w->count));
  if (host.rows != rows || host.cols != cols)
    return Status::invalid_argument("set_matrix: host matrix " + shape(host.rows, host.cols) + " for a weight of " +
                                    shape(rows, cols));
  const size_t n = static_cast<size_t>(rows * cols);
  const bool has_f32 = !host.f32.empty(), has_fp8 = !host.fp8.empty();
  if (has_f32 == has_fp8)
    return Status::invalid_argument("set_matrix: give exactly one of float32 values and FP8 bytes");
  if (has_f32 && host.f32.size() != n)
    return Status::invalid_argument("set_matrix: " + std::to_string(host.f32.size()) + " float32 values for " +
                                    shape(rows, cols));
  const int64_t scale_cols = ceil_div(cols, kc::kFp8GroupSize);
  if (has_fp8 && (host.fp8.size() != n ||
                  host.fp8_scales.size() != static_cast<size_t>(ceil_div(rows, kc::kFp8GroupSize) * scale_cols)))
    return Status::invalid_argument("set_matrix: FP8 form with " + std::to_string(host.fp8.size()) + " values and " +
                                    std::to_string(host.fp8_scales.size()) + " block scales for " + shape(rows, cols) +
                                    " (want " + std::to_string(n) + " and " +
                                    shape(ceil_div(rows, kc::kFp8GroupSize), scale_cols) + ")");
  const MatrixRef m = matrix_of(*w, index);
  void* dst = const_cast<void*>(m.values);

  if (w->precision == Precision::kFP8) {
    if (has_f32)
      return Status::invalid_argument(
          "set_matrix: an FP8 weight takes the checkpoint's FP8 bytes and block "
          "scales, not float32 values");
    // Values: rows padded with zero bytes to the stored stride. Scales: rows padded to scale_ld floats.
    std::vector<uint8_t> values(static_cast<size_t>(rows * w->stride), 0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(values.data() + r * w->stride, host.fp8.data() + r * cols, static_cast<size_t>(cols));
    std::vector<float> scales(static_cast<size_t>(w->scale_rows * w->scale_ld), 0.0f);
    for (int64_t r = 0; r < w->scale_rows; ++r)
      std::memcpy(scales.data() + r * w->scale_ld, host.fp8_scales.data() + r * scale_cols,
                  static_cast<size_t>(scale_cols) * sizeof(float));
    if (Status s = upload_now(values.data(), values.size(), dst); !s.ok()) return s;
    return upload_now(scales.data(), scales.size() * sizeof(float), const_cast<float*>(m.scales));
  }

  // bf16 / f32 weights: float32 values, the FP8 form dequantized on the host first (value = fp8 * scale).
  std::vector<float> dequantized;
  std::span<const float> values = host.f32;
  if (has_fp8) {
    dequantized.resize(n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        dequantized[static_cast<size_t>(r * cols + c)] =
            e4m3_to_f32(host.fp8[static_cast<size_t>(r * cols + c)]) *
            host.fp8_scales[static_cast<size_t>((r / kc::kFp8GroupSize) * scale_cols + c / kc::kFp8GroupSize)];
    values = dequantized;
  }
  if (w->precision == Precision::kF32) return upload_now(values.data(), n * sizeof(float), dst);
  std::vector<uint16_t> bf16(n);
  for (size_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16(values[i]);
  return upload_now(bf16.data(), n * sizeof(uint16_t), dst);
}

Result<Backend::Fp8Matrix> CudaBackend::read_matrix_fp8(const Weight& weight, int64_t index) {
  const auto* w = dynamic_cast<const CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  if (index < 0 || index >= w->count)
    return Status::invalid_argument("read_matrix_fp8: matrix " + std::to_string(index) + " of a stack of " +
                                    std::to_string(w->count));
  if (w->precision != Precision::kFP8)
    return Status::invalid_argument("read_matrix_fp8: the weight is not FP8 (read_matrix reads it)");
  activate();
  const MatrixRef m = matrix_of(*w, index);
  // The stored form (set_matrix's): rows padded to `stride` bytes, scale rows padded to `scale_ld` floats.
  std::vector<uint8_t> stored(static_cast<size_t>(w->rows * w->stride));
  std::vector<float> stored_scales(static_cast<size_t>(w->scale_rows * w->scale_ld));
  cudaError_t err = cudaMemcpyAsync(stored.data(), m.values, stored.size(), cudaMemcpyDeviceToHost, stream_);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(stored_scales.data(), m.scales, stored_scales.size() * sizeof(float), cudaMemcpyDeviceToHost,
                          stream_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::internal("read_matrix_fp8: " + std::string(cudaGetErrorString(err)));
  }
  const int64_t scale_cols = ceil_div(w->cols, kc::kFp8GroupSize);
  Fp8Matrix out;
  out.values.resize(static_cast<size_t>(w->rows * w->cols));
  for (int64_t r = 0; r < w->rows; ++r)
    std::memcpy(out.values.data() + r * w->cols, stored.data() + r * w->stride, static_cast<size_t>(w->cols));
  out.scales.resize(static_cast<size_t>(w->scale_rows * scale_cols));
  for (int64_t r = 0; r < w->scale_rows; ++r)
    std::memcpy(out.scales.data() + r * scale_cols, stored_scales.data() + r * w->scale_ld,
                static_cast<size_t>(scale_cols) * sizeof(float));
  return out;
}

Result<std::vector<float>> CudaBackend::read_matrix(const Weight& weight, int64_t index) {
  const auto* w = dynamic_cast<const CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  if (index < 0 || index >= w->count)
    return Status::invalid_argument("read_matrix: matrix " + std::to_string(index) + " of a stack of " +
                                    std::to_string(w->count));
  if (w->precision == Precision::kFP8)
    return Status::invalid_argument("read_matrix: an FP8 block-scaled weight (read_matrix_fp8 reads it)");
  activate();
  const MatrixRef m = matrix_of(*w, index);
  const bool f32 = w->precision == Precision::kF32;
  // The stored rows (stride elements each), as float32 or bf16 bits.
  std::vector<uint32_t> stored(static_cast<size_t>(w->rows * w->stride));
  const size_t bytes = stored.size() * (f32 ? 4 : 2);
  if (cudaError_t err = cudaMemcpyAsync(stored.data(), m.values, bytes, cudaMemcpyDeviceToHost, stream_);
      err != cudaSuccess || (err = cudaStreamSynchronize(stream_)) != cudaSuccess) {
    cudaGetLastError();
    return Status::internal("read_matrix: " + std::string(cudaGetErrorString(err)));
  }
  const auto* bf16 = reinterpret_cast<const uint16_t*>(stored.data());
  std::vector<float> values(static_cast<size_t>(w->rows * w->cols));
  for (int64_t r = 0; r < w->rows; ++r) {
    for (int64_t c = 0; c < w->cols; ++c) {
      const size_t at = static_cast<size_t>(r * w->stride + c);
      const uint32_t bits = f32 ? stored[at] : static_cast<uint32_t>(bf16[at]) << 16;  // bf16: float32's upper half
      std::memcpy(&values[static_cast<size_t>(r * w->cols + c)], &bits, 4);
    }
  }
  return values;
}

void CudaBackend::fill_random(Weight& weight, uint64_t seed, float scale) {
  auto* w = dynamic_cast<CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  activate();
  kc::FillRandomParams p;
  p.format = w->precision == Precision::kF32    ? kc::TableFormat::kF32
             : w->precision == Precision::kBF16 ? kc::TableFormat::kBF16
                                                : kc::TableFormat::kFP8;
  p.count = w->count;
  p.rows = w->rows;
  p.cols = w->cols;
  p.stride = w->stride;
  p.seed = seed;
  p.scale = scale;
  p.data = w->values.data();
  p.stream = stream_;
  check_cuda(kc::run_fill_random(p), "fill_random");
  if (w->precision == Precision::kFP8) {
    // The 8-bit values span +-448, so a block scale of scale/448 makes them uniform in +-scale.
    kc::FillF32Params s;
    s.n = w->count * w->scale_rows * w->scale_ld;
    s.value = scale / kc::kFp8E4m3Max;
    s.data = static_cast<float*>(w->scales.data());
    s.stream = stream_;
    check_cuda(kc::run_fill_f32(s), "fill_random (block scales)");
  }
}

Result<Buffer> CudaBackend::make_vector(std::span<const float> values) {
  const int64_t n = static_cast<int64_t>(values.size());
  Result<Buffer> buffer = alloc(vector_bytes(n));
  if (!buffer.ok() || n == 0) return buffer;
  std::vector<uint8_t> host(vector_bytes(n), 0);
  std::memcpy(host.data(), values.data(), values.size() * sizeof(float));
  auto* bf16 = reinterpret_cast<uint16_t*>(host.data() + vector_bf16_offset(n));
  for (int64_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16(values[static_cast<size_t>(i)]);
  if (Status s = upload_now(host.data(), host.size(), buffer->data()); !s.ok()) return s;
  return buffer;
}

}  // namespace deepinfer::backend::cuda
