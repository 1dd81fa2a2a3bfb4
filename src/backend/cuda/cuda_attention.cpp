// MLA attention on the CUDA backend. Absorbed form: run_mla_decode (tensor cores, split-KV) for DeepSeek's shapes
// (C = 512, R = 64, H % 16 == 0) — a pure decode step directly, any other step (prefill chunks over a cached
// prefix, decode rows beside them) with one batch entry per query row — and the generic kernel (mla_generic.h,
// CUDA cores) for other shapes. Expanded form (prefill from 0, and chunks over a cached prefix when
// mla_expanded_pays): the kv_b GEMM over the keys' latents (gathered from the cache in chunks of key positions), then
// run_mla_prefill reading its output in place (qk 192 / v 128), chunks merged by log-sum-exp.
#include <algorithm>
#include <cmath>
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
                                             num_sms_, mla_split_min_pages_);
    p.combine_loads = mla_combine_loads_;
    if (batch_invariant_) {  // splits at fixed pages: a row's sums whatever the batch (cuda_backend.h)
      p.split_pages = kc::kMlaInvariantSplitPages;
      p.num_splits = kc::mla_decode_invariant_splits(static_cast<int>(step_.max_blocks * kBlockTokens));
    }
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
  // Batch-invariant mode: every row through the absorbed kernels, so that a row's result is the same as a decode
  // row, inside a chunk or a prefill from 0, with or without a cached prefix (cuda_backend.h).
  if (batch_invariant_) return false;
  return a.nope_dim + a.rope_dim == kc::kMlaPrefillQkDim && a.rope_dim == kc::kMlaRopeDim &&
         a.v_dim == kc::kMlaPrefillVDim && a.kv_lora_rank % 8 == 0 && a.num_heads >= 1 && a.num_heads <= 65535;
}

namespace {

// The cost model of mla_expanded_pays, at rates measured on the H200 (bench/gpu/NOTES.md): the absorbed decode
// kernel with one batch entry per query row reaches ~117 TFLOPS at 16 heads (bench_model's 512-token chunk) and
// ~229 at 128 (V3's chunk); the expanded prefill kernel ~250 TFLOPS when its (64-row tile, head) CTAs fill two per
// SM, proportionally less below; cuBLAS bf16 GEMMs of a few thousand rows ~600; device copies ~3.5 TB/s; a chunk
// of context (gather, GEMM, attention) ~15 us of launches. Only the ratio of the two estimates matters.
constexpr double kAbsorbedTflopsAt16 = 117.0, kAbsorbedTflopsAt128 = 229.0, kPrefillTflops = 250.0,
                 kGemmTflops = 600.0, kCopyBytesPerUs = 3.5e6, kChunkOverheadUs = 15.0;
// Device memory one context chunk may take (packed latents, kv_b output): bounds the keys per chunk.
constexpr int64_t kChunkWorkspaceBytes = int64_t{512} << 20;
// The expanded kernel's key-split partials (f32 rows and log-sum-exps per split): V2-Lite's 3,080-row chunk at 16
// heads takes 25 MB a split, so 3 splits.
constexpr int64_t kSplitWorkspaceBytes = int64_t{96} << 20;

int64_t chunk_keys(int64_t heads, int64_t latent_dim, int64_t kvb_dim, int64_t groups) {
  const int64_t per_key = (latent_dim + heads * kvb_dim) * 2;
  const int64_t keys = kChunkWorkspaceBytes / per_key / std::max<int64_t>(groups, 1);
  return std::max<int64_t>(kBlockTokens, keys / kBlockTokens * kBlockTokens);
}

}  // namespace

int64_t CudaBackend::context_chunk(const MlaExpanded& a) const {
  if (mla_context_chunk_ > 0) return mla_context_chunk_;
  return chunk_keys(a.num_heads, a.kv_lora_rank + a.rope_dim, a.nope_dim + a.v_dim, step_.num_groups);
}

bool CudaBackend::mla_expanded_pays(const MlaExpanded& a) const {
  if (!has_mla_expanded(a) || !step_.grouped || step_.rows == 0) return false;
  if (step_.rows_start_at_zero || mla_form_ == MlaForm::kExpanded) return true;
  if (mla_form_ == MlaForm::kAbsorbed) return false;
  const double H = static_cast<double>(a.num_heads), C = static_cast<double>(a.kv_lora_rank),
               R = static_cast<double>(a.rope_dim), nope = static_cast<double>(a.nope_dim),
               V = static_cast<double>(a.v_dim);
  double pairs = 0.0, keys = 0.0, tiles = 0.0, context = 0.0;
  for (size_t g = 0; g < step_.group_rows.size(); ++g) {
    const double rows = step_.group_rows[g], ctx = step_.group_contexts[g];
    pairs += rows * ctx - rows * (rows - 1.0) / 2.0;  // row i of the group sees ctx - rows + 1 + i keys
    keys += ctx;
    tiles += std::ceil(rows / 64.0);
    context = std::max(context, ctx);
  }
  const double T = static_cast<double>(step_.rows);
  const double at = std::clamp((H - 16.0) / 112.0, 0.0, 1.0);
  const double absorbed_tflops = kAbsorbedTflopsAt16 + at * (kAbsorbedTflopsAt128 - kAbsorbedTflopsAt16);
  // Absorbed: the pairs over 2C + R dims (scores) and C (values), and the per-head w_uk / w_uv GEMMs of the rows.
  const double absorbed_us = pairs * H * 2.0 * (2.0 * C + R) / (absorbed_tflops * 1e6) +
                             T * H * 4.0 * nope * C / (kGemmTflops * 1e6);
  const double fill = std::min(1.0, tiles * H / (2.0 * std::max(num_sms_, 1)));
  const double chunks =
      std::ceil(context / static_cast<double>(context_chunk(a)));
  // Expanded: every visible key up-projected once (and its latent gathered, kv_b's output written and read), the
  // pairs over nope + R (scores) and V (values).
  const double expanded_us = keys * H * 2.0 * C * (nope + V) / (kGemmTflops * 1e6) +
                             keys * (2.0 * (C + R) * 2.0 + H * (nope + V) * 2.0 * 2.0) / kCopyBytesPerUs +
                             pairs * H * 2.0 * (nope + R + V) / (kPrefillTflops * fill * 1e6) +
                             chunks * kChunkOverheadUs;
  return expanded_us < absorbed_us;
}

void CudaBackend::mla_expanded(const MlaExpanded& a, const Tensor& q, const Tensor& kv, const Buffer& cache_layer,
                               Tensor out) {
  const int64_t H = a.num_heads, C = a.kv_lora_rank, R = a.rope_dim, nope = a.nope_dim, V = a.v_dim;
  const int64_t T = step_.rows, qk = nope + R, D = C + R, kvb_cols = H * (nope + V);
  BACKEND_CHECK(has_mla_expanded(a), "mla_expanded: needs nope + rope == 192, rope 64 and v == 128 (run_mla_prefill)");
  BACKEND_CHECK(step_.grouped, "mla_expanded: the step's rows of each sequence must be consecutive positions");
  BACKEND_CHECK(q.dtype == DType::kBF16 && kv.dtype == DType::kBF16 && out.dtype == DType::kBF16,
                "mla_expanded: bf16 views only");
  BACKEND_CHECK(q.rows == T && kv.rows == T && out.rows == T && q.cols == H * qk && kv.cols == D && out.cols == H * V,
                "mla_expanded: q " + dims(q) + ", kv " + dims(kv) + ", out " + dims(out) + " for " +
                    std::to_string(T) + " rows, " + std::to_string(H) + " heads");
  BACKEND_CHECK(a.kv_b != nullptr && a.kv_b->count == 1 && a.kv_b->rows == kvb_cols && a.kv_b->cols == C,
                "mla_expanded: kv_b must be one [" + std::to_string(kvb_cols) + ", " + std::to_string(C) + "] matrix");
  BACKEND_CHECK(step_.rows_start_at_zero || cache_layer.bytes % static_cast<size_t>(kBlockTokens * D * 2) == 0,
                "mla_expanded: the cache layer is not whole blocks of bf16 [64, " + std::to_string(D) + "]");
  if (failed() || T == 0) return;
  // run_mla_prefill reads q and writes out as contiguous [T, H, dim] with 16-byte rows (cp.async); it reads the keys
  // and values where kv_b's GEMM left them ([keys, H * (nope + V)]: k_nope | v per head) and the roped key from the
  // latent rows (head stride 0).
  const bool direct_q = q.stride == H * qk && aligned16(q.data);
  const bool direct_out = out.stride == H * V && aligned16(out.data);
  const bool direct_kv = kv.stride % 8 == 0 && aligned16(kv.data);
  const int64_t chunk = step_.rows_start_at_zero ? 0 : context_chunk(a);
  int64_t max_context = 0;
  for (int32_t ctx : step_.group_contexts) max_context = std::max<int64_t>(max_context, ctx);
  const int64_t num_chunks = step_.rows_start_at_zero ? 1 : (max_context + chunk - 1) / chunk;
  // The keys of the largest chunk (host arithmetic over the groups' contexts).
  auto keys_in_chunk = [&](int64_t c) {
    if (step_.rows_start_at_zero) return T;
    int64_t n = 0;
    for (int32_t ctx : step_.group_contexts) n += std::clamp<int64_t>(ctx - c * chunk, 0, chunk);
    return n;
  };
  int64_t max_keys = 0;
  for (int64_t c = 0; c < num_chunks; ++c) max_keys = std::max(max_keys, keys_in_chunk(c));
  ScratchLayout l;
  const size_t o_kvb = l.add(static_cast<size_t>(max_keys * kvb_cols) * 2);
  const size_t o_latent = step_.rows_start_at_zero && direct_kv ? 0 : l.add(static_cast<size_t>(max_keys * D) * 2);
  const size_t o_q = direct_q ? 0 : l.add(static_cast<size_t>(T * H * qk) * 2);
  const size_t o_out = direct_out ? 0 : l.add(static_cast<size_t>(T * H * V) * 2);
  const size_t o_cu =
      step_.rows_start_at_zero ? 0 : l.add(static_cast<size_t>(num_chunks * (step_.num_groups + 1)) * 4);
  const size_t o_acc = num_chunks > 1 ? l.add(static_cast<size_t>(T * H * V) * 4) : 0;
  const size_t o_lse = num_chunks > 1 ? l.add(static_cast<size_t>(T * H) * 4) : 0;
  // The key splits' workspace (run_mla_prefill picks 1 to max_splits by waves; few heads and long keys split).
  const int64_t split_bytes = kc::mla_prefill_split_floats(T, H, 1) * 4;
  int64_t max_splits = std::min<int64_t>(4, kSplitWorkspaceBytes / std::max<int64_t>(split_bytes, 1));
  if (mla_key_splits_ > 1) max_splits = mla_key_splits_;
  if (mla_prefill_mma_ || mla_key_splits_ == 1) max_splits = 1;
  const size_t o_split_o = max_splits > 1 ? l.add(static_cast<size_t>(max_splits * T * H * V) * 4) : 0;
  const size_t o_split_lse = max_splits > 1 ? l.add(static_cast<size_t>(max_splits * T * H) * 4) : 0;
  char* base = reserve(attention_, l.bytes);
  if (base == nullptr) return;

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
  p.k_token_stride = kvb_cols;
  p.k_head_stride = nope + V;
  p.v_token_stride = kvb_cols;
  p.v_head_stride = nope + V;
  p.out = static_cast<uint16_t*>(out_direct.data);
  p.stream = stream_;
  BACKEND_CHECK(p.num_seqs <= 65535, "mla_expanded: " + std::to_string(p.num_seqs) + " sequences (at most 65535)");
  const auto* kvb_data = reinterpret_cast<const uint16_t*>(base + o_kvb);
  p.k_nope = kvb_data;
  p.v = kvb_data + nope;
  p.kernel = mla_prefill_mma_ ? kc::MlaPrefillKernel::kMma : kc::MlaPrefillKernel::kWgmma;
  p.wgmma_overlap = mla_prefill_overlap_;
  if (max_splits > 1) {
    p.key_splits = mla_key_splits_ > 1 ? mla_key_splits_ : 0;
    p.max_key_splits = static_cast<int>(max_splits);
    p.split_rows = T;
    p.split_o = reinterpret_cast<float*>(base + o_split_o);
    p.split_lse = reinterpret_cast<float*>(base + o_split_lse);
  } else {
    p.key_splits = 1;
  }
  for (int32_t rows : step_.group_rows) {  // the CTAs with work, for the kernel's choice of rows per CTA
    p.tiles_64 += (rows + 63) / 64;
    p.tiles_128 += (rows + 127) / 128;
  }

  if (step_.rows_start_at_zero) {  // the keys are the step's own rows
    Tensor latent = kv;
    if (!direct_kv) {
      latent = Tensor{base + o_latent, DType::kBF16, T, D, D};
      copy(kv, latent);
    }
    linear_matrix(latent.cols_slice(0, C), matrix_of(*a.kv_b, 0), Tensor{base + o_kvb, DType::kBF16, T, kvb_cols, kvb_cols});
    p.k_rope = static_cast<const uint16_t*>(latent.cols_slice(C, R).data);
    p.k_rope_token_stride = latent.stride;
    p.k_rope_head_stride = 0;
    check_cuda(kc::run_mla_prefill(p), "mla_expanded (run_mla_prefill)");
    if (!direct_out) copy(out_direct, out);
    return;
  }

  // Over the cache: per chunk of key positions, gather the groups' latents, up-project them, attend, merge.
  auto* cu_keys = reinterpret_cast<int32_t*>(base + o_cu);
  kc::ChunkKeyOffsetsParams ko;
  ko.groups = step_.num_groups;
  ko.chunks = num_chunks;
  ko.chunk = chunk;
  ko.contexts = step_.group_contexts_device;
  ko.cu_keys = cu_keys;
  ko.stream = stream_;
  check_cuda(kc::run_chunk_key_offsets(ko), "mla_expanded (chunk key offsets)");
  const Tensor latent{base + o_latent, DType::kBF16, max_keys, D, D};
  p.q_positions = step_.q_positions_device;
  p.k_rope = static_cast<const uint16_t*>(latent.data) + C;
  p.k_rope_token_stride = D;
  p.k_rope_head_stride = 0;
  p.o_acc = num_chunks > 1 ? reinterpret_cast<float*>(base + o_acc) : nullptr;
  p.lse_acc = num_chunks > 1 ? reinterpret_cast<float*>(base + o_lse) : nullptr;
  for (int64_t c = 0; c < num_chunks && !failed(); ++c) {
    const int64_t keys = keys_in_chunk(c);
    kc::GatherCacheRowsParams gp;
    gp.groups = step_.num_groups;
    gp.rows = keys;
    gp.dim = D;
    gp.max_blocks = step_.max_blocks;
    gp.num_slots = static_cast<int64_t>(cache_layer.bytes / static_cast<size_t>(D * 2));
    gp.key_position = c * chunk;
    gp.cu_keys = cu_keys + c * (step_.num_groups + 1);
    gp.tables = step_.group_tables_device;
    gp.block_table = step_.block_table_device;
    gp.cache = static_cast<const uint16_t*>(cache_layer.data());
    gp.out = static_cast<uint16_t*>(latent.data);
    gp.stream = stream_;
    check_cuda(kc::run_gather_cache_rows(gp), "mla_expanded (gather the context's latents)");
    if (keys > 0)
      linear_matrix(Tensor{latent.data, DType::kBF16, keys, C, D}, matrix_of(*a.kv_b, 0),
                    Tensor{base + o_kvb, DType::kBF16, keys, kvb_cols, kvb_cols});
    p.cu_seqlens_k = gp.cu_keys;
    p.key_position = static_cast<int>(c * chunk);
    p.max_seqlen_k = static_cast<int>(std::min<int64_t>(chunk, max_context));
    p.merge = num_chunks == 1            ? kc::MlaPrefillMerge::kNone
              : c == 0                   ? kc::MlaPrefillMerge::kFirst
              : c + 1 == num_chunks      ? kc::MlaPrefillMerge::kLast
                                         : kc::MlaPrefillMerge::kMiddle;
    check_cuda(kc::run_mla_prefill(p), "mla_expanded (run_mla_prefill over the context)");
  }
  if (!direct_out) copy(out_direct, out);
}

}  // namespace deepinfer::backend::cuda
