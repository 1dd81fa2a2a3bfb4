// bench_replay: the no-model trace replay of the prefix cache (see trace_replay.h). Prints one JSON line per
// capacity; exit 0 on success, 1 on a load/replay error, 2 on bad arguments.
#include <iostream>
#include <string>
#include <vector>

#include "trace_replay.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
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
