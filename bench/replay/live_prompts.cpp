// Trace requests -> token-id prompts with the trace's sharing, and the infinite-cache bound on those prompts.
#include "live_prompts.h"

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <unordered_set>

namespace deepinfer::bench {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t id_space(const LivePromptConfig& config) {
  return static_cast<int64_t>(config.token_id_range) * static_cast<int64_t>(config.token_id_range);
}

}  // namespace

Status validate_live_prompt_config(const LivePromptConfig& config) {
  if (config.block_tokens < 2) {
    return Status::invalid_argument("block_tokens must be at least 2 (the first two ids name the block), got " +
                                    std::to_string(config.block_tokens));
  }
  if (config.max_prompt_tokens < 1) {
    return Status::invalid_argument("max_prompt_tokens must be positive, got " +
                                    std::to_string(config.max_prompt_tokens));
  }
  if (config.max_tokens < 1) {
    return Status::invalid_argument("max_tokens must be positive, got " + std::to_string(config.max_tokens));
  }
  if (config.first_token_id < 0 || config.token_id_range < 2 ||
      static_cast<int64_t>(config.first_token_id) + config.token_id_range > INT32_MAX) {
    return Status::invalid_argument("token ids [" + std::to_string(config.first_token_id) + ", +" +
                                    std::to_string(config.token_id_range) + ") are not a range of at least 2 ids");
  }
  return Status::ok_status();
}

std::vector<int32_t> live_block_token_ids(int64_t hash_id, const LivePromptConfig& config) {
  const int64_t range = config.token_id_range;
  std::vector<int32_t> ids(static_cast<size_t>(config.block_tokens));
  ids[0] = config.first_token_id + static_cast<int32_t>(hash_id % range);
  ids[1] = config.first_token_id + static_cast<int32_t>((hash_id / range) % range);
  for (size_t j = 2; j < ids.size(); ++j) {
    const std::array<uint64_t, 3> key{config.seed, static_cast<uint64_t>(hash_id), j};
    const uint64_t h = XXH3_64bits(key.data(), sizeof(key));
    ids[j] = config.first_token_id + static_cast<int32_t>(h % static_cast<uint64_t>(range));
  }
  return ids;
}

Result<LivePrompt> make_live_prompt(const TraceRequest& request, const LivePromptConfig& config) {
  if (Status s = validate_live_prompt_config(config); !s.ok()) return s;
  if (request.hash_ids.empty()) return Status::invalid_argument("a trace request with no hash ids");
  const int64_t n = static_cast<int64_t>(request.hash_ids.size());
  const int64_t last_trace_tokens =
      std::clamp<int64_t>(request.input_length - kMooncakeBlockTokens * (n - 1), 1, kMooncakeBlockTokens);
  const int64_t last_tokens = ceil_div(last_trace_tokens * config.block_tokens, kMooncakeBlockTokens);
  LivePrompt prompt;
  prompt.timestamp_ms = request.timestamp_ms;
  prompt.uncapped_tokens = (n - 1) * config.block_tokens + last_tokens;
  const int64_t length = std::min(prompt.uncapped_tokens, config.max_prompt_tokens);
  prompt.token_ids.reserve(static_cast<size_t>(length));
  for (int64_t j = 0; j < n && static_cast<int64_t>(prompt.token_ids.size()) < length; ++j) {
    const int64_t hash_id = request.hash_ids[static_cast<size_t>(j)];
    if (hash_id < 0 || hash_id >= id_space(config)) {
      return Status::invalid_argument("hash id " + std::to_string(hash_id) + " is outside [0, " +
                                      std::to_string(id_space(config)) + ") that " +
                                      std::to_string(config.token_id_range) + " token ids can name");
    }
    const std::vector<int32_t> block = live_block_token_ids(hash_id, config);
    const int64_t take = std::min({j + 1 < n ? int64_t{config.block_tokens} : last_tokens,
                                   length - static_cast<int64_t>(prompt.token_ids.size())});
    prompt.token_ids.insert(prompt.token_ids.end(), block.begin(), block.begin() + take);
  }
  const int64_t scaled_output =
      ceil_div(std::max<int64_t>(request.output_length, 1) * config.block_tokens, kMooncakeBlockTokens);
  prompt.max_tokens = static_cast<int32_t>(std::clamp<int64_t>(scaled_output, 1, config.max_tokens));
  return prompt;
}

Result<LivePrompt> make_warmup_prompt(int32_t index, const LivePromptConfig& config) {
  const int64_t id_space = static_cast<int64_t>(config.token_id_range) * config.token_id_range;
  TraceRequest warm;
  warm.input_length = kMooncakeBlockTokens * 4;
  warm.output_length = kMooncakeBlockTokens;
  for (int64_t b = 0; b < 4; ++b) warm.hash_ids.push_back(id_space - 1 - 4 * index - b);
  return make_live_prompt(warm, config);
}

Result<std::vector<LivePrompt>> make_live_prompts(const Trace& trace, int64_t limit, const LivePromptConfig& config) {
  const size_t count = limit > 0 ? std::min(trace.requests.size(), static_cast<size_t>(limit)) : trace.requests.size();
  std::vector<LivePrompt> prompts;
  prompts.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    Result<LivePrompt> prompt = make_live_prompt(trace.requests[i], config);
    if (!prompt.ok()) {
      return Status::invalid_argument(trace.name + " request " + std::to_string(i) + ": " + prompt.status().message());
    }
    prompts.push_back(std::move(prompt).value());
  }
  return prompts;
}

HitRates ideal_prompt_hit_rates(std::span<const LivePrompt> prompts, int32_t cache_block_tokens,
                                std::vector<int64_t>* reusable_tokens) {
  std::unordered_set<uint64_t> seen;  // chained hashes of full blocks
  int64_t prompt_tokens = 0, hit_tokens = 0, full_blocks = 0, hit_blocks = 0;
  if (reusable_tokens != nullptr) reusable_tokens->assign(prompts.size(), 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const LivePrompt& prompt = prompts[i];
    const int64_t length = static_cast<int64_t>(prompt.token_ids.size());
    const int64_t blocks = length / cache_block_tokens;
    const int64_t reusable = length > 0 ? (length - 1) / cache_block_tokens : 0;
    prompt_tokens += length;
    full_blocks += blocks;
    uint64_t parent = 0;
    bool prefix = true;
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t* first = prompt.token_ids.data() + b * cache_block_tokens;
      parent = XXH3_64bits_withSeed(first, sizeof(int32_t) * static_cast<size_t>(cache_block_tokens), parent);
      if (prefix && b < reusable && seen.contains(parent)) {
        ++hit_blocks;
        hit_tokens += cache_block_tokens;
        if (reusable_tokens != nullptr) (*reusable_tokens)[i] += cache_block_tokens;
      } else {
        prefix = false;
      }
      seen.insert(parent);
    }
  }
  HitRates rates;
  if (full_blocks > 0) rates.block_hit_rate = static_cast<double>(hit_blocks) / static_cast<double>(full_blocks);
  if (prompt_tokens > 0) rates.token_hit_rate = static_cast<double>(hit_tokens) / static_cast<double>(prompt_tokens);
  return rates;
}

}  // namespace deepinfer::bench
