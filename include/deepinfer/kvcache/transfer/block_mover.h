// Asynchronous KV block movement between the tiers of the prefix cache (kv_cache_manager.h): device <-> host
// copies and disk reads, writes and deletes, issued by the engine thread and run in order by one mover thread,
// so that no load, write-through or disk access ever runs on the step thread.
//
// The block layout, described once: a block's payload is `block_bytes` bytes, layer-major: for layer l
// (0 .. num_layers-1), bytes [l * layer_bytes, (l + 1) * layer_bytes) hold that layer's cache entries of the
// block's kBlockTokens tokens, token-major, in the backend's cache dtype (float32 on the CPU backend, bf16 on
// CUDA; MLA: kv_lora_rank + qk_rope_head_dim values per token). The same bytes are what the host tier keeps
// and what a disk block file carries after its header (disk_block_store.h); a remote worker's KV transfer
// ships them unchanged.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/kvcache/disk_block_store.h"
#include "deepinfer/kvcache/prefix_index.h"

namespace deepinfer::kvcache::transfer {

// Reads and writes one device block's payload (the layout above). The engine implements it over its backend's
// per-layer caches. Called on the mover thread while the step thread runs forward passes: only ever for blocks
// no scheduled step reads or writes (a block being loaded belongs to a request that is not scheduled yet; a block
// being read is a full, immutable cached block), so the two never touch the same bytes.
class DeviceBlockIo {
 public:
  virtual ~DeviceBlockIo() = default;
  // Copies device block `block` into `out` (block_bytes). Errors: the backend's copy error.
  virtual Status read(BlockId block, std::span<std::byte> out) = 0;
  // Copies `in` (block_bytes) into device block `block`. Errors: the backend's copy error.
  virtual Status write(BlockId block, std::span<const std::byte> in) = 0;
};

// A host copy of one block, shared by the host tier and the transfers that fill or read it. Filled once, by
// the transfer that created it (device -> host, or disk -> host), then read-only.
struct HostBlock {
  enum State : int { kPending = 0, kReady = 1, kFailed = 2 };
  std::vector<std::byte> bytes;  // block_bytes once ready
  std::atomic<int> state{kPending};
};

struct Transfer {
  enum class Kind : uint8_t {
    kDeviceToHost,    // device `block` -> `host` (write-through, demotion)
    kHostToDevice,    // `host` -> device `block` (a load-back; `host` may be filled by an earlier transfer)
    kDiskToDevice,    // disk `hash` -> device `block` (a load-back that host did not admit)
    kDiskToHost,      // disk `hash` -> `host`
    kToDisk,          // `host` (when set, else device `block`) -> disk `hash`, expiring ttl_ms from now
    kRemoveFromDisk,  // delete disk `hash`
  };
  Kind kind = Kind::kDeviceToHost;
  uint64_t id = 0;  // the submitter's name for it, echoed in its result
  BlockHash hash;
  BlockHash parent;  // kToDisk: recorded in the block file
  BlockId block = kNoBlock;
  std::shared_ptr<HostBlock> host;
  int64_t ttl_ms = 0;
  // Runs ahead of the queued transfers when none of its hash is queued or running (device -> host copies:
  // cheap, and the device block they read is free for reuse only when they are done).
  bool urgent = false;
};

struct TransferResult {
  uint64_t id = 0;  // Transfer::id
  Transfer::Kind kind = Transfer::Kind::kDeviceToHost;
  BlockHash hash;
  BlockId block = kNoBlock;
  Status status;          // Corruption: the disk copy was corrupt or foreign (and is deleted)
  int64_t bytes = 0;      // payload bytes moved
  double seconds = 0;     // time the transfer ran
};

// One queue of transfers and a few worker threads (the disk's queue depth: a cold block read is a random read,
// so one thread at a time would leave the disk idle between them). The dependency rule: transfers of the same
// hash run one at a time in submission order (a transfer reading a HostBlock runs after the one filling it, a
// disk read after the write of that hash); a disk write (kToDisk) also waits for the transfers of its parent hash
// queued before it or running, so a block's file lands only after the one it follows (a kill -9 leaves no chain
// with a gap); other transfers of different hashes run in any order, concurrently. The caller never reuses a device
// block while a transfer of it is in flight (KvCacheManager counts them).
// Thread-safety: submit, poll, wait, drain, queued may be called from any thread; the engine calls them from
// its step thread.
class BlockMover {
 public:
  // `io` and `disk` are not owned and must outlive the mover; either may be null when no transfer needs it
  // (a transfer that needs a missing one fails with FailedPrecondition). block_bytes > 0, workers >= 1. The
  // workers run at the lowest CPU priority (nice 19): KV movement yields the CPU to the step thread.
  BlockMover(DeviceBlockIo* io, DiskBlockStore* disk, size_t block_bytes, int workers = 4);
  // Runs what is queued, then stops the thread.
  ~BlockMover();
  BlockMover(const BlockMover&) = delete;
  BlockMover& operator=(const BlockMover&) = delete;

  void set_device_io(DeviceBlockIo* io);
  // Queues transfers, in order (one lock and at most one wake-up for the lot).
  void submit(std::vector<Transfer> transfers);
  // The same, unless a worker holds the queue's lock right now: then nothing is queued, `transfers` is left as
  // it was and false is returned (the step thread retries at its next call rather than wait for a worker that
  // runs at the lowest priority).
  bool try_submit(std::vector<Transfer>& transfers);
  // The transfers completed since the last poll. `wait_for_lock` false: empty when a worker holds the lock.
  std::vector<TransferResult> poll(bool wait_for_lock = true);
  // Until a completion is waiting to be polled, or `timeout`. True when one is.
  bool wait(std::chrono::milliseconds timeout);
  // Until every submitted transfer has completed.
  void drain();
  // Transfers submitted and not yet completed.
  int64_t queued() const;
  // Whether completed transfers wait for poll(). Takes the lock.
  bool has_completions() const;

 private:
  void run();
  TransferResult execute(const Transfer& transfer, std::vector<std::byte>& scratch);
  // With mu_ held: appends `transfers` (urgent ones ahead, see Transfer::urgent).
  void enqueue_locked(std::vector<Transfer>& transfers);
  // With mu_ held: the position in queue_ of the first transfer the dependency rule lets run, or queue_.size().
  size_t next_runnable_locked() const;

  std::atomic<DeviceBlockIo*> io_;
  DiskBlockStore* const disk_;
  const size_t block_bytes_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the thread waits for work or stop
  std::condition_variable done_cv_;  // wait() and drain() wait for completions
  std::deque<Transfer> queue_;
  std::unordered_set<BlockHash, BlockHashHasher> running_;  // hashes with a transfer in a worker
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> queued_;  // hashes with transfers in queue_
  std::vector<TransferResult> completed_;
  std::atomic<int64_t> in_flight_{0};  // submitted and not completed
  int32_t idle_workers_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace deepinfer::kvcache::transfer
