// The engine end to end on DeepSeek-V4 (tests/data/models/tiny-deepseek-v4-official, reference from DeepSeek's own
// V4 code): the scheduler, the V4 executor and the sampler give the reference's 16 greedy tokens for all 7 prompts
// run together under a small token budget (chunked prefill mixed with decode) and again when a small cache forces
// preemption (recompute from position 0 starts a fresh V4 cache); prefix caching and the host tier reuse V4 block
// payloads with the same tokens; a seeded sampled request gives the same tokens alone and in a batch; what V4 does
// not support yet is refused by name.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/model/safetensors.h"
#include "temp_dir.h"
#include "test_data.h"

namespace deepinfer::engine {
namespace {

const std::string kFixture = "tests/data/models/tiny-deepseek-v4-official";

Result<std::unique_ptr<Engine>> make_v4_engine(const EngineConfig& config) {
  std::unique_ptr<backend::Backend> backend = backend::make_cpu_backend();
  auto model = model::DeepSeekV4Model::load(deepinfer::testing::source_path(kFixture), *backend);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  return Engine::create(std::move(backend), std::move(model).value(), config);
}

EngineConfig v4_config() {
  EngineConfig config;
  config.enable_prefix_caching = false;
  config.kv_cache_bytes = 64ll << 20;
  config.max_num_seqs = 8;
  return config;
}

// kv_cache_bytes for `blocks` blocks of the main pool under `config`: the window rings of max_num_seqs sequences and
// the window pool (sized by the engine from max_num_seqs and max_num_batched_tokens) come first.
int64_t kv_bytes_for_blocks(const EngineConfig& config, int64_t blocks) {
  auto probe = make_v4_engine(config);
  EXPECT_TRUE(probe.ok()) << probe.status().to_string();
  const int64_t block = static_cast<int64_t>((*probe)->block_bytes());
  const int64_t window_pool = static_cast<int64_t>((*probe)->kv_cache_bytes()) - (*probe)->scheduler().config().num_blocks * block;
  const int64_t rings = int64_t{config.max_num_seqs} * 4 * 128 * 64 * 4;  // 4 layers x 128 rows x 64 floats
  return rings + window_pool + blocks * block;
}

struct Reference {
  std::vector<std::vector<int32_t>> prompts, greedy;
};

Reference load_reference() {
  Reference ref;
  auto file = model::Checkpoint::open(deepinfer::testing::source_path(kFixture + "/reference.safetensors"));
  EXPECT_TRUE(file.ok());
  for (int i = 0; i < 7; ++i) {
    for (const char* field : {".input_ids", ".greedy"}) {
      const std::string name = "prompt_" + std::to_string(i) + field;
      auto values = (*file)->load_i64(name, (*file)->find(name)->shape);
      (std::string(field) == ".greedy" ? ref.greedy : ref.prompts).emplace_back(values->begin(), values->end());
    }
  }
  return ref;
}

std::map<SequenceId, std::vector<TokenId>> drain(Engine& engine) {
  std::map<SequenceId, std::vector<TokenId>> tokens;
  for (int steps = 0; engine.has_pending_work(); ++steps) {
    auto events = engine.step();
    EXPECT_TRUE(events.ok()) << events.status().to_string();
    if (!events.ok() || steps > 5000) break;
    for (const TokenEvent& event : *events) {
      if (event.token) tokens[event.id].push_back(*event.token);
    }
  }
  return tokens;
}

SamplingParams greedy_params() {
  SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = 16;
  params.ignore_eos = true;
  return params;
}

TEST(EngineV4Test, AllPromptsTogetherUnderASmallBudgetMatchReferenceGreedy) {
  EngineConfig config = v4_config();
  config.max_num_batched_tokens = 96;  // the 600-token prompt takes 7+ chunked steps while others decode
  auto engine = make_v4_engine(config);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Reference ref = load_reference();
  std::vector<SequenceId> ids;
  for (const auto& prompt : ref.prompts) ids.push_back(*(*engine)->submit(prompt, greedy_params()));
  auto tokens = drain(**engine);
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(tokens[ids[i]], ref.greedy[i]) << "prompt_" << i;
  EXPECT_EQ((*engine)->model_config().model_type, "deepseek_v4");
  EXPECT_EQ((*engine)->scheduler().block_pool().num_free(), (*engine)->scheduler().block_pool().num_total());
}

TEST(EngineV4Test, PreemptionByRecomputeKeepsOutputsExact) {
  EngineConfig config = v4_config();
  config.max_num_batched_tokens = 256;
  config.max_num_seqs = 4;
  // 16 blocks after the window rings and pool: the 600- and 300-token prompts cannot both stay resident.
  config.kv_cache_bytes = kv_bytes_for_blocks(config, 16);
  auto engine = make_v4_engine(config);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  Reference ref = load_reference();
  std::vector<SequenceId> ids;
  for (int i : {4, 5, 6, 3}) ids.push_back(*(*engine)->submit(ref.prompts[i], greedy_params()));
  auto tokens = drain(**engine);
  int index = 0;
  for (int i : {4, 5, 6, 3}) EXPECT_EQ(tokens[ids[index++]], ref.greedy[i]) << "prompt_" << i;
  EXPECT_GT((*engine)->num_preemptions(), 0) << "the scenario must preempt";
}

TEST(EngineV4Test, SeededSamplingIsTheSameAloneAndInABatch) {
  Reference ref = load_reference();
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_p = 0.9f;
  params.seed = 1234;
  params.max_tokens = 12;
  params.ignore_eos = true;
  auto alone = make_v4_engine(v4_config());
  ASSERT_TRUE(alone.ok());
  SequenceId a = *(*alone)->submit(ref.prompts[3], params);
  auto alone_tokens = drain(**alone)[a];
  auto batched = make_v4_engine(v4_config());
  ASSERT_TRUE(batched.ok());
  ASSERT_TRUE((*batched)->submit(ref.prompts[5], greedy_params()).ok());
  SequenceId b = *(*batched)->submit(ref.prompts[3], params);
  ASSERT_TRUE((*batched)->submit(ref.prompts[2], params).ok());
  auto batched_tokens = drain(**batched)[b];
  EXPECT_EQ(alone_tokens.size(), 12u);
  EXPECT_EQ(alone_tokens, batched_tokens);
}

// Prefix caching over V4 block payloads: a repeated prompt and a prompt sharing a prefix reuse the cached blocks
// (restored into a fresh V4 cache) and give the same greedy tokens as without the cache; again after the blocks
// went to the host tier and came back.
TEST(EngineV4Test, PrefixCacheAndHostTierReuseBlocksExactly) {
  Reference ref = load_reference();
  std::vector<int32_t> shared(ref.prompts[6].begin(), ref.prompts[6].begin() + 300);
  shared.insert(shared.end(), ref.prompts[4].begin(), ref.prompts[4].end());  // 300 shared, then other tokens
  auto uncached = make_v4_engine(v4_config());
  ASSERT_TRUE(uncached.ok());
  SequenceId plain = *(*uncached)->submit(shared, greedy_params());
  const std::vector<TokenId> shared_tokens = drain(**uncached)[plain];

  for (bool host_tier : {false, true}) {
    EngineConfig config = v4_config();
    config.enable_prefix_caching = true;
    config.max_num_batched_tokens = 128;
    if (host_tier) {
      // A device cache of 12 blocks (after the window rings and pool): prompt 5 pushes prompt 6's blocks to the
      // host tier.
      auto probe = make_v4_engine(config);
      ASSERT_TRUE(probe.ok());
      config.kv_cache_bytes = kv_bytes_for_blocks(config, 12);
      config.host_cache_bytes = 64 * static_cast<int64_t>((*probe)->block_bytes());
    }
    auto engine = make_v4_engine(config);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    std::map<SequenceId, int64_t> cached;
    auto run = [&](const std::vector<int32_t>& prompt) {
      SequenceId id = *(*engine)->submit(prompt, greedy_params());
      std::vector<TokenId> tokens;
      for (int steps = 0; (*engine)->has_pending_work() && steps < 5000; ++steps) {
        auto events = (*engine)->step();
        EXPECT_TRUE(events.ok()) << events.status().to_string();
        if (!events.ok()) break;
        for (const TokenEvent& event : *events) {
          if (event.token) tokens.push_back(*event.token);
          if (event.finished) cached[event.id] = event.num_cached_tokens;
        }
      }
      (*engine)->flush_kv_tiers();
      return std::make_pair(id, tokens);
    };
    auto [first, first_tokens] = run(ref.prompts[6]);
    EXPECT_EQ(first_tokens, ref.greedy[6]);
    EXPECT_EQ(cached[first], 0);
    if (host_tier) {
      auto [other, other_tokens] = run(ref.prompts[5]);
      EXPECT_EQ(other_tokens, ref.greedy[5]);
    }
    auto [again, again_tokens] = run(ref.prompts[6]);
    EXPECT_EQ(again_tokens, ref.greedy[6]) << (host_tier ? "host tier" : "device");
    EXPECT_EQ(cached[again], 576) << (host_tier ? "host tier" : "device");
    auto [partial, partial_tokens] = run(shared);
    EXPECT_EQ(partial_tokens, shared_tokens);
    EXPECT_EQ(cached[partial], 256);
    if (host_tier) {
      EXPECT_GT((*engine)->kv_tier_stats().completed_loads, 0) << "the blocks came back from the host";
    }
  }
}

// The hybrid cache after a restart from the disk tier: the block payloads come back, the window rows (device only)
// do not. With bounded replay (the default) the prefix is reused whole and its last 128 tokens replayed (an
// approximation: 16 tokens come out, not necessarily the reference's); without, the prefix is recomputed from the
// last point whose window rows are cached (here: from position 0) and the tokens are the reference's.
TEST(EngineV4Test, APrefixWithoutItsWindowRowsIsReplayedOrRecomputed) {
  Reference ref = load_reference();
  deepinfer::testing::TempDir disk("deepinfer-v4-replay");
  EngineConfig config = v4_config();
  config.enable_prefix_caching = true;
  config.max_num_batched_tokens = 256;
  config.host_cache_bytes = 16ll << 20;
  config.disk_cache_path = disk.path().string();
  config.disk_cache_bytes = 64ll << 20;
  config.fingerprint = kvcache::model_fingerprint("tiny-deepseek-v4-official test", "f32");
  {
    auto first = make_v4_engine(config);
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    SequenceId id = *(*first)->submit(ref.prompts[6], greedy_params());
    EXPECT_EQ(drain(**first)[id], ref.greedy[6]);
    (*first)->flush_kv_tiers();
  }
  for (bool replay : {true, false}) {
    config.swa_bounded_replay = replay;
    auto engine = make_v4_engine(config);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    for (int turn = 0; turn < (replay ? 2 : 1); ++turn) {
    SequenceId id = *(*engine)->submit(ref.prompts[6], greedy_params());
    int64_t cached = -1;
    std::vector<TokenId> tokens;
    for (int steps = 0; (*engine)->has_pending_work() && steps < 5000; ++steps) {
      auto events = (*engine)->step();
      ASSERT_TRUE(events.ok()) << events.status().to_string();
      for (const TokenEvent& event : *events) {
        if (event.id != id) continue;
        if (event.token) tokens.push_back(*event.token);
        if (event.finished) cached = event.num_cached_tokens;
      }
    }
    ASSERT_EQ(tokens.size(), 16u);
    if (replay && turn == 0) {
      // 9 whole blocks of 600 tokens matched on the disk tier, of which the last window's 128 tokens were
      // recomputed (replayed): 448 reused.
      EXPECT_EQ(cached, 448);
      EXPECT_EQ((*engine)->num_replayed_tokens(), 128);
    } else if (replay) {
      // The replayed window's rows joined the cache: the same prefix again restores, no second replay (a
      // breaker's finding: every later hit replayed again).
      EXPECT_EQ(cached, 576);
      EXPECT_EQ((*engine)->num_replayed_tokens(), 128);
    } else {
      EXPECT_EQ(cached, 0);
      EXPECT_EQ((*engine)->num_replayed_tokens(), 0);
      EXPECT_EQ(tokens, ref.greedy[6]);
    }
    }
  }
}

TEST(EngineV4Test, RefusesWhatV4DoesNotRunYet) {
  EngineConfig config = v4_config();
  config.speculative.algorithm = SpeculativeAlgorithm::kMtp;
  config.speculative.num_draft_tokens = 2;
  auto engine = make_v4_engine(config);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("speculative decoding"), std::string::npos) << engine.status().to_string();
  config = v4_config();
  config.kv_cache_bytes = 1 << 20;  // less than 8 sequences' window rings
  engine = make_v4_engine(config);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("window rings"), std::string::npos) << engine.status().to_string();

  auto ok = make_v4_engine(v4_config());
  ASSERT_TRUE(ok.ok());
  KvHandoff handoff;
  handoff.import_blocks.push_back(std::vector<std::byte>(16));
  auto refused = (*ok)->submit({1, 2, 3}, greedy_params(), std::move(handoff));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace deepinfer::engine
