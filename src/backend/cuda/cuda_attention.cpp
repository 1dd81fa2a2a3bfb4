// MLA attention on the CUDA backend. Absorbed form: run_mla_decode (tensor cores, split-KV) for DeepSeek's shapes
// (C = 512, R = 64, H % 16 == 0) — a pure decode step directly, any other step (prefill chunks over a cached
// prefix, decode rows beside them) with one batch entry per query row — and the generic kernel (mla_generic.h,
// CUDA cores) for other shapes. Expanded form:
// the kv_b GEMM, the k/v layout kernel, then run_mla_prefill (qk 192 / v 128).
#include <cstdint>
#include <string>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/backend_ops.h"
#include "deepinfer/core/types.h"
#include "deepinfer/kernels/cuda/mla_decode.h"
#include "deepinfer/kernels/cuda/mla_generic.h"
#include "deepinfer/kernels/cuda/mla_prefill.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

constexpr int64_t kBlockTokens = ::deepinfer::kBlockTokens;  // core/types.h

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string dims(const Tensor& t) { return "[" + std::to_string(t.rows) + ", " + std::to_string(t.cols) + "]"; }

}  // namespace

void CudaBackend::mla_attention(const MlaAttention& a, const Tensor& q, const Buffer& cache_layer, Tensor out) {
  const int64_t H = a.num_heads, C = a.kv_lora_rank, R = a.rope_dim, D = C + R, T = step_.rows;
  BACKEND_CHECK(q.dtype == DType::kBF16 && out.dtype == DType::kBF16, "mla_attention: bf16 views only");
  BACKEND_CHECK(q.rows == T && out.rows == T && q.cols == H * D && out.cols == H * C,
                "mla_attention: q " + dims(q) + ", out " + dims(out) + " for " + std::to_string(T) + " rows, " +
                    std::to_string(H) + " heads, C " + std::to_string(C) + ", R " + std::to_string(R));
  BACKEND_CHECK(C > 0 && R >= 0 && D <= 1024 && H >= 1 && H <= 65535,
                "mla_attention: C + R <= 1024 and 1 <= H <= 65535 (the generic kernel's limits)");
  BACKEND_CHECK(cache_layer.bytes % static_cast<size_t>(kBlockTokens * D * 2) == 0,
                "mla_attention: the cache layer is not whole blocks of bf16 [64, " + std::to_string(D) + "]");
  if (failed() || T == 0) return;
  const bool decode_kernel = C == kc::kMlaLatentDim && R == kc::kMlaRopeDim && H % 16 == 0 && T <= 65535 &&
                             q.stride == H * D && out.stride == H * C && aligned16(q.data) && aligned16(out.data);
  if (decode_kernel) {
    // The kernel reads block tables by batch entry: a step with several rows per sequence gets one table per row
    // (a copy of its sequence's) and each row its own context (position + 1, so the rows stay causal). The
    // absorbed form costs (C + R + C) / (192 + 128) = 3.4x the expanded form's FLOPs per (row, key), but on tensor
    // cores instead of the generic kernel's CUDA cores (~30x fewer FLOP/s); bench_model's "chunk" line measures it.
    const int32_t* tables = step_.block_table_device;  // in row order on a one-row-per-sequence step
    if (!step_.one_row_per_sequence) {
      auto* row_tables = reinterpret_cast<int32_t*>(
          reserve(attention_tables_, static_cast<size_t>(T * step_.max_blocks) * sizeof(int32_t)));
      if (row_tables == nullptr) return;
      kc::RowBlockTablesParams rt;
      rt.rows = T;
      rt.max_blocks = step_.max_blocks;
      rt.table_rows = step_.table_rows;
      rt.row_table = step_.row_table_device;
      rt.block_table = step_.block_table_device;
      rt.row_tables = row_tables;
      rt.stream = stream_;
      check_cuda(kc::run_row_block_tables(rt), "mla_attention (per-row block tables)");
      tables = row_tables;
    }
    kc::MlaDecodeParams p;
    p.batch = static_cast<int>(T);
    p.num_heads = static_cast<int>(H);
    p.max_blocks_per_seq = static_cast<int>(step_.max_blocks);
    p.scale = a.scale;
    p.q = static_cast<const uint16_t*>(q.data);
    p.kv_cache = static_cast<const uint16_t*>(cache_layer.data());
    p.block_table = tables;
    p.context_lens = step_.row_context_device;
    p.out = static_cast<uint16_t*>(out.data);
    // From the table's stride, not the rows' contexts: a graph replays this launch for every step of its key.
    // Splits past a row's pages are empty (the kernel writes lse -inf for them); a padded stride costs a little
    // combine work, never a wrong result.
    p.num_splits = kc::mla_decode_num_splits(p.batch, p.num_heads, static_cast<int>(step_.max_blocks * kBlockTokens),
                                             num_sms_);
    const size_t floats = kc::mla_decode_workspace_floats(p.batch, p.num_heads, p.num_splits);
    if (floats > 0) {
      p.workspace = reinterpret_cast<float*>(reserve(attention_, floats * sizeof(float)));
      if (p.workspace == nullptr) return;
    }
    p.stream = stream_;
    check_cuda(kc::run_mla_decode(p), "mla_attention (run_mla_decode)");
    return;
  }
  kc::MlaGenericParams p;
  p.rows = T;
  p.num_heads = H;
  p.kv_lora_rank = C;
  p.rope_dim = R;
  p.scale = a.scale;
  p.q = static_cast<const uint16_t*>(q.data);
  p.q_stride = q.stride;
  p.cache = static_cast<const uint16_t*>(cache_layer.data());
  p.num_slots = static_cast<int64_t>(cache_layer.bytes / static_cast<size_t>(D * 2));
  p.block_table = step_.block_table_device;
  p.max_blocks = step_.max_blocks;
  p.row_table = step_.row_table_device;
  p.row_context = step_.row_context_device;
  p.out = static_cast<uint16_t*>(out.data);
  p.out_stride = out.stride;
  p.stream = stream_;
  check_cuda(kc::run_mla_generic(p), "mla_attention (run_mla_generic)");
}

bool CudaBackend::has_mla_expanded(const MlaExpanded& a) const {
  return a.nope_dim + a.rope_dim == kc::kMlaPrefillQkDim && a.v_dim == kc::kMlaPrefillVDim && a.num_heads >= 1 &&
         a.num_heads <= 65535;
}

void CudaBackend::mla_expanded(const MlaExpanded& a, const Tensor& q, const Tensor& kv, Tensor out) {
  const int64_t H = a.num_heads, C = a.kv_lora_rank, R = a.rope_dim, nope = a.nope_dim, V = a.v_dim;
  const int64_t T = step_.rows, qk = nope + R;
  BACKEND_CHECK(has_mla_expanded(a), "mla_expanded: needs nope + rope == 192 and v == 128 (run_mla_prefill)");
  BACKEND_CHECK(step_.rows_start_at_zero, "mla_expanded: the step's layout must set rows_start_at_zero");
  BACKEND_CHECK(q.dtype == DType::kBF16 && kv.dtype == DType::kBF16 && out.dtype == DType::kBF16,
                "mla_expanded: bf16 views only");
  BACKEND_CHECK(
      q.rows == T && kv.rows == T && out.rows == T && q.cols == H * qk && kv.cols == C + R && out.cols == H * V,
      "mla_expanded: q " + dims(q) + ", kv " + dims(kv) + ", out " + dims(out) + " for " + std::to_string(T) +
          " rows, " + std::to_string(H) + " heads");
  BACKEND_CHECK(
      a.kv_b != nullptr && a.kv_b->count == 1 && a.kv_b->rows == H * (nope + V) && a.kv_b->cols == C,
      "mla_expanded: kv_b must be one [" + std::to_string(H * (nope + V)) + ", " + std::to_string(C) + "] matrix");
  if (failed() || T == 0) return;
  // run_mla_prefill reads q, k, v and writes out as contiguous [T, H, dim] with 16-byte rows (cp.async).
  const bool direct_q = q.stride == H * qk && aligned16(q.data);
  const bool direct_out = out.stride == H * V && aligned16(out.data);
  ScratchLayout l;
  const size_t o_kvb = l.add(static_cast<size_t>(T * H * (nope + V)) * 2);
  const size_t o_k = l.add(static_cast<size_t>(T * H * qk) * 2);
  const size_t o_v = l.add(static_cast<size_t>(T * H * V) * 2);
  const size_t o_q = direct_q ? 0 : l.add(static_cast<size_t>(T * H * qk) * 2);
  const size_t o_out = direct_out ? 0 : l.add(static_cast<size_t>(T * H * V) * 2);
  char* base = reserve(attention_, l.bytes);
  if (base == nullptr) return;

  const Tensor kvb{base + o_kvb, DType::kBF16, T, H * (nope + V), H * (nope + V)};
  linear_matrix(kv.cols_slice(0, C), matrix_of(*a.kv_b, 0), kvb);
  kc::MlaExpandKvParams e;
  e.rows = T;
  e.num_heads = H;
  e.nope_dim = nope;
  e.rope_dim = R;
  e.v_dim = V;
  e.kvb = static_cast<const uint16_t*>(kvb.data);
  e.kvb_stride = kvb.stride;
  e.k_rope = static_cast<const uint16_t*>(kv.cols_slice(C, R).data);
  e.k_rope_stride = kv.stride;
  e.k = reinterpret_cast<uint16_t*>(base + o_k);
  e.v = reinterpret_cast<uint16_t*>(base + o_v);
  e.stream = stream_;
  check_cuda(kc::run_mla_expand_kv(e), "mla_expanded (k/v layout)");

  Tensor q_in = q, out_direct = out;
  if (!direct_q) {
    q_in = Tensor{base + o_q, DType::kBF16, T, H * qk, H * qk};
    copy(q, q_in);
  }
  if (!direct_out) out_direct = Tensor{base + o_out, DType::kBF16, T, H * V, H * V};
  kc::MlaPrefillParams p;
  p.num_seqs = step_.num_groups;
  p.num_heads = static_cast<int>(H);
  p.max_seqlen = step_.max_group_rows;
  p.scale = a.scale;
  p.cu_seqlens = step_.cu_seqlens_device;
  p.q = static_cast<const uint16_t*>(q_in.data);
  p.k = e.k;
  p.v = e.v;
  p.out = static_cast<uint16_t*>(out_direct.data);
  p.stream = stream_;
  BACKEND_CHECK(p.num_seqs <= 65535, "mla_expanded: " + std::to_string(p.num_seqs) + " sequences (at most 65535)");
  check_cuda(kc::run_mla_prefill(p), "mla_expanded (run_mla_prefill)");
  if (!direct_out) copy(out_direct, out);
}

}  // namespace deepinfer::backend::cuda
