// Mooncake trace -> token-id prompts for the live replay against a server (`bench_replay --live`). Each trace
// hash id becomes a fixed block of token ids, so requests that share hash ids share exactly those tokens and
// the server's prefix cache sees the trace's sharing; lengths are scaled from 512 tokens per trace block down
// to `block_tokens` and capped so the prompts fit a small model on a CPU. No I/O, no server.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"
#include "trace_replay.h"

namespace deepinfer::bench {

struct LivePromptConfig {
  // Prompt tokens per trace block (the trace's 512). 64, the engine's KV block, maps one trace block onto one
  // cache block, so block-level sharing in the trace is block-level sharing on the server. At least 2.
  int32_t block_tokens = 64;
  // Prompts are cut to this many tokens (the prefix is kept, so the sharing of what remains is unchanged).
  int64_t max_prompt_tokens = 960;
  // Generated tokens per request: the trace's output_length scaled like the prompt, then capped to this.
  int32_t max_tokens = 8;
  // Block content is drawn from token ids [first_token_id, first_token_id + token_id_range): ordinary
  // vocabulary of the DeepSeek tokenizers, clear of the special tokens at the start (BOS 0, EOS 1) and the
  // added tokens above 128,000.
  int32_t first_token_id = 1000;
  int32_t token_id_range = 99000;
  uint64_t seed = 0;  // another seed gives other block contents (the same sharing)
};

// Errors: InvalidArgument naming the field when block_tokens < 2, a bound is not positive, or the token range
// leaves [0, 2^31).
Status validate_live_prompt_config(const LivePromptConfig& config);

// The `block_tokens` token ids of trace block `hash_id`. Deterministic in (hash_id, seed). The first two ids
// spell hash_id in base token_id_range, so distinct ids below token_id_range^2 always give distinct blocks;
// the rest are pseudo-random (XXH3 of seed, hash_id, position).
// REQUIRES: validate_live_prompt_config(config).ok(), 0 <= hash_id < token_id_range^2.
std::vector<int32_t> live_block_token_ids(int64_t hash_id, const LivePromptConfig& config);

struct LivePrompt {
  int64_t timestamp_ms = 0;        // the trace's arrival time
  std::vector<int32_t> token_ids;  // what /v1/completions gets as `prompt`
  int32_t max_tokens = 1;
  int64_t uncapped_tokens = 0;  // the scaled length before max_prompt_tokens
};

// Block j < n-1 of the request contributes block_tokens ids of live_block_token_ids(hash_ids[j]); the last,
// partial block (input_length - 512 (n-1) tokens) contributes the first ceil(its tokens * block_tokens / 512)
// ids of its block; then the prompt is cut to max_prompt_tokens. max_tokens = clamp(ceil(output_length *
// block_tokens / 512), 1, config.max_tokens). No BOS is added: block 0 starts at token 0, aligned with the
// server's blocks. Errors: InvalidArgument for a bad config, a request with no hash ids, or a hash id outside
// [0, token_id_range^2).
Result<LivePrompt> make_live_prompt(const TraceRequest& request, const LivePromptConfig& config);

// The first `limit` requests of the trace (all when limit <= 0) as prompts, in trace order.
Result<std::vector<LivePrompt>> make_live_prompts(const Trace& trace, int64_t limit, const LivePromptConfig& config);

// Warm-up prompt `index` (0, 1, ...): 4 trace blocks of hash ids at the top of the id space, which no trace
// reaches, and one block's worth of output. The live replay sends them first; the offline replay too.
Result<LivePrompt> make_warmup_prompt(int32_t index, const LivePromptConfig& config);

// The bound an infinite prefix cache of `cache_block_tokens`-token blocks reaches on these prompts, replayed in
// order with each request's blocks cached before the next arrives: a request reuses its longest prefix of full
// blocks seen before, at most (length - 1) / cache_block_tokens blocks (one token is always computed, as the
// engine's scheduler does). token_hit_rate = reused tokens / prompt tokens; block_hit_rate = reused blocks /
// full blocks. With `reusable_tokens`, it is resized to prompts.size() and gets each prompt's reused tokens.
// REQUIRES: cache_block_tokens > 0.
HitRates ideal_prompt_hit_rates(std::span<const LivePrompt> prompts, int32_t cache_block_tokens,
                                std::vector<int64_t>* reusable_tokens = nullptr);

}  // namespace deepinfer::bench
