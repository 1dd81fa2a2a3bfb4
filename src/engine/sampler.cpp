// SamplingParams::validate, the Philox generator, and the CPU sampler (see sampler.h for the order of
// operations and the exact meaning of every knob).
#include "deepinfer/engine/sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>

namespace deepinfer::engine {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
// top-k uses a heap pass when k * kSmallTopKFactor <= vocab, nth_element otherwise.
constexpr size_t kSmallTopKFactor = 8;
// top-p sorts all candidates when there are at most this many; otherwise it bins them first.
constexpr size_t kSortWholeTopPBelow = 1024;
// top-p histogram: quarter-nat bins up to 64 nats below the maximum (weight e^-64), the last bin open-ended.
constexpr int kTopPBinsPerNat = 4;
constexpr int kTopPBins = 256;

std::string format_number(double value) {
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

// True when lo <= value <= hi; false for NaN.
bool in_closed_range(float value, float lo, float hi) { return value >= lo && value <= hi; }

Status check_token_id(TokenId id, int64_t vocab_size, const std::string& what) {
  if (id < 0 || id >= vocab_size) {
    return Status::invalid_argument(what + " = " + std::to_string(id) + " is not a token id: must be in [0, " +
                                    std::to_string(vocab_size) + ")");
  }
  return Status();
}

bool penalties_active(const SamplingParams& params) {
  return params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f;
}

}  // namespace

// ---- SamplingParams ------------------------------------------------------------------------------------

Status SamplingParams::validate(int64_t vocab_size) const {
  if (vocab_size <= 0) return Status::invalid_argument("vocab_size must be > 0, got " + std::to_string(vocab_size));
  if (!(temperature >= 0.0f) || std::isinf(temperature)) {
    return Status::invalid_argument("temperature must be a finite number >= 0 (0 means greedy), got " +
                                    format_number(temperature));
  }
  if (top_k < -1) {
    return Status::invalid_argument("top_k must be -1 or 0 (off) or >= 1, got " + std::to_string(top_k));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return Status::invalid_argument("top_p must be in (0, 1] (1 means off), got " + format_number(top_p));
  }
  if (!in_closed_range(min_p, 0.0f, 1.0f)) {
    return Status::invalid_argument("min_p must be in [0, 1] (0 means off), got " + format_number(min_p));
  }
  if (!(repetition_penalty > 0.0f) || std::isinf(repetition_penalty)) {
    return Status::invalid_argument("repetition_penalty must be a finite number > 0 (1 means off), got " +
                                    format_number(repetition_penalty));
  }
  if (!in_closed_range(presence_penalty, -2.0f, 2.0f)) {
    return Status::invalid_argument("presence_penalty must be in [-2, 2], got " + format_number(presence_penalty));
  }
  if (!in_closed_range(frequency_penalty, -2.0f, 2.0f)) {
    return Status::invalid_argument("frequency_penalty must be in [-2, 2], got " + format_number(frequency_penalty));
  }
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return Status::invalid_argument("logit_bias key " + std::to_string(id) + " is not a token id: must be in [0, " +
                                      std::to_string(vocab_size) + ")");
    }
    if (!std::isfinite(bias)) {
      return Status::invalid_argument("logit_bias[" + std::to_string(id) + "] must be a finite number, got " +
                                      format_number(bias));
    }
  }
  if (reasoning_budget) {
    if (*reasoning_budget < 0) {
      return Status::invalid_argument("reasoning_budget must be >= 0, got " + std::to_string(*reasoning_budget));
    }
    if (reasoning_end_token_ids.empty()) {
      return Status::invalid_argument("reasoning_budget needs reasoning_end_token_ids (the token that ends reasoning)");
    }
    for (size_t i = 0; i < reasoning_end_token_ids.size(); ++i) {
      Status status =
          check_token_id(reasoning_end_token_ids[i], vocab_size, "reasoning_end_token_ids[" + std::to_string(i) + "]");
      if (!status.ok()) return status;
    }
  }
  if (!forced_output_choices.empty() && !forced_output_prefix.empty()) {
    return Status::invalid_argument("forced_output_choices and forced_output_prefix are exclusive");
  }
  for (size_t c = 0; c < forced_output_choices.size(); ++c) {
    const std::string where = "forced_output_choices[" + std::to_string(c) + "]";
    if (forced_output_choices[c].empty()) return Status::invalid_argument(where + " is empty");
    for (size_t i = 0; i < forced_output_choices[c].size(); ++i) {
      Status status = check_token_id(forced_output_choices[c][i], vocab_size, where + "[" + std::to_string(i) + "]");
      if (!status.ok()) return status;
    }
  }
  for (size_t i = 0; i < forced_output_prefix.size(); ++i) {
    Status status = check_token_id(forced_output_prefix[i], vocab_size, "forced_output_prefix[" + std::to_string(i) + "]");
    if (!status.ok()) return status;
  }
  if (max_tokens && *max_tokens < 1) {
    return Status::invalid_argument("max_tokens must be >= 1, got " + std::to_string(*max_tokens));
  }
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    Status status = check_token_id(stop_token_ids[i], vocab_size, "stop_token_ids[" + std::to_string(i) + "]");
    if (!status.ok()) return status;
  }
  if (logprobs && (*logprobs < 0 || *logprobs > kMaxLogprobs)) {
    return Status::invalid_argument("logprobs must be in [0, " + std::to_string(kMaxLogprobs) + "], got " +
                                    std::to_string(*logprobs));
  }
  return Status();
}

// ---- Philox4x32-10 -------------------------------------------------------------------------------------

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  // Multipliers and Weyl key increments from the paper (Section 5, Table 2) and Random123's philox.h.
  constexpr uint32_t kMultiplier0 = 0xD2511F53u;
  constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kKeyIncrement0 = 0x9E3779B9u;
  constexpr uint32_t kKeyIncrement1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kKeyIncrement0;
      key[1] += kKeyIncrement1;
    }
    const uint64_t product0 = uint64_t{kMultiplier0} * counter[0];
    const uint64_t product1 = uint64_t{kMultiplier1} * counter[2];
    const auto high0 = static_cast<uint32_t>(product0 >> 32);
    const auto low0 = static_cast<uint32_t>(product0);
    const auto high1 = static_cast<uint32_t>(product1 >> 32);
    const auto low1 = static_cast<uint32_t>(product1);
    counter = {high1 ^ counter[1] ^ key[0], low1, high0 ^ counter[3] ^ key[1], low0};
  }
  return counter;
}

double philox_uniform(uint64_t seed, uint64_t counter, uint32_t stream) {
  const std::array<uint32_t, 4> block =
      philox4x32_10({static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), stream, 0u},
                    {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  const uint64_t bits = (uint64_t{block[1]} << 32) | block[0];
  return static_cast<double>(bits >> 11) * 0x1.0p-53;  // 53 bits: every value is exact, max is 1 - 2^-53
}

RequestRng make_request_rng(const SamplingParams& params, uint64_t fallback_seed) {
  return RequestRng{params.seed.value_or(fallback_seed), 0};
}

// ---- Sampler -------------------------------------------------------------------------------------------

Sampler::Sampler(int64_t vocab_size)
    : vocab_size_(vocab_size),
      logits_(static_cast<size_t>(vocab_size)),
      output_counts_(static_cast<size_t>(vocab_size), 0),
      in_prompt_(static_cast<size_t>(vocab_size), 0) {}

Status Sampler::check_row(const SamplerRow& row, size_t row_index) const {
  const std::string where = "row " + std::to_string(row_index) + ": ";
  if (row.params == nullptr) return Status::invalid_argument(where + "params is null");
  if (static_cast<int64_t>(row.logits.size()) != vocab_size_) {
    return Status::invalid_argument(where + "logits has " + std::to_string(row.logits.size()) +
                                    " entries, expected vocab_size " + std::to_string(vocab_size_));
  }
  if (Status status = row.params->validate(vocab_size_); !status.ok()) {
    return Status::invalid_argument(where + status.message());
  }
  bool any_finite = false;
  for (size_t i = 0; i < row.logits.size(); ++i) {
    const float logit = row.logits[i];
    if (std::isnan(logit) || logit == std::numeric_limits<float>::infinity()) {
      return Status::invalid_argument(where + "logits[" + std::to_string(i) + "] is " + format_number(logit) +
                                      "; logits must be finite or -inf");
    }
    any_finite = any_finite || logit != kNegativeInfinity;
  }
  if (!any_finite) return Status::invalid_argument(where + "every logit is -inf; there is no token to sample");
  // Only the ids the penalties read are checked: a 128k-token prompt is not scanned when nothing uses it.
  if (penalties_active(*row.params)) {
    for (size_t i = 0; i < row.output_token_ids.size(); ++i) {
      Status status =
          check_token_id(row.output_token_ids[i], vocab_size_, where + "output_token_ids[" + std::to_string(i) + "]");
      if (!status.ok()) return status;
    }
  }
  if (row.params->repetition_penalty != 1.0f) {
    for (size_t i = 0; i < row.prompt_token_ids.size(); ++i) {
      Status status =
          check_token_id(row.prompt_token_ids[i], vocab_size_, where + "prompt_token_ids[" + std::to_string(i) + "]");
      if (!status.ok()) return status;
    }
  }
  return Status();
}

namespace {
// forced_output_choices' distinct next tokens after `output` (ascending): those of the choices longer than the
// output that begin with it.
std::vector<TokenId> next_choice_tokens(const std::vector<std::vector<TokenId>>& choices,
                                        std::span<const TokenId> output) {
  std::vector<TokenId> next;
  for (const std::vector<TokenId>& choice : choices) {
    if (choice.size() <= output.size() || !std::equal(output.begin(), output.end(), choice.begin())) continue;
    next.push_back(choice[output.size()]);
  }
  std::sort(next.begin(), next.end());
  next.erase(std::unique(next.begin(), next.end()), next.end());
  return next;
}
}  // namespace

std::vector<TokenId> SamplingParams::choice_tokens(std::span<const TokenId> output_token_ids) const {
  if (forced_output_choices.empty()) return {};
  std::vector<TokenId> next = next_choice_tokens(forced_output_choices, output_token_ids);
  if (next.size() < 2) next.clear();
  return next;
}

TokenId SamplingParams::forced_token(std::span<const TokenId> output_token_ids) const {
  if (output_token_ids.size() < forced_output_prefix.size()) return forced_output_prefix[output_token_ids.size()];
  if (!forced_output_choices.empty()) {
    const std::vector<TokenId> next = next_choice_tokens(forced_output_choices, output_token_ids);
    if (next.size() == 1) return next.front();
  }
  if (!reasoning_budget || static_cast<int64_t>(output_token_ids.size()) != *reasoning_budget) return -1;
  for (TokenId token : output_token_ids) {
    if (std::find(reasoning_end_token_ids.begin(), reasoning_end_token_ids.end(), token) !=
        reasoning_end_token_ids.end()) {
      return -1;
    }
  }
  return reasoning_end_token_ids.front();
}

void Sampler::process_logits(const SamplerRow& row) {
  const SamplingParams& params = *row.params;
  std::copy(row.logits.begin(), row.logits.end(), logits_.begin());
  for (const auto& [id, bias] : params.logit_bias) {
    float& logit = logits_[static_cast<size_t>(id)];
    logit = saturate_logit(logit, logit + std::clamp(bias, -kMaxLogitBias, kMaxLogitBias));
  }
  if (const TokenId forced = params.forced_token(row.output_token_ids); forced >= 0) {
    float& logit = logits_[static_cast<size_t>(forced)];
    logit = saturate_logit(logit, logit + kForcedTokenBias);
  }
  for (TokenId allowed : params.choice_tokens(row.output_token_ids)) {
    float& logit = logits_[static_cast<size_t>(allowed)];
    logit = saturate_logit(logit, logit + kChoiceTokenBias);
  }
  if (!penalties_active(params)) return;

  if (params.repetition_penalty != 1.0f) {
    // in_prompt_ marks tokens already penalised so each distinct token is penalised once; reset after.
    const float penalty = params.repetition_penalty;
    auto penalise = [&](TokenId id) {
      uint8_t& done = in_prompt_[static_cast<size_t>(id)];
      if (done) return;
      done = 1;
      float& logit = logits_[static_cast<size_t>(id)];
      logit = saturate_logit(logit, logit > 0.0f ? logit / penalty : logit * penalty);
    };
    for (TokenId id : row.prompt_token_ids) penalise(id);
    for (TokenId id : row.output_token_ids) penalise(id);
    for (TokenId id : row.prompt_token_ids) in_prompt_[static_cast<size_t>(id)] = 0;
    for (TokenId id : row.output_token_ids) in_prompt_[static_cast<size_t>(id)] = 0;
  }

  if (params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f) {
    for (TokenId id : row.output_token_ids) ++output_counts_[static_cast<size_t>(id)];
    // Visiting a token zeroes its count, so each distinct token is penalised once and the buffer is left clean.
    for (TokenId id : row.output_token_ids) {
      int32_t& count = output_counts_[static_cast<size_t>(id)];
      if (count == 0) continue;
      float& logit = logits_[static_cast<size_t>(id)];
      logit = saturate_logit(logit, logit - params.frequency_penalty * static_cast<float>(count));
      logit = saturate_logit(logit, logit - params.presence_penalty);
      count = 0;
    }
  }
}

double Sampler::build_distribution(const SamplingParams& params) {
  distribution_.clear();
  if (params.is_greedy()) {
    size_t best = 0;
    for (size_t i = 1; i < logits_.size(); ++i) {
      if (logits_[i] > logits_[best]) best = i;  // strict: the lowest id wins ties
    }
    distribution_.push_back({static_cast<TokenId>(best), 1.0});
    return 1.0;
  }

  // More likely first; the lower id first among equals. A strict total order, so every cut is exact and
  // independent of the algorithm that finds it.
  auto more_likely = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.token_id < b.token_id);
  };
  const size_t vocab = logits_.size();
  const bool top_k_active = params.top_k >= 1 && static_cast<size_t>(params.top_k) < vocab;
  bool reordered = false;  // candidates_ no longer in ascending id order
  candidates_.clear();
  if (top_k_active && static_cast<size_t>(params.top_k) * kSmallTopKFactor <= vocab) {
    // Small k (step 5): one pass keeping a heap of the best k so far, whose front is the least likely of them;
    // almost every token costs a single comparison.
    const size_t k = static_cast<size_t>(params.top_k);
    for (size_t i = 0; i < vocab; ++i) {
      const float logit = logits_[i];
      if (logit == kNegativeInfinity) continue;
      const Candidate candidate{static_cast<TokenId>(i), logit, 0.0};
      if (candidates_.size() < k) {
        candidates_.push_back(candidate);
        std::push_heap(candidates_.begin(), candidates_.end(), more_likely);
      } else if (more_likely(candidate, candidates_.front())) {
        std::pop_heap(candidates_.begin(), candidates_.end(), more_likely);
        candidates_.back() = candidate;
        std::push_heap(candidates_.begin(), candidates_.end(), more_likely);
      }
    }
    reordered = true;
  } else {
    for (size_t i = 0; i < vocab; ++i) {
      if (logits_[i] != kNegativeInfinity) candidates_.push_back({static_cast<TokenId>(i), logits_[i], 0.0});
    }
    if (top_k_active && static_cast<size_t>(params.top_k) < candidates_.size()) {
      const auto cut = candidates_.begin() + params.top_k;
      std::nth_element(candidates_.begin(), cut, candidates_.end(), more_likely);
      candidates_.erase(cut, candidates_.end());
      reordered = true;
    }
  }

  // Step 4. float exp: the weights feed a draw, not a reference value, and expf is several times faster.
  float max_logit = kNegativeInfinity;
  for (const Candidate& candidate : candidates_) max_logit = std::max(max_logit, candidate.logit);
  const float inverse_temperature = 1.0f / params.temperature;
  for (Candidate& candidate : candidates_) {
    candidate.weight = std::exp((candidate.logit - max_logit) * inverse_temperature);
  }

  if (params.top_p < 1.0f) {  // step 6
    double total = 0.0;
    for (const Candidate& candidate : candidates_) total += candidate.weight;
    const double target = static_cast<double>(params.top_p) * total;
    const size_t count = candidates_.size();
    size_t head = count;  // a most-likely prefix (as a set) that should already hold the nucleus
    if (count > kSortWholeTopPBelow) {
      // Histogram of the scaled distance from the maximum, (max - logit) / T, in quarter nats. Bins are
      // monotone in likelihood, so the bins up to the one where the mass reaches `target` form a prefix in
      // the more_likely order that holds the nucleus; only it is sorted.
      auto bin_of = [&](const Candidate& candidate) {
        const float distance = (max_logit - candidate.logit) * inverse_temperature;
        if (!(distance < static_cast<float>(kTopPBins) / kTopPBinsPerNat)) return kTopPBins - 1;
        return std::min(static_cast<int>(distance * kTopPBinsPerNat), kTopPBins - 1);
      };
      std::array<double, kTopPBins> bin_mass{};
      for (const Candidate& candidate : candidates_)
        bin_mass[static_cast<size_t>(bin_of(candidate))] += candidate.weight;
      int last_bin = kTopPBins - 1;
      double mass = 0.0;
      for (int bin = 0; bin < kTopPBins; ++bin) {
        mass += bin_mass[static_cast<size_t>(bin)];
        if (mass >= target) {
          last_bin = bin;
          break;
        }
      }
      head = static_cast<size_t>(
          std::partition(candidates_.begin(), candidates_.end(),
                         [&](const Candidate& candidate) { return bin_of(candidate) <= last_bin; }) -
          candidates_.begin());
    }
    std::sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(head), more_likely);
    size_t kept = count;
    double mass = 0.0;
    for (size_t r = 0; r < count; ++r) {
      if (r == head) {
        // Summation order made the head's mass fall just short of `target`: sort the rest and go on.
        std::sort(candidates_.begin() + static_cast<std::ptrdiff_t>(head), candidates_.end(), more_likely);
      }
      mass += candidates_[r].weight;
      if (mass >= target) {  // the mass before token r was < top_p; nothing after r is kept
        kept = r + 1;
        break;
      }
    }
    candidates_.resize(kept);
    reordered = true;
  }

  if (params.min_p > 0.0f) {  // step 7
    // The most likely token has weight exp(0) = 1, so the threshold min_p * p_max is min_p in weights.
    const double threshold = params.min_p;
    std::erase_if(candidates_, [threshold](const Candidate& candidate) { return candidate.weight < threshold; });
  }

  if (reordered) {
    std::sort(candidates_.begin(), candidates_.end(),
              [](const Candidate& a, const Candidate& b) { return a.token_id < b.token_id; });
  }
  double total = 0.0;
  for (const Candidate& candidate : candidates_) {
    distribution_.push_back({candidate.token_id, candidate.weight});
    total += candidate.weight;
  }
  return total;
}

double log_sum_exp(std::span<const float> logits) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - max_logit);
  return max_logit + std::log(sum);
}

void Sampler::fill_logprobs(const SamplerRow& row, SampledToken& out) const {
  out.top_logprobs.clear();
  if (!row.params->logprobs) {
    out.logprob.reset();
    return;
  }
  const std::span<const float> logits = row.logits;
  const double log_normaliser = log_sum_exp(logits);  // finite maximum: checked
  out.logprob = static_cast<float>(logits[static_cast<size_t>(out.token_id)] - log_normaliser);

  const size_t wanted = std::min(static_cast<size_t>(*row.params->logprobs), logits.size());
  if (wanted == 0) return;
  // Keep the best `wanted` raw logits seen so far, sorted; ids arrive ascending, so an equal logit never
  // displaces an earlier (lower) id.
  std::vector<TokenLogprob>& top = out.top_logprobs;
  top.reserve(wanted + 1);
  for (size_t i = 0; i < logits.size(); ++i) {
    const float logit = logits[i];
    if (top.size() == wanted && !(logit > top.back().logprob)) continue;
    auto position = std::upper_bound(top.begin(), top.end(), logit,
                                     [](float value, const TokenLogprob& entry) { return value > entry.logprob; });
    top.insert(position, TokenLogprob{static_cast<TokenId>(i), logit});
    if (top.size() > wanted) top.pop_back();
  }
  for (TokenLogprob& entry : top) entry.logprob = static_cast<float>(entry.logprob - log_normaliser);
}

Status Sampler::final_distribution(const SamplerRow& row, std::vector<TokenProbability>& distribution) {
  if (Status status = check_row(row, 0); !status.ok()) return status;
  process_logits(row);
  const double total = build_distribution(*row.params);
  distribution.clear();
  for (const TokenProbability& entry : distribution_)
    distribution.push_back({entry.token_id, entry.probability / total});
  return Status();
}

Status Sampler::describe(const SamplerRow& row, TokenId token_id, SampledToken& out) const {
  if (Status status = check_row(row, 0); !status.ok()) return status;
  if (token_id < 0 || token_id >= vocab_size_) {
    return Status::invalid_argument("describe: token id " + std::to_string(token_id) + " outside the vocabulary of " +
                                    std::to_string(vocab_size_));
  }
  out.token_id = token_id;
  fill_logprobs(row, out);
  return Status();
}

Status Sampler::check(std::span<const SamplerRow> rows, std::span<SampledToken> outputs, size_t first_row) const {
  if (outputs.size() != rows.size()) {
    return Status::invalid_argument("sampler got " + std::to_string(rows.size()) + " rows but " +
                                    std::to_string(outputs.size()) + " output slots");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (Status status = check_row(rows[i], first_row + i); !status.ok()) return status;
    if (rows[i].rng == nullptr) {
      return Status::invalid_argument("row " + std::to_string(first_row + i) + ": rng is null");
    }
  }
  return Status();
}

Status Sampler::sample(std::span<const SamplerRow> rows, std::span<SampledToken> outputs) {
  if (Status status = check(rows, outputs); !status.ok()) return status;
  sample_checked(rows, outputs);
  return Status();
}

void Sampler::sample_checked(std::span<const SamplerRow> rows, std::span<SampledToken> outputs) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const SamplerRow& row = rows[i];
    process_logits(row);
    const double total = build_distribution(*row.params);
    TokenId token = distribution_.front().token_id;
    if (!row.params->is_greedy()) {
      // Inverse CDF in ascending id order. `total` was summed in this same order, so the running sum ends at
      // exactly `total` > target unless u * total rounded up to total; then the last positive-weight token wins.
      const double target = philox_uniform(row.rng->seed, row.rng->counter, kSamplingStream) * total;
      double cumulative = 0.0;
      for (const TokenProbability& entry : distribution_) {
        if (entry.probability <= 0.0) continue;
        cumulative += entry.probability;
        token = entry.token_id;
        if (cumulative > target) break;
      }
    }
    ++row.rng->counter;
    outputs[i].token_id = token;
    fill_logprobs(row, outputs[i]);
  }
}

void append_logit_adjustments(const SamplingParams& p, std::span<const TokenId> prompt_token_ids,
                              std::span<const TokenId> output_token_ids, int32_t row,
                              std::vector<backend::Backend::LogitAdjustment>& out) {
  const bool repetition = p.repetition_penalty != 1.0f;
  const bool output_penalties = p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
  const TokenId forced = p.forced_token(output_token_ids);
  const std::vector<TokenId> choices = p.choice_tokens(output_token_ids);
  if (p.logit_bias.empty() && !repetition && !output_penalties && forced < 0 && choices.empty()) return;
  // Per distinct token, what process_logits does to it (ascending ids; one entry each).
  std::map<TokenId, backend::Backend::LogitAdjustment> by_token;
  auto entry = [&](TokenId token) -> backend::Backend::LogitAdjustment& {
    auto [it, inserted] = by_token.try_emplace(token);
    if (inserted) {
      it->second.row = row;
      it->second.token = token;
    }
    return it->second;
  };
  for (const auto& [token, bias] : p.logit_bias) {
    auto& a = entry(token);
    a.has_bias = true;
    a.bias = std::clamp(bias, -kMaxLogitBias, kMaxLogitBias);
  }
  if (forced >= 0) {  // after its logit_bias, as process_logits adds them (the device adds the sum once)
    auto& a = entry(forced);
    a.bias = a.has_bias ? a.bias + kForcedTokenBias : kForcedTokenBias;
    a.has_bias = true;
  }
  for (TokenId allowed : choices) {  // the same order as process_logits
    auto& a = entry(allowed);
    a.bias = a.has_bias ? a.bias + kChoiceTokenBias : kChoiceTokenBias;
    a.has_bias = true;
  }
  if (repetition) {
    for (TokenId token : prompt_token_ids) entry(token).repetition = p.repetition_penalty;
    for (TokenId token : output_token_ids) entry(token).repetition = p.repetition_penalty;
  }
  if (output_penalties) {
    std::map<TokenId, int32_t> counts;
    for (TokenId token : output_token_ids) ++counts[token];
    for (const auto& [token, count] : counts) {
      auto& a = entry(token);
      a.in_output = true;
      a.frequency = p.frequency_penalty * static_cast<float>(count);  // the host Sampler's float product
      a.presence = p.presence_penalty;
    }
  }
  for (const auto& [token, a] : by_token) out.push_back(a);
}

}  // namespace deepinfer::engine
