// OpenAI Chat Completions request -> Conversation. One validating pass; the first error wins and names
// the field's JSON path.
#include "deepinfer/recipe/openai_request.h"

#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "request_json.h"

namespace deepinfer::recipe {
namespace json = boost::json;
namespace {

using request_json::kind_name;
using request_json::whole_number;

Status type_error(const std::string& path, std::string_view expected, const json::value& got) {
  return Status::invalid_argument(path + " must be " + std::string(expected) + ", got " + kind_name(got));
}

// Parses a content field: a string, null, or an array of {"type": "text"|"image_url", ...} parts.
Status parse_content(const json::value& content, const std::string& path, Message& message) {
  if (content.is_null()) {
    message.content_is_null = true;
    return Status();
  }
  if (content.is_string()) {
    message.content.push_back({ContentPart::Kind::kText, std::string(content.get_string()), {}});
    return Status();
  }
  if (!content.is_array()) return type_error(path, "a string, an array of content parts or null", content);
  const json::array& parts = content.get_array();
  if (parts.empty()) return Status::invalid_argument(path + " must not be an empty array (OpenAI's rule)");
  for (size_t i = 0; i < parts.size(); ++i) {
    std::string part_path = path + "[" + std::to_string(i) + "]";
    if (!parts[i].is_object()) return type_error(part_path, "an object", parts[i]);
    const json::object& part = parts[i].get_object();
    const json::value* type = part.if_contains("type");
    if (type == nullptr || !type->is_string()) return Status::invalid_argument(part_path + ".type must be a string");
    std::string_view type_name = type->get_string();
    if (type_name == "text" || type_name == "input_text") {
      const json::value* text = part.if_contains("text");
      if (text == nullptr || !text->is_string()) return Status::invalid_argument(part_path + ".text must be a string");
      message.content.push_back({ContentPart::Kind::kText, std::string(text->get_string()), {}});
    } else if (type_name == "image_url") {
      const json::value* image = part.if_contains("image_url");
      std::string url;
      if (image != nullptr && image->is_string()) {
        url = image->get_string();
      } else if (image != nullptr && image->is_object() && image->get_object().if_contains("url") &&
                 image->get_object().at("url").is_string()) {
        url = image->get_object().at("url").get_string();
      } else {
        return Status::invalid_argument(part_path + ".image_url must be a string or an object with a string url");
      }
      message.content.push_back({ContentPart::Kind::kImage, {}, std::move(url)});
    } else {
      return Status::invalid_argument(part_path + ".type '" + std::string(type_name) +
                                      "' is not supported; expected text or image_url");
    }
  }
  return Status();
}

Status parse_tool_call(const json::value& value, const std::string& path, ToolCall& call) {
  if (!value.is_object()) return type_error(path, "an object", value);
  const json::object& object = value.get_object();
  if (const json::value* id = object.if_contains("id")) {
    if (!id->is_string()) return type_error(path + ".id", "a string", *id);
    call.id = id->get_string();
  }
  if (const json::value* type = object.if_contains("type")) {
    if (!type->is_string() || type->get_string() != "function") {
      return Status::invalid_argument(path + ".type must be \"function\"");
    }
  }
  const json::value* function = object.if_contains("function");
  if (function == nullptr || !function->is_object()) {
    return Status::invalid_argument(path + ".function must be an object with name and arguments");
  }
  const json::object& fn = function->get_object();
  const json::value* name = fn.if_contains("name");
  if (name == nullptr || !name->is_string() || name->get_string().empty()) {
    return Status::invalid_argument(path + ".function.name must be a non-empty string");
  }
  call.name = name->get_string();
  const json::value* arguments = fn.if_contains("arguments");
  std::string arguments_path = path + ".function.arguments";
  if (arguments == nullptr || arguments->is_null()) return Status();  // no arguments: {}
  if (arguments->is_object()) {
    call.arguments = arguments->get_object();
    return Status();
  }
  if (!arguments->is_string()) return type_error(arguments_path, "a JSON string or an object", *arguments);
  std::string_view text = arguments->get_string();
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) return Status();  // "" means {}
  boost::system::error_code ec;
  json::value parsed = json::parse(text, ec);
  if (ec) {
    return Status::invalid_argument(arguments_path + " is not valid JSON (" + ec.message() + "): " +
                                    std::string(text.substr(0, 200)));
  }
  if (!parsed.is_object()) return type_error(arguments_path, "a JSON object", parsed);
  call.arguments = std::move(parsed.get_object());
  return Status();
}

Status parse_message(const json::value& value, const std::string& path, Message& message) {
  if (!value.is_object()) return type_error(path, "an object", value);
  const json::object& object = value.get_object();
  const json::value* role = object.if_contains("role");
  if (role == nullptr || !role->is_string()) return Status::invalid_argument(path + ".role must be a string");
  Result<Role> parsed_role = parse_role(role->get_string());
  if (!parsed_role.ok()) return Status::invalid_argument(path + ".role: " + parsed_role.status().message());
  message.role = *parsed_role;

  const json::value* content = object.if_contains("content");
  if (content == nullptr) {
    message.content_is_null = true;
  } else if (Status s = parse_content(*content, path + ".content", message); !s.ok()) {
    return s;
  }
  if (message.role != Role::kAssistant && message.content_is_null) {
    return Status::invalid_argument(path + ".content is required for role " + std::string(role_name(message.role)));
  }
  if (const json::value* name = object.if_contains("name")) {
    if (!name->is_string()) return type_error(path + ".name", "a string", *name);
    message.name = name->get_string();
  }
  for (const char* key : {"reasoning_content", "reasoning"}) {
    const json::value* reasoning = object.if_contains(key);
    if (reasoning == nullptr || reasoning->is_null()) continue;
    if (!reasoning->is_string()) return type_error(path + "." + key, "a string", *reasoning);
    if (message.role != Role::kAssistant) {
      return Status::invalid_argument(path + "." + key + " is only allowed on assistant messages");
    }
    message.reasoning_content = std::string(reasoning->get_string());
    break;
  }
  if (const json::value* calls = object.if_contains("tool_calls"); calls != nullptr && !calls->is_null()) {
    if (message.role != Role::kAssistant) {
      return Status::invalid_argument(path + ".tool_calls is only allowed on assistant messages");
    }
    if (!calls->is_array()) return type_error(path + ".tool_calls", "an array", *calls);
    const json::array& list = calls->get_array();
    for (size_t i = 0; i < list.size(); ++i) {
      ToolCall call;
      if (Status s = parse_tool_call(list[i], path + ".tool_calls[" + std::to_string(i) + "]", call); !s.ok()) {
        return s;
      }
      message.tool_calls.push_back(std::move(call));
    }
  }
  if (message.role == Role::kAssistant && message.content_is_null && message.tool_calls.empty()) {
    return Status::invalid_argument(path + " is an assistant message with neither content nor tool_calls");
  }
  if (const json::value* id = object.if_contains("tool_call_id"); id != nullptr && !id->is_null()) {
    if (!id->is_string()) return type_error(path + ".tool_call_id", "a string", *id);
    message.tool_call_id = id->get_string();
  }
  if (const json::value* prefix = object.if_contains("prefix"); prefix != nullptr && !prefix->is_null()) {
    if (!prefix->is_bool()) return type_error(path + ".prefix", "a boolean", *prefix);
    message.prefix = prefix->get_bool();
  }
  return Status();
}

Status parse_tool(const json::value& value, const std::string& path, ToolDefinition& out) {
  if (!value.is_object()) return type_error(path, "an object", value);
  const json::object& tool = value.get_object();
  const json::value* type = tool.if_contains("type");
  if (type != nullptr && (!type->is_string() || type->get_string() != "function")) {
    return Status::invalid_argument(path + ".type must be \"function\"");
  }
  const json::value* function = tool.if_contains("function");
  if (function == nullptr || !function->is_object()) {
    return Status::invalid_argument(path + ".function must be an object");
  }
  const json::value* name = function->get_object().if_contains("name");
  if (name == nullptr || !name->is_string() || name->get_string().empty()) {
    return Status::invalid_argument(path + ".function.name must be a non-empty string");
  }
  if (const json::value* parameters = function->get_object().if_contains("parameters");
      parameters != nullptr && !parameters->is_object()) {
    return type_error(path + ".function.parameters", "a JSON Schema object", *parameters);
  }
  if (Status s = request_json::refuse_strict(function->get_object(), path + ".function"); !s.ok()) return s;
  out = {std::string(name->get_string()), function->get_object()};
  return Status();
}

Status parse_tools(const json::value& value, std::vector<ToolDefinition>& tools) {
  if (value.is_null()) return Status();
  if (!value.is_array()) return type_error("tools", "an array", value);
  const json::array& list = value.get_array();
  for (size_t i = 0; i < list.size(); ++i) {
    ToolDefinition tool;
    if (Status s = parse_tool(list[i], "tools[" + std::to_string(i) + "]", tool); !s.ok()) return s;
    for (const ToolDefinition& earlier : tools) {
      if (earlier.name == tool.name) {
        return Status::invalid_argument("tools[" + std::to_string(i) + "]: a second tool named \"" + tool.name +
                                        "\" (tool names must be unique)");
      }
    }
    tools.push_back(std::move(tool));
  }
  return Status();
}

// Reads a thinking switch: a bool, or {"type": "enabled"|"disabled"} as Anthropic writes it.
// `thinking`: a boolean, or {"type": "enabled"|"disabled"} (DeepSeek's API), with "enabled" optionally an Anthropic-
// style "budget_tokens" (a positive integer, at most 2^31 - 1), enforced by the server as on /v1/messages. Other keys
// are refused, not ignored.
Status parse_thinking(const json::value& value, const std::string& path, ConversationOptions& options) {
  if (value.is_bool()) {
    options.thinking = value.get_bool();
    return Status();
  }
  if (value.is_object()) {
    const json::object& fields = value.get_object();
    const json::value* type = fields.if_contains("type");
    if (type != nullptr && type->is_string() && (type->get_string() == "enabled" || type->get_string() == "disabled")) {
      options.thinking = type->get_string() == "enabled";
      for (const auto& [key, field] : fields) {
        if (key != "type" && key != "budget_tokens")
          return Status::invalid_argument(path + "." + std::string(key) +
                                          " is not supported (thinking takes \"type\" and \"budget_tokens\")");
      }
      if (const json::value* budget = fields.if_contains("budget_tokens"); budget != nullptr) {
        if (!options.thinking)
          return Status::invalid_argument(path + ".budget_tokens is only allowed with {\"type\": \"enabled\"}");
        const std::optional<double> number = whole_number(*budget);
        if (!number || *number < 1 || *number > INT32_MAX)
          return Status::invalid_argument(path + ".budget_tokens must be an integer from 1 to 2147483647, got " +
                                          json::serialize(*budget));
        options.thinking_budget_tokens = static_cast<int64_t>(*number);
      }
      return Status();
    }
  }
  return Status::invalid_argument(path + " must be a boolean or {\"type\": \"enabled\"|\"disabled\"}");
}

// tool_choice: "none" drops the tools from the prompt; "required" and a named function (one of `tools`) are
// recorded in Conversation::tool_choice, for the renderer to honour or refuse.
Status apply_tool_choice(const json::value& choice, Conversation& conversation) {
  if (choice.is_null()) return Status();
  if (choice.is_string()) {
    std::string_view mode = choice.get_string();
    if (mode == "none") {
      conversation.tools.clear();
      return Status();
    }
    if (mode == "auto") return Status();
    if (mode == "required") {
      if (conversation.tools.empty()) return Status::invalid_argument("tool_choice \"required\" needs tools");
      conversation.tool_choice.mode = ToolChoice::Mode::kRequired;
      return Status();
    }
    return Status::invalid_argument(
        "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": "
        "...}}, got \"" +
        std::string(mode) + "\"");
  }
  if (!choice.is_object()) return Status::invalid_argument("tool_choice must be a string or an object");
  const json::value* function = choice.get_object().if_contains("function");
  const json::value* name =
      function != nullptr && function->is_object() ? function->get_object().if_contains("name") : nullptr;
  if (name == nullptr || !name->is_string()) {
    return Status::invalid_argument("tool_choice.function.name must be a string");
  }
  for (const ToolDefinition& tool : conversation.tools) {
    if (tool.name == name->get_string()) {
      conversation.tool_choice = {ToolChoice::Mode::kNamed, tool.name};
      return Status();
    }
  }
  return Status::invalid_argument("tool_choice.function.name '" + std::string(name->get_string()) +
                                  "' is not one of the request's tools");
}

}  // namespace

Result<Conversation> conversation_from_openai_chat(const json::value& request) {
  if (!request.is_object()) return Status::invalid_argument("the request body must be a JSON object");
  const json::object& body = request.get_object();
  Conversation conversation;
  const json::value* messages = body.if_contains("messages");
  if (messages == nullptr) return Status::invalid_argument("messages is required");
  if (!messages->is_array()) return type_error("messages", "an array", *messages);
  if (messages->get_array().empty()) return Status::invalid_argument("messages must not be empty");
  const json::array& list = messages->get_array();
  conversation.messages.resize(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    if (Status s = parse_message(list[i], "messages[" + std::to_string(i) + "]", conversation.messages[i]); !s.ok()) {
      return s;
    }
  }
  if (const json::value* tools = body.if_contains("tools")) {
    if (Status s = parse_tools(*tools, conversation.tools); !s.ok()) return s;
  }
  ConversationOptions& options = conversation.options;
  // The thinking switches: `thinking`, `chat_template_kwargs.enable_thinking` and `chat_template_kwargs.thinking`.
  // Any of them may be given; two that disagree are a 400 naming both (the official V3.1 template would let
  // `thinking` win silently).
  std::optional<std::pair<std::string, bool>> switched;  // the first switch given, and its value
  auto set_switch = [&](const std::string& path, bool value) -> Status {
    if (switched && switched->second != value)
      return Status::invalid_argument(path + " (" + (value ? "true" : "false") + ") disagrees with " + switched->first +
                                      " (" + (switched->second ? "true" : "false") + "): send one thinking switch");
    if (!switched) switched.emplace(path, value);
    options.thinking = value;
    return Status();
  };
  if (const json::value* thinking = body.if_contains("thinking"); thinking != nullptr && !thinking->is_null()) {
    if (Status s = parse_thinking(*thinking, "thinking", options); !s.ok()) return s;
    if (Status s = set_switch("thinking", options.thinking); !s.ok()) return s;
  }
  if (const json::value* kwargs = body.if_contains("chat_template_kwargs"); kwargs != nullptr && !kwargs->is_null()) {
    if (!kwargs->is_object()) return type_error("chat_template_kwargs", "an object", *kwargs);
    for (const char* key : {"enable_thinking", "thinking"}) {
      const json::value* value = kwargs->get_object().if_contains(key);
      if (value == nullptr) continue;
      const std::string path = std::string("chat_template_kwargs.") + key;
      if (!value->is_bool()) return type_error(path, "a boolean", *value);
      if (Status s = set_switch(path, value->get_bool()); !s.ok()) return s;
    }
  }
  if (const json::value* effort = body.if_contains("reasoning_effort"); effort != nullptr && !effort->is_null()) {
    if (effort->is_string()) {
      // "none" (OpenAI: no reasoning) asks for no effort level; thinking stays as the request's switches say.
      if (effort->get_string() != "none") options.reasoning_effort = std::string(effort->get_string());
    } else if (effort->is_int64()) {
      options.reasoning_effort = std::to_string(effort->get_int64());
    } else {
      return type_error("reasoning_effort", "a string or an integer", *effort);
    }
  }
  if (const json::value* add = body.if_contains("add_generation_prompt"); add != nullptr && !add->is_null()) {
    if (!add->is_bool()) return type_error("add_generation_prompt", "a boolean", *add);
    options.add_generation_prompt = add->get_bool();
  }
  if (const json::value* format = body.if_contains("response_format"); format != nullptr && !format->is_null()) {
    if (!format->is_object()) return type_error("response_format", "an object", *format);
    const json::object& fields = format->get_object();
    const json::value* type = fields.if_contains("type");
    if (type == nullptr || !type->is_string()) {
      return type_error("response_format.type", "a string", type != nullptr ? *type : json::value());
    }
    const std::string_view kind = type->get_string();
    if (kind == "json_schema") {
      // OpenAI's {"type": "json_schema", "json_schema": {"name", "schema"?, "description"?, "strict"?}}.
      const json::value* schema = fields.if_contains("json_schema");
      if (schema == nullptr || !schema->is_object()) {
        return Status::invalid_argument("response_format.json_schema must be an object with a name");
      }
      const json::value* name = schema->get_object().if_contains("name");
      if (name == nullptr || !name->is_string() || name->get_string().empty()) {
        return Status::invalid_argument("response_format.json_schema.name must be a non-empty string");
      }
      if (const json::value* body = schema->get_object().if_contains("schema"); body != nullptr && !body->is_object()) {
        return type_error("response_format.json_schema.schema", "an object", *body);
      }
      if (Status s = request_json::refuse_strict(schema->get_object(), "response_format.json_schema"); !s.ok())
        return s;
    } else if (kind != "text" && kind != "json_object") {
      return Status::invalid_argument("response_format.type must be text, json_object or json_schema, got \"" +
                                      std::string(kind) + "\"");
    }
    // {"type": "text"} asks for nothing; the formats only print schemas.
    if (kind != "text") options.response_format = *format;
  }
  if (const json::value* choice = body.if_contains("tool_choice")) {
    if (Status s = apply_tool_choice(*choice, conversation); !s.ok()) return s;
  }
  if (const json::value* parallel = body.if_contains("parallel_tool_calls"); parallel != nullptr && !parallel->is_null()) {
    if (!parallel->is_bool()) return type_error("parallel_tool_calls", "a boolean", *parallel);
    conversation.tool_choice.parallel = parallel->get_bool();
  }
  return conversation;
}

Result<Conversation> conversation_from_openai_chat(std::string_view json_text) {
  boost::system::error_code ec;
  json::value request = json::parse(json_text, ec);
  if (ec) return Status::invalid_argument("the request body is not valid JSON: " + ec.message());
  return conversation_from_openai_chat(request);
}

Result<Message> message_from_openai(const json::value& message, const std::string& path) {
  Message out;
  if (Status s = parse_message(message, path, out); !s.ok()) return s;
  return out;
}

Result<ToolDefinition> tool_from_openai(const json::value& tool, const std::string& path) {
  ToolDefinition out;
  if (Status s = parse_tool(tool, path, out); !s.ok()) return s;
  return out;
}

}  // namespace deepinfer::recipe
