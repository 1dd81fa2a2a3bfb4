// OpenAI Responses dialect: /v1/responses. `instructions`, the `input` items (messages, function_call,
// function_call_output, reasoning) and the flat `tools` become a Conversation; the reply comes back as
// reasoning, message and function_call output items, streamed as response.created / output_item / content_part
// / *.delta / *.done events ending in response.completed (or response.incomplete when max_output_tokens ran out).
#include <fmt/format.h>

#include "api.h"

namespace deepinfer::server {
namespace json = boost::json;
using Kind = recipe::StreamEvent::Kind;

namespace {

recipe::ContentPart text_part(std::string_view text) {
  return {recipe::ContentPart::Kind::kText, std::string(text), {}};
}

// A message's `content`: a string, or parts of type input_text / output_text (and input_image for users).
std::optional<ApiError> message_content(const json::value* content, const std::string& path, bool assistant,
                                        recipe::Message& message) {
  if (content == nullptr) return bad_request(path + " is required", path);
  if (content->is_string()) {
    message.content.push_back(text_part(content->get_string()));
    return std::nullopt;
  }
  if (!content->is_array()) return bad_request(path + " must be a string or an array of content parts", path);
  const json::array& parts = content->get_array();
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string part_path = fmt::format("{}[{}]", path, i);
    if (!parts[i].is_object()) return bad_request(part_path + " must be an object", part_path);
    const json::object& part = parts[i].get_object();
    std::string type;
    if (auto e = required_string(part, "type", part_path, type)) return e;
    if (type == "input_text" || type == "output_text") {
      std::string text;
      if (auto e = required_string(part, "text", part_path, text)) return e;
      message.content.push_back(text_part(text));
    } else if (type == "refusal" && assistant) {
      std::string text;
      if (auto e = required_string(part, "refusal", part_path, text)) return e;
      message.content.push_back(text_part(text));
    } else if (type == "input_image" && !assistant) {
      recipe::ContentPart image;
      image.kind = recipe::ContentPart::Kind::kImage;
      if (auto e = required_string(part, "image_url", part_path, image.image_url)) return e;
      message.content.push_back(std::move(image));
    } else {
      return bad_request(fmt::format("{}.type \"{}\" is not supported in a{} message", part_path, type,
                                     assistant ? "n assistant" : " user, system or developer"),
                         part_path + ".type");
    }
  }
  if (message.content.empty()) message.content.push_back(text_part(""));
  return std::nullopt;
}

// Builds the conversation from `input`. Assistant turns gather what belongs to them: a reasoning item goes to
// the next assistant message (or function_call), function_call items join the assistant message right before
// them (or open one with null content), so a tool round trip renders as the chat endpoint renders it.
class InputReader {
 public:
  explicit InputReader(recipe::Conversation& conversation) : conversation_(conversation) {}

  std::optional<ApiError> read(const json::value& input) {
    if (input.is_string()) {
      recipe::Message message;
      message.role = recipe::Role::kUser;
      message.content.push_back(text_part(input.get_string()));
      conversation_.messages.push_back(std::move(message));
      return std::nullopt;
    }
    if (!input.is_array()) return bad_request("input must be a string or an array of input items", "input");
    const json::array& items = input.get_array();
    if (items.empty()) return bad_request("input must not be empty", "input");
    for (size_t i = 0; i < items.size(); ++i) {
      if (auto e = item(items[i], fmt::format("input[{}]", i))) return e;
    }
    if (pending_reasoning_) {
      // Reasoning with no assistant turn after it: nothing to attach it to; it would render nowhere.
      return bad_request(pending_reasoning_path_ +
                             " is a reasoning item not followed by an assistant message or "
                             "function_call",
                         pending_reasoning_path_);
    }
    return std::nullopt;
  }

 private:
  std::optional<ApiError> item(const json::value& value, const std::string& path) {
    if (!value.is_object()) return bad_request(path + " must be an object", path);
    const json::object& object = value.get_object();
    std::string type = "message";  // an item with a role and no type is a message (EasyInputMessage)
    if (const json::value* t = present(object, "type")) {
      if (!t->is_string()) return bad_request(path + ".type must be a string", path + ".type");
      type = t->get_string();
    }
    if (type == "message") return message(object, path);
    if (type == "function_call") return function_call(object, path);
    if (type == "function_call_output") return function_call_output(object, path);
    if (type == "reasoning") return reasoning(object, path);
    return bad_request(fmt::format("{}.type \"{}\" is not supported: use message, function_call, "
                                   "function_call_output or reasoning",
                                   path, type),
                       path + ".type");
  }

  std::optional<ApiError> message(const json::object& object, const std::string& path) {
    std::string role;
    if (auto e = required_string(object, "role", path, role)) return e;
    recipe::Message message;
    if (role == "user") {
      message.role = recipe::Role::kUser;
    } else if (role == "assistant") {
      message.role = recipe::Role::kAssistant;
    } else if (role == "system") {
      message.role = recipe::Role::kSystem;
    } else if (role == "developer") {
      message.role = recipe::Role::kDeveloper;
    } else {
      return bad_request(
          fmt::format("{}.role must be \"user\", \"assistant\", \"system\" or \"developer\", got \"{}\"", path, role),
          path + ".role");
    }
    const bool assistant = message.role == recipe::Role::kAssistant;
    if (auto e = message_content(present(object, "content"), path + ".content", assistant, message)) return e;
    if (assistant) {
      take_reasoning(message);
    } else if (pending_reasoning_) {
      return bad_request(pending_reasoning_path_ + " is a reasoning item followed by a " + role +
                             " message; it must precede an assistant message or function_call",
                         pending_reasoning_path_);
    }
    conversation_.messages.push_back(std::move(message));
    last_is_assistant_ = assistant;
    return std::nullopt;
  }

  std::optional<ApiError> function_call(const json::object& object, const std::string& path) {
    recipe::ToolCall call;
    if (auto e = required_string(object, "call_id", path, call.id)) return e;
    if (auto e = required_string(object, "name", path, call.name)) return e;
    const json::value* arguments = present(object, "arguments");
    const std::string arguments_path = path + ".arguments";
    if (arguments == nullptr || !arguments->is_string()) {
      return bad_request(arguments_path + " must be a string holding a JSON object", arguments_path);
    }
    boost::system::error_code ec;
    json::value parsed = json::parse(arguments->get_string(), ec);
    if (ec) {
      return bad_request(fmt::format("{} is not valid JSON ({}): {}", arguments_path, ec.message(),
                                     std::string(arguments->get_string()).substr(0, 80)),
                         arguments_path);
    }
    if (!parsed.is_object()) return bad_request(arguments_path + " must hold a JSON object", arguments_path);
    call.arguments = std::move(parsed.get_object());
    if (!last_is_assistant_ || pending_reasoning_) {
      // A new assistant turn that only calls tools (content null, as the chat endpoint renders it).
      recipe::Message message;
      message.role = recipe::Role::kAssistant;
      message.content_is_null = true;
      take_reasoning(message);
      conversation_.messages.push_back(std::move(message));
      last_is_assistant_ = true;
    }
    conversation_.messages.back().tool_calls.push_back(std::move(call));
    return std::nullopt;
  }

  std::optional<ApiError> function_call_output(const json::object& object, const std::string& path) {
    if (pending_reasoning_) {
      return bad_request(pending_reasoning_path_ +
                             " is a reasoning item followed by a function_call_output; it "
                             "must precede an assistant message or function_call",
                         pending_reasoning_path_);
    }
    recipe::Message message;
    message.role = recipe::Role::kTool;
    if (auto e = required_string(object, "call_id", path, message.tool_call_id)) return e;
    const json::value* output = present(object, "output");
    if (output != nullptr && output->is_array()) {
      if (auto e = message_content(output, path + ".output", false, message)) return e;
    } else if (output != nullptr && output->is_string()) {
      message.content.push_back(text_part(output->get_string()));
    } else {
      return bad_request(path + ".output must be a string or an array of content parts", path + ".output");
    }
    conversation_.messages.push_back(std::move(message));
    last_is_assistant_ = false;
    return std::nullopt;
  }

  // {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}], "summary": [{"type": "summary_text",
  // "text"}]}: the full text when given, else the summary; parts are concatenated.
  std::optional<ApiError> reasoning(const json::object& object, const std::string& path) {
    std::string text;
    bool found = false;
    for (const char* key : {"content", "summary"}) {
      const json::value* parts = present(object, key);
      if (parts == nullptr) continue;
      const std::string parts_path = path + "." + key;
      if (!parts->is_array()) return bad_request(parts_path + " must be an array", parts_path);
      for (size_t i = 0; i < parts->get_array().size(); ++i) {
        const std::string part_path = fmt::format("{}[{}]", parts_path, i);
        const json::value& part = parts->get_array()[i];
        if (!part.is_object()) return bad_request(part_path + " must be an object", part_path);
        std::string piece;
        if (auto e = required_string(part.get_object(), "text", part_path, piece)) return e;
        if (!found) text += piece;
      }
      if (!parts->get_array().empty()) found = true;
    }
    pending_reasoning_ = pending_reasoning_.value_or("") + text;
    pending_reasoning_path_ = path;
    return std::nullopt;
  }

  void take_reasoning(recipe::Message& message) {
    if (pending_reasoning_) message.reasoning_content = std::move(*pending_reasoning_);
    pending_reasoning_.reset();
  }

  recipe::Conversation& conversation_;
  bool last_is_assistant_ = false;
  std::optional<std::string> pending_reasoning_;
  std::string pending_reasoning_path_;
};

// Flat function tools {type: "function", name, description, parameters, strict} -> the OpenAI function object
// {name, description, parameters}, the shape the renderers print.
std::optional<ApiError> convert_tools(const json::value* tools, recipe::Conversation& conversation) {
  if (tools == nullptr) return std::nullopt;
  if (!tools->is_array()) return bad_request("tools must be an array", "tools");
  const json::array& list = tools->get_array();
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("tools[{}]", i);
    if (!list[i].is_object()) return bad_request(path + " must be an object", path);
    const json::object& tool = list[i].get_object();
    std::string type;
    if (auto e = required_string(tool, "type", path, type)) return e;
    if (type != "function") {
      return bad_request(fmt::format("{}.type \"{}\" is not supported: only function tools are", path, type),
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
    if (const json::value* parameters = present(tool, "parameters")) {
      if (!parameters->is_object()) {
        return bad_request(path + ".parameters must be a JSON Schema object", path + ".parameters");
      }
      function["parameters"] = *parameters;
    }
    conversation.tools.push_back({name, std::move(function)});
  }
  return std::nullopt;
}

// tool_choice: "none" | "auto" | "required" | {"type": "function", "name"}; as in the chat dialect, "none" drops
// the tools; required and named are recorded for the renderer to honour or refuse.
std::optional<ApiError> apply_tool_choice(const json::value* choice, recipe::Conversation& conversation) {
  if (choice == nullptr) return std::nullopt;
  if (choice->is_string()) {
    const std::string_view mode = choice->get_string();
    if (mode == "none") {
      conversation.tools.clear();
    } else if (mode == "required") {
      if (conversation.tools.empty()) return bad_request("tool_choice \"required\" needs tools", "tool_choice");
      conversation.tool_choice.mode = recipe::ToolChoice::Mode::kRequired;
    } else if (mode != "auto") {
      return bad_request(fmt::format("tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": "
                                     "\"function\", \"name\": ...}}, got \"{}\"",
                                     std::string(mode)),
                         "tool_choice");
    }
    return std::nullopt;
  }
  if (!choice->is_object()) return bad_request("tool_choice must be a string or an object", "tool_choice");
  std::string name;
  if (auto e = required_string(choice->get_object(), "name", "tool_choice", name)) return e;
  for (const recipe::ToolDefinition& tool : conversation.tools) {
    if (tool.name == name) {
      conversation.tool_choice = {recipe::ToolChoice::Mode::kNamed, name};
      return std::nullopt;
    }
  }
  return bad_request(fmt::format("tool_choice.name '{}' is not one of the request's tools", name), "tool_choice.name");
}

// `reasoning`: {"effort": "none" | "minimal" | "low" | "medium" | "high" | "xhigh" | "max"}. Present (and not
// "none"), it turns thinking mode on; low..max pass through as reasoning_effort (the format checks them);
// without an effort (or "minimal") the format's default applies.
std::optional<ApiError> apply_reasoning(const json::value* reasoning, recipe::Conversation& conversation) {
  if (reasoning == nullptr) return std::nullopt;
  if (!reasoning->is_object()) return bad_request("reasoning must be an object", "reasoning");
  const json::value* effort = present(reasoning->get_object(), "effort");
  if (effort != nullptr && !effort->is_string()) {
    return bad_request("reasoning.effort must be a string", "reasoning.effort");
  }
  const std::string value = effort != nullptr ? std::string(effort->get_string()) : "minimal";
  if (value == "none") {
    conversation.options.thinking = false;
    return std::nullopt;
  }
  if (value != "minimal" && value != "low" && value != "medium" && value != "high" && value != "xhigh" &&
      value != "max") {
    return bad_request(
        fmt::format("reasoning.effort must be none, minimal, low, medium, high, xhigh or max, got \"{}\"", value),
        "reasoning.effort");
  }
  conversation.options.thinking = true;
  if (value != "minimal") conversation.options.reasoning_effort = value;
  return std::nullopt;
}

// `text`: {"format": {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema",
// "description"?, "strict"?}}. A JSON format becomes the chat dialect's response_format (same prompt: V3.2 and
// later describe it to the model; the other formats refuse it when rendering). Other keys are refused.
std::optional<ApiError> apply_text_format(const json::value* text, recipe::Conversation& conversation) {
  if (text == nullptr) return std::nullopt;
  if (!text->is_object()) return bad_request("text must be an object", "text");
  for (const auto& [key, value] : text->get_object()) {
    if (key != "format") {
      return bad_request(fmt::format("text.{} is not supported; only text.format is", std::string(key)),
                         "text." + std::string(key));
    }
    if (value.is_null()) continue;
    if (!value.is_object()) return bad_request("text.format must be an object", "text.format");
    const json::object& format = value.get_object();
    std::string type;
    if (auto e = required_string(format, "type", "text.format", type)) return e;
    if (type == "text") continue;
    if (type == "json_object") {
      conversation.options.response_format = json::object{{"type", "json_object"}};
    } else if (type == "json_schema") {
      json::object schema;
      for (const auto& [field, item] : format) {
        if (field != "type") schema[field] = item;
      }
      if (!schema.contains("name") || !schema.at("name").is_string()) {
        return bad_request("text.format.name must be a string", "text.format.name");
      }
      if (!schema.contains("schema") || !schema.at("schema").is_object()) {
        return bad_request("text.format.schema must be an object", "text.format.schema");
      }
      conversation.options.response_format = json::object{{"type", "json_schema"}, {"json_schema", std::move(schema)}};
    } else {
      return bad_request(fmt::format("text.format.type must be text, json_object or json_schema, got \"{}\"", type),
                         "text.format.type");
    }
  }
  return std::nullopt;
}

std::string sse_event(std::string_view type, json::object data) {
  return fmt::format("event: {}\ndata: {}\n\n", type, to_json_text(data));
}

class ResponsesWriter final : public ResponseWriter {
 public:
  ResponsesWriter(const ApiContext& context, bool stream, json::object echo)
      : id_(random_id("resp_")),
        created_at_(unix_time()),
        model_(context.model->served_model_name),
        stream_(stream),
        echo_(std::move(echo)) {}

  std::string start(const FinishInfo& info) override {
    std::string out = event("response.created", {{"response", response("in_progress", json::array{}, info, false)}});
    out += event("response.in_progress", {{"response", response("in_progress", json::array{}, info, false)}});
    return out;
  }

  std::string deltas(const std::vector<recipe::StreamEvent>& events, std::vector<TokenLogprobs>& logprobs) override {
    logprobs.clear();
    std::string out;
    for (const recipe::StreamEvent& e : events) {
      switch (e.kind) {
        case Kind::kReasoning:
          if (open_ != Item::kReasoning) {
            out += close();
            out += open(Item::kReasoning, {{"type", "reasoning"},
                                           {"id", random_id("rs_")},
                                           {"summary", json::array{}},
                                           {"content", json::array{}}});
            out += part_event("response.content_part.added", {{"type", "reasoning_text"}, {"text", ""}});
          }
          text_ += e.text;
          out += item_event("response.reasoning_text.delta", {{"content_index", 0}, {"delta", e.text}});
          break;
        case Kind::kContent:
          if (open_ != Item::kMessage) {
            out += close();
            out += open(Item::kMessage, {{"type", "message"},
                                         {"id", random_id("msg_")},
                                         {"status", "in_progress"},
                                         {"role", "assistant"},
                                         {"content", json::array{}}});
            out += part_event("response.content_part.added", output_text(""));
          }
          text_ += e.text;
          out += item_event("response.output_text.delta",
                            {{"content_index", 0}, {"delta", e.text}, {"logprobs", json::array{}}});
          break;
        case Kind::kToolCallBegin:
          out += close();
          out += open(Item::kFunctionCall, {{"type", "function_call"},
                                            {"id", random_id("fc_")},
                                            {"call_id", e.tool_id},
                                            {"name", e.tool_name},
                                            {"arguments", ""},
                                            {"status", "in_progress"}});
          break;
        case Kind::kToolArguments:
          if (open_ != Item::kFunctionCall) break;
          text_ += e.text;
          out += item_event("response.function_call_arguments.delta", {{"delta", e.text}});
          break;
        case Kind::kToolCallEnd:
          if (open_ == Item::kFunctionCall) out += close();
          break;
      }
    }
    return out;
  }

  std::string finish(const OutputMessage& message, const FinishInfo& info, std::vector<TokenLogprobs>&) override {
    const bool incomplete = info.kind == FinishInfo::Kind::kLength;
    if (!stream_) {
      return to_json_text(response(incomplete ? "incomplete" : "completed", output_items(message), info, true));
    }
    std::string out = close();
    out += event(incomplete ? "response.incomplete" : "response.completed",
                 {{"response", response(incomplete ? "incomplete" : "completed", output_, info, true)}});
    return out;
  }

  std::string stream_error(const ApiError& error) override {
    json::object data{{"code", error.code.empty() ? json::value(nullptr) : json::value(error.code)},
                      {"message", error.message},
                      {"param", error.param.empty() ? json::value(nullptr) : json::value(error.param)}};
    return event("error", std::move(data));
  }

 private:
  enum class Item { kNone, kReasoning, kMessage, kFunctionCall };

  static json::object output_text(std::string_view text) {
    return {{"type", "output_text"}, {"text", text}, {"annotations", json::array{}}};
  }

  // The non-streaming output: reasoning, then the message, then the function calls.
  static json::array output_items(const OutputMessage& message) {
    json::array items;
    if (!message.reasoning.empty()) {
      items.push_back({{"type", "reasoning"},
                       {"id", random_id("rs_")},
                       {"summary", json::array{}},
                       {"content", json::array{{{"type", "reasoning_text"}, {"text", message.reasoning}}}}});
    }
    if (!message.content.empty() || message.tool_calls.empty()) {
      items.push_back({{"type", "message"},
                       {"id", random_id("msg_")},
                       {"status", "completed"},
                       {"role", "assistant"},
                       {"content", json::array{output_text(message.content)}}});
    }
    for (const OutputToolCall& call : message.tool_calls) {
      items.push_back({{"type", "function_call"},
                       {"id", random_id("fc_")},
                       {"call_id", call.id},
                       {"name", call.name},
                       {"arguments", call.arguments_text},
                       {"status", "completed"}});
    }
    return items;
  }

  json::object response(std::string_view status, json::array output, const FinishInfo& info, bool final) const {
    json::object out{{"id", id_},        {"object", "response"},       {"created_at", created_at_},
                     {"status", status}, {"error", nullptr},           {"incomplete_details", nullptr},
                     {"model", model_},  {"output", std::move(output)}};
    if (status == "incomplete") out["incomplete_details"] = json::object{{"reason", "max_output_tokens"}};
    for (const auto& [key, value] : echo_) out[key] = value;
    if (final) {
      out["usage"] = json::object{{"input_tokens", info.prompt_tokens},
                                  {"input_tokens_details", {{"cached_tokens", info.cached_tokens}}},
                                  {"output_tokens", info.completion_tokens},
                                  // Not counted yet: the output parser does not attribute tokens to reasoning.
                                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                                  {"total_tokens", info.prompt_tokens + info.completion_tokens}};
    } else {
      out["usage"] = nullptr;
    }
    return out;
  }

  std::string event(std::string_view type, json::object data) {
    json::object out{{"type", type}, {"sequence_number", sequence_number_++}};
    for (auto& [key, value] : data) out[key] = std::move(value);
    return sse_event(type, std::move(out));
  }

  // An event about the open item (item_id, output_index).
  std::string item_event(std::string_view type, json::object data) {
    json::object out{{"item_id", item_["id"]}, {"output_index", static_cast<int64_t>(output_.size())}};
    for (auto& [key, value] : data) out[key] = std::move(value);
    return event(type, std::move(out));
  }

  std::string part_event(std::string_view type, json::object part) {
    return item_event(type, {{"content_index", 0}, {"part", std::move(part)}});
  }

  std::string open(Item kind, json::object item) {
    open_ = kind;
    item_ = std::move(item);
    text_.clear();
    return event("response.output_item.added",
                 {{"output_index", static_cast<int64_t>(output_.size())}, {"item", item_}});
  }

  // Closes the open item: its *.done events, and it joins the final output.
  std::string close() {
    std::string out;
    switch (open_) {
      case Item::kNone:
        return out;
      case Item::kReasoning: {
        json::object part{{"type", "reasoning_text"}, {"text", text_}};
        out += item_event("response.reasoning_text.done", {{"content_index", 0}, {"text", text_}});
        out += part_event("response.content_part.done", part);
        item_["content"] = json::array{std::move(part)};
        break;
      }
      case Item::kMessage: {
        out += item_event("response.output_text.done",
                          {{"content_index", 0}, {"text", text_}, {"logprobs", json::array{}}});
        out += part_event("response.content_part.done", output_text(text_));
        item_["content"] = json::array{output_text(text_)};
        item_["status"] = "completed";
        break;
      }
      case Item::kFunctionCall:
        out += item_event("response.function_call_arguments.done", {{"name", item_["name"]}, {"arguments", text_}});
        item_["arguments"] = text_;
        item_["status"] = "completed";
        break;
    }
    out +=
        event("response.output_item.done", {{"output_index", static_cast<int64_t>(output_.size())}, {"item", item_}});
    output_.push_back(std::move(item_));
    item_ = {};
    open_ = Item::kNone;
    return out;
  }

  std::string id_;
  int64_t created_at_;
  std::string model_;
  bool stream_;
  json::object echo_;  // request fields the response object repeats (instructions, tools, ...)
  int64_t sequence_number_ = 0;
  Item open_ = Item::kNone;
  json::object item_;  // the open item
  std::string text_;   // the open item's text or arguments so far
  json::array output_;
};

}  // namespace

ApiResult<GenerationPlan> plan_responses(const json::value& request, const ApiContext& context) {
  const json::object& body = request.get_object();
  if (auto e = check_model(body, *context.model, false)) return *e;
  if (present(body, "previous_response_id") != nullptr) {
    return bad_request(
        "previous_response_id is not supported: responses are not stored; send the whole "
        "conversation in input",
        "previous_response_id");
  }
  if (present(body, "conversation") != nullptr) {
    return bad_request("conversation is not supported: send the whole conversation in input", "conversation");
  }

  recipe::Conversation conversation;
  std::optional<std::string> instructions;
  if (auto e = read_string(body, "instructions", instructions)) return *e;
  if (instructions) {
    recipe::Message system;
    system.role = recipe::Role::kSystem;
    system.content.push_back(text_part(*instructions));
    conversation.messages.push_back(std::move(system));
  }
  const json::value* input = present(body, "input");
  if (input == nullptr) return bad_request("input is required", "input");
  if (auto e = InputReader(conversation).read(*input)) return *e;
  if (auto e = convert_tools(present(body, "tools"), conversation)) return *e;
  if (auto e = apply_tool_choice(present(body, "tool_choice"), conversation)) return *e;
  if (auto e = apply_reasoning(present(body, "reasoning"), conversation)) return *e;
  if (auto e = apply_text_format(present(body, "text"), conversation)) return *e;
  std::optional<bool> parallel, store;
  if (auto e = read_bool(body, "parallel_tool_calls", parallel)) return *e;
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
  if (auto e = fit_context(context, static_cast<int64_t>(prompt->token_ids.size()), max_output_tokens,
                           "max_output_tokens", plan.params)) {
    e->param = e->param.empty() ? "input" : e->param;
    return *e;
  }
  if (Status s = plan.params.validate(context.model->vocab_size); !s.ok()) return bad_request_from(s);

  json::object echo{
      {"instructions", instructions ? json::value(*instructions) : json::value(nullptr)},
      {"max_output_tokens", max_output_tokens ? json::value(*max_output_tokens) : json::value(nullptr)},
      {"parallel_tool_calls", parallel.value_or(true)},
      {"temperature", float_for_json(plan.params.temperature)},
      {"top_p", float_for_json(plan.params.top_p)},
      {"tool_choice", body.contains("tool_choice") ? body.at("tool_choice") : json::value("auto")},
      {"tools", body.contains("tools") && body.at("tools").is_array() ? body.at("tools") : json::value(json::array{})}};
  add_turn_marker_stops(context, plan.params);
  // Where the answer starts (reasoning, a prefilled tool-call block) and what it may hold (tools, JSON).
  recipe::StreamParserOptions options = recipe::stream_parser_options(conversation, *prompt);
  plan.dialect = Dialect::kOpenAI;
  plan.prompt_token_ids = std::move(prompt->token_ids);
  plan.builder = std::make_unique<OutputBuilder>(recipe::StreamParser(context.chat_format, context.tokenizer, options),
                                                 std::move(stops));
  plan.writer = std::make_unique<ResponsesWriter>(context, plan.stream, std::move(echo));
  return plan;
}

}  // namespace deepinfer::server
