// KV events: every block stored to or removed from a tier, and "all cleared", published so that a KV-aware
// router can mirror what a worker holds. The wire format is vLLM's (vllm/distributed/kv_events.py), so routers
// built for vLLM (llm-d's KV cache manager, Dynamo's router) can index DeepInfer workers unchanged:
//   ZeroMQ PUB, one multipart message per batch: [topic, sequence number (u64 big-endian), payload], the
//   payload a msgpack array (msgspec array_like, tagged unions):
//     KVEventBatch     = [ts (float64 seconds since the epoch), [event, ...]]
//     BlockStored      = ["BlockStored", [block_hash, ...], parent_block_hash | nil, [token_id, ...], block_size,
//                         lora_id (nil), medium]
//     BlockRemoved     = ["BlockRemoved", [block_hash, ...], medium]
//     AllBlocksCleared = ["AllBlocksCleared"]
//   block hashes are msgpack bin of 16 bytes (BlockHash, high half first, as BlockHash::to_hex prints);
//   medium is "GPU" (the device tier on a GPU), "DEVICE" (the device tier of the CPU backend), "CPU" (the host
//   tier) or "DISK" (the disk tier).
//   ZeroMQ ROUTER replay: a request [identity, "", start sequence (u64 big-endian)] is answered with
//   [identity, "", sequence, payload] for every buffered batch from that sequence on, then
//   [identity, "", 0xffffffffffffffff, ""].
// token_ids holds the blocks' tokens (block_size per block) when the tier got the block from computed tokens;
// it is empty for a block a tier got without its tokens (a disk block recovered at startup, or loaded back
// from disk): such an event still names the block by hash.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/core/types.h"
#include "deepinfer/kvcache/block_hash.h"

namespace deepinfer::kvcache {

inline constexpr std::string_view kMediumGpu = "GPU";
inline constexpr std::string_view kMediumDevice = "DEVICE";
inline constexpr std::string_view kMediumHost = "CPU";
inline constexpr std::string_view kMediumDisk = "DISK";

struct KvEvent {
  enum class Kind { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Kind kind = Kind::kBlockStored;
  std::vector<BlockHash> block_hashes;         // stored, removed: in chain order for stored
  std::optional<BlockHash> parent_block_hash;  // stored: the first block's parent (nullopt for a chain's root)
  std::vector<TokenId> token_ids;              // stored: block_size tokens per block, or empty (see above)
  int32_t block_size = kBlockTokens;
  std::string medium;  // stored, removed

  static KvEvent stored(std::string_view medium, const BlockHash& hash, const BlockHash& parent,
                        std::span<const TokenId> token_ids);
  static KvEvent removed(std::string_view medium, const BlockHash& hash);
  static KvEvent all_cleared();
};

struct KvEventBatch {
  double ts = 0;  // seconds since the Unix epoch
  std::vector<KvEvent> events;
};

// Reorders one batch's events so that a BlockStored comes after the BlockStored of its parent on the same medium
// where both are in the batch (tiers fed by demotion store a chain's end first; an indexer that drops a block whose
// parent it does not know yet, as vLLM-schema consumers may, would lose those). A parent's event moves only ahead of
// events it can pass without changing what a replay of the batch leaves: never past a BlockRemoved of the same block
// on that medium or an AllBlocksCleared. Otherwise the order is kept. O(n log n) in the batch's events.
void order_parents_first(std::vector<KvEvent>& events);

// The payload bytes of one batch (the format above).
std::string encode_kv_event_batch(const KvEventBatch& batch);
// The inverse, for subscribers (the router, tests). Errors: Corruption naming what is malformed.
Result<KvEventBatch> decode_kv_event_batch(std::string_view payload);

// Where a tier reports its events. publish() is thread-safe, never blocks on I/O and may be called with a
// tier's own mutex held (the sink's lock is a leaf).
class KvEventSink {
 public:
  virtual ~KvEventSink() = default;
  virtual void publish(KvEvent event) = 0;
};

struct KvEventPublisherConfig {
  std::string endpoint;         // ZeroMQ PUB endpoint to bind, e.g. tcp://*:5557 (--kv-events-endpoint)
  std::string replay_endpoint;  // ZeroMQ ROUTER endpoint to bind for replay; empty: none
  std::string topic;            // first frame of every message ("" by default, as vLLM's)
  size_t buffer_batches = 10000;  // batches kept for replay (the oldest are dropped first)
  int32_t flush_interval_ms = 100;  // events published outside an engine step go out after at most this long
};

// Publishes batches over ZeroMQ from a thread of its own; events collect between flush() calls (the engine
// flushes after every step) and go out as one batch with the next sequence number (0, 1, ...).
// Thread-safety: every method may be called from any thread.
class KvEventPublisher final : public KvEventSink {
 public:
  // Binds the sockets and starts the thread. Errors: InvalidArgument for an empty endpoint or one ZeroMQ
  // cannot bind (the message names it and ZeroMQ's reason, e.g. "Address already in use").
  static Result<std::unique_ptr<KvEventPublisher>> start(KvEventPublisherConfig config);
  ~KvEventPublisher() override;  // flushes, sends what is queued, closes the sockets
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  void publish(KvEvent event) override;
  // The events published since the last flush become one batch, queued for sending. No-op when none.
  void flush();
  // Batches queued or sent so far (the next batch's sequence number).
  uint64_t num_batches() const;

  struct Impl;

 private:
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deepinfer::kvcache
