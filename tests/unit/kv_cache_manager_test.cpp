// The prefix cache the engine runs (kv_cache_manager.h), with a fake device (bytes in memory) and a real disk
// tier: write-through to host and disk, load-back through the mover while other sequences step, failed loads
// that shorten the prefix, TTL expiry, a restart rebuilding the index from the disk, and eviction order.
// (These replace offload_store_test.cpp: the host map, its TTLs, watermarks and the disk LRU it tested are now
// the index's tiers; tier_policy_test.cpp tests the policy itself.)
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/scheduler.h"
#include "deepinfer/kvcache/kv_cache_manager.h"
#include "temp_dir.h"

namespace deepinfer::kvcache {
namespace {

using deepinfer::testing::TempDir;
using engine::ScheduledBatch;
using engine::Scheduler;
using engine::SchedulerConfig;
using engine::SequenceRequest;
using engine::SequenceStatus;

constexpr size_t kBytes = 128;
constexpr int64_t kHour = 3600 * 1000;

// Device blocks in memory. Writes can be held back (a gate) and made to fail for chosen contents.
class FakeDevice final : public transfer::DeviceBlockIo {
 public:
  explicit FakeDevice(int blocks) : blocks_(static_cast<size_t>(blocks), std::vector<std::byte>(kBytes)) {}
  Status read(BlockId block, std::span<std::byte> out) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return reads_open_; });
    std::memcpy(out.data(), blocks_[static_cast<size_t>(block)].data(), kBytes);
    return Status::ok_status();
  }
  Status write(BlockId block, std::span<const std::byte> in) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return open_; });
    if (fail_first_byte_.has_value() && in[0] == *fail_first_byte_) return Status::io_error("injected copy error");
    std::memcpy(blocks_[static_cast<size_t>(block)].data(), in.data(), kBytes);
    ++writes_;
    return Status::ok_status();
  }
  void fill(BlockId block, uint8_t tag) {
    std::lock_guard lock(mu_);
    std::fill(blocks_[static_cast<size_t>(block)].begin(), blocks_[static_cast<size_t>(block)].end(),
              static_cast<std::byte>(tag));
  }
  uint8_t tag(BlockId block) {
    std::lock_guard lock(mu_);
    return static_cast<uint8_t>(blocks_[static_cast<size_t>(block)][0]);
  }
  void set_open(bool open) {
    {
      std::lock_guard lock(mu_);
      open_ = open;
    }
    cv_.notify_all();
  }
  void set_reads_open(bool open) {
    {
      std::lock_guard lock(mu_);
      reads_open_ = open;
    }
    cv_.notify_all();
  }
  void fail_writes_of(uint8_t tag) {
    std::lock_guard lock(mu_);
    fail_first_byte_ = static_cast<std::byte>(tag);
  }
  int writes() {
    std::lock_guard lock(mu_);
    return writes_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<std::byte>> blocks_;
  bool open_ = true;
  bool reads_open_ = true;
  std::optional<std::byte> fail_first_byte_;
  int writes_ = 0;
};

SchedulerConfig scheduler_config(int32_t blocks) {
  SchedulerConfig config;
  config.max_num_batched_tokens = 1000;
  config.max_num_seqs = 8;
  config.num_blocks = blocks;
  config.fingerprint = {3, 4};
  return config;
}

KvCacheConfig cache_config(int32_t blocks, int64_t host_blocks, int64_t* clock) {
  KvCacheConfig config;
  config.num_device_blocks = blocks;
  config.block_bytes = kBytes;
  config.host_blocks = host_blocks;
  config.retention = RetentionConfig::defaults(/*default_ttl_hours=*/1.0);
  config.clock = [clock] { return *clock; };
  return config;
}

std::optional<DiskBlockStoreOptions> disk_options(const std::filesystem::path& dir) {
  DiskBlockStoreOptions disk;
  disk.directory = dir;
  disk.fingerprint = {3, 4};
  disk.block_bytes = kBytes;
  disk.capacity_blocks = 64;
  disk.sync = false;
  return disk;
}

SequenceRequest request(engine::SequenceId id, int first_token, int prompt_len, int max_tokens) {
  SequenceRequest r;
  r.id = id;
  for (int i = 0; i < prompt_len; ++i) r.prompt_token_ids.push_back(first_token + i);
  r.max_tokens = max_tokens;
  return r;
}

// One step in which every sampling entry samples token 7; each computed block is filled with its sequence's
// tag first (the "forward pass").
ScheduledBatch step(Scheduler& scheduler, FakeDevice& device, uint8_t tag) {
  ScheduledBatch batch = scheduler.schedule();
  std::vector<engine::TokenId> sampled;
  for (const engine::ScheduledEntry& entry : batch.entries) {
    for (int64_t p = entry.start_position; p < entry.end_position(); ++p) {
      device.fill(entry.block_table[static_cast<size_t>(p / kBlockTokens)], static_cast<uint8_t>(tag + p / kBlockTokens));
    }
    if (entry.samples) sampled.push_back(7);
  }
  EXPECT_TRUE(scheduler.update(batch, sampled).ok());
  return batch;
}

void run_to_end(Scheduler& scheduler, FakeDevice& device, uint8_t tag) {
  for (int i = 0; i < 100 && scheduler.has_pending_work(); ++i) step(scheduler, device, tag);
}

// Evicts every cached device copy no sequence uses: take all blocks, give them back.
void evict_device(KvCacheManager& cache) {
  std::vector<BlockId> taken;
  while (std::optional<BlockId> block = cache.allocate()) taken.push_back(*block);
  for (BlockId block : taken) cache.release(block);
  EXPECT_EQ(cache.num_cached_device_blocks(), 0);
}

TEST(KvCacheManagerTest, ALoadFromHostRunsOnTheMoverWhileOtherSequencesStep) {
  int64_t clock = 1'000'000;
  FakeDevice device(16);
  auto cache = std::move(KvCacheManager::create(cache_config(16, 16, &clock))).value();
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(16), std::move(cache))).value();

  ASSERT_TRUE(scheduler.add(request(1, 100, 192, 2)).ok());
  run_to_end(scheduler, device, 10);  // blocks 0..2 hold tags 10, 11, 12
  manager->flush();
  EXPECT_EQ(manager->blocks_in(Tier::kHost).size(), 3u);  // written through
  evict_device(*manager);
  EXPECT_EQ(manager->blocks_in(Tier::kHost).size(), 3u);

  device.set_open(false);  // loads into device wait
  ASSERT_TRUE(scheduler.add(request(2, 100, 200, 2)).ok());  // the same 192 tokens, then 8 more
  ASSERT_TRUE(scheduler.add(request(3, 5000, 10, 3)).ok());  // unrelated
  ScheduledBatch batch = step(scheduler, device, 30);
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].sequence_id, 3);
  EXPECT_EQ(scheduler.find(2)->status, SequenceStatus::kLoadingKv);
  EXPECT_EQ(scheduler.num_loading(), 1);
  // Sequence 3 decodes on while sequence 2's blocks are held back.
  for (int i = 0; i < 2; ++i) {
    batch = step(scheduler, device, 30);
    ASSERT_EQ(batch.entries.size(), 1u);
    EXPECT_EQ(batch.entries[0].sequence_id, 3);
  }
  EXPECT_EQ(scheduler.find(2)->status, SequenceStatus::kLoadingKv);

  device.set_open(true);
  manager->flush();
  batch = scheduler.schedule();
  ASSERT_EQ(batch.entries.size(), 1u);  // sequence 3 finished; sequence 2 computes its last 8 tokens
  EXPECT_EQ(batch.entries[0].sequence_id, 2);
  EXPECT_EQ(batch.entries[0].start_position, 192);
  const engine::SequenceState* second = scheduler.find(2);
  EXPECT_EQ(second->num_cached_tokens, 192);
  EXPECT_EQ(second->num_loaded_tokens, 192);
  for (int b = 0; b < 3; ++b) EXPECT_EQ(device.tag(second->block_table[static_cast<size_t>(b)]), 10 + b) << b;
  EXPECT_EQ(manager->counters().lower->host.hit_blocks, 3);
}

// Regression (a helper's crash: "a free or evictable block was counted"): a block counted free that the cache
// cannot hand out right now must not abort the scheduler. Here the only free blocks are cached ones whose
// write-through copies to host are held back: the new sequence waits (no entry, no crash) and runs once the
// copies are done.
TEST(KvCacheManagerTest, BlocksCountedFreeButStillBeingCopiedOutDelayASequenceInsteadOfAborting) {
  int64_t clock = 1'000'000;
  FakeDevice device(4);
  auto cache = std::move(KvCacheManager::create(cache_config(4, 16, &clock))).value();
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(4), std::move(cache))).value();
  device.set_reads_open(false);  // device -> host copies wait
  ASSERT_TRUE(scheduler.add(request(1, 100, 192, 2)).ok());
  run_to_end(scheduler, device, 10);  // 3 cached blocks, their copies to host still queued
  EXPECT_EQ(scheduler.block_pool().num_free(), 4);
  EXPECT_EQ(scheduler.block_pool().num_free_uncached(), 1);
  ASSERT_TRUE(scheduler.add(request(2, 7000, 200, 1)).ok());  // other tokens: needs all 4 blocks
  ScheduledBatch batch = scheduler.schedule();
  EXPECT_TRUE(batch.entries.empty()) << "the counted blocks are not there yet";
  std::vector<engine::TokenId> none;
  ASSERT_TRUE(scheduler.update(batch, none).ok());
  device.set_reads_open(true);
  manager->flush();
  batch = step(scheduler, device, 20);
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].sequence_id, 2);
  EXPECT_EQ(batch.entries[0].num_tokens(), 200);
  run_to_end(scheduler, device, 20);
  EXPECT_FALSE(scheduler.has_pending_work());
  EXPECT_EQ(manager->blocks_in(Tier::kHost).size(), 6u) << "both sequences' blocks were written through";
}

TEST(KvCacheManagerTest, AFailedLoadShortensThePrefixAndItsSubtreeLeavesTheIndex) {
  int64_t clock = 1'000'000;
  FakeDevice device(16);
  auto cache = std::move(KvCacheManager::create(cache_config(16, 16, &clock))).value();
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(16), std::move(cache))).value();
  ASSERT_TRUE(scheduler.add(request(1, 100, 192, 2)).ok());
  run_to_end(scheduler, device, 10);
  manager->flush();
  evict_device(*manager);

  device.fail_writes_of(11);  // block 1's copy cannot be written back
  ASSERT_TRUE(scheduler.add(request(2, 100, 200, 1)).ok());
  scheduler.schedule();  // admitted into kLoadingKv (this batch is abandoned: nothing was scheduled)
  manager->flush();
  ScheduledBatch batch = step(scheduler, device, 40);
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 64) << "block 0 loaded; blocks 1 and 2 are computed";
  EXPECT_EQ(scheduler.find(2)->num_cached_tokens, 64);
  EXPECT_EQ(manager->counters().failed_loads, 1);
  EXPECT_EQ(manager->counters().lower->host.hit_blocks, 2) << "the failed load counts as a host miss";
  run_to_end(scheduler, device, 40);
  manager->tick();
  // Block 1 and what hung below it left the index once unpinned, then came back as sequence 2 computed them.
  const std::vector<BlockHash> chain = block_hash_chain(request(2, 100, 200, 1).prompt_token_ids, {3, 4});
  EXPECT_TRUE(manager->device_block_of(chain[1]).has_value());
  EXPECT_EQ(device.tag(*manager->device_block_of(chain[1])), 41);
  EXPECT_TRUE(manager->policy().index().check_invariants().ok());
}

TEST(KvCacheManagerTest, ExpiredBlocksNeverMatchAndTickDropsThemFromEveryTier) {
  int64_t clock = 1'000'000;
  FakeDevice device(8);
  auto cache = std::move(KvCacheManager::create(cache_config(8, 8, &clock))).value();
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(8), std::move(cache))).value();
  ASSERT_TRUE(scheduler.add(request(1, 100, 130, 1)).ok());
  run_to_end(scheduler, device, 10);
  manager->flush();
  const std::vector<BlockHash> chain = block_hash_chain(request(1, 100, 130, 1).prompt_token_ids, {3, 4});
  EXPECT_EQ(manager->match(chain).device_blocks, 2);
  clock += kHour + 1;  // past the default class's 1-hour TTL
  EXPECT_EQ(manager->match(chain).device_blocks + manager->match(chain).lower_blocks, 0);
  manager->tick();
  EXPECT_EQ(manager->num_cached_device_blocks(), 0);
  EXPECT_TRUE(manager->blocks_in(Tier::kHost).empty());
  EXPECT_EQ(manager->pool().num_free_uncached(), 8) << "the expired blocks are plain free blocks again";
}

TEST(KvCacheManagerTest, TheDiskTierIsWrittenThroughAndRebuildsTheIndexAfterARestart) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  std::vector<BlockHash> chain;
  {
    FakeDevice device(8);
    KvCacheConfig config = cache_config(8, 4, &clock);
    config.disk = disk_options(dir.path());
    auto cache = std::move(KvCacheManager::create(config)).value();
    cache->set_device_io(&device);
    KvCacheManager* manager = cache.get();
    Scheduler scheduler = std::move(Scheduler::create(scheduler_config(8), std::move(cache))).value();
    ASSERT_TRUE(scheduler.add(request(1, 100, 260, 1)).ok());
    run_to_end(scheduler, device, 20);
    manager->flush();
    chain = block_hash_chain(request(1, 100, 260, 1).prompt_token_ids, {3, 4});
    EXPECT_EQ(manager->blocks_in(Tier::kDisk).size(), 4u);
    EXPECT_EQ(manager->counters().lower->disk.stored_blocks, 4);
  }
  // A new process: only the disk tier survives; its index is rebuilt from the block files' parent hashes.
  FakeDevice device(8);
  KvCacheConfig config = cache_config(8, 4, &clock);
  config.disk = disk_options(dir.path());
  auto cache = std::move(KvCacheManager::create(config)).value();
  cache->set_device_io(&device);
  EXPECT_EQ(cache->blocks_in(Tier::kDisk).size(), 4u);
  KvCacheManager::PrefixMatch match = cache->match(chain);
  EXPECT_EQ(match.device_blocks, 0);
  EXPECT_EQ(match.lower_blocks, 4);
  KvCacheManager::Admission admission = cache->admit(chain, {}, 260, kDefaultTtlClass);
  ASSERT_EQ(admission.nodes.size(), 4u);
  EXPECT_EQ(admission.loaded_blocks, 4);
  cache->flush();
  EXPECT_FALSE(cache->loading(admission.nodes));
  EXPECT_EQ(cache->usable_prefix(admission.nodes), 4u);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(device.tag(admission.blocks[static_cast<size_t>(b)]), 20 + b) << b;
  EXPECT_EQ(cache->counters().lower->disk.hit_blocks, 4);
  cache->release_nodes(admission.nodes);
  for (BlockId block : admission.blocks) cache->release(block);

  // The disk copies expire with their class (1 hour), across the restart too.
  clock += kHour + 1000;
  cache->tick();
  EXPECT_TRUE(cache->blocks_in(Tier::kDisk).empty());
  cache->flush();
  auto reopened_config = cache_config(8, 4, &clock);
  reopened_config.disk = disk_options(dir.path());
  cache.reset();
  auto reopened = std::move(KvCacheManager::create(reopened_config)).value();
  EXPECT_TRUE(reopened->blocks_in(Tier::kDisk).empty());
}

// A fake model caching two kinds: the latent of every token (2 layers) and a sliding window of 128 tokens
// (1 layer), as V4's window layers do. A prefix is reused when its blocks hold the latent and its last two
// blocks hold the window too; otherwise the hit ends before that window, which is recomputed.
CacheLayout two_kind_layout() {
  return CacheLayout{{CacheKindSpec{CacheKind::kLatent, "latent", 2, 1, 0},
                      CacheKindSpec{CacheKind::kSlidingWindow, "sliding_window", 1, 2, 128}}};
}

TEST(KvCacheManagerTest, AFakeTwoKindModelReusesAPrefixOnlyWithItsLastWindowAndReplaysItOtherwise) {
  const CacheLayout layout = two_kind_layout();
  ASSERT_TRUE(layout.validate().ok());
  EXPECT_EQ(layout.block_bytes(), (2 * 1 + 1 * 2) * kBlockTokens);
  EXPECT_EQ(layout.replay_blocks(), 2);
  EXPECT_EQ(layout.full_kinds(), CacheKindSet{CacheKind::kLatent});
  int64_t clock = 1'000'000;
  KvCacheConfig config = cache_config(32, 0, &clock);
  config.block_bytes = static_cast<size_t>(layout.block_bytes());
  config.layout = layout;
  auto cache = std::move(KvCacheManager::create(config)).value();
  KvCacheManager* manager = cache.get();
  FakeDevice device(32);
  SchedulerConfig sc = scheduler_config(32);
  Scheduler scheduler = std::move(Scheduler::create(sc, std::move(cache))).value();

  // Sequence 1 caches 5 full blocks (320 prompt tokens); its last two hold the window kind.
  ASSERT_TRUE(scheduler.add(request(1, 100, 320, 1)).ok());
  run_to_end(scheduler, device, 10);
  const std::vector<BlockHash> chain = block_hash_chain(request(1, 100, 320, 1).prompt_token_ids, {3, 4});
  const PrefixIndex& index = manager->policy().index();
  std::vector<NodeId> path = index.match(chain, clock, CacheKindSet{CacheKind::kLatent});
  ASSERT_EQ(path.size(), 5u);
  for (size_t b = 0; b < 5; ++b) {
    EXPECT_EQ(index.node(path[b]).kinds.has(CacheKind::kSlidingWindow), b >= 3) << "block " << b;
  }

  // The same 320 tokens and more: the prefix ends at block 4, whose window is there: all 5 blocks reused.
  SequenceRequest longer = request(2, 100, 384, 1);
  ASSERT_TRUE(scheduler.add(longer).ok());
  ScheduledBatch batch = step(scheduler, device, 20);
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 320);
  run_to_end(scheduler, device, 20);

  // The first 256 tokens, then others: the prefix ends at block 3, but block 2 lacks the window: the hit ends
  // before the window (blocks 2 and 3 are recomputed, rebuilding it).
  SequenceRequest branch = request(3, 100, 256, 1);
  for (int i = 0; i < 64; ++i) branch.prompt_token_ids.push_back(9000 + i);
  EXPECT_EQ(manager->match(block_hash_chain(branch.prompt_token_ids, {3, 4})).device_blocks, 2);
  ASSERT_TRUE(scheduler.add(branch).ok());
  batch = step(scheduler, device, 30);
  ASSERT_EQ(batch.entries.size(), 1u);
  EXPECT_EQ(batch.entries[0].start_position, 128);
  EXPECT_EQ(scheduler.find(3)->num_cached_tokens, 128);
}

TEST(KvCacheManagerTest, ConfigErrorsNameTheField) {
  int64_t clock = 0;
  struct Case {
    KvCacheConfig config;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({cache_config(0, 0, &clock), "num_device_blocks"});
  KvCacheConfig no_bytes = cache_config(4, 4, &clock);
  no_bytes.block_bytes = 0;
  cases.push_back({no_bytes, "block_bytes"});
  KvCacheConfig disk_without_host = cache_config(4, 0, &clock);
  disk_without_host.disk = disk_options("/tmp/unused");
  cases.push_back({disk_without_host, "host"});
  KvCacheConfig off = cache_config(4, 4, &clock);
  off.enable_prefix_caching = false;
  cases.push_back({off, "prefix caching"});
  KvCacheConfig wrong_bytes = cache_config(4, 0, &clock);
  wrong_bytes.layout = two_kind_layout();
  cases.push_back({wrong_bytes, "layout"});
  KvCacheConfig only_window = cache_config(4, 0, &clock);
  only_window.layout = CacheLayout{{CacheKindSpec{CacheKind::kSlidingWindow, "sliding_window", 1, 2, 128}}};
  only_window.block_bytes = 128;
  cases.push_back({only_window, "keep every token"});
  for (const Case& c : cases) {
    Result<std::unique_ptr<KvCacheManager>> created = KvCacheManager::create(c.config);
    ASSERT_FALSE(created.ok()) << c.field;
    EXPECT_NE(created.status().message().find(c.field), std::string::npos) << created.status().to_string();
  }
}

}  // namespace
}  // namespace deepinfer::kvcache
