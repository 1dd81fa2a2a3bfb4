// The CUDA backend's GEMMs: linear and linear_heads (bf16 through cuBLAS with the views' leading dimensions, FP8
// through act_quant + the block-scaled GEMM of kernels/cuda/gemm.cu, float32 weights through cuBLAS sgemm), and
// the head (row selection, final norm, float32 lm_head GEMM, argmax on the device; then the copy to the host).
//
// cuBLAS is column-major: a row-major y [M, N] = x [M, K] · W [N, K]ᵀ is, in its terms, yᵀ [N, M] (ld = y.stride)
// = op_T(W viewed as [K, N], ld = W's row stride) · xᵀ (viewed as [K, M], ld = x.stride).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/backend_ops.h"
#include "deepinfer/kernels/cuda/dspark_heads.h"
#include "deepinfer/kernels/cuda/fused_ops.h"
#include "deepinfer/kernels/cuda/moe_grouped.h"
#include "deepinfer/kernels/cuda/sampling.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr int64_t kStreamingLinearMaxRows = 8;  // one chunk of the streaming kernel: the weights read once
// Batch-invariant mode: the streaming kernel up to this many rows (per expert), the tiled kernel beyond (their sums
// are the same, so the boundary is only a matter of speed: the tiled kernel reads the weights once per 64 rows but
// has only ceil(N / 128) column CTAs per row tile).
constexpr int64_t kInvariantStreamingRows = 32;

std::string dims(const Tensor& t) { return "[" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "]"; }
std::string dims(const MatrixRef& m) { return "[" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "]"; }

// cuBLAS and the GEMM kernels take int sizes and leading dimensions.
bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// The expert GEMM kernels' parameters for one matrix (no offsets): y = x · wᵀ, bf16 y with row stride ldy.
kc::MoeGroupedGemmParams one_matrix_params(const Tensor& x, const MatrixRef& w, void* y, int64_t ldy, int num_sms,
                                           int stream_ring, cudaStream_t stream) {
  kc::MoeGroupedGemmParams p;
  p.format = w.precision == Precision::kFP8 ? kc::MoeWeightFormat::kFP8 : kc::MoeWeightFormat::kBF16;
  p.rows = x.rows;
  p.num_experts = 1;
  p.n = w.rows;
  p.k = w.cols;
  p.x = static_cast<const uint16_t*>(x.data);
  p.x_ld = x.stride;
  p.w = w.values;
  p.w_ld = w.stride;
  p.w_matrix_stride = w.rows * w.stride;
  if (w.precision == Precision::kFP8) {
    p.w_scale = w.scales;
    p.w_scale_ld = w.scale_ld;
    p.w_scale_matrix_stride = (w.rows + kc::kFp8GroupSize - 1) / kc::kFp8GroupSize * w.scale_ld;
  }
  p.y = static_cast<uint16_t*>(y);
  p.y_ld = ldy;
  p.num_sms = num_sms;
  p.stream_ring = stream_ring;
  p.stream = stream;
  return p;
}

}  // namespace

void CudaBackend::invariant_gemm(const Tensor& x, const MatrixRef& w, void* y, float* y32, int64_t ldy,
                                 const char* what) {
  BACKEND_CHECK(w.precision != Precision::kF32,
                std::string(what) + ": batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1) takes bf16 and FP8 " +
                    "weights; this one is float32");
  kc::MoeGroupedGemmParams p = one_matrix_params(x, w, y, ldy, num_sms_, moe_stream_ring_, stream_);
  p.weights_before_wait = early_weights_;  // w is a checkpoint weight (matrix_of), written only at load
  p.y_f32 = y32;
  p.tiled_order = true;
  BACKEND_CHECK(kc::moe_grouped_params_valid(p),
                std::string(what) + ": batch-invariant mode needs K % 8 == 0 and 16-byte aligned rows of x and w (x " +
                    dims(x) + " at stride " + std::to_string(x.stride) + ", w " + dims(w) + ")");
  if (failed() || x.rows == 0) return;
  const bool tiled = x.rows > kInvariantStreamingRows &&
                     kc::moe_grouped_row_tiles(x.rows, 1, 64) <= kc::kMoeMaxRowTiles;
  check_cuda(tiled ? kc::run_moe_grouped_gemm_tiled(p) : kc::run_moe_grouped_gemm(p), what);
}

void CudaBackend::linear(const Tensor& x, const Weight& w, Tensor y) {
  BACKEND_CHECK(w.count == 1, "linear takes one matrix; this weight stacks " + std::to_string(w.count));
  if (y.dtype == DType::kF32) {  // float32 logits (expert parallel's router, routed on the host): as moe's own
    BACKEND_CHECK(x.dtype == DType::kBF16 && x.cols == w.cols && y.cols == w.rows && x.rows == y.rows,
                  "linear into float32: bf16 x [rows, " + std::to_string(w.cols) + "] and y [rows, " +
                      std::to_string(w.rows) + "] expected");
    if (failed() || x.rows == 0) return;
    router_logits(x, matrix_of(w, 0), static_cast<float*>(y.data), y.stride);
    return;
  }
  linear_matrix(x, matrix_of(w, 0), y);
}

void CudaBackend::linear_matrix(const Tensor& x, const MatrixRef& w, Tensor y) {
  BACKEND_CHECK(x.dtype == DType::kBF16 && y.dtype == DType::kBF16, "linear: activations must be bf16");
  BACKEND_CHECK(x.cols == w.cols && y.cols == w.rows && x.rows == y.rows,
                "linear: x " + dims(x) + " · w " + dims(w) + "ᵀ -> y " + dims(y));
  BACKEND_CHECK(fits_int(x.rows) && fits_int(w.stride) && fits_int(w.rows) && fits_int(x.stride) && fits_int(y.stride),
                "linear: a size or stride beyond INT_MAX");
  if (failed() || x.rows == 0) return;
  if (batch_invariant_) {
    invariant_gemm(x, w, y.data, nullptr, y.stride, "linear (batch-invariant)");
    return;
  }
  // FP8 weights at a few rows (decode): the streaming kernel, one launch that widens the weights exactly and
  // multiplies them with the bf16 activations, instead of linear_fp8's activation quantization, zero rows up to 16
  // and block-scaled cuBLASLt GEMM. Measured on the H200 (bench/gpu/NOTES.md, 2026-12-04): the V3 slice's decode at
  // batch 1 1.885 -> 1.720 ms, batch 8 2.676 -> 2.539. bf16 weights: on the register path the streaming kernel was no
  // faster than cuBLAS (V2-Lite batch 1 3.558 vs 3.541 ms, batch 8 7.506 vs 7.600); on the shared-memory ring (H100,
  // 2026-12-06) a V2-Lite step at 1 row 3.18 -> 3.07 ms, at 8 rows 7.90 -> 7.98: so bf16 at 1 row only.
  const bool streamed_precision =
      w.precision == Precision::kFP8 || (w.precision == Precision::kBF16 && x.rows <= streaming_linear_bf16_rows_);
  if (streaming_linear_ && x.rows <= kStreamingLinearMaxRows && streamed_precision && w.cols % 8 == 0 &&
      x.stride % 8 == 0 && aligned16(x.data) && aligned16(w.values)) {
    kc::MoeGroupedGemmParams p = one_matrix_params(x, w, y.data, y.stride, num_sms_, moe_stream_ring_, stream_);
    p.weights_before_wait = early_weights_;  // every caller passes a checkpoint weight (matrix_of), written at load
    if (kc::moe_grouped_params_valid(p)) {  // else (an unpadded FP8 row stride) cuBLAS below
      check_cuda(kc::run_moe_grouped_gemm(p), "linear (streaming, a few rows)");
      return;
    }
  }
  const int m = static_cast<int>(x.rows), n = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
  switch (w.precision) {
    case Precision::kBF16: {
      const float one = 1.0f, zero = 0.0f;
      check_blas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.values, CUDA_R_16BF,
                              static_cast<int>(w.stride), x.data, CUDA_R_16BF, static_cast<int>(x.stride), &zero,
                              y.data, CUDA_R_16BF, static_cast<int>(y.stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "linear (cublasGemmEx, bf16)");
      return;
    }
    case Precision::kFP8:
      linear_fp8(x, w, y);
      return;
    case Precision::kF32: {
      // cuBLAS has no bf16 x f32 GEMM: float32 output first, then one rounding into y.
      auto* y32 = reinterpret_cast<float*>(reserve(gemm_staging_, static_cast<size_t>(x.rows * w.rows) * 4));
      if (y32 == nullptr) return;
      gemm_f32_out(x, w, y32, w.rows);
      copy(Tensor{y32, DType::kF32, x.rows, w.rows, w.rows}, y);
      return;
    }
  }
}

// act_quant wants a contiguous [M, K] with K % 128 == 0 and 16-byte rows: a strided, unaligned or narrow x is
// copied (zero-padded to the weight's stored stride) first. cuBLASLt's block-scaled FP8 kernels are chosen for M a
// multiple of 16 (at M = 1 its heuristic offers none, and the CUDA-core fallback reads weights at ~150 GB/s, measured
// on the H200): other M get zero rows up to the next multiple of 16. run_fp8_gemm writes a contiguous [M, N]: a
// strided, unaligned or padded y gets it through scratch.
void CudaBackend::linear_fp8(const Tensor& x, const MatrixRef& w, Tensor y) {
  const int64_t M = x.rows, N = w.rows, K = w.cols, padded = w.stride;
  const int64_t Mp = (M + 15) / 16 * 16;
  const bool direct_in = Mp == M && x.stride == K && K == padded && aligned16(x.data);
  const bool direct_out = Mp == M && y.stride == N && aligned16(y.data);
  ScratchLayout l;
  const size_t o_padded = direct_in ? 0 : l.add(static_cast<size_t>(Mp * padded) * 2);
  const size_t o_fp8 = l.add(static_cast<size_t>(Mp * padded));
  const size_t o_scale = l.add(static_cast<size_t>(padded / kc::kFp8GroupSize * Mp) * 4);
  char* base = reserve(gemm_in_, l.bytes);
  if (base == nullptr) return;
  const void* x_in = x.data;
  if (!direct_in) {
    if (Mp != M) {
      check_cuda(cudaMemsetAsync(base + o_padded + static_cast<size_t>(M * padded) * 2, 0,
                                 static_cast<size_t>((Mp - M) * padded) * 2, stream_),
                 "linear (FP8: zero rows)");
    }
    kc::Convert2dParams c;
    c.rows = M;
    c.src_cols = K;
    c.dst_cols = padded;
    c.src = x.data;
    c.src_stride = x.stride;
    c.dst = base + o_padded;
    c.dst_stride = padded;
    c.stream = stream_;
    check_cuda(kc::run_convert_2d(c), "linear (FP8: padded copy of x)");
    x_in = base + o_padded;
  }
  kc::ActQuantParams q;
  q.m = static_cast<int>(Mp);
  q.k = static_cast<int>(padded);
  q.x = static_cast<const uint16_t*>(x_in);
  q.x_fp8 = reinterpret_cast<uint8_t*>(base + o_fp8);
  q.x_scale = reinterpret_cast<float*>(base + o_scale);
  q.stream = stream_;
  check_cuda(kc::run_act_quant(q), "linear (FP8 act_quant)");
  uint16_t* y_out = static_cast<uint16_t*>(y.data);
  if (!direct_out) {
    y_out = reinterpret_cast<uint16_t*>(reserve(gemm_out_, static_cast<size_t>(Mp * N) * 2));
    if (y_out == nullptr) return;
  }
  kc::Fp8GemmParams g;
  g.m = static_cast<int>(Mp);
  g.n = static_cast<int>(N);
  g.k = static_cast<int>(padded);
  g.x_fp8 = q.x_fp8;
  g.x_scale = q.x_scale;
  g.w_fp8 = static_cast<const uint8_t*>(w.values);
  g.w_scale = w.scales;
  g.y = y_out;
  g.path = kc::Fp8GemmPath::kAuto;
  g.stream = stream_;
  check_gemm(kc::run_fp8_gemm(gemm_, g), "linear (FP8 GEMM)");
  if (!direct_out) copy(Tensor{y_out, DType::kBF16, M, N, N}, y);
}

void CudaBackend::gemm_f32_out(const Tensor& x, const MatrixRef& w, float* y, int64_t ldy) {
  BACKEND_CHECK(x.dtype == DType::kBF16 && x.cols == w.cols && ldy >= w.rows,
                "GEMM with f32 output: x " + dims(x) + " · w " + dims(w) + "ᵀ, ldy " + std::to_string(ldy));
  BACKEND_CHECK(fits_int(x.rows) && fits_int(w.stride) && fits_int(w.rows) && fits_int(x.stride) && fits_int(ldy),
                "GEMM with f32 output: a size or stride beyond INT_MAX");
  if (failed() || x.rows == 0) return;
  if (batch_invariant_) {
    invariant_gemm(x, w, nullptr, y, ldy, "GEMM with f32 output (batch-invariant)");
    return;
  }
  const int m = static_cast<int>(x.rows), n = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
  const float one = 1.0f, zero = 0.0f;
  switch (w.precision) {
    case Precision::kBF16:
      check_blas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.values, CUDA_R_16BF,
                              static_cast<int>(w.stride), x.data, CUDA_R_16BF, static_cast<int>(x.stride), &zero, y,
                              CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "GEMM with f32 output (cublasGemmEx, bf16)");
      return;
    case Precision::kF32: {
      // The router's float32 path (the reference computes router logits in float32): x widened exactly.
      auto* x32 = reinterpret_cast<float*>(reserve(gemm_in_, static_cast<size_t>(x.rows * w.cols) * 4));
      if (x32 == nullptr) return;
      copy(x, Tensor{x32, DType::kF32, x.rows, w.cols, w.cols});
      check_blas(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, static_cast<const float*>(w.values),
                             static_cast<int>(w.stride), x32, k, &zero, y, static_cast<int>(ldy)),
                 "GEMM with f32 output (cublasSgemm)");
      return;
    }
    case Precision::kFP8: {
      // The FP8 GEMM writes bf16: widen its output afterwards.
      auto* y16 = reinterpret_cast<uint16_t*>(reserve(gemm_staging_, static_cast<size_t>(x.rows * w.rows) * 2));
      if (y16 == nullptr) return;
      linear_fp8(x, w, Tensor{y16, DType::kBF16, x.rows, w.rows, w.rows});
      copy(Tensor{y16, DType::kBF16, x.rows, w.rows, w.rows}, Tensor{y, DType::kF32, x.rows, w.rows, ldy});
      return;
    }
  }
}

void CudaBackend::linear_heads(const Tensor& x, int64_t x_head_stride, const Weight& w, Tensor y,
                               int64_t y_head_stride) {
  const int64_t H = w.count;
  BACKEND_CHECK(x.dtype == DType::kBF16 && y.dtype == DType::kBF16, "linear_heads: activations must be bf16");
  BACKEND_CHECK(x.rows == y.rows && x_head_stride >= 0 && (H - 1) * x_head_stride + w.cols <= x.cols &&
                    (H == 1 || y_head_stride >= w.rows) && (H - 1) * y_head_stride + w.rows <= y.cols,
                "linear_heads: " + std::to_string(H) + " heads of [" + std::to_string(w.rows) + ", " +
                    std::to_string(w.cols) + "] with x " + dims(x) + " (head stride " + std::to_string(x_head_stride) +
                    ") and y " + dims(y) + " (head stride " + std::to_string(y_head_stride) + ")");
  if (failed() || x.rows == 0) return;
  if (w.precision != Precision::kBF16 || batch_invariant_) {
    // FP8 / f32 per-head weights, and batch-invariant mode: one GEMM per head (correct, not fast; the bf16 path is
    // the batched one).
    for (int64_t h = 0; h < H; ++h)
      linear_matrix(x.cols_slice(h * x_head_stride, w.cols), matrix_of(w, h), y.cols_slice(h * y_head_stride, w.rows));
    return;
  }
  const MatrixRef w0 = matrix_of(w, 0);
  BACKEND_CHECK(fits_int(x.rows) && fits_int(w.rows) && fits_int(w.cols) && fits_int(x.stride) && fits_int(y.stride) &&
                    fits_int(H),
                "linear_heads: a size or stride beyond INT_MAX");
  const float one = 1.0f, zero = 0.0f;
  check_blas(
      cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(x.rows),
                                 static_cast<int>(w.cols), &one, w0.values, CUDA_R_16BF, static_cast<int>(w0.stride),
                                 w.rows * w0.stride, x.data, CUDA_R_16BF, static_cast<int>(x.stride), x_head_stride,
                                 &zero, y.data, CUDA_R_16BF, static_cast<int>(y.stride), y_head_stride,
                                 static_cast<int>(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "linear_heads (cublasGemmStridedBatchedEx)");
}

// The step's logits rows: gather, final norm, lm_head with float32 output into the logits scratch, and with
// `greedy` the argmax ids beside them. Device work only (it may be captured into a graph); head_ says where the
// results are, for read_logits / read_greedy_tokens.
void CudaBackend::compute_logits(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head, bool greedy) {
  const MatrixRef w = matrix_of(lm_head, 0);
  const int64_t n = static_cast<int64_t>(step_.logits_rows.size()), hidden = x.cols, vocab = w.rows;
  BACKEND_CHECK(lm_head.count == 1 && w.cols == hidden && x.dtype == DType::kBF16,
                "logits: x " + dims(x) + " against lm_head " + dims(w));
  for (int32_t r : step_.logits_rows)
    BACKEND_CHECK(r < x.rows, "logits: row " + std::to_string(r) + " of x with " + std::to_string(x.rows) + " rows");
  const uint16_t* norm_weight = vector_bf16(norm, hidden, "logits (final norm)");
  head_ = HeadResult{};
  head_.rows = n;
  head_.vocab = vocab;
  head_.computed = true;
  head_.greedy = greedy;
  if (n == 0 || failed()) return;
  ScratchLayout l;
  const size_t o_rows = l.add(static_cast<size_t>(n * hidden) * 2);
  const size_t o_ids = l.add(static_cast<size_t>(n) * 4);
  const size_t o_probabilities = l.add(static_cast<size_t>(n) * 4);
  const size_t o_logits = l.add(static_cast<size_t>(n * vocab) * 4);
  char* base = reserve(logits_, l.bytes);
  if (base == nullptr) return;
  const Tensor selected{base + o_rows, DType::kBF16, n, hidden, hidden};
  kc::GatherRowsParams g;
  g.rows = n;
  g.cols = hidden;
  g.indices = step_.logits_rows_device;
  g.format = kc::TableFormat::kBF16;
  g.table = x.data;
  g.table_rows = x.rows;
  g.table_stride = x.stride;
  g.dst = static_cast<uint16_t*>(selected.data);
  g.dst_stride = hidden;
  g.stream = stream_;
  check_cuda(kc::run_gather_rows(g), "logits (row selection)");
  rms_norm_same_stride(selected, norm_weight, eps, selected, nullptr);
  auto* logits = reinterpret_cast<float*>(base + o_logits);
  gemm_f32_out(selected, w, logits, vocab);
  auto* ids = reinterpret_cast<int32_t*>(base + o_ids);
  if (greedy && !failed()) {
    kc::ArgmaxParams a;
    a.rows = n;
    a.cols = vocab;
    a.logits = logits;
    a.ids = ids;
    a.top_probability = reinterpret_cast<float*>(base + o_probabilities);
    a.stream = stream_;
    check_cuda(kc::run_argmax(a), "greedy_tokens (argmax)");
  }
  if (failed()) return;
  head_.logits = logits;
  head_.ids = greedy ? ids : nullptr;
  head_.top_probability = greedy ? reinterpret_cast<const float*>(base + o_probabilities) : nullptr;
}

// A pinned host buffer of at least `bytes` (device-to-host copies into pageable memory ran at ~2 GB/s on the H200
// machine: 53 ms for a 256-row step of a 102,400-token vocabulary).
void* CudaBackend::pinned_host(size_t bytes) {
  if (bytes <= pinned_host_bytes_) return pinned_host_;
  if (pinned_host_ != nullptr) cudaFreeHost(pinned_host_);
  pinned_host_ = nullptr;
  pinned_host_bytes_ = 0;
  void* p = nullptr;
  check_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "pinned host buffer for logits");
  if (failed()) return nullptr;
  pinned_host_ = p;
  pinned_host_bytes_ = bytes;
  return p;
}

Status CudaBackend::read_logits(std::vector<float>& host_logits) {
  BACKEND_CHECK(!capturing_, "read_logits inside run_graph's ops");
  BACKEND_CHECK(head_.computed, "read_logits without compute_logits for this step");
  activate();
  const size_t count = static_cast<size_t>(head_.rows * head_.vocab);
  host_logits.resize(count);
  if (head_.logits != nullptr && !failed()) {
    void* staging = pinned_host(count * 4);
    if (staging != nullptr) {
      check_cuda(cudaMemcpyAsync(staging, head_.logits, count * 4, cudaMemcpyDeviceToHost, stream_),
                 "logits (copy to host)");
      Status s = synchronize();
      if (!s.ok()) return s;
      // Out of the pinned buffer on all cores: one core moved ~5 GB/s on the H200 machine (a 256-row step of
      // DeepSeek-V3's vocabulary, 132 MB, cost 26 ms on top of the step).
      const int64_t chunk = int64_t{1} << 20;  // floats
      const int64_t chunks = (static_cast<int64_t>(count) + chunk - 1) / chunk;
      const float* from = static_cast<const float*>(staging);
#pragma omp parallel for schedule(static) if (chunks > 1)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = c * chunk, n = std::min<int64_t>(chunk, static_cast<int64_t>(count) - begin);
        std::memcpy(host_logits.data() + begin, from + begin, static_cast<size_t>(n) * 4);
      }
    }
  }
  return synchronize();
}

// `n` 4-byte values of the head results at `device` into `host` through the pinned buffer; waits for the step.
Status CudaBackend::read_head_values(const void* device, size_t n, void* host, const char* what) {
  activate();
  if (device != nullptr && !failed()) {
    void* staging = pinned_host(n * 4);
    if (staging != nullptr) {
      check_cuda(cudaMemcpyAsync(staging, device, n * 4, cudaMemcpyDeviceToHost, stream_), what);
      Status s = synchronize();
      if (!s.ok()) return s;
      std::memcpy(host, staging, n * 4);
    }
  }
  return synchronize();
}

Status CudaBackend::read_greedy_tokens(std::vector<int32_t>& host_ids) {
  BACKEND_CHECK(!capturing_, "read_greedy_tokens inside run_graph's ops");
  BACKEND_CHECK(head_.computed && head_.greedy, "read_greedy_tokens without compute_logits(greedy) for this step");
  host_ids.assign(static_cast<size_t>(head_.rows), -1);
  return read_head_values(head_.ids, host_ids.size(), host_ids.data(), "greedy_tokens (copy to host)");
}

Status CudaBackend::read_top_probabilities(std::vector<float>& host_probabilities) {
  BACKEND_CHECK(!capturing_, "read_top_probabilities inside run_graph's ops");
  BACKEND_CHECK(head_.computed && head_.greedy,
                "read_top_probabilities without compute_logits(greedy) for this step");
  host_probabilities.assign(static_cast<size_t>(head_.rows), 0.0f);
  return read_head_values(head_.top_probability, host_probabilities.size(), host_probabilities.data(),
                          "top probabilities (copy to host)");
}

Status CudaBackend::read_sampled_tokens(std::span<const DeviceSampling> rows, std::span<const LogitAdjustment> adjustments,
                                        std::vector<int32_t>& host_ids) {
  BACKEND_CHECK(!capturing_, "read_sampled_tokens inside run_graph's ops");
  BACKEND_CHECK(head_.computed && !head_.greedy, "read_sampled_tokens without compute_logits (not greedy) for this step");
  BACKEND_CHECK(static_cast<int64_t>(rows.size()) == head_.rows,
                "read_sampled_tokens: " + std::to_string(rows.size()) + " rows' parameters for " +
                    std::to_string(head_.rows) + " logits rows");
  activate();
  host_ids.assign(rows.size(), -1);
  sampled_logprobs_.clear();
  if (rows.empty() || head_.logits == nullptr || failed()) return synchronize();
  const size_t n = rows.size(), m = adjustments.size();
  bool logprobs = false;
  for (const DeviceSampling& row : rows) {
    BACKEND_CHECK(row.logprobs <= kc::kMaxTopLogprobs,
                  "read_sampled_tokens: " + std::to_string(row.logprobs) + " logprobs (at most " +
                      std::to_string(kc::kMaxTopLogprobs) + ")");
    logprobs = logprobs || row.logprobs >= 0;
  }
  constexpr size_t kTop = kc::kMaxTopLogprobs;
  ScratchLayout l;
  const size_t o_params = l.add(n * sizeof(kc::SampleRowParams));
  const size_t o_adjust = l.add(m * sizeof(kc::LogitAdjustment));
  // What comes back, contiguous: the ids, then (with logprobs) the drawn tokens' logprobs and the top lists.
  const size_t o_ids = l.add(n * 4);
  const size_t o_chosen = l.add(logprobs ? n * 4 : 0);
  const size_t o_top_ids = l.add(logprobs ? n * kTop * 4 : 0);
  const size_t o_top_logprobs = l.add(logprobs ? n * kTop * 4 : 0);
  const size_t o_back_end = l.bytes;
  const size_t o_normaliser = l.add(logprobs ? n * 8 : 0);
  const size_t o_original = l.add(logprobs ? m * 4 : 0);
  char* base = reserve(sampling_, l.bytes);
  if (base == nullptr) return synchronize();
  // The parameters through the pinned buffer (no copy of it is in flight: every read_* waits for its copy).
  auto* pinned = static_cast<char*>(pinned_host(o_back_end));
  if (pinned == nullptr) return synchronize();
  auto* staging = reinterpret_cast<kc::SampleRowParams*>(pinned + o_params);
  for (size_t r = 0; r < n; ++r) {
    kc::SampleRowParams& p = staging[r];
    p = kc::SampleRowParams{};
    p.temperature = rows[r].temperature;
    p.top_k = rows[r].top_k;
    p.top_p = rows[r].top_p;
    p.min_p = rows[r].min_p;
    p.seed = rows[r].seed;
    p.counter = rows[r].counter;
    p.logprobs = rows[r].logprobs;
  }
  auto* adjust = reinterpret_cast<kc::LogitAdjustment*>(pinned + o_adjust);
  for (size_t i = 0; i < m; ++i) {
    const LogitAdjustment& a = adjustments[i];
    BACKEND_CHECK(a.row >= 0 && static_cast<size_t>(a.row) < n && a.token >= 0 && a.token < head_.vocab,
                  "read_sampled_tokens: adjustment " + std::to_string(i) + " names row " + std::to_string(a.row) +
                      ", token " + std::to_string(a.token));
    kc::LogitAdjustment& d = adjust[i];
    d = kc::LogitAdjustment{};
    d.row = a.row;
    d.token = a.token;
    d.bias = a.bias;
    d.repetition = a.repetition;
    d.frequency = a.frequency;
    d.presence = a.presence;
    d.has_bias = a.has_bias ? 1 : 0;
    d.in_output = a.in_output ? 1 : 0;
  }
  // Parameters and adjustments in one copy (the same offsets in the pinned buffer and the device scratch).
  check_cuda(cudaMemcpyAsync(base, pinned, o_ids, cudaMemcpyHostToDevice, stream_), "sampling (parameters to the device)");
  const auto* row_params = reinterpret_cast<const kc::SampleRowParams*>(base + o_params);
  if (logprobs && !failed()) {  // of the raw logits: before the adjustments change them
    kc::LogprobsParams lp;
    lp.rows = static_cast<int64_t>(n);
    lp.cols = head_.vocab;
    lp.logits = head_.logits;
    lp.row_params = row_params;
    lp.normaliser = reinterpret_cast<double*>(base + o_normaliser);
    lp.top_ids = reinterpret_cast<int32_t*>(base + o_top_ids);
    lp.top_logprobs = reinterpret_cast<float*>(base + o_top_logprobs);
    lp.stream = stream_;
    check_cuda(kc::run_logprobs(lp), "sampling (logprobs)");
  }
  kc::LogitAdjustmentParams ap;
  ap.count = static_cast<int64_t>(m);
  ap.rows = static_cast<int64_t>(n);
  ap.cols = head_.vocab;
  ap.logits = const_cast<float*>(head_.logits);  // the step's own scratch: processed in place, read once
  ap.adjustments = reinterpret_cast<const kc::LogitAdjustment*>(base + o_adjust);
  ap.original = logprobs ? reinterpret_cast<float*>(base + o_original) : nullptr;
  ap.stream = stream_;
  if (m > 0 && !failed()) check_cuda(kc::run_logit_adjustments(ap), "sampling (logit_bias and penalties)");
  kc::SampleParams sp;
  sp.rows = static_cast<int64_t>(n);
  sp.cols = head_.vocab;
  sp.logits = head_.logits;
  sp.row_params = row_params;
  sp.ids = reinterpret_cast<int32_t*>(base + o_ids);
  sp.stream = stream_;
  if (!failed()) check_cuda(kc::run_sample(sp), "sampling (run_sample)");
  // The staging buffer is read by the copy above before the ids are copied into it (one stream, in order).
  if (!logprobs) return read_head_values(sp.ids, n, host_ids.data(), "sampled ids (copy to host)");
  kc::ChosenLogprobParams cp;
  cp.rows = static_cast<int64_t>(n);
  cp.cols = head_.vocab;
  cp.count = static_cast<int64_t>(m);
  cp.logits = head_.logits;
  cp.row_params = row_params;
  cp.ids = sp.ids;
  cp.normaliser = reinterpret_cast<const double*>(base + o_normaliser);
  cp.adjustments = ap.adjustments;
  cp.original = ap.original;
  cp.chosen = reinterpret_cast<float*>(base + o_chosen);
  cp.stream = stream_;
  if (!failed()) check_cuda(kc::run_chosen_logprobs(cp), "sampling (the drawn tokens' logprobs)");
  if (!failed()) {
    check_cuda(cudaMemcpyAsync(pinned + o_ids, base + o_ids, o_back_end - o_ids, cudaMemcpyDeviceToHost, stream_),
               "sampled ids and logprobs (copy to host)");
  }
  if (Status s = synchronize(); !s.ok()) return s;
  std::memcpy(host_ids.data(), pinned + o_ids, n * 4);
  const auto* chosen = reinterpret_cast<const float*>(pinned + o_chosen);
  const auto* top_ids = reinterpret_cast<const int32_t*>(pinned + o_top_ids);
  const auto* top_logprobs = reinterpret_cast<const float*>(pinned + o_top_logprobs);
  sampled_logprobs_.assign(n, SampledLogprobs{});
  for (size_t r = 0; r < n; ++r) {
    SampledLogprobs& out = sampled_logprobs_[r];
    if (rows[r].logprobs < 0) {
      out.logprob = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    out.logprob = chosen[r];
    for (size_t j = 0; j < static_cast<size_t>(rows[r].logprobs); ++j) {
      if (top_ids[r * kTop + j] < 0) break;
      out.top.emplace_back(top_ids[r * kTop + j], top_logprobs[r * kTop + j]);
    }
  }
  return Status();
}

Status CudaBackend::read_dspark_greedy_chains(const DsparkHeadsOnDevice& heads, const Tensor& h, int32_t gamma,
                                              std::span<const int32_t> previous, std::span<const int32_t> lengths,
                                              std::vector<int32_t>& drafts, std::vector<double>& confidences) {
  BACKEND_CHECK(!capturing_, "read_dspark_greedy_chains inside run_graph's ops");
  BACKEND_CHECK(head_.computed && !head_.greedy,
                "read_dspark_greedy_chains without compute_logits (not greedy) for this step");
  const int64_t chains = static_cast<int64_t>(previous.size()), rows = chains * gamma;
  BACKEND_CHECK(gamma > 0 && lengths.size() == previous.size() && chains <= kMaxDeviceDsparkChains &&
                    head_.rows == rows &&
                    head_.vocab == heads.draft_vocab && h.dtype == DType::kBF16 && h.rows >= rows &&
                    h.cols == heads.hidden && heads.rank > 0 && heads.rank <= kc::kDsparkMaxRank,
                "read_dspark_greedy_chains: " + std::to_string(chains) + " chains of " + std::to_string(gamma) +
                    " rows over " + std::to_string(head_.rows) + " logits rows of " + std::to_string(head_.vocab) +
                    " columns (draft vocabulary " + std::to_string(heads.draft_vocab) + "), h " + dims(h) +
                    ", rank " + std::to_string(heads.rank));
  BACKEND_CHECK(heads.w1.bytes >= static_cast<size_t>(heads.vocab * heads.rank) * 4 &&
                    heads.w2_rows.bytes >= static_cast<size_t>(heads.draft_vocab * heads.rank) * 4 &&
                    heads.confidence.bytes >= static_cast<size_t>(heads.hidden + heads.rank) * 4 &&
                    (heads.w2_norm.bytes == 0 || heads.w2_norm.bytes >= static_cast<size_t>(heads.draft_vocab) * 4) &&
                    (heads.active.bytes == 0 || heads.active.bytes >= static_cast<size_t>(heads.draft_vocab) * 4),
                "read_dspark_greedy_chains: the heads' device weights are smaller than their shapes");
  for (size_t c = 0; c < previous.size(); ++c) {
    BACKEND_CHECK(previous[c] >= 0 && previous[c] < heads.vocab && lengths[c] >= 0 && lengths[c] <= gamma,
                  "read_dspark_greedy_chains: chain " + std::to_string(c) + " after id " +
                      std::to_string(previous[c]) + " with " + std::to_string(lengths[c]) + " rows");
  }
  activate();
  drafts.assign(static_cast<size_t>(rows), 0);
  confidences.assign(static_cast<size_t>(rows), 0.0);
  if (rows == 0 || head_.logits == nullptr || failed()) return synchronize();
  const size_t n = static_cast<size_t>(chains), r = static_cast<size_t>(rows);
  ScratchLayout l;
  const size_t o_previous = l.add(n * 4);
  const size_t o_lengths = l.add(n * 4);
  const size_t o_drafts = l.add(r * 4);
  const size_t o_confidences = l.add(r * 8);
  const size_t o_back_end = l.bytes;
  const size_t o_kernel = l.add(kc::dspark_greedy_scratch_bytes(chains, gamma, heads.draft_vocab));
  char* base = reserve(dspark_, l.bytes);
  if (base == nullptr) return synchronize();
  // In through the pinned buffer (its first bytes), out through it too (after them): no copy of it is in flight.
  auto* pinned = static_cast<char*>(pinned_host(2 * o_back_end));
  if (pinned == nullptr) return synchronize();
  std::memcpy(pinned + o_previous, previous.data(), n * 4);
  std::memcpy(pinned + o_lengths, lengths.data(), n * 4);
  check_cuda(cudaMemcpyAsync(base, pinned, o_drafts, cudaMemcpyHostToDevice, stream_), "DSpark heads (inputs)");
  kc::DsparkGreedyParams p;
  p.chains = chains;
  p.gamma = gamma;
  p.n = heads.draft_vocab;
  p.vocab = heads.vocab;
  p.rank = static_cast<int32_t>(heads.rank);
  p.hidden = static_cast<int32_t>(heads.hidden);
  p.logits = head_.logits;
  p.h = static_cast<const uint16_t*>(h.data);
  p.h_stride = h.stride;
  p.w1 = static_cast<const float*>(heads.w1.data());
  p.w2_rows = static_cast<const float*>(heads.w2_rows.data());
  p.w2_norm = heads.w2_norm.bytes > 0 ? static_cast<const float*>(heads.w2_norm.data()) : nullptr;
  p.w2_norm_max = heads.w2_norm_max;
  p.confidence = static_cast<const float*>(heads.confidence.data());
  p.active = heads.active.bytes > 0 ? static_cast<const int32_t*>(heads.active.data()) : nullptr;
  p.outside = heads.outside;
  p.previous = reinterpret_cast<const int32_t*>(base + o_previous);
  p.lengths = reinterpret_cast<const int32_t*>(base + o_lengths);
  p.drafts = reinterpret_cast<int32_t*>(base + o_drafts);
  p.confidences = reinterpret_cast<double*>(base + o_confidences);
  p.scratch = base + o_kernel;
  p.stream = stream_;
  if (!failed()) check_cuda(cudaMemsetAsync(base + o_drafts, 0, o_back_end - o_drafts, stream_), "DSpark heads");
  if (!failed()) check_cuda(kc::run_dspark_greedy_chains(p), "DSpark heads (kernels)");
  if (failed()) return synchronize();
  char* back = pinned + o_back_end;
  check_cuda(cudaMemcpyAsync(back, base + o_drafts, o_back_end - o_drafts, cudaMemcpyDeviceToHost, stream_),
             "DSpark heads (copy to host)");
  if (Status s = synchronize(); !s.ok()) return s;
  std::memcpy(drafts.data(), back, r * 4);
  std::memcpy(confidences.data(), back + (o_confidences - o_drafts), r * 8);
  return Status();
}

Status CudaBackend::read_sampled_logprobs(std::vector<SampledLogprobs>& out) {
  out = sampled_logprobs_;
  return Status();
}

}  // namespace deepinfer::backend::cuda
