// Segment buffer for the renderers.
#include "prompt_builder.h"

namespace deepinfer::recipe {

void PromptBuilder::append(PromptSegment::Kind kind, std::string_view text) {
  if (text.empty()) return;
  if (!segments_.empty() && segments_.back().kind == kind && kind != PromptSegment::Kind::kControl) {
    segments_.back().text += text;
    return;
  }
  segments_.push_back({kind, std::string(text)});
}

PromptBuilder::Mark PromptBuilder::mark() const {
  return {segments_.size(), segments_.empty() ? 0 : segments_.back().text.size()};
}

void PromptBuilder::truncate(Mark mark) {
  segments_.resize(mark.segments);
  if (!segments_.empty()) segments_.back().text.resize(mark.last_size);
}

RenderedPrompt PromptBuilder::finish() && {
  RenderedPrompt prompt;
  size_t total = 0;
  for (const PromptSegment& segment : segments_) total += segment.text.size();
  prompt.text.reserve(total);
  for (const PromptSegment& segment : segments_) prompt.text += segment.text;
  prompt.segments = std::move(segments_);
  return prompt;
}

std::string hoisted_system_prompt(const Conversation& conversation, bool last_only) {
  std::string prompt;
  bool first = true;
  for (const Message& message : conversation.messages) {
    if (message.role != Role::kSystem) continue;
    if (last_only) prompt.clear();
    if (!first && !last_only) prompt += "\n\n";
    prompt += message.text();
    first = false;
  }
  return prompt;
}

}  // namespace deepinfer::recipe
