// The engine: requests in, token events out. Each step reads in three lines (nano-vllm's LLMEngine.step):
//   batch = scheduler_.schedule(); out = executor.run(batch); scheduler_.update(batch, out);
// where the executor turns the scheduled chunks into one forward pass over the paged latent KV cache and
// samples the rows that produce a token.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/sampling_params.h"
#include "deepinfer/engine/scheduler.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/model/deepseek_model.h"

namespace deepinfer::engine {

struct EngineConfig {
  int32_t max_num_batched_tokens = 2048;  // --max-num-batched-tokens
  int32_t max_num_seqs = 64;              // --max-num-seqs
  int64_t max_model_len = 0;              // prompt + output tokens; 0: the model's max_position_embeddings
  int64_t kv_cache_bytes = 1ll << 30;     // memory for the latent KV cache (sets the number of blocks)
  bool enable_prefix_caching = true;      // --no-prefix-caching turns it off
};

// What one step produced for one request: a new token, or the request's end. A request's end is reported
// once, in the step after its last token (or after cancel / abort), with no token.
struct TokenEvent {
  SequenceId id = 0;
  std::optional<TokenId> token;  // absent on the finish event
  std::optional<float> logprob;
  std::vector<TokenLogprob> top_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string message;  // why an aborted request was aborted
  // On the finish event: prompt tokens whose KV was reused from the prefix cache (a multiple of 64).
  int64_t num_cached_tokens = 0;
};

// Not thread-safe: one thread drives submit / cancel / step.
class Engine {
 public:
  // Takes ownership of the backend and the model built on it.
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<backend::Backend> backend,
                                                std::unique_ptr<model::DeepSeekModel> model, const EngineConfig& config);

  // Validates `params` and the prompt (ids in the vocabulary, length below max_model_len) and queues the
  // request. max_tokens defaults to what is left of max_model_len; the model's EOS ids stop it unless
  // params.ignore_eos.
  Result<SequenceId> submit(std::vector<TokenId> prompt_token_ids, const SamplingParams& params);
  // Cancels at any point; the request's blocks are freed and it finishes with kCancelled in the next step.
  Status cancel(SequenceId id);
  // Runs one step. Returns the events of the step (new tokens, finishes).
  Result<std::vector<TokenEvent>> step();
  bool has_pending_work() const { return scheduler_.has_pending_work(); }

  const model::ModelConfig& model_config() const { return model_->config(); }
  const Scheduler& scheduler() const { return scheduler_; }
  size_t kv_cache_bytes() const { return kv_storage_.size_bytes(); }
  int64_t num_preemptions() const { return num_preemptions_; }  // since creation

 private:
  struct RequestState {
    std::vector<TokenId> prompt;
    std::vector<TokenId> output;
    SamplingParams params;
    RequestRng rng;
  };
  Engine(std::unique_ptr<backend::Backend> backend, std::unique_ptr<model::DeepSeekModel> model,
         const EngineConfig& config, Scheduler scheduler, kvcache::LatentKvStorage storage);
  // The executor: one forward pass over the batch, then sampling of the rows that produce a token.
  Result<std::vector<SampledToken>> run(const ScheduledBatch& batch);

  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<model::DeepSeekModel> model_;
  EngineConfig config_;
  Scheduler scheduler_;
  kvcache::LatentKvStorage kv_storage_;
  std::vector<float*> layer_caches_;
  Sampler sampler_;
  std::map<SequenceId, RequestState> requests_;
  SequenceId next_id_ = 1;
  int64_t num_preemptions_ = 0;
  std::vector<float> logits_;
};

}  // namespace deepinfer::engine
