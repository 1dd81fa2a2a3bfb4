// The prefix cache the engine runs (kv_cache_manager.h), with a fake device (bytes in memory) and a real disk
// tier: write-through to host and disk, load-back through the mover while other sequences step, failed loads
// that shorten the prefix, TTL expiry, a restart rebuilding the index from the disk, and eviction order.
// (These replace offload_store_test.cpp: the host map, its TTLs, watermarks and the disk LRU it tested are now
// the index's tiers; tier_policy_test.cpp tests the policy itself.)
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "deepinfer/engine/engine.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/scheduler.h"
#include "deepinfer/kvcache/kv_cache_manager.h"
#include "temp_dir.h"

namespace deepinfer::kvcache {
namespace {

using deepinfer::testing::TempDir;
using engine::FinishedSequence;
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
  // Counted as expired, not as evicted (a break-it pass saw a TTL drop counted in evictions_total{device}).
  EXPECT_EQ(manager->counters().device_expired_blocks, 2);
  EXPECT_EQ(manager->counters().device_evicted_blocks, 0);
  EXPECT_EQ(manager->pool().num_free_uncached(), 8) << "the expired blocks are plain free blocks again";
}

// A manager of 8 device and 4 host blocks with a disk tier under `dir` (a process starting on that directory).
std::unique_ptr<KvCacheManager> disk_manager(const std::filesystem::path& dir, int64_t* clock) {
  KvCacheConfig config = cache_config(8, 4, clock);
  config.disk = disk_options(dir);
  return std::move(KvCacheManager::create(config)).value();
}

// One process serving a 260-token prompt with a disk tier under `dir`, until its 4 whole blocks are on disk; their
// hash chain.
std::vector<BlockHash> write_one_prompt_to_disk(const std::filesystem::path& dir, int64_t* clock) {
  FakeDevice device(8);
  auto cache = disk_manager(dir, clock);
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(8), std::move(cache))).value();
  EXPECT_TRUE(scheduler.add(request(1, 100, 260, 1)).ok());
  run_to_end(scheduler, device, 20);
  manager->flush();
  EXPECT_EQ(manager->blocks_in(Tier::kDisk).size(), 4u);
  EXPECT_EQ(manager->counters().lower->disk.stored_blocks, 4);
  return block_hash_chain(request(1, 100, 260, 1).prompt_token_ids, {3, 4});
}

TEST(KvCacheManagerTest, TheDiskTierIsWrittenThroughAndRebuildsTheIndexAfterARestart) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  const std::vector<BlockHash> chain = write_one_prompt_to_disk(dir.path(), &clock);
  // A new process: only the disk tier survives; its index is rebuilt from the block files' parent hashes.
  FakeDevice device(8);
  auto cache = disk_manager(dir.path(), &clock);
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
  cache.reset();
  auto reopened = disk_manager(dir.path(), &clock);
  EXPECT_TRUE(reopened->blocks_in(Tier::kDisk).empty());
}

// Regression (a break-it pass, 2026-12-07, eighteenth session): with the disk tier full, a host eviction demoted a
// prompt's later block to disk although the blocks before it were not there, evicting a chain's end to make room;
// the next start dropped the stray block (unchained) and recovered one block less. The disk tier now admits a block
// only below its parent's disk copy. A 10-block prompt, 2 host and 4 disk blocks.
TEST(KvCacheManagerTest, TheDiskTierHoldsOnlyBlocksWhoseChainReachesItsFirstBlockOnDisk) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  const SequenceRequest prompt = request(1, 100, 650, 2);
  {
    FakeDevice device(16);
    KvCacheConfig config = cache_config(16, 10, &clock);
    config.disk = disk_options(dir.path());
    config.disk->capacity_blocks = 5;
    auto cache = std::move(KvCacheManager::create(config)).value();
    cache->set_device_io(&device);
    KvCacheManager* manager = cache.get();
    Scheduler scheduler = std::move(Scheduler::create(scheduler_config(16), std::move(cache))).value();
    ASSERT_TRUE(scheduler.add(prompt).ok());
    run_to_end(scheduler, device, 10);
    manager->flush();
    // The host tier above its high watermark evicts its leaves (the prompt's last blocks) over the next seconds,
    // offering each to the full disk.
    for (int second = 0; second < 30; ++second) {
      clock += 1000;
      manager->tick();
      manager->flush();
    }
    EXPECT_EQ(manager->blocks_in(Tier::kDisk).size(), 5u);
  }
  auto reopened = disk_manager(dir.path(), &clock);
  const DiskRecoveryStats recovery = reopened->counters().lower->disk_recovery;
  EXPECT_EQ(recovery.unchained_dropped, 0) << "a disk block whose parent was not on disk";
  EXPECT_EQ(recovery.recovered_blocks, 5);
  const std::vector<BlockHash> chain = block_hash_chain(prompt.prompt_token_ids, {3, 4});
  EXPECT_EQ(reopened->match(chain).lower_blocks, 5) << "the prompt's first 5 blocks, from disk";
}

// Regression (a break-it pass, 2026-12-07): a prefix reused from any tier had its expiry moved in the policy's
// index only; the disk store kept the expiry it was written with, so its copies expired while still in use (their
// loads then failed, counted as corrupt) and a restart dropped them. A use now refreshes the disk copies too, and
// the file header of the chain's last block, so they outlive their first expiry across a restart.
TEST(KvCacheManagerTest, AReusedPrefixKeepsItsDiskCopiesPastTheirFirstExpiryAcrossARestart) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  const int64_t t0 = clock;
  const std::vector<BlockHash> chain = write_one_prompt_to_disk(dir.path(), &clock);  // expire at t0 + 1 h
  FakeDevice device(8);
  {
    clock = t0 + 40 * 60'000;  // a restart and a reuse 40 minutes in: from disk, to expire at t0 + 100 min
    auto cache = disk_manager(dir.path(), &clock);
    cache->set_device_io(&device);
    KvCacheManager::Admission admission = cache->admit(chain, {}, 260, kDefaultTtlClass);
    ASSERT_EQ(admission.loaded_blocks, 4);
    cache->flush();
    cache->release_nodes(admission.nodes);
    for (BlockId block : admission.blocks) cache->release(block);
  }
  clock = t0 + 70 * 60'000;  // past the first expiry: the next start keeps them, and they load
  auto cache = disk_manager(dir.path(), &clock);
  cache->set_device_io(&device);
  EXPECT_EQ(cache->blocks_in(Tier::kDisk).size(), 4u);
  KvCacheManager::Admission admission = cache->admit(chain, {}, 260, kDefaultTtlClass);
  EXPECT_EQ(admission.loaded_blocks, 4);
  cache->flush();
  EXPECT_EQ(cache->usable_prefix(admission.nodes), 4u);
  EXPECT_EQ(cache->counters().failed_loads, 0);
  EXPECT_EQ(cache->counters().lower->disk.corrupt_blocks, 0);
  cache->release_nodes(admission.nodes);
  for (BlockId block : admission.blocks) cache->release(block);
}

// Regression (a break-it pass, 2026-12-07): a disk write that failed (a full disk; here a directory where the block's
// file goes) left the block counted in the disk tier, whose usage then exceeded the files; its loads failed later.
TEST(KvCacheManagerTest, AFailedDiskWriteLeavesTheDiskTierOfTheIndex) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  const std::vector<BlockHash> chain = block_hash_chain(request(1, 100, 260, 1).prompt_token_ids, {3, 4});
  const std::string hex = chain[3].to_hex();
  std::filesystem::create_directories(dir.path() / hex.substr(0, 2) / (hex + ".kvb"));  // the last block's path
  FakeDevice device(8);
  auto cache = disk_manager(dir.path(), &clock);
  cache->set_device_io(&device);
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(scheduler_config(8), std::move(cache))).value();
  ASSERT_TRUE(scheduler.add(request(1, 100, 260, 1)).ok());
  run_to_end(scheduler, device, 20);
  manager->flush();
  EXPECT_EQ(manager->blocks_in(Tier::kDisk).size(), 3u);
  EXPECT_EQ(manager->counters().lower->disk.usage_blocks, 3);
  // At least the failed write. On a slow machine (ASan: 2 of 24 runs) a second failure may count too: the block's
  // file refreshed on a use while its failed write was still queued, or the block written again after it left the
  // disk tier; either fails against the directory and counts.
  EXPECT_GE(manager->counters().lower->disk.refused_blocks, 1);
  EXPECT_TRUE(manager->policy().index().check_invariants().ok());
}

// Regression (a break-it pass, 2026-12-07): blocks whose earlier block's file is gone (a kill -9 between two
// background writes, before those were ordered) were deleted at open but counted as recovered, so the next start
// reported fewer with nothing said. Now they are counted apart and recovered_blocks is what is left.
TEST(KvCacheManagerTest, BlocksCutOffFromTheirChainAtOpenAreCountedNotRecovered) {
  TempDir dir;
  int64_t clock = 1'800'000'000'000;
  const std::vector<BlockHash> chain = write_one_prompt_to_disk(dir.path(), &clock);
  {
    auto store = std::move(DiskBlockStore::open(*disk_options(dir.path()))).value();
    ASSERT_TRUE(std::filesystem::remove(store->block_path(chain[1])));
  }
  auto cache = disk_manager(dir.path(), &clock);
  const DiskRecoveryStats recovery = cache->counters().lower->disk_recovery;  // a copy: counters() is a value
  EXPECT_EQ(recovery.recovered_blocks, 1);
  EXPECT_EQ(recovery.unchained_dropped, 2);
  EXPECT_EQ(cache->blocks_in(Tier::kDisk).size(), 1u);
  EXPECT_EQ(cache->match(chain).lower_blocks, 1);
}

// A fake model caching two kinds: the latent of every token (2 layers) and a sliding window of 128 tokens
// (1 layer), as V4's window layers do. Each kind has its own pool: a sequence holds window blocks only for its
// last window; a prefix is reused when its blocks hold the latent and its last two blocks hold the window too;
// otherwise the hit ends before that window, which is recomputed.
CacheLayout two_kind_layout() {
  return CacheLayout{{CacheKindSpec{CacheKind::kLatent, "latent", 2, 1, 0},
                      CacheKindSpec{CacheKind::kSlidingWindow, "sliding_window", 1, 2, 128}}};
}

// The fake model's forward pass: each kind's storage holds, per block slot, the token whose entry it is. To
// compute position p it reads the latent of every position before p and the window entries of the 127 before
// it, through the entry's block table and window table, and checks each holds the right token; then it writes
// p's entries. A missing window block, a stale one or a wrong reuse fails the test.
class TwoKindModel {
 public:
  TwoKindModel(int latent_blocks, int window_blocks)
      : latent_(static_cast<size_t>(latent_blocks), std::vector<int>(kBlockTokens, -1)),
        window_(static_cast<size_t>(window_blocks), std::vector<int>(kBlockTokens, -1)) {}
  void set_tokens(engine::SequenceId id, std::vector<engine::TokenId> tokens) { tokens_[id] = std::move(tokens); }

  ScheduledBatch step(Scheduler& scheduler) {
    ScheduledBatch batch = scheduler.schedule();
    std::vector<engine::TokenId> sampled;
    for (const engine::ScheduledEntry& entry : batch.entries) {
      const std::vector<engine::TokenId>& tokens = tokens_.at(entry.sequence_id);
      EXPECT_EQ(entry.window_block_tables.size(), 1u);
      const std::vector<BlockId>& window_table = entry.window_block_tables.at(0);
      EXPECT_EQ(window_table.size(), entry.block_table.size());
      for (int64_t p = entry.start_position; p < entry.end_position(); ++p) {
        for (int64_t q = 0; q < p; ++q) {
          const BlockId block = entry.block_table[static_cast<size_t>(q / kBlockTokens)];
          EXPECT_EQ(latent_[static_cast<size_t>(block)][static_cast<size_t>(q % kBlockTokens)], tokens[static_cast<size_t>(q)])
              << "sequence " << entry.sequence_id << " latent of position " << q;
        }
        for (int64_t q = std::max<int64_t>(p - 127, 0); q < p; ++q) {
          const BlockId block = window_table[static_cast<size_t>(q / kBlockTokens)];
          EXPECT_NE(block, kNoBlock) << "sequence " << entry.sequence_id << " has no window block for " << q;
          if (block == kNoBlock) continue;
          EXPECT_EQ(window_[static_cast<size_t>(block)][static_cast<size_t>(q % kBlockTokens)], tokens[static_cast<size_t>(q)])
              << "sequence " << entry.sequence_id << " window entry of position " << q;
        }
        latent_[static_cast<size_t>(entry.block_table[static_cast<size_t>(p / kBlockTokens)])][static_cast<size_t>(p % kBlockTokens)] =
            tokens[static_cast<size_t>(p)];
        window_[static_cast<size_t>(window_table[static_cast<size_t>(p / kBlockTokens)])][static_cast<size_t>(p % kBlockTokens)] =
            tokens[static_cast<size_t>(p)];
      }
      if (entry.samples) sampled.push_back(7);
      // Held window blocks: the last window and this step's tokens, never more.
      const int64_t held = std::count_if(window_table.begin(), window_table.end(), [](BlockId b) { return b != kNoBlock; });
      EXPECT_LE(held, 2 + (entry.num_tokens() + kBlockTokens - 1) / kBlockTokens + 1) << "sequence " << entry.sequence_id;
    }
    EXPECT_TRUE(scheduler.update(batch, sampled).ok());
    return batch;
  }
  ScheduledBatch run(Scheduler& scheduler, SequenceRequest r) {
    std::vector<engine::TokenId> tokens = r.prompt_token_ids;
    tokens.insert(tokens.end(), static_cast<size_t>(r.max_tokens), 7);
    set_tokens(r.id, tokens);
    EXPECT_TRUE(scheduler.add(std::move(r)).ok());
    ScheduledBatch first = step(scheduler);
    for (int i = 0; i < 50 && scheduler.has_pending_work(); ++i) step(scheduler);
    return first;
  }

 private:
  std::vector<std::vector<int>> latent_;
  std::vector<std::vector<int>> window_;
  std::unordered_map<engine::SequenceId, std::vector<engine::TokenId>> tokens_;
};

TEST(KvCacheManagerTest, AFakeTwoKindModelHasAPoolPerKindAndReusesAPrefixOnlyWithItsLastWindow) {
  const CacheLayout layout = two_kind_layout();
  ASSERT_TRUE(layout.validate().ok());
  EXPECT_EQ(layout.full_block_bytes(), 2 * 1 * kBlockTokens);
  EXPECT_EQ(layout.block_bytes(), (2 * 1 + 1 * 2) * kBlockTokens);
  EXPECT_EQ(layout.replay_blocks(), 2);
  EXPECT_EQ(layout.full_kinds(), CacheKindSet{CacheKind::kLatent});
  int64_t clock = 1'000'000;
  KvCacheConfig config = cache_config(32, 0, &clock);
  config.block_bytes = static_cast<size_t>(layout.full_block_bytes());
  config.layout = layout;
  SchedulerConfig sc = scheduler_config(32);
  sc.max_num_batched_tokens = 128;  // prompts are prefilled in chunks of two blocks
  config.window_blocks = Scheduler::min_window_blocks(sc, 128);
  EXPECT_EQ(config.window_blocks, 6);
  {
    KvCacheConfig short_pool = config;
    short_pool.window_blocks = 5;
    Result<Scheduler> refused = Scheduler::create(sc, std::move(KvCacheManager::create(short_pool)).value());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("sliding_window"), std::string::npos) << refused.status().to_string();
  }
  auto cache = std::move(KvCacheManager::create(config)).value();
  KvCacheManager* manager = cache.get();
  ASSERT_EQ(manager->num_window_pools(), 1);
  EXPECT_EQ(manager->window_pool(0).num_total(), 6);
  Scheduler scheduler = std::move(Scheduler::create(sc, std::move(cache))).value();
  TwoKindModel model(32, 6);

  // Sequence 1: 320 prompt tokens in three chunks. Its last chunk holds window blocks only for blocks 2..4.
  ASSERT_TRUE(scheduler.add(request(1, 100, 320, 1)).ok());
  model.set_tokens(1, [] { auto t = request(1, 100, 320, 1).prompt_token_ids; t.push_back(7); return t; }());
  model.step(scheduler);
  model.step(scheduler);
  ScheduledBatch last = model.step(scheduler);
  ASSERT_EQ(last.entries.size(), 1u);
  EXPECT_EQ(last.entries[0].start_position, 256);
  const std::vector<BlockId>& windows = last.entries[0].window_block_tables[0];
  ASSERT_EQ(windows.size(), 5u);
  EXPECT_EQ(windows[0], kNoBlock);
  EXPECT_EQ(windows[1], kNoBlock);
  for (size_t b = 2; b < 5; ++b) EXPECT_NE(windows[b], kNoBlock) << "block " << b;
  EXPECT_FALSE(scheduler.has_pending_work() && scheduler.num_running() > 0);
  const std::vector<BlockHash> chain = block_hash_chain(request(1, 100, 320, 1).prompt_token_ids, {3, 4});
  const PrefixIndex& index = manager->policy().index();
  std::vector<NodeId> path = index.match(chain, clock, CacheKindSet{CacheKind::kLatent});
  ASSERT_EQ(path.size(), 5u);
  for (size_t b = 0; b < 5; ++b) {  // every computed block's window block was cached with it
    EXPECT_TRUE(index.node(path[b]).kinds.has(CacheKind::kSlidingWindow)) << "block " << b;
    EXPECT_TRUE(manager->cached_window_block(0, chain[b]).has_value()) << "block " << b;
  }

  // The same 320 tokens and more: the prefix's last window (blocks 3, 4) is cached: all 5 blocks are reused,
  // and the model reads the cached window entries.
  ScheduledBatch first = model.run(scheduler, request(2, 100, 384, 1));
  ASSERT_EQ(first.entries.size(), 1u);
  EXPECT_EQ(first.entries[0].start_position, 320);
  EXPECT_EQ(first.entries[0].window_block_tables[0][3], *manager->cached_window_block(0, chain[3]));

  // An unrelated prompt takes three window blocks: the window pool reuses the ones released longest ago, those
  // of sequence 1's blocks 0..2, whose nodes lose the window kind (the latent stays cached).
  model.run(scheduler, request(3, 20000, 192, 1));
  for (size_t b = 0; b < 5; ++b) {
    EXPECT_EQ(index.node(path[b]).kinds.has(CacheKind::kSlidingWindow), b >= 3) << "block " << b;
    EXPECT_EQ(manager->cached_window_block(0, chain[b]).has_value(), b >= 3) << "block " << b;
  }

  // Sequence 1's 320 tokens, then others: blocks 0..2 lack the window kind, but the prefix's last window
  // (blocks 3, 4) holds it: all 5 blocks are reused.
  SequenceRequest extended = request(4, 100, 320, 1);
  for (int i = 0; i < 64; ++i) extended.prompt_token_ids.push_back(8000 + i);
  EXPECT_EQ(manager->match(block_hash_chain(extended.prompt_token_ids, {3, 4})).device_blocks, 5);
  first = model.run(scheduler, extended);
  ASSERT_EQ(first.entries.size(), 1u);
  EXPECT_EQ(first.entries[0].start_position, 320);

  // The first 256 tokens, then others: the prefix would end at block 3, but block 2's window is gone, and so
  // are those of every earlier window (blocks 0, 1): nothing is reusable, everything is recomputed, and the
  // windows are cached again.
  SequenceRequest branch = request(5, 100, 256, 1);
  for (int i = 0; i < 64; ++i) branch.prompt_token_ids.push_back(9000 + i);
  EXPECT_EQ(manager->match(block_hash_chain(branch.prompt_token_ids, {3, 4})).device_blocks, 0);
  first = model.run(scheduler, branch);
  ASSERT_EQ(first.entries.size(), 1u);
  EXPECT_EQ(first.entries[0].start_position, 0);
  EXPECT_TRUE(manager->cached_window_block(0, chain[0]).has_value());
  EXPECT_TRUE(manager->cached_window_block(0, chain[2]).has_value());

  // Sequence 1's first 192 tokens and more: its last window (blocks 1, 2) is cached again: 3 blocks reused.
  SequenceRequest again = request(6, 100, 192, 1);
  for (int i = 0; i < 10; ++i) again.prompt_token_ids.push_back(7000 + i);
  first = model.run(scheduler, again);
  ASSERT_EQ(first.entries.size(), 1u);
  EXPECT_EQ(first.entries[0].start_position, 192);

  // Everything let go: every window block is free (cached or plain), none leaked.
  EXPECT_EQ(manager->window_pool(0).num_free(), 6);
  EXPECT_EQ(manager->pool().num_free(), 32);
}

TEST(KvCacheManagerTest, ASequenceShortOfWindowBlocksPreemptsTheLastAdmittedAndBothFinishExactly) {
  int64_t clock = 1'000'000;
  KvCacheConfig config = cache_config(64, 0, &clock);
  config.block_bytes = static_cast<size_t>(two_kind_layout().full_block_bytes());
  config.layout = two_kind_layout();
  SchedulerConfig sc = scheduler_config(64);
  sc.max_num_batched_tokens = 128;
  config.window_blocks = Scheduler::min_window_blocks(sc, 128);  // 6: two decoding sequences hold 3 each
  auto cache = std::move(KvCacheManager::create(config)).value();
  KvCacheManager* manager = cache.get();
  Scheduler scheduler = std::move(Scheduler::create(sc, std::move(cache))).value();
  TwoKindModel model(64, 6);
  // A decodes (holding 3 window blocks) while B's 400-token prompt is prefilled in chunks: B's second chunk
  // needs 4 window blocks, 7 in all: B, admitted last, is preempted and runs once A is done.
  auto add = [&](engine::SequenceId id, int first, int prompt, int max_tokens) {
    SequenceRequest r = request(id, first, prompt, max_tokens);
    std::vector<engine::TokenId> tokens = r.prompt_token_ids;
    tokens.insert(tokens.end(), static_cast<size_t>(max_tokens), 7);
    model.set_tokens(id, tokens);
    ASSERT_TRUE(scheduler.add(std::move(r)).ok());
  };
  add(1, 1000, 150, 60);
  model.step(scheduler);
  model.step(scheduler);
  add(2, 5000, 400, 3);
  int preemptions = 0;
  std::vector<FinishedSequence> finished;
  for (int i = 0; i < 400 && scheduler.has_pending_work(); ++i) {
    ScheduledBatch batch = model.step(scheduler);
    preemptions += static_cast<int>(batch.preempted.size());
    for (const auto& f : batch.finished) finished.push_back(f);
  }
  EXPECT_GE(preemptions, 1);
  ASSERT_EQ(finished.size(), 2u);
  for (const auto& f : finished) {
    EXPECT_EQ(f.reason, engine::FinishReason::kLength);
    EXPECT_EQ(f.num_generated_tokens, f.id == 1 ? 60 : 3);
  }
  EXPECT_EQ(manager->window_pool(0).num_free(), 6);
  EXPECT_EQ(manager->pool().num_free(), 64);
}

TEST(CacheLayoutTest, APrefixIsUsableUpToTheLastBlockWhoseWindowIsComplete) {
  const CacheLayout layout = two_kind_layout();  // window 128 tokens: 2 blocks
  struct Case {
    std::vector<bool> present;
    int64_t usable;
  };
  const std::vector<Case> cases = {
      {{}, 0},
      {{true}, 1},
      {{false}, 0},
      {{true, true, true, true}, 4},
      {{false, false, true, true}, 4},   // only the last window matters
      {{false, false, true, false}, 0},  // [1, 2] and [0, 1] and [0] all lack it
      {{true, true, false, false}, 2},
      {{true, false, true, true, false}, 4},
      {{false, true, false}, 0},
  };
  for (const Case& c : cases) {
    std::string pattern;
    for (bool b : c.present) pattern += b ? '1' : '0';
    EXPECT_EQ(layout.usable_blocks(c.present), c.usable) << pattern;
  }
  EXPECT_EQ(CacheLayout::latent_only(2, 4).usable_blocks({false, false}), 2);  // no window kind: every block
}

TEST(KvCacheManagerTest, TheEnginePlanGivesEachWindowKindItsOwnPoolOutOfTheSameMemory) {
  engine::EngineConfig config;
  config.max_num_batched_tokens = 128;
  config.max_num_seqs = 4;
  config.kv_cache_bytes = 1 << 20;
  engine::KvCachePlan latent = std::move(engine::plan_kv_cache(config, CacheLayout::latent_only(2, 1))).value();
  EXPECT_EQ(latent.cache.window_blocks, 0);
  EXPECT_EQ(latent.scheduler.num_blocks, (1 << 20) / 128);
  engine::KvCachePlan two = std::move(engine::plan_kv_cache(config, two_kind_layout())).value();
  // Window pool: 2 x (one sequence's step: 6, plus each running sequence's last window: 4 x 2) = 28 blocks of
  // 128 bytes; the main pool gets the rest in blocks of the latent's 128 bytes.
  EXPECT_EQ(two.cache.window_blocks, 28);
  EXPECT_EQ(two.scheduler.num_blocks, ((1 << 20) - 28 * 128) / 128);
  EXPECT_EQ(two.cache.block_bytes, 128u);
  auto cache = KvCacheManager::create(two.cache);
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  EXPECT_TRUE(Scheduler::create(two.scheduler, std::move(cache).value()).ok());
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
  wrong_bytes.block_bytes = 256;
  wrong_bytes.layout = two_kind_layout();
  wrong_bytes.window_blocks = 6;
  cases.push_back({wrong_bytes, "layout"});
  KvCacheConfig no_window_pool = cache_config(4, 0, &clock);
  no_window_pool.layout = two_kind_layout();
  cases.push_back({no_window_pool, "window_blocks"});
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
