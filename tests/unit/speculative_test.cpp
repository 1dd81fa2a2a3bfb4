// Speculative decoding's acceptance rule and configuration, with no model: verify_draft() over drafts drawn from q
// must emit tokens distributed as p (chi-square over 40,000 seeded draws, fixed seeds so it cannot flake), a greedy
// (point-mass) p accepts exactly its own token, and the flags' checks name what is wrong.
#include "deepinfer/engine/speculative.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

namespace deepinfer::engine {
namespace {

// Upper 0.1% point of the chi-square distribution with `df` degrees of freedom (Wilson-Hilferty), so that a correct
// rule fails with probability 1e-3 for a random seed; the seeds are fixed, so the outcome is fixed too.
double chi_square_999(int df) {
  const double z = 3.090232;  // standard normal 0.999 quantile
  const double k = static_cast<double>(df);
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

// Emitted-token counts of `draws` speculative steps with drafts x ~ q, chi-square against p.
double chi_square_of_rule(const std::vector<TokenProbability>& p, const std::vector<TokenProbability>& q, int draws,
                          uint64_t seed, int* accepted) {
  std::map<TokenId, int> counts;
  *accepted = 0;
  for (int i = 0; i < draws; ++i) {
    const uint64_t counter = static_cast<uint64_t>(i);
    const TokenId draft = draw_from(q, philox_uniform(seed, counter, kDraftStream));
    const DraftVerdict verdict = verify_draft(p, q, draft, seed, counter);
    if (verdict.accepted) {
      EXPECT_EQ(verdict.token_id, draft);
      ++*accepted;
    }
    ++counts[verdict.token_id];
  }
  double chi = 0.0;
  for (const TokenProbability& entry : p) {
    const double expected = entry.probability * draws;
    const double observed = counts[entry.token_id];
    chi += (observed - expected) * (observed - expected) / expected;
    counts.erase(entry.token_id);
  }
  EXPECT_TRUE(counts.empty()) << "a token outside p's support was emitted";
  return chi;
}

TEST(SpeculativeTest, RejectionSamplingEmitsTheTargetDistribution) {
  // q overlaps p partly, puts mass where p has none (token 9), and misses p's token 7.
  const std::vector<TokenProbability> p = {{2, 0.05}, {3, 0.30}, {5, 0.15}, {7, 0.25}, {8, 0.25}};
  const std::vector<TokenProbability> q = {{2, 0.40}, {3, 0.10}, {5, 0.15}, {8, 0.05}, {9, 0.30}};
  int accepted = 0;
  const int draws = 40000;
  const double chi = chi_square_of_rule(p, q, draws, /*seed=*/1234, &accepted);
  EXPECT_LT(chi, chi_square_999(static_cast<int>(p.size()) - 1)) << "emitted tokens are not distributed as p";
  // Acceptance probability = sum_x min(p(x), q(x)) = 0.05 + 0.10 + 0.15 + 0.05 = 0.35.
  EXPECT_NEAR(static_cast<double>(accepted) / draws, 0.35, 0.015);
}

TEST(SpeculativeTest, ThePowerOfTheTestShowsOnAWrongRule) {
  // Emitting the draft itself (q) must fail the same test: it has the power to see a wrong rule.
  const std::vector<TokenProbability> p = {{2, 0.05}, {3, 0.30}, {5, 0.15}, {7, 0.25}, {8, 0.25}};
  const std::vector<TokenProbability> q = {{2, 0.10}, {3, 0.30}, {5, 0.10}, {7, 0.25}, {8, 0.25}};
  const std::vector<TokenProbability> wrong = q;  // pretend the target were q: every draft accepted
  int accepted = 0;
  std::map<TokenId, int> counts;
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) {
    const TokenId draft = draw_from(q, philox_uniform(7, static_cast<uint64_t>(i), kDraftStream));
    const DraftVerdict verdict = verify_draft(wrong, q, draft, 7, static_cast<uint64_t>(i));
    accepted += verdict.accepted;
    ++counts[verdict.token_id];
  }
  EXPECT_EQ(accepted, draws);
  double chi = 0.0;
  for (const TokenProbability& entry : p) {
    const double expected = entry.probability * draws;
    chi += (counts[entry.token_id] - expected) * (counts[entry.token_id] - expected) / expected;
  }
  EXPECT_GT(chi, chi_square_999(static_cast<int>(p.size()) - 1));
}

TEST(SpeculativeTest, APointMassTargetAcceptsExactlyItsToken) {
  const std::vector<TokenProbability> greedy = {{42, 1.0}};
  const std::vector<TokenProbability> q = {{3, 0.5}, {42, 0.5}};
  for (uint64_t counter = 0; counter < 200; ++counter) {
    DraftVerdict hit = verify_draft(greedy, q, 42, 99, counter);
    EXPECT_TRUE(hit.accepted);
    EXPECT_EQ(hit.token_id, 42);
    DraftVerdict miss = verify_draft(greedy, q, 3, 99, counter);
    EXPECT_FALSE(miss.accepted);
    EXPECT_EQ(miss.token_id, 42);
  }
  // A point-mass draft (a greedy MTP draft) against a sampled target: accepted with probability p(x).
  const std::vector<TokenProbability> p = {{3, 0.2}, {42, 0.8}};
  const std::vector<TokenProbability> point = {{3, 1.0}};
  int accepted = 0;
  for (uint64_t counter = 0; counter < 20000; ++counter) {
    DraftVerdict verdict = verify_draft(p, point, 3, 5, counter);
    accepted += verdict.accepted;
    if (!verdict.accepted) {
      EXPECT_EQ(verdict.token_id, 42);  // the residual is p without token 3
    }
  }
  EXPECT_NEAR(accepted / 20000.0, 0.2, 0.015);
}

TEST(SpeculativeTest, StatsCountByPositionAndLength) {
  SpeculativeStats stats;
  stats.record(3, 0);
  stats.record(3, 3);
  stats.record(2, 1);
  EXPECT_EQ(stats.draft_tokens, 8);
  EXPECT_EQ(stats.accepted_tokens, 4);
  EXPECT_EQ(stats.verifies, 3);
  EXPECT_EQ(stats.emitted_tokens, 7);
  EXPECT_EQ(stats.drafted_by_position, (std::vector<int64_t>{3, 3, 2}));
  EXPECT_EQ(stats.accepted_by_position, (std::vector<int64_t>{2, 1, 1}));
  EXPECT_EQ(stats.verify_length_counts, (std::vector<int64_t>{0, 0, 0, 1, 2}));
}

TEST(SpeculativeTest, FlagsAreCheckedAndNameWhatIsMissing) {
  EXPECT_EQ(*parse_speculative_algorithm("mtp"), SpeculativeAlgorithm::kMtp);
  EXPECT_EQ(*parse_speculative_algorithm(""), SpeculativeAlgorithm::kNone);
  EXPECT_EQ(*parse_speculative_algorithm("DSPARK"), SpeculativeAlgorithm::kDspark) << "SGLang's spelling";
  EXPECT_EQ(*parse_speculative_algorithm("MTP"), SpeculativeAlgorithm::kMtp);
  Result<SpeculativeAlgorithm> eagle = parse_speculative_algorithm("eagle");
  ASSERT_FALSE(eagle.ok());
  EXPECT_NE(eagle.status().message().find("eagle"), std::string::npos);

  SpeculativeConfig config;
  config.algorithm = SpeculativeAlgorithm::kMtp;
  config.num_draft_tokens = 2;
  EXPECT_TRUE(config.validate(1).ok());
  Status no_layers = config.validate(0);
  ASSERT_FALSE(no_layers.ok());
  EXPECT_NE(no_layers.message().find("num_nextn_predict_layers"), std::string::npos) << no_layers.message();
  config.num_draft_tokens = 0;
  Status zero = config.validate(1);
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.message().find("--speculative-num-draft-tokens"), std::string::npos) << zero.message();
  config.num_draft_tokens = SpeculativeConfig::kMaxDraftTokens + 1;
  EXPECT_FALSE(config.validate(1).ok());
  SpeculativeConfig off;
  off.num_draft_tokens = 2;
  EXPECT_FALSE(off.validate(1).ok()) << "draft tokens without an algorithm would be silently ignored";
}

}  // namespace
}  // namespace deepinfer::engine
