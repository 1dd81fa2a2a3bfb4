// The CPU backend's DeepSeek-V4 ops (backend.h "DeepSeek-V4 ops"), float32 data in host memory. The arithmetic is
// the V4 reference's (double accumulation where DeepSeek's float32 code reduces; see model/deepseek_v4.h), so the CPU
// path stays exact against the official fixture. Internal to the CPU backend.
#pragma once

#include <cstdint>
#include <span>

#include "deepinfer/backend/backend.h"

namespace deepinfer::backend::cpu_v4 {

// mixes [T][mix] = X · fnᵀ (the caller's linear); the rest of V4HyperMix's definition.
void hc_pre(const Tensor& X, const float* mixes, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb);
void hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb);
// positions: the step's positions.
void norm_rope(Tensor x, const V4NormRope& p, std::span<const int32_t> positions);
void compress(const Tensor& kv, const Tensor& score, const V4Compressor& c, std::span<const V4CompressWork> work);
void indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale, std::span<const V4IndexRow> rows,
                  int64_t topk, const Buffer& ids);
void attention(const V4Attention& a, const Tensor& q, const Tensor& kv, std::span<const V4AttentionRow> rows,
               Tensor out);
void silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out);

}  // namespace deepinfer::backend::cpu_v4
