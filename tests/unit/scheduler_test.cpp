// Scheduler: scenarios run step by step against a table of expected states (in the manner of TensorRT-LLM's
// capacitySchedulerTest), with a scripted "model" that returns a token for every sampling entry. Every step
// also checks invariants no table states: entries' tokens and positions against an independent record of
// each sequence, block tables sized for what is scheduled, no block owned twice, no block leaked.
#include "deepinfer/engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace deepinfer::engine {
namespace {

using kvcache::blocks_for_tokens;
using kvcache::kBlockTokens;

// Prompt tokens encode (sequence, position), so a mix-up between sequences or positions shows.
SequenceRequest request(SequenceId id, int prompt_tokens, int64_t max_tokens, std::vector<TokenId> stop = {}) {
  SequenceRequest r;
  r.id = id;
  for (int i = 0; i < prompt_tokens; ++i) r.prompt_token_ids.push_back(static_cast<TokenId>(100000 * id + i));
  r.max_tokens = max_tokens;
  r.stop_token_ids = std::move(stop);
  return r;
}

// The scripted model's default sample; never a stop token of these tests (those are < 100).
TokenId default_sample(int step, SequenceId id) { return static_cast<TokenId>(1000 + 10 * step + id); }

struct Arrival {
  int step;  // added before schedule() of this step
  SequenceRequest request;
};

struct Cancellation {
  int step;
  SequenceId id;
  bool between_schedule_and_update = false;  // else before schedule()
};

struct ScriptedSample {
  int step;
  SequenceId id;
  TokenId token;
};

using Scheduled = std::pair<SequenceId, int64_t>;  // sequence, tokens computed this step
using Finished = std::pair<SequenceId, FinishReason>;

// The state right after schedule() of a step.
struct ExpectedStep {
  std::vector<Scheduled> scheduled = {};  // batch entries in order
  std::vector<SequenceId> running = {};
  std::vector<SequenceId> waiting = {};
  std::vector<SequenceId> preempted = {};
  std::vector<Finished> finished = {};
  int32_t free_blocks = 0;
};

struct Scenario {
  std::string name = {};
  SchedulerConfig config = {};
  std::vector<Arrival> arrivals = {};
  std::vector<Cancellation> cancellations = {};
  std::vector<ScriptedSample> script = {};
  std::vector<ExpectedStep> steps = {};  // steps 1, 2, ...; after the last one nothing may be left
};

std::string describe(const std::vector<Finished>& finished) {
  std::string out;
  for (const auto& [id, reason] : finished) {
    out += std::to_string(id) + ":" + std::string(finish_reason_name(reason)) + " ";
  }
  return out;
}

void check_invariants(const Scheduler& scheduler, const ScheduledBatch& batch,
                      const std::map<SequenceId, std::vector<TokenId>>& expected_tokens, const std::string& where) {
  std::map<SequenceId, const ScheduledEntry*> entry_of;
  for (const ScheduledEntry& entry : batch.entries) {
    EXPECT_TRUE(entry_of.emplace(entry.sequence_id, &entry).second) << where << ": sequence scheduled twice";
    const SequenceState* seq = scheduler.find(entry.sequence_id);
    ASSERT_NE(seq, nullptr) << where << ": entry for unknown sequence " << entry.sequence_id;
    EXPECT_EQ(seq->status, SequenceStatus::kRunning) << where << ", sequence " << seq->id;
    EXPECT_EQ(entry.start_position, seq->num_computed_tokens) << where << ", sequence " << seq->id;
    EXPECT_GE(entry.num_tokens(), 1) << where << ", sequence " << seq->id;
    const std::vector<TokenId>& tokens = expected_tokens.at(entry.sequence_id);
    ASSERT_LE(entry.end_position(), static_cast<int64_t>(tokens.size())) << where << ", sequence " << seq->id;
    std::vector<TokenId> want(tokens.begin() + entry.start_position, tokens.begin() + entry.end_position());
    EXPECT_EQ(entry.token_ids, want) << where << ": tokens of sequence " << seq->id;
    EXPECT_EQ(entry.samples, entry.end_position() == static_cast<int64_t>(tokens.size()))
        << where << ": samples flag of sequence " << seq->id;
    EXPECT_EQ(entry.block_table, seq->block_table) << where << ", sequence " << seq->id;
    EXPECT_EQ(static_cast<int64_t>(entry.block_table.size()), blocks_for_tokens(entry.end_position()))
        << where << ": block table size of sequence " << seq->id;
  }
  // A block is owned once per block table holding it (prefix caching shares full prompt blocks between
  // sequences, never within one); its reference count is its number of owners.
  std::map<kvcache::BlockId, int32_t> owners;
  for (SequenceId id : scheduler.running_ids()) {
    const SequenceState* seq = scheduler.find(id);
    ASSERT_NE(seq, nullptr) << where;
    if (!entry_of.contains(id)) {
      EXPECT_EQ(static_cast<int64_t>(seq->block_table.size()), blocks_for_tokens(seq->num_computed_tokens))
          << where << ": block table of unscheduled running sequence " << id;
    }
    std::set<kvcache::BlockId> own(seq->block_table.begin(), seq->block_table.end());
    EXPECT_EQ(own.size(), seq->block_table.size()) << where << ": sequence " << id << " holds a block twice";
    for (kvcache::BlockId block : seq->block_table) ++owners[block];
  }
  for (const auto& [block, count] : owners) {
    EXPECT_EQ(scheduler.block_pool().ref_count(block), count) << where << ": block " << block;
  }
  const int64_t num_owned = static_cast<int64_t>(owners.size());
  EXPECT_LE(scheduler.num_cached_blocks(), scheduler.block_pool().num_total()) << where;
  for (SequenceId id : scheduler.waiting_ids()) {
    const SequenceState* seq = scheduler.find(id);
    ASSERT_NE(seq, nullptr) << where;
    EXPECT_TRUE(seq->block_table.empty()) << where << ": waiting sequence " << id << " holds blocks";
    EXPECT_EQ(seq->num_computed_tokens, 0) << where << ": waiting sequence " << id;
    EXPECT_TRUE(seq->status == SequenceStatus::kWaiting || seq->status == SequenceStatus::kPreempted)
        << where << ": sequence " << id << " is " << sequence_status_name(seq->status);
  }
  EXPECT_EQ(num_owned, scheduler.block_pool().num_used()) << where << ": blocks leaked";
  for (const FinishedSequence& finished : batch.finished) {
    EXPECT_EQ(scheduler.find(finished.id), nullptr) << where << ": reported sequence " << finished.id << " still live";
  }
}

void run_scenario(const Scenario& scenario) {
  SCOPED_TRACE(scenario.name);
  Result<Scheduler> created = Scheduler::create(scenario.config);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Scheduler& scheduler = *created;
  std::map<SequenceId, std::vector<TokenId>> expected_tokens;  // prompt + what the model returned

  for (size_t index = 0; index < scenario.steps.size(); ++index) {
    const int step = static_cast<int>(index) + 1;
    const std::string where = "step " + std::to_string(step);
    const ExpectedStep& expected = scenario.steps[index];

    for (const Arrival& arrival : scenario.arrivals) {
      if (arrival.step != step) continue;
      expected_tokens[arrival.request.id] = arrival.request.prompt_token_ids;
      Status status = scheduler.add(arrival.request);
      ASSERT_TRUE(status.ok()) << where << ": add " << arrival.request.id << ": " << status.to_string();
    }
    for (const Cancellation& cancellation : scenario.cancellations) {
      if (cancellation.step != step || cancellation.between_schedule_and_update) continue;
      Status status = scheduler.cancel(cancellation.id);
      ASSERT_TRUE(status.ok()) << where << ": cancel " << cancellation.id << ": " << status.to_string();
      EXPECT_TRUE(scheduler.find(cancellation.id)->is_finished()) << where;
    }

    ScheduledBatch batch = scheduler.schedule();
    EXPECT_EQ(batch.step, static_cast<uint64_t>(step)) << where;
    std::vector<Scheduled> scheduled;
    for (const ScheduledEntry& entry : batch.entries) scheduled.emplace_back(entry.sequence_id, entry.num_tokens());
    std::vector<Finished> finished;
    for (const FinishedSequence& f : batch.finished) finished.emplace_back(f.id, f.reason);
    EXPECT_EQ(scheduled, expected.scheduled) << where << ": scheduled (sequence, tokens)";
    EXPECT_EQ(scheduler.running_ids(), expected.running) << where << ": running";
    EXPECT_EQ(scheduler.waiting_ids(), expected.waiting) << where << ": waiting";
    EXPECT_EQ(batch.preempted, expected.preempted) << where << ": preempted";
    EXPECT_EQ(finished, expected.finished)
        << where << ": finished, got " << describe(finished) << "want " << describe(expected.finished);
    EXPECT_EQ(scheduler.block_pool().num_free(), expected.free_blocks) << where << ": free blocks";
    EXPECT_LE(batch.num_scheduled_tokens(), scenario.config.max_num_batched_tokens) << where;
    EXPECT_LE(scheduler.num_running(), scenario.config.max_num_seqs) << where;
    check_invariants(scheduler, batch, expected_tokens, where);
    for (SequenceId id : batch.preempted) {
      const SequenceState* seq = scheduler.find(id);
      ASSERT_NE(seq, nullptr) << where;
      EXPECT_EQ(seq->status, SequenceStatus::kPreempted) << where << ": sequence " << id;
      EXPECT_EQ(seq->generated_token_ids.size() + seq->prompt_token_ids.size(), expected_tokens.at(id).size())
          << where << ": preempted sequence " << id << " must keep its generated tokens";
    }

    std::set<SequenceId> cancelled_mid_step;
    for (const Cancellation& cancellation : scenario.cancellations) {
      if (cancellation.step != step || !cancellation.between_schedule_and_update) continue;
      Status status = scheduler.cancel(cancellation.id);
      ASSERT_TRUE(status.ok()) << where << ": cancel " << cancellation.id << ": " << status.to_string();
      cancelled_mid_step.insert(cancellation.id);
    }

    // The scripted model: one token per sampling entry, in entry order.
    std::vector<TokenId> sampled;
    for (const ScheduledEntry& entry : batch.entries) {
      if (!entry.samples) continue;
      TokenId token = default_sample(step, entry.sequence_id);
      for (const ScriptedSample& s : scenario.script) {
        if (s.step == step && s.id == entry.sequence_id) token = s.token;
      }
      sampled.push_back(token);
      if (!cancelled_mid_step.contains(entry.sequence_id)) expected_tokens[entry.sequence_id].push_back(token);
    }
    Status status = scheduler.update(batch, sampled);
    ASSERT_TRUE(status.ok()) << where << ": update: " << status.to_string();
    for (const ScheduledEntry& entry : batch.entries) {
      const SequenceState* seq = scheduler.find(entry.sequence_id);
      ASSERT_NE(seq, nullptr) << where;
      if (seq->is_finished()) {
        EXPECT_TRUE(seq->block_table.empty()) << where << ": finished sequence " << seq->id << " holds blocks";
        continue;
      }
      EXPECT_EQ(seq->num_computed_tokens, entry.end_position()) << where << ": sequence " << seq->id;
      std::vector<TokenId> tokens = seq->prompt_token_ids;
      tokens.insert(tokens.end(), seq->generated_token_ids.begin(), seq->generated_token_ids.end());
      EXPECT_EQ(tokens, expected_tokens.at(seq->id)) << where << ": tokens of sequence " << seq->id;
    }
  }
  EXPECT_FALSE(scheduler.has_pending_work()) << "after the last step (" << scenario.steps.size() << ")";
  EXPECT_EQ(scheduler.block_pool().num_free(), scenario.config.num_blocks) << "after the last step: blocks leaked";
}

SchedulerConfig config(int32_t max_num_batched_tokens, int32_t max_num_seqs, int32_t num_blocks,
                       bool enable_chunked_prefill = true, bool enable_prefix_caching = true) {
  return {max_num_batched_tokens, max_num_seqs, num_blocks, enable_chunked_prefill, enable_prefix_caching, {}};
}

// A request whose prompt is `shared` shared-prefix tokens (the same for every id) then `own` tokens of its own.
SequenceRequest shared_prefix_request(SequenceId id, int shared, int own, int64_t max_tokens) {
  SequenceRequest r;
  r.id = id;
  for (int i = 0; i < shared; ++i) r.prompt_token_ids.push_back(static_cast<TokenId>(7000000 + i));
  for (int i = 0; i < own; ++i) r.prompt_token_ids.push_back(static_cast<TokenId>(100000 * id + i));
  r.max_tokens = max_tokens;
  return r;
}

constexpr FinishReason kStop = FinishReason::kStop;
constexpr FinishReason kLength = FinishReason::kLength;
constexpr FinishReason kCancelled = FinishReason::kCancelled;
constexpr FinishReason kAborted = FinishReason::kAborted;

TEST(SchedulerTest, AdmissionUnderMaxNumSeqs) {
  run_scenario({
      .name = "two slots, three requests: the third waits for a slot, FCFS",
      .config = config(1000, 2, 10),
      .arrivals = {{1, request(1, 10, 3)}, {1, request(2, 10, 3)}, {1, request(3, 10, 2)}},
      .steps =
          {
              {.scheduled = {{1, 10}, {2, 10}}, .running = {1, 2}, .waiting = {3}, .free_blocks = 8},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .waiting = {3}, .free_blocks = 8},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .waiting = {3}, .free_blocks = 8},
              {.scheduled = {{3, 10}}, .running = {3}, .finished = {{1, kLength}, {2, kLength}}, .free_blocks = 9},
              {.scheduled = {{3, 1}}, .running = {3}, .free_blocks = 9},
              {.finished = {{3, kLength}}, .free_blocks = 10},
          },
  });
}

TEST(SchedulerTest, LateArrivalJoinsRunningBatchBehindEarlierOnes) {
  run_scenario({
      .name = "a request arriving at step 2 is admitted after the running decodes",
      .config = config(1000, 4, 10),
      .arrivals = {{1, request(1, 20, 3)}, {2, request(2, 30, 2)}},
      .steps =
          {
              {.scheduled = {{1, 20}}, .running = {1}, .free_blocks = 9},
              {.scheduled = {{1, 1}, {2, 30}}, .running = {1, 2}, .free_blocks = 8},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .free_blocks = 8},
              {.finished = {{1, kLength}, {2, kLength}}, .free_blocks = 10},
          },
  });
}

TEST(SchedulerTest, TokenBudgetSharedAndLongPromptChunkedWhileOthersDecode) {
  run_scenario({
      .name = "budget 100: two prompts and a chunk of a third share step 1; the 250-token prompt is prefilled "
              "over four steps while the others decode",
      .config = config(100, 8, 20),
      .arrivals = {{1, request(1, 30, 5)}, {1, request(2, 40, 5)}, {1, request(3, 250, 2)}},
      .steps =
          {
              {.scheduled = {{1, 30}, {2, 40}, {3, 30}}, .running = {1, 2, 3}, .free_blocks = 17},
              {.scheduled = {{1, 1}, {2, 1}, {3, 98}}, .running = {1, 2, 3}, .free_blocks = 16},
              {.scheduled = {{1, 1}, {2, 1}, {3, 98}}, .running = {1, 2, 3}, .free_blocks = 14},
              {.scheduled = {{1, 1}, {2, 1}, {3, 24}}, .running = {1, 2, 3}, .free_blocks = 14},
              {.scheduled = {{1, 1}, {2, 1}, {3, 1}}, .running = {1, 2, 3}, .free_blocks = 14},
              {.finished = {{1, kLength}, {2, kLength}, {3, kLength}}, .free_blocks = 20},
          },
  });
}

TEST(SchedulerTest, BudgetStopsAdmissionAtTheHeadOfTheQueue) {
  run_scenario({
      .name = "budget 64: a 100-token prompt takes the whole step; the request behind it does not overtake",
      .config = config(64, 8, 20),
      .arrivals = {{1, request(1, 100, 1)}, {1, request(2, 10, 1)}},
      .steps =
          {
              {.scheduled = {{1, 64}}, .running = {1}, .waiting = {2}, .free_blocks = 19},
              {.scheduled = {{1, 36}, {2, 10}}, .running = {1, 2}, .free_blocks = 17},
              {.finished = {{1, kLength}, {2, kLength}}, .free_blocks = 20},
          },
  });
}

TEST(SchedulerTest, ChunkedPrefillDisabled) {
  run_scenario({
      .name = "chunking off: a prompt waits for a step with room for all of it; one longer than the budget is "
              "aborted",
      .config = config(100, 8, 10, /*enable_chunked_prefill=*/false),
      .arrivals = {{1, request(1, 60, 2)}, {1, request(2, 60, 2)}, {1, request(3, 150, 2)}},
      .steps =
          {
              {.scheduled = {{1, 60}}, .running = {1}, .waiting = {2}, .finished = {{3, kAborted}}, .free_blocks = 9},
              {.scheduled = {{1, 1}, {2, 60}}, .running = {1, 2}, .free_blocks = 8},
              {.scheduled = {{2, 1}}, .running = {2}, .finished = {{1, kLength}}, .free_blocks = 9},
              {.finished = {{2, kLength}}, .free_blocks = 10},
          },
  });
}

TEST(SchedulerTest, AdmissionBlockedByFreeBlocks) {
  run_scenario({
      .name = "4 blocks: a 130-token prompt takes 3; a 100-token one (2 blocks) waits until they are freed",
      .config = config(1000, 8, 4),
      .arrivals = {{1, request(1, 130, 2)}, {1, request(2, 100, 2)}},
      .steps =
          {
              {.scheduled = {{1, 130}}, .running = {1}, .waiting = {2}, .free_blocks = 1},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .free_blocks = 1},
              {.scheduled = {{2, 100}}, .running = {2}, .finished = {{1, kLength}}, .free_blocks = 2},
              {.scheduled = {{2, 1}}, .running = {2}, .free_blocks = 2},
              {.finished = {{2, kLength}}, .free_blocks = 4},
          },
  });
}

TEST(SchedulerTest, PreemptionByRecomputeAndResumption) {
  // Sequence 1 (126 prompt tokens, 2 blocks) needs a third block to decode position 128 at step 4; the pool
  // is full, so sequence 2, admitted last, is preempted: it keeps its 3 generated tokens and later
  // recomputes all 63 tokens in one step, sampling its 4th token at the end.
  run_scenario({
      .name = "3 blocks: the most recently admitted sequence is preempted and resumes after",
      .config = config(1000, 8, 3),
      .arrivals = {{1, request(1, 126, 6)}, {1, request(2, 60, 5)}},
      .steps =
          {
              {.scheduled = {{1, 126}, {2, 60}}, .running = {1, 2}, .free_blocks = 0},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .free_blocks = 0},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .preempted = {2}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .free_blocks = 0},
              {.scheduled = {{2, 63}}, .running = {2}, .finished = {{1, kLength}}, .free_blocks = 2},
              {.scheduled = {{2, 1}}, .running = {2}, .free_blocks = 2},
              {.finished = {{2, kLength}}, .free_blocks = 3},
          },
  });
}

TEST(SchedulerTest, TwoPreemptionsInOneStepKeepQueueOrder) {
  // Sequences 1 and 2 fill a block each at step 1 and each need a second one at step 2: 4 (admitted last)
  // goes first, then 3. Both resume in their original order and recompute 11 tokens (10 prompt + 1 generated).
  run_scenario({
      .name = "4 blocks, 4 sequences: two preempted in one step, no admission that step",
      .config = config(1000, 8, 4),
      .arrivals = {{1, request(1, 64, 2)}, {1, request(2, 64, 2)}, {1, request(3, 10, 3)}, {1, request(4, 10, 3)}},
      .steps =
          {
              {.scheduled = {{1, 64}, {2, 64}, {3, 10}, {4, 10}}, .running = {1, 2, 3, 4}, .free_blocks = 0},
              {.scheduled = {{1, 1}, {2, 1}},
               .running = {1, 2},
               .waiting = {3, 4},
               .preempted = {4, 3},
               .free_blocks = 0},
              {.scheduled = {{3, 11}, {4, 11}},
               .running = {3, 4},
               .finished = {{1, kLength}, {2, kLength}},
               .free_blocks = 2},
              {.scheduled = {{3, 1}, {4, 1}}, .running = {3, 4}, .free_blocks = 2},
              {.finished = {{3, kLength}, {4, kLength}}, .free_blocks = 4},
          },
  });
}

TEST(SchedulerTest, SequenceNeedingABlockPreemptsItselfWhenItIsTheNewest) {
  run_scenario({
      .name = "2 blocks: sequence 2 (newest) needs a block at position 64 and is its own victim",
      .config = config(1000, 8, 2),
      .arrivals = {{1, request(1, 10, 3)}, {1, request(2, 64, 2)}},
      .steps =
          {
              {.scheduled = {{1, 10}, {2, 64}}, .running = {1, 2}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .preempted = {2}, .free_blocks = 1},
              {.scheduled = {{1, 1}}, .running = {1}, .waiting = {2}, .free_blocks = 1},
              // Its first block (64 computed prompt tokens) is still in the prefix cache: only token 64 is recomputed.
              {.scheduled = {{2, 1}}, .running = {2}, .finished = {{1, kLength}}, .free_blocks = 0},
              {.finished = {{2, kLength}}, .free_blocks = 2},
          },
  });
}

TEST(SchedulerTest, CancellationWhileWaitingMidPrefillAndDecoding) {
  run_scenario({
      .name = "budget 64, two slots: 3 cancelled while waiting, 2 mid-prefill, 1 while decoding",
      .config = config(64, 2, 8),
      .arrivals = {{1, request(1, 10, 10)}, {1, request(2, 200, 5)}, {1, request(3, 10, 5)}},
      .cancellations = {{3, 3}, {4, 2}, {5, 1}},
      .steps =
          {
              {.scheduled = {{1, 10}, {2, 54}}, .running = {1, 2}, .waiting = {3}, .free_blocks = 6},
              {.scheduled = {{1, 1}, {2, 63}}, .running = {1, 2}, .waiting = {3}, .free_blocks = 5},
              {.scheduled = {{1, 1}, {2, 63}}, .running = {1, 2}, .finished = {{3, kCancelled}}, .free_blocks = 4},
              {.scheduled = {{1, 1}}, .running = {1}, .finished = {{2, kCancelled}}, .free_blocks = 7},
              {.finished = {{1, kCancelled}}, .free_blocks = 8},
          },
  });
}

TEST(SchedulerTest, CancellationBetweenScheduleAndUpdateDropsTheSampledToken) {
  run_scenario({
      .name = "cancelled after schedule(): update() skips its entry, the next step reports it",
      .config = config(1000, 8, 4),
      .arrivals = {{1, request(1, 10, 5)}, {1, request(2, 10, 3)}},
      .cancellations = {{2, 1, /*between_schedule_and_update=*/true}},
      .steps =
          {
              {.scheduled = {{1, 10}, {2, 10}}, .running = {1, 2}, .free_blocks = 2},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .free_blocks = 2},
              {.scheduled = {{2, 1}}, .running = {2}, .finished = {{1, kCancelled}}, .free_blocks = 3},
              {.finished = {{2, kLength}}, .free_blocks = 4},
          },
  });
}

TEST(SchedulerTest, StopTokenAndMaxTokensFinish) {
  run_scenario({
      .name = "1 stops on token 2 at step 3; 2 reaches max_tokens; 3 has max_tokens 1; 4 stops on its first token",
      .config = config(1000, 8, 4),
      .arrivals = {{1, request(1, 5, 10, {2, 9})},
                   {1, request(2, 5, 3, {2})},
                   {1, request(3, 5, 1)},
                   {1, request(4, 5, 10, {7})}},
      .script = {{3, 1, 2}, {1, 4, 7}},
      .steps =
          {
              {.scheduled = {{1, 5}, {2, 5}, {3, 5}, {4, 5}}, .running = {1, 2, 3, 4}, .free_blocks = 0},
              {.scheduled = {{1, 1}, {2, 1}},
               .running = {1, 2},
               .finished = {{3, kLength}, {4, kStop}},
               .free_blocks = 2},
              {.scheduled = {{1, 1}, {2, 1}}, .running = {1, 2}, .free_blocks = 2},
              {.finished = {{1, kStop}, {2, kLength}}, .free_blocks = 4},
          },
  });
}

TEST(SchedulerTest, RequestThatCanNeverFitIsAbortedWithoutBlockingOthers) {
  // 2 blocks = 128 tokens. Sequence 1's prompt needs 3 blocks: aborted on arrival. Sequence 2's 128-token
  // prompt fits, but decoding its first sampled token (position 128) would need a third block: aborted at
  // step 2, and sequence 3, blocked behind it, is admitted in the same step.
  run_scenario({
      .name = "2 blocks: prompts of 129 and 128 tokens can never complete",
      .config = config(1000, 8, 2),
      .arrivals = {{1, request(1, 129, 5)}, {1, request(2, 128, 5)}, {1, request(3, 10, 1)}},
      .steps =
          {
              {.scheduled = {{2, 128}}, .running = {2}, .waiting = {3}, .finished = {{1, kAborted}}, .free_blocks = 0},
              {.scheduled = {{3, 10}}, .running = {3}, .finished = {{2, kAborted}}, .free_blocks = 1},
              {.finished = {{3, kLength}}, .free_blocks = 2},
          },
  });
}

TEST(SchedulerTest, OneSequenceAloneDecodesUntilItFillsThePool) {
  // 1 block: a 60-token prompt decodes positions 60..63, then needs position 64: aborted with its 5 tokens.
  run_scenario({
      .name = "1 block, 60-token prompt, max_tokens 100",
      .config = config(1000, 8, 1),
      .arrivals = {{1, request(1, 60, 100)}},
      .steps =
          {
              {.scheduled = {{1, 60}}, .running = {1}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 0},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 0},
              {.finished = {{1, kAborted}}, .free_blocks = 1},
          },
  });
}

TEST(SchedulerTest, RandomWorkloadsKeepInvariantsAndDrain) {
  // Seeded random workloads (small pools, tight budgets, arrivals over time, stop tokens, cancellations at
  // any point) under the invariants of check_invariants(); each must drain, report every request once with
  // a justified reason, and return every block. std::mt19937's raw output is the same on every platform.
  constexpr TokenId kStopToken = 5;
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    std::mt19937 rng(seed);
    auto pick = [&rng](uint32_t lo, uint32_t hi) { return static_cast<int32_t>(lo + rng() % (hi - lo + 1)); };
    const int32_t budgets[] = {8, 64, 100, 300};
    SchedulerConfig cfg = config(budgets[pick(0, 3)], pick(1, 6), pick(1, 12),
                                 /*enable_chunked_prefill=*/pick(0, 9) < 7, /*enable_prefix_caching=*/seed % 2 == 0);
    std::vector<Arrival> arrivals;
    std::map<SequenceId, Cancellation> cancellations;
    const int num_requests = pick(1, 12);
    for (SequenceId id = 1; id <= num_requests; ++id) {
      arrivals.push_back({pick(1, 20), request(id, pick(1, 400), pick(1, 80), {kStopToken})});
      if (pick(0, 9) == 0) cancellations[id] = {pick(1, 60), id, pick(0, 1) == 1};
    }
    Result<Scheduler> created = Scheduler::create(cfg);
    ASSERT_TRUE(created.ok());
    Scheduler& scheduler = *created;
    std::map<SequenceId, std::vector<TokenId>> expected_tokens;
    std::map<SequenceId, FinishReason> reported;
    std::set<SequenceId> cancelled;
    int step = 0;
    for (; step < 5000; ++step) {
      const std::string where = "seed " + std::to_string(seed) + ", step " + std::to_string(step + 1);
      for (const Arrival& arrival : arrivals) {
        if (arrival.step != step + 1) continue;
        expected_tokens[arrival.request.id] = arrival.request.prompt_token_ids;
        ASSERT_TRUE(scheduler.add(arrival.request).ok()) << where;
      }
      auto cancel_now = [&](bool mid_step) {
        for (const auto& [id, cancellation] : cancellations) {
          if (cancellation.step != step + 1 || cancellation.between_schedule_and_update != mid_step) continue;
          if (scheduler.find(id) == nullptr) continue;  // not arrived yet, or already reported
          ASSERT_TRUE(scheduler.cancel(id).ok()) << where;
          if (scheduler.find(id)->finish_reason == FinishReason::kCancelled) cancelled.insert(id);
        }
      };
      cancel_now(false);
      ScheduledBatch batch = scheduler.schedule();
      EXPECT_LE(batch.num_scheduled_tokens(), cfg.max_num_batched_tokens) << where;
      EXPECT_LE(scheduler.num_running(), cfg.max_num_seqs) << where;
      check_invariants(scheduler, batch, expected_tokens, where);
      for (const FinishedSequence& finished : batch.finished) {
        EXPECT_TRUE(reported.emplace(finished.id, finished.reason).second) << where << ": reported twice";
        const std::vector<TokenId>& tokens = expected_tokens.at(finished.id);
        const SequenceRequest& req = arrivals[static_cast<size_t>(finished.id - 1)].request;
        const int64_t generated = static_cast<int64_t>(tokens.size() - req.prompt_token_ids.size());
        EXPECT_EQ(finished.num_generated_tokens, generated) << where << ", sequence " << finished.id;
        switch (finished.reason) {
          case FinishReason::kStop:
            EXPECT_EQ(tokens.back(), kStopToken) << where;
            break;
          case FinishReason::kLength:
            EXPECT_EQ(generated, req.max_tokens) << where;
            break;
          case FinishReason::kCancelled:
            EXPECT_TRUE(cancelled.contains(finished.id)) << where;
            break;
          case FinishReason::kAborted:
            EXPECT_TRUE(
                blocks_for_tokens(static_cast<int64_t>(tokens.size())) > cfg.num_blocks ||
                (!cfg.enable_chunked_prefill && static_cast<int64_t>(tokens.size()) > cfg.max_num_batched_tokens))
                << where << ": sequence " << finished.id << " aborted without cause: " << finished.message;
            break;
          case FinishReason::kNone:
            ADD_FAILURE() << where << ": finished without a reason";
            break;
        }
      }
      cancel_now(true);
      std::vector<TokenId> sampled;
      for (const ScheduledEntry& entry : batch.entries) {
        if (!entry.samples) continue;
        TokenId token = pick(0, 29) == 0 ? kStopToken : default_sample(step + 1, entry.sequence_id);
        sampled.push_back(token);
        if (!scheduler.find(entry.sequence_id)->is_finished()) expected_tokens[entry.sequence_id].push_back(token);
      }
      Status status = scheduler.update(batch, sampled);
      ASSERT_TRUE(status.ok()) << where << ": " << status.to_string();
      if (step >= 20 && !scheduler.has_pending_work()) break;
    }
    ASSERT_LT(step, 5000) << "seed " << seed << ": did not drain in 5000 steps";
    EXPECT_EQ(reported.size(), static_cast<size_t>(num_requests)) << "seed " << seed;
    EXPECT_EQ(scheduler.block_pool().num_free(), cfg.num_blocks) << "seed " << seed << ": blocks leaked";
  }
}

TEST(SchedulerTest, PrefixCacheAdmitsASharedTwoBlockPrefixAsComputed) {
  // Sequence 2 shares sequence 1's first 128 prompt tokens (2 full blocks): it is admitted with them computed
  // and schedules only its own 20 tokens, while both run; its 3rd block is its own.
  run_scenario({
      .name = "8 blocks: 138-token prompt, then a 148-token prompt sharing its first 128 tokens",
      .config = config(1000, 8, 8),
      .arrivals = {{1, shared_prefix_request(1, 128, 10, 4)}, {2, shared_prefix_request(2, 128, 20, 1)}},
      .steps =
          {
              {.scheduled = {{1, 138}}, .running = {1}, .free_blocks = 5},
              {.scheduled = {{1, 1}, {2, 20}}, .running = {1, 2}, .free_blocks = 4},
              {.scheduled = {{1, 1}}, .running = {1}, .finished = {{2, kLength}}, .free_blocks = 5},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 5},
              {.finished = {{1, kLength}}, .free_blocks = 8},
          },
  });
}

TEST(SchedulerTest, PrefixCacheOffComputesEverything) {
  run_scenario({
      .name = "as above with prefix caching off",
      .config = config(1000, 8, 8, true, /*enable_prefix_caching=*/false),
      .arrivals = {{1, shared_prefix_request(1, 128, 10, 4)}, {2, shared_prefix_request(2, 128, 20, 1)}},
      .steps =
          {
              {.scheduled = {{1, 138}}, .running = {1}, .free_blocks = 5},
              {.scheduled = {{1, 1}, {2, 148}}, .running = {1, 2}, .free_blocks = 2},
              {.scheduled = {{1, 1}}, .running = {1}, .finished = {{2, kLength}}, .free_blocks = 5},
              {.scheduled = {{1, 1}}, .running = {1}, .free_blocks = 5},
              {.finished = {{1, kLength}}, .free_blocks = 8},
          },
  });
}

// Schedules one step and answers every sampling entry with default_sample.
ScheduledBatch run_step(Scheduler& scheduler, int step) {
  ScheduledBatch batch = scheduler.schedule();
  std::vector<TokenId> sampled;
  for (const ScheduledEntry& entry : batch.entries) {
    if (entry.samples) sampled.push_back(default_sample(step, entry.sequence_id));
  }
  EXPECT_TRUE(scheduler.update(batch, sampled).ok());
  return batch;
}

TEST(SchedulerTest, PrefixCacheSharesBlockIdsAndOutlivesTheFirstRequest) {
  Result<Scheduler> created = Scheduler::create(config(1000, 8, 8));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(shared_prefix_request(1, 128, 10, 3)).ok());
  run_step(scheduler, 1);
  const std::vector<kvcache::BlockId> first_table = scheduler.find(1)->block_table;
  EXPECT_EQ(scheduler.num_cached_blocks(), 2);
  EXPECT_EQ(scheduler.find(1)->num_cached_tokens, 0);

  // While sequence 1 runs: sequence 2 shares its two full blocks (reference count 2).
  ASSERT_TRUE(scheduler.add(shared_prefix_request(2, 128, 5, 1)).ok());
  ScheduledBatch batch = scheduler.schedule();
  ASSERT_EQ(batch.entries.size(), 2u);
  EXPECT_EQ(batch.entries[1].start_position, 128);
  EXPECT_EQ(batch.entries[1].num_tokens(), 5);
  const SequenceState* second = scheduler.find(2);
  EXPECT_EQ(second->num_computed_tokens, 128);
  EXPECT_EQ(second->num_cached_tokens, 128);
  ASSERT_EQ(second->block_table.size(), 3u);
  EXPECT_EQ(second->block_table[0], first_table[0]);
  EXPECT_EQ(second->block_table[1], first_table[1]);
  EXPECT_NE(second->block_table[2], first_table[2]);
  EXPECT_EQ(scheduler.block_pool().ref_count(first_table[0]), 2);
  EXPECT_EQ(scheduler.block_pool().num_used(), 4);
  ASSERT_TRUE(scheduler.update(batch, std::vector<TokenId>{1, 2}).ok());

  // Both finish; the cached blocks go back to the free list but stay indexed.
  int step = 3;
  while (scheduler.has_pending_work()) run_step(scheduler, step++);
  EXPECT_EQ(scheduler.block_pool().num_free(), 8);
  EXPECT_EQ(scheduler.num_cached_blocks(), 2);

  // A third request with the same prefix revives them: same ids, 128 tokens cached.
  ASSERT_TRUE(scheduler.add(shared_prefix_request(3, 128, 64, 1)).ok());
  batch = scheduler.schedule();
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 128);
  EXPECT_EQ(batch.entries[0].num_tokens(), 64);
  EXPECT_EQ(scheduler.find(3)->block_table[0], first_table[0]);
  EXPECT_EQ(scheduler.find(3)->block_table[1], first_table[1]);
  EXPECT_EQ(scheduler.block_pool().num_free(), 8 - 3);
  EXPECT_EQ(batch.entries[0].block_table.size(), 3u);
  ASSERT_TRUE(scheduler.update(batch, std::vector<TokenId>{1}).ok());
  EXPECT_EQ(scheduler.num_cached_blocks(), 3);  // its own full block (tokens 128..191) joined the index
  batch = scheduler.schedule();
  ASSERT_EQ(batch.finished.size(), 1u);
  EXPECT_EQ(batch.finished[0].num_cached_tokens, 128);
  EXPECT_EQ(scheduler.block_pool().num_free(), 8);
  EXPECT_EQ(scheduler.num_prefix_hit_tokens(), 256);
}

TEST(SchedulerTest, PrefixCacheNeverReusesTheBlockOfTheLastPromptToken) {
  Result<Scheduler> created = Scheduler::create(config(1000, 8, 8));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(shared_prefix_request(1, 128, 0, 1)).ok());
  while (scheduler.has_pending_work()) run_step(scheduler, 1);
  EXPECT_EQ(scheduler.num_cached_blocks(), 2);
  ASSERT_TRUE(scheduler.add(shared_prefix_request(2, 128, 0, 1)).ok());  // the same 128 tokens
  ScheduledBatch batch = scheduler.schedule();
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 64);  // block 1 holds the last token: recomputed
  EXPECT_EQ(batch.entries[0].num_tokens(), 64);
  EXPECT_TRUE(batch.entries[0].samples);
  EXPECT_EQ(scheduler.find(2)->num_cached_tokens, 64);
}

TEST(SchedulerTest, PrefixCacheEvictsIndexOnlyBlocksBeforePreempting) {
  // 4 blocks. Sequence 1 leaves 2 indexed blocks on the free list; sequence 2 (other tokens) needs all 4:
  // the cached ones are evicted (least recently freed first), nobody is preempted.
  Result<Scheduler> created = Scheduler::create(config(1000, 8, 4));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(shared_prefix_request(1, 128, 2, 1)).ok());
  int step = 1;
  while (scheduler.has_pending_work()) run_step(scheduler, step++);
  EXPECT_EQ(scheduler.num_cached_blocks(), 2);
  EXPECT_EQ(scheduler.block_pool().num_free(), 4);

  ASSERT_TRUE(scheduler.add(request(2, 250, 1)).ok());
  ScheduledBatch batch = scheduler.schedule();
  EXPECT_TRUE(batch.preempted.empty());
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].num_tokens(), 250);
  EXPECT_EQ(scheduler.num_cached_blocks(), 0) << "both cached blocks were reallocated";
  EXPECT_EQ(scheduler.block_pool().num_free(), 0);
  ASSERT_TRUE(scheduler.update(batch, std::vector<TokenId>{1}).ok());
  EXPECT_EQ(scheduler.num_cached_blocks(), 3);  // sequence 2's full blocks
  while (scheduler.has_pending_work()) run_step(scheduler, step++);
  EXPECT_EQ(scheduler.block_pool().num_free(), 4);

  // Sequence 1's prefix is gone: the same prompt again computes everything.
  ASSERT_TRUE(scheduler.add(shared_prefix_request(4, 128, 2, 1)).ok());
  batch = scheduler.schedule();
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 0);
  EXPECT_EQ(scheduler.find(4)->num_cached_tokens, 0);
}

// ---- Contracts outside the step tables ----------------------------------------------------------------------

TEST(SchedulerTest, ConfigValidation) {
  struct Case {
    SchedulerConfig config;
    std::string field;
  };
  const Case cases[] = {
      {config(0, 1, 1), "max_num_batched_tokens"},
      {config(1, 0, 1), "max_num_seqs"},
      {config(1, 1, 0), "num_blocks"},
  };
  for (const Case& c : cases) {
    Result<Scheduler> created = Scheduler::create(c.config);
    ASSERT_FALSE(created.ok()) << c.field;
    EXPECT_EQ(created.status().code(), StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(created.status().message().find(c.field), std::string::npos) << created.status().to_string();
  }
}

TEST(SchedulerTest, AddRejectsInvalidRequestsAndChangesNothing) {
  Result<Scheduler> created = Scheduler::create(config(100, 4, 4));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(request(1, 5, 2)).ok());
  struct Case {
    SequenceRequest request;
    std::string why;
  };
  const Case cases[] = {
      {request(1, 5, 2), "duplicate id"},
      {request(2, 0, 2), "empty prompt"},
      {request(3, 5, 0), "max_tokens 0"},
  };
  for (const Case& c : cases) {
    Status status = scheduler.add(c.request);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.why << ": " << status.to_string();
  }
  EXPECT_EQ(scheduler.waiting_ids(), std::vector<SequenceId>{1});
}

TEST(SchedulerTest, CancelUnknownOrReportedIsNotFoundAndCancelTwiceIsOk) {
  Result<Scheduler> created = Scheduler::create(config(100, 4, 4));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  EXPECT_EQ(scheduler.cancel(7).code(), StatusCode::kNotFound);
  ASSERT_TRUE(scheduler.add(request(1, 5, 2)).ok());
  EXPECT_TRUE(scheduler.cancel(1).ok());
  EXPECT_TRUE(scheduler.cancel(1).ok());  // finished, not yet reported: no-op
  EXPECT_EQ(scheduler.find(1)->finish_reason, FinishReason::kCancelled);
  ScheduledBatch batch = scheduler.schedule();
  ASSERT_EQ(batch.finished.size(), 1u);
  EXPECT_EQ(batch.finished[0].reason, FinishReason::kCancelled);
  EXPECT_EQ(scheduler.cancel(1).code(), StatusCode::kNotFound);
  // The id may be reused once reported.
  EXPECT_TRUE(scheduler.add(request(1, 5, 2)).ok());
}

TEST(SchedulerTest, UpdateRejectsStaleRepeatedOrMiscountedResults) {
  Result<Scheduler> created = Scheduler::create(config(100, 4, 4));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(request(1, 5, 10)).ok());
  ASSERT_TRUE(scheduler.add(request(2, 5, 10)).ok());
  ScheduledBatch first = scheduler.schedule();
  ASSERT_EQ(first.num_sampling_entries(), 2);

  const std::vector<TokenId> one = {11};
  EXPECT_EQ(scheduler.update(first, one).code(), StatusCode::kInvalidArgument) << "one token for two entries";
  EXPECT_EQ(scheduler.find(1)->num_computed_tokens, 0) << "a rejected update changes nothing";

  // schedule() again without update(): the first batch is abandoned and the same work is planned again.
  ScheduledBatch second = scheduler.schedule();
  ASSERT_EQ(second.entries.size(), 2u);
  EXPECT_EQ(second.entries[0].token_ids, first.entries[0].token_ids);
  EXPECT_EQ(second.entries[0].block_table, first.entries[0].block_table);
  EXPECT_EQ(scheduler.block_pool().num_free(), 2) << "no blocks allocated twice";
  const std::vector<TokenId> two = {11, 12};
  EXPECT_EQ(scheduler.update(first, two).code(), StatusCode::kInvalidArgument) << "stale batch";
  ASSERT_TRUE(scheduler.update(second, two).ok());
  EXPECT_EQ(scheduler.update(second, two).code(), StatusCode::kInvalidArgument) << "updated twice";
  EXPECT_EQ(scheduler.find(1)->generated_token_ids, std::vector<TokenId>{11});
  EXPECT_EQ(scheduler.find(2)->generated_token_ids, std::vector<TokenId>{12});

  // An entry that disagrees with the sequence's state is an internal error.
  ScheduledBatch third = scheduler.schedule();
  ASSERT_EQ(third.entries.size(), 2u);
  third.entries[1].start_position = 3;
  EXPECT_EQ(scheduler.update(third, two).code(), StatusCode::kInternal);
  EXPECT_EQ(scheduler.find(1)->num_computed_tokens, 5) << "nothing changed, entry 0 included";
}

TEST(SchedulerTest, StopTokenIsKeptAndAbortMessageNamesTheLimit) {
  Result<Scheduler> created = Scheduler::create(config(100, 4, 2));
  ASSERT_TRUE(created.ok());
  Scheduler& scheduler = *created;
  ASSERT_TRUE(scheduler.add(request(1, 5, 10, {42})).ok());
  ASSERT_TRUE(scheduler.add(request(2, 200, 10)).ok());
  ScheduledBatch batch = scheduler.schedule();
  ASSERT_EQ(batch.finished.size(), 1u);
  EXPECT_EQ(batch.finished[0].id, 2);
  EXPECT_EQ(batch.finished[0].reason, FinishReason::kAborted);
  EXPECT_NE(batch.finished[0].message.find("needs 4 KV blocks"), std::string::npos) << batch.finished[0].message;
  EXPECT_NE(batch.finished[0].message.find("pool has 2 blocks"), std::string::npos) << batch.finished[0].message;
  const std::vector<TokenId> stop = {42};
  ASSERT_TRUE(scheduler.update(batch, stop).ok());
  EXPECT_EQ(scheduler.find(1)->generated_token_ids, std::vector<TokenId>{42});
  batch = scheduler.schedule();
  ASSERT_EQ(batch.finished.size(), 1u);
  EXPECT_EQ(batch.finished[0].reason, FinishReason::kStop);
  EXPECT_EQ(batch.finished[0].num_prompt_tokens, 5);
  EXPECT_EQ(batch.finished[0].num_generated_tokens, 1);
  EXPECT_TRUE(batch.finished[0].message.empty());
}

}  // namespace
}  // namespace deepinfer::engine
