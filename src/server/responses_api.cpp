// OpenAI Responses dialect: /v1/responses. The request becomes a Conversation (recipe/responses_request.h);
// the reply comes back in the recipe's Responses shapes (response_builder.h): reasoning, message and
// function_call output items, streamed as response.created / output_item / content_part / *.delta / *.done
// events ending in response.completed (or response.incomplete when max_output_tokens ran out).
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

  Result<recipe::Conversation> converted = recipe::conversation_from_responses(request);
  if (!converted.ok()) return bad_request_from(converted.status());
  recipe::Conversation& conversation = *converted;
  std::optional<bool> store;  // parallel_tool_calls: read into the conversation (ToolChoice::parallel)
  if (auto e = read_bool(body, "store", store)) return *e;  // accepted; nothing is stored

  GenerationPlan plan;
  std::vector<std::string> stops;
  if (auto e = read_openai_sampling(body, context, plan.params, stops)) return *e;
  std::optional<int64_t> max_output_tokens;
  if (auto e = read_integer(body, "max_output_tokens", 1, std::numeric_limits<int64_t>::max(), max_output_tokens))
    return *e;
  std::optional<bool> stream;
  if (auto e = read_bool(body, "stream", stream)) return *e;
  plan.stream = stream.value_or(false);

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
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 context.tokenizer, std::move(stops));
  if (conversation.tool_choice.single_call()) plan.builder->set_max_tool_calls(1);
  plan.writer = std::make_unique<ResponseWriter>(
      recipe::responses_builder({random_id("resp_"), context.model->served_model_name, unix_time()}, std::move(echo)),
      plan.stream);
  return plan;
}

}  // namespace deepinfer::server
