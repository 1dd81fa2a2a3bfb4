// Scheduler: running sequences first (decode tokens or their next prefill chunk), then FCFS admission from
// the waiting queue, within the token budget, the sequence cap and the free KV blocks; preemption by
// recompute of the most recently admitted sequence when a running one needs a block and none is free.
#include "deepinfer/core/check.h"
#include "deepinfer/engine/scheduler.h"

#include "deepinfer/engine/executor.h"

#include <algorithm>
#include <utility>

namespace deepinfer::engine {

using kvcache::blocks_for_tokens;

Status SchedulerConfig::validate() const {
  if (max_num_batched_tokens < 1) {
    return Status::invalid_argument("SchedulerConfig.max_num_batched_tokens must be >= 1, got " +
                                    std::to_string(max_num_batched_tokens));
  }
  if (max_num_seqs < 1) {
    return Status::invalid_argument("SchedulerConfig.max_num_seqs must be >= 1, got " + std::to_string(max_num_seqs));
  }
  if (num_blocks < 1) {
    return Status::invalid_argument("SchedulerConfig.num_blocks must be >= 1, got " + std::to_string(num_blocks));
  }
  if (num_lookahead_slots < 0) {
    return Status::invalid_argument("SchedulerConfig.num_lookahead_slots must be >= 0, got " +
                                    std::to_string(num_lookahead_slots));
  }
  return Status::ok_status();
}

int64_t ScheduledBatch::num_scheduled_tokens() const {
  int64_t total = 0;
  for (const ScheduledEntry& entry : entries) total += entry.num_tokens();
  return total;
}

int64_t ScheduledBatch::num_sampling_entries() const {
  return std::count_if(entries.begin(), entries.end(), [](const ScheduledEntry& entry) { return entry.samples; });
}

Result<Scheduler> Scheduler::create(const SchedulerConfig& config, std::unique_ptr<kvcache::KvCacheManager> cache) {
  if (Status status = config.validate(); !status.ok()) return status;
  if (cache == nullptr) {
    kvcache::KvCacheConfig device_only;
    device_only.num_device_blocks = config.num_blocks;
    device_only.enable_prefix_caching = config.enable_prefix_caching;
    Result<std::unique_ptr<kvcache::KvCacheManager>> created = kvcache::KvCacheManager::create(device_only);
    if (!created.ok()) return created.status();
    cache = std::move(created).value();
  }
  if (cache->pool().num_total() != config.num_blocks || cache->prefix_caching() != config.enable_prefix_caching) {
    return Status::invalid_argument("Scheduler::create: the KV cache has " + std::to_string(cache->pool().num_total()) +
                                    " blocks and prefix caching " + (cache->prefix_caching() ? "on" : "off") +
                                    "; the config says " + std::to_string(config.num_blocks) + " and " +
                                    (config.enable_prefix_caching ? "on" : "off"));
  }
  for (int slot = 0; slot < cache->num_window_pools(); ++slot) {
    const kvcache::CacheKindSpec& spec = cache->window_spec(slot);
    const int32_t need = min_window_blocks(config, spec.window_tokens);
    if (cache->window_pool(slot).num_total() < need) {
      return Status::invalid_argument("Scheduler::create: the window pool of cache kind '" + spec.name + "' has " +
                                      std::to_string(cache->window_pool(slot).num_total()) + " blocks; a " +
                                      std::to_string(spec.window_tokens) + "-token window with max_num_batched_tokens " +
                                      std::to_string(config.max_num_batched_tokens) + " needs at least " +
                                      std::to_string(need));
    }
  }
  return Scheduler(config, std::move(cache));
}

int32_t Scheduler::min_window_blocks(const SchedulerConfig& config, int32_t window_tokens) {
  return static_cast<int32_t>(blocks_for_tokens(window_tokens) +
                              blocks_for_tokens(int64_t{config.max_num_batched_tokens} + config.num_lookahead_slots) + 2);
}

Scheduler::Scheduler(const SchedulerConfig& config, std::unique_ptr<kvcache::KvCacheManager> cache)
    : config_(config), cache_(std::move(cache)) {}

SequenceState& Scheduler::state(SequenceId id) {
  auto it = sequences_.find(id);
  DEEPINFER_CHECK(it != sequences_.end());
  return it->second;
}

const SequenceState* Scheduler::find(SequenceId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

std::vector<SequenceId> Scheduler::running_ids() const { return running_; }

std::vector<SequenceId> Scheduler::waiting_ids() const { return {waiting_.begin(), waiting_.end()}; }

std::optional<std::string> Scheduler::why_never_schedulable(const SequenceState& seq) const {
  // All tokens up to the newest must be in the cache at once to compute the next one, and with every other
  // sequence preempted the whole pool is available: beyond that, waiting cannot help.
  int64_t blocks_needed = blocks_for_tokens(seq.num_tokens());
  if (blocks_needed > cache_->pool().num_total()) {
    return "sequence " + std::to_string(seq.id) + " needs " + std::to_string(blocks_needed) + " KV blocks for " +
           std::to_string(seq.num_tokens()) + " tokens (" + std::to_string(seq.num_prompt_tokens()) + " prompt + " +
           std::to_string(seq.num_generated_tokens()) + " generated) but the pool has " +
 std::to_string(cache_->pool().num_total()) + " blocks of " + std::to_string(kvcache::kBlockTokens) +
           " tokens; raise num_blocks or shorten the request";
  }
  int64_t uncomputed = seq.num_tokens() - seq.num_computed_tokens;
  if (!config_.enable_chunked_prefill && uncomputed > config_.max_num_batched_tokens) {
    return "sequence " + std::to_string(seq.id) + " must compute " + std::to_string(uncomputed) +
           " tokens in one step but max_num_batched_tokens is " + std::to_string(config_.max_num_batched_tokens) +
           " and chunked prefill is off; raise max_num_batched_tokens or enable chunked prefill";
  }
  return std::nullopt;
}

Status Scheduler::add(SequenceRequest request) {
  if (sequences_.contains(request.id)) {
    return Status::invalid_argument("Scheduler::add: sequence id " + std::to_string(request.id) + " is already live");
  }
  if (request.prompt_token_ids.empty()) {
    return Status::invalid_argument("Scheduler::add: sequence " + std::to_string(request.id) + " has an empty prompt");
  }
  if (request.max_tokens < 1) {
    return Status::invalid_argument("Scheduler::add: sequence " + std::to_string(request.id) + " has max_tokens " +
                                    std::to_string(request.max_tokens) + "; it must be >= 1");
  }
  SequenceState seq;
  seq.id = request.id;
  seq.prompt_token_ids = std::move(request.prompt_token_ids);
  seq.max_tokens = request.max_tokens;
  seq.stop_token_ids = std::move(request.stop_token_ids);
  seq.ttl_class = request.ttl_class;
  seq.block_hashes = std::move(request.block_hashes);
  seq.window_tables.resize(static_cast<size_t>(cache_->num_window_pools()));
  SequenceId id = seq.id;
  SequenceState& stored = sequences_.emplace(id, std::move(seq)).first->second;
  if (std::optional<std::string> reason = why_never_schedulable(stored)) {
    finish(stored, FinishReason::kAborted, std::move(*reason));
  } else {
    waiting_.push_back(stored.id);
  }
  return Status::ok_status();
}

Status Scheduler::cancel(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return Status::not_found("Scheduler::cancel: no live sequence " + std::to_string(id) +
                             " (never added, or its finish was already reported)");
  }
  SequenceState& seq = it->second;
  if (seq.is_finished()) return Status::ok_status();
  if (seq.status == SequenceStatus::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), id));
  } else if (seq.status == SequenceStatus::kLoadingKv) {
    loading_.erase(std::find(loading_.begin(), loading_.end(), id));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  finish(seq, FinishReason::kCancelled, "cancelled by the caller");
  return Status::ok_status();
}

void Scheduler::release_blocks(SequenceState& seq) {
  cache_->release_nodes(seq.cache_nodes);
  seq.cache_nodes.clear();
  truncate_blocks(seq, 0);
}

void Scheduler::truncate_blocks(SequenceState& seq, size_t keep) {
  for (size_t slot = 0; slot < seq.window_tables.size(); ++slot) {
    std::vector<kvcache::BlockId>& table = seq.window_tables[slot];
    for (size_t i = keep; i < table.size(); ++i) {
      if (table[i] != kvcache::kNoBlock) cache_->release_window(static_cast<int>(slot), table[i]);
    }
    if (table.size() > keep) table.resize(keep);
  }
  for (size_t i = keep; i < seq.block_table.size(); ++i) cache_->release(seq.block_table[i]);
  if (seq.block_table.size() > keep) seq.block_table.resize(keep);
  seq.num_window_released_blocks = std::min<int64_t>(seq.num_window_released_blocks, static_cast<int64_t>(keep));
}

void Scheduler::slide_windows(SequenceState& seq) {
  if (seq.window_tables.empty()) return;
  int64_t released = static_cast<int64_t>(seq.block_table.size());
  for (size_t slot = 0; slot < seq.window_tables.size(); ++slot) {
    const int64_t window = cache_->window_spec(static_cast<int>(slot)).window_tokens;
    // Block j is no longer read once its last position is before num_computed_tokens - window.
    const int64_t done = std::max<int64_t>(seq.num_computed_tokens - window, 0) / kvcache::kBlockTokens;
    std::vector<kvcache::BlockId>& table = seq.window_tables[slot];
    for (int64_t j = seq.num_window_released_blocks; j < done && j < static_cast<int64_t>(table.size()); ++j) {
      if (table[static_cast<size_t>(j)] == kvcache::kNoBlock) continue;
      cache_->release_window(static_cast<int>(slot), table[static_cast<size_t>(j)]);
      table[static_cast<size_t>(j)] = kvcache::kNoBlock;
    }
    released = std::min(released, done);
  }
  seq.num_window_released_blocks = std::max(seq.num_window_released_blocks, released);
}

void Scheduler::finish(SequenceState& seq, FinishReason reason, std::string message) {
  release_blocks(seq);
  seq.status = SequenceStatus::kFinished;
  seq.finish_reason = reason;
  seq.finish_message = std::move(message);
  newly_finished_.push_back(seq.id);
}

void Scheduler::preempt(SequenceState& seq) {
  release_blocks(seq);
  seq.num_computed_tokens = 0;
  seq.num_registered_blocks = 0;
  seq.status = SequenceStatus::kPreempted;
  ++seq.num_preemptions;
  waiting_.push_front(seq.id);
}

bool Scheduler::allocate_blocks(SequenceState& seq, int64_t end_position) {
  while (static_cast<int64_t>(seq.block_table.size()) < blocks_for_tokens(end_position)) {
    std::optional<kvcache::BlockId> block = cache_->allocate();
    if (!block.has_value()) return false;
    std::vector<kvcache::BlockId> windows;
    for (int slot = 0; slot < cache_->num_window_pools(); ++slot) {
      std::optional<kvcache::BlockId> window = cache_->allocate_window(slot);
      if (!window.has_value()) {
        for (int taken = 0; taken < slot; ++taken) cache_->release_window(taken, windows[static_cast<size_t>(taken)]);
        cache_->release(*block);
        return false;
      }
      windows.push_back(*window);
    }
    seq.block_table.push_back(*block);
    for (size_t slot = 0; slot < windows.size(); ++slot) seq.window_tables[slot].push_back(windows[slot]);
  }
  return true;
}

namespace {
std::vector<int32_t> all_tokens(const SequenceState& seq, int64_t count) {
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(count));
  for (int64_t position = 0; position < count; ++position) tokens.push_back(seq.token_at(position));
  return tokens;
}
}  // namespace

int64_t Scheduler::max_prefix_blocks(const SequenceState& seq) { return (seq.num_tokens() - 1) / kvcache::kBlockTokens; }

kvcache::KvCacheManager::PrefixMatch Scheduler::match_prefix(SequenceState& seq) {
  if (!config_.enable_prefix_caching) return {};
  // Never the block of the last token: at least that token is computed, so a token can be sampled.
  const int64_t max_blocks = max_prefix_blocks(seq);
  if (static_cast<int64_t>(seq.block_hashes.size()) < max_blocks) {
    std::vector<int32_t> tokens = all_tokens(seq, max_blocks * kvcache::kBlockTokens);
    kvcache::extend_block_hash_chain(seq.block_hashes, tokens, config_.fingerprint);
  }
  return cache_->match(std::span(seq.block_hashes).first(static_cast<size_t>(max_blocks)));
}

void Scheduler::register_computed_blocks(SequenceState& seq) {
  if (!config_.enable_prefix_caching) return;
  const int64_t full_blocks = seq.num_computed_tokens / kvcache::kBlockTokens;
  // After a bounded replay's step the replayed window's fresh window blocks join the cache (insert() attaches them
  // to the prefix's nodes), even when no new block completed.
  const bool rebuilt = std::exchange(seq.rebuild_window, false);
  if (full_blocks <= seq.num_registered_blocks && !rebuilt) return;
  // The tokens: for the hashes not yet computed, and for the KV events' BlockStored (only when they are on).
  const bool hashes_short = static_cast<int64_t>(seq.block_hashes.size()) < full_blocks;
  const std::vector<int32_t> tokens = hashes_short || cache_->publishes_events()
                                          ? all_tokens(seq, full_blocks * kvcache::kBlockTokens)
                                          : std::vector<int32_t>();
  if (hashes_short) {
    kvcache::extend_block_hash_chain(seq.block_hashes, tokens, config_.fingerprint);
  }
  // The whole chain again: the cache shares what it has, adds the rest, and pins each node once more; the
  // pins this sequence held before are then released, so it holds one per node.
  std::vector<kvcache::NodeId> nodes =
      cache_->insert(std::span(seq.block_hashes).first(static_cast<size_t>(full_blocks)), seq.block_table, tokens,
                     seq.ttl_class, seq.window_tables);
  cache_->release_nodes(seq.cache_nodes);
  seq.cache_nodes = std::move(nodes);
  seq.num_registered_blocks = full_blocks;
}

void Scheduler::start_running(SequenceState& seq) {
  // A failed load ends the usable prefix: the blocks after it are released and computed afresh.
  size_t usable = cache_->usable_prefix(seq.cache_nodes);
  if (!seq.window_tables.empty() && !cache_->bounded_replay()) {
    // The prefix's last window must hold every window kind (unless the executor replays it: bounded replay):
    // admit() handed out the window blocks of the admitted prefix's last window; a prefix shortened since (a
    // failed load) looks only at what it holds, so it may end earlier than the cache would allow (rare, and exact
    // either way).
    std::vector<bool> present;
    for (size_t i = 0; i < usable; ++i) {
      present.push_back(std::all_of(seq.window_tables.begin(), seq.window_tables.end(),
                                    [&](const std::vector<kvcache::BlockId>& table) {
                                      return i < table.size() && table[i] != kvcache::kNoBlock;
                                    }));
    }
    usable = static_cast<size_t>(cache_->layout().usable_blocks(present));
  }
  if (usable < seq.cache_nodes.size()) {
    cache_->release_nodes(std::span(seq.cache_nodes).subspan(usable));
    seq.cache_nodes.resize(usable);
  }
  truncate_blocks(seq, usable);
  seq.rebuild_window = false;
  if (!seq.window_tables.empty() && cache_->bounded_replay()) {
    // Where the prefix's last window lacks a window kind's block, the executor replays that window: it gets fresh
    // window blocks for all of it (never a cached one: the replayed rows are not the cached rows), which join the
    // cache with the next block this sequence registers - later hits on the prefix then restore instead of
    // replaying again. Admission counted these blocks (window_need).
    const size_t first = usable - std::min<size_t>(usable, static_cast<size_t>(cache_->layout().replay_blocks()));
    const bool missing = std::any_of(seq.window_tables.begin(), seq.window_tables.end(), [&](const auto& table) {
      for (size_t i = first; i < usable; ++i) {
        if (i >= table.size() || table[i] == kvcache::kNoBlock) return true;
      }
      return false;
    });
    seq.rebuild_window = missing;
    for (size_t slot = 0; missing && slot < seq.window_tables.size(); ++slot) {
      std::vector<kvcache::BlockId>& table = seq.window_tables[slot];
      if (table.size() < usable) table.resize(usable, kvcache::kNoBlock);
      for (size_t i = first; i < usable; ++i) {
        if (table[i] != kvcache::kNoBlock) cache_->release_window(static_cast<int>(slot), table[i]);
        std::optional<kvcache::BlockId> fresh = cache_->allocate_window(static_cast<int>(slot));
        table[i] = fresh.value_or(kvcache::kNoBlock);
      }
    }
  }
  const int64_t matched_blocks = static_cast<int64_t>(usable);
  const int64_t loaded_blocks = std::max<int64_t>(matched_blocks - seq.num_resident_prefix_blocks, 0);
  const int64_t num_matched_tokens = matched_blocks * kvcache::kBlockTokens;
  if (seq.num_preemptions == 0) {  // first admission (a sequence is admitted again only after a preemption)
    seq.num_cached_tokens = num_matched_tokens;
    seq.num_loaded_tokens = loaded_blocks * kvcache::kBlockTokens;
  }
  num_prefix_query_tokens_ += seq.num_tokens();
  num_prefix_query_blocks_ += max_prefix_blocks(seq);
  num_prefix_hit_tokens_ += num_matched_tokens;
  num_prefix_loaded_tokens_ += loaded_blocks * kvcache::kBlockTokens;
  seq.num_computed_tokens = num_matched_tokens;
  seq.num_registered_blocks = matched_blocks;
  seq.status = SequenceStatus::kRunning;
  running_.push_back(seq.id);
}

ScheduledEntry Scheduler::make_entry(const SequenceState& seq, int64_t num_new_tokens) const {
  ScheduledEntry entry;
  entry.sequence_id = seq.id;
  entry.start_position = seq.num_computed_tokens;
  entry.token_ids.reserve(static_cast<size_t>(num_new_tokens));
  for (int64_t position = entry.start_position; position < entry.start_position + num_new_tokens; ++position) {
    entry.token_ids.push_back(seq.token_at(position));
  }
  entry.block_table = seq.block_table;
  entry.window_block_tables = seq.window_tables;
  entry.rebuild_window = seq.rebuild_window;
  entry.samples = entry.end_position() == seq.num_tokens();
  return entry;
}

ScheduledBatch Scheduler::schedule() {
  ScheduledBatch batch;
  batch.step = ++last_step_;
  last_step_updated_ = false;
  int64_t budget = config_.max_num_batched_tokens;

  // 0. Loads that arrived: their sequences run from this step on (at the tail of the running ones).
  cache_->tick();
  for (size_t i = 0; i < loading_.size();) {
    SequenceState& seq = state(loading_[i]);
    if (cache_->loading(seq.cache_nodes)) {
      ++i;
      continue;
    }
    loading_.erase(loading_.begin() + static_cast<std::ptrdiff_t>(i));
    start_running(seq);
  }

  // 1. Running sequences, in admission order: one decode token, or the next prefill chunk.
  size_t index = 0;
  while (index < running_.size() && budget > 0) {
    SequenceState& seq = state(running_[index]);
    if (std::optional<std::string> reason = why_never_schedulable(seq)) {
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
      finish(seq, FinishReason::kAborted, std::move(*reason));
      continue;
    }
    int64_t num_new_tokens = seq.num_tokens() - seq.num_computed_tokens;
    DEEPINFER_CHECK(num_new_tokens >= 1, "a running sequence always has a token to compute");
    if (!config_.enable_chunked_prefill && num_new_tokens > budget) {
      ++index;  // only after an abandoned batch: its whole prompt waits for a step with room
      continue;
    }
    num_new_tokens = std::min(num_new_tokens, budget);
    int64_t end_position = seq.num_computed_tokens + num_new_tokens;
    int64_t blocks_needed = blocks_for_tokens(end_position) - static_cast<int64_t>(seq.block_table.size());
    bool preempted_itself = false;
    // num_free_blocks() counts cached blocks no sequence uses as free; one the cache cannot evict right now (a
    // copy out of it still running, a block another sequence's failed load left pinned) makes the allocation
    // fall short of the count: then preempt as when the count itself is short.
    while (blocks_needed > cache_->num_free_blocks() || !allocate_blocks(seq, end_position)) {
      // The tail was admitted last. It is never one scheduled earlier in this loop (those sit before
      // `index`), and it is `seq` itself only when everything after `seq` is gone; `seq` at index 0 always
      // fits, since why_never_schedulable() bounds its need by the whole pool.
      SequenceState& victim = state(running_.back());
      running_.pop_back();
      preempt(victim);
      batch.preempted.push_back(victim.id);
      if (victim.id == seq.id) {
        preempted_itself = true;
        break;
      }
    }
    if (preempted_itself) break;
    // Lookahead slots for drafts: within the budget, max_tokens and the blocks free now (never preempting).
    int64_t lookahead = 0;
    if (config_.num_lookahead_slots > 0 && end_position == seq.num_tokens()) {
      lookahead = std::min<int64_t>({config_.num_lookahead_slots, budget - num_new_tokens,
                                     seq.max_tokens - seq.num_generated_tokens() - 1});
      while (lookahead > 0 && blocks_for_tokens(end_position + lookahead) -
                                      static_cast<int64_t>(seq.block_table.size()) > cache_->num_free_blocks()) {
        --lookahead;
      }
      lookahead = std::max<int64_t>(lookahead, 0);
    }
    if (lookahead > 0 && !allocate_blocks(seq, end_position + lookahead)) {
      // Fewer lookahead slots than counted: as many as the blocks it got cover.
      lookahead = std::max<int64_t>(
          static_cast<int64_t>(seq.block_table.size()) * kvcache::kBlockTokens - end_position, 0);
      lookahead = std::min<int64_t>(lookahead, config_.num_lookahead_slots);
    }
    batch.entries.push_back(make_entry(seq, num_new_tokens));
    batch.entries.back().num_lookahead_slots = static_cast<int32_t>(lookahead);
    budget -= num_new_tokens + lookahead;
    ++index;
  }

  // 2. Admission, FCFS, unless this step preempted (the blocks just freed go to the running ones first;
  // admitting now would only thrash).
  if (batch.preempted.empty()) {
    while (!waiting_.empty() && budget > 0 && num_running() + num_loading() < config_.max_num_seqs) {
      SequenceState& seq = state(waiting_.front());
      if (std::optional<std::string> reason = why_never_schedulable(seq)) {
        waiting_.pop_front();
        finish(seq, FinishReason::kAborted, std::move(*reason));
        continue;
      }
      DEEPINFER_CHECK(seq.block_table.empty() && seq.num_computed_tokens == 0 && seq.cache_nodes.empty());
      const kvcache::KvCacheManager::PrefixMatch match = match_prefix(seq);
      // Blocks found below the device are loaded into fresh blocks before the sequence computes anything.
      const int64_t matched_blocks = match.device_blocks + match.lower_blocks;
      int64_t num_matched_tokens = matched_blocks * kvcache::kBlockTokens;
      int64_t num_new_tokens = seq.num_tokens() - num_matched_tokens;
      if (!config_.enable_chunked_prefill && num_new_tokens > budget) break;
      num_new_tokens = std::min(num_new_tokens, budget);
      int64_t end_position = num_matched_tokens + num_new_tokens;
      // Reviving a matched block no sequence uses takes it from the free blocks too.
      if (blocks_for_tokens(end_position) - match.device_blocks + match.device_free_blocks >
          cache_->num_free_blocks()) {
        break;  // FCFS: nobody overtakes the head of the queue
      }
      // The window kinds' blocks: one per new block, and the prefix's last window revived.
      const int64_t window_need = blocks_for_tokens(end_position) - matched_blocks +
                                  std::min<int64_t>(cache_->layout().replay_blocks(), matched_blocks);
      bool windows_short = false;
      for (int slot = 0; slot < cache_->num_window_pools(); ++slot) {
        windows_short = windows_short || window_need > cache_->window_pool(slot).num_free();
      }
      if (windows_short) break;
      waiting_.pop_front();
      const int64_t max_blocks = max_prefix_blocks(seq);
      kvcache::KvCacheManager::Admission admission;
      if (config_.enable_prefix_caching && max_blocks > 0) {
        admission = cache_->admit(std::span(seq.block_hashes).first(static_cast<size_t>(max_blocks)),
                                  cache_->publishes_events() ? all_tokens(seq, max_blocks * kvcache::kBlockTokens)
                                                             : std::vector<int32_t>(),
                                  seq.num_tokens(),
                                  seq.ttl_class);
      }
      seq.block_table = std::move(admission.blocks);
      seq.cache_nodes = std::move(admission.nodes);
      if (!admission.window_blocks.empty()) seq.window_tables = std::move(admission.window_blocks);
      for (std::vector<kvcache::BlockId>& table : seq.window_tables) table.resize(seq.block_table.size(), kvcache::kNoBlock);
      seq.num_window_released_blocks = 0;
      seq.num_resident_prefix_blocks = static_cast<int64_t>(seq.cache_nodes.size()) - admission.loaded_blocks;
      if (cache_->loading(seq.cache_nodes)) {
        seq.status = SequenceStatus::kLoadingKv;  // scheduled once its blocks arrived; the others step on
        loading_.push_back(seq.id);
        continue;
      }
      start_running(seq);
      num_matched_tokens = seq.num_computed_tokens;
      num_new_tokens = std::min(seq.num_tokens() - num_matched_tokens, budget);
      end_position = num_matched_tokens + num_new_tokens;
      // Counted, but not all allocatable now (see the running loop): it runs, and computes from the next
      // step, when the running loop can preempt for it; nobody is admitted after it (FCFS).
      if (!allocate_blocks(seq, end_position)) break;
      batch.entries.push_back(make_entry(seq, num_new_tokens));
      budget -= num_new_tokens;
    }
  }

  // 3. Report and forget the finished ones.
  for (SequenceId id : newly_finished_) {
    auto it = sequences_.find(id);
    DEEPINFER_CHECK(it != sequences_.end());
    const SequenceState& seq = it->second;
    batch.finished.push_back({id, seq.finish_reason, seq.finish_message, seq.num_prompt_tokens(),
                              seq.num_generated_tokens(), seq.num_cached_tokens, seq.num_loaded_tokens});
    sequences_.erase(it);
  }
  newly_finished_.clear();
  return batch;
}

StepOutput StepOutput::one_token_per_sampling_entry(const ScheduledBatch& batch, std::span<const TokenId> token_ids) {
  StepOutput out;
  out.entries.resize(batch.entries.size());
  size_t next = 0;
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    if (batch.entries[i].samples && next < token_ids.size()) out.entries[i].push_back({token_ids[next++], {}, {}});
  }
  return out;
}

Status Scheduler::update(const ScheduledBatch& batch, std::span<const TokenId> sampled_token_ids) {
  const int64_t num_sampling = batch.num_sampling_entries();
  if (static_cast<int64_t>(sampled_token_ids.size()) != num_sampling) {
    return Status::invalid_argument("Scheduler::update: step " + std::to_string(batch.step) + " has " +
                                    std::to_string(num_sampling) + " sampling entries but " +
                                    std::to_string(sampled_token_ids.size()) + " sampled tokens were given");
  }
  StepOutput out = StepOutput::one_token_per_sampling_entry(batch, sampled_token_ids);
  return update(batch, out);
}

Status Scheduler::update(const ScheduledBatch& batch, StepOutput& out) {
  if (batch.step != last_step_ || last_step_updated_) {
    return Status::invalid_argument("Scheduler::update: batch of step " + std::to_string(batch.step) +
                                    " is not the latest un-updated one (latest step " + std::to_string(last_step_) +
                                    (last_step_updated_ ? ", already updated)" : ")"));
  }
  if (out.entries.size() != batch.entries.size()) {
    return Status::invalid_argument("Scheduler::update: step " + std::to_string(batch.step) + " has " +
                                    std::to_string(batch.entries.size()) + " entries but the output has " +
                                    std::to_string(out.entries.size()));
  }
  // Check everything before changing anything.
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    const size_t produced = out.entries[i].size();
    const size_t most = entry.samples ? 1 + static_cast<size_t>(entry.num_lookahead_slots) : 0;
    if (produced > most || (entry.samples && produced == 0)) {
      return Status::invalid_argument("Scheduler::update: step " + std::to_string(batch.step) + " entry of sequence " +
                                      std::to_string(entry.sequence_id) + " got " + std::to_string(produced) +
                                      " tokens; it takes " + (entry.samples ? "1.." + std::to_string(most) : "none"));
    }
    auto it = sequences_.find(entry.sequence_id);
    if (it == sequences_.end()) {
      return Status::internal("Scheduler::update: step " + std::to_string(batch.step) + " names sequence " +
                              std::to_string(entry.sequence_id) + ", which is not live");
    }
    const SequenceState& seq = it->second;
    if (seq.is_finished()) continue;  // cancelled after schedule(): skipped below
    if (seq.status != SequenceStatus::kRunning || entry.start_position != seq.num_computed_tokens ||
        entry.num_tokens() < 1 || entry.end_position() > seq.num_tokens() ||
        entry.samples != (entry.end_position() == seq.num_tokens())) {
      return Status::internal(
          "Scheduler::update: step " + std::to_string(batch.step) + " entry of sequence " + std::to_string(seq.id) +
          " (positions " + std::to_string(entry.start_position) + ".." + std::to_string(entry.end_position()) +
          ") disagrees with its state (" + std::string(sequence_status_name(seq.status)) + ", " +
          std::to_string(seq.num_computed_tokens) + " computed of " + std::to_string(seq.num_tokens()) + ")");
    }
  }
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    std::vector<SampledToken>& tokens = out.entries[i];
    SequenceState& seq = state(entry.sequence_id);
    if (seq.is_finished()) {
      tokens.clear();  // cancelled since schedule(): its tokens are dropped
      continue;
    }
    // tokens[j] for j < size - 1 are accepted drafts: their KV sits at end_position() + j.
    seq.num_computed_tokens = entry.end_position();
    size_t kept = 0;
    bool finished = false;
    FinishReason reason = FinishReason::kNone;
    while (kept < tokens.size()) {
      const TokenId token = tokens[kept].token_id;
      seq.generated_token_ids.push_back(token);
      ++kept;
      if (kept < tokens.size()) ++seq.num_computed_tokens;
      const bool is_stop =
          std::find(seq.stop_token_ids.begin(), seq.stop_token_ids.end(), token) != seq.stop_token_ids.end();
      if (is_stop || seq.num_generated_tokens() >= seq.max_tokens) {
        finished = true;
        reason = is_stop ? FinishReason::kStop : FinishReason::kLength;
        break;
      }
    }
    tokens.resize(kept);  // tokens after a finish are dropped
    // Roll back the lookahead: blocks wholly past the computed tokens held only rejected drafts' KV (the
    // slots of rejected drafts inside the last kept block are simply overwritten by later steps).
    const int64_t keep_blocks = blocks_for_tokens(seq.num_computed_tokens);
    for (int64_t i = keep_blocks; i < static_cast<int64_t>(seq.block_table.size()); ++i) {
      DEEPINFER_CHECK(cache_->pool().ref_count(seq.block_table[static_cast<size_t>(i)]) == 1,
                      "a lookahead block is owned by its sequence alone");
    }
    truncate_blocks(seq, static_cast<size_t>(std::min<int64_t>(keep_blocks, static_cast<int64_t>(seq.block_table.size()))));
    register_computed_blocks(seq);
    slide_windows(seq);
    if (finished) {
      running_.erase(std::find(running_.begin(), running_.end(), seq.id));
      finish(seq, reason, "");
    }
  }
  last_step_updated_ = true;
  return Status::ok_status();
}

}  // namespace deepinfer::engine
