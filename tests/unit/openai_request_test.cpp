// OpenAI Chat Completions requests -> Conversation: what is accepted, and errors that name the field.
#include <string>
#include <utility>
#include <vector>

#include <boost/json.hpp>
#include <gtest/gtest.h>

#include "deepinfer/recipe/openai_request.h"

namespace deepinfer::recipe {
namespace {

TEST(OpenAIRequestTest, ParsesMessagesToolsAndSwitches) {
  Result<Conversation> c = conversation_from_openai_chat(std::string_view(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:x"}}]},
      {"role": "assistant", "content": null, "reasoning_content": "hm",
       "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2.5]}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "chat_template_kwargs": {"thinking": true},
    "reasoning_effort": "max"
  })"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_EQ(c->messages.size(), 4u);
  EXPECT_EQ(c->messages[1].content.size(), 2u);
  EXPECT_TRUE(c->messages[1].has_images());
  EXPECT_TRUE(c->messages[2].content_is_null);
  EXPECT_EQ(c->messages[2].reasoning_content.value_or(""), "hm");
  ASSERT_EQ(c->messages[2].tool_calls.size(), 1u);
  EXPECT_EQ(c->messages[2].tool_calls[0].name, "f");
  EXPECT_EQ(c->messages[2].tool_calls[0].arguments.begin()->key(), "b");  // key order kept
  EXPECT_EQ(c->messages[3].tool_call_id, "call_1");
  ASSERT_EQ(c->tools.size(), 1u);
  EXPECT_EQ(c->tools[0].name, "f");
  EXPECT_TRUE(c->options.thinking);
  EXPECT_EQ(c->options.reasoning_effort.value_or(""), "max");
}

TEST(OpenAIRequestTest, ArgumentsAsObjectAndEmptyString) {
  Result<Conversation> c = conversation_from_openai_chat(std::string_view(R"({"messages": [
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}},
                                         {"function": {"name": "g", "arguments": ""}}]}]})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->messages[0].tool_calls[0].arguments.size(), 1u);
  EXPECT_TRUE(c->messages[0].tool_calls[1].arguments.empty());
}

TEST(OpenAIRequestTest, ErrorsNameTheField) {
  struct Case {
    const char* request;
    const char* expected_fragment;
  };
  const Case cases[] = {
      {R"({"messages": [)", "not valid JSON"},
      {R"([])", "must be a JSON object"},
      {R"({})", "messages is required"},
      {R"({"messages": []})", "messages must not be empty"},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role: unknown role 'robot'"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role must be a string"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content must be a string"},
      {R"({"messages": [{"role": "user"}]})", "messages[0].content is required"},
      {R"({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})", "messages[0].content[0].type 'audio'"},
      {R"({"messages": [{"role": "assistant", "content": null}]})", "neither content nor tool_calls"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]})",
       "messages[0].tool_calls[0].function.arguments is not valid JSON"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]})",
       "messages[0].tool_calls[0].function.arguments must be a JSON object"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})",
       "messages[0].tool_calls[0].function.name must be a non-empty string"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})", "only allowed on assistant"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})",
       "tools[0].function must be an object"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": "yes"}})",
       "chat_template_kwargs.thinking must be a boolean"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": 1.5})", "reasoning_effort must be"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
       "tool_choice \"required\" needs tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "some"})", "tool_choice must be"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "g"}},
          "tools": [{"type": "function", "function": {"name": "f"}}]})",
       "tool_choice.function.name 'g' is not one of the request's tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"})",
       "parallel_tool_calls must be a boolean"},
  };
  for (const Case& c : cases) {
    Result<Conversation> result = conversation_from_openai_chat(std::string_view(c.request));
    ASSERT_FALSE(result.ok()) << c.request;
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << c.request;
    EXPECT_NE(result.status().message().find(c.expected_fragment), std::string::npos)
        << "request: " << c.request << "\nmessage: " << result.status().message();
  }
}

TEST(OpenAIRequestTest, ParallelToolCallsFalseAllowsOneCall) {
  for (const auto& [field, parallel] : std::vector<std::pair<std::string, bool>>{
           {"", true}, {R"(, "parallel_tool_calls": null)", true}, {R"(, "parallel_tool_calls": true)", true},
           {R"(, "parallel_tool_calls": false)", false}}) {
    const std::string request = R"({"messages": [{"role": "user", "content": "x"}])" + field + "}";
    Result<Conversation> c = conversation_from_openai_chat(std::string_view(request));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->tool_choice.parallel, parallel) << request;
  }
}

TEST(OpenAIRequestTest, ToolChoiceNoneDropsTheTools) {
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f"}}])";
  for (const char* choice : {R"("none")", R"("auto")", R"("required")", R"({"type": "function", "function": {"name": "f"}})"}) {
    std::string request = R"({"messages": [{"role": "user", "content": "x"}], )" + tools + R"(, "tool_choice": )" +
                          choice + "}";
    Result<Conversation> c = conversation_from_openai_chat(std::string_view(request));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->tools.size(), std::string_view(choice) == R"("none")" ? 0u : 1u) << choice;
  }
}

// One message or tool at a time (the Python builder): the same validation, the caller's path in errors.
TEST(OpenAIRequestTest, SingleMessageAndToolNameTheirPath) {
  Result<Message> message = message_from_openai(boost::json::parse(R"({"role": "tool", "tool_call_id": "c", "content": "r"})"),
                                                "messages[7]");
  ASSERT_TRUE(message.ok()) << message.status().to_string();
  EXPECT_EQ(message->role, Role::kTool);
  EXPECT_EQ(message->tool_call_id, "c");
  Result<Message> bad = message_from_openai(boost::json::parse(R"({"role": "assistant"})"), "messages[7]");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "messages[7] is an assistant message with neither content nor tool_calls");
  Result<ToolDefinition> tool =
      tool_from_openai(boost::json::parse(R"({"type": "function", "function": {"name": "f", "parameters": {}}})"), "tools[2]");
  ASSERT_TRUE(tool.ok()) << tool.status().to_string();
  EXPECT_EQ(tool->name, "f");
  Result<ToolDefinition> bad_tool =
      tool_from_openai(boost::json::parse(R"({"type": "function", "function": {"name": "f", "parameters": 1}})"), "tools[2]");
  ASSERT_FALSE(bad_tool.ok());
  EXPECT_EQ(bad_tool.status().message(), "tools[2].function.parameters must be a JSON Schema object, got a number");
}

}  // namespace
}  // namespace deepinfer::recipe
