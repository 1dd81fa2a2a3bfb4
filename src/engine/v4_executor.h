// The DeepSeek-V4 executor: one forward pass of DeepSeekV4Model over a ScheduledBatch, then sampling on host threads
// (RequestSampling, as the V2/V3 executor). A running sequence's cache is its V4Sequence (window rings, compressed
// entries, compressor state), kept here per request; every 64-token block a step finishes is also written as a
// block payload into that block of the paged cache (entry.block_table), which is what the prefix cache keeps, moves
// to the tiers and shares. A sequence that resumes elsewhere than where its V4Sequence ends (a prefix-cache hit at
// admission, a recompute after preemption) is restored from its blocks' payloads (from position 0: a fresh one).
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
  // `model` and `blocks` (host memory: the CPU backend's; block b at b * block_bytes) are not owned and must
  // outlive the executor. Sampling threads as RequestSampling.
  V4Executor(model::DeepSeekV4Model& model, const backend::Buffer& blocks, size_t block_bytes, int32_t sampling_threads,
             int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override;
  void remove_request(SequenceId id) override;
  // Errors: InvalidArgument (lookahead slots), Internal (a sequence resuming past or before its V4 cache, an
  // unknown request), the model's.
  Result<StepOutput> run(const ScheduledBatch& batch) override;

 private:
  float* block(kvcache::BlockId id) const {
    return reinterpret_cast<float*>(static_cast<char*>(blocks_.data()) + static_cast<size_t>(id) * block_bytes_);
  }

  model::DeepSeekV4Model& model_;
  const backend::Buffer& blocks_;
  size_t block_bytes_;
  RequestSampling sampling_;
  std::map<SequenceId, std::unique_ptr<model::V4Sequence>> sequences_;
  std::vector<float> logits_;
};

}  // namespace deepinfer::engine
