// Fuzz target: for valid UTF-8 input, untrusted encode then decode gives the input back, and the
// incremental detokenizer streams the same text. Invalid UTF-8 must not crash either.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "deepinfer/recipe/detokenizer.h"
#include "deepinfer/recipe/tokenizer.h"

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

bool valid_utf8(std::string_view s) {
  std::string repaired;
  append_utf8_lossy(s, repaired, false);
  return repaired == s;
}

}  // namespace

// The tokenizer loads before the first input, outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  const Tokenizer& tok = tokenizer();
  std::vector<TokenId> ids = tok.encode(text, TextTrust::kUntrusted);
  std::vector<TokenId> trusted = tok.encode(text, TextTrust::kTrusted);
  std::string decoded = tok.decode(ids);
  if (valid_utf8(text)) {
    if (decoded != text) abort();
    if (tok.decode(trusted) != text) abort();
  }
  static std::shared_ptr<const Tokenizer> shared(&tok, [](const Tokenizer*) {});
  IncrementalDetokenizer stream(shared);
  std::string streamed;
  for (TokenId id : ids) streamed += stream.push(id);
  streamed += stream.flush();
  if (streamed != decoded) abort();
  return 0;
}
