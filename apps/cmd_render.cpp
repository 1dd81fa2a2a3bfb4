// deepinfer render --format NAME --tokenizer DIR [--thinking] [--reasoning-effort E]
//   [--no-generation-prompt] [--ids]: stdin an OpenAI Chat Completions request; stdout the prompt text,
//   or its token ids as a JSON list with --ids. Flags override the request's own switches. With --jsonl, stdin
//   holds one request per line and stdout one line per request (its ids with --ids, else its text as a JSON
//   string): one process renders a whole data set (tools/prepare_demo_data.py). The tokenizer, when given, also
//   decides whether marker text in requests is ordinary text (a tokenizer with the ｜DSML｜ token; renderer.h).
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
    std::string revision = "0731";
    bool no_generation_prompt = false;
    bool ids = false;
    bool jsonl = false;
  };
  auto options = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("render", "Render an OpenAI chat request (stdin) as a DeepSeek prompt");
  cmd->add_option("--format", options->format,
                  "deepseek-v3 | deepseek-r1 | deepseek-v3.1 | deepseek-v3.2 | deepseek-v4 | deepseek-v4.1")
      ->required();
  cmd->add_option("--tokenizer", options->tokenizer,
                  "Directory holding tokenizer.json (needed for --ids; with the ｜DSML｜ token, marker text in "
                  "requests is ordinary text)");
  cmd->add_flag("--thinking", options->thinking, "Thinking mode (otherwise the request's switch, default off)");
  cmd->add_option("--reasoning-effort", options->reasoning_effort,
                  "V4 (0731): low|high|xhigh|max; V4 preview: low|medium|high|max; V4.1: low|medium|high|xhigh|max or 1-100");
  cmd->add_option("--chat-format-revision", options->revision, "deepseek-v4: 0731 (default) or preview")
      ->capture_default_str();
  cmd->add_flag("--no-generation-prompt", options->no_generation_prompt, "Do not open the assistant turn");
  cmd->add_flag("--ids", options->ids, "Print token ids (JSON list) instead of text");
  cmd->add_flag("--jsonl", options->jsonl, "One request per stdin line, one output line per request");
  return [options]() -> int {
    Result<recipe::PromptFormat> format = recipe::parse_format(options->format);
    if (!format.ok()) {
      std::cerr << "deepinfer render: " << format.status().message() << "\n";
      return 1;
    }
    Result<recipe::V4Revision> revision = recipe::parse_v4_revision(options->revision);
    if (!revision.ok()) {
      std::cerr << "deepinfer render: --chat-format-revision: " << revision.status().message() << "\n";
      return 1;
    }
    std::shared_ptr<const recipe::Tokenizer> tokenizer;
    if (options->ids && options->tokenizer.empty()) {
      std::cerr << "deepinfer render: --ids needs --tokenizer DIR\n";
      return 1;
    }
    recipe::RenderOptions render_options;
    if (!options->tokenizer.empty()) {
      Result<std::shared_ptr<const recipe::Tokenizer>> loaded = recipe::Tokenizer::load(options->tokenizer);
      if (!loaded.ok()) {
        std::cerr << "deepinfer render: " << loaded.status().to_string() << "\n";
        return 1;
      }
      tokenizer = std::move(loaded).value();
      render_options = recipe::render_options_for(*tokenizer);
    }
    // Renders one request; the output line is the prompt text (JSON string with --jsonl) or its ids.
    auto render_one = [&](std::string_view input, const std::string& where) -> bool {
      Result<recipe::Conversation> conversation = recipe::conversation_from_openai_chat(input);
      if (!conversation.ok()) {
        std::cerr << "deepinfer render: " << where << conversation.status().message() << "\n";
        return false;
      }
      if (options->thinking) conversation->options.thinking = true;
      if (options->reasoning_effort) conversation->options.reasoning_effort = options->reasoning_effort;
      if (options->no_generation_prompt) conversation->options.add_generation_prompt = false;
      conversation->options.v4_revision = *revision;
      Result<recipe::RenderedPrompt> prompt = recipe::render_prompt(*conversation, *format, render_options);
      if (!prompt.ok()) {
        std::cerr << "deepinfer render: " << where << prompt.status().message() << "\n";
        return false;
      }
      if (!options->ids) {
        if (options->jsonl) {
          std::cout << boost::json::serialize(boost::json::value(prompt->text)) << "\n";
        } else {
          std::cout << prompt->text;
        }
        return true;
      }
      recipe::tokenize_prompt(*tokenizer, *prompt);
      std::cout << boost::json::serialize(boost::json::array(prompt->token_ids.begin(), prompt->token_ids.end()))
                << "\n";
      return true;
    };
    if (!options->jsonl) {
      std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
      return render_one(input, "") ? 0 : 1;
    }
    std::string line;
    for (int64_t number = 1; std::getline(std::cin, line); ++number) {
      if (line.empty()) continue;
      if (!render_one(line, "stdin line " + std::to_string(number) + ": ")) return 1;
    }
    return 0;
  };
}

}  // namespace deepinfer::apps
