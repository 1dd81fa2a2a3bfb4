// Routing policies of `deepinfer router`: which worker gets a request. Pure decisions over a snapshot the
// router keeps (no I/O, no clock), so they are tested table by table and the replay benchmark runs the same
// code as the router.
//
//   kv-aware         by cost, as Dynamo's KV router: for worker w,
//                      cost_w = (prefill_weight * uncached_w + queue_weight * pending_prefill_w
//                               + decode_weight * active_tokens_w) / 64
//                    in 64-token blocks, where uncached_w is the request's prompt tokens less what w holds of
//                    its chain (a block held only in host RAM still costs host_block_cost of a block, one only
//                    on disk disk_block_cost), pending_prefill_w the uncached tokens of w's requests still
//                    waiting for their first byte, and active_tokens_w the prompt tokens of all of w's requests in
//                    flight (the KV its decode steps read). Lowest cost wins; ties go to the longer match, then in
//                    turn. Session affinity falls out of it: a conversation's next turn matches where its last
//                    one ran.
//   round-robin      in turn.
//   consistent-hash  a hash ring (160 virtual nodes per worker, XXH3-64 of "URL#i") over a key: the seed's
//                    gateway hashes the first 2,048 characters of the system and user text (affinity_key).
//   least-load       fewest requests in flight; ties in turn.
// Every policy skips unhealthy workers and the workers a retry excludes.
//
// Thread-safety: RoutingPolicy::choose is not thread-safe (its turn counter); the router calls it under its lock.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/router/kv_index.h"

namespace deepinfer::router {

enum class Policy { kKvAware, kRoundRobin, kConsistentHash, kLeastLoad };
inline constexpr std::string_view kPolicyNames = "kv-aware, round-robin, consistent-hash, least-load";
std::string_view policy_name(Policy policy);
// Errors: InvalidArgument naming the value and the choices.
Result<Policy> parse_policy(std::string_view name);

// What the router knows of one worker when it decides.
struct WorkerState {
  bool healthy = true;
  int32_t in_flight = 0;               // requests sent, response not ended
  int64_t pending_prefill_tokens = 0;  // uncached prompt tokens of those still waiting for their first byte
  int64_t active_tokens = 0;           // prompt tokens of every request in flight
};

struct CostWeights {
  double prefill_weight = 1.0;
  // Prefill queued on the worker (other requests' uncached tokens not yet answered), per block. 1.0 minimises
  // this request's wait alone; less keeps conversations with their cache when workers are busy (a request sent
  // away duplicates its prefix and loses its later turns' hits): on the live trace replay 1.0 reached 0.87 of
  // the single big worker's hit rate, 0.25 0.99 at the same TTFT (bench/router/README.md).
  double queue_weight = 0.25;
  // A running request's KV read by every decode step, per block, against a block of prefill. Dynamo counts them
  // alike (1.0); a decode step reads a block far faster than prefill computes one, and on the live trace replay
  // weight 1 sent returning conversations away from their cache (bench/router/README.md): default 0.1.
  double decode_weight = 0.1;
  double host_block_cost = 0.1;  // a block loaded back from host RAM, as a fraction of computing it
  double disk_block_cost = 0.3;  // from disk
};

// One request as the policies see it.
struct RouteRequest {
  int64_t prompt_tokens = 0;          // 0 when the router could not tokenize it (kv-aware then balances load)
  std::vector<PrefixMatch> matches;   // per worker; empty: no cache information
  uint64_t affinity_key = 0;          // consistent-hash's key
  std::vector<uint8_t> excluded;      // per worker, nonzero: tried already; empty: none
};

struct Decision {
  int32_t worker = -1;  // -1: no worker can take it (all unhealthy or excluded)
  // Why, for the metrics: "cache_hit" (kv-aware chose the longest match), "load" (kv-aware chose a shorter
  // match because the longest one was busier), "no_cache_hit" (no worker held any of it), "round_robin",
  // "consistent_hash", "least_load".
  std::string_view reason;
  int64_t cached_tokens = 0;  // the index's prediction for the chosen worker (kv-aware), else 0
  int64_t uncached_tokens = 0;  // prompt tokens the chosen worker must compute, predicted (all of them without an index)
};

class RoutingPolicy {
 public:
  // `worker_names` (the URLs) place the workers on the consistent-hash ring.
  RoutingPolicy(Policy policy, std::vector<std::string> worker_names, CostWeights weights = {});

  Decision choose(const RouteRequest& request, std::span<const WorkerState> workers);
  Policy policy() const { return policy_; }

  // Uncached prompt tokens on a worker holding `match` of a prompt of `prompt_tokens`, tier-weighted (at least 0).
  // Exposed for tests.
  double uncached_tokens(int64_t prompt_tokens, const PrefixMatch& match) const;

 private:
  bool eligible(const RouteRequest& request, std::span<const WorkerState> workers, int32_t w) const;
  Decision kv_aware(const RouteRequest& request, std::span<const WorkerState> workers);
  Decision consistent_hash(const RouteRequest& request, std::span<const WorkerState> workers) const;
  int32_t in_turn(const std::vector<int32_t>& candidates);

  Policy policy_;
  CostWeights weights_;
  std::vector<std::pair<uint64_t, int32_t>> ring_;  // (point, worker), sorted
  uint64_t turn_ = 0;
};

// The seed gateway's key: XXH3-64 of the first `chars` characters (Unicode code points; fewer when the text is
// shorter) of `text`, the request's system and user text in order. The seed's gateway uses 2,048
// (--affinity-chars).
inline constexpr int64_t kSeedAffinityChars = 2048;
uint64_t affinity_key(std::string_view text, int64_t chars = kSeedAffinityChars);

}  // namespace deepinfer::router
