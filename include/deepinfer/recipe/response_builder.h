// Response builders of the three API dialects: the output deltas (stream_parser.h events through an
// OutputBuilder), the usage and the ids become the dialect's response object and its stream chunks. Pure
// protocol: no HTTP, no engine. The server frames the chunks as SSE and writes the bodies; the Python module
// exposes the same builders (deepseek-recipe's chunk generators and response classes).
//
// Shapes, per dialect:
//   OpenAI Chat Completions  chat.completion / chat.completion.chunk (data-only SSE, ended by "data: [DONE]"):
//                            a role chunk, then reasoning_content / content / tool_calls deltas (consecutive
//                            pieces of one kind share a chunk), a finish_reason chunk, the usage chunk with
//                            stream_options.include_usage, [DONE].
//   OpenAI Completions       text_completion (legacy; the detokenizer's text, no parser).
//   Anthropic Messages       message; events message_start, content_block_start/delta/stop (thinking, text,
//                            tool_use blocks), message_delta, message_stop.
//   OpenAI Responses         response; events response.created, response.in_progress, output_item.added,
//                            content_part.added, *.delta, *.done, response.completed (response.incomplete when
//                            max_output_tokens ran out), each with a sequence_number.
#pragma once

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/recipe/output_builder.h"
#include "deepinfer/recipe/stream_parser.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

// One generated token's log probability and its top alternatives, as the engine reported them.
struct TokenLogprob {
  TokenId token_id = 0;
  float logprob = 0.0f;  // natural log; -inf allowed (written as -9999.0)
};
struct TokenLogprobs {
  TokenId token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
};

// How generation ended, and the token counts the usage objects report.
struct FinishInfo {
  enum class Kind { kStop, kStopString, kLength };
  Kind kind = Kind::kStop;
  std::optional<std::string> stop_string;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t reasoning_tokens = 0;  // of completion_tokens, those of the reasoning block (OutputBuilder)
};

// The identity a response carries. `created` in Unix seconds (Anthropic's message has none).
struct ResponseIdentity {
  std::string id;
  std::string model;
  int64_t created = 0;
};

// An error to report to a client, in a dialect's shape. `status` picks the error type (400
// invalid_request_error, 404 not_found_error, 429 rate_limit_error, 5xx server/api errors, ...).
struct ErrorInfo {
  int status = 400;
  std::string message;  // invalid UTF-8 is written as U+FFFD
  std::string param;    // the request field to blame; empty: none (OpenAI writes null)
  std::string code;     // OpenAI's machine-readable code; empty: null
};
enum class ErrorDialect { kOpenAI, kAnthropic };
// OpenAI {"error": {"message", "type", "param", "code"}}; Anthropic {"type": "error", "error": {"type",
// "message"}}.
boost::json::object error_object(const ErrorInfo& error, ErrorDialect dialect);

// One piece of a streamed response. `event` is the SSE event name (empty for OpenAI's data-only lines);
// `done` marks OpenAI's terminal "[DONE]" line (then `data` is unused).
struct StreamChunk {
  std::string event;
  boost::json::object data;
  bool done = false;
};
// The SSE bytes of one chunk: "event: E\ndata: {json}\n\n", "data: {json}\n\n" or "data: [DONE]\n\n".
std::string sse_frame(const StreamChunk& chunk);
std::string sse_frames(std::span<const StreamChunk> chunks);

// Builds one response. Streaming: start() once, deltas() per batch of events, then finish() (or
// stream_error()). Non-streaming: only response(). Deltas must be what an OutputBuilder emitted, and
// finish()/response() take that builder's message(). Logprob vectors are consumed (cleared). Not
// thread-safe: one per response.
class ResponseBuilder {
 public:
  virtual ~ResponseBuilder() = default;
  // The opening chunks. `usage_so_far`: the prompt's token counts (Anthropic's message_start reports them).
  virtual void start(const FinishInfo& usage_so_far, std::vector<StreamChunk>& out) = 0;
  virtual void deltas(std::span<const StreamEvent> events, std::vector<TokenLogprobs>& logprobs,
                      std::vector<StreamChunk>& out) = 0;
  // The closing chunks: finish reason, usage, and the dialect's terminal event.
  virtual void finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>& logprobs,
                      std::vector<StreamChunk>& out) = 0;
  // The whole non-streamed response.
  virtual boost::json::object response(const OutputMessage& message, const FinishInfo& info,
                                       std::vector<TokenLogprobs>& logprobs) = 0;
  // An error after the stream started (the HTTP status is already 200).
  virtual void stream_error(const ErrorInfo& error, std::vector<StreamChunk>& out) = 0;
};

// OpenAI Chat Completions. `include_usage`: stream_options.include_usage (every chunk then carries
// "usage": null, and a last chunk the usage). `logprobs`: write the logprobs passed in (the tokenizer decodes
// their tokens; it may be null when `logprobs` is false).
std::unique_ptr<ResponseBuilder> chat_completion_builder(ResponseIdentity identity, bool include_usage, bool logprobs,
                                                         std::shared_ptr<const Tokenizer> tokenizer);
// OpenAI (legacy) Completions: the text is the deltas' text; logprobs in the parallel-array shape.
std::unique_ptr<ResponseBuilder> completion_builder(ResponseIdentity identity, bool include_usage, bool logprobs,
                                                    std::shared_ptr<const Tokenizer> tokenizer);
// Anthropic Messages.
std::unique_ptr<ResponseBuilder> messages_builder(ResponseIdentity identity);
// OpenAI Responses. `echo`: request fields the response object repeats (responses_request.h:
// responses_echo()).
std::unique_ptr<ResponseBuilder> responses_builder(ResponseIdentity identity, boost::json::object echo);

// Helpers the builders and their callers share.
// prefix + 24 hex digits from a per-thread random generator ("chatcmpl-", "msg_", "resp_", ...).
std::string random_id(std::string_view prefix);
int64_t unix_time();  // seconds
// JSON text as clients and other servers write it: boost::json::serialize, except doubles in their shortest
// round-trip form in plain notation where that is short ("-0.5", "0.001", "1e-07", "12.0" for a whole number;
// boost::json writes "-5E-1"); integers as integers.
std::string to_json_text(const boost::json::value& value);

}  // namespace deepinfer::recipe
