// Anthropic dialect: /v1/messages. The request's system prompt, messages (text, image, tool_use,
// tool_result and thinking blocks) and tools become a Conversation; the reply comes back as thinking, text
// and tool_use blocks, streamed as message_start, content_block_start/delta/stop, message_delta and
// message_stop events.
#include <fmt/format.h>

#include "api.h"

namespace deepinfer::server {
namespace json = boost::json;
using Kind = recipe::StreamEvent::Kind;

namespace {

std::optional<ApiError> image_part(const json::object& block, const std::string& path, recipe::ContentPart& part) {
  const json::value* source = present(block, "source");
  if (source == nullptr || !source->is_object())
    return bad_request(path + ".source must be an object", path + ".source");
  const json::object& src = source->get_object();
  std::string type;
  if (auto e = required_string(src, "type", path + ".source", type)) return e;
  part.kind = recipe::ContentPart::Kind::kImage;
  if (type == "base64") {
    std::string media_type, data;
    if (auto e = required_string(src, "media_type", path + ".source", media_type)) return e;
    if (auto e = required_string(src, "data", path + ".source", data)) return e;
    part.image_url = "data:" + media_type + ";base64," + data;
  } else if (type == "url") {
    if (auto e = required_string(src, "url", path + ".source", part.image_url)) return e;
  } else {
    return bad_request(fmt::format("{}.source.type must be \"base64\" or \"url\", got \"{}\"", path, type),
                       path + ".source.type");
  }
  return std::nullopt;
}

// A tool_result's content: a string, or text (and image) blocks.
std::optional<ApiError> tool_result_content(const json::value* content, const std::string& path,
                                            recipe::Message& message) {
  if (content == nullptr) {
    message.content.push_back({recipe::ContentPart::Kind::kText, "", {}});
    return std::nullopt;
  }
  if (content->is_string()) {
    message.content.push_back({recipe::ContentPart::Kind::kText, std::string(content->get_string()), {}});
    return std::nullopt;
  }
  if (!content->is_array()) return bad_request(path + " must be a string or an array of content blocks", path);
  const json::array& blocks = content->get_array();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string block_path = fmt::format("{}[{}]", path, i);
    if (!blocks[i].is_object()) return bad_request(block_path + " must be an object", block_path);
    const json::object& block = blocks[i].get_object();
    std::string type;
    if (auto e = required_string(block, "type", block_path, type)) return e;
    recipe::ContentPart part;
    if (type == "text") {
      if (auto e = required_string(block, "text", block_path, part.text)) return e;
    } else if (type == "image") {
      if (auto e = image_part(block, block_path, part)) return e;
    } else {
      return bad_request(fmt::format("{}.type \"{}\" is not supported in a tool result", block_path, type),
                         block_path + ".type");
    }
    message.content.push_back(std::move(part));
  }
  if (message.content.empty()) message.content.push_back({recipe::ContentPart::Kind::kText, "", {}});
  return std::nullopt;
}

// One Anthropic message -> one or more Conversation messages (each tool_result becomes a tool message, in
// block order, between the user text before and after it).
std::optional<ApiError> convert_message(const json::value& value, const std::string& path,
                                        std::vector<recipe::Message>& out) {
  if (!value.is_object()) return bad_request(path + " must be an object", path);
  const json::object& object = value.get_object();
  std::string role;
  if (auto e = required_string(object, "role", path, role)) return e;
  if (role != "user" && role != "assistant") {
    return bad_request(fmt::format("{}.role must be \"user\" or \"assistant\", got \"{}\"", path, role),
                       path + ".role");
  }
  const bool assistant = role == "assistant";
  const json::value* content = present(object, "content");
  if (content == nullptr) return bad_request(path + ".content is required", path + ".content");
  recipe::Message message;
  message.role = assistant ? recipe::Role::kAssistant : recipe::Role::kUser;
  if (content->is_string()) {
    message.content.push_back({recipe::ContentPart::Kind::kText, std::string(content->get_string()), {}});
    out.push_back(std::move(message));
    return std::nullopt;
  }
  if (!content->is_array())
    return bad_request(path + ".content must be a string or an array of content blocks", path + ".content");
  const json::array& blocks = content->get_array();
  auto flush_user = [&] {
    if (!message.content.empty()) out.push_back(std::move(message));
    message = recipe::Message{};
    message.role = recipe::Role::kUser;
  };
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string block_path = fmt::format("{}.content[{}]", path, i);
    if (!blocks[i].is_object()) return bad_request(block_path + " must be an object", block_path);
    const json::object& block = blocks[i].get_object();
    std::string type;
    if (auto e = required_string(block, "type", block_path, type)) return e;
    if (type == "text") {
      recipe::ContentPart part;
      if (auto e = required_string(block, "text", block_path, part.text)) return e;
      message.content.push_back(std::move(part));
    } else if (type == "image" && !assistant) {
      recipe::ContentPart part;
      if (auto e = image_part(block, block_path, part)) return e;
      message.content.push_back(std::move(part));
    } else if (type == "tool_result" && !assistant) {
      recipe::Message result;
      result.role = recipe::Role::kTool;
      if (auto e = required_string(block, "tool_use_id", block_path, result.tool_call_id)) return e;
      if (auto e = tool_result_content(present(block, "content"), block_path + ".content", result)) return e;
      flush_user();
      out.push_back(std::move(result));
    } else if (type == "tool_use" && assistant) {
      recipe::ToolCall call;
      if (auto e = required_string(block, "id", block_path, call.id)) return e;
      if (auto e = required_string(block, "name", block_path, call.name)) return e;
      const json::value* input = present(block, "input");
      if (input != nullptr && !input->is_object()) {
        return bad_request(block_path + ".input must be an object", block_path + ".input");
      }
      if (input != nullptr) call.arguments = input->get_object();
      message.tool_calls.push_back(std::move(call));
    } else if (type == "thinking" && assistant) {
      std::string thinking;
      if (auto e = required_string(block, "thinking", block_path, thinking)) return e;
      message.reasoning_content = message.reasoning_content.value_or("") + thinking;
    } else if (type == "redacted_thinking" && assistant) {
      // Opaque to us: nothing to render.
    } else {
      return bad_request(fmt::format("{}.type \"{}\" is not supported in a{} message", block_path, type,
                                     assistant ? "n assistant" : " user"),
                         block_path + ".type");
    }
  }
  if (assistant) {
    if (message.content.empty()) message.content_is_null = !message.tool_calls.empty();
    if (message.content.empty() && message.tool_calls.empty())
      message.content.push_back({recipe::ContentPart::Kind::kText, "", {}});
    out.push_back(std::move(message));
  } else {
    if (!message.content.empty()) out.push_back(std::move(message));
  }
  return std::nullopt;
}

std::optional<ApiError> convert_system(const json::value* system, recipe::Conversation& conversation) {
  if (system == nullptr) return std::nullopt;
  recipe::Message message;
  message.role = recipe::Role::kSystem;
  if (system->is_string()) {
    message.content.push_back({recipe::ContentPart::Kind::kText, std::string(system->get_string()), {}});
  } else if (system->is_array()) {
    const json::array& blocks = system->get_array();
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string path = fmt::format("system[{}]", i);
      if (!blocks[i].is_object()) return bad_request(path + " must be an object", path);
      std::string type;
      if (auto e = required_string(blocks[i].get_object(), "type", path, type)) return e;
      if (type != "text") return bad_request(path + ".type must be \"text\"", path + ".type");
      recipe::ContentPart part;
      if (auto e = required_string(blocks[i].get_object(), "text", path, part.text)) return e;
      message.content.push_back(std::move(part));
    }
  } else {
    return bad_request("system must be a string or an array of text blocks", "system");
  }
  if (!message.content.empty()) conversation.messages.push_back(std::move(message));
  return std::nullopt;
}

std::optional<ApiError> convert_tools(const json::value* tools, recipe::Conversation& conversation) {
  if (tools == nullptr) return std::nullopt;
  if (!tools->is_array()) return bad_request("tools must be an array", "tools");
  const json::array& list = tools->get_array();
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("tools[{}]", i);
    if (!list[i].is_object()) return bad_request(path + " must be an object", path);
    const json::object& tool = list[i].get_object();
    if (const json::value* type = present(tool, "type");
        type != nullptr && !(type->is_string() && type->get_string() == "custom")) {
      return bad_request(fmt::format("{}.type {} is not supported: only client tools (name, description, input_schema) "
                                     "are",
                                     path, json::serialize(*type)),
                         path + ".type");
    }
    std::string name;
    if (auto e = required_string(tool, "name", path, name)) return e;
    if (name.empty()) return bad_request(path + ".name must not be empty", path + ".name");
    json::object function{{"name", name}};
    if (const json::value* description = present(tool, "description")) {
      if (!description->is_string()) return bad_request(path + ".description must be a string", path + ".description");
      function["description"] = *description;
    }
    const json::value* schema = present(tool, "input_schema");
    if (schema == nullptr || !schema->is_object()) {
      return bad_request(path + ".input_schema must be a JSON Schema object", path + ".input_schema");
    }
    function["parameters"] = *schema;
    conversation.tools.push_back({name, std::move(function)});
  }
  return std::nullopt;
}

// tool_choice {"type": "auto" | "any" | "tool" | "none", "name"}: as in the OpenAI dialect, "none" drops the
// tools, the others render and parse as auto; a named tool must exist.
std::optional<ApiError> apply_tool_choice(const json::value* choice, recipe::Conversation& conversation) {
  if (choice == nullptr) return std::nullopt;
  if (!choice->is_object()) return bad_request("tool_choice must be an object", "tool_choice");
  std::string type;
  if (auto e = required_string(choice->get_object(), "type", "tool_choice", type)) return e;
  if (type == "none") {
    conversation.tools.clear();
  } else if (type == "any") {
    if (conversation.tools.empty()) return bad_request("tool_choice \"any\" needs tools", "tool_choice");
  } else if (type == "tool") {
    std::string name;
    if (auto e = required_string(choice->get_object(), "name", "tool_choice", name)) return e;
    bool found = false;
    for (const recipe::ToolDefinition& tool : conversation.tools) found = found || tool.name == name;
    if (!found)
      return bad_request(fmt::format("tool_choice.name '{}' is not one of the request's tools", name),
                         "tool_choice.name");
  } else if (type != "auto") {
    return bad_request(fmt::format("tool_choice.type must be auto, any, tool or none, got \"{}\"", type),
                       "tool_choice.type");
  }
  return std::nullopt;
}

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
  return fmt::format("event: {}\ndata: {}\n\n", name, json::serialize(data));
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
    return json::serialize(json::object{{"id", id_},
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

ApiResult<GenerationPlan> plan_anthropic_messages(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, true)) return *e;
  std::optional<int64_t> max_tokens;
  if (auto e = read_integer(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), max_tokens)) return *e;
  if (!max_tokens) return bad_request("max_tokens is required", "max_tokens");

  recipe::Conversation conversation;
  if (auto e = convert_system(present(body, "system"), conversation)) return *e;
  const json::value* messages = present(body, "messages");
  if (messages == nullptr || !messages->is_array()) return bad_request("messages must be an array", "messages");
  if (messages->get_array().empty()) return bad_request("messages must not be empty", "messages");
  for (size_t i = 0; i < messages->get_array().size(); ++i) {
    if (auto e = convert_message(messages->get_array()[i], fmt::format("messages[{}]", i), conversation.messages))
      return *e;
  }
  if (auto e = convert_tools(present(body, "tools"), conversation)) return *e;
  if (auto e = apply_tool_choice(present(body, "tool_choice"), conversation)) return *e;
  if (const json::value* thinking = present(body, "thinking")) {
    const json::value* type = thinking->is_object() ? thinking->get_object().if_contains("type") : nullptr;
    if (type == nullptr || !type->is_string() ||
        (type->get_string() != "enabled" && type->get_string() != "disabled")) {
      return bad_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
                         "thinking");
    }
    conversation.options.thinking = type->get_string() == "enabled";  // budget_tokens is not enforced
  }

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

  Result<recipe::RenderedPrompt> prompt =
      recipe::render_and_tokenize(conversation, context.chat_format, *context.tokenizer, context.tokenization_cache);
  if (!prompt.ok()) return bad_request_from(prompt.status());
  if (auto e =
          fit_context(context, static_cast<int64_t>(prompt->token_ids.size()), max_tokens, "max_tokens", plan.params)) {
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  recipe::StreamParserOptions options;
  options.starts_in_reasoning = prompt_opens_reasoning(*prompt);
  options.tools_enabled = !conversation.tools.empty();
  plan.dialect = Dialect::kAnthropic;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 std::move(stops));
  plan.writer = std::make_unique<MessagesWriter>(context, plan.stream);
  return plan;
}

}  // namespace deepinfer::server
