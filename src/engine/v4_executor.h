// The DeepSeek-V4 executor: one forward pass of DeepSeekV4Model over a ScheduledBatch, then sampling on host threads
// (RequestSampling, as the V2/V3 executor). A running sequence's cache is its V4Sequence (window rings, compressed
// entries, compressor state), kept here per request; every 64-token block a step finishes is also written: its block
// payload into that block of the paged cache (entry.block_table: what the prefix cache keeps, moves to the tiers and
// shares) and its raw window rows into its block of the window pool (entry.window_block_tables[0]: the device only,
// kept by the cache for the last window of cached prefixes). A sequence that resumes elsewhere than where its
// V4Sequence ends (a prefix-cache hit at admission, a recompute after preemption) is restored from its blocks'
// payloads and the window pool's blocks of its last window (exact); where those are gone (evicted, or the prefix came
// from the host or disk tier) and bounded replay is on, the last sliding_window tokens are replayed first, in this
// step (DeepSeekV4Model::restore; a prefix of at most one window is simply fed again from position 0, exactly).
// No lookahead (no speculative decoding on V4 yet).
#pragma once

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/model/deepseek_v4.h"
#include "model_executor.h"

namespace deepinfer::engine {

class V4Executor final : public Executor {
 public:
  // `model`, `blocks` and `windows` (the model's backend memory: block b at b * block_bytes, window block w at
  // w * window_bytes) are not owned and must outlive the executor. Sampling threads as RequestSampling.
  V4Executor(model::DeepSeekV4Model& model, const backend::Buffer& blocks, size_t block_bytes,
             const backend::Buffer& windows, size_t window_bytes, int32_t sampling_threads,
             int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override;
  void remove_request(SequenceId id) override;
  // Errors: InvalidArgument (lookahead slots), Internal (a sequence resuming past or before its V4 cache, or where
  // neither its last window's rows nor a bounded replay can restore it; an unknown request), the model's.
  Result<StepOutput> run(const ScheduledBatch& batch) override;

  // Tokens replayed (bounded replay) and fed again from position 0 (a restore of at most one window without its
  // rows) since creation: the recompute a restore cost beyond the scheduled tokens.
  int64_t replayed_tokens() const { return replayed_tokens_; }
  // The tokens request `id`'s last restore recomputed (0: none, or restored exactly): its cached tokens less these
  // were really not computed.
  int64_t replayed_tokens(SequenceId id) const {
    auto it = last_replayed_.find(id);
    return it == last_replayed_.end() ? 0 : it->second;
  }

 private:
  float* block(kvcache::BlockId id) const {
    return reinterpret_cast<float*>(static_cast<char*>(blocks_.data()) + static_cast<size_t>(id) * block_bytes_);
  }
  // The window payload of `entry`'s block `index` (its block of the window pool), or null where it has none.
  float* window(const ScheduledEntry& entry, int64_t index) const {
    if (entry.window_block_tables.empty()) return nullptr;
    const std::vector<kvcache::BlockId>& table = entry.window_block_tables[0];
    if (index >= static_cast<int64_t>(table.size()) || table[static_cast<size_t>(index)] == kvcache::kNoBlock) {
      return nullptr;
    }
    return reinterpret_cast<float*>(static_cast<char*>(windows_.data()) +
                                    static_cast<size_t>(table[static_cast<size_t>(index)]) * window_bytes_);
  }
  // Restores sequence `entry.sequence_id` at entry.start_position (see the class comment); `replay` gets the chunk
  // to run first when it must be replayed or fed again, writing the window payloads of the blocks it finishes into
  // the entry's window blocks there (fresh ones the scheduler gave it: the rows then join the cache); `pointers`
  // keeps the chunk's payload pointer lists (two per replay).
  Status restore(const ScheduledEntry& entry, std::unique_ptr<model::V4Sequence>& sequence,
                 std::vector<model::DeepSeekV4Model::Chunk>& replay, std::vector<std::vector<float*>>& pointers);

  model::DeepSeekV4Model& model_;
  const backend::Buffer& blocks_;
  size_t block_bytes_;
  const backend::Buffer& windows_;
  size_t window_bytes_;
  RequestSampling sampling_;
  std::vector<int32_t> ids_;  // forward_on_device's
  std::vector<backend::Backend::DeviceSampling> device_rows_;
  std::vector<backend::Backend::LogitAdjustment> device_adjustments_;
  std::vector<backend::Backend::SampledLogprobs> device_logprobs_;
  std::map<SequenceId, std::unique_ptr<model::V4Sequence>> sequences_;
  std::map<SequenceId, std::vector<TokenId>> tokens_;  // per request: every token fed so far (replays read them)
  int64_t replayed_tokens_ = 0;
  std::map<SequenceId, int64_t> last_replayed_;
  // Where a prefix fed again from 0 writes its block payloads (the model's backend memory, window_blocks() payloads),
  // allocated on first use.
  backend::Buffer scratch_;
  std::vector<float> logits_;
};

}  // namespace deepinfer::engine
