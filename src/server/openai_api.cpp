// OpenAI dialect: /v1/chat/completions and /v1/completions (request -> GenerationPlan; the response and chunk
// shapes are the recipe's, response_builder.h), /tokenize and /detokenize.
#include <algorithm>

#include <fmt/format.h>

#include "deepinfer/server/api.h"
#include "deepinfer/recipe/openai_request.h"

namespace deepinfer::server {
namespace json = boost::json;

namespace {

// Text prompt -> ids as Hugging Face encodes with add_special_tokens (the DeepSeek tokenizers prepend BOS).
std::vector<recipe::TokenId> encode_text_prompt(const ApiContext& context, std::string_view text,
                                                bool add_special_tokens) {
  std::vector<recipe::TokenId> ids;
  if (add_special_tokens) ids.push_back(static_cast<recipe::TokenId>(context.model->bos_token_id));
  context.tokenizer->encode(text, recipe::TextTrust::kTrusted, ids);
  if (add_special_tokens && ids.size() > 1 && ids[1] == ids[0]) ids.erase(ids.begin());  // the text had its own BOS
  return ids;
}

std::optional<ApiError> check_token_ids(const json::array& list, std::string_view field, const ApiContext& context,
                                        std::vector<recipe::TokenId>& ids) {
  const int64_t vocab = context.model->vocab_size;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_int64() || list[i].get_int64() < 0 || list[i].get_int64() >= vocab) {
      return bad_request(
          fmt::format("{}[{}] must be a token id in [0, {}), got {}", field, i, vocab, to_json_text(list[i])),
          std::string(field));
    }
    ids.push_back(static_cast<recipe::TokenId>(list[i].get_int64()));
  }
  return std::nullopt;
}

// `prompt`: a string, a list of token ids, or a one-element list of either.
std::optional<ApiError> read_completion_prompt(const json::object& body, const ApiContext& context,
                                               bool add_special_tokens, std::vector<recipe::TokenId>& ids) {
  const json::value* prompt = body.if_contains("prompt");
  if (prompt == nullptr || prompt->is_null()) return bad_request("prompt is required", "prompt");
  if (prompt->is_string()) {
    ids = encode_text_prompt(context, prompt->get_string(), add_special_tokens);
  } else if (prompt->is_array()) {
    const json::array& list = prompt->get_array();
    if (list.empty()) return bad_request("prompt must not be empty", "prompt");
    if (list[0].is_string() || list[0].is_array()) {
      if (list.size() > 1) {
        return bad_request(fmt::format("prompt holds {} prompts; batched prompts are not supported yet, send one "
                                       "prompt per request",
                                       list.size()),
                           "prompt");
      }
      if (list[0].is_string()) {
        ids = encode_text_prompt(context, list[0].get_string(), add_special_tokens);
      } else if (auto e = check_token_ids(list[0].get_array(), "prompt[0]", context, ids)) {
        return e;
      }
    } else if (auto e = check_token_ids(list, "prompt", context, ids)) {
      return e;
    }
  } else {
    return bad_request("prompt must be a string, an array of token ids, or a one-element array of either", "prompt");
  }
  if (ids.empty()) return bad_request("prompt has no tokens", "prompt");
  return std::nullopt;
}

// best_of and echo: the legacy completion fields, refused above their defaults on both OpenAI endpoints.
std::optional<ApiError> refuse_best_of_and_echo(const json::object& body) {
  std::optional<int64_t> best_of;
  if (auto e = read_integer(body, "best_of", 1, 128, best_of)) return e;
  if (best_of.value_or(1) > 1) return bad_request("best_of > 1 is not supported yet", "best_of");
  std::optional<bool> echo;
  if (auto e = read_bool(body, "echo", echo)) return e;
  if (echo.value_or(false)) return bad_request("echo is not supported yet", "echo");
  return std::nullopt;
}

// vLLM's guided decoding fields: refused on both OpenAI endpoints (there is no constrained decoding).
std::optional<ApiError> refuse_guided(const json::object& body) {
  for (const char* guided : {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}) {
    if (body.contains(guided)) {
      return bad_request(fmt::format("{} is not supported yet (no constrained decoding)", guided), guided);
    }
  }
  return std::nullopt;
}

}  // namespace

ApiResult<GenerationPlan> plan_chat_completion(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  Result<recipe::Conversation> conversation = recipe::conversation_from_openai_chat(request);
  if (!conversation.ok()) return bad_request_from(conversation.status());
  // A JSON response_format is honoured only where the prompt format describes it to the model (V3.2 and later);
  // render_prompt refuses it elsewhere (renderer.h). vLLM's guided_* extensions are refused everywhere.
  if (auto e = refuse_guided(body)) return *e;
  // Fields other OpenAI-style servers take that would change the answer and are not implemented here: refused
  // naming what to send instead, never accepted and ignored (a break-it pass, 2026-12-06, found them ignored).
  static constexpr RefusedField kRefused[] = {
      {"functions", "functions (the deprecated form of tools) is not supported; send tools"},
      {"function_call", "function_call (the deprecated form of tool_choice) is not supported; send tool_choice"},
      {"chat_template", "chat_template is not supported: the prompt is the model's own format (DeepSeek's renderer)"},
      {"web_search_options", "web_search_options is not supported (no built-in web search)"},
      {"audio", "audio output is not supported"},
      {"enable_thinking", "enable_thinking is not a top-level field; send chat_template_kwargs.enable_thinking, or "
                          "thinking"},
  };
  if (auto e = refuse_fields(body, kRefused)) return *e;
  static constexpr std::string_view kChatFields[] = {"model",
                                                     "messages",
                                                     "tools",
                                                     "tool_choice",
                                                     "parallel_tool_calls",
                                                     "reasoning_effort",
                                                     "thinking",
                                                     "chat_template_kwargs",
                                                     "response_format",
                                                     "add_generation_prompt",
                                                     "return_token_ids",
                                                     "best_of",
                                                     "echo",
                                                     "user",
                                                     "modalities",
                                                     "logprobs",
                                                     "top_logprobs",
                                                     "max_tokens",
                                                     "max_completion_tokens",
                                                     "stream",
                                                     "stream_options",
                                                     "store",
                                                     "metadata",
                                                     "service_tier",
                                                     "prompt_cache_key",
                                                     "safety_identifier",
                                                     "prompt_cache_retention"};
  if (auto e = refuse_unknown_fields(body, kChatFields, Dialect::kOpenAI, kOpenAISamplingFields)) return *e;
  if (auto e = read_openai_bookkeeping(body)) return *e;
  // parallel_tool_calls: read into the conversation (ToolChoice::parallel), honoured by the output builder below.
  std::optional<bool> return_token_ids;  // vLLM's extension (ResponseWriter::return_token_ids)
  if (auto e = read_bool(body, "return_token_ids", return_token_ids)) return *e;
  // Fields other servers take on chat: refused where they would change the answer, as /v1/completions does.
  if (auto e = refuse_best_of_and_echo(body)) return *e;
  std::optional<std::string> user;
  if (auto e = read_string(body, "user", user)) return *e;
  if (const json::value* modalities = body.if_contains("modalities"); modalities != nullptr && !modalities->is_null()) {
    const auto is_text = [](const json::value& m) { return m.is_string() && m.get_string() == "text"; };
    const bool text_only = modalities->is_array() && !modalities->get_array().empty() &&
                           std::all_of(modalities->get_array().begin(), modalities->get_array().end(), is_text);
    if (!text_only) return bad_request("modalities: only [\"text\"] is supported (no audio output)", "modalities");
  }

  GenerationPlan plan;
  std::vector<std::string> stops;
  if (auto e = read_openai_sampling(body, context, plan.params, stops)) return *e;
  std::optional<bool> logprobs;
  if (auto e = read_bool(body, "logprobs", logprobs)) return *e;
  std::optional<int64_t> top_logprobs;
  if (auto e = read_integer(body, "top_logprobs", 0, engine::kMaxLogprobs, top_logprobs)) return *e;
  if (top_logprobs && !logprobs.value_or(false))
    return bad_request("top_logprobs needs logprobs: true", "top_logprobs");
  if (logprobs.value_or(false)) plan.params.logprobs = static_cast<int32_t>(top_logprobs.value_or(0));
  std::optional<int64_t> max_tokens, max_completion_tokens;
  if (auto e = read_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), max_tokens)) return *e;
  if (auto e =
          read_integer(body, "max_completion_tokens", 1, std::numeric_limits<int64_t>::max(), max_completion_tokens)) {
    return *e;
  }
  bool include_usage = false;
  if (auto e = read_stream_flags(body, plan.stream, &include_usage)) return *e;

  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(*conversation, context);
  if (!prompt.ok()) return bad_request_from(prompt.status());
  if (auto e = refuse_images(*conversation, "messages")) return *e;
  if (auto e = refuse_unopened_tool_choice(*conversation, *prompt)) return *e;
  const std::string_view max_field = max_completion_tokens ? "max_completion_tokens" : "max_tokens";
  if (auto e = fit_context(context, static_cast<int64_t>(prompt->token_ids.size()),
                           max_completion_tokens ? max_completion_tokens : max_tokens, max_field, plan.params)) {
    e->param = e->param.empty() ? "messages" : e->param;
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  add_turn_marker_stops(context, plan.params);
  // Where the answer starts (reasoning, a prefilled tool-call block) and what it may hold (tools, JSON).
  recipe::StreamParserOptions options = recipe::stream_parser_options(*conversation, *prompt);
  // fit_context filled max_tokens (the room left when the request gave none).
  if (auto e = apply_thinking_budget(plan.params.max_tokens.value_or(0), max_field, *conversation, options, context,
                                     plan.params)) {
    return *e;
  }
  plan.dialect = Dialect::kOpenAI;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  // A tool_choice naming a function: the answer begins with its call (RenderedPrompt::answer_prefix).
  plan.params.forced_output_prefix = std::move(prompt->answer_prefix_ids);
  // "required" with several tools: the call names one of them (RenderedPrompt::answer_prefix_choices).
  plan.params.forced_output_choices = std::move(prompt->answer_prefix_choice_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 context.tokenizer, std::move(stops));
  if (conversation->tool_choice.single_call()) plan.builder->set_max_tool_calls(1);
  plan.writer = std::make_unique<ResponseWriter>(
      recipe::chat_completion_builder({random_id("chatcmpl-"), context.model->served_model_name, unix_time()},
                                      include_usage, plan.params.logprobs.has_value(), context.tokenizer),
      plan.stream);
  if (return_token_ids.value_or(false)) {
    plan.writer->return_token_ids(plan.prompt_token_ids, ResponseWriter::PromptIdsAt::kTopLevel);
  }
  return plan;
}

ApiResult<GenerationPlan> plan_completion(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  if (auto e = refuse_guided(body)) return *e;
  static constexpr std::string_view kCompletionFields[] = {
      "model",          "prompt", "suffix",   "add_special_tokens", "return_token_ids",
      "best_of",        "echo",   "logprobs", "max_tokens",         "stream",
      "stream_options", "user"};
  if (auto e = refuse_unknown_fields(body, kCompletionFields, Dialect::kOpenAI, kOpenAISamplingFields)) return *e;
  if (auto e = refuse_best_of_and_echo(body)) return *e;
  std::optional<std::string> user;
  if (auto e = read_string(body, "user", user)) return *e;
  std::optional<bool> add_special_tokens;
  std::optional<std::string> suffix;
  if (auto e = read_string(body, "suffix", suffix)) return *e;
  if (suffix && !suffix->empty()) return bad_request("suffix is not supported", "suffix");
  if (auto e = read_bool(body, "add_special_tokens", add_special_tokens)) return *e;
  std::optional<bool> return_token_ids;  // vLLM's extension (ResponseWriter::return_token_ids)
  if (auto e = read_bool(body, "return_token_ids", return_token_ids)) return *e;

  GenerationPlan plan;
  std::vector<std::string> stops;
  if (auto e = read_openai_sampling(body, context, plan.params, stops)) return *e;
  std::optional<int64_t> logprobs;
  if (auto e = read_integer(body, "logprobs", 0, engine::kMaxLogprobs, logprobs)) return *e;
  if (logprobs) plan.params.logprobs = static_cast<int32_t>(*logprobs);
  std::optional<int64_t> max_tokens;
  if (auto e = read_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), max_tokens)) return *e;
  bool include_usage = false;
  if (auto e = read_stream_flags(body, plan.stream, &include_usage)) return *e;

  if (auto e = read_completion_prompt(body, context, add_special_tokens.value_or(true), plan.prompt_token_ids))
    return *e;
  // The legacy endpoint's default is 16 tokens (OpenAI's and vLLM's).
  constexpr int64_t kDefaultCompletionTokens = 16;
  const int64_t room = context.model->max_model_len - static_cast<int64_t>(plan.prompt_token_ids.size());
  if (!max_tokens && room > 0) max_tokens = std::min(kDefaultCompletionTokens, room);
  if (auto e = fit_context(context, static_cast<int64_t>(plan.prompt_token_ids.size()), max_tokens, "max_tokens",
                           plan.params)) {
    e->param = e->param.empty() ? "prompt" : e->param;
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);
  plan.dialect = Dialect::kOpenAI;
  plan.builder = std::make_unique<OutputBuilder>(context.tokenizer, std::move(stops));
  plan.writer = std::make_unique<ResponseWriter>(
      recipe::completion_builder({random_id("cmpl-"), context.model->served_model_name, unix_time()}, include_usage,
                                 logprobs.has_value(), context.tokenizer),
      plan.stream);
  if (return_token_ids.value_or(false)) {
    plan.writer->return_token_ids(plan.prompt_token_ids, ResponseWriter::PromptIdsAt::kChoice);
  }
  return plan;
}

ApiResult<std::string> tokenize_endpoint(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  std::optional<bool> add_special_tokens, return_token_strs;
  if (auto e = read_bool(body, "add_special_tokens", add_special_tokens)) return *e;
  if (auto e = read_bool(body, "return_token_strs", return_token_strs)) return *e;
  std::vector<recipe::TokenId> ids;
  if (body.contains("messages")) {
    Result<recipe::Conversation> conversation = recipe::conversation_from_openai_chat(request);
    if (!conversation.ok()) return bad_request_from(conversation.status());
    Result<recipe::RenderedPrompt> prompt = render_chat_prompt(*conversation, context);
    if (!prompt.ok()) return bad_request_from(prompt.status());
    ids = std::move(prompt->token_ids);
  } else {
    std::optional<std::string> prompt;
    if (auto e = read_string(body, "prompt", prompt)) return *e;
    if (!prompt) return bad_request("give prompt (a string) or messages (a chat)", "prompt");
    ids = encode_text_prompt(context, *prompt, add_special_tokens.value_or(true));
  }
  json::object out{{"count", ids.size()},
                   {"max_model_len", context.model->max_model_len},
                   {"tokens", json::array(ids.begin(), ids.end())}};
  if (return_token_strs.value_or(false)) {
    json::array pieces;
    for (recipe::TokenId id : ids) pieces.push_back(json::string(context.tokenizer->id_to_piece(id).value_or("")));
    out["token_strs"] = std::move(pieces);
  }
  return to_json_text(out);
}

ApiResult<std::string> detokenize_endpoint(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  const json::value* tokens = body.if_contains("tokens");
  if (tokens == nullptr || !tokens->is_array()) return bad_request("tokens must be an array of token ids", "tokens");
  // At most max_model_len ids: no sequence is longer, and a bound keeps a small request from asking for a
  // response hundreds of times its size (a 16 MiB body of 128-byte tokens decodes to ~360 MB).
  if (static_cast<int64_t>(tokens->get_array().size()) > context.model->max_model_len) {
    return bad_request(fmt::format("tokens has {} ids; at most max_model_len ({}) are decoded at once",
                                   tokens->get_array().size(), context.model->max_model_len),
                       "tokens");
  }
  std::vector<recipe::TokenId> ids;
  if (auto e = check_token_ids(tokens->get_array(), "tokens", context, ids)) return *e;
  return to_json_text(json::object{{"prompt", context.tokenizer->decode(ids)}});
}

}  // namespace deepinfer::server
