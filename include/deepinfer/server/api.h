// What the HTTP layer (http_server.cpp) and the API dialects (openai_api.cpp,
// anthropic_api.cpp, responses_api.cpp) share. A dialect turns a request body into a GenerationPlan (prompt ids,
// sampling parameters, the recipe's OutputBuilder and a ResponseWriter over the recipe's response builder); the
// HTTP layer runs the plan against the engine. `deepinfer router` runs the same planning to know a request's
// prompt token ids exactly as its workers will (router.h).
#pragma once

#include <boost/json.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/sampling_params.h"
#include "deepinfer/recipe/output_builder.h"
#include "deepinfer/recipe/response_builder.h"
#include "deepinfer/recipe/stream_parser.h"
#include "deepinfer/recipe/tokenization_cache.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/server/metrics.h"
#include "deepinfer/server/server.h"

namespace deepinfer::server {

// ---- Errors ---------------------------------------------------------------------------------------------

// An error a client gets. Rendered per dialect: OpenAI {"error": {"message", "type", "param", "code"}},
// Anthropic {"type": "error", "error": {"type", "message"}}; the type follows from the status.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;            // the request field to blame, when there is one
  std::string code;             // OpenAI's machine-readable code ("model_not_found", "context_length_exceeded", ...)
  int retry_after_seconds = 0;  // > 0: sent as Retry-After
};

ApiError bad_request(std::string message, std::string param = {});
// A 400 from a recipe or engine Status whose message starts with the field path ("messages[1].content ...").
ApiError bad_request_from(const Status& status);
// The same, for a dialect whose fields are spelled differently from the Conversation's (the recipe names
// "thinking", "reasoning_effort", "messages[i]"...): a message or param starting with `from` starts with `to`
// instead, the first matching pair winning (e.g. Responses: {"messages[", "input["}, {"thinking", "reasoning"}).
struct FieldRename {
  std::string_view from;
  std::string_view to;
};
ApiError bad_request_from(const Status& status, std::span<const FieldRename> renames);

enum class Dialect { kOpenAI, kAnthropic };
std::string error_body(const ApiError& error, Dialect dialect);

template <class T>
using ApiResult = std::variant<T, ApiError>;

// ---- Request JSON ---------------------------------------------------------------------------------------

// Parses a request body: valid UTF-8 (else 400 naming the byte offset), JSON (else 400 with line and
// column), at most `max_depth` levels of nesting (else 400 naming the limit), a JSON object (else 400).
ApiResult<boost::json::value> parse_body(std::string_view body, int32_t max_depth);

// Typed field readers: absent or null leaves `out` unset and returns nullopt; a wrong type or a value out of
// range returns the 400 naming the field (and the range).
std::optional<ApiError> read_bool(const boost::json::object& body, std::string_view key, std::optional<bool>& out);
std::optional<ApiError> read_string(const boost::json::object& body, std::string_view key,
                                    std::optional<std::string>& out);
std::optional<ApiError> read_integer(const boost::json::object& body, std::string_view key, int64_t min, int64_t max,
                                     std::optional<int64_t>& out);
// [min, max]; with min_exclusive, (min, max].
std::optional<ApiError> read_number(const boost::json::object& body, std::string_view key, double min, double max,
                                    bool min_exclusive, std::optional<double>& out);
// A string or an array of strings (`stop`, `stop_sequences`).
std::optional<ApiError> read_string_list(const boost::json::object& body, std::string_view key,
                                         std::vector<std::string>& out);

// ---- Generation ---------------------------------------------------------------------------------------

struct ApiContext {
  const ModelInfo* model = nullptr;
  std::shared_ptr<const recipe::Tokenizer> tokenizer;
  // Shared by every request (internally synchronized); null: prompts are tokenized without a cache.
  recipe::TokenizationCache* tokenization_cache = nullptr;
  recipe::PromptFormat chat_format = recipe::PromptFormat::kDeepSeekV3;
  recipe::V4Revision v4_revision = recipe::V4Revision::k0731;  // set on every conversation before rendering
  int64_t default_max_tokens = 0;
};

// Checks a request's `model` against the served name: absent is fine, another name is a 404.
std::optional<ApiError> check_model(const boost::json::object& body, const ModelInfo& model, bool required);
// The 400 for vLLM's `return_token_ids` (anything but absent, null or false) on an endpoint that returns no ids.
std::optional<ApiError> refuse_return_token_ids(const boost::json::object& body, std::string_view endpoint);
// The stream flags of the OpenAI endpoints: `stream`, and `stream_options` (only with stream: true) holding
// `include_obfuscation` (type-checked; no padding is sent) and, where `include_usage` is not null (chat, completions;
// Responses has none), `include_usage`. Any other key is a 400 naming it.
std::optional<ApiError> read_stream_flags(const boost::json::object& body, bool& stream, bool* include_usage);
// OpenAI's bookkeeping fields, which change no output, type-checked (a wrong type or value is a 400 naming the
// field): `store` (bool; nothing is stored), `metadata` (object of strings), `service_tier` ("auto" or "default":
// one tier here), `prompt_cache_key`, `safety_identifier` (strings: the prefix cache is keyed by the prompt's
// content, so the key is not needed), `prompt_cache_retention` ("in-memory" or "24h": the KV tiers' TTLs apply,
// --kv-cache-ttl-hours). Chat Completions and Responses list these among their fields.
std::optional<ApiError> read_openai_bookkeeping(const boost::json::object& body);
// The 400 for image input on a generation endpoint: the prompt formats that take images (deepseek-v4.1) render a
// placeholder token, but DeepInfer does not run DeepSeek-V4.1's vision encoder, so the model would never see the
// image. `messages_field` names the request's message list ("messages", or "input" for Responses). /tokenize
// and count_tokens render images as the placeholder and are not refused.
std::optional<ApiError> refuse_images(const recipe::Conversation& conversation, std::string_view messages_field);
// The 400 for a forced tool_choice (required, a named function; Anthropic any, tool) that the prompt could not open
// the answer for: the conversation ends with an assistant message the answer continues, or add_generation_prompt is
// false (recipe::RenderedPrompt::opens_tool_calls is false then), so nothing would make the answer a call.
// A field the dialect defines but this server does not implement, where ignoring it would change the answer: the 400
// for the first of `fields` (name, message naming what to send instead) present in the body (and not null).
struct RefusedField {
  const char* name;
  const char* message;
};
std::optional<ApiError> refuse_fields(const boost::json::object& body, std::span<const RefusedField> fields);

// Every top-level field of a request must be one its endpoint reads: honoured, or refused by the endpoint's own
// check with a specific message. Any other field is refused as the dialect's own API does (OpenAI: "Unrecognized
// request argument supplied: NAME"; Anthropic: "NAME: Extra inputs are not permitted"), never accepted and then
// ignored (a break-it pass, 2026-12-07, found vLLM's and OpenAI's extras silently dropped). `known` and `also`
// (e.g. kOpenAISamplingFields) are the endpoint's fields.
std::optional<ApiError> refuse_unknown_fields(const boost::json::object& body, std::span<const std::string_view> known,
                                              Dialect dialect, std::span<const std::string_view> also = {});
// The fields read_openai_sampling reads (OpenAI's sampling fields and vLLM's extensions).
extern const std::span<const std::string_view> kOpenAISamplingFields;

std::optional<ApiError> refuse_unopened_tool_choice(const recipe::Conversation& conversation,
                                                    const recipe::RenderedPrompt& prompt);

// Enforces conversation.options.thinking_budget_tokens (when thinking is on) as the engine's reasoning budget:
// 400 unless max_tokens (named max_tokens_field in the message) exceeds it, or when `</think>` is not one token.
std::optional<ApiError> apply_thinking_budget(int64_t max_tokens, std::string_view max_tokens_field,
                                              const recipe::Conversation& conversation,
                                              const recipe::StreamParserOptions& options, const ApiContext& context,
                                              engine::SamplingParams& params);

// Fills max_tokens against the prompt length and max_model_len: 400 when the prompt does not leave room for
// one token or prompt + requested max_tokens exceed max_model_len (both numbers in the message).
std::optional<ApiError> fit_context(const ApiContext& context, int64_t prompt_tokens, std::optional<int64_t> requested,
                                    std::string_view max_tokens_field, engine::SamplingParams& params);

// The deltas a client may see (the parser or detokenizer, then stop strings) and the final message: the
// recipe's (output_builder.h), as the Python module runs them too.
using recipe::FinishInfo;
using recipe::OutputBuilder;
using recipe::OutputMessage;
using recipe::OutputToolCall;
using recipe::TokenLogprobs;

// One generated token's logprobs, as the engine reported them, in the recipe's shape.
TokenLogprobs token_logprobs(recipe::TokenId token, float logprob, const std::vector<engine::TokenLogprob>& top);

// A dialect's recipe::ResponseBuilder (response_builder.h) as the HTTP layer sends it: SSE bytes when
// streaming (start() once, deltas() per batch of events, then finish() or stream_error()), else only
// finish(), which returns the JSON body.
class ResponseWriter {
 public:
  ResponseWriter(std::unique_ptr<recipe::ResponseBuilder> builder, bool stream);
  std::string start(const FinishInfo& usage_so_far);
  std::string deltas(const std::vector<recipe::StreamEvent>& events, std::vector<TokenLogprobs>& logprobs);
  std::string finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>& logprobs);
  std::string stream_error(const ApiError& error);

  // vLLM's `return_token_ids` (OpenAI dialects): the prompt's ids as `prompt_token_ids` (top level of the chat
  // response and of its first chunk; in the choice for legacy completions) and the generated ids as the
  // choice's `token_ids` (streaming: each chunk's own, the ids of tokens whose text was held back going with the
  // next chunk). Call once, before start()/finish(); then push_token() for every generated token.
  enum class PromptIdsAt { kTopLevel, kChoice };
  void return_token_ids(std::vector<recipe::TokenId> prompt_token_ids, PromptIdsAt where);
  void push_token(recipe::TokenId token) {
    if (token_ids_) pending_ids_.push_back(token);
  }

 private:
  std::string frames();  // the SSE bytes of chunks_, which it clears
  void attach_ids(std::span<recipe::StreamChunk> chunks,
                  bool generated = true);  // the pending ids (and the prompt's, once) on a chunk

  std::unique_ptr<recipe::ResponseBuilder> builder_;
  bool stream_;
  std::vector<recipe::StreamChunk> chunks_;
  bool token_ids_ = false;
  PromptIdsAt prompt_ids_at_ = PromptIdsAt::kTopLevel;
  std::optional<std::vector<recipe::TokenId>> prompt_ids_;  // until written
  std::vector<recipe::TokenId> pending_ids_;                // generated, not yet written
};

struct GenerationPlan {
  Dialect dialect = Dialect::kOpenAI;
  std::vector<recipe::TokenId> prompt_token_ids;
  engine::SamplingParams params;
  bool stream = false;
  std::unique_ptr<OutputBuilder> builder;
  std::unique_ptr<ResponseWriter> writer;
};

// Each takes a body parse_body() accepted (a JSON object).
ApiResult<GenerationPlan> plan_chat_completion(const boost::json::value& body, const ApiContext& context);
ApiResult<GenerationPlan> plan_completion(const boost::json::value& body, const ApiContext& context);
ApiResult<GenerationPlan> plan_anthropic_messages(const boost::json::value& body, const ApiContext& context);
ApiResult<GenerationPlan> plan_responses(const boost::json::value& body, const ApiContext& context);  // /v1/responses

// /tokenize: {"prompt": TEXT, "add_special_tokens"?} or a chat request {"messages": [...], ...};
// /detokenize: {"tokens": [ids]}. Both return the JSON body.
ApiResult<std::string> tokenize_endpoint(const boost::json::value& body, const ApiContext& context);
ApiResult<std::string> detokenize_endpoint(const boost::json::value& body, const ApiContext& context);
// POST /v1/messages/count_tokens (Anthropic): the request's messages, system, tools and thinking rendered and
// tokenized exactly as /v1/messages would; {"input_tokens": N}. Errors as /v1/messages (Anthropic-shaped).
ApiResult<std::string> count_tokens_endpoint(const boost::json::value& body, const ApiContext& context);
// GET /v1/models and /v1/models/{id}.
std::string models_body(const ModelInfo& model, int64_t created);
boost::json::object model_object(const ModelInfo& model, int64_t created);

// Shared helpers of the dialects.
using recipe::random_id;  // prefix + 24 hex digits
using recipe::unix_time;
// The prompt ended inside a reasoning block (the generation prompt opened <think>).
using recipe::prompt_opens_reasoning;
// The sampling fields OpenAI's two endpoints share (temperature, top_p, top_k, min_p, penalties, seed, stop,
// stop_token_ids, ignore_eos, logit_bias, n).
std::optional<ApiError> read_openai_sampling(const boost::json::object& body, const ApiContext& context,
                                             engine::SamplingParams& params, std::vector<std::string>& stops);
// A float parameter as JSON: its shortest decimal form as a float (0.7f -> 0.7, not 0.699999988079071).
double float_for_json(float value);
// The server's prompt of a chat request: `conversation` with the server's deepseek-v4 revision, rendered in its
// chat format and tokenized through its tokenization cache (every dialect renders through this). The prompt's new
// runs are added to the cache only when it is shorter than max_model_len (a refused prompt leaves the cache as it was).
Result<recipe::RenderedPrompt> render_chat_prompt(recipe::Conversation& conversation, const ApiContext& context);
// Adds the chat format's turn markers to the stop tokens unless params.ignore_eos (stream_parser.h: the parser
// ends the answer at one, so generation stops there too).
void add_turn_marker_stops(const ApiContext& context, engine::SamplingParams& params);
// JSON text of a response body, numbers as clients expect them (response_builder.h).
using recipe::to_json_text;

// The value of `key` in `object`, or nullptr when it is absent or JSON null.
const boost::json::value* present(const boost::json::object& object, std::string_view key);
// Reads the required string field `key` of `object` (at JSON path `path`) into `out`; a 400 naming
// `path.key` when it is missing or not a string.
std::optional<ApiError> required_string(const boost::json::object& object, std::string_view key,
                                        const std::string& path, std::string& out);

}  // namespace deepinfer::server
