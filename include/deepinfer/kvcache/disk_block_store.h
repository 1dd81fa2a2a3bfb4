// The disk tier of the KV cache: one file per block, keyed by its chained BlockHash. It is durable (files are
// written atomically and checksummed, the index is rebuilt by scanning the directory after a crash or kill -9)
// and careful about what it serves: a corrupted, truncated or foreign block is detected, deleted and reported
// as a miss, so the engine recomputes it. Never served.
//
// On-disk format (version 1). The directory holds
//   <directory>/LOCK                        flock()ed by the open store: one store per directory at a time
//   <directory>/MODEL                       text: "fingerprint <32 hex>\nmodel <name>\n", the model whose blocks
//                                           these are (written by open(); a directory of another model is refused)
//   <directory>/<hh>/<32 hex>.kvb           one block; <32 hex> is BlockHash::to_hex(), <hh> its first 2 digits
//                                           (256 fan-out directories at most, each made by the first put() into it)
//   <directory>/<hh>/<32 hex>.<seq>.tmp     a put() in progress (or killed): removed by open()
// Anything else is left alone. A .kvb file is a 128-byte header followed by the payload; all integers are
// little-endian:
//   offset   0  u8[8]  magic "DIKVBLK\0"
//   offset   8  u32    format version (1)
//   offset  12  u32    header size in bytes (128)
//   offset  16  u64    fingerprint.low      offset  24  u64  fingerprint.high   (the ModelFingerprint)
//   offset  32  u64    hash.low             offset  40  u64  hash.high          (must match the file name)
//   offset  48  u64    parent.low           offset  56  u64  parent.high        (the previous block's hash)
//   offset  64  u64    payload size in bytes (== block_bytes)
//   offset  72  u64    write sequence number (per directory, increasing; breaks recency ties on open())
//   offset  80  u64    XXH3-64 (seed 0) of the payload
//   offset  88  u64    expiry, Unix time in ms (0: never; files of before this field hold 0 there)
//   offset  96  u8[24] reserved, zero
//   offset 120  u64    XXH3-64 (seed 0) of header bytes [0, 120)
//   offset 128  u8[payload size]  the payload: the block's KV bytes, opaque to the store
// File size must be exactly 128 + payload size. Another magic, version or header size, a bad header checksum
// or non-zero reserved bytes make the file malformed (counted as corrupt); a valid header with another
// fingerprint makes it foreign. The parent hash is recorded for tools and future chain rebuilding; the store
// does not interpret it. Recency survives a restart through the file's mtime, which put() sets to the wall
// clock and get() refreshes; ties (file systems with coarse timestamps) are broken by the sequence number.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/kv_events.h"

namespace deepinfer::kvcache {

inline constexpr size_t kDiskBlockHeaderBytes = 128;
inline constexpr uint32_t kDiskBlockFormatVersion = 1;

struct DiskBlockStoreOptions {
  std::filesystem::path directory;  // created (with parents) if missing
  ModelFingerprint fingerprint;     // blocks written under another fingerprint are foreign: never served
  std::string model_name;           // recorded in MODEL and named in errors (e.g. the checkpoint directory)
  // A directory that holds blocks of another model (by MODEL, or by a foreign block file when MODEL is
  // missing) is refused by open(), naming both models, unless this is set: then those blocks are deleted
  // (--kv-disk-reset).
  bool reset_foreign = false;
  size_t block_bytes = 0;           // exact payload size of one block (all layers' latent KV of 64 tokens)
  int64_t capacity_blocks = 0;      // max blocks kept on disk; put() beyond it evicts the least recently used
  // false: put() never evicts (open() still trims to capacity_blocks). For an owner that keeps the count itself by
  // remove(): KvCacheManager, whose policy evicts a chain from its end and whose removes may land after the next
  // put()s (other hashes, other mover workers), so the store holds at most the writes in flight beyond capacity for
  // a moment. With put() evicting too, such a race took the least recently used block, often a chain's first, which
  // the policy still counted on disk: its loads failed and the next start dropped the blocks after it.
  bool evict_on_put = true;
  // fsync each block file before its rename and the fan-out directory after it, so a put() that returned
  // survives a power loss or kernel crash, at the price of one or two disk flushes per block. false skips
  // both: a put() that returned still survives kill -9 (the page cache outlives the process), but after a
  // power loss a block may be missing or, on some file systems, present with garbage; the checksums then
  // drop it. For tests and benchmarks, or a cache you are content to lose on power loss.
  bool sync = true;
  // The wall clock blocks expire by, in Unix ms (the disk tier outlives the process, so not a steady clock).
  // Empty: the system clock. Test seam.
  std::function<int64_t()> now_unix_ms;
  // Test seam, empty in production: called by put() after the temp file holds the header and before the
  // payload is written (a test kills the process there to leave a half-written temp file behind).
  std::function<void(const BlockHash&)> test_hook_mid_write;
};

// Counters since open(); `blocks` is a gauge. A metric exporter reads them through stats().
struct DiskBlockStoreStats {
  int64_t blocks = 0;              // blocks in the index now
  int64_t hits = 0;                // get() calls that returned a verified block
  int64_t misses = 0;              // get() calls that did not (absent, corrupt, foreign, I/O error)
  int64_t writes = 0;              // block files written by put()
  int64_t evictions = 0;           // blocks deleted to stay within capacity_blocks (put() and open())
  int64_t corrupt_dropped = 0;     // files deleted as malformed (open() and get())
  int64_t expired = 0;             // files deleted because their expiry passed (open() and get())
  int64_t foreign_dropped = 0;     // files deleted as written under another fingerprint (open() and get())
  int64_t temp_files_removed = 0;  // leftover temp files of interrupted put()s, removed by open()
  uint64_t bytes_written = 0;      // payload bytes written by put()
  uint64_t bytes_read = 0;         // payload bytes returned by successful get()s
};

// What open() found in the directory (fixed once open() returns): the startup log line and
// deepinfer_kv_disk_recovery_blocks report it.
struct DiskRecoveryStats {
  int64_t recovered_blocks = 0;    // valid blocks indexed
  int64_t corrupt_dropped = 0;     // malformed files deleted
  int64_t foreign_dropped = 0;     // another model's files deleted (only with reset_foreign)
  int64_t expired_dropped = 0;     // files whose expiry had passed, deleted
  int64_t temp_files_removed = 0;  // leftovers of interrupted put()s
  int64_t evicted = 0;             // valid blocks beyond capacity_blocks, deleted
  // Valid blocks whose chain does not reach a first block (the block before them is gone: expired, trimmed, or
  // never written), deleted by KvCacheManager::create after it rebuilt the chains: they could never be matched.
  // recovered_blocks counts what is left after them.
  int64_t unchained_dropped = 0;
};

// The store. Every method may be called from any thread: an internal mutex guards the index, the recency
// list and the counters, and is held for index updates and the metadata operations that must agree with
// the index (rename into place, unlink); reading and writing block bytes and fsync happen outside it, so a
// put() on the background writer does not stall a get() or match_prefix() on the engine thread.
// The object owns the directory (through LOCK) while it lives; destroy it before opening the directory again.
class DiskBlockStore {
 public:
  // Creates `directory` when missing, takes its LOCK, checks MODEL (another model's directory is refused
  // unless options.reset_foreign), and scans it: leftover temp files are removed; each
  // .kvb file's header is validated (magic, format version, header checksum, fingerprint, block hash equal
  // to the file name's, payload size, file size), not its payload checksum (get() checks that). Foreign files
  // (another fingerprint; only with reset_foreign, else open() fails and deletes none of them) and malformed
  // ones are deleted and counted; then MODEL is (re)written. The valid ones form the index, oldest
  // first by (mtime, sequence number); when there are more than capacity_blocks, the oldest are evicted.
  // Cost: one open() and one 128-byte read per file.
  // Errors: InvalidArgument when directory is empty, block_bytes is 0 or capacity_blocks < 1; IoError when
  // the directory cannot be created or read, or its LOCK is held (another store, in this or another process);
  // FailedPrecondition when it holds another model's blocks and reset_foreign is not set.
  static Result<std::unique_ptr<DiskBlockStore>> open(DiskBlockStoreOptions options);

  ~DiskBlockStore();
  DiskBlockStore(const DiskBlockStore&) = delete;
  DiskBlockStore& operator=(const DiskBlockStore&) = delete;

  // Stores one block, to expire `ttl_ms` after now by the store's clock (ttl_ms 0: never; an expired block is
  // absent to contains(), match_prefix() and get(), and deleted by get() and open()). When `hash` is already on disk,
  // only refreshes its recency (same hash, same KV) and, in the index, moves its expiry later when this one is later
  // (the file keeps the expiry it was written with). Either way the blocks before it (parent links) expire no earlier
  // than it: a block is usable only with its prefix. After a restart a block's expiry is the latest among its file's
  // and those of the files after it, so a reused prefix outlives its own file's expiry as long as a later block does.
  // Otherwise writes <hh>/<hash>.<seq>.tmp (header, payload, fsync when options.sync), renames it over
  // <hh>/<hash>.kvb, fsyncs the directory (when options.sync), adds it to the index as most recently used,
  // and evicts least recently used blocks beyond capacity_blocks. A reader never sees a partial file under
  // the final name; after a crash the temp file is removed by the next open().
  // REQUIRES: payload.size() == block_bytes (else InvalidArgument, nothing written).
  // Errors: IoError naming the file and errno when a write, fsync or rename fails (the temp file is removed;
  // the index is unchanged).
  // `token_ids` (the block's tokens, when the caller has them) only travel in the BlockStored event.
  Status put(const BlockHash& hash, const BlockHash& parent, std::span<const std::byte> payload, int64_t ttl_ms = 0,
             std::span<const TokenId> token_ids = {});

  // A use of block `hash` (a prompt reused it, from whichever tier): moves its expiry, and that of the blocks before
  // it, out to `ttl_ms` after now where theirs is earlier (ttl_ms 0: never), as put() of a block already on disk
  // does. The file's header gets the new expiry too when it is later than the header's by more than
  // refresh_slack_ms(ttl_ms) (a read-modify-write of the 128-byte header; at most one per block per slack), so a
  // restart keeps a prefix that stayed in use (open() gives a block the latest expiry of the blocks after it, so
  // refreshing a chain's last block on disk is enough). Ok when `hash` is absent or expired (nothing to refresh).
  // Errors: IoError when the header cannot be rewritten (the index keeps the new expiry).
  Status refresh(const BlockHash& hash, int64_t ttl_ms);
  static int64_t refresh_slack_ms(int64_t ttl_ms) { return std::max<int64_t>(1'000, ttl_ms / 16); }

  // Reads block `hash` into `out` and verifies the header and the payload checksum; on success marks it
  // most recently used (also in the file's mtime) and counts a hit. Any failure counts a miss, and the caller
  // treats it as one: `out`'s content is then unspecified.
  // REQUIRES: out.size() == block_bytes (else InvalidArgument).
  // Errors: NotFound when the block is not in the index (or its file vanished: it leaves the index);
  // Corruption when the file is malformed or foreign: it is deleted, leaves the index, and corrupt_dropped
  // or foreign_dropped counts it, so a later put() of the same hash writes it afresh; IoError when the
  // operating system refuses the read (the block stays indexed).
  Status get(const BlockHash& hash, std::span<std::byte> out);

  // Whether `hash` is in the index and not expired. Index only: no I/O, no recency change.
  bool contains(const BlockHash& hash) const;

  // Deletes block `hash` from the index and the disk. Ok when it was absent.
  // Errors: IoError when unlink fails for another reason than absence (the index no longer has it; the
  // file would be indexed again by the next open()).
  Status remove(const BlockHash& hash);

  // The number of leading elements of `chain` that are all in the index and not expired: chain[0, n) are on disk
  // and chain[n] is not (or n == chain.size()). Index only: no I/O, no recency change.
  size_t match_prefix(std::span<const BlockHash> chain) const;

  // A snapshot of the counters.
  DiskBlockStoreStats stats() const;
  // Every indexed block as (hash, parent), least recently used first (the KV-event snapshot after a restart).
  std::vector<std::pair<BlockHash, BlockHash>> list_blocks() const;
  // Every indexed block with its parent and expiry (Unix ms, 0: never), least recently used first: what the
  // prefix cache rebuilds its disk tier from after a restart.
  struct ListedBlock {
    BlockHash hash;
    BlockHash parent;
    int64_t expires_at_unix_ms = 0;
  };
  std::vector<ListedBlock> list_entries() const;
  // From now on, every block entering the index is reported as BlockStored and every one leaving it as
  // BlockRemoved (medium "DISK"), under the store's lock so the order matches the index. Not owned; must
  // outlive the store. Call before the store is shared.
  void set_event_sink(KvEventSink* sink) { sink_ = sink; }

  // What open() recovered and dropped. Immutable after open(); any thread.
  const DiskRecoveryStats& recovery() const { return recovery_; }
  // Called once by the index's owner after open(), when it has removed (remove()) the `unchained` blocks it could
  // not chain: counts them and sets recovered_blocks to the blocks left.
  void finish_recovery(int64_t unchained);

  const DiskBlockStoreOptions& options() const { return options_; }
  // The final path of block `hash`: <directory>/<hh>/<32 hex>.kvb (whether or not it exists).
  std::filesystem::path block_path(const BlockHash& hash) const;

 private:
  struct Entry {
    BlockHash parent;
    int64_t expires_at_unix_ms = 0;  // 0: never
    std::list<BlockHash>::iterator recency;  // into recency_
    int64_t file_expires_at_unix_ms = 0;     // what the file's header says (refresh() rewrites it)
  };

  DiskBlockStore(DiskBlockStoreOptions options, int lock_fd);
  // open()'s check of MODEL against options_ (FailedPrecondition for another model's directory).
  Status check_manifest();
  // open()'s scan of the fan-out directories. Runs before the store is shared.
  Status scan();
  // Writes MODEL (temp file + rename) after a successful scan.
  Status write_manifest();
  // Drops least recently used blocks until at most capacity_blocks remain, counting evictions.
  // REQUIRES: mu_ held.
  void evict_over_capacity_locked();
  // Removes `hash` from the index and unlinks its file; Ok when absent. REQUIRES: mu_ held.
  Status erase_locked(const BlockHash& hash);
  // Moves the expiry of `hash` and of every block before it (parent links) out to `expires_at_unix_ms` (0: never)
  // where theirs is earlier: a block is usable only with its prefix. In memory; scan() derives the same from the
  // files after a restart. REQUIRES: mu_ held.
  void extend_expiry_locked(const BlockHash& hash, int64_t expires_at_unix_ms);
  // Makes an indexed `hash` the most recently used. REQUIRES: mu_ held.
  void touch_locked(const BlockHash& hash);
  int64_t now_unix_ms() const;
  // Whether an index entry has expired at `now`. REQUIRES: mu_ held.
  static bool expired(const Entry& entry, int64_t now) {
    return entry.expires_at_unix_ms != 0 && entry.expires_at_unix_ms <= now;
  }

  const DiskBlockStoreOptions options_;
  const int lock_fd_;
  DiskRecoveryStats recovery_;  // written by open() before the store is shared
  KvEventSink* sink_ = nullptr;  // set before the store is shared

  mutable std::mutex mu_;
  std::unordered_map<BlockHash, Entry, BlockHashHasher> index_;  // GUARDED_BY(mu_)
  std::list<BlockHash> recency_;                                 // GUARDED_BY(mu_) least recently used first
  uint64_t next_sequence_ = 1;                                   // GUARDED_BY(mu_)
  DiskBlockStoreStats stats_;                                    // GUARDED_BY(mu_) (blocks filled by stats())
};

}  // namespace deepinfer::kvcache
