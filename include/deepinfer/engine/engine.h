// The engine: requests in, token events out. Each step reads in three lines (nano-vllm's LLMEngine.step):
//   batch = scheduler_.schedule(); out = executor.run(batch); scheduler_.update(batch, out);
// where the executor turns the scheduled chunks into one forward pass over the paged latent KV cache and
// samples the rows that produce a token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/sampling_params.h"
#include "deepinfer/engine/scheduler.h"
#include "deepinfer/engine/dspark.h"
#include "deepinfer/engine/speculative.h"
#include "deepinfer/kvcache/block_pool.h"
#include "deepinfer/engine/executor.h"
#include "deepinfer/kvcache/kv_cache_manager.h"
#include "deepinfer/model/deepseek_model.h"
#include "deepinfer/model/deepseek_v4.h"

namespace deepinfer::engine {

class MtpExecutor;  // src/engine/mtp_executor.h
class V4Executor;   // src/engine/v4_executor.h

struct EngineConfig {
  int32_t max_num_batched_tokens = 2048;  // --max-num-batched-tokens
  int32_t max_num_seqs = 64;              // --max-num-seqs
  // Prompt + output tokens; 0: the model's max_position_embeddings, lowered to what the KV cache holds (a
  // larger value given explicitly is refused by create()).
  int64_t max_model_len = 0;
  int64_t kv_cache_bytes = 1ll << 30;     // memory for the latent KV cache (sets the number of blocks)
  bool enable_prefix_caching = true;      // --no-prefix-caching turns it off
  // DeepSeek-V4's SWA bounded replay (--swa-bounded-replay, on by default): a cached prefix whose last window's
  // raw rows are gone (evicted from the window pool, or never below the device) is reused whole and its last
  // sliding_window tokens replayed (an approximation: kvcache::KvCacheConfig::bounded_replay, V4Executor). Off:
  // the prefix is reused up to where its window rows are still cached, the rest recomputed (exact).
  bool swa_bounded_replay = true;
  // Identity of the checkpoint in every block hash (kvcache::model_fingerprint): blocks of other weights or
  // another KV dtype never match, on disk across restarts included. Zero: a fixed value (device tier only).
  kvcache::ModelFingerprint fingerprint = {};
  // The tiers below the device (kvcache::KvCacheManager): off when host_cache_bytes is 0. The disk tier
  // needs the host tier (it loads through it) and a nonzero fingerprint.
  int64_t host_cache_bytes = 0;            // --kv-host-cache-gb
  std::string disk_cache_path;             // --tiered-kv-storage-path; empty: no disk tier
  std::string disk_cache_model_name;       // recorded in the disk tier's MODEL and named when it is refused
  bool disk_cache_reset = false;           // --kv-disk-reset: delete another model's blocks instead of refusing
  // KV events (kvcache/kv_events.h: vLLM's schema over ZeroMQ) of every tier: off when the endpoint is empty.
  // At start: AllBlocksCleared, then BlockStored for each disk block recovered; then every change.
  std::string kv_events_endpoint;          // --kv-events-endpoint, e.g. tcp://*:5557
  std::string kv_events_replay_endpoint;   // --kv-events-replay-endpoint, e.g. tcp://*:5558; empty: no replay
  int64_t disk_cache_bytes = 16ll << 30;   // --kv-disk-cache-gb
  double kv_cache_ttl_hours = 168.0;       // --kv-cache-ttl-hours: TTL of the default retention class
  double host_evict_bytes_per_s = kvcache::kUnlimited;  // --kv-evict-mb-per-s: host eviction token bucket
  // Threads that sample a step's rows (0: OpenMP's thread count, at most 16), and the step size (rows x vocab
  // logits) from which they are used: below it one thread samples (thread start-up would cost more).
  int32_t sampling_threads = 0;
  int64_t parallel_sampling_min_logits = int64_t{1} << 21;
  // Speculative decoding (--speculative-algorithm mtp --speculative-num-draft-tokens K): the checkpoint's MTP layer
  // drafts K tokens per request per step, verified in the next step's forward (speculative.h, mtp_executor.h).
  // Its KV is one more layer of every cache block. Engine::create refuses a config it cannot honour.
  SpeculativeConfig speculative;
};

// What an engine config makes of the scheduler and the prefix cache for a model caching `layout`: the main
// pool's block count from kv_cache_bytes (a block holds the kinds that keep every token, every layer), after a
// pool per sliding-window kind (twice the blocks the running sequences can hold at once: the rest caches
// finished prefixes' windows); the host and disk tiers; the retention classes.
// Engine::create uses it; so does the offline replay of a live trace (bench/replay/engine_replay.h), which runs
// the same scheduler and cache with no model. Errors: InvalidArgument naming the setting that cannot work.
struct KvCachePlan {
  SchedulerConfig scheduler;
  kvcache::KvCacheConfig cache;
};
// `sequence_bytes`: memory each of max_num_seqs running sequences keeps outside the blocks (DeepSeek-V4's window
// rings), taken from kv_cache_bytes first.
Result<KvCachePlan> plan_kv_cache(const EngineConfig& config, const kvcache::CacheLayout& layout,
                                  int64_t sequence_bytes = 0);

// DSpark's step times for this engine (dspark.h): "const" -> none (flat); a file of config.step_time_table measured
// for config.identity and reaching `max_rows` -> loaded; otherwise measured now on `model` over `layer_caches` (the
// main layers', then the MTP layer's, or with `dspark_module` the DSpark module's stages'; they must hold nothing yet:
// blocks from 0 up are overwritten; under a second on the CPU demo model) and written to that file (atomically; a
// write failure is logged, not fatal). Errors: the model's.
Result<StepTimes> step_times(const DsparkConfig& config, model::DeepSeekModel& model,
                             std::span<const backend::Buffer> layer_caches, int32_t num_blocks, int32_t max_num_seqs,
                             int32_t max_rows, bool dspark_module = false);

// The prefix cache's state per tier, for metrics (kvcache::KvCacheManager::counters()).
using KvTierStats = kvcache::KvCacheCounters;

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
  // Prompt tokens whose KV was reused from the prefix cache (a multiple of 64), on the finish event and on every
  // token event (fixed at the request's first admission), so that a client that stops early (a stop string, the
  // tool-call limit) still reports them.
  int64_t num_cached_tokens = 0;
};

// KV blocks handed between workers with a request (prefill/decode disaggregation: src/server/kv_transfer.h moves
// them). A payload is one whole 64-token block of every cache layer, in the layout kvcache/transfer/block_mover.h
// describes (block_bytes(): the two workers must run the same checkpoint, cache dtype and MTP setting; the block
// hashes' fingerprint tells the first two apart, the size the third).
struct KvHandoff {
  // The decode side: the payloads of the prompt's blocks import_first_block, import_first_block + 1, ... (received
  // from a prefill worker and checked against its checksums), one per block of `reservation` (below). Before the
  // request is queued they are written into the reserved blocks and become cached blocks of this engine, exactly
  // as if computed here, so its admission reuses them (a block cached meanwhile keeps its own copy).
  std::vector<std::vector<std::byte>> import_blocks;
  // The prompt block import_blocks[0] is: the reservation's first_block (the blocks before it are held here).
  int64_t import_first_block = 0;
  // The prefill side: called on the step thread with each full prompt block (index from 0, payload) once a step
  // has computed it or found it cached, in order, each once, before the request's next step. Must not block.
  std::function<void(int64_t block_index, std::vector<std::byte> payload)> export_block;
  int64_t export_from_block = 0;  // blocks before it are computed but not sent
  // The decode side, two-phase: Engine::reserve_kv_blocks' id, made before the transfer. import_blocks then go
  // into the reserved blocks (import_first_block must be the reservation's first_block, and one payload per
  // reserved block); the reservation ends with the submit, whatever its outcome. 0: none.
  uint64_t reservation = 0;
  bool empty() const { return import_blocks.empty() && !export_block && reservation == 0; }
};

// Engine::reserve_kv_blocks' answer: where a prefill worker's blocks will go.
struct KvReservation {
  uint64_t id = 0;
  // The prompt's leading blocks cached on this device, held until the reservation ends: not to be sent.
  int64_t first_block = 0;
  // Device blocks reserved for prompt blocks first_block .. first_block + size - 1, in that order.
  std::vector<kvcache::BlockId> blocks;
};

// Not thread-safe: one thread drives submit / cancel / step.
class Engine {
 public:
  // Takes ownership of the backend and the model built on it.
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<backend::Backend> backend,
                                                std::unique_ptr<model::DeepSeekModel> model, const EngineConfig& config);
  // A DeepSeek-V4 model (the CPU reference path): each running sequence's cache lives in the V4 executor
  // (V4Executor; its window rings are taken from kv_cache_bytes first), and each finished 64-token block's part of it
  // (a block payload, DeepSeekV4Model::block_payload_floats) in the paged cache's block: prefix caching, the
  // host/disk tiers and KV events work over those blocks as for V2/V3, and a sequence resuming from cached blocks is
  // restored from them. Unsupported: speculative decoding (a clear error); KvHandoff is refused by submit.
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<backend::Backend> backend,
                                                std::unique_ptr<model::DeepSeekV4Model> model,
                                                const EngineConfig& config);
  // Finishes the KV cache's transfers (disk writes included) before the device memory goes.
  ~Engine();

  // Validates `params` and the prompt (ids in the vocabulary, length below max_model_len) and queues the
  // request. max_tokens defaults to what is left of max_model_len; the model's EOS ids stop it unless
  // params.ignore_eos. `handoff`: KV blocks brought in or sent out (KvHandoff). Errors: InvalidArgument (also for
  // import blocks without a reservation, a payload whose size is not block_bytes(), or payloads that do not match
  // the reservation's blocks); FailedPrecondition for a handoff on DeepSeek-V4.
  Result<SequenceId> submit(std::vector<TokenId> prompt_token_ids, const SamplingParams& params,
                            KvHandoff handoff = {});
  // Prefill/decode disaggregation, the decode side's first phase: before asking a prefill worker for the KV of
  // `tokens` (whole 64-token blocks of a prompt), holds the leading blocks this device caches (so they stay) and
  // reserves free device blocks for all the others (so the transfer has somewhere to go, and a full pool is known
  // before any block is sent). Ends with the submit that names it (KvHandoff::reservation) or release_kv_blocks.
  // Errors: FailedPrecondition (prefix caching off, sliding-window caches, V4), ResourceExhausted (the pool's free
  // blocks do not cover the transfer plus one block per running request, so that no running request is preempted
  // for a reservation; nothing is held then).
  Result<KvReservation> reserve_kv_blocks(std::span<const TokenId> tokens);
  // Ends a reservation that no submit consumed: its blocks go back (the held cached ones stay cached). Unknown
  // ids (already consumed or released) are ignored.
  void release_kv_blocks(uint64_t reservation);
  // Reservations not ended yet.
  size_t num_kv_reservations() const { return reservations_.size(); }
  // Cancels at any point; the request's blocks are freed and it finishes with kCancelled in the next step.
  Status cancel(SequenceId id);
  // Runs one step. Returns the events of the step (new tokens, finishes).
  Result<std::vector<TokenEvent>> step();
  // Data parallel with expert parallel (StepGroup): in lock step every step() runs exactly one target pass, an empty
  // one when nothing is scheduled (the MoE layers' exchanges need every rank). With speculative decoding that pass
  // is the verify; the draft passes exchange nothing (the MTP layer's experts are whole on every rank, the DSpark
  // module is dense), so each rank drafts as its own planner says. Only with a V2/V3 model: else
  // FailedPrecondition.
  Status set_lockstep(bool on);
  bool has_pending_work() const { return scheduler_.has_pending_work(); }
  // Between steps, with no step to run: the KV cache's background work (transfers done or still to hand to the
  // mover, retention). Returns whether some is left (the caller comes back soon while true). Engine thread only.
  bool idle_tick();
  bool has_background_work() const { return scheduler_.cache().has_background_work(); }

  // The model's config (for V4: DeepSeekV4Model::engine_config(), the fields the engine and server read).
  const model::ModelConfig& model_config() const { return model_config_; }
  // The resolved max_model_len (EngineConfig::max_model_len): what submit() enforces.
  int64_t max_model_len() const { return config_.max_model_len; }
  const Scheduler& scheduler() const { return scheduler_; }
  size_t kv_cache_bytes() const { return kv_cache_bytes_; }
  // One KV block of every cache layer, in bytes (a KvHandoff payload).
  size_t block_bytes() const { return block_bytes_; }
  int64_t num_preemptions() const { return num_preemptions_; }  // since creation
  // DeepSeek-V4: tokens recomputed since creation to restore cached prefixes whose last window's raw rows were gone
  // (a bounded replay's sliding_window tokens, or a prefix of at most one window fed again); -1 for V2/V3 (no
  // window to replay).
  int64_t num_replayed_tokens() const;
  // Speculative decoding's counters since creation (all zero when it is off).
  const SpeculativeStats& speculative_stats() const { return speculative_stats_; }
  // Expert parallel's counters (empty without expert parallel).
  model::EplbStats eplb_stats() const { return model_ ? model_->eplb_stats() : model::EplbStats{}; }
  KvTierStats kv_tier_stats() const;
  // The blocks each tier holds now, by KV-event medium ("GPU" or "DEVICE", "CPU", "DISK"): what a subscriber
  // of the KV events must have rebuilt. For tests and introspection; costs a copy of the indexes.
  std::map<std::string, std::vector<kvcache::BlockHash>> kv_blocks_by_medium() const;
  // The device tier's KV-event medium: "GPU" on the CUDA backend, "DEVICE" on the CPU one.
  std::string_view device_medium() const;
  // Blocks until every block written through so far is on disk (tests, shutdown). No-op without a disk tier.
  void flush_kv_tiers();

 private:
  // Turns, first come first served, between the step thread's forward pass and the mover's copies, for a
  // backend whose calls must not overlap (CUDA: one stream, CUDA-graph capture, a sticky error status).
  class StepGate {
   public:
    void lock();
    void unlock();

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t next_ticket_ = 0;
    uint64_t serving_ = 0;
  };

  // Holds a StepGate's turn while it lives (none when the gate is null).
  class GateTurn {
   public:
    explicit GateTurn(StepGate* gate) : gate_(gate) {
      if (gate_ != nullptr) gate_->lock();
    }
    ~GateTurn() {
      if (gate_ != nullptr) gate_->unlock();
    }
    GateTurn(const GateTurn&) = delete;
    GateTurn& operator=(const GateTurn&) = delete;

   private:
    StepGate* gate_;
  };

  // The KV cache's mover reads and writes device blocks through this: one block of every layer's cache, in the
  // layout kvcache/transfer/block_mover.h describes (layer-major). Called on the mover's threads: concurrently
  // with the forward pass on the CPU backend (plain copies of blocks no step touches), in turns with it through
  // `gate` on the others and with tensor parallel. With `replicas` (tensor parallel's rank 0), every write goes to
  // the followers' caches too (DeepSeekModel::replicate_cache_blocks); reads need only this rank's (replicated).
  class DeviceBlocks final : public kvcache::transfer::DeviceBlockIo {
   public:
    DeviceBlocks(backend::Backend& backend, std::span<const backend::Buffer> layer_caches, size_t block_bytes,
                 StepGate* gate, model::DeepSeekModel* replicas)
        : backend_(backend),
          layer_caches_(layer_caches),
          layer_bytes_(block_bytes / layer_caches.size()),
          gate_(gate),
          replicas_(replicas) {}
    Status read(kvcache::BlockId block, std::span<std::byte> out) override;
    Status write(kvcache::BlockId block, std::span<const std::byte> in) override;
    // Many blocks in one backend batch (kv_block_copy.h); out[i] / in[i] are block_bytes each.
    Status read_blocks(std::span<const kvcache::BlockId> blocks, std::span<std::byte* const> out);
    Status write_blocks(std::span<const kvcache::BlockId> blocks, std::span<const std::byte* const> in);

   private:
    backend::Backend& backend_;
    std::span<const backend::Buffer> layer_caches_;
    size_t layer_bytes_;
    StepGate* gate_;  // null: no turns needed
    model::DeepSeekModel* replicas_;  // null: no other rank keeps a copy
  };

  Engine(std::unique_ptr<backend::Backend> backend, std::unique_ptr<model::DeepSeekModel> model,
         const EngineConfig& config, Scheduler scheduler, std::vector<backend::Buffer> layer_caches,
         std::unique_ptr<DraftPlanner> planner);
  // The KV cache's device I/O (the tiers' copies) over layer_caches_ and the KV event publisher, for create().
  Status attach_cache_io(size_t block_bytes);
  // KvHandoff::export_block for the entries of `batch` that export, after the executor computed their KV.
  void export_blocks(const ScheduledBatch& batch);

  struct Export {
    std::function<void(int64_t, std::vector<std::byte>)> send;
    int64_t next_block = 0;    // the first prompt block not sent yet
    int64_t prompt_blocks = 0;  // full blocks of the prompt
  };

  // First, so it is destroyed last: the scheduler and the tiers (and the disk writer thread) publish into it.
  std::unique_ptr<kvcache::KvEventPublisher> kv_events_;
  std::unique_ptr<backend::Backend> backend_;
  std::unique_ptr<model::DeepSeekModel> model_;    // V2/V3; null for V4
  std::unique_ptr<model::DeepSeekV4Model> v4_model_;  // V4; null for V2/V3
  backend::Buffer v4_windows_;  // V4: the window pool (window payloads; V4Executor), on the device only
  model::ModelConfig model_config_;
  EngineConfig config_;
  Scheduler scheduler_;
  // Per layer [num_blocks, 64, kv_cache_dim] in the cache dtype; with MTP drafting, then the MTP layer's
  // [num_blocks + max_num_seqs, 64, kv_cache_dim] (its last max_num_seqs blocks: the draft chains' scratch).
  std::vector<backend::Buffer> layer_caches_;
  size_t kv_cache_bytes_ = 0;
  std::unique_ptr<StepGate> step_gate_;          // null on the CPU backend without tensor parallel
  std::unique_ptr<DeviceBlocks> device_blocks_;  // points into layer_caches_
  std::unique_ptr<Executor> executor_;     // the model executor over model_ and layer_caches_
  MtpExecutor* mtp_executor_ = nullptr;  // executor_ when it drafts (its planner's counters)
  V4Executor* v4_executor_ = nullptr;    // executor_ for DeepSeek-V4
  SequenceId next_id_ = 1;
  size_t block_bytes_ = 0;
  std::unordered_map<SequenceId, Export> exports_;  // requests whose prompt blocks are sent out
  struct Reservation {
    std::vector<kvcache::BlockHash> chain;  // of the reserved tokens' whole blocks
    std::vector<TokenId> tokens;            // those tokens (KV events name them)
    std::vector<kvcache::BlockId> held;     // blocks 0 .. first_block - 1, cached here, retained
    std::vector<kvcache::BlockId> blocks;   // blocks first_block .., allocated
  };
  std::unordered_map<uint64_t, Reservation> reservations_;
  uint64_t next_reservation_ = 1;
  // Drops the reservation's hold on its blocks (held cached ones stay cached, allocated ones go back).
  void release_reservation_blocks(const Reservation& r);
  // KvHandoff::reservation: writes the payloads into the reserved blocks, caches them, ends the reservation.
  Status import_reserved(uint64_t reservation, std::vector<std::vector<std::byte>>& payloads, int64_t first_block,
                         kvcache::TtlClassId ttl_class);
  int64_t num_preemptions_ = 0;
  SpeculativeStats speculative_stats_;
  bool lockstep_ = false;
  std::vector<int32_t> idle_ids_;  // the empty pass's (none)
};

}  // namespace deepinfer::engine
