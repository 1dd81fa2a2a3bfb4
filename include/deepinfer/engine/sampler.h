// The sampler: turns one row of float32 logits per request into the next token, applying the request's
// SamplingParams, with a counter-based random generator so that a seeded request draws the same tokens
// whatever else shares the batch. CPU reference implementation; a device sampler must match it.
//
// Per row, in this order (vLLM's order, except that min-p comes last as documented below):
//   1. logit_bias: logit[id] += clamp(bias, -100, 100).
//   2. penalties (vLLM's apply_penalties order): repetition (prompt + output tokens, once per distinct
//      token: l > 0 ? l / r : l * r), then frequency (l -= f * count in output), then presence
//      (l -= p if the token occurs in the output).
//   3. greedy (temperature < kGreedyTemperature): argmax of the processed logits, lowest id on ties; top-k,
//      top-p and min-p are skipped (they always keep the argmax, so they could not change the result).
//   4. temperature: probabilities are softmax(l / T) over the tokens still kept.
//   5. top-k: keep the k largest processed logits; ties at the boundary go to the lower id.
//   6. top-p over the top-k set, renormalised: walking tokens from most to least likely (lower id first on
//      ties), keep a token while the mass of the tokens before it is < top_p (so at least one survives).
//      Matches vLLM's "drop while the ascending cumulative sum <= 1 - top_p".
//   7. min-p: drop tokens whose probability is < min_p * (probability of the most likely token). It
//      depends only on ratios to the maximum, so it gives the same set before or after top-k; it is applied
//      after top-p (vLLM applies it before top-k/top-p; the sets differ only when top-p and min-p are both
//      set and top-p would cut deeper after min-p's renormalisation).
//   8. draw: one uniform u in [0, 1) from Philox4x32-10 (key = seed, counter = number of tokens the request
//      has sampled); inverse CDF over the kept tokens in ascending token id order: the first kept token
//      whose cumulative weight exceeds u * total weight. Tokens with logit -inf are never kept.
// Steps 1-2 saturate: a finite logit that a bias or penalty would take past the float range becomes +-FLT_MAX (a
// repetition_penalty of 1e-38 makes a positive logit the largest finite value, not +inf; a raw -inf stays -inf).
// Logprobs (when params.logprobs is set) come from the raw distribution: log_softmax of the input logits
// before steps 1-7, as vLLM's default logprobs_mode "raw_logprobs" does.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/sampling_params.h"

namespace deepinfer::engine {

// The saturation of steps 1-2: `after` (one bias or penalty applied to `before`), or +-FLT_MAX where a finite
// `before` became infinite. The device sampler applies the same rule (kernels/cuda/sampling.cu).
inline float saturate_logit(float before, float after) {
  if (std::isfinite(before) && std::isinf(after))
    return after > 0.0f ? std::numeric_limits<float>::max() : std::numeric_limits<float>::lowest();
  return after;
}

// ---- Random numbers ------------------------------------------------------------------------------------

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3", SC'11): a
// bijection of the 128-bit counter under a 64-bit key. Pure function; identical on every platform.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// A double in [0, 1) built from the top 53 bits of the first 64 output bits of
// philox4x32_10({counter lo, counter hi, stream, 0}, {seed lo, seed hi}). Depends only on its arguments.
// stream separates independent uses of one counter (the sampler uses kSamplingStream; speculative
// decoding's acceptance tests can use others).
double philox_uniform(uint64_t seed, uint64_t counter, uint32_t stream);
inline constexpr uint32_t kSamplingStream = 0;

// log(sum(exp(logits))), accumulated in double around the largest logit: the normaliser of log_softmax (logprobs)
// and of a draft's top-1 probability. REQUIRES: logits non-empty with a finite maximum.
double log_sum_exp(std::span<const float> logits);

// One request's generator state. The sampler reads (seed, counter) and increments counter once per token it
// samples for the request, greedy or not, so counter == tokens sampled so far, and a request replayed from
// the same state (after preemption, say) draws the same tokens.
struct RequestRng {
  uint64_t seed = 0;
  uint64_t counter = 0;
};

// seed = params.seed if set, else fallback_seed (which the engine derives per request, e.g. from the
// request id and an engine-wide seed); counter = 0.
RequestRng make_request_rng(const SamplingParams& params, uint64_t fallback_seed);

// ---- Sampling ------------------------------------------------------------------------------------------

// One request's input for one step. Borrows everything; nothing is owned.
struct SamplerRow {
  std::span<const float> logits;              // [vocab_size] float32; finite or -inf (no NaN, no +inf)
  const SamplingParams* params = nullptr;     // non-null
  std::span<const TokenId> prompt_token_ids;  // read (and range-checked) only for repetition_penalty
  std::span<const TokenId> output_token_ids;  // generated so far; read (and checked) only for penalties
  RequestRng* rng = nullptr;                  // non-null; counter is incremented on success
};

struct TokenLogprob {
  TokenId token_id = 0;
  float logprob = 0.0f;  // natural log; -inf for a token whose raw logit is -inf
  friend bool operator==(const TokenLogprob&, const TokenLogprob&) = default;
};

struct SampledToken {
  TokenId token_id = 0;
  // Raw-distribution logprob of token_id; set iff params.logprobs is set.
  std::optional<float> logprob;
  // The min(*params.logprobs, vocab_size) most likely tokens of the raw distribution, by logprob
  // descending, lower id first on ties. Empty when params.logprobs is unset or 0.
  std::vector<TokenLogprob> top_logprobs;
};

// A kept token and its probability in the final (processed, truncated, renormalised) distribution.
struct TokenProbability {
  TokenId token_id = 0;
  double probability = 0.0;
};

// Holds scratch buffers sized to the vocabulary, reused across calls, so a step allocates nothing in the
// steady state (except SampledToken::top_logprobs). Not thread-safe: one Sampler per thread.
// Cost per row, all O(vocab) with no full sort of the vocabulary: a check pass and a copy; O(prompt +
// output) more for penalties; greedy is one argmax pass; top-k with k <= vocab / 8 is one pass with a k-heap
// (nth_element otherwise); top-p bins the candidates by likelihood in quarter nats and sorts only the bins
// that hold the nucleus; min-p is a linear filter; logprobs add one pass. Weights use float exp, summed in
// double.
class Sampler {
 public:
  // REQUIRES: vocab_size > 0 and < 2^31.
  explicit Sampler(int64_t vocab_size);

  int64_t vocab_size() const { return vocab_size_; }

  // Samples one token per row into outputs[i] and increments rows[i].rng->counter.
  // All-or-nothing: every row is checked first (logits size == vocab_size, no NaN or +inf, not all -inf,
  // params valid per SamplingParams::validate, token ids in range, non-null pointers); on any error it
  // returns InvalidArgument naming the row and the problem, and mutates neither outputs nor any rng.
  // REQUIRES: outputs.size() == rows.size().
  Status sample(std::span<const SamplerRow> rows, std::span<SampledToken> outputs);
  // sample() in two halves, for callers that split a batch over several Samplers (one per thread) and want the
  // whole batch all-or-nothing: check() makes every check sample() makes, naming rows from `first_row` on;
  // sample_checked() then samples. REQUIRES (sample_checked): check() returned ok for these rows and outputs.
  Status check(std::span<const SamplerRow> rows, std::span<SampledToken> outputs, size_t first_row = 0) const;
  void sample_checked(std::span<const SamplerRow> rows, std::span<SampledToken> outputs);

  // The distribution step 8 draws from, for one row, without drawing: the kept tokens in ascending id order
  // with probabilities summing to 1 (greedy: the argmax alone, probability 1). Does not touch row.rng
  // (it may be null). For tests, and for speculative decoding's acceptance test. Same checks as sample().
  Status final_distribution(const SamplerRow& row, std::vector<TokenProbability>& distribution);
  // What sample() would report had it drawn `token_id` from this row, without drawing: the token and, when
  // params.logprobs is set, its raw-distribution logprob and the top alternatives. For speculative decoding, whose
  // tokens come from the acceptance test. Does not touch row.rng. Same checks as sample(), plus InvalidArgument for a
  // token outside [0, vocab_size).
  Status describe(const SamplerRow& row, TokenId token_id, SampledToken& out) const;

 private:
  Status check_row(const SamplerRow& row, size_t row_index) const;
  // Fills logits_ with the row's logits after logit_bias and penalties (steps 1-2).
  void process_logits(const SamplerRow& row);
  // Steps 3-7 on logits_: fills distribution_ (ascending id) with unnormalised weights and returns their sum.
  double build_distribution(const SamplingParams& params);
  void fill_logprobs(const SamplerRow& row, SampledToken& out) const;

  struct Candidate {
    TokenId token_id;
    float logit;    // processed, before temperature
    double weight;  // exp((logit - max_logit) / temperature), the unnormalised probability
  };

  int64_t vocab_size_;
  std::vector<float> logits_;           // [vocab] processed logits of the current row
  std::vector<int32_t> output_counts_;  // [vocab] all zero between rows
  std::vector<uint8_t> in_prompt_;      // [vocab] all zero between rows
  std::vector<Candidate> candidates_;   // kept tokens of the current row
  std::vector<TokenProbability> distribution_;
};

// Steps 1-2 (logit_bias, penalties) of one row as per-token adjustments for a device sampler
// (Backend::read_sampled_tokens): one entry per distinct token they touch, ascending id, for logits row `row`; the
// bias clamped, the frequency term the same float product frequency_penalty * count the host computes. Appends
// nothing when the params have neither. Applying them (backend.h's LogitAdjustment) to the raw logits gives the
// logits process_logits gives.
void append_logit_adjustments(const SamplingParams& params, std::span<const TokenId> prompt_token_ids,
                              std::span<const TokenId> output_token_ids, int32_t row,
                              std::vector<backend::Backend::LogitAdjustment>& out);

}  // namespace deepinfer::engine
