// Incremental prompt tokenization, one thread: an agent conversation of ~77K tokens (a prefix of the 88K
// agent session, cut where the model would answer next) grows by one agent turn (the file's next assistant
// message and the tool results or user message after it); how long does render + tokenize of the grown
// conversation take with a TokenizationCache warmed by the previous request, against a full render?
// Prints one JSON line per format:
//   full_prefix_*      render + tokenize of the ~77K-token prefix, no cache (what the previous request cost)
//   full_grown_*       render + tokenize of the grown conversation, no cache (what this request costs today)
//   incremental_*      render + tokenize of the grown conversation with a cache warmed by the prefix (a fresh
//                      cache per repetition, warmed untimed, so no repetition sees its own earlier result)
//   cold_cache_*       render + tokenize of the prefix into an empty cache (the cost of filling it)
//   render_only_*      render of the grown conversation, no tokenization (the floor for incremental_*)
//   speedup_vs_full_prefix = full_prefix / incremental; speedup_vs_full_grown = full_grown / incremental
//   hit_rate_runs / hit_rate_tokens: of the cached runs of the incremental render, those found / their ids
// All times: median, min, max over --reps repetitions (the tokenizer's per-thread word cache is warm for
// all of them, as in a running server).
//
// Usage: bench_incremental_render [--tokenizer DIR] [--conversation FILE] [--format NAME|all]
//                                 [--target-tokens N] [--reps N] [--cache-mb N] [--min-cached-bytes N]
#include <algorithm>
#include <boost/json.hpp>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenization_cache.h"
#include "deepinfer/recipe/tokenizer.h"

namespace {

using namespace deepinfer;
using namespace deepinfer::recipe;
using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct Stats {
  double median_ms, min_ms, max_ms;
};

Stats summarize(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples.front(), samples.back()};
}

// `before` runs untimed ahead of each timed `fn`.
template <class Before, class F>
Stats time_ms(int reps, Before&& before, F&& fn) {
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    before();
    auto start = Clock::now();
    fn();
    samples.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return summarize(std::move(samples));
}

Conversation first_messages(const Conversation& conversation, size_t count) {
  Conversation prefix = conversation;
  prefix.messages.resize(count);
  return prefix;
}

void add(boost::json::object& line, const std::string& name, const Stats& stats) {
  line[name + "_median_ms"] = stats.median_ms;
  line[name + "_min_ms"] = stats.min_ms;
  line[name + "_max_ms"] = stats.max_ms;
}

// Where a request would end: after a user or tool message that an assistant message follows.
bool is_cut(const Conversation& conversation, size_t count) {
  return count > 0 && count < conversation.messages.size() && conversation.messages[count].role == Role::kAssistant &&
         conversation.messages[count - 1].role != Role::kAssistant;
}

int bench_format(const Conversation& session, PromptFormat format, const Tokenizer& tokenizer, size_t target_tokens,
                 int reps, size_t cache_bytes, size_t min_cached_bytes) {
  // The cut closest to the target: token counts of every cut, through a scratch cache (seconds otherwise).
  TokenizationCache scratch(size_t{1} << 30);
  size_t prefix_count = 0;
  size_t prefix_tokens = 0;
  for (size_t count = 1; count < session.messages.size(); ++count) {
    if (!is_cut(session, count)) continue;
    Result<RenderedPrompt> prompt = render_and_tokenize(first_messages(session, count), format, tokenizer, &scratch);
    if (!prompt.ok()) {
      std::cout << boost::json::serialize(boost::json::object{{"bench", "incremental_render"},
                                                              {"format", format_name(format)},
                                                              {"error", prompt.status().to_string()}})
                << std::endl;
      return 1;
    }
    const size_t tokens = prompt->token_ids.size();
    auto distance = [&](size_t n) { return n > target_tokens ? n - target_tokens : target_tokens - n; };
    if (prefix_count == 0 || distance(tokens) < distance(prefix_tokens)) {
      prefix_count = count;
      prefix_tokens = tokens;
    }
  }
  // One agent turn: the next assistant message and what follows it up to the next cut (or the end).
  size_t grown_count = prefix_count + 1;
  while (grown_count < session.messages.size() && !is_cut(session, grown_count)) ++grown_count;
  const Conversation prefix = first_messages(session, prefix_count);
  const Conversation grown = first_messages(session, grown_count);

  const auto nothing = [] {};
  Result<RenderedPrompt> reference = render_and_tokenize(grown, format, tokenizer);
  if (!reference.ok()) {
    std::cerr << reference.status().to_string() << "\n";
    return 1;
  }
  Stats full_prefix = time_ms(reps, nothing, [&] { (void)render_and_tokenize(prefix, format, tokenizer); });
  Stats full_grown = time_ms(reps, nothing, [&] { (void)render_and_tokenize(grown, format, tokenizer); });
  Stats render_only = time_ms(reps, nothing, [&] { (void)render_prompt(grown, format); });

  std::unique_ptr<TokenizationCache> cache;
  Stats cold_cache = time_ms(
      reps, [&] { cache = std::make_unique<TokenizationCache>(cache_bytes, min_cached_bytes); },
      [&] { (void)render_and_tokenize(prefix, format, tokenizer, cache.get()); });
  const TokenizationCache::Stats warmed = cache->stats();

  TokenizationCache::Stats after_warm;
  bool identical = true;
  Result<RenderedPrompt> incremental_prompt = Status::internal("not run");
  Stats incremental = time_ms(
      reps,
      [&] {
        cache = std::make_unique<TokenizationCache>(cache_bytes, min_cached_bytes);
        (void)render_and_tokenize(prefix, format, tokenizer, cache.get());
        after_warm = cache->stats();
      },
      [&] { incremental_prompt = render_and_tokenize(grown, format, tokenizer, cache.get()); });
  identical = incremental_prompt.ok() && incremental_prompt->token_ids == reference->token_ids &&
              incremental_prompt->text == reference->text;
  const TokenizationCache::Stats after = cache->stats();
  const uint64_t hits = after.hits - after_warm.hits;
  const uint64_t misses = after.misses - after_warm.misses;
  const uint64_t hit_tokens = after.hit_tokens - after_warm.hit_tokens;
  const uint64_t miss_tokens = after.miss_tokens - after_warm.miss_tokens;

  boost::json::object line{{"bench", "incremental_render"},
                           {"format", format_name(format)},
                           {"reps", reps},
                           {"prefix_messages", prefix_count},
                           {"prefix_tokens", prefix_tokens},
                           {"grown_messages", grown_count},
                           {"grown_tokens", reference->token_ids.size()},
                           {"new_tokens", reference->token_ids.size() - prefix_tokens},
                           {"cache_capacity_bytes", cache_bytes},
                           {"min_cached_bytes", min_cached_bytes},
                           {"cache_entries_after_prefix", warmed.entries},
                           {"cache_bytes_after_prefix", warmed.bytes}};
  add(line, "full_prefix", full_prefix);
  add(line, "full_grown", full_grown);
  add(line, "incremental", incremental);
  add(line, "cold_cache", cold_cache);
  add(line, "render_only", render_only);
  line["speedup_vs_full_prefix"] = full_prefix.median_ms / incremental.median_ms;
  line["speedup_vs_full_grown"] = full_grown.median_ms / incremental.median_ms;
  line["hits"] = hits;
  line["misses"] = misses;
  line["hit_tokens"] = hit_tokens;
  line["miss_tokens"] = miss_tokens;
  line["hit_rate_runs"] = hits + misses == 0 ? 0.0 : double(hits) / double(hits + misses);
  line["hit_rate_tokens"] = hit_tokens + miss_tokens == 0 ? 0.0 : double(hit_tokens) / double(hit_tokens + miss_tokens);
  line["identical_to_full_render"] = identical;
  std::cout << boost::json::serialize(line) << std::endl;
  return identical ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string root = DEEPINFER_SOURCE_DIR;
  std::string tokenizer_path = root + "/models/deepseek-v3";
  std::string conversation_path = root + "/tests/data/conversations/agent-session.json";
  std::string format_arg = "all";
  size_t target_tokens = 77000;
  int reps = 20;
  size_t cache_mb = 64;
  size_t min_cached_bytes = TokenizationCache::kDefaultMinCachedBytes;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--tokenizer")
      tokenizer_path = argv[i + 1];
    else if (flag == "--conversation")
      conversation_path = argv[i + 1];
    else if (flag == "--format")
      format_arg = argv[i + 1];
    else if (flag == "--target-tokens")
      target_tokens = std::stoul(argv[i + 1]);
    else if (flag == "--reps")
      reps = std::max(1, std::stoi(argv[i + 1]));
    else if (flag == "--cache-mb")
      cache_mb = std::stoul(argv[i + 1]);
    else if (flag == "--min-cached-bytes")
      min_cached_bytes = std::stoul(argv[i + 1]);
    else {
      std::cerr << "unknown flag " << flag << "\n";
      return 2;
    }
  }
  auto tokenizer = Tokenizer::load(tokenizer_path);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.status().to_string() << "\n";
    return 1;
  }
  std::string request = read_file(conversation_path);
  Result<Conversation> session = conversation_from_openai_chat(std::string_view(request));
  if (!session.ok()) {
    std::cerr << session.status().to_string() << "\n";
    return 1;
  }
  std::vector<PromptFormat> formats;
  if (format_arg == "all") {
    formats.assign(all_formats().begin(), all_formats().end());
  } else {
    Result<PromptFormat> format = parse_format(format_arg);
    if (!format.ok()) {
      std::cerr << format.status().to_string() << "\n";
      return 1;
    }
    formats.push_back(*format);
  }
  int rc = 0;
  for (PromptFormat format : formats) {
    rc |= bench_format(*session, format, **tokenizer, target_tokens, reps, cache_mb << 20, min_cached_bytes);
  }
  return rc;
}
