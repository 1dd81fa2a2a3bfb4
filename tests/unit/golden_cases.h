// The chat-template golden cases (tests/data/chat-templates/goldens/FORMAT.json) as Conversations, for the
// tests that render them: their requests with the options as the goldens write them.
#pragma once

#include <string>
#include <vector>

#include <boost/json.hpp>
#include <gtest/gtest.h>

#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"
#include "test_data.h"

namespace deepinfer::testing {

// The golden file of `format`: {"cases": [{"case", "request", "options", "prompt"?, ...}]}.
inline boost::json::value golden_file(recipe::PromptFormat format) {
  return read_json("tests/data/chat-templates/goldens/" + std::string(recipe::format_name(format)) + ".json");
}

// A case's request with its options: V3.1 `thinking`, the encoders' `thinking_mode` and `reasoning_effort`.
inline recipe::Conversation golden_conversation(const boost::json::object& golden) {
  Result<recipe::Conversation> conversation = recipe::conversation_from_openai_chat(golden.at("request"));
  EXPECT_TRUE(conversation.ok()) << conversation.status().to_string();
  if (!conversation.ok()) return {};
  const boost::json::object& options = golden.at("options").as_object();
  if (const boost::json::value* thinking = options.if_contains("thinking")) {
    conversation->options.thinking = thinking->as_bool();
  }
  if (const boost::json::value* mode = options.if_contains("thinking_mode")) {
    conversation->options.thinking = mode->as_string() == "thinking";
  }
  if (const boost::json::value* effort = options.if_contains("reasoning_effort")) {
    conversation->options.reasoning_effort =
        effort->is_string() ? std::string(effort->as_string()) : std::to_string(effort->to_number<int64_t>());
  }
  if (const boost::json::value* revision = options.if_contains("v4_revision")) {
    Result<recipe::V4Revision> parsed = recipe::parse_v4_revision(std::string(revision->as_string()));
    EXPECT_TRUE(parsed.ok()) << parsed.status().to_string();
    if (parsed.ok()) conversation->options.v4_revision = *parsed;
  }
  return std::move(conversation).value();
}

// "CASE {options}", for failure messages.
inline std::string golden_name(const boost::json::object& golden) {
  return std::string(golden.at("case").as_string()) + " " + boost::json::serialize(golden.at("options"));
}

}  // namespace deepinfer::testing
