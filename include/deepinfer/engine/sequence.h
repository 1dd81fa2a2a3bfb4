// A request as the scheduler sees it: token ids in, token ids out, and where its KV lives. No text, no
// sampling parameters beyond what decides when it ends (those belong to the sampler).
#pragma once

#include "deepinfer/core/types.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/kvcache/prefix_index.h"

namespace deepinfer::engine {

using ::deepinfer::TokenId;  // core/types.h
using SequenceId = int64_t;  // chosen by the caller, unique among the scheduler's live sequences

enum class SequenceStatus {
  kWaiting,    // in the waiting queue, never admitted; holds no blocks
  kRunning,    // admitted; holds blocks for its num_computed_tokens (and this step's tokens once scheduled)
  kLoadingKv,  // admitted; its cached prefix's blocks are being loaded from host or disk; computes nothing yet
  kPreempted,  // was running, released its blocks, back in the waiting queue to recompute from token 0
  kFinished,   // done; holds no blocks; reported once in a ScheduledBatch, then forgotten
};

enum class FinishReason {
  kNone,       // not finished
  kStop,       // sampled one of stop_token_ids (the stop token is the last generated token)
  kLength,     // generated max_tokens tokens
  kCancelled,  // Scheduler::cancel
  kAborted,    // can never be scheduled (message says why, e.g. it needs more KV blocks than the pool has)
};

constexpr std::string_view sequence_status_name(SequenceStatus status) {
  switch (status) {
    case SequenceStatus::kWaiting:
      return "waiting";
    case SequenceStatus::kRunning:
      return "running";
    case SequenceStatus::kLoadingKv:
      return "loading_kv";
    case SequenceStatus::kPreempted:
      return "preempted";
    case SequenceStatus::kFinished:
      return "finished";
  }
  return "unknown";
}

constexpr std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

// What the engine submits.
struct SequenceRequest {
  SequenceId id = 0;
  std::vector<TokenId> prompt_token_ids;  // REQUIRES: not empty
  int64_t max_tokens = 0;                 // REQUIRES: >= 1; generated tokens at most, a stop token included
  std::vector<TokenId> stop_token_ids;    // sampling any of these finishes the sequence with kStop
  kvcache::TtlClassId ttl_class = kvcache::kDefaultTtlClass;  // retention class of its cached blocks
  // Optional: the chained hashes of the prompt's leading full blocks, when the caller already computed them
  // (under the scheduler's fingerprint). REQUIRES: a prefix of block_hash_chain(prompt_token_ids, fingerprint).
  std::vector<kvcache::BlockHash> block_hashes;
};

// One sequence's state, owned and mutated only by the Scheduler; read through Scheduler::find().
// Its tokens are prompt_token_ids followed by generated_token_ids, at positions 0 .. num_tokens() - 1.
struct SequenceState {
  SequenceId id = 0;
  std::vector<TokenId> prompt_token_ids;
  std::vector<TokenId> generated_token_ids;
  int64_t max_tokens = 0;
  std::vector<TokenId> stop_token_ids;
  kvcache::TtlClassId ttl_class = kvcache::kDefaultTtlClass;

  SequenceStatus status = SequenceStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  std::string finish_message;  // for kAborted (and kCancelled): why, in words a user can act on

  // Tokens [0, num_computed_tokens) have their KV in the blocks of block_table. Reset to 0 on preemption.
  int64_t num_computed_tokens = 0;
  // block_table[i] holds the KV of positions [i * kBlockTokens, (i + 1) * kBlockTokens).
  std::vector<kvcache::BlockId> block_table;
  // Per window pool of the cache (KvCacheManager::window_pool, slot order), indexed like block_table: the
  // sliding-window kind's block of each block of the last window (and of this step's tokens), kNoBlock for
  // the blocks before it, whose window blocks were let go. Blocks [0, num_window_released_blocks) hold none.
  std::vector<std::vector<kvcache::BlockId>> window_tables;
  int64_t num_window_released_blocks = 0;
  // Bounded replay: at its last admission the prefix's last window lacked window blocks; it got fresh ones
  // (Scheduler::start_running) that the executor fills by replaying that window.
  bool rebuild_window = false;
  int32_t num_preemptions = 0;
  // Prefix caching: the chained hashes of the sequence's full blocks computed so far (a prefix of the chain
  // of its tokens), and how many of its leading blocks were offered to the prefix index.
  std::vector<kvcache::BlockHash> block_hashes;
  int64_t num_registered_blocks = 0;
  // The prefix cache's nodes of the blocks in block_table it caches (leading ones), each pinned once by this
  // sequence; and, at admission, how many of them were resident on device (the rest were loaded).
  std::vector<kvcache::NodeId> cache_nodes;
  int64_t num_resident_prefix_blocks = 0;
  // Prompt tokens whose KV came from the prefix cache at first admission (a multiple of kBlockTokens), and
  // of those, the ones loaded from a tier below the device.
  int64_t num_cached_tokens = 0;
  int64_t num_loaded_tokens = 0;

  int64_t num_prompt_tokens() const { return static_cast<int64_t>(prompt_token_ids.size()); }
  int64_t num_generated_tokens() const { return static_cast<int64_t>(generated_token_ids.size()); }
  int64_t num_tokens() const { return num_prompt_tokens() + num_generated_tokens(); }
  // REQUIRES: 0 <= position < num_tokens().
  TokenId token_at(int64_t position) const {
    return position < num_prompt_tokens() ? prompt_token_ids[static_cast<size_t>(position)]
                                          : generated_token_ids[static_cast<size_t>(position - num_prompt_tokens())];
  }
  bool is_finished() const { return status == SequenceStatus::kFinished; }
};

}  // namespace deepinfer::engine
