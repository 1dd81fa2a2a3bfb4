// The sampler: greedy and ties, temperature, top-k / top-p / min-p kept sets, penalties and logit_bias
// against hand-computed logits, per-request determinism whatever the batch, raw logprobs, and validate().
#include "deepinfer/engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace deepinfer::engine {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Owns everything a SamplerRow borrows.
struct Request {
  std::vector<float> logits;
  SamplingParams params;
  std::vector<TokenId> prompt;
  std::vector<TokenId> output;
  RequestRng rng;

  SamplerRow row() { return SamplerRow{logits, &params, prompt, output, &rng}; }
};

std::vector<float> log_of(const std::vector<double>& probabilities) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

std::vector<double> softmax(const std::vector<double>& logits, double temperature = 1.0) {
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> out;
  double sum = 0.0;
  for (double l : logits) {
    out.push_back(std::exp((l - max) / temperature));
    sum += out.back();
  }
  for (double& p : out) p /= sum;
  return out;
}

std::vector<TokenProbability> distribution_of(Request& request) {
  Sampler sampler(static_cast<int64_t>(request.logits.size()));
  std::vector<TokenProbability> distribution;
  Status status = sampler.final_distribution(request.row(), distribution);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return distribution;
}

std::set<TokenId> kept_set(Request& request) {
  std::set<TokenId> kept;
  for (const TokenProbability& entry : distribution_of(request)) kept.insert(entry.token_id);
  return kept;
}

// Draws `draws` tokens for one request, one step at a time (same logits every step), and counts them.
std::vector<int64_t> draw_counts(Request& request, int draws) {
  Sampler sampler(static_cast<int64_t>(request.logits.size()));
  std::vector<int64_t> counts(request.logits.size(), 0);
  SampledToken out;
  for (int i = 0; i < draws; ++i) {
    SamplerRow row = request.row();
    Status status = sampler.sample({&row, 1}, {&out, 1});
    EXPECT_TRUE(status.ok()) << status.to_string();
    ++counts[static_cast<size_t>(out.token_id)];
  }
  return counts;
}

std::set<TokenId> drawn_set(Request& request, int draws) {
  std::set<TokenId> drawn;
  std::vector<int64_t> counts = draw_counts(request, draws);
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > 0) drawn.insert(static_cast<TokenId>(i));
  }
  return drawn;
}

// ---- Philox ---------------------------------------------------------------------------------------------

TEST(PhiloxTest, KnownAnswerVectors) {
  // Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4] key[2] -> output[4].
  struct Case {
    std::array<uint32_t, 4> counter;
    std::array<uint32_t, 2> key;
    std::array<uint32_t, 4> expected;
  };
  const Case cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Case& c : cases) EXPECT_EQ(philox4x32_10(c.counter, c.key), c.expected);
}

TEST(PhiloxTest, UniformIsAPureFunctionInTheUnitInterval) {
  // From the first KAT line: words 0 and 1 give the 64 bits, of which the top 53 are used.
  const uint64_t bits = (uint64_t{0xe169c58d} << 32) | 0x6627e8d5;
  EXPECT_EQ(philox_uniform(0, 0, 0), static_cast<double>(bits >> 11) * 0x1.0p-53);
  EXPECT_EQ(philox_uniform(7, 3, 0), philox_uniform(7, 3, 0));
  EXPECT_NE(philox_uniform(7, 3, 0), philox_uniform(7, 3, 1));
  EXPECT_NE(philox_uniform(7, 3, 0), philox_uniform(7, 4, 0));
  EXPECT_NE(philox_uniform(7, 3, 0), philox_uniform(8, 3, 0));
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = philox_uniform(42, static_cast<uint64_t>(i), 0);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
}

TEST(PhiloxTest, RequestRngTakesTheSeedOrTheFallback) {
  SamplingParams params;
  EXPECT_EQ(make_request_rng(params, 99).seed, 99u);
  params.seed = 5;
  EXPECT_EQ(make_request_rng(params, 99).seed, 5u);
  EXPECT_EQ(make_request_rng(params, 99).counter, 0u);
}

// ---- Greedy ---------------------------------------------------------------------------------------------

TEST(GreedyTest, ArgmaxWithTiesToTheLowestId) {
  struct Case {
    std::string name;
    std::vector<float> logits;
    float temperature;
    TokenId expected;
  };
  const Case cases[] = {
      {"single max", {0.1f, 3.0f, -1.0f, 2.9f}, 0.0f, 1},
      {"tie goes to lower id", {1.0f, 5.0f, 2.0f, 5.0f, 5.0f}, 0.0f, 1},
      {"all equal", {0.0f, 0.0f, 0.0f}, 0.0f, 0},
      {"-inf ignored", {-kInf, -kInf, -3.0f, -kInf}, 0.0f, 2},
      {"max last", {-1.0f, -2.0f, 7.5f}, 0.0f, 2},
      {"below kGreedyTemperature is greedy", {0.0f, 1.0f, 0.9999f}, 1e-6f, 1},
  };
  for (const Case& c : cases) {
    Request request{c.logits, {}, {}, {}, {}};
    request.params.temperature = c.temperature;
    std::vector<int64_t> counts = draw_counts(request, 50);
    EXPECT_EQ(counts[static_cast<size_t>(c.expected)], 50) << c.name;
    std::vector<TokenProbability> distribution = distribution_of(request);
    ASSERT_EQ(distribution.size(), 1u) << c.name;
    EXPECT_EQ(distribution[0].token_id, c.expected) << c.name;
    EXPECT_EQ(distribution[0].probability, 1.0) << c.name;
  }
}

TEST(GreedyTest, IgnoresTruncationAndAdvancesTheCounter) {
  Request request{{0.5f, 2.0f, 2.0f, 1.0f}, {}, {}, {}, {}};
  request.params.temperature = 0.0f;
  request.params.top_k = 3;
  request.params.top_p = 0.1f;
  request.params.min_p = 0.9f;
  Sampler sampler(4);
  SampledToken out;
  SamplerRow row = request.row();
  ASSERT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
  EXPECT_EQ(out.token_id, 1);
  EXPECT_EQ(request.rng.counter, 1u);  // counter == tokens sampled, greedy or not
}

// ---- Temperature ----------------------------------------------------------------------------------------

TEST(TemperatureTest, MatchesHandComputedDistribution) {
  const std::vector<double> logits = {1.0, 2.0, 3.0, 0.5};
  for (double temperature : {0.5, 0.7, 1.0, 2.0}) {
    Request request{{1.0f, 2.0f, 3.0f, 0.5f}, {}, {}, {}, {}};
    request.params.temperature = static_cast<float>(temperature);
    request.params.seed = 20240601;
    request.rng = make_request_rng(request.params, 0);
    const std::vector<double> expected = softmax(logits, static_cast<float>(temperature));

    std::vector<TokenProbability> distribution = distribution_of(request);
    ASSERT_EQ(distribution.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(distribution[i].token_id, static_cast<TokenId>(i));
      EXPECT_NEAR(distribution[i].probability, expected[i], 1e-7) << "T=" << temperature << " token " << i;
    }

    const int draws = 200000;
    std::vector<int64_t> counts = draw_counts(request, draws);
    for (size_t i = 0; i < 4; ++i) {
      // Within 1% of the draws; the binomial standard deviation here is at most 0.0012.
      EXPECT_NEAR(static_cast<double>(counts[i]) / draws, expected[i], 0.01) << "T=" << temperature << " token " << i;
    }
    EXPECT_EQ(request.rng.counter, static_cast<uint64_t>(draws));
  }
}

// ---- Truncation: top-k, top-p, min-p --------------------------------------------------------------------

struct TruncationCase {
  std::string name;
  std::vector<double> probabilities;  // logits are their logs
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  std::set<TokenId> expected;
};

// Probabilities listed out of id order so that "most likely first" differs from "lowest id first".
const std::vector<double> kFour = {0.15, 0.5, 0.1, 0.25};  // order: 1, 3, 0, 2

const TruncationCase kTruncationCases[] = {
    {"off", kFour, 1.0f, -1, 1.0f, 0.0f, {0, 1, 2, 3}},
    {"top_k 0 is off", kFour, 1.0f, 0, 1.0f, 0.0f, {0, 1, 2, 3}},
    {"top_k 1", kFour, 1.0f, 1, 1.0f, 0.0f, {1}},
    {"top_k 2", kFour, 1.0f, 2, 1.0f, 0.0f, {1, 3}},
    {"top_k 3", kFour, 1.0f, 3, 1.0f, 0.0f, {0, 1, 3}},
    {"top_k above vocab", kFour, 1.0f, 10, 1.0f, 0.0f, {0, 1, 2, 3}},
    {"top_k tie at the boundary goes to the lower id", {0.3, 0.2, 0.3, 0.2}, 1.0f, 3, 1.0f, 0.0f, {0, 1, 2}},
    {"top_p 0.3", kFour, 1.0f, -1, 0.3f, 0.0f, {1}},
    {"top_p 0.6", kFour, 1.0f, -1, 0.6f, 0.0f, {1, 3}},
    {"top_p 0.8", kFour, 1.0f, -1, 0.8f, 0.0f, {0, 1, 3}},
    {"top_p 0.95", kFour, 1.0f, -1, 0.95f, 0.0f, {0, 1, 2, 3}},
    {"top_p is over the renormalised top-k set", kFour, 1.0f, 2, 0.6f, 0.0f, {1}},  // 0.5/0.75 = 0.67 >= 0.6
    {"top_p sees temperature", kFour, 3.0f, -1, 0.6f, 0.0f, {0, 1, 3}},             // flatter: see TopPWithTemperature
    {"min_p 0.25", kFour, 1.0f, -1, 1.0f, 0.25f, {0, 1, 3}},                        // threshold 0.125
    {"min_p 0.35", kFour, 1.0f, -1, 1.0f, 0.35f, {1, 3}},                           // threshold 0.175
    {"min_p 1 keeps the max", kFour, 1.0f, -1, 1.0f, 1.0f, {1}},
    {"min_p 1 keeps tied maxima", {0.4, 0.2, 0.4}, 1.0f, -1, 1.0f, 1.0f, {0, 2}},
    {"min_p sees temperature", kFour, 2.0f, -1, 1.0f, 0.4f, {0, 1, 2, 3}},  // ratios sqrt: 0.447 for token 2
    {"min_p after top_p", kFour, 1.0f, -1, 0.8f, 0.35f, {1, 3}},
    {"top_k then min_p", kFour, 1.0f, 3, 1.0f, 0.25f, {0, 1, 3}},
};

TEST(TruncationTest, KeepsExactlyTheExpectedSet) {
  for (const TruncationCase& c : kTruncationCases) {
    Request request{log_of(c.probabilities), {}, {}, {}, {}};
    request.params.temperature = c.temperature;
    request.params.top_k = c.top_k;
    request.params.top_p = c.top_p;
    request.params.min_p = c.min_p;
    request.params.seed = 7;
    request.rng = make_request_rng(request.params, 0);
    EXPECT_EQ(kept_set(request), c.expected) << c.name;
    // Every kept token has probability >= ~0.1 here, so 20k draws reach each of them.
    EXPECT_EQ(drawn_set(request, 20000), c.expected) << c.name;
    double sum = 0.0;
    for (const TokenProbability& entry : distribution_of(request)) sum += entry.probability;
    EXPECT_NEAR(sum, 1.0, 1e-12) << c.name;
  }
}

TEST(TruncationTest, TopPWithTemperatureKeepsThree) {
  // Hand check of the "top_p sees temperature" row: at T=3, p ~ (0.220, 0.328, 0.192, 0.260) by id, so the
  // two most likely (ids 1, 3) hold 0.589 < 0.6 and id 0 is needed too. At T=1 they hold 0.75 >= 0.6.
  const std::vector<double> p = softmax({std::log(0.15), std::log(0.5), std::log(0.1), std::log(0.25)}, 3.0);
  EXPECT_NEAR(p[1] + p[3], 0.589, 0.001);
  EXPECT_LT(p[1] + p[3], 0.6);
}

// A plain reference: full sort, then the same rules. Used on random vocabularies to exercise the chunked
// top-p and nth_element paths against something obviously right.
std::vector<TokenProbability> reference_distribution(const std::vector<float>& logits, const SamplingParams& params) {
  std::vector<TokenId> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](TokenId a, TokenId b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  });
  if (params.top_k >= 1 && static_cast<size_t>(params.top_k) < order.size()) order.resize(params.top_k);
  const double max = logits[static_cast<size_t>(order[0])];
  std::vector<double> weights;
  double total = 0.0;
  for (TokenId id : order) {
    weights.push_back(std::exp((logits[static_cast<size_t>(id)] - max) / params.temperature));
    total += weights.back();
  }
  size_t kept = order.size();
  double mass = 0.0;
  for (size_t r = 0; r < order.size() && params.top_p < 1.0f; ++r) {
    if (mass >= params.top_p * total) {
      kept = r;
      break;
    }
    mass += weights[r];
  }
  std::vector<TokenProbability> out;
  for (size_t r = 0; r < kept; ++r) {
    if (weights[r] >= params.min_p) out.push_back({order[r], weights[r]});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.token_id < b.token_id; });
  double sum = 0.0;
  for (const auto& entry : out) sum += entry.probability;
  for (auto& entry : out) entry.probability /= sum;
  return out;
}

TEST(TruncationTest, MatchesAFullSortReferenceOnRandomVocabularies) {
  struct Config {
    float temperature;
    int32_t top_k;
    float top_p;
    float min_p;
  };
  const Config configs[] = {{1.0f, -1, 0.9f, 0.0f},   {0.7f, -1, 0.95f, 0.0f}, {1.3f, 50, 1.0f, 0.0f},
                            {1.0f, 40, 0.8f, 0.0f},   {0.6f, -1, 1.0f, 0.05f}, {1.0f, 1000, 0.99f, 0.01f},
                            {2.0f, -1, 0.999f, 0.0f}, {1.0f, -1, 0.3f, 0.0f},  {0.9f, 3000, 0.97f, 0.001f}};
  const int64_t vocab = 6000;
  Sampler sampler(vocab);
  for (uint64_t trial = 0; trial < 6; ++trial) {
    // Logits with a heavy head (like a language model's) drawn from our own generator.
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (size_t i = 0; i < logits.size(); ++i) {
      const double u = philox_uniform(1000 + trial, i, 3);
      logits[i] = static_cast<float>(8.0 * std::pow(u, 6.0 + static_cast<double>(trial)) + 0.5 * u);
    }
    for (const Config& config : configs) {
      SamplingParams params;
      params.temperature = config.temperature;
      params.top_k = config.top_k;
      params.top_p = config.top_p;
      params.min_p = config.min_p;
      SamplerRow row{logits, &params, {}, {}, nullptr};
      std::vector<TokenProbability> got;
      ASSERT_TRUE(sampler.final_distribution(row, got).ok());
      const std::vector<TokenProbability> want = reference_distribution(logits, params);
      ASSERT_EQ(got.size(), want.size()) << "trial " << trial << " top_k " << config.top_k << " top_p " << config.top_p
                                         << " min_p " << config.min_p;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].token_id, want[i].token_id) << "trial " << trial << " index " << i;
        ASSERT_NEAR(got[i].probability / want[i].probability, 1.0, 1e-5) << "trial " << trial << " index " << i;
      }
    }
  }
}

TEST(TruncationTest, TiesInALargeVocabularyGoToTheLowerIds) {
  // Flat logits: every cut is decided by the id tie-break alone, on the heap, nth_element and histogram paths.
  struct Case {
    int32_t top_k;
    float top_p;
    size_t expected_count;  // kept ids are 0 .. expected_count - 1
  };
  const Case cases[] = {{100, 1.0f, 100}, {3000, 1.0f, 3000}, {-1, 0.5f, 2500}, {-1, 0.01f, 50}, {1000, 0.25f, 250}};
  for (const Case& c : cases) {
    Request request{std::vector<float>(5000, 1.5f), {}, {}, {}, {}};
    request.params.top_k = c.top_k;
    request.params.top_p = c.top_p;
    std::vector<TokenProbability> distribution = distribution_of(request);
    ASSERT_EQ(distribution.size(), c.expected_count) << "top_k " << c.top_k << " top_p " << c.top_p;
    for (size_t i = 0; i < distribution.size(); ++i) {
      ASSERT_EQ(distribution[i].token_id, static_cast<TokenId>(i));
      ASSERT_NEAR(distribution[i].probability, 1.0 / static_cast<double>(c.expected_count), 1e-12);
    }
  }
}

TEST(TruncationTest, NegativeInfinityIsNeverKept) {
  Request request{{-kInf, 0.0f, -kInf, 0.0f}, {}, {}, {}, {}};
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{1, 3}));
  EXPECT_EQ(drawn_set(request, 2000), (std::set<TokenId>{1, 3}));
}

// ---- Penalties and logit_bias ---------------------------------------------------------------------------

struct ProcessingCase {
  std::string name;
  float repetition_penalty;
  float frequency_penalty;
  float presence_penalty;
  std::map<TokenId, float> logit_bias;
  std::vector<double> expected_logits;  // hand-computed, for the logits/prompt/output below
};

// logits {2, -1, 0.5, 3, -2, 1}; prompt {0, 1, 0}; output {3, 3, 4, 1}.
const ProcessingCase kProcessingCases[] = {
    {"nothing", 1.0f, 0.0f, 0.0f, {}, {2, -1, 0.5, 3, -2, 1}},
    // Tokens 0, 1 (prompt) and 3, 4 (output), each once: positive / 2, negative * 2.
    {"repetition 2", 2.0f, 0.0f, 0.0f, {}, {1, -2, 0.5, 1.5, -4, 1}},
    {"repetition 0.5 encourages", 0.5f, 0.0f, 0.0f, {}, {4, -0.5, 0.5, 6, -1, 1}},
    // Output counts: 3 -> 2, 4 -> 1, 1 -> 1. The prompt does not count.
    {"frequency 0.5", 1.0f, 0.5f, 0.0f, {}, {2, -1.5, 0.5, 2, -2.5, 1}},
    {"presence 0.25", 1.0f, 0.0f, 0.25f, {}, {2, -1.25, 0.5, 2.75, -2.25, 1}},
    {"presence -1 encourages", 1.0f, 0.0f, -1.0f, {}, {2, 0, 0.5, 4, -1, 1}},
    {"all three, repetition first",
     2.0f,
     0.5f,
     0.25f,
     {},
     {1, -2 - 0.5 - 0.25, 0.5, 1.5 - 1.0 - 0.25, -4 - 0.5 - 0.25, 1}},
    {"bias", 1.0f, 0.0f, 0.0f, {{2, 1.5f}, {5, -3.0f}}, {2, -1, 2.0, 3, -2, -2}},
    {"bias clamped to 100", 1.0f, 0.0f, 0.0f, {{2, 500.0f}}, {2, -1, 100.5, 3, -2, 1}},
    {"bias clamped to -100", 1.0f, 0.0f, 0.0f, {{2, -1e9f}}, {2, -1, -99.5, 3, -2, 1}},
    // Bias first: token 3 becomes 3 + 3 = 6, then / 2 = 3 (not 3 / 2 + 3 = 4.5).
    {"bias before repetition", 2.0f, 0.0f, 0.0f, {{3, 3.0f}}, {1, -2, 0.5, 3, -4, 1}},
};

TEST(ProcessingTest, PenaltiesAndBiasMatchHandComputedLogits) {
  for (const ProcessingCase& c : kProcessingCases) {
    Request request{{2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.0f}, {}, {0, 1, 0}, {3, 3, 4, 1}, {}};
    request.params.repetition_penalty = c.repetition_penalty;
    request.params.frequency_penalty = c.frequency_penalty;
    request.params.presence_penalty = c.presence_penalty;
    request.params.logit_bias = c.logit_bias;
    const std::vector<double> expected = softmax(c.expected_logits);
    std::vector<TokenProbability> distribution = distribution_of(request);
    ASSERT_EQ(distribution.size(), expected.size()) << c.name;
    for (size_t i = 0; i < expected.size(); ++i) {
      // Relative where it can be: a banned token's probability (~1e-44) is a float subnormal in the sampler.
      if (expected[i] > 1e-30) {
        EXPECT_NEAR(distribution[i].probability / expected[i], 1.0, 1e-6) << c.name << " token " << i;
      } else {
        EXPECT_LT(distribution[i].probability, 1e-30) << c.name << " token " << i;
      }
    }
  }
}

TEST(ProcessingTest, GreedySeesBiasAndPenalties) {
  Request request{{2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.0f}, {}, {}, {3}, {}};
  request.params.temperature = 0.0f;
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{3}));
  request.params.presence_penalty = 1.5f;  // 3 -> 1.5 < 2
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{0}));
  request.params.logit_bias = {{4, 10.0f}};
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{4}));
}

TEST(ProcessingTest, BiasOfMinus100BansAToken) {
  Request request{{0.0f, 0.0f, 0.0f, 0.0f}, {}, {}, {}, {}};
  request.params.logit_bias = {{2, -100.0f}};
  request.params.seed = 3;
  request.rng = make_request_rng(request.params, 0);
  std::vector<int64_t> counts = draw_counts(request, 30000);
  EXPECT_EQ(counts[2], 0);
  for (size_t i : {0u, 1u, 3u}) EXPECT_NEAR(static_cast<double>(counts[i]) / 30000, 1.0 / 3, 0.01);
  // Even when it is by far the model's favourite.
  Request favourite{{50.0f, 0.0f, 0.0f}, {}, {}, {}, {}};
  favourite.params.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(draw_counts(favourite, 10000)[0], 0);
}

// A thinking budget (SamplingParams::reasoning_budget, Anthropic's thinking.budget_tokens): after `budget` output
// tokens with none of the end ids, the next token is the first end id with probability 1, greedy or sampled, even
// when the model all but bans it; before that position, after it, and once an end id has appeared, nothing changes.
TEST(ProcessingTest, AThinkingBudgetForcesTheEndOfReasoningAtItsPosition) {
  Request request{{5.0f, 0.0f, 1.0f, -30.0f, 2.0f}, {}, {}, {1, 2, 4}, {}};
  request.params.reasoning_budget = 3;
  request.params.reasoning_end_token_ids = {3, 0};
  request.params.seed = 11;
  request.rng = make_request_rng(request.params, 0);
  EXPECT_EQ(request.params.forced_token(request.output), 3);
  std::vector<int64_t> counts = draw_counts(request, 2000);
  EXPECT_EQ(counts[3], 2000);
  request.params.temperature = 0.0f;
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{3}));
  request.params.logit_bias = {{3, -100.0f}};  // a ban of the end token does not outweigh the budget
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{3}));
  request.params.logit_bias.clear();
  // One token short, one past, or reasoning already ended by either end id: the model's own argmax.
  for (const std::vector<TokenId>& output : {std::vector<TokenId>{1, 2}, std::vector<TokenId>{1, 2, 4, 1},
                                             std::vector<TokenId>{1, 3, 4}, std::vector<TokenId>{0, 2, 4}}) {
    request.output = output;
    EXPECT_EQ(request.params.forced_token(output), -1);
    EXPECT_EQ(kept_set(request), (std::set<TokenId>{0}));
  }
  // The device sampler's adjustments carry the same bias, added once to the token's own logit_bias.
  request.output = {1, 2, 4};
  request.params.logit_bias = {{3, 7.0f}};
  std::vector<backend::Backend::LogitAdjustment> adjustments;
  append_logit_adjustments(request.params, request.prompt, request.output, 2, adjustments);
  ASSERT_EQ(adjustments.size(), 1u);
  EXPECT_EQ(adjustments[0].row, 2);
  EXPECT_EQ(adjustments[0].token, 3);
  EXPECT_TRUE(adjustments[0].has_bias);
  EXPECT_EQ(adjustments[0].bias, 7.0f + kForcedTokenBias);
  // Validation: a budget needs an end id in the vocabulary, and is not negative.
  EXPECT_FALSE(request.params.is_plain_greedy());
  request.params.reasoning_end_token_ids = {};
  EXPECT_EQ(request.params.validate(5).message(),
            "reasoning_budget needs reasoning_end_token_ids (the token that ends reasoning)");
  request.params.reasoning_end_token_ids = {5};
  EXPECT_FALSE(request.params.validate(5).ok());
  request.params.reasoning_end_token_ids = {3};
  request.params.reasoning_budget = -1;
  EXPECT_EQ(request.params.validate(5).message(), "reasoning_budget must be >= 0, got -1");
}

// A forced output prefix (a named tool_choice's invoke header): output token i is prefix[i], then the model's own.
TEST(ProcessingTest, AForcedOutputPrefixIsTheAnswersFirstTokens) {
  Request request{{5.0f, 0.0f, 1.0f, -30.0f, 2.0f}, {}, {}, {}, {}};
  request.params.forced_output_prefix = {3, 1};
  request.params.seed = 4;
  request.rng = make_request_rng(request.params, 0);
  EXPECT_FALSE(request.params.is_plain_greedy());
  EXPECT_EQ(draw_counts(request, 500)[3], 500);
  request.output = {3};
  EXPECT_EQ(draw_counts(request, 500)[1], 500);
  request.output = {3, 1};
  EXPECT_EQ(request.params.forced_token(request.output), -1);
  request.params.temperature = 0.0f;
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{0}));
  request.params.forced_output_prefix = {5};
  EXPECT_EQ(request.params.validate(5).message(), "forced_output_prefix[0] = 5 is not a token id: must be in [0, 5)");
}

// Forced output choices ("required" with several tools: one invoke header each): where the choices agree the
// token is forced; where they part, only their next tokens can be drawn, in the model's proportions among them;
// past every choice, nothing is constrained. Choices {3, 1}, {3, 2, 0}, {3, 2, 4} over 5 tokens.
TEST(ProcessingTest, ForcedOutputChoicesAllowOnlyTheirNextTokens) {
  Request request{{5.0f, 0.0f, 1.0f, -30.0f, 2.0f}, {}, {}, {}, {}};
  request.params.forced_output_choices = {{3, 1}, {3, 2, 0}, {3, 2, 4}};
  request.params.seed = 9;
  request.rng = make_request_rng(request.params, 0);
  EXPECT_FALSE(request.params.is_plain_greedy());
  EXPECT_EQ(request.params.forced_token(request.output), 3);  // all three begin with 3
  EXPECT_TRUE(request.params.choice_tokens(request.output).empty());
  EXPECT_EQ(draw_counts(request, 500)[3], 500);
  // After 3: 1 or 2 (logits 0 and 1: probabilities 0.269 and 0.731 among them), never the model's favourite 0.
  request.output = {3};
  EXPECT_EQ(request.params.forced_token(request.output), -1);
  EXPECT_EQ(request.params.choice_tokens(request.output), (std::vector<TokenId>{1, 2}));
  std::vector<int64_t> counts = draw_counts(request, 20000);
  EXPECT_EQ(counts[1] + counts[2], 20000);
  EXPECT_NEAR(static_cast<double>(counts[2]) / 20000, std::exp(1.0) / (1.0 + std::exp(1.0)), 0.01);
  request.params.temperature = 0.0f;
  EXPECT_EQ(kept_set(request), (std::set<TokenId>{2}));
  request.params.temperature = 1.0f;
  // After 3, 2: 0 or 4; after 3, 1 (a choice ended) or past every choice: the model's own.
  request.output = {3, 2};
  EXPECT_EQ(request.params.choice_tokens(request.output), (std::vector<TokenId>{0, 4}));
  counts = draw_counts(request, 2000);
  EXPECT_EQ(counts[0] + counts[4], 2000);
  for (const std::vector<TokenId>& output : {std::vector<TokenId>{3, 1}, std::vector<TokenId>{3, 2, 4}}) {
    request.output = output;
    EXPECT_EQ(request.params.forced_token(output), -1);
    EXPECT_TRUE(request.params.choice_tokens(output).empty());
  }
  // The device sampler's adjustments carry the same bias (kChoiceTokenBias, after the token's own logit_bias).
  request.output = {3};
  request.params.logit_bias = {{2, -5.0f}};
  std::vector<backend::Backend::LogitAdjustment> adjustments;
  append_logit_adjustments(request.params, request.prompt, request.output, 1, adjustments);
  ASSERT_EQ(adjustments.size(), 2u);
  EXPECT_EQ(adjustments[0].token, 1);
  EXPECT_EQ(adjustments[0].bias, kChoiceTokenBias);
  EXPECT_EQ(adjustments[1].token, 2);
  EXPECT_EQ(adjustments[1].bias, -5.0f + kChoiceTokenBias);
  // Validation.
  request.params.forced_output_choices = {{3}, {}};
  EXPECT_EQ(request.params.validate(5).message(), "forced_output_choices[1] is empty");
  request.params.forced_output_choices = {{3, 5}};
  EXPECT_EQ(request.params.validate(5).message(),
            "forced_output_choices[0][1] = 5 is not a token id: must be in [0, 5)");
  request.params.forced_output_choices = {{3}};
  request.params.forced_output_prefix = {3};
  EXPECT_EQ(request.params.validate(5).message(), "forced_output_choices and forced_output_prefix are exclusive");
}

TEST(ProcessingTest, BuffersAreCleanBetweenRows) {
  // A penalised row followed by an unpenalised one with the same tokens: the second must be unaffected.
  Request penalised{{1.0f, 1.0f, 1.0f}, {}, {0}, {1, 1}, {}};
  penalised.params.repetition_penalty = 3.0f;
  penalised.params.frequency_penalty = 1.0f;
  Request plain{{1.0f, 1.0f, 1.0f}, {}, {0}, {1, 1}, {}};
  Sampler sampler(3);
  std::vector<TokenProbability> first;
  std::vector<TokenProbability> second;
  ASSERT_TRUE(sampler.final_distribution(penalised.row(), first).ok());
  ASSERT_TRUE(sampler.final_distribution(plain.row(), second).ok());
  EXPECT_LT(first[1].probability, first[2].probability);
  for (const TokenProbability& entry : second) EXPECT_NEAR(entry.probability, 1.0 / 3, 1e-12);
  // And the penalised row again gives the same answer as the first time.
  std::vector<TokenProbability> third;
  ASSERT_TRUE(sampler.final_distribution(penalised.row(), third).ok());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(third[i].probability, first[i].probability);
}

// ---- Determinism ----------------------------------------------------------------------------------------

// A fake model: logits for the next token of request `salt` depend on its step and last token only.
std::vector<float> fake_logits(uint64_t salt, size_t step, TokenId last_token, int64_t vocab) {
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (size_t i = 0; i < logits.size(); ++i) {
    const double u = philox_uniform(salt * 1000003 + static_cast<uint64_t>(last_token), step * vocab + i, 9);
    logits[i] = static_cast<float>(6.0 * u * u);
  }
  return logits;
}

std::vector<SamplingParams> batch_params() {
  std::vector<SamplingParams> params(6);
  params[0].temperature = 0.8f;  // the request under test
  params[0].top_p = 0.9f;
  params[0].seed = 1234;
  params[1].temperature = 0.0f;
  params[2].temperature = 1.2f;
  params[2].top_k = 20;
  params[2].seed = 1234;  // same seed, other params: must not disturb request 0
  params[3].temperature = 1.0f;
  params[3].min_p = 0.1f;
  params[3].repetition_penalty = 1.3f;
  params[3].seed = 77;
  params[4].temperature = 0.5f;
  params[4].frequency_penalty = 0.4f;
  params[4].logprobs = 5;
  params[5].temperature = 1.0f;
  params[5].presence_penalty = 0.8f;
  params[5].logit_bias = {{3, 2.0f}};
  return params;
}

// Runs the requests listed in `order` together for `steps` steps, one batch per step in that order, and
// returns every request's output (indexed by request, not position).
std::vector<std::vector<TokenId>> run_batch(const std::vector<size_t>& order, size_t steps) {
  const int64_t vocab = 300;
  const std::vector<SamplingParams> params = batch_params();
  std::vector<Request> requests(params.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    requests[r].params = params[r];
    requests[r].prompt = {static_cast<TokenId>(r), 5, 6};
    requests[r].rng = make_request_rng(params[r], /*fallback_seed=*/500 + r);
  }
  Sampler sampler(vocab);
  for (size_t step = 0; step < steps; ++step) {
    std::vector<SamplerRow> rows;
    for (size_t r : order) {
      Request& request = requests[r];
      const TokenId last = request.output.empty() ? request.prompt.back() : request.output.back();
      request.logits = fake_logits(r, step, last, vocab);
      rows.push_back(request.row());
    }
    std::vector<SampledToken> outputs(rows.size());
    Status status = sampler.sample(rows, outputs);
    EXPECT_TRUE(status.ok()) << "step " << step << ": " << status.to_string();
    for (size_t i = 0; i < order.size(); ++i) requests[order[i]].output.push_back(outputs[i].token_id);
  }
  std::vector<std::vector<TokenId>> outputs(requests.size());
  for (size_t r : order) outputs[r] = requests[r].output;
  return outputs;
}

TEST(DeterminismTest, SameSeedSameTokensWhateverTheBatch) {
  const size_t steps = 64;
  const std::vector<std::vector<size_t>> orders = {
      {0, 1, 2, 3, 4, 5}, {5, 4, 3, 2, 1, 0}, {2, 0, 4, 1, 5, 3}, {3, 5, 1, 0, 2, 4}};
  std::vector<std::vector<TokenId>> alone(6);
  for (size_t r = 0; r < 6; ++r) alone[r] = run_batch({r}, steps)[r];
  for (const std::vector<size_t>& order : orders) {
    const std::vector<std::vector<TokenId>> together = run_batch(order, steps);
    for (size_t r = 0; r < 6; ++r) {
      EXPECT_EQ(together[r], alone[r]) << "request " << r << " in order starting with " << order[0];
    }
  }
  // Request 0 is not degenerate: it draws a variety of tokens.
  EXPECT_GT(std::set<TokenId>(alone[0].begin(), alone[0].end()).size(), 10u);
}

TEST(DeterminismTest, DifferentSeedsDifferAndStateReplays) {
  std::vector<float> flat(1000, 0.0f);
  auto run = [&](RequestRng rng, int steps) {
    SamplingParams params;
    Request request{flat, params, {}, {}, rng};
    Sampler sampler(1000);
    SampledToken out;
    for (int i = 0; i < steps; ++i) {
      SamplerRow row = request.row();
      EXPECT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
      request.output.push_back(out.token_id);
    }
    return request.output;
  };
  const std::vector<TokenId> a = run({1, 0}, 32);
  EXPECT_EQ(run({1, 0}, 32), a);
  EXPECT_NE(run({2, 0}, 32), a);
  // Resuming from counter 16 (as after preemption) reproduces the second half.
  const std::vector<TokenId> resumed = run({1, 16}, 16);
  EXPECT_EQ(resumed, std::vector<TokenId>(a.begin() + 16, a.end()));
}

// ---- Logprobs -------------------------------------------------------------------------------------------

TEST(LogprobsTest, RawDistributionSortedWithTiesToLowerId) {
  Request request{{1.0f, 3.0f, 2.0f, 3.0f, -kInf, 0.5f, 2.0f, -1.0f}, {}, {}, {}, {}};
  request.params.logprobs = 20;              // capped at the vocabulary
  request.params.temperature = 0.3f;         // processing must not change logprobs...
  request.params.logit_bias = {{7, 50.0f}};  // ...even when it changes the sampled token
  Sampler sampler(8);
  SampledToken out;
  SamplerRow row = request.row();
  ASSERT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
  EXPECT_EQ(out.token_id, 7);

  std::vector<double> raw = {1, 3, 2, 3, -std::numeric_limits<double>::infinity(), 0.5, 2, -1};
  const std::vector<double> p = softmax(raw);
  ASSERT_TRUE(out.logprob.has_value());
  EXPECT_NEAR(*out.logprob, std::log(p[7]), 1e-5);

  ASSERT_EQ(out.top_logprobs.size(), 8u);
  const std::vector<TokenId> expected_order = {1, 3, 2, 6, 0, 5, 7, 4};
  double sum = 0.0;
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(out.top_logprobs[i].token_id, expected_order[i]) << i;
    const size_t id = static_cast<size_t>(expected_order[i]);
    if (id == 4) {
      EXPECT_EQ(out.top_logprobs[i].logprob, -kInf);
    } else {
      EXPECT_NEAR(out.top_logprobs[i].logprob, std::log(p[id]), 1e-5) << i;
    }
    sum += std::exp(static_cast<double>(out.top_logprobs[i].logprob));
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
}

TEST(LogprobsTest, CountAndAbsence) {
  const std::vector<float> logits = {0.1f, 0.4f, 0.3f, 0.2f, 0.4f};
  struct Case {
    std::optional<int32_t> logprobs;
    bool has_logprob;
    std::vector<TokenId> top_ids;
  };
  const Case cases[] = {{std::nullopt, false, {}}, {0, true, {}}, {1, true, {1}}, {3, true, {1, 4, 2}}};
  Sampler sampler(5);
  for (const Case& c : cases) {
    Request request{logits, {}, {}, {}, {}};
    request.params.logprobs = c.logprobs;
    SampledToken out;
    out.top_logprobs = {{9, 9.0f}};  // stale content from a previous step must go
    out.logprob = 1.0f;
    SamplerRow row = request.row();
    ASSERT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
    EXPECT_EQ(out.logprob.has_value(), c.has_logprob);
    std::vector<TokenId> ids;
    for (const TokenLogprob& entry : out.top_logprobs) ids.push_back(entry.token_id);
    EXPECT_EQ(ids, c.top_ids);
  }
}

TEST(LogprobsTest, FullDeepSeekVocabularySumsToOne) {
  const int64_t vocab = 129280;
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(20.0 * philox_uniform(5, i, 2) - 10.0);
  Request request{logits, {}, {}, {}, {}};
  request.params.logprobs = 20;
  request.params.top_k = 50;
  Sampler sampler(vocab);
  SampledToken out;
  SamplerRow row = request.row();
  ASSERT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
  // logprob = logit - log_normaliser, so log_normaliser = logit[token] - logprob.
  const double log_normaliser = static_cast<double>(logits[static_cast<size_t>(out.token_id)]) - *out.logprob;
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - log_normaliser);
  EXPECT_NEAR(sum, 1.0, 1e-4);
  ASSERT_EQ(out.top_logprobs.size(), 20u);
  for (size_t i = 1; i < 20; ++i) EXPECT_GE(out.top_logprobs[i - 1].logprob, out.top_logprobs[i].logprob);
  const float top = *std::max_element(logits.begin(), logits.end());
  EXPECT_EQ(logits[static_cast<size_t>(out.top_logprobs[0].token_id)], top);
}

// ---- validate() and errors ------------------------------------------------------------------------------

TEST(ValidateTest, AcceptsDefaultsAndOffValues) {
  std::vector<std::function<void(SamplingParams&)>> edits = {
      [](SamplingParams&) {},
      [](SamplingParams& p) { p.temperature = 0.0f; },
      [](SamplingParams& p) { p.temperature = 5.0f; },  // vLLM has no upper bound
      [](SamplingParams& p) { p.top_k = 0; },
      [](SamplingParams& p) { p.top_k = 1; },
      [](SamplingParams& p) { p.top_k = 1000000; },
      [](SamplingParams& p) { p.top_p = 1.0f; },
      [](SamplingParams& p) { p.top_p = 1e-6f; },
      [](SamplingParams& p) { p.min_p = 1.0f; },
      [](SamplingParams& p) { p.presence_penalty = -2.0f; },
      [](SamplingParams& p) { p.frequency_penalty = 2.0f; },
      [](SamplingParams& p) { p.repetition_penalty = 0.01f; },
      [](SamplingParams& p) {
        p.logit_bias = {{0, 1e6f}, {99, -100.0f}};
      },  // clamped when applied
      [](SamplingParams& p) { p.logprobs = 0; },
      [](SamplingParams& p) { p.logprobs = 20; },
      [](SamplingParams& p) { p.max_tokens = 1; },
      [](SamplingParams& p) {
        p.stop_token_ids = {0, 99};
      },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SamplingParams params;
    edits[i](params);
    Status status = params.validate(100);
    EXPECT_TRUE(status.ok()) << "edit " << i << ": " << status.to_string();
  }
}

TEST(ValidateTest, NamesTheFieldAndTheRange) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::function<void(SamplingParams&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](SamplingParams& p) { p.temperature = -0.5f; },
       "temperature must be a finite number >= 0 (0 means greedy), got -0.5"},
      {[&](SamplingParams& p) { p.temperature = nan; },
       "temperature must be a finite number >= 0 (0 means greedy), got nan"},
      {[](SamplingParams& p) { p.temperature = kInf; },
       "temperature must be a finite number >= 0 (0 means greedy), got inf"},
      {[](SamplingParams& p) { p.top_k = -2; }, "top_k must be -1 or 0 (off) or >= 1, got -2"},
      {[](SamplingParams& p) { p.top_p = 0.0f; }, "top_p must be in (0, 1] (1 means off), got 0"},
      {[](SamplingParams& p) { p.top_p = 1.5f; }, "top_p must be in (0, 1] (1 means off), got 1.5"},
      {[&](SamplingParams& p) { p.top_p = nan; }, "top_p must be in (0, 1] (1 means off), got nan"},
      {[](SamplingParams& p) { p.min_p = -0.1f; }, "min_p must be in [0, 1] (0 means off), got -0.1"},
      {[](SamplingParams& p) { p.min_p = 2.0f; }, "min_p must be in [0, 1] (0 means off), got 2"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; },
       "repetition_penalty must be a finite number > 0 (1 means off), got 0"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty must be in [-2, 2], got 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty must be in [-2, 2], got -3"},
      {[](SamplingParams& p) {
         p.logit_bias = {{100, 1.0f}};
       },
       "logit_bias key 100 is not a token id: must be in [0, 100)"},
      {[](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0f}};
       },
       "logit_bias key -1 is not a token id: must be in [0, 100)"},
      {[&](SamplingParams& p) {
         p.logit_bias = {{4, nan}};
       },
       "logit_bias[4] must be a finite number, got nan"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs must be in [0, 20], got 21"},
      {[](SamplingParams& p) { p.logprobs = -1; }, "logprobs must be in [0, 20], got -1"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens must be >= 1, got 0"},
      {[](SamplingParams& p) {
         p.stop_token_ids = {1, 100};
       },
       "stop_token_ids[1] = 100 is not a token id: must be in [0, 100)"},
  };
  for (const Case& c : cases) {
    SamplingParams params;
    c.edit(params);
    Status status = params.validate(100);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(status.message(), c.message);
  }
  EXPECT_EQ(SamplingParams().validate(0).message(), "vocab_size must be > 0, got 0");
}

TEST(SamplerErrorTest, RejectsBadRowsWithoutTouchingAnything) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::string name;
    std::function<void(Request&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"size", [](Request& r) { r.logits.pop_back(); }, "row 1: logits has 3 entries, expected vocab_size 4"},
      {"nan", [&](Request& r) { r.logits[2] = nan; }, "row 1: logits[2] is nan; logits must be finite or -inf"},
      {"+inf", [](Request& r) { r.logits[0] = kInf; }, "row 1: logits[0] is inf; logits must be finite or -inf"},
      {"all -inf", [](Request& r) { r.logits.assign(4, -kInf); },
       "row 1: every logit is -inf; there is no token to sample"},
      {"params", [](Request& r) { r.params.top_p = 0.0f; }, "row 1: top_p must be in (0, 1] (1 means off), got 0"},
      {"output id",
       [](Request& r) {
         r.params.presence_penalty = 1.0f;
         r.output = {1, 4};
       },
       "row 1: output_token_ids[1] = 4 is not a token id: must be in [0, 4)"},
      {"prompt id",
       [](Request& r) {
         r.params.repetition_penalty = 1.2f;
         r.prompt = {-3};
       },
       "row 1: prompt_token_ids[0] = -3 is not a token id: must be in [0, 4)"},
  };
  for (const Case& c : cases) {
    std::vector<Request> requests(3, Request{{0.0f, 1.0f, 2.0f, 3.0f}, {}, {}, {}, {}});
    c.edit(requests[1]);
    std::vector<SamplerRow> rows;
    for (Request& request : requests) rows.push_back(request.row());
    std::vector<SampledToken> outputs(3);
    for (SampledToken& out : outputs) out.token_id = -7;
    Sampler sampler(4);
    Status status = sampler.sample(rows, outputs);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_EQ(status.message(), c.message) << c.name;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(requests[i].rng.counter, 0u) << c.name << " row " << i;
      EXPECT_EQ(outputs[i].token_id, -7) << c.name << " row " << i;
    }
  }
  // Ids outside the vocabulary are fine when no penalty reads them (the prompt is not scanned).
  Request unpenalised{{0.0f, 1.0f}, {}, {999}, {-5}, {}};
  Sampler sampler(2);
  SampledToken out;
  SamplerRow row = unpenalised.row();
  EXPECT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
}

TEST(SamplerErrorTest, NullPointersAndOutputSize) {
  Request request{{0.0f, 1.0f}, {}, {}, {}, {}};
  Sampler sampler(2);
  SamplerRow row = request.row();
  std::vector<SampledToken> two(2);
  EXPECT_EQ(sampler.sample({&row, 1}, two).message(), "sampler got 1 rows but 2 output slots");
  SampledToken out;
  row.rng = nullptr;
  EXPECT_EQ(sampler.sample({&row, 1}, {&out, 1}).message(), "row 0: rng is null");
  row.params = nullptr;
  EXPECT_EQ(sampler.sample({&row, 1}, {&out, 1}).message(), "row 0: params is null");
}

// The device sampler's steps 1-2 (append_logit_adjustments, applied with the kernel's float arithmetic) give the logits
// process_logits gives: sampling the adjusted logits without bias and penalties draws the same distribution and the
// same tokens as sampling the raw logits with them. Repeated prompt/output tokens, a bias outside [-100, 100], a
// token both biased and penalised, a negative presence penalty.
TEST(LogitAdjustmentsTest, AppliedToTheRawLogitsTheyGiveWhatTheHostSamplerProcesses) {
  Request full;
  for (int i = 0; i < 300; ++i) full.logits.push_back(static_cast<float>(std::sin(i * 0.37) * 4.0 - (i % 7 == 0 ? 9.0 : 0.0)));
  full.logits[11] = 0.0f;
  full.logits[12] = -0.0f;
  full.prompt = {3, 7, 7, 11, 12, 200, 299};
  full.output = {7, 8, 8, 8, 12, 150, 3};
  full.params.temperature = 0.9f;
  full.params.top_p = 0.95f;
  full.params.repetition_penalty = 1.25f;
  full.params.frequency_penalty = 0.35f;
  full.params.presence_penalty = -0.15f;
  full.params.logit_bias = {{8, 1.5f}, {42, 130.0f}, {150, -7.0f}, {299, -200.0f}};
  std::vector<backend::Backend::LogitAdjustment> adjustments;
  append_logit_adjustments(full.params, full.prompt, full.output, 0, adjustments);
  // One entry per distinct token touched: bias keys {8, 42, 150, 299} and prompt/output {3, 7, 8, 11, 12, 150, 200}.
  ASSERT_EQ(adjustments.size(), 9u);
  for (size_t i = 1; i < adjustments.size(); ++i) EXPECT_LT(adjustments[i - 1].token, adjustments[i].token);
  Request adjusted = full;
  adjusted.params.repetition_penalty = 1.0f;
  adjusted.params.frequency_penalty = 0.0f;
  adjusted.params.presence_penalty = 0.0f;
  adjusted.params.logit_bias.clear();
  for (const auto& a : adjustments) {  // the kernel's arithmetic (kernels/cuda/sampling.cu)
    float& l = adjusted.logits[static_cast<size_t>(a.token)];
    if (a.has_bias) l = saturate_logit(l, l + a.bias);
    if (a.repetition != 1.0f) l = saturate_logit(l, l > 0.0f ? l / a.repetition : l * a.repetition);
    if (a.in_output) {
      l = saturate_logit(l, l - a.frequency);
      l = saturate_logit(l, l - a.presence);
    }
  }
  const std::vector<TokenProbability> want = distribution_of(full), got = distribution_of(adjusted);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].token_id, want[i].token_id);
    EXPECT_EQ(got[i].probability, want[i].probability) << "token " << want[i].token_id;
  }
  Sampler sampler(static_cast<int64_t>(full.logits.size()));
  for (uint64_t counter = 0; counter < 200; ++counter) {
    full.rng = {9, counter};
    adjusted.rng = {9, counter};
    SampledToken a, b;
    SamplerRow ra = full.row(), rb = adjusted.row();
    ASSERT_TRUE(sampler.sample({&ra, 1}, {&a, 1}).ok());
    ASSERT_TRUE(sampler.sample({&rb, 1}, {&b, 1}).ok());
    EXPECT_EQ(a.token_id, b.token_id) << "counter " << counter;
  }
  // Nothing to adjust: nothing appended.
  SamplingParams plain;
  std::vector<backend::Backend::LogitAdjustment> none;
  append_logit_adjustments(plain, full.prompt, full.output, 3, none);
  EXPECT_TRUE(none.empty());
}

// Regression: a repetition_penalty of 1e-38 (valid: finite, > 0) took a positive prompt logit to +inf, and a penalty
// of 3e38 took every negative one below -2 to -inf. The device sampler then rejected the row (-1), failing the whole step and
// every request in it; the host sampler read an empty distribution. Penalties now saturate at +-FLT_MAX.
TEST(PenaltiesTest, SaturateInsteadOfOverflowing) {
  Request tiny;
  tiny.logits = {1.0f, 3.0f, -2.0f, 0.5f};
  tiny.prompt = {0, 2};
  tiny.params.repetition_penalty = 1e-38f;  // token 0: 1 / 1e-38 = 1e38 (finite); token 2: -2e-38
  tiny.params.temperature = 0.5f;
  Request small = tiny;
  small.prompt = {3};  // 0.5 / 1e-38 = 5e37
  small.params.repetition_penalty = 1e-39f;  // a denormal: 0.5 / 1e-39 overflows to +inf, saturated
  for (Request* r : {&tiny, &small}) {
    // The saturated token takes all the mass (the others stay, at weight 0).
    for (const TokenProbability& p : distribution_of(*r))
      EXPECT_EQ(p.probability, p.token_id == (r == &tiny ? 0 : 3) ? 1.0 : 0.0) << "token " << p.token_id;
  }
  Request huge;
  huge.logits = {-2.0f, -3.0f, -5.0f};
  huge.prompt = {0, 1, 2};
  huge.params.repetition_penalty = 3e38f;  // every logit to -inf without saturation: all at the lowest float now
  const std::vector<TokenProbability> d = distribution_of(huge);
  ASSERT_EQ(d.size(), 3u);  // equal, the lowest float each: uniform
  for (const TokenProbability& p : d) EXPECT_NEAR(p.probability, 1.0 / 3.0, 1e-12);
  Sampler sampler(3);
  SampledToken out;
  SamplerRow row = huge.row();
  ASSERT_TRUE(sampler.sample({&row, 1}, {&out, 1}).ok());
  EXPECT_GE(out.token_id, 0);
  EXPECT_LT(out.token_id, 3);
  EXPECT_EQ(saturate_logit(-kInf, -kInf), -kInf);  // a raw -inf stays banned
  EXPECT_EQ(saturate_logit(2.0f, kInf), std::numeric_limits<float>::max());
}

}  // namespace
}  // namespace deepinfer::engine
