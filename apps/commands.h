// Subcommands of the `deepinfer` binary. Each registers its options on the app and returns the exit code
// of its run; errors go to stderr as one line.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace deepinfer::apps {

// Registers the subcommand; the returned function runs it after parsing.
std::function<int()> add_tokenize_command(CLI::App& app);
std::function<int()> add_render_command(CLI::App& app);
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_random_model_command(CLI::App& app);
std::function<int()> add_serve_command(CLI::App& app);
std::function<int()> add_router_command(CLI::App& app);

}  // namespace deepinfer::apps
