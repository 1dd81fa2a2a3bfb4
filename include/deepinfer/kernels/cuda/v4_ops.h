// DeepSeek-V4's kernels (the CUDA backend's V4 ops, backend.h "DeepSeek-V4"): the hyper-connection mix (mHC), per-row
// RMS norm with partial interleaved rotary, the compressors (pooling, their row rings), the lightning indexer's scores
// and top-k, sparse attention with sinks over a row's window and compressed entries, a list of copies, and the
// clamped SwiGLU. Activations are bf16 (uint16_t bit patterns), arithmetic float32 (angles in double); float32 small
// outputs (mix weights). Every launcher is asynchronous on params.stream and returns the launch error; pointers are
// device memory; strides in elements. Descriptor arrays (the *Device structs) are device memory too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace deepinfer::kernels::cuda {

// mHC before a sublayer (backend.h V4HyperMix), from mixes = X · fnᵀ (float32, computed by the caller).
struct V4HcPreParams {
  int64_t rows = 0, hc = 4, d = 0, sinkhorn_iters = 20;
  double norm_eps = 1e-6, hc_eps = 1e-6;
  bool head = false;  // pre only (mixes [rows, hc]); post and comb not written
  const uint16_t* x = nullptr;  // [rows, hc * d]
  int64_t x_stride = 0;
  const float* mixes = nullptr;  // [rows, mix, mix_splits] contiguous: each mix value as mix_splits partial sums
  int mix_splits = 1;
  // The mixes kernel's partial sums of squares of each row [rows, mix_splits], or null: computed here.
  const float* sumsq = nullptr;
  const float* base = nullptr;   // [mix]
  const float* scale = nullptr;  // [3] ([1] for the head)
  uint16_t* y = nullptr;  // [rows, d]
  int64_t y_stride = 0;
  float* post = nullptr;  // [rows, hc]
  int64_t post_stride = 0;
  float* comb = nullptr;  // [rows, hc * hc]
  int64_t comb_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_hc_pre(const V4HcPreParams& params);  // hc <= 8

// The mix logits for a few rows, in `splits` partial sums over column ranges: mixes[r][o][s] = Σ_{i in range s}
// x[r][i] · fn[o][i] (x bf16 [rows, cols], fn float32 [outputs, cols] at row stride fn_stride; mixes contiguous
// [rows, outputs, splits]), one CTA per (row, output, split), products summed in double. hc_pre adds the splits up
// in order (deterministic). splits <= 64 (the CUDA backend takes this kernel up to 64 rows, cuBLAS beyond).
struct V4MixesParams {
  int64_t rows = 0, outputs = 0, cols = 0;
  int splits = 1;
  const uint16_t* x = nullptr;
  int64_t x_stride = 0;
  const float* fn = nullptr;
  int64_t fn_stride = 0;
  float* mixes = nullptr;
  float* sumsq = nullptr;  // [rows, splits]: each row's sum of squares per range (for hc_pre), or null
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_mixes(const V4MixesParams& params);

// In place: x_j = post_j · out + Σ_i comb[i][j] · x_i.
struct V4HcPostParams {
  int64_t rows = 0, hc = 4, d = 0;
  uint16_t* x = nullptr;
  int64_t x_stride = 0;
  const uint16_t* out = nullptr;
  int64_t out_stride = 0;
  const float* post = nullptr;
  int64_t post_stride = 0;
  const float* comb = nullptr;
  int64_t comb_stride = 0;
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_hc_post(const V4HcPostParams& params);  // hc <= 8

// Per row (cols values): optional RMS norm (optional weight), then rotation of the last rope_dim values (interleaved
// pairs) at positions[r / vectors_per_position] (inverse: -position). rope_dim <= 128, even.
struct V4NormRopeParams {
  int64_t rows = 0, cols = 0, stride = 0;
  uint16_t* x = nullptr;
  bool norm = false;
  const float* weight = nullptr;
  double eps = 1e-6;
  const double* inv_freq = nullptr;  // [rope_dim / 2], or null: no rotation
  int rope_dim = 0;
  bool inverse = false;
  int64_t vectors_per_position = 1;
  const int32_t* positions = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_norm_rope(const V4NormRopeParams& params);

// One sequence's chunk of a compress call (backend.h V4CompressWork, device side).
struct V4CompressWorkDevice {
  int64_t row_first = 0, start = 0;
  uint16_t* ring_kv = nullptr;     // [2m][width]
  uint16_t* ring_score = nullptr;  // [2m][width], ape added
  uint16_t* entries = nullptr;     // [..][dim]
};
struct V4CompressEntry {
  int32_t work = 0;
  int64_t j = 0;
};
// A raw row to copy out: position `position` of work `work` into kv_dst / score_dst ([width] each; score with ape).
struct V4CompressRowTask {
  int32_t work = 0;
  int64_t position = 0;
  uint16_t* kv_dst = nullptr;
  uint16_t* score_dst = nullptr;
};
struct V4CompressParams {
  int64_t ratio = 0, dim = 0, coff = 1;  // dim <= 1024
  const uint16_t* kv = nullptr;          // the step's rows [T, kv_stride]
  int64_t kv_stride = 0;
  const uint16_t* score = nullptr;  // without ape
  int64_t score_stride = 0;
  const float* ape = nullptr;   // [m][width]
  const float* norm = nullptr;  // [dim]
  double eps = 1e-6;
  const double* inv_freq = nullptr;
  int rope_dim = 0;
  const V4CompressWorkDevice* work = nullptr;
  const V4CompressEntry* entries = nullptr;  // the entries to make
  int64_t num_entries = 0;
  const V4CompressRowTask* tasks = nullptr;  // run_v4_compress_rows: the rows to copy
  int64_t num_tasks = 0;
  cudaStream_t stream = nullptr;
};
// Makes params.entries (pooling, RMS norm, rotation at j · m).
cudaError_t run_v4_compress(const V4CompressParams& params);
// Copies params.tasks' rows (the step's rows with ape added to the score, or the rings').
cudaError_t run_v4_compress_rows(const V4CompressParams& params);

// The lightning indexer: per row with visible > topk, scores[r][s] = Σ_h relu(q_h · k_s) · weights_h · weight_scale
// for s < visible, then ids[r][0..topk) = the topk best s (equal scores: lower s first), in no particular order.
struct V4IndexRowDevice {
  const uint16_t* keys = nullptr;  // [visible][dim]
  int64_t visible = 0;
};
struct V4IndexerParams {
  int64_t rows = 0, heads = 0, dim = 0, topk = 0;  // heads * dim <= 16384, dim % 8 == 0
  const uint16_t* q = nullptr;
  int64_t q_stride = 0;
  const uint16_t* weights = nullptr;
  int64_t weights_stride = 0;
  double weight_scale = 1.0;
  const V4IndexRowDevice* row_keys = nullptr;
  int64_t max_visible = 0;  // the longest row's visible (scores' row stride)
  float* scores = nullptr;  // [rows][max_visible] workspace
  int32_t* ids = nullptr;   // [rows][topk]
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_indexer_topk(const V4IndexerParams& params);

// Sparse attention with sinks (backend.h V4AttentionRow / V4Attention).
struct V4AttentionRowDevice {
  int64_t position = 0, window_first = 0, step_start = 0, row_first = 0;
  const uint16_t* ring = nullptr;
  const uint16_t* entries = nullptr;
  int64_t entry_count = 0;
  int32_t indexed = 0;
};
struct V4AttentionParams {
  int64_t rows = 0, heads = 0, head_dim = 0, window = 0;  // heads % 4 == 0, head_dim % 128 == 0, <= 1024
  float scale = 1.0f;
  const float* sinks = nullptr;
  const int32_t* ids = nullptr;
  int64_t topk = 0;
  const uint16_t* q = nullptr;
  int64_t q_stride = 0;
  const uint16_t* kv = nullptr;
  int64_t kv_stride = 0;
  const V4AttentionRowDevice* row_keys = nullptr;
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  // Splits of each row's keys over CTAs (flash-decode, for few rows): 1 writes out directly; more write float32
  // partial sums [rows][heads][splits][head_dim] and (max, sum) pairs [rows][heads][splits][2], merged by a second
  // kernel. splits <= 64.
  int splits = 1;
  float* partial_acc = nullptr;
  float* partial_ml = nullptr;
  cudaStream_t stream = nullptr;
};
cudaError_t run_v4_attention(const V4AttentionParams& params);

// Copies; spans must not overlap (their order is not kept).
struct CopySpanDevice {
  const void* src = nullptr;
  void* dst = nullptr;
  uint64_t bytes = 0;
};
cudaError_t run_copy_spans(const CopySpanDevice* spans, int64_t count, cudaStream_t stream);

// out[r, :n] = silu(min(gate, limit)) · clamp(up, -limit, limit) (limit <= 0: no clamp); gate_up [rows, 2n]
// contiguous rows of stride gate_up_stride, out stride out_stride.
cudaError_t run_silu_mul_clamped(const uint16_t* gate_up, int64_t gate_up_stride, uint16_t* out, int64_t out_stride,
                                 int64_t rows, int64_t n, float limit, cudaStream_t stream);

}  // namespace deepinfer::kernels::cuda
