// DSpark's verify-length planner, its step-time table and the rollback fallback (dspark.h).
#include "deepinfer/engine/dspark.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cmath>

namespace deepinfer::engine {

Result<StepTimeTable> StepTimeTable::create(std::vector<std::pair<int32_t, double>> points) {
  for (size_t i = 0; i < points.size(); ++i) {
    const auto& [tokens, ms] = points[i];
    if (tokens < 1 || !(ms > 0.0) || !std::isfinite(ms) || (i > 0 && tokens <= points[i - 1].first)) {
      return Status::invalid_argument("step-time table: point " + std::to_string(i) + " (" + std::to_string(tokens) +
                                      " tokens, " + std::to_string(ms) +
                                      " ms) is not ascending in tokens with a positive time");
    }
  }
  StepTimeTable table;
  table.points_ = std::move(points);
  return table;
}

StepTimeTable StepTimeTable::flat() { return StepTimeTable(); }

double StepTimeTable::milliseconds(int64_t tokens) const {
  if (points_.empty()) return 1.0;
  if (tokens <= points_.front().first) return points_.front().second;
  for (size_t i = 1; i < points_.size(); ++i) {
    const auto& [t1, ms1] = points_[i];
    if (tokens <= t1) {
      const auto& [t0, ms0] = points_[i - 1];
      return ms0 + (ms1 - ms0) * static_cast<double>(tokens - t0) / static_cast<double>(t1 - t0);
    }
  }
  const auto& [t_last, ms_last] = points_.back();
  double slope = 0.0;
  if (points_.size() >= 2) {
    const auto& [t0, ms0] = points_[points_.size() - 2];
    slope = std::max(0.0, (ms_last - ms0) / static_cast<double>(t_last - t0));
  }
  return ms_last + slope * static_cast<double>(tokens - t_last);
}

namespace {
boost::json::array points_json(const StepTimeTable& table) {
  boost::json::array points;
  for (const auto& [tokens, ms] : table.points()) points.push_back(boost::json::array{tokens, ms});
  return points;
}

Result<StepTimeTable> points_from_json(const boost::json::object& object, const char* key) {
  const boost::json::value* points = object.if_contains(key);
  if (points == nullptr || !points->is_array()) {
    return Status::invalid_argument(std::string("step-time file: no \"") + key + "\" array");
  }
  std::vector<std::pair<int32_t, double>> parsed;
  for (const boost::json::value& point : points->get_array()) {
    if (!point.is_array() || point.get_array().size() != 2 || !point.get_array()[0].is_int64() ||
        !point.get_array()[1].is_number()) {
      return Status::invalid_argument(std::string("step-time file: a point of \"") + key + "\" is not [rows, ms]");
    }
    parsed.emplace_back(static_cast<int32_t>(point.get_array()[0].get_int64()), point.get_array()[1].to_number<double>());
  }
  return StepTimeTable::create(std::move(parsed));
}
}  // namespace

std::string StepTimes::to_json(std::string_view identity) const {
  return boost::json::serialize(boost::json::object{{"identity", identity},
                                                    {"verify", points_json(verify)},
                                                    {"draft", points_json(draft)},
                                                    {"mtp_kv", points_json(mtp_kv)}});
}

Result<StepTimes> StepTimes::from_json(std::string_view text, std::string_view identity) {
  boost::system::error_code error;
  boost::json::value value = boost::json::parse(text, error);
  if (error || !value.is_object()) return Status::invalid_argument("step-time file: not a JSON object");
  const boost::json::object& object = value.get_object();
  const boost::json::value* id = object.if_contains("identity");
  if (id == nullptr || !id->is_string()) return Status::invalid_argument("step-time file: no \"identity\" string");
  if (id->get_string() != identity) {
    return Status::invalid_argument("step-time file: measured for '" + std::string(id->get_string()) +
                                    "', not for this engine ('" + std::string(identity) + "')");
  }
  Result<StepTimeTable> verify = points_from_json(object, "verify");
  if (!verify.ok()) return verify.status();
  Result<StepTimeTable> draft = points_from_json(object, "draft");
  if (!draft.ok()) return draft.status();
  Result<StepTimeTable> mtp_kv = points_from_json(object, "mtp_kv");
  if (!mtp_kv.ok()) return mtp_kv.status();
  return StepTimes{std::move(verify).value(), std::move(draft).value(), std::move(mtp_kv).value()};
}

int32_t plan_draft_length(int64_t base_tokens, int64_t committing, int64_t chains, int32_t max_draft_tokens,
                          std::span<const double> all_accepted_rate, const StepTimes& times, bool block_draft) {
  if (chains <= 0) return 0;
  // Keeping the draft's KV current: a DSpark module's injection pass runs in every step that drafts (before its
  // block pass); a step without drafts runs it (or the MTP layer's KV-only pass) only while it costs at most
  // kMaxKeepKvFraction of the step (DsparkPlanner::begin_drafting).
  const double plain = times.verify.milliseconds(base_tokens);
  const double kv = times.mtp_kv.empty() ? 0.0 : times.mtp_kv.milliseconds(chains);
  const double none = static_cast<double>(committing) /
                      (plain + (kv <= DsparkPlanner::kMaxKeepKvFraction * plain ? kv : 0.0));
  double best_rate = none, expected = static_cast<double>(committing);
  int32_t best = 0;
  for (int32_t length = 1; length <= max_draft_tokens && length <= static_cast<int32_t>(all_accepted_rate.size());
       ++length) {
    expected += static_cast<double>(chains) * std::clamp(all_accepted_rate[static_cast<size_t>(length - 1)], 0.0, 1.0);
    const double ms = times.verify.milliseconds(base_tokens + chains * length) +
                      (times.draft.empty() ? 0.0 : (block_draft ? 1 : length) * times.draft.milliseconds(chains)) +
                      (block_draft ? kv : 0.0);
    const double rate = expected / ms;
    if (rate > best_rate * (1.0 + 1e-9)) {
      best_rate = rate;
      best = length;
    }
  }
  return best;
}

double plan_verify(int64_t base_tokens, int64_t committing, const StepTimeTable& table,
                   std::span<VerifyRequest> requests) {
  constexpr double kSurvivalEps = 1e-6;  // SGLang's survival_eps
  struct Candidate {
    double survival;
    size_t request;
    int32_t index;
  };
  std::vector<Candidate> candidates;
  for (size_t r = 0; r < requests.size(); ++r) {
    requests[r].verify_drafts = 0;
    double survival = 1.0;
    for (size_t k = 0; k < requests[r].confidences.size(); ++k) {
      survival *= std::clamp(requests[r].confidences[k], 0.0, 1.0);
      if (!(survival >= kSurvivalEps)) break;
      candidates.push_back({survival, r, static_cast<int32_t>(k)});
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.survival > b.survival; });
  // tau(b) / ms(base + b) over b = 0..candidates.size(); the first maximum.
  double expected = static_cast<double>(committing);
  size_t best_b = 0;
  double best_rate = expected / table.milliseconds(base_tokens);
  for (size_t b = 1; b <= candidates.size(); ++b) {
    expected += candidates[b - 1].survival;
    const double rate = expected / table.milliseconds(base_tokens + static_cast<int64_t>(b));
    if (rate > best_rate) {
      best_rate = rate;
      best_b = b;
    }
  }
  // Survivals fall with the draft index, so each request's chosen drafts are its first ones (ties between equal
  // survivals of one request keep index order: stable sort).
  for (size_t b = 0; b < best_b; ++b) {
    VerifyRequest& request = requests[candidates[b].request];
    request.verify_drafts = std::max(request.verify_drafts, candidates[b].index + 1);
  }
  return best_rate * 1000.0;
}

DsparkPlanner::DsparkPlanner(DsparkConfig config, StepTimes times, int32_t max_draft_tokens, bool block_draft)
    : config_(std::move(config)), times_(std::move(times)), max_draft_tokens_(max_draft_tokens),
      block_draft_(block_draft) {
  constexpr double kPriorVerifies = 4.0, kPriorRate = 0.7;
  double rate = 1.0;
  for (int32_t k = 0; k < max_draft_tokens_; ++k) {
    rate *= kPriorRate;
    verified_at_.push_back(kPriorVerifies);
    all_accepted_at_.push_back(kPriorVerifies * rate);
  }
}

std::vector<double> DsparkPlanner::all_accepted_rate() const {
  std::vector<double> rates(verified_at_.size(), 0.0);
  for (size_t k = 0; k < rates.size(); ++k) rates[k] = verified_at_[k] > 0 ? all_accepted_at_[k] / verified_at_[k] : 0.0;
  return rates;
}

void DsparkPlanner::begin_drafting(int64_t base_tokens, int64_t committing, int64_t chains) {
  const std::vector<double> rates = all_accepted_rate();
  committing_ = committing;
  chains_ = chains;
  plain_ms_ = times_.verify.empty() ? 0.0 : times_.verify.milliseconds(base_tokens);
  // The guard's plain step is a decode step of this batch: one row per committing request (a step with prompt rows
  // is no sample, and its verify_ms(base_tokens) would make a plain decode step look slow).
  decode_ms_ = times_.verify.empty() ? 0.0 : times_.verify.milliseconds(committing > 0 ? committing : base_tokens);
  const double kv_ms = times_.mtp_kv.empty() ? 0.0 : times_.mtp_kv.milliseconds(chains);
  step_draft_length_ =
      plan_draft_length(base_tokens, committing, chains, max_draft_tokens_, rates, times_, block_draft_);
  measuring_plain_ = false;
  if (step_draft_length_ > 0 && all_greedy_ && drafting_samples_ >= kMinDraftSamples && decode_ms_ > 0.0) {
    if (drafting_rate_ < kGuardMargin * plain_rate()) {
      step_draft_length_ = 0;  // drafting steps delivered less than plain ones would
    } else if (plain_samples_ < kMinPlainSamples && measuring_plain_steps_ < kMaxPlainMeasuringSteps &&
               drafting_rate_ < kMeasurePlainBelow / decode_ms_) {
      // A close call on the table's word: plain steps are measured first (a few, once, until counted).
      step_draft_length_ = 0;
      measuring_plain_ = true;
      ++measuring_plain_steps_;
    }
  }
  probe_step_ = false;
  probe_taken_ = false;
  drafted_ = false;
  // A retry's kMinDraftSamples drafting steps cost at most kMaxRetryCost of the plain steps between retries.
  const double pass_ms = (times_.draft.empty() ? 0.0 : times_.draft.milliseconds(chains)) + kv_ms;
  min_retry_steps_ = plain_ms_ > 0.0 ? static_cast<int32_t>(std::min<double>(
                                           std::ceil(kMinDraftSamples * pass_ms / (kMaxRetryCost * plain_ms_)),
                                           kMaxRetryAfterPlainSteps))
                                     : 0;
  skip_idle_pass_ = !times_.mtp_kv.empty() && plain_ms_ > 0.0 && kv_ms > kMaxKeepKvFraction * plain_ms_;

  // No probes while the MTP KV is not kept current: drafts would read stale entries and measure nothing useful.
  if (step_draft_length_ == 0 && chains > 0 && !skip_idle_pass_ && ++steps_without_drafts_ >= probe_interval_) {
    probe_step_ = true;
    // Keep A_1 measured (a DSpark module's block pass makes every length at once: A_1..A_K, for a longer verify of
    // one request), less often while probing keeps showing that drafting does not pay (a probe step costs a draft
    // pass and a longer verify).
    step_draft_length_ = block_draft_ ? max_draft_tokens_ : 1;
    steps_without_drafts_ = 0;
    probe_interval_ = std::min(2 * probe_interval_, kMaxProbeInterval);
  } else if (step_draft_length_ > 0) {
    steps_without_drafts_ = 0;
    probe_interval_ = kProbeEverySteps;
  }
}

int32_t DsparkPlanner::max_drafts(SequenceId id, int32_t max_draft_tokens) {
  RequestState& state = state_[id];
  if (state.fallback) {
    // In fallback: one probe draft every kProbeEveryFallbackSteps steps, for its confidence (never verified). Where
    // the idle pass is skipped, only in a step whose draft pass runs anyway (a request not in fallback drafts:
    // chains_ counts this step's requests, requests_in_fallback_ every live one in fallback, so more chains than
    // that means at least one drafter); alone, a probe would cost a whole draft pass for a draft of stale entries.
    const bool pass_runs_anyway = step_draft_length_ > 0 && !probe_step_ && chains_ > requests_in_fallback_;
    if (probe_step_ || (skip_idle_pass_ && !pass_runs_anyway)) return 0;
    if (++state.steps_since_probe < kProbeEveryFallbackSteps) return 0;
    state.steps_since_probe = 0;
    drafted_ = drafted_ || max_draft_tokens > 0;
    return std::min(max_draft_tokens, 1);
  }
  if (probe_step_) {  // the first request asked probes; the others decode plainly
    if (probe_taken_) return 0;
    probe_taken_ = true;
  }
  const int32_t drafts = std::min(max_draft_tokens, step_draft_length_);
  drafted_ = drafted_ || drafts > 0;
  return drafts;
}

bool DsparkPlanner::continue_after(SequenceId id, int32_t index, double confidence) {
  RequestState& state = state_[id];
  const bool confident = confidence >= config_.confidence_threshold;
  if (state.fallback) {
    if (index == 0) {
      state.probes_in_a_row = confident ? state.probes_in_a_row + 1 : 0;
      if (state.probes_in_a_row >= DsparkConfig::kProbesToReturn) {
        state.fallback = false;
        state.probes_in_a_row = 0;
        state.rollbacks_in_a_row = 0;
        ++fallback_returns_;
        --requests_in_fallback_;
      }
    }
    return false;
  }
  return confident;
}

void DsparkPlanner::on_step(int64_t drafts_verified, int64_t committed, double milliseconds, bool steady) {
  spdlog::debug(
      "dspark step: L {} verified {} committed {} of {} requests in {:.3f} ms{}{}; drafting rate {:.3f} ({} "
      "samples) against a plain step's {:.3f} tokens/ms ({} measured); {} in fallback",
      step_draft_length_, drafts_verified, committed, committing_, milliseconds, steady ? "" : " (not steady)",
      probe_step_ ? " (probe)" : "", drafting_rate_, drafting_samples_, plain_rate(), plain_samples_,
      requests_in_fallback_);
  // The planner's own probe (begin_drafting) is not what the plan would draft: neither the step that made its drafts
  // nor the one that verified them is a sample of drafting (nor a plain step).
  const bool probing = (probe_step_ && drafted_) || probe_verify_pending_;
  probe_verify_pending_ = probe_step_ && drafted_;
  // The first step of a run of drafting steps (none made the step before, none in fallback to probe) pays a draft
  // pass with nothing to verify: its rate, one token per request, says nothing of the run's.
  const bool first_drafts = drafted_ && drafts_verified == 0 && !last_step_drafted_ && requests_in_fallback_ == 0;
  last_step_drafted_ = drafted_;
  if (times_.verify.empty() || !(milliseconds > 0.0) || !all_greedy_ || probing) return;  // 'const': no table
  // A drafting step: one that verified drafts or made some (a fallback probe included: its draft pass is in the
  // step's time). A step whose plan allowed drafts that nobody made (every request in fallback) is a plain one.
  const bool drafting = drafts_verified > 0 || drafted_;
  if (drafting && committing_ > 0) {
    // Prompt rows or graph recordings in its time, the run's first step, or a step kept plain to measure plain steps
    // that verifies the drafts before (a verify without a draft pass): no sample.
    if (!steady || measuring_plain_ || first_drafts) return;
    const double rate = static_cast<double>(committed) / (static_cast<double>(committing_) * milliseconds);
    drafting_rate_ = drafting_samples_ == 0 ? rate : drafting_rate_ + kStepTimeWeight * (rate - drafting_rate_);
    ++drafting_samples_;
    plain_steps_ = 0;
    if (drafting_samples_ >= kMinDraftSamples && decode_ms_ > 0.0 && drafting_rate_ >= kGuardMargin * plain_rate()) {
      retry_after_ = kRetryAfterPlainSteps;  // drafting pays: a later loss is retried soon
    }
  } else if (!drafting && committing_ > 0 && steady && decode_ms_ > 0.0) {
    // What a plain step delivered against the table's 1 / decode_ms_: the guard's reference (plain_rate).
    const double factor =
        std::clamp(static_cast<double>(committed) * decode_ms_ / (static_cast<double>(committing_) * milliseconds),
                   kMinPlainFactor, kMaxPlainFactor);
    plain_factor_ = plain_samples_ == 0 ? factor : plain_factor_ + kStepTimeWeight * (factor - plain_factor_);
    ++plain_samples_;
  }
  if (!drafting && ++plain_steps_ >= std::max(retry_after_, min_retry_steps_)) {
    drafting_samples_ = 0;
    plain_steps_ = 0;
    retry_after_ = std::min(2 * retry_after_, kMaxRetryAfterPlainSteps);  // unless this retry pays
  }
}

void DsparkPlanner::plan(int64_t base_tokens, int64_t committing, std::span<VerifyRequest> requests) {
  // Requests in fallback verify nothing (their one draft is a probe): no candidates of theirs enter the choice.
  for (VerifyRequest& request : requests) {
    if (in_fallback(request.id)) request.confidences.clear();
  }
  plan_verify(base_tokens, committing, times_.verify, requests);
  for (const VerifyRequest& request : requests) unverified_steps_ += request.verify_drafts == 0 ? 1 : 0;
}

void DsparkPlanner::on_verified(SequenceId id, int32_t verified, int32_t accepted) {
  if (verified <= 0) return;
  // The running acceptance rates, decayed so that they follow the batch (about the last 200 verifies).
  constexpr double kDecay = 0.995;
  for (size_t k = 0; k < verified_at_.size(); ++k) {
    verified_at_[k] *= kDecay;
    all_accepted_at_[k] *= kDecay;
    if (static_cast<int32_t>(k) < verified) {
      verified_at_[k] += 1.0;
      all_accepted_at_[k] += static_cast<int32_t>(k) < accepted ? 1.0 : 0.0;
    }
  }
  RequestState& state = state_[id];
  if (state.fallback) return;
  const double rolled_back = static_cast<double>(verified - accepted) / static_cast<double>(verified);
  if (rolled_back > config_.abort_on_rollback_rate) {
    if (++state.rollbacks_in_a_row >= DsparkConfig::kRollbacksToFallBack) {
      state.fallback = true;
      state.rollbacks_in_a_row = 0;
      state.probes_in_a_row = 0;
      ++fallbacks_;
      ++requests_in_fallback_;
    }
  } else {
    state.rollbacks_in_a_row = 0;
  }
}

bool DsparkPlanner::in_fallback(SequenceId id) const {
  auto it = state_.find(id);
  return it != state_.end() && it->second.fallback;
}

double DsparkPlanner::plain_rate() const {
  if (!(decode_ms_ > 0.0)) return 0.0;
  return (plain_samples_ >= kMinPlainSamples ? plain_factor_ : 1.0) / decode_ms_;
}

void DsparkPlanner::add_counters(SpeculativeStats& stats) const {
  stats.fallbacks = fallbacks_;
  stats.fallback_returns = fallback_returns_;
  stats.unverified_steps = unverified_steps_;
  stats.requests_in_fallback = requests_in_fallback_;
}

void DsparkPlanner::on_removed(SequenceId id) {
  auto it = state_.find(id);
  if (it == state_.end()) return;
  if (it->second.fallback) --requests_in_fallback_;
  state_.erase(it);
}

}  // namespace deepinfer::engine
