// Native DeepSeek prompt renderers (no Jinja at run time): Conversation -> prompt segments -> token ids.
//
// A prompt is a list of segments. Control segments are the format's structural markers (`<｜User｜>`,
// `<｜tool▁call▁begin｜>`, `<think>`, ...): each becomes its added-token id when the tokenizer has that
// token, else it is ordinary text. Template segments are fixed text the format writes (tool instructions,
// DSML tags). Content segments are message text from the request. All non-control text is tokenized with
// no added-token matching (TextTrust::kUntrusted), so user or tool text can never become a control id.
//
// Formats and their references (goldens in tests/data/chat-templates/goldens):
//   deepseek-v3    official DeepSeek-V3 chat template (tokenizer_config.json), quirks included
//   deepseek-r1    DeepSeek-R1 template (only the last system message; `</think>` stripped from history)
//   deepseek-v3.1  official V3.1 template (thinking / non-thinking, `prefix` messages)
//   deepseek-v3.2  DeepSeek's V3.2 reference encoder (encoding_dsv32.py): DSML tool calls
//   deepseek-v4    V4 reference encoder (encoding_dsv4.py): tool results merged into user turns
//   deepseek-v4.1  V4.1 reference encoder (encoding_dsv41.py): `<｜System｜>`, numeric effort, images
//
// The plain-text marker rule (one rule, shared with the output parser): a format whose structure uses
// markers that are *text* rather than tokens (DSML tags, `<function_results>`/`<result>`, `<tool_result>`,
// `<｜deepseek_image｜>`) rejects any request text that contains one of its markers, with an
// InvalidArgument naming the message, the field and the marker. Nothing is escaped or silently altered.
// Formats whose markers are all tokens (V3, R1, V3.1) reject nothing: the untrusted tokenization already
// makes such text harmless.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/recipe/conversation.h"
#include "deepinfer/recipe/tokenization_cache.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::recipe {

enum class PromptFormat { kDeepSeekV3, kDeepSeekR1, kDeepSeekV31, kDeepSeekV32, kDeepSeekV4, kDeepSeekV41 };
std::string_view format_name(PromptFormat format);
// "deepseek-v3", "deepseek-r1", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "deepseek-v4.1".
Result<PromptFormat> parse_format(std::string_view name);
std::span<const PromptFormat> all_formats();

struct PromptSegment {
  enum class Kind { kControl, kTemplate, kContent };
  Kind kind;
  std::string text;
};

// A rendered prompt. `text` is the concatenation of the segments' text: what the reference templates
// produce. `token_ids` is empty until tokenize_prompt() fills it.
struct RenderedPrompt {
  std::vector<PromptSegment> segments;
  std::string text;
  std::vector<TokenId> token_ids;
};

// Renders `conversation` in `format`. Thread-safe (pure). Errors (InvalidArgument) for conversations the
// format cannot express: a tool result with no matching call, an invalid reasoning effort, images in a
// format without vision, plain-text markers in request text (see above).
Result<RenderedPrompt> render_prompt(const Conversation& conversation, PromptFormat format);

// Fills `prompt.token_ids`: control segments as their added-token ids where the tokenizer has them, and
// each maximal run of other text tokenized untrusted as one string (so ids equal the reference
// tokenizer's on the whole prompt text whenever the request text holds no marker text).
// With a `cache`, each run's ids come from it when it holds that run (a conversation that grew by a turn
// re-tokenizes only the runs that changed) and new runs are added to it; the ids are identical to those
// without a cache. `cache` is not owned and may be shared between threads (tokenization_cache.h). With
// `pending`, the runs the cache misses are recorded there instead of inserted (TokenizationCache::commit).
void tokenize_prompt(const Tokenizer& tokenizer, RenderedPrompt& prompt, TokenizationCache* cache = nullptr,
                     TokenizationCache::PendingInserts* pending = nullptr);

// render_prompt + tokenize_prompt.
Result<RenderedPrompt> render_and_tokenize(const Conversation& conversation, PromptFormat format,
                                           const Tokenizer& tokenizer, TokenizationCache* cache = nullptr,
                                           TokenizationCache::PendingInserts* pending = nullptr);

// The prompt ends inside a reasoning block (its generation prompt opened <think>, trailing spaces and newlines
// aside): the model's output then starts as reasoning (StreamParserOptions::starts_in_reasoning).
bool prompt_opens_reasoning(const RenderedPrompt& prompt);

}  // namespace deepinfer::recipe
