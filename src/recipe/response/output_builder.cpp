// Generated tokens -> the deltas a client may see: the output parser (or detokenizer), then stop strings.
#include "deepinfer/recipe/output_builder.h"

namespace deepinfer::recipe {

using Kind = StreamEvent::Kind;

OutputBuilder::OutputBuilder(StreamParser parser, std::shared_ptr<const Tokenizer> tokenizer,
                             std::vector<std::string> stops)
    : parser_(std::move(parser)), tokenizer_(std::move(tokenizer)), matcher_(std::move(stops)) {}

OutputBuilder::OutputBuilder(std::shared_ptr<const Tokenizer> tokenizer, std::vector<std::string> stops)
    : tokenizer_(tokenizer), detokenizer_(std::in_place, tokenizer), matcher_(std::move(stops)) {}

int32_t OutputBuilder::malformed_tool_calls() const { return parser_ ? parser_->malformed_tool_calls() : 0; }

bool OutputBuilder::push(TokenId token, std::vector<StreamEvent>& out) {
  if (matcher_.matched() || tool_limit_reached_) return true;
  scratch_.clear();
  if (parser_) {
    const bool was_reasoning = parser_->in_reasoning();
    parser_->push(token, scratch_);
    if (was_reasoning || parser_->in_reasoning()) ++reasoning_tokens_;
  } else if (!tokenizer_->is_special_token(token)) {
    std::string text = detokenizer_->push(token);
    if (!text.empty()) scratch_.push_back({Kind::kContent, std::move(text), -1, {}, {}});
  }
  return filter(scratch_, out);
}

bool OutputBuilder::push_text(std::string_view text, std::vector<StreamEvent>& out) {
  text_ids_.clear();
  tokenizer_->encode(text, TextTrust::kTrusted, text_ids_);
  // One push of text gives one delta per run (as one token would): adjacent text of one kind, or arguments of
  // one call, are merged.
  const size_t first = out.size();
  std::vector<StreamEvent> step;
  bool stopped = matcher_.matched().has_value() || tool_limit_reached_;
  for (TokenId id : text_ids_) {
    if (stopped) break;
    step.clear();
    stopped = push(id, step);
    for (StreamEvent& event : step) {
      StreamEvent* last = out.size() > first ? &out.back() : nullptr;
      const bool text_run = event.kind == Kind::kReasoning || event.kind == Kind::kContent;
      const bool arguments =
          event.kind == Kind::kToolArguments && last != nullptr && last->tool_index == event.tool_index;
      if (last != nullptr && last->kind == event.kind && (text_run || arguments)) {
        last->text += event.text;
      } else {
        out.push_back(std::move(event));
      }
    }
  }
  return stopped;
}

void OutputBuilder::finish(std::vector<StreamEvent>& out, bool cut_off) {
  if (matcher_.matched() || tool_limit_reached_) return;
  scratch_.clear();
  if (parser_) {
    parser_->finish(scratch_, cut_off);
  } else {
    std::string text = detokenizer_->flush();
    if (!text.empty()) scratch_.push_back({Kind::kContent, std::move(text), -1, {}, {}});
  }
  if (filter(scratch_, out)) return;
  flush_text(out);
}

bool OutputBuilder::filter(std::vector<StreamEvent>& events, std::vector<StreamEvent>& out) {
  for (StreamEvent& event : events) {
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
      // A call the parser closed on malformed markup (whose text it then emits as content) is not a complete call:
      // it does not count toward the limit, and generation goes on as without one.
      bool call_ended = event.kind == Kind::kToolCallEnd;
      if (call_ended && parser_ && parser_->malformed_tool_calls() > malformed_seen_) {
        malformed_seen_ = parser_->malformed_tool_calls();
        call_ended = false;
      }
      emit(std::move(event), out);
      if (call_ended && max_tool_calls_ > 0 && ++tool_calls_ended_ >= max_tool_calls_) {
        tool_limit_reached_ = true;  // the rest of this token's events (a next call's start) is not shown
        return true;
      }
    }
  }
  return false;
}

void OutputBuilder::flush_text(std::vector<StreamEvent>& out) {
  std::string held = matcher_.flush();
  if (!held.empty()) emit({text_kind_, std::move(held), -1, {}, {}}, out);
}

void OutputBuilder::emit(StreamEvent event, std::vector<StreamEvent>& out) {
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

}  // namespace deepinfer::recipe
