// DeepSeek-V3 and DeepSeek-R1 prompt formats, written from their official chat templates. The templates'
// quirks are part of the format the checkpoints were released with, and are reproduced on purpose:
//   V3: all system messages joined by "\n\n" up front; an assistant turn with content renders only its
//       content; the first tool call ever opens `<｜Assistant｜><｜tool▁calls▁begin｜>` and is never closed,
//       later calls each close `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`; `is_first`/`is_output_first`
//       are never reset, so only the conversation's first call and first output open their blocks.
//   R1: only the last system message is kept; the calls of one turn are closed once; an answer's text
//       before its last `</think>` is dropped; the generation prompt opens `<think>\n`.
// Tool-call arguments are printed as Python's json.dumps prints them (the goldens' byte form).
#include <string>

#include "deepinfer/recipe/python_json.h"
#include "prompt_builder.h"

namespace deepinfer::recipe {
namespace {

enum class Variant { kV3, kR1 };

void render_call(PromptBuilder& out, const ToolCall& call) {
  out.fixed("function");
  out.control(kToolSep);
  out.content(call.name);
  out.fixed("\n```json\n");
  out.content(python_json(call.arguments));
  out.fixed("\n```");
  out.control(kToolCallEnd);
}

Result<RenderedPrompt> render(const Conversation& conversation, Variant variant) {
  PromptBuilder out;
  out.control(kBos);
  // System prompt: V3 joins every system message with "\n\n"; R1 keeps the last one.
  out.content(hoisted_system_prompt(conversation, variant == Variant::kR1));

  bool is_first = false;  // a tool call has been opened (never reset, as in the templates)
  bool is_tool = false;   // inside a run of tool outputs
  bool is_output_first = true;
  for (const Message& message : conversation.messages) {
    switch (message.role) {
      case Role::kSystem:
        break;
      case Role::kUser:
      case Role::kDeveloper:
      case Role::kLatestReminder:
        is_tool = false;
        out.control(kUser);
        out.content(message.text());
        break;
      case Role::kAssistant: {
        // V3 renders tool calls only when content is null; "" is not null: the template then renders the empty
        // answer and drops the calls, R1 renders both (goldens empty_content_with_tool_calls*).
        const bool content_null = message.content_is_null;
        bool render_calls = variant == Variant::kR1 ? !message.tool_calls.empty() : content_null;
        if (render_calls) {
          is_tool = false;
          for (const ToolCall& call : message.tool_calls) {
            if (!is_first) {
              out.control(kAssistant);
              out.control(kToolCallsBegin);
              out.control(kToolCallBegin);
              render_call(out, call);
              is_first = true;
            } else {
              out.fixed("\n");
              out.control(kToolCallBegin);
              render_call(out, call);
              if (variant == Variant::kV3) {
                out.control(kToolCallsEnd);
                out.control(kEos);
              }
            }
          }
          if (variant == Variant::kR1) {
            out.control(kToolCallsEnd);
            out.control(kEos);
          }
        }
        if (!content_null) {
          std::string content = message.text();
          if (is_tool) {
            out.control(kToolOutputsEnd);
            out.content(content);
            out.control(kEos);
            is_tool = false;
          } else {
            if (variant == Variant::kR1) {
              size_t end = content.rfind(kThinkEnd);
              if (end != std::string::npos) content.erase(0, end + kThinkEnd.size());
            }
            out.control(kAssistant);
            out.content(content);
            out.control(kEos);
          }
        }
        break;
      }
      case Role::kTool:
        is_tool = true;
        if (is_output_first) {
          out.control(kToolOutputsBegin);
          is_output_first = false;
        } else {
          out.fixed("\n");
        }
        out.control(kToolOutputBegin);
        out.content(message.text());
        out.control(kToolOutputEnd);
        break;
    }
  }
  if (is_tool) out.control(kToolOutputsEnd);
  if (conversation.options.add_generation_prompt && !is_tool) {
    out.control(kAssistant);
    if (variant == Variant::kR1) {
      out.control(kThinkStart);
      out.fixed("\n");
    }
  }
  return std::move(out).finish();
}

}  // namespace

Result<RenderedPrompt> render_v3(const Conversation& conversation) { return render(conversation, Variant::kV3); }
Result<RenderedPrompt> render_r1(const Conversation& conversation) { return render(conversation, Variant::kR1); }

}  // namespace deepinfer::recipe
