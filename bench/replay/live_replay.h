// Live trace replay: a Mooncake trace's first requests, turned into token-id prompts with the trace's prefix
// sharing (live_prompts.h), sent to a running `deepinfer serve` as streaming /v1/completions, in trace order.
// One JSON line per run: TTFT and end-to-end percentiles, TTFT apart for the requests at least half of whose
// prompt an infinite cache would hold ("mostly shared") and the rest, prompt and cached tokens (from usage),
// the server's own hit rates (deltas of its /metrics over the run) and the ideal bound of an infinite cache.
// Run it against servers with and without prefix caching to measure what the cache buys in TTFT.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <string>

#include "deepinfer/core/status.h"
#include "live_prompts.h"

namespace deepinfer::bench {

struct LiveReplayOptions {
  // http://host:port of the server; or several, comma-separated: each request then goes to every server in
  // turn (the first one rotating), so that outside load on a shared machine falls on all alike, and each server
  // gets its own JSON line. Closed loop only.
  std::string url;
  std::string trace_path;
  int64_t requests = 200;  // the first N requests of the trace; <= 0: all
  LivePromptConfig prompts;
  // Closed loop (default): `concurrency` clients send the requests in trace order, each the next one as soon as
  // its previous one ends. TTFT runs from sending.
  int32_t concurrency = 1;
  // Open loop: request i is due at start + timestamp_i / time_scale, sent by the first of `concurrency` clients
  // that is free; TTFT runs from when it was due, so a late send (all clients busy) counts against it.
  std::optional<double> time_scale;
  int32_t warmup_requests = 1;  // sent first, uncounted, with tokens no trace block uses
  std::string model;            // `model` field; empty: none (the server's own)
  std::string api_key;
  std::string label;         // with several URLs, "A|B|..." labels them in order
  std::string command_line;  // echoed into the JSON line
};

// Parses `--live URL[,URL...] --trace FILE [--requests N] [--block-tokens T] [--max-prompt-tokens P] [--max-tokens M]
// [--concurrency C] [--time-scale F] [--warmup N] [--seed S] [--model NAME] [--api-key KEY] [--label TEXT]`
// (args without the program name). Errors: InvalidArgument naming the flag and value.
Result<LiveReplayOptions> parse_live_replay_args(std::span<const std::string> args);
std::string live_replay_usage();

// Loads the trace, builds the prompts, replays them and prints one JSON line to `out`. Requests that fail are
// counted (`failed`, `first_error`), not fatal. Errors: the trace or config is bad, or the server's /metrics
// cannot be read (IoError naming the URL).
Status run_live_replay(const LiveReplayOptions& options, std::ostream& out);

}  // namespace deepinfer::bench
