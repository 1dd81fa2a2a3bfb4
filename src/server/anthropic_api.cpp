// Anthropic dialect: /v1/messages. The request becomes a Conversation (recipe/anthropic_request.h); the reply
// comes back as thinking, text and tool_use blocks, streamed as message_start, content_block_start/delta/stop,
// message_delta and message_stop events.
#include <fmt/format.h>

#include "api.h"
#include "deepinfer/recipe/anthropic_request.h"

namespace deepinfer::server {
namespace json = boost::json;
using Kind = recipe::StreamEvent::Kind;

namespace {

std::string_view stop_reason(const FinishInfo& info, const OutputMessage& message) {
  if (info.kind == FinishInfo::Kind::kLength) return "max_tokens";
  if (info.kind == FinishInfo::Kind::kStopString) return "stop_sequence";
  if (!message.tool_calls.empty()) return "tool_use";
  return "end_turn";
}

json::object tool_input(const OutputToolCall& call) {
  boost::system::error_code ec;
  json::value parsed = json::parse(call.arguments_text, ec);
  if (ec || !parsed.is_object()) return {};
  return std::move(parsed.get_object());
}

std::string event(std::string_view name, const json::object& data) {
  return fmt::format("event: {}\ndata: {}\n\n", name, to_json_text(data));
}

class MessagesWriter final : public ResponseWriter {
 public:
  MessagesWriter(const ApiContext& context, bool stream)
      : id_(random_id("msg_")), model_(context.model->served_model_name), stream_(stream) {}

  std::string start(const FinishInfo& info) override {
    json::object message{{"id", id_},
                         {"type", "message"},
                         {"role", "assistant"},
                         {"model", model_},
                         {"content", json::array{}},
                         {"stop_reason", nullptr},
                         {"stop_sequence", nullptr},
                         {"usage", usage(info, 0)}};
    return event("message_start", {{"type", "message_start"}, {"message", std::move(message)}});
  }

  std::string deltas(const std::vector<recipe::StreamEvent>& events, std::vector<TokenLogprobs>& logprobs) override {
    logprobs.clear();
    std::string out;
    for (const recipe::StreamEvent& e : events) {
      switch (e.kind) {
        case Kind::kReasoning:
          out += open(Block::kThinking, {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}});
          out += delta({{"type", "thinking_delta"}, {"thinking", e.text}});
          break;
        case Kind::kContent:
          out += open(Block::kText, {{"type", "text"}, {"text", ""}});
          out += delta({{"type", "text_delta"}, {"text", e.text}});
          break;
        case Kind::kToolCallBegin:
          out += close();
          out += open(Block::kToolUse,
                      {{"type", "tool_use"}, {"id", e.tool_id}, {"name", e.tool_name}, {"input", json::object{}}});
          break;
        case Kind::kToolArguments:
          if (open_ == Block::kToolUse) out += delta({{"type", "input_json_delta"}, {"partial_json", e.text}});
          break;
        case Kind::kToolCallEnd:
          out += close();
          break;
      }
    }
    return out;
  }

  std::string finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>&) override {
    json::value stop_sequence = nullptr;
    if (info.stop_string) stop_sequence = json::string(*info.stop_string);
    if (stream_) {
      std::string out = close();
      out += event("message_delta",
                   {{"type", "message_delta"},
                    {"delta", {{"stop_reason", stop_reason(info, message)}, {"stop_sequence", stop_sequence}}},
                    {"usage", {{"output_tokens", info.completion_tokens}}}});
      out += event("message_stop", {{"type", "message_stop"}});
      return out;
    }
    json::array content;
    if (!message.reasoning.empty())
      content.push_back({{"type", "thinking"}, {"thinking", message.reasoning}, {"signature", ""}});
    if (!message.content.empty()) content.push_back({{"type", "text"}, {"text", message.content}});
    for (const OutputToolCall& call : message.tool_calls) {
      content.push_back({{"type", "tool_use"}, {"id", call.id}, {"name", call.name}, {"input", tool_input(call)}});
    }
    return to_json_text(json::object{{"id", id_},
                                        {"type", "message"},
                                        {"role", "assistant"},
                                        {"model", model_},
                                        {"content", std::move(content)},
                                        {"stop_reason", stop_reason(info, message)},
                                        {"stop_sequence", stop_sequence},
                                        {"usage", usage(info, info.completion_tokens)}});
  }

  std::string stream_error(const ApiError& error) override {
    return fmt::format("event: error\ndata: {}\n\n", error_body(error, Dialect::kAnthropic));
  }

 private:
  enum class Block { kNone, kThinking, kText, kToolUse };

  static json::object usage(const FinishInfo& info, int64_t output_tokens) {
    return {{"input_tokens", info.prompt_tokens},
            {"output_tokens", output_tokens},
            {"cache_creation_input_tokens", 0},
            {"cache_read_input_tokens", info.cached_tokens}};
  }

  // Opens a block of `kind` unless one is open already.
  std::string open(Block kind, json::object content_block) {
    if (open_ == kind && kind != Block::kToolUse) return {};
    std::string out = close();
    open_ = kind;
    out += event("content_block_start",
                 {{"type", "content_block_start"}, {"index", index_}, {"content_block", std::move(content_block)}});
    return out;
  }

  std::string delta(json::object delta) {
    return event("content_block_delta",
                 {{"type", "content_block_delta"}, {"index", index_}, {"delta", std::move(delta)}});
  }

  std::string close() {
    if (open_ == Block::kNone) return {};
    std::string out = event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
    open_ = Block::kNone;
    ++index_;
    return out;
  }

  std::string id_;
  std::string model_;
  bool stream_;
  Block open_ = Block::kNone;
  int64_t index_ = 0;
};

}  // namespace

// The recipe names the Conversation's fields; Anthropic's effort lives in output_config.
constexpr FieldRename kAnthropicRenames[] = {{"reasoning_effort", "output_config.effort"}};

ApiResult<std::string> count_tokens_endpoint(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, true)) return *e;
  Result<recipe::Conversation> conversation = recipe::conversation_from_anthropic_messages(request);
  if (!conversation.ok()) return bad_request_from(conversation.status());
  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(*conversation, context);
  if (!prompt.ok()) return bad_request_from(prompt.status(), kAnthropicRenames);
  return to_json_text(json::object{{"input_tokens", prompt->token_ids.size()}});
}

ApiResult<GenerationPlan> plan_anthropic_messages(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, true)) return *e;
  std::optional<int64_t> max_tokens;
  if (auto e = read_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), max_tokens)) return *e;
  if (!max_tokens) return bad_request("max_tokens is required", "max_tokens");

  Result<recipe::Conversation> parsed = recipe::conversation_from_anthropic_messages(request);
  if (!parsed.ok()) return bad_request_from(parsed.status());
  recipe::Conversation& conversation = *parsed;

  GenerationPlan plan;
  std::optional<double> number;
  if (auto e = read_number(body, "temperature", 0.0, 1.0, false, number)) return *e;
  if (number) plan.params.temperature = static_cast<float>(*number);
  number.reset();
  if (auto e = read_number(body, "top_p", 0.0, 1.0, true, number)) return *e;
  if (number) plan.params.top_p = static_cast<float>(*number);
  std::optional<int64_t> top_k;
  if (auto e = read_integer(body, "top_k", 0, context.model->vocab_size, top_k)) return *e;
  if (top_k && *top_k > 0) plan.params.top_k = static_cast<int32_t>(*top_k);
  std::vector<std::string> stops;
  if (auto e = read_string_list(body, "stop_sequences", stops)) return *e;
  std::optional<bool> stream;
  if (auto e = read_bool(body, "stream", stream)) return *e;
  plan.stream = stream.value_or(false);
  if (const json::value* metadata = present(body, "metadata"); metadata != nullptr && !metadata->is_object()) {
    return bad_request("metadata must be an object", "metadata");
  }

  Result<recipe::RenderedPrompt> prompt = render_chat_prompt(conversation, context);
  if (!prompt.ok()) return bad_request_from(prompt.status(), kAnthropicRenames);
  if (auto e =
          fit_context(context, static_cast<int64_t>(prompt->token_ids.size()), max_tokens, "max_tokens", plan.params)) {
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  add_turn_marker_stops(context, plan.params);
  // Where the answer starts (reasoning, a prefilled tool-call block) and what it may hold (tools, JSON).
  recipe::StreamParserOptions options = recipe::stream_parser_options(conversation, *prompt);
  plan.dialect = Dialect::kAnthropic;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 std::move(stops));
  plan.writer = std::make_unique<MessagesWriter>(context, plan.stream);
  return plan;
}

}  // namespace deepinfer::server
