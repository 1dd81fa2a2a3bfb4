// OpenAI Responses request (`instructions`, `input` items, flat `tools`, `tool_choice`, `reasoning`, `text`)
// -> Conversation, with every field validated. As for the other dialects, errors name the JSON path of the
// offending field ("input[2].call_id must be a string") so the server can return them as a 400 body unchanged.
#pragma once

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>
#include <cstdint>
#include <optional>
#include <string_view>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/conversation.h"

namespace deepinfer::recipe {

// Reads `instructions` (a system message first), `input` (required: a string, or items of type message,
// function_call, function_call_output and reasoning; an item with a role and no type is a message), `tools`
// (function tools {type, name, description, parameters}), `tool_choice` ("none" drops the tools; "required"
// and {"type": "function", "name"} are recorded for the renderer), `reasoning` ({"effort"}: present and not
// "none", thinking mode on; low..max as reasoning_effort) and `text` ({"format": text | json_object |
// json_schema}, as response_format). Assistant turns gather what belongs to them: a reasoning item goes to the
// next assistant message (or function_call), function_call items join the assistant message right before them
// (or open one with null content), so a tool round trip renders as the chat endpoint renders it.
// Sampling fields, `stream`, `store`, `model`, `previous_response_id` are left to the caller.
Result<Conversation> conversation_from_responses(const boost::json::value& request);

// The request fields a Responses response object repeats: instructions, tool_choice ("auto" when absent) and
// tools ([] when absent) from `request`, and the values the caller read and will use: max_output_tokens (null
// when absent), parallel_tool_calls (default true), temperature, top_p.
// REQUIRES: `request` passed conversation_from_responses (its field types are not checked again).
boost::json::object responses_echo(const boost::json::object& request, std::optional<int64_t> max_output_tokens,
                                   bool parallel_tool_calls, double temperature, double top_p);

}  // namespace deepinfer::recipe
