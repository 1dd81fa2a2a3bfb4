// The DeepSeek-V4 executor: one forward pass of DeepSeekV4Model over a ScheduledBatch, then sampling on host threads
// (RequestSampling, as the V2/V3 executor). The V4 cache is per sequence, inside the model's V4Sequence (the
// window rings, compressed entries and compressor state), kept here per request: the scheduler's block tables
// only account for its memory. So a sequence must resume where its V4Sequence ends: a recompute from position 0
// (preemption) starts a fresh one; a prefix-cache hit or imported KV cannot be honoured (the engine refuses both
// for V4). No lookahead (no speculative decoding on V4 yet).
#pragma once

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "deepinfer/engine/executor.h"
#include "deepinfer/model/deepseek_v4.h"
#include "model_executor.h"

namespace deepinfer::engine {

class V4Executor final : public Executor {
 public:
  // `model` is not owned and must outlive the executor. Sampling threads as RequestSampling.
  V4Executor(model::DeepSeekV4Model& model, int32_t sampling_threads, int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override;
  void remove_request(SequenceId id) override;
  // Errors: InvalidArgument (lookahead slots), Internal (a sequence resuming past or before its V4 cache, an
  // unknown request), the model's.
  Result<StepOutput> run(const ScheduledBatch& batch) override;

 private:
  model::DeepSeekV4Model& model_;
  RequestSampling sampling_;
  std::map<SequenceId, std::unique_ptr<model::V4Sequence>> sequences_;
  std::vector<float> logits_;
};

}  // namespace deepinfer::engine
