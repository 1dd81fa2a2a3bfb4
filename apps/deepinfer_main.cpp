// deepinfer: one binary, one subcommand per job.
#include <spdlog/cfg/env.h>

#include <iostream>
#include <map>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug (or info, warn, ...; per logger: name=level)
  CLI::App app{"DeepInfer: DeepSeek inference stack"};
  app.require_subcommand(1);
  std::map<std::string, std::function<int()>> runs;
  runs["tokenize"] = deepinfer::apps::add_tokenize_command(app);
  runs["render"] = deepinfer::apps::add_render_command(app);
  runs["generate"] = deepinfer::apps::add_generate_command(app);
  runs["random-model"] = deepinfer::apps::add_random_model_command(app);
  runs["serve"] = deepinfer::apps::add_serve_command(app);
  runs["router"] = deepinfer::apps::add_router_command(app);
  CLI11_PARSE(app, argc, argv);
  for (CLI::App* sub : app.get_subcommands()) return runs.at(sub->get_name())();
  return 2;
}
