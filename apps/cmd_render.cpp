// deepinfer render --format NAME --tokenizer DIR [--thinking] [--reasoning-effort E]
//   [--no-generation-prompt] [--ids]: stdin an OpenAI Chat Completions request; stdout the prompt text,
//   or its token ids as a JSON list with --ids. Flags override the request's own switches.
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>

#include <boost/json.hpp>

#include "commands.h"
#include "deepinfer/recipe/openai_request.h"
#include "deepinfer/recipe/renderer.h"

namespace deepinfer::apps {

std::function<int()> add_render_command(CLI::App& app) {
  struct Options {
    std::string format;
    std::string tokenizer;
    bool thinking = false;
    std::optional<std::string> reasoning_effort;
    bool no_generation_prompt = false;
    bool ids = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("render", "Render an OpenAI chat request (stdin) as a DeepSeek prompt");
  cmd->add_option("--format", options->format,
                  "deepseek-v3 | deepseek-r1 | deepseek-v3.1 | deepseek-v3.2 | deepseek-v4 | deepseek-v4.1")
      ->required();
  cmd->add_option("--tokenizer", options->tokenizer, "Directory holding tokenizer.json (needed for --ids)");
  cmd->add_flag("--thinking", options->thinking, "Thinking mode (otherwise the request's switch, default off)");
  cmd->add_option("--reasoning-effort", options->reasoning_effort, "low|medium|high|xhigh|max, or 1-100 (V4.1)");
  cmd->add_flag("--no-generation-prompt", options->no_generation_prompt, "Do not open the assistant turn");
  cmd->add_flag("--ids", options->ids, "Print token ids (JSON list) instead of text");
  return [options]() -> int {
    Result<recipe::PromptFormat> format = recipe::parse_format(options->format);
    if (!format.ok()) {
      std::cerr << "deepinfer render: " << format.status().message() << "\n";
      return 1;
    }
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    Result<recipe::Conversation> conversation = recipe::conversation_from_openai_chat(std::string_view(input));
    if (!conversation.ok()) {
      std::cerr << "deepinfer render: " << conversation.status().message() << "\n";
      return 1;
    }
    if (options->thinking) conversation->options.thinking = true;
    if (options->reasoning_effort) conversation->options.reasoning_effort = options->reasoning_effort;
    if (options->no_generation_prompt) conversation->options.add_generation_prompt = false;
    Result<recipe::RenderedPrompt> prompt = recipe::render_prompt(*conversation, *format);
    if (!prompt.ok()) {
      std::cerr << "deepinfer render: " << prompt.status().message() << "\n";
      return 1;
    }
    if (!options->ids) {
      std::cout << prompt->text;
      return 0;
    }
    if (options->tokenizer.empty()) {
      std::cerr << "deepinfer render: --ids needs --tokenizer DIR\n";
      return 1;
    }
    Result<std::shared_ptr<const recipe::Tokenizer>> tokenizer = recipe::Tokenizer::load(options->tokenizer);
    if (!tokenizer.ok()) {
      std::cerr << "deepinfer render: " << tokenizer.status().to_string() << "\n";
      return 1;
    }
    recipe::tokenize_prompt(**tokenizer, *prompt);
    std::cout << boost::json::serialize(boost::json::array(prompt->token_ids.begin(), prompt->token_ids.end()))
              << "\n";
    return 0;
  };
}

}  // namespace deepinfer::apps
