// Multi-token steps: the scheduler gives a running sequence lookahead slots, a scripted executor "drafts"
// into them and accepts 0, 1 and 3 drafts in turn (then a stop token among accepted drafts), and update()
// must keep exactly the accepted tokens, roll back the rejected drafts' blocks, and index only blocks of
// verified tokens. The executor records the KV it "wrote" per position, so a rolled-back position that was
// kept (or a kept position written with a rejected draft) shows. Every failure names the step.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/scheduler.h"
#include "deepinfer/kvcache/block_hash.h"

namespace deepinfer::engine {
namespace {

using kvcache::kBlockTokens;

constexpr TokenId kStop = 7;
constexpr TokenId kRejected = 999999;  // what a rejected draft position holds

// Per step, how many drafts the executor accepts (of the lookahead slots it got) and the tokens it returns:
// accepted drafts, then the token sampled after them.
struct ScriptedStep {
  std::vector<TokenId> tokens;
};

class ScriptedExecutor final : public Executor {
 public:
  explicit ScriptedExecutor(std::vector<ScriptedStep> script) : script_(std::move(script)) {}
  Status add_request(SequenceId, std::span<const TokenId>, const SamplingParams&) override { return Status(); }
  void remove_request(SequenceId) override {}
  Result<StepOutput> run(const ScheduledBatch& batch) override {
    StepOutput out;
    out.entries.resize(batch.entries.size());
    const ScriptedStep& step = script_.at(next_++);
    for (size_t i = 0; i < batch.entries.size(); ++i) {
      const ScheduledEntry& entry = batch.entries[i];
      std::map<int64_t, TokenId>& kv = kv_[entry.sequence_id];
      for (int64_t p = 0; p < entry.num_tokens(); ++p) kv[entry.start_position + p] = entry.token_ids[p];
      if (!entry.samples) continue;
      // Drafts: the accepted ones are the tokens returned; the rest are rejected (a token nobody samples).
      const size_t accepted = step.tokens.size() - 1;
      for (int64_t d = 0; d < entry.num_lookahead_slots; ++d) {
        kv[entry.end_position() + d] = static_cast<size_t>(d) < accepted ? step.tokens[d] : kRejected;
      }
      for (TokenId token : step.tokens) out.entries[i].push_back({token, std::nullopt, {}});
    }
    return out;
  }
  const std::map<int64_t, TokenId>& kv(SequenceId id) { return kv_[id]; }

 private:
  std::vector<ScriptedStep> script_;
  size_t next_ = 0;
  std::map<SequenceId, std::map<int64_t, TokenId>> kv_;
};

struct Expected {
  int32_t lookahead_slots;        // of the sequence's entry in this step
  std::vector<TokenId> returned;  // the executor's tokens
  size_t kept;                    // tokens update() keeps
  int64_t computed;               // num_computed_tokens after update
  size_t blocks;                  // block table size after update
  int64_t cached_blocks;          // blocks in the prefix index after update
  bool finished;
};

TEST(MultiTokenStepTest, ScriptedExecutorAcceptsZeroOneAndThreeDraftsThenAStopToken) {
  SchedulerConfig config;
  config.max_num_batched_tokens = 256;
  config.max_num_seqs = 4;
  config.num_blocks = 8;
  config.num_lookahead_slots = 3;
  config.fingerprint = kvcache::model_fingerprint("multi-token-step-test", "");
  Result<Scheduler> created = Scheduler::create(config);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Scheduler& scheduler = *created;
  SequenceRequest request;
  request.id = 1;
  for (int i = 0; i < 62; ++i) request.prompt_token_ids.push_back(1000 + i);
  request.max_tokens = 20;
  request.stop_token_ids = {kStop};
  ASSERT_TRUE(scheduler.add(request).ok());

  const std::vector<Expected> steps = {
      // 1: prefill of 62 tokens (admission: no lookahead) -> 1 token.
      {0, {500}, 1, 62, 1, 0, false},
      // 2: decode at 62, 3 slots (positions 63..65, a second block); 0 drafts accepted: back to one block.
      {3, {501}, 1, 63, 1, 0, false},
      // 3: decode at 63, 3 slots; 1 accepted: positions 0..64 computed, block 0 (0..63) full and indexed.
      {3, {502, 503}, 2, 65, 2, 1, false},
      // 4: decode at 65, 3 slots; all 3 accepted: 0..68 computed.
      {3, {504, 505, 506, 507}, 4, 69, 2, 1, false},
      // 5: decode at 69, 3 slots; a stop token among the accepted drafts: kept through it, then finished.
      {3, {508, kStop, 509, 510}, 2, 0, 0, 1, true},
  };
  ScriptedExecutor executor([&] {
    std::vector<ScriptedStep> script;
    for (const Expected& e : steps) script.push_back({e.returned});
    return script;
  }());
  std::vector<TokenId> expected_generated;
  for (size_t s = 0; s < steps.size(); ++s) {
    const Expected& e = steps[s];
    SCOPED_TRACE("step " + std::to_string(s + 1));
    ScheduledBatch batch = scheduler.schedule();
    ASSERT_EQ(batch.entries.size(), 1u);
    EXPECT_EQ(batch.entries[0].num_lookahead_slots, e.lookahead_slots);
    EXPECT_GE(static_cast<int64_t>(batch.entries[0].block_table.size()) * kBlockTokens,
              batch.entries[0].end_position() + batch.entries[0].num_lookahead_slots)
        << "the block table covers the lookahead slots";
    Result<StepOutput> out = executor.run(batch);
    ASSERT_TRUE(out.ok());
    ASSERT_TRUE(scheduler.update(batch, *out).ok());
    ASSERT_EQ(out->entries[0].size(), e.kept) << "update() trims the output to the kept tokens";
    for (size_t k = 0; k < e.kept; ++k) expected_generated.push_back(e.returned[k]);
    const SequenceState* seq = scheduler.find(1);
    ASSERT_NE(seq, nullptr);
    EXPECT_EQ(seq->generated_token_ids, expected_generated);
    EXPECT_EQ(seq->is_finished(), e.finished);
    EXPECT_EQ(seq->num_computed_tokens, e.finished ? seq->num_computed_tokens : e.computed);
    EXPECT_EQ(seq->block_table.size(), e.blocks);
    EXPECT_EQ(scheduler.num_cached_blocks(), e.cached_blocks);
    EXPECT_EQ(scheduler.block_pool().num_used(), static_cast<int32_t>(e.blocks)) << "no block leaked";
    if (!e.finished) {
      // Every computed position holds the KV of the sequence's token there: no rejected draft survived.
      const std::map<int64_t, TokenId>& kv = executor.kv(1);
      for (int64_t p = 0; p < seq->num_computed_tokens; ++p) {
        ASSERT_TRUE(kv.contains(p)) << "position " << p;
        EXPECT_EQ(kv.at(p), seq->token_at(p)) << "position " << p;
      }
    }
    // The index holds exactly the full blocks of verified tokens.
    std::vector<TokenId> verified(request.prompt_token_ids);
    verified.insert(verified.end(), expected_generated.begin(), expected_generated.end());
    const std::vector<kvcache::BlockHash> chain = kvcache::block_hash_chain(verified, config.fingerprint);
    for (int64_t b = 0; b < e.cached_blocks; ++b) {
      EXPECT_TRUE(scheduler.cached_block(chain[static_cast<size_t>(b)]).has_value()) << "block " << b;
    }
  }
  ScheduledBatch last = scheduler.schedule();
  ASSERT_EQ(last.finished.size(), 1u);
  EXPECT_EQ(last.finished[0].reason, FinishReason::kStop);
  EXPECT_EQ(last.finished[0].num_generated_tokens, 10);
  EXPECT_EQ(scheduler.block_pool().num_used(), 0);
}

TEST(MultiTokenStepTest, OutputsThatDoNotFitTheBatchAreRefusedAndChangeNothing) {
  SchedulerConfig config;
  config.num_blocks = 4;
  config.num_lookahead_slots = 2;
  Result<Scheduler> created = Scheduler::create(config);
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  SequenceRequest request;
  request.id = 1;
  request.prompt_token_ids = {1, 2, 3};
  request.max_tokens = 10;
  ASSERT_TRUE(scheduler.add(request).ok());
  ScheduledBatch prefill = scheduler.schedule();
  ASSERT_TRUE(scheduler.update(prefill, std::vector<TokenId>{11}).ok());
  ScheduledBatch decode = scheduler.schedule();
  ASSERT_EQ(decode.entries.at(0).num_lookahead_slots, 2);
  StepOutput too_many;
  too_many.entries = {{{21, {}, {}}, {22, {}, {}}, {23, {}, {}}, {24, {}, {}}}};  // 4 > 1 + 2
  EXPECT_EQ(scheduler.update(decode, too_many).code(), StatusCode::kInvalidArgument);
  StepOutput none;
  none.entries = {{}};
  EXPECT_EQ(scheduler.update(decode, none).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler.find(1)->generated_token_ids, std::vector<TokenId>{11}) << "nothing changed";
  StepOutput fits;
  fits.entries = {{{21, {}, {}}, {22, {}, {}}, {23, {}, {}}}};
  EXPECT_TRUE(scheduler.update(decode, fits).ok());
  EXPECT_EQ(scheduler.find(1)->generated_token_ids, (std::vector<TokenId>{11, 21, 22, 23}));
  EXPECT_EQ(scheduler.find(1)->num_computed_tokens, 6);
}

}  // namespace
}  // namespace deepinfer::engine
