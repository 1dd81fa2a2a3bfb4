// DSpark's scheduling half (deepseek-v4-spec.md §5.2; SGLang's dspark_verify_planner.py and dspark_scheduler.py):
// each step, how many of its drafts each request verifies, chosen for the whole batch so that the expected
// committed tokens per second is largest — the seed's "1.6x at batch 1, 0.9x at batch 32" is what it prevents:
// where another verified row costs more time than its chance of being accepted pays back, it is not verified.
//
//   Survival of request i's k-th draft: S_ik = conf_i1 * ... * conf_ik (the chance that drafts 1..k all pass).
//   With N committing requests and base_tokens rows the step computes anyway, verifying the b drafts of largest
//   survival commits tau(b) = N + (sum of those b survivals) tokens in expected value, in step_ms(base_tokens + b)
//   milliseconds (a StepTimeTable measured on the running backend). b* = argmax tau(b) / step_ms(base_tokens + b);
//   request i verifies its drafts among those b* (survivals fall with k, so they are its first ones).
//   Before drafting, the chain length L of the step is chosen the same way, with the draft passes' measured time
//   and the running acceptance rates (plan_draft_length): drafting stops where it would not pay. A step without
//   drafts still runs the MTP layer over its rows (keeping the draft's KV current) unless that alone costs more than
//   5% of the step.
//   A request whose drafts keep being rejected (DsparkConfig::kRollbacksToFallBack verifies in a row rejecting more
//   than --dspark-abort-on-rollback-rate of their drafts) falls back to plain decoding: it verifies nothing and
//   drafts one probe every few steps (its confidence only); after DsparkConfig::kProbesToReturn probes in a row at or above
//   --dspark-confidence-threshold it drafts again.
// Confidence: a DSpark module's confidence head when the checkpoint has one (model/deepseek_model.h); else the draft
// distribution's top-1 probability (the MTP layer's softmax for a greedy request, its own sampling distribution for a
// sampled one) — the MTP-only checkpoint form.
// The drafts being verified were made at the end of the previous step with their confidences known, so nothing is
// lagged (SGLang lags them one step for its overlap scheduler).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/sequence.h"
#include "deepinfer/engine/speculative.h"

namespace deepinfer::engine {

// Milliseconds of a target forward pass against the rows it computes (tokens per step -> ms), measured on the
// running backend at startup (Engine::create) or loaded from its file. Immutable once built; thread-compatible.
class StepTimeTable {
 public:
  StepTimeTable() = default;
  // `points`: (tokens, ms), tokens ascending and >= 1, ms > 0. Errors: InvalidArgument.
  static Result<StepTimeTable> create(std::vector<std::pair<int32_t, double>> points);
  // Every step the same time (SGLang's "const" table): the planner then verifies every draft.
  static StepTimeTable flat();
  // Piecewise linear between points; the first point's time below it; beyond the last, the last segment's slope
  // (never decreasing). An empty table is flat.
  double milliseconds(int64_t tokens) const;
  const std::vector<std::pair<int32_t, double>>& points() const { return points_; }
  bool empty() const { return points_.empty(); }

 private:
  std::vector<std::pair<int32_t, double>> points_;
};

// What the planner knows of this machine: the target pass against its rows (verify) and one draft pass against the
// requests drafting (MTP: each chain's next draft, logits row included; a DSpark module: the block pass, all of a
// request's drafts at once). Both empty: "const" (drafting and verifying look free).
struct StepTimes {
  StepTimeTable verify, draft;
  // What keeping the draft's KV current costs when nobody drafts, against the step's rows: the MTP pass without
  // logits, or a DSpark module's injection pass.
  StepTimeTable mtp_kv;
  // {"identity": ..., "verify": [[rows, ms], ...], "draft": [[rows, ms], ...], "mtp_kv": [[rows, ms], ...]}.
  std::string to_json(std::string_view identity) const;
  // Errors: InvalidArgument when the text is not such a file, or was measured for another identity (named).
  static Result<StepTimes> from_json(std::string_view text, std::string_view identity);
};

// One drafting request of a step, for plan_verify.
struct VerifyRequest {
  SequenceId id = 0;
  std::vector<double> confidences;  // of its drafts in order (each in [0, 1]); their count is the most it may verify
  int32_t verify_drafts = 0;        // out: how many of its first drafts to verify (0: plain decoding this step)
};

// The batch-wide choice above. `base_tokens`: the rows the step computes without drafts (prompt chunks, one per
// decode); `committing`: the requests that commit at least one token this step (N). Survivals below 1e-6 are never
// verified. Returns the expected committed tokens per second of the choice. Deterministic (ties: the earlier
// request, the lower draft index).
double plan_verify(int64_t base_tokens, int64_t committing, const StepTimeTable& verify_times,
                   std::span<VerifyRequest> requests);

// How long the chains drafted this step may be (0..max_draft_tokens), for the whole batch: the L maximising
// (committing + chains * sum_{k<=L} A_k) / (verify_ms(base_tokens + chains * L) + L * draft_ms(chains)) (with a
// `block_draft`, a DSpark module's, one block pass makes every length: draft_ms(chains) once, plus its injection
// pass, mtp_kv_ms(chains), which every drafting step runs), where A_k is the running rate at which drafts 1..k were
// all accepted; L = 0 costs verify_ms(base_tokens), plus mtp_kv_ms(chains) where the idle pass is kept. Drafting
// pays only where it buys more tokens than the draft passes and the longer verify cost; on a machine where a draft
// pass costs as much as a step (a CPU with a large vocabulary head, or a tiny model whose step is a few launches)
// that is L = 0: plain decoding; the MTP layer's
// pass still keeps its KV current unless that costs more than DsparkPlanner::kMaxKeepKvFraction of the step.
int32_t plan_draft_length(int64_t base_tokens, int64_t committing, int64_t chains, int32_t max_draft_tokens,
                          std::span<const double> all_accepted_rate, const StepTimes& times, bool block_draft = false);

// How long each request's draft chain is and how much of it a step verifies: the MTP executor's seam
// (mtp_executor.h). The default drafts and verifies the maximum (plain MTP). Called on the step thread only.
class DraftPlanner {
 public:
  virtual ~DraftPlanner() = default;
  // Before the step's chains: `chains` requests may draft after a target pass of `base_tokens` rows in which
  // `committing` requests commit tokens.
  virtual void begin_drafting(int64_t /*base_tokens*/, int64_t /*committing*/, int64_t /*chains*/) {}
  // Before request `id`'s chain: how many drafts at most (0..max_draft_tokens).
  virtual int32_t max_drafts(SequenceId /*id*/, int32_t max_draft_tokens) { return max_draft_tokens; }
  // After its draft number `index` (0-based) of confidence `confidence` (dspark.h's rule; computed only when
  // wants_confidence()): whether to draft another (the executor also stops at max_drafts).
  virtual bool continue_after(SequenceId /*id*/, int32_t /*index*/, double /*confidence*/) { return true; }
  virtual bool wants_confidence() const { return false; }
  // Whether a step in which no request drafts may skip the MTP layer's pass over its rows (their MTP KV entries
  // then stay stale; drafts read them later). Plain MTP keeps them exact: false.
  virtual bool skips_idle_draft_pass() const { return false; }
  // Before the target pass: how many of each drafting request's drafts to verify (VerifyRequest::verify_drafts,
  // preset to all of them). `base_tokens` and `committing` as plan_verify's.
  virtual void plan(int64_t /*base_tokens*/, int64_t /*committing*/, std::span<VerifyRequest> /*requests*/) {}
  // After acceptance: request `id` verified `verified` drafts (0 when plan chose none) and accepted `accepted`.
  virtual void on_verified(SequenceId /*id*/, int32_t /*verified*/, int32_t /*accepted*/) {}
  virtual void on_removed(SequenceId /*id*/) {}
  // After the whole step (target pass, acceptance, the next step's draft passes): it verified `drafts_verified`
  // drafts, committed `committed` tokens, and took `milliseconds` of wall time. `steady`: a decode step (one row per
  // request besides its drafts: no prompt rows) during which the backend recorded no graphs
  // (Backend::graph_recordings): its time is the steady state's, which timing rules may learn from.
  virtual void on_step(int64_t /*drafts_verified*/, int64_t /*committed*/, double /*milliseconds*/, bool /*steady*/) {}
  // Before begin_drafting: whether every request committing this step decodes greedily (plain greedy sampling).
  virtual void set_all_greedy(bool /*all_greedy*/) {}
  // Counters for SpeculativeStats (fallbacks, fallback_returns, requests_in_fallback).
  virtual void add_counters(SpeculativeStats& /*stats*/) const {}
};

// DSpark's planner over a draft whose confidence is its top-1 probability (the rules at the top of this file).
class DsparkPlanner final : public DraftPlanner {
 public:
  // `max_draft_tokens`: K, the longest chain. `block_draft`: the drafts come from a DSpark module's block pass (one
  // pass whatever the length) instead of chained MTP passes.
  DsparkPlanner(DsparkConfig config, StepTimes times, int32_t max_draft_tokens, bool block_draft = false);

  void begin_drafting(int64_t base_tokens, int64_t committing, int64_t chains) override;
  int32_t max_drafts(SequenceId id, int32_t max_draft_tokens) override;
  bool continue_after(SequenceId id, int32_t index, double confidence) override;
  bool wants_confidence() const override { return true; }
  bool skips_idle_draft_pass() const override { return skip_idle_pass_; }
  void plan(int64_t base_tokens, int64_t committing, std::span<VerifyRequest> requests) override;
  void on_verified(SequenceId id, int32_t verified, int32_t accepted) override;
  void on_removed(SequenceId id) override;
  // The table is measured at startup on even, decode-shaped passes; serving steps are not (verify rows spread
  // unevenly over the sequences, new shapes warming up, a per-request verify cut that does not reach the acceptance
  // rates). So the planner also counts what drafting steps delivered: their committed tokens per committing request
  // per ms of wall time (exponential average, weight kStepTimeWeight) of steady steps only (on_step): a step with
  // prompt rows takes longer for them, and a step that recorded CUDA graphs (a new verify or block shape's first
  // two runs: eager, then the capture) several times a replay's time; the average, seeded by its first sample, would
  // keep either for tens of steps. Once kMinDraftSamples drafting steps are
  // counted, a step does not draft while that rate is below kGuardMargin x a plain step's (plain_rate()); the count
  // restarts after kRetryAfterPlainSteps plain steps, twice as many after each retry that
  // keeps losing (up to kMaxRetryAfterPlainSteps), back to kRetryAfterPlainSteps once drafting pays, and never sooner
  // than the retry's kMinDraftSamples draft passes (draft_ms + mtp_kv_ms of the step's chains) cost kMaxRetryCost of
  // the plain steps between (a tiny model whose draft pass costs a step: ~320 steps). A drafting step
  // is one that verified drafts or made some (fallback probes included); a step in which every request is in
  // fallback and none probes is a plain one, so a new request starts from that verdict instead of drafting until it
  // rolls back. Only that clear loss stops drafting
  // (the margin): where drafting pays, the choice of L stays the table's, so that a seeded request's verify
  // lengths, and with them its sampled tokens, do not follow the machine's timing noise. For the same reason the
  // rule counts, and acts on, only steps whose committing requests are all greedy (set_all_greedy): greedy tokens
  // are the same whatever is verified; a seeded sampled request's are the same only for the same verify lengths.
  void on_step(int64_t drafts_verified, int64_t committed, double milliseconds, bool steady) override;
  void set_all_greedy(bool all_greedy) override { all_greedy_ = all_greedy; }
  static constexpr double kStepTimeWeight = 0.2;
  static constexpr double kGuardMargin = 0.95;
  static constexpr int32_t kMinDraftSamples = 3;
  // A plain step's rate, in committed tokens per committing request per ms: the table's 1 / verify_ms(committing)
  // times what steady plain steps delivered against it (their exponential average, weight kStepTimeWeight, clamped
  // to [kMinPlainFactor, kMaxPlainFactor]) once kMinPlainSamples are counted, the table's alone before. The table
  // is timed on passes alone; a serving step's wall time also holds sampling, the MTP KV pass and the host's work,
  // and overlaps some of it (the demo model on an H100 at batch 1: a 0.26 ms verify of one row in the table, 0.24
  // ms a plain step, so drafting at 0.86x of plain decoding looked like 0.92x of the table's plain step and went
  // on). Where drafting has not yet been seen beside plain steps and the verdict is close (the drafting rate below
  // kMeasurePlainBelow x the table's plain rate), steps do not draft until kMinPlainSamples plain steps are counted
  // (at most kMaxPlainMeasuringSteps such steps in the planner's life; later plain steps keep the average current).
  double plain_rate() const;
  static constexpr int32_t kMinPlainSamples = 3;
  static constexpr int32_t kMaxPlainMeasuringSteps = 8;
  static constexpr double kMeasurePlainBelow = 1.25;
  static constexpr double kMinPlainFactor = 0.5, kMaxPlainFactor = 2.0;
  static constexpr int32_t kRetryAfterPlainSteps = 100;
  static constexpr int32_t kMaxRetryAfterPlainSteps = 1600;
  static constexpr double kMaxRetryCost = 0.01;
  double drafting_rate() const { return drafting_rate_; }
  void add_counters(SpeculativeStats& stats) const override;

  const StepTimes& times() const { return times_; }
  bool in_fallback(SequenceId id) const;
  // A_k (k = 1..K): the decayed rate at which a verify of at least k drafts accepted drafts 1..k.
  std::vector<double> all_accepted_rate() const;
  // Steps in a row without drafting after which one step drafts a single token for one request anyway, so that A_1
  // keeps being measured (the batch's acceptance may have changed; with a DSpark module the whole block, which its
  // one pass makes anyway: A_1..A_K, else a pessimistic prior on the later positions could keep a good module from
  // ever drafting); doubled after each such probe up to kMaxProbeInterval, back to kProbeEverySteps once drafting
  // pays again. Neither a probe's step nor the step verifying it is a sample of the drafting rate (on_step).
  static constexpr int32_t kProbeEverySteps = 16;
  static constexpr int32_t kMaxProbeInterval = 512;
  // A step where nobody drafts skips the MTP pass when keeping its KV current would cost more than this fraction of
  // the step (mtp_kv_ms(chains) against verify_ms(base_tokens): a tiny model, a few-layer slice; a full DeepSeek-V3
  // has 1 MTP layer to 61). Then there are no probes either (their drafts would read stale entries): speculation
  // costs nothing and stays off until the batch changes to where keeping the KV is cheap again; drafts made after
  // that read the stale entries of the skipped positions (worse drafts, never wrong tokens).
  static constexpr double kMaxKeepKvFraction = 0.05;
  // A request in fallback drafts its probe every this many steps (a probe costs a draft pass's logits row). Where
  // the idle pass is skipped (kMaxKeepKvFraction), only in steps where a request not in fallback drafts, so that the
  // draft pass runs anyway: at batch 1 a probe alone would cost a whole draft pass (on the H100's demo model, 0.31
  // ms against a 0.28 ms step) to read stale entries.
  static constexpr int32_t kProbeEveryFallbackSteps = 4;

 private:
  struct RequestState {
    int32_t rollbacks_in_a_row = 0;
    bool fallback = false;
    int32_t probes_in_a_row = 0;  // in fallback: probe drafts at or above the threshold, in a row
    int32_t steps_since_probe = 0;
  };
  DsparkConfig config_;
  StepTimes times_;
  int32_t max_draft_tokens_;
  bool block_draft_;
  int32_t step_draft_length_ = 0;  // this step's L (begin_drafting)
  int32_t steps_without_drafts_ = 0;
  int32_t probe_interval_ = kProbeEverySteps;
  bool probe_step_ = false;  // this step only probes: one request drafts (one token; a block with a DSpark module)
  bool probe_verify_pending_ = false;  // the last step made a probe's drafts: this one verifies them
  bool skip_idle_pass_ = false;
  int64_t committing_ = 0;              // this step's committing requests (begin_drafting)
  double drafting_rate_ = 0.0;          // committed tokens per committing request per ms of drafting steps
  int32_t drafting_samples_ = 0;
  int32_t plain_steps_ = 0;             // since the last drafting step
  double plain_factor_ = 1.0;           // steady plain steps' rate against the table's (plain_rate)
  int32_t plain_samples_ = 0;
  int32_t measuring_plain_steps_ = 0;   // steps kept plain to measure plain_factor_ (begin_drafting)
  bool measuring_plain_ = false;        // this step is one of them
  bool last_step_drafted_ = false;      // the step before made drafts (on_step)
  bool all_greedy_ = true;              // this step's committing requests (set_all_greedy)
  bool probe_taken_ = false;
  bool drafted_ = false;                // some max_drafts of this step returned drafts (probes included)
  int64_t chains_ = 0;                  // this step's requests that may draft (begin_drafting)
  double plain_ms_ = 0.0;               // verify_ms(base_tokens) of this step: a plain step's time
  double decode_ms_ = 0.0;              // verify_ms(committing): a plain decode step of this batch (the guard's)
  int32_t retry_after_ = kRetryAfterPlainSteps;
  int32_t min_retry_steps_ = 0;         // this step's floor of retry_after_ (begin_drafting)
  // Decayed counts per draft position k: verifies that checked k drafts or more, and those that accepted 1..k.
  // Seeded with a prior of 4 verifies accepting at 0.7^k, so that drafting starts before anything is measured.
  std::vector<double> verified_at_, all_accepted_at_;
  std::map<SequenceId, RequestState> state_;
  int64_t fallbacks_ = 0, fallback_returns_ = 0, unverified_steps_ = 0, requests_in_fallback_ = 0;
};

}  // namespace deepinfer::engine
