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

}  // namespace deepinfer::recipe
