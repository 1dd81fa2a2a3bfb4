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

// The per-request sampling state every executor keeps (parameters, RNG stream, prompt and generated tokens for
// penalties) and the host-thread sampling of a step's logits rows. Used by the executors of both model families.
class RequestSampling {
 public:
  // sampling_threads: 1..16 Samplers; parallel_sampling_min_logits: rows x vocab from which a step's rows are
  // split over them.
  RequestSampling(int64_t vocab_size, int32_t sampling_threads, int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params);
  void remove_request(SequenceId id);
  bool contains(SequenceId id) const { return requests_.contains(id); }
  bool is_plain_greedy(SequenceId id) const { return requests_.at(id).params.is_plain_greedy(); }
  // The request's row's parameters where the logits are (Backend::read_sampled_tokens: seed, the counter of its next
  // token, the logprobs asked for), and its logit_bias and penalties as adjustments of logits row `row` (appended
  // to `out`: the host Sampler's process_logits per token).
  backend::Backend::DeviceSampling device_row(SequenceId id) const;
  void device_adjustments(SequenceId id, int32_t row, std::vector<backend::Backend::LogitAdjustment>& out) const;
  // Whether every sampling entry of `batch` is plain greedy (the backend's argmax ids are then its tokens).
  bool all_plain_greedy(const ScheduledBatch& batch) const;
  // The sampling entries' device_row()s and device_adjustments(), in entry order (Backend::read_sampled_tokens).
  void device_inputs(const ScheduledBatch& batch, std::vector<backend::Backend::DeviceSampling>& rows,
                     std::vector<backend::Backend::LogitAdjustment>& adjustments) const;
  // out.entries from the backend's ids for the sampling entries (entry order) and, where `rows` asked for them, the
  // logprobs. InvalidArgument for a row the backend marked -1 (NaN or +inf, or nothing above -inf), as the sampler.
  Status take_device_tokens(const ScheduledBatch& batch, std::span<const int32_t> ids,
                            std::span<const backend::Backend::DeviceSampling> rows,
                            std::span<const backend::Backend::SampledLogprobs> logprobs, StepOutput& out) const;
  // Samples one token per sampling entry of `batch` from `logits` (float32 [sampling entries][vocab], in entry
  // order) into out.entries. All-or-nothing: a bad row (NaN, nothing finite) fails the call, nothing sampled.
  Status sample(const ScheduledBatch& batch, std::span<const float> logits, StepOutput& out);
  // After a step's tokens are final: the RNG streams advance (`count_greedy`: also for entries the caller
  // picked the argmax for, as the sampler does for every row) and the tokens join the penalty windows.
  void commit(const ScheduledBatch& batch, const StepOutput& out, bool count_greedy);

 private:
  struct RequestState {
    std::vector<TokenId> prompt;
    std::vector<TokenId> output;
    SamplingParams params;
    RequestRng rng;
  };
  Status sample_rows(std::span<const SamplerRow> rows, std::span<SampledToken> sampled);

  int64_t parallel_sampling_min_logits_;
  std::vector<Sampler> samplers_;  // one per sampling thread (a Sampler keeps per-row scratch)
  std::map<SequenceId, RequestState> requests_;
};

class ModelExecutor final : public Executor {
 public:
  // `model` and `layer_caches` (per layer [num_blocks, 64, kv_cache_dim]) are not owned and must outlive
  // the executor. Sampling threads as RequestSampling.
  ModelExecutor(model::DeepSeekModel& model, std::span<const backend::Buffer> layer_caches, int32_t sampling_threads,
                int64_t parallel_sampling_min_logits);

  Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) override {
    return sampling_.add_request(id, prompt_token_ids, params);
  }
  void remove_request(SequenceId id) override { sampling_.remove_request(id); }
  Result<StepOutput> run(const ScheduledBatch& batch) override;

 private:
  model::DeepSeekModel& model_;
  std::span<const backend::Buffer> layer_caches_;
  RequestSampling sampling_;
  std::vector<float> logits_;
  std::vector<int32_t> greedy_ids_;  // forward_greedy's or forward_sampled's ids
  std::vector<backend::Backend::SampledLogprobs> device_logprobs_;  // forward_sampled's
  std::vector<backend::Backend::DeviceSampling> device_rows_;
  std::vector<backend::Backend::LogitAdjustment> device_adjustments_;
};

}  // namespace deepinfer::engine
