// What every dialect shares: error bodies, the guarded body parser, typed field readers, context checks.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include "deepinfer/server/api.h"

namespace deepinfer::server {
namespace json = boost::json;

// ---- Errors ---------------------------------------------------------------------------------------------

ApiError bad_request(std::string message, std::string param) {
  return ApiError{400, std::move(message), std::move(param), {}, 0};
}

ApiError bad_request_from(const Status& status) {
  if (status.code() != StatusCode::kInvalidArgument && status.code() != StatusCode::kUnsupported &&
      status.code() != StatusCode::kNotFound) {
    return ApiError{500, "internal server error", {}, {}, 0};
  }
  // Recipe's messages start with the field path: "messages[2].content is required ...".
  const std::string& message = status.message();
  std::string first = message.substr(0, message.find(' '));
  if (first.ends_with(':')) first.pop_back();
  // The top-level fields of every dialect's recipe conversion (Responses: input, instructions, reasoning, text).
  static constexpr std::string_view kTopLevel[] = {"messages",
                                                   "tools",
                                                   "tool_choice",
                                                   "reasoning_effort",
                                                   "thinking",
                                                   "chat_template_kwargs",
                                                   "response_format",
                                                   "add_generation_prompt",
                                                   "system",
                                                   "input",
                                                   "instructions",
                                                   "reasoning",
                                                   "text",
                                                   "parallel_tool_calls"};
  const bool path_like = first.find_first_of(".[") != std::string::npos ||
                         std::find(std::begin(kTopLevel), std::end(kTopLevel), first) != std::end(kTopLevel);
  const bool path_chars = std::all_of(first.begin(), first.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '[' || c == ']';
  });
  return bad_request(message, path_like && path_chars ? first : std::string());
}

ApiError bad_request_from(const Status& status, std::span<const FieldRename> renames) {
  ApiError error = bad_request_from(status);
  for (const FieldRename& rename : renames) {
    if (!error.message.starts_with(rename.from)) continue;
    error.message = std::string(rename.to) + error.message.substr(rename.from.size());
    if (error.param.starts_with(rename.from)) error.param = std::string(rename.to) + error.param.substr(rename.from.size());
    break;
  }
  return error;
}

Result<recipe::RenderedPrompt> render_chat_prompt(recipe::Conversation& conversation, const ApiContext& context) {
  conversation.options.v4_revision = context.v4_revision;
  // The prompt's new runs enter the shared tokenization cache only when the prompt fits the model: a prompt that
  // is refused for its length never evicts other conversations' entries.
  recipe::TokenizationCache::PendingInserts pending;
  Result<recipe::RenderedPrompt> prompt = recipe::render_and_tokenize(
      conversation, context.chat_format, *context.tokenizer, context.tokenization_cache, &pending);
  if (prompt.ok() && context.tokenization_cache != nullptr &&
      static_cast<int64_t>(prompt->token_ids.size()) < context.model->max_model_len) {
    context.tokenization_cache->commit(pending);
  }
  return prompt;
}

void add_turn_marker_stops(const ApiContext& context, engine::SamplingParams& params) {
  if (params.ignore_eos) return;
  for (recipe::TokenId id : recipe::turn_marker_ids(*context.tokenizer, context.chat_format)) {
    params.stop_token_ids.push_back(id);
  }
}

double float_for_json(float value) {
  char buffer[32];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  if (ec != std::errc()) return value;
  return std::strtod(std::string(buffer, end).c_str(), nullptr);
}

namespace {

// Offset of the first byte that does not belong to well-formed UTF-8 (Unicode 15, Table 3-7), or npos.
size_t find_invalid_utf8(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t size = text.size();
  size_t i = 0;
  while (i < size) {
    const unsigned char lead = bytes[i];
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead == 0xE0) {
      length = 3, low = 0xA0;
    } else if (lead == 0xED) {
      length = 3, high = 0x9F;
    } else if (lead >= 0xE1 && lead <= 0xEF) {
      length = 3;
    } else if (lead == 0xF0) {
      length = 4, low = 0x90;
    } else if (lead >= 0xF1 && lead <= 0xF3) {
      length = 4;
    } else if (lead == 0xF4) {
      length = 4, high = 0x8F;
    } else {
      return i;
    }
    if (i + length > size) return i;
    if (bytes[i + 1] < low || bytes[i + 1] > high) return i;
    for (size_t k = 2; k < length; ++k) {
      if (bytes[i + k] < 0x80 || bytes[i + k] > 0xBF) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

std::string kind_name(const json::value& v) {
  switch (v.kind()) {
    case json::kind::null:
      return "null";
    case json::kind::bool_:
      return "a boolean";
    case json::kind::int64:
    case json::kind::uint64:
    case json::kind::double_:
      return "a number";
    case json::kind::string:
      return "a string";
    case json::kind::array:
      return "an array";
    case json::kind::object:
      return "an object";
  }
  return "unknown";
}

ApiError type_error(std::string_view key, std::string_view expected, const json::value& got) {
  return bad_request(fmt::format("{} must be {}, got {}", key, expected, kind_name(got)), std::string(key));
}

// A present, non-null field, or nullptr.
const json::value* field(const json::object& body, std::string_view key) {
  const json::value* value = body.if_contains(key);
  return value == nullptr || value->is_null() ? nullptr : value;
}

}  // namespace

std::string error_body(const ApiError& error, Dialect dialect) {
  return to_json_text(recipe::error_object(
      {error.status, error.message, error.param, error.code},
      dialect == Dialect::kAnthropic ? recipe::ErrorDialect::kAnthropic : recipe::ErrorDialect::kOpenAI));
}

// ---- Request JSON ---------------------------------------------------------------------------------------

ApiResult<json::value> parse_body(std::string_view body, int32_t max_depth) {
  if (size_t bad = find_invalid_utf8(body); bad != std::string_view::npos) {
    return bad_request(fmt::format("the request body is not valid UTF-8 (first invalid byte at offset {})", bad));
  }
  json::parse_options options;
  options.max_depth = static_cast<size_t>(std::max(1, max_depth));
  json::stream_parser parser(json::storage_ptr(), options);
  boost::system::error_code ec;
  const size_t consumed = parser.write(body.data(), body.size(), ec);
  if (!ec) parser.finish(ec);
  if (ec) {
    if (ec == json::error::too_deep) {
      return bad_request(
          fmt::format("the request JSON nests deeper than {} levels (the server's --max-json-depth)", max_depth));
    }
    const size_t at = std::min(consumed, body.size());
    const std::string_view before = body.substr(0, at);
    const size_t line = static_cast<size_t>(std::count(before.begin(), before.end(), '\n')) + 1;
    const size_t line_start = before.rfind('\n');
    const size_t column = at - (line_start == std::string_view::npos ? 0 : line_start + 1) + 1;
    if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) {
      return bad_request("the request body is empty; expected a JSON object");
    }
    return bad_request(
        fmt::format("the request body is not valid JSON: {} at line {}, column {}", ec.message(), line, column));
  }
  json::value value = parser.release();
  if (!value.is_object()) return bad_request("the request body must be a JSON object, got " + kind_name(value));
  return value;
}

std::optional<ApiError> read_bool(const json::object& body, std::string_view key, std::optional<bool>& out) {
  const json::value* value = field(body, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_bool()) return type_error(key, "a boolean", *value);
  out = value->get_bool();
  return std::nullopt;
}

std::optional<ApiError> read_string(const json::object& body, std::string_view key, std::optional<std::string>& out) {
  const json::value* value = field(body, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) return type_error(key, "a string", *value);
  out = std::string(value->get_string());
  return std::nullopt;
}

std::optional<ApiError> read_integer(const json::object& body, std::string_view key, int64_t min, int64_t max,
                                     std::optional<int64_t>& out) {
  const json::value* value = field(body, key);
  if (value == nullptr) return std::nullopt;
  int64_t number = 0;
  bool in_range = true;
  if (value->is_int64()) {
    number = value->get_int64();
  } else if (value->is_uint64()) {
    in_range = false;  // above INT64_MAX
  } else if (value->is_double() && std::isfinite(value->get_double()) &&
             value->get_double() == std::floor(value->get_double())) {
    const double d = value->get_double();
    if (d < -9.2e18 || d > 9.2e18) {
      in_range = false;
    } else {
      number = static_cast<int64_t>(d);
    }
  } else {
    return type_error(key, "an integer", *value);
  }
  if (!in_range || number < min || number > max) {
    std::string range =
        max == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", min) : fmt::format("in [{}, {}]", min, max);
    return bad_request(fmt::format("{} must be an integer {}, got {}", key, range, to_json_text(*value)),
                       std::string(key));
  }
  out = number;
  return std::nullopt;
}

std::optional<ApiError> read_number(const json::object& body, std::string_view key, double min, double max,
                                    bool min_exclusive, std::optional<double>& out) {
  const json::value* value = field(body, key);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) return type_error(key, "a number", *value);
  const double number = value->to_number<double>();
  if (!(min_exclusive ? number > min : number >= min) || !(number <= max)) {
    return bad_request(fmt::format("{} must be in {}{}, {}], got {}", key, min_exclusive ? "(" : "[", min, max,
                                   to_json_text(*value)),
                       std::string(key));
  }
  // The engine keeps these as 32-bit floats: a value above an exclusive bound that rounds onto it is out of range.
  if (min_exclusive && !(static_cast<double>(static_cast<float>(number)) > min)) {
    return bad_request(fmt::format("{} must be in ({}, {}], got {} (which rounds to {} as a 32-bit float)", key, min,
                                   max, to_json_text(*value), static_cast<float>(number)),
                       std::string(key));
  }
  out = number;
  return std::nullopt;
}

std::optional<ApiError> read_string_list(const json::object& body, std::string_view key,
                                         std::vector<std::string>& out) {
  constexpr size_t kMaxStops = 64;
  const json::value* value = field(body, key);
  if (value == nullptr) return std::nullopt;
  if (value->is_string()) {
    if (!value->get_string().empty()) out.emplace_back(value->get_string());
    return std::nullopt;
  }
  if (!value->is_array()) return type_error(key, "a string or an array of strings", *value);
  const json::array& list = value->get_array();
  if (list.size() > kMaxStops) {
    return bad_request(fmt::format("{} has {} entries; at most {} are allowed", key, list.size(), kMaxStops),
                       std::string(key));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string() || list[i].get_string().empty()) {
      return bad_request(fmt::format("{}[{}] must be a non-empty string", key, i), std::string(key));
    }
    out.emplace_back(list[i].get_string());
  }
  return std::nullopt;
}

// ---- Context checks -------------------------------------------------------------------------------------

std::optional<ApiError> check_model(const json::object& body, const ModelInfo& model, bool required) {
  const json::value* value = field(body, "model");
  if (value == nullptr) {
    if (!required) return std::nullopt;
    return bad_request("model is required", "model");
  }
  if (!value->is_string()) return type_error("model", "a string", *value);
  if (value->get_string() == model.served_model_name) return std::nullopt;
  return ApiError{404,
                  fmt::format("The model `{}` does not exist; this server serves `{}`",
                              std::string(value->get_string()), model.served_model_name),
                  "model", "model_not_found", 0};
}

std::optional<ApiError> refuse_return_token_ids(const json::object& body, std::string_view endpoint) {
  const json::value* ids = body.if_contains("return_token_ids");
  if (ids == nullptr || ids->is_null() || (ids->is_bool() && !ids->get_bool())) return std::nullopt;
  return bad_request(fmt::format("return_token_ids is vLLM's extension of /v1/chat/completions and /v1/completions; "
                                 "{} does not return token ids",
                                 endpoint),
                     "return_token_ids");
}

std::optional<ApiError> read_stream_flags(const json::object& body, bool& stream, bool* include_usage) {
  std::optional<bool> flag;
  if (auto e = read_bool(body, "stream", flag)) return e;
  stream = flag.value_or(false);
  const json::value* options = body.if_contains("stream_options");
  if (options == nullptr || options->is_null()) return std::nullopt;
  if (!stream) return bad_request("stream_options is only allowed with stream: true", "stream_options");
  if (!options->is_object()) return bad_request("stream_options must be an object", "stream_options");
  for (const auto& [key, value] : options->get_object()) {
    if (std::string_view(key) == "include_obfuscation") {  // OpenAI's padding of stream events: none is sent
      if (!value.is_bool() && !value.is_null())
        return bad_request("stream_options.include_obfuscation must be a boolean",
                           "stream_options.include_obfuscation");
    } else if (include_usage == nullptr || std::string_view(key) != "include_usage") {
      return bad_request(include_usage != nullptr
                             ? fmt::format("stream_options.{} is not supported; only stream_options.include_usage "
                                           "(and include_obfuscation, which changes nothing here) are",
                                           std::string_view(key))
                             : fmt::format("stream_options.{} is not supported; this endpoint's stream_options takes "
                                           "only include_obfuscation (a boolean, which changes nothing here)",
                                           std::string_view(key)),
                         "stream_options." + std::string(key));
    }
  }
  if (include_usage == nullptr) return std::nullopt;
  std::optional<bool> usage;
  if (auto e = read_bool(options->get_object(), "include_usage", usage)) {
    e->message = "stream_options." + e->message;
    e->param = "stream_options.include_usage";
    return e;
  }
  *include_usage = usage.value_or(false);
  return std::nullopt;
}

std::optional<ApiError> read_openai_bookkeeping(const json::object& body) {
  std::optional<bool> store;
  if (auto e = read_bool(body, "store", store)) return e;
  if (const json::value* metadata = present(body, "metadata"); metadata != nullptr) {
    if (!metadata->is_object()) return bad_request("metadata must be an object of strings", "metadata");
    for (const auto& [key, value] : metadata->get_object()) {
      if (!value.is_string())
        return bad_request("metadata." + std::string(key) + " must be a string", "metadata." + std::string(key));
    }
  }
  std::optional<std::string> text;
  for (std::string_view field : {"prompt_cache_key", "safety_identifier"}) {
    if (auto e = read_string(body, field, text)) return e;
  }
  text.reset();
  if (auto e = read_string(body, "service_tier", text)) return e;
  if (text && *text != "auto" && *text != "default") {
    return bad_request("service_tier \"" + *text +
                           "\" is not available: this server has one tier (\"auto\" or "
                           "\"default\")",
                       "service_tier");
  }
  text.reset();
  if (auto e = read_string(body, "prompt_cache_retention", text)) return e;
  if (text && *text != "in-memory" && *text != "24h") {
    return bad_request(
        "prompt_cache_retention must be \"in-memory\" or \"24h\" (the KV tiers keep blocks for "
        "--kv-cache-ttl-hours either way)",
        "prompt_cache_retention");
  }
  return std::nullopt;
}

std::optional<ApiError> refuse_images(const recipe::Conversation& conversation, std::string_view messages_field) {
  for (size_t i = 0; i < conversation.messages.size(); ++i) {
    if (!conversation.messages[i].has_images()) continue;
    return bad_request(fmt::format("image input is not supported: the prompt format renders an image as its "
                                   "placeholder token, but DeepInfer does not run DeepSeek-V4.1's vision encoder, "
                                   "so the model would not see the image; send text only ({} holds an image)",
                                   messages_field),
                       std::string(messages_field));
  }
  return std::nullopt;
}

std::optional<ApiError> refuse_fields(const json::object& body, std::span<const RefusedField> fields) {
  for (const RefusedField& refused : fields) {
    if (present(body, refused.name) != nullptr) return bad_request(refused.message, refused.name);
  }
  return std::nullopt;
}

std::optional<ApiError> refuse_unknown_fields(const json::object& body, std::span<const std::string_view> known,
                                              Dialect dialect, std::span<const std::string_view> also) {
  for (const auto& [key, value] : body) {
    if (value.is_null()) continue;  // null is absent, as every field reader takes it (present())
    const std::string_view field = key;  // a plain variable: clang (the fuzz build) cannot capture a binding
    const auto is_key = [field](std::string_view name) { return name == field; };
    if (std::any_of(known.begin(), known.end(), is_key) || std::any_of(also.begin(), also.end(), is_key)) continue;
    // The name as sent, up to 256 bytes (a 100 KB key came back whole in the message and the param).
    constexpr size_t kMaxEcho = 256;
    const std::string shown =
        field.size() <= kMaxEcho ? std::string(field) : std::string(field.substr(0, kMaxEcho)) + "...";
    if (dialect == Dialect::kAnthropic) {
      return bad_request(fmt::format("{}: Extra inputs are not permitted", shown), shown);
    }
    return bad_request(fmt::format("Unrecognized request argument supplied: {}", shown), shown);
  }
  return std::nullopt;
}

namespace {
constexpr std::string_view kSamplingFieldNames[] = {
    "temperature",    "top_p",     "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "top_k",          "seed",      "n",     "min_tokens",       "ignore_eos",        "stop",
    "stop_token_ids", "logit_bias"};
}  // namespace
const std::span<const std::string_view> kOpenAISamplingFields = kSamplingFieldNames;

std::optional<ApiError> refuse_unopened_tool_choice(const recipe::Conversation& conversation,
                                                    const recipe::RenderedPrompt& prompt) {
  const recipe::ToolChoice& choice = conversation.tool_choice;
  if (choice.mode == recipe::ToolChoice::Mode::kAuto || prompt.opens_tool_calls) return std::nullopt;
  return bad_request(fmt::format("tool_choice {} needs the answer to start after the generation prompt, but this "
                                 "conversation ends with an assistant message that the answer would continue (or "
                                 "add_generation_prompt is false); use \"auto\" or end with a user or tool message",
                                 choice.mode == recipe::ToolChoice::Mode::kRequired
                                     ? std::string("requiring a tool call")
                                     : "naming the function '" + choice.name + "'"),
                     "tool_choice");
}

// thinking.budget_tokens (the recipe validated it: a positive integer with thinking on; Anthropic's: at least 1,024)
// is enforced: after that many reasoning tokens the next token is `</think>` (SamplingParams::reasoning_budget).
// Anthropic's rule that max_tokens exceed it is kept on every route.
std::optional<ApiError> apply_thinking_budget(int64_t max_tokens, std::string_view max_tokens_field,
                                              const recipe::Conversation& conversation,
                                              const recipe::StreamParserOptions& options, const ApiContext& context,
                                              engine::SamplingParams& params) {
  const std::optional<int64_t>& budget = conversation.options.thinking_budget_tokens;
  if (!conversation.options.thinking || !budget) return std::nullopt;
  if (*budget >= max_tokens) {
    return bad_request(std::string(max_tokens_field) + " must be greater than thinking.budget_tokens (" +
                           std::string(max_tokens_field) + " " + std::to_string(max_tokens) + ", budget_tokens " +
                           std::to_string(*budget) + ")",
                       std::string(max_tokens_field));
  }
  // Where the format does not open reasoning for this turn (V3.1 after a tool result: the answer goes on without
  // thinking), there is no reasoning to budget.
  if (!options.starts_in_reasoning) return std::nullopt;
  std::vector<recipe::TokenId> ends =
      recipe::reasoning_end_ids(*context.tokenizer, context.chat_format, options.tools_enabled);
  if (ends.empty()) {
    return bad_request("thinking.budget_tokens cannot be enforced with this tokenizer: `</think>` is not one token",
                       "thinking.budget_tokens");
  }
  params.reasoning_budget = *budget;
  params.reasoning_end_token_ids = std::move(ends);
  return std::nullopt;
}

std::optional<ApiError> fit_context(const ApiContext& context, int64_t prompt_tokens, std::optional<int64_t> requested,
                                    std::string_view max_tokens_field, engine::SamplingParams& params) {
  const int64_t max_model_len = context.model->max_model_len;
  if (prompt_tokens >= max_model_len) {
    return ApiError{400,
                    fmt::format("the prompt has {} tokens, but this model's max_model_len is {} tokens (prompt plus "
                                "generated tokens); shorten the prompt to at most {} tokens",
                                prompt_tokens, max_model_len, max_model_len - 1),
                    {},
                    "context_length_exceeded",
                    0};
  }
  const int64_t room = max_model_len - prompt_tokens;
  if (requested) {
    if (*requested > room) {
      // The real total (saturated: max_tokens may be near INT64_MAX).
      const int64_t total = *requested > std::numeric_limits<int64_t>::max() - prompt_tokens
                                ? std::numeric_limits<int64_t>::max()
                                : prompt_tokens + *requested;
      return ApiError{400,
                      fmt::format("this model's max_model_len is {} tokens, but the request asks for {} ({} in the "
                                  "prompt, {} in {}); lower {} to at most {}",
                                  max_model_len, total, prompt_tokens, *requested, max_tokens_field,
                                  max_tokens_field, room),
                      std::string(max_tokens_field), "context_length_exceeded", 0};
    }
    params.max_tokens = *requested;
  } else {
    params.max_tokens = context.default_max_tokens > 0 ? std::min(context.default_max_tokens, room) : room;
  }
  return std::nullopt;
}

std::optional<ApiError> read_openai_sampling(const json::object& body, const ApiContext& context,
                                             engine::SamplingParams& params, std::vector<std::string>& stops) {
  const int64_t vocab = context.model->vocab_size;
  std::optional<double> number;
  if (auto e = read_number(body, "temperature", 0.0, 2.0, false, number)) return e;
  if (number) params.temperature = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "top_p", 0.0, 1.0, true, number)) return e;
  if (number) params.top_p = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "min_p", 0.0, 1.0, false, number)) return e;
  if (number) params.min_p = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "presence_penalty", -2.0, 2.0, false, number)) return e;
  if (number) params.presence_penalty = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "frequency_penalty", -2.0, 2.0, false, number)) return e;
  if (number) params.frequency_penalty = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "repetition_penalty", 0.0, 100.0, true, number)) return e;
  if (number) params.repetition_penalty = static_cast<float>(*number);
  std::optional<int64_t> integer;
  if (auto e = read_integer(body, "top_k", -1, vocab, integer)) return e;
  if (integer) params.top_k = static_cast<int32_t>(*integer);
  integer.reset();
  if (const json::value* seed = field(body, "seed")) {
    if (seed->is_int64()) {
      params.seed = static_cast<uint64_t>(seed->get_int64());
    } else if (seed->is_uint64()) {
      params.seed = seed->get_uint64();
    } else if (seed->is_double() && std::isfinite(seed->get_double()) &&
               seed->get_double() == std::floor(seed->get_double())) {
      // A whole number written as a double (42.0), as the other integer fields take it; past 64 bits a range error,
      // not a type error (a break-it pass: 2^64 was "must be an integer" while 2^63 was taken).
      const double d = seed->get_double();
      if (d < -9.2e18 || d >= 18446744073709551616.0) {
        return bad_request(fmt::format("seed must be an integer from -2^63 to 2^64 - 1, got {}", to_json_text(*seed)),
                           "seed");
      }
      params.seed = d < 0 ? static_cast<uint64_t>(static_cast<int64_t>(d)) : static_cast<uint64_t>(d);
    } else {
      return type_error("seed", "an integer", *seed);
    }
  }
  if (auto e = read_integer(body, "n", 1, 128, integer)) return e;
  if (integer && *integer > 1) {
    return bad_request(fmt::format("n = {} is not supported yet; send n = 1 (or several requests)", *integer), "n");
  }
  integer.reset();
  if (auto e = read_integer(body, "min_tokens", 0, std::numeric_limits<int64_t>::max(), integer)) return e;
  if (integer && *integer > 0) return bad_request("min_tokens is not supported yet", "min_tokens");
  std::optional<bool> flag;
  if (auto e = read_bool(body, "ignore_eos", flag)) return e;
  params.ignore_eos = flag.value_or(false);
  if (auto e = read_string_list(body, "stop", stops)) return e;
  if (const json::value* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) return type_error("stop_token_ids", "an array of token ids", *ids);
    const json::array& list = ids->get_array();
    for (size_t i = 0; i < list.size(); ++i) {
      if (!list[i].is_int64() || list[i].get_int64() < 0 || list[i].get_int64() >= vocab) {
        return bad_request(fmt::format("stop_token_ids[{}] must be a token id in [0, {})", i, vocab), "stop_token_ids");
      }
      params.stop_token_ids.push_back(static_cast<engine::TokenId>(list[i].get_int64()));
    }
  }
  if (const json::value* bias = field(body, "logit_bias")) {
    if (!bias->is_object()) return type_error("logit_bias", "an object of token id -> bias", *bias);
    for (const auto& [key, value] : bias->get_object()) {
      int64_t id = -1;
      auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id >= vocab) {
        return bad_request(fmt::format("logit_bias key '{}' must be a token id in [0, {})", std::string(key), vocab),
                           "logit_bias");
      }
      if (!value.is_number() || !(std::abs(value.to_number<double>()) <= engine::kMaxLogitBias)) {
        return bad_request(fmt::format("logit_bias['{}'] must be a number in [-100, 100]", std::string(key)),
                           "logit_bias");
      }
      params.logit_bias[static_cast<engine::TokenId>(id)] = static_cast<float>(value.to_number<double>());
    }
  }
  return std::nullopt;
}

// ---- Helpers --------------------------------------------------------------------------------------------

TokenLogprobs token_logprobs(recipe::TokenId token, float logprob, const std::vector<engine::TokenLogprob>& top) {
  TokenLogprobs out{token, logprob, {}};
  out.top.reserve(top.size());
  for (const engine::TokenLogprob& alternative : top) out.top.push_back({alternative.token_id, alternative.logprob});
  return out;
}

ResponseWriter::ResponseWriter(std::unique_ptr<recipe::ResponseBuilder> builder, bool stream)
    : builder_(std::move(builder)), stream_(stream) {}

std::string ResponseWriter::frames() {
  std::string out = recipe::sse_frames(chunks_);
  chunks_.clear();
  return out;
}

void ResponseWriter::return_token_ids(std::vector<recipe::TokenId> prompt_token_ids, PromptIdsAt where) {
  token_ids_ = true;
  prompt_ids_at_ = where;
  prompt_ids_ = std::move(prompt_token_ids);
}

namespace {

json::array id_array(std::span<const recipe::TokenId> ids) {
  json::array out;
  out.reserve(ids.size());
  for (recipe::TokenId id : ids) out.emplace_back(id);
  return out;
}

// The first choice of a response or chunk object, or null when it has none.
json::object* first_choice(json::object& object) {
  json::value* choices = object.if_contains("choices");
  if (choices == nullptr || !choices->is_array() || choices->get_array().empty()) return nullptr;
  return choices->get_array()[0].if_object();
}

}  // namespace

void ResponseWriter::attach_ids(std::span<recipe::StreamChunk> chunks, bool generated) {
  if (!token_ids_) return;
  // The prompt's ids go on the first chunk with a choice; the pending generated ids on the last one, except on the
  // opening (role) chunk, which carries no text: they wait for the chunk with their text (a new user's pass found
  // the first token's id one chunk ahead of it).
  recipe::StreamChunk* first = nullptr;
  recipe::StreamChunk* last = nullptr;
  for (recipe::StreamChunk& chunk : chunks) {
    if (chunk.done || first_choice(chunk.data) == nullptr) continue;
    if (first == nullptr) first = &chunk;
    last = &chunk;
  }
  if (first == nullptr) return;
  if (prompt_ids_) {
    json::object& target = prompt_ids_at_ == PromptIdsAt::kTopLevel ? first->data : *first_choice(first->data);
    target["prompt_token_ids"] = id_array(*prompt_ids_);
    prompt_ids_.reset();
  }
  if (!generated) return;
  (*first_choice(last->data))["token_ids"] = id_array(pending_ids_);
  pending_ids_.clear();
}

std::string ResponseWriter::start(const FinishInfo& usage_so_far) {
  builder_->start(usage_so_far, chunks_);
  attach_ids(chunks_, false);
  return frames();
}

std::string ResponseWriter::deltas(const std::vector<recipe::StreamEvent>& events,
                                   std::vector<TokenLogprobs>& logprobs) {
  builder_->deltas(events, logprobs, chunks_);
  attach_ids(chunks_);
  return frames();
}

std::string ResponseWriter::finish(const OutputMessage& message, const FinishInfo& info,
                                   std::vector<TokenLogprobs>& logprobs) {
  if (!stream_) {
    json::object response = builder_->response(message, info, logprobs);
    if (token_ids_ && first_choice(response) != nullptr) {
      json::object& target = prompt_ids_at_ == PromptIdsAt::kTopLevel ? response : *first_choice(response);
      target["prompt_token_ids"] = id_array(prompt_ids_.value_or(std::vector<recipe::TokenId>{}));
      (*first_choice(response))["token_ids"] = id_array(pending_ids_);
    }
    return to_json_text(response);
  }
  builder_->finish(message, info, logprobs, chunks_);
  attach_ids(chunks_);
  return frames();
}

std::string ResponseWriter::stream_error(const ApiError& error) {
  builder_->stream_error({error.status, error.message, error.param, error.code}, chunks_);
  return frames();
}

json::object model_object(const ModelInfo& model, int64_t created) {
  json::object object{{"id", model.served_model_name},
                      {"object", "model"},
                      {"created", created},
                      {"owned_by", "deepinfer"},
                      {"root", model.served_model_name},  // never the checkpoint's path on this host
                      {"parent", nullptr},
                      {"max_model_len", model.max_model_len}};
  if (!model.description.empty()) object["description"] = model.description;
  return object;
}

std::string models_body(const ModelInfo& model, int64_t created) {
  return to_json_text(json::object{{"object", "list"}, {"data", json::array{model_object(model, created)}}});
}

const boost::json::value* present(const boost::json::object& object, std::string_view key) {
  const boost::json::value* value = object.if_contains(key);
  return value == nullptr || value->is_null() ? nullptr : value;
}

std::optional<ApiError> required_string(const boost::json::object& object, std::string_view key,
                                        const std::string& path, std::string& out) {
  const boost::json::value* value = present(object, key);
  if (value == nullptr || !value->is_string()) {
    return bad_request(fmt::format("{}.{} must be a string", path, key), path + "." + std::string(key));
  }
  out = value->get_string();
  return std::nullopt;
}

}  // namespace deepinfer::server
