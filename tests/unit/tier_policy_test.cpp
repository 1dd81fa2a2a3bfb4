// TierPolicy as tables of steps with the expected state after each (the step number in every failure
// message): the token bucket, watermark eviction and its hysteresis, the bucket's limit per tick, admission
// refused rather than flushed, TTL expiry and LRU within a class, demotion and load-back across device, host
// and disk with their counters.
#include "deepinfer/kvcache/tier_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer::kvcache {
namespace {

constexpr int64_t kBytesPerBlock = 100;
constexpr int64_t kHourMs = 3600LL * 1000;
constexpr int64_t kDayMs = 24 * kHourMs;

std::vector<BlockHash> chain_of(std::initializer_list<uint64_t> ids) {
  std::vector<BlockHash> chain;
  for (uint64_t id : ids) chain.push_back(BlockHash{id, 0});
  return chain;
}

TierPolicyConfig make_config(int64_t device, int64_t host = 0, int64_t disk = 0) {
  TierPolicyConfig config;
  config.bytes_per_block = kBytesPerBlock;
  config.tiers[0].capacity_blocks = device;
  config.tiers[1].capacity_blocks = host;
  config.tiers[2].capacity_blocks = disk;
  for (TierConfig& tier : config.tiers) tier.high_watermark = tier.low_watermark = 1.0;  // admission only
  return config;
}

TierPolicy make_policy(TierPolicyConfig config) {
  Result<TierPolicy> policy = TierPolicy::create(std::move(config));
  EXPECT_TRUE(policy.ok()) << policy.status().to_string();
  return std::move(policy).value();
}

// Single-block chains {id}: the ids with a copy in `tier`, ascending.
std::vector<uint64_t> resident(const TierPolicy& policy, Tier tier, uint64_t max_id = 100) {
  std::vector<uint64_t> ids;
  for (uint64_t id = 1; id <= max_id; ++id) {
    const NodeId node = policy.index().find_child(kNoNode, BlockHash{id, 0});
    if (node != kNoNode && policy.index().node(node).tiers.has(tier)) ids.push_back(id);
  }
  return ids;
}

void insert_and_release(TierPolicy& policy, const std::vector<BlockHash>& chain, int64_t now_ms,
                        TtlClassId ttl_class = kDefaultTtlClass) {
  InsertResult result = policy.insert(chain, now_ms, ttl_class);
  ASSERT_TRUE(policy.release(result.nodes).ok());
}

TEST(TokenBucketTest, Steps) {
  enum class Op { kRefill, kTake, kRefund };
  struct Step {
    Op op;
    double value;  // now_ms for refill, tokens otherwise
    bool expected_taken;
    double expected_available;
  };
  const std::vector<Step> steps = {
      {Op::kRefill, 0, true, 5},  // the first refill sets the clock; the bucket starts full
      {Op::kTake, 3, true, 2},       {Op::kTake, 3, false, 2},    // not enough: nothing taken
      {Op::kRefill, 100, true, 3},                                // 10 tokens/s x 0.1 s
      {Op::kTake, 3, true, 0},       {Op::kRefill, 50, true, 0},  // time going backwards is ignored
      {Op::kRefill, 10100, true, 5},                              // capped at the burst
      {Op::kTake, 5, true, 0},       {Op::kRefund, 2, true, 2},  {Op::kRefund, 10, true, 5},  // capped
  };
  TokenBucket bucket(10.0, 5.0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    bool taken = true;
    if (step.op == Op::kRefill) bucket.refill(static_cast<int64_t>(step.value));
    if (step.op == Op::kTake) taken = bucket.try_take(step.value);
    if (step.op == Op::kRefund) bucket.refund(step.value);
    EXPECT_EQ(taken, step.expected_taken) << "step " << i + 1;
    EXPECT_NEAR(bucket.available(), step.expected_available, 1e-9) << "step " << i + 1;
  }
  TokenBucket unlimited(kUnlimited, 1.0);
  EXPECT_TRUE(unlimited.try_take(1e18));
  EXPECT_TRUE(unlimited.unlimited());
}

TEST(TierPolicyTest, WatermarkEvictionStartsAboveHighAndStopsAtLow) {
  TierPolicyConfig config = make_config(10);
  config.tiers[0].high_watermark = 0.8;  // 8 blocks
  config.tiers[0].low_watermark = 0.5;   // 5 blocks
  TierPolicy policy = make_policy(config);
  struct Step {
    uint64_t insert_id;  // 0: tick instead
    int64_t expected_evicted;
    int64_t expected_usage;
    bool expected_evicting;
    std::vector<uint64_t> expected_resident;  // checked when not empty
  };
  const std::vector<Step> steps = {
      {1, 0, 1, false, {}},
      {2, 0, 2, false, {}},
      {3, 0, 3, false, {}},
      {4, 0, 4, false, {}},
      {5, 0, 5, false, {}},
      {6, 0, 6, false, {}},
      {7, 0, 7, false, {}},
      {8, 0, 8, false, {}},
      {0, 0, 8, false, {1, 2, 3, 4, 5, 6, 7, 8}},  // at the high mark, not above it
      {9, 0, 9, false, {}},                        // inserts never evict below capacity
      {0, 4, 5, false, {5, 6, 7, 8, 9}},           // above high: down to low, oldest first
      {0, 0, 5, false, {}},
      {10, 0, 6, false, {}},
      {11, 0, 7, false, {}},
      {12, 0, 8, false, {}},
      {0, 0, 8, false, {}},
      {13, 0, 9, false, {}},
      {0, 4, 5, false, {9, 10, 11, 12, 13}},
  };
  int64_t now = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    now += 1000;
    int64_t evicted = 0;
    if (step.insert_id != 0) {
      insert_and_release(policy, chain_of({step.insert_id}), now);
    } else {
      evicted = policy.tick(now).evicted[0];
    }
    EXPECT_EQ(evicted, step.expected_evicted) << where;
    EXPECT_EQ(policy.index().num_in_tier(Tier::kDevice), step.expected_usage) << where;
    EXPECT_EQ(policy.evicting(Tier::kDevice), step.expected_evicting) << where;
    if (!step.expected_resident.empty()) {
      EXPECT_EQ(resident(policy, Tier::kDevice), step.expected_resident) << where;
    }
  }
  EXPECT_EQ(policy.counters().tiers[0].evicted_blocks, 8);
}

TEST(TierPolicyTest, TokenBucketLimitsEvictionsPerTick) {
  TierPolicyConfig config = make_config(10);
  config.tiers[0].high_watermark = 0.5;                    // 5 blocks
  config.tiers[0].low_watermark = 0.2;                     // 2 blocks
  config.tiers[0].evict_bytes_per_s = 2 * kBytesPerBlock;  // 2 blocks/s
  config.tiers[0].evict_burst_bytes = 2 * kBytesPerBlock;  // at most 2 in one go
  TierPolicy policy = make_policy(config);
  for (uint64_t id = 1; id <= 10; ++id) insert_and_release(policy, chain_of({id}), 0);
  ASSERT_EQ(policy.index().num_in_tier(Tier::kDevice), 10);
  struct Step {
    int64_t tick_ms;
    int64_t expected_evicted;
    int64_t expected_usage;
    bool expected_evicting;
  };
  const std::vector<Step> steps = {
      {0, 2, 8, true},                           // a full bucket: 2 blocks
      {500, 1, 7, true},                         // 0.5 s: 1 block
      {1000, 1, 6, true},   {3000, 2, 4, true},  // 2 s earns 4, the burst caps it at 2; below high now, still running
      {3000, 0, 4, true},                        // no time, no tokens
      {4000, 2, 2, false},                       // reaches the low mark and stops
      {10000, 0, 2, false},                      // at or below high: nothing to do
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    TickResult result = policy.tick(step.tick_ms);
    EXPECT_EQ(result.evicted[0], step.expected_evicted) << where;
    EXPECT_EQ(policy.index().num_in_tier(Tier::kDevice), step.expected_usage) << where;
    EXPECT_EQ(policy.evicting(Tier::kDevice), step.expected_evicting) << where;
  }
  EXPECT_EQ(resident(policy, Tier::kDevice), (std::vector<uint64_t>{9, 10}));
}

// How many leading blocks of `chain` have a device copy.
size_t device_prefix(const TierPolicy& policy, const std::vector<BlockHash>& chain) {
  NodeId node = kNoNode;
  size_t length = 0;
  for (const BlockHash& hash : chain) {
    node = policy.index().find_child(node, hash);
    if (node == kNoNode || !policy.index().node(node).tiers.has(Tier::kDevice)) break;
    ++length;
  }
  return length;
}

TEST(TierPolicyTest, FullTierWithEmptyBucketRefusesInsteadOfFlushing) {
  TierPolicyConfig config = make_config(4);
  config.tiers[0].evict_bytes_per_s = 1 * kBytesPerBlock;  // 1 block/s, burst 1 block
  TierPolicy policy = make_policy(config);
  const std::vector<BlockHash> x = chain_of({1, 2, 3, 4});
  const std::vector<BlockHash> y = chain_of({5, 6, 7});
  struct Step {
    const std::vector<BlockHash>* chain;
    int64_t now_ms;
    size_t expected_nodes;  // cached prefix of the chain after the insert
    int64_t expected_new;
    int64_t expected_evicted;  // cumulative
    int64_t expected_refused;  // cumulative
    size_t expected_x_on_device;
    size_t expected_y_on_device;
  };
  const std::vector<Step> steps = {
      {&x, 0, 4, 4, 0, 0, 4, 0},
      {&y, 0, 1, 1, 1, 1, 3, 1},     // one token: one eviction (x's leaf), then refused, not flushed
      {&y, 0, 1, 0, 1, 2, 3, 1},     // still no token
      {&y, 1000, 2, 1, 2, 3, 2, 2},  // one more second, one more block
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    InsertResult result = policy.insert(*step.chain, step.now_ms);
    EXPECT_EQ(result.nodes.size(), step.expected_nodes) << where;
    EXPECT_EQ(result.new_blocks, step.expected_new) << where;
    ASSERT_TRUE(policy.release(result.nodes).ok()) << where;
    const CacheCounters counters = policy.counters();
    EXPECT_EQ(counters.tiers[0].evicted_blocks, step.expected_evicted) << where;
    EXPECT_EQ(counters.tiers[0].refused_blocks, step.expected_refused) << where;
    EXPECT_EQ(counters.tiers[0].usage_blocks, 4) << where;
    EXPECT_EQ(device_prefix(policy, x), step.expected_x_on_device) << where;
    EXPECT_EQ(device_prefix(policy, y), step.expected_y_on_device) << where;
    EXPECT_TRUE(policy.index().check_invariants().ok()) << where;
  }
}

TEST(TierPolicyTest, TtlExpiryAndLruWithinAClass) {
  TierPolicyConfig config = make_config(3);
  config.retention = RetentionConfig::defaults(/*default_ttl_hours=*/1.0);
  const TtlClassId chat = *config.retention.find("chat");
  const TtlClassId agent = *config.retention.find("agent");
  TierPolicy policy = make_policy(config);
  enum class Op { kInsert, kLookup, kTick };
  struct Step {
    Op op;
    uint64_t id;
    int64_t now_ms;
    TtlClassId ttl_class;
    int64_t expected_hit_blocks;  // kLookup
    std::vector<uint64_t> expected_resident;
    int64_t expected_expired;  // cumulative
  };
  const std::vector<Step> steps = {
      {Op::kInsert, 1, 0, chat, 0, {1}, 0},
      {Op::kInsert, 2, 1, agent, 0, {1, 2}, 0},
      {Op::kInsert, 3, 2, chat, 0, {1, 2, 3}, 0},
      {Op::kInsert, 4, 3, chat, 0, {1, 3, 4}, 0},               // full: the agent block expires first, so it goes
      {Op::kLookup, 1, 4, chat, 1, {1, 3, 4}, 0},               // block 1 is now the most recent chat block
      {Op::kInsert, 5, 5, agent, 0, {1, 4, 5}, 0},              // LRU among chat blocks: 3
      {Op::kInsert, 6, 6, chat, 0, {1, 4, 6}, 0},               // agent 5 expires first
      {Op::kLookup, 4, 7 * kDayMs + 3, chat, 1, {1, 4, 6}, 0},  // live through now == expiry
      {Op::kTick, 0, 7 * kDayMs + 5, chat, 0, {4, 6}, 1},       // block 1 expired at 7 d + 4
      {Op::kLookup, 1, 7 * kDayMs + 5, chat, 0, {4, 6}, 1},
      {Op::kInsert, 7, 7 * kDayMs + 6, kDefaultTtlClass, 0, {4, 6, 7}, 1},  // the default class: 1 h
      {Op::kLookup, 7, 7 * kDayMs + 6 + kHourMs, chat, 1, {4, 6, 7}, 1},    // a chat request refreshes it for 7 d
      {Op::kTick, 0, 14 * kDayMs + 3, chat, 0, {4, 7}, 2},                  // 6 expired; 4 lives through 14 d + 3
      {Op::kTick, 0, 30 * kDayMs, chat, 0, {}, 4},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    if (step.op == Op::kInsert) insert_and_release(policy, chain_of({step.id}), step.now_ms, step.ttl_class);
    if (step.op == Op::kTick) policy.tick(step.now_ms);
    if (step.op == Op::kLookup) {
      LookupResult result = policy.lookup(chain_of({step.id}), 64, step.now_ms, step.ttl_class);
      EXPECT_EQ(static_cast<int64_t>(result.nodes.size()), step.expected_hit_blocks) << where;
      ASSERT_TRUE(policy.release(result.nodes).ok()) << where;
    }
    EXPECT_EQ(resident(policy, Tier::kDevice), step.expected_resident) << where;
    EXPECT_EQ(policy.counters().tiers[0].expired_blocks, step.expected_expired) << where;
  }
}

TEST(TierPolicyTest, PinnedBlocksOutliveTheirTtlAndPressure) {
  TierPolicyConfig config = make_config(2);
  config.retention = RetentionConfig::defaults(1.0);
  TierPolicy policy = make_policy(config);
  InsertResult held = policy.insert(chain_of({1, 2}), 0);  // a running request keeps its blocks pinned
  ASSERT_EQ(held.nodes.size(), 2u);
  EXPECT_EQ(policy.tick(10 * kHourMs).expired[0], 0);
  InsertResult other = policy.insert(chain_of({3}), 10 * kHourMs);
  EXPECT_TRUE(other.nodes.empty()) << "full of pinned blocks: refused";
  EXPECT_EQ(policy.counters().tiers[0].refused_blocks, 1);
  ASSERT_TRUE(policy.release(held.nodes).ok());
  EXPECT_EQ(policy.release(held.nodes).code(), StatusCode::kInternal) << "double release";
  EXPECT_EQ(policy.tick(10 * kHourMs).expired[0], 2);
  EXPECT_EQ(policy.index().num_nodes(), 0);
}

TEST(TierPolicyTest, DemotionAndLoadBackAcrossTiers) {
  TierPolicy policy = make_policy(make_config(/*device=*/2, /*host=*/4, /*disk=*/8));
  enum class Op { kInsert, kLookup };
  struct Counts {  // per tier: device, host, disk
    std::array<int64_t, 3> admitted, evicted, demoted, hits, misses, bytes_written, bytes_read;
  };
  struct Step {
    Op op;
    uint64_t id;
    std::vector<uint64_t> device, host, disk;  // resident after the step
    Tier expected_source = Tier::kDevice;      // kLookup that hits
    int64_t expected_hits = 0;
    int64_t expected_bytes_loaded = 0;
    Counts counts = {};
  };
  const std::vector<Step> steps = {
      {Op::kInsert, 1, {1}, {1}, {}},
      {Op::kInsert, 2, {1, 2}, {1, 2}, {}},
      {Op::kInsert, 3, {2, 3}, {1, 2, 3}, {}},  // device drops 1: host has it (write-through), no demotion
      {Op::kInsert, 4, {3, 4}, {1, 2, 3, 4}, {}},
      // Host full: its oldest block (1, host only) is demoted to disk.
      {Op::kInsert,
       5,
       {4, 5},
       {2, 3, 4, 5},
       {1},
       Tier::kDevice,
       0,
       0,
       {{5, 5, 1}, {3, 1, 0}, {0, 1, 0}, {0, 0, 0}, {0, 0, 0}, {500, 500, 100}, {0, 100, 0}}},
      // A hit on disk: disk -> host (host demotes its oldest, 2) -> device (device drops 4, backed by host).
      {Op::kLookup,
       1,
       {5, 1},
       {3, 4, 5, 1},
       {1, 2},
       Tier::kDisk,
       1,
       100,
       {{6, 6, 2}, {4, 2, 0}, {0, 2, 0}, {0, 0, 1}, {1, 1, 0}, {600, 600, 200}, {0, 200, 100}}},
      {Op::kLookup,
       2,
       {1, 2},
       {4, 5, 1, 2},
       {1, 2, 3},
       Tier::kDisk,
       1,
       100,
       {{7, 7, 3}, {5, 3, 0}, {0, 3, 0}, {0, 0, 2}, {2, 2, 0}, {700, 700, 300}, {0, 300, 200}}},
      // A hit on host: loaded to device, which drops its oldest (1; copies on host and disk remain).
      {Op::kLookup,
       4,
       {2, 4},
       {4, 5, 1, 2},
       {1, 2, 3},
       Tier::kHost,
       1,
       100,
       {{8, 7, 3}, {6, 3, 0}, {0, 3, 0}, {0, 1, 2}, {3, 2, 0}, {800, 700, 300}, {0, 400, 200}}},
      // A miss everywhere.
      {Op::kLookup,
       99,
       {2, 4},
       {4, 5, 1, 2},
       {1, 2, 3},
       Tier::kDevice,
       0,
       0,
       {{8, 7, 3}, {6, 3, 0}, {0, 3, 0}, {0, 1, 2}, {4, 3, 1}, {800, 700, 300}, {0, 400, 200}}},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const std::string where = "step " + std::to_string(i + 1);
    const int64_t now = static_cast<int64_t>(i) * 1000;
    if (step.op == Op::kInsert) {
      insert_and_release(policy, chain_of({step.id}), now);
    } else {
      LookupResult result = policy.lookup(chain_of({step.id}), 64, now);
      EXPECT_EQ(static_cast<int64_t>(result.nodes.size()), step.expected_hits) << where;
      EXPECT_EQ(result.bytes_loaded, step.expected_bytes_loaded) << where;
      if (step.expected_hits > 0) {
        ASSERT_EQ(result.sources.size(), 1u) << where;
        EXPECT_EQ(result.sources[0], step.expected_source) << where;
        EXPECT_TRUE(policy.index().node(result.nodes[0]).tiers.has(Tier::kDevice)) << where << ": loaded back";
        EXPECT_EQ(result.hit_tokens, 64) << where;
      }
      ASSERT_TRUE(policy.release(result.nodes).ok()) << where;
    }
    auto sorted = [](std::vector<uint64_t> ids) {
      std::sort(ids.begin(), ids.end());
      return ids;
    };
    EXPECT_EQ(resident(policy, Tier::kDevice), sorted(step.device)) << where << ": device";
    EXPECT_EQ(resident(policy, Tier::kHost), sorted(step.host)) << where << ": host";
    EXPECT_EQ(resident(policy, Tier::kDisk), sorted(step.disk)) << where << ": disk";
    EXPECT_TRUE(policy.index().check_invariants().ok()) << where;
    if (step.counts.admitted[0] == 0) continue;
    const CacheCounters counters = policy.counters();
    for (size_t t = 0; t < 3; ++t) {
      const TierCounters& c = counters.tiers[t];
      const std::string tier = where + ", " + std::string(tier_name(static_cast<Tier>(t)));
      EXPECT_EQ(c.admitted_blocks, step.counts.admitted[t]) << tier << ": admitted";
      EXPECT_EQ(c.evicted_blocks, step.counts.evicted[t]) << tier << ": evicted";
      EXPECT_EQ(c.demoted_blocks, step.counts.demoted[t]) << tier << ": demoted";
      EXPECT_EQ(c.hit_blocks, step.counts.hits[t]) << tier << ": hits";
      EXPECT_EQ(c.miss_blocks, step.counts.misses[t]) << tier << ": misses";
      EXPECT_EQ(c.bytes_written, step.counts.bytes_written[t]) << tier << ": bytes written";
      EXPECT_EQ(c.bytes_read, step.counts.bytes_read[t]) << tier << ": bytes read";
      EXPECT_EQ(c.refused_blocks, 0) << tier;
    }
  }
  const CacheCounters counters = policy.counters();
  EXPECT_EQ(counters.lookups, 4);
  EXPECT_EQ(counters.lookup_blocks, 4);
  EXPECT_EQ(counters.hit_blocks, 3);
  EXPECT_DOUBLE_EQ(counters.block_hit_rate(), 0.75);
  EXPECT_EQ(counters.tiers[1].usage_blocks, 4);
  EXPECT_EQ(counters.tiers[2].capacity_blocks, 8);
}

TEST(TierPolicyTest, LoadBackStopsWhereDeviceRefuses) {
  TierPolicyConfig config = make_config(/*device=*/2, /*host=*/8);
  config.tiers[0].evict_bytes_per_s = 1 * kBytesPerBlock;  // 1 block/s
  TierPolicy policy = make_policy(config);
  insert_and_release(policy, chain_of({1, 2}), 0);
  // Device full: one token evicts block 2 (backed by host) for block 3; block 4 goes to host only.
  InsertResult b = policy.insert(chain_of({3, 4}), 0);
  EXPECT_EQ(b.nodes.size(), 2u);
  EXPECT_EQ(b.device_blocks, 1);
  ASSERT_TRUE(policy.release(b.nodes).ok());
  struct Step {
    int64_t now_ms;
    size_t expected_hits;
    std::vector<Tier> expected_sources;
    int64_t expected_bytes_loaded;
  };
  const std::vector<Step> steps = {
      {0, 1, {Tier::kDevice}, 0},                    // block 2 is on host, but device has no token to take it
      {1000, 2, {Tier::kDevice, Tier::kHost}, 100},  // a second later it does
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string where = "step " + std::to_string(i + 1);
    LookupResult result = policy.lookup(chain_of({1, 2}), 128, steps[i].now_ms);
    EXPECT_EQ(result.nodes.size(), steps[i].expected_hits) << where;
    EXPECT_EQ(result.sources, steps[i].expected_sources) << where;
    EXPECT_EQ(result.bytes_loaded, steps[i].expected_bytes_loaded) << where;
    EXPECT_EQ(result.hit_tokens, static_cast<int64_t>(steps[i].expected_hits) * 64) << where;
    ASSERT_TRUE(policy.release(result.nodes).ok()) << where;
    EXPECT_TRUE(policy.index().check_invariants().ok()) << where;
  }
  const CacheCounters counters = policy.counters();
  EXPECT_EQ(counters.lookup_tokens, 256);
  EXPECT_EQ(counters.hit_tokens, 192);
  EXPECT_DOUBLE_EQ(counters.token_hit_rate(), 0.75);
}

// Random requests over a small tree of prompts (shared prefixes, three tiers, rate limits, TTL classes):
// after every step the index's invariants hold, no tier exceeds its capacity, and pins balance.
TEST(TierPolicyTest, RandomRequestsKeepEveryInvariant) {
  TierPolicyConfig config = make_config(/*device=*/6, /*host=*/12, /*disk=*/24);
  for (TierConfig& tier : config.tiers) {
    tier.high_watermark = 0.8;
    tier.low_watermark = 0.5;
    tier.evict_bytes_per_s = 3 * kBytesPerBlock;
  }
  config.retention = RetentionConfig::defaults(/*default_ttl_hours=*/0.001);  // 3.6 s
  config.retention.classes[1].ttl_ms = 20 * 1000;                             // chat: 20 s
  config.retention.classes[2].ttl_ms = 8 * 1000;                              // agent: 8 s
  TierPolicy policy = make_policy(config);
  uint32_t state = 12345;
  auto next = [&](uint32_t bound) {
    state = state * 1664525u + 1013904223u;
    return (state >> 8) % bound;
  };
  std::vector<std::vector<NodeId>> running;  // pinned node lists of requests still "decoding"
  int64_t now = 0;
  for (int step = 1; step <= 3000; ++step) {
    const std::string where = "step " + std::to_string(step);
    now += next(400);
    // Prompts: a branch id per block from a small alphabet, so prefixes are shared often.
    std::vector<BlockHash> chain;
    uint64_t hash = 0;
    for (uint32_t i = 0, length = 1 + next(6); i < length; ++i) {
      hash = hash * 7 + 1 + next(3);
      chain.push_back(BlockHash{hash, i});
    }
    const TtlClassId ttl_class = static_cast<TtlClassId>(next(3));
    switch (next(3)) {
      case 0:
        policy.tick(now);
        break;
      case 1: {
        LookupResult hit = policy.lookup(chain, static_cast<int64_t>(chain.size()) * 64 - 5, now, ttl_class);
        ASSERT_LE(hit.nodes.size(), chain.size()) << where;
        running.push_back(hit.nodes);
        break;
      }
      default: {
        InsertResult inserted = policy.insert(chain, now, ttl_class);
        running.push_back(inserted.nodes);
        break;
      }
    }
    // A few requests run at a time; a random one finishes.
    if (running.size() > 3 || (!running.empty() && next(2) == 0)) {
      const size_t victim = next(static_cast<uint32_t>(running.size()));
      ASSERT_TRUE(policy.release(running[victim]).ok()) << where;
      running.erase(running.begin() + static_cast<std::ptrdiff_t>(victim));
    }
    Status invariants = policy.index().check_invariants();
    ASSERT_TRUE(invariants.ok()) << where << ": " << invariants.to_string();
    for (Tier tier : kAllTiers) {
      ASSERT_LE(policy.index().num_in_tier(tier), config.tiers[static_cast<size_t>(tier_index(tier))].capacity_blocks)
          << where << ": " << tier_name(tier);
    }
  }
  for (const std::vector<NodeId>& nodes : running) ASSERT_TRUE(policy.release(nodes).ok());
  const CacheCounters counters = policy.counters();
  for (int second = 1; second <= 60; ++second) policy.tick(now + second * 1000);  // 3 blocks/s per tier
  EXPECT_EQ(policy.index().num_nodes(), 0) << "everything expires once nothing is pinned";
  EXPECT_GT(counters.hit_blocks, 0);
  EXPECT_GT(counters.tiers[0].evicted_blocks, 0);
  EXPECT_GT(counters.tiers[1].demoted_blocks, 0);
  EXPECT_GT(counters.tiers[1].hit_blocks, 0);
  EXPECT_GT(counters.tiers[2].hit_blocks, 0);
  EXPECT_GT(counters.tiers[0].expired_blocks + counters.tiers[1].expired_blocks, 0);
}

TEST(TierPolicyTest, ConfigValidation) {
  struct Case {
    std::string name;
    TierPolicyConfig config;
  };
  std::vector<Case> cases;
  cases.push_back({"no device tier", make_config(0)});
  cases.push_back({"negative host", make_config(4, -1)});
  TierPolicyConfig config = make_config(4);
  config.tiers[0].low_watermark = 0.9;
  config.tiers[0].high_watermark = 0.8;
  cases.push_back({"low above high", config});
  config = make_config(4);
  config.tiers[2].evict_bytes_per_s = 0;
  cases.push_back({"zero rate", config});
  config = make_config(4);
  config.bytes_per_block = 0;
  cases.push_back({"zero bytes per block", config});
  config = make_config(4);
  config.retention.classes.clear();
  cases.push_back({"no TTL class", config});
  for (const Case& c : cases) {
    Result<TierPolicy> policy = TierPolicy::create(c.config);
    EXPECT_FALSE(policy.ok()) << c.name;
    if (!policy.ok()) {
      EXPECT_EQ(policy.status().code(), StatusCode::kInvalidArgument) << c.name;
    }
  }
  EXPECT_TRUE(TierPolicy::create(make_config(4, 8, 16)).ok());
}

}  // namespace
}  // namespace deepinfer::kvcache
