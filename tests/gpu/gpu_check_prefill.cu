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
// The fast kernel every check and bench launches (main runs them all for each).
k::MlaPrefillKernel g_kernel = k::MlaPrefillKernel::kWgmma;
bool g_overlap = true;  // MlaPrefillParams::wgmma_overlap of every launch
int g_splits = 0;       // MlaPrefillParams::key_splits of every launch (0: by waves, with a 4-split workspace)
constexpr int kMaxSplits = 4;

// The key-split workspace of every launch (run_mla_prefill splits only where it pays, or where g_splits forces it).
struct SplitWorkspace {
  DeviceBuffer<float> buffer;
  int64_t rows;
  int heads;
  SplitWorkspace(int64_t t, int h)
      : buffer(static_cast<size_t>(std::max<int64_t>(k::mla_prefill_split_floats(t, h, kMaxSplits), 1))),
        rows(t),
        heads(h) {}
  // Sets the split fields of p and fills the workspace with NaN (a split that writes nothing shows).
  void apply(k::MlaPrefillParams& p) const {
    if (g_kernel == k::MlaPrefillKernel::kMma) return;
    CUDA_TRY(cudaMemset(buffer.ptr, 0xff, buffer.count * sizeof(float)));
    p.key_splits = g_splits;
    p.max_key_splits = kMaxSplits;
    p.split_rows = rows;
    p.split_o = buffer.ptr;
    p.split_lse = buffer.ptr + static_cast<size_t>(kMaxSplits) * rows * heads * kV;
  }
};
double g_gemm_tflops = 0.0;
struct Summary {
  std::string name;
  double us, tflops, pct, err;
};
std::vector<Summary> g_summary;

// "other_overlap_bytes_equal" from a comparison's result: -1 not compared (null), 0 equal, 1 different.
const char* equal_field(int differ) { return differ < 0 ? "null" : (differ == 0 ? "true" : "false"); }

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
  p.kernel = g_kernel;
  p.wgmma_overlap = g_overlap;
  const SplitWorkspace splits(T, H);
  splits.apply(p);
  p.num_seqs = B;
  p.num_heads = H;
  p.max_seqlen = max_len;
  p.scale = scale;
  p.cu_seqlens = d_cu.ptr;
  p.q = q.ptr;
  p.k_nope = kk.ptr;
  p.v = v.ptr;
  p.out = out.ptr;
  CUDA_TRY(k::run_mla_prefill(p));
  CUDA_TRY(cudaDeviceSynchronize());
  // The wgmma kernels with the other overlap setting must give the same bytes (the same additions, in order): the
  // bf16 output, and the f32 rows and log-sum-exps a first merge chunk (kFirst) writes.
  int overlap_bytes_differ = -1;  // -1: not compared (mma.sync)
  if (g_kernel != k::MlaPrefillKernel::kMma) {
    DeviceBuffer<uint16_t> out_other(out.count);
    poison(out_other.ptr, out_other.count);
    k::MlaPrefillParams other = p;
    other.wgmma_overlap = !g_overlap;
    other.out = out_other.ptr;
    splits.apply(other);  // the workspace NaN again: the other run must write every partial it combines
    CUDA_TRY(k::run_mla_prefill(other));
    std::vector<std::vector<float>> f32;  // o_acc, lse_acc of this setting, then of the other
    for (const bool overlap : {g_overlap, !g_overlap}) {
      DeviceBuffer<float> o_acc(size_t{1} * T * H * kV), lse(size_t{1} * T * H);
      CUDA_TRY(cudaMemset(o_acc.ptr, 0xff, o_acc.count * sizeof(float)));
      CUDA_TRY(cudaMemset(lse.ptr, 0xff, lse.count * sizeof(float)));
      k::MlaPrefillParams first = p;
      first.wgmma_overlap = overlap;
      first.merge = k::MlaPrefillMerge::kFirst;
      first.o_acc = o_acc.ptr;
      first.lse_acc = lse.ptr;
      splits.apply(first);
      CUDA_TRY(k::run_mla_prefill(first));
      CUDA_TRY(cudaDeviceSynchronize());
      f32.push_back(o_acc.download());
      f32.push_back(lse.download());
    }
    const std::vector<uint16_t> a = out.download(), b = out_other.download();
    overlap_bytes_differ = std::memcmp(a.data(), b.data(), a.size() * sizeof(uint16_t)) != 0 ||
                                   std::memcmp(f32[0].data(), f32[2].data(), f32[0].size() * sizeof(float)) != 0 ||
                                   std::memcmp(f32[1].data(), f32[3].data(), f32[1].size() * sizeof(float)) != 0
                               ? 1
                               : 0;
  }
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
  // A forced split count is what runs (128 rows a CTA when the keys are split).
  const k::MlaPrefillShape shape = k::mla_prefill_shape(p);
  const bool shape_ok = g_splits <= 1 || (shape.key_splits == g_splits && shape.rows_per_cta == 128);
  const bool ok = non_finite == 0 && non_finite_ref == 0 && worst <= kTolerance && worst_ref <= kTolerance &&
                  fast_vs_ref_kernel <= kTolerance && overlap_bytes_differ != 1 && shape_ok;
  g_all_ok = g_all_ok && ok;
  std::string lens_s;
  for (int b = 0; b < B; ++b) {
    if (b) lens_s.push_back(',');
    lens_s.append(std::to_string(lens[b]));
  }
  std::printf(
      "{\"kind\":\"check\",\"case\":\"%s\",\"heads\":%d,\"lens\":[%s],\"tokens\":%d,\"scale\":%.4f,"
      "\"sampled_rows\":%zu,\"max_row_rel_err_fast\":%.3e,\"max_row_rel_err_reference_kernel\":%.3e,"
      "\"fast_vs_reference_kernel_rel_err\":%.3e,\"non_finite_fast\":%ld,\"non_finite_reference\":%ld,"
      "\"other_overlap_bytes_equal\":%s,\"ok\":%s}\n",
      name, H, lens_s.c_str(), T, scale, rows.size(), worst, worst_ref, fast_vs_ref_kernel, non_finite, non_finite_ref,
      equal_field(overlap_bytes_differ), ok ? "true" : "false");
  std::fflush(stdout);
  g_summary.push_back({std::string("check ") + name, 0, 0, 0, ok ? worst : INFINITY});
}

// A chunk over a cached prefix: group b has q_len new rows at the end of a context of ctx keys (query i at position
// ctx - q_len + i). Keys come in the backend's layout: kv_b's output [Tk, H * 256] (k_nope | v per head) and the
// latent rows [Tk, 576] whose last 64 values are the roped key every head shares (head stride 0). Checked: the fast
// kernel over the whole context (kNone) and in chunks of `chunk` key positions merged by log-sum-exp (kFirst,
// kMiddle, kLast; each chunk's keys packed again, as the backend's gather does) against the reference kernel and a
// float64 loop on sampled rows; chunked vs whole over every element.
uint16_t host_bf16(float x) {
  __nv_bfloat16 b = __float2bfloat16(x);
  return *reinterpret_cast<uint16_t*>(&b);
}
void check_context_case(const char* name, int H, const std::vector<std::pair<int, int>>& groups, int chunk,
                        float scale, uint32_t seed) {
  const int B = static_cast<int>(groups.size());
  constexpr int kKvb = 256, kLatent = 576;
  std::vector<int32_t> cu_q(B + 1, 0), cu_k(B + 1, 0), q_pos(B, 0);
  int max_q = 0, max_ctx = 0;
  for (int b = 0; b < B; ++b) {
    cu_q[b + 1] = cu_q[b] + groups[b].first;
    cu_k[b + 1] = cu_k[b] + groups[b].second;
    q_pos[b] = groups[b].second - groups[b].first;
    max_q = std::max(max_q, groups[b].first);
    max_ctx = std::max(max_ctx, groups[b].second);
  }
  const int Tq = cu_q[B], Tk = cu_k[B];
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> hq(size_t{1} * Tq * H * kQK), hkvb(size_t{1} * Tk * H * kKvb), hlat(size_t{1} * Tk * kLatent);
  for (auto* v : {&hq, &hkvb, &hlat})
    for (uint16_t& x : *v) x = host_bf16(u(rng));
  DeviceBuffer<uint16_t> q(hq.size()), kvb(hkvb.size()), lat(hlat.size()), out(size_t{1} * Tq * H * kV),
      out_ref(size_t{1} * Tq * H * kV), out_chunked(size_t{1} * Tq * H * kV);
  DeviceBuffer<int32_t> d_cu_q(B + 1), d_cu_k(B + 1), d_qpos(B);
  q.upload(hq);
  kvb.upload(hkvb);
  lat.upload(hlat);
  d_cu_q.upload(cu_q);
  d_cu_k.upload(cu_k);
  d_qpos.upload(q_pos);
  poison(out.ptr, out.count);
  poison(out_ref.ptr, out_ref.count);
  poison(out_chunked.ptr, out_chunked.count);
  const SplitWorkspace splits(Tq, H);
  auto params = [&](const uint16_t* kvb_ptr, const uint16_t* lat_ptr, const int32_t* cu_keys) {
    k::MlaPrefillParams p;
    p.kernel = g_kernel;
    p.wgmma_overlap = g_overlap;
    splits.apply(p);
    p.num_seqs = B;
    p.num_heads = H;
    p.max_seqlen = max_q;
    p.max_seqlen_k = max_ctx;
    p.scale = scale;
    p.cu_seqlens = d_cu_q.ptr;
    p.cu_seqlens_k = cu_keys;
    p.q_positions = d_qpos.ptr;
    p.q = q.ptr;
    p.k_nope = kvb_ptr;
    p.k_token_stride = static_cast<int64_t>(H) * kKvb;
    p.k_head_stride = kKvb;
    p.v = kvb_ptr + 128;
    p.v_token_stride = static_cast<int64_t>(H) * kKvb;
    p.v_head_stride = kKvb;
    p.k_rope = lat_ptr + 512;
    p.k_rope_token_stride = kLatent;
    p.k_rope_head_stride = 0;
    return p;
  };
  k::MlaPrefillParams whole = params(kvb.ptr, lat.ptr, d_cu_k.ptr);
  auto whole_pass = [&](uint16_t* out_ptr, bool overlap) {
    whole.out = out_ptr;
    whole.wgmma_overlap = overlap;
    CUDA_TRY(k::run_mla_prefill(whole));
    CUDA_TRY(cudaDeviceSynchronize());
    whole.wgmma_overlap = g_overlap;
  };
  // Chunks of key positions [c * chunk, (c + 1) * chunk), packed per chunk.
  const int num_chunks = (max_ctx + chunk - 1) / chunk;
  auto chunked_pass = [&](uint16_t* out_chunked_ptr, float* acc_ptr, float* lse_ptr, bool overlap) {
    for (int c = 0; c < num_chunks; ++c) {
      std::vector<int32_t> cu_c(B + 1, 0);
      std::vector<uint16_t> kvb_c, lat_c;
      for (int b = 0; b < B; ++b) {
        const int first = c * chunk, end = std::min(groups[b].second, (c + 1) * chunk);
        for (int pos = first; pos < end; ++pos) {
          const size_t row = static_cast<size_t>(cu_k[b] + pos);
          kvb_c.insert(kvb_c.end(), hkvb.begin() + row * H * kKvb, hkvb.begin() + (row + 1) * H * kKvb);
          lat_c.insert(lat_c.end(), hlat.begin() + row * kLatent, hlat.begin() + (row + 1) * kLatent);
        }
        cu_c[b + 1] = cu_c[b] + std::max(0, end - first);
      }
      DeviceBuffer<uint16_t> d_kvb_c(std::max<size_t>(kvb_c.size(), 8)), d_lat_c(std::max<size_t>(lat_c.size(), 8));
      DeviceBuffer<int32_t> d_cu_c(B + 1);
      if (!kvb_c.empty()) d_kvb_c.upload(kvb_c);
      if (!lat_c.empty()) d_lat_c.upload(lat_c);
      d_cu_c.upload(cu_c);
      k::MlaPrefillParams p = params(d_kvb_c.ptr, d_lat_c.ptr, d_cu_c.ptr);
      p.wgmma_overlap = overlap;
      p.key_position = c * chunk;
      p.out = out_chunked_ptr;
      p.o_acc = acc_ptr;
      p.lse_acc = lse_ptr;
      p.merge = num_chunks == 1 ? k::MlaPrefillMerge::kNone
                : c == 0        ? k::MlaPrefillMerge::kFirst
                : c + 1 == num_chunks ? k::MlaPrefillMerge::kLast
                                      : k::MlaPrefillMerge::kMiddle;
      CUDA_TRY(k::run_mla_prefill(p));
      CUDA_TRY(cudaDeviceSynchronize());  // the chunk's buffers are freed at the end of this iteration
    }
  };
  whole_pass(out.ptr, g_overlap);
  whole.out = out_ref.ptr;
  CUDA_TRY(k::run_mla_prefill_reference(whole));
  CUDA_TRY(cudaDeviceSynchronize());
  DeviceBuffer<float> acc(size_t{1} * Tq * H * kV), lse(size_t{1} * Tq * H);
  CUDA_TRY(cudaMemset(acc.ptr, 0xff, acc.count * sizeof(float)));  // NaN: a row no merge wrote shows
  CUDA_TRY(cudaMemset(lse.ptr, 0xff, lse.count * sizeof(float)));
  chunked_pass(out_chunked.ptr, acc.ptr, lse.ptr, g_overlap);
  // The wgmma kernels with the other overlap setting must give the same bytes: the whole pass's and the chunked
  // pass's bf16 outputs, and the f32 rows and log-sum-exps the merges leave (after the last kFirst / kMiddle).
  int overlap_bytes_differ = -1;  // -1: not compared (mma.sync)
  if (g_kernel != k::MlaPrefillKernel::kMma) {
    DeviceBuffer<uint16_t> out_other(out.count), out_chunked_other(out.count);
    DeviceBuffer<float> acc_other(acc.count), lse_other(lse.count);
    poison(out_other.ptr, out_other.count);
    poison(out_chunked_other.ptr, out_chunked_other.count);
    CUDA_TRY(cudaMemset(acc_other.ptr, 0xff, acc_other.count * sizeof(float)));
    CUDA_TRY(cudaMemset(lse_other.ptr, 0xff, lse_other.count * sizeof(float)));
    whole_pass(out_other.ptr, !g_overlap);
    chunked_pass(out_chunked_other.ptr, acc_other.ptr, lse_other.ptr, !g_overlap);
    auto differ16 = [](const DeviceBuffer<uint16_t>& x, const DeviceBuffer<uint16_t>& y) {
      const std::vector<uint16_t> a = x.download(), b = y.download();
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(uint16_t)) != 0;
    };
    auto differ32 = [](const DeviceBuffer<float>& x, const DeviceBuffer<float>& y) {
      const std::vector<float> a = x.download(), b = y.download();
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0;
    };
    overlap_bytes_differ = differ16(out, out_other) || differ16(out_chunked, out_chunked_other) ||
                                   (num_chunks > 1 && (differ32(acc, acc_other) || differ32(lse, lse_other)))
                               ? 1
                               : 0;
  }
  const std::vector<uint16_t> ho = out.download(), hr = out_ref.download(), hc = out_chunked.download();
  long non_finite = 0;
  double num = 0.0, den = 0.0, num_c = 0.0;
  for (size_t i = 0; i < ho.size(); ++i) {
    const double a = bf16_to_double(ho[i]), r = bf16_to_double(hr[i]), c = bf16_to_double(hc[i]);
    if (!std::isfinite(a) || !std::isfinite(r) || !std::isfinite(c)) {
      ++non_finite;
      continue;
    }
    num += (a - r) * (a - r);
    num_c += (c - a) * (c - a);
    den += r * r;
  }
  const double fast_vs_ref = std::sqrt(num / std::max(den, 1e-30)), chunked_vs_whole = std::sqrt(num_c / std::max(den, 1e-30));
  // Sampled rows vs float64: each group's first and last rows and random ones.
  double worst = 0.0, worst_chunked = 0.0;
  std::vector<std::pair<int, int>> rows;  // (packed query row, head)
  for (int b = 0; b < B; ++b) {
    if (groups[b].first == 0) continue;
    rows.push_back({cu_q[b], static_cast<int>(rng() % H)});
    rows.push_back({cu_q[b + 1] - 1, static_cast<int>(rng() % H)});
  }
  for (int n = 0; n < 100 && Tq > 0; ++n) rows.push_back({static_cast<int>(rng() % Tq), static_cast<int>(rng() % H)});
  std::vector<uint16_t> keys, vals;
  for (const auto& [row, h] : rows) {
    int b = 0;
    while (cu_q[b + 1] <= row) ++b;
    const int last = q_pos[b] + (row - cu_q[b]);  // the last visible key
    keys.assign(static_cast<size_t>(last + 1) * kQK, 0);
    vals.assign(static_cast<size_t>(last + 1) * kV, 0);
    for (int j = 0; j <= last; ++j) {
      const size_t key_row = static_cast<size_t>(cu_k[b] + j);
      std::copy_n(hkvb.begin() + (key_row * H + h) * kKvb, 128, keys.begin() + j * kQK);
      std::copy_n(hlat.begin() + key_row * kLatent + 512, 64, keys.begin() + j * kQK + 128);
      std::copy_n(hkvb.begin() + (key_row * H + h) * kKvb + 128, kV, vals.begin() + j * kV);
    }
    const std::vector<double> ref =
        reference_row(hq.data() + (static_cast<size_t>(row) * H + h) * kQK, keys.data(), kQK, vals.data(), kV, last, scale);
    worst = std::max(worst, row_rel_err(ho.data() + (static_cast<size_t>(row) * H + h) * kV, ref));
    worst_chunked = std::max(worst_chunked, row_rel_err(hc.data() + (static_cast<size_t>(row) * H + h) * kV, ref));
  }
  const bool ok = non_finite == 0 && worst <= kTolerance && worst_chunked <= kTolerance && fast_vs_ref <= kTolerance &&
                  chunked_vs_whole <= kTolerance && overlap_bytes_differ != 1;
  g_all_ok = g_all_ok && ok;
  std::string groups_s;
  for (int b = 0; b < B; ++b) {
    if (b) groups_s.push_back(',');
    groups_s += "[" + std::to_string(groups[b].first) + "," + std::to_string(groups[b].second) + "]";
  }
  std::printf(
      "{\"kind\":\"check\",\"case\":\"%s\",\"heads\":%d,\"groups_rows_context\":[%s],\"chunk\":%d,"
      "\"chunks\":%d,\"sampled_rows\":%zu,\"max_row_rel_err_fast\":%.3e,\"max_row_rel_err_chunked\":%.3e,"
      "\"fast_vs_reference_kernel_rel_err\":%.3e,\"chunked_vs_whole_rel_err\":%.3e,\"non_finite\":%ld,"
      "\"other_overlap_bytes_equal\":%s,\"ok\":%s}\n",
      name, H, groups_s.c_str(), chunk, num_chunks, rows.size(), worst, worst_chunked, fast_vs_ref, chunked_vs_whole,
      non_finite, equal_field(overlap_bytes_differ), ok ? "true" : "false");
  std::fflush(stdout);
  g_summary.push_back({std::string("check ") + name, 0, 0, 0, ok ? std::max(worst, worst_chunked) : INFINITY});
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
  p.kernel = g_kernel;
  p.wgmma_overlap = g_overlap;
  const SplitWorkspace splits(static_cast<int64_t>(T), H);
  splits.apply(p);
  p.num_seqs = batch;
  p.num_heads = H;
  p.max_seqlen = len;
  p.scale = scale;
  p.cu_seqlens = d_cu.ptr;
  p.q = q.ptr;
  p.k_nope = kk.ptr;
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

// Times the fast kernel over a cached prefix: one sequence, `rows` new rows at the end of a `context`-key context,
// keys in the backend's layout (kv_b output [context, H * 256], latent rows [context, 576]), all keys in one launch.
// FLOPs: 2 * H * (192 + 128) per visible (row, key) pair.
void bench_context_case(const char* name, int H, int rows, int context, int reps) {
  DeviceBuffer<uint16_t> q(size_t{1} * rows * H * kQK), kvb(size_t{1} * context * H * 256),
      lat(size_t{1} * context * 576), out(size_t{1} * rows * H * kV);
  DeviceBuffer<int32_t> d_cu_q(2), d_cu_k(2), d_qpos(1);
  d_cu_q.upload({0, rows});
  d_cu_k.upload({0, context});
  d_qpos.upload({context - rows});
  fill_random(q.ptr, q.count, 11, 1.0f);
  fill_random(kvb.ptr, kvb.count, 12, 1.0f);
  fill_random(lat.ptr, lat.count, 13, 1.0f);
  k::MlaPrefillParams p;
  p.kernel = g_kernel;
  p.wgmma_overlap = g_overlap;
  const SplitWorkspace splits(rows, H);
  splits.apply(p);
  p.num_seqs = 1;
  p.num_heads = H;
  p.max_seqlen = rows;
  p.max_seqlen_k = context;
  p.scale = 0.3f;
  p.cu_seqlens = d_cu_q.ptr;
  p.cu_seqlens_k = d_cu_k.ptr;
  p.q_positions = d_qpos.ptr;
  p.q = q.ptr;
  p.k_nope = kvb.ptr;
  p.k_token_stride = static_cast<int64_t>(H) * 256;
  p.k_head_stride = 256;
  p.v = kvb.ptr + 128;
  p.v_token_stride = static_cast<int64_t>(H) * 256;
  p.v_head_stride = 256;
  p.k_rope = lat.ptr + 512;
  p.k_rope_token_stride = 576;
  p.k_rope_head_stride = 0;
  p.out = out.ptr;
  const Stats st = stats_of(time_events([&](int) { CUDA_TRY(k::run_mla_prefill(p)); }, 1, reps));
  const double pairs = static_cast<double>(rows) * context - static_cast<double>(rows) * (rows - 1) / 2.0;
  const double flops = pairs * H * 2.0 * (kQK + kV);
  const double tflops = flops / (st.median_us * 1e-6) / 1e12;
  const double pct = g_gemm_tflops > 0 ? 100.0 * tflops / g_gemm_tflops : 0.0;
  const k::MlaPrefillShape shape = k::mla_prefill_shape(p);
  std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"heads\":%d,\"rows\":%d,\"context\":%d,\"flops\":%.4e,"
              "\"reps\":%d,\"median_us\":%.1f,\"min_us\":%.1f,\"tflops\":%.1f,\"pct_gemm\":%.1f,"
              "\"rows_per_cta\":%d,\"key_splits\":%d}\n",
              name, H, rows, context, flops, reps, st.median_us, st.min_us, tflops, pct, shape.rows_per_cta,
              shape.key_splits);
  std::fflush(stdout);
  g_summary.push_back({name, st.median_us, tflops, pct, 0.0});
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
  struct ContextCase {
    const char* name;
    int heads;
    std::vector<std::pair<int, int>> groups;  // (new rows, context)
    int chunk;
  };
  const std::vector<ContextCase> context_checks = {
      // a 512-row chunk after 3,584 cached (bench_model's case, shortened), decode rows, a row at position 0
      {"ctx_h16_chunk", 16, {{200, 1000}, {1, 300}, {1, 1}, {65, 65}, {0, 10}, {7, 129}}, 1024},
      {"ctx_h16_chunks64", 16, {{200, 1000}, {1, 300}, {1, 1}, {65, 65}, {0, 10}, {7, 129}}, 64},
      {"ctx_h128_chunks320", 128, {{130, 700}, {3, 1200}, {64, 64}}, 320},
      {"ctx_h16_from_zero", 16, {{300, 300}, {1, 1}}, 128},  // no cached prefix, chunked keys
  };
  // Every check and bench for each fast kernel: the default (wgmma, rows per CTA and key splits by waves, softmax
  // overlapped with P · V), the same without the overlap, then wgmma with 64 and with 128 rows per CTA forced, the
  // keys split 2 and 3 ways (128 rows), then mma.sync (names end in " serial", " w64", " w128", " s2", " s3",
  // " mma").
  struct Variant {
    k::MlaPrefillKernel kernel;
    bool overlap;
    int splits;
    const char* suffix;
  };
  const Variant variants[] = {{k::MlaPrefillKernel::kWgmma, true, 0, ""},
                              {k::MlaPrefillKernel::kWgmma, true, 1, " s1"},
                              {k::MlaPrefillKernel::kWgmma, false, 0, " serial"},
                              {k::MlaPrefillKernel::kWgmma64, true, 1, " w64"},
                              {k::MlaPrefillKernel::kWgmma128, true, 1, " w128"},
                              {k::MlaPrefillKernel::kWgmma, true, 2, " s2"},
                              {k::MlaPrefillKernel::kWgmma, true, 3, " s3"},
                              {k::MlaPrefillKernel::kMma, true, 1, " mma"}};
  for (const Variant& variant : variants) {
    const k::MlaPrefillKernel kernel = variant.kernel;
    const bool overlap = variant.overlap;
    g_kernel = kernel;
    g_overlap = overlap;
    g_splits = variant.splits;
    const std::string suffix = variant.suffix;
    auto named = [&](const char* name) { return std::string(name) + suffix; };
    for (const ContextCase& c : context_checks) {
      try {
        check_context_case(named(c.name).c_str(), c.heads, c.groups, c.chunk, v3_scale,
                           4321u + static_cast<uint32_t>(c.chunk));
      } catch (const std::exception& ex) {
        std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", named(c.name).c_str(),
                    ex.what());
        g_all_ok = false;
        if (cudaDeviceSynchronize() != cudaSuccess) break;
      }
    }
    int ci = 0;
    for (const CheckCase& c : checks) {
      if (quick && ci++ >= 2) break;
      try {
        check_case(named(c.name).c_str(), c.heads, c.lens, c.scale, 1234u + 17u * static_cast<uint32_t>(ci) + c.heads);
      } catch (const std::exception& ex) {
        std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", named(c.name).c_str(),
                    ex.what());
        g_all_ok = false;
        if (cudaDeviceSynchronize() != cudaSuccess) break;
      }
    }
    if (!quick) {
      try {
        if (kernel == k::MlaPrefillKernel::kWgmma && overlap && variant.splits == 0) measure_ceiling();
      } catch (const std::exception& ex) {
        std::printf("{\"kind\":\"ceiling\",\"error\":\"%s\"}\n", ex.what());
      }
      struct BenchCase {
        const char* name;
        int batch, len, reps;
      };
      const BenchCase benches[] = {
          {"h128 1x4096", 1, 4096, 20}, {"h128 1x32768", 1, 32768, 5}, {"h128 8x4096", 8, 4096, 10}};
      struct ContextBench {
        const char* name;
        int heads, rows, context, reps;
      };
      const ContextBench context_benches[] = {{"ctx h16 512 after 3584", 16, 512, 4096, 20},
                                              {"ctx h128 512 after 3584", 128, 512, 4096, 20},
                                              {"ctx h128 3080 after 73920", 128, 3080, 77000, 3},
                                              {"ctx h16 3080 after 73920", 16, 3080, 77000, 3},
                                              {"ctx h16 1024 after 3072", 16, 1024, 4096, 20}};
      for (const ContextBench& bc : context_benches) {
        try {
          bench_context_case(named(bc.name).c_str(), bc.heads, bc.rows, bc.context, bc.reps);
        } catch (const std::exception& ex) {
          std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", named(bc.name).c_str(),
                    ex.what());
          g_all_ok = false;
          if (cudaDeviceSynchronize() != cudaSuccess) break;
        }
      }
      for (const BenchCase& bc : benches) {
        try {
          bench_case(named(bc.name).c_str(), 128, bc.batch, bc.len, bc.reps);
        } catch (const std::exception& ex) {
          std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", named(bc.name).c_str(),
                    ex.what());
          g_all_ok = false;
          if (cudaDeviceSynchronize() != cudaSuccess) break;
        }
      }
    }
    if (cudaDeviceSynchronize() != cudaSuccess) break;  // a sticky error: the next kernels could only fail too
  }
  print_summary();
  return g_all_ok ? 0 : 1;
}
