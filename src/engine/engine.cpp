// Engine step: schedule, execute (forward + sample), update; plus request admission and cancellation.
#include "deepinfer/engine/engine.h"

#include "model_executor.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace deepinfer::engine {

namespace {
// Milliseconds on the monotonic clock: the host tier's TTLs (in memory, so they need not survive a restart).
int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Engine::OffloadTiers::OffloadTiers(std::unique_ptr<kvcache::KvOffloadStore> store, backend::Backend& backend,
                                   std::span<const backend::Buffer> layer_caches)
    : store_(std::move(store)),
      backend_(backend),
      layer_caches_(layer_caches),
      scratch_(store_->config().block_bytes) {}

int64_t Engine::OffloadTiers::match(std::span<const kvcache::BlockHash> chain) {
  return store_->match(chain, now_ms());
}

bool Engine::OffloadTiers::load(const kvcache::BlockHash& hash, kvcache::BlockId block, kvcache::TtlClassId ttl_class) {
  if (!store_->load(hash, scratch_, ttl_class, now_ms())) return false;
  const size_t layer_bytes = scratch_.size() / layer_caches_.size();
  for (size_t layer = 0; layer < layer_caches_.size(); ++layer) {
    // A failed copy is a miss: the block is then computed, never used half-written.
    if (!backend_
             .upload(scratch_.data() + layer * layer_bytes, layer_bytes, layer_caches_[layer],
                     static_cast<size_t>(block) * layer_bytes)
             .ok()) {
      return false;
    }
  }
  return true;
}

void Engine::OffloadTiers::store(const kvcache::BlockHash& hash, const kvcache::BlockHash& parent,
                                 kvcache::BlockId block, kvcache::TtlClassId ttl_class,
                                 std::span<const TokenId> token_ids) {
  const size_t layer_bytes = scratch_.size() / layer_caches_.size();
  for (size_t layer = 0; layer < layer_caches_.size(); ++layer) {
    // A block that cannot be read back is not stored: a lower tier never holds another block's bytes.
    if (!backend_
             .download(layer_caches_[layer], static_cast<size_t>(block) * layer_bytes, layer_bytes,
                       scratch_.data() + layer * layer_bytes)
             .ok()) {
      return;
    }
  }
  store_->store(hash, parent, scratch_, ttl_class, now_ms(), token_ids);
}

Engine::Engine(std::unique_ptr<backend::Backend> backend, std::unique_ptr<model::DeepSeekModel> model,
               const EngineConfig& config, Scheduler scheduler, std::vector<backend::Buffer> layer_caches)
    : backend_(std::move(backend)),
      model_(std::move(model)),
      config_(config),
      scheduler_(std::move(scheduler)),
      layer_caches_(std::move(layer_caches)) {
  for (const backend::Buffer& layer : layer_caches_) kv_cache_bytes_ += layer.bytes;
  // Sampling threads: one Sampler each (a Sampler keeps per-row scratch and is single-threaded), at most 16.
  const int32_t threads = config.sampling_threads > 0 ? config.sampling_threads : std::clamp(omp_get_max_threads(), 1, 16);
  executor_ = std::make_unique<ModelExecutor>(*model_, layer_caches_, threads, config.parallel_sampling_min_logits);
}

KvTierStats Engine::kv_tier_stats() const {
  KvTierStats stats;
  stats.device_usage_blocks = scheduler_.num_cached_blocks();
  stats.device_capacity_blocks = scheduler_.block_pool().num_total();
  stats.device_hit_blocks =
      (scheduler_.num_prefix_hit_tokens() - scheduler_.num_prefix_loaded_tokens()) / kvcache::kBlockTokens;
  stats.device_miss_blocks = scheduler_.num_prefix_query_blocks() - stats.device_hit_blocks;
  stats.device_evicted_blocks = scheduler_.num_device_evicted_blocks();
  stats.loaded_blocks = scheduler_.num_prefix_loaded_tokens() / kvcache::kBlockTokens;
  if (offload_) stats.lower = offload_->offload().counters();
  return stats;
}

std::map<std::string, std::vector<kvcache::BlockHash>> Engine::kv_blocks_by_medium() const {
  std::map<std::string, std::vector<kvcache::BlockHash>> out;
  out[std::string(device_medium())] = scheduler_.cached_hashes();
  if (offload_) {
    out[std::string(kvcache::kMediumHost)] = offload_->offload().host_blocks();
    out[std::string(kvcache::kMediumDisk)] = offload_->offload().disk_blocks();
  }
  return out;
}

std::string_view Engine::device_medium() const {
  return backend_->name() == "cuda" ? kvcache::kMediumGpu : kvcache::kMediumDevice;
}

void Engine::flush_kv_tiers() {
  if (offload_) offload_->offload().flush();
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<backend::Backend> backend,
                                               std::unique_ptr<model::DeepSeekModel> model,
                                               const EngineConfig& config) {
  const model::ModelConfig& c = model->config();
  EngineConfig resolved = config;
  if (resolved.max_model_len <= 0) resolved.max_model_len = c.max_position_embeddings;
  // One block of every layer's cache, in the backend's cache dtype (float32 on CPU, bf16 on CUDA).
  const int64_t block_bytes = static_cast<int64_t>(model->layer_block_bytes()) * c.num_hidden_layers;
  const int64_t num_blocks = resolved.kv_cache_bytes / block_bytes;
  if (num_blocks < 1) {
    return Status::invalid_argument("kv_cache_bytes " + std::to_string(resolved.kv_cache_bytes) +
                                    " holds no KV block; one block needs " + std::to_string(block_bytes) + " bytes");
  }
  SchedulerConfig scheduler_config;
  scheduler_config.max_num_batched_tokens = resolved.max_num_batched_tokens;
  scheduler_config.max_num_seqs = resolved.max_num_seqs;
  scheduler_config.num_blocks = static_cast<int32_t>(std::min<int64_t>(num_blocks, INT32_MAX));
  scheduler_config.enable_prefix_caching = resolved.enable_prefix_caching;
  // Without the checkpoint's identity the cache cannot outlive this engine: a fixed value serves the device
  // and host tiers, which live and die with it and its one model; the disk tier requires the real one.
  const bool has_fingerprint = resolved.fingerprint != kvcache::ModelFingerprint{};
  scheduler_config.fingerprint =
      has_fingerprint ? resolved.fingerprint : kvcache::model_fingerprint("deepinfer-engine-device-tier", "");
  if (!resolved.disk_cache_path.empty() && !has_fingerprint) {
    return Status::invalid_argument("the disk KV tier (" + resolved.disk_cache_path +
                                    ") needs the checkpoint's fingerprint in EngineConfig.fingerprint");
  }
  if (!resolved.disk_cache_path.empty() && resolved.host_cache_bytes <= 0) {
    return Status::invalid_argument("the disk KV tier (" + resolved.disk_cache_path +
                                    ") loads through the host tier: set a host cache size too");
  }
  if (resolved.host_cache_bytes > 0 && !resolved.enable_prefix_caching) {
    return Status::invalid_argument("the host/disk KV tiers need prefix caching; it is off");
  }
  Result<Scheduler> scheduler = Scheduler::create(scheduler_config);
  if (!scheduler.ok()) return scheduler.status();
  Result<std::vector<backend::Buffer>> layer_caches = model->make_layer_caches(scheduler_config.num_blocks);
  if (!layer_caches.ok()) return layer_caches.status();
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(backend), std::move(model), resolved,
                                                   std::move(scheduler).value(), std::move(layer_caches).value()));
  if (resolved.host_cache_bytes > 0) {
    kvcache::OffloadConfig offload;
    offload.block_bytes = static_cast<size_t>(block_bytes);
    offload.host_capacity_blocks = resolved.host_cache_bytes / block_bytes;
    if (offload.host_capacity_blocks < 1) {
      return Status::invalid_argument("host KV cache of " + std::to_string(resolved.host_cache_bytes) +
                                      " bytes holds no block; one block needs " + std::to_string(block_bytes));
    }
    offload.evict_bytes_per_s = resolved.host_evict_bytes_per_s;
    if (!(resolved.kv_cache_ttl_hours > 0)) {
      return Status::invalid_argument("kv_cache_ttl_hours must be > 0, got " +
                                      std::to_string(resolved.kv_cache_ttl_hours));
    }
    offload.retention = kvcache::RetentionConfig::defaults(resolved.kv_cache_ttl_hours);
    if (!resolved.disk_cache_path.empty()) {
      kvcache::DiskBlockStoreOptions disk;
      disk.directory = resolved.disk_cache_path;
      disk.fingerprint = scheduler_config.fingerprint;
      disk.model_name = resolved.disk_cache_model_name;
      disk.reset_foreign = resolved.disk_cache_reset;
      disk.block_bytes = offload.block_bytes;
      disk.capacity_blocks = resolved.disk_cache_bytes / block_bytes;
      if (disk.capacity_blocks < 1) {
        return Status::invalid_argument("disk KV cache of " + std::to_string(resolved.disk_cache_bytes) +
                                        " bytes holds no block; one block needs " + std::to_string(block_bytes));
      }
      offload.disk = std::move(disk);
    }
    Result<std::unique_ptr<kvcache::KvOffloadStore>> store = kvcache::KvOffloadStore::create(std::move(offload));
    if (!store.ok()) return store.status();
    engine->offload_ =
        std::make_unique<OffloadTiers>(std::move(store).value(), *engine->backend_, engine->layer_caches_);
    engine->scheduler_.set_lower_tiers(engine->offload_.get());
  }
  if (!resolved.kv_events_endpoint.empty()) {
    if (!resolved.enable_prefix_caching) return Status::invalid_argument("KV events need prefix caching; it is off");
    kvcache::KvEventPublisherConfig events;
    events.endpoint = resolved.kv_events_endpoint;
    events.replay_endpoint = resolved.kv_events_replay_endpoint;
    Result<std::unique_ptr<kvcache::KvEventPublisher>> publisher = kvcache::KvEventPublisher::start(events);
    if (!publisher.ok()) return publisher.status();
    engine->kv_events_ = std::move(publisher).value();
    // A fresh worker holds nothing on device and host: subscribers drop what they knew, then learn the disk.
    engine->kv_events_->publish(kvcache::KvEvent::all_cleared());
    if (engine->offload_) engine->offload_->offload().set_event_sink(engine->kv_events_.get());
    engine->scheduler_.set_kv_event_sink(engine->kv_events_.get(), std::string(engine->device_medium()));
    engine->kv_events_->flush();
  }
  return engine;
}

Result<SequenceId> Engine::submit(std::vector<TokenId> prompt, const SamplingParams& params) {
  const model::ModelConfig& c = model_->config();
  if (prompt.empty()) return Status::invalid_argument("the prompt has no tokens");
  if (Status s = params.validate(c.vocab_size); !s.ok()) return s;
  static const size_t classes = kvcache::RetentionConfig::defaults().classes.size();
  if (params.kv_ttl_class >= classes) {
    return Status::invalid_argument("kv_ttl_class " + std::to_string(params.kv_ttl_class) +
                                    " is not a retention class (0.." + std::to_string(classes - 1) + ")");
  }
  for (TokenId id : prompt) {
    if (id < 0 || id >= c.vocab_size) {
      return Status::invalid_argument("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                      std::to_string(c.vocab_size) + ")");
    }
  }
  const int64_t room = config_.max_model_len - static_cast<int64_t>(prompt.size());
  if (room < 1) {
    return Status::invalid_argument("the prompt has " + std::to_string(prompt.size()) + " tokens; max_model_len is " +
                                    std::to_string(config_.max_model_len));
  }
  SequenceRequest request;
  request.id = next_id_++;
  request.prompt_token_ids = prompt;
  request.max_tokens = std::min(params.max_tokens.value_or(room), room);
  request.stop_token_ids = params.stop_token_ids;
  request.ttl_class = params.kv_ttl_class;
  if (!params.ignore_eos) {
    for (int64_t eos : c.eos_token_ids) request.stop_token_ids.push_back(static_cast<TokenId>(eos));
  }
  if (offload_) {
    // Read the request's disk blocks into host while it waits in the queue; the scheduler reuses the chain.
    request.block_hashes = kvcache::block_hash_chain(request.prompt_token_ids, scheduler_.config().fingerprint);
    offload_->offload().prefetch(request.block_hashes, request.ttl_class, now_ms());
  }
  const SequenceId id = request.id;
  if (Status s = executor_->add_request(id, prompt, params); !s.ok()) return s;
  if (Status s = scheduler_.add(std::move(request)); !s.ok()) {
    executor_->remove_request(id);
    return s;
  }
  return id;
}

Status Engine::cancel(SequenceId id) { return scheduler_.cancel(id); }

Result<std::vector<TokenEvent>> Engine::step() {
  if (offload_) offload_->offload().tick(now_ms());
  ScheduledBatch batch = scheduler_.schedule();
  num_preemptions_ += static_cast<int64_t>(batch.preempted.size());
  std::vector<TokenEvent> events;
  for (const FinishedSequence& finished : batch.finished) {
    events.push_back({finished.id, std::nullopt, std::nullopt, {}, true, finished.reason, finished.message,
                      finished.num_cached_tokens});
    executor_->remove_request(finished.id);
  }
  if (batch.empty()) {
    if (kv_events_) kv_events_->flush();
    return events;
  }
  Result<StepOutput> out = executor_->run(batch);
  if (!out.ok()) return out.status();
  if (Status s = scheduler_.update(batch, *out); !s.ok()) return s;
  if (kv_events_) kv_events_->flush();  // one batch of KV events per step, as vLLM publishes them
  // Each kept token is one event, in order; a finish (stop token, length) is reported once, by the next step's
  // `finished` list.
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    for (SampledToken& token : out->entries[i]) {
      events.push_back({batch.entries[i].sequence_id, token.token_id, token.logprob, std::move(token.top_logprobs),
                        false, FinishReason::kNone, {}, 0});
    }
  }
  return events;
}

}  // namespace deepinfer::engine
