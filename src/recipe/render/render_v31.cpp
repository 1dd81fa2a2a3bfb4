// DeepSeek-V3.1 prompt format, written from the official V3.1 chat template: `<｜Assistant｜></think>`
// opens every answer to a user turn (`<think>` for the generation prompt in thinking mode, and for a
// `prefix` assistant message in thinking mode); tool calls are `NAME<｜tool▁sep｜>ARGS` with no fence;
// tool outputs are bare `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>` after which the model continues
// without a new `<｜Assistant｜>`; an answer's text up to its first `</think>` is dropped from history.
#include <string>

#include "deepinfer/recipe/python_json.h"
#include "prompt_builder.h"

namespace deepinfer::recipe {

Result<RenderedPrompt> render_v31(const Conversation& conversation) {
  const bool thinking = conversation.options.thinking;
  PromptBuilder out;
  out.control(kBos);
  out.content(hoisted_system_prompt(conversation, /*last_only=*/false));

  bool is_tool = false;
  bool is_last_user = false;
  for (const Message& message : conversation.messages) {
    switch (message.role) {
      case Role::kSystem:
        break;
      case Role::kUser:
      case Role::kDeveloper:
      case Role::kLatestReminder:
        is_tool = false;
        is_last_user = true;
        out.control(kUser);
        out.content(message.text());
        break;
      case Role::kAssistant:
        if (!message.tool_calls.empty()) {
          if (is_last_user) {
            out.control(kAssistant);
            out.control(kThinkEnd);
          }
          is_last_user = false;
          is_tool = false;
          out.content(message.text());
          out.control(kToolCallsBegin);
          for (const ToolCall& call : message.tool_calls) {
            out.control(kToolCallBegin);
            out.content(call.name);
            out.control(kToolSep);
            out.content(python_json(call.arguments));
            out.control(kToolCallEnd);
          }
          out.control(kToolCallsEnd);
          out.control(kEos);
        } else {
          if (is_last_user) {
            out.control(kAssistant);
            out.control(message.prefix && thinking ? kThinkStart : kThinkEnd);
          }
          is_last_user = false;
          std::string content = message.text();
          if (is_tool) {
            is_tool = false;
          } else {
            size_t end = content.find(kThinkEnd);
            if (end != std::string::npos) content.erase(0, end + kThinkEnd.size());
          }
          out.content(content);
          out.control(kEos);
        }
        break;
      case Role::kTool:
        is_last_user = false;
        is_tool = true;
        out.control(kToolOutputBegin);
        out.content(message.text());
        out.control(kToolOutputEnd);
        break;
    }
  }
  if (conversation.options.add_generation_prompt && is_last_user && !is_tool) {
    out.control(kAssistant);
    out.control(thinking ? kThinkStart : kThinkEnd);
  }
  return std::move(out).finish();
}

}  // namespace deepinfer::recipe
