// deepinfer generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens N [--temperature T]
//   [--top-p P] [--top-k K] [--seed S] [--device cpu|cuda] [--bf16] [--json]
//   [--speculative-algorithm mtp --speculative-num-draft-tokens K]: one request through the engine.
// With --json: {"output_ids": [...], "text": "..."} (text when the checkpoint directory has a tokenizer.json).
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include <boost/json.hpp>

#include "commands.h"
#include "backend_choice.h"
#include "speculative_flags.h"
#include "deepinfer/engine/engine.h"
#include "deepinfer/recipe/tokenizer.h"

namespace deepinfer::apps {

std::function<int()> add_generate_command(CLI::App& app) {
  struct Options {
    std::string model;
    std::optional<std::string> prompt;
    std::optional<std::string> prompt_ids;
    int64_t max_tokens = 16;
    float temperature = 0.0f;
    float top_p = 1.0f;
    int32_t top_k = -1;
    std::optional<uint64_t> seed;
    DeviceOptions device;
    SpeculativeOptions speculative;
    bool json = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd =
      app.add_subcommand("generate", "Generate from one prompt with a DeepSeek checkpoint (CPU, or --device cuda)");
  cmd->add_option("--model", options->model, "Checkpoint directory (config.json + *.safetensors)")->required();
  auto* prompt = cmd->add_option("--prompt", options->prompt, "Prompt text (needs tokenizer.json in the model directory)");
  auto* ids = cmd->add_option("--prompt-ids", options->prompt_ids, "Prompt token ids, comma-separated");
  prompt->excludes(ids);
  cmd->add_option("--max-tokens", options->max_tokens, "Tokens to generate at most")->transform(at_least(1, INT64_MAX));
  cmd->add_option("--temperature", options->temperature, "0 is greedy");
  cmd->add_option("--top-p", options->top_p, "Nucleus sampling mass (1 is off)");
  cmd->add_option("--top-k", options->top_k, "Keep the k most likely tokens (-1 is off)");
  cmd->add_option("--seed", options->seed, "Per-request seed");
  add_device_flags(cmd, options->device);
  add_speculative_flags(cmd, options->speculative);
  cmd->add_flag("--json", options->json,
                "Print {\"output_ids\": [...], \"finish_reason\": ..., \"text\": ...} (text with a tokenizer.json)");
  return [options]() -> int {
    auto fail = [](const std::string& message) {
      std::cerr << "deepinfer generate: " << message << "\n";
      return 1;
    };
    std::shared_ptr<const recipe::Tokenizer> tokenizer;
    if (std::filesystem::exists(std::filesystem::path(options->model) / "tokenizer.json")) {
      auto loaded = recipe::Tokenizer::load(options->model);
      if (!loaded.ok()) return fail(loaded.status().to_string());
      tokenizer = *loaded;
    }
    std::vector<engine::TokenId> prompt_ids;
    if (options->prompt_ids) {
      std::stringstream stream(*options->prompt_ids);
      std::string item;
      while (std::getline(stream, item, ',')) {
        try {
          prompt_ids.push_back(std::stoi(item));
        } catch (const std::exception&) {
          return fail("--prompt-ids: '" + item + "' is not an integer");
        }
      }
    } else if (options->prompt) {
      if (!tokenizer) return fail("--prompt needs tokenizer.json in " + options->model + "; use --prompt-ids");
      prompt_ids = tokenizer->encode(*options->prompt, recipe::TextTrust::kTrusted);
    } else {
      return fail("give --prompt or --prompt-ids");
    }
    Result<model::ModelConfig> model_config = model::load_engine_model_config(options->model);
    if (!model_config.ok()) return fail(model_config.status().to_string());
    // DeepSeek-V4 (CPU: the float32 reference path; CUDA: bf16), without speculative decoding yet.
    const bool v4 = model_config->model_type == "deepseek_v4";
    if (v4 && (options->speculative.dspark_enable ||
               (!options->speculative.algorithm.empty() && options->speculative.algorithm != "none"))) {
      return fail("--speculative-algorithm: DeepSeek-V4 does not support it yet in this build");
    }
    Result<engine::SpeculativeConfig> speculative =
        speculative_config(options->speculative, model_config->num_nextn_predict_layers,
                           model_config->dspark.has_value());
    if (!speculative.ok()) return fail(speculative.status().message() + " (" + options->model + ")");
    Result<BackendChoice> choice = make_backend(options->device);
    if (!choice.ok()) return fail(choice.status().to_string());
    auto backend = std::move(choice->backend);
    engine::EngineConfig engine_config;
    engine_config.speculative = *speculative;
    Result<std::unique_ptr<engine::Engine>> engine = Status::internal("no engine");
    if (v4) {
      auto model = model::DeepSeekV4Model::load(options->model, *backend, choice->precision);
      if (!model.ok()) return fail(model.status().to_string());
      engine = engine::Engine::create(std::move(backend), std::move(model).value(), engine_config);
    } else {
      auto model = model::DeepSeekModel::load(options->model, *backend, choice->precision, /*progress=*/true);
      if (!model.ok()) return fail(model.status().to_string());
      if (Status s = set_dspark_table(*speculative, options->speculative, options->model,
                                      std::string(backend->name()), choice->compute_mode);
          !s.ok()) {
        return fail(s.to_string());
      }
      engine = engine::Engine::create(std::move(backend), std::move(model).value(), engine_config);
    }
    if (!engine.ok()) return fail(engine.status().to_string());
    engine::SamplingParams params;
    params.temperature = options->temperature;
    params.top_p = options->top_p;
    params.top_k = options->top_k;
    params.seed = options->seed;
    params.max_tokens = options->max_tokens;
    auto id = (*engine)->submit(prompt_ids, params);
    if (!id.ok()) return fail(id.status().message());
    std::vector<engine::TokenId> output;
    engine::FinishReason reason = engine::FinishReason::kNone;
    while ((*engine)->has_pending_work()) {
      auto events = (*engine)->step();
      if (!events.ok()) return fail(events.status().to_string());
      for (const auto& event : *events) {
        if (event.token) output.push_back(*event.token);
        if (event.finished) reason = event.finish_reason;
      }
    }
    std::string text = tokenizer ? tokenizer->decode(output) : std::string();
    if (options->json) {
      boost::json::object result{{"output_ids", boost::json::array(output.begin(), output.end())},
                                  {"finish_reason", std::string(engine::finish_reason_name(reason))}};
      if (tokenizer) result["text"] = text;
      std::cout << boost::json::serialize(result) << "\n";
    } else if (tokenizer) {
      std::cout << text << "\n";
    } else {
      for (size_t i = 0; i < output.size(); ++i) std::cout << (i ? "," : "") << output[i];
      std::cout << "\n";
    }
    return 0;
  };
}

}  // namespace deepinfer::apps
