// Subcommands of the `deepinfer` binary. Each registers its options on the app and returns the exit code
// of its run; errors go to stderr as one line.
#pragma once

#include <charconv>
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

// A validator for a whole number >= `min` written in decimal: "must be a whole number >= 1, got '0'" (CLI11's
// PositiveNumber names a range up to 1.8e308 instead, and its conversion reads "010" as octal 8 and "0x10" as 16).
// The text is rewritten in plain decimal before CLI11 converts it. `max`: the option's type's limit.
inline CLI::Validator at_least(int64_t min, int64_t max = INT32_MAX) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        int64_t value = 0;
        const char* end = text.data() + text.size();
        auto [at, error] = std::from_chars(text.data(), end, value, 10);
        if (text.empty() || error != std::errc() || at != end || value < min || value > max) {
          return "must be a whole number from " + std::to_string(min) + " to " + std::to_string(max) + ", got '" +
                 text + "'";
        }
        text = std::to_string(value);
        return {};
      },
      ">=" + std::to_string(min));
}

// A validator refusing an empty value ("--flag ''"), which CLI11 would otherwise take as the option not given.
inline CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string { return text.empty() ? std::string("must not be empty") : std::string(); },
      "NOT EMPTY");
}

}  // namespace deepinfer::apps
