// Shared setup of the server tests: the built-in default model (DeepSeek-V3 architecture, random weights, the
// real DeepSeek-V3 tokenizer) written once into the build directory, and a real Server on an ephemeral
// loopback port over the real engine on the CPU.
#pragma once

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/model/config.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/random_checkpoint.h"
#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"
#include "deepinfer/recipe/tokenizer.h"
#include "deepinfer/server/server.h"
#include "test_client.h"

namespace deepinfer::server::testing {

inline constexpr const char* kModelName = "default";

// The default model, written once per build (content-addressed by its config, moved into place atomically
// so that concurrent test processes agree).
inline const std::filesystem::path& model_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    const boost::json::object config = model::random_model_config();
    const std::string key = std::to_string(std::hash<std::string>{}(boost::json::serialize(config)));
    const fs::path final_dir = fs::path(SERVER_TEST_MODEL_DIR) / key;
    if (fs::exists(final_dir / "tokenizer.json")) return final_dir;
    const fs::path staging = final_dir.string() + ".staging." + std::to_string(getpid());
    Status s = model::write_random_checkpoint(staging, config, /*seed=*/20261130);
    if (!s.ok()) throw std::runtime_error(s.to_string());
    fs::copy_file(fs::path(DEEPINFER_SOURCE_DIR) / "models/deepseek-v3/tokenizer.json", staging / "tokenizer.json",
                  fs::copy_options::overwrite_existing);
    std::error_code ec;
    fs::rename(staging, final_dir, ec);
    if (ec) fs::remove_all(staging, ec);  // another process won the race; use its copy
    return final_dir;
  }();
  return dir;
}

inline std::shared_ptr<const recipe::Tokenizer> tokenizer() {
  static const std::shared_ptr<const recipe::Tokenizer> loaded = [] {
    auto result = recipe::Tokenizer::load(model_dir());
    if (!result.ok()) throw std::runtime_error(result.status().to_string());
    return *result;
  }();
  return loaded;
}

struct TestServerOptions {
  ServerConfig config;
  int64_t max_model_len = 4096;
  int32_t max_num_seqs = 64;
  int64_t kv_cache_bytes = 48ll << 20;  // ~400 blocks of 64 tokens
};

inline std::unique_ptr<Server> start_server(TestServerOptions options = {}) {
  // DEEPINFER_TEST_LOG=1 shows the server's request log.
  spdlog::set_level(std::getenv("DEEPINFER_TEST_LOG") != nullptr ? spdlog::level::info : spdlog::level::warn);
  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::load(model_dir(), *backend, backend::Precision::kBF16);
  if (!model.ok()) throw std::runtime_error(model.status().to_string());
  ModelInfo info;
  info.served_model_name = kModelName;
  info.model_type = (*model)->config().model_type;
  info.vocab_size = (*model)->config().vocab_size;
  info.bos_token_id = (*model)->config().bos_token_id;
  info.max_model_len = options.max_model_len;
  info.root = model_dir();
  info.description = "test model: random weights";
  engine::EngineConfig engine_config;
  engine_config.max_model_len = options.max_model_len;
  engine_config.max_num_seqs = options.max_num_seqs;
  engine_config.kv_cache_bytes = options.kv_cache_bytes;
  auto engine = engine::Engine::create(std::move(backend), std::move(model).value(), engine_config);
  if (!engine.ok()) throw std::runtime_error(engine.status().to_string());
  options.config.host = "127.0.0.1";
  options.config.port = 0;
  auto server = Server::start(options.config, info, engine::make_in_process_client(std::move(engine).value()), tokenizer());
  if (!server.ok()) throw std::runtime_error(server.status().to_string());
  return std::move(server).value();
}

// The prompt length the server must report for a chat request: the rendered, tokenized conversation.
inline int64_t rendered_prompt_tokens(const std::string& chat_request_json) {
  auto conversation = recipe::conversation_from_openai_chat(std::string_view(chat_request_json));
  if (!conversation.ok()) throw std::runtime_error(conversation.status().to_string());
  auto prompt = recipe::render_and_tokenize(*conversation, recipe::PromptFormat::kDeepSeekV3, *tokenizer());
  if (!prompt.ok()) throw std::runtime_error(prompt.status().to_string());
  return static_cast<int64_t>(prompt->token_ids.size());
}

// A JSON string's text (anything else serialized), for comparisons.
inline std::string str(const boost::json::value& value) {
  return value.is_string() ? std::string(value.get_string()) : boost::json::serialize(value);
}

// One value of a Prometheus text exposition ("name" or "name{labels}"); -1 when absent.
inline double metric_value(const std::string& exposition, const std::string& series) {
  size_t at = 0;
  while ((at = exposition.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || exposition[at - 1] == '\n') {
      size_t begin = at + series.size() + 1;
      return std::stod(exposition.substr(begin, exposition.find('\n', begin) - begin));
    }
    at += series.size();
  }
  return -1;
}

}  // namespace deepinfer::server::testing
