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
    std::string tokenizer = "models/deepseek-v3";
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("random-model", "Write a DeepSeek-V3-architecture model with random weights");
  cmd->add_option("--out", options->out, "Directory to write")->capture_default_str();
  cmd->add_option("--tokenizer", options->tokenizer, "Directory with DeepSeek-V3's tokenizer.json to copy")
      ->capture_default_str();
  return [options]() -> int {
    namespace fs = std::filesystem;
    const fs::path out(options->out);
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
    Status s = model::write_random_checkpoint(out, model::random_model_config(), /*seed=*/20261130);
    if (!s.ok()) {
      std::cerr << "deepinfer random-model: " << s.to_string() << "\n";
      return 1;
    }
    std::cout << "wrote the default model (random weights, DeepSeek-V3 architecture and tokenizer) to " << out.string()
              << "\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
