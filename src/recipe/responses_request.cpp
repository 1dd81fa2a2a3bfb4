// OpenAI Responses request -> Conversation. One validating pass; the first error wins and names the field's
// JSON path (the server derives the error's `param` from it).
#include "deepinfer/recipe/responses_request.h"

#include <boost/json.hpp>

#include "request_json.h"

namespace deepinfer::recipe {
namespace json = boost::json;
namespace {

using request_json::indexed;
using request_json::kind_name;
using request_json::present;
using request_json::quoted;
using request_json::required_string;

ContentPart text_part(std::string_view text) { return {ContentPart::Kind::kText, std::string(text), {}}; }

// A message's `content`: a string, or parts of type input_text / output_text (and input_image for users).
Status message_content(const json::value* content, const std::string& path, bool assistant, Message& message) {
  if (content == nullptr) return Status::invalid_argument(path + " is required");
  if (content->is_string()) {
    message.content.push_back(text_part(content->get_string()));
    return Status();
  }
  if (!content->is_array()) return Status::invalid_argument(path + " must be a string or an array of content parts");
  const json::array& parts = content->get_array();
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string part_path = indexed(path, i);
    if (!parts[i].is_object()) return Status::invalid_argument(part_path + " must be an object");
    const json::object& part = parts[i].get_object();
    std::string type;
    if (Status s = required_string(part, "type", part_path, type); !s.ok()) return s;
    if (type == "input_text" || type == "output_text") {
      std::string text;
      if (Status s = required_string(part, "text", part_path, text); !s.ok()) return s;
      message.content.push_back(text_part(text));
    } else if (type == "refusal" && assistant) {
      std::string text;
      if (Status s = required_string(part, "refusal", part_path, text); !s.ok()) return s;
      message.content.push_back(text_part(text));
    } else if (type == "input_image" && !assistant) {
      ContentPart image;
      image.kind = ContentPart::Kind::kImage;
      if (Status s = required_string(part, "image_url", part_path, image.image_url); !s.ok()) return s;
      message.content.push_back(std::move(image));
    } else {
      return Status::invalid_argument(part_path + ".type " + quoted(type) + " is not supported in a" +
                                      (assistant ? "n assistant" : " user, system or developer") + " message");
    }
  }
  if (message.content.empty()) message.content.push_back(text_part(""));
  return Status();
}

// Builds the conversation from `input` (see the header for how assistant turns are gathered).
class InputReader {
 public:
  explicit InputReader(Conversation& conversation) : conversation_(conversation) {}

  Status read(const json::value& input) {
    if (input.is_string()) {
      Message message;
      message.role = Role::kUser;
      message.content.push_back(text_part(input.get_string()));
      conversation_.messages.push_back(std::move(message));
      return Status();
    }
    if (!input.is_array()) return Status::invalid_argument("input must be a string or an array of input items");
    const json::array& items = input.get_array();
    if (items.empty()) return Status::invalid_argument("input must not be empty");
    for (size_t i = 0; i < items.size(); ++i) {
      if (Status s = item(items[i], indexed("input", i)); !s.ok()) return s;
    }
    if (pending_reasoning_) {
      // Reasoning with no assistant turn after it: nothing to attach it to; it would render nowhere.
      return Status::invalid_argument(pending_reasoning_path_ +
                                      " is a reasoning item not followed by an assistant message or function_call");
    }
    return Status();
  }

 private:
  Status item(const json::value& value, const std::string& path) {
    if (!value.is_object()) return Status::invalid_argument(path + " must be an object");
    const json::object& object = value.get_object();
    std::string type = "message";  // an item with a role and no type is a message (EasyInputMessage)
    if (const json::value* t = present(object, "type")) {
      if (!t->is_string()) return Status::invalid_argument(path + ".type must be a string");
      type = t->get_string();
    }
    if (type == "message") return message(object, path);
    if (type == "function_call") return function_call(object, path);
    if (type == "function_call_output") return function_call_output(object, path);
    if (type == "reasoning") return reasoning(object, path);
    return Status::invalid_argument(path + ".type " + quoted(type) +
                                    " is not supported: use message, function_call, function_call_output or reasoning");
  }

  Status message(const json::object& object, const std::string& path) {
    std::string role;
    if (Status s = required_string(object, "role", path, role); !s.ok()) return s;
    Message message;
    if (role == "user") {
      message.role = Role::kUser;
    } else if (role == "assistant") {
      message.role = Role::kAssistant;
    } else if (role == "system") {
      message.role = Role::kSystem;
    } else if (role == "developer") {
      message.role = Role::kDeveloper;
    } else {
      return Status::invalid_argument(
          path + ".role must be \"user\", \"assistant\", \"system\" or \"developer\", got " + quoted(role));
    }
    const bool assistant = message.role == Role::kAssistant;
    if (Status s = message_content(present(object, "content"), path + ".content", assistant, message); !s.ok()) {
      return s;
    }
    if (assistant) {
      take_reasoning(message);
    } else if (pending_reasoning_) {
      return Status::invalid_argument(pending_reasoning_path_ + " is a reasoning item followed by a " + role +
                                      " message; it must precede an assistant message or function_call");
    }
    conversation_.messages.push_back(std::move(message));
    last_is_assistant_ = assistant;
    return Status();
  }

  Status function_call(const json::object& object, const std::string& path) {
    ToolCall call;
    if (Status s = required_string(object, "call_id", path, call.id); !s.ok()) return s;
    if (Status s = required_string(object, "name", path, call.name); !s.ok()) return s;
    const json::value* arguments = present(object, "arguments");
    const std::string arguments_path = path + ".arguments";
    if (arguments == nullptr || !arguments->is_string()) {
      return Status::invalid_argument(arguments_path + " must be a string holding a JSON object");
    }
    boost::system::error_code ec;
    json::value parsed = json::parse(arguments->get_string(), ec);
    if (ec) {
      return Status::invalid_argument(arguments_path + " is not valid JSON (" + ec.message() +
                                      "): " + std::string(arguments->get_string()).substr(0, 80));
    }
    if (!parsed.is_object()) return Status::invalid_argument(arguments_path + " must hold a JSON object");
    call.arguments = std::move(parsed.get_object());
    if (!last_is_assistant_ || pending_reasoning_) {
      // A new assistant turn that only calls tools (content null, as the chat endpoint renders it).
      Message message;
      message.role = Role::kAssistant;
      message.content_is_null = true;
      take_reasoning(message);
      conversation_.messages.push_back(std::move(message));
      last_is_assistant_ = true;
    }
    conversation_.messages.back().tool_calls.push_back(std::move(call));
    return Status();
  }

  Status function_call_output(const json::object& object, const std::string& path) {
    if (pending_reasoning_) {
      return Status::invalid_argument(pending_reasoning_path_ +
                                      " is a reasoning item followed by a function_call_output; it must precede an "
                                      "assistant message or function_call");
    }
    Message message;
    message.role = Role::kTool;
    if (Status s = required_string(object, "call_id", path, message.tool_call_id); !s.ok()) return s;
    const json::value* output = present(object, "output");
    if (output != nullptr && output->is_array()) {
      if (Status s = message_content(output, path + ".output", false, message); !s.ok()) return s;
    } else if (output != nullptr && output->is_string()) {
      message.content.push_back(text_part(output->get_string()));
    } else {
      return Status::invalid_argument(path + ".output must be a string or an array of content parts");
    }
    conversation_.messages.push_back(std::move(message));
    last_is_assistant_ = false;
    return Status();
  }

  // {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}], "summary": [{"type": "summary_text",
  // "text"}]}: the full text when given, else the summary; parts are concatenated.
  Status reasoning(const json::object& object, const std::string& path) {
    std::string text;
    bool found = false;
    for (const char* key : {"content", "summary"}) {
      const json::value* parts = present(object, key);
      if (parts == nullptr) continue;
      const std::string parts_path = path + "." + key;
      if (!parts->is_array()) return Status::invalid_argument(parts_path + " must be an array");
      for (size_t i = 0; i < parts->get_array().size(); ++i) {
        const std::string part_path = indexed(parts_path, i);
        const json::value& part = parts->get_array()[i];
        if (!part.is_object()) return Status::invalid_argument(part_path + " must be an object");
        std::string piece;
        if (Status s = required_string(part.get_object(), "text", part_path, piece); !s.ok()) return s;
        if (!found) text += piece;
      }
      if (!parts->get_array().empty()) found = true;
    }
    pending_reasoning_ = pending_reasoning_.value_or("") + text;
    pending_reasoning_path_ = path;
    return Status();
  }

  void take_reasoning(Message& message) {
    if (pending_reasoning_) message.reasoning_content = std::move(*pending_reasoning_);
    pending_reasoning_.reset();
  }

  Conversation& conversation_;
  bool last_is_assistant_ = false;
  std::optional<std::string> pending_reasoning_;
  std::string pending_reasoning_path_;
};

// Flat function tools {type: "function", name, description, parameters, strict} -> the OpenAI function object
// {name, description, parameters}, the shape the renderers print.
Status convert_tools(const json::value* tools, Conversation& conversation) {
  if (tools == nullptr) return Status();
  if (!tools->is_array()) return Status::invalid_argument("tools must be an array");
  const json::array& list = tools->get_array();
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = indexed("tools", i);
    if (!list[i].is_object()) return Status::invalid_argument(path + " must be an object");
    const json::object& tool = list[i].get_object();
    std::string type;
    if (Status s = required_string(tool, "type", path, type); !s.ok()) return s;
    if (type != "function") {
      return Status::invalid_argument(path + ".type " + quoted(type) + " is not supported: only function tools are");
    }
    std::string name;
    if (Status s = required_string(tool, "name", path, name); !s.ok()) return s;
    if (name.empty()) return Status::invalid_argument(path + ".name must not be empty");
    json::object function{{"name", name}};
    if (const json::value* description = present(tool, "description")) {
      if (!description->is_string()) return Status::invalid_argument(path + ".description must be a string");
      function["description"] = *description;
    }
    if (const json::value* parameters = present(tool, "parameters")) {
      if (!parameters->is_object()) return Status::invalid_argument(path + ".parameters must be a JSON Schema object");
      function["parameters"] = *parameters;
    }
    // strict is true by default in this API (every Responses client sends function tools so): taken, type-checked,
    // and not enforced (no constrained decoding; the README says so). The chat dialect, where it is opt-in, refuses
    // true (request_json::refuse_strict).
    bool strict = false;
    if (Status s = request_json::read_strict(tool, path, strict); !s.ok()) return s;
    conversation.tools.push_back({name, std::move(function)});
  }
  return Status();
}

// tool_choice: "none" | "auto" | "required" | {"type": "function", "name"}; as in the chat dialect, "none" drops
// the tools; required and named are recorded for the renderer to honour or refuse.
Status apply_tool_choice(const json::value* choice, Conversation& conversation) {
  if (choice == nullptr) return Status();
  if (choice->is_string()) {
    const std::string_view mode = choice->get_string();
    if (mode == "none") {
      conversation.tools.clear();
    } else if (mode == "required") {
      if (conversation.tools.empty()) return Status::invalid_argument("tool_choice \"required\" needs tools");
      conversation.tool_choice.mode = ToolChoice::Mode::kRequired;
    } else if (mode != "auto") {
      return Status::invalid_argument(
          "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}, got " +
          quoted(mode));
    }
    return Status();
  }
  if (!choice->is_object()) return Status::invalid_argument("tool_choice must be a string or an object");
  std::string name;
  if (Status s = required_string(choice->get_object(), "name", "tool_choice", name); !s.ok()) return s;
  for (const ToolDefinition& tool : conversation.tools) {
    if (tool.name == name) {
      conversation.tool_choice = {ToolChoice::Mode::kNamed, name};
      return Status();
    }
  }
  return Status::invalid_argument("tool_choice.name '" + name + "' is not one of the request's tools");
}

// `reasoning`: {"effort": "none" | "minimal" | "low" | "medium" | "high" | "xhigh" | "max"}. Present (and not
// "none"), it turns thinking mode on; low..max pass through as reasoning_effort (the format checks them);
// without an effort (or "minimal") the format's default applies.
Status apply_reasoning(const json::value* reasoning, Conversation& conversation) {
  if (reasoning == nullptr) return Status();
  if (!reasoning->is_object()) return Status::invalid_argument("reasoning must be an object");
  const json::value* effort = present(reasoning->get_object(), "effort");
  if (effort != nullptr && !effort->is_string()) return Status::invalid_argument("reasoning.effort must be a string");
  const std::string value = effort != nullptr ? std::string(effort->get_string()) : "minimal";
  if (value == "none") {
    conversation.options.thinking = false;
    return Status();
  }
  if (value != "minimal" && value != "low" && value != "medium" && value != "high" && value != "xhigh" &&
      value != "max") {
    return Status::invalid_argument("reasoning.effort must be none, minimal, low, medium, high, xhigh or max, got " +
                                    quoted(value));
  }
  conversation.options.thinking = true;
  if (value != "minimal") conversation.options.reasoning_effort = value;
  return Status();
}

// `text`: {"format": {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema",
// "description"?, "strict"?}}. A JSON format becomes the chat dialect's response_format (same prompt: V3.2 and
// later describe it to the model; the other formats refuse it when rendering). Other keys are refused.
Status apply_text_format(const json::value* text, Conversation& conversation) {
  if (text == nullptr) return Status();
  if (!text->is_object()) return Status::invalid_argument("text must be an object");
  for (const auto& [key, value] : text->get_object()) {
    if (key != "format") {
      return Status::invalid_argument("text." + std::string(key) + " is not supported; only text.format is");
    }
    if (value.is_null()) continue;
    if (!value.is_object()) return Status::invalid_argument("text.format must be an object");
    const json::object& format = value.get_object();
    std::string type;
    if (Status s = required_string(format, "type", "text.format", type); !s.ok()) return s;
    if (type == "text") continue;
    if (type == "json_object") {
      conversation.options.response_format = json::object{{"type", "json_object"}};
    } else if (type == "json_schema") {
      json::object schema;
      for (const auto& [field, item] : format) {
        if (field != "type") schema[field] = item;
      }
      if (!schema.contains("name") || !schema.at("name").is_string()) {
        return Status::invalid_argument("text.format.name must be a string");
      }
      if (!schema.contains("schema") || !schema.at("schema").is_object()) {
        return Status::invalid_argument("text.format.schema must be an object");
      }
      if (Status s = request_json::refuse_strict(format, "text.format"); !s.ok()) return s;
      conversation.options.response_format = json::object{{"type", "json_schema"}, {"json_schema", std::move(schema)}};
    } else {
      return Status::invalid_argument("text.format.type must be text, json_object or json_schema, got " + quoted(type));
    }
  }
  return Status();
}

}  // namespace

Result<Conversation> conversation_from_responses(const json::value& request) {
  if (!request.is_object()) return Status::invalid_argument("the request must be a JSON object");
  const json::object& body = request.get_object();
  Conversation conversation;
  if (const json::value* instructions = present(body, "instructions")) {
    if (!instructions->is_string()) {
      return Status::invalid_argument("instructions must be a string, got " + std::string(kind_name(*instructions)));
    }
    Message system;
    system.role = Role::kSystem;
    system.content.push_back(text_part(instructions->get_string()));
    conversation.messages.push_back(std::move(system));
  }
  const json::value* input = present(body, "input");
  if (input == nullptr) return Status::invalid_argument("input is required");
  if (Status s = InputReader(conversation).read(*input); !s.ok()) return s;
  if (Status s = convert_tools(present(body, "tools"), conversation); !s.ok()) return s;
  if (Status s = apply_tool_choice(present(body, "tool_choice"), conversation); !s.ok()) return s;
  if (const json::value* parallel = present(body, "parallel_tool_calls"); parallel != nullptr) {
    if (!parallel->is_bool()) {
      return Status::invalid_argument("parallel_tool_calls must be a boolean, got " + std::string(kind_name(*parallel)));
    }
    conversation.tool_choice.parallel = parallel->get_bool();
  }
  if (Status s = apply_reasoning(present(body, "reasoning"), conversation); !s.ok()) return s;
  if (Status s = apply_text_format(present(body, "text"), conversation); !s.ok()) return s;
  return conversation;
}

json::object responses_echo(const json::object& request, std::optional<int64_t> max_output_tokens,
                            bool parallel_tool_calls, double temperature, double top_p) {
  const json::value* instructions = present(request, "instructions");
  const json::value* tools = request.if_contains("tools");
  return {{"instructions", instructions != nullptr ? *instructions : json::value(nullptr)},
          {"max_output_tokens", max_output_tokens ? json::value(*max_output_tokens) : json::value(nullptr)},
          {"parallel_tool_calls", parallel_tool_calls},
          {"temperature", temperature},
          {"top_p", top_p},
          {"tool_choice", request.contains("tool_choice") ? request.at("tool_choice") : json::value("auto")},
          {"tools", tools != nullptr && tools->is_array() ? *tools : json::value(json::array{})}};
}

}  // namespace deepinfer::recipe
