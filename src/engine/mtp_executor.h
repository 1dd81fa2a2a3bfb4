// The MTP executor: speculative decoding with the checkpoint's own next-n (MTP) layer as the draft model, in the
// "MTP Eagle" form (TensorRT-LLM): the one MTP layer chained K times, each step reading the previous step's hidden
// state and draft token. One step of the engine for a request that drafted last step:
//   1. verify: one target forward over [last token, d_1..d_m] (m = min(drafts, lookahead slots)) through the paged
//      MLA path, several rows per sequence, keeping every row's final hidden state (after model.norm);
//   2. accept (speculative.h): greedy requests keep drafts while they equal the target's argmax; sampled ones run
//      the rejection test; then one more token (the target's at the first rejection, or the bonus after all);
//   3. draft pass 1: the MTP layer over every computed row whose next token is now known (prefill chunks with
//      the next prompt token, the accepted rows with the accepted drafts and the new token), writing the MTP
//      layer's KV at those positions (its cache is one more layer of the paged cache: same block ids, so the
//      scheduler's rollback and the prefix cache carry it); the last row's logits give d'_1;
//   4. draft passes 2..K: one row per drafting request at the next position, reading the previous pass's hidden
//      state (after shared_head.norm) and draft; positions beyond the request's block table go to a scratch block
//      of the MTP cache (blocks num_blocks.. of it, one per row), which nothing else reads.
// Drafts wait in the request's state for the next step, which verifies them if it is that request's next decode
// (its entry ends where they begin); anything else (preemption, fewer slots) drops or trims them. Verification is
// exact whatever the drafts are, so a stale draft costs speed, never correctness.
// Draft distributions: greedy requests draft the MTP's argmax (q a point mass); sampled requests draw each draft
// from the MTP's distribution under the request's own sampling parameters (q), with philox kDraftStream.
// With a DSpark draft module (use_dspark_module; model/deepseek_model.h says what it computes) steps 3-4 are instead:
//   3'. inject: every computed row's target residuals (kept by the verify pass) into the module's stage caches (S more
//       layers of the paged cache, like the MTP layer's);
//   4'. one block pass for all drafting requests: gamma rows [anchor, noise...] each, from the anchor's position (the
//       last committed token); per request the drafts come out of the host heads in order (the Markov head reads the
//       previous draft), each with the confidence head's value, cut by the planner (DSpark's confidence rule).
// Known approximation (drafts only): a prefix-cache hit reuses the MTP entries its blocks hold, of which the last
// was written with the next token of the sequence that computed it (vLLM recomputes the last block for EAGLE).
#pragma once

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/dspark.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/speculative.h"
#include "deepinfer/model/deepseek_model.h"

namespace deepinfer::engine {

class MtpExecutor final : public Executor {
 public:
  // `layer_caches`: the model's num_hidden_layers caches ([num_blocks, 64, kv_cache_dim] each) followed by the MTP
  // layer's cache of num_blocks + max_num_seqs blocks (the last max_num_seqs are the chain's scratch blocks). Not
  // owned; must outlive the executor. REQUIRES: model.num_mtp_layers() >= 1, 1 <= num_draft_tokens <=
  // SpeculativeConfig::kMaxDraftTokens. `planner` may be null (fixed length).
  // With `use_dspark_module` (REQUIRES: model.config().dspark), the MTP layer's cache is replaced by the module's S
  // stage caches of num_blocks + max_num_seqs blocks each, and drafts come from the module (at most its block size).
  MtpExecutor(model::DeepSeekModel& model, std::span<const backend::Buffer> layer_caches, int32_t num_blocks,
              int32_t max_num_seqs, int32_t num_draft_tokens, std::unique_ptr<DraftPlanner> planner = nullptr,
              bool use_dspark_module = false);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override;
  void remove_request(SequenceId id) override;
  Result<StepOutput> run(const ScheduledBatch& batch) override;
  // The planner's counters (fallbacks) and the steps' phase times into `stats`.
  void add_counters(SpeculativeStats& stats) const {
    planner_->add_counters(stats);
    stats.phase_seconds = phase_seconds_;
  }

 private:
  struct RequestState {
    std::vector<TokenId> prompt;
    std::vector<TokenId> output;  // committed tokens (those the scheduler will keep, and any after a finish)
    SamplingParams params;
    RequestRng rng;
    // Drafts for the positions draft_position, draft_position + 1, ...; their distributions q (one per draft).
    std::vector<TokenId> drafts;
    std::vector<std::vector<TokenProbability>> draft_distributions;
    std::vector<double> draft_confidences;  // the planner's confidence of each draft (dspark.h)
    int64_t draft_position = -1;

    TokenId token_at(int64_t position) const;
    void clear_drafts();  // no drafts waiting (draft_position -1)
  };
  // The target's verdict on one sampling entry: its tokens (accepted drafts, then one more).
  Status verify_sampled(const ScheduledEntry& entry, RequestState& request, std::span<const float> logits,
                        int32_t num_drafts, std::vector<SampledToken>& tokens, int32_t& accepted);
  // The chain after the target pass: fills each drafting request's drafts. `rows_of_entry`: per entry, its first
  // target row and its computed rows (kept ones).
  Status draft(const ScheduledBatch& batch, std::span<const int32_t> first_rows, std::span<const int32_t> kept_rows);
  // Tells the planner this step's drafting requests (one per sampling entry), before either draft path.
  void begin_drafting(const ScheduledBatch& batch);
  // The same with the DSpark module (steps 3'-4').
  Status draft_block(const ScheduledBatch& batch, std::span<const int32_t> first_rows,
                     std::span<const int32_t> kept_rows);
  // A draft from an MTP logits row for `request` whose chain so far is `chain`, and its confidence (dspark.h).
  Status draft_from_logits(RequestState& request, std::span<const float> logits, std::span<const TokenId> chain,
                           TokenId& token, std::vector<TokenProbability>& distribution, double& confidence);

  model::DeepSeekModel& model_;
  std::span<const backend::Buffer> layer_caches_;  // main layers, then the MTP layer
  int32_t num_blocks_;
  int32_t max_num_seqs_;
  int32_t num_draft_tokens_;
  bool dspark_module_;
  std::unique_ptr<DraftPlanner> planner_;
  Sampler sampler_;
  std::map<SequenceId, RequestState> requests_;
  std::array<double, SpeculativeStats::kNumPhases> phase_seconds_{};  // SpeculativeStats::phase_seconds
  // Adds the time since `since` to `phase` and returns now.
  std::chrono::steady_clock::time_point lap(SpeculativeStats::Phase phase, std::chrono::steady_clock::time_point since);
  std::vector<float> logits_;
  std::vector<int32_t> greedy_ids_;
  std::vector<float> greedy_probabilities_;
  std::vector<float> block_hidden_, corrected_;  // the DSpark block pass's h rows; one draft row's logits
  std::vector<TokenId> penalty_window_;  // output + drafts of the row being sampled
};

}  // namespace deepinfer::engine
