// The continuous-batching scheduler: each step it picks which sequences compute which tokens, within a token
// budget, a sequence cap and the KV block pool, and after the model ran it folds the sampled tokens back in.
// The engine's step is three lines (executor.h):
//   ScheduledBatch batch = scheduler.schedule();
//   Result<StepOutput> out = executor.run(batch);
//   scheduler.update(batch, *out);
// Policy (vLLM V1's, which operators know): running sequences first, then waiting ones FCFS; chunked prefill
// falls out of the token budget; preemption by recompute when blocks run out.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/sequence.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/kvcache/kv_cache_manager.h"
#include "deepinfer/kvcache/kv_events.h"

namespace deepinfer::engine {

struct SchedulerConfig {
  int32_t max_num_batched_tokens = 8192;  // tokens computed per step, prefill chunks and decodes together
  int32_t max_num_seqs = 256;             // running sequences at most (scheduled this step or not)
  int32_t num_blocks = 0;                 // KV blocks of kvcache::kBlockTokens tokens in the pool
  // On: a prompt longer than the step's remaining budget is prefilled in chunks over several steps.
  // Off: a sequence is admitted only when all its tokens fit the remaining budget; one longer than
  // max_num_batched_tokens is aborted.
  bool enable_chunked_prefill = true;
  // Automatic prefix caching (kvcache/kv_cache_manager.h): a full block whose 64 tokens' KV is computed is
  // indexed by its chained hash (kvcache/block_hash.h); an admitted sequence reuses the blocks of the longest
  // cached prefix of its tokens, in any tier, never the block holding its last token (at least one token is
  // computed, so one can be sampled). A cached block whose last owner released it stays cached, counted as
  // free, and is revived on a hit; when a block is wanted and none is plainly free, the cache evicts one (its
  // index decides which), so cached blocks are always evicted before anyone is preempted.
  bool enable_prefix_caching = true;
  // Identifies the model in the block hashes (see kvcache::model_fingerprint).
  kvcache::ModelFingerprint fingerprint = {};
  // KV slots reserved after a running sequence's sampling entry for draft tokens (speculative decoding: the
  // executor drafts into them and verifies in the same step), at most this many, fewer when the token budget,
  // max_tokens or the free blocks leave less room (lookahead never preempts anyone). update() rolls back the
  // slots of rejected drafts. 0: plain decoding.
  int32_t num_lookahead_slots = 0;

  // InvalidArgument naming the field when a limit is not positive.
  Status validate() const;
};

// One sequence's work in a step: compute the KV of `token_ids` at positions start_position, start_position+1,
// ..., and, when `samples`, the logits of the last one, from which the executor samples exactly one token.
struct ScheduledEntry {
  SequenceId sequence_id = 0;
  std::vector<TokenId> token_ids;  // [num_tokens] >= 1: a prefill chunk, a recompute chunk or one decode token
  int64_t start_position = 0;      // == the sequence's num_computed_tokens before this step
  // Copy of the sequence's block table, covering positions [0, start_position + token_ids.size()); the
  // executor writes this step's KV at block_table[p / kBlockTokens], slot p % kBlockTokens.
  std::vector<kvcache::BlockId> block_table;
  // Per sliding-window kind of the cache (its window pools, slot order; empty for V2/V3): the window kind's
  // blocks, indexed like block_table, kNoBlock for blocks wholly before position start_position - window.
  std::vector<std::vector<kvcache::BlockId>> window_block_tables;
  // Bounded replay (kvcache::KvCacheConfig::bounded_replay): the window blocks of the prefix's last window (before
  // start_position) are fresh, not cached: an executor resuming the sequence there replays that window into them.
  bool rebuild_window = false;
  // True when these are the sequence's last uncomputed tokens: the end of its prompt (or of a recompute
  // after preemption) or a decode token. Exactly one sampled token is expected back for such an entry.
  bool samples = false;
  // KV slots after end_position() that block_table also covers, for the executor's draft tokens (only on a
  // sampling entry; see SchedulerConfig::num_lookahead_slots and StepOutput).
  int32_t num_lookahead_slots = 0;

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t end_position() const { return start_position + num_tokens(); }  // exclusive
};

// A sequence that finished since the previous schedule() (by update, cancel or abort). Reported once.
struct FinishedSequence {
  SequenceId id = 0;
  FinishReason reason = FinishReason::kNone;
  std::string message;  // empty for kStop / kLength
  int64_t num_prompt_tokens = 0;
  int64_t num_generated_tokens = 0;
  int64_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache at first admission
  int64_t num_loaded_tokens = 0;  // of those, loaded from a tier below the device
};

// What the executor returns for a batch (executor.h).
struct StepOutput;

struct ScheduledBatch {
  uint64_t step = 0;  // 1, 2, ...: which schedule() call produced it
  // Running sequences first, in admission order, then the ones admitted this step, in queue order.
  std::vector<ScheduledEntry> entries;
  // Sequences preempted this step, in the order they were chosen (most recently admitted first). They
  // released their blocks and wait at the front of the queue; their generated tokens are kept.
  std::vector<SequenceId> preempted;
  // Sequences that finished since the previous schedule(), plus any aborted during this one. After this
  // batch they are forgotten: find() returns nullptr and cancel() NotFound.
  std::vector<FinishedSequence> finished;

  bool empty() const { return entries.empty(); }
  int64_t num_scheduled_tokens() const;
  int64_t num_sampling_entries() const;
};

// Not thread-safe: the engine calls every method from its one step thread.
class Scheduler {
 public:
  // `cache`: the prefix cache with its tiers (the engine builds it with host and disk); null: a device-only
  // cache of config.num_blocks blocks. Errors: those of SchedulerConfig::validate(); InvalidArgument when
  // `cache` disagrees with the config (block count, prefix caching on or off).
  // A window pool smaller than min_window_blocks() is InvalidArgument too.
  static Result<Scheduler> create(const SchedulerConfig& config, std::unique_ptr<kvcache::KvCacheManager> cache = nullptr);
  // The fewest blocks a sliding-window kind's pool needs so that one sequence always fits a step: its last
  // window (ceil(window_tokens / 64) blocks), a chunk of max_num_batched_tokens plus the lookahead slots, and
  // the two blocks they may straddle.
  static int32_t min_window_blocks(const SchedulerConfig& config, int32_t window_tokens);

  // The prefix cache: its tiers, counters and KV events (KvCacheManager::set_event_sink).
  kvcache::KvCacheManager& cache() { return *cache_; }
  const kvcache::KvCacheManager& cache() const { return *cache_; }

  // Queues a request at the back of the waiting queue. A request that can never be scheduled (its prompt
  // needs more blocks than the pool has, or, with chunked prefill off, more tokens than
  // max_num_batched_tokens) is accepted and finished as kAborted with the reason; it is reported in the
  // next batch's `finished`.
  // Errors (nothing queued): InvalidArgument for a duplicate live id, an empty prompt or max_tokens < 1.
  Status add(SequenceRequest request);

  // Finishes a live sequence as kCancelled wherever it is (waiting, preempted, mid-prefill, decoding),
  // releasing its blocks at once; it is reported in the next batch's `finished`. If it is in a batch that
  // was scheduled but not yet updated, update() skips its entry (its sampled token is dropped).
  // A sequence already finished but not yet reported is left as it is (Ok).
  // Errors: NotFound when no live sequence has this id (never added, or already reported).
  Status cancel(SequenceId id);

  // Plans one step; mutates the queues, block tables (allocating this step's blocks) and preemption state;
  // num_computed_tokens only at admission, to the length of the reused cached prefix (update() advances it).
  // A sequence whose cached prefix lies partly below the device is admitted into kLoadingKv: its blocks are
  // reserved and their loads queued (the cache's mover runs them); it is scheduled from the first step after
  // they arrived, while the others keep stepping. A failed load shortens its prefix (the rest is computed).
  // Deterministic. Calling schedule() again without update() abandons the previous batch: its tokens are simply
  // scheduled again.
  ScheduledBatch schedule();

  // Folds a step's results in (`out` as executor.h's StepOutput describes it). Per entry: num_computed_tokens
  // advances to end_position() plus the accepted drafts; the entry's tokens are appended in order, and the
  // first stop token (kStop, checked first) or the one reaching max_tokens (kLength) finishes the sequence,
  // releasing its blocks; the lookahead blocks past the computed tokens are released (the rejected drafts'
  // KV is rolled back); full blocks of computed tokens join the prefix index, so a block hash never covers
  // an unverified token. `out` is trimmed to the tokens kept: none for an entry cancelled since schedule(),
  // none past a finish.
  // Errors (nothing changes): InvalidArgument when `batch` is not the latest schedule()'s or was already
  // updated, or `out` does not match it (entry count; 0 tokens for a non-sampling entry; 1..k+1 for a
  // sampling entry with k lookahead slots); Internal when an entry disagrees with the sequence's state.
  Status update(const ScheduledBatch& batch, StepOutput& out);
  // The same with one token per sampling entry and no lookahead (table-driven tests; the plain decoding case).
  Status update(const ScheduledBatch& batch, std::span<const TokenId> sampled_token_ids);

  // A live (not yet reported) sequence, or nullptr. The pointer is valid until the next non-const call.
  const SequenceState* find(SequenceId id) const;
  std::vector<SequenceId> running_ids() const;  // admission order
  std::vector<SequenceId> waiting_ids() const;  // queue order, preempted ones included
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  // Admitted sequences waiting for their prefix's blocks to arrive from host or disk (they count against
  // max_num_seqs).
  int32_t num_loading() const { return static_cast<int32_t>(loading_.size()); }
  std::vector<SequenceId> loading_ids() const { return loading_; }
  // True while any sequence waits, loads or runs, or a finished one is still to be reported by schedule().
  bool has_pending_work() const {
    return !running_.empty() || !waiting_.empty() || !loading_.empty() || !newly_finished_.empty();
  }

  const kvcache::BlockPool& block_pool() const { return cache_->pool(); }
  // Cached blocks on device (in use by a sequence, or free but still holding indexed content).
  int64_t num_cached_blocks() const { return cache_->num_cached_device_blocks(); }
  // Every hash cached on device.
  std::vector<kvcache::BlockHash> cached_hashes() const { return cache_->blocks_in(kvcache::Tier::kDevice); }
  // The device block caching `hash`, or nullopt.
  std::optional<kvcache::BlockId> cached_block(const kvcache::BlockHash& hash) const {
    return cache_->device_block_of(hash);
  }
  // Lifetime totals: prompt (and recompute) tokens looked up at admission, and those found in the cache.
  int64_t num_prefix_query_tokens() const { return num_prefix_query_tokens_; }
  int64_t num_prefix_hit_tokens() const { return num_prefix_hit_tokens_; }
  // Of the hit tokens, those loaded from a tier below the device; and device blocks whose cached content was
  // evicted (reallocated for other content).
  int64_t num_prefix_loaded_tokens() const { return num_prefix_loaded_tokens_; }
  // Full blocks looked up at admission (the last token's block excluded): hits plus misses.
  int64_t num_prefix_query_blocks() const { return num_prefix_query_blocks_; }
  int64_t num_device_evicted_blocks() const { return cache_->counters().device_evicted_blocks; }
  const SchedulerConfig& config() const { return config_; }

 private:
  Scheduler(const SchedulerConfig& config, std::unique_ptr<kvcache::KvCacheManager> cache);

  SequenceState& state(SequenceId id);
  // Why `seq` can never be scheduled, or nullopt when it can.
  std::optional<std::string> why_never_schedulable(const SequenceState& seq) const;
  void finish(SequenceState& seq, FinishReason reason, std::string message);  // does not touch the queues
  void release_blocks(SequenceState& seq);
  void preempt(SequenceState& seq);  // does not touch running_
  // Grows seq's block table to cover `end_position` tokens. False when the cache ran out of blocks first (the
  // blocks taken so far stay in the table).
  // With the window kinds' blocks of each new block (all or nothing per block).
  [[nodiscard]] bool allocate_blocks(SequenceState& seq, int64_t end_position);
  // Lets go of the window blocks of blocks wholly before num_computed_tokens - window (cached ones stay cached).
  void slide_windows(SequenceState& seq);
  // Releases seq's blocks from block `keep` on (block table, window tables).
  void truncate_blocks(SequenceState& seq, size_t keep);
  ScheduledEntry make_entry(const SequenceState& seq, int64_t num_new_tokens) const;
  // The longest cached prefix of seq's tokens, excluding the block of its last token (extends seq.block_hashes
  // to that bound).
  kvcache::KvCacheManager::PrefixMatch match_prefix(SequenceState& seq);
  // The full blocks a lookup may reuse: never the block of the last token.
  static int64_t max_prefix_blocks(const SequenceState& seq);
  // Adds seq's full computed blocks to the prefix cache (which writes them through to the lower tiers).
  void register_computed_blocks(SequenceState& seq);
  // An admitted sequence's cached prefix is in place (resident, or its loads arrived): keep what is usable,
  // count the hit and make it running at the tail of running_.
  void start_running(SequenceState& seq);

  SchedulerConfig config_;
  std::unique_ptr<kvcache::KvCacheManager> cache_;
  std::unordered_map<SequenceId, SequenceState> sequences_;  // live ones: not yet reported as finished
  std::vector<SequenceId> running_;                          // admission order; the tail is preempted first
  std::deque<SequenceId> waiting_;                           // FCFS; preempted ones pushed at the front
  std::vector<SequenceId> loading_;                          // kLoadingKv, in admission order
  std::vector<SequenceId> newly_finished_;                   // to report in the next batch, in finish order
  int64_t num_prefix_query_tokens_ = 0;
  int64_t num_prefix_hit_tokens_ = 0;
  int64_t num_prefix_loaded_tokens_ = 0;
  int64_t num_prefix_query_blocks_ = 0;
  uint64_t last_step_ = 0;
  bool last_step_updated_ = true;
};

}  // namespace deepinfer::engine
