// Anthropic Messages request (`system`, `messages` with text, image, tool_use, tool_result and thinking
// blocks, `tools`, `tool_choice`, `thinking`) -> Conversation, with every field validated. As for the OpenAI
// dialect, errors name the JSON path of the offending field ("messages[1].content[0].tool_use_id must be a
// string") so the server can return them as a 400 body unchanged.
#pragma once

#include <boost/json/value.hpp>
#include <string_view>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/conversation.h"

namespace deepinfer::recipe {

// Reads `system` (a string or text blocks), `messages` (required, non-empty; each tool_result block becomes a
// tool message, in block order, between the user text before and after it), `tools` (client tools: name,
// description, input_schema), `tool_choice` ("none" drops the tools; "any" requires a call and "tool" names
// one, as the renderer honours them; a named tool must exist; disable_parallel_tool_use sets
// ToolChoice::parallel) and `thinking` ({"type": "enabled"|"disabled"}; budget_tokens is validated here, kept in
// ConversationOptions::thinking_budget_tokens, and enforced by the server as the engine's thinking budget).
// Sampling fields (`max_tokens`, `temperature`, ...) and `model` are left to the caller.
Result<Conversation> conversation_from_anthropic_messages(const boost::json::value& request);
// The same from JSON text. Malformed JSON is an InvalidArgument.
Result<Conversation> conversation_from_anthropic_messages(std::string_view json_text);

}  // namespace deepinfer::recipe
