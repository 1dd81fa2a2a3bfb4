// The server's Prometheus metrics (text exposition format 0.0.4), every name prefixed `deepinfer_`:
//   deepinfer_time_to_first_token_seconds        histogram  request arrival -> first generated token
//   deepinfer_time_per_output_token_seconds      histogram  per request: (last token - first token) / (n - 1)
//   deepinfer_e2e_request_latency_seconds        histogram  request arrival -> response end
//   deepinfer_prompt_tokens_total                counter    prompt tokens of admitted requests
//   deepinfer_prompt_tokens_cached_total         counter    of those, served from the prefix cache
//   deepinfer_generation_tokens_total            counter    generated tokens (every token the engine produced)
//   deepinfer_num_requests_running               gauge      sequences the engine is running
//   deepinfer_num_requests_waiting               gauge      sequences queued (preempted ones included)
//   deepinfer_kv_cache_blocks_used               gauge      KV blocks in use
//   deepinfer_kv_cache_blocks_free               gauge      KV blocks free
//   deepinfer_requests_total{outcome}            counter    finished generation requests by outcome: the
//                                                           finish reason (stop, length, tool_calls), or
//                                                           client_disconnect, or error_<HTTP status>
//   deepinfer_client_disconnects_total           counter    clients that went away before their response ended
//   deepinfer_malformed_tool_calls_total         counter    tool-call markup the output parser could not parse
//   deepinfer_http_requests_total{status}        counter    HTTP responses by status code (every route)
//   deepinfer_tokenization_cache_hits_total      counter    prompt text runs whose ids came from the
//                                                           tokenization cache (--tokenization-cache-mb)
//   deepinfer_tokenization_cache_misses_total    counter    runs encoded and added to it
//   deepinfer_tokenization_cache_hit_tokens_total counter   prompt tokens served from it
//   deepinfer_tokenization_cache_miss_tokens_total counter  prompt tokens encoded on a miss
//   deepinfer_tokenization_cache_evictions_total counter    entries evicted (least recently used first)
//   deepinfer_tokenization_cache_bytes           gauge      bytes its entries hold (all 0 when it is off)
// The prefix cache per tier (tier = device, host, disk; host and disk only when configured), in 64-token blocks:
//   deepinfer_kv_tier_usage_blocks{tier}         gauge      blocks cached in the tier
//   deepinfer_kv_tier_capacity_blocks{tier}      gauge      blocks the tier can hold
//   deepinfer_kv_tier_hits_total{tier}           counter    prompt blocks served from the tier at admission (device:
//                                                           reused in place; host, disk: loaded back)
//   deepinfer_kv_tier_misses_total{tier}         counter    prompt blocks an admitted request needed from the tier and
//                                                           did not get from it (absent, expired or corrupt)
//   deepinfer_kv_tier_evictions_total{tier}      counter    blocks dropped under capacity pressure
//   deepinfer_kv_tier_expired_total{tier}        counter    blocks dropped because their TTL passed
//   deepinfer_kv_tier_refused_total{tier}        counter    stores refused (tier full, eviction bucket empty) or failed
//   deepinfer_kv_tier_corrupt_total{tier}        counter    loads that found the block corrupt, foreign or gone (disk)
//   deepinfer_kv_tier_bytes_written_total{tier}  counter    bytes copied into the tier
//   deepinfer_kv_tier_bytes_read_total{tier}     counter    bytes copied out of the tier (load-back)
//   deepinfer_kv_tier_loaded_blocks_total        counter    device blocks filled from host or disk instead of prefill
//   deepinfer_kv_disk_queue_blocks               gauge      block transfers queued or running (disk, host copies)
// Speculative decoding (--speculative-algorithm mtp; all zero when off). A verify: one request's step that checked
// drafts.
//   deepinfer_spec_draft_tokens_total            counter    draft tokens the target verified
//   deepinfer_spec_accepted_tokens_total         counter    of those, accepted
//   deepinfer_spec_emitted_tokens_total          counter    tokens verifies produced (accepted + 1 each); mean
//                                                           accepted length = this / deepinfer_spec_verify_length_count
//   deepinfer_spec_draft_tokens_by_position_total{position}    counter  drafts verified at draft position 1..K
//   deepinfer_spec_accepted_tokens_by_position_total{position} counter  drafts accepted there (acceptance by position
//                                                           = accepted / draft, per position)
//   deepinfer_spec_verify_length                 histogram  tokens per verify: the last token + drafts (le 1..K+1)
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/recipe/tokenization_cache.h"
#include "deepinfer/engine/engine_client.h"

namespace deepinfer::server {

// A cumulative histogram with fixed upper bounds (seconds). Thread-safe.
class Histogram {
 public:
  // REQUIRES: bounds ascending.
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Appends the HELP, TYPE, _bucket, _sum and _count lines for `name`.
  void render(std::string_view name, std::string_view help, std::string& out) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> buckets_;  // GUARDED_BY(mu_) per bound (not cumulative); +Inf is count_
  double sum_ = 0.0;               // GUARDED_BY(mu_)
  uint64_t count_ = 0;             // GUARDED_BY(mu_)
};

// Thread-safe: every member may be updated from any thread.
class Metrics {
 public:
  Metrics();

  Histogram time_to_first_token;
  Histogram time_per_output_token;
  Histogram e2e_request_latency;
  std::atomic<int64_t> prompt_tokens{0};
  std::atomic<int64_t> prompt_tokens_cached{0};
  std::atomic<int64_t> generation_tokens{0};
  std::atomic<int64_t> client_disconnects{0};
  std::atomic<int64_t> malformed_tool_calls{0};
  // Prefill/decode KV transfer (kv_transfer.h): blocks and payload bytes by direction, the receiver's time from
  // asking to holding every block checked, and the transfers a receiver gave up on (it computes the prompt itself).
  std::atomic<int64_t> kv_transfer_blocks_sent{0};
  std::atomic<int64_t> kv_transfer_blocks_received{0};
  std::atomic<int64_t> kv_transfer_bytes_sent{0};
  std::atomic<int64_t> kv_transfer_bytes_received{0};
  Histogram kv_transfer_seconds;

  void count_outcome(std::string_view outcome);
  // reason: timeout, connect, peer_error, corrupt, protocol, refused (the engine refused the blocks).
  void count_kv_transfer_failure(std::string_view reason);
  void count_http_status(int status);
  // The whole exposition, with the engine gauges taken from `load` and the tokenization cache's counters
  // from `tokenization` (the server's cache keeps them; a default Stats when it has none).
  std::string render(const engine::EngineLoad& load, const recipe::TokenizationCache::Stats& tokenization) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t, std::less<>> outcomes_;  // GUARDED_BY(mu_)
  std::map<int, int64_t> http_statuses_;                  // GUARDED_BY(mu_)
  std::map<std::string, int64_t, std::less<>> kv_transfer_failures_;  // GUARDED_BY(mu_)
};

}  // namespace deepinfer::server
