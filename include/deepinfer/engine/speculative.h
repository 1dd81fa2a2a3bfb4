// Speculative decoding: its configuration (`--speculative-algorithm mtp --speculative-num-draft-tokens K`, as vLLM
// and SGLang users know them), its counters, and the acceptance rule that keeps the output exact.
//   Greedy requests: a draft is accepted while it equals the target's greedy token; the output is token-identical
//   to plain decoding.
//   Sampled requests: standard speculative sampling (Leviathan, Kalman, Matias, "Fast Inference from Transformers
//   via Speculative Decoding", ICML 2023, §2.3 and Appendix A.1; Chen et al., "Accelerating Large Language Model
//   Decoding with Speculative Sampling", 2023, Algorithm 2): a draft x drawn from the draft distribution q is kept
//   with probability min(1, p(x) / q(x)), else the token is drawn from normalize(max(0, p - q)); each emitted token
//   is then distributed exactly as p, the target's final distribution (the sampler's, after penalties, logit_bias,
//   temperature, top-k/top-p/min-p).
// The MTP executor (src/engine/mtp_executor.cpp) drafts and verifies; the scheduler reserves the slots and rolls
// back the rejected drafts' KV (scheduler.h).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/sampler.h"

namespace deepinfer::engine {

enum class SpeculativeAlgorithm {
  kNone,    // plain decoding
  kMtp,     // the checkpoint's next-n (MTP) layer, chained num_draft_tokens times (TensorRT-LLM's "MTP Eagle")
  kDspark,  // the same drafts under DSpark's planner (dspark.h): per-request verify length from the drafts'
            // confidence and a measured step-time table, chains cut at low confidence, a rollback fallback
};

// "mtp" -> kMtp, "dspark" -> kDspark, "none" / "" -> kNone (any case: vLLM writes mtp, SGLang MTP / DSPARK). Errors:
// InvalidArgument naming the accepted values.
Result<SpeculativeAlgorithm> parse_speculative_algorithm(const std::string& name);

// DSpark's knobs, the seed's flags: --dspark-enable --dspark-confidence-threshold 0.85 --dspark-max-draft-tokens 6
// --dspark-abort-on-rollback-rate 0.30 (dspark.h says what each does).
struct DsparkConfig {
  // A draft chain stops after a draft whose confidence is below this (that draft is still offered to the planner);
  // a request in fallback returns after kProbesToReturn consecutive probe drafts at or above it. In [0, 1].
  double confidence_threshold = 0.85;
  // A verify that rejects more than this fraction of its drafts is a rollback; kRollbacksToFallBack consecutive
  // rollbacks put the request on plain decoding (the seed's "three consecutive rollbacks"). In (0, 1].
  double abort_on_rollback_rate = 0.30;
  static constexpr int32_t kRollbacksToFallBack = 3;
  static constexpr int32_t kProbesToReturn = 3;
  // Where the step-time table lives: a JSON file loaded when it was measured for this engine (`identity`), else
  // measured at startup and written there; "const": a flat table (every step the same time: verify every draft,
  // SGLang's "const"); "": measured, not written.
  std::string step_time_table;
  // What makes a table valid for this engine (checkpoint fingerprint, backend and device, threads, weights); the
  // file records it and a table of another identity is measured again.
  std::string identity;
};

struct SpeculativeConfig {
  SpeculativeAlgorithm algorithm = SpeculativeAlgorithm::kNone;
  // Drafts per request per step (K; with DSpark, --dspark-max-draft-tokens). The scheduler reserves this many
  // lookahead slots; a step verifies fewer where the token budget, max_tokens or the free blocks leave less room,
  // or (DSpark) where the planner says they do not pay.
  int32_t num_draft_tokens = 0;
  DsparkConfig dspark;  // read with kDspark only
  // The most drafts a step may verify for one request (a chain longer than one KV block is not supported).
  static constexpr int32_t kMaxDraftTokens = 16;

  bool enabled() const { return algorithm != SpeculativeAlgorithm::kNone; }
  // Ok, or InvalidArgument naming the flag: --speculative-num-draft-tokens must be in [1, kMaxDraftTokens] with an
  // algorithm (and 0 without one); FailedPrecondition-style InvalidArgument when the algorithm needs MTP layers and
  // `num_nextn_predict_layers` (the checkpoint's config.json) is 0 (DSpark: and the checkpoint has no DSpark draft
  // module, `has_dspark_module`).
  Status validate(int64_t num_nextn_predict_layers, bool has_dspark_module = false) const;
};

// Lifetime counters of speculative decoding, summed over requests. A "verify" is one request's sampling entry in a
// step that checked at least one draft. Counts are of the executor's verdicts, before a stop token or max_tokens
// trims the kept tokens.
struct SpeculativeStats {
  int64_t draft_tokens = 0;     // drafts the target checked
  int64_t accepted_tokens = 0;  // of those, accepted
  int64_t verifies = 0;
  int64_t emitted_tokens = 0;  // tokens the verifies produced (accepted + one each): mean accepted length =
                               // emitted_tokens / verifies
  // DSpark: requests put on plain decoding by consecutive rollbacks, requests that came back from it, and the
  // requests on plain decoding now.
  int64_t fallbacks = 0, fallback_returns = 0, requests_in_fallback = 0;
  // DSpark: a drafting request's steps where the planner verified none of its drafts (plain decoding that step,
  // fallbacks included).
  int64_t unverified_steps = 0;
  // Per draft position i (0-based: the i+1-th draft of a verify): drafts checked there, and accepted there.
  std::vector<int64_t> drafted_by_position, accepted_by_position;
  // verify_length_counts[n]: verifies of n tokens (the last token plus n - 1 drafts), n in [2, K + 1].
  std::vector<int64_t> verify_length_counts;
  // Wall time of the speculative steps by phase (seconds, cumulative; the step thread's view, so a phase includes
  // waiting for the device work it reads back): the target pass (verify; its read-back of ids or logits), acceptance
  // and commit on the host, the draft passes (the MTP chain with its host work, or DSpark's injection and block
  // passes), and DSpark's draft heads on the host (Markov and confidence heads, the planner's cut, sampled drafts).
  enum Phase { kTargetPass, kAcceptance, kDraftPasses, kDraftHeads, kNumPhases };
  static constexpr const char* kPhaseNames[kNumPhases] = {"target_pass", "acceptance", "draft_passes", "draft_heads"};
  std::array<double, kNumPhases> phase_seconds{};

  // Counts one verify of `drafts` drafts of which `accepted` were accepted. REQUIRES: 1 <= drafts, accepted <= drafts.
  void record(int32_t drafts, int32_t accepted);
};

// Stream ids of philox_uniform (sampler.h) that speculative decoding draws from, besides kSamplingStream (the
// residual and the bonus token use it, at the same counter as plain sampling would):
inline constexpr uint32_t kAcceptanceStream = 1;  // the acceptance test's uniform
inline constexpr uint32_t kDraftStream = 2;       // a sampled draft

// The first token of `distribution` (ascending ids, probabilities summing to ~1) whose cumulative probability
// exceeds u * total, the sampler's inverse-CDF rule; the last token with positive probability when rounding leaves
// none. REQUIRES: some probability > 0, u in [0, 1).
TokenId draw_from(std::span<const TokenProbability> distribution, double u);

struct DraftVerdict {
  bool accepted = false;
  TokenId token_id = 0;  // the draft when accepted, else the token drawn from the residual
};

// One step of speculative sampling for the token at counter `counter` (the number of tokens the request has emitted
// before it) of a request seeded `seed`: `target` is p, `draft_distribution` q (both ascending ids, each summing to
// ~1; q(draft) > 0), `draft` the draft token x ~ q. Accepts when philox_uniform(seed, counter, kAcceptanceStream) <
// p(x) / q(x); otherwise draws from normalize(max(0, p - q)) with philox_uniform(seed, counter, kSamplingStream)
// (from p itself in the measure-zero case where rounding leaves the residual empty). Deterministic in its arguments.
// A point-mass p (greedy) accepts exactly when x is its token and otherwise returns it.
DraftVerdict verify_draft(std::span<const TokenProbability> target,
                          std::span<const TokenProbability> draft_distribution, TokenId draft, uint64_t seed,
                          uint64_t counter);

}  // namespace deepinfer::engine
