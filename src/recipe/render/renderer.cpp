// Format registry and prompt tokenization: control segments become their added-token ids, every other
// run of text is tokenized untrusted as one string.
#include "deepinfer/recipe/renderer.h"

#include <algorithm>
#include <array>

#include <boost/json/serialize.hpp>
#include <boost/json/value.hpp>

#include "prompt_builder.h"

namespace deepinfer::recipe {
namespace {

constexpr std::array<PromptFormat, 6> kFormats = {PromptFormat::kDeepSeekV3,  PromptFormat::kDeepSeekR1,
                                                  PromptFormat::kDeepSeekV31, PromptFormat::kDeepSeekV32,
                                                  PromptFormat::kDeepSeekV4,  PromptFormat::kDeepSeekV41};

}  // namespace

std::string_view format_name(PromptFormat format) {
  switch (format) {
    case PromptFormat::kDeepSeekV3: return "deepseek-v3";
    case PromptFormat::kDeepSeekR1: return "deepseek-r1";
    case PromptFormat::kDeepSeekV31: return "deepseek-v3.1";
    case PromptFormat::kDeepSeekV32: return "deepseek-v3.2";
    case PromptFormat::kDeepSeekV4: return "deepseek-v4";
    case PromptFormat::kDeepSeekV41: return "deepseek-v4.1";
  }
  return "unknown";
}

Result<PromptFormat> parse_format(std::string_view name) {
  for (PromptFormat format : kFormats) {
    if (format_name(format) == name) return format;
  }
  return Status::invalid_argument("unknown prompt format '" + std::string(name) +
                                  "'; expected deepseek-v3, deepseek-r1, deepseek-v3.1, deepseek-v3.2, "
                                  "deepseek-v4 or deepseek-v4.1");
}

std::span<const PromptFormat> all_formats() { return kFormats; }

namespace {
// A message's content has "json" in some case (OpenAI's and deepseek-recipe's json_object rule: any message's
// content, ASCII case-insensitive; reasoning and tool-call arguments do not count).
bool asks_for_json(const Conversation& conversation) {
  for (const Message& message : conversation.messages) {
    for (const ContentPart& part : message.content) {
      if (part.kind != ContentPart::Kind::kText || part.text.size() < 4) continue;
      for (size_t i = 0; i + 4 <= part.text.size(); ++i) {
        if ((part.text[i] | 0x20) == 'j' && (part.text[i + 1] | 0x20) == 's' && (part.text[i + 2] | 0x20) == 'o' &&
            (part.text[i + 3] | 0x20) == 'n') {
          return true;
        }
      }
    }
  }
  return false;
}

// What a request asks that the format cannot honour is refused here, for every dialect and Python alike:
// never accepted and then dropped (renderer.h lists the rules).
Status check_capabilities(const Conversation& conversation, PromptFormat format) {
  const std::string name(format_name(format));
  const bool template_formats =
      format == PromptFormat::kDeepSeekV3 || format == PromptFormat::kDeepSeekR1 || format == PromptFormat::kDeepSeekV31;
  if (template_formats) {
    for (size_t i = 0; i < conversation.messages.size(); ++i) {
      if (conversation.messages[i].has_images()) {
        return Status::invalid_argument("messages[" + std::to_string(i) + "].content has an image; " + name +
                                        " has no image input (deepseek-v4.1 has)");
      }
    }
    if (conversation.tool_choice.mode != ToolChoice::Mode::kAuto) {
      const std::string what = conversation.tool_choice.mode == ToolChoice::Mode::kRequired
                                   ? std::string("requiring a tool call")
                                   : "naming the function '" + conversation.tool_choice.name + "'";
      return Status::invalid_argument("tool_choice " + what + " cannot be honoured with the " + name +
                                      " prompt format: it does not describe tools to the model; use \"auto\"");
    }
    if (conversation.options.response_format) {
      return Status::invalid_argument("response_format other than {\"type\": \"text\"} is not supported with the " +
                                      name + " prompt format (it does not describe a response format to the model, "
                                      "and there is no constrained decoding yet)");
    }
  }
  if (format == PromptFormat::kDeepSeekV3 && conversation.options.thinking) {
    return Status::invalid_argument("thinking is not available with the deepseek-v3 prompt format (it has no "
                                    "thinking mode; deepseek-r1, deepseek-v3.1 and later have)");
  }
  if (conversation.options.reasoning_effort && format != PromptFormat::kDeepSeekV4 &&
      format != PromptFormat::kDeepSeekV41) {
    return Status::invalid_argument("reasoning_effort is not available with the " + name +
                                    " prompt format (deepseek-v4 and deepseek-v4.1 have it)");
  }
  if (template_formats) return Status();
  // A DSML call names its function in a quoted attribute (`invoke name="NAME">`): a name holding a quote, an angle
  // bracket or a control character could never be called (the call's markup would break), so it is refused.
  const auto breaks_markup = [](std::string_view text) {
    return std::any_of(text.begin(), text.end(), [](char c) {
      const auto u = static_cast<unsigned char>(c);
      return c == '"' || c == '<' || c == '>' || u < 0x20 || u == 0x7f;
    });
  };
  // The same for the tool calls in the history, whose names and argument keys the format writes into the same
  // attributes (`parameter name="KEY"`): a client's key such as `k" string="false">` would write markup the model
  // reads as structure (regression: it was rendered as is).
  for (size_t i = 0; i < conversation.messages.size(); ++i) {
    for (const ToolCall& call : conversation.messages[i].tool_calls) {
      std::string bad_text;
      if (breaks_markup(call.name))
        bad_text = "a tool call named " + boost::json::serialize(boost::json::value(call.name));
      for (const auto& [key, value] : call.arguments) {
        if (bad_text.empty() && breaks_markup(key))
          bad_text = "a tool call argument named " + boost::json::serialize(boost::json::value(std::string(key)));
      }
      if (!bad_text.empty()) {
        return Status::invalid_argument("message " + std::to_string(i) + " of the conversation holds " + bad_text +
                                        ", which a " + name +
                                        " tool call cannot carry (quotes, angle brackets and control characters "
                                        "break its markup)");
      }
    }
  }
  for (size_t i = 0; i < conversation.tools.size(); ++i) {
    const std::string& tool = conversation.tools[i].name;
    if (breaks_markup(tool)) {
      return Status::invalid_argument("tools[" + std::to_string(i) + "] is named " +
                                      boost::json::serialize(boost::json::value(tool)) + ", which a " + name +
                                      " tool call cannot carry (quotes, angle brackets and control characters break "
                                      "its markup; OpenAI and Anthropic allow letters, digits, '_' and '-')");
    }
  }
  // The DSML formats honour tool_choice by prefilling the tool-call block (renderer.h).
  const ToolChoice& choice = conversation.tool_choice;
  if (choice.mode != ToolChoice::Mode::kAuto) {
    const std::string what = choice.mode == ToolChoice::Mode::kRequired ? std::string("requiring a tool call")
                                                                        : "naming the function '" + choice.name + "'";
    if (conversation.tools.empty()) return Status::invalid_argument("tool_choice " + what + " needs tools");
    const bool known = choice.mode == ToolChoice::Mode::kRequired ||
                       std::any_of(conversation.tools.begin(), conversation.tools.end(),
                                   [&](const ToolDefinition& tool) { return tool.name == choice.name; });
    if (!known) {
      return Status::invalid_argument("tool_choice names '" + choice.name + "', which is not one of the tools");
    }
    if (conversation.options.thinking) {
      return Status::invalid_argument("tool_choice " + what + " cannot be combined with thinking on the " + name +
                                      " prompt format (the prefilled tool-call block would open where the "
                                      "reasoning starts; deepseek-recipe refuses it too): turn thinking off or use "
                                      "\"auto\"");
    }
  }
  if (const std::optional<boost::json::value>& format_value = conversation.options.response_format) {
    const boost::json::object* object = format_value->if_object();
    const boost::json::value* type = object != nullptr ? object->if_contains("type") : nullptr;
    if (type != nullptr && type->is_string() && type->get_string() == "json_object" && !asks_for_json(conversation)) {
      return Status::invalid_argument(
          "response_format json_object needs the word \"json\" in some message (as "
          "OpenAI's API and deepseek-recipe require: ask the model for JSON, or it may "
          "not write any)");
    }
  }
  return Status();
}
}  // namespace

RenderOptions render_options_for(const Tokenizer& tokenizer) {
  return RenderOptions{.dsml_token = tokenizer.added_token_id(kDsml).has_value()};
}

namespace {

// DeepSeek's chat prefix completion: a last assistant message with prefix: true is the start of the answer, which
// the model continues, so its closing end-of-sentence is left off (the rest of the prompt is the format's own).
// Elsewhere `prefix` is refused: on another message it would mean nothing.
Status check_prefix(const Conversation& conversation) {
  for (size_t i = 0; i < conversation.messages.size(); ++i) {
    const Message& message = conversation.messages[i];
    if (!message.prefix) continue;
    const std::string path = "messages[" + std::to_string(i) + "].prefix";
    if (i + 1 != conversation.messages.size() || message.role != Role::kAssistant || !message.tool_calls.empty()) {
      return Status::invalid_argument(path +
                                      ": prefix: true is for the last message only, an assistant message "
                                      "without tool calls (the start of the answer, which the model continues)");
    }
  }
  return Status();
}

Result<RenderedPrompt> continue_prefix(const Conversation& conversation, PromptFormat format,
                                       Result<RenderedPrompt> prompt) {
  if (!prompt.ok()) return prompt;
  std::vector<PromptSegment>& segments = prompt->segments;
  // The marker is the last segment (PromptBuilder keeps each control marker a segment of its own).
  if (segments.empty() || segments.back().kind != PromptSegment::Kind::kControl || segments.back().text != kEos) {
    return Status::invalid_argument("messages[" + std::to_string(conversation.messages.size() - 1) + "].prefix: the " +
                                    std::string(format_name(format)) +
                                    " prompt format does not end an assistant message where it could be continued");
  }
  prompt->text.resize(prompt->text.size() - kEos.size());
  segments.pop_back();
  // The answer goes on as reasoning when the last think marker opened a block.
  for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
    if (it->kind != PromptSegment::Kind::kControl || (it->text != kThinkStart && it->text != kThinkEnd)) continue;
    prompt->continues_reasoning = it->text == kThinkStart;
    break;
  }
  return prompt;
}

Result<RenderedPrompt> render_format(const Conversation& conversation, PromptFormat format, RenderOptions options) {
  switch (format) {
    case PromptFormat::kDeepSeekV3: return render_v3(conversation);
    case PromptFormat::kDeepSeekR1: return render_r1(conversation);
    case PromptFormat::kDeepSeekV31: return render_v31(conversation);
    default: return render_dsml(conversation, format, options);
  }
}

}  // namespace

Result<RenderedPrompt> render_prompt(const Conversation& conversation, PromptFormat format, RenderOptions options) {
  if (conversation.messages.empty()) return Status::invalid_argument("messages must not be empty");
  if (Status s = check_capabilities(conversation, format); !s.ok()) return s;
  if (Status s = check_prefix(conversation); !s.ok()) return s;
  if (!conversation.messages.back().prefix) return render_format(conversation, format, options);
  // The prefix is the answer's start: no generation prompt after it (V3's template opens a new turn there).
  Conversation open = conversation;
  open.options.add_generation_prompt = false;
  return continue_prefix(open, format, render_format(open, format, options));
}

namespace {

void tokenize_segments(const Tokenizer& tokenizer, std::span<const PromptSegment> segments,
                       std::vector<TokenId>& token_ids, TokenizationCache* cache,
                       TokenizationCache::PendingInserts* pending) {
  // The pending run of non-control text: a view of one segment while it is one (the usual case), copied
  // into `joined` once a second segment extends it.
  std::string_view run;
  std::string joined;
  auto flush = [&] {
    if (run.empty()) return;
    // The run is the unit of tokenization, so it is also the unit of the cache (tokenization_cache.h).
    if (cache != nullptr) {
      cache->encode(tokenizer, run, TextTrust::kUntrusted, token_ids, pending);
    } else {
      tokenizer.encode(run, TextTrust::kUntrusted, token_ids);
    }
    run = {};
    joined.clear();
  };
  for (const PromptSegment& segment : segments) {
    if (segment.kind == PromptSegment::Kind::kControl) {
      if (std::optional<TokenId> id = tokenizer.added_token_id(segment.text)) {
        flush();
        token_ids.push_back(*id);
        continue;
      }
    }
    // A marker this tokenizer lacks is ordinary text, as the reference sees it.
    if (run.empty()) {
      run = segment.text;
    } else {
      if (joined.empty()) joined.assign(run);
      joined += segment.text;
      run = joined;
    }
  }
  flush();
}

}  // namespace

void tokenize_prompt(const Tokenizer& tokenizer, RenderedPrompt& prompt, TokenizationCache* cache,
                     TokenizationCache::PendingInserts* pending) {
  prompt.token_ids.clear();
  prompt.token_ids.reserve(prompt.text.size() / 3 + 16);
  tokenize_segments(tokenizer, prompt.segments, prompt.token_ids, cache, pending);
  prompt.answer_prefix_ids.clear();
  tokenize_segments(tokenizer, prompt.answer_prefix, prompt.answer_prefix_ids, nullptr, nullptr);
  prompt.answer_prefix_choice_ids.assign(prompt.answer_prefix_choices.size(), {});
  for (size_t i = 0; i < prompt.answer_prefix_choices.size(); ++i) {
    tokenize_segments(tokenizer, prompt.answer_prefix_choices[i], prompt.answer_prefix_choice_ids[i], nullptr, nullptr);
  }
}

Result<RenderedPrompt> render_and_tokenize(const Conversation& conversation, PromptFormat format,
                                           const Tokenizer& tokenizer, TokenizationCache* cache,
                                           TokenizationCache::PendingInserts* pending) {
  Result<RenderedPrompt> prompt = render_prompt(conversation, format, render_options_for(tokenizer));
  if (prompt.ok()) tokenize_prompt(tokenizer, *prompt, cache, pending);
  return prompt;
}

bool prompt_opens_reasoning(const RenderedPrompt& prompt) {
  if (prompt.continues_reasoning) return true;
  std::string_view text = prompt.text;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  return text.ends_with("<think>");
}

}  // namespace deepinfer::recipe
