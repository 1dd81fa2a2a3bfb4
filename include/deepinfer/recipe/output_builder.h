// Generated tokens (or text) -> the deltas a client may see: the output parser (chat dialects) or the
// incremental detokenizer (completions), then the stop strings. What the server and the Python module's
// StreamProcessor both run between the engine and a response builder (response_builder.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/recipe/detokenizer.h"
#include "deepinfer/recipe/stop_matcher.h"
#include "deepinfer/recipe/stream_parser.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

// The final message as built from the emitted deltas (so it holds exactly what the client was shown).
struct OutputToolCall {
  std::string id;
  std::string name;
  std::string arguments_text;  // the concatenated argument fragments
};
struct OutputMessage {
  std::string reasoning;
  std::string content;
  std::vector<OutputToolCall> tool_calls;
};

// Stop strings are matched within each run of reasoning or content text (tool-call arguments are never cut); a
// partial match is held back; the text from the match on is dropped. Not thread-safe: one per generated
// sequence.
class OutputBuilder {
 public:
  // Chat: every token goes through the stream parser. `tokenizer` is the parser's (push_text() encodes with it).
  OutputBuilder(StreamParser parser, std::shared_ptr<const Tokenizer> tokenizer, std::vector<std::string> stops);
  // Completions: the incremental detokenizer; special tokens (EOS, ...) add no text.
  OutputBuilder(std::shared_ptr<const Tokenizer> tokenizer, std::vector<std::string> stops);

  // At most `n` tool calls (n >= 1; ToolChoice::parallel false is 1): when the n-th call is complete, push()
  // returns true (generation is over, as for a stop string) and nothing after it is shown. A call the parser
  // closes on malformed markup is not complete and does not count. Default: no limit.
  void set_max_tool_calls(int32_t n) { max_tool_calls_ = n; }
  // Whether push() stopped because the tool-call limit was reached (then stop_string() is empty).
  bool tool_call_limit_reached() const { return tool_limit_reached_; }
  // Feeds one generated token and appends what may be shown now to `out`. Returns true when a stop string
  // completed or the tool-call limit was reached: generation is over, feed nothing more.
  bool push(TokenId token, std::vector<StreamEvent>& out);
  // Feeds generated text instead of ids (a backend that reports text): it is encoded with the tokenizer,
  // added tokens matched (TextTrust::kTrusted, so the model's marker text becomes the ids it stands for), and
  // the ids are pushed. The parser matches markers on the decoded text, so the result equals that of the
  // model's own ids whenever their decoded text is `text`; adjacent deltas of one kind (text, or one call's
  // arguments) are merged, so one push gives one delta per run. Returns true as push() does.
  bool push_text(std::string_view text, std::vector<StreamEvent>& out);
  // Generation ended by the engine (EOS, stop token, length): appends what was held back. `cut_off`: the length
  // limit ended it (StreamParser::finish: a call cut short keeps no markup).
  void finish(std::vector<StreamEvent>& out, bool cut_off = false);
  const OutputMessage& message() const { return message_; }
  // Tokens pushed while the parser was in the reasoning block, the token that closes it included (the usage's
  // reasoning_tokens). 0 for completions.
  int64_t reasoning_tokens() const { return reasoning_tokens_; }
  const std::optional<std::string>& stop_string() const { return matcher_.matched(); }
  int32_t malformed_tool_calls() const;

 private:
  // Passes parser events through the stop matcher into `out`; true on a stop-string match.
  bool filter(std::vector<StreamEvent>& events, std::vector<StreamEvent>& out);
  void flush_text(std::vector<StreamEvent>& out);
  void emit(StreamEvent event, std::vector<StreamEvent>& out);

  std::optional<StreamParser> parser_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::optional<IncrementalDetokenizer> detokenizer_;
  StopMatcher matcher_;
  StreamEvent::Kind text_kind_ = StreamEvent::Kind::kContent;
  std::vector<StreamEvent> scratch_;
  std::vector<TokenId> text_ids_;
  OutputMessage message_;
  int64_t reasoning_tokens_ = 0;
  int32_t max_tool_calls_ = 0;  // 0: no limit
  int32_t tool_calls_ended_ = 0;  // complete calls (not closed on malformed markup)
  int32_t malformed_seen_ = 0;
  bool tool_limit_reached_ = false;
};

}  // namespace deepinfer::recipe
