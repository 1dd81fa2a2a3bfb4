// gpu_check_ops: checks the fused ops and MoE kernels (kernels/cuda/fused_ops.cu) against the project's own CPU
// code on fresh random inputs — rms_norm (+ fused residual add), silu_mul and rope against the CPU backend
// (src/backend/cpu/cpu_backend.cpp), MoE routing against the model's rule route_token
// (src/backend/moe_routing.cpp, the function deepseek_model.cpp calls), token permutation / gather / combine
// against the model's by-expert grouping — then times each at V3 decode / prefill sizes (T = 128, 8192) against
// the run's device-copy bandwidth. Outputs are poisoned (NaN / -1) before every checked run.
// Prints JSON lines, then a table. Exit status 0 only when every check passed (timings never fail it).
//   gpu_check_ops           checks + copy ceiling + benchmarks
//   gpu_check_ops --quick   the checks only
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/kernels/cuda/dspark_heads.h"
#include "deepinfer/kernels/cuda/fused_ops.h"
#include "deepinfer/kernels/cuda/sampling.h"
#include "deepinfer/backend/moe_routing.h"
#include "gpu_check_common.h"

namespace {

namespace k = deepinfer::kernels::cuda;
namespace be = deepinfer::backend;
using namespace deepinfer::gpu_check;

uint16_t float_to_bf16(float value) {  // round to nearest even (inputs here are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

std::mt19937_64 g_rng(20261130);
bool g_all_ok = true;
double g_copy_gbps = 0.0;
std::unique_ptr<be::Backend> g_cpu;

// A host array as a CPU backend tensor (the CPU backend's memory is host memory).
be::Tensor cpu_tensor(const float* data, int64_t rows, int64_t cols, int64_t stride) {
  return be::Tensor{const_cast<float*>(data), be::DType::kF32, rows, cols, stride};
}

struct Row {
  std::string name;
  double us = 0, bytes = 0, gbps = 0, pct = 0, floor_us = 0, err = -1;
  bool check = false, ok = true;
};
std::vector<Row> g_rows;

void report_check(const std::string& op, const std::string& name, double err, double tol, long bad, long unwritten,
                  const std::string& extra = "") {
  const bool ok = std::isfinite(err) && err <= tol && bad == 0 && unwritten == 0;
  g_all_ok = g_all_ok && ok;
  std::printf("{\"kind\":\"check\",\"op\":\"%s\",\"case\":\"%s\",\"rel_err\":%.3e,\"tolerance\":%.1e,"
              "\"mismatches\":%ld,\"unwritten\":%ld%s,\"ok\":%s}\n",
              op.c_str(), name.c_str(), err, tol, bad, unwritten, extra.c_str(), ok ? "true" : "false");
  std::fflush(stdout);
  g_rows.push_back({"check " + op + " " + name, 0, 0, 0, 0, 0, err, true, ok});
}

// ‖o − r‖ / ‖r‖ over the given values; non-finite outputs counted separately (poison left = unwritten).
struct Cmp {
  double num = 0, den = 0;
  long non_finite = 0;
  void add(double o, double r) {
    if (!std::isfinite(o)) {
      ++non_finite;
      return;
    }
    num += (o - r) * (o - r);
    den += r * r;
  }
  double rel() const { return den > 0 ? std::sqrt(num / den) : std::sqrt(num); }
};

// Host values of a device tensor in the given dtype.
struct HostTensor {
  k::DType dtype;
  std::vector<float> f32;      // the values (bf16 ones decoded)
  std::vector<uint16_t> bf16;  // the bits when dtype is bf16
};
HostTensor random_tensor(k::DType dtype, size_t n, float scale) {
  HostTensor t{dtype, std::vector<float>(n), {}};
  std::normal_distribution<float> d(0.0f, scale);
  for (float& v : t.f32) v = d(g_rng);
  if (dtype == k::DType::kBF16) {
    t.bf16.resize(n);
    for (size_t i = 0; i < n; ++i) {
      t.bf16[i] = float_to_bf16(t.f32[i]);
      t.f32[i] = bf16_to_float(t.bf16[i]);
    }
  }
  return t;
}
size_t elem_bytes(k::DType d) { return d == k::DType::kBF16 ? 2 : 4; }
struct DevTensor {
  k::DType dtype;
  DeviceBuffer<uint8_t> buf;
  DevTensor(k::DType d, size_t n) : dtype(d), buf(n * elem_bytes(d)) {}
  void upload(const HostTensor& h) {
    const void* src = dtype == k::DType::kBF16 ? static_cast<const void*>(h.bf16.data()) : h.f32.data();
    CUDA_TRY(cudaMemcpy(buf.ptr, src, buf.count, cudaMemcpyHostToDevice));
  }
  std::vector<float> download() const {
    std::vector<uint8_t> raw = buf.download();
    const size_t n = raw.size() / elem_bytes(dtype);
    std::vector<float> v(n);
    if (dtype == k::DType::kBF16) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, raw.data() + 2 * i, 2);
        v[i] = bf16_to_float(b);
      }
    } else {
      std::memcpy(v.data(), raw.data(), n * 4);
    }
    return v;
  }
  void* ptr() { return buf.ptr; }
};
const char* dname(k::DType d) { return d == k::DType::kBF16 ? "bf16" : "f32"; }
double tol_of(k::DType d) { return d == k::DType::kBF16 ? 1e-2 : 1e-5; }

// ---- rms_norm ----
void check_rms_norm(k::DType dt, int64_t rows, int64_t dim, int64_t stride, bool residual) {
  const size_t n = static_cast<size_t>(rows * stride);
  HostTensor x = random_tensor(dt, n, 1.0f), r = random_tensor(dt, n, 1.0f), w = random_tensor(dt, dim, 0.3f);
  for (float& v : w.f32) v += 1.0f;  // weights near 1 as trained ones are
  if (dt == k::DType::kBF16)
    for (size_t i = 0; i < w.f32.size(); ++i) w.f32[i] = bf16_to_float(w.bf16[i] = float_to_bf16(w.f32[i]));
  DevTensor dx(dt, n), dr(dt, n), dw(dt, dim), dy(dt, n);
  dx.upload(x);
  dr.upload(r);
  dw.upload(w);
  dy.buf.poison();
  k::RmsNormParams p;
  p.dtype = dt;
  p.rows = rows;
  p.dim = dim;
  p.stride = stride;
  p.eps = 1e-6f;
  p.x = dx.ptr();
  p.weight = dw.ptr();
  p.residual = residual ? dr.ptr() : nullptr;
  p.y = dy.ptr();
  CUDA_TRY(k::run_rms_norm(p));
  CUDA_TRY(cudaDeviceSynchronize());
  // Reference: the residual sum stored in the dtype, then the CPU backend's rms_norm on it.
  std::vector<float> in = x.f32;
  long residual_bad = 0;
  if (residual) {
    std::vector<float> got_r = dr.download();
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t i = 0; i < dim; ++i) {
        const size_t j = static_cast<size_t>(row * stride + i);
        float z = x.f32[j] + r.f32[j];
        if (dt == k::DType::kBF16) z = bf16_to_float(float_to_bf16(z));
        in[j] = z;
        if (!(got_r[j] == z)) ++residual_bad;  // exact: one rounding of the float sum on both sides
      }
  }
  std::vector<float> ref(n, 0.0f);
  be::Buffer weight = g_cpu->make_vector(w.f32).value();
  g_cpu->rms_norm(cpu_tensor(in.data(), rows, dim, stride), weight, 1e-6f, cpu_tensor(ref.data(), rows, dim, stride));
  std::vector<float> got = dy.download();
  Cmp c;
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t i = 0; i < dim; ++i) c.add(got[row * stride + i], ref[row * stride + i]);
  char name[96];
  std::snprintf(name, sizeof(name), "%s_r%lld_d%lld_s%lld%s", dname(dt), static_cast<long long>(rows),
                static_cast<long long>(dim), static_cast<long long>(stride), residual ? "_residual" : "");
  report_check("rms_norm", name, c.rel(), tol_of(dt), residual_bad, c.non_finite);
}

// ---- silu_mul ----
void check_silu_mul(k::DType dt, int64_t rows, int64_t n) {
  HostTensor gu = random_tensor(dt, static_cast<size_t>(rows * 2 * n), 2.0f);
  DevTensor dgu(dt, gu.f32.size()), dout(dt, static_cast<size_t>(rows * n));
  dgu.upload(gu);
  dout.buf.poison();
  k::SiluMulParams p;
  p.dtype = dt;
  p.rows = rows;
  p.n = n;
  p.gate_up = dgu.ptr();
  p.out = dout.ptr();
  CUDA_TRY(k::run_silu_mul(p));
  CUDA_TRY(cudaDeviceSynchronize());
  std::vector<float> ref(static_cast<size_t>(rows * n));
  g_cpu->silu_mul(cpu_tensor(gu.f32.data(), rows, 2 * n, 2 * n), cpu_tensor(ref.data(), rows, n, n));
  std::vector<float> got = dout.download();
  Cmp c;
  for (size_t i = 0; i < ref.size(); ++i) c.add(got[i], ref[i]);
  char name[64];
  std::snprintf(name, sizeof(name), "%s_r%lld_n%lld", dname(dt), static_cast<long long>(rows), static_cast<long long>(n));
  report_check("silu_mul", name, c.rel(), tol_of(dt), 0, c.non_finite);
}

// ---- rope ----
// YaRN-like table as V3's (factor 40, base 10000, dim 64): inv_freq interpolated, attention_factor 1.3689.
std::vector<float> make_inv_freq(int64_t dim) {
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float extrapolation = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / dim));
    const float ramp = std::clamp((static_cast<float>(i) - 10.0f) / (23.0f - 10.0f), 0.0f, 1.0f);
    f[i] = extrapolation / 40.0f * ramp + extrapolation * (1.0f - ramp);
  }
  return f;
}
void check_rope(k::DType dt, int64_t rows, int64_t dim, int64_t stride, int64_t vpp) {
  const size_t n = static_cast<size_t>(rows * stride);
  HostTensor x = random_tensor(dt, n, 1.0f);
  const int64_t groups = (rows + vpp - 1) / vpp;
  std::vector<int32_t> pos(static_cast<size_t>(groups));
  for (int32_t& p : pos) p = static_cast<int32_t>(g_rng() % 163840);
  std::vector<float> inv = make_inv_freq(dim);
  const float factor = static_cast<float>(0.1 * std::log(40.0) + 1.0);
  DevTensor dx(dt, n);
  dx.upload(x);
  DeviceBuffer<int32_t> dpos(pos.size());
  DeviceBuffer<float> dinv(inv.size());
  dpos.upload(pos);
  dinv.upload(inv);
  // In place, so no poison: the comparison covers every row value and the padding between rows must stay as is.
  k::RopeParams p;
  p.dtype = dt;
  p.rows = rows;
  p.dim = dim;
  p.stride = stride;
  p.vectors_per_position = vpp;
  p.x = dx.ptr();
  p.positions = dpos.ptr;
  p.inv_freq = dinv.ptr;
  p.attention_factor = factor;
  CUDA_TRY(k::run_rope(p));
  CUDA_TRY(cudaDeviceSynchronize());
  std::vector<float> ref = x.f32;
  // The CPU backend reads positions from its step: one row per position, nothing else used.
  be::StepLayout layout;
  layout.positions = pos;
  if (!g_cpu->begin_step(layout).ok()) std::abort();
  be::Buffer inv_freq = g_cpu->make_vector(inv).value();
  g_cpu->rope(cpu_tensor(ref.data(), rows, dim, stride), vpp, inv_freq, factor);
  std::vector<float> got = dx.download();
  Cmp c;
  long padding_changed = 0;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < dim; ++i) c.add(got[row * stride + i], ref[row * stride + i]);
    for (int64_t i = dim; i < stride; ++i) padding_changed += got[row * stride + i] != x.f32[row * stride + i];
  }
  char name[96];
  std::snprintf(name, sizeof(name), "%s_r%lld_d%lld_s%lld_vpp%lld", dname(dt), static_cast<long long>(rows),
                static_cast<long long>(dim), static_cast<long long>(stride), static_cast<long long>(vpp));
  report_check("rope", name, c.rel(), tol_of(dt), padding_changed, c.non_finite);
}

// ---- MoE routing ----
struct RouteCase {
  const char* name;
  be::MoeRoutingRule rule;
  int logits_kind;  // 0 normal(0, 2); 1 grid {0, .25, .., 4} (exact ties)
  float bias_lo, bias_hi;  // bias uniform in [lo, hi); lo == hi == 0: no bias tensor
};
be::MoeRoutingRule make_rule(be::MoeRoutingRule::Scoring s, be::MoeRoutingRule::TopK t, int64_t E, int64_t kk,
                             int64_t ng, int64_t tg, bool norm, bool after, double rsf) {
  be::MoeRoutingRule r;
  r.scoring = s;
  r.topk = t;
  r.num_experts = E;
  r.top_k = kk;
  r.n_group = ng;
  r.topk_group = tg;
  r.norm_topk_prob = norm;
  r.scale_after_normalize = after;
  r.routed_scaling_factor = rsf;
  return r;
}
k::MoeRoutingParams device_rule(const be::MoeRoutingRule& r) {
  k::MoeRoutingParams p;
  p.num_experts = r.num_experts;
  p.top_k = r.top_k;
  p.sigmoid = r.scoring == be::MoeRoutingRule::Scoring::kSigmoid;
  p.grouping = r.topk == be::MoeRoutingRule::TopK::kGreedy ? 0 : r.topk == be::MoeRoutingRule::TopK::kGroupLimitedGreedy ? 1 : 2;
  p.n_group = static_cast<int>(r.n_group);
  p.topk_group = static_cast<int>(r.topk_group);
  p.norm_topk_prob = r.norm_topk_prob;
  p.scale_after_normalize = r.scale_after_normalize;
  p.routed_scaling_factor = r.routed_scaling_factor;
  return p;
}
// True when a decision of the rule (order within the top k + 1 choices after masking; the kept/dropped group
// boundary) rests on two different values closer than rounding could blur (float32 vs float64, CPU expf vs GPU
// expf): such tokens are redrawn. Exact ties (equal inputs) are kept: the documented tie rule decides them.
bool near_tie(const be::MoeRoutingRule& r, const float* logits, const std::vector<float>& bias) {
  const int64_t E = r.num_experts;
  std::vector<double> s(static_cast<size_t>(E)), c(static_cast<size_t>(E));
  double mx = *std::max_element(logits, logits + E), sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(logits[e]) - mx);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = r.scoring == be::MoeRoutingRule::Scoring::kSigmoid ? 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])))
                                                              : std::exp(logits[e] - mx) / sum;
    c[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
  }
  auto close = [](double a, double b) {
    const double gap = std::fabs(a - b);
    return gap > 0 && gap < 1e-6 + 1e-5 * std::max(std::fabs(a), std::fabs(b));
  };
  if (r.topk != be::MoeRoutingRule::TopK::kGreedy) {
    const int64_t per = E / r.n_group;
    std::vector<double> gs(static_cast<size_t>(r.n_group));
    for (int64_t g = 0; g < r.n_group; ++g) {
      std::vector<double> m(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(m.begin(), m.end(), std::greater<>());
      gs[g] = r.topk == be::MoeRoutingRule::TopK::kNoauxTc ? m[0] + (per > 1 ? m[1] : 0.0) : m[0];
      for (size_t i = 0; i + 1 < m.size() && i < 2; ++i)
        if (close(m[i], m[i + 1])) return true;  // which two members are the top-2 (sum unaffected, but be safe)
    }
    std::vector<double> sorted = gs;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    if (r.topk_group < r.n_group && close(sorted[r.topk_group - 1], sorted[r.topk_group])) return true;
    // (a group-score tie that is exact in double and not in float32 cannot come from grid logits >= 0)
    std::vector<bool> keep(static_cast<size_t>(r.n_group), false);
    for (int64_t g = 0; g < r.n_group; ++g) {
      int rank = 0;
      for (int64_t h = 0; h < r.n_group; ++h) rank += gs[h] > gs[g] || (gs[h] == gs[g] && h < g);
      keep[g] = rank < r.topk_group;
    }
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) c[e] = 0.0;
  }
  std::vector<double> sorted = c;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  for (int64_t i = 0; i < std::min<int64_t>(r.top_k, E - 1); ++i)
    if (close(sorted[i], sorted[i + 1])) return true;
  return false;
}
struct RoutingInput {
  std::vector<float> logits, bias;
  long redrawn = 0;
};
RoutingInput make_routing_input(const RouteCase& rc, int64_t T) {
  const int64_t E = rc.rule.num_experts;
  RoutingInput in;
  if (rc.bias_lo != 0 || rc.bias_hi != 0) {
    std::uniform_real_distribution<float> u(rc.bias_lo, rc.bias_hi);
    in.bias.resize(static_cast<size_t>(E));
    for (float& b : in.bias) b = u(g_rng);
  }
  in.logits.resize(static_cast<size_t>(T * E));
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int64_t t = 0; t < T; ++t) {
    float* l = in.logits.data() + t * E;
    for (int attempt = 0; attempt < 100; ++attempt) {
      for (int64_t e = 0; e < E; ++e) l[e] = rc.logits_kind == 1 ? static_cast<float>(g_rng() % 17) * 0.25f : nd(g_rng);
      if (!near_tie(rc.rule, l, in.bias)) break;
      ++in.redrawn;
    }
  }
  return in;
}
struct RoutingOut {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};
RoutingOut run_routing_device(const be::MoeRoutingRule& rule, const RoutingInput& in, int64_t T) {
  const int64_t E = rule.num_experts, kk = rule.top_k;
  DeviceBuffer<float> dl(static_cast<size_t>(T * E)), db(std::max<size_t>(in.bias.size(), 1)),
      dw(static_cast<size_t>(T * kk));
  DeviceBuffer<int32_t> di(static_cast<size_t>(T * kk));
  dl.upload(in.logits);
  if (!in.bias.empty()) db.upload(in.bias);
  di.poison();
  dw.poison();
  k::MoeRoutingParams p = device_rule(rule);
  p.tokens = T;
  p.logits = dl.ptr;
  p.bias = in.bias.empty() ? nullptr : db.ptr;
  p.ids = di.ptr;
  p.weights = dw.ptr;
  CUDA_TRY(k::run_moe_routing(p));
  CUDA_TRY(cudaDeviceSynchronize());
  return {di.download(), dw.download()};
}
// Returns the device ids (for the permutation checks).
std::vector<int32_t> check_routing(const RouteCase& rc, int64_t T) {
  RoutingInput in = make_routing_input(rc, T);
  RoutingOut got = run_routing_device(rc.rule, in, T);
  const int64_t E = rc.rule.num_experts, kk = rc.rule.top_k;
  long id_mismatch = 0, unwritten = 0;
  double worst_w = 0;
  std::vector<int32_t> ids;
  std::vector<float> w;
  for (int64_t t = 0; t < T; ++t) {
    be::route_token(rc.rule, in.logits.data() + t * E, in.bias, ids, w);
    for (int64_t s = 0; s < kk; ++s) {
      const int32_t gi = got.ids[t * kk + s];
      const float gw = got.weights[t * kk + s];
      if (gi < 0 || !std::isfinite(gw)) ++unwritten;
      if (gi != ids[s]) ++id_mismatch;
      worst_w = std::max(worst_w, std::fabs(static_cast<double>(gw) - w[s]) / (std::fabs(w[s]) + 1e-30));
    }
  }
  if (unwritten) worst_w = INFINITY;
  char name[96], extra[96];
  std::snprintf(name, sizeof(name), "%s_T%lld", rc.name, static_cast<long long>(T));
  std::snprintf(extra, sizeof(extra), ",\"tokens_redrawn_for_near_ties\":%ld", in.redrawn);
  report_check("moe_routing", name, worst_w, 1e-5, id_mismatch, unwritten, extra);

  // run_moe_route_and_permute (one CTA up to 256 entries, else the two launches): the same ids and weights, bit
  // for bit, and the permutation the reference builds from them (the by_expert lists, concatenated).
  {
    const int64_t entries = T * kk;
    DeviceBuffer<float> dl(static_cast<size_t>(T * E)), db(std::max<size_t>(in.bias.size(), 1)),
        dw(static_cast<size_t>(entries));
    DeviceBuffer<int32_t> di(static_cast<size_t>(entries)), counts(E), offsets(E + 1), sorted(entries),
        position(entries);
    DeviceBuffer<uint8_t> ws(k::moe_permute_workspace_bytes(entries, E));
    dl.upload(in.logits);
    if (!in.bias.empty()) db.upload(in.bias);
    for (auto* b : {&di, &counts, &offsets, &sorted, &position}) b->poison();
    dw.poison();
    k::MoeRoutingParams r = device_rule(rc.rule);
    r.tokens = T;
    r.logits = dl.ptr;
    r.bias = in.bias.empty() ? nullptr : db.ptr;
    r.ids = di.ptr;
    r.weights = dw.ptr;
    k::MoePermuteParams p;
    p.tokens = T;
    p.top_k = kk;
    p.num_experts = E;
    p.ids = di.ptr;
    p.counts = counts.ptr;
    p.offsets = offsets.ptr;
    p.sorted_entries = sorted.ptr;
    p.entry_position = position.ptr;
    p.workspace = ws.ptr;
    CUDA_TRY(k::run_moe_route_and_permute(r, p));
    CUDA_TRY(cudaDeviceSynchronize());
    std::vector<int32_t> fused_ids = di.download();
    std::vector<float> fused_w = dw.download();
    long bad = 0;
    for (int64_t j = 0; j < entries; ++j)
      bad += fused_ids[j] != got.ids[j] || std::memcmp(&fused_w[j], &got.weights[j], sizeof(float)) != 0;
    std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(E));
    for (int64_t j = 0; j < entries; ++j)
      if (got.ids[j] >= 0 && got.ids[j] < E) by_expert[got.ids[j]].push_back(static_cast<int32_t>(j));
    std::vector<int32_t> want_sorted, want_counts, want_offsets{0}, want_pos(static_cast<size_t>(entries), -1);
    for (int64_t e = 0; e < E; ++e) {
      for (int32_t j : by_expert[e]) {
        want_pos[j] = static_cast<int32_t>(want_sorted.size());
        want_sorted.push_back(j);
      }
      want_counts.push_back(static_cast<int32_t>(by_expert[e].size()));
      want_offsets.push_back(static_cast<int32_t>(want_sorted.size()));
    }
    bad += want_counts != counts.download();
    bad += want_offsets != offsets.download();
    bad += want_sorted != sorted.download();
    bad += want_pos != position.download();
    report_check("moe_route_and_permute", name, bad ? INFINITY : 0.0, 0.0, bad, 0);
  }
  return got.ids;
}

// run_moe_router_logits against the dot products in long double: error relative to sum |x_i w_i| (the float
// result's rounding alone is 6e-8 of |logit|).
void check_router_logits(const std::string& name, int64_t T, int64_t E, int64_t hidden, int64_t x_stride) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * x_stride));
  for (uint16_t& v : x) v = float_to_bf16(nd(g_rng));
  std::vector<float> w(static_cast<size_t>(E * hidden));
  for (float& v : w) v = nd(g_rng) * 0.02f;
  DeviceBuffer<uint16_t> dx(x.size());
  DeviceBuffer<float> dw(w.size()), dl(static_cast<size_t>(T * E));
  dx.upload(x);
  dw.upload(w);
  dl.poison();
  k::MoeRouterLogitsParams p;
  p.tokens = T;
  p.num_experts = E;
  p.hidden = hidden;
  p.x = dx.ptr;
  p.x_stride = x_stride;
  p.w = dw.ptr;
  p.w_stride = hidden;
  p.logits = dl.ptr;
  p.logits_stride = E;
  CUDA_TRY(k::run_moe_router_logits(p));
  CUDA_TRY(cudaDeviceSynchronize());
  std::vector<float> got = dl.download();
  double worst = 0.0;
  long non_finite = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      long double dot = 0, mag = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        const long double prod = static_cast<long double>(bf16_to_float(x[t * x_stride + i])) * w[e * hidden + i];
        dot += prod;
        mag += prod < 0 ? -prod : prod;
      }
      const float g = got[t * E + e];
      if (!std::isfinite(g)) ++non_finite;
      worst = std::max(worst, static_cast<double>(std::fabs(static_cast<long double>(g) - dot) / (mag + 1e-30L)));
    }
  report_check("moe_router_logits", name, non_finite ? INFINITY : worst, 1e-7, 0, non_finite);
}

// ---- permutation, gather, combine ----
void check_permute(const std::string& name, const std::vector<int32_t>& ids, int64_t T, int64_t kk, int64_t E) {
  const int64_t entries = T * kk;
  DeviceBuffer<int32_t> dids(ids.size()), counts(E), offsets(E + 1), sorted(entries), position(entries);
  DeviceBuffer<uint8_t> ws(k::moe_permute_workspace_bytes(entries, E));
  dids.upload(ids);
  counts.poison();
  offsets.poison();
  sorted.poison();
  position.poison();
  k::MoePermuteParams p;
  p.tokens = T;
  p.top_k = kk;
  p.num_experts = E;
  p.ids = dids.ptr;
  p.counts = counts.ptr;
  p.offsets = offsets.ptr;
  p.sorted_entries = sorted.ptr;
  p.entry_position = position.ptr;
  p.workspace = ws.ptr;
  CUDA_TRY(k::run_moe_permute(p));
  CUDA_TRY(cudaDeviceSynchronize());
  // Reference: deepseek_model.cpp's by_expert lists (tokens in order, per expert), concatenated by expert.
  std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < kk; ++s) by_expert[ids[t * kk + s]].push_back(static_cast<int32_t>(t * kk + s));
  std::vector<int32_t> want_sorted, want_counts, want_offsets{0}, want_pos(static_cast<size_t>(entries));
  for (int64_t e = 0; e < E; ++e) {
    for (int32_t j : by_expert[e]) {
      want_pos[j] = static_cast<int32_t>(want_sorted.size());
      want_sorted.push_back(j);
    }
    want_counts.push_back(static_cast<int32_t>(by_expert[e].size()));
    want_offsets.push_back(static_cast<int32_t>(want_sorted.size()));
  }
  long bad = 0;
  bad += want_counts != counts.download();
  bad += want_offsets != offsets.download();
  std::vector<int32_t> gs = sorted.download(), gp = position.download();
  long unwritten = 0;
  for (int64_t j = 0; j < entries; ++j) {
    unwritten += gs[j] < 0 || gp[j] < 0;
    bad += gs[j] != want_sorted[j];
    bad += gp[j] != want_pos[j];
  }
  report_check("moe_permute", name, bad == 0 && unwritten == 0 ? 0.0 : INFINITY, 0.0, bad, unwritten);

  // Gather and combine on the same permutation (hidden 7168 and an odd 100).
  for (int64_t hidden : {int64_t{7168}, int64_t{100}}) {
    if (entries * hidden > (int64_t{1} << 25)) continue;  // host reference cost
    std::vector<uint16_t> x(static_cast<size_t>(T * hidden)), eo(static_cast<size_t>(entries * hidden)),
        base(static_cast<size_t>(T * hidden));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto* v : {&x, &eo, &base})
      for (uint16_t& b : *v) b = float_to_bf16(nd(g_rng));
    std::vector<float> wts(static_cast<size_t>(entries));
    std::uniform_real_distribution<float> u(0.05f, 1.0f);
    for (float& w : wts) w = u(g_rng);
    DeviceBuffer<uint16_t> dx(x.size()), dperm(eo.size()), deo(eo.size()), dbase(base.size()), dout(base.size());
    DeviceBuffer<float> dw(wts.size());
    dx.upload(x);
    deo.upload(eo);
    dbase.upload(base);
    dw.upload(wts);
    dperm.poison();
    k::MoeGatherParams gp2;
    gp2.entries = entries;
    gp2.top_k = kk;
    gp2.hidden = hidden;
    gp2.x = dx.ptr;
    gp2.sorted_entries = sorted.ptr;
    gp2.permuted = dperm.ptr;
    CUDA_TRY(k::run_moe_gather(gp2));
    CUDA_TRY(cudaDeviceSynchronize());
    std::vector<uint16_t> perm = dperm.download();
    long gbad = 0;
    for (int64_t q = 0; q < entries; ++q)
      gbad += std::memcmp(perm.data() + q * hidden, x.data() + (want_sorted[q] / kk) * hidden, hidden * 2) != 0;
    report_check("moe_gather", name + "_h" + std::to_string(hidden), gbad ? INFINITY : 0.0, 0.0, gbad, 0);
    for (bool with_base : {true, false}) {
      dout.poison();
      k::MoeCombineParams cp;
      cp.tokens = T;
      cp.top_k = kk;
      cp.hidden = hidden;
      cp.expert_out = deo.ptr;
      cp.entry_position = position.ptr;
      cp.weights = dw.ptr;
      cp.base = with_base ? dbase.ptr : nullptr;
      cp.out = dout.ptr;
      CUDA_TRY(k::run_moe_combine(cp));
      CUDA_TRY(cudaDeviceSynchronize());
      std::vector<uint16_t> out = dout.download();
      // The model's accumulation: ffn = shared (or 0), then += w · expert_out per expert, experts ascending.
      Cmp c;
      std::vector<float> acc(static_cast<size_t>(hidden));
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < hidden; ++i) acc[i] = with_base ? bf16_to_float(base[t * hidden + i]) : 0.0f;
        std::vector<int64_t> slots(static_cast<size_t>(kk));
        for (int64_t s = 0; s < kk; ++s) slots[s] = s;
        std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[t * kk + a] < ids[t * kk + b]; });
        for (int64_t s : slots) {
          const int64_t row = want_pos[t * kk + s];
          for (int64_t i = 0; i < hidden; ++i) acc[i] += wts[t * kk + s] * bf16_to_float(eo[row * hidden + i]);
        }
        for (int64_t i = 0; i < hidden; ++i) c.add(bf16_to_float(out[t * hidden + i]), acc[i]);
      }
      report_check("moe_combine", name + "_h" + std::to_string(hidden) + (with_base ? "_base" : ""), c.rel(), 1e-2,
                   0, c.non_finite);
    }
  }
}
// ids with heavy collisions: every token picks k distinct experts out of the first `hot` ones.
std::vector<int32_t> skewed_ids(int64_t T, int64_t kk, int64_t hot) {
  std::vector<int32_t> ids(static_cast<size_t>(T * kk));
  std::vector<int32_t> pool(static_cast<size_t>(hot));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < hot; ++e) pool[e] = static_cast<int32_t>(e);
    std::shuffle(pool.begin(), pool.end(), g_rng);
    for (int64_t s = 0; s < kk; ++s) ids[t * kk + s] = pool[s];
  }
  return ids;
}

// ---- timing ----
__global__ void fill_kernel(uint8_t* p, size_t n_words, uint64_t seed, int mode) {
  // mode 0: bf16 pairs uniform in [-2, 2); mode 1: f32 normal-ish in [-4, 4)
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n_words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float a = static_cast<float>(r >> 40) * (1.0f / 16777216.0f), b = static_cast<float>((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    if (mode == 0) {
      reinterpret_cast<__nv_bfloat162*>(p)[i] = __floats2bfloat162_rn(4.0f * a - 2.0f, 4.0f * b - 2.0f);
    } else {
      reinterpret_cast<float*>(p)[i] = 4.0f * (a + b - 1.0f);
    }
  }
}
void fill(void* p, size_t bytes, uint64_t seed, int mode) {
  fill_kernel<<<1024, 256>>>(static_cast<uint8_t*>(p), bytes / 4, seed, mode);
  CUDA_TRY(cudaGetLastError());
}

size_t g_l2 = 0;
int sets_for(double bytes) {
  return static_cast<int>(std::clamp<double>(3.0 * static_cast<double>(g_l2) / bytes + 1, 2, 64));
}
void bench_row(const std::string& name, double bytes, const std::function<void(int)>& launch, int sets) {
  const int reps = std::max(30, 2 * sets);
  const double us = stats_of(time_events(launch, std::max(3, sets), reps)).median_us;
  const double gbps = bytes / (us * 1e-6) / 1e9;
  const double floor_us = g_copy_gbps > 0 ? bytes / (g_copy_gbps * 1e3) : 0;
  const double pct = g_copy_gbps > 0 ? 100.0 * gbps / g_copy_gbps : 0;
  std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"bytes\":%.0f,\"sets\":%d,\"median_us\":%.2f,\"gbps\":%.0f,"
              "\"pct_copy\":%.1f,\"floor_us\":%.2f}\n",
              name.c_str(), bytes, sets, us, gbps, pct, floor_us);
  std::fflush(stdout);
  g_rows.push_back({name, us, bytes, gbps, pct, floor_us, -1, false, true});
}

// A pool of `sets` copies of a buffer (rotated so that timings do not run from L2).
struct Pool {
  DeviceBuffer<uint8_t> buf;
  size_t each = 0;
  Pool(size_t bytes, int sets, uint64_t seed, int mode) : buf(((bytes + 255) / 256 * 256) * sets), each((bytes + 255) / 256 * 256) {
    fill(buf.ptr, buf.count, seed, mode);
  }
  void* at(int i) { return buf.ptr + each * static_cast<size_t>(i); }
};

void bench_all() {
  const int64_t H = 7168, kk = 8, E = 256;
  for (int64_t T : {int64_t{128}, int64_t{8192}}) {
    char tbuf[32];
    std::snprintf(tbuf, sizeof(tbuf), "T%lld ", static_cast<long long>(T));
    const std::string t = tbuf;
    {  // rms_norm hidden (plain and fused residual), kv_a (512 of 576), q_a (1536)
      struct N {
        const char* name;
        int64_t dim, stride;
        bool residual;
      };
      for (N n : {N{"rms_norm h7168", H, H, false}, N{"rms_norm+residual h7168", H, H, true},
                  N{"rms_norm kv_a 512/576", 512, 576, false}, N{"rms_norm q_a 1536", 1536, 1536, false}}) {
        const double bytes = 2.0 * T * n.dim * (n.residual ? 4 : 2) + 2.0 * n.dim;
        const int sets = sets_for(bytes);
        Pool x(2 * T * n.stride, sets, 1, 0), r(n.residual ? 2 * T * n.stride : 4, n.residual ? sets : 1, 2, 0),
            y(2 * T * n.stride, sets, 3, 0), w(2 * n.dim, 1, 4, 0);
        bench_row(t + n.name, bytes, [&](int i) {
          k::RmsNormParams p;
          p.rows = T;
          p.dim = n.dim;
          p.stride = n.stride;
          p.x = x.at(i % sets);
          p.weight = w.at(0);
          p.residual = n.residual ? r.at(i % sets) : nullptr;
          p.y = y.at(i % sets);
          CUDA_TRY(k::run_rms_norm(p));
        }, sets);
      }
    }
    {  // silu_mul: dense V3 (18432) and the routed experts' rows (T*8 x 2048)
      struct S {
        const char* name;
        int64_t rows, n;
      };
      for (S s : {S{"silu_mul dense 18432", T, 18432}, S{"silu_mul experts 8T x 2048", T * kk, 2048}}) {
        const double bytes = 2.0 * s.rows * 3 * s.n;
        const int sets = sets_for(bytes);
        Pool gu(4 * s.rows * s.n, sets, 5, 0), out(2 * s.rows * s.n, sets, 6, 0);
        bench_row(t + s.name, bytes, [&](int i) {
          k::SiluMulParams p;
          p.rows = s.rows;
          p.n = s.n;
          p.gate_up = gu.at(i % sets);
          p.out = out.at(i % sets);
          CUDA_TRY(k::run_silu_mul(p));
        }, sets);
      }
    }
    {  // rope: q (T*128 heads x 64, contiguous, 128 per position) and k (T x 64 at stride 576)
      std::vector<int32_t> pos(static_cast<size_t>(T));
      for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(1000 + i);
      DeviceBuffer<int32_t> dpos(pos.size());
      dpos.upload(pos);
      std::vector<float> inv = make_inv_freq(64);
      DeviceBuffer<float> dinv(inv.size());
      dinv.upload(inv);
      struct R {
        const char* name;
        int64_t rows, stride, vpp;
      };
      for (R r : {R{"rope q 128h x 64", T * 128, 64, 128}, R{"rope k 64/576", T, 576, 1}}) {
        const double bytes = 2.0 * 2 * r.rows * 64 + 4.0 * T;
        const int sets = sets_for(bytes);
        Pool x(2 * r.rows * r.stride, sets, 7, 0);
        bench_row(t + r.name, bytes, [&](int i) {
          k::RopeParams p;
          p.rows = r.rows;
          p.dim = 64;
          p.stride = r.stride;
          p.vectors_per_position = r.vpp;
          p.x = x.at(i % sets);
          p.positions = dpos.ptr;
          p.inv_freq = dinv.ptr;
          p.attention_factor = 1.3689f;
          CUDA_TRY(k::run_rope(p));
        }, sets);
      }
    }
    // routing V3 (256 experts, top-8, 8 groups / 4) -> permute -> gather -> combine
    {
      const double rbytes = 4.0 * T * E + 8.0 * T * kk + 4.0 * E;
      const int sets = sets_for(rbytes);
      Pool logits(4 * T * E, sets, 8, 1), bias(4 * E, 1, 9, 1);
      DeviceBuffer<int32_t> ids(static_cast<size_t>(T * kk) * sets);
      DeviceBuffer<float> wts(static_cast<size_t>(T * kk) * sets);
      k::MoeRoutingParams rp = device_rule(make_rule(be::MoeRoutingRule::Scoring::kSigmoid, be::MoeRoutingRule::TopK::kNoauxTc,
                                                     E, kk, 8, 4, true, true, 2.5));
      rp.tokens = T;
      rp.bias = static_cast<const float*>(bias.at(0));
      auto route = [&](int i) {
        k::MoeRoutingParams p = rp;
        p.logits = static_cast<const float*>(logits.at(i % sets));
        p.ids = ids.ptr + static_cast<size_t>(T * kk) * (i % sets);
        p.weights = wts.ptr + static_cast<size_t>(T * kk) * (i % sets);
        CUDA_TRY(k::run_moe_routing(p));
      };
      bench_row(t + "moe_routing V3 256e top8", rbytes, route, sets);
      const int64_t entries = T * kk;
      DeviceBuffer<int32_t> counts(E), offsets(E + 1), sorted(entries), position(entries);
      DeviceBuffer<uint8_t> ws(k::moe_permute_workspace_bytes(entries, E));
      const double pbytes = 4.0 * entries * 3 + 8.0 * E;
      bench_row(t + "moe_permute (counts, offsets, order)", pbytes, [&](int i) {
        k::MoePermuteParams p;
        p.tokens = T;
        p.top_k = kk;
        p.num_experts = E;
        p.ids = ids.ptr + static_cast<size_t>(entries) * (i % sets);
        p.counts = counts.ptr;
        p.offsets = offsets.ptr;
        p.sorted_entries = sorted.ptr;
        p.entry_position = position.ptr;
        p.workspace = ws.ptr;
        CUDA_TRY(k::run_moe_permute(p));
      }, sets);
      CUDA_TRY(cudaDeviceSynchronize());  // sorted/position now from set (last % sets): a valid permutation
      const double gbytes = 2.0 * T * H + 2.0 * entries * H + 4.0 * entries;
      const int gsets = sets_for(gbytes);
      Pool x(2 * T * H, gsets, 10, 0), perm(2 * entries * H, gsets, 11, 0), out(2 * T * H, gsets, 12, 0);
      bench_row(t + "moe_gather 8T x 7168", gbytes, [&](int i) {
        k::MoeGatherParams p;
        p.entries = entries;
        p.top_k = kk;
        p.hidden = H;
        p.x = static_cast<const uint16_t*>(x.at(i % gsets));
        p.sorted_entries = sorted.ptr;
        p.permuted = static_cast<uint16_t*>(perm.at(i % gsets));
        CUDA_TRY(k::run_moe_gather(p));
      }, gsets);
      const double cbytes = 2.0 * entries * H + 2.0 * 2 * T * H + 8.0 * entries;
      bench_row(t + "moe_combine 8T x 7168 + base", cbytes, [&](int i) {
        k::MoeCombineParams p;
        p.tokens = T;
        p.top_k = kk;
        p.hidden = H;
        p.expert_out = static_cast<const uint16_t*>(perm.at(i % gsets));
        p.entry_position = position.ptr;
        p.weights = wts.ptr;
        p.base = static_cast<const uint16_t*>(x.at(i % gsets));
        p.out = static_cast<uint16_t*>(out.at(i % gsets));
        CUDA_TRY(k::run_moe_combine(p));
      }, gsets);
    }
  }
}

// Sampling 256 rows of DeepSeek-V3's 129,280-token vocabulary (values in [-4, 4)): temperature 0.8 with top_p 0.9
// (flat rows: the top-p set is most of the vocabulary, the kernel's worst case), a peaked temperature, top_k 50, no
// cut, and the radix fallback forced; and the logprobs kernel with 20 alternatives per row. The bytes are one read
// of the logits (the floor); the kernels pass over each row 2-4 times (sampling) or 3 (logprobs).
void bench_sampling() {
  const int64_t rows = 256, vocab = 129280;
  const double bytes = static_cast<double>(rows * vocab * 4);
  const int sets = sets_for(bytes);
  Pool logits(static_cast<size_t>(bytes), sets, 91, 1);
  std::vector<k::SampleRowParams> host(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    host[r].temperature = 0.8f;
    host[r].top_p = 0.9f;
    host[r].seed = 7;
    host[r].counter = static_cast<uint64_t>(r);
    host[r].logprobs = 20;
  }
  DeviceBuffer<k::SampleRowParams> params(host.size());
  CUDA_TRY(cudaMemcpy(params.ptr, host.data(), host.size() * sizeof(k::SampleRowParams), cudaMemcpyHostToDevice));
  DeviceBuffer<int32_t> ids(static_cast<size_t>(rows)), top_ids(static_cast<size_t>(rows * k::kMaxTopLogprobs));
  DeviceBuffer<float> top_logprobs(static_cast<size_t>(rows * k::kMaxTopLogprobs));
  DeviceBuffer<double> normaliser(static_cast<size_t>(rows));
  struct Timed {
    const char* name;
    float temperature;
    int32_t top_k;
    float top_p;
    int64_t capacity;
  };
  for (const Timed& t : {Timed{"top_p 0.9, T 0.8 (flat rows: most of the vocabulary kept)", 0.8f, -1, 0.9f, 0},
                         Timed{"top_p 0.9, T 0.05 (peaked: ~150 tokens kept)", 0.05f, -1, 0.9f, 0},
                         Timed{"top_k 50 + top_p 0.9, T 0.8", 0.8f, 50, 0.9f, 0},
                         Timed{"temperature 0.8 alone", 0.8f, -1, 1.0f, 0},
                         Timed{"top_p 0.9, T 0.8, radix fallback (capacity 1)", 0.8f, -1, 0.9f, 1}}) {
    for (int64_t r = 0; r < rows; ++r) {
      host[r].temperature = t.temperature;
      host[r].top_k = t.top_k;
      host[r].top_p = t.top_p;
    }
    CUDA_TRY(cudaMemcpy(params.ptr, host.data(), host.size() * sizeof(k::SampleRowParams), cudaMemcpyHostToDevice));
    bench_row(std::string("sample 256 x 129280 ") + t.name, bytes, [&](int i) {
      k::SampleParams p;
      p.rows = rows;
      p.cols = vocab;
      p.logits = static_cast<const float*>(logits.at(i % sets));
      p.row_params = params.ptr;
      p.ids = ids.ptr;
      p.candidate_capacity = t.capacity;
      CUDA_TRY(k::run_sample(p));
    }, sets);
  }
  bench_row("logprobs 256 x 129280, 20 alternatives", bytes, [&](int i) {
    k::LogprobsParams p;
    p.rows = rows;
    p.cols = vocab;
    p.logits = static_cast<const float*>(logits.at(i % sets));
    p.row_params = params.ptr;
    p.normaliser = normaliser.ptr;
    p.top_ids = top_ids.ptr;
    p.top_logprobs = top_logprobs.ptr;
    CUDA_TRY(k::run_logprobs(p));
  }, sets);
}

void measure_copy() {
  const size_t bytes = size_t{2} << 30;
  const double us = time_d2d_copy(bytes, [](uint8_t* src, size_t n) { fill(src, n, 77, 0); }, 3, 20).median_us;
  g_copy_gbps = 2.0 * bytes / (us * 1e-6) / 1e9;
  std::printf("{\"kind\":\"ceiling\",\"name\":\"d2d_copy\",\"bytes\":%zu,\"median_us\":%.1f,\"gbps_read_plus_write\":%.1f}\n",
              bytes, us, g_copy_gbps);
  std::fflush(stdout);
}

void print_summary() {
  std::printf("\n%-52s %9s %9s %7s %9s %10s\n", "case", "us", "GB/s", "%copy", "floor_us", "err");
  std::printf("%-52s %9s %9.0f %7s %9s %10s\n", "ceiling: d2d copy (read + write)", "-", g_copy_gbps, "100", "-", "-");
  int checks = 0, failed = 0;
  double worst_bf16 = 0;
  for (const Row& r : g_rows) {
    if (r.check) {
      ++checks;
      failed += !r.ok;
      if (!r.ok) std::printf("%-52s %9s %9s %7s %9s %10.2e FAIL\n", r.name.substr(0, 52).c_str(), "-", "-", "-", "-", r.err);
      if (r.name.find("bf16") != std::string::npos) worst_bf16 = std::max(worst_bf16, r.err);
      continue;
    }
    std::printf("%-52s %9.2f %9.0f %7.1f %9.2f %10s\n", r.name.c_str(), r.us, r.gbps, r.pct, r.floor_us, "-");
  }
  std::printf("ops checks: %d run, %d failed (worst bf16 rel err %.2e); all ops checks: %s\n", checks, failed,
              worst_bf16, g_all_ok ? "PASS" : "FAIL");
}

// The sampling kernel's paths against each other on the same draws: the default (candidates in shared memory when
// they fit), candidate capacities 256 and 16 (the crossing bin alone, or the radix fallback) and 1 (the radix
// fallback nearly always). Rows of 129,280 values: smooth ones, peaked ones (x 12) and ones with few distinct values
// (ties by the thousand: the radix fallback even by default). A draw may differ only when u * total or a cut lies
// within rounding of a boundary (the paths sum masses in different orders): at most 0.2% of draws.
void check_sampling_paths() {
  const int64_t rows = 64, vocab = 129280;
  std::vector<float> host(static_cast<size_t>(rows * vocab));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < vocab; ++c) {
      const uint64_t x = splitmix64(0x5a3 * 1000003ull + static_cast<uint64_t>(r * vocab + c));
      const float a = static_cast<float>(x >> 40) / 16777216.0f, b = static_cast<float>((x >> 16) & 0xffffff) / 16777216.0f;
      float v = 4.0f * (a + b - 1.0f);
      if (r % 4 == 1) v *= 12.0f;                   // peaked
      if (r % 4 == 3) v = std::round(v * 2.0f) / 2.0f;  // 17 distinct values
      host[static_cast<size_t>(r * vocab + c)] = v;
    }
  }
  DeviceBuffer<float> logits(host.size());
  CUDA_TRY(cudaMemcpy(logits.ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  struct Set {
    const char* name;
    float temperature;
    int32_t top_k;
    float top_p, min_p;
  };
  const Set sets[] = {{"top_p 0.9 T 0.8", 0.8f, -1, 0.9f, 0.0f},      {"top_k 50", 1.0f, 50, 1.0f, 0.0f},
                      {"top_k 5000", 1.0f, 5000, 1.0f, 0.0f},           {"top_k 100000 + top_p 0.5", 1.3f, 100000, 0.5f, 0.0f},
                      {"top_k 40 + top_p 0.95 + min_p 0.02", 0.9f, 40, 0.95f, 0.02f},
                      {"top_p 0.9 T 0.05", 0.05f, -1, 0.9f, 0.0f},    {"min_p 0.1", 1.0f, -1, 1.0f, 0.1f},
                      {"temperature 1", 1.0f, -1, 1.0f, 0.0f},        {"top_p 0.999 + min_p 0.001", 1.0f, -1, 0.999f, 0.001f}};
  DeviceBuffer<k::SampleRowParams> params(static_cast<size_t>(rows));
  DeviceBuffer<int32_t> ids(static_cast<size_t>(rows));
  for (const Set& set : sets) {
    long draws = 0, mismatches = 0;
    for (uint64_t counter = 0; counter < 6; ++counter) {
      std::vector<k::SampleRowParams> rp(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        rp[r].temperature = set.temperature;
        rp[r].top_k = set.top_k;
        rp[r].top_p = set.top_p;
        rp[r].min_p = set.min_p;
        rp[r].seed = 11 + static_cast<uint64_t>(r);
        rp[r].counter = counter;
      }
      CUDA_TRY(cudaMemcpy(params.ptr, rp.data(), rp.size() * sizeof(rp[0]), cudaMemcpyHostToDevice));
      std::vector<int32_t> want;
      for (int64_t capacity : {int64_t{0}, int64_t{256}, int64_t{16}, int64_t{1}}) {
        k::SampleParams p;
        p.rows = rows;
        p.cols = vocab;
        p.logits = logits.ptr;
        p.row_params = params.ptr;
        p.ids = ids.ptr;
        p.candidate_capacity = capacity;
        CUDA_TRY(k::run_sample(p));
        std::vector<int32_t> got(static_cast<size_t>(rows));
        CUDA_TRY(cudaMemcpy(got.data(), ids.ptr, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
        if (capacity == 0) {
          want = got;
          for (int32_t id : got) mismatches += id < 0 || id >= vocab ? 1000000 : 0;  // every row has a token
          continue;
        }
        for (int64_t r = 0; r < rows; ++r) {
          ++draws;
          mismatches += got[r] != want[r] ? 1 : 0;
        }
      }
    }
    report_check("sample_paths", set.name, static_cast<double>(mismatches) / static_cast<double>(draws), 2e-3, 0, 0,
                 ",\"draws\":" + std::to_string(draws) + ",\"differ\":" + std::to_string(mismatches));
  }
  // Logprobs: the candidates in shared memory against the fallback's arg-max passes (capacity 1), 20, 3, 1 and 0
  // alternatives on the same rows: the same ids and floats; both runs' normalisers against the host's (≤ 1e-9).
  std::vector<k::SampleRowParams> rp(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) rp[r].logprobs = std::array<int, 4>{20, 3, 1, 0}[r % 4];
  CUDA_TRY(cudaMemcpy(params.ptr, rp.data(), rp.size() * sizeof(rp[0]), cudaMemcpyHostToDevice));
  DeviceBuffer<double> normaliser(static_cast<size_t>(rows));
  DeviceBuffer<int32_t> top_ids(static_cast<size_t>(rows * k::kMaxTopLogprobs));
  DeviceBuffer<float> top_logprobs(static_cast<size_t>(rows * k::kMaxTopLogprobs));
  std::vector<double> normalisers[2];
  std::vector<int32_t> ids_of[2];
  std::vector<float> values_of[2];
  for (int pass = 0; pass < 2; ++pass) {
    k::LogprobsParams p;
    p.rows = rows;
    p.cols = vocab;
    p.logits = logits.ptr;
    p.row_params = params.ptr;
    p.normaliser = normaliser.ptr;
    p.top_ids = top_ids.ptr;
    p.top_logprobs = top_logprobs.ptr;
    p.candidate_capacity = pass == 0 ? 0 : 1;
    CUDA_TRY(k::run_logprobs(p));
    normalisers[pass].resize(static_cast<size_t>(rows));
    ids_of[pass].resize(static_cast<size_t>(rows * k::kMaxTopLogprobs));
    values_of[pass].resize(static_cast<size_t>(rows * k::kMaxTopLogprobs));
    CUDA_TRY(cudaMemcpy(normalisers[pass].data(), normaliser.ptr, rows * sizeof(double), cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(ids_of[pass].data(), top_ids.ptr, ids_of[pass].size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(values_of[pass].data(), top_logprobs.ptr, values_of[pass].size() * sizeof(float),
                        cudaMemcpyDeviceToHost));
  }
  long differ = 0, entries = 0;
  double worst = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    // The normaliser against the host's max + log(sum exp(l - max)) in double (run_logprobs' contract).
    float m = -INFINITY;
    for (int64_t c = 0; c < vocab; ++c) m = std::max(m, host[static_cast<size_t>(r * vocab + c)]);
    double sum = 0.0;
    for (int64_t c = 0; c < vocab; ++c) sum += std::exp(static_cast<double>(host[static_cast<size_t>(r * vocab + c)]) - m);
    const double want = static_cast<double>(m) + std::log(sum);
    worst = std::max({worst, std::abs(normalisers[0][r] - want), std::abs(normalisers[1][r] - want)});
    for (int j = 0; j < k::kMaxTopLogprobs; ++j) {
      const size_t e = static_cast<size_t>(r * k::kMaxTopLogprobs + j);
      ++entries;
      const bool same = ids_of[0][e] == ids_of[1][e] && (ids_of[0][e] < 0 || values_of[0][e] == values_of[1][e]);
      differ += same ? 0 : 1;
      const int want = rp[r].logprobs;
      if ((j < want) != (ids_of[0][e] >= 0)) ++differ;  // every asked-for entry filled, the rest -1
    }
  }
  report_check("logprobs_paths", "shared candidates vs arg-max passes, 20/3/1/0 alternatives", worst, 1e-9, differ,
               0, ",\"entries\":" + std::to_string(entries));
}

// DSpark's greedy heads (kernels/cuda/dspark_heads.cu) against their definition on the host: every entry's Markov
// value (base + w2[i][0] e[0] + ..., each operation rounded, as the host build computes it), std::max_element's
// first largest, finish_argmax's ids (with a compact draft vocabulary: the ids outside it count as logit 0), and the
// confidence sigmoid(confidence . [h ; e]) in double. Cases the demo model does not reach: every value negative, a
// draft vocabulary smaller than a CTA, NaN inside a row (the whole-row path) and at entry 0 (-1, and the chain's
// later rows -1), no row norms (no pruning).
void check_dspark_heads() {
  struct Case {
    const char* name;
    int64_t n, vocab;
    float shift;     // added to every base logit
    bool compact;    // draft vocabulary: the even ids
    bool norms;
    int nan_entry;   // -1: none; else row 1 of chain 0 gets a NaN there
  };
  const Case cases[] = {{"n 129280, mixed", 129280, 129280, 0.0f, false, true, -1},
                        {"n 100, all negative", 100, 100, -6.0f, false, true, -1},
                        {"n 5000 compact, all negative", 5000, 10000, -6.0f, true, true, -1},
                        {"n 5000 compact, positive", 5000, 10000, 6.0f, true, true, -1},
                        {"n 9000, NaN at 4321", 9000, 9000, 0.0f, false, true, 4321},
                        {"n 9000, NaN at 0", 9000, 9000, 0.0f, false, true, 0},
                        {"n 20000, no norms", 20000, 20000, -1.0f, false, false, -1}};
  const int64_t chains = 3, gamma = 4, rank = 16, hidden = 160;
  const std::vector<int32_t> lengths = {4, 2, 0}, previous = {7, 1234 % 100, 42};
  uint64_t seed = 0xd5a7;
  auto uniform = [&](double lo, double hi) {
    const uint64_t x = splitmix64(seed++);
    return static_cast<float>(lo + (hi - lo) * static_cast<double>(x >> 11) / 9007199254740992.0);
  };
  for (const Case& cs : cases) {
    const size_t n = static_cast<size_t>(cs.n), rows = static_cast<size_t>(chains * gamma);
    std::vector<float> base(rows * n), w1(static_cast<size_t>(cs.vocab * rank)), w2(n * rank), norm(n),
        conf(static_cast<size_t>(hidden + rank));
    std::vector<uint16_t> h(rows * static_cast<size_t>(hidden));
    std::vector<int32_t> active;
    for (float& v : base) v = cs.shift + uniform(-2.0, 2.0);
    for (float& v : w1) v = uniform(-0.5, 0.5);
    for (float& v : w2) v = uniform(-0.5, 0.5);
    for (float& v : conf) v = uniform(-0.1, 0.1);
    for (uint16_t& v : h) v = float_to_bf16(uniform(-1.0, 1.0));
    if (cs.nan_entry >= 0) base[1 * n + static_cast<size_t>(cs.nan_entry)] = NAN;
    float norm_max = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      double squares = 0.0;
      for (int64_t j = 0; j < rank; ++j) squares += static_cast<double>(w2[i * rank + j]) * w2[i * rank + j];
      norm[i] = static_cast<float>(std::sqrt(squares) * (1.0 + 1e-6));
      norm_max = std::max(norm_max, norm[i]);
    }
    int32_t outside = static_cast<int32_t>(cs.vocab);
    if (cs.compact) {
      for (size_t i = 0; i < n; ++i) active.push_back(static_cast<int32_t>(2 * i));
      outside = 1;
    }
    // The host's definition, chain by chain.
    std::vector<int32_t> want(rows, 0);
    std::vector<double> want_conf(rows, 0.0);
    for (int64_t c = 0; c < chains; ++c) {
      int32_t prev = c == 1 ? previous[1] % static_cast<int32_t>(cs.vocab) : previous[c];
      for (int64_t k = 0; k < lengths[c]; ++k) {
        const size_t row = static_cast<size_t>(c * gamma + k);
        if (prev < 0) {
          want[row] = -1;
          continue;
        }
        const float* e = w1.data() + static_cast<size_t>(prev) * rank;
        std::vector<float> value(n);
        for (size_t i = 0; i < n; ++i) {
          volatile float sum = base[row * n + i];  // no contraction: each product and sum rounded
          for (int64_t j = 0; j < rank; ++j) {
            volatile float product = w2[i * rank + j] * e[j];
            sum = sum + product;
          }
          value[i] = sum;
        }
        const size_t best = static_cast<size_t>(std::max_element(value.begin(), value.end()) - value.begin());
        int32_t id = -1;
        if (std::isfinite(value[best])) {
          id = cs.compact ? active[best] : static_cast<int32_t>(best);
          if (cs.compact && !(value[best] > 0.0f)) id = value[best] < 0.0f ? outside : std::min(id, outside);
        }
        double z = 0.0;
        for (int64_t j = 0; j < hidden; ++j) {
          uint32_t bits = static_cast<uint32_t>(h[row * hidden + j]) << 16;
          float hj;
          std::memcpy(&hj, &bits, 4);
          z += static_cast<double>(conf[j]) * hj;
        }
        for (int64_t j = 0; j < rank; ++j) z += static_cast<double>(conf[hidden + j]) * e[j];
        want[row] = id;
        want_conf[row] = 1.0 / (1.0 + std::exp(-z));
        prev = id;
      }
    }
    DeviceBuffer<float> d_base(base.size()), d_w1(w1.size()), d_w2(w2.size()), d_norm(norm.size()), d_conf(conf.size());
    DeviceBuffer<uint16_t> d_h(h.size());
    DeviceBuffer<int32_t> d_active(std::max<size_t>(active.size(), 1)), d_prev(3), d_len(3), d_drafts(rows);
    DeviceBuffer<double> d_confidences(rows);
    DeviceBuffer<char> scratch(k::dspark_greedy_scratch_bytes(chains, gamma, cs.n));
    d_base.upload(base);
    d_w1.upload(w1);
    d_w2.upload(w2);
    d_norm.upload(norm);
    d_conf.upload(conf);
    d_h.upload(h);
    if (!active.empty()) d_active.upload(active);
    d_prev.upload({previous[0], previous[1] % static_cast<int32_t>(cs.vocab), previous[2]});
    d_len.upload(lengths);
    CUDA_TRY(cudaMemset(d_drafts.ptr, 0, rows * 4));
    CUDA_TRY(cudaMemset(d_confidences.ptr, 0, rows * 8));
    k::DsparkGreedyParams p;
    p.chains = chains;
    p.gamma = gamma;
    p.n = cs.n;
    p.vocab = cs.vocab;
    p.rank = static_cast<int32_t>(rank);
    p.hidden = static_cast<int32_t>(hidden);
    p.logits = d_base.ptr;
    p.h = d_h.ptr;
    p.h_stride = hidden;
    p.w1 = d_w1.ptr;
    p.w2_rows = d_w2.ptr;
    p.w2_norm = cs.norms ? d_norm.ptr : nullptr;
    p.w2_norm_max = norm_max;
    p.confidence = d_conf.ptr;
    p.active = cs.compact ? d_active.ptr : nullptr;
    p.outside = outside;
    p.previous = d_prev.ptr;
    p.lengths = d_len.ptr;
    p.drafts = d_drafts.ptr;
    p.confidences = d_confidences.ptr;
    p.scratch = scratch.ptr;
    CUDA_TRY(k::run_dspark_greedy_chains(p));
    CUDA_TRY(cudaDeviceSynchronize());
    const std::vector<int32_t> got = d_drafts.download();
    const std::vector<double> got_conf = d_confidences.download();
    long bad = 0;
    double err = 0.0;
    for (size_t r = 0; r < rows; ++r) {
      if (got[r] != want[r]) {
        ++bad;
        std::printf("{\"kind\":\"detail\",\"op\":\"dspark_heads\",\"case\":\"%s\",\"row\":%zu,"
                    "\"got\":%d,\"want\":%d}\n",
                    cs.name, r, got[r], want[r]);
      }
      err = std::max(err, std::fabs(got_conf[r] - want_conf[r]));
    }
    report_check("dspark_heads", cs.name, err, 1e-9, bad, 0);
  }
}

void run_checks(bool quick) {
  using S = be::MoeRoutingRule::Scoring;
  using K = be::MoeRoutingRule::TopK;
  for (k::DType dt : {k::DType::kBF16, k::DType::kF32}) {
    check_rms_norm(dt, 128, 7168, 7168, false);
    check_rms_norm(dt, 37, 7168, 7168, true);
    check_rms_norm(dt, 64, 512, 576, false);   // kv_a_layernorm: 512 of each 576-wide row
    check_rms_norm(dt, 50, 1536, 1536, true);  // q_a_layernorm
    check_rms_norm(dt, 7, 1000, 1003, true);   // scalar path
    check_rms_norm(dt, 3, 7, 7, false);
    check_rms_norm(dt, 2, 40000, 40000, false);  // wider than the register path: scalar
    check_silu_mul(dt, 128, 2048);
    check_silu_mul(dt, 9, 18432);
    check_silu_mul(dt, 33, 1408);  // V2-Lite moe_intermediate_size
    check_silu_mul(dt, 5, 13);
    check_rope(dt, 128 * 128, 64, 64, 128);  // q_rope: 128 heads per position
    check_rope(dt, 300, 64, 576, 1);         // k rope inside the latent row
    check_rope(dt, 40 * 16, 64, 192, 16);    // in q directly (qk_head_dim 192), 16 heads
    check_rope(dt, 37, 6, 9, 3);             // scalar path
    check_rope(dt, 11, 48, 48, 2);           // 48 / 8 = 6 lanes per row does not divide 32: scalar path
  }
  check_sampling_paths();
  check_dspark_heads();
  const RouteCase cases[] = {
      {"v3_256e_top8_g8_tg4", make_rule(S::kSigmoid, K::kNoauxTc, 256, 8, 8, 4, true, true, 2.5), 0, -0.1f, 0.1f},
      {"v3_negative_bias", make_rule(S::kSigmoid, K::kNoauxTc, 256, 8, 8, 4, true, true, 2.5), 0, -1.0f, -0.3f},
      {"v3_grid_ties", make_rule(S::kSigmoid, K::kNoauxTc, 256, 8, 8, 4, true, true, 2.5), 1, 0.0f, 0.0f},
      {"v2lite_64e_top6_greedy", make_rule(S::kSoftmax, K::kGreedy, 64, 6, 1, 1, false, false, 1.0), 0, 0.0f, 0.0f},
      {"v2lite_grid_ties", make_rule(S::kSoftmax, K::kGreedy, 64, 6, 1, 1, false, false, 1.0), 1, 0.0f, 0.0f},
      {"v2_160e_top6_group_max", make_rule(S::kSoftmax, K::kGroupLimitedGreedy, 160, 6, 8, 3, false, false, 16.0), 0, 0, 0},
      {"odd_72e_top5_g4_tg2", make_rule(S::kSigmoid, K::kNoauxTc, 72, 5, 4, 2, false, false, 1.5), 0, -0.2f, 0.2f},
      {"odd_500e_top3_norm", make_rule(S::kSoftmax, K::kGreedy, 500, 3, 1, 1, true, false, 1.0), 0, 0, 0},
  };
  for (const RouteCase& rc : cases) {
    for (int64_t T : {int64_t{1}, int64_t{37}, int64_t{quick ? 300 : 8192}}) {
      std::vector<int32_t> ids = check_routing(rc, T);
      if (T > 1)
        check_permute(std::string(rc.name) + "_T" + std::to_string(T), ids, T, rc.rule.top_k, rc.rule.num_experts);
    }
  }
  check_permute("skewed_256e_top8_hot12_T5000", skewed_ids(5000, 8, 12), 5000, 8, 256);
  check_permute("skewed_1024e_top8_hot9_T777", skewed_ids(777, 8, 9), 777, 8, 1024);
  check_permute("T1_top8", skewed_ids(1, 8, 256), 1, 8, 256);
  check_permute("skewed_1024e_top8_hot9_T32", skewed_ids(32, 8, 9), 32, 8, 1024);  // 256 entries: one CTA
  check_permute("skewed_1024e_top8_hot9_T33", skewed_ids(33, 8, 9), 33, 8, 1024);  // 264: the chunked kernels
  // The chunk sizes (fused_ops.cu, perm_items): 1 item a thread up to 4,096 entries, then 2, 4, 8, 16; 72,000
  // entries are 18 chunks of 16 items (the scan's batches of 4 with a remainder).
  for (const int64_t T : {int64_t{700}, int64_t{1500}, int64_t{3000}, int64_t{9000}})
    check_permute("skewed_64e_top8_hot12_T" + std::to_string(T), skewed_ids(T, 8, 12), T, 8, 64);
  check_router_logits("v2lite_T1_64x2048", 1, 64, 2048, 2048);
  check_router_logits("v3_T37_256x7168_strided", 37, 256, 7168, 7168 + 64);
  check_router_logits("odd_T3_72x100", 3, 72, 100, 100);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  try {
    cudaDeviceProp prop{};
    CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    g_l2 = static_cast<size_t>(prop.l2CacheSize);
    std::printf("{\"kind\":\"device\",\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d,\"l2_bytes\":%d}\n", prop.name,
                prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize);
    g_cpu = be::make_cpu_backend();
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"fatal\",\"error\":\"%s\"}\n", ex.what());
    return 2;
  }
  try {
    run_checks(quick);
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"check\",\"op\":\"exception\",\"ok\":false,\"error\":\"%s\"}\n", ex.what());
    g_all_ok = false;
  }
  if (!quick && cudaDeviceSynchronize() == cudaSuccess) {
    try {
      measure_copy();
      bench_all();
      bench_sampling();
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"bench\",\"error\":\"%s\"}\n", ex.what());
    }
  }
  print_summary();
  return g_all_ok ? 0 : 1;
}
