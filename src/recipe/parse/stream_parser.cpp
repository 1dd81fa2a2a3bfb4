// The output parser: token ids -> UTF-8 text (IncrementalDetokenizer) -> one text-level state machine per
// prompt format. Markers are matched on the decoded text; the end-of-sequence token by id only.
//
// States (Impl::State): kStart decides a leading <think> / </think>; kReasoning and kContent emit text while
// holding back any suffix that may begin a marker (find_marker); with JSON output, content is kJsonLead,
// kJson and kJsonDone instead (only kJson's text is emitted); the tool-block states consume markup into raw_
// until an event represents it, and stream tool events; kPlainContent is terminal (after malformed markup
// everything is content). A prefilled tool-call block opener starts the machine in kBetweenCalls. The
// fallback rule and its commit points are spelled out in the header.
// Every byte is examined a bounded number of times (held-back tails are shorter than the longest marker),
// so a message costs O(length).
#include "deepinfer/recipe/stream_parser.h"

#include <algorithm>
#include <array>
#include <boost/json/parse.hpp>
#include <optional>
#include <random>
#include <span>
#include <string_view>
#include <unordered_set>

#include "deepinfer/recipe/detokenizer.h"
#include "json_stream.h"

namespace deepinfer::recipe {
namespace {

constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kToolCallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kToolCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kToolCallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kToolCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kToolSep = "<｜tool▁sep｜>";
constexpr std::string_view kDsmlOpen = "<｜DSML｜";
constexpr std::string_view kDsmlClose = "</｜DSML｜";
// JSON output (deepseek-recipe's parse_json_output): where the JSON text starts and ends.
constexpr std::string_view kJsonFence = "```json\n";
constexpr std::string_view kFence = "```\n";
constexpr std::string_view kJsonEnd = "\n```";

// Longest function name or parameter key accepted; a longer one is malformed markup (and bounds what a
// broken header can make us hold).
constexpr size_t kMaxNameBytes = 1024;

bool is_whitespace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

bool all_whitespace(std::string_view text) { return std::all_of(text.begin(), text.end(), is_whitespace); }

std::string_view trim(std::string_view text) {
  while (!text.empty() && is_whitespace(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_whitespace(text.back())) text.remove_suffix(1);
  return text;
}

// A byte that may not appear in a function name or parameter key (it means the markup went wrong).
bool bad_name_byte(char c) {
  return c == '<' || c == '>' || c == '"' || c == '\n' || static_cast<unsigned char>(c) < 0x20;
}

struct MarkerMatch {
  size_t position;  // in the scanned text
  size_t index;     // which marker
};

// Finds the earliest complete marker in `text` (on a tie, the longer one). Without one, `safe` is the length
// of the prefix that cannot be part of any marker: the text minus its longest suffix that is a proper
// prefix of a marker (all of it when `at_end`).
std::optional<MarkerMatch> find_marker(std::string_view text, std::span<const std::string_view> markers, bool at_end,
                                       size_t& safe) {
  std::optional<MarkerMatch> best;
  for (size_t i = 0; i < markers.size(); ++i) {
    size_t position = text.find(markers[i]);
    if (position == std::string_view::npos) continue;
    if (!best || position < best->position ||
        (position == best->position && markers[i].size() > markers[best->index].size())) {
      best = MarkerMatch{position, i};
    }
  }
  if (best) {
    safe = best->position;
    return best;
  }
  safe = text.size();
  if (at_end) return std::nullopt;
  for (std::string_view marker : markers) {
    size_t from = text.size() >= marker.size() ? text.size() - marker.size() + 1 : 0;
    for (size_t i = from; i < text.size(); ++i) {
      if (text[i] == marker.front() && marker.starts_with(text.substr(i))) {
        safe = std::min(safe, i);
        break;
      }
    }
  }
  return std::nullopt;
}

std::string random_suffix() {
  static constexpr std::string_view kAlphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  thread_local std::mt19937_64 generator{std::random_device{}()};
  std::uniform_int_distribution<size_t> pick(0, kAlphabet.size() - 1);
  std::string out(16, '0');
  for (char& c : out) c = kAlphabet[pick(generator)];
  return out;
}

// V3.2 and later write tool calls as DSML text; V3, R1 and V3.1 with the tool-call tokens.
bool uses_dsml(PromptFormat format) {
  return format == PromptFormat::kDeepSeekV32 || format == PromptFormat::kDeepSeekV4 ||
         format == PromptFormat::kDeepSeekV41;
}

}  // namespace

struct StreamParser::Impl {
  enum class State {
    kStart,         // nothing decided yet: a leading <think> or </think> is consumed
    kReasoning,     // text is reasoning until </think> (or a tool-call block opener)
    kContent,       // text is content until a tool-call block opener
    kPlainContent,  // terminal: everything is content (after malformed markup)
    // Content with JSON output: text before the JSON text and after it is dropped.
    kJsonLead,  // until a fence, '{' or '[' (or a tool-call block opener)
    kJson,      // the JSON text, emitted, until "\n```"
    kJsonDone,  // after it (a tool-call block opener is still recognised)
    // Tool-call blocks. V3/R1 and V3.1: the block opener <｜tool▁calls▁begin｜> has been consumed. Both
    // families read both call syntaxes (they share their tokens): after <｜tool▁call▁begin｜>, text up to
    // <｜tool▁sep｜> is V3's type "function" (then NAME "\n" and a fenced object) or V3.1's NAME (then the
    // object). "function" followed by '{' is a V3.1 call to a function named "function".
    kBetweenCalls,   // whitespace, then the next call's opener or the block's closing marker
    kCallHead,       // text up to <｜tool▁sep｜>
    kAfterFunction,  // after "function"<｜tool▁sep｜>: '{' (V3.1 syntax) or V3's NAME line
    kV3Name,         // V3: NAME up to "\n"
    kV3Fence,        // V3: optional ```json, then '{'
    kArgsStart,      // V3.1: whitespace, then '{'
    kArgsJson,       // the arguments object, streamed byte by byte as validated
    kCallEnd,        // whitespace, an optional closing ```, then <｜tool▁call▁end｜>
    // DSML: the block opener `<｜DSML｜BLOCK` has been consumed.
    kDsmlBlockGt,      // '>' of the block opener
    kDsmlInvokeName,   // ` name="NAME">` of an invoke tag
    kDsmlInvokeBody,   // whitespace, then a parameter tag or the invoke's closing tag
    kDsmlParamHeader,  // ` name="KEY" string="true|false">`
    kDsmlStringValue,  // a string value, streamed JSON-escaped until the closing parameter tag
    kDsmlRawValue,     // a JSON value, held until the closing parameter tag
    kDsmlCloseGt,      // '>' of a closing parameter, invoke or block tag
  };

  Impl(PromptFormat format, std::shared_ptr<const Tokenizer> tokenizer, StreamParserOptions options);

  void push(TokenId token, std::vector<StreamEvent>& events);
  void finish(std::vector<StreamEvent>& events, bool cut_off);

  // Drives the state machine over the undecided input until it needs more.
  void run();
  bool step();
  void end_of_output(bool cut_off = false);
  void cut_short();

  bool step_start();
  bool step_text();
  bool step_between_calls();
  bool step_call_head();
  bool step_after_function();
  bool step_v3_name();
  bool step_v3_fence();
  bool step_args_start();
  bool step_args_json();
  bool step_call_end();
  bool step_dsml_block_gt();
  bool step_dsml_invoke_name();
  bool step_dsml_invoke_body();
  bool step_dsml_param_header();
  bool step_dsml_value();
  bool step_dsml_close_gt();

  // Input helpers. `in()` is the undecided input; consuming moves bytes into `raw_` (markup not yet
  // represented by an event).
  std::string_view in() const { return std::string_view(buffer_).substr(position_); }
  void consume_markup(size_t bytes) {
    raw_.append(buffer_, position_, bytes);
    position_ += bytes;
  }
  void skip_whitespace() {
    size_t n = 0;
    std::string_view text = in();
    while (n < text.size() && is_whitespace(text[n])) ++n;
    consume_markup(n);
  }
  enum class Expect { kMatched, kNeedMore, kMismatch };
  // Matches one of `literals` at the start of the input (the longest; waits while a longer one may still
  // match) and consumes it.
  Expect expect(std::initializer_list<std::string_view> literals, size_t* which = nullptr);
  // Reads a name or key up to `terminator` (a byte). kMatched consumes the terminator too.
  Expect read_name(char terminator, std::string& name);

  // Output helpers.
  void emit_text(StreamEvent::Kind kind, std::string_view text);
  void begin_call(std::string name);
  void emit_arguments(std::string_view text);
  bool end_call();  // false: the arguments are not a JSON object (the call still ends)
  void start_block(std::string_view opener);
  void end_block();
  void malformed();

  bool dsml_;  // DSML tool calls (V3.2+), else tool-call tokens (V3, R1, V3.1)
  std::shared_ptr<const Tokenizer> tokenizer_;
  StreamParserOptions options_;
  bool starts_in_reasoning_;
  std::optional<TokenId> eos_id_;
  std::vector<TokenId> turn_markers_;
  IncrementalDetokenizer detokenizer_;

  // DSML tag texts for this format.
  std::string block_open_, block_open_after_blank_, block_close_;
  std::string invoke_open_, invoke_close_, param_open_, param_close_;
  // Markers that end kReasoning / kContent / kJsonLead.
  std::vector<std::string_view> reasoning_markers_, content_markers_, json_lead_markers_;

  State state_ = State::kStart;
  State content_state_ = State::kContent;  // where content goes on: kContent, or kJsonLead / kJsonDone
  std::string buffer_;  // decoded text not yet consumed starts at position_
  size_t position_ = 0;
  std::string raw_;      // consumed markup not yet represented by an event
  bool at_end_ = false;  // no more input will come
  bool cut_off_ = false;  // ...because the length limit ended the output (finish(events, true))
  bool ended_ = false;

  // Tool-call block state.
  int32_t calls_in_block_ = 0;
  bool opener_may_repeat_ = false;  // started inside a prefilled block: the model may write its opener again
  bool call_open_ = false;
  bool fence_seen_ = false;
  std::string name_;
  JsonPrefixValidator json_;
  // DSML parameter state.
  int32_t params_in_call_ = 0;
  std::unordered_set<std::string> keys_;
  std::string key_;
  int header_step_ = 0;  // progress through kDsmlParamHeader
  bool value_is_string_ = false;
  std::string value_;  // kDsmlRawValue: the value so far
  enum class CloseOf { kParameter, kInvoke, kBlock } close_of_ = CloseOf::kParameter;

  ParsedMessage message_;
  int32_t malformed_ = 0;
  std::vector<StreamEvent>* events_ = nullptr;
  size_t first_event_ = 0;  // events before this index belong to earlier calls: never merged into
};

StreamParser::Impl::Impl(PromptFormat format, std::shared_ptr<const Tokenizer> tokenizer, StreamParserOptions options)
    : dsml_(uses_dsml(format)),
      tokenizer_(std::move(tokenizer)),
      options_(options),
      // R1's generation prompt always opens <think>.
      starts_in_reasoning_(options.starts_in_reasoning || format == PromptFormat::kDeepSeekR1),
      eos_id_(tokenizer_->added_token_id(kEosText)),
      turn_markers_(turn_marker_ids(*tokenizer_, format)),
      detokenizer_(tokenizer_) {
  if (dsml_) {
    std::string_view block = format == PromptFormat::kDeepSeekV32  ? "function_calls"
                             : format == PromptFormat::kDeepSeekV4 ? "tool_calls"
                                                                   : " calls";
    std::string_view invoke = format == PromptFormat::kDeepSeekV41 ? " invoke" : "invoke";
    std::string_view parameter = format == PromptFormat::kDeepSeekV41 ? " parameter" : "parameter";
    block_open_ = std::string(kDsmlOpen) + std::string(block);
    // The encoders write "\n\n" before the block; those two newlines belong to the markup, not the content.
    block_open_after_blank_ = "\n\n" + block_open_;
    block_close_ = std::string(kDsmlClose) + std::string(block);
    invoke_open_ = std::string(kDsmlOpen) + std::string(invoke);
    invoke_close_ = std::string(kDsmlClose) + std::string(invoke);
    param_open_ = std::string(kDsmlOpen) + std::string(parameter);
    param_close_ = std::string(kDsmlClose) + std::string(parameter);
  }
  reasoning_markers_.push_back(kThinkEnd);
  if (options_.tools_enabled) {
    if (dsml_) {
      content_markers_ = {block_open_after_blank_, block_open_};
    } else {
      content_markers_ = {kToolCallsBegin};
    }
    // A tool-call block opened inside reasoning ends the reasoning (V4 does this; harmless elsewhere).
    reasoning_markers_.insert(reasoning_markers_.end(), content_markers_.begin(), content_markers_.end());
  }
  if (options_.json_output) {
    content_state_ = State::kJsonLead;
    json_lead_markers_ = content_markers_;
    json_lead_markers_.insert(json_lead_markers_.end(), {kJsonFence, kFence, "{", "["});
  }
  if (options_.starts_in_tool_calls && options_.tools_enabled) {
    // The prompt prefilled the block's opener (and V3.2+'s '>'): the output continues inside the block.
    state_ = State::kBetweenCalls;
    opener_may_repeat_ = true;
  }
}

void StreamParser::Impl::push(TokenId token, std::vector<StreamEvent>& events) {
  if (ended_) return;
  events_ = &events;
  first_event_ = events.size();
  if (eos_id_ && token == *eos_id_) {
    message_.ended_with_eos = true;
    end_of_output();
    return;
  }
  if (std::find(turn_markers_.begin(), turn_markers_.end(), token) != turn_markers_.end()) {
    message_.ended_with_turn_marker = true;
    end_of_output();
    return;
  }
  // Tokens flagged special other than EOS (BOS, padding, DeepSeek's placeholder ids) are never text, as with
  // vLLM's default skip_special_tokens. The structural markers (tool calls, roles) are not flagged special.
  if (tokenizer_->is_special_token(token)) return;
  buffer_ += detokenizer_.push(token);
  run();
  buffer_.erase(0, position_);  // what stays is a short undecided tail
  position_ = 0;
}

void StreamParser::Impl::finish(std::vector<StreamEvent>& events, bool cut_off) {
  if (ended_) return;
  events_ = &events;
  first_event_ = events.size();
  end_of_output(cut_off);
}

void StreamParser::Impl::end_of_output(bool cut_off) {
  buffer_ += detokenizer_.flush();
  at_end_ = true;
  cut_off_ = cut_off;
  run();
  switch (state_) {
    case State::kStart:
    case State::kReasoning:
    case State::kContent:
    case State::kPlainContent:
    case State::kJsonLead:
    case State::kJson:
    case State::kJsonDone:
      break;  // run() emitted everything
    case State::kBetweenCalls:
      // Output ended after a complete call, without the block's closing marker: the calls stand.
      if (calls_in_block_ > 0 && in().empty() && all_whitespace(raw_)) {
        raw_.clear();
        break;
      }
      cut_off ? cut_short() : malformed();
      break;
    default:
      cut_off ? cut_short() : malformed();  // output ended inside a call
      break;
  }
  buffer_.clear();
  position_ = 0;
  ended_ = true;
}

void StreamParser::Impl::run() {
  while (step()) {
  }
}

bool StreamParser::Impl::step() {
  switch (state_) {
    case State::kStart:
      return step_start();
    case State::kReasoning:
    case State::kContent:
    case State::kPlainContent:
    case State::kJsonLead:
    case State::kJson:
    case State::kJsonDone:
      return step_text();
    case State::kBetweenCalls:
      return step_between_calls();
    case State::kCallHead:
      return step_call_head();
    case State::kAfterFunction:
      return step_after_function();
    case State::kV3Name:
      return step_v3_name();
    case State::kV3Fence:
      return step_v3_fence();
    case State::kArgsStart:
      return step_args_start();
    case State::kArgsJson:
      return step_args_json();
    case State::kCallEnd:
      return step_call_end();
    case State::kDsmlBlockGt:
      return step_dsml_block_gt();
    case State::kDsmlInvokeName:
      return step_dsml_invoke_name();
    case State::kDsmlInvokeBody:
      return step_dsml_invoke_body();
    case State::kDsmlParamHeader:
      return step_dsml_param_header();
    case State::kDsmlStringValue:
    case State::kDsmlRawValue:
      return step_dsml_value();
    case State::kDsmlCloseGt:
      return step_dsml_close_gt();
  }
  return false;
}

// ---- reasoning and content -------------------------------------------------------------------------------

bool StreamParser::Impl::step_start() {
  // Thinking prompts already opened <think>: a repeated one is dropped. Otherwise a leading <think> opens a
  // reasoning block, and a leading </think> (non-thinking prompts end with one) closes an empty one.
  std::string_view text = in();
  std::array<std::string_view, 2> candidates = {kThinkStart, kThinkEnd};
  size_t count = starts_in_reasoning_ ? 1 : 2;
  for (size_t i = 0; i < count; ++i) {
    if (text.starts_with(candidates[i])) {
      position_ += candidates[i].size();
      state_ = i == 0 ? State::kReasoning : content_state_;
      return true;
    }
  }
  for (size_t i = 0; i < count; ++i) {
    if (!at_end_ && candidates[i].starts_with(text)) return false;  // may still become one
  }
  state_ = starts_in_reasoning_ ? State::kReasoning : content_state_;
  return true;
}

bool StreamParser::Impl::step_text() {
  std::string_view text = in();
  if (text.empty()) return false;
  if (state_ == State::kPlainContent) {
    emit_text(StreamEvent::Kind::kContent, text);
    position_ = buffer_.size();
    return false;
  }
  static constexpr std::array<std::string_view, 1> kJsonEndMarker = {kJsonEnd};
  const bool reasoning = state_ == State::kReasoning;
  const auto kind = reasoning ? StreamEvent::Kind::kReasoning : StreamEvent::Kind::kContent;
  std::span<const std::string_view> markers = content_markers_;
  if (reasoning) {
    markers = reasoning_markers_;
  } else if (state_ == State::kJsonLead) {
    markers = json_lead_markers_;
  } else if (state_ == State::kJson) {
    markers = kJsonEndMarker;
  }
  size_t safe = 0;
  // Cut by the length limit, a tail that could have become a marker (a tool-call block's "\n\n<｜DSML｜") is dropped,
  // not shown as text.
  std::optional<MarkerMatch> match = find_marker(text, markers, at_end_ && !cut_off_, safe);
  // Text around the JSON text is dropped (JSON output).
  if (state_ != State::kJsonLead && state_ != State::kJsonDone) emit_text(kind, text.substr(0, safe));
  position_ += safe;
  if (!match) {
    if (at_end_) position_ = buffer_.size();
    return false;
  }
  std::string_view marker = markers[match->index];
  if (marker == kThinkEnd && reasoning) {
    position_ += marker.size();
    state_ = content_state_;
  } else if (marker == "{" || marker == "[") {
    state_ = State::kJson;  // the bracket is the JSON text's first byte
  } else if (marker == kJsonFence || marker == kFence) {
    position_ += marker.size();
    state_ = State::kJson;
  } else if (marker == kJsonEnd) {
    position_ += marker.size();
    state_ = content_state_ = State::kJsonDone;
  } else {
    start_block(marker);
  }
  return true;
}

// ---- tool-call blocks: shared ----------------------------------------------------------------------------

void StreamParser::Impl::start_block(std::string_view opener) {
  raw_.clear();
  consume_markup(opener.size());
  calls_in_block_ = 0;
  state_ = dsml_ ? State::kDsmlBlockGt : State::kBetweenCalls;
}

void StreamParser::Impl::end_block() {
  raw_.clear();
  state_ = content_state_;
}

// The length limit ended the output inside tool-call markup: the markup read and the undecided tail are dropped,
// a call whose name was read ends with the arguments streamed so far. Not counted as malformed (the model was
// stopped, not wrong).
void StreamParser::Impl::cut_short() {
  raw_.clear();
  if (call_open_) end_call();
  position_ = buffer_.size();
  state_ = State::kPlainContent;
}

void StreamParser::Impl::malformed() {
  std::string markup = std::move(raw_);
  raw_.clear();
  if (call_open_) end_call();
  ++malformed_;
  emit_text(StreamEvent::Kind::kContent, markup);
  emit_text(StreamEvent::Kind::kContent, in());
  position_ = buffer_.size();
  state_ = State::kPlainContent;
}

StreamParser::Impl::Expect StreamParser::Impl::expect(std::initializer_list<std::string_view> literals, size_t* which) {
  std::string_view text = in();
  size_t best = literals.size();
  bool may_grow = false;
  size_t i = 0;
  for (std::string_view literal : literals) {
    if (text.starts_with(literal)) {
      if (best == literals.size() || literal.size() > std::data(literals)[best].size()) best = i;
    } else if (literal.starts_with(text)) {
      may_grow = true;
    }
    ++i;
  }
  if (may_grow) return Expect::kNeedMore;
  if (best == literals.size()) return Expect::kMismatch;
  consume_markup(std::data(literals)[best].size());
  if (which != nullptr) *which = best;
  return Expect::kMatched;
}

StreamParser::Impl::Expect StreamParser::Impl::read_name(char terminator, std::string& name) {
  std::string_view text = in();
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == terminator) {
      name.append(text.substr(0, i));
      consume_markup(i + 1);
      return Expect::kMatched;
    }
    if (bad_name_byte(text[i]) || name.size() + i >= kMaxNameBytes) {
      name.append(text.substr(0, i));
      consume_markup(i);
      return Expect::kMismatch;
    }
  }
  name.append(text);
  consume_markup(text.size());
  return Expect::kNeedMore;
}

bool StreamParser::Impl::step_between_calls() {
  skip_whitespace();
  size_t which = 0;
  Expect result = Expect::kMismatch;
  if (!opener_may_repeat_) {
    result = dsml_ ? expect({invoke_open_, block_close_}, &which) : expect({kToolCallBegin, kToolCallsEnd}, &which);
  } else {
    result = dsml_ ? expect({invoke_open_, block_close_, block_open_}, &which)
                   : expect({kToolCallBegin, kToolCallsEnd, kToolCallsBegin}, &which);
  }
  if (result == Expect::kNeedMore) return false;
  opener_may_repeat_ = false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  if (which == 2) {  // the prefilled opener, written again by the model: dropped
    if (dsml_) state_ = State::kDsmlBlockGt;
    return true;
  }
  if (which == 1) {  // the block's closing marker
    if (calls_in_block_ == 0) {
      malformed();  // an empty block: markup that is no tool call
      return false;
    }
    if (dsml_) {
      close_of_ = CloseOf::kBlock;
      state_ = State::kDsmlCloseGt;
    } else {
      end_block();
    }
    return true;
  }
  name_.clear();
  fence_seen_ = false;
  header_step_ = 0;
  state_ = dsml_ ? State::kDsmlInvokeName : State::kCallHead;
  return true;
}

// ---- V3 / R1 and V3.1 calls ------------------------------------------------------------------------------

bool StreamParser::Impl::step_v3_name() {
  // The name runs to the end of the line (a trailing '\r' or spaces are trimmed below).
  std::string_view text = in();
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '\n') {
      name_.append(text.substr(0, i));
      consume_markup(i + 1);
      std::string_view name = trim(name_);
      if (name.empty()) {
        malformed();
        return false;
      }
      name_ = std::string(name);
      state_ = State::kV3Fence;
      return true;
    }
    if ((bad_name_byte(c) && c != '\r') || name_.size() + i >= kMaxNameBytes) {
      name_.append(text.substr(0, i));
      consume_markup(i);
      malformed();
      return false;
    }
  }
  name_.append(text);
  consume_markup(text.size());
  return false;
}

bool StreamParser::Impl::step_v3_fence() {
  skip_whitespace();
  std::string_view text = in();
  if (text.empty()) return false;
  if (text.front() == '{') {
    begin_call(std::move(name_));
    json_.reset();
    state_ = State::kArgsJson;
    return true;
  }
  if (fence_seen_) {
    malformed();
    return false;
  }
  Expect result = expect({"```json", "```"});
  if (result == Expect::kNeedMore) return false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  fence_seen_ = true;
  return true;
}

bool StreamParser::Impl::step_call_head() {
  std::string_view text = in();
  static constexpr std::array<std::string_view, 1> kSeparator = {kToolSep};
  size_t safe = 0;
  std::optional<MarkerMatch> match = find_marker(text, kSeparator, /*at_end=*/false, safe);
  std::string_view part = text.substr(0, safe);
  for (size_t i = 0; i < part.size(); ++i) {
    if (bad_name_byte(part[i]) || name_.size() + i >= kMaxNameBytes) {
      name_.append(part.substr(0, i));
      consume_markup(i);
      malformed();
      return false;
    }
  }
  name_.append(part);
  consume_markup(part.size());
  if (!match) return false;
  consume_markup(kToolSep.size());
  std::string_view name = trim(name_);
  if (name.empty()) {
    malformed();
    return false;
  }
  name_ = std::string(name);
  state_ = name_ == "function" ? State::kAfterFunction : State::kArgsStart;
  return true;
}

bool StreamParser::Impl::step_after_function() {
  skip_whitespace();
  std::string_view text = in();
  if (text.empty()) return false;
  if (text.front() == '{') {
    state_ = State::kArgsStart;
  } else {
    name_.clear();
    state_ = State::kV3Name;
  }
  return true;
}

bool StreamParser::Impl::step_args_start() {
  skip_whitespace();
  std::string_view text = in();
  if (text.empty()) return false;
  if (text.front() != '{') {
    malformed();  // arguments that are not a JSON object
    return false;
  }
  begin_call(std::move(name_));
  json_.reset();
  state_ = State::kArgsJson;
  return true;
}

bool StreamParser::Impl::step_args_json() {
  std::string_view text = in();
  for (size_t i = 0; i < text.size(); ++i) {
    JsonPrefixValidator::Step result = json_.push(text[i]);
    if (result == JsonPrefixValidator::Step::kError) {
      emit_arguments(text.substr(0, i));
      position_ += i;
      malformed();
      return false;
    }
    if (result == JsonPrefixValidator::Step::kComplete) {
      emit_arguments(text.substr(0, i + 1));
      position_ += i + 1;
      state_ = State::kCallEnd;
      fence_seen_ = false;
      return true;
    }
  }
  emit_arguments(text);
  position_ += text.size();
  return false;
}

bool StreamParser::Impl::step_call_end() {
  skip_whitespace();
  size_t which = 0;
  Expect result = fence_seen_ ? expect({kToolCallEnd}, &which) : expect({"```", kToolCallEnd}, &which);
  if (result == Expect::kNeedMore) return false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  if (!fence_seen_ && which == 0) {
    fence_seen_ = true;
    return true;
  }
  if (!end_call()) {
    malformed();
    return false;
  }
  state_ = State::kBetweenCalls;
  return true;
}

// ---- DSML calls ------------------------------------------------------------------------------------------

bool StreamParser::Impl::step_dsml_block_gt() {
  Expect result = expect({">"});
  if (result == Expect::kNeedMore) return false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  state_ = State::kBetweenCalls;
  return true;
}

bool StreamParser::Impl::step_dsml_invoke_name() {
  // ` name="NAME">` (whitespace around the attribute is tolerated).
  if (header_step_ == 0) {
    skip_whitespace();
    Expect result = expect({"name=\""});
    if (result == Expect::kNeedMore) return false;
    if (result == Expect::kMismatch) {
      malformed();
      return false;
    }
    header_step_ = 1;
  }
  if (header_step_ == 1) {
    Expect result = read_name('"', name_);
    if (result == Expect::kNeedMore) return false;
    if (result == Expect::kMismatch || name_.empty()) {
      malformed();
      return false;
    }
    header_step_ = 2;
  }
  skip_whitespace();
  Expect result = expect({">"});
  if (result == Expect::kNeedMore) return false;
  header_step_ = 0;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  begin_call(std::move(name_));
  emit_arguments("{");
  params_in_call_ = 0;
  keys_.clear();
  state_ = State::kDsmlInvokeBody;
  return true;
}

bool StreamParser::Impl::step_dsml_invoke_body() {
  skip_whitespace();
  size_t which = 0;
  Expect result = expect({param_open_, invoke_close_}, &which);
  if (result == Expect::kNeedMore) return false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  if (which == 0) {
    key_.clear();
    header_step_ = 0;
    state_ = State::kDsmlParamHeader;
  } else {
    close_of_ = CloseOf::kInvoke;
    state_ = State::kDsmlCloseGt;
  }
  return true;
}

bool StreamParser::Impl::step_dsml_param_header() {
  // ` name="KEY" string="true|false">`
  auto fail = [this] {
    malformed();
    return false;
  };
  while (true) {
    Expect result = Expect::kMatched;
    size_t which = 0;
    switch (header_step_) {
      case 0:
        skip_whitespace();
        result = expect({"name=\""});
        break;
      case 1:
        result = read_name('"', key_);
        break;
      case 2:
        skip_whitespace();
        result = expect({"string=\""});
        break;
      case 3:
        result = expect({"true\"", "false\""}, &which);
        value_is_string_ = which == 0;
        break;
      case 4:
        skip_whitespace();
        result = expect({">"});
        break;
    }
    if (result == Expect::kNeedMore) return false;
    if (result == Expect::kMismatch) return fail();
    if (++header_step_ < 5) continue;
    break;
  }
  header_step_ = 0;
  if (!keys_.insert(key_).second) return fail();  // a duplicate parameter
  if (value_is_string_) {
    std::string text = params_in_call_ > 0 ? ", \"" : "\"";
    append_json_escaped(key_, text);
    text += "\": \"";
    emit_arguments(text);
    ++params_in_call_;
    state_ = State::kDsmlStringValue;
  } else {
    value_.clear();
    state_ = State::kDsmlRawValue;
  }
  return true;
}

bool StreamParser::Impl::step_dsml_value() {
  // The value runs to the closing parameter tag, whatever it contains (as the reference parser reads it).
  std::string_view text = in();
  std::array<std::string_view, 1> close = {param_close_};
  size_t safe = 0;
  std::optional<MarkerMatch> match = find_marker(text, close, /*at_end=*/false, safe);
  std::string_view part = text.substr(0, safe);
  if (state_ == State::kDsmlStringValue) {
    std::string escaped;
    append_json_escaped(part, escaped);
    if (match) escaped += '"';
    emit_arguments(escaped);
    position_ += part.size();
    if (!match) return false;
    position_ += param_close_.size();
  } else {
    value_.append(part);
    consume_markup(part.size());
    if (!match) return false;
    consume_markup(param_close_.size());
    boost::json::error_code error;
    boost::json::parse_options parse_options;
    parse_options.max_depth = kMaxJsonDepth;
    boost::json::parse(value_, error, {}, parse_options);
    if (error) {
      malformed();  // a string="false" value that is not JSON
      return false;
    }
    std::string text_out = params_in_call_ > 0 ? ", \"" : "\"";
    append_json_escaped(key_, text_out);
    text_out += "\": ";
    text_out += value_;
    emit_arguments(text_out);
    ++params_in_call_;
  }
  close_of_ = CloseOf::kParameter;
  state_ = State::kDsmlCloseGt;
  return true;
}

bool StreamParser::Impl::step_dsml_close_gt() {
  skip_whitespace();
  Expect result = expect({">"});
  if (result == Expect::kNeedMore) return false;
  if (result == Expect::kMismatch) {
    malformed();
    return false;
  }
  switch (close_of_) {
    case CloseOf::kParameter:
      raw_.clear();
      state_ = State::kDsmlInvokeBody;
      break;
    case CloseOf::kInvoke:
      emit_arguments("}");
      if (!end_call()) {
        malformed();
        return false;
      }
      state_ = State::kBetweenCalls;
      break;
    case CloseOf::kBlock:
      end_block();
      break;
  }
  return true;
}

// ---- events ----------------------------------------------------------------------------------------------

void StreamParser::Impl::emit_text(StreamEvent::Kind kind, std::string_view text) {
  if (text.empty()) return;
  (kind == StreamEvent::Kind::kReasoning ? message_.reasoning : message_.content).append(text);
  if (events_->size() > first_event_ && events_->back().kind == kind) {
    events_->back().text.append(text);
    return;
  }
  StreamEvent event;
  event.kind = kind;
  event.text = std::string(text);
  events_->push_back(std::move(event));
}

void StreamParser::Impl::begin_call(std::string name) {
  ParsedToolCall call;
  const auto index = static_cast<int32_t>(message_.tool_calls.size());
  call.id = "call_" + std::to_string(index) + "_" + random_suffix();
  call.name = std::move(name);
  StreamEvent event;
  event.kind = StreamEvent::Kind::kToolCallBegin;
  event.tool_index = index;
  event.tool_id = call.id;
  event.tool_name = call.name;
  events_->push_back(std::move(event));
  message_.tool_calls.push_back(std::move(call));
  call_open_ = true;
  raw_.clear();
}

void StreamParser::Impl::emit_arguments(std::string_view text) {
  if (text.empty()) return;
  const auto index = static_cast<int32_t>(message_.tool_calls.size()) - 1;
  message_.tool_calls.back().arguments_text.append(text);
  raw_.clear();
  if (events_->size() > first_event_ && events_->back().kind == StreamEvent::Kind::kToolArguments &&
      events_->back().tool_index == index) {
    events_->back().text.append(text);
    return;
  }
  StreamEvent event;
  event.kind = StreamEvent::Kind::kToolArguments;
  event.text = std::string(text);
  event.tool_index = index;
  events_->push_back(std::move(event));
}

bool StreamParser::Impl::end_call() {
  ParsedToolCall& call = message_.tool_calls.back();
  boost::json::error_code error;
  boost::json::parse_options parse_options;
  parse_options.max_depth = kMaxJsonDepth;
  boost::json::value arguments = boost::json::parse(call.arguments_text, error, {}, parse_options);
  bool ok = !error && arguments.is_object();
  if (ok) call.arguments = std::move(arguments.as_object());
  StreamEvent event;
  event.kind = StreamEvent::Kind::kToolCallEnd;
  event.tool_index = static_cast<int32_t>(message_.tool_calls.size()) - 1;
  events_->push_back(std::move(event));
  call_open_ = false;
  ++calls_in_block_;
  raw_.clear();
  return ok;
}

// ---- public API ------------------------------------------------------------------------------------------

StreamParser::StreamParser(PromptFormat format, std::shared_ptr<const Tokenizer> tokenizer, StreamParserOptions options)
    : impl_(std::make_unique<Impl>(format, std::move(tokenizer), options)) {}
StreamParser::~StreamParser() = default;
StreamParser::StreamParser(StreamParser&&) noexcept = default;

void StreamParser::push(TokenId token, std::vector<StreamEvent>& events) { impl_->push(token, events); }
void StreamParser::finish(std::vector<StreamEvent>& events, bool cut_off) { impl_->finish(events, cut_off); }
const ParsedMessage& StreamParser::result() const { return impl_->message_; }
int32_t StreamParser::malformed_tool_calls() const { return impl_->malformed_; }
bool StreamParser::in_reasoning() const { return impl_->state_ == Impl::State::kReasoning; }

StreamParserOptions stream_parser_options(const Conversation& conversation, const RenderedPrompt& prompt) {
  StreamParserOptions options;
  options.tools_enabled = !conversation.tools.empty();
  options.starts_in_reasoning = prompt_opens_reasoning(prompt);
  options.starts_in_tool_calls = prompt.opens_tool_calls;
  options.json_output = conversation.options.response_format.has_value();
  return options;
}

std::vector<TokenId> turn_marker_ids(const Tokenizer& tokenizer, PromptFormat format) {
  std::vector<std::string_view> markers = {"<\uFF5CUser\uFF5C>", "<\uFF5CAssistant\uFF5C>"};
  if (format == PromptFormat::kDeepSeekV41) markers.push_back("<\uFF5CSystem\uFF5C>");
  if (format == PromptFormat::kDeepSeekV4 || format == PromptFormat::kDeepSeekV41) {
    markers.push_back("<\uFF5Clatest_reminder\uFF5C>");
  }
  std::vector<TokenId> ids;
  for (std::string_view marker : markers) {
    if (std::optional<TokenId> id = tokenizer.added_token_id(marker)) ids.push_back(*id);
  }
  return ids;
}

std::vector<TokenId> reasoning_end_ids(const Tokenizer& tokenizer, PromptFormat format, bool tools_enabled) {
  std::optional<TokenId> think_end = tokenizer.added_token_id(kThinkEnd);
  if (!think_end) return {};
  std::vector<TokenId> ids = {*think_end};
  if (tools_enabled) {
    const bool template_format =
        format == PromptFormat::kDeepSeekV3 || format == PromptFormat::kDeepSeekR1 || format == PromptFormat::kDeepSeekV31;
    std::optional<TokenId> opener =
        tokenizer.added_token_id(template_format ? kToolCallsBegin : kDsmlOpen.substr(1));  // "｜DSML｜"
    if (opener) ids.push_back(*opener);
  }
  return ids;
}

}  // namespace deepinfer::recipe
