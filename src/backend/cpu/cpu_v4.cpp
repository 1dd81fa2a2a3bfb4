// The CPU backend's DeepSeek-V4 ops (cpu_v4.h): the reference arithmetic of model/deepseek_v4.h, rows in parallel.
#include "cpu_v4.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace deepinfer::backend::cpu_v4 {
namespace {

float* f32(const Tensor& t) { return static_cast<float*>(t.data); }
const float* f32(const Buffer* b) { return b == nullptr ? nullptr : static_cast<const float*>(b->data()); }
const double* f64(const Buffer* b) { return b == nullptr ? nullptr : static_cast<const double*>(b->data()); }

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// y = x / sqrt(mean(x²) + eps) (* weight) over n values; y may alias x.
void rms_norm(const float* x, int64_t n, const float* weight, double eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(sum / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]) * inv;
    y[i] = static_cast<float>(weight != nullptr ? v * weight[i] : v);
  }
}

// Rotates the interleaved pairs of v (half = inv_freq's length) by position (inverse: -position).
void rotate(float* v, int64_t half, const double* inv_freq, int64_t position, bool inverse) {
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * inv_freq[i];
    const double c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
    const double x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = static_cast<float>(x0 * c - x1 * s);
    v[2 * i + 1] = static_cast<float>(x0 * s + x1 * c);
  }
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "cpu backend: %s\n", what);
  std::abort();
}

}  // namespace

void hc_pre(const Tensor& X, const float* mixes, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb) {
  const int64_t hc = m.hc, d = y.cols, T = X.rows;
  if (X.cols != hc * d) fail("v4_hc_pre: X must be [T, hc * d]");
  const int64_t mix = m.head ? hc : (2 + hc) * hc;
  const float* scale = f32(m.scale);
  const float* base = f32(m.base);
  const double eps = m.hc_eps;
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = f32(X) + t * X.stride;
    double sum = 0.0;
    for (int64_t i = 0; i < hc * d; ++i) sum += static_cast<double>(x[i]) * x[i];
    const double rs = 1.0 / std::sqrt(sum / static_cast<double>(hc * d) + m.norm_eps);
    const float* mx_row = mixes + t * mix;
    std::vector<double> pre(static_cast<size_t>(hc));
    for (int64_t j = 0; j < hc; ++j) pre[j] = sigmoid(mx_row[j] * rs * scale[0] + base[j]) + eps;
    if (!m.head) {
      float* p = f32(post) + t * post.stride;
      for (int64_t j = 0; j < hc; ++j) p[j] = static_cast<float>(2.0 * sigmoid(mx_row[hc + j] * rs * scale[1] + base[hc + j]));
      std::vector<double> cm(static_cast<size_t>(hc * hc));
      for (int64_t i = 0; i < hc; ++i) {  // row softmax + eps
        double mx = -INFINITY;
        for (int64_t j = 0; j < hc; ++j) {
          cm[i * hc + j] = mx_row[2 * hc + i * hc + j] * rs * scale[2] + base[2 * hc + i * hc + j];
          mx = std::max(mx, cm[i * hc + j]);
        }
        double s = 0.0;
        for (int64_t j = 0; j < hc; ++j) s += (cm[i * hc + j] = std::exp(cm[i * hc + j] - mx));
        for (int64_t j = 0; j < hc; ++j) cm[i * hc + j] = cm[i * hc + j] / s + eps;
      }
      auto normalize_columns = [&] {
        for (int64_t j = 0; j < hc; ++j) {
          double s = 0.0;
          for (int64_t i = 0; i < hc; ++i) s += cm[i * hc + j];
          for (int64_t i = 0; i < hc; ++i) cm[i * hc + j] /= s + eps;
        }
      };
      normalize_columns();
      for (int64_t it = 1; it < m.sinkhorn_iters; ++it) {
        for (int64_t i = 0; i < hc; ++i) {
          double s = 0.0;
          for (int64_t j = 0; j < hc; ++j) s += cm[i * hc + j];
          for (int64_t j = 0; j < hc; ++j) cm[i * hc + j] /= s + eps;
        }
        normalize_columns();
      }
      float* c = f32(comb) + t * comb.stride;
      for (int64_t k = 0; k < hc * hc; ++k) c[k] = static_cast<float>(cm[k]);
    }
    float* out = f32(y) + t * y.stride;
    for (int64_t k = 0; k < d; ++k) {
      double acc = 0.0;
      for (int64_t j = 0; j < hc; ++j) acc += pre[j] * x[j * d + k];
      out[k] = static_cast<float>(acc);
    }
  }
}

void hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb) {
  const int64_t d = out.cols, hc = post.cols, T = X.rows;
  if (X.cols != hc * d) fail("v4_hc_post: X must be [T, hc * d]");
#pragma omp parallel for schedule(static) if (T > 4)
  for (int64_t t = 0; t < T; ++t) {
    float* x = f32(X) + t * X.stride;
    const float* o = f32(out) + t * out.stride;
    const float* p = f32(post) + t * post.stride;
    const float* cm = f32(comb) + t * comb.stride;
    std::vector<float> next(static_cast<size_t>(hc * d));
    for (int64_t j = 0; j < hc; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        double acc = static_cast<double>(p[j]) * o[k];
        for (int64_t i = 0; i < hc; ++i) acc += static_cast<double>(cm[i * hc + j]) * x[i * d + k];
        next[j * d + k] = static_cast<float>(acc);
      }
    }
    std::copy(next.begin(), next.end(), x);
  }
}

void norm_rope(Tensor x, const V4NormRope& p, std::span<const int32_t> positions) {
  const int64_t n = x.cols, R = p.rope_dim;
  const float* weight = f32(p.weight);
  const double* inv_freq = f64(p.inv_freq);
#pragma omp parallel for schedule(static) if (x.rows > 16)
  for (int64_t r = 0; r < x.rows; ++r) {
    float* v = f32(x) + r * x.stride;
    if (p.norm) rms_norm(v, n, weight, p.eps, v);
    if (inv_freq != nullptr) {
      rotate(v + n - R, R / 2, inv_freq, positions[static_cast<size_t>(r / p.vectors_per_position)], p.inverse);
    }
  }
}

void compress(const Tensor& kv, const Tensor& score, const V4Compressor& c, std::span<const V4CompressWork> work) {
  const int64_t m = c.ratio, dim = c.dim, width = c.coff * dim, R = c.rope_dim, ring = 2 * m;
  const float* ape = f32(c.ape);
  const float* norm = f32(c.norm);
  const double* inv_freq = f64(c.inv_freq);
  for (const V4CompressWork& w : work) {
    float* ring_kv = static_cast<float*>(w.ring_kv);
    float* ring_score = static_cast<float*>(w.ring_score);
    const int64_t end = w.start + w.count;
    // Position p's rows: the step's (score + ape) or the ring's.
    auto kv_row = [&](int64_t p) -> const float* {
      return p >= w.start ? f32(kv) + (w.row_first + p - w.start) * kv.stride : ring_kv + (p % ring) * width;
    };
    std::vector<float> scored(static_cast<size_t>(w.count * width));
    for (int64_t i = 0; i < w.count; ++i) {
      const float* s = f32(score) + (w.row_first + i) * score.stride;
      const float* a = ape + ((w.start + i) % m) * width;
      for (int64_t k = 0; k < width; ++k) scored[i * width + k] = s[k] + a[k];
    }
    auto score_row = [&](int64_t p) -> const float* {
      return p >= w.start ? scored.data() + (p - w.start) * width : ring_score + (p % ring) * width;
    };
#pragma omp parallel for schedule(static) if (w.end_entry - w.first_entry > 1)
    for (int64_t j = w.first_entry; j < w.end_entry; ++j) {
      float* entry = static_cast<float*>(w.entries) + j * dim;
      const bool previous = c.coff == 2 && j > 0;
      for (int64_t ch = 0; ch < dim; ++ch) {
        const int64_t own = c.coff == 2 ? dim + ch : ch;
        double mx = -INFINITY;
        for (int64_t t = 0; t < m; ++t) {
          mx = std::max<double>(mx, score_row(j * m + t)[own]);
          if (previous) mx = std::max<double>(mx, score_row((j - 1) * m + t)[ch]);
        }
        double sum = 0.0, acc = 0.0;
        for (int64_t t = 0; t < m; ++t) {
          const double e = std::exp(score_row(j * m + t)[own] - mx);
          sum += e;
          acc += e * kv_row(j * m + t)[own];
          if (previous) {
            const double ep = std::exp(score_row((j - 1) * m + t)[ch] - mx);
            sum += ep;
            acc += ep * kv_row((j - 1) * m + t)[ch];
          }
        }
        entry[ch] = static_cast<float>(acc / sum);
      }
      rms_norm(entry, dim, norm, c.eps, entry);
      rotate(entry + dim - R, R / 2, inv_freq, j * m, false);
    }
    for (const V4RowSnapshot& s : w.snapshots) {
      const int64_t keep = m == 4 ? std::max<int64_t>(0, (s.boundary / m) * m - m) : (s.boundary / m) * m;
      for (int64_t p = keep; p < s.boundary; ++p) {
        std::copy_n(kv_row(p), width, static_cast<float*>(s.kv_rows) + (p - keep) * width);
        std::copy_n(score_row(p), width, static_cast<float*>(s.score_rows) + (p - keep) * width);
      }
    }
    for (int64_t p = std::max(w.start, end - ring); p < end; ++p) {
      std::copy_n(kv_row(p), width, ring_kv + (p % ring) * width);
      std::copy_n(score_row(p), width, ring_score + (p % ring) * width);
    }
  }
}

void indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale, std::span<const V4IndexRow> rows,
                  int64_t topk, const Buffer& ids) {
  const int64_t HI = weights.cols, DI = q.cols / HI;
  const int64_t T = static_cast<int64_t>(rows.size());
#pragma omp parallel for schedule(dynamic) if (T > 1)
  for (int64_t t = 0; t < T; ++t) {
    const V4IndexRow& row = rows[static_cast<size_t>(t)];
    if (row.visible <= topk) continue;
    const float* keys = static_cast<const float*>(row.keys);
    std::vector<float> w(static_cast<size_t>(HI));
    for (int64_t h = 0; h < HI; ++h) w[h] = static_cast<float>(f32(weights)[t * weights.stride + h] * weight_scale);
    std::vector<std::pair<double, int64_t>> ranked;
    ranked.reserve(static_cast<size_t>(row.visible));
    for (int64_t s = 0; s < row.visible; ++s) {
      double score = 0.0;
      for (int64_t h = 0; h < HI; ++h) {
        const float* qh = f32(q) + t * q.stride + h * DI;
        double dot = 0.0;
        for (int64_t k = 0; k < DI; ++k) dot += static_cast<double>(qh[k]) * keys[s * DI + k];
        score += std::max(dot, 0.0) * w[h];
      }
      ranked.emplace_back(score, s);
    }
    std::partial_sort(ranked.begin(), ranked.begin() + topk, ranked.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    int32_t* out = static_cast<int32_t*>(ids.data()) + t * topk;
    for (int64_t k = 0; k < topk; ++k) out[k] = static_cast<int32_t>(ranked[k].second);
  }
}

void attention(const V4Attention& a, const Tensor& q, const Tensor& kv, std::span<const V4AttentionRow> rows,
               Tensor out) {
  const int64_t H = a.heads, D = a.head_dim, W = a.window, T = static_cast<int64_t>(rows.size());
  const float* sinks = f32(a.sinks);
#pragma omp parallel for schedule(dynamic) if (T > 1)
  for (int64_t t = 0; t < T; ++t) {
    const V4AttentionRow& row = rows[static_cast<size_t>(t)];
    std::vector<const float*> keys;
    for (int64_t s = row.window_first; s <= row.position; ++s) {
      keys.push_back(s >= row.step_start ? f32(kv) + (row.row_first + s - row.step_start) * kv.stride
                                         : static_cast<const float*>(row.ring) + (s % W) * D);
    }
    const float* entries = static_cast<const float*>(row.entries);
    if (row.indexed) {
      const int32_t* ids = static_cast<const int32_t*>(a.ids->data()) + t * a.topk;
      for (int64_t k = 0; k < row.entry_count; ++k) keys.push_back(entries + static_cast<int64_t>(ids[k]) * D);
    } else {
      for (int64_t s = 0; s < row.entry_count; ++s) keys.push_back(entries + s * D);
    }
    std::vector<double> scores(keys.size()), acc(static_cast<size_t>(D));
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = f32(q) + t * q.stride + h * D;
      double mx = sinks[h];
      for (size_t s = 0; s < keys.size(); ++s) {
        double dot = 0.0;
        for (int64_t k = 0; k < D; ++k) dot += static_cast<double>(qh[k]) * keys[s][k];
        scores[s] = dot * a.scale;
        mx = std::max(mx, scores[s]);
      }
      double sum = std::exp(sinks[h] - mx);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (size_t s = 0; s < keys.size(); ++s) {
        const double e = std::exp(scores[s] - mx);
        sum += e;
        for (int64_t k = 0; k < D; ++k) acc[k] += e * keys[s][k];
      }
      float* oh = f32(out) + t * out.stride + h * D;
      for (int64_t k = 0; k < D; ++k) oh[k] = static_cast<float>(acc[k] / sum);
    }
  }
}

void silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out) {
  const int64_t n = out.cols;
#pragma omp parallel for schedule(static) if (out.rows > 4)
  for (int64_t r = 0; r < out.rows; ++r) {
    const float* gate = f32(gate_up) + r * gate_up.stride;
    const float* up = gate + n;
    float* o = f32(out) + r * out.stride;
    for (int64_t i = 0; i < n; ++i) {
      double g = gate[i], u = up[i];
      if (limit > 0.0f) {
        u = std::clamp<double>(u, -limit, limit);
        g = std::min<double>(g, limit);
      }
      o[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
  }
}

}  // namespace deepinfer::backend::cpu_v4
