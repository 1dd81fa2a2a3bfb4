// Response builders (response_builder.h) and the output builder's text input: one scripted V4.1 output (reasoning,
// content, a tool call) through an OutputBuilder into each dialect's builder, streamed and whole. The streamed
// chunks must rebuild the whole response's message exactly; the server tests check the bytes on the wire.
#include "deepinfer/recipe/response_builder.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "deepinfer/recipe/output_builder.h"
#include "deepinfer/recipe/responses_request.h"
#include "test_data.h"

namespace deepinfer::recipe {
namespace {

namespace json = boost::json;

constexpr std::string_view kOutput =
    "Let me look.</think>Checking the weather.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
    "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>";

std::shared_ptr<const Tokenizer> tokenizer() {
  static Result<std::shared_ptr<const Tokenizer>> loaded = Tokenizer::load(deepinfer::testing::tokenizer_path());
  EXPECT_TRUE(loaded.ok()) << loaded.status().to_string() << " (run scripts/setup.sh to fetch the tokenizer)";
  return loaded.ok() ? *loaded : nullptr;
}

OutputBuilder v41_builder(std::vector<std::string> stops = {}) {
  StreamParserOptions options;
  options.starts_in_reasoning = true;
  return OutputBuilder(StreamParser(PromptFormat::kDeepSeekV41, tokenizer(), options), tokenizer(), std::move(stops));
}

// The output fed as text in pieces of `piece_bytes` (cut at character boundaries), all chunks of a stream.
struct Streamed {
  std::vector<StreamChunk> chunks;
  OutputMessage message;
  json::object whole;
};

Streamed run(ResponseBuilder& streaming, ResponseBuilder& whole, size_t piece_bytes) {
  OutputBuilder builder = v41_builder();
  FinishInfo info;
  info.prompt_tokens = 7;
  Streamed out;
  std::vector<TokenLogprobs> logprobs;
  streaming.start(info, out.chunks);
  std::vector<StreamEvent> events;
  for (size_t at = 0; at < kOutput.size();) {
    size_t end = std::min(kOutput.size(), at + piece_bytes);
    while (end < kOutput.size() && (static_cast<unsigned char>(kOutput[end]) & 0xC0) == 0x80) ++end;
    builder.push_text(kOutput.substr(at, end - at), events);
    ++info.completion_tokens;
    streaming.deltas(events, logprobs, out.chunks);
    events.clear();
    at = end;
  }
  builder.finish(events);
  streaming.deltas(events, logprobs, out.chunks);
  streaming.finish(builder.message(), info, logprobs, out.chunks);
  out.message = builder.message();
  out.whole = whole.response(builder.message(), info, logprobs);
  return out;
}

TEST(ResponseBuilderTest, ChatChunksRebuildTheWholeMessage) {
  for (size_t piece : {1, 5, 4096}) {
    auto streaming = chat_completion_builder({"chatcmpl-1", "m", 9}, /*include_usage=*/true, false, nullptr);
    auto whole = chat_completion_builder({"chatcmpl-1", "m", 9}, false, false, nullptr);
    Streamed out = run(*streaming, *whole, piece);
    std::string reasoning, content, name, arguments;
    ASSERT_GE(out.chunks.size(), 4u) << "piece " << piece;
    EXPECT_TRUE(out.chunks.back().done);
    const json::object& usage = out.chunks[out.chunks.size() - 2].data;
    EXPECT_EQ(usage.at("usage").at("prompt_tokens").as_int64(), 7);
    EXPECT_EQ(out.chunks[out.chunks.size() - 3].data.at("choices").at(0).at("finish_reason"), "tool_calls");
    for (const StreamChunk& chunk : out.chunks) {
      if (chunk.done || chunk.data.at("choices").as_array().empty()) continue;
      const json::object& delta = chunk.data.at("choices").at(0).at("delta").as_object();
      if (auto* r = delta.if_contains("reasoning_content")) reasoning += r->as_string();
      if (auto* c = delta.if_contains("content")) content += c->as_string();
      if (auto* calls = delta.if_contains("tool_calls")) {
        const json::object& function = calls->at(0).at("function").as_object();
        if (auto* n = function.if_contains("name")) name += n->as_string();
        arguments += function.at("arguments").as_string();
      }
    }
    const json::object& message = out.whole.at("choices").at(0).at("message").as_object();
    EXPECT_EQ(reasoning, "Let me look.") << "piece " << piece;
    EXPECT_EQ(reasoning, message.at("reasoning_content").as_string());
    EXPECT_EQ(content, message.at("content").as_string());
    EXPECT_EQ(name, "get_weather");
    EXPECT_EQ(json::parse(arguments), json::parse(R"({"city": "Paris"})"));
    EXPECT_EQ(arguments, message.at("tool_calls").at(0).at("function").at("arguments").as_string());
    EXPECT_EQ(out.whole.at("object"), "chat.completion");
    EXPECT_EQ(out.whole.at("id"), "chatcmpl-1");
  }
}

TEST(ResponseBuilderTest, MessagesEventsOpenAndCloseBlocksInOrder) {
  auto streaming = messages_builder({"msg_1", "m", 0});
  auto whole = messages_builder({"msg_1", "m", 0});
  Streamed out = run(*streaming, *whole, 3);
  std::vector<std::string> names;
  for (const StreamChunk& chunk : out.chunks) {
    if (chunk.event != "content_block_delta" && (names.empty() || names.back() != chunk.event))
      names.push_back(chunk.event);
  }
  const std::vector<std::string> expected = {"message_start",       "content_block_start", "content_block_stop",
                                             "content_block_start", "content_block_stop",  "content_block_start",
                                             "content_block_stop",  "message_delta",       "message_stop"};
  EXPECT_EQ(names, expected);
  const json::array& content = out.whole.at("content").as_array();
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(content[0].at("type"), "thinking");
  EXPECT_EQ(content[2].at("input"), json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(out.whole.at("stop_reason"), "tool_use");
}

TEST(ResponseBuilderTest, ResponsesEventsAreNumberedAndEndCompleted) {
  json::object echo = responses_echo(json::parse(R"({"input": "hi"})").as_object(), std::nullopt, true, 1.0, 1.0);
  auto streaming = responses_builder({"resp_1", "m", 9}, echo);
  auto whole = responses_builder({"resp_1", "m", 9}, echo);
  Streamed out = run(*streaming, *whole, 7);
  for (size_t i = 0; i < out.chunks.size(); ++i) {
    EXPECT_EQ(out.chunks[i].data.at("sequence_number").as_int64(), static_cast<int64_t>(i));
    EXPECT_EQ(out.chunks[i].event, out.chunks[i].data.at("type").as_string());
  }
  EXPECT_EQ(out.chunks.back().event, "response.completed");
  const json::array& streamed_output = out.chunks.back().data.at("response").at("output").as_array();
  const json::array& output = out.whole.at("output").as_array();
  ASSERT_EQ(streamed_output.size(), output.size());
  for (size_t i = 0; i < output.size(); ++i) EXPECT_EQ(streamed_output[i].at("type"), output[i].at("type"));
  EXPECT_EQ(out.whole.at("tool_choice"), "auto");
  EXPECT_EQ(out.whole.at("status"), "completed");
}

// Issue 16: usage.output_tokens_details.reasoning_tokens counts the reasoning block's tokens (it was always 0),
// and the item the length limit cut off is "incomplete", as the response is.
TEST(ResponseBuilderTest, ReasoningTokensAreCountedAndALengthCutItemIsIncomplete) {
  std::vector<TokenId> ids;
  tokenizer()->encode(kOutput, TextTrust::kTrusted, ids);
  std::vector<TokenId> reasoning;
  tokenizer()->encode("Let me look.</think>", TextTrust::kTrusted, reasoning);
  ASSERT_LT(reasoning.size(), ids.size());
  ASSERT_TRUE(std::equal(reasoning.begin(), reasoning.end(), ids.begin()));
  OutputBuilder builder = v41_builder();
  std::vector<StreamEvent> events;
  for (TokenId id : ids) builder.push(id, events);
  builder.finish(events);
  EXPECT_EQ(builder.reasoning_tokens(), static_cast<int64_t>(reasoning.size()));

  FinishInfo info;
  info.kind = FinishInfo::Kind::kLength;
  info.completion_tokens = static_cast<int64_t>(ids.size());
  info.reasoning_tokens = builder.reasoning_tokens();
  std::vector<TokenLogprobs> logprobs;
  json::object echo = responses_echo(json::parse(R"({"input": "hi"})").as_object(), std::nullopt, true, 1.0, 1.0);
  json::object whole = responses_builder({"resp_1", "m", 9}, echo)->response(builder.message(), info, logprobs);
  EXPECT_EQ(whole.at("status"), "incomplete");
  const json::array& output = whole.at("output").as_array();
  ASSERT_EQ(output.size(), 3u);  // reasoning, message, function_call
  EXPECT_EQ(output[1].at("status"), "completed");
  EXPECT_EQ(output[2].at("status"), "incomplete");
  EXPECT_EQ(whole.at("usage").at("output_tokens_details").at("reasoning_tokens").as_int64(), info.reasoning_tokens);
}

// Anthropic counts cache reads apart from input_tokens (OpenAI's prompt_tokens include them): 100 prompt tokens of
// which 64 came from the cache are input_tokens 36 + cache_read_input_tokens 64. Regression: both said 100.
TEST(ResponseBuilderTest, AnthropicInputTokensLeaveOutCacheReads) {
  FinishInfo info;
  info.prompt_tokens = 100;
  info.cached_tokens = 64;
  info.completion_tokens = 3;
  std::vector<TokenLogprobs> logprobs;
  OutputBuilder builder = v41_builder();
  json::object whole = messages_builder({"msg_1", "m", 0})->response(builder.message(), info, logprobs);
  EXPECT_EQ(whole.at("usage").at("input_tokens").as_int64(), 36);
  EXPECT_EQ(whole.at("usage").at("cache_read_input_tokens").as_int64(), 64);
  json::object chat =
      chat_completion_builder({"chatcmpl-1", "m", 0}, false, false, nullptr)->response(builder.message(), info, logprobs);
  EXPECT_EQ(chat.at("usage").at("prompt_tokens").as_int64(), 100);
}

TEST(ResponseBuilderTest, SseFramesPerDialect) {
  EXPECT_EQ(sse_frame({"", json::object{{"a", -0.5}}, false}), "data: {\"a\":-0.5}\n\n");
  EXPECT_EQ(sse_frame({"message_stop", json::object{{"type", "message_stop"}}, false}),
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
  EXPECT_EQ(sse_frame({"", {}, true}), "data: [DONE]\n\n");
  EXPECT_EQ(to_json_text(error_object({404, "no", "model", ""}, ErrorDialect::kAnthropic)),
            R"({"type":"error","error":{"type":"not_found_error","message":"no"}})");
  EXPECT_EQ(to_json_text(error_object({400, "bad", "", ""}, ErrorDialect::kOpenAI)),
            R"({"error":{"message":"bad","type":"invalid_request_error","param":null,"code":null}})");
}

// Text and ids give the same message: push_text encodes with added tokens matched, and the parser matches markers
// on the decoded text.
TEST(ResponseBuilderTest, TextInputEqualsTokenInput) {
  OutputBuilder by_text = v41_builder({"weather"});
  OutputBuilder by_ids = v41_builder({"weather"});
  std::vector<StreamEvent> events;
  by_text.push_text(kOutput, events);
  by_text.finish(events);
  for (TokenId id : tokenizer()->encode(kOutput, TextTrust::kUntrusted)) {
    if (by_ids.push(id, events)) break;
  }
  by_ids.finish(events);
  EXPECT_EQ(by_text.message().content, "Checking the ");
  EXPECT_EQ(by_text.message().content, by_ids.message().content);
  EXPECT_EQ(by_text.message().reasoning, by_ids.message().reasoning);
  EXPECT_EQ(by_text.stop_string(), std::optional<std::string>("weather"));
}

// At most one tool call (parallel_tool_calls: false): push() reports the end when the first call is complete, the
// second call never reaches the events or the message, and finish() adds nothing.
TEST(ResponseBuilderTest, OneToolCallWhenParallelCallsAreOff) {
  constexpr std::string_view kTwoCalls =
      "Let me look.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
      "<｜DSML｜ invoke name=\"get_time\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Rome</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
      "</｜DSML｜ calls>";
  for (int32_t limit : {0, 1}) {
    OutputBuilder builder = v41_builder();
    if (limit > 0) builder.set_max_tool_calls(limit);
    std::vector<StreamEvent> events;
    bool stopped = false;
    size_t pushed = 0;
    const std::vector<TokenId> ids = tokenizer()->encode(kTwoCalls, TextTrust::kUntrusted);
    for (TokenId id : ids) {
      ++pushed;
      if ((stopped = builder.push(id, events))) break;
    }
    if (!stopped) builder.finish(events);
    const auto begins = std::count_if(events.begin(), events.end(),
                                      [](const StreamEvent& e) { return e.kind == StreamEvent::Kind::kToolCallBegin; });
    if (limit == 0) {
      EXPECT_FALSE(stopped);
      EXPECT_EQ(begins, 2);
      ASSERT_EQ(builder.message().tool_calls.size(), 2u);
      EXPECT_FALSE(builder.tool_call_limit_reached());
    } else {
      EXPECT_TRUE(stopped);
      EXPECT_TRUE(builder.tool_call_limit_reached());
      EXPECT_FALSE(builder.stop_string().has_value());
      EXPECT_LT(pushed, ids.size());  // generation ends at the first call's end, not at the block's
      EXPECT_EQ(begins, 1);
      ASSERT_EQ(builder.message().tool_calls.size(), 1u);
      EXPECT_EQ(builder.message().tool_calls[0].name, "get_weather");
      EXPECT_EQ(builder.message().tool_calls[0].arguments_text, R"({"city": "Paris"})");
      std::vector<StreamEvent> after;
      EXPECT_TRUE(builder.push(ids.back(), after));
      builder.finish(after);
      EXPECT_TRUE(after.empty());
    }
  }
}

// A call the parser closes on malformed markup (an unknown tag inside the invoke) is not the one complete call:
// with the limit, generation goes on as without it, and the markup is content as before (regression: the limit
// stopped there and the client got arguments "{" and no content).
TEST(ResponseBuilderTest, AMalformedCallDoesNotCountTowardTheLimit) {
  constexpr std::string_view kMalformed =
      "Let me look.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ param name=\"city\" string=\"true\">Paris</｜DSML｜ param>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  OutputMessage unlimited;
  for (int32_t limit : {0, 1}) {
    OutputBuilder builder = v41_builder();
    if (limit > 0) builder.set_max_tool_calls(limit);
    std::vector<StreamEvent> events;
    bool stopped = false;
    for (TokenId id : tokenizer()->encode(kMalformed, TextTrust::kUntrusted)) {
      if ((stopped = builder.push(id, events))) break;
    }
    EXPECT_FALSE(stopped) << "limit " << limit;
    builder.finish(events);
    EXPECT_EQ(builder.malformed_tool_calls(), 1);
    EXPECT_FALSE(builder.tool_call_limit_reached());
    EXPECT_NE(builder.message().content.find("param name="), std::string::npos) << builder.message().content;
    if (limit == 0) {
      unlimited = builder.message();
    } else {
      EXPECT_EQ(builder.message().content, unlimited.content);
      EXPECT_EQ(builder.message().tool_calls.size(), unlimited.tool_calls.size());
    }
  }
}

}  // namespace
}  // namespace deepinfer::recipe
