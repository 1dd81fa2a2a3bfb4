// POST /v1/responses end to end on one in-process server: the response object with exact usage, the streaming
// event sequence (whose deltas concatenate to the non-streaming text), a multi-turn tool conversation that
// renders exactly as the equivalent chat request, and OpenAI error bodies that name the field.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server_fixture.h"

namespace deepinfer::server::testing {
namespace {

namespace json = boost::json;

class ResponsesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = start_server().release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  TestClient client() { return TestClient(server_->port()); }
  static Server* server_;
};
Server* ResponsesTest::server_ = nullptr;

const std::string kRequest =
    R"({"model": "default", "instructions": "You are terse.", "input": "Hello, who are you?",
        "max_output_tokens": 6, "temperature": 0, "ignore_eos": true)";
// The same conversation as a chat request, for the prompt length.
const std::string kEquivalentChat =
    R"({"messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hello, who are you?"}]})";

std::string request(const std::string& extra = "") { return kRequest + extra + "}"; }

// The output_text of a non-streaming response's message items.
std::string output_text(const json::object& response) {
  std::string text;
  for (const json::value& item : response.at("output").as_array()) {
    if (item.at("type") != "message") continue;
    for (const json::value& part : item.at("content").as_array()) {
      if (part.at("type") == "output_text") text += part.at("text").as_string();
    }
  }
  return text;
}

TEST_F(ResponsesTest, NonStreamingTextHasExactUsage) {
  TestClient c = client();
  HttpResponse response = c.post("/v1/responses", request());
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(response.headers["content-type"], "application/json");
  json::object body = response.json().as_object();
  EXPECT_TRUE(body["id"].as_string().starts_with("resp_"));
  EXPECT_EQ(body["object"], "response");
  EXPECT_EQ(body["model"], kModelName);
  EXPECT_TRUE(body["created_at"].is_int64());
  // max_output_tokens ran out (ignore_eos): incomplete, as OpenAI reports it.
  EXPECT_EQ(body["status"], "incomplete");
  EXPECT_EQ(body["incomplete_details"].at("reason"), "max_output_tokens");
  EXPECT_EQ(body["instructions"], "You are terse.");
  const json::array& output = body["output"].as_array();
  ASSERT_EQ(output.size(), 1u) << response.body;
  const json::object& message = output[0].as_object();
  EXPECT_EQ(message.at("type"), "message");
  EXPECT_EQ(message.at("role"), "assistant");
  EXPECT_EQ(message.at("status"), "incomplete");  // cut off by the limit, as the response (issue 16)
  EXPECT_TRUE(message.at("id").as_string().starts_with("msg_"));
  const json::object& part = message.at("content").at(0).as_object();
  EXPECT_EQ(part.at("type"), "output_text");
  EXPECT_TRUE(part.at("text").is_string());
  EXPECT_TRUE(part.at("annotations").as_array().empty());
  const json::object& usage = body["usage"].as_object();
  EXPECT_EQ(usage.at("input_tokens").as_int64(), rendered_prompt_tokens(kEquivalentChat));
  EXPECT_EQ(usage.at("output_tokens").as_int64(), 6);
  EXPECT_EQ(usage.at("total_tokens").as_int64(), usage.at("input_tokens").as_int64() + 6);
  EXPECT_EQ(usage.at("input_tokens_details").at("cached_tokens").as_int64(), 0);
  EXPECT_EQ(usage.at("output_tokens_details").at("reasoning_tokens").as_int64(), 0);
}

TEST_F(ResponsesTest, StreamEventOrderAndDeltasMatchNonStreaming) {
  TestClient c = client();
  HttpResponse plain = c.post("/v1/responses", request());
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::string expected = output_text(plain.json().as_object());
  ASSERT_FALSE(expected.empty()) << plain.body;

  HttpResponse response = c.post("/v1/responses", request(R"(, "stream": true)"));
  ASSERT_EQ(response.status, 200) << response.body;
  EXPECT_EQ(response.headers["content-type"], "text/event-stream");
  std::vector<SseEvent> events = parse_sse(response.body);
  ASSERT_GE(events.size(), 9u) << response.body;
  std::vector<std::string> types;
  std::string deltas, done_text, part_text;
  std::string item_id;
  for (size_t i = 0; i < events.size(); ++i) {
    SCOPED_TRACE(events[i].data);
    json::object data = json::parse(events[i].data).as_object();
    EXPECT_EQ(data["type"].as_string(), events[i].event);
    EXPECT_EQ(data["sequence_number"].as_int64(), static_cast<int64_t>(i));
    const std::string type = events[i].event;
    // Consecutive deltas collapse to one entry, so the order reads as a grammar.
    if (type != "response.output_text.delta" || types.empty() || types.back() != type) types.push_back(type);
    if (type == "response.output_item.added") item_id = data["item"].at("id").as_string();
    if (type == "response.output_text.delta") {
      EXPECT_EQ(data["item_id"].as_string(), item_id);
      EXPECT_EQ(data["output_index"].as_int64(), 0);
      EXPECT_EQ(data["content_index"].as_int64(), 0);
      deltas += data["delta"].as_string();
    }
    if (type == "response.output_text.done") done_text = data["text"].as_string();
    if (type == "response.content_part.done") part_text = data["part"].at("text").as_string();
  }
  const std::vector<std::string> expected_order = {"response.created",           "response.in_progress",
                                                   "response.output_item.added", "response.content_part.added",
                                                   "response.output_text.delta", "response.output_text.done",
                                                   "response.content_part.done", "response.output_item.done",
                                                   "response.incomplete"};
  EXPECT_EQ(types, expected_order);
  EXPECT_EQ(deltas, expected);
  EXPECT_EQ(done_text, expected);
  EXPECT_EQ(part_text, expected);

  json::object created = json::parse(events.front().data).as_object();
  EXPECT_EQ(created["response"].at("status"), "in_progress");
  EXPECT_TRUE(created["response"].at("output").as_array().empty());
  json::object last = json::parse(events.back().data).as_object();
  const json::object& final_response = last["response"].as_object();
  EXPECT_EQ(final_response.at("status"), "incomplete");
  EXPECT_EQ(final_response.at("id"), created["response"].at("id"));
  EXPECT_EQ(output_text(final_response), expected);
  EXPECT_EQ(final_response.at("output").at(0).at("id").as_string(), item_id);
  EXPECT_EQ(final_response.at("usage").at("input_tokens").as_int64(), rendered_prompt_tokens(kEquivalentChat));
  EXPECT_EQ(final_response.at("usage").at("output_tokens").as_int64(), 6);
}

// Two tool rounds: reasoning + a call with no text (content null), then text + a call in one assistant turn.
const std::string kToolInput = R"(
  "instructions": "Use the tools.",
  "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call the tool for Paris."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris is sunny."}]},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
    {"role": "user", "content": "Thanks"}],
  "tools": [{"type": "function", "name": "get_weather", "description": "Weather by city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])";

std::string chat_equivalent(const std::string& paris_arguments) {
  return R"({"model": "default", "max_tokens": 2, "temperature": 0, "ignore_eos": true,
    "messages": [
      {"role": "system", "content": "Use the tools."},
      {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
      {"role": "assistant", "content": null, "reasoning_content": "Call the tool for Paris.",
       "tool_calls": [{"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": )" +
         paris_arguments + R"(}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
      {"role": "assistant", "content": "Paris is sunny.",
       "tool_calls": [{"id": "call_2", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
      {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
      {"role": "user", "content": "Thanks"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})";
}

TEST_F(ResponsesTest, MultiTurnToolConversationRendersLikeTheChatRequest) {
  TestClient c = client();
  HttpResponse response =
      c.post("/v1/responses", R"({"model": "default", "max_output_tokens": 2, "temperature": 0, "ignore_eos": true,)" +
                                  kToolInput + "}");
  ASSERT_EQ(response.status, 200) << response.body;
  const int64_t input_tokens = response.json().at("usage").at("input_tokens").as_int64();

  HttpResponse chat = c.post("/v1/chat/completions", chat_equivalent(R"("{\"city\": \"Paris\"}")"));
  ASSERT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(input_tokens, chat.json().at("usage").at("prompt_tokens").as_int64());
  EXPECT_EQ(input_tokens, rendered_prompt_tokens(chat_equivalent(R"("{\"city\": \"Paris\"}")")));
  // The arguments reach the prompt: other arguments render to another length.
  EXPECT_NE(input_tokens, rendered_prompt_tokens(chat_equivalent(R"("{}")")));

  HttpResponse stream =
      c.post("/v1/responses", R"({"max_output_tokens": 2, "stream": true, "ignore_eos": true,)" + kToolInput + "}");
  ASSERT_EQ(stream.status, 200) << stream.body;
  std::vector<SseEvent> events = parse_sse(stream.body);
  ASSERT_FALSE(events.empty());
  json::object last = json::parse(events.back().data).as_object();
  EXPECT_EQ(last["response"].at("usage").at("input_tokens").as_int64(), input_tokens);
  // The request's tools come back on the response object, flat as sent.
  EXPECT_EQ(last["response"].at("tools").at(0).at("name"), "get_weather");
}

void expect_error(const HttpResponse& response, int status, const std::string& param, const std::string& message_part) {
  SCOPED_TRACE(param);
  EXPECT_EQ(response.status, status) << response.body;
  EXPECT_EQ(response.headers.at("content-type"), "application/json");
  json::value body;
  ASSERT_NO_THROW(body = json::parse(response.body)) << response.body;
  const json::object& error = body.at("error").as_object();
  EXPECT_NE(std::string(error.at("message").as_string()).find(message_part), std::string::npos) << response.body;
  EXPECT_TRUE(error.at("type").is_string());
  ASSERT_TRUE(error.contains("code"));
  EXPECT_EQ(str(error.at("param")), param) << response.body;
}

TEST_F(ResponsesTest, ErrorsNameTheField) {
  TestClient c = client();
  expect_error(c.post("/v1/responses", R"({"model": "default"})"), 400, "input", "input is required");
  expect_error(c.post("/v1/responses", R"({"input": 5})"), 400, "input", "input must be a string or an array");
  expect_error(c.post("/v1/responses", R"({"input": [{"role": "user", "content": "Hi"},
                                                     {"type": "web_search_call", "id": "ws_1"}]})"),
               400, "input[1].type", "\"web_search_call\" is not supported");
  expect_error(c.post("/v1/responses", R"({"input": [{"role": "user", "content": "Hi"},
      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c1", "output": "ok"},
      {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": "}]})"),
               400, "input[3].arguments", "input[3].arguments is not valid JSON");
  expect_error(c.post("/v1/responses", R"({"input": [{"type": "function_call", "call_id": "c1", "name": "f",
                                                      "arguments": "[1, 2]"}]})"),
               400, "input[0].arguments", "must hold a JSON object");
  expect_error(c.post("/v1/responses", R"({"input": [{"role": "user", "content": [{"type": "input_file"}]}]})"), 400,
               "input[0].content[0].type", "\"input_file\" is not supported");
  expect_error(c.post("/v1/responses", R"({"input": [{"role": "robot", "content": "Hi"}]})"), 400, "input[0].role",
               "\"robot\"");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "tools": [{"type": "web_search"}]})"), 400, "tools[0].type",
               "only function tools");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "previous_response_id": "resp_1"})"), 400,
               "previous_response_id", "not supported");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "max_output_tokens": 0})"), 400, "max_output_tokens",
               "max_output_tokens");
  expect_error(c.post("/v1/responses", R"({"model": "gpt-4o", "input": "Hi"})"), 404, "model", "gpt-4o");
  // text.format: a JSON format is the chat dialect's response_format, which the default model's format
  // (deepseek-v3) cannot describe: refused, not ignored (issue 16); plain text is fine.
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "w",
                                           "schema": {"type": "object"}}}})"),
               400, "text.format", "not supported with the deepseek-v3 prompt format");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "text": {"format": {"type": "json_object"}}})"), 400,
               "text.format", "deepseek-v3");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "text": {"format": {"type": "json_schema"}}})"), 400,
               "text.format.name", "must be a string");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "text": {"verbosity": "low"}})"), 400, "text.verbosity",
               "not supported");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "reasoning": {"effort": "high"}})"), 400, "reasoning",
               "reasoning is not available with the deepseek-v3 prompt format");
  expect_error(c.post("/v1/responses", R"({"input": "Hi", "temperature": 2.5})"), 400, "temperature", "got 2.5");
  HttpResponse plain = c.post("/v1/responses", R"({"input": "Hi", "text": {"format": {"type": "text"}},
                                                   "max_output_tokens": 1, "temperature": 0.7, "top_p": 0.9})");
  EXPECT_EQ(plain.status, 200);
  // The echoed parameters read as sent (floats in their shortest form: 0.7, not 0.699999988079071).
  EXPECT_NE(plain.body.find(R"("temperature":0.7,)"), std::string::npos) << plain.body;
  EXPECT_NE(plain.body.find(R"("top_p":0.9)"), std::string::npos) << plain.body;
  // The server keeps serving.
  EXPECT_EQ(c.post("/v1/responses", R"({"input": "Hi", "max_output_tokens": 1})").status, 200);
}

}  // namespace
}  // namespace deepinfer::server::testing
