// Fuzz target, built once per API dialect (FUZZ_DIALECT 0 chat, 1 completions, 2 Anthropic messages, 3
// Responses): arbitrary bytes as a request body, through exactly what the server runs before the engine
// (parse_body with the depth limit, then the dialect's plan_*: validation -> Conversation -> prompt -> token
// ids, sampling parameters, stream writers). Any input gives an ApiError or a plan, never a crash; a plan's
// prompt ids are inside the vocabulary and fit the context.
#include <boost/json.hpp>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <variant>

#include "deepinfer/server/api.h"
#include "fuzz_common.h"

using namespace deepinfer;
using namespace deepinfer::server;

DEEPINFER_FUZZ_PRELOAD_TOKENIZER()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ModelInfo model = [] {
    ModelInfo m;
    m.served_model_name = "default";
    m.model_type = "deepseek_v3";
    m.vocab_size = 129280;
    m.max_model_len = 4096;
    return m;
  }();
  static ApiContext context = [] {
    ApiContext c;
    c.model = &model;
    c.tokenizer = fuzz::tokenizer();
    c.default_max_tokens = 16;
    return c;
  }();
  ApiResult<boost::json::value> body =
      parse_body(std::string_view(reinterpret_cast<const char*>(data), size), /*max_depth=*/64);
  if (std::holds_alternative<ApiError>(body)) return 0;
  const boost::json::value& value = std::get<boost::json::value>(body);
  ApiResult<GenerationPlan> plan = FUZZ_DIALECT == 0   ? plan_chat_completion(value, context)
                                   : FUZZ_DIALECT == 1 ? plan_completion(value, context)
                                   : FUZZ_DIALECT == 2 ? plan_anthropic_messages(value, context)
                                                       : plan_responses(value, context);
  if (auto* ok = std::get_if<GenerationPlan>(&plan)) {
    if (ok->prompt_token_ids.empty() || static_cast<int64_t>(ok->prompt_token_ids.size()) >= model.max_model_len) abort();
    for (int32_t id : ok->prompt_token_ids) {
      if (id < 0 || id >= model.vocab_size) abort();
    }
  }
  return 0;
}
