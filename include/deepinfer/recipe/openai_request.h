// OpenAI Chat Completions request (`messages`, `tools`, thinking switches) -> Conversation, with every
// field validated. Errors name the JSON path of the offending field ("messages[2].tool_calls[0].function.
// arguments") and what was expected, so the server can return them as a 400 body unchanged.
#pragma once

#include <string>
#include <string_view>

#include <boost/json/value.hpp>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/conversation.h"

namespace deepinfer::recipe {

// Reads `messages` (required), `tools`, `tool_choice` ("none" drops the tools; "auto", "required" and a
// named function render as auto, and a named function must be one of `tools`), `reasoning_effort`,
// `response_format`, `add_generation_prompt`, and the thinking switches `chat_template_kwargs.thinking`,
// `chat_template_kwargs.enable_thinking` and top-level `thinking` (bool, or Anthropic-style
// {"type": "enabled"|"disabled"}). Fields it does not know are left to the caller. Tool-call `arguments` may be
// a JSON string (OpenAI) or an object; either way they must hold a JSON object.
Result<Conversation> conversation_from_openai_chat(const boost::json::value& request);
// The same from JSON text. Malformed JSON is an InvalidArgument naming the line and column.
Result<Conversation> conversation_from_openai_chat(std::string_view json_text);

// One element of `messages` or of `tools`, validated exactly as above; errors name `path` (e.g. "messages[3]").
// For callers that build a conversation piece by piece (the Python module's Conversation builder).
Result<Message> message_from_openai(const boost::json::value& message, const std::string& path);
Result<ToolDefinition> tool_from_openai(const boost::json::value& tool, const std::string& path);

}  // namespace deepinfer::recipe
