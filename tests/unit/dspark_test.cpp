// DSpark's planner with no model (engine/dspark.h): the step-time tables and their file, the batch-wide verify
// length (worked examples whose arithmetic is in the comments), the draft length against the draft passes' cost,
// and the rollback fallback with its return.
#include "deepinfer/engine/dspark.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace deepinfer::engine {
namespace {

StepTimeTable table(std::vector<std::pair<int32_t, double>> points) {
  Result<StepTimeTable> created = StepTimeTable::create(std::move(points));
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  return created.ok() ? *created : StepTimeTable();
}

VerifyRequest request(SequenceId id, std::vector<double> confidences) {
  VerifyRequest r;
  r.id = id;
  r.confidences = std::move(confidences);
  r.verify_drafts = static_cast<int32_t>(r.confidences.size());
  return r;
}

TEST(DsparkTest, StepTimeTableInterpolatesAndExtrapolates) {
  const StepTimeTable t = table({{1, 10.0}, {4, 13.0}, {8, 21.0}});
  EXPECT_DOUBLE_EQ(t.milliseconds(0), 10.0);
  EXPECT_DOUBLE_EQ(t.milliseconds(1), 10.0);
  EXPECT_DOUBLE_EQ(t.milliseconds(2), 11.0);
  EXPECT_DOUBLE_EQ(t.milliseconds(6), 17.0);
  EXPECT_DOUBLE_EQ(t.milliseconds(10), 25.0);  // the last segment's 2 ms per row
  EXPECT_DOUBLE_EQ(StepTimeTable::flat().milliseconds(1000), StepTimeTable::flat().milliseconds(1));
  EXPECT_FALSE(StepTimeTable::create({{4, 1.0}, {2, 2.0}}).ok()) << "not ascending";
  EXPECT_FALSE(StepTimeTable::create({{1, 0.0}}).ok()) << "no time";
  EXPECT_FALSE(StepTimeTable::create({{0, 1.0}}).ok()) << "no rows";
}

TEST(DsparkTest, StepTimesRoundTripThroughTheirFileAndRefuseAnotherIdentity) {
  StepTimes times{table({{1, 6.5}, {2, 6.75}, {40, 25.0}}), table({{1, 4.25}, {8, 5.5}}), table({{1, 0.5}})};
  const std::string text = times.to_json("abc (f32 weights, cpu, 2 threads)");
  Result<StepTimes> back = StepTimes::from_json(text, "abc (f32 weights, cpu, 2 threads)");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->verify.points(), times.verify.points());
  EXPECT_EQ(back->draft.points(), times.draft.points());
  EXPECT_EQ(back->mtp_kv.points(), times.mtp_kv.points());
  Result<StepTimes> other = StepTimes::from_json(text, "def (bf16 weights, cuda, 16 threads)");
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("measured for 'abc"), std::string::npos) << other.status().message();
  EXPECT_FALSE(StepTimes::from_json("{\"identity\": \"x\", \"verify\": [[1, \"a\"]], \"draft\": []}", "x").ok());
  EXPECT_FALSE(StepTimes::from_json("not json", "x").ok());
}

TEST(DsparkTest, AFlatTableVerifiesEveryDraftAboveTheSurvivalFloor) {
  std::vector<VerifyRequest> requests{request(1, {0.9, 0.5, 0.1}), request(2, {1e-4, 1e-4})};
  plan_verify(2, 2, StepTimeTable::flat(), requests);
  EXPECT_EQ(requests[0].verify_drafts, 3);
  EXPECT_EQ(requests[1].verify_drafts, 1) << "1e-4 * 1e-4 = 1e-8 is below the 1e-6 floor";
}

TEST(DsparkTest, CheapRowsAtBatchOneVerifyWhatPays) {
  // 0.5 ms per extra row over 10 ms. Survivals 0.9, 0.72, 0.072:
  //   b=0: 1/10 = 0.100; b=1: 1.9/10.5 = 0.181; b=2: 2.62/11 = 0.238; b=3: 2.692/11.5 = 0.234 -> b* = 2.
  std::vector<VerifyRequest> requests{request(7, {0.9, 0.8, 0.1})};
  const double rate = plan_verify(1, 1, table({{1, 10.0}, {2, 10.5}, {4, 11.5}, {8, 13.5}}), requests);
  EXPECT_EQ(requests[0].verify_drafts, 2);
  EXPECT_NEAR(rate, 2620.0 / 11.0, 1e-6);  // tokens per second
}

TEST(DsparkTest, RowsCostingTheirShareAtBatch32VerifyNothing) {
  // Every row costs 1 ms (a step of 32 decode rows takes 32 ms): a draft of survival s adds s tokens for 1 ms,
  // against 1 token per ms without it, so no draft with s < 1 pays: the seed's "1.6x at batch 1, 0.9x at batch 32".
  const StepTimeTable linear = table({{1, 1.0}, {64, 64.0}});
  std::vector<VerifyRequest> requests;
  for (SequenceId id = 0; id < 32; ++id) requests.push_back(request(id, id == 0 ? std::vector<double>{0.99, 0.99}
                                                                                   : std::vector<double>{0.5}));
  plan_verify(32, 32, linear, requests);
  for (const VerifyRequest& r : requests) EXPECT_EQ(r.verify_drafts, 0) << r.id;
  // At batch 1 with a step's fixed cost (10 ms + 1 ms per row): the 0.9 draft pays (1.9/12 > 1/11), its
  // 0.09-survival successor does not (1.99/13 < 1.9/12).
  std::vector<VerifyRequest> alone{request(3, {0.9, 0.1})};
  plan_verify(1, 1, table({{1, 11.0}, {64, 74.0}}), alone);
  EXPECT_EQ(alone[0].verify_drafts, 1);
}

TEST(DsparkTest, DraftLengthWeighsTheDraftPassesCost) {
  const std::vector<double> rates{0.6, 0.4, 0.2};
  // Draft passes as costly as a step (a CPU's vocabulary head): rate(0) = 1/6.6 = 0.152; rate(1) = 1.6/(6.8+4.5)
  // = 0.142: no drafting.
  StepTimes costly{table({{1, 6.6}, {2, 6.8}, {4, 6.9}}), table({{1, 4.5}, {8, 6.0}}), StepTimeTable()};
  EXPECT_EQ(plan_draft_length(1, 1, 1, 3, rates, costly), 0);
  // Cheap draft passes (a GPU at batch 1): rate(1) = 1.6/(10.05+0.5) = 0.152, rate(2) = 2.0/(10.1+1) = 0.180,
  // rate(3) = 2.2/(10.15+1.5) = 0.189 > 1/10.
  StepTimes cheap{table({{1, 10.0}, {64, 13.15}}), table({{1, 0.5}, {64, 2.0}}), StepTimeTable()};
  EXPECT_EQ(plan_draft_length(1, 1, 1, 3, rates, cheap), 3);
  EXPECT_EQ(plan_draft_length(1, 1, 1, 2, rates, cheap), 2) << "clamped to the longest chain";
  EXPECT_EQ(plan_draft_length(1, 1, 0, 3, rates, cheap), 0) << "no chains";
  EXPECT_EQ(plan_draft_length(1, 1, 1, 3, rates, StepTimes{}), 3) << "const: drafting looks free";
  // A DSpark module on a GPU where the target step is a few launches (the demo model on the H100: verify 0.34 ms,
  // block pass 0.26, injection 0.13). Rates 0.5, 0.3, 0.1: L = 3 buys 1.9 tokens in 0.34 + 0.26 + 0.13 = 0.73 ms
  // (2.6 per ms) against 1 in 0.34 (2.9; the idle injection, 38% of the step, is skipped): no drafting. Without the
  // injection's cost the block looked like 1.9 in 0.60 ms (3.2 per ms).
  const std::vector<double> falling{0.5, 0.3, 0.1};
  const StepTimes gpu{table({{1, 0.34}, {64, 0.34}}), table({{1, 0.26}}), table({{1, 0.13}})};
  EXPECT_EQ(plan_draft_length(1, 1, 1, 3, falling, gpu, true), 0);
  const StepTimes no_injection{table({{1, 0.34}, {64, 0.34}}), table({{1, 0.26}}), StepTimeTable()};
  EXPECT_EQ(plan_draft_length(1, 1, 1, 3, falling, no_injection, true), 3);
}

// The table's times hold, but drafting steps commit fewer tokens than the acceptance rates promise (the H200's
// demo run at batch 32: 2.06 per request per step, in 1.4 ms, against a plain step's 1 in 0.42 ms): after
// kMinDraftSamples such steps no step drafts; after enough plain steps drafting is tried again.
TEST(DsparkTest, DraftingStepsThatDeliverLessThanPlainOnesStop) {
  const StepTimes gpu{table({{32, 0.42}, {160, 0.53}}), table({{32, 0.45}}), table({{32, 0.12}})};
  DsparkConfig config;
  DsparkPlanner planner(config, gpu, 4, /*block_draft=*/true);
  for (int i = 0; i < 40; ++i) planner.on_verified(1, 4, 4);
  int drafting_steps = 0;
  for (int step = 0; step < 10; ++step) {
    planner.begin_drafting(32, 32, 32);
    if (planner.max_drafts(1, 4) == 0) break;
    ++drafting_steps;
    planner.on_step(96, 32 * 2, 0.53 + 0.45 + 0.12, true);  // as the table says, but 2 tokens per request
  }
  EXPECT_EQ(drafting_steps, DsparkPlanner::kMinDraftSamples);
  EXPECT_NEAR(planner.drafting_rate(), 2.0 / 1.1, 1e-9);
  int plain_steps = 0;
  for (; plain_steps < 1000; ++plain_steps) {
    planner.begin_drafting(32, 32, 32);
    if (planner.max_drafts(1, 4) > 0) break;
    planner.on_step(0, 32, 0.42, true);
  }
  // Not sooner than three draft passes (0.45 + 0.12 ms each) costing 1% of the plain steps (0.42 ms) between.
  EXPECT_EQ(plain_steps, 408);
  static_assert(DsparkPlanner::kMinDraftSamples == 3 && DsparkPlanner::kMaxRetryCost == 0.01);
}

// `steps` steps of one request alone, from its prefill step (not steady): a step that verifies the drafts the step
// before made commits 2 tokens in verify_ms, one that verifies none 1 token in plain_ms, each plus draft_ms where it
// drafts. `pattern`: per step 'D' (it drafts or verifies drafts) or 'p' (plain); `pending`: the last step's drafts.
struct Decoded {
  std::string pattern;
  int32_t pending = 0;
};
Decoded decode_alone(DsparkPlanner& planner, int steps, double verify_ms, double plain_ms, double draft_ms) {
  Decoded out;
  for (int step = 0; step < steps; ++step) {
    planner.set_all_greedy(true);
    planner.begin_drafting(1, 1, 1);
    const int32_t drafts = planner.max_drafts(1, 4);
    const int32_t pending = out.pending;
    planner.on_step(pending, pending > 0 ? 2 : 1, (pending > 0 ? verify_ms : plain_ms) + (drafts > 0 ? draft_ms : 0.0),
                    step > 0);
    out.pattern += pending > 0 || drafts > 0 ? 'D' : 'p';
    out.pending = drafts;
  }
  return out;
}

// The demo model on an H100 at batch 1 (bench_speculative, 2026-12-07): the table's plain step (a verify of one
// row) 0.26 ms, a serving plain step 0.238 ms (4.2 tokens per ms); DSpark steps commit 2 tokens in 0.532 ms (3.76
// per ms: 0.90x of plain decoding, but 0.98x of the table's plain step, so the guard went on drafting, and the run
// ended at 0.86x of plain decoding). So close a call is checked against measured plain steps first; drafting stops
// where they are faster than the table's, and goes on where they take what it says (3.76 >= 0.95 x 3.85).
TEST(DsparkTest, TheGuardComparesDraftingWithMeasuredPlainSteps) {
  const StepTimes h100{table({{1, 0.26}, {5, 0.27}}), table({{1, 0.24}}), table({{1, 0.03}})};
  auto run = [&](double plain_step_ms) {
    DsparkPlanner planner(DsparkConfig{}, h100, 4, /*block_draft=*/true);
    for (int i = 0; i < 40; ++i) planner.on_verified(1, 4, 3);  // the plan expects 4 tokens a step; 2 come
    std::string pattern = decode_alone(planner, 40, 0.27, plain_step_ms, 0.262).pattern;
    return std::pair(pattern, planner.plain_rate());
  };
  static_assert(DsparkPlanner::kMinDraftSamples == 3 && DsparkPlanner::kMinPlainSamples == 3);
  const auto [faster, faster_rate] = run(0.238);
  // The prefill and 3 drafting samples (DDDD); a step verifying the last drafts (D), 3 plain samples (ppp); then
  // plain decoding.
  EXPECT_EQ(faster, "DDDDDppp" + std::string(32, 'p'));
  EXPECT_NEAR(faster_rate, 1.0 / 0.238, 1e-9);
  const auto [as_table, as_table_rate] = run(0.26);
  EXPECT_EQ(as_table, "DDDDDppp" + std::string(32, 'D'));
  EXPECT_NEAR(as_table_rate, 1.0 / 0.26, 1e-9);
}

// A new request's prefill step (its prompt's rows and one committing request) is compared with a plain decode step
// of the batch, not with a pass over the prompt's rows (H100, 2026-12-07: verify_ms(30 rows) made a plain step look
// slow enough that every new request at batch 1 drafted again, at 0.83x of plain decoding over 64 tokens).
TEST(DsparkTest, APrefillStepDoesNotReopenDraftingTheGuardClosed) {
  const StepTimes h100{table({{1, 0.26}, {5, 0.27}, {64, 0.60}}), table({{1, 0.24}}), table({{1, 0.03}})};
  DsparkPlanner planner(DsparkConfig{}, h100, 4, /*block_draft=*/true);
  for (int i = 0; i < 40; ++i) planner.on_verified(1, 4, 3);
  // Drafting at 2 tokens in 0.7 ms (2.9 per ms against 3.8): stopped.
  ASSERT_EQ(decode_alone(planner, 12, 0.45, 0.26, 0.25).pending, 0);
  planner.on_removed(1);
  planner.set_all_greedy(true);
  planner.begin_drafting(30, 1, 1);  // request 2's prefill step: 30 prompt rows, its first token
  EXPECT_EQ(planner.max_drafts(2, 4), 0);
}

// A request's prefill step (its prompt rows) and a new verify or block shape's first steps (CUDA graphs recorded: an
// eager run, then the capture) take several times a decode step: the guard above must not count them (the demo
// model at batch 1, CPU and H100: the prefill and the first drafting steps stopped drafting for the next 100-310
// steps).
TEST(DsparkTest, StepsThatAreNotSteadyDoNotStopDrafting) {
  const StepTimes gpu{table({{1, 0.30}, {5, 0.30}}), table({{1, 0.25}}), table({{1, 0.06}})};
  // Up to 20 steps that draft, each reported with `steady(step)`: how many drafted before the guard stopped them.
  auto drafting_steps = [&](DsparkPlanner& planner, auto steady) {
    for (int i = 0; i < 40; ++i) planner.on_verified(1, 4, 3);
    int steps = 0;
    for (int step = 0; step < 20; ++step) {
      planner.set_all_greedy(true);
      planner.begin_drafting(1, 1, 1);
      if (planner.max_drafts(1, 4) == 0) break;
      ++steps;
      // Four tokens a step in 0.61 ms (6.6 per ms against a plain step's 3.3); the first is the prefill, the next
      // four record graphs.
      planner.on_step(step == 0 ? 0 : 3, step == 0 ? 1 : 4, step < 5 ? 4.0 : 0.61, steady(step));
    }
    return steps;
  };
  DsparkPlanner planner(DsparkConfig{}, gpu, 4, /*block_draft=*/true);
  EXPECT_EQ(drafting_steps(planner, [](int step) { return step >= 5; }), 20);
  EXPECT_NEAR(planner.drafting_rate(), 4.0 / 0.61, 1e-9);
  // The same steps counted as steady: the first samples' 1 token in 4 ms stop drafting.
  // (The first step, which drafts with nothing to verify, is no sample in any case.)
  DsparkPlanner counted(DsparkConfig{}, gpu, 4, /*block_draft=*/true);
  EXPECT_EQ(drafting_steps(counted, [](int) { return true; }), 1 + DsparkPlanner::kMinDraftSamples);
}

// The demo model on the 2-core CPU at batch 8 (its measured table, the block pass a little dearer): with the
// prior's acceptance (0.7^k) no length pays, so only probes draft. A module whose drafts 1..3 are always accepted
// makes L = 3 pay (32 tokens in 37.1 ms against 8 in 13.0); a probe of one token could never show it (A_1 -> 1, but
// A_2.. stayed the prior: at best 22.6 tokens in 37.1 ms), and a probe step counted as a drafting one (one
// request's draft) put the guard's rate below a plain step's. Probes of a block draft verify the whole block, and
// are no samples of the guard: the planner drafts after its first probe and keeps drafting.
TEST(DsparkTest, ProbesOfABlockDraftMeasureEveryPositionAndDoNotFeedTheGuard) {
  const StepTimes cpu{table({{8, 12.89}, {16, 15.78}, {32, 22.99}, {40, 31.29}}), table({{8, 14.0}}),
                      table({{8, 0.08}})};
  DsparkPlanner planner(DsparkConfig{}, cpu, 4, /*block_draft=*/true);
  std::map<SequenceId, std::vector<double>> drafts;  // made last step, verified this one
  int drafting_steps_late = 0, verified_late = 0;
  for (int step = 0; step < 400; ++step) {
    std::vector<VerifyRequest> verify;
    for (const auto& [id, confidences] : drafts) verify.push_back(request(id, confidences));
    planner.plan(8, 8, verify);
    int64_t verified_total = 0, committed = 0;
    for (const VerifyRequest& v : verify) {
      const int32_t accepted = std::min(v.verify_drafts, 3);
      planner.on_verified(v.id, v.verify_drafts, accepted);
      verified_total += v.verify_drafts;
      committed += accepted;
    }
    committed += 8;
    planner.set_all_greedy(true);
    planner.begin_drafting(8, 8, 8);
    drafts.clear();
    int64_t chains = 0;
    for (SequenceId id = 1; id <= 8; ++id) {
      const int32_t most = planner.max_drafts(id, 4);
      for (int32_t k = 0; k < most; ++k) {
        drafts[id].push_back(0.95);
        if (!planner.continue_after(id, k, 0.95)) break;
      }
      chains += most > 0 ? 1 : 0;
    }
    const double ms = cpu.verify.milliseconds(8 + verified_total) + (chains > 0 ? cpu.draft.milliseconds(8) : 0.0) +
                      cpu.mtp_kv.milliseconds(8);
    planner.on_step(verified_total, committed, ms, true);
    if (step >= 300) {
      drafting_steps_late += chains == 8 ? 1 : 0;
      verified_late += static_cast<int>(verified_total);
    }
  }
  EXPECT_EQ(drafting_steps_late, 100);
  EXPECT_GE(verified_late, 100 * 8 * 3);
}

TEST(DsparkTest, ConsecutiveRollbacksFallBackAndConfidentProbesReturn) {
  DsparkConfig config;
  config.confidence_threshold = 0.85;
  config.abort_on_rollback_rate = 0.30;
  DsparkPlanner planner(config, StepTimes{}, 4);
  planner.begin_drafting(2, 2, 2);
  EXPECT_EQ(planner.max_drafts(1, 4), 4);
  EXPECT_TRUE(planner.continue_after(1, 0, 0.9));
  EXPECT_FALSE(planner.continue_after(1, 1, 0.5)) << "a chain stops after a draft below the threshold";
  // Rollbacks: 2 of 4 rejected (0.5 > 0.3), twice; a good verify resets the run; then three in a row.
  planner.on_verified(1, 4, 2);
  planner.on_verified(1, 4, 2);
  planner.on_verified(1, 4, 3);  // 0.25 rejected: not a rollback
  EXPECT_FALSE(planner.in_fallback(1));
  planner.on_verified(1, 3, 0);
  planner.on_verified(1, 2, 1);
  EXPECT_FALSE(planner.in_fallback(1));
  planner.on_verified(1, 1, 0);
  EXPECT_TRUE(planner.in_fallback(1));
  SpeculativeStats stats;
  planner.add_counters(stats);
  EXPECT_EQ(stats.fallbacks, 1);
  EXPECT_EQ(stats.requests_in_fallback, 1);
  // In fallback: one probe draft every few steps, never verified, never continued.
  int probe_steps = 0;
  for (int step = 0; step < 4 * DsparkPlanner::kProbeEveryFallbackSteps; ++step) {
    const int32_t drafts = planner.max_drafts(1, 4);
    EXPECT_LE(drafts, 1);
    probe_steps += drafts;
  }
  EXPECT_EQ(probe_steps, 4);
  std::vector<VerifyRequest> requests{request(1, {0.99}), request(2, {0.99})};
  planner.plan(2, 2, requests);
  EXPECT_EQ(requests[0].verify_drafts, 0);
  EXPECT_EQ(requests[1].verify_drafts, 1) << "the other request is not affected";
  // Three confident probes in a row bring it back; an unconfident one restarts the count.
  EXPECT_FALSE(planner.continue_after(1, 0, 0.9));
  EXPECT_FALSE(planner.continue_after(1, 0, 0.9));
  EXPECT_FALSE(planner.continue_after(1, 0, 0.2));
  EXPECT_TRUE(planner.in_fallback(1));
  for (int i = 0; i < 3; ++i) planner.continue_after(1, 0, 0.95);
  EXPECT_FALSE(planner.in_fallback(1));
  planner.add_counters(stats);
  EXPECT_EQ(stats.fallback_returns, 1);
  EXPECT_EQ(stats.requests_in_fallback, 0);
  EXPECT_EQ(planner.max_drafts(1, 4), 4);
  planner.on_removed(1);
  EXPECT_FALSE(planner.in_fallback(1));
}

// The H100's demo-model case at batch 1 (bench/gpu/NOTES.md, 2026-12-06): a step is 0.30 ms, a DSpark block pass
// 0.25 ms plus its 0.06 ms injection pass, which costs more than 5% of the step, so the idle pass is skipped. Requests
// of `tokens` tokens run one after another, each step driven as MtpExecutor drives the planner (drafts made at the
// end of a step, verified in the next), every draft confident (0.9) and accepted, given the ones before it were, with
// probability accept_percent / 100 (a fixed pseudo-random sequence). Returns the simulated milliseconds.
double simulate_batch_one(DsparkPlanner& planner, const StepTimes& times, int requests, int tokens, int accept_percent,
                          int& draft_passes) {
  double total_ms = 0.0;
  draft_passes = 0;
  uint64_t lcg = 12345;
  auto accept = [&] {
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int>((lcg >> 33) % 100) < accept_percent;
  };
  for (SequenceId id = 1; id <= static_cast<SequenceId>(requests); ++id) {
    std::vector<double> drafts;
    for (int committed = 0; committed < tokens;) {
      int32_t verified = 0;
      if (!drafts.empty()) {
        std::vector<VerifyRequest> verify{request(id, drafts)};
        planner.plan(1, 1, verify);
        verified = verify[0].verify_drafts;
      }
      int32_t accepted = 0;
      while (accepted < verified && accept()) ++accepted;
      planner.on_verified(id, verified, accepted);
      planner.set_all_greedy(true);
      planner.begin_drafting(1, 1, 1);
      drafts.clear();
      const int32_t most = planner.max_drafts(id, 4);
      for (int32_t k = 0; k < most; ++k) {
        drafts.push_back(0.9);
        if (!planner.continue_after(id, k, 0.9)) break;
      }
      const bool pass = !drafts.empty() || !planner.skips_idle_draft_pass();
      draft_passes += drafts.empty() ? 0 : 1;
      const double ms = times.verify.milliseconds(1 + verified) + (pass ? times.mtp_kv.milliseconds(1) : 0.0) +
                        (drafts.empty() ? 0.0 : times.draft.milliseconds(1));
      total_ms += ms;
      planner.on_step(verified, 1 + accepted, ms, true);
      committed += 1 + accepted;
    }
    planner.on_removed(id);
  }
  return total_ms;
}

// Before this rule a request in fallback probed alone every 4 steps (a whole draft pass each, reading stale entries),
// and the planner counted steps in which nobody drafted as drafting ones. Every draft rejected: the first request's
// three rollbacks end drafting for the run (3 draft passes in 20 requests; 6 before). Drafts accepted at 60%:
// drafting pays when verified (0.990x of plain decoding's time for the same tokens, 93 draft passes); before, the
// fallbacks' lone probes cost more than the drafting gained (1.004x, drafting stopped after 8 passes).
TEST(DsparkTest, AtBatchOneRejectedDraftsCostNoLoneProbes) {
  const StepTimes h100{table({{1, 0.30}, {2, 0.305}, {5, 0.32}}), table({{1, 0.25}, {8, 0.27}}),
                       table({{1, 0.06}, {8, 0.07}})};
  DsparkConfig config;
  config.confidence_threshold = 0.85;
  config.abort_on_rollback_rate = 0.30;
  const int requests = 20, tokens = 64;
  const double plain = requests * tokens * 0.30;
  {
    DsparkPlanner planner(config, h100, 4, /*block_draft=*/true);
    int draft_passes = 0;
    const double ms = simulate_batch_one(planner, h100, requests, tokens, 0, draft_passes);
    EXPECT_LE(draft_passes, 4) << ms / plain;
  }
  {
    DsparkPlanner planner(config, h100, 4, /*block_draft=*/true);
    int draft_passes = 0;
    const double ms = simulate_batch_one(planner, h100, requests, tokens, 60, draft_passes);
    EXPECT_LE(ms / plain, 1.0) << draft_passes << " draft passes";
  }
}

// Where another request drafts (its draft pass runs anyway), a request in fallback still probes every
// kProbeEveryFallbackSteps steps, even with the idle pass skipped: it can return when its confidence does.
TEST(DsparkTest, AFallbackProbeRidesOnAStepWhereAnotherRequestDrafts) {
  const StepTimes h100{table({{1, 0.30}, {8, 0.31}, {40, 0.40}}), table({{1, 0.25}, {8, 0.27}}),
                       table({{1, 0.06}, {8, 0.07}})};
  DsparkConfig config;
  DsparkPlanner planner(config, h100, 4, /*block_draft=*/true);
  for (int i = 0; i < 40; ++i) planner.on_verified(2, 4, 4);  // request 2's drafts are good
  for (int i = 0; i < DsparkConfig::kRollbacksToFallBack; ++i) planner.on_verified(1, 4, 0);
  ASSERT_TRUE(planner.in_fallback(1));
  int probes = 0, alone = 0;
  for (int step = 0; step < 4 * DsparkPlanner::kProbeEveryFallbackSteps; ++step) {
    planner.begin_drafting(2, 2, 2);
    ASSERT_TRUE(planner.skips_idle_draft_pass());
    probes += planner.max_drafts(1, 4);
    EXPECT_EQ(planner.max_drafts(2, 4), 4);
  }
  EXPECT_EQ(probes, 4);
  for (int step = 0; step < 4 * DsparkPlanner::kProbeEveryFallbackSteps; ++step) {
    planner.begin_drafting(1, 1, 1);  // request 1 alone
    alone += planner.max_drafts(1, 4);
  }
  EXPECT_EQ(alone, 0) << "alone, a probe would cost a whole draft pass to read stale entries";
}

TEST(DsparkTest, AcceptanceRatesFollowTheVerifiesAndTheDraftLengthFollowsThem) {
  // Costly draft passes: drafting pays only when the first draft is nearly always accepted; keeping the MTP KV
  // current costs 0.2 of 6.6 ms (3%), so it is kept and probes run.
  StepTimes costly{table({{1, 6.6}, {2, 6.8}, {8, 7.0}}), table({{1, 4.5}, {8, 6.0}}), table({{1, 0.2}, {8, 0.3}})};
  DsparkPlanner planner(DsparkConfig{}, costly, 2);
  for (int i = 0; i < 2000; ++i) planner.on_verified(1, 2, 2);  // everything accepted
  EXPECT_NEAR(planner.all_accepted_rate()[0], 1.0, 1e-3);
  planner.begin_drafting(1, 1, 1);
  EXPECT_EQ(planner.max_drafts(1, 2), 2) << "3 tokens per 6.8 + 2 * 4.5 ms beat 1 per 6.6 ms";
  for (int i = 0; i < 2000; ++i) planner.on_verified(1, 2, 0);  // nothing accepted (a rollback run: fallback)
  EXPECT_LT(planner.all_accepted_rate()[0], 0.01);
  planner.begin_drafting(1, 1, 1);
  EXPECT_EQ(planner.max_drafts(2, 2), 0) << "another request: not in fallback, but drafting does not pay";
  // After kProbeEverySteps steps without drafting, one step drafts a single token to measure again; then after
  // twice as many, four times, ... (the probes keep finding nothing here: no verify reports back).
  std::vector<int> probe_steps;
  for (int step = 1; step < DsparkPlanner::kProbeEverySteps * 7; ++step) {  // step 0 was the call above
    planner.begin_drafting(1, 1, 1);
    if (planner.max_drafts(2, 2) > 0) {
      probe_steps.push_back(step);
      EXPECT_EQ(planner.max_drafts(3, 2), 0) << "one request probes";
    }
  }
  const int first = DsparkPlanner::kProbeEverySteps - 1;
  EXPECT_EQ(probe_steps, (std::vector<int>{first, first + 2 * DsparkPlanner::kProbeEverySteps,
                                           first + 6 * DsparkPlanner::kProbeEverySteps}));
}

TEST(DsparkTest, TheIdleMtpPassIsSkippedOnlyWhereKeepingItCostsMoreThanAFewPercentOfTheStep) {
  const StepTimeTable verify = table({{1, 10.0}, {64, 20.0}}), draft = table({{1, 9.0}, {64, 12.0}});  // drafting never pays
  DsparkPlanner cheap(DsparkConfig{}, StepTimes{verify, draft, table({{1, 0.4}, {64, 3.0}})}, 2);
  cheap.begin_drafting(1, 1, 1);
  EXPECT_FALSE(cheap.skips_idle_draft_pass()) << "0.4 ms of a 10 ms step: the MTP KV stays current";
  DsparkPlanner costly(DsparkConfig{}, StepTimes{verify, draft, table({{1, 0.6}, {64, 9.0}})}, 2);
  costly.begin_drafting(1, 1, 1);
  EXPECT_TRUE(costly.skips_idle_draft_pass()) << "0.6 ms of a 10 ms step";
  // And then no probe ever: its draft would read stale entries.
  for (int step = 0; step < 4 * DsparkPlanner::kProbeEverySteps; ++step) {
    costly.begin_drafting(1, 1, 1);
    EXPECT_EQ(costly.max_drafts(1, 2), 0);
  }
  DsparkPlanner flat(DsparkConfig{}, StepTimes{}, 2);
  flat.begin_drafting(1, 1, 1);
  EXPECT_FALSE(flat.skips_idle_draft_pass()) << "const: nothing measured, nothing skipped";
}

}  // namespace
}  // namespace deepinfer::engine
