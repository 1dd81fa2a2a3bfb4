// Offline replay of a live trace replay: the same prompts `bench_replay --live` sends (live_prompts.h, the
// warm-up included), run through the engine's own scheduler and prefix cache (engine::plan_kv_cache,
// engine::Scheduler, kvcache::KvCacheManager with its mover) with no model: every sampled token is a fixed id and
// device blocks are bytes nobody reads. Its per-tier hit rates are what a server with the same settings reports
// in /metrics for the same trace; the note on the engine-core issue compares the two.
#pragma once

#include <cstdint>
#include <ostream>
#include <span>
#include <string>

#include "deepinfer/core/status.h"
#include "live_prompts.h"

namespace deepinfer::bench {

struct EngineReplayOptions {
  std::string trace_path;
  int64_t requests = 200;  // the first N requests; <= 0: all
  LivePromptConfig prompts;
  int32_t warmup_requests = 1;
  int32_t concurrency = 1;  // requests in flight (closed loop, as the live replay's clients)
  // The server's settings: KV blocks per tier (the demo model's 98,304-byte blocks by default), step limits.
  int64_t block_bytes = 98304;
  int64_t device_blocks = 96;
  int64_t host_blocks = 0;  // 0: no host tier
  int32_t max_num_batched_tokens = 2048;
  int32_t max_num_seqs = 64;
  std::string command_line;
};

// `--engine-replay --trace FILE [--requests N] [--device-blocks N] [--host-blocks N] [--block-bytes B]
// [--block-tokens T] [--max-prompt-tokens P] [--max-tokens M] [--concurrency C] [--warmup N] [--seed S]
// [--max-num-batched-tokens N] [--max-num-seqs N]`. Errors: InvalidArgument naming the flag.
Result<EngineReplayOptions> parse_engine_replay_args(std::span<const std::string> args);

// One JSON line: the live replay's "server" object (token hit rate, per-tier hits, misses, hit rate,
// evictions) from the cache's counters over the run (after the warm-up), plus the settings.
Status run_engine_replay(const EngineReplayOptions& options, std::ostream& out);

}  // namespace deepinfer::bench
