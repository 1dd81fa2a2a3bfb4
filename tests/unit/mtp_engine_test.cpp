// Speculative decoding with the MTP layer, end to end through the engine (src/engine/mtp_executor.cpp):
//   - greedy output is token-identical to plain decoding on the tiny DeepSeek-V3 fixture (its reference tokens) at
//     K = 1, 2, 3, alone and with all prompts at once under a small token budget (chunked prefill), and again with
//     prefix-cache hits; and on the trained demo model (models/demo, against its PyTorch reference tokens), where
//     the drafts are mostly accepted;
//   - stop tokens, max_tokens, logprobs, penalties, logit_bias and a thinking budget keep their meaning (same tokens,
//     finish reasons and logprobs as plain decoding);
//   - sampled output has plain sampling's distribution (two-sample chi-square over 400 + 400 seeded requests, fixed
//     seeds so it cannot flake);
//   - a checkpoint without next-n layers is refused with a message naming what is missing;
//   - a DSpark draft module (random weights on the fixture's shapes; the trained demo's in the demo tests) keeps
//     plain decoding's greedy tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "deepinfer/engine/engine.h"
#include "deepinfer/model/config.h"
#include "deepinfer/model/safetensors.h"
#include "fixture_engine.h"
#include "test_data.h"

namespace deepinfer::engine {
namespace {

using deepinfer::testing::source_path;

struct Outcome {
  std::map<SequenceId, std::vector<TokenId>> tokens;
  std::map<SequenceId, std::vector<float>> logprobs;
  std::map<SequenceId, FinishReason> reasons;
  std::map<SequenceId, int64_t> cached_tokens;
};

Outcome drain(Engine& engine) {
  Outcome outcome;
  int steps = 0;
  while (engine.has_pending_work()) {
    auto events = engine.step();
    EXPECT_TRUE(events.ok()) << events.status().to_string();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      if (event.token) outcome.tokens[event.id].push_back(*event.token);
      if (event.logprob) outcome.logprobs[event.id].push_back(*event.logprob);
      if (event.finished) {
        outcome.reasons[event.id] = event.finish_reason;
        outcome.cached_tokens[event.id] = event.num_cached_tokens;
      }
    }
    if (++steps > 20000) {
      ADD_FAILURE() << "engine did not drain";
      break;
    }
  }
  return outcome;
}

std::vector<std::vector<int32_t>> load_ints(const std::string& file, const char* field, int count) {
  auto opened = model::SafetensorsFile::open(source_path(file));
  EXPECT_TRUE(opened.ok()) << opened.status().to_string();
  std::vector<std::vector<int32_t>> out;
  if (!opened.ok()) return out;
  for (int i = 0; i < count; ++i) {
    const model::TensorView* view = (*opened)->find("prompt_" + std::to_string(i) + field);
    if (view == nullptr) break;
    std::vector<int32_t> values(static_cast<size_t>(view->numel()));
    std::memcpy(values.data(), view->data, view->size_bytes);
    out.push_back(std::move(values));
  }
  return out;
}

const std::string kTinyReference = "tests/data/models/tiny-deepseek-v3/reference.safetensors";

SamplingParams greedy(int64_t max_tokens = 16) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = max_tokens;
  params.ignore_eos = true;
  return params;
}

EngineConfig tiny_config(int32_t draft_tokens, int32_t budget = 96) {
  EngineConfig config;
  config.max_num_batched_tokens = budget;
  config.kv_cache_bytes = 64ll << 20;
  if (draft_tokens > 0) {
    config.speculative.algorithm = SpeculativeAlgorithm::kMtp;
    config.speculative.num_draft_tokens = draft_tokens;
  }
  return config;
}

// Two-sample chi-square per position (from 1) between plain sampling's tokens and another side's, tokens seen fewer
// than 10 times in all pooled into one bin; fails above the upper 0.1% point (Wilson-Hilferty).
void expect_same_distribution(const std::vector<std::vector<TokenId>>& plain,
                              const std::vector<std::vector<TokenId>>& other, int tokens_per_request,
                              const std::string& label) {
  for (int position = 1; position < tokens_per_request; ++position) {
    std::map<TokenId, std::array<int, 2>> counts;
    for (int side : {0, 1}) {
      for (const auto& tokens : side == 0 ? plain : other) {
        ASSERT_EQ(tokens.size(), static_cast<size_t>(tokens_per_request));
        ++counts[tokens[static_cast<size_t>(position)]][side];
      }
    }
    std::vector<std::array<int, 2>> bins;
    std::array<int, 2> pooled{0, 0};
    for (const auto& [token, c] : counts) {
      if (c[0] + c[1] < 10) {
        pooled[0] += c[0];
        pooled[1] += c[1];
      } else {
        bins.push_back(c);
      }
    }
    if (pooled[0] + pooled[1] > 0) bins.push_back(pooled);
    if (bins.size() < 2) continue;  // one token only: nothing to compare
    double chi = 0.0;
    for (const auto& c : bins) chi += static_cast<double>((c[0] - c[1]) * (c[0] - c[1])) / (c[0] + c[1]);
    const double df = static_cast<double>(bins.size()) - 1.0;
    const double t = 1.0 - 2.0 / (9.0 * df) + 3.090232 * std::sqrt(2.0 / (9.0 * df));
    EXPECT_LT(chi, df * t * t * t) << label << " position " << position << ": " << bins.size() << " bins";
    std::cout << "[ chi2   ] " << label << " position " << position << ": " << chi << " over " << bins.size()
              << " bins (0.1% point " << df * t * t * t << ")\n";
  }
}

// DSpark over the MTP drafts (dspark.h): at most `max_drafts` per chain; `table` "const" (always draft, verify all
// above the survival floor) or "" (measured on this machine when the engine starts).
EngineConfig dspark_config(int32_t max_drafts, const std::string& table, double threshold, int32_t budget = 96) {
  EngineConfig config = tiny_config(0, budget);
  config.speculative.algorithm = SpeculativeAlgorithm::kDspark;
  config.speculative.num_draft_tokens = max_drafts;
  config.speculative.dspark.step_time_table = table;
  config.speculative.dspark.confidence_threshold = threshold;
  return config;
}

TEST(MtpEngineTest, GreedyIsTokenIdenticalToPlainDecodingOnTheTinyFixture) {
  const auto prompts = load_ints(kTinyReference, ".input_ids", 6);  // up to 300 tokens (prompt_6's 600: too slow)
  const auto reference = load_ints(kTinyReference, ".greedy", 6);
  ASSERT_EQ(prompts.size(), 6u);
  for (int32_t k : {1, 3}) {
    auto engine = deepinfer::testing::make_fixture_engine(tiny_config(k));
    ASSERT_NE(engine, nullptr);
    if (k == 3) {  // batch 1
      SequenceId alone = *engine->submit(prompts[4], greedy());
      Outcome one = drain(*engine);
      EXPECT_EQ(one.tokens[alone], reference[4]) << "K " << k << ", prompt_4 alone";
    }
    // All at once, the long prompts chunked under the 96-token budget; then the longest again, from the prefix
    // cache (its leading blocks, and blocks the first run completed during decode).
    for (int run = 0; run < 2; ++run) {
      std::vector<size_t> which = run == 0 ? std::vector<size_t>{0, 1, 2, 3, 4, 5} : std::vector<size_t>{3, 4, 5};
      std::vector<SequenceId> ids;
      for (size_t i : which) ids.push_back(*engine->submit(prompts[i], greedy()));
      Outcome all = drain(*engine);
      int64_t cached = 0;
      for (size_t j = 0; j < ids.size(); ++j) {
        EXPECT_EQ(all.tokens[ids[j]], reference[which[j]]) << "K " << k << ", run " << run << ", prompt_" << which[j];
        EXPECT_EQ(all.reasons[ids[j]], FinishReason::kLength);
        cached += all.cached_tokens[ids[j]];
      }
      if (run == 1) {
        EXPECT_GT(cached, 0) << "the second run reuses the prefix cache";
      }
    }
    const SpeculativeStats& stats = engine->speculative_stats();
    EXPECT_GT(stats.verifies, 0);
    EXPECT_EQ(static_cast<int64_t>(stats.drafted_by_position.size()), k);
    EXPECT_EQ(stats.emitted_tokens, stats.accepted_tokens + stats.verifies);
    EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());
  }
}

// Plain decoding and MTP (K = 3) on the same requests: same tokens, finish reasons and logprobs.
TEST(MtpEngineTest, StopTokensMaxTokensLogprobsAndPenaltiesKeepTheirMeaning) {
  const auto prompts = load_ints(kTinyReference, ".input_ids", 7);
  const auto reference = load_ints(kTinyReference, ".greedy", 7);
  ASSERT_EQ(prompts.size(), 7u);
  std::vector<std::pair<std::vector<TokenId>, SamplingParams>> requests;
  requests.push_back({prompts[3], greedy(5)});  // max_tokens lands inside a draft chain
  SamplingParams stop = greedy();
  stop.stop_token_ids = {reference[2][6]};  // a stop token the drafts reach
  requests.push_back({prompts[2], stop});
  SamplingParams logprobs = greedy();
  logprobs.logprobs = 3;  // greedy, but the logits come to the host
  requests.push_back({prompts[1], logprobs});
  SamplingParams penalised = greedy();
  penalised.repetition_penalty = 1.3f;
  penalised.frequency_penalty = 0.5f;
  penalised.logit_bias = {{reference[5][1], -100.0f}};
  requests.push_back({prompts[5], penalised});
  // A thinking budget of 4: the fifth token is forced (the drafts past it were made after the model's own fifth
  // token, and must be rejected).
  TokenId end = 7;
  while (std::find(reference[6].begin(), reference[6].begin() + 5, end) != reference[6].begin() + 5) ++end;
  SamplingParams budgeted = greedy();
  budgeted.reasoning_budget = 4;
  budgeted.reasoning_end_token_ids = {end};
  requests.push_back({prompts[6], budgeted});
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.seed = 11;
  sampled.max_tokens = 12;
  sampled.logprobs = 1;
  sampled.ignore_eos = true;
  requests.push_back({prompts[0], sampled});

  std::vector<Outcome> outcomes;
  std::vector<std::vector<SequenceId>> ids(2);
  for (int32_t k : {0, 3}) {
    auto engine = deepinfer::testing::make_fixture_engine(tiny_config(k));
    ASSERT_NE(engine, nullptr);
    for (const auto& [prompt, params] : requests) ids[k == 0 ? 0 : 1].push_back(*engine->submit(prompt, params));
    outcomes.push_back(drain(*engine));
  }
  for (size_t r = 0; r + 1 < requests.size(); ++r) {  // the sampled one draws differently: checked below
    const SequenceId plain = ids[0][r], mtp = ids[1][r];
    EXPECT_EQ(outcomes[1].tokens[mtp], outcomes[0].tokens[plain]) << "request " << r;
    EXPECT_EQ(outcomes[1].reasons[mtp], outcomes[0].reasons[plain]) << "request " << r;
    ASSERT_EQ(outcomes[1].logprobs[mtp].size(), outcomes[0].logprobs[plain].size()) << "request " << r;
    for (size_t i = 0; i < outcomes[0].logprobs[plain].size(); ++i) {
      EXPECT_NEAR(outcomes[1].logprobs[mtp][i], outcomes[0].logprobs[plain][i], 1e-4)
          << "request " << r << " token " << i;
    }
  }
  EXPECT_EQ(outcomes[1].tokens[ids[1][0]].size(), 5u);
  EXPECT_EQ(outcomes[1].reasons[ids[1][1]], FinishReason::kStop);
  EXPECT_EQ(outcomes[1].tokens[ids[1][1]].back(), reference[2][6]);
  EXPECT_EQ(outcomes[1].logprobs[ids[1][2]].size(), 16u);
  const std::vector<TokenId>& forced = outcomes[1].tokens[ids[1][4]];
  ASSERT_EQ(forced.size(), 16u);
  EXPECT_EQ(std::vector<TokenId>(forced.begin(), forced.begin() + 4),
            std::vector<TokenId>(reference[6].begin(), reference[6].begin() + 4));
  EXPECT_EQ(forced[4], end);
  // The sampled request: 12 tokens, each with the logprob of the target's distribution (finite, <= 0).
  ASSERT_EQ(outcomes[1].tokens[ids[1][5]].size(), 12u);
  ASSERT_EQ(outcomes[1].logprobs[ids[1][5]].size(), 12u);
  for (float lp : outcomes[1].logprobs[ids[1][5]]) EXPECT_TRUE(std::isfinite(lp) && lp <= 0.0f);
}

// Token frequencies at positions 2..4 (the ones verified against drafts) of 400 seeded requests with MTP (K = 2),
// and with DSpark (up to 3 drafts, every one drafted and verified: threshold 0, "const" table), each against 400
// other seeds without: a two-sample chi-square per position, rare tokens pooled.
TEST(MtpEngineTest, SampledTokensHaveThePlainSamplingDistribution) {
  const auto prompts = load_ints(kTinyReference, ".input_ids", 7);
  ASSERT_FALSE(prompts.empty());
  constexpr int kRequests = 400;
  constexpr int kTokens = 4;
  std::vector<std::vector<std::vector<TokenId>>> outputs(3);  // [plain | mtp | dspark][request][token]
  int64_t accepted = 0, dspark_accepted = 0;
  for (int side = 0; side < 3; ++side) {
    EngineConfig config = side == 2 ? dspark_config(3, "const", 0.0, 4096) : tiny_config(side == 0 ? 0 : 2, 4096);
    config.max_num_seqs = kRequests;  // all in one batch: few steps
    auto engine = deepinfer::testing::make_fixture_engine(config);
    ASSERT_NE(engine, nullptr);
    std::vector<SequenceId> ids;
    for (int i = 0; i < kRequests; ++i) {
      SamplingParams params;
      params.temperature = 0.6f;
      params.top_k = 6;
      params.max_tokens = kTokens;
      params.ignore_eos = true;
      params.seed = static_cast<uint64_t>(side * kRequests + i);  // independent draws on the two sides
      ids.push_back(*engine->submit(prompts[1], params));
    }
    Outcome outcome = drain(*engine);
    for (SequenceId id : ids) outputs[side].push_back(outcome.tokens[id]);
    if (side == 1) accepted = engine->speculative_stats().accepted_tokens;
    if (side == 2) dspark_accepted = engine->speculative_stats().accepted_tokens;
  }
  EXPECT_GT(accepted, 0) << "no draft was ever accepted: the test would not exercise acceptance";
  EXPECT_GT(dspark_accepted, 0) << "no DSpark draft was ever accepted";
  expect_same_distribution(outputs[0], outputs[1], kTokens, "mtp");
  expect_same_distribution(outputs[0], outputs[2], kTokens, "dspark");
}

TEST(MtpEngineTest, ACheckpointWithoutNextNLayersIsRefused) {
  auto config = model::load_model_config(source_path(deepinfer::testing::kTinyV3Fixture));
  ASSERT_TRUE(config.ok());
  config->num_nextn_predict_layers = 0;
  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::create_random(*config, *backend, backend::Precision::kF32, 1);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto engine = Engine::create(std::move(backend), std::move(model).value(), tiny_config(2));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("num_nextn_predict_layers 0"), std::string::npos)
      << engine.status().message();
}

// The trained demo model: its MTP layer predicts well (79% teacher-forced greedy acceptance at training time), so
// this exercises long accepted runs. Its plain greedy tokens are the PyTorch reference's (demo_model_test.cpp checks
// the plain engine against the same file), so the reference stands in for a plain run.
TEST(MtpEngineTest, GreedyIsTokenIdenticalOnTheDemoModel) {
  namespace fs = std::filesystem;
  const std::string dir = source_path("models/demo");
  if (!fs::exists(fs::path(dir) / "model.safetensors")) {
    if (!fs::exists(source_path("assets/demo-model/config.json"))) GTEST_SKIP() << "no demo model";
    FAIL() << dir << " has no model.safetensors: run scripts/setup.sh";
  }
  const std::string reference_file = "tests/data/models/demo-reference.safetensors";
  const auto prompts = load_ints(reference_file, ".input_ids", 8);
  const auto reference = load_ints(reference_file, ".greedy", 8);
  ASSERT_FALSE(prompts.empty());
  ASSERT_EQ(prompts.size(), reference.size());
  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::load(dir, *backend, backend::Precision::kF32);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  auto engine = Engine::create(std::move(backend), std::move(model).value(), tiny_config(2, 12));  // chunked prefill
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  const SamplingParams params = greedy(static_cast<int64_t>(reference[0].size()));
  SequenceId alone = *(*engine)->submit(prompts.back(), params);  // batch 1
  EXPECT_EQ(drain(**engine).tokens[alone], reference.back()) << "alone";
  std::vector<SequenceId> ids;
  for (const auto& prompt : prompts) ids.push_back(*(*engine)->submit(prompt, params));
  Outcome all = drain(**engine);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(all.tokens[ids[i]], reference[i]) << "prompt_" << i;
  const SpeculativeStats& stats = (*engine)->speculative_stats();
  ASSERT_EQ(stats.drafted_by_position.size(), 2u);
  const double mean_accepted_length = static_cast<double>(stats.emitted_tokens) / static_cast<double>(stats.verifies);
  std::cout << "[ mtp    ] demo model K=2: mean accepted length " << mean_accepted_length
            << "; accepted at position 1: " << stats.accepted_by_position[0] << "/" << stats.drafted_by_position[0]
            << ", position 2: " << stats.accepted_by_position[1] << "/" << stats.drafted_by_position[1] << "\n";
  EXPECT_GT(mean_accepted_length, 1.5) << "the MTP layer's convention (its input, its norms) is likely wrong";
}

// DSpark changes how many drafts are made and verified, never the tokens: the tiny fixture with every draft made
// and verified (threshold 0, "const" table: its random weights' drafts are mostly rejected, so requests fall back
// to plain decoding and return mid-run), and the demo model with the step times measured on this machine.
TEST(MtpEngineTest, DsparkGreedyIsTokenIdenticalToPlainDecoding) {
  const auto prompts = load_ints(kTinyReference, ".input_ids", 6);
  const auto reference = load_ints(kTinyReference, ".greedy", 6);
  ASSERT_EQ(prompts.size(), 6u);
  auto engine = deepinfer::testing::make_fixture_engine(dspark_config(4, "const", 0.0));
  ASSERT_NE(engine, nullptr);
  std::vector<SequenceId> ids;
  for (const auto& prompt : prompts) ids.push_back(*engine->submit(prompt, greedy(24)));
  Outcome all = drain(*engine);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_GE(all.tokens[ids[i]].size(), reference[i].size());
    EXPECT_EQ(std::vector<TokenId>(all.tokens[ids[i]].begin(), all.tokens[ids[i]].begin() + reference[i].size()),
              reference[i])
        << "prompt_" << i;
  }
  const SpeculativeStats& stats = engine->speculative_stats();
  EXPECT_GT(stats.verifies, 0);
  EXPECT_GT(stats.fallbacks, 0) << "random drafts are rejected: some request falls back";
  EXPECT_EQ(stats.requests_in_fallback, 0) << "finished requests leave no fallback state";
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());

  namespace fs = std::filesystem;
  const std::string dir = source_path("models/demo");
  if (!fs::exists(fs::path(dir) / "model.safetensors")) GTEST_SKIP() << "no demo model";
  const std::string reference_file = "tests/data/models/demo-reference.safetensors";
  const auto demo_prompts = load_ints(reference_file, ".input_ids", 8);
  const auto demo_reference = load_ints(reference_file, ".greedy", 8);
  ASSERT_FALSE(demo_prompts.empty());
  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::load(dir, *backend, backend::Precision::kF32);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  // A step-time file in a fresh directory: measured by the first engine, loaded by the second.
  const fs::path table = fs::temp_directory_path() / ("dspark-test-" + std::to_string(::getpid())) / "times.json";
  EngineConfig config = dspark_config(3, table.string(), 0.5, 12);
  config.speculative.dspark.identity = "demo, this test";
  auto demo = Engine::create(std::move(backend), std::move(model).value(), config);
  ASSERT_TRUE(demo.ok()) << demo.status().to_string();
  ASSERT_TRUE(fs::exists(table)) << "the measured step times are written";
  std::vector<SequenceId> demo_ids;
  for (const auto& prompt : demo_prompts) {
    demo_ids.push_back(*(*demo)->submit(prompt, greedy(static_cast<int64_t>(demo_reference[0].size()))));
  }
  Outcome demo_all = drain(**demo);
  for (size_t i = 0; i < demo_ids.size(); ++i) {
    EXPECT_EQ(demo_all.tokens[demo_ids[i]], demo_reference[i]) << "demo prompt_" << i;
  }
  Result<StepTimes> loaded = [&]() -> Result<StepTimes> {
    std::ifstream in(table);
    std::stringstream text;
    text << in.rdbuf();
    return StepTimes::from_json(text.str(), "demo, this test");
  }();
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_FALSE(loaded->verify.empty());
  EXPECT_FALSE(loaded->draft.empty());
  EXPECT_FALSE(loaded->mtp_kv.empty());
  fs::remove_all(table.parent_path());
}


// A DSpark draft module with random weights on the tiny fixture's shapes (its drafts mostly wrong, the Markov head
// adding nothing, confidence 0.5): greedy output is plain decoding's, sampled requests run through the module's draft
// distributions; every block pass drafts at most the block size.
TEST(MtpEngineTest, DsparkModuleKeepsPlainDecodingsTokens) {
  auto config = model::load_model_config(source_path("tests/data/models/tiny-deepseek-v3"));
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  config->dspark = model::DsparkDraftConfig{{0, 2}, 3, 8, 7};
  auto make = [&](const EngineConfig& engine_config) -> std::unique_ptr<Engine> {
    auto backend = backend::make_cpu_backend();
    auto model = model::DeepSeekModel::create_random(*config, *backend, backend::Precision::kF32, 42);
    EXPECT_TRUE(model.ok()) << model.status().to_string();
    if (!model.ok()) return nullptr;
    EXPECT_NE((*model)->dspark_heads(), nullptr);
    auto engine = Engine::create(std::move(backend), std::move(model).value(), engine_config);
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    return engine.ok() ? std::move(engine).value() : nullptr;
  };
  const auto prompts = load_ints(kTinyReference, ".input_ids", 6);
  ASSERT_EQ(prompts.size(), 6u);
  auto plain = make(tiny_config(0));
  auto module = make(dspark_config(5, "const", 0.0, 24));  // chunked prefill; at most 3 drafts (the block size)
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(module, nullptr);
  std::vector<SequenceId> plain_ids, module_ids;
  for (const auto& prompt : prompts) {
    plain_ids.push_back(*plain->submit(prompt, greedy(24)));
    module_ids.push_back(*module->submit(prompt, greedy(24)));
  }
  Outcome expected = drain(*plain), got = drain(*module);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(expected.tokens[plain_ids[i]].size(), 24u);
    EXPECT_EQ(got.tokens[module_ids[i]], expected.tokens[plain_ids[i]]) << "prompt_" << i;
  }
  const SpeculativeStats& stats = module->speculative_stats();
  EXPECT_GT(stats.verifies, 0);
  EXPECT_LE(stats.drafted_by_position.size(), 3u) << "no more drafts than the block has rows";
  const int64_t greedy_verifies = stats.verifies;
  SamplingParams sampled = greedy(12);
  sampled.temperature = 1.0f;
  std::vector<SequenceId> sampled_ids;
  for (int i = 0; i < 8; ++i) {
    sampled.seed = 100 + i;
    sampled_ids.push_back(*module->submit(prompts[static_cast<size_t>(i) % prompts.size()], sampled));
  }
  Outcome sampled_out = drain(*module);
  for (SequenceId id : sampled_ids) {
    ASSERT_EQ(sampled_out.tokens[id].size(), 12u);
    for (TokenId token : sampled_out.tokens[id]) EXPECT_TRUE(token >= 0 && token < config->vocab_size);
  }
  EXPECT_GT(module->speculative_stats().verifies, greedy_verifies) << "sampled requests draft too";
  EXPECT_EQ(module->scheduler().block_pool().num_free(), module->scheduler().block_pool().num_total());
}


// The trained demo module's drafts under sampling (its Markov-corrected distribution as q, every draft made and
// verified): the emitted tokens keep plain sampling's distribution (400 + 400 seeded requests, chi-square per position).
TEST(MtpEngineTest, DsparkModuleSampledTokensHaveThePlainSamplingDistribution) {
  namespace fs = std::filesystem;
  const std::string dir = source_path("models/demo");
  if (!fs::exists(fs::path(dir) / "model.safetensors")) GTEST_SKIP() << "no demo model";
  const auto prompts = load_ints("tests/data/models/demo-reference.safetensors", ".input_ids", 8);
  ASSERT_FALSE(prompts.empty());
  constexpr int kRequests = 400;
  constexpr int kTokens = 4;
  std::vector<std::vector<std::vector<TokenId>>> outputs(2);
  int64_t accepted = 0;
  for (int side = 0; side < 2; ++side) {
    auto backend = backend::make_cpu_backend();
    auto model = model::DeepSeekModel::load(dir, *backend, backend::Precision::kF32);
    ASSERT_TRUE(model.ok()) << model.status().to_string();
    ASSERT_TRUE((*model)->config().dspark.has_value());
    EngineConfig config = side == 1 ? dspark_config(4, "const", 0.0, 4096) : tiny_config(0, 4096);
    config.max_num_seqs = kRequests;
    auto engine = Engine::create(std::move(backend), std::move(model).value(), config);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    std::vector<SequenceId> ids;
    for (int i = 0; i < kRequests; ++i) {
      SamplingParams params;
      params.temperature = 0.8f;
      params.top_k = 8;
      params.max_tokens = kTokens;
      params.ignore_eos = true;
      params.seed = static_cast<uint64_t>(side * kRequests + i);
      ids.push_back(*(*engine)->submit(prompts.back(), params));
    }
    Outcome outcome = drain(**engine);
    for (SequenceId id : ids) outputs[side].push_back(outcome.tokens[id]);
    if (side == 1) accepted = (*engine)->speculative_stats().accepted_tokens;
  }
  EXPECT_GT(accepted, kRequests / 4) << "the test must exercise acceptance: the trained module's drafts are accepted";
  expect_same_distribution(outputs[0], outputs[1], kTokens, "dspark module");
}

}  // namespace
}  // namespace deepinfer::engine
