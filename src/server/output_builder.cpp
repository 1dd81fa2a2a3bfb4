// Generated tokens -> the deltas a client may see: the output parser (or detokenizer), then stop strings.
#include "api.h"

namespace deepinfer::server {

using Kind = recipe::StreamEvent::Kind;

OutputBuilder::OutputBuilder(recipe::StreamParser parser, std::vector<std::string> stops)
    : parser_(std::move(parser)), matcher_(std::move(stops)) {}

OutputBuilder::OutputBuilder(std::shared_ptr<const recipe::Tokenizer> tokenizer, std::vector<std::string> stops)
    : tokenizer_(tokenizer), detokenizer_(std::in_place, tokenizer), matcher_(std::move(stops)) {}

int32_t OutputBuilder::malformed_tool_calls() const { return parser_ ? parser_->malformed_tool_calls() : 0; }

bool OutputBuilder::push(recipe::TokenId token, std::vector<recipe::StreamEvent>& out) {
  if (matcher_.matched()) return true;
  scratch_.clear();
  if (parser_) {
    parser_->push(token, scratch_);
  } else if (!tokenizer_->is_special_token(token)) {
    std::string text = detokenizer_->push(token);
    if (!text.empty()) scratch_.push_back({Kind::kContent, std::move(text), -1, {}, {}});
  }
  return filter(scratch_, out);
}

void OutputBuilder::finish(std::vector<recipe::StreamEvent>& out) {
  if (matcher_.matched()) return;
  scratch_.clear();
  if (parser_) {
    parser_->finish(scratch_);
  } else {
    std::string text = detokenizer_->flush();
    if (!text.empty()) scratch_.push_back({Kind::kContent, std::move(text), -1, {}, {}});
  }
  if (filter(scratch_, out)) return;
  flush_text(out);
}

bool OutputBuilder::filter(std::vector<recipe::StreamEvent>& events, std::vector<recipe::StreamEvent>& out) {
  for (recipe::StreamEvent& event : events) {
    if (event.kind == Kind::kReasoning || event.kind == Kind::kContent) {
      // A partial stop match cannot continue across a change of kind: release it first.
      if (event.kind != text_kind_) {
        flush_text(out);
        text_kind_ = event.kind;
      }
      std::string visible = matcher_.push(event.text);
      if (!visible.empty()) emit({text_kind_, std::move(visible), -1, {}, {}}, out);
      if (matcher_.matched()) return true;
    } else {
      flush_text(out);
      emit(std::move(event), out);
    }
  }
  return false;
}

void OutputBuilder::flush_text(std::vector<recipe::StreamEvent>& out) {
  std::string held = matcher_.flush();
  if (!held.empty()) emit({text_kind_, std::move(held), -1, {}, {}}, out);
}

void OutputBuilder::emit(recipe::StreamEvent event, std::vector<recipe::StreamEvent>& out) {
  switch (event.kind) {
    case Kind::kReasoning:
      message_.reasoning += event.text;
      break;
    case Kind::kContent:
      message_.content += event.text;
      break;
    case Kind::kToolCallBegin:
      message_.tool_calls.push_back({event.tool_id, event.tool_name, {}});
      break;
    case Kind::kToolArguments:
      if (event.tool_index >= 0 && static_cast<size_t>(event.tool_index) < message_.tool_calls.size()) {
        message_.tool_calls[static_cast<size_t>(event.tool_index)].arguments_text += event.text;
      }
      break;
    case Kind::kToolCallEnd:
      break;
  }
  out.push_back(std::move(event));
}

}  // namespace deepinfer::server
