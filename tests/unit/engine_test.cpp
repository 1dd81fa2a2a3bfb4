// The engine end to end on the tiny DeepSeek-V3 fixture: scheduler + forward + sampler give the reference's
// greedy tokens for all 7 prompts run together under a small token budget (chunked prefill mixed with
// decode), and again when a small KV cache forces preemption; cancellation frees everything; a seeded
// sampled request gives the same tokens alone and in a batch. Data parallel's lock step: empty passes when idle, an
// engine client in a (scripted) step group steps when the group has work and ends its requests when the group fails.
#include <condition_variable>
#include <cstring>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "deepinfer/engine/engine.h"
#include "deepinfer/engine/engine_client.h"
#include "deepinfer/model/safetensors.h"
#include "fixture_engine.h"
#include "test_data.h"

namespace deepinfer::engine {
namespace {

const std::string kFixture = "tests/data/models/tiny-deepseek-v3";

std::unique_ptr<Engine> make_engine(const EngineConfig& config) { return deepinfer::testing::make_fixture_engine(config); }

struct Reference {
  std::vector<std::vector<int32_t>> prompts, greedy;
};

Reference load_reference() {
  Reference ref;
  auto file = model::SafetensorsFile::open(deepinfer::testing::source_path(kFixture + "/reference.safetensors"));
  EXPECT_TRUE(file.ok());
  for (int i = 0; i < 7; ++i) {
    for (const char* field : {".input_ids", ".greedy"}) {
      const model::TensorView* view = (*file)->find("prompt_" + std::to_string(i) + field);
      std::vector<int32_t> values(static_cast<size_t>(view->numel()));
      std::memcpy(values.data(), view->data, view->size_bytes);
      (std::string(field) == ".greedy" ? ref.greedy : ref.prompts).push_back(values);
    }
  }
  return ref;
}

// Runs the engine until idle; returns tokens and finish reasons per request.
struct Outcome {
  std::map<SequenceId, std::vector<TokenId>> tokens;
  std::map<SequenceId, FinishReason> reasons;
  std::map<SequenceId, int64_t> cached_tokens;  // from the finish events
  int steps = 0;
};

Outcome drain(Engine& engine, std::map<int, SequenceId> cancel_at_step = {}) {
  Outcome outcome;
  while (engine.has_pending_work()) {
    if (auto it = cancel_at_step.find(outcome.steps); it != cancel_at_step.end()) {
      EXPECT_TRUE(engine.cancel(it->second).ok());
    }
    auto events = engine.step();
    EXPECT_TRUE(events.ok()) << events.status().to_string();
    if (!events.ok()) break;
    for (const TokenEvent& event : *events) {
      if (event.token) outcome.tokens[event.id].push_back(*event.token);
      if (event.finished) {
        outcome.reasons[event.id] = event.finish_reason;
        outcome.cached_tokens[event.id] = event.num_cached_tokens;
      }
    }
    if (++outcome.steps > 10000) {
      ADD_FAILURE() << "engine did not drain";
      break;
    }
  }
  return outcome;
}

SamplingParams greedy_params() {
  SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = 16;
  params.ignore_eos = true;  // the reference decodes 16 tokens with no EOS stop
  return params;
}

TEST(EngineTest, AllPromptsTogetherUnderASmallBudgetMatchReferenceGreedy) {
  EngineConfig config;
  config.max_num_batched_tokens = 96;  // the 600-token prompt takes 7+ chunked steps while others decode
  config.kv_cache_bytes = 64ll << 20;
  auto engine = make_engine(config);
  Reference ref = load_reference();
  std::vector<SequenceId> ids;
  for (const auto& prompt : ref.prompts) ids.push_back(*engine->submit(prompt, greedy_params()));
  Outcome outcome = drain(*engine);
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(outcome.tokens[ids[i]], ref.greedy[i]) << "prompt_" << i;
    EXPECT_EQ(outcome.reasons[ids[i]], FinishReason::kLength) << "prompt_" << i;
  }
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());
}

TEST(EngineTest, PreemptionByRecomputeKeepsOutputsExact) {
  EngineConfig config;
  config.max_num_batched_tokens = 256;
  // 16 blocks of 64 tokens: the 600- and 300-token prompts cannot both stay resident.
  const int64_t block_bytes = 64 * 3 * (64 + 16) * sizeof(float);
  config.kv_cache_bytes = 16 * block_bytes;
  auto engine = make_engine(config);
  Reference ref = load_reference();
  std::vector<SequenceId> ids;
  for (int i : {4, 5, 6, 3}) ids.push_back(*engine->submit(ref.prompts[i], greedy_params()));
  Outcome outcome = drain(*engine);
  int index = 0;
  for (int i : {4, 5, 6, 3}) {
    EXPECT_EQ(outcome.tokens[ids[index]], ref.greedy[i]) << "prompt_" << i;
    ++index;
  }
  EXPECT_GT(engine->num_preemptions(), 0) << "the scenario must preempt";
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());
}

TEST(EngineTest, CancellationFreesBlocksAtAnyPoint) {
  EngineConfig config;
  config.max_num_batched_tokens = 64;
  config.kv_cache_bytes = 64ll << 20;
  auto engine = make_engine(config);
  Reference ref = load_reference();
  SequenceId waiting = *engine->submit(ref.prompts[6], greedy_params());
  SequenceId prefilling = *engine->submit(ref.prompts[5], greedy_params());
  SequenceId decoding = *engine->submit(ref.prompts[1], greedy_params());
  SequenceId untouched = *engine->submit(ref.prompts[2], greedy_params());
  Outcome outcome = drain(*engine, {{0, waiting}, {3, prefilling}, {12, decoding}});
  EXPECT_EQ(outcome.reasons[waiting], FinishReason::kCancelled);
  EXPECT_EQ(outcome.reasons[prefilling], FinishReason::kCancelled);
  EXPECT_EQ(outcome.reasons[decoding], FinishReason::kCancelled);
  EXPECT_EQ(outcome.tokens[untouched], ref.greedy[2]);
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());
}

TEST(EngineTest, SeededSamplingIsTheSameAloneAndInABatch) {
  EngineConfig config;
  config.kv_cache_bytes = 64ll << 20;
  Reference ref = load_reference();
  SamplingParams params;
  params.temperature = 0.8f;
  params.top_p = 0.9f;
  params.seed = 1234;
  params.max_tokens = 12;
  params.ignore_eos = true;
  auto alone = make_engine(config);
  SequenceId id = *alone->submit(ref.prompts[3], params);
  std::vector<TokenId> tokens_alone = drain(*alone).tokens[id];
  auto batched = make_engine(config);
  for (int i : {0, 5, 2}) ASSERT_TRUE(batched->submit(ref.prompts[i], greedy_params()).ok());
  SequenceId id_in_batch = *batched->submit(ref.prompts[3], params);
  ASSERT_TRUE(batched->submit(ref.prompts[4], params).ok());  // same seed, other prompt
  EXPECT_EQ(drain(*batched).tokens[id_in_batch], tokens_alone);
  EXPECT_EQ(tokens_alone.size(), 12u);
}

// A step's rows sampled on 4 threads (one Sampler each) give the very tokens one thread gives: every request draws
// from its own seeded stream, whichever thread samples its row.
TEST(EngineTest, SampledStepsGiveTheSameTokensOnOneOrFourThreads) {
  Reference ref = load_reference();
  std::map<SequenceId, std::vector<TokenId>> by_threads[2];
  for (int run = 0; run < 2; ++run) {
    EngineConfig config;
    config.kv_cache_bytes = 64ll << 20;
    config.sampling_threads = run == 0 ? 1 : 4;
    config.parallel_sampling_min_logits = 0;  // split even this small vocabulary
    auto engine = make_engine(config);
    for (int i = 0; i < 7; ++i) {
      SamplingParams params;
      params.temperature = 0.9f;
      params.top_p = 0.95f;
      params.top_k = i % 2 == 0 ? -1 : 40;
      params.seed = 100 + static_cast<uint64_t>(i);
      params.max_tokens = 10;
      params.ignore_eos = true;
      ASSERT_TRUE(engine->submit(ref.prompts[static_cast<size_t>(i)], params).ok());
    }
    by_threads[run] = drain(*engine).tokens;
  }
  ASSERT_EQ(by_threads[0].size(), 7u);
  for (const auto& [id, tokens] : by_threads[0]) {
    EXPECT_EQ(tokens.size(), 10u);
    EXPECT_EQ(by_threads[1][id], tokens) << "request " << id;
  }
}

TEST(EngineTest, MultiTurnReusesThePrefixCacheExactly) {
  // Turn 1: prompt_5 (300 tokens) and 16 greedy tokens. Turn 2: turn 1's prompt + its output + 5 more tokens.
  // Turn 2 on the same engine reuses the 4 full blocks turn 1 computed (300 prompt + 15 decoded tokens of KV:
  // 256 tokens) and must give the same tokens as on a fresh engine with prefix caching off.
  EngineConfig config;
  config.max_num_batched_tokens = 256;
  config.kv_cache_bytes = 64ll << 20;
  Reference ref = load_reference();
  auto engine = make_engine(config);
  SequenceId first = *engine->submit(ref.prompts[5], greedy_params());
  Outcome turn1 = drain(*engine);
  ASSERT_EQ(turn1.tokens[first], ref.greedy[5]);
  EXPECT_EQ(turn1.cached_tokens[first], 0);
  ASSERT_GE(ref.prompts[2].size(), 5u);
  std::vector<TokenId> prompt2 = ref.prompts[5];
  prompt2.insert(prompt2.end(), turn1.tokens[first].begin(), turn1.tokens[first].end());
  prompt2.insert(prompt2.end(), ref.prompts[2].begin(), ref.prompts[2].begin() + 5);
  SequenceId second = *engine->submit(prompt2, greedy_params());
  Outcome turn2 = drain(*engine);
  EXPECT_EQ(turn2.cached_tokens[second], 256);
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());

  EngineConfig uncached_config = config;
  uncached_config.enable_prefix_caching = false;
  auto uncached = make_engine(uncached_config);
  SequenceId fresh = *uncached->submit(prompt2, greedy_params());
  Outcome reference = drain(*uncached);
  EXPECT_EQ(reference.cached_tokens[fresh], 0);
  ASSERT_EQ(reference.tokens[fresh].size(), 16u);
  EXPECT_EQ(turn2.tokens[second], reference.tokens[fresh]);
}

TEST(EngineTest, AllPromptsTwiceOnOneEngineMatchReferenceGreedy) {
  EngineConfig config;
  config.max_num_batched_tokens = 96;
  config.kv_cache_bytes = 64ll << 20;
  auto engine = make_engine(config);
  Reference ref = load_reference();
  int64_t cached_second_run = 0;
  for (int run = 0; run < 2; ++run) {
    std::vector<SequenceId> ids;
    for (const auto& prompt : ref.prompts) ids.push_back(*engine->submit(prompt, greedy_params()));
    Outcome outcome = drain(*engine);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(outcome.tokens[ids[i]], ref.greedy[i]) << "run " << run << ", prompt_" << i;
      if (run == 1) {
        EXPECT_EQ(outcome.cached_tokens[ids[i]],
                  (static_cast<int64_t>(ref.prompts[i].size()) - 1) / kvcache::kBlockTokens * kvcache::kBlockTokens)
            << "prompt_" << i;
        cached_second_run += outcome.cached_tokens[ids[i]];
      }
    }
  }
  EXPECT_GT(cached_second_run, 0);
  std::cout << "[ cached ] second run: " << cached_second_run << " prompt tokens from the prefix cache\n";
  EXPECT_EQ(engine->scheduler().block_pool().num_free(), engine->scheduler().block_pool().num_total());
}

TEST(EngineTest, BadRequestsAreRejectedWithAReason) {
  EngineConfig config;
  config.kv_cache_bytes = 8ll << 20;
  auto engine = make_engine(config);
  SamplingParams params = greedy_params();
  EXPECT_FALSE(engine->submit({}, params).ok());
  auto out_of_vocab = engine->submit({5, 4096}, params);
  ASSERT_FALSE(out_of_vocab.ok());
  EXPECT_NE(out_of_vocab.status().message().find("4096"), std::string::npos);
  params.top_p = 0.0f;
  EXPECT_FALSE(engine->submit({5, 6}, params).ok());
  EXPECT_FALSE(engine->submit(std::vector<TokenId>(2000, 5), greedy_params()).ok());  // past max_model_len 1024
}

// Data parallel's lock step (engine::StepGroup, Engine::set_lockstep): a step with nothing scheduled runs an empty
// pass instead of none, and changes no request's tokens.
TEST(EngineTest, LockStepRunsEmptyPassesAndKeepsOutputsExact) {
  EngineConfig config;
  config.kv_cache_bytes = 16ll << 20;
  auto engine = make_engine(config);
  ASSERT_TRUE(engine->set_lockstep(true).ok());
  auto idle = engine->step();  // nothing submitted: one empty pass
  ASSERT_TRUE(idle.ok()) << idle.status().to_string();
  EXPECT_TRUE(idle->empty());
  Reference ref = load_reference();
  const SequenceId id = *engine->submit(ref.prompts[0], greedy_params());
  Outcome outcome = drain(*engine);
  EXPECT_EQ(outcome.tokens[id], ref.greedy[0]);
  // Speculative decoding in lock step: the verify is the step's one target pass (an idle step still makes one); the
  // draft passes are this engine's own. Greedy output stays plain decoding's.
  auto demo = [&](const EngineConfig& engine_config) {
    auto backend = backend::make_cpu_backend();
    auto model = model::DeepSeekModel::load(deepinfer::testing::source_path("models/demo"), *backend,
                                            backend::Precision::kF32);
    EXPECT_TRUE(model.ok()) << model.status().to_string();
    return Engine::create(std::move(backend), std::move(model).value(), engine_config);
  };
  EngineConfig speculative = config;
  speculative.speculative.algorithm = SpeculativeAlgorithm::kMtp;
  speculative.speculative.num_draft_tokens = 2;
  auto drafting = demo(speculative);
  ASSERT_TRUE(drafting.ok()) << drafting.status().to_string();
  ASSERT_TRUE((*drafting)->set_lockstep(true).ok());
  auto idle_draft = (*drafting)->step();
  ASSERT_TRUE(idle_draft.ok()) << idle_draft.status().to_string();
  EXPECT_TRUE(idle_draft->empty());
  auto plain = demo(config);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  const std::vector<TokenId> prompt = {0, 1001, 4117, 344, 15390, 33, 2000};
  const SequenceId want_id = *(*plain)->submit(prompt, greedy_params());
  const SequenceId got_id = *(*drafting)->submit(prompt, greedy_params());
  Outcome want = drain(**plain), got = drain(**drafting);
  EXPECT_FALSE(want.tokens[want_id].empty());
  EXPECT_EQ(got.tokens[got_id], want.tokens[want_id]);
  EXPECT_GT((*drafting)->speculative_stats().draft_tokens, 0);
}

// A group double: answers whether any engine has work as told, records what this engine said.
class ScriptedGroup final : public StepGroup {
 public:
  explicit ScriptedGroup(int busy_answers, bool fail = false) : busy_answers_(busy_answers), fail_(fail) {}
  Result<bool> any_pending(bool mine) override {
    std::lock_guard lock(mu_);
    saw_mine_ = saw_mine_ || mine;
    ++calls_;
    // Failing: at the first question asked with work here (asked before the request arrived, a failure would leave
    // the engine alone and the request would run; seen in CI).
    if (fail_ && mine)
      return Status::shutting_down("the server is stopping: its data-parallel group failed (scripted)");
    if (fail_) return false;
    if (busy_answers_ > 0) {  // another rank has work: this one steps (empty passes) even when idle
      --busy_answers_;
      return true;
    }
    return mine;
  }
  bool saw_mine() const {
    std::lock_guard lock(mu_);
    return saw_mine_;
  }
  int calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }

 private:
  mutable std::mutex mu_;
  int busy_answers_;
  bool fail_;
  bool saw_mine_ = false;
  int calls_ = 0;
};

// Collects one request's events.
class Collect final : public EventSink {
 public:
  void deliver(std::vector<GenerationEvent> events) override {
    std::lock_guard lock(mu_);
    for (GenerationEvent& e : events) {
      if (e.event.token) tokens_.push_back(*e.event.token);
      if (!e.error.ok()) error_ = e.error;
      if (e.event.finished) done_.set_value();
    }
  }
  std::future<void> done() { return done_.get_future(); }
  std::vector<TokenId> tokens() {
    std::lock_guard lock(mu_);
    return tokens_;
  }
  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::vector<TokenId> tokens_;
  Status error_;
  std::promise<void> done_;
};

TEST(EngineTest, AnEngineInAStepGroupStepsWhenTheGroupHasWork) {
  EngineConfig config;
  config.kv_cache_bytes = 16ll << 20;
  ScriptedGroup group(/*busy_answers=*/50);  // the "other rank" is busy for 50 iterations first
  auto client = make_in_process_client(make_engine(config), &group);
  Reference ref = load_reference();
  auto sink = std::make_shared<Collect>();
  auto done = sink->done();
  client->submit(ref.prompts[1], greedy_params(), sink);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_TRUE(sink->error().ok()) << sink->error().to_string();
  EXPECT_EQ(sink->tokens(), ref.greedy[1]);
  EXPECT_TRUE(group.saw_mine());
  EXPECT_GE(group.calls(), 17);  // at least one question per step
  client->stop();
}

TEST(EngineTest, AFailedStepGroupEndsTheRequestsWithItsError) {
  EngineConfig config;
  config.kv_cache_bytes = 16ll << 20;
  ScriptedGroup group(0, /*fail=*/true);
  auto client = make_in_process_client(make_engine(config), &group);
  auto sink = std::make_shared<Collect>();
  auto done = sink->done();
  client->submit(load_reference().prompts[0], greedy_params(), sink);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_EQ(sink->error().code(), StatusCode::kShuttingDown);
  EXPECT_NE(sink->error().message().find("data-parallel group failed"), std::string::npos);
  EXPECT_TRUE(sink->tokens().empty());
  client->stop();
}

}  // namespace
}  // namespace deepinfer::engine
