// Subcommands of the `deepinfer` binary. Each registers its options on the app and returns the exit code
// of its run; errors go to stderr as one line.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

namespace deepinfer::apps {

// Registers the subcommand; the returned function runs it after parsing.
std::function<int()> add_tokenize_command(CLI::App& app);
std::function<int()> add_render_command(CLI::App& app);
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_random_model_command(CLI::App& app);
std::function<int()> add_serve_command(CLI::App& app);
std::function<int()> add_router_command(CLI::App& app);

// A validator for a whole number >= `min`: "must be a whole number >= 1, got 0" (CLI11's PositiveNumber names a
// range up to 1.8e308 instead).
inline CLI::Validator at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        int64_t value = 0;
        if (!CLI::detail::lexical_cast(text, value) || value < min) {
          return "must be a whole number >= " + std::to_string(min) + ", got '" + text + "'";
        }
        return {};
      },
      ">=" + std::to_string(min));
}

}  // namespace deepinfer::apps
