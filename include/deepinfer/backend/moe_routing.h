// MoE routing of one token as a pure function (no model types, standard library only), so that the model's
// forward pass (src/model/deepseek_model.cpp) and the GPU kernels' checks (tests/gpu/gpu_check_ops.cu) run the
// very same rule. transformers' DeepseekV2Moe / DeepseekV3TopkRouter:
//   scores   = softmax(logits) (V2) | sigmoid(logits) (V3) | sqrt(softplus(logits)) (V4)   float32
//   choice   = scores + e_score_correction_bias (bias empty: + 0.0f)
//   groups   (noaux_tc: score of a group = sum of its top-2 choices; group_limited_greedy: its max choice):
//            the topk_group best groups are kept (stable sort, descending: equal group scores -> lower group
//            index first); every expert of the other groups gets choice = 0.0f (not -inf, as the reference).
//   ids      = the top_k experts by choice, descending; equal choices -> lower expert index first. ids are
//            returned in that order.
//   weights  = scores[ids] (the unbiased scores); with normalize (norm_topk_prob and top_k > 1) divided by
//            (their double sum + 1e-20); then times routed_scaling_factor when not normalized or when
//            scale_after_normalize (V3: DeepSeek-V3 renormalizes then scales; V2 does one or the other).
// DeepSeek-V4's hash-routed layers take the ids from a token table instead (route_token_fixed): the weights are
// computed from the scores as above.
// Numerics (what a device port must reproduce): sigmoid = 1.0f / (1.0f + expf(-x)) in float; sqrt(softplus) =
// float(sqrt(x > 20 ? x : log1p(exp(double x)))) (torch's softplus threshold); softmax =
// float(expf(x - max) / double sum of exp(double(x) - max)); weight sum in double in id order.
#pragma once

#include <cstdint>
#include <vector>

namespace deepinfer::backend {

struct MoeRoutingRule {
  enum class Scoring { kSoftmax, kSigmoid, kSqrtSoftplus };
  enum class TopK { kGreedy, kGroupLimitedGreedy, kNoauxTc };
  Scoring scoring = Scoring::kSoftmax;
  TopK topk = TopK::kGreedy;
  int64_t num_experts = 0;   // E; E % n_group == 0
  int64_t top_k = 0;         // k <= E
  int64_t n_group = 1;       // used by kGroupLimitedGreedy / kNoauxTc
  int64_t topk_group = 1;    // <= n_group
  bool norm_topk_prob = false;
  bool scale_after_normalize = false;  // model_type == deepseek_v3
  double routed_scaling_factor = 1.0;
};

// One token: logits [E] (float32), bias [E] or empty. ids and weights are resized to top_k.
void route_token(const MoeRoutingRule& rule, const float* logits, const std::vector<float>& bias,
                 std::vector<int32_t>& ids, std::vector<float>& weights);
// One token whose experts are given (fixed_ids [top_k], each < E): ids = them, weights as route_token's.
void route_token_fixed(const MoeRoutingRule& rule, const float* logits, const int32_t* fixed_ids,
                       std::vector<int32_t>& ids, std::vector<float>& weights);

}  // namespace deepinfer::backend
