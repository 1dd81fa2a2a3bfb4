// The error table: each bad request gets its status and an error body of the dialect's shape, and the
// server keeps serving good requests afterwards. Also the API key and the concurrency limit.
#include <gtest/gtest.h>

#include <string>

#include "server_fixture.h"

namespace deepinfer::server::testing {
namespace {

namespace json = boost::json;

const std::string kGood =
    R"({"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "ignore_eos": true})";

struct BadRequest {
  std::string name;
  std::string target;
  std::string body;
  int status;
  std::string message_part;  // must occur in error.message
  std::string param;         // expected error.param ("" for null)
};

void expect_openai_error(const HttpResponse& response, int status, const std::string& message_part,
                         const std::string& param, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(response.status, status) << response.body;
  EXPECT_EQ(response.headers.at("content-type"), "application/json");
  json::value body;
  ASSERT_NO_THROW(body = json::parse(response.body)) << response.body;
  ASSERT_TRUE(body.is_object());
  const json::object& error = body.at("error").as_object();
  ASSERT_TRUE(error.at("message").is_string());
  EXPECT_NE(std::string(error.at("message").as_string()).find(message_part), std::string::npos) << response.body;
  EXPECT_TRUE(error.at("type").is_string());
  ASSERT_TRUE(error.contains("param"));
  ASSERT_TRUE(error.contains("code"));
  if (param.empty()) {
    EXPECT_TRUE(error.at("param").is_null()) << response.body;
  } else {
    EXPECT_EQ(str(error.at("param")), param) << response.body;
  }
}

class ErrorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TestServerOptions options;
    options.max_model_len = 64;
    options.config.max_body_bytes = 64 * 1024;
    options.config.max_json_depth = 16;
    server_ = start_server(options).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static Server* server_;
};
Server* ErrorTest::server_ = nullptr;

TEST_F(ErrorTest, EachBadRequestGetsItsStatusAndTheServerKeepsServing) {
  std::string long_prompt = R"({"messages": [{"role": "user", "content": ")";
  for (int i = 0; i < 100; ++i) long_prompt += "word ";
  long_prompt += R"("}]})";
  std::string deep = std::string(40, '[') + std::string(40, ']');
  const std::vector<BadRequest> cases = {
      {"malformed JSON", "/v1/chat/completions", R"({"messages": [)", 400, "not valid JSON", ""},
      {"empty body", "/v1/chat/completions", "", 400, "empty", ""},
      {"not an object", "/v1/chat/completions", "[1, 2]", 400, "must be a JSON object", ""},
      {"messages wrong type", "/v1/chat/completions", R"({"messages": "hi"})", 400, "messages must be an array",
       "messages"},
      {"message content wrong type", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": 5}]})", 400,
       "messages[0].content", "messages[0].content"},
      {"bad role", "/v1/chat/completions", R"({"messages": [{"role": "robot", "content": "x"}]})", 400,
       "messages[0].role", "messages[0].role"},
      {"temperature wrong type", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", 400, "temperature must be a number",
       "temperature"},
      {"temperature out of range", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "temperature": 3})", 400, "[0, 2]", "temperature"},
      {"top_p out of range", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})",
       400, "top_p", "top_p"},
      {"max_tokens zero", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", 400, "max_tokens", "max_tokens"},
      {"n > 1", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "n": 2})", 400,
       "not supported yet", "n"},
      // Regression: a JSON response_format was accepted and ignored by formats that do not describe it.
      {"response_format json on V3", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})", 400,
       "is not supported with the deepseek-v3 prompt format", "response_format"},
      // Regression (a helper's break-it run): an unknown response_format type was accepted, its object printed into
      // the prompt as a schema and the prose answer dropped as non-JSON; a json_schema without one likewise.
      {"response_format xml", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}})", 400,
       "response_format.type must be text, json_object or json_schema", "response_format.type"},
      {"response_format empty", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {}})", 400, "response_format.type",
       "response_format.type"},
      {"response_format json_schema without one", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})", 400,
       "response_format.json_schema must be an object", "response_format.json_schema"},
      {"response_format schema not an object", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", )"
       R"("json_schema": {"name": "x", "schema": 5}}})",
       400, "response_format.json_schema.schema", "response_format.json_schema.schema"},
      {"service_tier priority", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "service_tier": "priority"})", 400, "one tier",
       "service_tier"},
      {"prompt_cache_key not a string", "/v1/responses", R"({"input": "x", "prompt_cache_key": 5})", 400,
       "prompt_cache_key", "prompt_cache_key"},
      {"metadata value not a string", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}})", 400, "must be a string",
       "metadata.k"},
      {"responses stream_options include_usage", "/v1/responses",
       R"({"input": "x", "stream": true, "stream_options": {"include_usage": true}})", 400, "include_obfuscation",
       "stream_options.include_usage"},
      {"duplicate tool names", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "tools": [)"
       R"({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)"
       R"({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})",
       400, "tool names must be unique", "tools[1]"},
      {"empty content array", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": []}]})", 400,
       "must not be an empty array", "messages[0].content"},
      // Regression: accepted on chat and not honoured.
      {"best_of on chat", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "best_of": 3})",
       400, "best_of > 1", "best_of"},
      {"audio modality", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]})", 400, "only [\"text\"]",
       "modalities"},
      {"user not a string", "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "user": 5})",
       400, "user", "user"},
      {"guided_json", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}})", 400,
       "guided_json is not supported yet", "guided_json"},
      // Regression (a break-it pass, 2026-12-06): accepted and ignored.
      {"legacy functions", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]})", 400, "send tools",
       "functions"},
      {"legacy function_call", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "function_call": {"name": "f"}})", 400, "send tool_choice",
       "function_call"},
      {"chat_template override", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"})", 400, "chat_template",
       "chat_template"},
      {"top-level enable_thinking", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "enable_thinking": true})", 400,
       "chat_template_kwargs.enable_thinking", "enable_thinking"},
      {"thinking budget not an integer", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": -5}})", 400,
       "thinking.budget_tokens must be an integer from 1", "thinking.budget_tokens"},
      {"thinking unknown key", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget": 5}})", 400,
       "thinking.budget is not supported", "thinking.budget"},
      {"thinking switches disagree", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "thinking": true,)"
       R"( "chat_template_kwargs": {"thinking": false}})",
       400, "disagrees with thinking", "chat_template_kwargs.thinking"},
      {"thinking kwargs disagree", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}],)"
       R"( "chat_template_kwargs": {"enable_thinking": false, "thinking": true}})",
       400, "send one thinking switch", "chat_template_kwargs.thinking"},
      {"seed past 64 bits", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616})", 400,
       "seed must be an integer from -2^63 to 2^64 - 1", "seed"},
      {"responses logprobs", "/v1/responses", R"({"input": "x", "top_logprobs": 3})", 400,
       "top_logprobs is not supported", "top_logprobs"},
      {"responses include logprobs", "/v1/responses", R"({"input": "x", "include": ["message.output_text.logprobs"]})",
       400, "not supported", "include[0]"},
      {"responses include unknown", "/v1/responses", R"({"input": "x", "include": ["bogus.thing"]})", 400,
       "not one OpenAI defines", "include[0]"},
      {"responses background", "/v1/responses", R"({"input": "x", "background": true})", 400,
       "background is not supported", "background"},
      {"responses stored prompt", "/v1/responses", R"({"input": "x", "prompt": {"id": "pmpt_1"}})", 400,
       "stored prompt template", "prompt"},
      // Regression (a break-it pass, 2026-12-07): any field the endpoint does not read was accepted and ignored.
      {"chat unknown field", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "foo_bar": 1})", 400,
       "Unrecognized request argument supplied: foo_bar", "foo_bar"},
      {"chat vLLM include_stop_str_in_output", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a"], "include_stop_str_in_output": true})", 400,
       "Unrecognized request argument supplied: include_stop_str_in_output", "include_stop_str_in_output"},
      {"chat stream_options unknown key", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "stream": true, )"
       R"("stream_options": {"continuous_usage_stats": true}})",
       400, "stream_options.continuous_usage_stats is not supported", "stream_options.continuous_usage_stats"},
      {"completions guided_choice", "/v1/completions", R"({"prompt": "x", "guided_choice": ["yes", "no"]})", 400,
       "guided_choice is not supported yet", "guided_choice"},
      {"completions chat field", "/v1/completions", R"({"prompt": "x", "tools": []})", 400,
       "Unrecognized request argument supplied: tools", "tools"},
      {"completions max_completion_tokens", "/v1/completions", R"({"prompt": "x", "max_completion_tokens": 1})", 400,
       "Unrecognized request argument supplied: max_completion_tokens", "max_completion_tokens"},
      {"completions user not a string", "/v1/completions", R"({"prompt": "x", "user": 5})", 400, "user", "user"},
      {"responses max_tokens", "/v1/responses", R"({"input": "x", "max_tokens": 2})", 400, "send max_output_tokens",
       "max_tokens"},
      {"responses truncation auto", "/v1/responses", R"({"input": "x", "truncation": "auto"})", 400,
       "only \"disabled\"", "truncation"},
      {"responses max_tool_calls negative", "/v1/responses", R"({"input": "x", "max_tool_calls": -5})", 400,
       "max_tool_calls", "max_tool_calls"},
      {"responses unknown field", "/v1/responses", R"({"input": "x", "verbosity": "low"})", 400,
       "Unrecognized request argument supplied: verbosity", "verbosity"},
      {"responses tool strict not a boolean", "/v1/responses",
       R"({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]})", 400,
       "strict must be a boolean", "tools[0].strict"},
      // Regression (the same pass): strict schemas were accepted and not enforced (no constrained decoding).
      {"json_schema strict", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_schema", )"
       R"("json_schema": {"name": "x", "strict": true, "schema": {"type": "object"}}}})",
       400, "strict: true needs constrained decoding", "response_format.json_schema.strict"},
      {"json_schema strict not a boolean", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_schema", )"
       R"("json_schema": {"name": "x", "strict": "yes", "schema": {"type": "object"}}}})",
       400, "strict must be a boolean", "response_format.json_schema.strict"},
      {"tool strict", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": )"
       R"({"name": "f", "strict": true, "parameters": {"type": "object"}}}]})",
       400, "strict: true needs constrained decoding", "tools[0].function.strict"},
      {"responses text.format strict", "/v1/responses",
       R"({"input": "json", "text": {"format": {"type": "json_schema", "name": "x", "strict": true, )"
       R"("schema": {"type": "object"}}}})",
       400, "strict: true needs constrained decoding", "text.format.strict"},
      // Regression (the same pass): a top_p above 0 that is 0 as a 32-bit float was refused by the engine with a
      // message contradicting the input and no param.
      {"top_p below float precision", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "top_p": 1e-46})", 400, "rounds to 0 as a 32-bit float",
       "top_p"},
      {"logit_bias bad key", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}})", 400, "logit_bias",
       "logit_bias"},
      {"stream_options without stream", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}})", 400,
       "stream_options", "stream_options"},
      {"unknown model", "/v1/chat/completions", R"({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})",
       404, "gpt-4", "model"},
      {"prompt longer than max_model_len", "/v1/chat/completions", long_prompt, 400, "max_model_len is 64", "messages"},
      {"max_tokens past max_model_len", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100})", 400, "max_model_len is 64",
       "max_tokens"},
      // The real total, not one capped at max_model_len (issue 16).
      {"max_tokens far past max_model_len", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000})", 400, "asks for 100", "max_tokens"},
      {"too deep JSON", "/v1/chat/completions", deep, 400, "deeper than 16", ""},
      {"invalid UTF-8", "/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"\xC3\x28\"}]}",
       400, "not valid UTF-8", ""},
      {"completions batch", "/v1/completions", R"({"prompt": ["a", "b"]})", 400, "not supported yet", "prompt"},
      {"completions token out of vocabulary", "/v1/completions", R"({"prompt": [1, 999999]})", 400, "prompt[1]",
       "prompt"},
      {"detokenize bad ids", "/detokenize", R"({"tokens": [-1]})", 400, "tokens[0]", "tokens"},
  };
  TestClient client(server_->port());
  // A review's regressions: values an endpoint takes (its own check accepts them, or null: absent) are not refused
  // as unknown fields.
  for (const auto& [target, body] : std::vector<std::pair<std::string, std::string>>{
           {"/v1/responses",
            R"({"input": "x", "max_output_tokens": 2, "background": false, "return_token_ids": false})"},
           {"/v1/responses", R"({"input": "x", "max_output_tokens": 2, "previous_response_id": null, "prompt": null})"},
           {"/v1/chat/completions",
            R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "functions": null, "foo": null})"},
           // OpenAI's bookkeeping fields, which the SDKs and agent clients send (regression: refused as unknown).
           {"/v1/chat/completions",
            R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "store": false, )"
            R"("metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "s1", "safety_identifier": "u1", )"
            R"("prompt_cache_retention": "24h", "stream": true, )"
            R"("stream_options": {"include_usage": true, "include_obfuscation": false}})"},
           {"/v1/responses",
            R"({"input": "x", "max_output_tokens": 2, "prompt_cache_key": "s1", "safety_identifier": "u1", )"
            R"("service_tier": "default", "prompt_cache_retention": "in-memory", "stream": true, )"
            R"("stream_options": {"include_obfuscation": true}})"},
           {"/v1/messages", R"({"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], )"
                            R"("return_token_ids": false, )"
                            R"("container": null})"}}) {
    HttpResponse taken = client.post(target, body);
    EXPECT_EQ(taken.status, 200) << target << " " << body << " -> " << taken.body;
  }
  // count_tokens names a refused Messages field as /v1/messages does.
  HttpResponse counted =
      client.post("/v1/messages/count_tokens",
                  R"({"model": "default", "messages": [{"role": "user", "content": "x"}], "mcp_servers": []})");
  EXPECT_EQ(counted.status, 400);
  EXPECT_NE(counted.body.find("no MCP connector"), std::string::npos) << counted.body;
  // Regression: count_tokens took values /v1/messages refuses (it checked the Messages fields' names only).
  for (const auto& [extra, part] : std::initializer_list<std::pair<const char*, const char*>>{
           {R"("max_tokens": "4")", "max_tokens"},
           {R"("max_tokens": 0)", "max_tokens"},
           {R"("temperature": 1e308)", "temperature"},
           {R"("top_k": -1)", "top_k"},
           {R"("stop_sequences": "x")", "stop_sequences"},
           {R"("metadata": {"x": "y"})", "metadata.x"},
           {R"("service_tier": "priority")", "service_tier"},
           {R"("return_token_ids": true)", "return_token_ids"}}) {
    HttpResponse refused = client.post(
        "/v1/messages/count_tokens",
        std::string(R"({"model": "default", "messages": [{"role": "user", "content": "x"}], )") + extra + "}");
    EXPECT_EQ(refused.status, 400) << extra << " -> " << refused.body;
    EXPECT_NE(refused.body.find(part), std::string::npos) << extra << " -> " << refused.body;
  }
  HttpResponse with_fields =
      client.post("/v1/messages/count_tokens",
                  R"({"model": "default", "messages": [{"role": "user", "content": "x"}], )"
                  R"("max_tokens": 4, "temperature": 0.5, "stream": true, "metadata": {"user_id": "u"}})");
  EXPECT_EQ(with_fields.status, 200) << with_fields.body;
  for (const BadRequest& bad : cases) {
    HttpResponse response = client.post(bad.target, bad.body);
    expect_openai_error(response, bad.status, bad.message_part, bad.param, bad.name);
    EXPECT_TRUE(response.keep_alive) << bad.name;
    // The same connection still serves a good request.
    HttpResponse good = client.post("/v1/chat/completions", kGood);
    EXPECT_EQ(good.status, 200) << bad.name << ": " << good.body;
  }
}

TEST_F(ErrorTest, RoutesAndMethods) {
  TestClient client(server_->port());
  expect_openai_error(client.get("/v1/nothing"), 404, "no route", "", "unknown route");
  HttpResponse wrong_method = client.get("/v1/chat/completions");
  expect_openai_error(wrong_method, 405, "use POST", "", "wrong method");
  EXPECT_EQ(wrong_method.headers["allow"], "POST");
  EXPECT_EQ(client.post("/v1/chat/completions", kGood).status, 200);
}

TEST_F(ErrorTest, OversizedBodyIs413) {
  TestClient client(server_->port());
  std::string huge = R"({"messages": [{"role": "user", "content": ")" + std::string(100 * 1024, 'a') + R"("}]})";
  HttpResponse response = client.post("/v1/chat/completions", huge);
  expect_openai_error(response, 413, "65536 bytes", "", "oversized body");
  EXPECT_FALSE(response.keep_alive);
  TestClient again(server_->port());
  EXPECT_EQ(again.post("/v1/chat/completions", kGood).status, 200);
}

TEST_F(ErrorTest, MalformedHttpIs400) {
  TestClient client(server_->port());
  HttpResponse response = client.raw("GARBAGE\r\n\r\n");
  EXPECT_EQ(response.status, 400);
  TestClient again(server_->port());
  EXPECT_EQ(again.post("/v1/chat/completions", kGood).status, 200);
}

TEST_F(ErrorTest, AnthropicErrorsHaveAnthropicShape) {
  TestClient client(server_->port());
  for (
      const auto& [body, status] : std::vector<std::pair<std::string, int>>{
          {R"({"model": "default", "messages": [{"role": "user", "content": "x"}]})", 400},  // no max_tokens
          {R"({"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})", 404},
          {R"({"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]})",
           400},
          // Regression (a helper's break-it run): these were accepted.
          {R"({"model": "default", "max_tokens": 5, "service_tier": "bogus", )"
           R"("messages": [{"role": "user", "content": "x"}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "metadata": {"user_id": 5}, )"
           R"("messages": [{"role": "user", "content": "x"}]})",
           400},
          // Regression (a break-it pass, 2026-12-06): accepted and ignored.
          {R"({"model": "default", "max_tokens": 5, "output_format": {"type": "json_schema", "schema": {}}, )"
           R"("messages": [{"role": "user", "content": "x"}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "mcp_servers": [], "messages": [{"role": "user", "content": "x"}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "metadata": {"foo": "x"}, )"
           R"("messages": [{"role": "user", "content": "x"}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "stop_sequences": "table", )"
           R"("messages": [{"role": "user", "content": "x"}]})",
           400},
          {R"({"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": []}]})", 400},
          // Regression (a break-it pass, 2026-12-07): OpenAI's sampling fields and unknown ones were ignored.
          {R"({"model": "default", "max_tokens": 5, "seed": 42, "messages": [{"role": "user", "content": "x"}]})", 400},
          {R"({"model": "default", "max_tokens": 5, "foo": 1, "messages": [{"role": "user", "content": "x"}]})", 400},
          {"{", 400}}) {
    HttpResponse response = client.post("/v1/messages", body);
    EXPECT_EQ(response.status, status) << body << " -> " << response.body;
    json::object error = response.json().as_object();
    EXPECT_EQ(error["type"], "error") << response.body;
    EXPECT_TRUE(error["error"].at("type").is_string());
    EXPECT_TRUE(error["error"].at("message").is_string());
  }
  EXPECT_EQ(client
                .post("/v1/messages",
                      R"({"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})")
                .status,
            200);
}

TEST(AuthTest, ApiKeyIsRequiredOnApiRoutes) {
  TestServerOptions options;
  options.config.api_key = "sk-test-123";
  std::unique_ptr<Server> server = start_server(options);
  TestClient client(server->port());
  expect_openai_error(client.post("/v1/chat/completions", kGood), 401, "API key", "", "no key");
  expect_openai_error(client.post("/v1/chat/completions", kGood, {{"Authorization", "Bearer wrong"}}), 401, "API key",
                      "", "wrong key");
  HttpResponse anthropic = client.post("/v1/messages", R"({"model": "default", "max_tokens": 2, "messages": []})");
  EXPECT_EQ(anthropic.status, 401);
  EXPECT_EQ(anthropic.json().at("error").at("type"), "authentication_error");
  EXPECT_EQ(client.post("/v1/chat/completions", kGood, {{"Authorization", "Bearer sk-test-123"}}).status, 200);
  EXPECT_EQ(client.post("/v1/chat/completions", kGood, {{"x-api-key", "sk-test-123"}}).status, 200);
  EXPECT_EQ(client.get("/health").status, 200);  // probes need no key
  EXPECT_EQ(client.get("/metrics").status, 200);
}

TEST(LimitTest, ConcurrentRequestsOverTheLimitGet429WithRetryAfter) {
  TestServerOptions options;
  options.config.max_concurrent_requests = 1;
  std::unique_ptr<Server> server = start_server(options);
  TestClient streaming(server->port());
  // Hold the only slot with a long stream, read until it produced something.
  streaming.stream_until(
      "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3000, "ignore_eos": true, "stream": true})",
      [](const std::string& body) { return body.find("\"content\"") != std::string::npos; });
  TestClient second(server->port());
  HttpResponse refused = second.post("/v1/chat/completions", kGood);
  expect_openai_error(refused, 429, "concurrent requests", "", "over the limit");
  EXPECT_EQ(refused.headers["retry-after"], "1");
  streaming.close();  // the stream's slot returns once the server sees the disconnect
  for (int attempt = 0; attempt < 200; ++attempt) {
    HttpResponse response = second.post("/v1/chat/completions", kGood);
    if (response.status == 200) return;
    ASSERT_EQ(response.status, 429);
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  FAIL() << "the slot never came back";
}

}  // namespace
}  // namespace deepinfer::server::testing
