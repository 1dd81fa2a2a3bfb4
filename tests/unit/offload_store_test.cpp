// KvOffloadStore without a model: host retention (TTL classes, LRU within a class, gradual watermark eviction
// under a token bucket, refusal instead of a flush), write-through to disk and load-back, prefetch.
#include "deepinfer/kvcache/offload_store.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "temp_dir.h"

namespace deepinfer::kvcache {
namespace {

using TempDir = deepinfer::testing::TempDir;

constexpr size_t kBytes = 256;
constexpr int64_t kHour = 3600 * 1000;

BlockHash hash_of(uint64_t i) { return {i * 0x9E3779B97F4A7C15ull + 1, i + 7}; }

std::vector<std::byte> payload_of(uint64_t i) {
  std::vector<std::byte> bytes(kBytes);
  for (size_t k = 0; k < kBytes; ++k) bytes[k] = static_cast<std::byte>((i * 31 + k * 7) & 0xff);
  return bytes;
}

OffloadConfig host_only(int64_t capacity) {
  OffloadConfig config;
  config.block_bytes = kBytes;
  config.host_capacity_blocks = capacity;
  config.retention = RetentionConfig::defaults(/*default_ttl_hours=*/1.0);
  return config;
}

std::vector<BlockHash> chain_of(uint64_t first, uint64_t count) {
  std::vector<BlockHash> chain;
  for (uint64_t i = first; i < first + count; ++i) chain.push_back(hash_of(i));
  return chain;
}

TEST(OffloadStoreTest, StoreMatchLoadRoundTripsThroughHost) {
  auto store = std::move(KvOffloadStore::create(host_only(8))).value();
  for (uint64_t i = 0; i < 3; ++i) store->store(hash_of(i), hash_of(i - 1), payload_of(i), kDefaultTtlClass, 0);
  EXPECT_EQ(store->match(chain_of(0, 5), 10), 3);
  std::vector<std::byte> out(kBytes);
  ASSERT_TRUE(store->load(hash_of(1), out, kDefaultTtlClass, 10));
  EXPECT_EQ(out, payload_of(1));
  EXPECT_FALSE(store->load(hash_of(9), out, kDefaultTtlClass, 10));
  OffloadCounters counters = store->counters();
  EXPECT_EQ(counters.host.usage_blocks, 3);
  // match() counts nothing (a waiting request is matched again each step); hits are loads.
  EXPECT_EQ(counters.host.hit_blocks, 1);
  EXPECT_EQ(counters.host.miss_blocks, 0);
  store->record_miss();
  EXPECT_EQ(store->counters().host.miss_blocks, 1);
  EXPECT_EQ(counters.host.bytes_read, static_cast<int64_t>(kBytes));
}

TEST(OffloadStoreTest, ExpiredBlocksNeverMatchAndTickDropsThem) {
  auto store = std::move(KvOffloadStore::create(host_only(8))).value();
  const TtlClassId agent = *store->config().retention.find("agent");  // 3 days
  store->store(hash_of(0), kRootBlockHash, payload_of(0), kDefaultTtlClass, 0);  // 1 hour
  store->store(hash_of(1), hash_of(0), payload_of(1), agent, 0);
  EXPECT_EQ(store->match(chain_of(0, 1), kHour - 1), 1);
  EXPECT_EQ(store->match(chain_of(0, 1), kHour), 0);
  EXPECT_EQ(store->match(chain_of(1, 1), kHour), 1);
  store->tick(kHour);
  OffloadCounters counters = store->counters();
  EXPECT_EQ(counters.host.expired_blocks, 1);
  EXPECT_EQ(counters.host.usage_blocks, 1);
  // An access by a longer-lived class extends the expiry; a shorter one never shortens it.
  std::vector<std::byte> out(kBytes);
  ASSERT_TRUE(store->load(hash_of(1), out, kDefaultTtlClass, 2 * kHour));
  EXPECT_EQ(store->match(chain_of(1, 1), 71 * kHour), 1);
}

TEST(OffloadStoreTest, WatermarkEvictionIsGradualAndEarliestExpiryFirst) {
  OffloadConfig config = host_only(10);
  config.high_watermark = 0.8;  // evict above 8 blocks ...
  config.low_watermark = 0.5;   // ... down to 5
  config.evict_bytes_per_s = 2.0 * kBytes;  // two blocks per second, burst of two
  auto store = std::move(KvOffloadStore::create(config)).value();
  for (uint64_t i = 0; i < 9; ++i) store->store(hash_of(i), kRootBlockHash, payload_of(i), kDefaultTtlClass, i);
  store->tick(9);  // the bucket starts full: 2 evictions
  EXPECT_EQ(store->counters().host.usage_blocks, 7);
  store->tick(10);  // no time passed for a refill
  EXPECT_EQ(store->counters().host.usage_blocks, 7);
  store->tick(1010);  // one second: 2 more
  EXPECT_EQ(store->counters().host.usage_blocks, 5);
  store->tick(5010);  // at the low watermark: eviction stops
  EXPECT_EQ(store->counters().host.usage_blocks, 5);
  EXPECT_EQ(store->counters().host.evicted_blocks, 4);
  // The oldest four (earliest expiry) went.
  EXPECT_EQ(store->match(chain_of(0, 1), 6000), 0);
  EXPECT_EQ(store->match(chain_of(3, 1), 6000), 0);
  EXPECT_EQ(store->match(chain_of(4, 5), 6000), 5);
}

TEST(OffloadStoreTest, AFullHostRefusesInsteadOfFlushingWhenTheBucketIsEmpty) {
  OffloadConfig config = host_only(2);
  config.evict_bytes_per_s = 1.0 * kBytes;  // one block per second
  auto store = std::move(KvOffloadStore::create(config)).value();
  store->store(hash_of(0), kRootBlockHash, payload_of(0), kDefaultTtlClass, 0);
  store->store(hash_of(1), kRootBlockHash, payload_of(1), kDefaultTtlClass, 0);
  store->store(hash_of(2), kRootBlockHash, payload_of(2), kDefaultTtlClass, 0);  // evicts 0 with the one token
  store->store(hash_of(3), kRootBlockHash, payload_of(3), kDefaultTtlClass, 0);  // no token left: refused
  OffloadCounters counters = store->counters();
  EXPECT_EQ(counters.host.usage_blocks, 2);
  EXPECT_EQ(counters.host.evicted_blocks, 1);
  EXPECT_EQ(counters.host.refused_blocks, 1);
  EXPECT_EQ(store->match(chain_of(3, 1), 1), 0);
  store->store(hash_of(3), kRootBlockHash, payload_of(3), kDefaultTtlClass, 1000);  // a second later: admitted
  EXPECT_EQ(store->match(chain_of(3, 1), 1001), 1);
}

TEST(OffloadStoreTest, DiskTierHoldsWhatHostEvictedAndSurvivesReopen) {
  TempDir dir;
  OffloadConfig config = host_only(2);
  config.disk = DiskBlockStoreOptions{};
  config.disk->directory = dir.path();
  config.disk->fingerprint = {1, 2};
  config.disk->block_bytes = kBytes;
  config.disk->capacity_blocks = 100;
  config.disk->sync = false;
  {
    auto store = std::move(KvOffloadStore::create(config)).value();
    for (uint64_t i = 0; i < 6; ++i) store->store(hash_of(i), hash_of(i - 1), payload_of(i), kDefaultTtlClass, 0);
    store->flush();
    OffloadCounters counters = store->counters();
    EXPECT_EQ(counters.host.usage_blocks, 2);
    EXPECT_EQ(counters.disk.usage_blocks, 6);
    EXPECT_EQ(counters.disk.stored_blocks, 6);
    EXPECT_EQ(counters.disk_queue_blocks, 0);
    // Blocks 0..3 are only on disk now: matched, and loaded back through host.
    EXPECT_EQ(store->match(chain_of(0, 6), 1), 6);
    std::vector<std::byte> out(kBytes);
    ASSERT_TRUE(store->load(hash_of(0), out, kDefaultTtlClass, 1));
    EXPECT_EQ(out, payload_of(0));
    EXPECT_EQ(store->counters().disk.bytes_read, static_cast<int64_t>(kBytes));
  }
  auto reopened = std::move(KvOffloadStore::create(config)).value();
  EXPECT_EQ(reopened->match(chain_of(0, 6), 0), 6);
  EXPECT_EQ(reopened->counters().host.usage_blocks, 0);
  // Prefetch reads them into host in the background.
  reopened->prefetch(chain_of(0, 2), kDefaultTtlClass, 0);
  for (int i = 0; i < 200 && reopened->counters().host.usage_blocks < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(reopened->counters().host.usage_blocks, 2);
  std::vector<std::byte> out(kBytes);
  ASSERT_TRUE(reopened->load(hash_of(1), out, kDefaultTtlClass, 1));
  EXPECT_EQ(out, payload_of(1));
}

// The disk copy of a block keeps its request's retention class: it expires when the host copy would (the disk
// store's wall clock, faked here), across a reopen too, and is then neither matched nor loaded.
TEST(OffloadStoreTest, DiskCopiesExpireWithTheirRetentionClass) {
  TempDir dir;
  int64_t wall_ms = 1'800'000'000'000;
  OffloadConfig config = host_only(2);  // default class 1 h
  config.disk = DiskBlockStoreOptions{};
  config.disk->directory = dir.path();
  config.disk->fingerprint = {1, 2};
  config.disk->block_bytes = kBytes;
  config.disk->capacity_blocks = 100;
  config.disk->sync = false;
  config.disk->now_unix_ms = [&wall_ms] { return wall_ms; };
  const TtlClassId agent = *config.retention.find("agent");  // 3 days
  {
    auto store = std::move(KvOffloadStore::create(config)).value();
    for (uint64_t i = 0; i < 4; ++i) {
      store->store(hash_of(i), hash_of(i - 1), payload_of(i), i < 2 ? kDefaultTtlClass : agent, 0);
    }
    store->flush();
    EXPECT_EQ(store->counters().disk.usage_blocks, 4);
  }
  wall_ms += 2 * kHour;  // the default class (1 h) has expired on disk, the agent class (3 days) has not
  auto reopened = std::move(KvOffloadStore::create(config)).value();
  EXPECT_EQ(reopened->counters().disk.usage_blocks, 2);
  EXPECT_EQ(reopened->counters().disk.expired_blocks, 2);
  EXPECT_EQ(reopened->match(chain_of(0, 4), 0), 0) << "block 0 expired: the chain ends before it";
  EXPECT_EQ(reopened->match(chain_of(2, 2), 0), 2);
  std::vector<std::byte> out(kBytes);
  EXPECT_FALSE(reopened->load(hash_of(1), out, kDefaultTtlClass, 0));
  ASSERT_TRUE(reopened->load(hash_of(3), out, agent, 0));
  EXPECT_EQ(out, payload_of(3));
  wall_ms += 3 * 24 * kHour;  // and now the agent class too (still in host, which the engine's clock governs)
  EXPECT_EQ(reopened->match(chain_of(2, 1), 0), 0);
}

TEST(OffloadStoreTest, ConfigErrorsNameTheField) {
  OffloadConfig config = host_only(0);
  auto store = KvOffloadStore::create(config);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("host_capacity_blocks"), std::string::npos);
  config = host_only(4);
  config.low_watermark = 0.99;
  store = KvOffloadStore::create(config);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find("watermarks"), std::string::npos);
}

}  // namespace
}  // namespace deepinfer::kvcache
