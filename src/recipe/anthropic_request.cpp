// Anthropic Messages request -> Conversation. One validating pass; the first error wins and names the
// field's JSON path (the server derives the error's `param` from it).
#include "deepinfer/recipe/anthropic_request.h"

#include <algorithm>
#include <boost/json.hpp>
#include <cctype>
#include <cmath>
#include <cstdint>

#include "request_json.h"

namespace deepinfer::recipe {
namespace json = boost::json;
namespace {

using request_json::indexed;
using request_json::present;
using request_json::quoted;
using request_json::required_string;
using request_json::whole_number;

ContentPart text_part(std::string text) { return {ContentPart::Kind::kText, std::move(text), {}}; }

Status image_part(const json::object& block, const std::string& path, ContentPart& part) {
  const json::value* source = present(block, "source");
  if (source == nullptr || !source->is_object()) return Status::invalid_argument(path + ".source must be an object");
  const json::object& src = source->get_object();
  std::string type;
  if (Status s = required_string(src, "type", path + ".source", type); !s.ok()) return s;
  part.kind = ContentPart::Kind::kImage;
  if (type == "base64") {
    std::string media_type, data;
    if (Status s = required_string(src, "media_type", path + ".source", media_type); !s.ok()) return s;
    if (Status s = required_string(src, "data", path + ".source", data); !s.ok()) return s;
    part.image_url = "data:" + media_type + ";base64," + data;
  } else if (type == "url") {
    if (Status s = required_string(src, "url", path + ".source", part.image_url); !s.ok()) return s;
  } else {
    return Status::invalid_argument(path + ".source.type must be \"base64\" or \"url\", got " + quoted(type));
  }
  return Status();
}

// A tool_result's content: a string, or text (and image) blocks.
Status tool_result_content(const json::value* content, const std::string& path, Message& message) {
  if (content == nullptr) {
    message.content.push_back(text_part(""));
    return Status();
  }
  if (content->is_string()) {
    message.content.push_back(text_part(std::string(content->get_string())));
    return Status();
  }
  if (!content->is_array()) return Status::invalid_argument(path + " must be a string or an array of content blocks");
  const json::array& blocks = content->get_array();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string block_path = indexed(path, i);
    if (!blocks[i].is_object()) return Status::invalid_argument(block_path + " must be an object");
    const json::object& block = blocks[i].get_object();
    std::string type;
    if (Status s = required_string(block, "type", block_path, type); !s.ok()) return s;
    ContentPart part;
    if (type == "text") {
      if (Status s = required_string(block, "text", block_path, part.text); !s.ok()) return s;
    } else if (type == "image") {
      if (Status s = image_part(block, block_path, part); !s.ok()) return s;
    } else {
      return Status::invalid_argument(block_path + ".type " + quoted(type) + " is not supported in a tool result");
    }
    message.content.push_back(std::move(part));
  }
  if (message.content.empty()) message.content.push_back(text_part(""));
  return Status();
}

// One Anthropic message -> one or more Conversation messages (each tool_result becomes a tool message, in
// block order, between the user text before and after it).
// Anthropic's rules on empty content, as its API words them: every message has content except an assistant message
// that ends the list (the prefill the answer continues from), and no text block is empty.
constexpr const char* kEmptyMessage =
    ": all messages must have non-empty content except for the optional final "
    "assistant message";
constexpr const char* kEmptyTextBlock = ": text content blocks must be non-empty";
constexpr const char* kBlankTextBlock = ": text content blocks must contain non-whitespace text";

bool blank(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
}

// A text block's text: refused when empty or only whitespace (Anthropic's rules).
Status check_text_block(const std::string& text, const std::string& path) {
  if (text.empty()) return Status::invalid_argument(path + kEmptyTextBlock);
  if (blank(text)) return Status::invalid_argument(path + kBlankTextBlock);
  return Status();
}

// The prefill the answer continues from (a final assistant message) may not end in whitespace: Anthropic refuses it
// (the model's next token usually carries its own leading space).
Status check_prefill_end(const Message& message, bool last, const std::string& path) {
  if (!last || message.content.empty() || message.content.back().text.empty()) return Status();
  if (!std::isspace(static_cast<unsigned char>(message.content.back().text.back()))) return Status();
  return Status::invalid_argument(path + ": final assistant content cannot end with trailing whitespace");
}

Status convert_message(const json::value& value, const std::string& path, bool last, std::vector<Message>& out) {
  if (!value.is_object()) return Status::invalid_argument(path + " must be an object");
  const json::object& object = value.get_object();
  std::string role;
  if (Status s = required_string(object, "role", path, role); !s.ok()) return s;
  if (role != "user" && role != "assistant") {
    return Status::invalid_argument(path + ".role must be \"user\" or \"assistant\", got " + quoted(role));
  }
  const bool assistant = role == "assistant";
  const json::value* content = present(object, "content");
  if (content == nullptr) return Status::invalid_argument(path + ".content is required");
  const bool may_be_empty = assistant && last;
  const bool empty =
      (content->is_string() && content->get_string().empty()) || (content->is_array() && content->get_array().empty());
  if (empty && !may_be_empty) return Status::invalid_argument(path + kEmptyMessage);
  Message message;
  message.role = assistant ? Role::kAssistant : Role::kUser;
  if (content->is_string()) {
    if (!empty && !may_be_empty && blank(content->get_string()))
      return Status::invalid_argument(path + ".content" + kBlankTextBlock);
    message.content.push_back(text_part(std::string(content->get_string())));
    if (assistant) {
      if (Status s = check_prefill_end(message, last, path); !s.ok()) return s;
    }
    out.push_back(std::move(message));
    return Status();
  }
  if (!content->is_array()) {
    return Status::invalid_argument(path + ".content must be a string or an array of content blocks");
  }
  const json::array& blocks = content->get_array();
  auto flush_user = [&] {
    if (!message.content.empty()) out.push_back(std::move(message));
    message = Message{};
    message.role = Role::kUser;
  };
  bool ends_in_text = false;  // the last block is a text block (tool_use and thinking blocks are not)
  for (size_t i = 0; i < blocks.size(); ++i) {
    ends_in_text = false;
    const std::string block_path = indexed(path + ".content", i);
    if (!blocks[i].is_object()) return Status::invalid_argument(block_path + " must be an object");
    const json::object& block = blocks[i].get_object();
    std::string type;
    if (Status s = required_string(block, "type", block_path, type); !s.ok()) return s;
    if (type == "text") {
      ContentPart part;
      if (Status s = required_string(block, "text", block_path, part.text); !s.ok()) return s;
      if (Status s = check_text_block(part.text, block_path + ".text"); !s.ok()) return s;
      message.content.push_back(std::move(part));
      ends_in_text = true;
      continue;
    } else if (type == "image" && !assistant) {
      ContentPart part;
      if (Status s = image_part(block, block_path, part); !s.ok()) return s;
      message.content.push_back(std::move(part));
    } else if (type == "tool_result" && !assistant) {
      Message result;
      result.role = Role::kTool;
      if (Status s = required_string(block, "tool_use_id", block_path, result.tool_call_id); !s.ok()) return s;
      // is_error has nowhere to go in DeepSeek's formats (a tool result is its text; DeepSeek's own Anthropic API
      // ignores the flag too): type-checked, and the README says to put the error in the content.
      if (const json::value* is_error = present(block, "is_error"); is_error != nullptr && !is_error->is_bool())
        return Status::invalid_argument(block_path + ".is_error must be a boolean");
      if (Status s = tool_result_content(present(block, "content"), block_path + ".content", result); !s.ok()) {
        return s;
      }
      flush_user();
      out.push_back(std::move(result));
    } else if (type == "tool_use" && assistant) {
      ToolCall call;
      if (Status s = required_string(block, "id", block_path, call.id); !s.ok()) return s;
      if (Status s = required_string(block, "name", block_path, call.name); !s.ok()) return s;
      const json::value* input = present(block, "input");
      if (input != nullptr && !input->is_object())
        return Status::invalid_argument(block_path + ".input must be an object");
      if (input != nullptr) call.arguments = input->get_object();
      message.tool_calls.push_back(std::move(call));
    } else if (type == "thinking" && assistant) {
      std::string thinking;
      if (Status s = required_string(block, "thinking", block_path, thinking); !s.ok()) return s;
      message.reasoning_content = message.reasoning_content.value_or("") + thinking;
    } else if (type == "redacted_thinking" && assistant) {
      // Opaque to us: nothing to render.
    } else {
      return Status::invalid_argument(block_path + ".type " + quoted(type) + " is not supported in a" +
                                      (assistant ? "n assistant" : " user") + " message");
    }
  }
  if (assistant) {
    if (ends_in_text) {
      if (Status s = check_prefill_end(message, last, path); !s.ok()) return s;
    }
    if (message.content.empty()) message.content_is_null = !message.tool_calls.empty();
    if (message.content.empty() && message.tool_calls.empty()) message.content.push_back(text_part(""));
    out.push_back(std::move(message));
  } else if (!message.content.empty()) {
    out.push_back(std::move(message));
  }
  return Status();
}

Status convert_system(const json::value* system, Conversation& conversation) {
  if (system == nullptr) return Status();
  Message message;
  message.role = Role::kSystem;
  if (system->is_string()) {
    message.content.push_back(text_part(std::string(system->get_string())));
  } else if (system->is_array()) {
    const json::array& blocks = system->get_array();
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string path = indexed("system", i);
      if (!blocks[i].is_object()) return Status::invalid_argument(path + " must be an object");
      std::string type;
      if (Status s = required_string(blocks[i].get_object(), "type", path, type); !s.ok()) return s;
      if (type != "text") return Status::invalid_argument(path + ".type must be \"text\"");
      ContentPart part;
      if (Status s = required_string(blocks[i].get_object(), "text", path, part.text); !s.ok()) return s;
      if (Status s = check_text_block(part.text, path + ".text"); !s.ok()) return s;
      message.content.push_back(std::move(part));
    }
  } else {
    return Status::invalid_argument("system must be a string or an array of text blocks");
  }
  if (!message.content.empty()) conversation.messages.push_back(std::move(message));
  return Status();
}

// Anthropic's refusal of a key its schema does not have, for the nested objects read here (the server refuses
// unknown top-level fields). `allowed` lists the keys read or taken.
Status refuse_extra_keys(const json::object& object, std::initializer_list<std::string_view> allowed,
                         const std::string& path) {
  for (const auto& [key, value] : object) {
    const std::string_view name = key;
    if (value.is_null() || std::find(allowed.begin(), allowed.end(), name) != allowed.end()) continue;
    return Status::invalid_argument(path + "." + std::string(name.substr(0, 256)) + ": Extra inputs are not permitted");
  }
  return Status();
}

Status convert_tools(const json::value* tools, Conversation& conversation) {
  if (tools == nullptr) return Status();
  if (!tools->is_array()) return Status::invalid_argument("tools must be an array");
  const json::array& list = tools->get_array();
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = indexed("tools", i);
    if (!list[i].is_object()) return Status::invalid_argument(path + " must be an object");
    const json::object& tool = list[i].get_object();
    // cache_control is taken: every prompt's blocks are cached by content (the prefix cache).
    if (Status s = refuse_extra_keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, path);
        !s.ok()) {
      return s;
    }
    if (const json::value* type = present(tool, "type");
        type != nullptr && !(type->is_string() && type->get_string() == "custom")) {
      return Status::invalid_argument(path + ".type " + json::serialize(*type) +
                                      " is not supported: only client tools (name, description, input_schema) are");
    }
    std::string name;
    if (Status s = required_string(tool, "name", path, name); !s.ok()) return s;
    if (name.empty()) return Status::invalid_argument(path + ".name must not be empty");
    json::object function{{"name", name}};
    if (const json::value* description = present(tool, "description")) {
      if (!description->is_string()) return Status::invalid_argument(path + ".description must be a string");
      function["description"] = *description;
    }
    const json::value* schema = present(tool, "input_schema");
    if (schema == nullptr || !schema->is_object()) {
      return Status::invalid_argument(path + ".input_schema must be a JSON Schema object");
    }
    function["parameters"] = *schema;
    conversation.tools.push_back({name, std::move(function)});
  }
  return Status();
}

// tool_choice {"type": "auto" | "any" | "tool" | "none", "name"}: as in the OpenAI dialect, "none" drops the
// tools; "any" and a named tool (which must exist) are recorded for the renderer to honour or refuse.
Status apply_tool_choice(const json::value* choice, Conversation& conversation) {
  if (choice == nullptr) return Status();
  if (!choice->is_object()) return Status::invalid_argument("tool_choice must be an object");
  std::string type;
  if (Status s = required_string(choice->get_object(), "type", "tool_choice", type); !s.ok()) return s;
  if (Status s = refuse_extra_keys(choice->get_object(), {"type", "name", "disable_parallel_tool_use"}, "tool_choice");
      !s.ok()) {
    return s;
  }
  // disable_parallel_tool_use (auto, any, tool): at most one tool_use block in the answer (ToolChoice::parallel).
  if (const json::value* single = present(choice->get_object(), "disable_parallel_tool_use"); single != nullptr) {
    if (!single->is_bool()) return Status::invalid_argument("tool_choice.disable_parallel_tool_use must be a boolean");
    if (type == "none") {
      return Status::invalid_argument("tool_choice.disable_parallel_tool_use is not allowed with {\"type\": \"none\"}");
    }
    conversation.tool_choice.parallel = !single->get_bool();
  }
  if (type == "none") {
    conversation.tools.clear();
  } else if (type == "any") {
    if (conversation.tools.empty()) return Status::invalid_argument("tool_choice \"any\" needs tools");
    conversation.tool_choice.mode = ToolChoice::Mode::kRequired;
  } else if (type == "tool") {
    std::string name;
    if (Status s = required_string(choice->get_object(), "name", "tool_choice", name); !s.ok()) return s;
    bool found = false;
    for (const ToolDefinition& tool : conversation.tools) found = found || tool.name == name;
    if (!found) return Status::invalid_argument("tool_choice.name '" + name + "' is not one of the request's tools");
    conversation.tool_choice.mode = ToolChoice::Mode::kNamed;
    conversation.tool_choice.name = name;
  } else if (type != "auto") {
    return Status::invalid_argument("tool_choice.type must be auto, any, tool or none, got " + quoted(type));
  }
  return Status();
}

}  // namespace

Result<Conversation> conversation_from_anthropic_messages(const json::value& request) {
  if (!request.is_object()) return Status::invalid_argument("the request body must be a JSON object");
  const json::object& body = request.get_object();
  Conversation conversation;
  if (Status s = convert_system(present(body, "system"), conversation); !s.ok()) return s;
  const json::value* messages = present(body, "messages");
  if (messages == nullptr || !messages->is_array()) return Status::invalid_argument("messages must be an array");
  if (messages->get_array().empty()) return Status::invalid_argument("messages must not be empty");
  for (size_t i = 0; i < messages->get_array().size(); ++i) {
    const bool last = i + 1 == messages->get_array().size();
    if (Status s = convert_message(messages->get_array()[i], indexed("messages", i), last, conversation.messages);
        !s.ok()) {
      return s;
    }
  }
  if (Status s = convert_tools(present(body, "tools"), conversation); !s.ok()) return s;
  if (Status s = apply_tool_choice(present(body, "tool_choice"), conversation); !s.ok()) return s;
  if (const json::value* thinking = present(body, "thinking")) {
    const json::value* type = thinking->is_object() ? thinking->get_object().if_contains("type") : nullptr;
    if (type == nullptr || !type->is_string() ||
        (type->get_string() != "enabled" && type->get_string() != "disabled")) {
      return Status::invalid_argument(
          "thinking must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}");
    }
    if (Status s = refuse_extra_keys(thinking->get_object(), {"type", "budget_tokens"}, "thinking"); !s.ok()) return s;
    conversation.options.thinking = type->get_string() == "enabled";
    // Anthropic's rule: budget_tokens is required with "enabled", an integer of at least 1,024. The server
    // enforces it (a thinking budget in the engine) and checks that max_tokens exceeds it.
    const json::value* budget = thinking->get_object().if_contains("budget_tokens");
    if (conversation.options.thinking) {
      // A whole number written as a double (1024.0, as Python's json writes a float) is that integer, as the
      // server's other integer fields take it (api_common.cpp's read_int). At most kMaxBudget: a larger one is
      // refused as such, not clamped (max_tokens, which must exceed it, is bounded by max_model_len anyway).
      constexpr double kMaxBudget = INT32_MAX;
      const std::optional<double> whole = budget != nullptr ? whole_number(*budget) : std::nullopt;
      const bool integer = whole.has_value();
      const double number = whole.value_or(0.0);
      const std::string got = budget == nullptr ? std::string("none") : json::serialize(*budget);
      if (integer && number > kMaxBudget) {
        return Status::invalid_argument("thinking.budget_tokens must be at most " +
                                        std::to_string(static_cast<int64_t>(kMaxBudget)) + ", got " + got);
      }
      if (!integer || number < 1024) {
        return Status::invalid_argument(
            "thinking.budget_tokens must be an integer of at least 1024 when thinking is enabled, got " + got);
      }
      conversation.options.thinking_budget_tokens = static_cast<int64_t>(number);
    } else if (budget != nullptr) {
      return Status::invalid_argument("thinking.budget_tokens is only allowed with {\"type\": \"enabled\"}");
    }
  }
  // Anthropic's effort control maps onto the format's reasoning-effort levels (checked when rendering).
  if (const json::value* output = present(body, "output_config")) {
    if (!output->is_object()) return Status::invalid_argument("output_config must be an object");
    for (const auto& [key, value] : output->get_object()) {
      if (key == "effort") {
        if (value.is_null()) continue;
        if (!value.is_string()) return Status::invalid_argument("output_config.effort must be a string");
        conversation.options.reasoning_effort = std::string(value.get_string());
      } else {
        return Status::invalid_argument("output_config." + std::string(key) +
                                        " is not supported; only output_config.effort is");
      }
    }
  }
  return conversation;
}

Result<Conversation> conversation_from_anthropic_messages(std::string_view json_text) {
  boost::system::error_code ec;
  json::value request = json::parse(json_text, ec);
  if (ec) return Status::invalid_argument("the request body is not valid JSON: " + ec.message());
  return conversation_from_anthropic_messages(request);
}

}  // namespace deepinfer::recipe
