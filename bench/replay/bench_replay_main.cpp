// bench_replay: the no-model trace replay of the prefix cache (see trace_replay.h), or with --live URL the replay
// of a trace against a running server (see live_replay.h), or with --engine-replay the same prompts through the
// engine's scheduler and prefix cache with no model (see engine_replay.h). Prints JSON lines; exit 0 on success, 1 on a
// load/replay error, 2 on bad arguments.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "engine_replay.h"
#include "live_replay.h"
#include "trace_replay.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (std::find(args.begin(), args.end(), "--engine-replay") != args.end()) {
    deepinfer::Result<deepinfer::bench::EngineReplayOptions> options = deepinfer::bench::parse_engine_replay_args(args);
    if (!options.ok()) {
      std::cerr << options.status().message() << "\n";
      return 2;
    }
    options->command_line = std::string(argv[0]);
    for (const std::string& arg : args) options->command_line += " " + arg;
    if (deepinfer::Status status = deepinfer::bench::run_engine_replay(*options, std::cout); !status.ok()) {
      std::cerr << status.to_string() << "\n";
      return 1;
    }
    return 0;
  }
  if (std::find(args.begin(), args.end(), "--live") != args.end()) {
    deepinfer::Result<deepinfer::bench::LiveReplayOptions> options = deepinfer::bench::parse_live_replay_args(args);
    if (!options.ok()) {
      std::cerr << options.status().message() << "\n";
      return 2;
    }
    std::string command_line = argv[0];
    for (const std::string& arg : args) {
      command_line += arg.find_first_of(" \"'") == std::string::npos ? " " + arg : " '" + arg + "'";
    }
    options->command_line = command_line;
    if (deepinfer::Status status = deepinfer::bench::run_live_replay(*options, std::cout); !status.ok()) {
      std::cerr << status.to_string() << "\n";
      return 1;
    }
    return 0;
  }
  deepinfer::Result<deepinfer::bench::ReplayOptions> options = deepinfer::bench::parse_replay_args(args);
  if (!options.ok()) {
    std::cerr << options.status().message() << "\n";
    return 2;
  }
  if (deepinfer::Status status = deepinfer::bench::run_replay(*options, std::cout); !status.ok()) {
    std::cerr << status.to_string() << "\n";
    return 1;
  }
  return 0;
}
