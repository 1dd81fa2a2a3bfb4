// The one canonical conversation: every API dialect (OpenAI Chat Completions, OpenAI Responses, Anthropic
// Messages) converts into it, and every prompt format renders from it. Tool-call arguments are held once,
// as a parsed JSON object, and serialized per format only at the edge.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include "deepinfer/core/status.h"

namespace deepinfer::recipe {

enum class Role {
  kSystem,
  kDeveloper,       // OpenAI's operator role; V3.2+ render it as a user turn with instructions
  kUser,
  kAssistant,
  kTool,            // the result of one tool call
  kLatestReminder,  // DeepSeek V4's reminder role
};
std::string_view role_name(Role role);
Result<Role> parse_role(std::string_view name);

// One part of a message's content. Text is untrusted: it is never matched against control tokens.
struct ContentPart {
  enum class Kind { kText, kImage };
  Kind kind = Kind::kText;
  std::string text;       // kText: the text (UTF-8)
  std::string image_url;  // kImage: a URL or data: URI, passed through untouched
};

struct ToolCall {
  std::string id;                 // e.g. "call_1"; may be empty for formats that carry no ids
  std::string name;               // function name
  boost::json::object arguments;  // parsed arguments, keys in the order the model or client wrote them
};

struct Message {
  Role role = Role::kUser;
  // Content parts in order. `content_is_null` distinguishes JSON null from "" (the V3/R1 templates branch
  // on it for assistant turns that only call tools).
  std::vector<ContentPart> content;
  bool content_is_null = false;
  std::optional<std::string> reasoning_content;  // assistant: the thinking that preceded the answer
  std::vector<ToolCall> tool_calls;              // assistant
  std::string tool_call_id;                      // tool: which call this result answers
  std::string name;                              // optional participant or tool name
  bool prefix = false;  // the last message, an assistant one: the start of the answer, continued (render_prompt)

  // The text parts joined with `separator`; images are skipped. "" when content is null.
  std::string text(std::string_view separator = "\n") const;
  bool has_images() const;
};

// A function the model may call. `function` is the OpenAI function object as the client sent it
// (`name`, `description`, `parameters`, ... in the client's key order): the DSML formats print it verbatim.
struct ToolDefinition {
  std::string name;
  boost::json::object function;
};

// The two revisions of the deepseek-v4 format, which differ only in the reasoning-effort preambles:
//   kPreview  the preview encoder (our V4 goldens): only `max` adds a preamble ("Absolute maximum ...");
//             low, medium, high add nothing.
//   k0731     the released V4-Flash / V4-Pro revision: `low` (the default) adds nothing, `high` adds the
//             preview's `max` text, `max` (and `xhigh`) add "Beyond maximum ..."; anything else is refused.
// Other formats ignore it.
enum class V4Revision { k0731, kPreview };
// "0731" / "preview" (InvalidArgument otherwise), and back.
Result<V4Revision> parse_v4_revision(std::string_view name);
std::string_view v4_revision_name(V4Revision revision);

struct ConversationOptions {
  bool thinking = false;                        // reasoning on (thinking mode) or off (chat mode)
  // Anthropic's thinking.budget_tokens with thinking on (in [1,024, 2^31 - 1]; the recipe refuses others): the
  // most reasoning tokens; the server enforces it (engine::SamplingParams::reasoning_budget). Unset: no budget.
  std::optional<int64_t> thinking_budget_tokens;
  std::optional<std::string> reasoning_effort;  // "low" | "medium" | "high" | "xhigh" | "max" | "1".."100"
  V4Revision v4_revision = V4Revision::k0731;   // deepseek-v4 only: which effort preambles (see above)
  bool add_generation_prompt = true;            // end with the assistant turn opener
  std::optional<boost::json::value> response_format;  // JSON schema request (V3.2+ print it)
};

// What the request asked of the tools: OpenAI "auto" / "required" / a named function, Anthropic "auto" / "any" /
// "tool" ("none" drops the tools instead). The DSML formats honour required and named by prefilling the
// tool-call block (named: with only that function described, and the answer forced to begin with its call); the
// others refuse them when rendering (renderer.h).
struct ToolChoice {
  enum class Mode { kAuto, kRequired, kNamed };
  Mode mode = Mode::kAuto;
  std::string name;  // kNamed: the function
  // false: the answer holds at most one tool call (OpenAI's parallel_tool_calls: false, Anthropic's
  // tool_choice.disable_parallel_tool_use: true). The prompt is unchanged; the server stops generating when the
  // first call is complete (OutputBuilder::set_max_tool_calls), so no later call reaches the client.
  bool parallel = true;

  // The answer holds one call at most: parallel false, or a named function (that one call, as vLLM's named
  // tool_choice gives; the forced header makes it the named one, and no other may follow).
  bool single_call() const { return !parallel || mode == Mode::kNamed; }
};

struct Conversation {
  std::vector<Message> messages;
  std::vector<ToolDefinition> tools;
  ToolChoice tool_choice;
  ConversationOptions options;
};

}  // namespace deepinfer::recipe
