// OpenAI Responses dialect: /v1/responses. The request becomes a Conversation (recipe/responses_request.h);
// the reply comes back in the recipe's Responses shapes (response_builder.h): reasoning, message and
// function_call output items, streamed as response.created / output_item / content_part / *.delta / *.done
// events ending in response.completed (or response.incomplete when max_output_tokens ran out).
#include <algorithm>
#include <iterator>

#include <fmt/format.h>

#include "deepinfer/server/api.h"
#include "deepinfer/recipe/responses_request.h"

namespace deepinfer::server {
namespace json = boost::json;

ApiResult<GenerationPlan> plan_responses(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  if (auto e = refuse_return_token_ids(body, "/v1/responses")) return *e;
  if (present(body, "previous_response_id") != nullptr) {
    return bad_request(
        "previous_response_id is not supported: responses are not stored; send the whole "
        "conversation in input",
        "previous_response_id");
  }
  if (present(body, "conversation") != nullptr) {
    return bad_request("conversation is not supported: send the whole conversation in input", "conversation");
  }
  if (const json::value* background = present(body, "background");
      background != nullptr && !(background->is_bool() && !background->get_bool())) {
    return bad_request("background is not supported: responses are not stored; send background: false", "background");
  }
  if (present(body, "prompt") != nullptr) {
    return bad_request("prompt (a stored prompt template) is not supported: send instructions and input",
                       "prompt");
  }
  if (const json::value* top = present(body, "top_logprobs");
      top != nullptr && !(top->is_int64() && top->get_int64() == 0)) {
    return bad_request("top_logprobs is not supported on /v1/responses yet; use /v1/chat/completions with logprobs",
                       "top_logprobs");
  }
  // include: what the answer carries besides the output. Logprobs are refused (not produced here); values OpenAI
  // does not define are refused; the others name outputs of tools this server has none of (nothing to include), or
  // reasoning.encrypted_content (reasoning items are returned in the clear and taken back as they are).
  if (const json::value* include = present(body, "include"); include != nullptr) {
    if (!include->is_array()) return bad_request("include must be an array of strings", "include");
    static constexpr std::string_view kKnown[] = {
        "file_search_call.results",        "web_search_call.results", "web_search_call.action.sources",
        "message.input_image.image_url",   "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",   "reasoning.encrypted_content"};
    const json::array& list = include->get_array();
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string param = "include[" + std::to_string(i) + "]";
      if (!list[i].is_string()) return bad_request(param + " must be a string", param);
      const std::string_view value = list[i].get_string();
      if (value == "message.output_text.logprobs") {
        return bad_request("include message.output_text.logprobs is not supported on /v1/responses yet; use "
                           "/v1/chat/completions with logprobs",
                           param);
      }
      if (std::find(std::begin(kKnown), std::end(kKnown), value) == std::end(kKnown)) {
        return bad_request("include value \"" + std::string(value) + "\" is not one OpenAI defines", param);
      }
    }
  }

  if (present(body, "max_tokens") != nullptr) {
    return bad_request("max_tokens is not a /v1/responses field; send max_output_tokens", "max_tokens");
  }
  // The fields read here and by the conversion (recipe/responses_request.h); store, metadata and user are taken and
  // have nothing to change (nothing is stored; no output depends on them); max_tool_calls counts built-in tool calls,
  // of which this server has none; truncation "disabled" is what happens (an input past the context is refused).
  static constexpr std::string_view kResponsesFields[] = {"model",
                                                          "input",
                                                          "instructions",
                                                          "reasoning",
                                                          "text",
                                                          "tools",
                                                          "tool_choice",
                                                          "parallel_tool_calls",
                                                          "store",
                                                          "include",
                                                          "top_logprobs",
                                                          "max_output_tokens",
                                                          "stream",
                                                          "metadata",
                                                          "user",
                                                          "max_tool_calls",
                                                          "truncation",
                                                          "background",
                                                          "return_token_ids",
                                                          "service_tier",
                                                          "prompt_cache_key",
                                                          "safety_identifier",
                                                          "prompt_cache_retention",
                                                          "stream_options"};
  if (auto e = refuse_unknown_fields(body, kResponsesFields, Dialect::kOpenAI, kOpenAISamplingFields)) return *e;
  if (const json::value* truncation = present(body, "truncation");
      truncation != nullptr && !(truncation->is_string() && truncation->get_string() == "disabled")) {
    return bad_request("truncation: only \"disabled\" is supported (an input longer than the context is refused)",
                       "truncation");
  }
  std::optional<int64_t> max_tool_calls;
  if (auto e = read_integer(body, "max_tool_calls", 1, std::numeric_limits<int64_t>::max(), max_tool_calls)) return *e;
  std::optional<std::string> user;
  if (auto e = read_string(body, "user", user)) return *e;
  if (auto e = read_openai_bookkeeping(body)) return *e;  // store, metadata, service_tier, prompt_cache_key, ...
  Result<recipe::Conversation> converted = recipe::conversation_from_responses(request);
  if (!converted.ok()) return bad_request_from(converted.status());
  recipe::Conversation& conversation = *converted;
  // parallel_tool_calls: read into the conversation (ToolChoice::parallel)

  GenerationPlan plan;
  std::vector<std::string> stops;
  if (auto e = read_openai_sampling(body, context, plan.params, stops)) return *e;
  std::optional<int64_t> max_output_tokens;
  if (auto e = read_integer(body, "max_output_tokens", 1, std::numeric_limits<int64_t>::max(), max_output_tokens))
    return *e;
  if (auto e = read_stream_flags(body, plan.stream, nullptr)) return *e;

  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(conversation, context);
  if (!prompt.ok()) {
    // The recipe names the Conversation's fields; say them as this dialect spells them.
    static constexpr FieldRename kRenames[] = {{"messages[", "input["},
                                               {"thinking", "reasoning"},
                                               {"reasoning_effort", "reasoning.effort"},
                                               {"response_format", "text.format"}};
    return bad_request_from(prompt.status(), kRenames);
  }
  if (auto e = refuse_images(conversation, "input")) return *e;
  if (auto e = refuse_unopened_tool_choice(conversation, *prompt)) return *e;
  if (auto e = fit_context(context, static_cast<int64_t>(prompt->token_ids.size()), max_output_tokens,
                           "max_output_tokens", plan.params)) {
    e->param = e->param.empty() ? "input" : e->param;
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  json::object echo =
      recipe::responses_echo(body, max_output_tokens, conversation.tool_choice.parallel,
                             float_for_json(plan.params.temperature),
                             float_for_json(plan.params.top_p));
  add_turn_marker_stops(context, plan.params);
  // Where the answer starts (reasoning, a prefilled tool-call block) and what it may hold (tools, JSON).
  recipe::StreamParserOptions options = recipe::stream_parser_options(conversation, *prompt);
  plan.dialect = Dialect::kOpenAI;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  // A tool_choice naming a function: the answer begins with its call (RenderedPrompt::answer_prefix).
  plan.params.forced_output_prefix = std::move(prompt->answer_prefix_ids);
  // "required" with several tools: the call names one of them (RenderedPrompt::answer_prefix_choices).
  plan.params.forced_output_choices = std::move(prompt->answer_prefix_choice_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 context.tokenizer, std::move(stops));
  if (conversation.tool_choice.single_call()) plan.builder->set_max_tool_calls(1);
  plan.writer = std::make_unique<ResponseWriter>(
      recipe::responses_builder({random_id("resp_"), context.model->served_model_name, unix_time()}, std::move(echo)),
      plan.stream);
  return plan;
}

}  // namespace deepinfer::server
