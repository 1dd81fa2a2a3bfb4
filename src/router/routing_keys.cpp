#include "deepinfer/router/routing_keys.h"

#include <vector>

namespace deepinfer::router {
namespace json = boost::json;
namespace {

void append(std::string& out, std::string_view text) {
  if (text.empty()) return;
  if (!out.empty()) out += '\n';
  out += text;
}

// A content value: a string, or parts with a string `text`.
void append_content(std::string& out, const json::value& content) {
  if (content.is_string()) {
    append(out, content.as_string());
  } else if (content.is_array()) {
    for (const json::value& part : content.as_array()) {
      if (!part.is_object()) continue;
      if (const json::value* text = part.as_object().if_contains("text"); text != nullptr && text->is_string()) {
        append(out, text->as_string());
      }
    }
  }
}

void append_prompt(std::string& out, const json::value& prompt, const recipe::Tokenizer* tokenizer) {
  if (prompt.is_string()) {
    append(out, prompt.as_string());
    return;
  }
  if (!prompt.is_array()) return;
  const json::array& items = prompt.as_array();
  if (!items.empty() && (items[0].is_string() || items[0].is_array())) {
    for (const json::value& item : items) append_prompt(out, item, tokenizer);
    return;
  }
  std::vector<recipe::TokenId> ids;
  for (const json::value& item : items) {
    if (!item.is_int64() || item.as_int64() < 0 || item.as_int64() > INT32_MAX) return;
    ids.push_back(static_cast<recipe::TokenId>(item.as_int64()));
  }
  if (tokenizer != nullptr) {
    append(out, tokenizer->decode(ids));
  } else {
    std::string text;
    for (recipe::TokenId id : ids) text += std::to_string(id) + " ";
    append(out, text);
  }
}

}  // namespace

std::string affinity_text(const json::object& body, const recipe::Tokenizer* tokenizer) {
  std::string out;
  if (const json::value* system = body.if_contains("system")) append_content(out, *system);
  if (const json::value* instructions = body.if_contains("instructions"); instructions && instructions->is_string()) {
    append(out, instructions->as_string());
  }
  for (std::string_view key : {"messages", "input"}) {
    const json::value* items = body.if_contains(key);
    if (items == nullptr) continue;
    if (items->is_string()) {
      append(out, items->as_string());
      continue;
    }
    if (!items->is_array()) continue;
    for (const json::value& item : items->as_array()) {
      if (!item.is_object()) continue;
      const json::object& message = item.as_object();
      const json::value* role = message.if_contains("role");
      if (role == nullptr || !role->is_string()) continue;
      const std::string_view r = role->as_string();
      if (r != "system" && r != "developer" && r != "user") continue;
      if (const json::value* content = message.if_contains("content")) append_content(out, *content);
    }
  }
  if (const json::value* prompt = body.if_contains("prompt")) append_prompt(out, *prompt, tokenizer);
  return out;
}

}  // namespace deepinfer::router
