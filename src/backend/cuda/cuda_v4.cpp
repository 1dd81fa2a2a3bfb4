// The CUDA backend's DeepSeek-V4 ops (backend.h "DeepSeek-V4"; kernels in kernels/cuda/v4_ops.cu). Each op turns its
// host descriptors into the kernels' device descriptors and uploads them through the descriptor arena: pinned host
// memory copied to the device in stream order, reused from the next begin_step on (V4 ops never run inside graphs).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/fused_ops.h"
#include "deepinfer/kernels/cuda/v4_ops.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

uint16_t* bf16_data(const Tensor& t) { return static_cast<uint16_t*>(t.data); }
const float* f32_of(const Buffer* b) { return b == nullptr ? nullptr : static_cast<const float*>(b->data()); }
const double* f64_of(const Buffer* b) { return b == nullptr ? nullptr : static_cast<const double*>(b->data()); }

void check_bf16(const Tensor& t, const char* what) {
  BACKEND_CHECK(t.dtype == DType::kBF16 && t.stride >= t.cols, std::string(what) + ": bf16 views only");
}
void check_f32(const Tensor& t, const char* what) {
  BACKEND_CHECK(t.dtype == DType::kF32 && t.stride >= t.cols, std::string(what) + ": float32 views only");
}

}  // namespace

const void* CudaBackend::upload_descriptors(const void* host, size_t bytes) {
  BACKEND_CHECK(!capturing_, "a V4 op inside run_graph's ops");
  if (failed() || bytes == 0) return nullptr;
  const size_t need = (bytes + 255) / 256 * 256;
  if (descriptor_arenas_.empty() || descriptor_arenas_.back().used + need > descriptor_arenas_.back().bytes) {
    // A new, larger arena; the old one stays until the next begin_step (queued copies and kernels read it).
    const size_t size = std::max(need, descriptor_arenas_.empty() ? size_t{1} << 20 : 2 * descriptor_arenas_.back().bytes);
    DescriptorArena arena;
    check_cuda(cudaHostAlloc(&arena.host, size, cudaHostAllocDefault), "V4 descriptors (pinned arena)");
    if (failed()) return nullptr;
    check_cuda(cudaMalloc(&arena.device, size), "V4 descriptors (device arena)");
    if (failed()) {
      cudaFreeHost(arena.host);
      return nullptr;
    }
    arena.bytes = size;
    descriptor_arenas_.push_back(arena);
  }
  DescriptorArena& a = descriptor_arenas_.back();
  char* h = static_cast<char*>(a.host) + a.used;
  char* d = static_cast<char*>(a.device) + a.used;
  std::memcpy(h, host, bytes);
  check_cuda(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_), "V4 descriptors (upload)");
  a.used += need;
  return failed() ? nullptr : d;
}

void CudaBackend::recycle_descriptor_arenas() {
  if (descriptor_arenas_.empty() || (descriptor_arenas_.size() == 1 && descriptor_arenas_.back().used == 0)) return;
  // The previous step's copies and kernels may still read them (a V4 forward ends by reading its logits, so this
  // waits for nothing in practice).
  check_cuda(cudaStreamSynchronize(stream_), "V4 descriptors (recycling)");
  while (descriptor_arenas_.size() > 1) {
    cudaFreeHost(descriptor_arenas_.front().host);
    cudaFree(descriptor_arenas_.front().device);
    descriptor_arenas_.erase(descriptor_arenas_.begin());
  }
  descriptor_arenas_.back().used = 0;
}

void CudaBackend::free_descriptor_arenas() {
  for (DescriptorArena& a : descriptor_arenas_) {
    cudaFreeHost(a.host);
    cudaFree(a.device);
  }
  descriptor_arenas_.clear();
}

void CudaBackend::v4_hc_pre(const Tensor& X, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb) {
  check_bf16(X, "v4_hc_pre");
  check_bf16(y, "v4_hc_pre");
  BACKEND_CHECK(m.fn != nullptr && m.fn->precision == Precision::kF32 && m.fn->cols == X.cols && m.fn->count == 1,
                "v4_hc_pre: fn must be one float32 matrix [mix][hc * d]");
  BACKEND_CHECK(X.cols == m.hc * y.cols && y.rows == X.rows, "v4_hc_pre: X [T, hc * d], y [T, d]");
  if (!m.head) {
    check_f32(post, "v4_hc_pre");
    check_f32(comb, "v4_hc_pre");
  }
  const int64_t T = X.rows, mix = m.fn->rows;
  if (failed() || T == 0) return;
  // A few rows: one CTA per (row, output, 1,024 columns), the partial sums added up by the mix kernel; else cuBLAS.
  const int splits = T <= 64 ? static_cast<int>(std::clamp<int64_t>((X.cols + 1023) / 1024, 1, 32)) : 1;
  char* scratch = reserve(v4_, static_cast<size_t>(T * mix * splits + T * splits) * 4);
  if (scratch == nullptr) return;
  float* mixes = reinterpret_cast<float*>(scratch);
  float* sumsq = T <= 64 ? mixes + T * mix * splits : nullptr;  // the mixes kernel's, for hc_pre
  const MatrixRef fn = matrix_of(*m.fn, 0);
  if (T <= 64) {
    kc::V4MixesParams mp;
    mp.rows = T;
    mp.outputs = mix;
    mp.cols = X.cols;
    mp.x = bf16_data(X);
    mp.x_stride = X.stride;
    mp.fn = static_cast<const float*>(fn.values);
    mp.fn_stride = fn.stride;
    mp.mixes = mixes;
    mp.splits = splits;
    mp.sumsq = sumsq;
    mp.stream = stream_;
    check_cuda(kc::run_v4_mixes(mp), "v4_hc_pre (mixes)");
  } else {
    gemm_f32_out(X, fn, mixes, mix);
  }
  kc::V4HcPreParams p;
  p.rows = T;
  p.hc = m.hc;
  p.d = y.cols;
  p.sinkhorn_iters = m.sinkhorn_iters;
  p.norm_eps = m.norm_eps;
  p.hc_eps = m.hc_eps;
  p.head = m.head;
  p.x = bf16_data(X);
  p.x_stride = X.stride;
  p.mixes = mixes;
  p.mix_splits = splits;
  p.sumsq = sumsq;
  p.base = f32_of(m.base);
  p.scale = f32_of(m.scale);
  p.y = bf16_data(y);
  p.y_stride = y.stride;
  if (!m.head) {
    p.post = static_cast<float*>(post.data);
    p.post_stride = post.stride;
    p.comb = static_cast<float*>(comb.data);
    p.comb_stride = comb.stride;
  }
  p.stream = stream_;
  check_cuda(kc::run_v4_hc_pre(p), "v4_hc_pre");
}

void CudaBackend::v4_hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb) {
  check_bf16(X, "v4_hc_post");
  check_bf16(out, "v4_hc_post");
  check_f32(post, "v4_hc_post");
  check_f32(comb, "v4_hc_post");
  BACKEND_CHECK(X.cols == post.cols * out.cols && comb.cols == post.cols * post.cols, "v4_hc_post: shapes");
  if (failed() || X.rows == 0) return;
  kc::V4HcPostParams p;
  p.rows = X.rows;
  p.hc = post.cols;
  p.d = out.cols;
  p.x = bf16_data(X);
  p.x_stride = X.stride;
  p.out = bf16_data(out);
  p.out_stride = out.stride;
  p.post = static_cast<const float*>(post.data);
  p.post_stride = post.stride;
  p.comb = static_cast<const float*>(comb.data);
  p.comb_stride = comb.stride;
  p.stream = stream_;
  check_cuda(kc::run_v4_hc_post(p), "v4_hc_post");
}

void CudaBackend::v4_norm_rope(Tensor x, const V4NormRope& n) {
  check_bf16(x, "v4_norm_rope");
  BACKEND_CHECK(n.inv_freq == nullptr || x.rows <= step_.rows * n.vectors_per_position,
                "v4_norm_rope: more rows than the step's positions");
  if (failed() || x.rows == 0) return;
  kc::V4NormRopeParams p;
  p.rows = x.rows;
  p.cols = x.cols;
  p.stride = x.stride;
  p.x = bf16_data(x);
  p.norm = n.norm;
  p.weight = f32_of(n.weight);
  p.eps = n.eps;
  p.inv_freq = f64_of(n.inv_freq);
  p.rope_dim = static_cast<int>(n.rope_dim);
  p.inverse = n.inverse;
  p.vectors_per_position = n.vectors_per_position;
  p.positions = step_.positions_device;
  p.stream = stream_;
  check_cuda(kc::run_v4_norm_rope(p), "v4_norm_rope");
}

void CudaBackend::v4_compress(const Tensor& kv, const Tensor& score, const V4Compressor& c,
                              std::span<const V4CompressWork> work) {
  check_bf16(kv, "v4_compress");
  check_bf16(score, "v4_compress");
  const int64_t m = c.ratio, width = c.coff * c.dim;
  BACKEND_CHECK(kv.cols == width && score.cols == width, "v4_compress: kv and score must be [T, coff * dim]");
  if (failed() || work.empty()) return;
  std::vector<kc::V4CompressWorkDevice> devices;
  std::vector<kc::V4CompressEntry> entries;
  std::vector<kc::V4CompressRowTask> snapshots, rings;
  for (size_t i = 0; i < work.size(); ++i) {
    const V4CompressWork& w = work[i];
    kc::V4CompressWorkDevice d;
    d.row_first = w.row_first;
    d.start = w.start;
    d.ring_kv = static_cast<uint16_t*>(w.ring_kv);
    d.ring_score = static_cast<uint16_t*>(w.ring_score);
    d.entries = static_cast<uint16_t*>(w.entries);
    devices.push_back(d);
    const int32_t index = static_cast<int32_t>(i);
    for (int64_t j = w.first_entry; j < w.end_entry; ++j) entries.push_back({index, j});
    for (const V4RowSnapshot& s : w.snapshots) {
      const int64_t keep = m == 4 ? std::max<int64_t>(0, (s.boundary / m) * m - m) : (s.boundary / m) * m;
      for (int64_t p = keep; p < s.boundary; ++p) {
        snapshots.push_back({index, p, static_cast<uint16_t*>(s.kv_rows) + (p - keep) * width,
                             static_cast<uint16_t*>(s.score_rows) + (p - keep) * width});
      }
    }
    const int64_t end = w.start + w.count;
    for (int64_t p = std::max(w.start, end - 2 * m); p < end; ++p) {
      rings.push_back({index, p, d.ring_kv + (p % (2 * m)) * width, d.ring_score + (p % (2 * m)) * width});
    }
  }
  kc::V4CompressParams p;
  p.ratio = m;
  p.dim = c.dim;
  p.coff = c.coff;
  p.kv = bf16_data(kv);
  p.kv_stride = kv.stride;
  p.score = bf16_data(score);
  p.score_stride = score.stride;
  p.ape = f32_of(c.ape);
  p.norm = f32_of(c.norm);
  p.eps = c.eps;
  p.inv_freq = f64_of(c.inv_freq);
  p.rope_dim = static_cast<int>(c.rope_dim);
  p.work = static_cast<const kc::V4CompressWorkDevice*>(upload_descriptors(devices));
  p.stream = stream_;
  if (failed()) return;
  if (!entries.empty()) {
    p.entries = static_cast<const kc::V4CompressEntry*>(upload_descriptors(entries));
    p.num_entries = static_cast<int64_t>(entries.size());
    check_cuda(kc::run_v4_compress(p), "v4_compress");
  }
  // The snapshots read the rings before this step's rows overwrite them.
  for (const std::vector<kc::V4CompressRowTask>* tasks : {&snapshots, &rings}) {
    if (tasks->empty() || failed()) continue;
    p.tasks = static_cast<const kc::V4CompressRowTask*>(upload_descriptors(*tasks));
    p.num_tasks = static_cast<int64_t>(tasks->size());
    check_cuda(kc::run_v4_compress_rows(p), "v4_compress (rows)");
  }
}

void CudaBackend::v4_indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale,
                                  std::span<const V4IndexRow> rows, int64_t topk, const Buffer& ids) {
  check_bf16(q, "v4_indexer_topk");
  check_bf16(weights, "v4_indexer_topk");
  const int64_t T = static_cast<int64_t>(rows.size()), heads = weights.cols;
  BACKEND_CHECK(q.rows == T && weights.rows == T && q.cols % heads == 0, "v4_indexer_topk: shapes");
  BACKEND_CHECK(ids.bytes >= static_cast<size_t>(T * topk) * 4, "v4_indexer_topk: ids holds fewer than [T][topk]");
  if (failed() || T == 0) return;
  std::vector<kc::V4IndexRowDevice> devices(static_cast<size_t>(T));
  int64_t longest = 0;
  for (int64_t t = 0; t < T; ++t) {
    devices[static_cast<size_t>(t)] = {static_cast<const uint16_t*>(rows[static_cast<size_t>(t)].keys),
                                       rows[static_cast<size_t>(t)].visible};
    longest = std::max(longest, rows[static_cast<size_t>(t)].visible);
  }
  if (longest <= topk) return;
  float* scores = reinterpret_cast<float*>(reserve(v4_, static_cast<size_t>(T * longest) * 4));
  if (scores == nullptr) return;
  kc::V4IndexerParams p;
  p.rows = T;
  p.heads = heads;
  p.dim = q.cols / heads;
  p.topk = topk;
  p.q = bf16_data(q);
  p.q_stride = q.stride;
  p.weights = bf16_data(weights);
  p.weights_stride = weights.stride;
  p.weight_scale = weight_scale;
  p.row_keys = static_cast<const kc::V4IndexRowDevice*>(upload_descriptors(devices));
  p.max_visible = longest;
  p.scores = scores;
  p.ids = static_cast<int32_t*>(ids.data());
  p.stream = stream_;
  if (failed()) return;
  check_cuda(kc::run_v4_indexer_topk(p), "v4_indexer_topk");
}

void CudaBackend::v4_attention(const V4Attention& a, const Tensor& q, const Tensor& kv,
                               std::span<const V4AttentionRow> rows, Tensor out) {
  check_bf16(q, "v4_attention");
  check_bf16(kv, "v4_attention");
  check_bf16(out, "v4_attention");
  const int64_t T = static_cast<int64_t>(rows.size());
  BACKEND_CHECK(q.rows == T && q.cols == a.heads * a.head_dim && out.rows == T && out.cols == q.cols &&
                    kv.cols == a.head_dim,
                "v4_attention: q and out [T, heads * head_dim], kv [T, head_dim]");
  if (failed() || T == 0) return;
  std::vector<kc::V4AttentionRowDevice> devices(static_cast<size_t>(T));
  int64_t longest = 0;  // keys of the row with the most
  for (int64_t t = 0; t < T; ++t) {
    const V4AttentionRow& r = rows[static_cast<size_t>(t)];
    longest = std::max(longest, r.position - r.window_first + 1 + r.entry_count);
    kc::V4AttentionRowDevice& d = devices[static_cast<size_t>(t)];
    d.position = r.position;
    d.window_first = r.window_first;
    d.step_start = r.step_start;
    d.row_first = r.row_first;
    d.ring = static_cast<const uint16_t*>(r.ring);
    d.entries = static_cast<const uint16_t*>(r.entries);
    d.entry_count = r.entry_count;
    d.indexed = r.indexed ? 1 : 0;
    BACKEND_CHECK(!r.indexed || a.ids != nullptr, "v4_attention: an indexed row without ids");
  }
  kc::V4AttentionParams p;
  p.rows = T;
  p.heads = a.heads;
  p.head_dim = a.head_dim;
  p.window = a.window;
  p.scale = static_cast<float>(a.scale);
  p.sinks = f32_of(a.sinks);
  p.ids = a.ids != nullptr ? static_cast<const int32_t*>(a.ids->data()) : nullptr;
  p.topk = a.topk;
  p.q = bf16_data(q);
  p.q_stride = q.stride;
  p.kv = bf16_data(kv);
  p.kv_stride = kv.stride;
  p.row_keys = static_cast<const kc::V4AttentionRowDevice*>(upload_descriptors(devices));
  p.out = bf16_data(out);
  p.out_stride = out.stride;
  p.stream = stream_;
  // Few rows: split each row's keys over more CTAs (at least 32 keys each) so that every SM has work twice over.
  const int64_t ctas = T * (a.heads / 4);
  if (ctas < 2 * num_sms_) {
    p.splits = static_cast<int>(std::clamp<int64_t>(
        std::min((2 * num_sms_ + ctas - 1) / ctas, (longest + 31) / 32), 1, 16));
  }
  if (p.splits > 1) {
    const size_t parts = static_cast<size_t>(T * a.heads * p.splits);
    char* base = reserve(v4_, parts * static_cast<size_t>(a.head_dim) * 4 + parts * 8);
    if (base == nullptr) return;
    p.partial_acc = reinterpret_cast<float*>(base);
    p.partial_ml = reinterpret_cast<float*>(base + parts * static_cast<size_t>(a.head_dim) * 4);
  }
  if (failed()) return;
  check_cuda(kc::run_v4_attention(p), "v4_attention");
}

void CudaBackend::copy_spans(std::span<const CopySpan> spans) {
  if (failed() || spans.empty()) return;
  std::vector<kc::CopySpanDevice> devices;
  devices.reserve(spans.size());
  for (const CopySpan& s : spans) {
    if (s.bytes > 0) devices.push_back({s.src, s.dst, s.bytes});
  }
  if (devices.empty()) return;
  const auto* d = static_cast<const kc::CopySpanDevice*>(upload_descriptors(devices));
  if (failed()) return;
  check_cuda(kc::run_copy_spans(d, static_cast<int64_t>(devices.size()), stream_), "copy_spans");
}

void CudaBackend::silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out) {
  check_bf16(gate_up, "silu_mul_clamped");
  check_bf16(out, "silu_mul_clamped");
  BACKEND_CHECK(gate_up.rows == out.rows && gate_up.cols == 2 * out.cols, "silu_mul_clamped: shapes");
  if (failed() || out.rows == 0) return;
  check_cuda(kc::run_silu_mul_clamped(bf16_data(gate_up), gate_up.stride, bf16_data(out), out.stride, out.rows,
                                      out.cols, limit, stream_),
             "silu_mul_clamped");
}

}  // namespace deepinfer::backend::cuda
