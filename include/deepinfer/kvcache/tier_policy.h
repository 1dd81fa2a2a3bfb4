// The tier and retention policy of the prefix cache: which tier holds which block, when blocks move down
// (device -> host -> disk) and back up, and when they go. It owns the PrefixIndex and makes every decision
// the engine will follow; it moves no bytes itself (the engine's transfer code does, from the lists this
// returns and the index's events), so the same code runs the trace replay with no model.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/prefix_index.h"

namespace deepinfer::kvcache {

inline constexpr double kUnlimited = std::numeric_limits<double>::infinity();

// A token bucket: tokens accrue at `rate_per_s` up to `burst`; work takes tokens or waits. It starts full.
// Time is passed in (milliseconds, monotonic); a refill with an earlier time than the last one is ignored.
// Thread-safety: a value; one owner.
class TokenBucket {
 public:
  // rate_per_s = kUnlimited: try_take always succeeds. REQUIRES: rate_per_s > 0, burst > 0.
  TokenBucket(double rate_per_s, double burst);

  // Adds rate_per_s * (now_ms - last refill) / 1000 tokens, capped at burst. The first call only sets the clock.
  void refill(int64_t now_ms);
  // Takes `amount` tokens when that many are available; false (and nothing taken) otherwise.
  bool try_take(double amount);
  // Returns tokens taken for work that did not happen (capped at burst).
  void refund(double amount);
  double available() const { return tokens_; }
  bool unlimited() const { return rate_per_s_ == kUnlimited; }

 private:
  double rate_per_s_;
  double burst_;
  double tokens_;
  std::optional<int64_t> last_ms_;
};

// One tier's size and eviction settings. Watermarks are fractions of capacity_blocks: background eviction
// starts when usage rises above floor(high_watermark * capacity) and, once started, runs (across ticks) until
// usage is at or below floor(low_watermark * capacity). Every eviction from the tier, by tick or by an
// admission, costs bytes_per_block tokens of the tier's bucket.
struct TierConfig {
  int64_t capacity_blocks = 0;  // 0: the tier is absent (the device tier must be present)
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  double evict_bytes_per_s = kUnlimited;  // the token bucket's rate
  double evict_burst_bytes = 0;           // its size; 0: one second of the rate, at least one block
};

struct TierPolicyConfig {
  std::array<TierConfig, kNumTiers> tiers;  // indexed by tier_index(Tier)
  int64_t bytes_per_block = 1;              // of one block, all cache kinds (V3, bf16: 61 x 64 x 576 x 2)
  int32_t block_tokens = kBlockTokens;      // tokens per block (512 in the Mooncake traces)
  RetentionConfig retention = RetentionConfig::defaults();
  bool write_through_to_host = true;          // copy each completed block to host at once
  // Copy each completed block to disk at once too (the engine's choice: a kill -9 then loses no block), rather
  // than only when host evicts it.
  bool write_through_to_disk = false;
  CacheKindSet required_kinds = kLatentOnly;  // what a lookup needs for a block to count
  // Validates everything: InvalidArgument naming the field, value and limit.
  Status validate() const;
};

// Counters of one tier; everything a metric needs (usage and capacity are gauges, the rest only grow).
struct TierCounters {
  int64_t usage_blocks = 0;
  int64_t capacity_blocks = 0;
  int64_t hit_blocks = 0;       // prompt blocks served from this tier (the fastest tier holding them)
  int64_t miss_blocks = 0;      // prompt blocks that reached this tier and were not served by it
  int64_t admitted_blocks = 0;  // copies written into this tier (insert, write-through, demotion, load-back)
  int64_t refused_blocks = 0;   // admissions refused: the tier was full and its bucket had no tokens
  int64_t evicted_blocks = 0;   // copies dropped under pressure (watermarks or admission)
  int64_t expired_blocks = 0;   // copies dropped because their TTL passed
  int64_t demoted_blocks = 0;   // evicted copies first written to the next lower tier
  int64_t bytes_written = 0;    // into this tier
  int64_t bytes_read = 0;       // out of this tier (load-back to device, demotion to a lower tier)
};

struct CacheCounters {
  std::array<TierCounters, kNumTiers> tiers;
  int64_t lookups = 0;
  int64_t lookup_blocks = 0;    // blocks of the looked-up chains (full blocks; the trace counts its partial tail too)
  int64_t hit_blocks = 0;       // of which served from some tier
  int64_t lookup_tokens = 0;    // prompt tokens of the lookups
  int64_t hit_tokens = 0;       // of which served from the cache
  int64_t inserted_blocks = 0;  // new nodes created by insert
  double block_hit_rate() const { return lookup_blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / lookup_blocks; }
  double token_hit_rate() const { return lookup_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / lookup_tokens; }
};

// The longest cached prefix of a request, ready for prefill: every node is pinned once and has a device
// copy (blocks found lower down were admitted to device: the engine loads their bytes before prefill).
struct LookupResult {
  std::vector<NodeId> nodes;  // chain order
  std::vector<Tier> sources;  // per node: the tier it was found in (kDevice: already resident)
  int64_t hit_tokens = 0;     // min(nodes.size() * block_tokens, prompt_tokens)
  int64_t bytes_loaded = 0;   // bytes to move up into device
};

struct InsertResult {
  std::vector<NodeId> nodes;  // chain[0, nodes.size()), pinned once each; shorter than the chain when refused
  int64_t new_blocks = 0;     // nodes created
  int64_t device_blocks = 0;  // of the chain's blocks, how many now have a device copy
};

struct TickResult {
  std::array<int64_t, kNumTiers> evicted{};
  std::array<int64_t, kNumTiers> expired{};
  std::array<int64_t, kNumTiers> demoted{};
};

// The policy.
//
// Request path (engine thread): lookup() before prefill, insert() once the prompt's blocks are complete (and
// again as decode fills blocks), release() when the request finishes. Background: tick() every few
// milliseconds (the engine loop) or, in the replay, before each request.
//
// Placement: insert puts each block in device, and with write_through_to_host also in host. An eviction from
// device or host first writes the block to the next lower present tier when that tier lacks it (demotion);
// an eviction from disk drops it. A lookup that finds a block only in host or disk loads it back to device
// (from disk through host), counted as a hit of the tier it came from, with the bytes moved.
//
// Retention: each block's expiry is its last access plus its class's TTL; expired blocks never match and
// tick() drops them (without demotion) ahead of anything else. Under pressure the block with the earliest
// expiry goes first: LRU within a class. Only the index's eviction candidates (unpinned leaves of that tier)
// ever go.
//
// Gradual eviction, no flush on the request path: tick() evicts above the high watermark down to the low
// one, at most as fast as the tier's token bucket allows. An admission into a full tier (usage == capacity)
// may evict one block per admitted block, and only with a token from that tier's bucket; when the bucket is
// empty the admission is refused: the block is simply not cached in that tier (an insert stops at the first
// block no tier admits; a load-back stops the match there). So a request never waits for more eviction work
// than its own blocks, bounded by the bucket.
//
// Disk chains: a block whose parent has no disk copy enters the disk tier only into free room, never by evicting
// (a restart rebuilds the disk tier from chains' first blocks: such a block survives one only once its parent
// follows it down, as a host tier's eviction from chains' ends brings it).
//
// Thread-safety: not thread-safe; one owner (the engine thread) calls everything, including tick().
class TierPolicy {
 public:
  // Errors: the config's validation error.
  static Result<TierPolicy> create(TierPolicyConfig config);

  // Finds the longest live prefix of `chain` with config.required_kinds in any tier, loads the blocks found
  // below device back to device (stopping at the first one device refuses), touches and pins the result, and
  // counts the lookup: `prompt_tokens` prompt tokens, chain.size() blocks (pass the trailing partial block's
  // hash too when the caller has one, as the trace does; the engine passes full blocks only).
  // REQUIRES: known ttl_class; prompt_tokens >= 0.
  // `max_hit_blocks`: the hit ends there at the latest (the engine's bounded-replay rule for sliding-window
  // kinds, cache_layout.h); the rest of the chain counts as missed.
  LookupResult lookup(std::span<const BlockHash> chain, int64_t prompt_tokens, int64_t now_ms,
                      TtlClassId ttl_class = kDefaultTtlClass, size_t max_hit_blocks = SIZE_MAX);

  // Caches the blocks of `chain` (whose KV the engine has just computed or holds): existing nodes are shared
  // and touched, new ones created; each block gets a device copy when device admits it and a host copy by
  // write-through; stops at the first block that no tier admits and the index lacks. Pins every returned
  // node once. REQUIRES: known ttl_class.
  InsertResult insert(std::span<const BlockHash> chain, int64_t now_ms, TtlClassId ttl_class = kDefaultTtlClass);

  // Evicts one candidate of `tier` now (demoting it first, as tick() does), paid from the tier's bucket: the
  // engine's device pool asks for a block this way when no block is free. False when none may go.
  bool evict_one_now(Tier tier, int64_t now_ms);

  // A block lookup() counted as a hit of `source` could not be loaded after all (its copy was corrupt or gone):
  // it counts as a miss there instead.
  void count_failed_hit(Tier source);

  // Unpins nodes returned by lookup() or insert() (once per time returned).
  // Errors: the index's unpin error for the first bad id; the ids before it are unpinned.
  Status release(std::span<const NodeId> nodes);

  // Background work at now_ms: refills the buckets, drops expired blocks, evicts by watermarks, all within
  // the buckets. Returns what it did.
  TickResult tick(int64_t now_ms);

  // The counters, with usage gauges filled in.
  CacheCounters counters() const;
  const PrefixIndex& index() const { return index_; }
  // For the engine: record device block ids, add kinds, set the event listener. Mutating tiers or pins
  // behind the policy's back is allowed but then the caller owns the consequences.
  PrefixIndex& mutable_index() { return index_; }
  const TierPolicyConfig& config() const { return config_; }
  bool tier_present(Tier tier) const {
    return config_.tiers[static_cast<size_t>(tier_index(tier))].capacity_blocks > 0;
  }
  // Whether background eviction of `tier` is running (above its high watermark, not yet at its low one).
  bool evicting(Tier tier) const { return evicting_[static_cast<size_t>(tier_index(tier))]; }

 private:
  explicit TierPolicy(TierPolicyConfig config);
  TierConfig& tier_config(Tier tier) { return config_.tiers[static_cast<size_t>(tier_index(tier))]; }
  TierCounters& tier_counters(Tier tier) { return counters_.tiers[static_cast<size_t>(tier_index(tier))]; }
  TokenBucket& bucket(Tier tier) { return buckets_[static_cast<size_t>(tier_index(tier))]; }
  std::optional<Tier> lower_tier(Tier tier) const;
  // Frees one slot of a full tier within its bucket; false when the tier is full and nothing may go.
  bool make_room(Tier tier, int64_t now_ms);
  // Copies `node` into `tier` when there is room; counts the admission or the refusal.
  bool admit(NodeId node, Tier tier, int64_t now_ms);
  // Evicts the first of the next few candidates of `tier` that can go (only expired ones when
  // `expired_only`), paying one block from the bucket; false when none could.
  bool evict_one(Tier tier, int64_t now_ms, bool expired_only, TickResult* result);
  // Removes candidate `node` from `tier`, demoting it first unless it expired. False (nothing changed but
  // counters of a failed demotion) when it is the node's last copy, it has children, and it cannot be demoted.
  bool evict(NodeId node, Tier tier, int64_t now_ms, TickResult* result);

  TierPolicyConfig config_;
  PrefixIndex index_;
  std::array<TokenBucket, kNumTiers> buckets_;
  std::array<bool, kNumTiers> evicting_{};
  CacheCounters counters_;
};

}  // namespace deepinfer::kvcache
