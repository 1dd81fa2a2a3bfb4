// The CUDA backend's per-row ops: RMSNorm (with the fused residual add), SiLU·mul, rope, add, copy, fill_zero.
// The fused kernels (kernels/cuda/fused_ops.cu) take one row stride per call and contiguous SiLU operands; views
// that differ go through a copy first, so every Tensor the interface allows works.
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/core/types.h"
#include "deepinfer/kernels/cuda/backend_ops.h"
#include "deepinfer/kernels/cuda/fused_ops.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

kc::DType kernel_dtype(DType d) { return d == DType::kF32 ? kc::DType::kF32 : kc::DType::kBF16; }

std::string dims(const Tensor& t) { return "[" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "]"; }

void check_bf16(const Tensor& t, const char* what) {
  BACKEND_CHECK(t.dtype == DType::kBF16 && t.stride >= t.cols, std::string(what) + ": bf16 views only");
}

}  // namespace

// The f32 copy sits at offset 0, so a longer vector serves too; the bf16 copy's offset depends on the exact length.
const float* vector_f32(const Buffer& vector, int64_t n, const char* what) {
  BACKEND_CHECK(vector.bytes >= vector_bytes(n), std::string(what) + ": a vector of " + std::to_string(vector.bytes) +
                                                     " bytes is not make_vector of " + std::to_string(n) + " values");
  return static_cast<const float*>(vector.data());
}

const uint16_t* vector_bf16(const Buffer& vector, int64_t n, const char* what) {
  BACKEND_CHECK(vector.bytes == vector_bytes(n), std::string(what) + ": a vector of " + std::to_string(vector.bytes) +
                                                     " bytes is not make_vector of " + std::to_string(n) + " values");
  return reinterpret_cast<const uint16_t*>(static_cast<const char*>(vector.data()) + vector_bf16_offset(n));
}

void CudaBackend::rms_norm_same_stride(const Tensor& x, const uint16_t* weight, float eps, Tensor y,
                                       uint16_t* residual) {
  if (failed() || x.rows == 0) return;
  kc::RmsNormParams p;
  p.dtype = kc::DType::kBF16;
  p.rows = x.rows;
  p.dim = x.cols;
  p.stride = x.stride;
  p.eps = eps;
  p.x = x.data;
  p.weight = weight;
  p.residual = residual;
  p.y = y.data;
  p.stream = stream_;
  check_cuda(kc::run_rms_norm(p), "rms_norm");
}

void CudaBackend::rms_norm(const Tensor& x, const Buffer& weight, float eps, Tensor y) {
  check_bf16(x, "rms_norm");
  check_bf16(y, "rms_norm");
  BACKEND_CHECK(x.rows == y.rows && x.cols == y.cols, "rms_norm: x " + dims(x) + ", y " + dims(y));
  const uint16_t* w = vector_bf16(weight, x.cols, "rms_norm");
  if (x.stride == y.stride) {
    rms_norm_same_stride(x, w, eps, y, nullptr);
  } else {
    copy(x, y);  // then normalize in place: the kernel allows y == x
    rms_norm_same_stride(y, w, eps, y, nullptr);
  }
}

void CudaBackend::add_rms_norm(Tensor residual, const Tensor& delta, const Buffer& weight, float eps, Tensor y) {
  check_bf16(residual, "add_rms_norm");
  check_bf16(delta, "add_rms_norm");
  check_bf16(y, "add_rms_norm");
  BACKEND_CHECK(
      residual.rows == delta.rows && residual.cols == delta.cols && residual.rows == y.rows && residual.cols == y.cols,
      "add_rms_norm: residual " + dims(residual) + ", delta " + dims(delta) + ", y " + dims(y));
  const uint16_t* w = vector_bf16(weight, residual.cols, "add_rms_norm");
  if (residual.stride == delta.stride && residual.stride == y.stride) {
    // The fused kernel: residual = delta + residual (rounded to bf16 once), y = rms_norm(residual as stored).
    rms_norm_same_stride(delta, w, eps, y, static_cast<uint16_t*>(residual.data));
  } else {
    add(residual, delta);  // the same arithmetic in two launches
    rms_norm(residual, weight, eps, y);
  }
}

void CudaBackend::add(Tensor x, const Tensor& delta) {
  check_bf16(x, "add");
  check_bf16(delta, "add");
  BACKEND_CHECK(x.rows == delta.rows && x.cols == delta.cols, "add: x " + dims(x) + ", delta " + dims(delta));
  if (failed() || x.rows == 0) return;
  kc::Add2dParams p;
  p.rows = x.rows;
  p.cols = x.cols;
  p.x = static_cast<uint16_t*>(x.data);
  p.x_stride = x.stride;
  p.delta = static_cast<const uint16_t*>(delta.data);
  p.delta_stride = delta.stride;
  p.stream = stream_;
  check_cuda(kc::run_add_2d(p), "add");
}

void CudaBackend::fill_zero(Tensor x) {
  BACKEND_CHECK(x.stride >= x.cols, "fill_zero: stride below cols");
  if (failed() || x.rows == 0 || x.cols == 0) return;
  const size_t element = dtype_size(x.dtype);
  check_cuda(cudaMemset2DAsync(x.data, static_cast<size_t>(x.stride) * element, 0,
                               static_cast<size_t>(x.cols) * element, static_cast<size_t>(x.rows), stream_),
             "fill_zero (cudaMemset2DAsync)");
}

void CudaBackend::copy(const Tensor& src, Tensor dst) {
  BACKEND_CHECK(src.rows == dst.rows && src.cols == dst.cols && src.stride >= src.cols && dst.stride >= dst.cols,
                "copy: src " + dims(src) + ", dst " + dims(dst));
  if (failed() || src.rows == 0) return;
  kc::Convert2dParams p;
  p.rows = src.rows;
  p.src_cols = p.dst_cols = src.cols;
  p.src_dtype = kernel_dtype(src.dtype);
  p.dst_dtype = kernel_dtype(dst.dtype);
  p.src = src.data;
  p.src_stride = src.stride;
  p.dst = dst.data;
  p.dst_stride = dst.stride;
  p.stream = stream_;
  check_cuda(kc::run_convert_2d(p), "copy");
}

void CudaBackend::silu_mul(const Tensor& gate_up, Tensor out) {
  check_bf16(gate_up, "silu_mul");
  check_bf16(out, "silu_mul");
  const int64_t n = out.cols, rows = out.rows;
  BACKEND_CHECK(gate_up.rows == rows && gate_up.cols == 2 * n,
                "silu_mul: gate_up " + dims(gate_up) + ", out " + dims(out));
  if (failed() || rows == 0) return;
  // The kernel reads gate_up [rows, 2n] and writes out [rows, n] contiguously.
  const bool direct_in = gate_up.stride == 2 * n, direct_out = out.stride == n;
  ScratchLayout l;
  const size_t o_in = direct_in ? 0 : l.add(static_cast<size_t>(rows * 2 * n) * 2);
  const size_t o_out = direct_out ? 0 : l.add(static_cast<size_t>(rows * n) * 2);
  char* base = nullptr;
  if (l.bytes > 0 && (base = reserve(rowwise_, l.bytes)) == nullptr) return;
  Tensor in = gate_up, result = out;
  if (!direct_in) {
    in = Tensor{base + o_in, DType::kBF16, rows, 2 * n, 2 * n};
    copy(gate_up, in);
  }
  if (!direct_out) result = Tensor{base + o_out, DType::kBF16, rows, n, n};
  kc::SiluMulParams p;
  p.dtype = kc::DType::kBF16;
  p.rows = rows;
  p.n = n;
  p.gate_up = in.data;
  p.out = result.data;
  p.stream = stream_;
  check_cuda(kc::run_silu_mul(p), "silu_mul");
  if (!direct_out) copy(result, out);
}

void CudaBackend::rope(Tensor x, int64_t vectors_per_position, const Buffer& inv_freq, float attention_factor) {
  check_bf16(x, "rope");
  BACKEND_CHECK(x.cols % 2 == 0 && x.cols <= 256, "rope: rope dim " + std::to_string(x.cols) + " (even, <= 256)");
  BACKEND_CHECK(vectors_per_position >= 1 && (x.rows + vectors_per_position - 1) / vectors_per_position <= step_.rows,
                "rope: " + std::to_string(x.rows) + " vectors at " + std::to_string(vectors_per_position) +
                    " per position, for a step of " + std::to_string(step_.rows) + " rows");
  const float* freq = vector_f32(inv_freq, x.cols / 2, "rope (inv_freq)");
  if (failed() || x.rows == 0) return;
  kc::RopeParams p;
  p.dtype = kc::DType::kBF16;
  p.rows = x.rows;
  p.dim = x.cols;
  p.stride = x.stride;
  p.vectors_per_position = vectors_per_position;
  p.x = x.data;
  p.positions = step_.positions_device;
  p.inv_freq = freq;
  p.attention_factor = attention_factor;
  p.stream = stream_;
  check_cuda(kc::run_rope(p), "rope");
}

// One kernel where the operands allow it (run_mla_prepare's REQUIRES), else the base version's five ops.
// DEEPINFER_FUSED_MLA_PREPARE: 0 always the five ops; "require" the kernel or an error (the GPU checks set it, so
// that their comparison with the five ops cannot pass by falling back); unset or else: the kernel where it can.
void CudaBackend::mla_prepare(Tensor kv, int64_t latent, const Buffer& norm_weight, float eps, Tensor q_rope,
                              int64_t heads, const Buffer& inv_freq, float attention_factor, const Buffer& cache_layer,
                              Tensor q_rope_copy) {
  static const std::string mode = [] {
    const char* env = std::getenv("DEEPINFER_FUSED_MLA_PREPARE");
    return std::string(env == nullptr ? "" : env);
  }();
  const int64_t R = kv.cols - latent, entry_bytes = kv.cols * 2;
  const bool copy = q_rope_copy.rows > 0;
  kc::MlaPrepareParams p;
  p.tokens = kv.rows;
  p.latent = latent;
  p.rope_dim = R;
  p.heads = heads;
  p.kv = static_cast<uint16_t*>(kv.data);
  p.kv_stride = kv.stride;
  p.eps = eps;
  p.q = static_cast<uint16_t*>(q_rope.data);
  p.q_stride = q_rope.stride;
  p.q_copy = copy ? static_cast<uint16_t*>(q_rope_copy.data) : nullptr;
  p.q_copy_stride = q_rope_copy.stride;
  p.positions = step_.positions_device;
  p.attention_factor = attention_factor;
  p.slots = step_.slots_device;
  p.cache = static_cast<uint16_t*>(cache_layer.data());
  p.stream = stream_;
  if (latent > 0 && R > 0) {  // the five ops check the same sizes
    p.norm_weight = vector_bf16(norm_weight, latent, "mla_prepare (norm weight)");
    p.inv_freq = vector_f32(inv_freq, R / 2, "mla_prepare (inv_freq)");
  }
  const bool takes = kv.dtype == DType::kBF16 && q_rope.dtype == DType::kBF16 && R > 0 && q_rope.cols == R &&
                     (!copy || (q_rope_copy.dtype == DType::kBF16 && q_rope_copy.cols == R &&
                                q_rope_copy.rows == q_rope.rows)) &&
                     kc::mla_prepare_takes(p);
  if (mode == "0" || (!takes && mode != "require")) {
    Backend::mla_prepare(kv, latent, norm_weight, eps, q_rope, heads, inv_freq, attention_factor, cache_layer,
                         q_rope_copy);
    return;
  }
  BACKEND_CHECK(takes, "mla_prepare: DEEPINFER_FUSED_MLA_PREPARE=require, but the kernel does not take these operands "
                       "(kv " + dims(kv) + ", latent " + std::to_string(latent) + ", q_rope " + dims(q_rope) + ")");
  BACKEND_CHECK(kv.rows == step_.rows && q_rope.rows == kv.rows * heads &&
                    cache_layer.bytes % static_cast<size_t>(entry_bytes * ::deepinfer::kBlockTokens) == 0,
                "mla_prepare: kv " + dims(kv) + " for a step of " + std::to_string(step_.rows) + " rows, q_rope " +
                    dims(q_rope) + " at " + std::to_string(heads) + " heads, a cache layer of " +
                    std::to_string(cache_layer.bytes) + " bytes");
  p.num_slots = static_cast<int64_t>(cache_layer.bytes / static_cast<size_t>(entry_bytes));
  if (failed() || kv.rows == 0) return;
  check_cuda(kc::run_mla_prepare(p), "mla_prepare");
}

}  // namespace deepinfer::backend::cuda
