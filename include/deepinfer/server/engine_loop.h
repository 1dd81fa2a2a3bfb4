// The engine thread: one thread owns the engine and runs its step loop; HTTP threads hand it submits and
// cancels through a mutex-protected queue and get token events back through each request's EventSink.
// The loop steps only while the engine has work and otherwise sleeps on a condition variable.
// StepEngine is the narrow face of the engine the server drives, so tests can put a scripted double behind
// the real server (the real one is engine::Engine, wrapped by wrap_engine).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/engine.h"

namespace deepinfer::server {

// A snapshot of the engine's load, for the running / waiting / KV-block gauges.
struct EngineLoad {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t kv_blocks_used = 0;
  int32_t kv_blocks_free = 0;
  engine::KvTierStats kv_tiers;  // the prefix cache per tier
};

// What the server needs from an engine. Same contract as engine::Engine's methods of the same names;
// called from the engine thread only.
class StepEngine {
 public:
  virtual ~StepEngine() = default;
  virtual Result<engine::SequenceId> submit(std::vector<engine::TokenId> prompt_token_ids,
                                            const engine::SamplingParams& params) = 0;
  virtual Status cancel(engine::SequenceId id) = 0;
  virtual Result<std::vector<engine::TokenEvent>> step() = 0;
  virtual bool has_pending_work() const = 0;
  virtual EngineLoad load() const = 0;
};

// Adapts the real engine. Takes ownership.
std::unique_ptr<StepEngine> wrap_engine(std::unique_ptr<engine::Engine> engine);

// One event for one request: a token or the request's end (engine::TokenEvent), or an error that ends it
// (the engine refused the submit, or a step failed). `error` is Ok for engine events.
struct GenerationEvent {
  engine::TokenEvent event;
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

// Thread-safety: submit(), cancel(), load(), and stop() may be called from any thread.
class EngineLoop {
 public:
  using Ticket = uint64_t;  // the loop's id for a request, assigned at submit, never reused

  // Starts the engine thread. REQUIRES: engine non-null.
  explicit EngineLoop(std::unique_ptr<StepEngine> engine);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request. Its events (or the submit's error) go to `sink`, which the loop keeps until the
  // request's end. Never blocks on the engine.
  Ticket submit(std::vector<engine::TokenId> prompt_token_ids, engine::SamplingParams params,
                std::shared_ptr<EventSink> sink);
  // Cancels a request wherever it is (queued, running, already finished: then nothing happens). Its KV
  // blocks return to the pool in the engine's next step; no further events are delivered.
  void cancel(Ticket ticket);
  // The load after the latest step (or after the latest submit/cancel while idle).
  EngineLoad load() const;
  // Cancels every live request, ends the engine thread and joins it. Idempotent.
  void stop();

 private:
  struct Submit {
    Ticket ticket;
    std::vector<engine::TokenId> prompt;
    engine::SamplingParams params;
    std::shared_ptr<EventSink> sink;
  };
  struct Cancel {
    Ticket ticket;
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
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::variant<Submit, Cancel>> commands_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                              // GUARDED_BY(mu_)
  Ticket next_ticket_ = 1;                             // GUARDED_BY(mu_)
  // Engine thread only.
  std::unordered_map<engine::SequenceId, Live> live_;
  std::unordered_map<Ticket, engine::SequenceId> sequence_of_;
  std::atomic<int32_t> num_running_{0}, num_waiting_{0}, kv_blocks_used_{0}, kv_blocks_free_{0};
  mutable std::mutex kv_tiers_mu_;
  engine::KvTierStats kv_tiers_;  // GUARDED_BY(kv_tiers_mu_)
  std::thread thread_;
};

}  // namespace deepinfer::server
