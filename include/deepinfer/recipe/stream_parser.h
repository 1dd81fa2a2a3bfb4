// Incremental parser of a DeepSeek model's output tokens into reasoning, content and tool calls, one state
// machine per prompt format. Streaming and non-streaming use the same object (non-streaming = push every
// token, then finish(), then result()), so both give the same final message however tokens are grouped.
//
// Formats (what the model writes after the generation prompt):
//   deepseek-v3, deepseek-r1: [reasoning </think>] content [<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
//     <｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>(\n<｜tool▁call▁begin｜>...)*<｜tool▁calls▁end｜>]
//     (R1: the prompt already opened <think>, so output starts inside reasoning)
//   deepseek-v3.1: [reasoning </think>] content [<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
//     <｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>]
//   deepseek-v3.2 / v4 / v4.1: [reasoning </think>] content [\n\n<｜DSML｜function_calls|tool_calls| calls> blocks of
//     invoke/parameter tags]; V4 may open its tool-call block before </think>. `｜DSML｜` is one added token in
//     V4's and V4.1's tokenizers (id 128825) and text in V3.2's; either way it decodes to the same text.
// After a prompt that prefilled a tool-call block's opener (tool_choice required or named:
// options.starts_in_tool_calls), the output starts inside the block, before its first call; the opener written
// again there (whitespace aside) is dropped, as a repeated <think> is.
// The end-of-sequence token ends the message and is not content; other tokens flagged `special` in the
// tokenizer (BOS, padding, placeholders) are skipped, as vLLM's default skip_special_tokens does.
// Turn markers (turn_marker_ids(): `<｜User｜>`, `<｜Assistant｜>`, and V4.1's `<｜System｜>`, V4's
// `<｜latest_reminder｜>`) written as their added token end the message the same way: the model has started a
// turn that is not its own, so the marker and anything after it never reach the client (the server also
// stops generation there: they are stop tokens of every chat request; finish reason "stop").
//
// Markers are matched on the decoded text, whether the model wrote them as one added token (`<think>`,
// `</think>`, `｜DSML｜`, the V3 tool tokens) or as several ordinary pieces, so the result depends only on the
// text (plus the end-of-sequence id), never on how it was tokenized. Reasoning: when
// options.starts_in_reasoning (always for deepseek-r1), text up to </think> is reasoning and a leading repeated
// <think> is dropped; otherwise an output that begins with <think> opens a reasoning block, and a leading
// </think> closes an empty one. Any later <think> / </think> in content is
// content. With tools enabled, a tool-call block opener inside reasoning ends the reasoning (V4 does this).
// The whitespace-tolerant grammar: whitespace is allowed between tags and around attributes; V3 and V3.1
// read each other's call syntax (they share their tokens); "\n\n" before a DSML block belongs to the markup.
//
// Malformed tool markup (the one documented fallback rule): markup that cannot be parsed as a tool call is
// emitted as content, verbatim, and counted in malformed_tool_calls(); a tool call whose arguments are not a
// JSON object after parsing is handled the same way. Nothing is silently dropped (but see JSON output).
// Precisely, with streaming:
//   - A call commits when its header is complete: for V3/R1/V3.1 the name is read and the arguments start
//     with '{'; for DSML the `invoke name="NAME">` tag is read. kToolCallBegin is emitted then, not before.
//   - When markup breaks (a byte the grammar does not allow, a duplicate parameter, a string="false" value
//     that is not JSON, an empty block, the end of output inside a block), all consumed markup not yet
//     represented by an event plus all the rest of the output is emitted as content, verbatim, the counter is
//     incremented, and the rest of the message is plain content. So a block that breaks before its first
//     call commits is content in full, starting at its opener.
//   - A committed call is never retracted: if it breaks, it ends with kToolCallEnd, keeps the argument text
//     streamed so far (always a valid JSON prefix: raw JSON is checked byte by byte and DSML string="false"
//     values are held until their closing tag), and its `arguments` is that text parsed when it is a
//     complete object, else empty.
//   - The end of output right after a complete call (the block's closing marker missing) is not malformed.
//   - After a prefilled opener (starts_in_tool_calls) the opener is the prompt's, not output: markup that breaks
//     is emitted from the model's first byte on, and an output with no call at all counts as malformed.
//
// JSON output (options.json_output, for a request's JSON response_format), as deepseek-recipe's
// parse_json_output: in content, the JSON text starts at the first fence "```json\n" or "```\n" (dropped) or
// at the first '{' or '[' (kept), and runs to the next "\n```" (dropped); content before and after it is
// dropped (deepseek-recipe turns each such piece into one space, a count that depends on how the output was
// chunked). Tool-call blocks are still recognised outside the JSON text; reasoning is unaffected.
//
// Not thread-safe: one parser per generated sequence. O(total output length).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/json/object.hpp>

#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

struct StreamParserOptions {
  // The prompt ended inside a reasoning block (thinking mode: the generation prompt ends with <think>, and
  // always for deepseek-r1). Output then starts as reasoning until </think>.
  bool starts_in_reasoning = false;
  // Tool calls are recognised only when the request offered tools (else their markup is content).
  bool tools_enabled = true;
  // The prompt ends with a prefilled tool-call block opener (RenderedPrompt::opens_tool_calls): output starts
  // inside the block, before its first call. Only with tools_enabled; takes precedence over
  // starts_in_reasoning.
  bool starts_in_tool_calls = false;
  // Content keeps only the JSON text (see the file comment): the request asked for a JSON response_format.
  bool json_output = false;
};

// The options for parsing the answer to `conversation` rendered as `prompt` (render_prompt): starts_in_reasoning
// when the prompt opened <think> (prompt_opens_reasoning), starts_in_tool_calls when it prefilled a tool-call
// block, tools_enabled when the request offered tools, json_output when it asked for JSON.
StreamParserOptions stream_parser_options(const Conversation& conversation, const RenderedPrompt& prompt);

// One delta of the stream, in order. Concatenating all kReasoning texts gives the final reasoning, all
// kContent texts the final content, and for each tool-call index all kToolArguments fragments its
// arguments JSON text (OpenAI streaming semantics: id and name once, in kToolCallBegin, before fragments).
struct StreamEvent {
  enum class Kind { kReasoning, kContent, kToolCallBegin, kToolArguments, kToolCallEnd };
  Kind kind = Kind::kContent;
  std::string text;     // kReasoning, kContent: UTF-8 text; kToolArguments: a JSON text fragment
  int32_t tool_index = -1;  // tool events: 0-based index of the call in this message
  std::string tool_id;      // kToolCallBegin: generated id ("call_<index>_<random>")
  std::string tool_name;    // kToolCallBegin
};

struct ParsedToolCall {
  std::string id;
  std::string name;
  boost::json::object arguments;  // parsed
  std::string arguments_text;     // exactly the concatenated kToolArguments fragments
};

struct ParsedMessage {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  bool ended_with_eos = false;          // the end-of-sequence token was seen
  bool ended_with_turn_marker = false;  // a turn marker token ended it (see the file comment)
};

// The ids of `format`'s turn markers that the tokenizer has as added tokens (see the file comment), in a
// fixed order; empty when it has none.
std::vector<TokenId> turn_marker_ids(const Tokenizer& tokenizer, PromptFormat format);

// The ids of the tokens whose appearance ends reasoning for this parser, for a thinking budget
// (engine::SamplingParams::reasoning_budget): `</think>` first, then, with tools enabled, the token that opens the
// format's tool-call block (`<｜tool▁calls▁begin｜>` on V3, R1 and V3.1, `｜DSML｜` on V3.2 and later), where the
// tokenizer has it as an added token. Empty when `</think>` is not one (a budget cannot be enforced then).
std::vector<TokenId> reasoning_end_ids(const Tokenizer& tokenizer, PromptFormat format, bool tools_enabled);

class StreamParser {
 public:
  // REQUIRES: tokenizer != nullptr (the model's tokenizer: token bytes and the end-of-sequence id).
  StreamParser(PromptFormat format, std::shared_ptr<const Tokenizer> tokenizer, StreamParserOptions options);
  ~StreamParser();
  StreamParser(StreamParser&&) noexcept;

  // Feeds one generated token; appends the events it completes to `events`. Text that could still turn out
  // to be the start of a marker (a partial "</think>" or DSML tag) or an incomplete UTF-8 character is held
  // back until it is decided; it is never emitted and then retracted. Adjacent text or argument deltas of
  // one push are merged into one event. The end-of-sequence token does what finish() does; tokens after it
  // (or after finish()) are ignored.
  void push(TokenId token, std::vector<StreamEvent>& events);
  // End of generation (EOS, length or stop): flushes what was held back by the rule above. Output that ends inside
  // tool-call markup is malformed and comes back as content, unless `cut_off` (the length limit ended it): then
  // the markup is dropped and a call whose name was read stands with the arguments read so far (OpenAI's partial
  // arguments at finish_reason "length"); the markup never reaches the client.
  void finish(std::vector<StreamEvent>& events, bool cut_off = false);
  // The message so far (complete after finish()).
  const ParsedMessage& result() const;
  int32_t malformed_tool_calls() const;
  // The parser is inside the reasoning block: the last token pushed was reasoning (or opened it), so the next
  // one is too unless it closes it. OutputBuilder counts reasoning tokens with it.
  bool in_reasoning() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepinfer::recipe
