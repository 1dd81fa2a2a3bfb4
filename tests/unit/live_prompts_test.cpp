// The live replay's trace -> prompt mapping (bench/replay/live_prompts.h): equal hash ids give equal token
// blocks and distinct ids distinct ones, lengths scale from 512 tokens per trace block to block_tokens and are
// capped, the ideal hit rate of the prompts follows the engine's rule (one token always computed), and the
// --live argument parser.
#include "live_prompts.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "live_replay.h"

namespace deepinfer::bench {
namespace {

TraceRequest request(int64_t input_length, std::vector<int64_t> hash_ids, int64_t output_length = 16) {
  TraceRequest r;
  r.input_length = input_length;
  r.output_length = output_length;
  r.hash_ids = std::move(hash_ids);
  return r;
}

std::vector<int32_t> slice(const std::vector<int32_t>& ids, size_t begin, size_t count) {
  return {ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.begin() + static_cast<std::ptrdiff_t>(begin + count)};
}

TEST(LivePrompts, EqualHashIdsGiveEqualBlocksAtEveryPosition) {
  const LivePromptConfig config;  // 64 tokens per block
  Result<LivePrompt> a = make_live_prompt(request(4 * 512, {0, 1, 2, 3}), config);
  Result<LivePrompt> b = make_live_prompt(request(4 * 512, {0, 1, 2, 9}), config);
  Result<LivePrompt> c = make_live_prompt(request(2 * 512, {7, 2}), config);  // id 2 in another position
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ(a->token_ids.size(), 256u);
  ASSERT_EQ(b->token_ids.size(), 256u);
  for (size_t block = 0; block < 3; ++block) {
    EXPECT_EQ(slice(a->token_ids, block * 64, 64), slice(b->token_ids, block * 64, 64)) << "block " << block;
  }
  EXPECT_NE(slice(a->token_ids, 192, 64), slice(b->token_ids, 192, 64)) << "ids 3 and 9";
  EXPECT_EQ(slice(c->token_ids, 64, 64), slice(a->token_ids, 128, 64)) << "a block's tokens do not depend on where";
  EXPECT_EQ(slice(a->token_ids, 0, 64), live_block_token_ids(0, config));
}

TEST(LivePrompts, DistinctHashIdsGiveDistinctBlocks) {
  const LivePromptConfig config;
  std::set<std::vector<int32_t>> blocks;
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < 3000; ++id) ids.push_back(id);
  // Ids that agree modulo the token range (same first token) and large ids.
  const int64_t range = config.token_id_range;
  for (int64_t id : {range, range + 1, 2 * range, 2 * range + 1, range * range - 1, range * (range - 1)}) {
    ids.push_back(id);
  }
  for (int64_t id : ids) {
    const std::vector<int32_t> block = live_block_token_ids(id, config);
    ASSERT_EQ(block.size(), 64u);
    for (int32_t token : block) {
      ASSERT_GE(token, config.first_token_id) << "id " << id;
      ASSERT_LT(token, config.first_token_id + config.token_id_range) << "id " << id;
    }
    EXPECT_TRUE(blocks.insert(block).second) << "hash id " << id << " repeats another id's block";
  }
  // Two tokens name the block even when the seed makes the rest equal-looking.
  LivePromptConfig two = config;
  two.block_tokens = 2;
  EXPECT_NE(live_block_token_ids(5, two), live_block_token_ids(5 + range, two));
  LivePromptConfig other_seed = config;
  other_seed.seed = 1;
  EXPECT_NE(live_block_token_ids(5, config), live_block_token_ids(5, other_seed));
}

TEST(LivePrompts, ScalesLengthsAndCapsThePrompt) {
  LivePromptConfig config;
  // 512 + 512 + 176 trace tokens -> 64 + 64 + ceil(176 * 64 / 512) = 22 tokens.
  Result<LivePrompt> p = make_live_prompt(request(1200, {4, 5, 6}, 500), config);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->token_ids.size(), 150u);
  EXPECT_EQ(p->uncapped_tokens, 150);
  EXPECT_EQ(slice(p->token_ids, 128, 22), slice(live_block_token_ids(6, config), 0, 22));
  EXPECT_EQ(p->max_tokens, 8) << "500 output tokens scale to 63, capped at 8";
  config.max_tokens = 100;
  EXPECT_EQ(make_live_prompt(request(1200, {4, 5, 6}, 500), config)->max_tokens, 63);
  EXPECT_EQ(make_live_prompt(request(1200, {4, 5, 6}, 0), config)->max_tokens, 1);
  EXPECT_EQ(make_live_prompt(request(1, {4}), config)->token_ids.size(), 1u) << "one trace token is one token";

  config.max_prompt_tokens = 100;  // cut inside block 1
  Result<LivePrompt> capped = make_live_prompt(request(1200, {4, 5, 6}, 500), config);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->token_ids.size(), 100u);
  EXPECT_EQ(capped->uncapped_tokens, 150);
  EXPECT_EQ(capped->token_ids, slice(p->token_ids, 0, 100)) << "the cap keeps the prefix";

  config = LivePromptConfig{};
  config.block_tokens = 16;  // 3 blocks of 16, the last 176 -> ceil(5.5) = 6
  EXPECT_EQ(make_live_prompt(request(1200, {4, 5, 6}), config)->token_ids.size(), 38u);
}

TEST(LivePrompts, RejectsBadConfigAndIds) {
  LivePromptConfig config;
  config.block_tokens = 1;
  EXPECT_FALSE(make_live_prompt(request(512, {0}), config).ok());
  config = LivePromptConfig{};
  config.max_prompt_tokens = 0;
  EXPECT_FALSE(validate_live_prompt_config(config).ok());
  config = LivePromptConfig{};
  EXPECT_FALSE(make_live_prompt(request(512, {-1}), config).ok());
  EXPECT_FALSE(make_live_prompt(request(512, {int64_t{config.token_id_range} * config.token_id_range}), config).ok());
  EXPECT_FALSE(make_live_prompt(request(0, {}), config).ok());
}

// A: ids 0 1 2, B: 0 1 3, C: 0 1 2, D: 0 1 2 4, each 512 trace tokens a block -> 64-token blocks.
TEST(LivePrompts, IdealHitRateFollowsTheEnginesOneTokenRule) {
  const LivePromptConfig config;
  std::vector<LivePrompt> prompts;
  for (const std::vector<int64_t>& ids :
       std::vector<std::vector<int64_t>>{{0, 1, 2}, {0, 1, 3}, {0, 1, 2}, {0, 1, 2, 4}}) {
    prompts.push_back(*make_live_prompt(request(512 * static_cast<int64_t>(ids.size()), ids), config));
  }
  std::vector<int64_t> reusable;
  const HitRates rates = ideal_prompt_hit_rates(prompts, 64, &reusable);
  // A: nothing before it. B: blocks 0, 1. C: all three seen, but (192 - 1) / 64 = 2 may be reused. D: 0, 1, 2.
  EXPECT_EQ(reusable, (std::vector<int64_t>{0, 128, 128, 192}));
  EXPECT_NEAR(rates.token_hit_rate, 448.0 / 832.0, 1e-12);
  EXPECT_NEAR(rates.block_hit_rate, 7.0 / 13.0, 1e-12);
}

TEST(LivePrompts, ConversationTraceSliceFitsTheDemoModel) {
  Result<Trace> trace =
      load_mooncake_trace(std::string(DEEPINFER_SOURCE_DIR) + "/tests/data/traces/mooncake/conversation_trace.jsonl");
  ASSERT_TRUE(trace.ok()) << trace.status().to_string();
  const LivePromptConfig config;
  Result<std::vector<LivePrompt>> prompts = make_live_prompts(*trace, 200, config);
  ASSERT_TRUE(prompts.ok()) << prompts.status().to_string();
  ASSERT_EQ(prompts->size(), 200u);
  for (size_t i = 0; i < prompts->size(); ++i) {
    const LivePrompt& p = (*prompts)[i];
    EXPECT_LE(static_cast<int64_t>(p.token_ids.size()) + p.max_tokens, 1024) << "request " << i;
    EXPECT_EQ(p.timestamp_ms, trace->requests[i].timestamp_ms) << "request " << i;
  }
  const HitRates rates = ideal_prompt_hit_rates(*prompts, 64);
  EXPECT_GT(rates.token_hit_rate, 0.05);
  EXPECT_LT(rates.token_hit_rate, 0.5);
}

TEST(LiveReplayArgs, ParsesAndRejects) {
  const std::vector<std::string> good = {
      "--live", "http://127.0.0.1:8001", "--trace", "t.jsonl",      "--requests", "50", "--block-tokens",
      "32",     "--concurrency",         "4",       "--time-scale", "10"};
  Result<LiveReplayOptions> options = parse_live_replay_args(good);
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  EXPECT_EQ(options->requests, 50);
  EXPECT_EQ(options->prompts.block_tokens, 32);
  EXPECT_EQ(options->concurrency, 4);
  ASSERT_TRUE(options->time_scale.has_value());
  EXPECT_EQ(*options->time_scale, 10.0);
  for (const std::vector<std::string>& bad :
       std::vector<std::vector<std::string>>{{"--trace", "t.jsonl"},
                                             {"--live", "http://x:1"},
                                             {"--live", "http://x:1", "--trace", "t", "--block-tokens", "1"},
                                             {"--live", "http://x:1", "--trace", "t", "--time-scale", "0"},
                                             {"--live", "http://x:1", "--trace", "t", "--concurrency", "0"},
                                             {"--live", "http://x:1", "--trace", "t", "--requests", "2.5"},
                                             {"--live", "http://x:1", "--trace", "t", "--bogus", "1"}}) {
    EXPECT_FALSE(parse_live_replay_args(bad).ok()) << bad.back();
  }
}

}  // namespace
}  // namespace deepinfer::bench
