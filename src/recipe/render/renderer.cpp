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

Result<RenderedPrompt> render_prompt(const Conversation& conversation, PromptFormat format) {
  if (conversation.messages.empty()) return Status::invalid_argument("messages must not be empty");
  switch (format) {
    case PromptFormat::kDeepSeekV3: return render_v3(conversation);
    case PromptFormat::kDeepSeekR1: return render_r1(conversation);
    case PromptFormat::kDeepSeekV31: return render_v31(conversation);
    default: return render_dsml(conversation, format);
  }
}

void tokenize_prompt(const Tokenizer& tokenizer, RenderedPrompt& prompt, TokenizationCache* cache) {
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
      cache->encode(tokenizer, run, TextTrust::kUntrusted, prompt.token_ids);
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
                                           const Tokenizer& tokenizer, TokenizationCache* cache) {
  Result<RenderedPrompt> prompt = render_prompt(conversation, format);
  if (prompt.ok()) tokenize_prompt(tokenizer, *prompt, cache);
  return prompt;
}

bool prompt_opens_reasoning(const RenderedPrompt& prompt) {
  std::string_view text = prompt.text;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  return text.ends_with("<think>");
}

}  // namespace deepinfer::recipe
