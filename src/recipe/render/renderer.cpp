// Format registry and prompt tokenization: control segments become their added-token ids, every other
// run of text is tokenized untrusted as one string.
#include "deepinfer/recipe/renderer.h"

#include <array>

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
  return Status();
}
}  // namespace

Result<RenderedPrompt> render_prompt(const Conversation& conversation, PromptFormat format) {
  if (conversation.messages.empty()) return Status::invalid_argument("messages must not be empty");
  if (Status s = check_capabilities(conversation, format); !s.ok()) return s;
  switch (format) {
    case PromptFormat::kDeepSeekV3: return render_v3(conversation);
    case PromptFormat::kDeepSeekR1: return render_r1(conversation);
    case PromptFormat::kDeepSeekV31: return render_v31(conversation);
    default: return render_dsml(conversation, format);
  }
}

void tokenize_prompt(const Tokenizer& tokenizer, RenderedPrompt& prompt, TokenizationCache* cache,
                     TokenizationCache::PendingInserts* pending) {
  prompt.token_ids.clear();
  prompt.token_ids.reserve(prompt.text.size() / 3 + 16);
  // The pending run of non-control text: a view of one segment while it is one (the usual case), copied
  // into `joined` once a second segment extends it.
  std::string_view run;
  std::string joined;
  auto flush = [&] {
    if (run.empty()) return;
    // The run is the unit of tokenization, so it is also the unit of the cache (tokenization_cache.h).
    if (cache != nullptr) {
      cache->encode(tokenizer, run, TextTrust::kUntrusted, prompt.token_ids, pending);
    } else {
      tokenizer.encode(run, TextTrust::kUntrusted, prompt.token_ids);
    }
    run = {};
    joined.clear();
  };
  for (const PromptSegment& segment : prompt.segments) {
    if (segment.kind == PromptSegment::Kind::kControl) {
      if (std::optional<TokenId> id = tokenizer.added_token_id(segment.text)) {
        flush();
        prompt.token_ids.push_back(*id);
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

Result<RenderedPrompt> render_and_tokenize(const Conversation& conversation, PromptFormat format,
                                           const Tokenizer& tokenizer, TokenizationCache* cache,
                                           TokenizationCache::PendingInserts* pending) {
  Result<RenderedPrompt> prompt = render_prompt(conversation, format);
  if (prompt.ok()) tokenize_prompt(tokenizer, *prompt, cache, pending);
  return prompt;
}

bool prompt_opens_reasoning(const RenderedPrompt& prompt) {
  std::string_view text = prompt.text;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  return text.ends_with("<think>");
}

}  // namespace deepinfer::recipe
