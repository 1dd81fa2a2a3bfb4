// A Backend that forwards every call to another one and, while enabled, times each op on the host with the
// device synchronized before and after (so the op's own time, launch included; steps run slower while it is on).
// bench_model --profile uses it to say where a decode or prefill step goes. Not thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "deepinfer/backend/backend.h"

namespace deepinfer::bench {

class ProfilingBackend final : public backend::Backend {
 public:
  explicit ProfilingBackend(backend::Backend& inner) : inner_(inner) {}
  bool enabled = false;
  std::map<std::string, double> seconds;  // op name -> total time while enabled
  std::map<std::string, int64_t> calls;

  std::string_view name() const override { return inner_.name(); }
  backend::DType activation_dtype() const override { return inner_.activation_dtype(); }
  backend::DType cache_dtype() const override { return inner_.cache_dtype(); }
  Result<backend::Buffer> alloc(size_t bytes) override { return inner_.alloc(bytes); }
  Status upload(const void* host, size_t bytes, const backend::Buffer& dst, size_t offset) override {
    Status s;
    timed("upload", [&] { s = inner_.upload(host, bytes, dst, offset); });
    return s;
  }
  Status download(const backend::Buffer& src, size_t offset, size_t bytes, void* host) override {
    Status s;
    timed("download", [&] { s = inner_.download(src, offset, bytes, host); });
    return s;
  }
  Status download_batch(std::span<const DownloadRegion> regions) override {
    Status s;
    timed("download_batch", [&] { s = inner_.download_batch(regions); });
    return s;
  }
  Status upload_batch(std::span<const UploadRegion> regions) override {
    Status s;
    timed("upload_batch", [&] { s = inner_.upload_batch(regions); });
    return s;
  }
  Status check_model_shapes(const backend::ModelShapes& shapes) const override {
    return inner_.check_model_shapes(shapes);
  }
  Status synchronize() override { return inner_.synchronize(); }
  Result<std::unique_ptr<backend::Weight>> make_weight(int64_t count, int64_t rows, int64_t cols,
                                                       backend::Precision precision) override {
    return inner_.make_weight(count, rows, cols, precision);
  }
  Status set_matrix(backend::Weight& w, int64_t index, const backend::HostMatrix& host) override {
    return inner_.set_matrix(w, index, host);
  }
  void fill_random(backend::Weight& w, uint64_t seed, float scale) override { inner_.fill_random(w, seed, scale); }
  Result<backend::Buffer> make_vector(std::span<const float> values) override { return inner_.make_vector(values); }
  Status begin_step(const backend::StepLayout& layout) override {
    Status s;
    timed("begin_step", [&] { s = inner_.begin_step(layout); });
    return s;
  }
  void embed(const backend::Weight& table, backend::Tensor out, int64_t first_id) override {
    timed("embed", [&] { inner_.embed(table, out, first_id); });
  }
  void gather_step_rows(const backend::Tensor& src, backend::Tensor out) override {
    timed("gather_step_rows", [&] { inner_.gather_step_rows(src, out); });
  }
  void linear(const backend::Tensor& x, const backend::Weight& w, backend::Tensor y) override {
    const char* kind = w.precision == backend::Precision::kFP8 ? "linear fp8" : "linear bf16";
    timed(std::string(kind) + " " + std::to_string(w.rows) + "x" + std::to_string(w.cols),
          [&] { inner_.linear(x, w, y); });
  }
  void linear_heads(const backend::Tensor& x, int64_t xs, const backend::Weight& w, backend::Tensor y,
                    int64_t ys) override {
    timed("linear_heads " + std::to_string(w.rows) + "x" + std::to_string(w.cols),
          [&] { inner_.linear_heads(x, xs, w, y, ys); });
  }
  void rms_norm(const backend::Tensor& x, const backend::Buffer& w, float eps, backend::Tensor y) override {
    timed("rms_norm", [&] { inner_.rms_norm(x, w, eps, y); });
  }
  void add_rms_norm(backend::Tensor r, const backend::Tensor& d, const backend::Buffer& w, float eps,
                    backend::Tensor y) override {
    timed("add_rms_norm", [&] { inner_.add_rms_norm(r, d, w, eps, y); });
  }
  void add(backend::Tensor x, const backend::Tensor& d) override { timed("add", [&] { inner_.add(x, d); }); }
  void fill_zero(backend::Tensor x) override { timed("fill_zero", [&] { inner_.fill_zero(x); }); }
  void copy(const backend::Tensor& s, backend::Tensor d) override { timed("copy", [&] { inner_.copy(s, d); }); }
  void silu_mul(const backend::Tensor& g, backend::Tensor o) override { timed("silu_mul", [&] { inner_.silu_mul(g, o); }); }
  void rope(backend::Tensor x, int64_t vpp, const backend::Buffer& f, float a) override {
    timed("rope", [&] { inner_.rope(x, vpp, f, a); });
  }
  void store_kv(const backend::Tensor& kv, const backend::Buffer& c) override {
    timed("store_kv", [&] { inner_.store_kv(kv, c); });
  }
  void mla_attention(const backend::MlaAttention& a, const backend::Tensor& q, const backend::Buffer& c,
                     backend::Tensor o) override {
    timed("mla_attention", [&] { inner_.mla_attention(a, q, c, o); });
  }
  bool has_mla_expanded(const backend::MlaExpanded& a) const override { return inner_.has_mla_expanded(a); }
  bool mla_expanded_pays(const backend::MlaExpanded& a) const override { return inner_.mla_expanded_pays(a); }
  void mla_expanded(const backend::MlaExpanded& a, const backend::Tensor& q, const backend::Tensor& kv,
                    const backend::Buffer& cache, backend::Tensor o) override {
    timed("mla_expanded", [&] { inner_.mla_expanded(a, q, kv, cache, o); });
  }
  void moe(const backend::Tensor& x, const backend::MoeWeights& w, backend::Tensor out) override {
    timed("moe", [&] { inner_.moe(x, w, out); });
  }
  // The side lane only while not timing: per-op times need the ops one after the other.
  bool has_side_lane() const override { return !enabled && inner_.has_side_lane(); }
  void begin_side_lane() override { inner_.begin_side_lane(); }
  void end_side_lane() override { inner_.end_side_lane(); }
  void join_side_lane() override { inner_.join_side_lane(); }
  // While timing, the ops run eagerly (each is synchronized on its own, which a recorded graph could not be);
  // otherwise the inner backend may record and replay them as usual.
  Status run_graph(const backend::GraphKey& key, const std::function<void()>& ops) override {
    if (!enabled) return inner_.run_graph(key, ops);
    ops();
    return inner_.synchronize();
  }
  void reset_graphs() override { inner_.reset_graphs(); }
  int64_t graph_replays() const override { return inner_.graph_replays(); }
  int64_t graph_recordings() const override { return inner_.graph_recordings(); }
  void compute_logits(const backend::Tensor& x, const backend::Buffer& norm, float eps, const backend::Weight& head,
                      bool greedy) override {
    timed(greedy ? "greedy head" : "logits head", [&] { inner_.compute_logits(x, norm, eps, head, greedy); });
  }
  Status read_logits(std::vector<float>& host) override {
    Status s;
    timed("read logits", [&] { s = inner_.read_logits(host); });
    return s;
  }
  Status read_greedy_tokens(std::vector<int32_t>& ids) override {
    Status s;
    timed("read greedy tokens", [&] { s = inner_.read_greedy_tokens(ids); });
    return s;
  }
  Status read_top_probabilities(std::vector<float>& p) override {
    Status s;
    timed("read top probabilities", [&] { s = inner_.read_top_probabilities(p); });
    return s;
  }
  // Every virtual with a base version is forwarded too: otherwise the base composition (e.g. mla_prepare's five ops)
  // would run instead of the inner backend's own, and the benchmark would time another code path than the product.
  Result<DeviceMemory> device_memory() override { return inner_.device_memory(); }
  Result<std::vector<float>> read_matrix(const backend::Weight& w, int64_t index) override {
    return inner_.read_matrix(w, index);
  }
  void mla_prepare(backend::Tensor kv, int64_t latent, const backend::Buffer& norm_weight, float eps,
                   backend::Tensor q_rope, int64_t heads, const backend::Buffer& inv_freq, float attention_factor,
                   const backend::Buffer& cache_layer, backend::Tensor q_rope_copy) override {
    timed("mla_prepare", [&] {
      inner_.mla_prepare(kv, latent, norm_weight, eps, q_rope, heads, inv_freq, attention_factor, cache_layer,
                         q_rope_copy);
    });
  }
  bool has_v4_ops() const override { return inner_.has_v4_ops(); }
  void v4_hc_pre(const backend::Tensor& X, const backend::V4HyperMix& m, backend::Tensor y, backend::Tensor post,
                 backend::Tensor comb) override {
    timed("v4_hc_pre", [&] { inner_.v4_hc_pre(X, m, y, post, comb); });
  }
  void v4_hc_post(backend::Tensor X, const backend::Tensor& out, const backend::Tensor& post,
                  const backend::Tensor& comb) override {
    timed("v4_hc_post", [&] { inner_.v4_hc_post(X, out, post, comb); });
  }
  void v4_norm_rope(backend::Tensor x, const backend::V4NormRope& p) override {
    timed("v4_norm_rope", [&] { inner_.v4_norm_rope(x, p); });
  }
  void v4_compress(const backend::Tensor& kv, const backend::Tensor& score, const backend::V4Compressor& c,
                   std::span<const backend::V4CompressWork> work) override {
    timed("v4_compress", [&] { inner_.v4_compress(kv, score, c, work); });
  }
  void v4_indexer_topk(const backend::Tensor& q, const backend::Tensor& weights, double weight_scale,
                       std::span<const backend::V4IndexRow> rows, int64_t topk, const backend::Buffer& ids) override {
    timed("v4_indexer_topk", [&] { inner_.v4_indexer_topk(q, weights, weight_scale, rows, topk, ids); });
  }
  void v4_attention(const backend::V4Attention& a, const backend::Tensor& q, const backend::Tensor& kv,
                    std::span<const backend::V4AttentionRow> rows, backend::Tensor out) override {
    timed("v4_attention", [&] { inner_.v4_attention(a, q, kv, rows, out); });
  }
  void copy_spans(std::span<const backend::CopySpan> spans) override {
    timed("copy_spans", [&] { inner_.copy_spans(spans); });
  }
  void silu_mul_clamped(const backend::Tensor& gate_up, float limit, backend::Tensor out) override {
    timed("silu_mul_clamped", [&] { inner_.silu_mul_clamped(gate_up, limit, out); });
  }
  Status read_sampled_logprobs(std::vector<SampledLogprobs>& out) override {
    Status s;
    timed("read sampled logprobs", [&] { s = inner_.read_sampled_logprobs(out); });
    return s;
  }
  bool has_device_sampling() const override { return inner_.has_device_sampling(); }
  Status read_sampled_tokens(std::span<const DeviceSampling> rows,
                             std::span<const LogitAdjustment> adjustments,
                             std::vector<int32_t>& host_ids) override {
    Status s;
    timed("read sampled tokens", [&] { s = inner_.read_sampled_tokens(rows, adjustments, host_ids); });
    return s;
  }

 private:
  template <typename F>
  void timed(const std::string& op, F&& f) {
    if (!enabled) return f();
    (void)inner_.synchronize();
    const auto start = std::chrono::steady_clock::now();
    f();
    (void)inner_.synchronize();
    seconds[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    calls[op] += 1;
  }
  backend::Backend& inner_;
};

}  // namespace deepinfer::bench
