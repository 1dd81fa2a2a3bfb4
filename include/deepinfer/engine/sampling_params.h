// SamplingParams: the per-request knobs that decide how the next token is drawn from the model's logits,
// with the names, defaults and ranges that vLLM and OpenAI-API users expect. The server fills it from a
// request (recipe never sees it); the scheduler reads the stop fields; the sampler reads the rest.
#pragma once

#include "deepinfer/core/types.h"

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::engine {

using ::deepinfer::TokenId;  // core/types.h

// Below this temperature a request samples greedily (vLLM's _SAMPLING_EPS): dividing logits by a smaller
// number only risks overflow, and the distribution is a point mass to within float precision anyway.
inline constexpr float kGreedyTemperature = 1e-5f;
// logit_bias values are clamped to [-kMaxLogitBias, kMaxLogitBias] when applied (OpenAI's range).
inline constexpr float kMaxLogitBias = 100.0f;
// What a forced token's logit gets added (SamplingParams::reasoning_budget): far past any logit, so the softmax gives
// every other token exactly 0 in float and double.
inline constexpr float kForcedTokenBias = 1e30f;
// What each allowed token's logit gets added where SamplingParams::forced_output_choices allow several: past every
// other token by far more than a logit's range (probability exactly 0 in float up to temperature 2, OpenAI's
// largest), while keeping the model's preferences among the allowed ones (a float's step at 1,000 is 6e-5).
inline constexpr float kChoiceTokenBias = 1000.0f;
// At most this many top alternatives per token (OpenAI's top_logprobs limit).
inline constexpr int32_t kMaxLogprobs = 20;

// A value type; copy freely. Thread-safety: none needed (no shared state).
// Defaults are "off": plain sampling from softmax(logits) at temperature 1.
struct SamplingParams {
  // Logits are divided by this before softmax. [0, inf); below kGreedyTemperature (so 0) means greedy:
  // argmax of the processed logits, ties to the lowest token id.
  float temperature = 1.0f;
  // Keep only the top_k most likely tokens (ties at the boundary go to the lower id, so exactly
  // min(top_k, #finite) tokens stay). -1 or 0: off.
  int32_t top_k = -1;
  // Nucleus: keep the smallest most-likely-first prefix whose probability mass reaches top_p. (0, 1]; 1: off.
  float top_p = 1.0f;
  // Drop tokens whose probability is below min_p times the most likely token's. [0, 1]; 0: off.
  float min_p = 0.0f;
  // vLLM/HF (Keskar et al. 2019, CTRL): for every token in the prompt or the output so far, a positive logit
  // is divided by it and a negative one multiplied. (0, inf); 1: off; > 1 discourages repetition.
  float repetition_penalty = 1.0f;
  // OpenAI: subtract presence_penalty once from each token that occurs in the output so far (not the
  // prompt). [-2, 2]; 0: off.
  float presence_penalty = 0.0f;
  // OpenAI: subtract frequency_penalty times the token's count in the output so far. [-2, 2]; 0: off.
  float frequency_penalty = 0.0f;
  // token id -> value added to that token's logit, clamped to [-100, 100]; -100 effectively bans a token.
  // Ids must lie in [0, vocab_size); values must be finite.
  std::map<TokenId, float> logit_bias;
  // Same seed, same params, same logits -> same tokens, whatever else shares the batch. Unset: the engine
  // supplies a per-request seed (see make_request_rng in sampler.h).
  std::optional<uint64_t> seed;
  // Most tokens to generate; unset: until the context is full. >= 1. Read by the scheduler, not the sampler.
  std::optional<int64_t> max_tokens;
  // Generation stops after emitting any of these (the token is part of the output). Read by the scheduler.
  std::vector<TokenId> stop_token_ids;
  // Do not stop at the model's end-of-sequence token. Read by the scheduler; the sampler does not ban EOS.
  bool ignore_eos = false;
  // Retention class of the request's cached KV blocks (a kvcache::TtlClassId: 0 default, then the classes of
  // the engine's RetentionConfig, e.g. chat, agent). Read by the scheduler, not the sampler.
  uint8_t kv_ttl_class = 0;
  // Unset: no logprobs. Set to n in [0, 20]: return the sampled token's logprob and the n most likely
  // alternatives, all from the raw model distribution (log_softmax of the logits before any processing).
  std::optional<int32_t> logprobs;
  // A thinking budget (Anthropic's thinking.budget_tokens; SGLang's thinking-budget logit processor): the output
  // starts inside reasoning, and when its first reasoning_budget tokens hold none of reasoning_end_token_ids, the
  // next token is reasoning_end_token_ids[0] (`</think>`): the sampler adds kForcedTokenBias to its logit, so every
  // other token's probability is 0, greedy or not, on the host and on the device alike; a draft is verified against
  // that distribution. Logprobs stay the raw model's. Unset: no budget. >= 0; the ids non-empty and in the vocabulary.
  std::optional<int64_t> reasoning_budget;
  std::vector<TokenId> reasoning_end_token_ids;
  // Output token i < size() is forced_output_prefix[i], the same way (kForcedTokenBias): the answer a request must
  // begin with (a tool_choice naming a function: its invoke header, recipe::RenderedPrompt::answer_prefix). They are
  // output tokens like any other (counted, streamed, parsed). Ids in the vocabulary.
  std::vector<TokenId> forced_output_prefix;
  // The output must begin with one of these token sequences (tool_choice "required" with several tools: one invoke
  // header per offered tool, recipe::RenderedPrompt::answer_prefix_choices). At output position i, the choices
  // that agree with the output so far name the allowed next tokens: one token is forced (as forced_output_prefix's
  // are); several each get kChoiceTokenBias (the model picks among them, every other token has probability 0); none
  // (position i past every choice) constrain nothing. Each choice non-empty; ids in the vocabulary. Exclusive
  // with forced_output_prefix.
  std::vector<std::vector<TokenId>> forced_output_choices;

  bool is_greedy() const { return temperature < kGreedyTemperature; }
  // Greedy with nothing that reads or changes the logits first (penalties, logit_bias, logprobs, forced tokens):
  // the token is the plain argmax, which the backend computes where the logits are (DeepSeekModel::forward_greedy).
  bool is_plain_greedy() const {
    return is_greedy() && repetition_penalty == 1.0f && presence_penalty == 0.0f && frequency_penalty == 0.0f &&
           logit_bias.empty() && !logprobs.has_value() && !reasoning_budget.has_value() &&
           forced_output_prefix.empty() && forced_output_choices.empty();
  }
  // The token forced after `output_token_ids` (the output so far, drafts before the row included): the prefix's next
  // token, the one next token the choices still allow, or the thinking budget's reasoning_end_token_ids[0]; -1 when
  // nothing is forced. O(budget) at the one
  // position the budget can force, O(1) elsewhere.
  TokenId forced_token(std::span<const TokenId> output_token_ids) const;
  // forced_output_choices' allowed next tokens after `output_token_ids` when they are several (ascending, distinct);
  // empty when one token is forced (forced_token returns it) or nothing is constrained. O(choices x position).
  std::vector<TokenId> choice_tokens(std::span<const TokenId> output_token_ids) const;

  // Ok, or InvalidArgument naming the first bad field, its value and the allowed range, e.g.
  // "top_p must be in (0, 1], got 0". Checks NaN/inf too. Ranges follow vLLM's SamplingParams.
  // REQUIRES: nothing; vocab_size <= 0 is itself reported as an error.
  Status validate(int64_t vocab_size) const;
};

}  // namespace deepinfer::engine
