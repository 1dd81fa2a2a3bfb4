// Fuzz target: the streaming output parser over token ids, for every prompt format. Byte 0 picks the format
// and options; then either (bit 7 of byte 0 clear) the rest is text tokenized with control tokens recognised
// (the model can emit any of them), or (set) little-endian u32 ids modulo the vocabulary. Ids are pushed one
// at a time; the concatenated deltas must equal the final message (the parser's contract).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/stream_parser.h"
#include "fuzz_common.h"

using namespace deepinfer;
using namespace deepinfer::recipe;

DEEPINFER_FUZZ_PRELOAD_TOKENIZER()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& tok = fuzz::tokenizer();
  const auto formats = all_formats();
  const uint8_t control = data[0];
  const PromptFormat format = formats[control % formats.size()];
  StreamParserOptions options;
  options.starts_in_reasoning = (control & 0x10) != 0;
  options.tools_enabled = (control & 0x20) != 0;
  options.starts_in_tool_calls = (control & 0x40) != 0;  // a prefilled tool-call block (tool_choice required)
  options.json_output = (control & 0x08) != 0;           // response_format json_object
  std::vector<TokenId> ids;
  if ((control & 0x80) == 0) {
    tok->encode(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1), TextTrust::kTrusted, ids);
  } else {
    for (size_t i = 1; i + 4 <= size; i += 4) {
      uint32_t raw = 0;
      std::memcpy(&raw, data + i, 4);
      ids.push_back(static_cast<TokenId>(raw % tok->vocab_size()));
    }
  }
  StreamParser parser(format, tok, options);
  std::vector<StreamEvent> events;
  for (TokenId id : ids) parser.push(id, events);
  parser.finish(events);
  std::string reasoning, content;
  std::map<int32_t, std::string> arguments;
  for (const StreamEvent& event : events) {
    if (event.kind == StreamEvent::Kind::kReasoning) reasoning += event.text;
    if (event.kind == StreamEvent::Kind::kContent) content += event.text;
    if (event.kind == StreamEvent::Kind::kToolArguments) arguments[event.tool_index] += event.text;
  }
  const ParsedMessage& message = parser.result();
  if (reasoning != message.reasoning || content != message.content) abort();
  for (size_t i = 0; i < message.tool_calls.size(); ++i) {
    if (arguments[static_cast<int32_t>(i)] != message.tool_calls[i].arguments_text) abort();
  }
  return 0;
}
