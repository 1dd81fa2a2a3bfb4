// scripted_server: a TEST-ONLY executable (built under tests/, never linked into `deepinfer`, not reachable
// from any product flag). It runs the real deepinfer::server::Server (HTTP, both API dialects, the real
// streaming output parser) over ScriptedEngine, a StepEngine double that, instead of sampling a model, emits
// a fixed token stream chosen by a marker in the prompt. Random weights never write reasoning or tool-call
// markup; this lets the SDK tests (tests/sdk/tools.test.mjs) check tool calls and reasoning end to end.
//
// The script is chosen by the LAST "script:NAME" marker in the decoded prompt (so a tool result containing
// "script:final" picks the final answer in a follow-up turn):
//   script:tool_call  -> [reasoning</think>] + a get_weather({"city": "Paris"}) call in the format's syntax
//   script:reasoning  -> [reasoning</think>] + "The answer is 42."
//   script:final      -> [reasoning</think>] + "It is 22 degrees and sunny in Paris."
//   (none)            -> "Hello from the scripted engine."
// The reasoning part is written only when the prompt ends in thinking mode (its generation prompt ends with
// <think>), as a DeepSeek model would. Every script ends with the end-of-sequence id. The text is tokenized
// with the model's tokenizer, TextTrust::kTrusted, so markers become their added-token ids.
//
// Usage: scripted_server [--host H] [--port P] [--chat-format deepseek-v3.1|deepseek-v4.1|...]
//                        [--model-path models/demo] [--served-model-name default] [--step-delay-ms 3]
// Runs until SIGTERM/SIGINT (drains in-flight requests first).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/model/config.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/engine/engine_client.h"
#include "deepinfer/server/server.h"

namespace {

using deepinfer::Result;
using deepinfer::Status;
using deepinfer::engine::FinishReason;
using deepinfer::engine::SamplingParams;
using deepinfer::engine::SequenceId;
using deepinfer::engine::TokenEvent;
using deepinfer::engine::TokenId;
using deepinfer::recipe::PromptFormat;
using deepinfer::recipe::TextTrust;
using deepinfer::recipe::Tokenizer;
using deepinfer::engine::EngineLoad;
using deepinfer::engine::StepEngine;

constexpr std::string_view kReasoning = "The user wants the weather in Paris. I should call get_weather.";

std::string tool_call_text(PromptFormat format) {
  switch (format) {
    case PromptFormat::kDeepSeekV3:
    case PromptFormat::kDeepSeekR1:
      return "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
             "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    case PromptFormat::kDeepSeekV31:
      return "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    case PromptFormat::kDeepSeekV32:
    case PromptFormat::kDeepSeekV4:
    case PromptFormat::kDeepSeekV41: {
      const bool v41 = format == PromptFormat::kDeepSeekV41;
      const std::string block = format == PromptFormat::kDeepSeekV32  ? "function_calls"
                                : format == PromptFormat::kDeepSeekV4 ? "tool_calls"
                                                                      : " calls";
      const std::string invoke = v41 ? " invoke" : "invoke";
      const std::string parameter = v41 ? " parameter" : "parameter";
      return "\n\n<｜DSML｜" + block + ">\n<｜DSML｜" + invoke + " name=\"get_weather\">\n<｜DSML｜" + parameter +
             " name=\"city\" string=\"true\">Paris</｜DSML｜" + parameter + ">\n</｜DSML｜" + invoke +
             ">\n</｜DSML｜" + block + ">";
    }
  }
  return {};
}

// The text the "model" writes for `prompt_text` (the decoded prompt).
std::string script_for(const std::string& prompt_text, PromptFormat format) {
  const bool thinking = prompt_text.ends_with("<think>") || format == PromptFormat::kDeepSeekR1;
  const std::string reasoning = thinking ? std::string(kReasoning) + "</think>" : std::string();
  std::string name;
  if (size_t at = prompt_text.rfind("script:"); at != std::string::npos) {
    size_t begin = at + 7, end = begin;
    while (end < prompt_text.size() && (std::isalnum(static_cast<unsigned char>(prompt_text[end])) != 0 ||
                                        prompt_text[end] == '_')) {
      ++end;
    }
    name = prompt_text.substr(begin, end - begin);
  }
  if (name == "tool_call") return reasoning + tool_call_text(format);
  if (name == "reasoning") return reasoning + "The answer is 42.";
  if (name == "final") return reasoning + "It is 22 degrees and sunny in Paris.";
  return "Hello from the scripted engine.";
}

// Same contract as engine::Engine: one token per running sequence per step; a sequence's end (stop token,
// EOS, max_tokens, cancel) is reported in the step after its last token, with no token.
class ScriptedEngine final : public StepEngine {
 public:
  ScriptedEngine(std::shared_ptr<const Tokenizer> tokenizer, PromptFormat format, TokenId eos, int64_t vocab_size,
                 int64_t max_model_len, int step_delay_ms)
      : tokenizer_(std::move(tokenizer)), format_(format), eos_(eos), vocab_size_(vocab_size),
        max_model_len_(max_model_len), step_delay_ms_(step_delay_ms) {}

  Result<SequenceId> submit(std::vector<TokenId> prompt, const SamplingParams& params) override {
    if (Status s = params.validate(vocab_size_); !s.ok()) return s;
    if (prompt.empty()) return Status::invalid_argument("empty prompt");
    if (static_cast<int64_t>(prompt.size()) >= max_model_len_) {
      return Status::invalid_argument("prompt of " + std::to_string(prompt.size()) + " tokens exceeds max_model_len");
    }
    Sequence seq;
    seq.params = params;
    seq.tokens = tokenizer_->encode(script_for(tokenizer_->decode(prompt), format_), TextTrust::kTrusted);
    seq.tokens.push_back(eos_);
    const SequenceId id = next_id_++;
    sequences_.emplace(id, std::move(seq));
    return id;
  }

  Status cancel(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::not_found("no sequence " + std::to_string(id));
    if (it->second.finish == FinishReason::kNone) it->second.finish = FinishReason::kCancelled;
    return Status::ok_status();
  }

  Result<std::vector<TokenEvent>> step() override {
    // A real step takes milliseconds; pacing keeps the HTTP side from coalescing a whole script into one
    // SSE delta, so the streaming tests see the text split across many deltas.
    if (step_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_delay_ms_));
    std::vector<TokenEvent> events;
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      Sequence& seq = it->second;
      if (seq.finish != FinishReason::kNone) {
        TokenEvent end;
        end.id = it->first;
        end.finished = true;
        end.finish_reason = seq.finish;
        events.push_back(std::move(end));
        it = sequences_.erase(it);
        continue;
      }
      const TokenId token = seq.tokens[seq.next++];
      TokenEvent event;
      event.id = it->first;
      event.token = token;
      if (seq.params.logprobs) {
        event.logprob = 0.0f;
        if (*seq.params.logprobs > 0) event.top_logprobs.push_back({token, 0.0f});
      }
      events.push_back(std::move(event));
      const auto& stops = seq.params.stop_token_ids;
      const int64_t generated = static_cast<int64_t>(seq.next);
      if (std::find(stops.begin(), stops.end(), token) != stops.end() || (token == eos_ && !seq.params.ignore_eos)) {
        seq.finish = FinishReason::kStop;
      } else if ((seq.params.max_tokens && generated >= *seq.params.max_tokens) || seq.next >= seq.tokens.size()) {
        seq.finish = FinishReason::kLength;
      }
      ++it;
    }
    return events;
  }

  bool has_pending_work() const override { return !sequences_.empty(); }

  EngineLoad load() const override {
    EngineLoad load;
    load.num_running = static_cast<int32_t>(sequences_.size());
    return load;
  }

 private:
  struct Sequence {
    SamplingParams params;
    std::vector<TokenId> tokens;  // the script, EOS last
    size_t next = 0;
    FinishReason finish = FinishReason::kNone;  // set: report the end in the next step
  };
  std::shared_ptr<const Tokenizer> tokenizer_;
  PromptFormat format_;
  TokenId eos_;
  int64_t vocab_size_;
  int64_t max_model_len_;
  int step_delay_ms_;
  std::map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 1;
};

int fail(const std::string& message) {
  std::cerr << "scripted_server: " << message << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using namespace deepinfer;
  std::string host = "127.0.0.1", chat_format = "deepseek-v3.1", model_path = "models/demo", name = "default";
  int port = 18124, step_delay_ms = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return fail("missing value for " + arg);
    const std::string value = argv[++i];
    if (arg == "--host") host = value;
    else if (arg == "--port") port = std::atoi(value.c_str());
    else if (arg == "--chat-format") chat_format = value;
    else if (arg == "--model-path") model_path = value;
    else if (arg == "--served-model-name") name = value;
    else if (arg == "--step-delay-ms") step_delay_ms = std::atoi(value.c_str());
    else return fail("unknown option " + arg);
  }
  spdlog::set_level(std::getenv("DEEPINFER_TEST_LOG") != nullptr ? spdlog::level::info : spdlog::level::warn);
  Result<recipe::PromptFormat> format = recipe::parse_format(chat_format);
  if (!format.ok()) return fail("--chat-format: " + format.status().message());
  Result<model::ModelConfig> config = model::load_model_config(model_path);
  if (!config.ok()) return fail(config.status().to_string());
  Result<std::shared_ptr<const recipe::Tokenizer>> tokenizer = recipe::Tokenizer::load(model_path);
  if (!tokenizer.ok()) return fail(tokenizer.status().to_string());
  if (config->eos_token_ids.empty()) return fail("the config has no eos_token_id");

  server::ModelInfo info;
  info.served_model_name = name;
  info.model_type = config->model_type;
  info.vocab_size = config->vocab_size;
  info.max_model_len = config->max_position_embeddings;
  info.bos_token_id = config->bos_token_id;
  info.root = fs::absolute(model_path);
  info.description = "scripted test double: fixed token streams chosen by a marker in the prompt";

  server::ServerConfig server_config;
  server_config.host = host;
  server_config.port = static_cast<uint16_t>(port);
  server_config.chat_format = *format;
  server_config.handle_signals = true;
  auto engine = std::make_unique<ScriptedEngine>(*tokenizer, *format, static_cast<TokenId>(config->eos_token_ids[0]),
                                                 info.vocab_size, info.max_model_len, step_delay_ms);
  auto server = server::Server::start(server_config, info, std::make_unique<deepinfer::engine::InProcessEngineClient>(std::move(engine)), *tokenizer);
  if (!server.ok()) return fail(server.status().to_string());
  std::cout << "scripted_server: " << recipe::format_name(*format) << " on http://" << host << ":"
            << (*server)->port() << "\n"
            << std::flush;
  (*server)->wait();
  return 0;
}
