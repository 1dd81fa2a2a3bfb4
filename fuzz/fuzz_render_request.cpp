// Fuzz target: arbitrary bytes as an OpenAI chat request -> Conversation -> every prompt format ->
// token ids. Any input must give a Status or a prompt, never a crash; a rendered prompt's token ids must
// decode back to its text.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"

namespace {

using namespace deepinfer::recipe;

const Tokenizer& tokenizer() {
  static std::shared_ptr<const Tokenizer> t = [] {
    auto loaded = Tokenizer::load(std::string(DEEPINFER_SOURCE_DIR) + "/models/deepseek-v3/tokenizer.json");
    if (!loaded.ok()) abort();
    return *loaded;
  }();
  return *t;
}

}  // namespace

// The tokenizer loads before the first input, outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view request(reinterpret_cast<const char*>(data), size);
  auto conversation = conversation_from_openai_chat(request);
  if (!conversation.ok()) return 0;
  for (PromptFormat format : all_formats()) {
    for (bool thinking : {false, true}) {
      conversation->options.thinking = thinking;
      auto prompt = render_and_tokenize(*conversation, format, tokenizer());
      if (!prompt.ok()) continue;
      std::string decoded = tokenizer().decode(prompt->token_ids);
      // Request strings are valid UTF-8 (the JSON parser checks), so the round trip is exact.
      if (decoded != prompt->text) abort();
    }
  }
  return 0;
}
