// The engine's async face, EngineClient: submit, cancel, token events per request (EventSink), load. The
// server, a prefill worker's hand-off and the router's workers talk to an engine only through it; the
// in-process implementation (InProcessEngineClient) is one thread that owns the engine and runs its step
// loop, fed submits and cancels through a mutex-protected queue, stepping only while the engine has work and
// otherwise sleeping on a condition variable. A remote client (a prefill or decode worker in another
// process) is the next implementation of the same interface.
// StepEngine is the narrow face of the engine that thread drives, so tests can put a scripted double behind
// the real server (the real one is Engine, wrapped by wrap_engine).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/engine.h"

namespace deepinfer::engine {

// A snapshot of the engine's load, for the running / waiting / KV-block gauges.
struct EngineLoad {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t kv_blocks_used = 0;
  int32_t kv_blocks_free = 0;
  KvTierStats kv_tiers;  // the prefix cache per tier
  SpeculativeStats speculative;  // speculative decoding's counters (zero when off)
  model::EplbStats eplb;          // expert parallel's counters (empty without)
  int64_t swa_replayed_tokens = -1;  // DeepSeek-V4: Engine::num_replayed_tokens(); -1: not a V4 engine
  // Seconds the engine thread has spent in its current iteration (a step, or the lock-step question to its
  // data-parallel group); 0 while it waits for work. A value that keeps growing is a hung engine or peer (a rank
  // stopped mid-collective): the server's /health answers 503 past --health-max-step-seconds.
  double busy_seconds = 0.0;
};

// What the server needs from an engine. Same contract as Engine's methods of the same names;
// called from the engine thread only.
class StepEngine {
 public:
  virtual ~StepEngine() = default;
  virtual Result<SequenceId> submit(std::vector<TokenId> prompt_token_ids,
                                            const SamplingParams& params) = 0;
  // The same with KV blocks brought in or sent out (Engine::submit's KvHandoff). An engine without KV blocks
  // takes an empty handoff only (else Unsupported).
  virtual Result<SequenceId> submit_with_kv(std::vector<TokenId> prompt_token_ids, const SamplingParams& params,
                                            KvHandoff handoff) {
    if (!handoff.empty()) return Status::unsupported("this engine does not hand KV blocks over");
    return submit(std::move(prompt_token_ids), params);
  }
  // Engine::reserve_kv_blocks / release_kv_blocks; an engine without KV blocks has none to reserve.
  virtual Result<KvReservation> reserve_kv_blocks(std::span<const TokenId> /*tokens*/) {
    return Status::unsupported("this engine does not hand KV blocks over");
  }
  virtual void release_kv_blocks(uint64_t /*reservation*/) {}
  virtual Status cancel(SequenceId id) = 0;
  virtual Result<std::vector<TokenEvent>> step() = 0;
  // Engine::set_lockstep; an engine without model passes ignores it.
  virtual Status set_lockstep(bool /*on*/) { return Status(); }
  virtual bool has_pending_work() const = 0;
  // Engine::idle_tick / has_background_work: work between steps (the KV cache's transfers); none by default.
  virtual bool idle_tick() { return false; }
  virtual bool has_background_work() const { return false; }
  virtual EngineLoad load() const = 0;
};

// Adapts the real engine. Takes ownership.
std::unique_ptr<StepEngine> wrap_engine(std::unique_ptr<Engine> engine);

// Data parallel with expert parallel (DeepSeek's attention data parallel + EP, vLLM's --data-parallel-size with
// --enable-expert-parallel): one engine per process, each with its own scheduler and KV cache, whose model passes
// must run in lock step, since every MoE layer's all-to-all joins all ranks. Each iteration of its engine thread
// asks the group whether any engine has work; when one has, every engine steps (Engine::set_lockstep: a pass
// with no tokens where nothing is scheduled); when none has, they wait for work, asking again every idle_poll().
class StepGroup {
 public:
  virtual ~StepGroup() = default;
  // Whether any engine of the group has pending work, given this one's. Every rank calls it equally often, on its
  // engine thread. Errors: the group's (a collective that failed: ShuttingDown naming it; the group is gone).
  virtual Result<bool> any_pending(bool mine) = 0;
  // How long an idle engine thread waits for work of its own before asking the group again.
  virtual std::chrono::microseconds idle_poll() const { return std::chrono::microseconds(1000); }
  // This engine is stopping (its server has drained): whether every engine of the group is stopping and none has
  // work (then they all leave together), and whether any has work (this engine's experts are still needed: it makes
  // its passes). Paired with the others' any_pending() calls: one collective per call. The base: {true, false}
  // (a group that does not wait: leave at once).
  struct StopPoll {
    bool all_stopping = true;
    bool any_pending = false;
  };
  virtual Result<StopPoll> stop_poll(bool /*mine*/) { return StopPoll{}; }
  // How long a stopping engine stays in the group's passes for the others (stop_poll) before it leaves anyway.
  virtual std::chrono::steady_clock::time_point stop_deadline() const { return std::chrono::steady_clock::now(); }
  // This engine stops (the server's stop, after its drain): the group may tell the others why they lose it.
  virtual void leave() {}
  // After any_pending() failed, once the engine client has ended its live requests with that error and will tell
  // later ones the same: the group may now stop what else it serves (the server). Called once, on the engine thread.
  virtual void stop_after_failure() {}
};

class EngineClient;
// The real engine behind an InProcessEngineClient. Takes ownership. With `group` (outlives the client), the
// engine steps in lock step with the group's (its engine set to lock step here).
std::unique_ptr<EngineClient> make_in_process_client(std::unique_ptr<Engine> engine, StepGroup* group = nullptr);

// One event for one request: a token or the request's end (TokenEvent), or an error that ends it
// (the engine refused the submit, or a step failed). `error` is Ok for engine events.
struct GenerationEvent {
  TokenEvent event;
  Status error;
};

// Receives a request's events. deliver() is called on the engine thread, in order, with every event of one
// step for this request; it must not block (queue and wake the HTTP side). After an event with
// event.finished set or a non-Ok error, nothing more is delivered.
class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void deliver(std::vector<GenerationEvent> events) = 0;
};

// Thread-safety: every method may be called from any thread.
class EngineClient {
 public:
  using Ticket = uint64_t;  // the client's id for a request, assigned at submit, never reused

  virtual ~EngineClient() = default;
  // Queues a request. Its events (or the submit's error, e.g. InvalidArgument for a prompt outside the
  // vocabulary, ShuttingDown after stop()) go to `sink`, which the client keeps until the request's end.
  // Never blocks on the engine.
  // `handoff`: KV blocks brought in from a prefill worker or sent out to a decode worker (Engine::submit); its
  // export callback runs on the engine thread.
  virtual Ticket submit(std::vector<TokenId> prompt_token_ids, SamplingParams params,
                        std::shared_ptr<EventSink> sink, KvHandoff handoff = {}) = 0;
  // Cancels a request wherever it is (queued, running, already finished: then nothing happens). Its KV
  // blocks return to the pool in the engine's next step; no further events are delivered.
  virtual void cancel(Ticket ticket) = 0;
  // Prefill/decode disaggregation, the decode side's first phase (Engine::reserve_kv_blocks): `done` gets the
  // reservation (or its error; ShuttingDown after stop()) on the engine thread, between steps; it must not block.
  // A reservation ends with the submit whose KvHandoff::reservation names it, or with release_kv_blocks (from any
  // thread; a no-op after stop(), when the engine's blocks go anyway).
  virtual void reserve_kv_blocks(std::vector<TokenId> tokens, std::function<void(Result<KvReservation>)> done) = 0;
  virtual void release_kv_blocks(uint64_t reservation) = 0;
  // The load after the latest step (or after the latest submit/cancel while idle).
  virtual EngineLoad load() const = 0;
  // Ends every live request with a ShuttingDown error event, stops the engine and waits for it. Idempotent.
  virtual void stop() = 0;
};

// The engine in this process, on a thread of its own.
class InProcessEngineClient final : public EngineClient {
 public:
  // Starts the engine thread. REQUIRES: engine non-null; `group` (optional) outlives the client and the engine was
  // set to lock step.
  explicit InProcessEngineClient(std::unique_ptr<StepEngine> engine, StepGroup* group = nullptr);
  ~InProcessEngineClient() override;  // stop()
  InProcessEngineClient(const InProcessEngineClient&) = delete;
  InProcessEngineClient& operator=(const InProcessEngineClient&) = delete;

  Ticket submit(std::vector<TokenId> prompt_token_ids, SamplingParams params,
                std::shared_ptr<EventSink> sink, KvHandoff handoff = {}) override;
  void cancel(Ticket ticket) override;
  void reserve_kv_blocks(std::vector<TokenId> tokens, std::function<void(Result<KvReservation>)> done) override;
  void release_kv_blocks(uint64_t reservation) override;
  EngineLoad load() const override;
  void stop() override;

 private:
  struct Submit {
    Ticket ticket;
    std::vector<TokenId> prompt;
    SamplingParams params;
    std::shared_ptr<EventSink> sink;
    KvHandoff handoff;
  };
  struct Cancel {
    Ticket ticket;
  };
  struct Reserve {
    std::vector<TokenId> tokens;
    std::function<void(Result<KvReservation>)> done;
  };
  struct Release {
    uint64_t reservation;
  };
  struct Live {
    Ticket ticket;
    std::shared_ptr<EventSink> sink;
  };

  void run();
  void apply(Submit& command);
  void apply(const Cancel& command);
  void publish_load();
  void fail_all(const Status& error);

  std::unique_ptr<StepEngine> engine_;  // touched by the engine thread only
  StepGroup* group_;                     // null: steps on its own
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::variant<Submit, Cancel, Reserve, Release>> commands_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                              // GUARDED_BY(mu_)
  // Why the engine stopped serving when it was not asked to (its step group failed): what later requests are told
  // instead of "the server is shutting down". GUARDED_BY(mu_).
  std::string stop_reason_;
  // ShuttingDown with stop_reason_ (or "the server is shutting down"). REQUIRES: mu_ held.
  Status stopping_status() const;
  Ticket next_ticket_ = 1;                             // GUARDED_BY(mu_)
  // Engine thread only.
  std::unordered_map<SequenceId, Live> live_;
  std::unordered_map<Ticket, SequenceId> sequence_of_;
  std::atomic<int32_t> num_running_{0}, num_waiting_{0}, kv_blocks_used_{0}, kv_blocks_free_{0};
  mutable std::mutex kv_tiers_mu_;
  KvTierStats kv_tiers_;  // GUARDED_BY(kv_tiers_mu_)
  SpeculativeStats speculative_;  // GUARDED_BY(kv_tiers_mu_)
  model::EplbStats eplb_;  // GUARDED_BY(kv_tiers_mu_)
  std::atomic<int64_t> swa_replayed_tokens_{-1};
  std::atomic<int64_t> busy_since_ns_{0};  // steady_clock of the current iteration's start; 0: waiting for work
  std::thread thread_;
};

}  // namespace deepinfer::engine
