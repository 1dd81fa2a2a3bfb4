// gpu_check_backend: every op of the CUDA backend (src/backend/cuda) against the CPU backend, the reference, on the
// same random inputs (bf16-representable, so both backends start from identical values), through the Backend
// interface only (ggml's test-backend-ops). Strided views carry a sentinel in their padding columns, which must
// survive every op. mla_expanded, which the CPU backend lacks, is checked against a float64 loop here.
// Prints one JSON line per check; exit status 0 only when every check passed (2: no usable CUDA device).
//   gpu_check_backend [device]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/backend/communicator.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/sampling_params.h"

namespace {

namespace be = deepinfer::backend;
using be::Backend;
using be::Buffer;
using be::DType;
using be::Precision;
using be::Tensor;

constexpr float kSentinel = 77.0f;  // the padding columns' value (exact in bf16)

uint16_t to_bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float from_bf16_bits(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
float round_bf16(float v) { return from_bf16_bits(to_bf16_bits(v)); }

float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

struct Random {
  std::mt19937_64 engine{20250611};
  // n bf16-representable values uniform in [-scale, scale).
  std::vector<float> values(size_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = round_bf16(u(engine));
    return v;
  }
  int64_t index(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(engine); }
};

int g_failures = 0;

void expect_close(const std::string& name, const std::vector<float>& got, const std::vector<float>& want,
                  double tolerance) {
  double max_err = 0.0, max_ref = 0.0;
  size_t worst = 0;
  bool finite = got.size() == want.size();
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (!std::isfinite(got[i])) finite = false;
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  const bool ok = finite && max_err <= tolerance * std::max(max_ref, 1e-3);
  std::printf(
      "{\"check\":\"%s\",\"values\":%zu,\"max_abs_err\":%.4g,\"max_abs_ref\":%.4g,\"worst_index\":%zu,"
      "\"got\":%.6g,\"want\":%.6g,\"tolerance\":%.3g,\"ok\":%s}\n",
      name.c_str(), want.size(), max_err, max_ref, worst, worst < got.size() ? got[worst] : NAN,
      worst < want.size() ? want[worst] : NAN, tolerance, ok ? "true" : "false");
  if (!ok) ++g_failures;
}

void expect(const std::string& name, bool ok, const std::string& detail = "") {
  std::printf("{\"check\":\"%s\",\"detail\":\"%s\",\"ok\":%s}\n", name.c_str(), detail.c_str(), ok ? "true" : "false");
  if (!ok) ++g_failures;
}

void expect_ok(const std::string& name, const deepinfer::Status& s) { expect(name, s.ok(), s.to_string()); }

template <class T>
T must(deepinfer::Result<T> r, const char* what) {
  if (!r.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, r.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(r).value();
}

// An activation [rows, cols] at row stride `stride` in one backend's memory; padding columns hold kSentinel.
struct Act {
  Buffer buffer;
  Tensor view;
};

Act make_act(Backend& b, const std::vector<float>& host, int64_t rows, int64_t cols, int64_t stride) {
  const DType d = b.activation_dtype();
  Act a;
  a.buffer = must(b.alloc(static_cast<size_t>(rows * stride) * be::dtype_size(d)), "alloc");
  std::vector<float> full(static_cast<size_t>(rows * stride), kSentinel);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) full[r * stride + c] = host[r * cols + c];
  if (d == DType::kF32) {
    expect_ok("upload", b.upload(full.data(), full.size() * 4, a.buffer, 0));
  } else {
    std::vector<uint16_t> bits(full.size());
    for (size_t i = 0; i < full.size(); ++i) bits[i] = to_bf16_bits(full[i]);
    expect_ok("upload", b.upload(bits.data(), bits.size() * 2, a.buffer, 0));
  }
  a.view = Tensor{a.buffer.data(), d, rows, cols, stride};
  return a;
}
Act make_act(Backend& b, int64_t rows, int64_t cols, int64_t stride) {
  return make_act(b, std::vector<float>(static_cast<size_t>(rows * cols), 0.0f), rows, cols, stride);
}

// The view's values [rows, cols]; a changed padding column fails the check `name`.
std::vector<float> read_act(Backend& b, const Act& a, const std::string& name) {
  expect_ok(name + " (synchronize)", b.synchronize());
  const int64_t rows = a.view.rows, cols = a.view.cols, stride = a.view.stride;
  std::vector<float> full(static_cast<size_t>(rows * stride));
  if (a.view.dtype == DType::kF32) {
    expect_ok(name + " (download)", b.download(a.buffer, 0, full.size() * 4, full.data()));
  } else {
    std::vector<uint16_t> bits(full.size());
    expect_ok(name + " (download)", b.download(a.buffer, 0, bits.size() * 2, bits.data()));
    for (size_t i = 0; i < bits.size(); ++i) full[i] = from_bf16_bits(bits[i]);
  }
  std::vector<float> out(static_cast<size_t>(rows * cols));
  bool padding_ok = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < stride; ++c) {
      if (c < cols)
        out[r * cols + c] = full[r * stride + c];
      else
        padding_ok = padding_ok && full[r * stride + c] == kSentinel;
    }
  if (stride > cols) expect(name + " (padding untouched)", padding_ok, b.name().data());
  return out;
}

// The same weight on both backends: host values [count][rows][cols]. FP8: the GPU gets e4m3 bytes with
// power-of-two block scales, the CPU the exactly dequantized values (a bf16 weight).
struct WeightPair {
  std::unique_ptr<be::Weight> cpu, gpu;
  std::vector<float> values;  // what both compute with
};

WeightPair make_weights(Backend& cpu, Backend& gpu, Random& rng, int64_t count, int64_t rows, int64_t cols,
                        Precision precision, float scale) {
  WeightPair w;
  const int64_t n = rows * cols;
  w.cpu = must(cpu.make_weight(count, rows, cols, precision == Precision::kFP8 ? Precision::kBF16 : precision),
               "make_weight (cpu)");
  w.gpu = must(gpu.make_weight(count, rows, cols, precision), "make_weight (gpu)");
  for (int64_t m = 0; m < count; ++m) {
    std::vector<float> values;
    be::HostMatrix gpu_host{rows, cols, {}, {}, {}};
    std::vector<uint8_t> bytes;
    std::vector<float> scales;
    if (precision == Precision::kFP8) {
      const int64_t sr = (rows + 127) / 128, sc = (cols + 127) / 128;
      bytes.resize(static_cast<size_t>(n));
      for (uint8_t& b : bytes) {
        b = static_cast<uint8_t>(rng.index(256));
        if ((b & 0x7f) == 0x7f) b ^= 1;  // no NaN
      }
      scales.resize(static_cast<size_t>(sr * sc));
      for (float& s : scales) s = std::ldexp(scale, -8 - static_cast<int>(rng.index(3)));  // |fp8| <= 448
      values.resize(static_cast<size_t>(n));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          values[r * cols + c] = e4m3_to_float(bytes[r * cols + c]) * scales[(r / 128) * sc + c / 128];
      gpu_host.fp8 = bytes;
      gpu_host.fp8_scales = scales;
    } else {
      values = rng.values(static_cast<size_t>(n), scale);
      gpu_host.f32 = values;
    }
    expect_ok("set_matrix (gpu)", gpu.set_matrix(*w.gpu, m, gpu_host));
    expect_ok("set_matrix (cpu)", cpu.set_matrix(*w.cpu, m, be::HostMatrix{rows, cols, values, {}, {}}));
    w.values.insert(w.values.end(), values.begin(), values.end());
  }
  return w;
}

struct Pair {
  Backend& cpu;
  Backend& gpu;
  Random rng;
};

void check_linear(Pair& p, const char* label, Precision precision, int64_t M, int64_t K, int64_t N, int64_t x_pad,
                  int64_t y_pad, double tolerance) {
  WeightPair w = make_weights(p.cpu, p.gpu, p.rng, 1, N, K, precision, 1.0f / std::sqrt(static_cast<float>(K)));
  const std::vector<float> x = p.rng.values(static_cast<size_t>(M * K));
  std::vector<float> results[2];
  Backend* backends[2] = {&p.cpu, &p.gpu};
  const be::Weight* weights[2] = {w.cpu.get(), w.gpu.get()};
  for (int i = 0; i < 2; ++i) {
    Act xa = make_act(*backends[i], x, M, K, K + x_pad);
    Act ya = make_act(*backends[i], M, N, N + y_pad);
    backends[i]->linear(xa.view, *weights[i], ya.view);
    results[i] = read_act(*backends[i], ya, label);
  }
  expect_close(label, results[1], results[0], tolerance);
}

void check_linear_heads(Pair& p, const char* label, Precision precision) {
  const int64_t T = 6, H = 4, K = 64, N = 32, x_head = 80, y_head = 40;
  WeightPair w = make_weights(p.cpu, p.gpu, p.rng, H, N, K, precision, 0.125f);
  const std::vector<float> x = p.rng.values(static_cast<size_t>(T * H * x_head));
  Backend* backends[2] = {&p.cpu, &p.gpu};
  const be::Weight* weights[2] = {w.cpu.get(), w.gpu.get()};
  std::vector<float> results[2];
  for (int i = 0; i < 2; ++i) {
    Act xa = make_act(*backends[i], x, T, H * x_head, H * x_head + 8);
    Act ya = make_act(*backends[i], T, H * y_head, H * y_head + 8);
    backends[i]->fill_zero(ya.view);
    backends[i]->linear_heads(xa.view, x_head, *weights[i], ya.view, y_head);
    results[i] = read_act(*backends[i], ya, label);
  }
  expect_close(label, results[1], results[0], 2e-2);
}

void check_rowwise(Pair& p) {
  Backend* backends[2] = {&p.cpu, &p.gpu};
  for (int64_t dim : {160, 7168}) {
    const int64_t rows = 9;
    const std::vector<float> x = p.rng.values(static_cast<size_t>(rows * dim), 4.0f);
    const std::vector<float> delta = p.rng.values(static_cast<size_t>(rows * dim), 4.0f);
    const std::vector<float> norm = p.rng.values(static_cast<size_t>(dim), 2.0f);
    std::vector<float> normed[2], strided[2], fused_res[2], fused_y[2], mixed_y[2], added[2], copied[2], zero[2];
    for (int i = 0; i < 2; ++i) {
      Backend& b = *backends[i];
      Buffer nw = must(b.make_vector(norm), "make_vector");
      Act xa = make_act(b, x, rows, dim, dim);
      Act ya = make_act(b, rows, dim, dim);
      b.rms_norm(xa.view, nw, 1e-6f, ya.view);
      normed[i] = read_act(b, ya, "rms_norm");
      Act yb = make_act(b, rows, dim, dim + 24);  // a different stride than x: the copy-then-normalize path
      b.rms_norm(xa.view, nw, 1e-6f, yb.view);
      strided[i] = read_act(b, yb, "rms_norm (strided y)");
      Act res = make_act(b, x, rows, dim, dim), da = make_act(b, delta, rows, dim, dim);
      Act y2 = make_act(b, rows, dim, dim);
      b.add_rms_norm(res.view, da.view, nw, 1e-6f, y2.view);
      fused_y[i] = read_act(b, y2, "add_rms_norm");
      fused_res[i] = read_act(b, res, "add_rms_norm residual");
      Act res2 = make_act(b, x, rows, dim, dim + 8), y3 = make_act(b, rows, dim, dim + 16);
      b.add_rms_norm(res2.view, da.view, nw, 1e-6f, y3.view);
      mixed_y[i] = read_act(b, y3, "add_rms_norm (mixed strides)");
      Act xs = make_act(b, x, rows, dim, dim + 8), ds = make_act(b, delta, rows, dim, dim + 16);
      b.add(xs.view, ds.view);
      added[i] = read_act(b, xs, "add");
      Act cs = make_act(b, rows, dim, dim + 40);
      b.copy(ds.view, cs.view);
      copied[i] = read_act(b, cs, "copy");
      b.fill_zero(cs.view);
      zero[i] = read_act(b, cs, "fill_zero");
    }
    const std::string d = " dim " + std::to_string(dim);
    expect_close("rms_norm" + d, normed[1], normed[0], 1e-2);
    expect_close("rms_norm strided" + d, strided[1], strided[0], 1e-2);
    expect_close("add_rms_norm y" + d, fused_y[1], fused_y[0], 1.5e-2);
    expect_close("add_rms_norm residual" + d, fused_res[1], fused_res[0], 1e-2);
    expect_close("add_rms_norm mixed strides" + d, mixed_y[1], mixed_y[0], 1.5e-2);
    expect_close("add" + d, added[1], added[0], 1e-2);
    expect_close("copy" + d, copied[1], copied[0], 0.0);
    expect_close("fill_zero" + d, zero[1], zero[0], 0.0);
  }
  for (int64_t n : {96, 2048}) {
    const int64_t rows = 7;
    const std::vector<float> gu = p.rng.values(static_cast<size_t>(rows * 2 * n), 4.0f);
    std::vector<float> direct[2], strided[2];
    for (int i = 0; i < 2; ++i) {
      Backend& b = *backends[i];
      Act g = make_act(b, gu, rows, 2 * n, 2 * n), o = make_act(b, rows, n, n);
      b.silu_mul(g.view, o.view);
      direct[i] = read_act(b, o, "silu_mul");
      Act gs = make_act(b, gu, rows, 2 * n, 2 * n + 8), os = make_act(b, rows, n, n + 8);
      b.silu_mul(gs.view, os.view);
      strided[i] = read_act(b, os, "silu_mul strided");
    }
    expect_close("silu_mul n " + std::to_string(n), direct[1], direct[0], 1e-2);
    expect_close("silu_mul strided n " + std::to_string(n), strided[1], strided[0], 1e-2);
  }
}

// A step of `rows` rows over sequences given as (first position, rows); block tables of distinct random blocks.
struct StepData {
  std::vector<int32_t> token_ids, positions, row_sequence, logits_rows;
  std::vector<int64_t> slots;
  std::vector<std::vector<int32_t>> block_tables;
  bool rows_start_at_zero = false;
  be::StepLayout layout() const {
    return be::StepLayout{token_ids, positions, row_sequence, slots, block_tables, logits_rows, rows_start_at_zero};
  }
};

StepData make_step(Random& rng, const std::vector<std::pair<int32_t, int32_t>>& sequences, int64_t num_blocks,
                   int64_t vocab) {
  StepData s;
  std::vector<int32_t> free_blocks(static_cast<size_t>(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) free_blocks[i] = static_cast<int32_t>(i);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng.engine);
  size_t next = 0;
  s.rows_start_at_zero = true;
  for (size_t q = 0; q < sequences.size(); ++q) {
    const auto [start, rows] = sequences[q];
    std::vector<int32_t> table;
    for (int32_t b = 0; b < (start + rows + 63) / 64; ++b) table.push_back(free_blocks.at(next++));
    for (int32_t i = 0; i < rows; ++i) {
      const int32_t pos = start + i;
      s.token_ids.push_back(static_cast<int32_t>(rng.index(vocab)));
      s.positions.push_back(pos);
      s.row_sequence.push_back(static_cast<int32_t>(q));
      s.slots.push_back(static_cast<int64_t>(table[pos / 64]) * 64 + pos % 64);
    }
    s.block_tables.push_back(table);
    s.rows_start_at_zero = s.rows_start_at_zero && start == 0;
  }
  return s;
}

void check_step_ops(Pair& p) {
  Backend* backends[2] = {&p.cpu, &p.gpu};
  const int64_t vocab = 1000, hidden = 160, H = 4, nope = 32, R = 64;
  const StepData s = make_step(p.rng, {{5, 3}, {0, 4}, {130, 1}}, 16, vocab);
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  WeightPair table = make_weights(p.cpu, p.gpu, p.rng, 1, vocab, hidden, Precision::kBF16, 1.0f);
  std::vector<float> inv_freq(R / 2);
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / R);
  const std::vector<float> q = p.rng.values(static_cast<size_t>(T * H * (nope + R)));
  std::vector<float> embedded[2], roped[2], sharded[2], gathered[2];
  // gather_step_rows: the step's ids index an activation of vocab rows (strided source, DSpark's injection).
  const std::vector<float> source = p.rng.values(static_cast<size_t>(vocab * 32));
  const be::Weight* tables[2] = {table.cpu.get(), table.gpu.get()};
  // A vocabulary shard (tensor parallel): ids [600, 1600) of a table of 1000 rows; the others' rows are zeros.
  WeightPair shard = make_weights(p.cpu, p.gpu, p.rng, 1, vocab, hidden, Precision::kBF16, 1.0f);
  const be::Weight* shards[2] = {shard.cpu.get(), shard.gpu.get()};
  for (int i = 0; i < 2; ++i) {
    Backend& b = *backends[i];
    expect_ok("begin_step", b.begin_step(s.layout()));
    Act e = make_act(b, T, hidden, hidden + 8);
    b.embed(*tables[i], e.view, 0);
    embedded[i] = read_act(b, e, "embed");
    Act es = make_act(b, T, hidden, hidden);
    b.embed(*shards[i], es.view, 600);
    sharded[i] = read_act(b, es, "embed (vocabulary shard)");
    Act src = make_act(b, source, vocab, 24, 32);
    Act g = make_act(b, T, 24, 24);
    b.gather_step_rows(src.view, g.view);
    gathered[i] = read_act(b, g, "gather_step_rows");
    Buffer freq = must(b.make_vector(inv_freq), "make_vector");
    Act qa = make_act(b, q, T, H * (nope + R), H * (nope + R));
    // The rope part of every head: T * H vectors of R values at stride nope + R.
    const Tensor rope_view{static_cast<char*>(qa.buffer.data()) + nope * be::dtype_size(b.activation_dtype()),
                           b.activation_dtype(), T * H, R, nope + R};
    b.rope(rope_view, H, freq, 1.25f);
    roped[i] = read_act(b, qa, "rope");
  }
  expect_close("embed", embedded[1], embedded[0], 0.0);
  expect_close("embed (vocabulary shard, first id 600)", sharded[1], sharded[0], 0.0);
  expect_close("rope (q heads, strided)", roped[1], roped[0], 1e-2);
  expect_close("gather_step_rows", gathered[1], gathered[0], 0.0);
}

// mla_prepare (rms_norm + rope + store_kv + rope + copy) at DeepSeek-V3's sizes (128 heads: the kernel's rope loop
// runs several rounds): the CUDA backend's fused kernel (main() sets DEEPINFER_FUSED_MLA_PREPARE=require, so it
// cannot fall back to the five ops unnoticed) against the same backend's five ops (the base version: the same bits)
// and against the CPU backend.
void check_mla_prepare(Pair& p) {
  const int64_t H = 128, C = 512, R = 64, nope = 128, qk = nope + R, entry = C + R, num_blocks = 16;
  const StepData s = make_step(p.rng, {{5, 3}, {0, 4}, {130, 1}, {63, 2}}, num_blocks, 100);
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  std::vector<float> inv_freq(R / 2);
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / R);
  const std::vector<float> kv = p.rng.values(static_cast<size_t>(T * entry), 3.0f);
  const std::vector<float> q = p.rng.values(static_cast<size_t>(T * H * qk));
  const std::vector<float> cache_values = p.rng.values(static_cast<size_t>(num_blocks * 64 * entry));
  std::vector<float> norm = p.rng.values(static_cast<size_t>(C));
  for (float& w : norm) w = round_bf16(1.0f + 0.5f * w);
  enum { kCpu, kFused, kComposed };
  std::vector<float> got[3][4];
  for (int run : {kCpu, kFused, kComposed}) {
    Backend& b = run == kCpu ? p.cpu : p.gpu;
    expect_ok("begin_step", b.begin_step(s.layout()));
    Act kva = make_act(b, kv, T, entry, entry + 8);
    Act qa = make_act(b, q, T, H * qk, H * qk);
    Act absorbed = make_act(b, T, H * entry, H * entry);
    Act cache = make_act(b, cache_values, num_blocks * 64, entry, entry);
    Buffer nw = must(b.make_vector(norm), "make_vector");
    Buffer freq = must(b.make_vector(inv_freq), "make_vector");
    const size_t e = be::dtype_size(b.activation_dtype());
    const Tensor q_rope{static_cast<char*>(qa.buffer.data()) + nope * e, b.activation_dtype(), T * H, R, qk};
    const Tensor copy{static_cast<char*>(absorbed.buffer.data()) + C * e, b.activation_dtype(), T * H, R, entry};
    if (run == kComposed) {
      b.Backend::mla_prepare(kva.view, C, nw, 1e-6f, q_rope, H, freq, 1.25f, cache.buffer, copy);
    } else {
      b.mla_prepare(kva.view, C, nw, 1e-6f, q_rope, H, freq, 1.25f, cache.buffer, copy);
    }
    got[run][0] = read_act(b, kva, "mla_prepare (kv)");
    got[run][1] = read_act(b, qa, "mla_prepare (q)");
    got[run][2] = read_act(b, absorbed, "mla_prepare (absorbed q)");
    got[run][3] = read_act(b, cache, "mla_prepare (cache)");
  }
  const char* what[4] = {"kv", "q", "absorbed q's rope part", "cache"};
  for (int k = 0; k < 4; ++k) {
    expect_close(std::string("mla_prepare fused vs five ops, ") + what[k], got[kFused][k], got[kComposed][k], 0.0);
    expect_close(std::string("mla_prepare vs cpu, ") + what[k], got[kFused][k], got[kCpu][k], 1e-2);
  }
}

// ---- DeepSeek-V4's ops (backend.h "DeepSeek-V4"): both backends from the same bf16-exact inputs ----

Buffer upload_raw(Backend& b, const void* data, size_t bytes) {
  Buffer buffer = must(b.alloc(bytes), "alloc");
  expect_ok("upload", b.upload(data, bytes, buffer, 0));
  return buffer;
}
// `elements` activation-dtype elements into a's buffer.
void* at_element(Backend& b, const Act& a, int64_t elements) {
  return static_cast<char*>(a.buffer.data()) + elements * static_cast<int64_t>(be::dtype_size(b.activation_dtype()));
}
// A float32 tensor [rows, cols] (zeros) and its values after the ops.
struct F32 {
  Buffer buffer;
  Tensor view;
};
F32 make_f32(Backend& b, int64_t rows, int64_t cols) {
  F32 f;
  f.buffer = upload_raw(b, std::vector<float>(static_cast<size_t>(rows * cols), 0.0f).data(),
                        static_cast<size_t>(rows * cols) * 4);
  f.view = Tensor{f.buffer.data(), DType::kF32, rows, cols, cols};
  return f;
}
std::vector<float> read_f32(Backend& b, const F32& f) {
  std::vector<float> v(static_cast<size_t>(f.view.rows * f.view.cols));
  expect_ok("download", b.download(f.buffer, 0, v.size() * 4, v.data()));
  return v;
}

void check_v4_ops(Pair& p) {
  Backend* backends[2] = {&p.cpu, &p.gpu};
  // Three chunks: positions 60..64 (finishes block 64), 0..6, 100 (a decode row).
  struct Chunk {
    int64_t start, count;
  };
  const Chunk chunks[3] = {{60, 5}, {0, 7}, {100, 1}};
  StepData s;
  for (const Chunk& c : chunks) {
    for (int64_t i = 0; i < c.count; ++i) {
      s.token_ids.push_back(static_cast<int32_t>(p.rng.index(1000)));
      s.positions.push_back(static_cast<int32_t>(c.start + i));
    }
  }
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  const int64_t d = 256, hc = 4, mix = (2 + hc) * hc, H = 8, D = 128, R = 32, W = 16, DI = 32, HI = 4, topk = 8;
  std::vector<double> inv_freq(R / 2);
  for (int64_t i = 0; i < R / 2; ++i) inv_freq[i] = std::pow(10000.0, -2.0 * static_cast<double>(i) / R);
  WeightPair fn = make_weights(p.cpu, p.gpu, p.rng, 1, mix, hc * d, Precision::kF32, 0.05f);
  WeightPair fn_head = make_weights(p.cpu, p.gpu, p.rng, 1, hc, hc * d, Precision::kF32, 0.05f);
  const std::vector<float> X = p.rng.values(static_cast<size_t>(T * hc * d)), out = p.rng.values(static_cast<size_t>(T * d));
  const std::vector<float> base = p.rng.values(mix, 0.5f), head_base = p.rng.values(hc, 0.5f);
  const std::vector<float> scale = {0.7f, 0.9f, 1.1f}, head_scale = {0.8f};
  const std::vector<float> q = p.rng.values(static_cast<size_t>(T * H * D)), kv = p.rng.values(static_cast<size_t>(T * D));
  const std::vector<float> kv_norm = p.rng.values(D, 1.0f), sinks = p.rng.values(H, 1.0f);
  // Compressors: overlapped m = 4 (width 2D) and plain m = 8 (width D); their linear outputs, ape, norm, the rings
  // of the rows before each chunk.
  struct Comp {
    int64_t m, coff;
  };
  const Comp comps[2] = {{4, 2}, {8, 1}};
  std::vector<float> ckv[2], cscore[2], ape[2], rings[2][3][2];
  for (int c = 0; c < 2; ++c) {
    const int64_t width = comps[c].coff * D;
    ckv[c] = p.rng.values(static_cast<size_t>(T * width));
    cscore[c] = p.rng.values(static_cast<size_t>(T * width), 2.0f);
    ape[c] = p.rng.values(static_cast<size_t>(comps[c].m * width), 0.5f);
    for (int k = 0; k < 3; ++k)
      for (int r = 0; r < 2; ++r) rings[c][k][r] = p.rng.values(static_cast<size_t>(2 * comps[c].m * width), r ? 2.0f : 1.0f);
  }
  const std::vector<float> cnorm = p.rng.values(D, 1.0f);
  // Per chunk: window ring [W][D], compressed entries [32][D] (the first ones made before), indexer keys [32][DI].
  std::vector<float> window[3], entries[3], index_keys[3];
  for (int k = 0; k < 3; ++k) {
    window[k] = p.rng.values(static_cast<size_t>(W * D));
    entries[k] = p.rng.values(static_cast<size_t>(32 * D));
    index_keys[k] = p.rng.values(static_cast<size_t>(32 * DI));
  }
  const std::vector<float> index_q = p.rng.values(static_cast<size_t>(T * HI * DI)), index_w = p.rng.values(static_cast<size_t>(T * HI));
  // MoE: 16 experts, top 4, hash table over 1000 token ids, clamped at 0.3.
  const int64_t E = 16, K = 4, I = 64;
  WeightPair router = make_weights(p.cpu, p.gpu, p.rng, 1, E, d, Precision::kF32, 0.1f);
  WeightPair gate_up = make_weights(p.cpu, p.gpu, p.rng, E, 2 * I, d, Precision::kBF16, 0.1f);
  WeightPair down = make_weights(p.cpu, p.gpu, p.rng, E, d, I, Precision::kBF16, 0.1f);
  const std::vector<float> bias = p.rng.values(E, 0.1f), moe_x = p.rng.values(static_cast<size_t>(T * d));
  std::vector<int32_t> hash(1000 * K);
  for (int64_t t = 0; t < 1000; ++t)
    for (int64_t k = 0; k < K; ++k) hash[t * K + k] = static_cast<int32_t>((t * 5 + k * 4) % E);

  std::vector<std::vector<float>> got[2];  // per backend, the results in the order taken
  std::vector<std::vector<int32_t>> ids_of[2];
  for (int i = 0; i < 2; ++i) {
    Backend& b = *backends[i];
    expect_ok("begin_step (V4: no block tables)", b.begin_step(s.layout()));
    // mHC: the mix before a sublayer, after it, and the head's.
    Act x = make_act(b, X, T, hc * d, hc * d), y = make_act(b, T, d, d), o = make_act(b, out, T, d, d);
    F32 post = make_f32(b, T, hc), comb = make_f32(b, T, hc * hc);
    Buffer base_b = must(b.make_vector(base), "make_vector"), scale_b = must(b.make_vector(scale), "make_vector");
    Buffer head_base_b = must(b.make_vector(head_base), "v"), head_scale_b = must(b.make_vector(head_scale), "v");
    be::V4HyperMix m{i == 0 ? fn.cpu.get() : fn.gpu.get(), &base_b, &scale_b, hc, 20, 1e-6, 1e-6, false};
    b.v4_hc_pre(x.view, m, y.view, post.view, comb.view);
    got[i].push_back(read_act(b, y, "v4_hc_pre"));
    got[i].push_back(read_f32(b, post));
    got[i].push_back(read_f32(b, comb));
    b.v4_hc_post(x.view, o.view, post.view, comb.view);
    got[i].push_back(read_act(b, x, "v4_hc_post"));
    be::V4HyperMix mh{i == 0 ? fn_head.cpu.get() : fn_head.gpu.get(), &head_base_b, &head_scale_b, hc, 20, 1e-6, 1e-6, true};
    b.v4_hc_pre(x.view, mh, y.view, post.view, comb.view);
    got[i].push_back(read_act(b, y, "v4_hc_pre (head)"));
    // Norm and rotary: q per head (no weight), kv (weight), o inverse (no norm).
    Buffer freq = upload_raw(b, inv_freq.data(), inv_freq.size() * sizeof(double));
    Buffer kv_norm_b = must(b.make_vector(kv_norm), "make_vector");
    Act qa = make_act(b, q, T, H * D, H * D), kva = make_act(b, kv, T, D, D), oa = make_act(b, q, T, H * D, H * D);
    b.v4_norm_rope(qa.view.reshaped(D), be::V4NormRope{true, nullptr, 1e-6, &freq, R, false, H});
    b.v4_norm_rope(kva.view, be::V4NormRope{true, &kv_norm_b, 1e-6, &freq, R, false, 1});
    b.v4_norm_rope(oa.view.reshaped(D), be::V4NormRope{false, nullptr, 1e-6, &freq, R, true, H});
    got[i].push_back(read_act(b, qa, "v4_norm_rope (q)"));
    got[i].push_back(read_act(b, kva, "v4_norm_rope (kv)"));
    got[i].push_back(read_act(b, oa, "v4_norm_rope (inverse)"));
    // Compressors: entries made, snapshots at 64, rings after.
    Buffer cnorm_b = must(b.make_vector(cnorm), "make_vector");
    for (int c = 0; c < 2; ++c) {
      const int64_t mm = comps[c].m, width = comps[c].coff * D;
      Act kvs = make_act(b, ckv[c], T, width, width), scs = make_act(b, cscore[c], T, width, width);
      Buffer ape_b = must(b.make_vector(ape[c]), "make_vector");
      std::vector<Act> ring_kv, ring_score, ents;
      Act shot_kv = make_act(b, 8, width, width), shot_score = make_act(b, 8, width, width);
      std::vector<be::V4RowSnapshot> shots = {{64, shot_kv.buffer.data(), shot_score.buffer.data()}};
      std::vector<be::V4CompressWork> work;
      int64_t row = 0;
      for (int k = 0; k < 3; ++k) {
        ring_kv.push_back(make_act(b, rings[c][k][0], 2 * mm, width, width));
        ring_score.push_back(make_act(b, rings[c][k][1], 2 * mm, width, width));
        ents.push_back(make_act(b, entries[k], 32, D, D));
        const int64_t end = chunks[k].start + chunks[k].count;
        be::V4CompressWork w;
        w.row_first = row;
        w.start = chunks[k].start;
        w.count = chunks[k].count;
        w.ring_kv = ring_kv.back().buffer.data();
        w.ring_score = ring_score.back().buffer.data();
        w.entries = ents.back().buffer.data();
        w.first_entry = chunks[k].start / mm;
        w.end_entry = std::max(w.first_entry, end / mm);
        if (k == 0) w.snapshots = shots;
        work.push_back(w);
        row += chunks[k].count;
      }
      b.v4_compress(kvs.view, scs.view, be::V4Compressor{mm, D, comps[c].coff, &ape_b, &cnorm_b, 1e-6, &freq, R}, work);
      for (int k = 0; k < 3; ++k) {
        got[i].push_back(read_act(b, ents[k], "v4_compress (entries)"));
        got[i].push_back(read_act(b, ring_kv[k], "v4_compress (ring kv)"));
        got[i].push_back(read_act(b, ring_score[k], "v4_compress (ring score)"));
      }
      got[i].push_back(read_act(b, shot_kv, "v4_compress (snapshot kv)"));
      got[i].push_back(read_act(b, shot_score, "v4_compress (snapshot score)"));
    }
    // The indexer (chunk 0's rows and chunk 2's: visible 15..25 > topk 8), then attention over window rings, the
    // step's kv rows and the entries (indexed rows through the ids; the others every visible entry).
    std::vector<Act> keys, rings_w, ents_a;
    for (int k = 0; k < 3; ++k) {
      keys.push_back(make_act(b, index_keys[k], 32, DI, DI));
      rings_w.push_back(make_act(b, window[k], W, D, D));
      ents_a.push_back(make_act(b, entries[k], 32, D, D));
    }
    std::vector<be::V4IndexRow> index_rows;
    std::vector<be::V4AttentionRow> attention_rows;
    int64_t row = 0;
    for (int k = 0; k < 3; ++k) {
      for (int64_t j = 0; j < chunks[k].count; ++j, ++row) {
        const int64_t pos = chunks[k].start + j, visible = (pos + 1) / 4;
        index_rows.push_back({keys[k].buffer.data(), visible});
        be::V4AttentionRow a;
        a.position = pos;
        a.window_first = std::max<int64_t>(0, pos - (W - 1));
        a.step_start = chunks[k].start;
        a.row_first = row - j;
        a.ring = rings_w[k].buffer.data();
        a.entries = ents_a[k].buffer.data();
        a.entry_count = std::min(visible, topk);
        a.indexed = visible > topk;
        attention_rows.push_back(a);
      }
    }
    Act iq = make_act(b, index_q, T, HI * DI, HI * DI), iw = make_act(b, index_w, T, HI, HI);
    std::vector<int32_t> no_ids(static_cast<size_t>(T * topk), -1);
    Buffer ids = upload_raw(b, no_ids.data(), no_ids.size() * 4);
    b.v4_indexer_topk(iq.view, iw.view, 0.125, index_rows, topk, ids);
    std::vector<int32_t> host_ids(no_ids.size());
    expect_ok("synchronize", b.synchronize());
    expect_ok("download", b.download(ids, 0, host_ids.size() * 4, host_ids.data()));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> set(host_ids.begin() + t * topk, host_ids.begin() + (t + 1) * topk);
      std::sort(set.begin(), set.end());
      ids_of[i].push_back(set);
    }
    Buffer sinks_b = must(b.make_vector(sinks), "make_vector");
    Act step_kv = make_act(b, kv, T, D, D), attn_q = make_act(b, q, T, H * D, H * D), attn_out = make_act(b, T, H * D, H * D + 8);
    b.v4_attention(be::V4Attention{H, D, W, 1.0 / std::sqrt(static_cast<double>(D)), &sinks_b, &ids, topk}, attn_q.view,
                   step_kv.view, attention_rows, attn_out.view);
    got[i].push_back(read_act(b, attn_out, "v4_attention"));
    // One row alone (41 keys: its keys split over two CTAs on CUDA, then merged).
    {
      const be::V4AttentionRow last = attention_rows.back();
      be::V4AttentionRow alone = last;
      alone.row_first = 0;
      alone.step_start = last.position;  // the row is the only step row: its own key from kv row 0
      alone.indexed = false;             // every visible entry (25)
      alone.entry_count = (last.position + 1) / 4;
      Act one_q = make_act(b, std::vector<float>(q.end() - H * D, q.end()), 1, H * D, H * D);
      Act one_kv = make_act(b, std::vector<float>(kv.end() - D, kv.end()), 1, D, D);
      Act one_out = make_act(b, 1, H * D, H * D);
      b.v4_attention(be::V4Attention{H, D, W, 1.0 / std::sqrt(static_cast<double>(D)), &sinks_b, &ids, topk},
                     one_q.view, one_kv.view, std::span<const be::V4AttentionRow>(&alone, 1), one_out.view);
      got[i].push_back(read_act(b, one_out, "v4_attention (one row)"));
    }
    // MoE: hash-routed and learned (sqrt-softplus, bias), both clamped.
    Buffer bias_b = must(b.make_vector(bias), "make_vector");
    Buffer hash_b = upload_raw(b, hash.data(), hash.size() * 4);
    for (bool hashed : {true, false}) {
      be::MoeWeights w;
      w.rule.scoring = be::MoeRoutingRule::Scoring::kSqrtSoftplus;
      w.rule.num_experts = E;
      w.rule.top_k = K;
      w.rule.norm_topk_prob = true;
      w.rule.scale_after_normalize = true;
      w.rule.routed_scaling_factor = 1.5;
      w.router = i == 0 ? router.cpu.get() : router.gpu.get();
      w.gate_up = i == 0 ? gate_up.cpu.get() : gate_up.gpu.get();
      w.down = i == 0 ? down.cpu.get() : down.gpu.get();
      if (hashed) w.hash_ids = &hash_b;
      else w.bias = &bias_b;
      w.swiglu_limit = 0.3f;
      Act mx = make_act(b, moe_x, T, d, d), mo = make_act(b, T, d, d);
      b.moe(mx.view, w, mo.view);
      got[i].push_back(read_act(b, mo, hashed ? "moe (hash)" : "moe (sqrt-softplus)"));
    }
    // The clamped SwiGLU alone, and copy_spans (kv rows 0..3 into rows 9..12 of another act).
    Act gu = make_act(b, moe_x, T, d, d), act = make_act(b, T, d / 2, d / 2);
    b.silu_mul_clamped(gu.view, 0.3f, act.view);
    got[i].push_back(read_act(b, act, "silu_mul_clamped"));
    Act src = make_act(b, kv, T, D, D), dst = make_act(b, T, D, D);
    std::vector<be::CopySpan> spans;
    for (int64_t r = 0; r < 4; ++r) {
      spans.push_back({at_element(b, src, r * D), at_element(b, dst, (9 + r) * D),
                       static_cast<size_t>(D) * be::dtype_size(b.activation_dtype())});
    }
    b.copy_spans(spans);
    got[i].push_back(read_act(b, dst, "copy_spans"));
  }
  const char* names[] = {"v4_hc_pre (y)", "v4_hc_pre (post)", "v4_hc_pre (comb)", "v4_hc_post", "v4_hc_pre (head)",
                         "v4_norm_rope (q heads)", "v4_norm_rope (kv, weight)", "v4_norm_rope (inverse)"};
  int slot = 0;
  for (const char* name : names) {
    const double tolerance = slot == 1 || slot == 2 ? 1e-4 : 1e-2;
    expect_close(name, got[1][slot], got[0][slot], tolerance);
    ++slot;
  }
  for (int c = 0; c < 2; ++c) {
    const std::string label = "v4_compress m " + std::to_string(comps[c].m);
    for (int k = 0; k < 3; ++k) {
      expect_close(label + " chunk " + std::to_string(k) + " entries", got[1][slot], got[0][slot], 1e-2);
      expect_close(label + " chunk " + std::to_string(k) + " ring kv", got[1][slot + 1], got[0][slot + 1], 1e-2);
      expect_close(label + " chunk " + std::to_string(k) + " ring score", got[1][slot + 2], got[0][slot + 2], 1e-2);
      slot += 3;
    }
    expect_close(label + " snapshot kv", got[1][slot], got[0][slot], 1e-2);
    expect_close(label + " snapshot score", got[1][slot + 1], got[0][slot + 1], 1e-2);
    slot += 2;
  }
  int same = 0, indexed = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (ids_of[0][t].front() == -1) continue;  // not an indexed row
    ++indexed;
    same += ids_of[0][t] == ids_of[1][t] ? 1 : 0;
  }
  expect("v4_indexer_topk (the same top-8 set on every indexed row)", same == indexed && indexed > 0,
         std::to_string(same) + " of " + std::to_string(indexed) + " rows");
  expect_close("v4_attention (window ring + step rows + entries, indexed and not)", got[1][slot], got[0][slot], 1e-2);
  expect_close("v4_attention (one row of 41 keys: split over CTAs)", got[1][slot + 1], got[0][slot + 1], 1e-2);
  slot += 2;
  expect_close("moe (hash-routed, clamped)", got[1][slot], got[0][slot], 2e-2);
  expect_close("moe (sqrt-softplus + bias, clamped)", got[1][slot + 1], got[0][slot + 1], 2e-2);
  expect_close("silu_mul_clamped", got[1][slot + 2], got[0][slot + 2], 1e-2);
  expect_close("copy_spans", got[1][slot + 3], got[0][slot + 3], 0.0);
}

// store_kv + mla_attention on a step; the cache starts with random entries (the earlier tokens).
void check_attention(Pair& p, const char* label, int64_t H, int64_t C, int64_t R,
                     const std::vector<std::pair<int32_t, int32_t>>& sequences) {
  Backend* backends[2] = {&p.cpu, &p.gpu};
  const int64_t D = C + R, num_blocks = 24;
  const StepData s = make_step(p.rng, sequences, num_blocks, 100);
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  const std::vector<float> cache_values = p.rng.values(static_cast<size_t>(num_blocks * 64 * D));
  const std::vector<float> kv = p.rng.values(static_cast<size_t>(T * D));
  const std::vector<float> q = p.rng.values(static_cast<size_t>(T * H * D));
  const be::MlaAttention a{H, C, R, 1.0f / std::sqrt(static_cast<float>(D))};
  std::vector<float> results[2];
  for (int i = 0; i < 2; ++i) {
    Backend& b = *backends[i];
    expect_ok("begin_step", b.begin_step(s.layout()));
    Act cache = make_act(b, cache_values, num_blocks * 64, D, D);
    Act kva = make_act(b, kv, T, D, D + 8);
    b.store_kv(kva.view, cache.buffer);
    Act qa = make_act(b, q, T, H * D, H * D);
    Act out = make_act(b, T, H * C, H * C);
    b.mla_attention(a, qa.view, cache.buffer, out.view);
    results[i] = read_act(b, out, label);
  }
  expect_close(label, results[1], results[0], 2e-2);
}

// mla_expanded against a float64 loop: k = [latent · kv_bᵀ (nope part) | rope key], v = the V part, over every
// position up to the row's. The cache starts with random entries (the earlier tokens) and store_kv writes the
// step's rows first, as the model does; steps whose rows start past 0 read the context from the cache (in chunks
// of DEEPINFER_MLA_CONTEXT_CHUNK keys on a backend made with it), others attend the step's own rows.
void check_mla_expanded(Pair& p, Backend& b, const char* label, const std::vector<std::pair<int32_t, int32_t>>& sequences) {
  const int64_t H = 2, C = 64, nope = 128, R = 64, V = 128, qk = nope + R, D = C + R, num_blocks = 24;
  const be::MlaExpanded a{H, C, R, nope, V, 1.0f / std::sqrt(static_cast<float>(qk)), nullptr};
  if (!b.has_mla_expanded(a)) {
    expect(std::string(label) + ": mla_expanded available", false);
    return;
  }
  const StepData s = make_step(p.rng, sequences, num_blocks, 100);
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  WeightPair kv_b = make_weights(p.cpu, b, p.rng, 1, H * (nope + V), C, Precision::kBF16, 0.125f);
  const std::vector<float> q = p.rng.values(static_cast<size_t>(T * H * qk));
  const std::vector<float> kv = p.rng.values(static_cast<size_t>(T * D));
  std::vector<float> cache_values = p.rng.values(static_cast<size_t>(num_blocks * 64 * D));
  be::MlaExpanded with_weight = a;
  with_weight.kv_b = kv_b.gpu.get();
  expect_ok(std::string(label) + ": begin_step", b.begin_step(s.layout()));
  expect(std::string(label) + ": mla_expanded_pays (rows from 0, or forced)", b.mla_expanded_pays(a));
  Act cache = make_act(b, cache_values, num_blocks * 64, D, D);
  Act qa = make_act(b, q, T, H * qk, H * qk), kva = make_act(b, kv, T, D, D);
  b.store_kv(kva.view, cache.buffer);
  Act out = make_act(b, T, H * V, H * V + 8);
  b.mla_expanded(with_weight, qa.view, kva.view, cache.buffer, out.view);
  const std::vector<float> got = read_act(b, out, label);

  // The cache after store_kv, in bf16 as the GPU holds it, and each key's kv_b projection in float64.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) cache_values[s.slots[t] * D + c] = kv[t * D + c];
  for (float& x : cache_values) x = from_bf16_bits(to_bf16_bits(x));
  std::vector<float> want(static_cast<size_t>(T * H * V));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<int32_t>& table = s.block_tables[s.row_sequence[t]];
    const int64_t last = s.positions[t];
    std::vector<double> kvb(static_cast<size_t>((last + 1) * H * (nope + V)));
    for (int64_t j = 0; j <= last; ++j) {
      const float* latent = cache_values.data() + (table[j / 64] * 64 + j % 64) * D;
      for (int64_t o = 0; o < H * (nope + V); ++o) {
        double sum = 0.0;
        for (int64_t c = 0; c < C; ++c) sum += static_cast<double>(latent[c]) * kv_b.values[o * C + c];
        kvb[j * H * (nope + V) + o] = sum;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> score(static_cast<size_t>(last + 1));
      double mx = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        const float* latent = cache_values.data() + (table[j / 64] * 64 + j % 64) * D;
        double dot = 0.0;
        for (int64_t c = 0; c < nope; ++c) dot += q[(t * H + h) * qk + c] * kvb[(j * H + h) * (nope + V) + c];
        for (int64_t c = 0; c < R; ++c) dot += q[(t * H + h) * qk + nope + c] * static_cast<double>(latent[C + c]);
        score[j] = dot * a.scale;
        mx = std::max(mx, score[j]);
      }
      double sum = 0.0;
      for (double& x : score) sum += (x = std::exp(x - mx));
      for (int64_t c = 0; c < V; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j <= last; ++j) acc += score[j] * kvb[(j * H + h) * (nope + V) + nope + c];
        want[t * H * V + h * V + c] = static_cast<float>(acc / sum);
      }
    }
  }
  expect_close(std::string(label) + " (vs float64)", got, want, 3e-2);
}

// One routed-experts layer on both backends. The CUDA backend picks the expert GEMMs' kernel by rows per expert
// (cuda_moe.cpp): the streaming kernel (moe_grouped.h), the tiled kernel (64-row tiles) or per-expert cuBLAS GEMMs
// after a host copy of the offsets; every case runs on the default backend and on one backend per forced path
// (DEEPINFER_MOE_GEMM). The cases cover bf16 and FP8 experts, K and N that are not multiples of the kernels' tiles
// (K 200, 104: 16-byte vectors past the last full stage, an FP8 K tail inside a 16-byte chunk; N 200: partial warp
// and 128-column tiles), enough experts and columns for the streaming kernel's K split to be 1, 2 and 4 (on a
// 132-SM H200), and experts with several 64-row tiles, the last one partial. `skewed`: the correction bias sends
// every token to expert 3 (T rows) and keeps the last group's experts empty.
struct MoeCase {
  const char* label;
  Precision precision;
  int64_t T, hidden, I, E, top_k;
  bool skewed;
  int64_t x_pad, out_pad;  // extra columns of x's and out's rows (strided views)
};

// A CUDA backend and the expert GEMM path it was made with ("auto" or a forced DEEPINFER_MOE_GEMM value).
struct MoeBackend {
  const char* path;
  Backend* gpu;
};

const be::Weight* pick_router(const WeightPair& w, bool cpu) { return cpu ? w.cpu.get() : w.gpu.get(); }

void check_moe(Pair& p, const MoeCase& c, const std::vector<MoeBackend>& gpus) {
  const int64_t T = c.T, hidden = c.hidden, E = c.E, I = c.I;
  be::MoeRoutingRule rule;
  rule.scoring = be::MoeRoutingRule::Scoring::kSigmoid;
  rule.topk = be::MoeRoutingRule::TopK::kNoauxTc;
  rule.num_experts = E;
  rule.top_k = c.top_k;
  rule.n_group = 4;
  rule.topk_group = 2;
  rule.norm_topk_prob = true;
  rule.scale_after_normalize = true;
  rule.routed_scaling_factor = 2.5;
  WeightPair router = make_weights(p.cpu, p.gpu, p.rng, 1, E, hidden, Precision::kF32, 0.3f);
  WeightPair gate_up =
      make_weights(p.cpu, p.gpu, p.rng, E, 2 * I, hidden, c.precision, 1.0f / std::sqrt(static_cast<float>(hidden)));
  WeightPair down =
      make_weights(p.cpu, p.gpu, p.rng, E, hidden, I, c.precision, 1.0f / std::sqrt(static_cast<float>(I)));
  expect_ok("synchronize (weights for every CUDA backend)", p.gpu.synchronize());
  std::vector<float> bias = p.rng.values(static_cast<size_t>(E), 0.1f);
  if (c.skewed) {
    bias[3] = 8.0f;  // sigmoid scores are in (0, 1): expert 3 (and its group) wins for every token
    for (int64_t e = E - E / rule.n_group; e < E; ++e) bias[e] = -8.0f;  // the last group never wins
  }
  std::vector<float> x = p.rng.values(static_cast<size_t>(T * hidden));
  // FP8: rows of magnitudes 1/4 to 4, so that the activations' per-row scales differ (a kernel taking one token's
  // scale for another's shows).
  if (c.precision == Precision::kFP8)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < hidden; ++j) x[static_cast<size_t>(t * hidden + j)] *= std::ldexp(1.0f, t % 5 - 2);
  const std::vector<float> out0 = p.rng.values(static_cast<size_t>(T * hidden));
  auto run = [&](Backend& b, bool cpu) {
    auto pick = [&](WeightPair& w) { return cpu ? w.cpu.get() : w.gpu.get(); };
    Buffer bias_buffer = must(b.make_vector(bias), "make_vector");
    const be::MoeWeights mw{rule, pick(router), &bias_buffer, pick(gate_up), pick(down)};
    Act xa = make_act(b, x, T, hidden, hidden + c.x_pad), oa = make_act(b, out0, T, hidden, hidden + c.out_pad);
    b.moe(xa.view, mw, oa.view);
    return read_act(b, oa, c.label);
  };
  const std::vector<float> want = run(p.cpu, true);
  for (const MoeBackend& g : gpus) {
    // FP8 activations are quantized to e4m3 per 1 x 128 (act_quant) on the per-expert path and on the wgmma kernel
    // (its swapped tiles included); the streaming and tiled kernels keep them bf16. Auto (cuda_moe.cpp) takes the
    // wgmma kernel past 8 rows per expert when hidden and I are whole 128-groups (swapped tiles up to 64), else the
    // tiled kernel up to 64 and per-expert GEMMs beyond.
    const std::string path = g.path;
    const int64_t P = c.T * c.top_k;
    const bool whole_groups = c.hidden % 128 == 0 && c.I % 128 == 0;
    const bool quantized = c.precision == Precision::kFP8 &&
                           (path == "per-expert" || path.rfind("wgmma", 0) == 0 ||
                            (path == "auto" && P > 8 * c.E && (whole_groups || P > 64 * c.E)));
    const std::string label = std::string(c.label) + " [" + g.path + "]";
    expect_close(label.c_str(), run(*g.gpu, false), want,
                 quantized ? 8e-2 : 3e-2);
  }

  // Expert parallel (MoeWeights' given routing): two "ranks" holding experts [0, E/2) and [E/2, E) of the same rule,
  // each applying the routing given on the host to all T rows; out accumulates both. The routing is random (distinct
  // experts per row), with some weights 0 (a capacity factor's drops: not computed) and rows whose experts are all on
  // the other half (nothing to add). Against the CPU backend's given routing on the same halves.
  if (E % 2 != 0) return;
  const int64_t half = E / 2, k = c.top_k;
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> weights(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> experts(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) experts[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), p.rng.engine);
    if (t % 5 == 1) std::sort(experts.begin(), experts.end());  // all in the lower half (k <= E/2)
    for (int64_t i = 0; i < k; ++i) {
      ids[static_cast<size_t>(t * k + i)] = experts[static_cast<size_t>(i)];
      weights[static_cast<size_t>(t * k + i)] = (t * k + i) % 7 == 3 ? 0.0f : 0.1f + 0.3f * static_cast<float>(i);
    }
  }
  WeightPair halves_gate_up[2], halves_down[2];
  for (int h = 0; h < 2; ++h) {
    halves_gate_up[h] = make_weights(p.cpu, p.gpu, p.rng, half, 2 * I, hidden, c.precision,
                                     1.0f / std::sqrt(static_cast<float>(hidden)));
    halves_down[h] = make_weights(p.cpu, p.gpu, p.rng, half, hidden, I, c.precision,
                                  1.0f / std::sqrt(static_cast<float>(I)));
  }
  expect_ok("synchronize (expert-parallel halves)", p.gpu.synchronize());
  auto run_given = [&](Backend& b, bool cpu) {
    Act xa = make_act(b, x, T, hidden, hidden + c.x_pad), oa = make_act(b, out0, T, hidden, hidden + c.out_pad);
    for (int h = 0; h < 2; ++h) {
      const be::Weight* gu = cpu ? halves_gate_up[h].cpu.get() : halves_gate_up[h].gpu.get();
      const be::Weight* dn = cpu ? halves_down[h].cpu.get() : halves_down[h].gpu.get();
      const be::MoeWeights mw{rule, pick_router(router, cpu), nullptr, gu, dn, h * half, ids, weights};
      b.moe(xa.view, mw, oa.view);
    }
    return read_act(b, oa, c.label);
  };
  const std::vector<float> want_given = run_given(p.cpu, true);
  for (const MoeBackend& g : gpus) {
    const std::string path = g.path;
    const bool quantized = c.precision == Precision::kFP8 && path != "streaming" && path != "tiled";
    const std::string label = std::string(c.label) + " given routing, 2 halves [" + g.path + "]";
    expect_close(label.c_str(), run_given(*g.gpu, false), want_given, quantized ? 8e-2 : 3e-2);
  }
}

// The side lane (Backend::begin_side_lane): a shared-expert MLP (linear, silu_mul, linear into out) queued on it,
// then moe() on the main lane, which joins it before its combine adds into out. The same bits as running them one
// after the other on the same backend: each op's arithmetic is the same on either lane. bf16 and FP8 weights (FP8
// at a few rows on the streaming kernel, at more on cuBLASLt: the side lane's own library and scratch), a decode
// batch and a prefill chunk, out strided; three layers in a row, so that a lane reused before the previous join's
// work has drained is covered.
void check_side_lane(Pair& p) {
  Backend& b = p.gpu;
  if (!b.has_side_lane()) {  // DEEPINFER_SIDE_LANE=0
    std::printf("{\"check\":\"side lane\",\"detail\":\"skipped: DEEPINFER_SIDE_LANE=0\",\"ok\":true}\n");
    return;
  }
  for (Precision precision : {Precision::kBF16, Precision::kFP8}) {
    for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{300}}) {
      const int64_t hidden = 256, I = 128, shared_I = 256, E = 16;
      be::MoeRoutingRule rule;
      rule.scoring = be::MoeRoutingRule::Scoring::kSoftmax;
      rule.num_experts = E;
      rule.top_k = 4;
      WeightPair router = make_weights(p.cpu, p.gpu, p.rng, 1, E, hidden, Precision::kF32, 0.3f);
      WeightPair gate_up = make_weights(p.cpu, p.gpu, p.rng, E, 2 * I, hidden, precision, 0.06f);
      WeightPair down = make_weights(p.cpu, p.gpu, p.rng, E, hidden, I, precision, 0.09f);
      WeightPair shared_gate_up = make_weights(p.cpu, p.gpu, p.rng, 1, 2 * shared_I, hidden, precision, 0.06f);
      WeightPair shared_down = make_weights(p.cpu, p.gpu, p.rng, 1, hidden, shared_I, precision, 0.06f);
      const std::vector<float> x = p.rng.values(static_cast<size_t>(T * hidden));
      const be::MoeWeights mw{rule, router.gpu.get(), nullptr, gate_up.gpu.get(), down.gpu.get()};
      auto run = [&](bool lane) {
        Act xa = make_act(b, x, T, hidden, hidden), oa = make_act(b, T, hidden, hidden + 8);
        Act gu = make_act(b, T, 2 * shared_I, 2 * shared_I), act = make_act(b, T, shared_I, shared_I);
        for (int layer = 0; layer < 3; ++layer) {
          if (lane) b.begin_side_lane();
          b.linear(xa.view, *shared_gate_up.gpu, gu.view);
          b.silu_mul(gu.view, act.view);
          b.linear(act.view, *shared_down.gpu, oa.view);
          if (lane) b.end_side_lane();
          b.moe(xa.view, mw, oa.view);
          b.copy(oa.view, xa.view.cols_slice(0, hidden));  // the next layer's input
        }
        return read_act(b, oa, "side lane");
      };
      const std::vector<float> sequential = run(false), beside = run(true);
      size_t differ = 0;
      for (size_t i = 0; i < sequential.size(); ++i) differ += sequential[i] != beside[i] ? 1 : 0;
      expect(std::string("side lane: shared MLP beside moe, ") + (precision == Precision::kFP8 ? "fp8" : "bf16") +
                 ", T " + std::to_string(T) + ": bit-identical to one after the other",
             differ == 0, std::to_string(differ) + " values differ");
    }
  }
}

// moe_add_rms_norm: the MoE, then the next layer's residual add and input norm, which the CUDA backend runs in the
// combine's launch (run_moe_combine with a residual). The same bits as moe() and then add_rms_norm() on the same
// backend, in out, the residual and the normed rows: hidden 256, 2,048 (V2-Lite) and 7,168 (V3: 4 vectors a
// thread), bf16 and FP8 experts, 1, 8 and 300 rows; y the MoE's own input x (as the model calls it); and out
// strided (the fused launch does not apply: the two ops run). Against the CPU backend's moe + add_rms_norm too.
void check_moe_norm(Pair& p) {
  for (Precision precision : {Precision::kBF16, Precision::kFP8}) {
    for (int64_t hidden : {int64_t{256}, int64_t{2048}, int64_t{7168}}) {
      for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{300}}) {
        for (int64_t out_pad : {int64_t{0}, int64_t{8}}) {
          if (out_pad != 0 && (hidden != 256 || T != 8)) continue;
          const int64_t I = 128, E = 16;
          be::MoeRoutingRule rule;
          rule.scoring = be::MoeRoutingRule::Scoring::kSoftmax;
          rule.num_experts = E;
          rule.top_k = 4;
          WeightPair router = make_weights(p.cpu, p.gpu, p.rng, 1, E, hidden, Precision::kF32, 0.3f);
          WeightPair gate_up = make_weights(p.cpu, p.gpu, p.rng, E, 2 * I, hidden, precision,
                                            1.0f / std::sqrt(static_cast<float>(hidden)));
          WeightPair down = make_weights(p.cpu, p.gpu, p.rng, E, hidden, I, precision, 0.09f);
          const std::vector<float> x = p.rng.values(static_cast<size_t>(T * hidden));
          const std::vector<float> base = p.rng.values(static_cast<size_t>(T * hidden));
          const std::vector<float> residual = p.rng.values(static_cast<size_t>(T * hidden), 4.0f);
          const std::vector<float> norm = p.rng.values(static_cast<size_t>(hidden), 2.0f);
          // Returns out, residual and y (= x) one after the other.
          auto run = [&](Backend& b, bool cpu, bool fused) {
            const be::MoeWeights mw{rule, cpu ? router.cpu.get() : router.gpu.get(), nullptr,
                                    cpu ? gate_up.cpu.get() : gate_up.gpu.get(), cpu ? down.cpu.get() : down.gpu.get()};
            Buffer nw = must(b.make_vector(norm), "make_vector");
            Act xa = make_act(b, x, T, hidden, hidden), oa = make_act(b, base, T, hidden, hidden + out_pad);
            Act ra = make_act(b, residual, T, hidden, hidden);
            if (fused) {
              b.moe_add_rms_norm(xa.view, mw, oa.view, ra.view, nw, 1e-6f, xa.view);
            } else {
              b.moe(xa.view, mw, oa.view);
              b.add_rms_norm(ra.view, oa.view, nw, 1e-6f, xa.view);
            }
            std::vector<float> all = read_act(b, oa, "moe norm (out)");
            for (const Act* a : {&ra, &xa}) {
              const std::vector<float> part = read_act(b, *a, "moe norm");
              all.insert(all.end(), part.begin(), part.end());
            }
            return all;
          };
          const std::vector<float> separate = run(p.gpu, false, false), fused = run(p.gpu, false, true);
          size_t differ = separate.size() == fused.size() ? 0 : separate.size() + 1;
          for (size_t i = 0; differ == 0 && i < separate.size(); ++i) differ += separate[i] != fused[i] ? 1 : 0;
          const std::string label = std::string("moe_add_rms_norm, ") +
                                    (precision == Precision::kFP8 ? "fp8" : "bf16") + ", hidden " +
                                    std::to_string(hidden) + ", T " + std::to_string(T) +
                                    (out_pad != 0 ? ", out strided" : "");
          expect(label + ": bit-identical to moe then add_rms_norm", differ == 0,
                 std::to_string(differ) + " values differ");
          expect_close((label + " (vs the CPU backend)").c_str(), fused, run(p.cpu, true, true),
                       precision == Precision::kFP8 ? 8e-2 : 3e-2);
        }
      }
    }
  }
}

void check_logits(Pair& p) {
  Backend* backends[2] = {&p.cpu, &p.gpu};
  const int64_t hidden = 160, vocab = 1000;
  StepData s = make_step(p.rng, {{0, 3}, {7, 3}}, 4, vocab);
  s.logits_rows = {1, 4, 5};
  const int64_t T = static_cast<int64_t>(s.token_ids.size());
  WeightPair lm_head = make_weights(p.cpu, p.gpu, p.rng, 1, vocab, hidden, Precision::kBF16, 0.1f);
  const std::vector<float> x = p.rng.values(static_cast<size_t>(T * hidden), 3.0f);
  const std::vector<float> norm = p.rng.values(static_cast<size_t>(hidden), 2.0f);
  std::vector<float> results[2];
  // And the greedy head: the argmax ids and each id's softmax probability (a draft's confidence, speculative
  // decoding), computed again on the same step.
  std::vector<int32_t> ids[2];
  std::vector<float> top[2];
  for (int i = 0; i < 2; ++i) {
    Backend& b = *backends[i];
    const be::Weight& head = i == 0 ? *lm_head.cpu : *lm_head.gpu;
    expect_ok("begin_step", b.begin_step(s.layout()));
    Buffer nw = must(b.make_vector(norm), "make_vector");
    Act xa = make_act(b, x, T, hidden, hidden + 8);
    expect_ok("logits", b.logits(xa.view, nw, 1e-6f, head, results[i]));
    expect_ok("greedy_tokens", b.greedy_tokens(xa.view, nw, 1e-6f, head, ids[i]));
    expect_ok("read_top_probabilities", b.read_top_probabilities(top[i]));
  }
  expect_close("logits", results[1], results[0], 2e-2);
  // The ids from each side's own logits; the probability of the GPU's id under the CPU's logits.
  bool ids_ok = ids[0].size() == 3 && ids[1].size() == 3;
  for (size_t r = 0; ids_ok && r < 3; ++r) {
    const float* row = results[0].data() + r * vocab;
    ids_ok = ids[0][r] == static_cast<int32_t>(std::max_element(row, row + vocab) - row) &&
             std::abs(row[ids[1][r]] - row[ids[0][r]]) < 2e-2f * (1.0f + std::abs(row[ids[0][r]]));
  }
  expect("greedy_tokens (argmax ids, CPU and CUDA)", ids_ok);
  expect_close("read_top_probabilities", top[1], top[0], 2e-2);
}

// Sampling on the device (Backend::read_sampled_tokens) against the engine's host Sampler on the same logits (the
// GPU's own, read back): for each parameter set, `rows` rows (each its own seed) x `counters` draws; the tokens must
// be the host's (a draw may differ only when u * total falls within rounding of a boundary: at most 0.1% allowed).
// lm_head rows 0..9 are one vector (ten tied logits at the top of every row: top-k and top-p boundaries inside the
// tie, broken by the lower id) and rows 10..19 another. Then one row drawn `kFrequencyDraws` times: the device's
// token frequencies against the host sampler's final distribution (total variation distance), and a timing of 256
// rows of DeepSeek-V3's 129,280-token vocabulary.
void check_device_sampling(Pair& p, int64_t vocab, bool timing) {
  Backend& gpu = p.gpu;
  if (!gpu.has_device_sampling()) {
    expect("has_device_sampling", false);
    return;
  }
  const int64_t hidden = 64, rows = timing ? 256 : 48;
  std::vector<float> head(static_cast<size_t>(vocab * hidden));
  {
    const std::vector<float> random = p.rng.values(head.size(), 0.25f);
    head = random;
    const std::vector<float> top = p.rng.values(static_cast<size_t>(hidden), 0.6f);
    const std::vector<float> second = p.rng.values(static_cast<size_t>(hidden), 0.5f);
    for (int64_t r = 0; r < 20 && r < vocab; ++r)
      for (int64_t c = 0; c < hidden; ++c) head[r * hidden + c] = r < 10 ? top[c] : second[c];
  }
  std::unique_ptr<be::Weight> lm_head = must(gpu.make_weight(1, vocab, hidden, Precision::kBF16), "make_weight");
  expect_ok("set_matrix (lm_head)", gpu.set_matrix(*lm_head, 0, be::HostMatrix{vocab, hidden, head, {}, {}}));
  StepData s = make_step(p.rng, {{0, static_cast<int32_t>(rows)}}, (rows + 63) / 64, 100);
  s.logits_rows.clear();
  for (int64_t r = 0; r < rows; ++r) s.logits_rows.push_back(static_cast<int32_t>(r));
  // Rows aligned with the tied vectors (positive dot products with them) and random ones.
  std::vector<float> x = p.rng.values(static_cast<size_t>(rows * hidden), 1.0f);
  const std::vector<float> norm(static_cast<size_t>(hidden), 1.0f);
  for (int64_t r = 0; r < rows; r += 2)
    for (int64_t c = 0; c < hidden; ++c) x[r * hidden + c] = round_bf16(head[c] * 4.0f + 0.1f * x[r * hidden + c]);
  expect_ok("begin_step (sampling)", gpu.begin_step(s.layout()));
  Buffer nw = must(gpu.make_vector(norm), "make_vector");
  Act xa = make_act(gpu, x, rows, hidden, hidden);
  std::vector<float> logits;
  expect_ok("logits (sampling)", gpu.logits(xa.view, nw, 1e-6f, *lm_head, logits));

  struct Case {
    const char* name;
    float temperature;
    int32_t top_k;
    float top_p, min_p;
    bool penalties = false;  // logit_bias (one of the tied maxima banned, others raised), repetition, frequency, presence
  };
  const Case cases[] = {
      {"temperature 1", 1.0f, -1, 1.0f, 0.0f},
      {"temperature 0.7, top_k 5 (inside the tie)", 0.7f, 5, 1.0f, 0.0f},
      {"top_k 50", 1.0f, 50, 1.0f, 0.0f},
      {"top_p 0.9", 0.8f, -1, 0.9f, 0.0f},
      {"top_p 0.3 (inside the tie)", 1.0f, -1, 0.3f, 0.0f},
      {"top_k 100 + top_p 0.5, temperature 1.3", 1.3f, 100, 0.5f, 0.0f},
      {"min_p 0.1", 1.0f, -1, 1.0f, 0.1f},
      {"top_k 40 + top_p 0.95 + min_p 0.02", 0.9f, 40, 0.95f, 0.02f},
      {"greedy (temperature 0)", 0.0f, -1, 1.0f, 0.0f},
      {"top_k 1", 1.0f, 1, 1.0f, 0.0f},
      {"top_p 1e-6 (the first of the tied maxima)", 1.0f, -1, 1e-6f, 0.0f},
      {"min_p 1 (the tied maxima only)", 1.0f, -1, 1.0f, 1.0f},
      {"top_k vocab - 1, temperature 20", 20.0f, static_cast<int32_t>(vocab - 1), 1.0f, 0.0f},
      {"logit_bias + repetition + frequency + presence, top_p 0.9", 1.0f, -1, 0.9f, 0.0f, true},
      {"logit_bias + penalties, greedy", 0.0f, -1, 1.0f, 0.0f, true},
      {"logit_bias + penalties, top_k 5", 0.7f, 5, 1.0f, 0.0f, true},
  };
  // Per row a "prompt" and an "output" (tokens among the tied ones and random ones) for the penalties.
  std::vector<std::vector<deepinfer::TokenId>> prompts(static_cast<size_t>(rows)), outputs(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < 30; ++i) prompts[r].push_back(static_cast<deepinfer::TokenId>(p.rng.index(vocab)));
    for (int i = 0; i < 8; ++i) outputs[r].push_back(static_cast<deepinfer::TokenId>(i < 4 ? i : p.rng.index(vocab)));
    outputs[r].push_back(2);  // token 2 twice: frequency counts it twice
  }
  deepinfer::engine::Sampler sampler(vocab);
  const int counters = timing ? 2 : 40;
  for (const Case& c : cases) {
    deepinfer::engine::SamplingParams params;
    params.temperature = c.temperature;
    params.top_k = c.top_k;
    params.top_p = c.top_p;
    params.min_p = c.min_p;
    if (c.penalties) {
      params.logit_bias = {{0, -100.0f}, {1, -0.5f}, {15, 4.0f}, {static_cast<deepinfer::TokenId>(vocab - 1), 250.0f}};
      params.repetition_penalty = 1.2f;
      params.frequency_penalty = 0.3f;
      params.presence_penalty = -0.2f;
    }
    // Every other row also asks for logprobs (20 or 3 alternatives; the same draws: logprobs do not change them).
    deepinfer::engine::SamplingParams with_20 = params, with_3 = params;
    with_20.logprobs = 20;
    with_3.logprobs = 3;
    auto params_of = [&](int64_t r) -> const deepinfer::engine::SamplingParams& {
      return r % 2 == 1 ? params : r % 4 == 0 ? with_20 : with_3;
    };
    std::vector<be::Backend::LogitAdjustment> adjustments;
    for (int64_t r = 0; r < rows; ++r)
      deepinfer::engine::append_logit_adjustments(params, prompts[r], outputs[r], static_cast<int32_t>(r), adjustments);
    int64_t draws = 0, mismatches = 0, logprob_rows = 0, logprob_mismatches = 0;
    double worst_logprob_error = 0.0;
    for (int counter = 0; counter < counters; ++counter) {
      std::vector<be::Backend::DeviceSampling> device(static_cast<size_t>(rows));
      std::vector<deepinfer::engine::RequestRng> rngs(static_cast<size_t>(rows));
      std::vector<deepinfer::engine::SamplerRow> host_rows(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const uint64_t seed = 1000 + static_cast<uint64_t>(r) * 7919;
        device[r] = {c.temperature, c.top_k, c.top_p, c.min_p, seed, static_cast<uint64_t>(counter),
                     params_of(r).logprobs.value_or(-1)};
        rngs[r] = {seed, static_cast<uint64_t>(counter)};
        host_rows[r].logits = std::span<const float>(logits).subspan(static_cast<size_t>(r * vocab), static_cast<size_t>(vocab));
        host_rows[r].params = &params_of(r);
        host_rows[r].rng = &rngs[r];
        host_rows[r].prompt_token_ids = prompts[r];
        host_rows[r].output_token_ids = outputs[r];
      }
      std::vector<deepinfer::engine::SampledToken> want(static_cast<size_t>(rows));
      expect_ok("host sampler", sampler.sample(host_rows, want));
      gpu.compute_logits(xa.view, nw, 1e-6f, *lm_head, false);
      std::vector<int32_t> got;
      deepinfer::Status st = gpu.read_sampled_tokens(device, adjustments, got);
      expect_ok(std::string("read_sampled_tokens (") + c.name + ")", st);
      if (!st.ok() || got.size() != want.size()) {
        mismatches += rows;
        draws += rows;
        continue;
      }
      std::vector<be::Backend::SampledLogprobs> got_logprobs;
      expect_ok("read_sampled_logprobs", gpu.read_sampled_logprobs(got_logprobs));
      for (int64_t r = 0; r < rows; ++r) {
        ++draws;
        mismatches += got[r] == want[r].token_id ? 0 : 1;
        if (!params_of(r).logprobs) continue;
        // The drawn token's logprob (where both drew the same token) and the alternatives: the same ids in the same
        // order, values within float rounding of the host's (the sum of exponentials in another order).
        ++logprob_rows;
        bool same = static_cast<size_t>(r) < got_logprobs.size() &&
                    got_logprobs[r].top.size() == want[r].top_logprobs.size() && want[r].logprob.has_value();
        auto close = [&](float a, float b) {
          const double e = std::fabs(static_cast<double>(a) - b);
          worst_logprob_error = std::max(worst_logprob_error, e);
          return e <= 1e-6 + 1e-6 * std::fabs(b);
        };
        if (same && got[r] == want[r].token_id) same = close(got_logprobs[r].logprob, *want[r].logprob);
        for (size_t j = 0; same && j < want[r].top_logprobs.size(); ++j) {
          same = got_logprobs[r].top[j].first == want[r].top_logprobs[j].token_id &&
                 close(got_logprobs[r].top[j].second, want[r].top_logprobs[j].logprob);
        }
        logprob_mismatches += same ? 0 : 1;
      }
    }
    std::printf("{\"check\":\"device sampling vs host sampler: %s\",\"vocab\":%lld,\"draws\":%lld,\"mismatches\":%lld,"
                "\"logprob_rows\":%lld,\"logprob_mismatches\":%lld,\"worst_logprob_error\":%.3g,\"ok\":%s}\n",
                c.name, static_cast<long long>(vocab), static_cast<long long>(draws), static_cast<long long>(mismatches),
                static_cast<long long>(logprob_rows), static_cast<long long>(logprob_mismatches), worst_logprob_error,
                mismatches * 1000 <= draws && logprob_mismatches == 0 ? "true" : "false");
    if (mismatches * 1000 > draws || logprob_mismatches != 0) ++g_failures;
  }
  if (!timing) {
    // One row's logits in every row of a step, drawn at counters 0, 1, ...: the device's token frequencies against
    // the host sampler's final distribution (total variation distance, against 3x its expected sampling noise) and
    // against the host sampler's own draws at the same counters.
    constexpr int kFrequencySteps = 84;  // x 48 rows = 4,032 draws
    deepinfer::engine::SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = 0.95f;
    std::vector<float> same(static_cast<size_t>(rows * hidden));
    for (int64_t r = 0; r < rows; ++r) std::copy_n(x.begin() + hidden, hidden, same.begin() + r * hidden);  // row 1
    Act sa = make_act(gpu, same, rows, hidden, hidden);
    std::vector<float> same_logits;
    expect_ok("logits (one row repeated)", gpu.logits(sa.view, nw, 1e-6f, *lm_head, same_logits));
    const std::span<const float> row_logits = std::span<const float>(same_logits).subspan(0, static_cast<size_t>(vocab));
    deepinfer::engine::RequestRng rng{42, 0};
    deepinfer::engine::SamplerRow row{row_logits, &params, {}, {}, &rng};
    std::vector<deepinfer::engine::TokenProbability> distribution;
    expect_ok("final_distribution", sampler.final_distribution(row, distribution));
    std::vector<double> device_freq(static_cast<size_t>(vocab), 0.0), host_freq(static_cast<size_t>(vocab), 0.0);
    int64_t n = 0;
    for (int step = 0; step < kFrequencySteps; ++step) {
      std::vector<be::Backend::DeviceSampling> device(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) device[r] = {1.0f, -1, 0.95f, 0.0f, 42, static_cast<uint64_t>(step * rows + r)};
      gpu.compute_logits(sa.view, nw, 1e-6f, *lm_head, false);
      std::vector<int32_t> got;
      expect_ok("read_sampled_tokens (frequencies)", gpu.read_sampled_tokens(device, {}, got));
      for (int64_t r = 0; r < rows && r < static_cast<int64_t>(got.size()); ++r) {
        if (got[r] >= 0) device_freq[static_cast<size_t>(got[r])] += 1.0;
        rng = {42, static_cast<uint64_t>(step * rows + r)};
        deepinfer::engine::SampledToken want;
        expect_ok("host sampler (frequencies)", sampler.sample({&row, 1}, {&want, 1}));
        host_freq[static_cast<size_t>(want.token_id)] += 1.0;
        ++n;
      }
    }
    double tv = 0.0, tv_host = 0.0, noise = 0.0;
    std::vector<double> prob(static_cast<size_t>(vocab), 0.0);
    for (const auto& e : distribution) prob[static_cast<size_t>(e.token_id)] = e.probability;
    for (int64_t t = 0; t < vocab; ++t) {
      tv += 0.5 * std::abs(device_freq[t] / static_cast<double>(n) - prob[t]);
      tv_host += 0.5 * std::abs(device_freq[t] - host_freq[t]) / static_cast<double>(n);
      noise += 0.5 * std::sqrt(prob[t] * (1.0 - prob[t]) / static_cast<double>(n));
    }
    const bool ok = tv <= 3.0 * noise && tv_host <= 1e-3;
    std::printf("{\"check\":\"device sampling frequencies (top_p 0.95, one row x %lld draws)\",\"kept_tokens\":%zu,"
                "\"tv_vs_distribution\":%.4f,\"expected_noise\":%.4f,\"tv_vs_host_draws\":%.5f,\"ok\":%s}\n",
                static_cast<long long>(n), distribution.size(), tv, noise, tv_host, ok ? "true" : "false");
    if (!ok) ++g_failures;
  }
  if (timing) {
    constexpr int kReps = 20;
    std::vector<be::Backend::DeviceSampling> device(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) device[r] = {0.8f, -1, 0.9f, 0.0f, 7, static_cast<uint64_t>(r)};
    double sampled_ms = 0.0, logits_ms = 0.0;
    for (int i = 0; i < kReps; ++i) {
      gpu.compute_logits(xa.view, nw, 1e-6f, *lm_head, false);
      expect_ok("synchronize", gpu.synchronize());
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<int32_t> got;
      expect_ok("read_sampled_tokens (timing)", gpu.read_sampled_tokens(device, {}, got));
      const auto t1 = std::chrono::steady_clock::now();
      gpu.compute_logits(xa.view, nw, 1e-6f, *lm_head, false);
      expect_ok("synchronize", gpu.synchronize());
      const auto t2 = std::chrono::steady_clock::now();
      std::vector<float> host;
      expect_ok("read_logits (timing)", gpu.read_logits(host));
      const auto t3 = std::chrono::steady_clock::now();
      sampled_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
      logits_ms += std::chrono::duration<double, std::milli>(t3 - t2).count();
    }
    std::printf("{\"measure\":\"device sampling, top_p 0.9\",\"rows\":%lld,\"vocab\":%lld,\"sample_and_ids_to_host_ms\":%.3f,"
                "\"logits_to_host_ms\":%.3f}\n",
                static_cast<long long>(rows), static_cast<long long>(vocab), sampled_ms / kReps, logits_ms / kReps);
  }
}

}  // namespace

// The NCCL communicator with a group of one on this GPU (what one device can show; two ranks need two GPUs:
// scripts/gpu-check.sh's multi-GPU stage): each collective leaves its tensor as it was / copies it, on the backend's
// stream, and the host-staged ones round-trip.
// download_batch / upload_batch (the KV blocks' copies, kv_block_copy.h) against single download / upload: regions of
// KV-block size scattered over two buffers, a zero-byte one, and one larger than a pinned staging half (16 MiB), so
// the rounds alternate halves and a region spans rounds.
void check_batch_copies(Backend& gpu, Random& rng) {
  const size_t small = 73728, big = (size_t{40} << 20) + 12345;
  Buffer a = must(gpu.alloc(small * 300), "alloc a");
  Buffer b = must(gpu.alloc(big + 4096), "alloc b");
  std::vector<std::vector<std::byte>> src;
  std::vector<Backend::UploadRegion> up;
  std::vector<std::pair<const Buffer*, size_t>> where;
  for (int i = 0; i < 300; i += 3) {  // every third slot of a, in reverse order
    where.emplace_back(&a, static_cast<size_t>(299 - i) * small);
  }
  auto fill = [&](size_t n) {
    std::vector<std::byte> v(n);
    for (size_t k = 0; k < n; k += 8) v[k] = static_cast<std::byte>(rng.index(256));
    return v;
  };
  for (auto [buffer, offset] : where) {
    src.push_back(fill(small));
    up.push_back({src.back().data(), small, buffer, offset});
  }
  up.push_back({nullptr, 0, &a, 0});
  src.push_back(fill(big));
  up.push_back({src.back().data(), big, &b, 4096});
  expect_ok("upload_batch", gpu.upload_batch(up));
  // The reference: each region downloaded on its own.
  bool same = true;
  for (const Backend::UploadRegion& r : up) {
    std::vector<std::byte> got(r.bytes);
    if (r.bytes > 0 && !gpu.download(*r.dst, r.dst_offset, r.bytes, got.data()).ok()) same = false;
    if (r.bytes > 0 && std::memcmp(got.data(), r.host, r.bytes) != 0) same = false;
  }
  expect("upload_batch: every region as uploaded (101 regions, one of 40 MiB)", same);
  std::vector<std::vector<std::byte>> back;
  std::vector<Backend::DownloadRegion> down;
  for (const Backend::UploadRegion& r : up) back.emplace_back(r.bytes);
  for (size_t i = 0; i < up.size(); ++i) down.push_back({up[i].dst, up[i].dst_offset, up[i].bytes, back[i].data()});
  expect_ok("download_batch", gpu.download_batch(down));
  same = true;
  for (size_t i = 0; i < up.size(); ++i) {
    if (up[i].bytes > 0 && std::memcmp(back[i].data(), up[i].host, up[i].bytes) != 0) same = false;
  }
  expect("download_batch: every region as uploaded", same);
}

void check_nccl(Backend& gpu, Random& rng) {
  auto store = be::serve_tcp_store("127.0.0.1", 0);
  expect_ok("tcp store", store.status());
  if (!store.ok()) return;
  auto comm = be::make_nccl_communicator(gpu, **store, "check", 0, 1, std::chrono::seconds(10));
  expect_ok("make_nccl_communicator (1 rank)", comm.status());
  if (!comm.ok()) return;
  const int64_t rows = 7, cols = 96;
  const std::vector<float> values = rng.values(static_cast<size_t>(rows * cols));
  Act x = make_act(gpu, values, rows, cols, cols);
  const std::vector<float> before = read_act(gpu, x, "nccl input");
  (*comm)->all_reduce_sum(x.view);
  expect_close("nccl all_reduce_sum (1 rank)", read_act(gpu, x, "all_reduce"), before, 0.0);
  Act gathered = make_act(gpu, rows, cols, cols);
  (*comm)->all_gather_rows(x.view, gathered.view);
  expect_close("nccl all_gather_rows (1 rank)", read_act(gpu, gathered, "all_gather"), before, 0.0);
  Act moved = make_act(gpu, rows, cols, cols);
  const int64_t counts[1] = {rows};
  (*comm)->all_to_all_rows(x.view, counts, moved.view, counts);
  expect_close("nccl all_to_all_rows (1 rank)", read_act(gpu, moved, "all_to_all"), before, 0.0);
  std::vector<std::byte> bytes(100, std::byte{7});
  (*comm)->broadcast_host(bytes, 0);
  int64_t sent[1] = {42}, got[1] = {0};
  (*comm)->all_to_all_counts(sent, got);
  expect("nccl broadcast_host / all_to_all_counts (1 rank)", bytes[99] == std::byte{7} && got[0] == 42);
  (*comm)->barrier();
  expect_ok("nccl status", (*comm)->status());
}

int main(int argc, char** argv) {
  // Usage: gpu_check_backend [DEVICE] [--no-nccl] (under compute-sanitizer: NCCL's init probes kernel images with
  // cudaFuncGetAttributes and handles the errors itself, which memcheck would count).
  int device = 0;
  bool nccl = true;
  setenv("DEEPINFER_FUSED_MLA_PREPARE", "require", /*overwrite=*/0);  // check_mla_prepare: the kernel, or an abort
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-nccl") {
      nccl = false;
    } else {
      device = std::atoi(argv[i]);
    }
  }
  auto gpu = be::make_cuda_backend(device);
  if (!gpu.ok()) {
    std::fprintf(stderr, "gpu_check_backend: %s\n", gpu.status().to_string().c_str());
    return 2;
  }
  std::unique_ptr<Backend> cpu = be::make_cpu_backend();
  Pair p{*cpu, **gpu, Random{}};
  check_linear(p, "linear bf16 (strided, K 160)", Precision::kBF16, 5, 160, 96, 40, 4, 2e-2);
  check_linear(p, "linear bf16 (K 512)", Precision::kBF16, 33, 512, 256, 0, 0, 2e-2);
  check_linear(p, "linear f32 weight", Precision::kF32, 7, 160, 16, 8, 8, 2e-2);
  check_linear(p, "linear fp8 (padded K 160, N 96: simple kernel)", Precision::kFP8, 5, 160, 96, 40, 4, 8e-2);
  check_linear(p, "linear fp8 (K 512, N 256: cuBLASLt)", Precision::kFP8, 33, 512, 256, 0, 0, 8e-2);
  check_linear(p, "linear fp8 (strided y)", Precision::kFP8, 3, 256, 128, 0, 24, 8e-2);
  check_linear_heads(p, "linear_heads bf16", Precision::kBF16);
  check_linear_heads(p, "linear_heads f32 (per-head loop)", Precision::kF32);
  check_batch_copies(p.gpu, p.rng);
  check_rowwise(p);
  check_step_ops(p);
  check_mla_prepare(p);
  check_v4_ops(p);
  check_attention(p, "mla_attention decode (C 512, R 64, H 16: run_mla_decode)", 16, 512, 64,
                  {{0, 1}, {69, 1}, {300, 1}});
  check_attention(p, "mla_attention decode shape, H 4 (generic)", 4, 512, 64, {{10, 1}, {129, 1}});
  check_attention(p, "mla_attention chunked prefill (C 64, R 32, generic)", 4, 64, 32, {{5, 3}, {0, 70}, {200, 2}});
  check_mla_expanded(p, p.gpu, "mla_expanded (rows from position 0)", {{0, 5}, {0, 70}, {0, 1}});
  // Over a cached prefix: a chunk after 130 cached tokens, decode rows, a chunk from 0 beside them; on a backend
  // forced to the expanded form with 64-key context chunks (4 chunks: kFirst, kMiddle, kLast merges).
  setenv("DEEPINFER_MLA_FORM", "expanded", 1);
  setenv("DEEPINFER_MLA_CONTEXT_CHUNK", "64", 1);
  std::unique_ptr<Backend> chunked = must(be::make_cuda_backend(0), "make_cuda_backend (DEEPINFER_MLA_CONTEXT_CHUNK)");
  unsetenv("DEEPINFER_MLA_CONTEXT_CHUNK");
  std::unique_ptr<Backend> whole = must(be::make_cuda_backend(0), "make_cuda_backend (DEEPINFER_MLA_FORM)");
  unsetenv("DEEPINFER_MLA_FORM");
  const std::vector<std::pair<int32_t, int32_t>> cached = {{130, 70}, {40, 1}, {0, 9}, {199, 1}};
  check_mla_expanded(p, *whole, "mla_expanded over the cache (one context chunk)", cached);
  check_mla_expanded(p, *chunked, "mla_expanded over the cache (64-key context chunks)", cached);
  {
    deepinfer::Result<std::unique_ptr<Backend>> bad = [] {
      setenv("DEEPINFER_MLA_CONTEXT_CHUNK", "100", 1);
      auto r = be::make_cuda_backend(0);
      unsetenv("DEEPINFER_MLA_CONTEXT_CHUNK");
      return r;
    }();
    expect("DEEPINFER_MLA_CONTEXT_CHUNK=100 refused (not a multiple of 64)", !bad.ok());
  }
  const Precision bf16 = Precision::kBF16, fp8 = Precision::kFP8;
  const MoeCase moe_cases[] = {
      {"moe bf16 experts (strided x, out)", bf16, 7, 160, 96, 16, 4, false, 8, 16},
      {"moe fp8 experts (strided x, out)", fp8, 7, 160, 96, 16, 4, false, 8, 16},
      {"moe bf16 skewed (one expert 21 rows, empty experts; K 200/104, N 200 tails)", bf16, 21, 200, 104, 16, 4, true,
       0, 0},
      {"moe fp8 skewed (one expert 21 rows, empty experts; K 200/104, N 200 tails)", fp8, 21, 200, 104, 16, 4, true, 0,
       0},
      {"moe bf16 (down K 1408 as V2-Lite, K split 1 and 4)", bf16, 5, 256, 1408, 16, 6, false, 0, 8},
      {"moe fp8 (down K 1408, K split 1 and 4)", fp8, 5, 256, 1408, 16, 6, false, 0, 0},
      {"moe fp8 (64 experts, K split 1 and 2)", fp8, 21, 256, 704, 64, 6, true, 0, 0},
      {"moe bf16 (64 experts, K split 1 and 4)", bf16, 21, 256, 704, 64, 6, false, 8, 0},
      {"moe bf16 prefill (P 1200: 75 rows per expert, one expert 300 rows)", bf16, 300, 160, 96, 16, 4, true, 8, 16},
      {"moe fp8 prefill (P 1200: 75 rows per expert, one expert 300 rows)", fp8, 300, 160, 96, 16, 4, true, 0, 0},
      {"moe bf16 prefill (P 3072 over 64 experts: 48 rows each; N 1408, K 704, N 200)", bf16, 512, 200, 704, 64, 6,
       false, 0, 0},
      {"moe fp8 prefill (P 3072 over 64 experts; N 1424, K 712 and 200: FP8 K tails)", fp8, 512, 200, 712, 64, 6, false,
       0, 0},
      {"moe bf16 prefill (P 6144 over 16 experts: 384 rows each, auto takes wgmma; N 1024, K 256 and 512)", bf16, 1024,
       256, 512, 16, 6, false, 0, 0},
      {"moe fp8 prefill (P 1536 over 16 experts: 96 rows each, auto takes wgmma; K 384 and 256, N 512 and 384)", fp8,
       256, 384, 256, 16, 6, true, 0, 0},
      {"moe fp8 chunk (P 288 over 16 experts: 18 rows each, auto takes the 32-token swapped tiles; one expert 48 rows)",
       fp8, 48, 384, 256, 16, 6, true, 0, 0},
      {"moe fp8 chunk (P 768 over 16 experts: 48 rows each, auto takes the 64-token swapped tiles; N 768 and 384)", fp8,
       128, 384, 384, 16, 6, false, 0, 0},
  };
  // The same cases on one more CUDA backend per forced expert GEMM path.
  std::vector<std::unique_ptr<Backend>> forced;
  std::vector<MoeBackend> moe_backends = {{"auto", &p.gpu}};
  for (const char* path :
       {"streaming", "tiled", "wgmma-128", "wgmma-256", "wgmma-swap32", "wgmma-swap64", "per-expert"}) {
    setenv("DEEPINFER_MOE_GEMM", path, 1);
    forced.push_back(must(be::make_cuda_backend(0), "make_cuda_backend (DEEPINFER_MOE_GEMM)"));
    moe_backends.push_back({path, forced.back().get()});
  }
  unsetenv("DEEPINFER_MOE_GEMM");
  for (const MoeCase& c : moe_cases) check_moe(p, c, moe_backends);
  check_moe_norm(p);
  check_side_lane(p);
  check_logits(p);
  check_device_sampling(p, 3001, false);
  check_device_sampling(p, 129280, true);
  if (nccl) check_nccl(p.gpu, p.rng);
  std::printf("{\"summary\":\"gpu_check_backend\",\"failures\":%d}\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
