// Trace replay with no model: a Mooncake trace's requests (arrival time, prompt length, 512-token block hash
// ids) driven through the real TierPolicy at a range of capacities, against the ideal infinite-cache bound.
// One JSON line per capacity; optionally a PNG plot of hit rate vs capacity. Used by `bench_replay` and by
// the tests that pin the ideal bounds.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/tier_policy.h"

namespace deepinfer::bench {

// Tokens per block in the Mooncake traces (FAST'25 release README; `len(hash_ids) == ceil(input_length/512)`).
inline constexpr int32_t kMooncakeBlockTokens = 512;

struct TraceRequest {
  int64_t timestamp_ms = 0;       // from the start of the trace
  int64_t input_length = 0;       // prompt tokens
  int64_t output_length = 0;      // generated tokens (unused by the cache simulation)
  std::vector<int64_t> hash_ids;  // one per 512-token block, the last one partial
};

struct Trace {
  std::string name;  // the file name without directory and extension
  std::vector<TraceRequest> requests;
  int64_t total_blocks = 0;   // sum of hash_ids sizes
  int64_t unique_blocks = 0;  // distinct hash ids: the working set of an infinite cache
};

// Reads a Mooncake JSON-lines trace. Errors: IoError when unreadable; Corruption naming the line and field
// when a line is not an object with integer timestamp/input_length/output_length and an integer array
// hash_ids of ceil(input_length / 512) entries, or timestamps go backwards.
Result<Trace> load_mooncake_trace(const std::string& path);

struct HitRates {
  double block_hit_rate = 0;
  double token_hit_rate = 0;
};

// The bound of an infinite cache: a request's block hits when it and every earlier block of the request were
// seen before (prefix semantics; on these traces identical to "seen anywhere"), and, with `ttl_ms`, were last
// touched at most ttl_ms earlier. Token-weighted: the last block counts input_length - 512 * (n - 1) tokens.
HitRates ideal_hit_rates(const Trace& trace, std::optional<int64_t> ttl_ms = std::nullopt);

struct ReplayConfig {
  int64_t capacity_blocks = 0;  // device tier, in 512-token blocks
  int64_t host_blocks = 0;      // 0: no host tier
  int64_t disk_blocks = 0;      // 0: no disk tier
  std::optional<double> ttl_s;  // the default class's TTL; none: RetentionConfig::defaults() (7 days)
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  double evict_blocks_per_s = kvcache::kUnlimited;  // per tier
  // DeepSeek-V3 in bf16: 61 layers x 576 values x 2 bytes per token, 512 tokens per block.
  int64_t bytes_per_block = 61LL * 576 * 2 * kMooncakeBlockTokens;
};

struct ReplayResult {
  ReplayConfig config;
  kvcache::CacheCounters counters;
  double seconds = 0;  // wall time of the replay
};

// Replays the trace in arrival order: at each request's timestamp, tick(), lookup() of its hash chain (its
// longest cached prefix hits), insert() of all its blocks, release(). Requests hold no pins past their
// arrival (no decode time is simulated). Errors: the policy config's validation error.
Result<ReplayResult> replay_trace(const Trace& trace, const ReplayConfig& config);

// The default capacity range: C = ceil(unique_blocks / high_watermark), the smallest device tier that holds
// the whole working set without crossing its high watermark, and C/2, C/4, ..., C/128 (8 points, ascending,
// at least 1, duplicates removed).
std::vector<int64_t> default_capacities(const Trace& trace, double high_watermark);

// One JSON object (no newline): trace, capacity_blocks, block_hit_rate, token_hit_rate, ideal_block_hit_rate,
// ideal_token_hit_rate, then details (ttl_s, ideal TTL-bounded rates when a TTL is set, request and block
// counts, per-tier counters, seconds).
std::string replay_json_line(const Trace& trace, const ReplayResult& result, const HitRates& ideal,
                             const std::optional<HitRates>& ideal_with_ttl);

// Command line of `bench_replay` / `deepinfer bench replay`.
struct ReplayOptions {
  std::string trace_path;
  std::vector<int64_t> capacities;  // empty: default_capacities()
  std::optional<double> ttl_s;
  std::string plot_path;  // empty: no plot; else a PNG there and the same data as CSV beside it
  ReplayConfig base;      // host/disk tiers, watermarks, eviction rate
};

// Parses `--trace FILE [--capacity-blocks N,M,...] [--ttl-s S] [--plot OUT.png] [--host-blocks N]
// [--disk-blocks N] [--evict-blocks-per-s R] [--high-watermark F] [--low-watermark F]` (args without the
// program name). Errors: InvalidArgument naming the flag and value.
Result<ReplayOptions> parse_replay_args(std::span<const std::string> args);
std::string replay_usage();

// Loads, replays every capacity (printing each JSON line to `out` as it finishes) and writes the plot.
// Errors: loading, config and plot-writing errors.
Status run_replay(const ReplayOptions& options, std::ostream& out);

}  // namespace deepinfer::bench
