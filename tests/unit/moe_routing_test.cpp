// route_token (src/backend/moe_routing.cpp), the MoE routing rule shared by the model's forward pass and the GPU
// routing kernel's checks: the documented tie rules, the V2/V3 weight rules, and agreement on random inputs with
// the model's router as it was written before it was factored out (copied below verbatim but for the
// ModelConfig argument).
#include "deepinfer/backend/moe_routing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>

namespace deepinfer::backend {
namespace {

struct OldConfig {  // the ModelConfig fields the pre-refactor route() read
  int64_t n_routed_experts, num_experts_per_tok, n_group, topk_group;
  std::string scoring_func, topk_method, model_type;
  bool norm_topk_prob;
  double routed_scaling_factor;
};

// deepseek_model.cpp's route() at commit e3debba, unchanged but for the config type.
void old_route(const OldConfig& c, const float* logits, const std::vector<float>& bias, std::vector<int32_t>& ids,
               std::vector<float>& weights) {
  const int64_t n = c.n_routed_experts, k = c.num_experts_per_tok;
  std::vector<float> scores(static_cast<size_t>(n)), choice(static_cast<size_t>(n));
  if (c.scoring_func == "sigmoid") {
    for (int64_t e = 0; e < n; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    float max_logit = *std::max_element(logits, logits + n);
    double sum = 0.0;
    for (int64_t e = 0; e < n; ++e) sum += std::exp(static_cast<double>(logits[e]) - max_logit);
    for (int64_t e = 0; e < n; ++e) scores[e] = static_cast<float>(std::exp(logits[e] - max_logit) / sum);
  }
  for (int64_t e = 0; e < n; ++e) choice[e] = scores[e] + (bias.empty() ? 0.0f : bias[e]);
  if (c.topk_method == "noaux_tc" || c.topk_method == "group_limited_greedy") {
    const int64_t groups = c.n_group, per_group = n / groups;
    std::vector<float> group_score(static_cast<size_t>(groups));
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<float> member(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(member.begin(), member.end(), std::greater<>());
      group_score[g] = c.topk_method == "noaux_tc" ? member[0] + (per_group > 1 ? member[1] : 0.0f) : member[0];
    }
    std::vector<int64_t> order(static_cast<size_t>(groups));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
    std::vector<bool> keep(static_cast<size_t>(groups), false);
    for (int64_t g = 0; g < c.topk_group; ++g) keep[order[g]] = true;
    for (int64_t e = 0; e < n; ++e) {
      if (!keep[e / per_group]) choice[e] = 0.0f;
    }
  }
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
  ids.assign(order.begin(), order.begin() + k);
  weights.resize(static_cast<size_t>(k));
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    weights[i] = scores[ids[i]];
    sum += weights[i];
  }
  bool normalize = c.norm_topk_prob && k > 1;
  for (float& weight : weights) {
    if (normalize) weight = static_cast<float>(weight / (sum + 1e-20));
    if (!normalize || c.model_type == "deepseek_v3") weight *= static_cast<float>(c.routed_scaling_factor);
  }
}

MoeRoutingRule rule_of(const OldConfig& c) {
  MoeRoutingRule r;
  r.scoring = c.scoring_func == "sigmoid" ? MoeRoutingRule::Scoring::kSigmoid : MoeRoutingRule::Scoring::kSoftmax;
  r.topk = c.topk_method == "noaux_tc"               ? MoeRoutingRule::TopK::kNoauxTc
           : c.topk_method == "group_limited_greedy" ? MoeRoutingRule::TopK::kGroupLimitedGreedy
                                                     : MoeRoutingRule::TopK::kGreedy;
  r.num_experts = c.n_routed_experts;
  r.top_k = c.num_experts_per_tok;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.norm_topk_prob = c.norm_topk_prob;
  r.scale_after_normalize = c.model_type == "deepseek_v3";
  r.routed_scaling_factor = c.routed_scaling_factor;
  return r;
}

TEST(MoeRouting, AgreesWithTheModelsRouterOnRandomInputs) {
  const OldConfig configs[] = {
      {256, 8, 8, 4, "sigmoid", "noaux_tc", "deepseek_v3", true, 2.5},                 // V3
      {64, 6, 1, 1, "softmax", "greedy", "deepseek_v2", false, 1.0},                   // V2-Lite
      {160, 6, 8, 3, "softmax", "group_limited_greedy", "deepseek_v2", false, 16.0},   // V2
      {72, 5, 4, 2, "sigmoid", "noaux_tc", "deepseek_v3", false, 1.5},                 // odd
      {48, 1, 3, 1, "softmax", "group_limited_greedy", "deepseek_v2", true, 1.0},
  };
  std::mt19937 rng(7);
  for (const OldConfig& c : configs) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> logits(static_cast<size_t>(c.n_routed_experts)), bias;
      std::normal_distribution<float> normal(0.0f, 2.0f);
      // Every third trial on a coarse grid: exact ties in scores and group scores exercise the tie rules.
      for (float& x : logits) x = trial % 3 == 0 ? std::round(normal(rng) * 2.0f) / 2.0f : normal(rng);
      if (c.topk_method == "noaux_tc") {
        std::uniform_real_distribution<float> u(trial % 2 ? -1.0f : -0.1f, 0.1f);  // negatives: masked 0.0 wins
        for (int64_t e = 0; e < c.n_routed_experts; ++e) bias.push_back(trial % 3 == 0 ? 0.0f : u(rng));
      }
      std::vector<int32_t> want_ids, got_ids;
      std::vector<float> want_w, got_w;
      old_route(c, logits.data(), bias, want_ids, want_w);
      route_token(rule_of(c), logits.data(), bias, got_ids, got_w);
      ASSERT_EQ(want_ids, got_ids) << c.topk_method << " trial " << trial;
      ASSERT_EQ(want_w, got_w) << c.topk_method << " trial " << trial;  // bitwise: the same code
    }
  }
}

TEST(MoeRouting, EqualChoicesGoToTheLowerExpertIndex) {
  MoeRoutingRule r;
  r.num_experts = 6;
  r.top_k = 3;
  const float logits[] = {0.5f, 1.0f, 0.5f, 1.0f, 0.5f, 0.0f};
  std::vector<int32_t> ids;
  std::vector<float> w;
  route_token(r, logits, {}, ids, w);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 0}));
}

TEST(MoeRouting, EqualGroupScoresKeepTheLowerGroupAndMaskedExpertsScoreZero) {
  MoeRoutingRule r;
  r.scoring = MoeRoutingRule::Scoring::kSigmoid;
  r.topk = MoeRoutingRule::TopK::kNoauxTc;
  r.num_experts = 8;
  r.top_k = 3;
  r.n_group = 4;
  r.topk_group = 1;
  // Groups {0,1} {2,3} {4,5} {6,7}: groups 1 and 2 tie on the top-2 sum; group 1 is kept. With the bias the kept
  // experts' choices are negative, so masked experts (choice 0.0) take the remaining slots by lowest index.
  const float logits[] = {-3.0f, -3.0f, 1.0f, 2.0f, 2.0f, 1.0f, -3.0f, -3.0f};
  const std::vector<float> bias(8, -0.95f);
  std::vector<int32_t> ids;
  std::vector<float> w;
  route_token(r, logits, bias, ids, w);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 4}));
}

TEST(MoeRouting, V3NormalizesThenScalesAndV2ScalesOnly) {
  MoeRoutingRule r;
  r.scoring = MoeRoutingRule::Scoring::kSigmoid;
  r.topk = MoeRoutingRule::TopK::kNoauxTc;
  r.num_experts = 4;
  r.top_k = 2;
  r.n_group = 1;
  r.topk_group = 1;
  r.norm_topk_prob = true;
  r.scale_after_normalize = true;
  r.routed_scaling_factor = 2.5;
  const float logits[] = {0.0f, 3.0f, -1.0f, 1.0f};
  std::vector<int32_t> ids;
  std::vector<float> w;
  route_token(r, logits, {}, ids, w);
  ASSERT_EQ(ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(w[0] + w[1], 2.5, 1e-6);
  r.scoring = MoeRoutingRule::Scoring::kSoftmax;
  r.topk = MoeRoutingRule::TopK::kGreedy;
  r.norm_topk_prob = false;
  r.scale_after_normalize = false;
  r.routed_scaling_factor = 16.0;
  route_token(r, logits, {}, ids, w);
  double z = 1 + std::exp(3.0) + std::exp(-1.0) + std::exp(1.0);
  EXPECT_NEAR(w[0], 16.0 * std::exp(3.0) / z, 1e-4);
}

}  // namespace
}  // namespace deepinfer::backend
