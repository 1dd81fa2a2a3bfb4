// The router's picture of what each worker caches: a mirror of every worker's prefix index, fed by the KV
// events the workers publish (kvcache/kv_events.h, vLLM's schema). Blocks are named by their chained hashes
// (block_hash.h), and a chained hash names its whole prefix, so one map from block hash to the workers holding
// it is a radix tree over all workers at once: a request's cached prefix on worker W is the longest run of its
// hash chain, from block 0, that W holds. This is how llm-d's KV-cache indexer and Dynamo's router index vLLM
// workers. It is approximate as DESIGN.md says: events arrive after the fact and a worker may evict between the
// event and the request; the worker's own prefix index (kvcache/prefix_index.h) stays the only one that
// decides what is reused.
//
// Thread-safety: every method may be called from any thread (one mutex).
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/kv_events.h"

namespace deepinfer::router {

// What a worker holds of one request's chain: leading blocks with a copy in some tier, and how many of
// those have their fastest copy in the host or the disk tier (loaded back before prefill: cheaper than
// computing, dearer than a device hit).
struct PrefixMatch {
  int32_t blocks = 0;       // leading blocks held in any tier
  int32_t host_blocks = 0;  // of those, fastest copy in host RAM ("CPU" medium)
  int32_t disk_blocks = 0;  // of those, only on disk ("DISK" medium)
};

class KvIndex {
 public:
  // REQUIRES: 0 < num_workers <= 65535.
  explicit KvIndex(int32_t num_workers);

  // Applies one batch of `worker`'s events: BlockStored adds the tier (by medium: "GPU"/"DEVICE" -> device,
  // "CPU" -> host, "DISK" -> disk; another medium counts as device), BlockRemoved drops it, AllBlocksCleared
  // forgets everything the worker held. Unknown hashes in BlockRemoved are ignored (an event lost earlier).
  void apply(int32_t worker, const kvcache::KvEventBatch& batch);
  // Forgets everything `worker` held (it restarted, or its event stream had a gap that replay cannot fill).
  void clear_worker(int32_t worker);

  // For each worker, what it holds of `chain` (chain[i] = hash of block i). Size num_workers.
  std::vector<PrefixMatch> match(std::span<const kvcache::BlockHash> chain) const;

  // Blocks `worker` holds in any tier, and the distinct blocks over all workers.
  int64_t worker_blocks(int32_t worker) const;
  int64_t distinct_blocks() const;
  int32_t num_workers() const { return num_workers_; }

 private:
  struct Holder {
    uint16_t worker = 0;
    uint8_t tiers = 0;  // bit tier_index(Tier)
  };
  void drop_tier_locked(int32_t worker, const kvcache::BlockHash& hash, uint8_t tier_bit);

  int32_t num_workers_;
  mutable std::mutex mutex_;
  std::unordered_map<kvcache::BlockHash, std::vector<Holder>, kvcache::BlockHashHasher> blocks_;
  std::vector<int64_t> worker_blocks_;
};

}  // namespace deepinfer::router
