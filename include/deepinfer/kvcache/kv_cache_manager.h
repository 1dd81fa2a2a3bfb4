// The prefix cache the engine runs: one radix index over chained block hashes (PrefixIndex, owned by TierPolicy)
// whose device, host and disk tiers are levels of the same tree, the device block pool, the host copies, the
// disk tier's files, and the mover thread that copies bytes between them (transfer/block_mover.h). Every
// decision (what matches, what is admitted where, what is evicted or expires, the watermarks and the rate
// limits) is TierPolicy's, the same code `bench_replay` drives with no model; this class only carries it out on
// real blocks and publishes what changed (KV events).
//
//   device pool (BlockPool) --write-through (mover)--> host (HostBlock) --write-through (mover)--> disk
//   device <---------- load-back at admission: host -> device, or disk -> host -> device (mover) -----------
//
// A device block is private to a sequence (being filled) or cached (a node of the index has its device copy
// there). Cached blocks are shared by every sequence whose prefix uses them (pool reference counts, and one
// index pin per sequence); when no sequence uses one it stays cached on the pool's second free list until the
// index evicts it (allocate() asks for that when no plain block is free), so the cache never makes anyone wait.
//
// Sliding-window kinds (cache_layout.h) have a pool each ("window pools", indexed by slot: the layout's
// window_specs() order). A sequence holds a window block for each block of its last window only; a computed full
// block's window block is cached with the block's node (its kinds gain the window kind) and stays cached after
// its sequence lets go of it, until the window pool needs a block and none is plainly free: then the one
// released longest ago is reused and its node loses the kind. Window blocks live on the device only: a prefix
// whose last window's window blocks are gone is reused up to that window, which is recomputed.
//
// Loads are asynchronous: admit() pins the prefix, reserves device blocks for its part found below the device
// and queues their loads; the scheduler keeps the request in a "loading KV" state until loading() says its
// blocks have arrived, while every other request keeps stepping. A load that fails (a corrupt or vanished disk
// copy, a copy error) ends the usable prefix there (usable_prefix()): the rest is recomputed, and the failed
// block with everything below it leaves the index once no request pins it.
//
// Time: the manager reads the clock of its config (Unix milliseconds: the disk tier's expiries outlive the
// process, so the whole index runs on wall-clock time).
// Thread-safety: not thread-safe; the engine's step thread calls everything. The mover thread only runs
// transfers; their completions are taken in on the step thread by tick() (and wait_for_transfers()).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/core/types.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/kvcache/cache_layout.h"
#include "deepinfer/kvcache/disk_block_store.h"
#include "deepinfer/kvcache/kv_events.h"
#include "deepinfer/kvcache/prefix_index.h"
#include "deepinfer/kvcache/tier_policy.h"
#include "deepinfer/kvcache/transfer/block_mover.h"

namespace deepinfer::kvcache {

struct KvCacheConfig {
  int32_t num_device_blocks = 0;      // the device pool; REQUIRES >= 1
  bool enable_prefix_caching = true;  // off: a plain block pool, nothing indexed or matched
  size_t block_bytes = 0;             // one block's payload (all layers); REQUIRES > 0 with a host tier
  // The kinds the model caches (cache_layout.h); empty: the MLA latent only. Its full_block_bytes() must equal
  // block_bytes when both are set (block_bytes is a block of the main pool and of a host or disk copy).
  std::optional<CacheLayout> layout;
  // Blocks in each sliding-window kind's own pool (the layout's window kinds); REQUIRES >= 1 when it has one.
  // The scheduler needs at least Scheduler::min_window_blocks(); what is left over caches the windows of
  // finished prefixes.
  int32_t window_blocks = 0;
  // SWA bounded replay (DeepSeek-V4, --swa-bounded-replay): a prefix is reused whole, whether or not its last
  // window still holds the window kinds; the executor replays that window where they are gone. Off: the hit
  // shrinks to the longest prefix whose last window holds them (CacheLayout::usable_blocks).
  bool bounded_replay = false;
  int64_t host_blocks = 0;            // 0: no host tier
  double host_high_watermark = 0.95;  // TierConfig's meaning
  double host_low_watermark = 0.90;
  double host_evict_bytes_per_s = kUnlimited;
  // The disk tier (needs the host tier): its directory, capacity, fingerprint. Its block_bytes must equal
  // block_bytes. Every completed block is written through to it, so a kill -9 loses no block.
  std::optional<DiskBlockStoreOptions> disk;
  RetentionConfig retention = RetentionConfig::defaults();
  // Unix milliseconds; empty: the system clock. Test seam.
  std::function<int64_t()> clock;
  // Errors: InvalidArgument naming the field.
  Status validate() const;
};

// Counters of one tier below the device (gauges: usage, capacity; the rest only grow). The metrics' shape.
struct OffloadTierCounters {
  int64_t usage_blocks = 0;
  int64_t capacity_blocks = 0;
  int64_t hit_blocks = 0;      // prompt blocks served from this tier (the fastest one holding them)
  int64_t miss_blocks = 0;     // prompt blocks looked up in this tier and not served by it
  int64_t stored_blocks = 0;   // copies admitted into this tier
  int64_t refused_blocks = 0;  // admissions refused (full, no eviction token) or writes that failed
  int64_t evicted_blocks = 0;  // dropped under capacity pressure
  int64_t expired_blocks = 0;  // dropped because their TTL passed
  int64_t corrupt_blocks = 0;  // loads that found the copy corrupt, foreign or gone (disk)
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;
};

struct OffloadCounters {
  OffloadTierCounters host;
  OffloadTierCounters disk;
  int64_t disk_queue_blocks = 0;    // transfers queued on the mover and not done
  DiskRecoveryStats disk_recovery;  // what the disk tier's open() found (zero without a disk tier)
};

struct KvCacheCounters {
  int64_t device_usage_blocks = 0;  // cached blocks on device (index nodes with a device copy)
  int64_t device_capacity_blocks = 0;
  int64_t device_hit_blocks = 0;
  int64_t device_miss_blocks = 0;
  int64_t device_evicted_blocks = 0;  // cached device copies dropped under capacity pressure
  int64_t device_expired_blocks = 0;  // cached device copies dropped because their TTL passed
  int64_t completed_loads = 0;        // device blocks filled from a lower tier
  int64_t failed_loads = 0;           // loads that failed (the block was recomputed)
  int64_t loaded_blocks = 0;          // prompt blocks a request used from loads (the scheduler's count; 0 here)
  int64_t lookup_blocks = 0;          // full prompt blocks looked up at admission
  int64_t hit_blocks = 0;             // of which served from some tier
  std::optional<OffloadCounters> lower;  // absent without host/disk tiers
};

class KvCacheManager {
 public:
  // Opens the disk tier and rebuilds its part of the index from the block files (parents before children;
  // a block whose parent is not on disk can never match and is deleted), starts the mover.
  // Errors: the config's validation error; the disk store's open error.
  static Result<std::unique_ptr<KvCacheManager>> create(KvCacheConfig config);
  // shutdown(), then frees everything.
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  // Where device blocks are read and written (not owned; must outlive the manager or be reset). Needed before
  // the first transfer when there is a host tier.
  void set_device_io(transfer::DeviceBlockIo* io);
  // Publishes every change of every tier to `sink` (device under `device_medium`, "CPU", "DISK"), starting
  // with a BlockStored for each disk block already indexed (parents first). Not owned; nullptr: none.
  void set_event_sink(KvEventSink* sink, std::string device_medium);
  // Runs every queued transfer and stops the mover; after it no transfer runs (the engine calls it before its
  // device memory goes away). Idempotent.
  void shutdown();

  // ---- device blocks ----
  const BlockPool& pool() const { return pool_; }
  // Blocks that allocate() can provide now: free ones plus cached ones no sequence uses (evictable).
  int32_t num_free_blocks() const { return pool_.num_free(); }
  // A block for a sequence's own tokens (reference count 1): a plain free one, else the index evicts an
  // unused cached one (demoting it to host first when host lacks it). nullopt when none can be had now, also
  // when num_free_blocks() counted some: an evicted block whose copy out is still running (waited for 50 ms at
  // most), or a cached block pinned by a sequence that does not hold it. The caller preempts or retries.
  std::optional<BlockId> allocate();
  // Adds an owner to a block of a matched prefix (reviving it when no sequence used it).
  void retain(BlockId block);
  // Drops one owner. A cached block whose last owner leaves stays cached.
  void release(BlockId block);

  // ---- window pools (one per sliding-window kind; see the class comment) ----
  int num_window_pools() const { return static_cast<int>(windows_.size()); }
  // REQUIRES: 0 <= slot < num_window_pools() for these four.
  const CacheKindSpec& window_spec(int slot) const { return windows_[static_cast<size_t>(slot)].spec; }
  const BlockPool& window_pool(int slot) const { return windows_[static_cast<size_t>(slot)].pool; }
  // A window block for a sequence (count 1): a plain free one, else the cached one released longest ago (its
  // node loses the kind). nullopt when every block is held by a sequence.
  std::optional<BlockId> allocate_window(int slot);
  // Drops one owner; a cached window block whose last owner leaves stays cached.
  void release_window(int slot, BlockId block);
  // The window block cached for `hash`, or nullopt.
  std::optional<BlockId> cached_window_block(int slot, const BlockHash& hash) const;

  // ---- prefix matching ----
  struct PrefixMatch {
    int64_t device_blocks = 0;       // leading blocks resident on device (or being loaded there)
    int64_t lower_blocks = 0;        // blocks after them held only by host or disk
    int64_t device_free_blocks = 0;  // of the device ones, those no sequence uses (reviving them takes free blocks)
  };
  // The longest live cached prefix of `chain` that may be reused: every block holds the layout's full kinds,
  // and its last window's blocks hold the window kinds (else it ends earlier: CacheLayout::usable_blocks).
  // Index only: changes and counts nothing.
  PrefixMatch match(std::span<const BlockHash> chain) const;

  struct Admission {
    std::vector<NodeId> nodes;    // the prefix, chain order, each pinned once for the caller
    std::vector<BlockId> blocks;  // their device blocks, each retained once for the caller (its block table)
    int64_t loaded_blocks = 0;    // of them, blocks being loaded from host or disk
    // Per window pool (slot), by chain position like `blocks`: the cached window blocks of the prefix's last
    // window, each retained once for the caller, kNoBlock elsewhere (and where the window block is gone).
    std::vector<std::vector<BlockId>> window_blocks;
  };
  // Takes the longest cached prefix of `chain` for a request: counts the lookup (`prompt_tokens` tokens),
  // pins it, reserves device blocks for the part found below the device and queues their loads.
  // `tokens`: the chain's tokens for the KV events (may be empty when publishes_events() is false).
  // REQUIRES: match(chain)'s blocks fit num_free_blocks() (the scheduler checks), ttl_class known.
  Admission admit(std::span<const BlockHash> chain, std::span<const TokenId> tokens, int64_t prompt_tokens,
                  TtlClassId ttl_class);
  // Whether a load into any of `nodes` is still in flight.
  bool loading(std::span<const NodeId> nodes) const;
  // How many leading `nodes` hold good data: a failed load, or a node that left the index, ends it.
  size_t usable_prefix(std::span<const NodeId> nodes) const;

  // Caches the full computed blocks chain[0, n) whose KV sits in `blocks` (a sequence's block table): new
  // nodes get these device blocks; a node that already has a device copy keeps it (the sequence's block
  // stays private); write-through copies are queued. Returns the nodes, each pinned once for the caller.
  // `tokens`: the chain's tokens for the KV events (may be empty when publishes_events() is false).
  // `window_tables`: per window pool, the sequence's window blocks by chain position (kNoBlock where it holds
  // none); a block's window block joins the cache with it unless one is cached for it already.
  // REQUIRES: blocks.size() >= chain.size(), known ttl_class, window_tables empty or one per window pool.
  std::vector<NodeId> insert(std::span<const BlockHash> chain, std::span<const BlockId> blocks,
                             std::span<const TokenId> tokens, TtlClassId ttl_class,
                             std::span<const std::vector<BlockId>> window_tables = {});
  // Unpins nodes returned by admit() or insert(); a failed load's subtree nobody pins any more leaves the index.
  void release_nodes(std::span<const NodeId> nodes);

  // ---- background ----
  // Takes in completed transfers, drops the subtrees of failed loads nobody pins, and runs the policy's
  // retention work (expiry, watermarks, within the rate limits). Every engine step.
  void tick();
  // Whether transfers are still to hand to the mover, running, or done and not taken in: tick() has work to do even
  // with no step to run (the engine's idle loop polls while this is true, so an idle server still writes its
  // blocks to disk and takes their completions in).
  bool has_background_work() const;
  // Until some transfer completes or `timeout` (the engine waits here when only loading requests remain).
  // Takes the completions in. True when one arrived.
  bool wait_for_transfers(std::chrono::milliseconds timeout);
  // Until every queued transfer is done, taking their completions in (tests, shutdown).
  void flush();

  // ---- introspection ----
  const TierPolicy& policy() const { return *policy_; }
  // The kinds cached (the config's layout, or the latent alone).
  const CacheLayout& layout() const { return layout_; }
  bool prefix_caching() const { return config_.enable_prefix_caching; }
  bool bounded_replay() const { return config_.bounded_replay; }  // KvCacheConfig::bounded_replay
  // Whether KV events are published (then admit() and insert() want the chain's tokens for BlockStored).
  bool publishes_events() const { return sink_ != nullptr; }
  bool has_lower_tiers() const { return config_.host_blocks > 0; }
  // Cached blocks on device.
  int64_t num_cached_device_blocks() const;
  // The hashes held by `tier` now. O(nodes).
  std::vector<BlockHash> blocks_in(Tier tier) const;
  // The device block caching `hash`, or nullopt. O(nodes); for tests.
  std::optional<BlockId> device_block_of(const BlockHash& hash) const;
  KvCacheCounters counters() const;
  int64_t now_ms() const;

 private:
  // What the listener needs to know about the policy call it runs inside.
  struct CallContext {
    enum class Kind { kOther, kAdmit, kInsert, kRecover } kind = Kind::kOther;
    std::span<const BlockHash> chain;    // kAdmit, kInsert: the chain the call works on
    std::span<const BlockId> blocks;     // kInsert: by chain position
    std::vector<BlockId>* reserved = nullptr;  // kAdmit: blocks for the loads, taken in order
    std::span<const TokenId> tokens;     // kAdmit, kInsert: by chain position
    int64_t* loaded = nullptr;           // kAdmit: loads queued
    std::unordered_set<BlockHash, BlockHashHasher> via_host;  // kAdmit: disk blocks passing through host
  };

  explicit KvCacheManager(KvCacheConfig config);
  void on_event(const CacheEvent& event);
  // Queues a transfer (sent to the mover by flush_submissions(), once per manager call).
  uint64_t submit(transfer::Transfer transfer, NodeId node);
  void flush_submissions();
  // The disk tier's expiry of the deepest of `nodes` with a disk copy (and of the blocks before it) follows the
  // policy's, just moved by a lookup or insert (DiskBlockStore::refresh).
  void refresh_disk_expiry(std::span<const NodeId> nodes);
  void take_completions(std::vector<transfer::TransferResult> results);
  void drop_failed_subtrees();
  // How many of the matched nodes may be reused under the layout's bounded-replay rule.
  size_t usable_match(std::span<const NodeId> matched) const;
  std::span<const TokenId> event_tokens(const CacheEvent& event) const;
  std::string_view medium(Tier tier) const;

  struct CachedWindow {
    BlockId block = kNoBlock;
    NodeId node = kNoNode;
  };
  struct WindowPool {
    CacheKindSpec spec;
    BlockPool pool;
    std::unordered_map<BlockHash, CachedWindow, BlockHashHasher> cached;  // hash -> its cached window block
    std::unordered_map<BlockId, BlockHash> hash_of;                       // cached window block -> hash
  };
  // Forgets `hash`'s cached window block in `window` (its node leaves the index, or the block is reused); with
  // update_node, the node loses the kind. `hash` by value: callers pass map entries this erases.
  void forget_window(WindowPool& window, BlockHash hash, bool update_node);

  KvCacheConfig config_;
  CacheLayout layout_;
  BlockPool pool_;
  std::vector<WindowPool> windows_;
  std::unique_ptr<TierPolicy> policy_;
  std::unique_ptr<DiskBlockStore> disk_;
  std::unique_ptr<transfer::BlockMover> mover_;
  KvEventSink* sink_ = nullptr;
  std::string device_medium_ = std::string(kMediumDevice);
  CallContext context_;

  // The device block of every cached hash (the index's device tier, by hash).
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> device_block_;
  // The host copy of every hash in the host tier.
  std::unordered_map<BlockHash, std::shared_ptr<transfer::HostBlock>, BlockHashHasher> host_;
  // Loads in flight into device, by hash -> transfer id (a later load of the same hash replaces it).
  std::unordered_map<BlockHash, uint64_t, BlockHashHasher> loading_;
  // Hashes whose load failed, with their node: the subtree leaves the index once unpinned.
  std::unordered_map<BlockHash, NodeId, BlockHashHasher> failed_;
  // Transfers in flight that read or write each device block; a block evicted meanwhile stays out of the free
  // list until they are done (draining_).
  std::unordered_map<BlockId, int32_t> block_transfers_;
  std::unordered_set<BlockId> draining_;
  std::unordered_map<uint64_t, BlockId> transfer_block_;  // transfer id -> the device block it touches
  std::unordered_map<uint64_t, NodeId> transfer_node_;    // transfer id -> the node it moves
  std::unordered_map<uint64_t, Tier> load_source_;        // load transfer id -> the tier the lookup found it in

  std::vector<transfer::Transfer> submissions_;
  uint64_t next_transfer_id_ = 1;
  int64_t loaded_blocks_ = 0;
  int64_t failed_loads_ = 0;
  int64_t disk_write_failures_ = 0;
  int64_t disk_corrupt_ = 0;
  int64_t disk_bytes_read_ = 0;
  int64_t disk_bytes_written_ = 0;
  int64_t host_bytes_read_ = 0;
  int64_t host_bytes_written_ = 0;
};

}  // namespace deepinfer::kvcache
