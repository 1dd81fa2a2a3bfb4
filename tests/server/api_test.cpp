// The endpoints end to end on one in-process server: chat completions (stream and not, usage exact),
// completions, Anthropic messages, models, health, metrics, tokenize/detokenize.
#include <gtest/gtest.h>

#include <string>

#include "deepinfer/server/api.h"
#include "deepinfer/server/metrics.h"
#include "server_fixture.h"

namespace deepinfer::server::testing {
namespace {

namespace json = boost::json;

class ApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = start_server().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  TestClient client() { return TestClient(server_->port()); }
  static Server* server_;
};
Server* ApiTest::server_ = nullptr;

const std::string kChat =
    R"({"model": "default", "messages": [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, who are you?"}], "max_tokens": 6, "temperature": 0, "ignore_eos": true)";

std::string chat(const std::string& extra = "") { return kChat + extra + "}"; }

TEST_F(ApiTest, ChatNonStreamingHasExactUsage) {
  TestClient c = client();
  HttpResponse response = c.post("/v1/chat/completions", chat());
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(response.headers["content-type"], "application/json");
  json::object body = response.json().as_object();
  EXPECT_TRUE(body["id"].as_string().starts_with("chatcmpl-"));
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["model"], kModelName);
  const json::object& choice = body["choices"].as_array()[0].as_object();
  EXPECT_EQ(choice.at("finish_reason"), "length");
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  EXPECT_TRUE(choice.at("message").at("content").is_string());
  EXPECT_TRUE(choice.at("message").as_object().contains("reasoning_content"));
  const json::object& usage = body["usage"].as_object();
  EXPECT_EQ(usage.at("prompt_tokens").as_int64(), rendered_prompt_tokens(chat()));
  EXPECT_EQ(usage.at("completion_tokens").as_int64(), 6);
  EXPECT_EQ(usage.at("total_tokens").as_int64(), usage.at("prompt_tokens").as_int64() + 6);
  EXPECT_EQ(usage.at("prompt_tokens_details").at("cached_tokens").as_int64(), 0);
}

// A request the server ends itself (a stop string here; the one tool call of parallel_tool_calls: false too) still
// reports the prompt tokens read from the prefix cache: the engine's finish event is not waited for, so the count
// comes with the tokens (regression: it was 0, and the metric undercounted).
TEST_F(ApiTest, AStopStringKeepsTheCachedTokenCount) {
  TestClient c = client();
  std::string system;
  for (int i = 0; i < 40; ++i) system += "The cache keeps every whole block of this prompt. ";
  const std::string head = R"({"model": "default", "messages": [{"role": "system", "content": ")" + system +
                           R"("}, {"role": "user", "content": "Go on."}], "temperature": 0, "ignore_eos": true)";
  HttpResponse first = c.post("/v1/chat/completions", head + R"(, "max_tokens": 4})");
  ASSERT_EQ(first.status, 200) << first.body;
  const std::string content(first.json().at("choices").at(0).at("message").at("content").as_string());
  ASSERT_FALSE(content.empty()) << first.body;
  size_t length = 1;  // the first UTF-8 character of the answer: a stop string that ends it at once
  while (length < content.size() && (static_cast<unsigned char>(content[length]) & 0xC0) == 0x80) ++length;
  const std::string stop = json::serialize(json::value(content.substr(0, length)));
  HttpResponse second = c.post("/v1/chat/completions", head + R"(, "max_tokens": 4, "stop": [)" + stop + "]}");
  ASSERT_EQ(second.status, 200) << second.body;
  const json::value& body = second.json();
  EXPECT_EQ(body.at("choices").at(0).at("finish_reason"), "stop") << second.body;
  const int64_t prompt = body.at("usage").at("prompt_tokens").as_int64();
  ASSERT_GE(prompt, 128);
  EXPECT_EQ(body.at("usage").at("prompt_tokens_details").at("cached_tokens").as_int64(), (prompt - 1) / 64 * 64)
      << second.body;
}

// A streamed Anthropic answer's message_start splits the prompt as the final usage does: the tokens read from the
// prefix cache are cache_read_input_tokens, not input_tokens (regression: message_start went out before the count
// was known and reported every prompt token as input).
TEST_F(ApiTest, AnthropicMessageStartReportsTheCachedTokens) {
  TestClient c = client();
  std::string system;
  for (int i = 0; i < 40; ++i) system += "Every whole block of this prompt is read from the cache. ";
  const std::string request = R"({"model": "default", "system": ")" + system +
                              R"(", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3,
                              "temperature": 0, "stream": true})";
  HttpResponse first = c.post("/v1/messages", request);
  ASSERT_EQ(first.status, 200) << first.body;
  HttpResponse second = c.post("/v1/messages", request);
  ASSERT_EQ(second.status, 200) << second.body;
  std::vector<SseEvent> events = parse_sse(second.body);
  ASSERT_GE(events.size(), 3u);
  ASSERT_EQ(events.front().event, "message_start");
  const json::value start = json::parse(events.front().data);
  const json::value& usage = start.at("message").at("usage");
  const int64_t cached = usage.at("cache_read_input_tokens").as_int64();
  const int64_t prompt = usage.at("input_tokens").as_int64() + cached;
  ASSERT_GE(prompt, 128);
  EXPECT_EQ(cached, (prompt - 1) / 64 * 64) << events.front().data;
}

TEST_F(ApiTest, ChatStreamingMatchesNonStreamingAndCountsUsage) {
  TestClient c = client();
  HttpResponse plain = c.post("/v1/chat/completions", chat());
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::string expected = std::string(plain.json().at("choices").at(0).at("message").at("content").as_string());

  HttpResponse response = c.post("/v1/chat/completions",
                                 chat(R"(, "stream": true, "stream_options": {"include_usage": true}, "logprobs": true,
                                        "top_logprobs": 2)"));
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(response.headers["content-type"], "text/event-stream");
  std::vector<SseEvent> events = parse_sse(response.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back().data, "[DONE]");
  std::string content;
  int64_t logprob_tokens = 0;
  std::string finish_reason;
  json::object usage;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json::object chunk = json::parse(events[i].data).as_object();
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_TRUE(chunk.contains("usage"));
    json::array& choices = chunk["choices"].as_array();
    if (choices.empty()) {
      usage = chunk["usage"].as_object();
      continue;
    }
    json::object& choice = choices[0].as_object();
    json::object& delta = choice["delta"].as_object();
    if (i == 0) {
      EXPECT_EQ(str(delta["role"]), "assistant");
    }
    if (delta.contains("content")) content += delta["content"].as_string();
    if (choice["logprobs"].is_object()) {
      for (const json::value& entry : choice["logprobs"].at("content").as_array()) {
        ++logprob_tokens;
        EXPECT_EQ(entry.at("top_logprobs").as_array().size(), 2u);
        EXPECT_LE(entry.at("logprob").to_number<double>(), 0.0);
      }
    }
    if (choice["finish_reason"].is_string()) finish_reason = choice["finish_reason"].as_string();
  }
  EXPECT_EQ(content, expected);
  EXPECT_EQ(finish_reason, "length");
  EXPECT_EQ(logprob_tokens, 6);
  ASSERT_FALSE(usage.empty());
  EXPECT_EQ(usage["prompt_tokens"].as_int64(), rendered_prompt_tokens(chat()));
  EXPECT_EQ(usage["completion_tokens"].as_int64(), 6);
}

// vLLM's return_token_ids: the prompt's ids and the generated ids, streamed and not, chat and completions
// (a breaker found it accepted and ignored).
TEST_F(ApiTest, ReturnTokenIdsGivesThePromptAndTheGeneratedIds) {
  TestClient c = client();
  HttpResponse plain = c.post("/v1/chat/completions", chat(R"(, "return_token_ids": true)"));
  ASSERT_EQ(plain.status, 200) << plain.body;
  json::object body = plain.json().as_object();
  ASSERT_TRUE(body.contains("prompt_token_ids")) << plain.body;
  EXPECT_EQ(static_cast<int64_t>(body["prompt_token_ids"].as_array().size()), rendered_prompt_tokens(chat()));
  const json::array generated = body["choices"].at(0).at("token_ids").as_array();
  ASSERT_EQ(generated.size(), 6u);

  HttpResponse streamed = c.post("/v1/chat/completions", chat(R"(, "return_token_ids": true, "stream": true)"));
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  json::array streamed_ids;
  int prompt_ids_seen = 0;
  for (const SseEvent& event : parse_sse(streamed.body)) {
    if (event.data == "[DONE]") continue;
    json::object chunk = json::parse(event.data).as_object();
    if (chunk.contains("prompt_token_ids")) {
      ++prompt_ids_seen;
      EXPECT_EQ(chunk["prompt_token_ids"], body["prompt_token_ids"]);
    }
    if (chunk["choices"].as_array().empty()) continue;
    const json::object& choice = chunk["choices"].at(0).as_object();
    if (const json::value* delta_ids = choice.if_contains("token_ids")) {
      for (const json::value& id : delta_ids->as_array()) streamed_ids.push_back(id);
      // Regression (a new user's pass): the opening chunk (the role, no text) carried the first token's id, and
      // the chunk with its text none. A chunk's ids are those of its own text.
      const json::object& delta = choice.at("delta").as_object();
      const json::value* content = delta.if_contains("content");
      const bool has_text = content != nullptr && content->is_string() && !content->as_string().empty();
      if (!delta_ids->as_array().empty()) {
        EXPECT_TRUE(has_text) << event.data;
      }
    }
  }
  EXPECT_EQ(prompt_ids_seen, 1);
  EXPECT_EQ(streamed_ids, generated);

  HttpResponse completion =
      c.post("/v1/completions", R"({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                    "ignore_eos": true, "return_token_ids": true})");
  ASSERT_EQ(completion.status, 200) << completion.body;
  const json::value completion_body = completion.json();
  const json::object& choice = completion_body.at("choices").at(0).as_object();
  EXPECT_EQ(choice.at("prompt_token_ids").as_array().size(),
            tokenizer()->encode("The capital of France is", recipe::TextTrust::kTrusted).size() + 1);  // + BOS
  std::vector<recipe::TokenId> ids;
  for (const json::value& id : choice.at("token_ids").as_array()) ids.push_back(static_cast<recipe::TokenId>(id.as_int64()));
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(tokenizer()->decode(ids), std::string(choice.at("text").as_string()));

  HttpResponse wrong = c.post("/v1/chat/completions", chat(R"(, "return_token_ids": "yes")"));
  EXPECT_EQ(wrong.status, 400);
  EXPECT_NE(wrong.body.find("return_token_ids"), std::string::npos) << wrong.body;
  // The other dialects do not return ids: refused there, never accepted and ignored.
  for (const char* path : {"/v1/messages", "/v1/responses"}) {
    HttpResponse refused = c.post(path, R"({"model": "default", "max_tokens": 4, "max_output_tokens": 16,
                                            "messages": [{"role": "user", "content": "Hi"}], "input": "Hi",
                                            "return_token_ids": true})");
    EXPECT_EQ(refused.status, 400) << path;
    EXPECT_NE(refused.body.find("return_token_ids"), std::string::npos) << refused.body;
  }
}

TEST_F(ApiTest, ChatSeededSamplingIsReproducible) {
  TestClient c = client();
  const std::string request = chat(R"(, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7,
                                      "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                                      "logit_bias": {"100": -100})");
  HttpResponse first = c.post("/v1/chat/completions", request);
  HttpResponse second = c.post("/v1/chat/completions", request);
  ASSERT_EQ(first.status, 200) << first.body;
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(first.json().at("choices").at(0).at("message").at("content"),
            second.json().at("choices").at(0).at("message").at("content"));
}

TEST_F(ApiTest, CompletionsWithTextAndTokenPrompts) {
  TestClient c = client();
  HttpResponse text = c.post("/v1/completions",
                             R"({"model": "default", "prompt": "The capital of France is", "max_tokens": 5,
                                 "temperature": 0, "ignore_eos": true, "logprobs": 1})");
  ASSERT_EQ(text.status, 200) << text.body;
  json::object body = text.json().as_object();
  EXPECT_EQ(body["object"], "text_completion");
  const std::vector<recipe::TokenId> ids = tokenizer()->encode("The capital of France is", recipe::TextTrust::kTrusted);
  EXPECT_EQ(body["usage"].at("prompt_tokens").as_int64(), static_cast<int64_t>(ids.size()) + 1);  // + BOS
  EXPECT_EQ(body["usage"].at("completion_tokens").as_int64(), 5);
  const json::object& choice = body["choices"].at(0).as_object();
  EXPECT_EQ(choice.at("finish_reason"), "length");
  EXPECT_EQ(choice.at("logprobs").at("tokens").as_array().size(), 5u);
  EXPECT_EQ(choice.at("logprobs").at("top_logprobs").at(0).as_object().size(), 1u);

  // The same prompt as token ids (BOS included) gives the same text.
  json::array id_array{0};
  for (recipe::TokenId id : ids) id_array.push_back(id);
  HttpResponse tokens = c.post(
      "/v1/completions",
      json::serialize(json::object{{"prompt", id_array}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}}));
  ASSERT_EQ(tokens.status, 200) << tokens.body;
  EXPECT_EQ(tokens.json().at("choices").at(0).at("text"), choice.at("text"));

  HttpResponse stream =
      c.post("/v1/completions", json::serialize(json::object{{"prompt", id_array},
                                                             {"max_tokens", 5},
                                                             {"temperature", 0},
                                                             {"ignore_eos", true},
                                                             {"stream", true},
                                                             {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(stream.status, 200) << stream.body;
  std::string streamed;
  int64_t completion_tokens = -1;
  for (const SseEvent& event : parse_sse(stream.body)) {
    if (event.data == "[DONE]") continue;
    json::object chunk = json::parse(event.data).as_object();
    if (!chunk["choices"].as_array().empty()) streamed += chunk["choices"].at(0).at("text").as_string();
    if (chunk["usage"].is_object()) completion_tokens = chunk["usage"].at("completion_tokens").as_int64();
  }
  EXPECT_EQ(streamed, std::string(choice.at("text").as_string()));
  EXPECT_EQ(completion_tokens, 5);
}

TEST_F(ApiTest, AnthropicMessages) {
  TestClient c = client();
  const std::string request =
      R"({"model": "default", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                                                         {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                          "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                                    {"type": "text", "text": "Thanks"}]}],
          "tools": [{"name": "get_weather", "description": "Weather by city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
          "temperature": 0)";
  HttpResponse response =
      c.post("/v1/messages", request + "}", {{"x-api-key", "anything"}, {"anthropic-version", "2023-06-01"}});
  ASSERT_EQ(response.status, 200) << response.body;
  json::object body = response.json().as_object();
  EXPECT_EQ(body["type"], "message");
  EXPECT_EQ(body["role"], "assistant");
  EXPECT_TRUE(body["id"].as_string().starts_with("msg_"));
  EXPECT_TRUE(body["content"].is_array());
  EXPECT_EQ(body["usage"].at("output_tokens").as_int64(), 4);
  EXPECT_GT(body["usage"].at("input_tokens").as_int64(), 20);
  EXPECT_EQ(body["stop_reason"], "max_tokens");

  // count_tokens counts what /v1/messages renders: its input_tokens plus those read from the cache (Anthropic's
  // input_tokens exclude cache reads; a user's finding: they were counted in both).
  HttpResponse counted = c.post("/v1/messages/count_tokens", request + "}");
  ASSERT_EQ(counted.status, 200) << counted.body;
  EXPECT_EQ(counted.json().at("input_tokens").as_int64(),
            body["usage"].at("input_tokens").as_int64() + body["usage"].at("cache_read_input_tokens").as_int64());
  // Errors on every /v1/messages route are Anthropic-shaped, the 404 of an unknown one included.
  HttpResponse missing = c.post("/v1/messages/batches", request + "}");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(missing.json().at("type"), "error") << missing.body;
  EXPECT_EQ(missing.json().at("error").at("type"), "not_found_error") << missing.body;
  HttpResponse bad_count = c.post("/v1/messages/count_tokens", R"({"model": "default", "messages": []})");
  EXPECT_EQ(bad_count.status, 400);
  EXPECT_EQ(bad_count.json().at("error").at("type"), "invalid_request_error") << bad_count.body;

  HttpResponse stream = c.post("/v1/messages", request + R"(, "stream": true})");
  ASSERT_EQ(stream.status, 200) << stream.body;
  std::vector<SseEvent> events = parse_sse(stream.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.front().event, "message_start");
  EXPECT_EQ(events[events.size() - 2].event, "message_delta");
  EXPECT_EQ(events.back().event, "message_stop");
  json::object start = json::parse(events.front().data).as_object();
  EXPECT_EQ(start["message"].at("usage").at("input_tokens").as_int64() +
                start["message"].at("usage").at("cache_read_input_tokens").as_int64(),
            counted.json().at("input_tokens").as_int64());
  json::object delta = json::parse(events[events.size() - 2].data).as_object();
  EXPECT_EQ(delta["delta"].at("stop_reason"), "max_tokens");
  EXPECT_EQ(delta["usage"].at("output_tokens").as_int64(), 4);
  int open_blocks = 0;
  for (const SseEvent& event : events) {
    EXPECT_EQ(json::parse(event.data).at("type").as_string(), event.event);
    if (event.event == "content_block_start") ++open_blocks;
    if (event.event == "content_block_stop") --open_blocks;
    EXPECT_GE(open_blocks, 0);
    EXPECT_LE(open_blocks, 1);
  }
  EXPECT_EQ(open_blocks, 0);
}

TEST_F(ApiTest, ModelsHealthAndMetrics) {
  TestClient c = client();
  HttpResponse models = c.get("/v1/models");
  ASSERT_EQ(models.status, 200);
  json::object model = models.json().at("data").at(0).as_object();
  EXPECT_EQ(model["id"], kModelName);
  EXPECT_EQ(model["object"], "model");
  EXPECT_EQ(model["max_model_len"].as_int64(), 4096);
  EXPECT_TRUE(model["description"].is_string());
  EXPECT_EQ(c.get("/v1/models/default").status, 200);
  EXPECT_EQ(c.get("/v1/models/other").status, 404);

  HttpResponse health = c.get("/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_TRUE(health.keep_alive);

  ASSERT_EQ(c.post("/v1/chat/completions", chat()).status, 200);
  HttpResponse metrics = c.get("/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_TRUE(metrics.headers["content-type"].starts_with("text/plain"));
  for (const char* name :
       {"deepinfer_time_to_first_token_seconds_bucket", "deepinfer_time_per_output_token_seconds_count",
        "deepinfer_e2e_request_latency_seconds_sum", "deepinfer_prompt_tokens_total",
        "deepinfer_generation_tokens_total", "deepinfer_prompt_tokens_cached_total", "deepinfer_num_requests_running",
        "deepinfer_num_requests_waiting", "deepinfer_kv_cache_blocks_used", "deepinfer_kv_cache_blocks_free",
        "deepinfer_requests_total{outcome=\"length\"}", "deepinfer_client_disconnects_total",
        "deepinfer_kv_tier_usage_blocks{tier=\"device\"}", "deepinfer_kv_tier_hits_total{tier=\"device\"}",
        "deepinfer_kv_tier_misses_total{tier=\"device\"}", "deepinfer_kv_tier_loaded_blocks_total",
        "deepinfer_tokenization_cache_hits_total", "deepinfer_tokenization_cache_misses_total",
        "deepinfer_tokenization_cache_hit_tokens_total", "deepinfer_tokenization_cache_miss_tokens_total",
        "deepinfer_tokenization_cache_evictions_total", "deepinfer_tokenization_cache_bytes",
        "deepinfer_spec_draft_tokens_total", "deepinfer_spec_accepted_tokens_total",
        "deepinfer_spec_verify_length_count"}) {
    EXPECT_NE(metrics.body.find(name), std::string::npos) << name;
  }
  EXPECT_GE(metric_value(metrics.body, "deepinfer_generation_tokens_total"), 6);
  EXPECT_EQ(metric_value(metrics.body, "deepinfer_kv_cache_blocks_used"), 0);
}

// Speculative decoding's series, from the engine's counters: totals, acceptance by position, verify-length histogram.
TEST(MetricsTest, SpeculativeDecodingCountersAreExported) {
  server::Metrics metrics;
  engine::EngineLoad load;
  load.speculative.record(2, 2);
  load.speculative.record(2, 0);
  load.speculative.record(1, 1);
  const std::string text = metrics.render(load, {});
  EXPECT_EQ(metric_value(text, "deepinfer_spec_draft_tokens_total"), 5);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_accepted_tokens_total"), 3);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_emitted_tokens_total"), 6);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_draft_tokens_by_position_total{position=\"1\"}"), 3);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_accepted_tokens_by_position_total{position=\"1\"}"), 2);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_accepted_tokens_by_position_total{position=\"2\"}"), 1);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_verify_length_bucket{le=\"2\"}"), 1);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_verify_length_bucket{le=\"3\"}"), 3);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_verify_length_count"), 3);
  EXPECT_EQ(metric_value(text, "deepinfer_spec_verify_length_sum"), 8);
}

TEST_F(ApiTest, KvCacheClassHeaderPicksARetentionClassOrIsRejected) {
  TestClient c = client();
  EXPECT_EQ(c.post("/v1/chat/completions", chat(), {{"X-KV-Cache-Class", "agent"}}).status, 200);
  HttpResponse bad = c.post("/v1/chat/completions", chat(), {{"X-KV-Cache-Class", "forever"}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("X-KV-Cache-Class: 'forever' is not a retention class"), std::string::npos) << bad.body;
}

TEST_F(ApiTest, TokenizeDetokenizeRoundTrip) {
  TestClient c = client();
  const std::string text = "Hello, world! 你好，世界 🙂";
  HttpResponse tokenized =
      c.post("/tokenize", json::serialize(json::object{{"prompt", text}, {"add_special_tokens", false}}));
  ASSERT_EQ(tokenized.status, 200) << tokenized.body;
  json::object body = tokenized.json().as_object();
  EXPECT_EQ(body["count"].as_int64(), static_cast<int64_t>(body["tokens"].as_array().size()));
  EXPECT_EQ(body["max_model_len"].as_int64(), 4096);
  HttpResponse detokenized = c.post("/detokenize", json::serialize(json::object{{"tokens", body["tokens"]}}));
  ASSERT_EQ(detokenized.status, 200) << detokenized.body;
  EXPECT_EQ(str(detokenized.json().at("prompt")), text);

  // A chat: the count is the rendered prompt's, the number the usage reports.
  HttpResponse chat_tokens = c.post("/tokenize", chat());
  ASSERT_EQ(chat_tokens.status, 200) << chat_tokens.body;
  EXPECT_EQ(chat_tokens.json().at("count").as_int64(), rendered_prompt_tokens(chat()));
}

TEST_F(ApiTest, AGrowingConversationIsTokenizedFromTheCache) {
  TestClient c = client();
  // Long enough turns that each is cached (runs of at least TokenizationCache::kDefaultMinCachedBytes).
  const std::string question = "Please explain, in a few careful sentences, how a radix tree indexes prefixes.";
  const std::string answer = "A radix tree stores each shared prefix once, so lookups walk the common path once.";
  json::array messages{json::object{{"role", "user"}, {"content", question}}};
  auto tokenize = [&] {
    HttpResponse response = c.post("/tokenize", json::serialize(json::object{{"messages", messages}}));
    EXPECT_EQ(response.status, 200) << response.body;
    return response.json().at("count").as_int64();
  };
  tokenize();
  const std::string before = c.get("/metrics").body;
  messages.push_back(json::object{{"role", "assistant"}, {"content", answer}});
  messages.push_back(json::object{{"role", "user"}, {"content", "And how is a block found again after eviction?"}});
  const int64_t count = tokenize();
  const std::string after = c.get("/metrics").body;
  // The first turn came from the cache; the ids are the uncached render's.
  EXPECT_GE(metric_value(after, "deepinfer_tokenization_cache_hits_total"),
            metric_value(before, "deepinfer_tokenization_cache_hits_total") + 1);
  EXPECT_GT(metric_value(after, "deepinfer_tokenization_cache_hit_tokens_total"),
            metric_value(before, "deepinfer_tokenization_cache_hit_tokens_total"));
  EXPECT_GT(metric_value(after, "deepinfer_tokenization_cache_bytes"), 0);
  EXPECT_EQ(count, rendered_prompt_tokens(json::serialize(json::object{{"messages", messages}})));
}

// Issue 16: a prompt refused for its length leaves the shared tokenization cache as it was (it used to insert its
// runs, evicting other conversations' entries).
TEST_F(ApiTest, APromptTooLongForTheModelDoesNotFillTheTokenizationCache) {
  TestClient c = client();
  std::string long_text;
  for (int i = 0; i < 3000; ++i) long_text += "radix " + std::to_string(i) + " ";
  const std::string body = json::serialize(json::object{
      {"model", "default"}, {"messages", json::array{json::object{{"role", "user"}, {"content", long_text}}}}});
  const double before = metric_value(c.get("/metrics").body, "deepinfer_tokenization_cache_bytes");
  HttpResponse refused = c.post("/v1/chat/completions", body);
  ASSERT_EQ(refused.status, 400) << refused.body;
  EXPECT_NE(refused.body.find("context_length_exceeded"), std::string::npos) << refused.body;
  EXPECT_EQ(metric_value(c.get("/metrics").body, "deepinfer_tokenization_cache_bytes"), before);
}

// Numbers as clients expect them (issue 16): logprobs like -11.25, not boost::json's -1.125E1.
TEST_F(ApiTest, NumbersArePrintedInPlainNotation) {
  TestClient c = client();
  HttpResponse response = c.post("/v1/chat/completions", chat(R"(, "logprobs": true, "top_logprobs": 2)"));
  ASSERT_EQ(response.status, 200) << response.body;
  const json::value body = response.json();
  ASSERT_TRUE(body.at("choices").at(0).at("logprobs").at("content").at(0).at("logprob").is_double());
  for (size_t i = 0; i + 1 < response.body.size(); ++i) {
    const bool digit = response.body[i] >= '0' && response.body[i] <= '9';
    ASSERT_FALSE(digit && response.body[i + 1] == 'E') << "boost exponent form at " << i << ": "
                                                        << response.body.substr(i > 20 ? i - 20 : 0, 40);
  }
}

TEST_F(ApiTest, ToolChoice) {
  TestClient c = client();
  const std::string tools = R"(, "tools": [{"type": "function", "function": {"name": "get_weather",
                                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  EXPECT_EQ(c.post("/v1/chat/completions", chat(tools + R"(, "tool_choice": "auto")")).status, 200);
  // The default model's format (deepseek-v3) does not describe tools to the model: required and a named
  // function cannot be honoured, so they are refused, naming the field and the format (issue 16).
  HttpResponse required = c.post("/v1/chat/completions", chat(tools + R"(, "tool_choice": "required")"));
  EXPECT_EQ(required.status, 400);
  EXPECT_EQ(required.json().at("error").at("param"), "tool_choice");
  EXPECT_NE(required.body.find("cannot be honoured with the deepseek-v3 prompt format"), std::string::npos)
      << required.body;
  HttpResponse named = c.post("/v1/chat/completions",
                              chat(tools + R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})"));
  EXPECT_EQ(named.status, 400);
  EXPECT_NE(named.body.find("naming the function 'get_weather'"), std::string::npos) << named.body;
  // tool_choice none: the tools are not rendered, so the prompt is the one without tools.
  HttpResponse none = c.post("/v1/chat/completions", chat(tools + R"(, "tool_choice": "none")"));
  ASSERT_EQ(none.status, 200) << none.body;
  EXPECT_EQ(none.json().at("usage").at("prompt_tokens").as_int64(), rendered_prompt_tokens(chat()));
  HttpResponse unknown = c.post("/v1/chat/completions",
                                chat(tools + R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}})"));
  EXPECT_EQ(unknown.status, 400);
  EXPECT_EQ(unknown.json().at("error").at("param"), "tool_choice.function.name");
  EXPECT_EQ(c.post("/v1/chat/completions", chat(R"(, "tool_choice": "required")")).status, 400);
}

// deepseek-v4's two revisions (issue 16): the server renders the one it was started with; the checkpoint's
// own encoder names it.
TEST(ChatFormatRevisionTest, TheServerRendersItsRevisionsEffortPreamblesAndRefusesTheOthersLevels) {
  const std::string body =
      R"({"messages": [{"role": "user", "content": "Prove it."}], "thinking": true, "reasoning_effort": ")";
  auto tokens = [&](Server& server, const std::string& effort) {
    TestClient c(server.port());
    return c.post("/tokenize", body + effort + "\"}");
  };
  TestServerOptions released;
  released.config.chat_format = recipe::PromptFormat::kDeepSeekV4;
  std::unique_ptr<Server> r0731 = start_server(released);
  TestServerOptions preview = released;
  preview.config.chat_format_revision = recipe::V4Revision::kPreview;
  std::unique_ptr<Server> rpreview = start_server(preview);

  // 0731's `high` is the preview's `max`, token for token; 0731's `max` is longer (its own text).
  HttpResponse high = tokens(*r0731, "high");
  HttpResponse preview_max = tokens(*rpreview, "max");
  HttpResponse max = tokens(*r0731, "max");
  ASSERT_EQ(high.status, 200) << high.body;
  ASSERT_EQ(preview_max.status, 200) << preview_max.body;
  ASSERT_EQ(max.status, 200) << max.body;
  EXPECT_EQ(high.json().at("tokens"), preview_max.json().at("tokens"));
  EXPECT_NE(max.json().at("tokens"), high.json().at("tokens"));
  EXPECT_EQ(tokens(*r0731, "xhigh").json().at("tokens"), max.json().at("tokens"));
  EXPECT_EQ(tokens(*r0731, "low").json().at("tokens"), tokens(*rpreview, "high").json().at("tokens"));
  HttpResponse medium = tokens(*r0731, "medium");
  EXPECT_EQ(medium.status, 400);
  EXPECT_NE(medium.body.find("low, high, xhigh or max"), std::string::npos) << medium.body;
  EXPECT_EQ(tokens(*rpreview, "medium").status, 200);
}

TEST(ChatFormatRevisionTest, TheCheckpointNamesItsChatFormat) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("deepinfer-format-" + std::to_string(getpid()));
  fs::create_directories(dir / "encoding");
  EXPECT_EQ(checkpoint_chat_format(dir, "deepseek_v3").value(), recipe::PromptFormat::kDeepSeekV3);
  EXPECT_FALSE(checkpoint_chat_format(dir, "llama").ok());
  std::ofstream(dir / "encoding" / "encoding_dsv32.py") << "# V3.2\n";
  EXPECT_EQ(checkpoint_chat_format(dir, "deepseek_v3").value(), recipe::PromptFormat::kDeepSeekV32);
  std::ofstream(dir / "encoding" / "encoding_dsv41.py") << "# V4.1\n";
  EXPECT_EQ(checkpoint_chat_format(dir, "deepseek_v3").value(), recipe::PromptFormat::kDeepSeekV41);
  std::ofstream(dir / "config.json") << R"({"model_type": "deepseek_v3", "chat_format": "deepseek-r1"})";
  EXPECT_EQ(checkpoint_chat_format(dir, "deepseek_v3").value(), recipe::PromptFormat::kDeepSeekR1);
  std::ofstream(dir / "config.json") << R"({"model_type": "deepseek_v3", "chat_format": "chatml"})";
  Result<recipe::PromptFormat> bad = checkpoint_chat_format(dir, "deepseek_v3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("config.json's chat_format must be one of"), std::string::npos)
      << bad.status().message();
  fs::remove_all(dir);
}

// Image input on deepseek-v4.1: the format renders a placeholder token, but there is no vision encoder, so every
// generation endpoint refuses it (400 naming the message list) instead of answering without the image; /tokenize
// and count_tokens still render it.
TEST(ImageInputTest, GenerationEndpointsRefuseImagesTheModelCouldNotSee) {
  TestServerOptions options;
  options.config.chat_format = recipe::PromptFormat::kDeepSeekV41;
  std::unique_ptr<Server> server = start_server(options);
  TestClient c(server->port());
  const std::string png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";
  const std::string chat_image = R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
      {"type": "image_url", "image_url": {"url": "data:image/png;base64,)" + png + R"("}}]}], "max_tokens": 4)";
  HttpResponse chat_response = c.post("/v1/chat/completions", chat_image + "}");
  EXPECT_EQ(chat_response.status, 400) << chat_response.body;
  EXPECT_EQ(chat_response.json().at("error").at("param"), "messages");
  EXPECT_NE(chat_response.body.find("vision encoder"), std::string::npos) << chat_response.body;
  EXPECT_EQ(c.post("/tokenize", chat_image + "}").status, 200);
  const std::string anthropic = R"({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [
      {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ")" + png + R"("}},
      {"type": "text", "text": "What is it?"}]}]})";
  HttpResponse messages = c.post("/v1/messages", anthropic, {{"anthropic-version", "2023-06-01"}});
  EXPECT_EQ(messages.status, 400) << messages.body;
  EXPECT_EQ(messages.json().at("type"), "error");
  EXPECT_EQ(c.post("/v1/messages/count_tokens", anthropic).status, 200);
  HttpResponse responses = c.post("/v1/responses", R"({"max_output_tokens": 4, "input": [{"role": "user", "content": [
      {"type": "input_text", "text": "What is it?"},
      {"type": "input_image", "image_url": "data:image/png;base64,)" + png + R"("}]}]})");
  EXPECT_EQ(responses.status, 400) << responses.body;
  EXPECT_EQ(responses.json().at("error").at("param"), "input");
  // Text alone is served as before.
  EXPECT_EQ(c.post("/v1/chat/completions", chat()).status, 200);
  // parallel_tool_calls must be a boolean: a 400 naming it (both dialects that have it).
  for (const char* path : {"/v1/chat/completions", "/v1/responses"}) {
    const std::string body = std::string(path) == "/v1/responses"
                                 ? std::string(R"({"input": "hi", "parallel_tool_calls": 0})")
                                 : chat(R"(, "parallel_tool_calls": "false")");
    HttpResponse refused = c.post(path, body);
    EXPECT_EQ(refused.status, 400) << path << ": " << refused.body;
    EXPECT_EQ(refused.json().at("error").at("param"), "parallel_tool_calls") << path << ": " << refused.body;
  }
}

// A DSML format (issue 16): tool_choice required / named prefill the tool-call block of the prompt the server
// generates from (the parser then starts inside it, recipe::stream_parser_options); a forced tool call with
// thinking and json_object without the word "json" are 400s naming their field.
TEST(DsmlFormatTest, AForcedToolChoicePrefillsTheToolCallBlockAndRefusalsNameTheirField) {
  TestServerOptions options;
  options.config.chat_format = recipe::PromptFormat::kDeepSeekV4;
  std::unique_ptr<Server> server = start_server(options);
  TestClient c(server->port());
  const std::string tools = R"(, "tools": [{"type": "function", "function": {"name": "get_weather",
                                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const std::string opener = "<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n";
  for (const std::string choice : {R"("required")", R"({"type": "function", "function": {"name": "get_weather"}})"}) {
    const std::string body = chat(tools + R"(, "tool_choice": )" + choice);
    HttpResponse tokens = c.post("/tokenize", body);
    ASSERT_EQ(tokens.status, 200) << tokens.body;
    const json::value listed = tokens.json();
    std::vector<recipe::TokenId> ids;
    for (const json::value& id : listed.at("tokens").as_array()) ids.push_back(id.to_number<recipe::TokenId>());
    EXPECT_TRUE(tokenizer()->decode(ids).ends_with(opener)) << tokenizer()->decode(ids);
    HttpResponse response = c.post("/v1/chat/completions", body);
    ASSERT_EQ(response.status, 200) << response.body;
    EXPECT_EQ(response.json().at("usage").at("prompt_tokens").as_int64(), static_cast<int64_t>(ids.size()));
  }
  // A named function is the one the answer calls, even from random weights: the answer is forced to begin with its
  // invoke header (RenderedPrompt::answer_prefix; the prompt above is unchanged), in both dialects, streamed or not.
  const std::string named_tools =
      R"("tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
                   {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])";
  for (const bool stream : {false, true}) {
    const std::string body = R"({"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30,
        "temperature": 0, )" + named_tools + R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "stream": )" + (stream ? "true" : "false") + "}";
    HttpResponse named = c.post("/v1/chat/completions", body);
    ASSERT_EQ(named.status, 200) << named.body;
    if (!stream) {
      const json::value reply = named.json();
      const json::value& message = reply.at("choices").at(0).at("message");
      ASSERT_TRUE(message.at("tool_calls").is_array()) << named.body;
      ASSERT_EQ(message.at("tool_calls").as_array().size(), 1u) << named.body;
      EXPECT_EQ(message.at("tool_calls").at(0).at("function").at("name"), "get_time") << named.body;
    } else {
      EXPECT_NE(named.body.find(R"("name":"get_time")"), std::string::npos) << named.body;
      EXPECT_EQ(named.body.find(R"("name":"get_weather")"), std::string::npos) << named.body;
    }
  }
  // "required" with several tools: the call names one of them, even from random weights (the answer may begin only
  // with one of their invoke headers: RenderedPrompt::answer_prefix_choices; before, the model could name a tool
  // it knew from training that the request did not offer). Greedy and sampled, in both dialects.
  for (const int seed : {0, 1, 2, 3, 4, 5}) {
    const std::string sampling =
        seed == 0 ? R"("temperature": 0)" : R"("temperature": 1, "seed": )" + std::to_string(seed);
    HttpResponse required =
        c.post("/v1/chat/completions", R"({"model": "default", "max_tokens": 30, )" + sampling +
                                           R"(, "messages": [{"role": "user", "content": "Hi"}], )" + named_tools +
                                           R"(, "tool_choice": "required"})");
    ASSERT_EQ(required.status, 200) << required.body;
    const json::value reply = required.json();
    const json::value& message = reply.at("choices").at(0).at("message");
    ASSERT_TRUE(message.at("tool_calls").is_array()) << required.body;
    ASSERT_GE(message.at("tool_calls").as_array().size(), 1u) << required.body;
    const std::string name(message.at("tool_calls").at(0).at("function").at("name").as_string());
    EXPECT_TRUE(name == "get_weather" || name == "get_time") << required.body;
  }
  HttpResponse any = c.post("/v1/messages", R"({"model": "default", "max_tokens": 30, "temperature": 0,
      "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "any"},
      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}},
                {"name": "get_time", "input_schema": {"type": "object"}}]})");
  ASSERT_EQ(any.status, 200) << any.body;
  const json::value any_answer = any.json();
  int any_uses = 0;
  for (const json::value& block : any_answer.at("content").as_array()) {
    if (block.at("type") != "tool_use") continue;
    ++any_uses;
    EXPECT_TRUE(block.at("name") == "get_weather" || block.at("name") == "get_time") << any.body;
  }
  EXPECT_GE(any_uses, 1) << any.body;
  // A forced choice with nothing to force: the answer would continue the last assistant message (a helper found
  // it generated plain text, the choice dropped). A 400 naming tool_choice, in each dialect.
  HttpResponse continued = c.post("/v1/chat/completions", R"({"model": "default", "max_tokens": 4,
      "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me check."}], )" +
                                      named_tools + R"(, "tool_choice": "required"})");
  EXPECT_EQ(continued.status, 400) << continued.body;
  EXPECT_EQ(continued.json().at("error").at("param"), "tool_choice") << continued.body;
  HttpResponse continued_anthropic = c.post("/v1/messages", R"({"model": "default", "max_tokens": 4,
      "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me check."}],
      "tool_choice": {"type": "tool", "name": "get_time"}, "tools": [{"name": "get_time", "input_schema": {}}]})");
  EXPECT_EQ(continued_anthropic.status, 400) << continued_anthropic.body;
  EXPECT_EQ(continued_anthropic.json().at("error").at("type"), "invalid_request_error") << continued_anthropic.body;
  HttpResponse anthropic = c.post("/v1/messages", R"({"model": "default", "max_tokens": 30, "temperature": 0,
      "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "tool", "name": "get_time"},
      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}},
                {"name": "get_time", "input_schema": {"type": "object"}}]})");
  ASSERT_EQ(anthropic.status, 200) << anthropic.body;
  int uses = 0;
  const json::value answer = anthropic.json();
  for (const json::value& block : answer.at("content").as_array()) {
    if (block.at("type") != "tool_use") continue;
    ++uses;
    EXPECT_EQ(block.at("name"), "get_time") << anthropic.body;
  }
  EXPECT_EQ(uses, 1) << anthropic.body;
  HttpResponse thinking =
      c.post("/v1/chat/completions", chat(tools + R"(, "tool_choice": "required", "thinking": true)"));
  EXPECT_EQ(thinking.status, 400);
  EXPECT_EQ(thinking.json().at("error").at("param"), "tool_choice");
  HttpResponse json_object = c.post("/v1/chat/completions", chat(R"(, "response_format": {"type": "json_object"})"));
  EXPECT_EQ(json_object.status, 400);
  EXPECT_EQ(json_object.json().at("error").at("param"), "response_format");
  EXPECT_NE(json_object.body.find("needs the word"), std::string::npos) << json_object.body;
  const std::string asks_for_json =
      R"({"model": "default", "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 4,
          "response_format": {"type": "json_object"}})";
  EXPECT_EQ(c.post("/v1/chat/completions", asks_for_json).status, 200);
}

TEST(ChatFormatRevisionTest, TheCheckpointsEncoderNamesTheRevision) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("deepinfer-revision-" + std::to_string(getpid()));
  fs::create_directories(dir / "encoding");
  EXPECT_EQ(checkpoint_v4_revision(dir), std::nullopt);
  auto write = [&](const std::string& text) { std::ofstream(dir / "encoding" / "encoding_dsv4.py") << text; };
  write("REASONING_EFFORT_MAX = 'Reasoning Effort: Absolute maximum with no shortcuts permitted.'\n");
  EXPECT_EQ(checkpoint_v4_revision(dir), recipe::V4Revision::kPreview);
  write("HIGH = 'Reasoning Effort: Absolute maximum ...'\nMAX = 'Reasoning Effort: Beyond maximum ...'\n");
  EXPECT_EQ(checkpoint_v4_revision(dir), recipe::V4Revision::k0731);
  write("# no effort text\n");
  EXPECT_EQ(checkpoint_v4_revision(dir), std::nullopt);
  fs::remove_all(dir);
}

// CORS (--allowed-origins; issue 16): off by default; a listed origin gets Access-Control-Allow-Origin on every
// response and a 204 to its preflight, before authentication.
TEST(CorsTest, AListedOriginIsAnsweredAndOthersAreNot) {
  namespace http = boost::beast::http;
  TestServerOptions options;
  options.config.allowed_origins = {"https://app.example"};
  options.config.api_key = "secret";
  std::unique_ptr<Server> server = start_server(options);
  TestClient c(server->port());
  HttpResponse preflight = c.request(http::verb::options, "/v1/chat/completions", "",
                                     {{"Origin", "https://app.example"},
                                      {"Access-Control-Request-Method", "POST"},
                                      {"Access-Control-Request-Headers", "authorization, content-type"}});
  EXPECT_EQ(preflight.status, 204) << preflight.body;
  EXPECT_EQ(preflight.headers["access-control-allow-origin"], "https://app.example");
  EXPECT_EQ(preflight.headers["access-control-allow-headers"], "authorization, content-type");
  EXPECT_NE(preflight.headers["access-control-allow-methods"].find("POST"), std::string::npos);
  HttpResponse chat_response = c.post("/v1/chat/completions", chat(), {{"Origin", "https://app.example"},
                                                                       {"Authorization", "Bearer secret"}});
  EXPECT_EQ(chat_response.status, 200) << chat_response.body;
  EXPECT_EQ(chat_response.headers["access-control-allow-origin"], "https://app.example");
  HttpResponse stream = c.post("/v1/chat/completions", chat(R"(, "stream": true)"),
                               {{"Origin", "https://app.example"}, {"Authorization", "Bearer secret"}});
  EXPECT_EQ(stream.status, 200);
  EXPECT_EQ(stream.headers["access-control-allow-origin"], "https://app.example");
  HttpResponse unauthorized = c.post("/v1/chat/completions", chat(), {{"Origin", "https://app.example"}});
  EXPECT_EQ(unauthorized.status, 401);
  EXPECT_EQ(unauthorized.headers["access-control-allow-origin"], "https://app.example");  // the page can read why
  HttpResponse other = c.post("/v1/chat/completions", chat(), {{"Origin", "https://evil.example"},
                                                               {"Authorization", "Bearer secret"}});
  EXPECT_EQ(other.status, 200);
  EXPECT_FALSE(other.headers.contains("access-control-allow-origin"));
  HttpResponse other_preflight = c.request(http::verb::options, "/v1/chat/completions", "",
                                           {{"Origin", "https://evil.example"}, {"Access-Control-Request-Method", "POST"}});
  EXPECT_NE(other_preflight.status, 204);
  EXPECT_FALSE(other_preflight.headers.contains("access-control-allow-origin"));
}

}  // namespace
}  // namespace deepinfer::server::testing

namespace deepinfer::server::testing {
namespace {

// The demo model's tokenizer behind an ApiContext in the deepseek-v4.1 format (max_model_len 8,192).
struct DemoApi {
  std::shared_ptr<const recipe::Tokenizer> tokenizer;
  ModelInfo model;
  ApiContext context() const { return ApiContext{&model, tokenizer, nullptr, recipe::PromptFormat::kDeepSeekV41}; }
};

std::unique_ptr<DemoApi> demo_api() {
  auto loaded = recipe::Tokenizer::load(std::filesystem::path(DEEPINFER_SOURCE_DIR) / "models/demo");
  EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  if (!loaded.ok()) return nullptr;
  auto api = std::make_unique<DemoApi>();
  api->tokenizer = std::move(loaded).value();
  api->model.served_model_name = "default";
  api->model.vocab_size = 129280;
  api->model.max_model_len = 8192;
  return api;
}

// Anthropic's thinking.budget_tokens reaches the engine as a thinking budget (the engine's forcing is tested in
// tests/unit/sampler_test.cpp and mtp_engine_test.cpp): after that many reasoning tokens, `</think>` (or, with
// tools, the DSML token that opens a call block inside reasoning). Anthropic's rule max_tokens > budget_tokens is
// kept; without thinking there is no budget. The demo model's tokenizer and the deepseek-v4.1 format.
TEST(ThinkingBudgetTest, BudgetTokensBecomeTheEnginesThinkingBudget) {
  std::unique_ptr<DemoApi> api = demo_api();
  ASSERT_NE(api, nullptr);
  const std::shared_ptr<const recipe::Tokenizer>& demo = api->tokenizer;
  const ApiContext context = api->context();
  auto plan = [&](const std::string& extra) {
    return plan_anthropic_messages(
        json::parse(R"({"model": "default", "messages": [{"role": "user", "content": "Think first."}])" + extra + "}"), context);
  };
  const recipe::TokenId think_end = *demo->added_token_id("</think>");
  const recipe::TokenId dsml = *demo->added_token_id("｜DSML｜");

  auto thinking = plan(R"(, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024})");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(thinking)) << std::get<ApiError>(thinking).message;
  const engine::SamplingParams& params = std::get<GenerationPlan>(thinking).params;
  EXPECT_EQ(params.reasoning_budget, 1024);
  EXPECT_EQ(params.reasoning_end_token_ids, std::vector<recipe::TokenId>{think_end});
  EXPECT_FALSE(params.is_plain_greedy());

  auto tools = plan(R"(, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1500},
                      "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}])");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(tools)) << std::get<ApiError>(tools).message;
  EXPECT_EQ(std::get<GenerationPlan>(tools).params.reasoning_budget, 1500);
  EXPECT_EQ(std::get<GenerationPlan>(tools).params.reasoning_end_token_ids,
            (std::vector<recipe::TokenId>{think_end, dsml}));

  auto too_small = plan(R"(, "max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(too_small));
  EXPECT_EQ(std::get<ApiError>(too_small).status, 400);
  EXPECT_EQ(std::get<ApiError>(too_small).param, "max_tokens");
  EXPECT_EQ(std::get<ApiError>(too_small).message,
            "max_tokens must be greater than thinking.budget_tokens (max_tokens 1024, budget_tokens 1024)");

  auto disabled = plan(R"(, "max_tokens": 16, "thinking": {"type": "disabled"})");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(disabled));
  EXPECT_FALSE(std::get<GenerationPlan>(disabled).params.reasoning_budget.has_value());
}

// The same budget on /v1/chat/completions (Regression, a break-it pass 2026-12-06: `thinking.budget_tokens` was
// accepted there and ignored). Any positive budget; max_tokens (or max_completion_tokens) must exceed it; without a
// max_tokens the budget still applies (the request may run to the context's end).
TEST(ThinkingBudgetTest, ChatCompletionsEnforceTheBudgetToo) {
  std::unique_ptr<DemoApi> api = demo_api();
  ASSERT_NE(api, nullptr);
  const std::shared_ptr<const recipe::Tokenizer>& demo = api->tokenizer;
  const ApiContext context = api->context();
  auto plan = [&](const std::string& extra) {
    return plan_chat_completion(
        json::parse(R"({"model": "default", "messages": [{"role": "user", "content": "Think first."}])" + extra + "}"),
        context);
  };
  const recipe::TokenId think_end = *demo->added_token_id("</think>");

  auto small = plan(R"(, "max_tokens": 24, "thinking": {"type": "enabled", "budget_tokens": 3})");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(small)) << std::get<ApiError>(small).message;
  EXPECT_EQ(std::get<GenerationPlan>(small).params.reasoning_budget, 3);
  EXPECT_EQ(std::get<GenerationPlan>(small).params.reasoning_end_token_ids, std::vector<recipe::TokenId>{think_end});

  auto no_max = plan(R"(, "thinking": {"type": "enabled", "budget_tokens": 100})");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(no_max)) << std::get<ApiError>(no_max).message;
  EXPECT_EQ(std::get<GenerationPlan>(no_max).params.reasoning_budget, 100);

  auto too_small = plan(R"(, "max_completion_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 8})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(too_small));
  EXPECT_EQ(std::get<ApiError>(too_small).param, "max_completion_tokens");
  EXPECT_EQ(std::get<ApiError>(too_small).message, "max_completion_tokens must be greater than "
                                                   "thinking.budget_tokens (max_completion_tokens 8, budget_tokens 8)");

  auto no_budget = plan(R"(, "max_tokens": 24, "thinking": {"type": "enabled"})");
  ASSERT_TRUE(std::holds_alternative<GenerationPlan>(no_budget));
  EXPECT_FALSE(std::get<GenerationPlan>(no_budget).params.reasoning_budget.has_value());

  auto disabled = plan(R"(, "max_tokens": 24, "thinking": {"type": "disabled", "budget_tokens": 3})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(disabled));
  EXPECT_EQ(std::get<ApiError>(disabled).param, "thinking.budget_tokens");
}

}  // namespace
}  // namespace deepinfer::server::testing
