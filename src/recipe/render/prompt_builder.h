// PromptBuilder: the renderers' output buffer, a list of segments that merges adjacent ones of one kind.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/recipe/renderer.h"

namespace deepinfer::recipe {

class PromptBuilder {
 public:
  void control(std::string_view marker) { append(PromptSegment::Kind::kControl, marker); }
  void fixed(std::string_view text) { append(PromptSegment::Kind::kTemplate, text); }
  void content(std::string_view text) { append(PromptSegment::Kind::kContent, text); }

  // A position to come back to with truncate(): used to drop a trailing generation prompt.
  struct Mark {
    size_t segments;
    size_t last_size;
  };
  Mark mark() const;
  void truncate(Mark mark);

  RenderedPrompt finish() &&;

 private:
  void append(PromptSegment::Kind kind, std::string_view text);
  std::vector<PromptSegment> segments_;
};

// Fixed markers shared by the formats.
inline constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUser = "<｜User｜>";
inline constexpr std::string_view kAssistant = "<｜Assistant｜>";
inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kToolCallsBegin = "<｜tool▁calls▁begin｜>";
inline constexpr std::string_view kToolCallsEnd = "<｜tool▁calls▁end｜>";
inline constexpr std::string_view kToolCallBegin = "<｜tool▁call▁begin｜>";
inline constexpr std::string_view kToolCallEnd = "<｜tool▁call▁end｜>";
inline constexpr std::string_view kToolSep = "<｜tool▁sep｜>";
inline constexpr std::string_view kToolOutputsBegin = "<｜tool▁outputs▁begin｜>";
inline constexpr std::string_view kToolOutputsEnd = "<｜tool▁outputs▁end｜>";
inline constexpr std::string_view kToolOutputBegin = "<｜tool▁output▁begin｜>";
inline constexpr std::string_view kToolOutputEnd = "<｜tool▁output▁end｜>";
// The marker of every DSML tag (`<｜DSML｜tool_calls>`): one added token in V4's and V4.1's tokenizers.
inline constexpr std::string_view kDsml = "｜DSML｜";

// The system prompt the V3 / R1 / V3.1 templates put right after BOS: every system message's text joined
// with "\n\n", or only the last one (R1).
std::string hoisted_system_prompt(const Conversation& conversation, bool last_only);

// Per-format renderers (render_v3.cpp, render_v31.cpp, render_dsml.cpp). They assume a validated
// Conversation (conversation_from_* or a caller that upholds the same rules).
Result<RenderedPrompt> render_v3(const Conversation& conversation);
Result<RenderedPrompt> render_r1(const Conversation& conversation);
Result<RenderedPrompt> render_v31(const Conversation& conversation);
Result<RenderedPrompt> render_dsml(const Conversation& conversation, PromptFormat format, RenderOptions options);

}  // namespace deepinfer::recipe
