// The model executor: one forward pass of the DeepSeek model over a ScheduledBatch on its backend, then
// sampling of the rows that produce a token (on the backend for plain greedy steps, else on host threads).
// It owns the per-request sampling state (parameters, RNG stream, generated tokens for penalties). It does
// not schedule lookahead: a batch with lookahead slots is refused (the draft-and-verify executor fills them).
#pragma once

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/model/deepseek_model.h"

namespace deepinfer::engine {

class ModelExecutor final : public Executor {
 public:
  // `model` and `layer_caches` (per layer [num_blocks, 64, kv_cache_dim]) are not owned and must outlive
  // the executor. sampling_threads: 1..16 Samplers; parallel_sampling_min_logits: rows x vocab from which a
  // step's rows are split over them.
  ModelExecutor(model::DeepSeekModel& model, std::span<const backend::Buffer> layer_caches, int32_t sampling_threads,
                int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override;
  void remove_request(SequenceId id) override;
  Result<StepOutput> run(const ScheduledBatch& batch) override;

 private:
  struct RequestState {
    std::vector<TokenId> prompt;
    std::vector<TokenId> output;
    SamplingParams params;
    RequestRng rng;
  };
  Status sample_rows(std::span<const SamplerRow> rows, std::span<SampledToken> sampled);

  model::DeepSeekModel& model_;
  std::span<const backend::Buffer> layer_caches_;
  int64_t parallel_sampling_min_logits_;
  std::vector<Sampler> samplers_;  // one per sampling thread (a Sampler keeps per-row scratch)
  std::map<SequenceId, RequestState> requests_;
  std::vector<float> logits_;
  std::vector<int32_t> greedy_ids_;
};

}  // namespace deepinfer::engine
