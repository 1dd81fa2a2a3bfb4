// bench_model: the model-level GPU benchmark (issue 5). DeepSeek-V2-Lite in bf16 and a 4-layer slice of DeepSeek-V3
// in FP8, their real shapes (bench/gpu/configs) with random weights on the CUDA backend: decode tokens/s at context
// 4096 against a memory roofline, prefill tokens/s against tensor-core peaks, all ceilings measured in this process.
// Prints one JSON line per measurement (an "error" field when one could not be made); passes or fails nothing.
//
// --model v4-flash-slice: DeepSeek-V4-Flash's shapes on 4 layers (bf16), decode and prefill (bench_v4).
// Usage: bench_model [--model v2-lite|v3-slice|v4-flash-slice|all] [--batches 1,8,64,256] [--prefill 4096,32768] [--steps 10]
//                    [--prefill-steps 2] [--configs DIR] [--profile] [--moe-sweep 1,8,64,512,4096,16384]
//                    [--kv-copy 1,48,1024] (whole KV blocks device <-> host: bench_kv_copy)
#include <CLI/CLI.hpp>
#include <cuda_profiler_api.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/backend/kv_block_copy.h"
#include "op_profile.h"
#include "deepinfer/kernels/cuda/gemm.h"
#include "deepinfer/model/config.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/deepseek_v4.h"
#include "gpu_check_common.h"  // tests/gpu: CUDA_TRY, DeviceBuffer, CUDA-event timing, the copy ceiling

namespace {

using namespace deepinfer;
namespace gc = deepinfer::gpu_check;
namespace k = deepinfer::kernels::cuda;
using backend::Precision;
using Clock = std::chrono::steady_clock;

constexpr int64_t kContext = 4096;    // decode: every sequence's new token sits at position kContext - 1
constexpr int64_t kBlockTokens = 64;  // tokens per cache block (DeepSeekModel's paged cache)
constexpr int kWarmupSteps = 2;
constexpr int kCeilingReps = 5;  // ceilings: best of 5
constexpr uint64_t kSeed = 1130;

// One JSON object on one line, fields in the order added (scripts/gpu-check.sh reads them with sed).
class JsonLine {
 public:
  explicit JsonLine(std::string_view kind) { str("kind", kind); }
  JsonLine& str(std::string_view key, std::string_view value) {
    std::string quoted = "\"";
    for (char c : value) {
      if (c == '"' || c == '\\') quoted += '\\';
      quoted += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
    }
    return raw(key, quoted + "\"");
  }
  JsonLine& integer(std::string_view key, int64_t value) { return raw(key, std::to_string(value)); }
  JsonLine& num(std::string_view key, double value, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
    return raw(key, buf);
  }
  void print() const {
    std::printf("{%s}\n", body_.c_str());
    std::fflush(stdout);  // a crash later must not take the lines already measured with it
  }

 private:
  JsonLine& raw(std::string_view key, const std::string& value) {
    if (!body_.empty()) body_ += ",";
    body_ += "\"" + std::string(key) + "\":" + value;
    return *this;
  }
  std::string body_;
};

struct Stats {
  double median = 0, min = 0, max = 0;
};
Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

// Ceilings of this GPU, 0 where the measurement failed (its line says why).
struct Ceilings {
  double copy_gbps = 0;  // device-to-device copy, bytes read + written
  double bf16_tflops = 0, fp8_tflops = 0;
};

// Uniform values in [-1, 1) as bf16 bits, filled on the host (this file is plain C++: no fill kernels).
void fill_bf16(gc::DeviceBuffer<uint16_t>& buffer, uint64_t seed) {
  std::vector<uint16_t> host(buffer.count);
  for (size_t i = 0; i < host.size(); ++i) {
    const float value = static_cast<float>(gc::splitmix64(seed * 0x100000000ull + i) >> 40) / 8388608.0f - 1.0f;
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    host[i] = static_cast<uint16_t>(bits >> 16);
  }
  buffer.upload(host);
}

void measure_copy(Ceilings& ceilings) {
  const size_t bytes = size_t{2} << 30;
  JsonLine line("ceiling");
  line.str("name", "d2d_copy").integer("bytes", static_cast<int64_t>(bytes));
  try {
    gc::Stats s = gc::time_d2d_copy(
        bytes, [](uint8_t* p, size_t n) { CUDA_TRY(cudaMemset(p, 0x5a, n)); }, 2, kCeilingReps);
    ceilings.copy_gbps = 2.0 * bytes / (s.min_us * 1e-6) / 1e9;
    line.num("best_us", s.min_us, 1)
        .num("median_us", s.median_us, 1)
        .num("gbps_read_plus_write", ceilings.copy_gbps, 1);
  } catch (const std::exception& e) {
    line.str("error", e.what());
    (void)cudaGetLastError();
  }
  line.print();
}

// cuBLAS bf16 GEMM 8192³, f32 accumulation (tests/gpu's ceiling, taken as the best of 5 rather than the median).
void measure_bf16_gemm(Ceilings& ceilings) {
  const int n = 8192;
  JsonLine line("ceiling");
  line.str("name", "cublas_bf16_gemm_8192");
  try {
    gc::DeviceBuffer<uint16_t> a(size_t{1} * n * n), b(size_t{1} * n * n), c(size_t{1} * n * n);
    fill_bf16(a, 11);
    fill_bf16(b, 12);
    cublasHandle_t handle;
    CUBLAS_TRY(cublasCreate(&handle));
    std::unique_ptr<cublasContext, decltype(&cublasDestroy)> guard(handle, &cublasDestroy);
    const float alpha = 1.0f, beta = 0.0f;
    gc::Stats s = gc::stats_of(gc::time_events(
        [&](int) {
          CUBLAS_TRY(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF, n, b.ptr,
                                  CUDA_R_16BF, n, &beta, c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
        },
        2, kCeilingReps));
    ceilings.bf16_tflops = 2.0 * n * n * static_cast<double>(n) / (s.min_us * 1e-6) / 1e12;
    line.num("best_us", s.min_us, 1).num("median_us", s.median_us, 1).num("tflops", ceilings.bf16_tflops, 1);
  } catch (const std::exception& e) {
    line.str("error", e.what());
    (void)cudaGetLastError();
  }
  line.print();
}

// FP8 block-scaled GEMM 8192³ through the kernels the CUDA backend uses (run_fp8_gemm, as tests/gpu/gpu_check_gemm.cu
// calls it): x quantized by run_act_quant, W random e4m3 bytes with one scale per 128x128 block. The GEMM alone.
void measure_fp8_gemm(Ceilings& ceilings) {
  const int n = 8192;
  JsonLine line("ceiling");
  line.str("name", "fp8_gemm_8192");
  try {
    gc::DeviceBuffer<uint16_t> x(size_t{1} * n * n), y(size_t{1} * n * n);
    gc::DeviceBuffer<uint8_t> x_fp8(size_t{1} * n * n), w_fp8(size_t{1} * n * n);
    gc::DeviceBuffer<float> x_scale(size_t{1} * (n / k::kFp8GroupSize) * n);
    gc::DeviceBuffer<float> w_scale(size_t{1} * (n / k::kFp8GroupSize) * k::fp8_weight_scale_ld(n));
    fill_bf16(x, 13);
    std::vector<uint8_t> w_host(w_fp8.count);
    for (size_t i = 0; i < w_host.size(); ++i) {
      const uint8_t byte = static_cast<uint8_t>(gc::splitmix64(14 * 0x100000000ull + i));
      w_host[i] = (byte & 0x7f) == 0x7f ? byte ^ 1 : byte;  // 0x7f / 0xff are e4m3fn's NaNs
    }
    w_fp8.upload(w_host);
    w_scale.upload(std::vector<float>(w_scale.count, 1.0f / k::kFp8E4m3Max));
    k::ActQuantParams quant;
    quant.m = quant.k = n;
    quant.x = x.ptr;
    quant.x_fp8 = x_fp8.ptr;
    quant.x_scale = x_scale.ptr;
    CUDA_TRY(k::run_act_quant(quant));

    k::GemmStatus status;
    std::unique_ptr<k::GemmLibrary, decltype(&k::gemm_library_destroy)> lib(
        k::gemm_library_create(size_t{32} << 20, &status), &k::gemm_library_destroy);
    if (!lib) throw std::runtime_error(std::string("gemm_library_create: ") + status.where);
    k::Fp8GemmParams p;
    p.m = p.n = p.k = n;
    p.x_fp8 = x_fp8.ptr;
    p.x_scale = x_scale.ptr;
    p.w_fp8 = w_fp8.ptr;
    p.w_scale = w_scale.ptr;
    p.y = y.ptr;
    k::Fp8GemmPath used = k::Fp8GemmPath::kAuto;
    gc::Stats s = gc::stats_of(gc::time_events(
        [&](int) {
          k::GemmStatus st = k::run_fp8_gemm(lib.get(), p, &used);
          if (!st.ok()) {
            throw std::runtime_error(std::string(st.where) + " -> cuda " + cudaGetErrorName(st.cuda) +
                                     ", cublas status " + std::to_string(st.cublas));
          }
        },
        2, kCeilingReps));
    ceilings.fp8_tflops = 2.0 * n * n * static_cast<double>(n) / (s.min_us * 1e-6) / 1e12;
    line.str("path", used == k::Fp8GemmPath::kCublasLt ? "cublaslt" : "simt")
        .num("best_us", s.min_us, 1)
        .num("median_us", s.median_us, 1)
        .num("tflops", ceilings.fp8_tflops, 1);
  } catch (const std::exception& e) {
    line.str("error", e.what());
    (void)cudaGetLastError();
  }
  line.print();
}

// What a step must read or compute, from the config and the precision DeepSeekModel keeps each weight in
// (src/model/deepseek_model.cpp, Loader): linear weights in the run's precision (bf16: 2 bytes per parameter; FP8:
// 1 byte, the 128x128 block scales, 4 bytes per 16 KiB, left out); embedding, lm_head and the absorbed W_UK / W_UV
// (kv_b_proj) in bf16; the router in float32. Norm vectors and the few embedding rows a step reads are left out.
struct ModelShape {
  double non_expert_bytes = 0;  // read by every decode step whatever the routing: attention, dense/shared MLPs,
                                // routers, lm_head
  double expert_bytes = 0;      // one routed expert of one layer (gate, up, down)
  int64_t moe_layers = 0;
  // Weight parameters each prefill token is multiplied by: attention in the expanded form (kv_b_proj on every
  // token), dense or shared MLP, router and the top-k experts. Embedding (a lookup) and lm_head (last row only) out.
  double active_params_per_token = 0;
};

ModelShape model_shape(const model::ModelConfig& c, Precision precision) {
  const double linear = precision == Precision::kFP8 ? 1.0 : 2.0, bf16 = 2.0, f32 = 4.0;
  const double hidden = static_cast<double>(c.hidden_size), heads = static_cast<double>(c.num_attention_heads);
  const double rank = static_cast<double>(c.kv_lora_rank), qk = static_cast<double>(c.qk_head_dim());
  const double q_path =
      c.q_lora_rank ? static_cast<double>(*c.q_lora_rank) * (hidden + heads * qk) : heads * qk * hidden;
  const double attention = q_path + static_cast<double>(c.kv_cache_dim()) * hidden +  // q, kv_a_proj_with_mqa
                           hidden * heads * static_cast<double>(c.v_head_dim);        // o_proj
  const double kv_b = heads * static_cast<double>(c.qk_nope_head_dim + c.v_head_dim) * rank;
  const double expert = 3.0 * hidden * static_cast<double>(c.moe_intermediate_size);
  ModelShape s;
  s.expert_bytes = expert * linear;
  s.non_expert_bytes = static_cast<double>(c.vocab_size) * hidden * bf16;  // lm_head
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    s.non_expert_bytes += attention * linear + kv_b * bf16;
    s.active_params_per_token += attention + kv_b;
    if (c.is_moe_layer(l)) {
      ++s.moe_layers;
      const double router = static_cast<double>(c.n_routed_experts) * hidden;
      const double shared = expert * static_cast<double>(c.n_shared_experts);
      s.non_expert_bytes += router * f32 + shared * linear;
      s.active_params_per_token += router + shared + expert * static_cast<double>(c.num_experts_per_tok);
    } else {
      const double mlp = 3.0 * hidden * static_cast<double>(c.intermediate_size);
      s.non_expert_bytes += mlp * linear;
      s.active_params_per_token += mlp;
    }
  }
  return s;
}

// Times `steps` forward passes after `warmup` untimed ones (scratch growth, GEMM plans), wall clock around each:
// forward() returns once the logits are on the host, forward_greedy() (greedy) once the argmax ids are. Returns ms
// per step, or the first error.
Result<std::vector<double>> time_forward(model::DeepSeekModel& model, const model::ForwardBatch& batch,
                                         model::LayerCaches caches, int warmup, int steps, bool greedy = false) {
  std::vector<float> logits;
  std::vector<int32_t> ids;
  std::vector<double> ms;
  for (int i = 0; i < warmup + steps; ++i) {
    const auto start = Clock::now();
    Status s = greedy ? model.forward_greedy(batch, caches, ids) : model.forward(batch, caches, logits);
    if (!s.ok()) return s;
    const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (i >= warmup) ms.push_back(elapsed);
  }
  return ms;
}

std::vector<int32_t> random_tokens(int64_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int32_t& id : ids) id = token(rng);
  return ids;
}

std::vector<int32_t> block_range(int64_t first, int64_t count) {
  std::vector<int32_t> blocks(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) blocks[static_cast<size_t>(i)] = static_cast<int32_t>(first + i);
  return blocks;
}

struct Run {
  std::string name;  // --model value
  Precision precision;
  model::DeepSeekModel& model;
  backend::Backend& backend;
  ModelShape shape;
  const Ceilings& ceilings;
  bench::ProfilingBackend* profiler;  // null unless --profile
};

// --profile: one more forward with every op timed on its own; a JSON line per op, the slowest first.
void profile_forward(const Run& run, const std::string& phase, const model::ForwardBatch& fb,
                     std::span<const backend::Buffer> caches) {
  if (run.profiler == nullptr) return;
  run.profiler->seconds.clear();
  run.profiler->calls.clear();
  run.profiler->enabled = true;
  std::vector<float> logits;
  Status s = run.model.forward(fb, caches, logits);
  run.profiler->enabled = false;
  if (!s.ok()) return JsonLine("profile").str("model", run.name).str("phase", phase).str("error", s.to_string()).print();
  std::vector<std::pair<double, std::string>> ops;
  for (const auto& [op, sec] : run.profiler->seconds) ops.push_back({sec, op});
  std::sort(ops.rbegin(), ops.rend());
  for (const auto& [sec, op] : ops) {
    JsonLine("profile")
        .str("model", run.name)
        .str("phase", phase)
        .str("op", op)
        .num("ms", sec * 1e3, 3)
        .integer("calls", run.profiler->calls[op])
        .print();
  }
}

// Decode: `batch` sequences at context 4096, one new token each (position 4095) with its own 64 cache blocks; the
// cache holds zeros, which costs the attention kernels the same reads as real entries.
void bench_decode(const Run& run, int64_t batch, int steps) {
  const model::ModelConfig& c = run.model.config();
  JsonLine line("decode");
  line.str("model", run.name).integer("batch", batch).integer("context", kContext);
  const int64_t blocks_per_sequence = kContext / kBlockTokens;
  Result<std::vector<backend::Buffer>> caches = run.model.make_layer_caches(batch * blocks_per_sequence + 1);
  if (!caches.ok()) return line.str("error", caches.status().to_string()).print();
  model::ForwardBatch fb;
  fb.token_ids = random_tokens(batch, c.vocab_size, kSeed + static_cast<uint64_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    fb.sequences.push_back(
        {1, static_cast<int32_t>(kContext - 1), block_range(b * blocks_per_sequence, blocks_per_sequence)});
    fb.logits_rows.push_back(static_cast<int32_t>(b));
  }
  // Greedy decoding (only the argmax ids leave the GPU) is the measurement; a step that brings every row's float32
  // logits to the host (sampling on the CPU) is reported beside it.
  Result<std::vector<double>> ms = time_forward(run.model, fb, *caches, kWarmupSteps, steps, /*greedy=*/true);
  if (!ms.ok()) return line.str("error", ms.status().to_string()).print();
  Result<std::vector<double>> logits_ms = time_forward(run.model, fb, *caches, 1, steps);
  if (!logits_ms.ok()) return line.str("error", logits_ms.status().to_string()).print();
  profile_forward(run, "decode B=" + std::to_string(batch), fb, *caches);
  const Stats st = stats_of(*ms);

  // Roofline: each byte the step must read, read once at the measured copy rate. Routed experts under uniform
  // routing: a layer's E experts each stay unpicked by all `batch` tokens with probability (1 - k/E)^batch.
  const double experts_e = static_cast<double>(c.n_routed_experts), top_k = static_cast<double>(c.num_experts_per_tok);
  const double experts_per_layer =
      c.n_routed_experts > 0 ? experts_e * (1.0 - std::pow(1.0 - top_k / experts_e, static_cast<double>(batch))) : 0.0;
  const double expert_bytes = static_cast<double>(run.shape.moe_layers) * experts_per_layer * run.shape.expert_bytes;
  const double kv_bytes = static_cast<double>(batch * kContext * c.kv_cache_dim() * c.num_hidden_layers) *
                          static_cast<double>(backend::dtype_size(run.backend.cache_dtype()));
  const double step_bytes = run.shape.non_expert_bytes + expert_bytes + kv_bytes;
  line.integer("steps", steps)
      .num("median_ms", st.median, 3)
      .num("min_ms", st.min, 3)
      .num("max_ms", st.max, 3)
      .num("tokens_per_s", static_cast<double>(batch) / (st.median * 1e-3), 1)
      .num("bytes_non_expert", run.shape.non_expert_bytes, 0)
      .num("experts_per_moe_layer", experts_per_layer, 2)
      .num("bytes_experts", expert_bytes, 0)
      .num("bytes_kv", kv_bytes, 0)
      .num("bytes_step", step_bytes, 0)
      .str("sampling", "greedy on the GPU")
      // The same step bringing every row's float32 logits to the host instead (not in the roofline).
      .num("with_logits_to_host_ms", stats_of(*logits_ms).median, 3)
      .num("logits_host_bytes", static_cast<double>(batch * c.vocab_size * 4), 0);
  if (run.ceilings.copy_gbps > 0) {
    const double roofline_ms = step_bytes / (run.ceilings.copy_gbps * 1e9) * 1e3;
    line.num("roofline_ms", roofline_ms, 3).num("pct_roofline", 100.0 * roofline_ms / st.median, 1);
  }
  line.print();
}

// Prefill: one sequence of `tokens` from position 0 in one forward, logits for its last row only.
void bench_prefill(const Run& run, int64_t tokens, int steps) {
  const model::ModelConfig& c = run.model.config();
  JsonLine line("prefill");
  line.str("model", run.name).integer("tokens", tokens);
  const backend::MlaExpanded expanded{
      c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, 0.0f, nullptr};
  line.str("attention", run.backend.has_mla_expanded(expanded) ? "expanded" : "absorbed");
  const int64_t blocks = (tokens + kBlockTokens - 1) / kBlockTokens;
  Result<std::vector<backend::Buffer>> caches = run.model.make_layer_caches(blocks + 1);
  if (!caches.ok()) return line.str("error", caches.status().to_string()).print();
  model::ForwardBatch fb;
  fb.token_ids = random_tokens(tokens, c.vocab_size, kSeed + static_cast<uint64_t>(tokens));
  fb.sequences.push_back({static_cast<int32_t>(tokens), 0, block_range(0, blocks)});
  fb.logits_rows = {static_cast<int32_t>(tokens - 1)};
  Result<std::vector<double>> ms = time_forward(run.model, fb, *caches, 1, steps);
  if (ms.ok()) profile_forward(run, "prefill T=" + std::to_string(tokens), fb, *caches);
  if (!ms.ok()) return line.str("error", ms.status().to_string()).print();
  const Stats st = stats_of(*ms);

  // FLOPs: 2 per weight parameter per token, plus causal attention's QKᵀ (qk_head_dim 192) and PV (v_head_dim 128)
  // over T(T+1)/2 query-key pairs per head per layer (the expanded form's count).
  const double t = static_cast<double>(tokens);
  const double attention_flops = 2.0 * static_cast<double>(c.num_attention_heads * (c.qk_head_dim() + c.v_head_dim)) *
                                 t * (t + 1.0) / 2.0 * static_cast<double>(c.num_hidden_layers);
  const double flops = 2.0 * run.shape.active_params_per_token * t + attention_flops;
  const double tflops = flops / (st.median * 1e-3) / 1e12;
  line.integer("steps", steps)
      .num("median_ms", st.median, 2)
      .num("min_ms", st.min, 2)
      .num("max_ms", st.max, 2)
      .num("tokens_per_s", t / (st.median * 1e-3), 1)
      .num("active_params_per_token", run.shape.active_params_per_token, 0)
      .num("flops", flops, 0)
      .num("tflops", tflops, 1);
  if (run.ceilings.bf16_tflops > 0) line.num("pct_bf16_peak", 100.0 * tflops / run.ceilings.bf16_tflops, 1);
  if (run.ceilings.fp8_tflops > 0) line.num("pct_fp8_peak", 100.0 * tflops / run.ceilings.fp8_tflops, 1);
  // The peak of the weights' precision (attention runs in bf16 either way).
  const double peak = run.precision == Precision::kFP8 ? run.ceilings.fp8_tflops : run.ceilings.bf16_tflops;
  if (peak > 0) line.num("pct_peak", 100.0 * tflops / peak, 1);
  line.print();
}

// A prefill chunk over a cached prefix (chunked prefill, a prefix-cache hit): `tokens` new rows of one sequence at
// positions prefix .. prefix + tokens - 1 (the cache holds zeros, which cost the attention the same reads). The
// backend picks the MLA form by its cost model (mla_expanded_pays) unless DEEPINFER_MLA_FORM forces one
// (`mla_form` in the line). FLOPs per (row, head, visible key): absorbed 2 (C + R) + 2 C, expanded 2 (nope + R) + 2 V
// plus, once per key and head, the up-projection 2 C (nope + V); `tflops` and `pct_peak` count the model's weights
// and the cheaper form's attention (the work the step must do), at the peak of the weights' precision.
void bench_chunk(const Run& run, int64_t prefix, int64_t tokens, int steps) {
  const model::ModelConfig& c = run.model.config();
  JsonLine line("chunk");
  const char* form = std::getenv("DEEPINFER_MLA_FORM");
  line.str("model", run.name).integer("prefix", prefix).integer("tokens", tokens).str(
      "mla_form", form != nullptr && *form != '\0' ? form : "auto");
  const int64_t blocks = (prefix + tokens + kBlockTokens - 1) / kBlockTokens;
  Result<std::vector<backend::Buffer>> caches = run.model.make_layer_caches(blocks + 1);
  if (!caches.ok()) return line.str("error", caches.status().to_string()).print();
  model::ForwardBatch fb;
  fb.token_ids = random_tokens(tokens, c.vocab_size, kSeed + static_cast<uint64_t>(prefix));
  fb.sequences.push_back({static_cast<int32_t>(tokens), static_cast<int32_t>(prefix), block_range(0, blocks)});
  fb.logits_rows = {static_cast<int32_t>(tokens - 1)};
  Result<std::vector<double>> ms = time_forward(run.model, fb, *caches, 1, steps);
  if (!ms.ok()) return line.str("error", ms.status().to_string()).print();
  profile_forward(run, "chunk " + std::to_string(tokens) + " after " + std::to_string(prefix), fb, *caches);
  const Stats st = stats_of(*ms);
  const double t = static_cast<double>(tokens), p = static_cast<double>(prefix);
  const double pairs = t * p + t * (t + 1.0) / 2.0;  // visible keys summed over the rows
  const double H = static_cast<double>(c.num_attention_heads), layers = static_cast<double>(c.num_hidden_layers);
  const double C = static_cast<double>(c.kv_lora_rank), R = static_cast<double>(c.qk_rope_head_dim),
               nope = static_cast<double>(c.qk_nope_head_dim), V = static_cast<double>(c.v_head_dim);
  const double absorbed_flops = pairs * H * (2.0 * (C + R) + 2.0 * C) * layers;
  const double expanded_flops =
      (pairs * H * (2.0 * (nope + R) + 2.0 * V) + (p + t) * H * 2.0 * C * (nope + V)) * layers;
  const double flops = 2.0 * run.shape.active_params_per_token * t + std::min(absorbed_flops, expanded_flops);
  const double tflops = flops / (st.median * 1e-3) / 1e12;
  line.integer("steps", steps)
      .num("median_ms", st.median, 2)
      .num("tokens_per_s", t / (st.median * 1e-3), 1)
      .num("attention_flops_absorbed", absorbed_flops, 0)
      .num("attention_flops_expanded", expanded_flops, 0)
      .num("tflops", tflops, 1);
  if (run.ceilings.bf16_tflops > 0) line.num("pct_bf16_peak", 100.0 * tflops / run.ceilings.bf16_tflops, 1);
  const double peak = run.precision == Precision::kFP8 ? run.ceilings.fp8_tflops : run.ceilings.bf16_tflops;
  if (peak > 0) line.num("pct_peak", 100.0 * tflops / peak, 1);
  line.print();
}

// DeepSeek-V4-Flash-shaped layers (configs/v4-flash-slice) with random bf16 weights on the CUDA backend's V4 path:
// decode steps at context kContext (the sequences prefilled first, 4 at a time) with every row's logits brought to
// the host (the V4 executor samples there), against the memory roofline; prefill of one sequence from position 0
// against the bf16 peak. Wall-clock per forward (each ends by reading its logits).
// With `profile`, one more decode step and one more prefill each run between cudaProfilerStart and Stop, for
// `ncu --profile-from-start off` (kernel times of one step; bench/gpu/ncu_step_summary.py groups them).
void bench_v4(const std::filesystem::path& config_dir, const std::vector<int64_t>& batches,
              const std::vector<int64_t>& prefill, int steps, int prefill_steps, const Ceilings& ceilings,
              bool profile, bool fp8) {
  const std::string name = "v4-flash-slice";
  JsonLine head("model");
  head.str("model", name).str("precision", fp8 ? "fp8 (as the release: attention, indexer wq_b, experts)" : "bf16");
  Result<model::V4Config> config = model::load_v4_config(config_dir / name / "config.json");
  if (!config.ok()) return head.str("error", config.status().to_string()).print();
  Result<std::unique_ptr<backend::Backend>> backend = backend::make_cuda_backend(0);
  if (!backend.ok()) return head.str("error", backend.status().to_string()).print();
  Result<std::unique_ptr<model::DeepSeekV4Model>> made = model::DeepSeekV4Model::create_random(
      *config, **backend, kSeed, fp8 ? std::optional(Precision::kFP8) : std::nullopt);
  if (!made.ok()) return head.str("error", made.status().to_string()).print();
  model::DeepSeekV4Model& m = **made;
  const model::V4Config& c = *config;
  const double dense = static_cast<double>(m.dense_weight_bytes()), expert = static_cast<double>(m.expert_bytes());
  const double layers = static_cast<double>(c.num_hidden_layers), K = static_cast<double>(c.num_experts_per_tok);
  const double E = static_cast<double>(c.n_routed_experts), D = static_cast<double>(c.head_dim);
  // Weights a token multiplies: every dense weight but the head and its K routed experts; the head only for the rows
  // whose logits are computed.
  const double head_params = static_cast<double>(c.vocab_size * c.hidden_size);
  const double expert_params = 3.0 * static_cast<double>(c.moe_intermediate_size * c.hidden_size);
  const double active_params = static_cast<double>(m.dense_weight_params()) - head_params + layers * K * expert_params;
  head.integer("layers", c.num_hidden_layers)
      .integer("fp8_weights", m.fp8_weights())
      .num("bytes_dense_weights", dense, 0)
      .num("bytes_per_expert", expert, 0)
      .num("active_params_per_token", active_params, 0)
      .print();
  using Chunk = model::DeepSeekV4Model::Chunk;
  using Logits = model::DeepSeekV4Model::Logits;
  auto timed = [](const std::function<Status()>& forward) -> Result<double> {
    const auto t0 = Clock::now();
    if (Status st = forward(); !st.ok()) return st;
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  std::vector<float> logits;
  for (int64_t batch : batches) {
    JsonLine line("decode");
    line.str("model", name).integer("batch", batch).integer("context", kContext);
    std::vector<std::unique_ptr<model::V4Sequence>> sequences;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t b = 0; b < batch; ++b) {
      sequences.push_back(m.new_sequence());
      prompts.push_back(random_tokens(kContext - 1, c.vocab_size, kSeed + static_cast<uint64_t>(b)));
    }
    Status status;
    for (int64_t b0 = 0; b0 < batch && status.ok(); b0 += 4) {
      std::vector<Chunk> chunks;
      for (int64_t b = b0; b < std::min(batch, b0 + 4); ++b) {
        chunks.push_back({sequences[static_cast<size_t>(b)].get(), prompts[static_cast<size_t>(b)], Logits::kNone});
      }
      status = m.forward(chunks, logits);
    }
    if (!status.ok()) {
      line.str("error", status.to_string()).print();
      continue;
    }
    std::vector<double> ms;
    for (int s = 0; s < kWarmupSteps + steps + (profile ? 1 : 0) && status.ok(); ++s) {
      const bool profiled = s == kWarmupSteps + steps;
      std::vector<int32_t> next = random_tokens(batch, c.vocab_size, kSeed + 1000 + static_cast<uint64_t>(s));
      std::vector<Chunk> chunks;
      for (int64_t b = 0; b < batch; ++b) {
        chunks.push_back({sequences[static_cast<size_t>(b)].get(),
                          std::span<const int32_t>(next.data() + b, 1), Logits::kLast});
      }
      if (profiled) cudaProfilerStart();
      Result<double> t = timed([&] { return m.forward(chunks, logits); });
      if (profiled) cudaProfilerStop();
      if (!t.ok()) {
        status = t.status();
      } else if (s >= kWarmupSteps && !profiled) {
        ms.push_back(*t);
      }
    }
    if (!status.ok()) {
      line.str("error", status.to_string()).print();
      continue;
    }
    const Stats st = stats_of(ms);
    // Bytes a step must read: the dense weights, the routed experts uniform routing touches, and per row and layer
    // the window's keys, the compressed entries attended (CSA: top-k; HCA: all) and the indexer keys scored.
    const double experts_per_layer = E * (1.0 - std::pow(1.0 - K / E, static_cast<double>(batch)));
    double kv_row = 0.0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const int64_t ratio = c.compress_ratios[static_cast<size_t>(l)];
      double keys = static_cast<double>(c.sliding_window);
      if (ratio == 4) {
        keys += static_cast<double>(std::min<int64_t>(c.index_topk, kContext / 4));
        kv_row += static_cast<double>(kContext / 4 * c.index_head_dim) * 2.0;
      } else if (ratio == 128) {
        keys += static_cast<double>(kContext / 128);
      }
      kv_row += keys * D * 2.0;
    }
    const double step_bytes = dense + layers * experts_per_layer * expert + static_cast<double>(batch) * kv_row;
    line.integer("steps", steps)
        .num("median_ms", st.median, 3)
        .num("min_ms", st.min, 3)
        .num("tokens_per_s", static_cast<double>(batch) / (st.median * 1e-3), 1)
        .num("experts_per_layer", experts_per_layer, 2)
        .num("bytes_step", step_bytes, 0)
        .str("sampling", "logits to the host");
    if (ceilings.copy_gbps > 0) {
      const double roofline_ms = step_bytes / (ceilings.copy_gbps * 1e9) * 1e3;
      line.num("roofline_ms", roofline_ms, 3).num("pct_roofline", 100.0 * roofline_ms / st.median, 1);
    }
    line.print();
  }
  for (int64_t tokens : prefill) {
    JsonLine line("prefill");
    line.str("model", name).integer("tokens", tokens);
    const std::vector<int32_t> ids = random_tokens(tokens, c.vocab_size, kSeed + static_cast<uint64_t>(tokens));
    std::vector<double> ms;
    Status status;
    for (int s = 0; s < 1 + prefill_steps + (profile ? 1 : 0) && status.ok(); ++s) {
      const bool profiled = s == 1 + prefill_steps;
      std::unique_ptr<model::V4Sequence> sequence = m.new_sequence();
      const Chunk chunk{sequence.get(), ids, Logits::kLast};
      if (profiled) cudaProfilerStart();
      Result<double> t = timed([&] { return m.forward(std::span<const Chunk>(&chunk, 1), logits); });
      if (profiled) cudaProfilerStop();
      if (!t.ok()) {
        status = t.status();
      } else if (s >= 1 && !profiled) {
        ms.push_back(*t);
      }
    }
    if (!status.ok()) {
      line.str("error", status.to_string()).print();
      continue;
    }
    const Stats st = stats_of(ms);
    // FLOPs: 2 per active parameter per token; attention 4 D per (row, head, key) over the window and the entries
    // each row attends; the indexer 2 index_dim per (row, index head, visible entry) on CSA layers.
    const double H = static_cast<double>(c.num_attention_heads);
    double attention = 0.0;
    for (int64_t p = 0; p < tokens; ++p) {
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const int64_t ratio = c.compress_ratios[static_cast<size_t>(l)];
        double keys = static_cast<double>(std::min<int64_t>(p + 1, c.sliding_window));
        if (ratio == 4) {
          const int64_t visible = (p + 1) / 4;
          keys += static_cast<double>(std::min(visible, c.index_topk));
          if (visible > c.index_topk) {
            attention += 2.0 * static_cast<double>(visible * c.index_n_heads * c.index_head_dim);
          }
        } else if (ratio == 128) {
          keys += static_cast<double>((p + 1) / 128);
        }
        attention += 4.0 * D * H * keys;
      }
    }
    const double flops = 2.0 * active_params * static_cast<double>(tokens) + 2.0 * head_params + attention;
    const double tflops = flops / (st.median * 1e-3) / 1e12;
    line.integer("steps", prefill_steps)
        .num("median_ms", st.median, 2)
        .num("tokens_per_s", static_cast<double>(tokens) / (st.median * 1e-3), 1)
        .num("attention_flops", attention, 0)
        .num("flops", flops, 0)
        .num("tflops", tflops, 1);
    if (ceilings.bf16_tflops > 0) line.num("pct_bf16_peak", 100.0 * tflops / ceilings.bf16_tflops, 1);
    if (fp8 && ceilings.fp8_tflops > 0) line.num("pct_fp8_peak", 100.0 * tflops / ceilings.fp8_tflops, 1);
    line.print();
  }
}

// A chunk case of --chunks: `tokens` new rows after `prefix` cached ones.
struct ChunkCase {
  int64_t prefix = 0, tokens = 0;
};

void bench_model(const std::string& name, Precision precision, const std::filesystem::path& config_dir,
                 const std::vector<int64_t>& batches, const std::vector<int64_t>& prefill,
                 const std::vector<ChunkCase>& chunks, int steps, int prefill_steps, const Ceilings& ceilings,
                 bool profile) {
  JsonLine line("model");
  line.str("model", name).str("precision", precision == Precision::kFP8 ? "fp8" : "bf16");
  Result<model::ModelConfig> config = model::load_model_config(config_dir / name / "config.json");
  if (!config.ok()) return line.str("error", config.status().to_string()).print();
  config->num_nextn_predict_layers = 0;  // MTP is not benchmarked
  Result<std::unique_ptr<backend::Backend>> backend = backend::make_cuda_backend(0);
  if (!backend.ok()) return line.str("error", backend.status().to_string()).print();
  // With --profile the model runs on a pass-through wrapper (timing only while enabled).
  std::unique_ptr<bench::ProfilingBackend> profiler;
  if (profile) profiler = std::make_unique<bench::ProfilingBackend>(**backend);
  backend::Backend& used = profiler ? *profiler : **backend;
  const auto start = Clock::now();
  Result<std::unique_ptr<model::DeepSeekModel>> model =
      model::DeepSeekModel::create_random(*config, used, precision, kSeed);
  Status synced = model.ok() ? (*backend)->synchronize() : model.status();  // fill_random is asynchronous
  if (!synced.ok()) return line.str("error", synced.to_string()).print();
  const double load_s = std::chrono::duration<double>(Clock::now() - start).count();
  const ModelShape shape = model_shape(*config, precision);
  line.integer("layers", config->num_hidden_layers)
      .integer("weight_bytes", static_cast<int64_t>((*model)->weight_bytes()))
      .num("load_s", load_s, 2)
      .num("bytes_non_expert", shape.non_expert_bytes, 0)
      .num("bytes_per_expert", shape.expert_bytes, 0)
      .integer("moe_layers", shape.moe_layers)
      .num("active_params_per_token", shape.active_params_per_token, 0)
      .print();
  const Run run{name, precision, **model, **backend, shape, ceilings, profiler.get()};
  for (int64_t batch : batches) bench_decode(run, batch, steps);
  for (int64_t tokens : prefill) bench_prefill(run, tokens, prefill_steps);
  for (const ChunkCase& chunk : chunks) bench_chunk(run, chunk.prefix, chunk.tokens, prefill_steps);
}

// --moe-sweep: one routed-experts layer (Backend::moe: routing, permutation, the expert GEMMs, combine) of the
// model's shape, random weights and activations, for each token count and each expert GEMM path (auto and the three
// forced through DEEPINFER_MOE_GEMM: a fresh backend per path). Against two limits: reading every expert the
// tokens reach once (expected distinct experts under uniform routing, E (1 - (1 - k/E)^T)) at the measured copy
// bandwidth, and the experts' FLOPs (2 T k 3 hidden I) at the tensor-core peak of the weights' precision.
void bench_moe_sweep(const std::string& name, Precision precision, const std::filesystem::path& config_dir,
                     const std::vector<int64_t>& tokens_list, const Ceilings& ceilings) {
  Result<model::ModelConfig> config = model::load_model_config(config_dir / name / "config.json");
  if (!config.ok()) return JsonLine("moe_sweep").str("model", name).str("error", config.status().to_string()).print();
  const model::ModelConfig& c = *config;
  const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok, hidden = c.hidden_size,
                I = c.moe_intermediate_size;
  const backend::MoeRoutingRule rule = model::routing_rule(c);
  const double weight_bytes = precision == Precision::kFP8 ? 1.0 : 2.0;
  const double expert_bytes = 3.0 * static_cast<double>(hidden * I) * weight_bytes;
  const double peak = precision == Precision::kFP8 ? ceilings.fp8_tflops : ceilings.bf16_tflops;
  const int64_t max_tokens = *std::max_element(tokens_list.begin(), tokens_list.end());
  for (const char* path :
       {"auto", "streaming", "tiled", "wgmma-128", "wgmma-256", "wgmma-swap32", "wgmma-swap64", "per-expert"}) {
    setenv("DEEPINFER_MOE_GEMM", path, 1);
    Result<std::unique_ptr<backend::Backend>> made = backend::make_cuda_backend(0);
    unsetenv("DEEPINFER_MOE_GEMM");
    JsonLine base("moe_sweep");
    base.str("model", name).str("precision", precision == Precision::kFP8 ? "fp8" : "bf16").str("path", path);
    if (!made.ok()) return JsonLine(base).str("error", made.status().to_string()).print();
    backend::Backend& b = **made;
    auto weight = [&](int64_t count, int64_t rows, int64_t cols, Precision p, uint64_t seed) {
      Result<std::unique_ptr<backend::Weight>> w = b.make_weight(count, rows, cols, p);
      if (w.ok()) b.fill_random(**w, seed, 1.0f / std::sqrt(static_cast<float>(cols)));
      return w;
    };
    auto router = weight(1, E, hidden, Precision::kF32, kSeed);
    auto gate_up = weight(E, 2 * I, hidden, precision, kSeed + 1);
    auto down = weight(E, hidden, I, precision, kSeed + 2);
    Result<backend::Buffer> bias = b.make_vector(std::vector<float>(static_cast<size_t>(E), 0.0f));
    Result<backend::Buffer> x = b.alloc(static_cast<size_t>(max_tokens * hidden) * 2);
    Result<backend::Buffer> out = b.alloc(static_cast<size_t>(max_tokens * hidden) * 2);
    if (!router.ok() || !gate_up.ok() || !down.ok() || !bias.ok() || !x.ok() || !out.ok())
      return JsonLine(base).str("error", "allocating the layer's weights or activations failed").print();
    {
      std::vector<uint16_t> host(static_cast<size_t>(max_tokens * hidden));
      for (size_t i = 0; i < host.size(); ++i) {
        const float v = static_cast<float>(gc::splitmix64(kSeed * 0x100000000ull + i) >> 40) / 8388608.0f - 1.0f;
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        host[i] = static_cast<uint16_t>(bits >> 16);
      }
      if (Status st = b.upload(host.data(), host.size() * 2, *x, 0); !st.ok())
        return JsonLine(base).str("error", st.to_string()).print();
    }
    const backend::MoeWeights mw{rule, router->get(), c.topk_method == "noaux_tc" ? &*bias : nullptr, gate_up->get(),
                                 down->get()};
    for (int64_t T : tokens_list) {
      JsonLine line(base);
      const backend::Tensor xt{x->data(), backend::DType::kBF16, T, hidden, hidden};
      const backend::Tensor ot{out->data(), backend::DType::kBF16, T, hidden, hidden};
      constexpr int kWarmup = 2;
      const int reps = T >= 4096 ? 5 : 20;
      for (int i = 0; i < kWarmup; ++i) b.moe(xt, mw, ot);
      Status st = b.synchronize();
      const auto start = Clock::now();
      for (int i = 0; i < reps && st.ok(); ++i) b.moe(xt, mw, ot);
      if (st.ok()) st = b.synchronize();
      if (!st.ok()) {
        line.integer("tokens", T).str("error", st.to_string()).print();
        return;
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / reps;
      const double Ed = static_cast<double>(E), kd = static_cast<double>(k), Td = static_cast<double>(T);
      const double experts_read = Ed * (1.0 - std::pow(1.0 - kd / Ed, Td));
      const double bytes = experts_read * expert_bytes + 2.0 * Td * static_cast<double>(hidden) * 2.0;
      const double flops = 2.0 * Td * kd * 3.0 * static_cast<double>(hidden * I);
      const double bytes_us = ceilings.copy_gbps > 0 ? bytes / (ceilings.copy_gbps * 1e3) : 0;
      const double flops_us = peak > 0 ? flops / (peak * 1e6) : 0;
      line.integer("tokens", T)
          .num("rows_per_expert", Td * kd / Ed, 1)
          .num("us", us, 1)
          .num("bytes_limit_us", bytes_us, 1)
          .num("flops_limit_us", flops_us, 1)
          .num("pct_of_limit", 100.0 * std::max(bytes_us, flops_us) / us, 1)
          .num("tflops", flops / (us * 1e6), 1)
          .print();
    }
  }
}

// --kv-copy: whole KV blocks of the model's cache layout (num_hidden_layers x 64 tokens x (kv_lora_rank +
// qk_rope_head_dim) bf16) between the device caches and pageable host payloads, as a prefill/decode handoff and the
// host tier move them: backend::download_kv_blocks / upload_kv_blocks (the product's batched path, pinned staging)
// against the path before it (one pageable Backend::download / upload per layer and block), for N blocks scattered
// over a pool. The ceilings, in the same run: one contiguous cudaMemcpy of the same bytes from / to pinned memory,
// and from / to pageable memory.
void bench_kv_copy(const std::string& name, const std::filesystem::path& config_dir,
                   const std::vector<int64_t>& blocks_list) {
  Result<model::ModelConfig> config = model::load_model_config(config_dir / name / "config.json");
  if (!config.ok()) return JsonLine("kv_copy").str("model", name).str("error", config.status().to_string()).print();
  const int64_t layers = config->num_hidden_layers;
  const size_t layer_bytes = static_cast<size_t>(64 * (config->kv_lora_rank + config->qk_rope_head_dim)) * 2;
  const int64_t max_blocks = *std::max_element(blocks_list.begin(), blocks_list.end());
  const int64_t pool = 2 * max_blocks;
  Result<std::unique_ptr<backend::Backend>> made = backend::make_cuda_backend(0);
  if (!made.ok()) return JsonLine("kv_copy").str("model", name).str("error", made.status().to_string()).print();
  backend::Backend& b = **made;
  std::vector<backend::Buffer> caches;
  for (int64_t l = 0; l < layers; ++l) {
    Result<backend::Buffer> cache = b.alloc(static_cast<size_t>(pool) * layer_bytes);
    if (!cache.ok()) return JsonLine("kv_copy").str("model", name).str("error", cache.status().to_string()).print();
    caches.push_back(*cache);
  }
  const size_t block_bytes = static_cast<size_t>(layers) * layer_bytes;
  std::mt19937_64 rng(kSeed);
  for (int64_t n : blocks_list) {
    std::vector<int32_t> ids(static_cast<size_t>(pool));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<size_t>(n));
    std::vector<std::vector<std::byte>> payloads(static_cast<size_t>(n), std::vector<std::byte>(block_bytes));
    std::vector<std::byte*> out;
    std::vector<const std::byte*> in;
    for (auto& p : payloads) {
      out.push_back(p.data());
      in.push_back(p.data());
    }
    const double bytes = static_cast<double>(block_bytes) * static_cast<double>(n);
    auto time_ms = [&](const std::function<Status()>& run) -> double {
      double best = 1e30;
      for (int rep = 0; rep < 4; ++rep) {  // the first is a warm-up (pinned staging, page faults)
        const auto start = Clock::now();
        if (Status st = run(); !st.ok()) return -1;
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
        if (rep > 0) best = std::min(best, ms);
      }
      return best;
    };
    const double batch_down = time_ms([&] { return backend::download_kv_blocks(b, caches, layer_bytes, ids, out); });
    const double batch_up = time_ms([&] { return backend::upload_kv_blocks(b, caches, layer_bytes, ids, in); });
    const double per_layer_down = time_ms([&] {
      for (size_t i = 0; i < ids.size(); ++i)
        for (int64_t l = 0; l < layers; ++l)
          if (Status st = b.download(caches[static_cast<size_t>(l)], static_cast<size_t>(ids[i]) * layer_bytes,
                                     layer_bytes, out[i] + static_cast<size_t>(l) * layer_bytes);
              !st.ok())
            return st;
      return Status();
    });
    const double per_layer_up = time_ms([&] {
      for (size_t i = 0; i < ids.size(); ++i)
        for (int64_t l = 0; l < layers; ++l)
          if (Status st = b.upload(in[i] + static_cast<size_t>(l) * layer_bytes, layer_bytes,
                                   caches[static_cast<size_t>(l)], static_cast<size_t>(ids[i]) * layer_bytes);
              !st.ok())
            return st;
      return Status();
    });
    // Ceilings: the same bytes in one contiguous copy, pinned and pageable host memory.
    const size_t total = static_cast<size_t>(bytes);
    double pinned_down = -1, pinned_up = -1, pageable_down = -1, pageable_up = -1;
    void* pinned = nullptr;
    Result<backend::Buffer> flat = b.alloc(total);
    if (flat.ok() && cudaHostAlloc(&pinned, total, cudaHostAllocDefault) == cudaSuccess) {
      std::vector<std::byte> pageable(total);
      auto copy = [&](void* dst, const void* src, cudaMemcpyKind kind) {
        return time_ms([&] {
          return cudaMemcpy(dst, src, total, kind) == cudaSuccess ? Status() : Status::internal("cudaMemcpy");
        });
      };
      pinned_down = copy(pinned, flat->data(), cudaMemcpyDeviceToHost);
      pinned_up = copy(flat->data(), pinned, cudaMemcpyHostToDevice);
      pageable_down = copy(pageable.data(), flat->data(), cudaMemcpyDeviceToHost);
      pageable_up = copy(flat->data(), pageable.data(), cudaMemcpyHostToDevice);
      cudaFreeHost(pinned);
    }
    (void)cudaGetLastError();
    auto gbps = [&](double ms) { return ms > 0 ? bytes / (ms * 1e6) : -1.0; };
    JsonLine("kv_copy")
        .str("model", name)
        .integer("layers", layers)
        .integer("block_bytes", static_cast<int64_t>(block_bytes))
        .integer("blocks", n)
        .num("batch_download_ms", batch_down, 2)
        .num("batch_download_gbps", gbps(batch_down), 2)
        .num("per_layer_download_ms", per_layer_down, 2)
        .num("per_layer_download_gbps", gbps(per_layer_down), 2)
        .num("batch_upload_ms", batch_up, 2)
        .num("batch_upload_gbps", gbps(batch_up), 2)
        .num("per_layer_upload_ms", per_layer_up, 2)
        .num("per_layer_upload_gbps", gbps(per_layer_up), 2)
        .num("pinned_contiguous_download_gbps", gbps(pinned_down), 2)
        .num("pinned_contiguous_upload_gbps", gbps(pinned_up), 2)
        .num("pageable_contiguous_download_gbps", gbps(pageable_down), 2)
        .num("pageable_contiguous_upload_gbps", gbps(pageable_up), 2)
        .print();
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Model-level GPU benchmark: decode and prefill of DeepSeek-V2-Lite (bf16) and a 4-layer DeepSeek-V3 "
      "slice (FP8) with random weights on the CUDA backend; JSON lines"};
  std::string which = "all";
  std::vector<int64_t> batches = {1, 8, 64, 256};
  std::vector<int64_t> prefill = {4096, 32768};
  int steps = 10, prefill_steps = 2;
  // The script runs from the repository root; the source tree's copy otherwise.
  std::string configs =
      std::filesystem::exists("bench/gpu/configs") ? "bench/gpu/configs" : DEEPINFER_SOURCE_DIR "/bench/gpu/configs";
  app.add_option("--model", which, "v2-lite, v3-slice, v4-flash-slice or all (the first two)")
      ->check(CLI::IsMember({"v2-lite", "v3-slice", "v4-flash-slice", "all"}))
      ->capture_default_str();
  app.add_option("--batches", batches, "decode batch sizes (context 4096 each)")->delimiter(',')->capture_default_str();
  app.add_option("--prefill", prefill, "prefill lengths (one sequence each)")->delimiter(',')->capture_default_str();
  app.add_option("--steps", steps, "timed decode steps (after 2 warm-up steps)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--prefill-steps", prefill_steps, "timed prefill passes (after 1 warm-up pass)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--configs", configs, "directory with <model>/config.json")->capture_default_str();
  bool v4_fp8 = false;
  app.add_flag("--fp8", v4_fp8,
               "v4-flash-slice: FP8 weights where the release has them (attention, the indexer's wq_b, experts); "
               "default bf16 (v3-slice is always FP8, v2-lite bf16)");
  bool profile = false;
  app.add_flag("--profile", profile, "after each measurement, one more forward with every backend op timed alone");
  std::vector<std::string> chunk_specs = {"3584:512"};
  app.add_option("--chunks", chunk_specs,
                 "prefill chunks over a cached prefix, CACHED:NEW each (the seed's scenario: 73920:3080); none: skip")
      ->delimiter(',')
      ->capture_default_str();
  std::vector<int64_t> moe_sweep;
  app.add_option("--moe-sweep", moe_sweep,
                 "instead of the model runs: one MoE layer at these token counts, every expert GEMM path")
      ->delimiter(',');
  std::vector<int64_t> kv_copy;
  app.add_option("--kv-copy", kv_copy,
                 "instead of the model runs: whole KV blocks device <-> host at these block counts, batched and "
                 "per layer")
      ->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  // The modes replace the model runs, one at a time, and run over v2-lite / v3-slice only.
  if (!kv_copy.empty() && !moe_sweep.empty()) {
    std::fprintf(stderr, "--kv-copy and --moe-sweep are separate runs: give one\n");
    return 2;
  }
  if ((!kv_copy.empty() || !moe_sweep.empty()) && which == "v4-flash-slice") {
    std::fprintf(stderr, "--kv-copy and --moe-sweep take --model v2-lite, v3-slice or all\n");
    return 2;
  }
  if (v4_fp8 && which != "v4-flash-slice") {
    std::fprintf(stderr, "--fp8 applies to --model v4-flash-slice only (v3-slice is FP8, v2-lite bf16)\n");
    return 2;
  }
  std::vector<ChunkCase> chunks;
  for (const std::string& spec : chunk_specs) {
    if (spec == "none") continue;
    const size_t colon = spec.find(':');
    ChunkCase chunk;
    try {
      if (colon == std::string::npos) throw std::invalid_argument(spec);
      chunk.prefix = std::stoll(spec.substr(0, colon));
      chunk.tokens = std::stoll(spec.substr(colon + 1));
    } catch (const std::exception&) {
      chunk.tokens = 0;
    }
    if (chunk.prefix < 0 || chunk.tokens <= 0) {
      std::fprintf(stderr, "--chunks: '%s' is not CACHED:NEW with CACHED >= 0 and NEW >= 1\n", spec.c_str());
      return 2;
    }
    chunks.push_back(chunk);
  }

  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, 0); e != cudaSuccess) {
    JsonLine("device").str("error", cudaGetErrorString(e)).print();
    return 1;
  }
  JsonLine("device")
      .str("name", prop.name)
      .integer("sms", prop.multiProcessorCount)
      .integer("memory_bytes", static_cast<int64_t>(prop.totalGlobalMem))
      .print();
  Ceilings ceilings;
  if (kv_copy.empty()) {  // --kv-copy measures its own (host <-> device)
    measure_copy(ceilings);
    measure_bf16_gemm(ceilings);
    measure_fp8_gemm(ceilings);
  }
  if (which == "v4-flash-slice") {
    bench_v4(configs, batches, prefill, steps, prefill_steps, ceilings, profile, v4_fp8);
    return 0;
  }
  for (const auto& [name, precision] :
       {std::pair{"v2-lite", Precision::kBF16}, std::pair{"v3-slice", Precision::kFP8}}) {
    if (which != "all" && which != name) continue;
    if (!kv_copy.empty())
      bench_kv_copy(name, configs, kv_copy);
    else if (!moe_sweep.empty())
      bench_moe_sweep(name, precision, configs, moe_sweep, ceilings);
    else
      bench_model(name, precision, configs, batches, prefill, chunks, steps, prefill_steps, ceilings, profile);
  }
  return 0;
}
