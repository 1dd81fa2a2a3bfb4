// deepinfer random-model --out DIR [--tokenizer DIR]: writes a DeepSeek-V3-architecture checkpoint with
// deterministic random weights and the real DeepSeek-V3 tokenizer into DIR, for tests and benchmarks that need
// a model of the real shape family but not a trained one (the built-in demo model is models/demo).
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "deepinfer/model/random_checkpoint.h"

namespace deepinfer::apps {

std::function<int()> add_random_model_command(CLI::App& app) {
  struct Options {
    std::string out = "models/random";
    std::string tokenizer;
    std::string architecture = "deepseek-v3";
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("random-model", "Write a DeepSeek model (V3 or V4 architecture) with random weights");
  cmd->add_option("--out", options->out, "Directory to write")->capture_default_str();
  cmd->add_option("--tokenizer", options->tokenizer,
                  "Directory with the tokenizer.json to copy (default: models/deepseek-v3; deepseek-v4: models/demo, "
                  "DeepSeek-V3's tokenizer with V4's added tokens)");
  cmd->add_option("--architecture", options->architecture, "deepseek-v3 or deepseek-v4 (the CPU reference path)")
      ->check(CLI::IsMember({"deepseek-v3", "deepseek-v4"}))
      ->capture_default_str();
  return [options]() -> int {
    namespace fs = std::filesystem;
    const fs::path out(options->out);
    const bool v4 = options->architecture == "deepseek-v4";
    if (options->tokenizer.empty()) options->tokenizer = v4 ? "models/demo" : "models/deepseek-v3";
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
      if (!fs::exists(fs::path(options->tokenizer) / file)) {
        std::cerr << "deepinfer random-model: " << (fs::path(options->tokenizer) / file).string()
                  << ": no such file (run scripts/setup.sh to fetch the tokenizer, from the repository root, or pass "
                     "--tokenizer DIR)\n";
        return 1;
      }
    }
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
      std::error_code ec;
      fs::create_directories(out, ec);
      fs::copy_file(fs::path(options->tokenizer) / file, out / file, fs::copy_options::overwrite_existing, ec);
      if (ec) {
        std::cerr << "deepinfer random-model: " << (fs::path(options->tokenizer) / file).string() << ": "
                  << ec.message() << " (run scripts/setup.sh to fetch the tokenizer)\n";
        return 1;
      }
    }
    Status s = v4 ? model::write_random_v4_checkpoint(out, model::random_v4_model_config(), /*seed=*/20261203)
                  : model::write_random_checkpoint(out, model::random_model_config(), /*seed=*/20261130);
    if (!s.ok()) {
      std::cerr << "deepinfer random-model: " << s.to_string() << "\n";
      return 1;
    }
    std::cout << "wrote a model with random weights (" << options->architecture << " architecture) to " << out.string()
              << "\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
