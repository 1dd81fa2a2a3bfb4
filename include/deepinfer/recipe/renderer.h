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
// The plain-text marker rule. The DSML formats write their tool-call
// markup `<｜DSML｜…>` with the `｜DSML｜` marker as a control segment, so it carries its own id where the
// tokenizer has it as an added token (DeepSeek-V4's and V4.1's: 128825), while request text, tokenized
// untrusted, never does. With such a tokenizer (RenderOptions::dsml_token) request text may contain anything,
// marker text included (`｜DSML｜`, `<tool_result>`, `<function_results>`, `<｜deepseek_image｜>`): it is
// ordinary text, as DeepSeek's API and deepseek-recipe accept it. (`<tool_result>` and the V3.2 result tags are
// text in the format itself, as in DeepSeek's encoders; the tool-call markup, which the parser acts on, is the
// part the token sets apart.) With a tokenizer that lacks the token (V3's, V3.2's: the markup is plain text to
// the model) a format rejects request text that contains one of its markers, with an InvalidArgument naming
// the message, the field and the marker, since the model could not tell it from the prompt's structure.
// Nothing is escaped or silently altered. Formats whose markers are all tokens (V3, R1, V3.1) reject nothing:
// the untrusted tokenization already makes such text harmless.
//
// tool_choice (Conversation::tool_choice) on the DSML formats, as deepseek-recipe does it: "required" (Anthropic
// "any") prefills the tool-call block's opener after the generation prompt (`\n\n<｜DSML｜tool_calls>\n`; V3.2
// `function_calls`, V4.1 ` calls`), so the model's output starts inside the block (RenderedPrompt::
// opens_tool_calls; the parser then starts there, stream_parser_options()). A named function (Anthropic
// "tool") does the same with only that function's definition in the prompt, and the answer must then begin with
// that function's invoke header (RenderedPrompt::answer_prefix, which the server forces); "required" with several
// tools allows only their invoke headers (RenderedPrompt::answer_prefix_choices). Both are refused with
// thinking on
// (the block would open where the reasoning starts) and on V3, R1 and V3.1, whose templates do not describe
// tools. A JSON response_format (json_object, json_schema) is printed as a "## Response Format" section of the
// system prompt on V3.2 and later; json_object needs the word "json" in some message's content (OpenAI's and
// deepseek-recipe's rule: the model must be asked for JSON), and the parser keeps only the JSON text
// (StreamParserOptions::json_output).
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
  // The generation prompt ends with a prefilled tool-call block opener (tool_choice required or named, see
  // above): the model's output starts inside the block (StreamParserOptions::starts_in_tool_calls).
  bool opens_tool_calls = false;
  // What the answer must begin with, not part of the prompt (which stays deepseek-recipe's, byte for byte): with a
  // tool_choice naming a function on the DSML formats, that function's invoke header (`<｜DSML｜invoke
  // name="NAME">\n`; V4.1 ` invoke`), so that the model cannot call another one. The engine forces these tokens
  // (engine::SamplingParams::forced_output_prefix) and the parser reads them as the model's output, as the call's
  // first bytes. `answer_prefix_ids` is filled by tokenize_prompt, as the prompt's ids (control segments as added
  // tokens, the name untrusted). Empty: nothing forced.
  std::vector<PromptSegment> answer_prefix;
  std::vector<TokenId> answer_prefix_ids;
  // tool_choice "required" (Anthropic "any") with several tools on the DSML formats: the answer must begin with one
  // of their invoke headers, one per tool in the request's order, so that the call names a tool the request offered
  // (the model picks which; the engine allows only these: engine::SamplingParams::forced_output_choices).
  // `answer_prefix_choice_ids` is filled by tokenize_prompt as answer_prefix_ids is. Empty otherwise.
  std::vector<std::vector<PromptSegment>> answer_prefix_choices;
  std::vector<std::vector<TokenId>> answer_prefix_choice_ids;
  // The last message is an assistant prefix (Message::prefix, DeepSeek's chat prefix completion) inside an open
  // reasoning block: the answer continues the reasoning (prompt_opens_reasoning).
  bool continues_reasoning = false;
};

// What rendering needs to know of the tokenizer the prompt is for (render_options_for() reads it off one).
struct RenderOptions {
  // The tokenizer has `｜DSML｜` as an added token: marker text in requests is then ordinary text on the DSML
  // formats, not an error (the marker rule above). The default assumes a tokenizer without it.
  bool dsml_token = false;
};
RenderOptions render_options_for(const Tokenizer& tokenizer);

// Renders `conversation` in `format` for a tokenizer described by `options`. Thread-safe (pure). Errors
// (InvalidArgument) for conversations the format cannot express: a tool result with no matching call, an
// invalid reasoning effort, images in a format without vision, plain-text markers in request text without
// the DSML token, a tool_choice or response_format the format cannot honour (see above).
Result<RenderedPrompt> render_prompt(const Conversation& conversation, PromptFormat format, RenderOptions options = {});

// Fills `prompt.token_ids` (and `prompt.answer_prefix_ids` the same way, without the cache): control segments as
// their added-token ids where the tokenizer has them, and
// each maximal run of other text tokenized untrusted as one string (so ids equal the reference
// tokenizer's on the whole prompt text whenever the request text holds no marker text).
// With a `cache`, each run's ids come from it when it holds that run (a conversation that grew by a turn
// re-tokenizes only the runs that changed) and new runs are added to it; the ids are identical to those
// without a cache. `cache` is not owned and may be shared between threads (tokenization_cache.h). With
// `pending`, the runs the cache misses are recorded there instead of inserted (TokenizationCache::commit).
void tokenize_prompt(const Tokenizer& tokenizer, RenderedPrompt& prompt, TokenizationCache* cache = nullptr,
                     TokenizationCache::PendingInserts* pending = nullptr);

// render_prompt (with render_options_for(tokenizer)) + tokenize_prompt.
Result<RenderedPrompt> render_and_tokenize(const Conversation& conversation, PromptFormat format,
                                           const Tokenizer& tokenizer, TokenizationCache* cache = nullptr,
                                           TokenizationCache::PendingInserts* pending = nullptr);

// The prompt ends inside a reasoning block (its generation prompt opened <think>, trailing spaces and newlines
// aside): the model's output then starts as reasoning (StreamParserOptions::starts_in_reasoning).
bool prompt_opens_reasoning(const RenderedPrompt& prompt);

}  // namespace deepinfer::recipe
