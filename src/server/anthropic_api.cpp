// Anthropic dialect: /v1/messages and /v1/messages/count_tokens. The request becomes a Conversation
// (recipe/anthropic_request.h); the reply comes back in the recipe's Messages shapes (response_builder.h):
// thinking, text and tool_use blocks, streamed as message_start, content_block_start/delta/stop, message_delta
// and message_stop events.
#include <fmt/format.h>

#include "deepinfer/server/api.h"
#include "deepinfer/recipe/anthropic_request.h"
#include "deepinfer/recipe/stream_parser.h"

namespace deepinfer::server {
namespace json = boost::json;

// The recipe names the Conversation's fields; Anthropic's effort lives in output_config.
constexpr FieldRename kAnthropicRenames[] = {{"reasoning_effort", "output_config.effort"}};
// The fields of a Messages request (the conversation's, then the sampling and stream fields read below).
constexpr std::string_view kConversationFields[] = {"model",       "messages", "system",       "tools",
                                                    "tool_choice", "thinking", "output_config"};
constexpr std::string_view kMessagesFields[] = {"max_tokens", "metadata",     "stop_sequences",
                                                "stream",     "temperature",  "top_k",
                                                "top_p",      "service_tier", "return_token_ids"};
// Beta fields that would change the answer and are not implemented: refused, never accepted and ignored.
constexpr RefusedField kRefused[] = {
    {"output_format", "output_format (structured outputs) is not supported"},
    {"mcp_servers", "mcp_servers is not supported (no MCP connector)"},
    {"container", "container is not supported (no code execution tool)"},
};

namespace {

// The Messages fields beside the conversation (sampling, stop sequences, stream, metadata, service tier), read and
// checked: /v1/messages and count_tokens take the same body and refuse the same values (count_tokens used to check
// only their names).
struct MessagesFields {
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature, top_p;
  std::optional<int64_t> top_k;
  std::vector<std::string> stops;
  bool stream = false;
};

std::optional<ApiError> read_messages_fields(const json::object& body, const ApiContext& context,
                                             std::string_view endpoint, MessagesFields& out) {
  if (auto e = refuse_return_token_ids(body, endpoint)) return e;
  if (auto e = read_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), out.max_tokens)) return e;
  if (auto e = read_number(body, "temperature", 0.0, 1.0, false, out.temperature)) return e;
  if (auto e = read_number(body, "top_p", 0.0, 1.0, true, out.top_p)) return e;
  if (auto e = read_integer(body, "top_k", 0, context.model->vocab_size, out.top_k)) return e;
  if (const json::value* sequences = present(body, "stop_sequences"); sequences != nullptr && !sequences->is_array())
    return bad_request("stop_sequences must be an array of strings", "stop_sequences");
  if (auto e = read_string_list(body, "stop_sequences", out.stops)) return e;
  if (auto e = refuse_fields(body, kRefused)) return e;
  if (auto e = refuse_unknown_fields(body, kConversationFields, Dialect::kAnthropic, kMessagesFields)) return e;
  std::optional<bool> stream;
  if (auto e = read_bool(body, "stream", stream)) return e;
  out.stream = stream.value_or(false);
  if (const json::value* metadata = present(body, "metadata"); metadata != nullptr) {
    if (!metadata->is_object()) return bad_request("metadata must be an object", "metadata");
    for (const auto& [key, value] : metadata->get_object()) {
      if (key != "user_id")
        return bad_request("metadata." + std::string(key) + ": only metadata.user_id is accepted",
                           "metadata." + std::string(key));
    }
    const json::value* user = metadata->get_object().if_contains("user_id");
    if (user != nullptr && !user->is_null() && !user->is_string()) {
      return bad_request("metadata.user_id must be a string", "metadata.user_id");
    }
  }
  if (const json::value* tier = present(body, "service_tier"); tier != nullptr) {
    if (!tier->is_string() || (tier->get_string() != "auto" && tier->get_string() != "standard_only")) {
      return bad_request("service_tier must be \"auto\" or \"standard_only\"", "service_tier");
    }
  }
  return std::nullopt;
}

}  // namespace

ApiResult<std::string> count_tokens_endpoint(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, true)) return *e;
  // count_tokens also takes the Messages fields that cannot change the count (clients send one body to both), and
  // refuses what /v1/messages would refuse. max_tokens is optional here.
  MessagesFields fields;
  if (auto e = read_messages_fields(body, context, "/v1/messages/count_tokens", fields)) return *e;
  Result<recipe::Conversation> conversation = recipe::conversation_from_anthropic_messages(request);
  if (!conversation.ok()) return bad_request_from(conversation.status());
  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(*conversation, context);
  if (!prompt.ok()) return bad_request_from(prompt.status(), kAnthropicRenames);
  // Images are counted (as their placeholder tokens on deepseek-v4.1), as /tokenize renders them.
  if (fields.max_tokens) {  // the thinking budget must fit below it, as on /v1/messages
    engine::SamplingParams params;
    recipe::StreamParserOptions options = recipe::stream_parser_options(*conversation, *prompt);
    if (auto e = apply_thinking_budget(*fields.max_tokens, "max_tokens", *conversation, options, context, params))
      return *e;
  }
  return to_json_text(json::object{{"input_tokens", prompt->token_ids.size()}});
}

ApiResult<GenerationPlan> plan_anthropic_messages(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, true)) return *e;
  MessagesFields fields;
  if (auto e = read_messages_fields(body, context, "/v1/messages", fields)) return *e;
  if (!fields.max_tokens) return bad_request("max_tokens is required", "max_tokens");
  const std::optional<int64_t> max_tokens = fields.max_tokens;

  Result<recipe::Conversation> parsed = recipe::conversation_from_anthropic_messages(request);
  if (!parsed.ok()) return bad_request_from(parsed.status());
  recipe::Conversation& conversation = *parsed;

  GenerationPlan plan;
  if (fields.temperature) plan.params.temperature = static_cast<float>(*fields.temperature);
  if (fields.top_p) plan.params.top_p = static_cast<float>(*fields.top_p);
  if (fields.top_k && *fields.top_k > 0) plan.params.top_k = static_cast<int32_t>(*fields.top_k);
  std::vector<std::string> stops = std::move(fields.stops);
  plan.stream = fields.stream;

  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(conversation, context);
  if (!prompt.ok()) return bad_request_from(prompt.status(), kAnthropicRenames);
  if (auto e = refuse_images(conversation, "messages")) return *e;
  if (auto e = refuse_unopened_tool_choice(conversation, *prompt)) return *e;
  if (auto e =
          fit_context(context, static_cast<int64_t>(prompt->token_ids.size()), max_tokens, "max_tokens", plan.params)) {
    return *e;
  }
  // Where the answer starts (reasoning, a prefilled tool-call block) and what it may hold (tools, JSON).
  recipe::StreamParserOptions options = recipe::stream_parser_options(conversation, *prompt);
  if (auto e = apply_thinking_budget(*max_tokens, "max_tokens", conversation, options, context, plan.params))
    return *e;
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  add_turn_marker_stops(context, plan.params);
  plan.dialect = Dialect::kAnthropic;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  // A tool_choice naming a function: the answer begins with its call (RenderedPrompt::answer_prefix).
  plan.params.forced_output_prefix = std::move(prompt->answer_prefix_ids);
  // "required" with several tools: the call names one of them (RenderedPrompt::answer_prefix_choices).
  plan.params.forced_output_choices = std::move(prompt->answer_prefix_choice_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 context.tokenizer, std::move(stops));
  if (conversation.tool_choice.single_call()) plan.builder->set_max_tool_calls(1);
  plan.writer = std::make_unique<ResponseWriter>(
      recipe::messages_builder({random_id("msg_"), context.model->served_model_name, 0}), plan.stream);
  return plan;
}

}  // namespace deepinfer::server
