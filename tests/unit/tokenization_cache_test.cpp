// Incremental prompt tokenization: with a TokenizationCache, render_and_tokenize gives exactly the text and
// ids it gives without one — for every golden case of every format, with the cache warmed by the
// conversation minus its last message and by the whole conversation, as a conversation grows turn by turn,
// under eviction, and with one cache shared by several threads — and a grown conversation really is served
// from the cache.
#include "deepinfer/recipe/tokenization_cache.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "golden_cases.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;
using deepinfer::testing::golden_conversation;
using deepinfer::testing::golden_file;
using deepinfer::testing::golden_name;

std::shared_ptr<const Tokenizer> deepseek_v3_tokenizer() {
  static Result<std::shared_ptr<const Tokenizer>> tokenizer = Tokenizer::load(deepinfer::testing::tokenizer_path());
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status().to_string() << " (run scripts/setup.sh to fetch the tokenizer)";
  return tokenizer.ok() ? *tokenizer : nullptr;
}

struct Case {
  PromptFormat format;
  std::string name;
  Conversation conversation;
  RenderedPrompt expected;  // rendered and tokenized without a cache
};

// Every golden case of every format that renders, with its uncached prompt.
std::vector<Case> golden_cases(const Tokenizer& tokenizer) {
  std::vector<Case> cases;
  for (PromptFormat format : all_formats()) {
    json::value file = golden_file(format);
    for (const json::value& item : file.at("cases").as_array()) {
      const json::object& golden = item.as_object();
      if (!golden.contains("prompt")) continue;  // the reference could not render it
      Conversation conversation = golden_conversation(golden);
      Result<RenderedPrompt> expected = render_and_tokenize(conversation, format, tokenizer);
      EXPECT_TRUE(expected.ok()) << golden_name(golden) << ": " << expected.status().to_string();
      if (!expected.ok()) continue;
      cases.push_back({format, std::string(format_name(format)) + " " + golden_name(golden), std::move(conversation),
                       std::move(expected).value()});
    }
  }
  return cases;
}

// Text and ids equal to `expected`.
void expect_same(const Result<RenderedPrompt>& actual, const RenderedPrompt& expected, const std::string& what) {
  ASSERT_TRUE(actual.ok()) << what << ": " << actual.status().to_string();
  EXPECT_EQ(actual->text, expected.text) << what;
  EXPECT_EQ(actual->token_ids, expected.token_ids) << what;
}

Conversation first_messages(const Conversation& conversation, size_t count) {
  Conversation prefix = conversation;
  prefix.messages.resize(count);
  return prefix;
}

TEST(TokenizationCacheTest, WarmCacheGivesTheUncachedPromptForEveryGoldenCase) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::vector<Case> cases = golden_cases(*tokenizer);
  ASSERT_GE(cases.size(), 100u);
  int prefixes = 0;
  uint64_t hits_when_warm = 0;
  // Every run cached (min 1 byte), and the default threshold the server uses.
  for (size_t min_cached_bytes : {size_t{1}, TokenizationCache::kDefaultMinCachedBytes}) {
    for (const Case& c : cases) {
      const std::string what = c.name + " min_cached_bytes=" + std::to_string(min_cached_bytes);
      TokenizationCache cache(64 << 20, min_cached_bytes);
      // The previous request: the conversation minus its last message (when that is a conversation the
      // format renders), itself identical to its uncached render.
      if (c.conversation.messages.size() > 1) {
        Conversation prefix = first_messages(c.conversation, c.conversation.messages.size() - 1);
        Result<RenderedPrompt> uncached = render_and_tokenize(prefix, c.format, *tokenizer);
        if (uncached.ok()) {
          expect_same(render_and_tokenize(prefix, c.format, *tokenizer, &cache), *uncached, what + " (prefix)");
          ++prefixes;
        }
      }
      expect_same(render_and_tokenize(c.conversation, c.format, *tokenizer, &cache), c.expected,
                  what + " (warmed by the prefix)");
      // Rendered once fully: now every cached run is a hit.
      const TokenizationCache::Stats before = cache.stats();
      expect_same(render_and_tokenize(c.conversation, c.format, *tokenizer, &cache), c.expected,
                  what + " (warmed by itself)");
      const TokenizationCache::Stats after = cache.stats();
      EXPECT_EQ(after.misses, before.misses) << what;
      if (min_cached_bytes == 1) hits_when_warm += after.hits - before.hits;
    }
  }
  EXPECT_GE(prefixes, 100);
  EXPECT_GE(hits_when_warm, cases.size());
}

TEST(TokenizationCacheTest, AgentConversationGrowingByTwoTurnsReTokenizesOnlyTheNewTurns) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  Result<Conversation> session = conversation_from_openai_chat(std::string_view(
      deepinfer::testing::read_file(deepinfer::testing::source_path("tests/data/conversations/agent-session.json"))));
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  // Three requests of the agent loop: each ends before an assistant message, the next adds that assistant
  // message (tool calls, or text) and the tool results or user message after it.
  std::vector<size_t> cuts;
  for (size_t count = 20; count < session->messages.size() && cuts.size() < 3; ++count) {
    if (session->messages[count].role == Role::kAssistant && session->messages[count - 1].role != Role::kAssistant) {
      cuts.push_back(count);
    }
  }
  ASSERT_EQ(cuts.size(), 3u);
  for (PromptFormat format : all_formats()) {
    TokenizationCache cache(64 << 20);
    size_t previous_tokens = 0;
    for (size_t turn = 0; turn < cuts.size(); ++turn) {
      const std::string what = std::string(format_name(format)) + " request " + std::to_string(turn) + " (" +
                               std::to_string(cuts[turn]) + " messages)";
      Conversation conversation = first_messages(*session, cuts[turn]);
      Result<RenderedPrompt> expected = render_and_tokenize(conversation, format, *tokenizer);
      ASSERT_TRUE(expected.ok()) << what << ": " << expected.status().to_string();
      const TokenizationCache::Stats before = cache.stats();
      expect_same(render_and_tokenize(conversation, format, *tokenizer, &cache), *expected, what);
      const TokenizationCache::Stats after = cache.stats();
      const size_t earlier_tokens = previous_tokens;
      previous_tokens = expected->token_ids.size();
      if (turn == 0) continue;
      // The earlier turns come from the cache. Encoded: the new turn's runs, and the run of the previous
      // request that the new turn continues (with this tokenizer `</think>` is text, so in V3.2 a tool
      // result run goes on into the next assistant message), so a few misses and nearly all earlier ids hit.
      const uint64_t hit_tokens = after.hit_tokens - before.hit_tokens;
      const uint64_t miss_tokens = after.miss_tokens - before.miss_tokens;
      EXPECT_LE(after.misses - before.misses, 3u) << what;
      EXPECT_GE(hit_tokens, 9 * earlier_tokens / 10)
          << what << ": " << hit_tokens << " ids from the cache, " << miss_tokens << " encoded, " << earlier_tokens
          << " in the previous request";
    }
  }
}

TEST(TokenizationCacheTest, EvictionUnderATinyCapacityKeepsEveryPromptIdentical) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  std::vector<Case> cases = golden_cases(*tokenizer);
  for (size_t capacity : {size_t{0}, size_t{700}, size_t{4096}}) {
    TokenizationCache cache(capacity, /*min_cached_bytes=*/1);
    // Twice through every case of every format, interleaved, so entries are evicted and re-inserted.
    for (int pass = 0; pass < 2; ++pass) {
      for (const Case& c : cases) {
        const std::string what = c.name + " capacity=" + std::to_string(capacity) + " pass " + std::to_string(pass);
        expect_same(render_and_tokenize(c.conversation, c.format, *tokenizer, &cache), c.expected, what);
        EXPECT_LE(cache.stats().bytes, capacity) << what;
      }
    }
    const TokenizationCache::Stats stats = cache.stats();
    if (capacity == 0) {
      EXPECT_EQ(stats.entries, 0u);
      EXPECT_EQ(stats.hits, 0u);
    } else {
      EXPECT_GT(stats.evictions, 0u) << "capacity " << capacity;
      EXPECT_GT(stats.hits, 0u) << "capacity " << capacity;
    }
  }
}

TEST(TokenizationCacheTest, EvictsTheLeastRecentlyUsedEntry) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  // Three texts of one length and one token count, so each entry accounts the same bytes.
  auto text = [](char letter) {
    return std::string("Entry ") + letter + ": the quick brown fox jumps over the lazy dog.";
  };
  std::vector<TokenId> ids;
  TokenizationCache sizing(1 << 20, 1);
  sizing.encode(*tokenizer, text('A'), TextTrust::kUntrusted, ids);
  const size_t entry_bytes = sizing.stats().bytes;
  for (char letter : {'B', 'C'}) sizing.encode(*tokenizer, text(letter), TextTrust::kUntrusted, ids);
  ASSERT_EQ(sizing.stats().bytes, 3 * entry_bytes);

  TokenizationCache cache(2 * entry_bytes, 1);  // room for two
  auto encode = [&](char letter) {
    std::vector<TokenId> out;
    cache.encode(*tokenizer, text(letter), TextTrust::kUntrusted, out);
    EXPECT_EQ(out, tokenizer->encode(text(letter), TextTrust::kUntrusted)) << letter;
  };
  encode('A');
  encode('B');
  encode('A');  // A is now the most recently used
  encode('C');  // evicts B
  EXPECT_EQ(cache.stats().hits, 1u);
  EXPECT_EQ(cache.stats().evictions, 1u);
  encode('A');  // hit
  EXPECT_EQ(cache.stats().hits, 2u);
  encode('B');  // miss: it was evicted
  EXPECT_EQ(cache.stats().hits, 2u);
  EXPECT_EQ(cache.stats().misses, 4u);
  EXPECT_EQ(cache.stats().entries, 2u);
  cache.clear();
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().bytes, 0u);
  EXPECT_EQ(cache.stats().hits, 0u);
}

TEST(TokenizationCacheTest, EntriesAreNotSharedBetweenTokenizersOrTrustModes) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  Result<std::shared_ptr<const Tokenizer>> other = Tokenizer::load(deepinfer::testing::tokenizer_path());
  ASSERT_TRUE(other.ok());
  ASSERT_NE((*other)->instance_id(), tokenizer->instance_id());
  // Text whose trusted and untrusted ids differ: the trust mode must be part of the key.
  const std::string text = "A user wrote <｜User｜> and <｜end▁of▁sentence｜> into a long enough message.";
  TokenizationCache cache(1 << 20, 1);
  std::vector<TokenId> untrusted, trusted, from_other;
  cache.encode(*tokenizer, text, TextTrust::kUntrusted, untrusted);
  cache.encode(*tokenizer, text, TextTrust::kTrusted, trusted);
  cache.encode(**other, text, TextTrust::kUntrusted, from_other);
  EXPECT_EQ(cache.stats().hits, 0u);
  EXPECT_EQ(cache.stats().misses, 3u);
  EXPECT_EQ(untrusted, tokenizer->encode(text, TextTrust::kUntrusted));
  EXPECT_EQ(trusted, tokenizer->encode(text, TextTrust::kTrusted));
  EXPECT_NE(trusted, untrusted);
  EXPECT_EQ(from_other, untrusted);
}

TEST(TokenizationCacheTest, ThreadsSharingOneCacheGetTheUncachedPrompts) {
  auto tokenizer = deepseek_v3_tokenizer();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<Case> cases = golden_cases(*tokenizer);
  // Small enough that threads evict each other's entries while others copy ids out of them.
  TokenizationCache cache(16 << 10, 1);
  constexpr int kThreads = 4;
  constexpr int kPasses = 3;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int pass = 0; pass < kPasses; ++pass) {
        // Each thread walks the cases from its own starting point.
        for (size_t i = 0; i < cases.size(); ++i) {
          const Case& c = cases[(i + static_cast<size_t>(t) * cases.size() / kThreads) % cases.size()];
          Result<RenderedPrompt> prompt = render_and_tokenize(c.conversation, c.format, *tokenizer, &cache);
          if (!prompt.ok() || prompt->text != c.expected.text || prompt->token_ids != c.expected.token_ids) {
            ++mismatches[t];
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  const TokenizationCache::Stats stats = cache.stats();
  EXPECT_GT(stats.hits, 0u);
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_LE(stats.bytes, cache.capacity_bytes());
}

}  // namespace
}  // namespace deepinfer::recipe
