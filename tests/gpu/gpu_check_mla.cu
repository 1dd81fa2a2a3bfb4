// gpu_check_mla: checks the MLA decode kernels (kernels/cuda/mla_decode.cu) against a float64 CPU reference and
// the project's CPU backend, then times them on the issue's cases next to the run's own ceilings (device copy
// bandwidth, cuBLAS bf16 GEMM). Prints JSON lines on stdout ({"kind": "check" | "ceiling" | "bench" | ...}),
// then a short table. Exit status: 0 when every check passed, 1 otherwise (timings never fail it).
//   gpu_check_mla            checks + ceilings + benchmarks
//   gpu_check_mla --quick    the small checks only (for compute-sanitizer)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "deepinfer/kernels/cuda/mla_decode.h"
#include "gpu_check_common.h"
#ifdef DEEPINFER_GPU_CHECK_CPU_BACKEND
#include "deepinfer/backend/backend.h"
#endif

namespace {

namespace k = deepinfer::kernels::cuda;
using namespace deepinfer::gpu_check;

constexpr int kD = k::kMlaEntryDim;
constexpr int kC = k::kMlaLatentDim;
constexpr int kPage = k::kMlaBlockTokens;
constexpr double kTolerance = 1e-2;

// Counter-based random bf16 in [-amplitude, amplitude): splitmix64 of (seed, index).
__global__ void fill_random_bf16(__nv_bfloat16* dst, size_t n, uint64_t seed, float amplitude) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + i);
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16((2.0f * u - 1.0f) * amplitude);
  }
}
void fill_random(uint16_t* dst, size_t n, uint64_t seed, float amplitude) {
  fill_random_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(dst), n, seed, amplitude);
  CUDA_TRY(cudaGetLastError());
}

// One problem instance on the device: cache pages scattered by a random block table, NaN in the unused rows of
// each sequence's last page (the kernels must never let them reach the output).
struct Problem {
  int batch = 0, heads = 0, max_blocks = 0;
  float scale = 0.0f;
  std::vector<int32_t> context, table;  // host copies
  size_t num_pages = 0;
  DeviceBuffer<uint16_t> q, cache, out;
  DeviceBuffer<int32_t> d_table, d_context;
};

Problem make_problem(int batch, int heads, const std::vector<int>& contexts, float scale, float q_amplitude,
                     uint64_t seed, bool poison_tail) {
  Problem pr;
  pr.batch = batch;
  pr.heads = heads;
  pr.scale = scale;
  pr.context.assign(contexts.begin(), contexts.end());
  int max_ctx = *std::max_element(contexts.begin(), contexts.end());
  pr.max_blocks = std::max(1, (max_ctx + kPage - 1) / kPage);
  std::vector<int> pages_of(batch);
  for (int b = 0; b < batch; ++b) {
    pages_of[b] = (contexts[b] + kPage - 1) / kPage;
    pr.num_pages += pages_of[b];
  }
  pr.num_pages += 3;  // a few pages nobody owns
  std::vector<int32_t> perm(pr.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  pr.table.assign(static_cast<size_t>(batch) * pr.max_blocks, -1);  // padding: never read
  size_t next = 0;
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < pages_of[b]; ++i) pr.table[static_cast<size_t>(b) * pr.max_blocks + i] = perm[next++];
  pr.q = DeviceBuffer<uint16_t>(static_cast<size_t>(batch) * heads * kD);
  pr.cache = DeviceBuffer<uint16_t>(pr.num_pages * kPage * kD);
  pr.out = DeviceBuffer<uint16_t>(static_cast<size_t>(batch) * heads * kC);
  pr.d_table = DeviceBuffer<int32_t>(pr.table.size());
  pr.d_context = DeviceBuffer<int32_t>(batch);
  fill_random(pr.q.ptr, pr.q.count, seed ^ 0x51, q_amplitude);
  fill_random(pr.cache.ptr, pr.cache.count, seed ^ 0xca, 1.0f);
  if (poison_tail) {
    std::vector<uint16_t> nan_row(kD, kBf16NaN);
    for (int b = 0; b < batch; ++b) {
      const int ctx = contexts[b];
      if (ctx % kPage == 0) continue;
      const int32_t page = pr.table[static_cast<size_t>(b) * pr.max_blocks + ctx / kPage];
      for (int r = ctx % kPage; r < kPage; ++r)
        CUDA_TRY(cudaMemcpy(pr.cache.ptr + (static_cast<size_t>(page) * kPage + r) * kD, nan_row.data(),
                            kD * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
  }
  pr.d_table.upload(pr.table);
  pr.d_context.upload(pr.context);
  CUDA_TRY(cudaDeviceSynchronize());
  return pr;
}

k::MlaDecodeParams params_of(const Problem& pr) {
  k::MlaDecodeParams p;
  p.batch = pr.batch;
  p.num_heads = pr.heads;
  p.max_blocks_per_seq = pr.max_blocks;
  p.scale = pr.scale;
  p.q = pr.q.ptr;
  p.kv_cache = pr.cache.ptr;
  p.block_table = pr.d_table.ptr;
  p.context_lens = pr.d_context.ptr;
  p.out = pr.out.ptr;
  return p;
}

// Host copy of what the reference needs: q rows and the pages of the sequences checked.
struct HostView {
  std::vector<uint16_t> q;
  std::vector<std::vector<uint16_t>> pages_of_seq;  // [b] -> ctx rows of 576, or empty if not fetched
};
HostView fetch(const Problem& pr, const std::vector<int>& sequences) {
  HostView v;
  v.q = pr.q.download();
  v.pages_of_seq.resize(pr.batch);
  for (int b : sequences) {
    if (!v.pages_of_seq[b].empty()) continue;
    const int ctx = pr.context[b];
    const int pages = (ctx + kPage - 1) / kPage;
    std::vector<uint16_t>& rows = v.pages_of_seq[b];
    rows.resize(static_cast<size_t>(pages) * kPage * kD);
    for (int i = 0; i < pages; ++i) {
      const int32_t page = pr.table[static_cast<size_t>(b) * pr.max_blocks + i];
      CUDA_TRY(cudaMemcpy(rows.data() + static_cast<size_t>(i) * kPage * kD,
                          pr.cache.ptr + static_cast<size_t>(page) * kPage * kD, kPage * kD * sizeof(uint16_t),
                          cudaMemcpyDeviceToHost));
    }
  }
  return v;
}

// float64 reference of one (b, h) row.
std::vector<double> reference_row(const Problem& pr, const HostView& v, int b, int h) {
  const int ctx = pr.context[b];
  std::vector<double> out(kC, 0.0);
  if (ctx == 0) return out;
  const uint16_t* q = v.q.data() + (static_cast<size_t>(b) * pr.heads + h) * kD;
  double qd[kD];
  for (int c = 0; c < kD; ++c) qd[c] = bf16_to_float(q[c]);
  std::vector<double> scores(ctx);
  double mx = -INFINITY;
  for (int j = 0; j < ctx; ++j) {
    const uint16_t* kv = v.pages_of_seq[b].data() + static_cast<size_t>(j) * kD;
    double dot = 0.0;
    for (int c = 0; c < kD; ++c) dot += qd[c] * bf16_to_float(kv[c]);
    scores[j] = dot * pr.scale;
    mx = std::max(mx, scores[j]);
  }
  double sum = 0.0;
  for (double& s : scores) sum += (s = std::exp(s - mx));
  for (int j = 0; j < ctx; ++j) {
    const uint16_t* kv = v.pages_of_seq[b].data() + static_cast<size_t>(j) * kD;
    const double w = scores[j] / sum;
    for (int c = 0; c < kC; ++c) out[c] += w * bf16_to_float(kv[c]);
  }
  return out;
}

struct Errors {
  double max_row_rel = 0.0;  // max over rows of ||o - r|| / ||r||
  double global_rel = 0.0;   // ||O - R|| / ||R|| over the rows checked
  long non_finite = 0;       // NaN/inf (also: never-written, since outputs are poisoned with NaN)
  int rows = 0;
  bool ok() const { return non_finite == 0 && max_row_rel <= kTolerance && rows > 0; }
};
Errors compare_rows(const std::vector<uint16_t>& out, int heads, const std::vector<std::pair<int, int>>& rows,
                    const std::vector<std::vector<double>>& refs) {
  Errors e;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto [b, h] = rows[i];
    const uint16_t* o = out.data() + (static_cast<size_t>(b) * heads + h) * kC;
    double rn = 0.0, rd = 0.0;
    for (int c = 0; c < kC; ++c) {
      const double x = bf16_to_float(o[c]);
      if (!std::isfinite(x)) ++e.non_finite;
      rn += (x - refs[i][c]) * (x - refs[i][c]);
      rd += refs[i][c] * refs[i][c];
    }
    num += rn;
    den += rd;
    e.max_row_rel = std::max(e.max_row_rel, rd > 0 ? std::sqrt(rn / rd) : std::sqrt(rn));
    ++e.rows;
  }
  e.global_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!std::isfinite(e.max_row_rel)) e.max_row_rel = INFINITY;
  return e;
}
long count_non_finite(const std::vector<uint16_t>& out) {
  long n = 0;
  for (uint16_t x : out) n += std::isfinite(bf16_to_float(x)) ? 0 : 1;
  return n;
}

struct Variant {
  std::string name;
  bool reference = false;
  int heads_per_cta = 0;  // 0 = auto
  int num_splits = 0;     // 0 = auto (mla_decode_num_splits)
  int version = 0;        // MlaDecodeParams::kernel_version: 0 auto, 1 v1, 2 v2 (4 warps/16 heads), 3 v2 (2 warps)
  bool bench = true;      // also timed by bench_case
  int combine_loads = 0;  // MlaDecodeParams::combine_loads (0: the kernel's default)
  std::string same_as;    // a variant run before whose output this one must equal byte for byte
};

int g_num_sms = 0;
bool g_all_ok = true;

struct Summary {
  std::string name;
  double us = 0, gbps = 0, copy_pct = 0, tflops = 0, gemm_pct = 0, err = -1;
};
std::vector<Summary> g_summary;

// Runs one variant into pr.out (poisoned first); returns the launch/run error, or cudaSuccess.
cudaError_t run_variant(Problem& pr, const Variant& v, DeviceBuffer<float>& workspace, int* splits_used) {
  k::MlaDecodeParams p = params_of(pr);
  int max_ctx = *std::max_element(pr.context.begin(), pr.context.end());
  p.heads_per_cta = v.heads_per_cta;
  p.kernel_version = v.version;
  p.combine_loads = v.combine_loads;
  p.num_splits = v.num_splits > 0 ? v.num_splits : k::mla_decode_num_splits(pr.batch, pr.heads, max_ctx, g_num_sms);
  const size_t need = k::mla_decode_workspace_floats(pr.batch, pr.heads, p.num_splits);
  if (need > workspace.count) workspace = DeviceBuffer<float>(need);
  p.workspace = workspace.ptr;
  if (splits_used) *splits_used = p.num_splits;
  return v.reference ? k::run_mla_decode_reference(p) : k::run_mla_decode(p);
}

std::vector<Variant> variants_for(int heads, bool with_reference) {
  std::vector<Variant> vs;
  auto add = [&vs](std::string name, bool reference, int heads_per_cta, int num_splits, int version, bool bench,
                   int combine_loads = 0, std::string same_as = "") {
    vs.push_back({std::move(name), reference, heads_per_cta, num_splits, version, bench, combine_loads,
                  std::move(same_as)});
  };
  // fast*: the automatic kernel choice (v2 where 64 heads/CTA apply, else v1); v1_*: v1 forced; v2_*: v2 forced.
  if (with_reference) add("reference", true, 0, 1, 0, false);
  add("fast", false, 0, 0, 0, true);
  add("fast_split1", false, 0, 1, 0, true);
  add("fast_split3", false, 0, 3, 0, !with_reference);  // v1's old automatic choice at B=128, H=16
  add("fast_split7", false, 0, 7, 0, false);
  // The combine's loads in flight change no sum: at 40 splits (a partial group of 8 at 32) 16 and 32 loads equal
  // 8 byte for byte, and at the automatic split count so do 8 and the automatic loads (32 past 16 splits).
  add("fast_split40_loads8", false, 0, 40, 0, false, 8);
  add("fast_split40_loads16", false, 0, 40, 0, false, 16, "fast_split40_loads8");
  add("fast_split40_loads32", false, 0, 40, 0, false, 32, "fast_split40_loads8");
  add("fast_loads8", false, 0, 0, 0, false, 8, "fast");
  for (int hpc : {16, 32, 64})
    if (heads % hpc == 0) {
      char name[16];
      std::snprintf(name, sizeof(name), "v1_h%d", hpc);
      add(name, false, hpc, 0, 1, true);
    }
  if (heads % 64 == 0) {
    add("v2_w4", false, 64, 0, 2, true);
    add("v2_w2", false, 64, 0, 3, true);
    add("v2_w4_split1", false, 64, 1, 2, false);
    add("v2_w2_split1", false, 64, 1, 3, false);
    add("v2_w4_split7", false, 64, 7, 2, false);
    add("v2_w2_split7", false, 64, 7, 3, false);
  }
  return vs;
}

// Correctness on small problems: every row against float64, and against the CPU backend.
void check_case(const std::string& name, int batch, int heads, const std::vector<int>& contexts, float scale,
                uint64_t seed) {
  Problem pr = make_problem(batch, heads, contexts, scale, 1.0f, seed, true);
  std::vector<int> all(batch);
  std::iota(all.begin(), all.end(), 0);
  HostView hv = fetch(pr, all);
  std::vector<std::pair<int, int>> rows;
  std::vector<std::vector<double>> refs;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      rows.push_back({b, h});
      refs.push_back(reference_row(pr, hv, b, h));
    }
  DeviceBuffer<float> workspace;
  std::map<std::string, std::vector<uint16_t>> outputs;  // by variant name
  double worst_err = 0.0;
  std::string worst_variant;
  int variants_run = 0;
  for (const Variant& v : variants_for(heads, true)) {
    pr.out.poison();  // NaN
    int splits = 1;
    cudaError_t err = run_variant(pr, v, workspace, &splits);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n",
                  name.c_str(), v.name.c_str(), cudaGetErrorString(err));
      g_all_ok = false;
      if (err != cudaErrorInvalidValue && err != cudaErrorInvalidConfiguration) throw std::runtime_error("sticky CUDA error");
      continue;
    }
    std::vector<uint16_t> out = pr.out.download();
    const long unwritten = count_non_finite(out);
    Errors e = compare_rows(out, heads, rows, refs);
    const bool same = v.same_as.empty() || (outputs.count(v.same_as) != 0 && outputs[v.same_as] == out);
    if (!same)
      std::printf(
          "{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"%s\",\"ok\":false,\"error\":\"differs from %s\"}\n",
          name.c_str(), v.name.c_str(), v.same_as.c_str());
    const bool ok = e.ok() && unwritten == 0 && same;
    outputs[v.name] = out;
    g_all_ok = g_all_ok && ok;
    std::printf(
        "{\"kind\":\"check\",\"case\":\"%s\",\"variant\":\"%s\",\"batch\":%d,\"heads\":%d,\"splits\":%d,\"scale\":%g,"
        "\"rows\":%d,\"max_row_rel_err\":%.3e,\"global_rel_err\":%.3e,\"non_finite\":%ld,\"ok\":%s}\n",
        name.c_str(), v.name.c_str(), batch, heads, splits, scale, e.rows, e.max_row_rel, e.global_rel, unwritten,
        ok ? "true" : "false");
    if (!v.reference) {
      ++variants_run;
      const double err = ok ? e.max_row_rel : INFINITY;
      if (err >= worst_err) {
        worst_err = err;
        worst_variant = v.name;
      }
    }
  }
  g_summary.push_back({"check " + name + " (worst of " + std::to_string(variants_run) + ": " + worst_variant + ")", 0,
                       0, 0, 0, 0, worst_err});
#ifdef DEEPINFER_GPU_CHECK_CPU_BACKEND
  // The project's CPU backend on the same (bf16 -> float) inputs, against the fast kernel's output.
  {
    namespace be = deepinfer::backend;
    std::vector<uint16_t> cache_bits = pr.cache.download();
    auto cpu = be::make_cpu_backend();
    // The backend's own memory: the cache as float, q as [B, H * (C + R)] (latent | rope per head), out [B, H * C].
    be::Buffer cache = cpu->alloc(cache_bits.size() * sizeof(float)).value();
    be::Buffer q = cpu->alloc(static_cast<size_t>(batch) * heads * kD * sizeof(float)).value();
    std::vector<float> out(static_cast<size_t>(batch) * heads * kC);
    float* cache_f = static_cast<float*>(cache.data());
    float* q_f = static_cast<float*>(q.data());
    for (size_t i = 0; i < cache_bits.size(); ++i) cache_f[i] = bf16_to_float(cache_bits[i]);
    for (size_t i = 0; i < static_cast<size_t>(batch) * heads * kD; ++i) q_f[i] = bf16_to_float(hv.q[i]);
    std::vector<std::vector<int32_t>> tables(batch);
    std::vector<int32_t> row_sequence(batch), positions(batch), token_ids(batch, 0);
    std::vector<int64_t> slots(batch, -1);
    for (int b = 0; b < batch; ++b) {
      const int pages = (pr.context[b] + kPage - 1) / kPage;
      tables[b].assign(pr.table.begin() + static_cast<long>(b) * pr.max_blocks,
                       pr.table.begin() + static_cast<long>(b) * pr.max_blocks + pages);
      row_sequence[b] = b;
      positions[b] = pr.context[b] - 1;
    }
    be::StepLayout layout;
    layout.token_ids = token_ids;
    layout.positions = positions;
    layout.row_sequence = row_sequence;
    layout.slots = slots;
    layout.block_tables = tables;
    if (!cpu->begin_step(layout).ok()) std::abort();
    be::MlaAttention attention{heads, kC, k::kMlaRopeDim, scale};
    cpu->mla_attention(attention, be::Tensor{q.data(), be::DType::kF32, batch, heads * kD, heads * kD}, cache,
                       be::Tensor{out.data(), be::DType::kF32, batch, heads * kC, heads * kC});
    std::vector<std::vector<double>> cpu_refs;
    for (auto [b, h] : rows) {
      const float* o = out.data() + (static_cast<size_t>(b) * heads + h) * kC;
      cpu_refs.emplace_back(o, o + kC);
    }
    // The CPU backend vs float64 (sanity of the comparison itself), then the fast kernel vs the CPU backend.
    double cpu_vs_f64 = 0.0;
    for (size_t i = 0; i < rows.size(); ++i) {
      double n = 0, d = 0;
      for (int c = 0; c < kC; ++c) {
        n += (cpu_refs[i][c] - refs[i][c]) * (cpu_refs[i][c] - refs[i][c]);
        d += refs[i][c] * refs[i][c];
      }
      cpu_vs_f64 = std::max(cpu_vs_f64, d > 0 ? std::sqrt(n / d) : std::sqrt(n));
    }
    if (auto fast = outputs.find("fast"); fast != outputs.end()) {
      Errors e = compare_rows(fast->second, heads, rows, cpu_refs);
      g_all_ok = g_all_ok && e.ok();
      std::printf(
          "{\"kind\":\"check_cpu_backend\",\"case\":\"%s\",\"variant\":\"fast\",\"rows\":%d,\"max_row_rel_err\":%.3e,"
          "\"global_rel_err\":%.3e,\"cpu_backend_vs_f64\":%.3e,\"ok\":%s}\n",
          name.c_str(), e.rows, e.max_row_rel, e.global_rel, cpu_vs_f64, e.ok() ? "true" : "false");
    }
  }
#endif
  std::fflush(stdout);
}

double g_copy_gbps = 0.0, g_gemm_tflops = 0.0;

void measure_ceilings() {
  {  // device-to-device copy, 2 GiB, bytes read + written
    const size_t bytes = size_t{2} << 30;
    Stats s = time_d2d_copy(bytes, [](uint8_t* src, size_t n) { CUDA_TRY(cudaMemset(src, 0x5a, n)); }, 3, 20);
    g_copy_gbps = 2.0 * bytes / (s.median_us * 1e-6) / 1e9;
    std::printf("{\"kind\":\"ceiling\",\"name\":\"d2d_copy\",\"bytes\":%zu,\"median_us\":%.1f,\"min_us\":%.1f,"
                "\"max_us\":%.1f,\"gbps_read_plus_write\":%.1f}\n",
                bytes, s.median_us, s.min_us, s.max_us, g_copy_gbps);
  }
  // cuBLAS bf16 GEMM 8192^3, f32 accumulation, random inputs
  g_gemm_tflops = measure_cublas_bf16_gemm_ceiling(
      [](uint16_t* p, size_t n, uint64_t seed) { fill_random(p, n, seed, 1.0f); }, 3, 20);
  std::fflush(stdout);
}

// The issue's cases: batch 128, context 4096 / 8192, heads 16 / 128; two input sets (each far past the 60 MB L2)
// alternate between runs.
void bench_case(int heads, int ctx) {
  const int batch = 128;
  const float scale = 1.0f / std::sqrt(192.0f);
  std::vector<int> contexts(batch, ctx);
  Problem sets[2] = {make_problem(batch, heads, contexts, scale, 1.0f, 1000 + heads + ctx, false),
                     make_problem(batch, heads, contexts, scale, 1.0f, 2000 + heads + ctx, false)};
  const double kv_bytes = static_cast<double>(batch) * ctx * kD * 2;
  const double bytes = kv_bytes + static_cast<double>(batch) * heads * (kD + kC) * 2;
  const double flops = 2.0 * batch * heads * static_cast<double>(ctx) * (kD + kC);
  char cname_buf[32];
  std::snprintf(cname_buf, sizeof(cname_buf), "h%d_ctx%d", heads, ctx);
  const std::string cname = cname_buf;
  std::printf("{\"kind\":\"floor\",\"case\":\"%s\",\"bytes\":%.0f,\"flops\":%.0f,\"floor_us_bytes\":%.1f,"
              "\"floor_us_flops\":%.1f}\n",
              cname.c_str(), bytes, flops, g_copy_gbps > 0 ? bytes / (g_copy_gbps * 1e3) : 0.0,
              g_gemm_tflops > 0 ? flops / (g_gemm_tflops * 1e6) : 0.0);
  DeviceBuffer<float> workspace[2];
  // Rows checked after timing: 8 (sequence, head) pairs of set 0.
  std::vector<std::pair<int, int>> rows;
  std::mt19937 rng(heads * 7 + ctx);
  for (int i = 0; i < 8; ++i) rows.push_back({static_cast<int>(rng() % batch), static_cast<int>(rng() % heads)});
  std::vector<int> seqs;
  for (auto [b, h] : rows) seqs.push_back(b);
  HostView hv = fetch(sets[0], seqs);
  std::vector<std::vector<double>> refs;
  for (auto [b, h] : rows) refs.push_back(reference_row(sets[0], hv, b, h));
  Summary best;
  best.us = 1e30;
  for (const Variant& v : variants_for(heads, false)) {
    if (!v.bench) continue;
    int splits = 1;
    bool failed = false;
    auto launch = [&](int i) {
      cudaError_t err = run_variant(sets[i & 1], v, workspace[i & 1], &splits);
      if (err != cudaSuccess) throw std::runtime_error(std::string("launch: ") + cudaGetErrorString(err));
    };
    Stats s{};
    try {
      // allocate workspaces outside the timed region
      launch(0);
      launch(1);
      // Timed runs restart at set 0 after the 3 warm-up runs (time_events numbers them on from the warm-up).
      s = stats_of(time_events([&](int i) { launch(i < 3 ? i : i - 3); }, 3, 30));
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"bench\",\"case\":\"%s\",\"variant\":\"%s\",\"error\":\"%s\"}\n", cname.c_str(),
                  v.name.c_str(), ex.what());
      failed = true;
      g_all_ok = false;
      if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) throw;
    }
    if (failed) continue;
    // Correctness of this variant on this size: poison set 0's output, run once, compare the sampled rows.
    sets[0].out.poison();
    launch(0);
    CUDA_TRY(cudaDeviceSynchronize());
    std::vector<uint16_t> out = sets[0].out.download();
    Errors e = compare_rows(out, heads, rows, refs);
    e.non_finite += count_non_finite(out);
    g_all_ok = g_all_ok && e.ok();
    const double gbps = bytes / (s.median_us * 1e-6) / 1e9;
    const double tflops = flops / (s.median_us * 1e-6) / 1e12;
    const double copy_pct = g_copy_gbps > 0 ? 100.0 * gbps / g_copy_gbps : 0.0;
    const double gemm_pct = g_gemm_tflops > 0 ? 100.0 * tflops / g_gemm_tflops : 0.0;
    std::printf(
        "{\"kind\":\"bench\",\"case\":\"%s\",\"variant\":\"%s\",\"batch\":%d,\"heads\":%d,\"context\":%d,"
        "\"splits\":%d,\"median_us\":%.1f,\"min_us\":%.1f,\"max_us\":%.1f,\"gbps\":%.1f,\"pct_copy\":%.1f,"
        "\"tflops\":%.1f,\"pct_gemm\":%.1f,\"max_row_rel_err\":%.3e,\"non_finite\":%ld,\"ok\":%s}\n",
        cname.c_str(), v.name.c_str(), batch, heads, ctx, splits, s.median_us, s.min_us, s.max_us, gbps, copy_pct,
        tflops, gemm_pct, e.max_row_rel, e.non_finite, e.ok() ? "true" : "false");
    std::fflush(stdout);
    const Summary row{cname + " " + v.name + " s" + std::to_string(splits), s.median_us, gbps, copy_pct, tflops,
                      gemm_pct, e.max_row_rel};
    g_summary.push_back(row);
    if (s.median_us < best.us) best = row;
  }
  if (best.us < 1e29) {
    best.name = "  best: " + best.name;
    g_summary.push_back(best);
  }
}

void print_summary() {
  std::printf("\n%-40s %9s %8s %7s %8s %7s %10s\n", "case", "us", "GB/s", "%copy", "TFLOPS", "%gemm", "max_rel_err");
  std::printf("%-40s %9s %8.0f %7s %8.1f %7s %10s\n", "ceilings (copy, cuBLAS bf16)", "-", g_copy_gbps, "100",
              g_gemm_tflops, "100", "-");
  for (const Summary& s : g_summary) {
    if (s.us == 0)
      std::printf("%-40s %9s %8s %7s %8s %7s %10.2e\n", s.name.c_str(), "-", "-", "-", "-", "-", s.err);
    else
      std::printf("%-40s %9.1f %8.0f %7.1f %8.1f %7.1f %10.2e\n", s.name.c_str(), s.us, s.gbps, s.copy_pct, s.tflops,
                  s.gemm_pct, s.err);
  }
  std::printf("all checks: %s\n", g_all_ok ? "PASS" : "FAIL");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  try {
    cudaDeviceProp prop{};
    CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    g_num_sms = prop.multiProcessorCount;
    std::printf("{\"kind\":\"device\",\"name\":\"%s\",\"cc\":\"%d.%d\",\"sms\":%d,\"l2_bytes\":%d,"
                "\"smem_optin\":%zu,\"global_mem_bytes\":%zu}\n",
                prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize,
                prop.sharedMemPerBlockOptin, prop.totalGlobalMem);
  } catch (const std::exception& ex) {
    std::printf("{\"kind\":\"fatal\",\"error\":\"%s\"}\n", ex.what());
    return 2;
  }
  struct CheckCase {
    std::string name;
    int batch, heads;
    std::vector<int> contexts;
    float scale;
  };
  std::vector<CheckCase> checks = {
      {"h16_mixed", 6, 16, {1, 63, 64, 65, 1000, 3001}, 0.0722f},
      {"h128_mixed", 3, 128, {63, 777, 2048}, 0.3f},
      {"h32_long", 2, 32, {129, 4500}, 0.1f},
      {"h64_peaked", 3, 64, {5000, 1, 200}, 1.0f},
      {"h16_empty_ctx", 3, 16, {0, 70, 640}, 0.2f},
  };
  if (quick) checks.resize(2);
  for (const CheckCase& c : checks) {
    try {
      check_case(c.name, c.batch, c.heads, c.contexts, c.scale, 12345 + c.batch * 31 + c.heads);
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"check\",\"case\":\"%s\",\"ok\":false,\"error\":\"%s\"}\n", c.name.c_str(), ex.what());
      g_all_ok = false;
      if (cudaDeviceSynchronize() != cudaSuccess) break;  // context lost: nothing further can run
    }
  }
  if (!quick) {
    try {
      measure_ceilings();
    } catch (const std::exception& ex) {
      std::printf("{\"kind\":\"ceiling\",\"error\":\"%s\"}\n", ex.what());
    }
    for (int ctx : {4096, 8192})
      for (int heads : {16, 128}) {
        try {
          bench_case(heads, ctx);
        } catch (const std::exception& ex) {
          std::printf("{\"kind\":\"bench\",\"case\":\"h%d_ctx%d\",\"error\":\"%s\"}\n", heads, ctx, ex.what());
          g_all_ok = false;
          if (cudaDeviceSynchronize() != cudaSuccess) break;
        }
      }
  }
  print_summary();
  return g_all_ok ? 0 : 1;
}
