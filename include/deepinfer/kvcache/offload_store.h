// The tiers below the device: a host-RAM tier and an optional durable disk tier (DiskBlockStore), holding
// copies of full KV blocks keyed by their chained hash (block_hash.h). The device tier is the scheduler's
// block pool; this store is what the engine writes completed blocks through to and loads them back from
// (the shape of vLLM's KV offloading connector and SGLang's HiCache, with DeepInfer's retention rules).
//
//   device --write-through on completion--> host --background writer, batched--> disk
//   device <--load-back at admission-------- host <--prefetch while the request waits-- disk
//
// Retention: each host copy expires `ttl` after its last access by a request of its class (RetentionConfig:
// chat 7 days, agent 3 days, default from --kv-cache-ttl-hours); expired copies never match. Under pressure
// the copy with the earliest expiry goes first (LRU within a class). Host eviction runs gradually in tick()
// between the high and low watermarks, paid from a token bucket of bytes/s; a store into a full host tier may
// evict one copy with a token, else it is refused (no synchronous flush on the request path). The disk tier
// keeps its own LRU within its capacity; its blocks outlive the process (kill -9 included) and are served
// again after a restart under the same model fingerprint.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/disk_block_store.h"
#include "deepinfer/kvcache/kv_events.h"
#include "deepinfer/kvcache/prefix_index.h"
#include "deepinfer/kvcache/tier_policy.h"

namespace deepinfer::kvcache {

struct OffloadConfig {
  size_t block_bytes = 0;                // bytes of one block's KV (all layers); REQUIRES > 0
  int64_t host_capacity_blocks = 0;      // REQUIRES > 0
  double high_watermark = 0.95;          // fractions of host_capacity_blocks (TierConfig's meaning)
  double low_watermark = 0.90;
  double evict_bytes_per_s = kUnlimited;  // host eviction token bucket; burst is one second, at least one block
  RetentionConfig retention = RetentionConfig::defaults();
  // The disk tier, when set: its directory, capacity and the model fingerprint (foreign blocks are dropped).
  // Its block_bytes must equal block_bytes above.
  std::optional<DiskBlockStoreOptions> disk;
  // Errors: InvalidArgument naming the field.
  Status validate() const;
};

// Counters of one tier below the device (gauges: usage, capacity; the rest only grow).
struct OffloadTierCounters {
  int64_t usage_blocks = 0;
  int64_t capacity_blocks = 0;
  int64_t hit_blocks = 0;      // blocks loaded back from this tier (the fastest one below device holding them)
  int64_t miss_blocks = 0;     // blocks an admitted lookup needed from this tier and did not get from it
  int64_t stored_blocks = 0;   // copies written into this tier
  int64_t refused_blocks = 0;  // stores refused (host full, no eviction token) or failed (disk write error)
  int64_t evicted_blocks = 0;  // dropped under capacity pressure
  int64_t expired_blocks = 0;  // dropped because their TTL passed (host: by tick(); disk: found expired by a load or at open)
  int64_t corrupt_blocks = 0;  // found corrupt or foreign and dropped (disk)
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;
};

struct OffloadCounters {
  OffloadTierCounters host;
  OffloadTierCounters disk;
  int64_t disk_queue_blocks = 0;  // blocks waiting for the background writer
  DiskRecoveryStats disk_recovery;  // what the disk tier's open() found (zero without a disk tier)
};

// Thread-safety: every public method may be called from any thread; one mutex guards the host tier and the
// queues, disk I/O runs on the store's background thread (writes, prefetch) or, for a load of a block that
// was not prefetched, on the caller's thread outside the mutex.
class KvOffloadStore {
 public:
  // Opens the disk tier (rebuilding its index from the directory) and starts the background thread.
  // Errors: the config's validation error; the disk store's open error.
  static Result<std::unique_ptr<KvOffloadStore>> create(OffloadConfig config);
  // Drains the disk queue (every block stored before is on disk when this returns), then stops the thread.
  ~KvOffloadStore();
  KvOffloadStore(const KvOffloadStore&) = delete;
  KvOffloadStore& operator=(const KvOffloadStore&) = delete;

  // Write-through of a completed block: copies `payload` (block_bytes) into host (when host admits it) and
  // queues it for the disk tier. A block host already holds is only touched. REQUIRES: payload.size() ==
  // block_bytes, ttl_class known.
  // `token_ids`: the block's tokens, reported in the BlockStored events (empty when unknown).
  void store(const BlockHash& hash, const BlockHash& parent, std::span<const std::byte> payload, TtlClassId ttl_class,
             int64_t now_ms, std::span<const TokenId> token_ids = {});

  // Reports every block entering or leaving the host tier (medium "CPU") and the disk tier ("DISK") to `sink`
  // (not owned; must outlive the store), and first the disk blocks recovered at open, as BlockStored without
  // tokens. Call before the store is used.
  void set_event_sink(KvEventSink* sink);

  // How many leading blocks of `chain` are held below the device (live in host, or on disk). Index only: no
  // block is read, nothing is counted (a request may be matched again before it is admitted).
  int64_t match(std::span<const BlockHash> chain, int64_t now_ms);

  // Copies block `hash` into `out` (block_bytes): from host (touching it for `ttl_class`), else from disk,
  // verified, and then kept in host too. False when neither holds it intact (a corrupt or foreign disk copy is
  // dropped, never returned): the caller recomputes.
  bool load(const BlockHash& hash, std::span<std::byte> out, TtlClassId ttl_class, int64_t now_ms);

  // Counts an admitted request's lookup ending at a block that no tier below the device could serve (absent,
  // expired or corrupt): one miss in host, and one in disk when there is a disk tier. Hits are counted by load().
  void record_miss();

  // Queues disk -> host reads of the blocks of `chain` that only the disk holds, so a request waiting in the
  // queue finds them in host at admission.
  void prefetch(std::span<const BlockHash> chain, TtlClassId ttl_class, int64_t now_ms);

  // Background retention work for the host tier at now_ms: drops expired copies, then evicts from above the
  // high watermark down to the low one within the token bucket. Call it every engine step.
  void tick(int64_t now_ms);

  // Blocks until the disk queue is empty (tests, shutdown).
  void flush();

  OffloadCounters counters() const;
  // The blocks held now: host (expired copies not yet dropped included) and disk (empty without one).
  std::vector<BlockHash> host_blocks() const;
  std::vector<BlockHash> disk_blocks() const;
  const OffloadConfig& config() const { return config_; }

 private:
  struct HostEntry {
    std::shared_ptr<const std::vector<std::byte>> payload;
    int64_t expiry_ms = 0;
    // Read from disk by prefetch() for a waiting request: its first load counts as a disk hit (and a host miss),
    // as a load straight from disk does, whichever wins the race.
    bool prefetched = false;
  };
  struct DiskWrite {
    BlockHash hash;
    BlockHash parent;
    std::shared_ptr<const std::vector<std::byte>> payload;
    int64_t ttl_ms;  // the request's retention class: the disk copy expires as the host copy would
    std::vector<TokenId> token_ids;  // for the BlockStored event (may be empty)
  };
  struct Prefetch {
    BlockHash hash;
    TtlClassId ttl_class;
    int64_t now_ms;
  };

  KvOffloadStore(OffloadConfig config, std::unique_ptr<DiskBlockStore> disk);
  void run_background();
  // With mu_ held: inserts into host, evicting one copy with a bucket token when full. False when refused.
  KvEventSink* sink_ = nullptr;  // set before use
  // `parent` and `token_ids` only travel in the BlockStored event (root and empty when unknown).
  bool host_insert_locked(const BlockHash& hash, std::shared_ptr<const std::vector<std::byte>> payload,
                          int64_t expiry_ms, int64_t now_ms, const BlockHash& parent = kRootBlockHash,
                          std::span<const TokenId> token_ids = {}, bool prefetched = false);
  void host_erase_locked(const BlockHash& hash);
  bool host_live_locked(const BlockHash& hash, int64_t now_ms) const;
  void touch_locked(const BlockHash& hash, int64_t expiry_ms);

  OffloadConfig config_;
  std::unique_ptr<DiskBlockStore> disk_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;   // the background thread waits for queued work or stop
  std::condition_variable drain_cv_;  // flush() waits for the writer to catch up
  std::unordered_map<BlockHash, HostEntry, BlockHashHasher> host_;
  std::set<std::pair<int64_t, BlockHash>> host_by_expiry_;  // eviction order: earliest expiry first
  TokenBucket host_bucket_;
  bool host_evicting_ = false;
  std::deque<DiskWrite> disk_queue_;
  // Every block queued for or being written by the background writer, by hash: its bytes are still in memory.
  std::unordered_map<BlockHash, std::shared_ptr<const std::vector<std::byte>>, BlockHashHasher> pending_writes_;
  std::deque<Prefetch> prefetch_queue_;
  int64_t disk_in_flight_ = 0;  // writes taken off the queue and not yet done
  bool stop_ = false;
  OffloadCounters counters_;
  std::thread background_;
};

}  // namespace deepinfer::kvcache
