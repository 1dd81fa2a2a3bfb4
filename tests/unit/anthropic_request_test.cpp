// Anthropic Messages requests -> Conversation: blocks become the canonical messages, and errors name the field.
#include "deepinfer/recipe/anthropic_request.h"

#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <string>

namespace deepinfer::recipe {
namespace {

TEST(AnthropicRequestTest, BlocksBecomeMessages) {
  Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(R"({
    "model": "m", "max_tokens": 10,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool"},
                                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}]},
      {"role": "user", "content": [{"type": "text", "text": "before"},
                                   {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                                   {"type": "text", "text": "after"}]}
    ],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "tool", "name": "f"},
    "thinking": {"type": "enabled", "budget_tokens": 1024}
  })"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ASSERT_EQ(c->messages.size(), 6u);
  EXPECT_EQ(c->messages[0].role, Role::kSystem);
  EXPECT_EQ(c->messages[0].text(), "Be brief.");
  EXPECT_EQ(c->messages[2].role, Role::kAssistant);
  EXPECT_TRUE(c->messages[2].content_is_null);
  EXPECT_EQ(c->messages[2].reasoning_content.value_or(""), "use the tool");
  ASSERT_EQ(c->messages[2].tool_calls.size(), 1u);
  EXPECT_EQ(c->messages[2].tool_calls[0].arguments.begin()->key(), "b");  // key order kept
  // A tool_result splits the user turn: text before, the result, text after.
  EXPECT_EQ(c->messages[3].text(), "before");
  EXPECT_EQ(c->messages[4].role, Role::kTool);
  EXPECT_EQ(c->messages[4].tool_call_id, "t1");
  EXPECT_EQ(c->messages[4].text(), "sunny");
  EXPECT_EQ(c->messages[5].text(), "after");
  ASSERT_EQ(c->tools.size(), 1u);
  EXPECT_EQ(boost::json::serialize(c->tools[0].function),
            R"({"name":"f","description":"d","parameters":{"type":"object"}})");
  EXPECT_TRUE(c->options.thinking);
}

// Regression: 1024.0 (a whole number as Python's json writes a float) was refused as "not an integer", while the
// server's integer fields (max_tokens, ...) take it.
TEST(AnthropicRequestTest, AWholeNumberBudgetWrittenAsAFloatIsThatInteger) {
  Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1500.0}})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->options.thinking_budget_tokens.value_or(0), 1500);
}

TEST(AnthropicRequestTest, ToolChoiceNoneDropsTheTools) {
  Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}],
          "tool_choice": {"type": "none"}})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->tools.empty());
}

// disable_parallel_tool_use: true allows one tool call (ToolChoice::parallel false); a non-boolean, or the field
// with "none", is refused.
TEST(AnthropicRequestTest, DisableParallelToolUseAllowsOneCall) {
  const std::string head = R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}], )";
  Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(head + R"("tool_choice": {"type": "auto"}})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->tool_choice.parallel);
  for (const char* choice : {R"({"type": "auto", "disable_parallel_tool_use": true})",
                             R"({"type": "any", "disable_parallel_tool_use": true})",
                             R"({"type": "tool", "name": "f", "disable_parallel_tool_use": true})"}) {
    c = conversation_from_anthropic_messages(std::string_view(head + "\"tool_choice\": " + choice + "}"));
    ASSERT_TRUE(c.ok()) << choice << ": " << c.status().to_string();
    EXPECT_FALSE(c->tool_choice.parallel) << choice;
  }
  c = conversation_from_anthropic_messages(
      std::string_view(head + R"("tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}})"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "tool_choice.disable_parallel_tool_use must be a boolean");
  c = conversation_from_anthropic_messages(
      std::string_view(head + R"("tool_choice": {"type": "none", "disable_parallel_tool_use": true}})"));
  ASSERT_FALSE(c.ok());
}

TEST(AnthropicRequestTest, OutputConfigEffortIsTheReasoningEffortAndOtherKeysAreRefused) {
  Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}})"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->options.reasoning_effort, "high");
  c = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "json_schema"}}})"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "output_config.format is not supported; only output_config.effort is");
  c = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}], "output_config": {"effort": 3}})"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "output_config.effort must be a string");
}

TEST(AnthropicRequestTest, OnlyTheFinalAssistantMessageMayBeEmpty) {
  for (const char* last : {R"("")", "[]"}) {
    const std::string request =
        std::string(R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": )") + last +
        "}]}";
    Result<Conversation> c = conversation_from_anthropic_messages(std::string_view(request));
    ASSERT_TRUE(c.ok()) << request << ": " << c.status().message();
    ASSERT_EQ(c->messages.size(), 2u);
    EXPECT_EQ(c->messages[1].role, Role::kAssistant);
  }
  Result<Conversation> prefill = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]})"));
  ASSERT_TRUE(prefill.ok()) << prefill.status().message();
  // Regression: the trailing-whitespace rule read the last text block, so text before a final tool_use was refused.
  Result<Conversation> call = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [)"
      R"({"type": "text", "text": "Let me check. "}, {"type": "tool_use", "id": "t1", "name": "get", "input": {}}]}]})"));
  ASSERT_TRUE(call.ok()) << call.status().message();
  Result<Conversation> failed_tool = conversation_from_anthropic_messages(std::string_view(
      R"({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such )"
      R"(file", "is_error": true}]}]})"));
  ASSERT_TRUE(failed_tool.ok()) << failed_tool.status().message();
}

TEST(AnthropicRequestTest, ErrorsNameTheField) {
  struct Case {
    const char* request;
    const char* message;
  };
  const Case cases[] = {
      {R"({"messages": 1})", "messages must be an array"},
      {R"({"messages": []})", "messages must not be empty"},
      {R"({"messages": [{"role": "system", "content": "x"}]})",
       "messages[0].role must be \"user\" or \"assistant\", got \"system\""},
      {R"({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]})",
       "messages[0].content[0].type \"tool_use\" is not supported in a user message"},
      {R"({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 1}]}]})",
       "messages[0].content[0].input must be an object"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]})",
       "messages[0].content[0].source.type must be \"base64\" or \"url\", got \"file\""},
      // Regression: an empty user turn was accepted (Anthropic refuses every empty message but a final assistant
      // one, and every empty text block).
      {R"({"messages": [{"role": "user", "content": ""}]})",
       "messages[0]: all messages must have non-empty content except for the optional final assistant message"},
      {R"({"messages": [{"role": "user", "content": []}]})",
       "messages[0]: all messages must have non-empty content except for the optional final assistant message"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, )"
       R"({"role": "user", "content": "y"}]})",
       "messages[1]: all messages must have non-empty content except for the optional final assistant message"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}]})",
       "messages[0].content[1].text: text content blocks must be non-empty"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}]})",
       "messages[0].content[0].text: text content blocks must contain non-whitespace text"},
      {R"({"messages": [{"role": "user", "content": "   "}]})",
       "messages[0].content: text content blocks must contain non-whitespace text"},
      {R"({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]})",
       "messages[0].content[0].is_error must be a boolean"},
      {R"({"system": [{"type": "text", "text": ""}], "messages": [{"role": "user", "content": "x"}]})",
       "system[0].text: text content blocks must be non-empty"},
      {R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is "}]})",
       "messages[1]: final assistant content cannot end with trailing whitespace"},
      // Regression: extra keys in nested objects were taken and ignored.
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}, "strict": true}]})",
       "tools[0].strict: Extra inputs are not permitted"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024, "foo": 1}})",
       "thinking.foo: Extra inputs are not permitted"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}], )"
       R"("tool_choice": {"type": "auto", "foo": 1}})",
       "tool_choice.foo: Extra inputs are not permitted"},
      {R"({"system": 3, "messages": [{"role": "user", "content": "x"}]})",
       "system must be a string or an array of text blocks"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]})",
       "tools[0].input_schema must be a JSON Schema object"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}})",
       "tool_choice \"any\" needs tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}})",
       "thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}"},
      // Regression: a negative budget was accepted.
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": -1}})",
       "thinking.budget_tokens must be an integer of at least 1024 when thinking is enabled, got -1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}})",
       "thinking.budget_tokens must be an integer of at least 1024 when thinking is enabled, got none"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1500.5}})",
       "thinking.budget_tokens must be an integer of at least 1024 when thinking is enabled, got 1.5005E3"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1023.0}})",
       "thinking.budget_tokens must be an integer of at least 1024 when thinking is enabled, got 1.023E3"},
      // Regression: a budget beyond int64 was clamped to 9.2e18, so the refusal named max_tokens and a value the
      // client never sent.
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1e19}})",
       "thinking.budget_tokens must be at most 2147483647, got 1E19"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 18446744073709551615}})",
       "thinking.budget_tokens must be at most 2147483647, got 18446744073709551615"},
      {R"({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 2147483648}})",
       "thinking.budget_tokens must be at most 2147483647, got 2147483648"},
  };
  for (const Case& c : cases) {
    Result<Conversation> result = conversation_from_anthropic_messages(std::string_view(c.request));
    ASSERT_FALSE(result.ok()) << c.request;
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << c.request;
    EXPECT_EQ(result.status().message(), c.message) << c.request;
  }
}

}  // namespace
}  // namespace deepinfer::recipe
