// MoE routing of one token (contract in include/deepinfer/backend/moe_routing.h). Standard library only: the GPU
// checks compile this file on the GPU machine as their routing reference.
#include "deepinfer/backend/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

namespace deepinfer::backend {

namespace {

std::vector<float> score_experts(const MoeRoutingRule& rule, const float* logits) {
  const int64_t n = rule.num_experts;
  std::vector<float> scores(static_cast<size_t>(n));
  if (rule.scoring == MoeRoutingRule::Scoring::kSigmoid) {
    for (int64_t e = 0; e < n; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else if (rule.scoring == MoeRoutingRule::Scoring::kSqrtSoftplus) {
    for (int64_t e = 0; e < n; ++e) {
      const double x = logits[e];
      scores[e] = static_cast<float>(std::sqrt(x > 20.0 ? x : std::log1p(std::exp(x))));
    }
  } else {
    float max_logit = *std::max_element(logits, logits + n);
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += std::exp(static_cast<double>(logits[e]) - max_logit);
    for (int64_t e = 0; e < n; ++e) scores[e] = static_cast<float>(std::exp(logits[e] - max_logit) / sum);
  }
  return scores;
}

void weigh(const MoeRoutingRule& rule, const std::vector<float>& scores, const std::vector<int32_t>& ids,
           std::vector<float>& weights) {
  const int64_t k = rule.top_k;
  weights.resize(static_cast<size_t>(k));
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = scores[ids[i]];
    sum += weights[i];
  }
  // V3 renormalizes then scales; V2 (DeepSeek's rule) either renormalizes or scales.
  bool normalize = rule.norm_topk_prob && k > 1;
  for (float& weight : weights) {
    if (normalize) weight = static_cast<float>(weight / (sum + 1e-20));
    if (!normalize || rule.scale_after_normalize) weight *= static_cast<float>(rule.routed_scaling_factor);
  }
}

}  // namespace

void route_token(const MoeRoutingRule& rule, const float* logits, const std::vector<float>& bias,
                 std::vector<int32_t>& ids, std::vector<float>& weights) {
  using TopK = MoeRoutingRule::TopK;
  const int64_t n = rule.num_experts, k = rule.top_k;
  std::vector<float> scores = score_experts(rule, logits), choice(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) choice[e] = scores[e] + (bias.empty() ? 0.0f : bias[e]);
  if (rule.topk == TopK::kNoauxTc || rule.topk == TopK::kGroupLimitedGreedy) {
    const int64_t groups = rule.n_group, per_group = n / groups;
    std::vector<float> group_score(static_cast<size_t>(groups));
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<float> member(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(member.begin(), member.end(), std::greater<>());
      // noaux_tc: sum of the top-2 of each group; group_limited_greedy: the group's max.
      group_score[g] = rule.topk == TopK::kNoauxTc ? member[0] + (per_group > 1 ? member[1] : 0.0f) : member[0];
    }
    std::vector<int64_t> order(static_cast<size_t>(groups));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
    std::vector<bool> keep(static_cast<size_t>(groups), false);
    for (int64_t g = 0; g < rule.topk_group; ++g) keep[order[g]] = true;
    for (int64_t e = 0; e < n; ++e) {
      if (!keep[e / per_group]) choice[e] = 0.0f;
    }
  }
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
  ids.assign(order.begin(), order.begin() + k);
  weigh(rule, scores, ids, weights);
}

void route_token_fixed(const MoeRoutingRule& rule, const float* logits, const int32_t* fixed_ids,
                       std::vector<int32_t>& ids, std::vector<float>& weights) {
  ids.assign(fixed_ids, fixed_ids + rule.top_k);
  weigh(rule, score_experts(rule, logits), ids, weights);
}

}  // namespace deepinfer::backend
