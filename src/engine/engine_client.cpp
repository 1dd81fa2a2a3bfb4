// InProcessEngineClient: drain the command queue, step while there is work, hand each request its events.
#include "deepinfer/engine/engine_client.h"

#include <spdlog/spdlog.h>

#include "deepinfer/core/check.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

namespace deepinfer::engine {
namespace {

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class EngineAdapter final : public StepEngine {
 public:
  explicit EngineAdapter(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
  Result<SequenceId> submit(std::vector<TokenId> prompt,
                                    const SamplingParams& params) override {
    return engine_->submit(std::move(prompt), params);
  }
  Result<SequenceId> submit_with_kv(std::vector<TokenId> prompt, const SamplingParams& params,
                                    KvHandoff handoff) override {
    return engine_->submit(std::move(prompt), params, std::move(handoff));
  }
  Result<KvReservation> reserve_kv_blocks(std::span<const TokenId> tokens) override {
    return engine_->reserve_kv_blocks(tokens);
  }
  void release_kv_blocks(uint64_t reservation) override { engine_->release_kv_blocks(reservation); }
  Status cancel(SequenceId id) override { return engine_->cancel(id); }
  Result<std::vector<TokenEvent>> step() override { return engine_->step(); }
  bool idle_tick() override { return engine_->idle_tick(); }
  bool has_background_work() const override { return engine_->has_background_work(); }
  Status set_lockstep(bool on) override { return engine_->set_lockstep(on); }
  bool has_pending_work() const override { return engine_->has_pending_work(); }
  EngineLoad load() const override {
    const Scheduler& scheduler = engine_->scheduler();
    return {scheduler.num_running(), scheduler.num_waiting(), scheduler.block_pool().num_used(),
            scheduler.block_pool().num_free(), engine_->kv_tier_stats(), engine_->speculative_stats(),
            engine_->eplb_stats(), engine_->num_replayed_tokens()};
  }

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace

std::unique_ptr<StepEngine> wrap_engine(std::unique_ptr<Engine> engine) {
  return std::make_unique<EngineAdapter>(std::move(engine));
}

std::unique_ptr<EngineClient> make_in_process_client(std::unique_ptr<Engine> engine, StepGroup* group) {
  if (group != nullptr) DEEPINFER_CHECK(engine->set_lockstep(true).ok(), "a lock-step engine (Engine::set_lockstep)");
  return std::make_unique<InProcessEngineClient>(wrap_engine(std::move(engine)), group);
}

InProcessEngineClient::InProcessEngineClient(std::unique_ptr<StepEngine> engine, StepGroup* group)
    : engine_(std::move(engine)), group_(group) {
  publish_load();
  thread_ = std::thread([this] { run(); });
}

InProcessEngineClient::~InProcessEngineClient() { stop(); }

EngineClient::Ticket InProcessEngineClient::submit(std::vector<TokenId> prompt, SamplingParams params,
                                      std::shared_ptr<EventSink> sink, KvHandoff handoff) {
  Ticket ticket;
  bool stopped = false;
  Status why;
  {
    std::lock_guard lock(mu_);
    ticket = next_ticket_++;
    stopped = stopping_;
    if (!stopped) commands_.push_back(Submit{ticket, std::move(prompt), std::move(params), sink, std::move(handoff)});
    if (stopped) why = stopping_status();
  }
  if (stopped) {  // the engine thread is gone: answer here
    GenerationEvent event;
    event.event.finished = true;
    event.event.finish_reason = FinishReason::kCancelled;
    event.error = why;
    sink->deliver({std::move(event)});
    return ticket;
  }
  wake_.notify_one();
  return ticket;
}

Status InProcessEngineClient::stopping_status() const {
  return Status::shutting_down(stop_reason_.empty() ? "the server is shutting down" : stop_reason_);
}

void InProcessEngineClient::cancel(Ticket ticket) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    commands_.push_back(Cancel{ticket});
  }
  wake_.notify_one();
}

void InProcessEngineClient::reserve_kv_blocks(std::vector<TokenId> tokens,
                                              std::function<void(Result<KvReservation>)> done) {
  Status why;
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      commands_.push_back(Reserve{std::move(tokens), std::move(done)});
      done = nullptr;
    } else {
      why = stopping_status();
    }
  }
  if (done) {  // the engine thread is gone: answer here
    done(why);
    return;
  }
  wake_.notify_one();
}

void InProcessEngineClient::release_kv_blocks(uint64_t reservation) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    commands_.push_back(Release{reservation});
  }
  wake_.notify_one();
}

EngineLoad InProcessEngineClient::load() const {
  const int64_t since = busy_since_ns_.load();
  const double busy = since == 0 ? 0.0 : static_cast<double>(steady_now_ns() - since) * 1e-9;
  std::lock_guard lock(kv_tiers_mu_);
  return {num_running_.load(), num_waiting_.load(), kv_blocks_used_.load(), kv_blocks_free_.load(), kv_tiers_,
          speculative_, eplb_, swa_replayed_tokens_.load(), std::max(busy, 0.0)};
}

void InProcessEngineClient::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void InProcessEngineClient::publish_load() {
  EngineLoad load = engine_->load();
  num_running_ = load.num_running;
  num_waiting_ = load.num_waiting;
  kv_blocks_used_ = load.kv_blocks_used;
  kv_blocks_free_ = load.kv_blocks_free;
  std::lock_guard lock(kv_tiers_mu_);
  kv_tiers_ = load.kv_tiers;
  speculative_ = std::move(load.speculative);
  eplb_ = std::move(load.eplb);
  swa_replayed_tokens_ = load.swa_replayed_tokens;
}

void InProcessEngineClient::apply(Submit& command) {
  Result<SequenceId> id = command.handoff.empty()
                              ? engine_->submit(std::move(command.prompt), command.params)
                              : engine_->submit_with_kv(std::move(command.prompt), command.params, std::move(command.handoff));
  if (!id.ok()) {
    GenerationEvent event;
    event.event.finished = true;
    event.event.finish_reason = FinishReason::kAborted;
    event.error = id.status();
    command.sink->deliver({std::move(event)});
    return;
  }
  live_[*id] = Live{command.ticket, std::move(command.sink)};
  sequence_of_[command.ticket] = *id;
}

void InProcessEngineClient::apply(const Cancel& command) {
  auto it = sequence_of_.find(command.ticket);
  if (it == sequence_of_.end()) return;  // already finished (or its submit failed)
  const SequenceId id = it->second;
  sequence_of_.erase(it);
  live_.erase(id);  // the requester is gone: its finish event is dropped
  if (Status s = engine_->cancel(id); !s.ok()) spdlog::debug("engine cancel of sequence {}: {}", id, s.to_string());
}

void InProcessEngineClient::fail_all(const Status& error) {
  for (auto& [id, live] : live_) {
    (void)engine_->cancel(id);
    GenerationEvent event;
    event.event.id = id;
    event.event.finished = true;
    event.event.finish_reason = FinishReason::kAborted;
    event.error = error;
    live.sink->deliver({std::move(event)});
  }
  live_.clear();
  sequence_of_.clear();
}

void InProcessEngineClient::run() {
  std::deque<std::variant<Submit, Cancel, Reserve, Release>> commands;
  // While idle with KV transfers in flight (blocks on their way to disk): how often the loop takes them in.
  constexpr auto kBackgroundPoll = std::chrono::milliseconds(10);
  // While idle otherwise: how often the KV cache's retention runs (expired blocks leave every tier, their disk
  // files too, without waiting for the next request; a break-it pass saw them stay on an idle server).
  constexpr auto kIdleTick = std::chrono::seconds(1);
  bool background = false;  // the last idle tick left KV cache work (engine_->idle_tick())
  while (true) {
    bool stopping = false;
    Status stopped_with;
    busy_since_ns_ = 0;
    {
      std::unique_lock lock(mu_);
      auto ready = [&] { return stopping_ || !commands_.empty() || engine_->has_pending_work(); };
      if (group_ != nullptr) {
        wake_.wait_for(lock, group_->idle_poll(), ready);  // the group may have work while this engine has none
      } else if (background) {
        wake_.wait_for(lock, kBackgroundPoll, ready);  // the KV cache's transfers go on without steps
      } else {
        wake_.wait_for(lock, kIdleTick, ready);
      }
      commands.swap(commands_);
      stopping = stopping_;
      if (stopping) stopped_with = stopping_status();
    }
    busy_since_ns_ = steady_now_ns();
    for (auto& command : commands) {
      if (auto* submit = std::get_if<Submit>(&command)) {
        if (stopping) {
          GenerationEvent event;
          event.event.finished = true;
          event.event.finish_reason = FinishReason::kCancelled;
          event.error = stopped_with;
          submit->sink->deliver({std::move(event)});
        } else {
          apply(*submit);
        }
      } else if (auto* reserve = std::get_if<Reserve>(&command)) {
        reserve->done(stopping ? Result<KvReservation>(stopped_with)
                               : engine_->reserve_kv_blocks(reserve->tokens));
      } else if (auto* release = std::get_if<Release>(&command)) {
        engine_->release_kv_blocks(release->reservation);
      } else {
        apply(std::get<Cancel>(command));
      }
    }
    commands.clear();
    if (stopping) {
      fail_all(stopped_with);
      if (group_ != nullptr) {
        // The others' tokens need this engine's experts: it keeps making the group's passes until every engine stops
        // with no work left (an orchestrator stopping every rank: they leave together, nothing fails), or until the
        // group's stop deadline (a rank stopped alone: the others then fail, naming it).
        const auto deadline = group_->stop_deadline();
        while (std::chrono::steady_clock::now() < deadline) {
          Result<StepGroup::StopPoll> poll = group_->stop_poll(engine_->has_pending_work());
          if (!poll.ok() || (poll->all_stopping && !poll->any_pending)) break;
          if (!poll->any_pending) {
            std::this_thread::sleep_for(group_->idle_poll());
          } else if (!engine_->step().ok()) {
            break;
          }
        }
        // The cancellations below need no pass: this engine leaves the group here.
        (void)engine_->set_lockstep(false);
        group_->leave();
      }
      // Let the cancellations take effect so the blocks are accounted for.
      while (engine_->has_pending_work()) {
        if (!engine_->step().ok()) break;
      }
      publish_load();
      return;
    }
    bool step = engine_->has_pending_work();
    if (group_ != nullptr) {
      Result<bool> any = group_->any_pending(step);
      if (!any.ok()) {
        spdlog::error("data-parallel group: {}", any.status().to_string());
        const Status failed = any.status().code() == StatusCode::kShuttingDown
                                  ? any.status()
                                  : Status::shutting_down(any.status().message());
        {
          std::lock_guard lock(mu_);
          stop_reason_ = failed.message();  // what the requests that come while the server stops are told
        }
        fail_all(failed);
        (void)engine_->set_lockstep(false);
        group_->stop_after_failure();
        group_ = nullptr;  // gone: this engine steps alone until the server stops
        publish_load();
        continue;
      }
      step = *any;
    }
    if (!step) {
      background = engine_->idle_tick();  // idle: hand the KV cache's transfers on, take their completions in
    } else {
      Result<std::vector<TokenEvent>> events = engine_->step();
      if (!events.ok()) {
        spdlog::error("engine step failed: {}", events.status().to_string());
        // ShuttingDown: the step cannot run again (a tensor-parallel rank is gone), and says why; anything else is
        // the engine's fault, not the requests' to read about.
        fail_all(events.status().code() == StatusCode::kShuttingDown ? events.status()
                                                                     : Status::internal("the engine failed"));
      } else {
        // Group by request, keeping order, so each sink is woken once per step.
        std::unordered_map<SequenceId, std::vector<GenerationEvent>> grouped;
        for (TokenEvent& event : *events) {
          if (!live_.contains(event.id)) continue;  // cancelled by its requester
          grouped[event.id].push_back(GenerationEvent{std::move(event), Status()});
        }
        for (auto& [id, list] : grouped) {
          auto live = live_.find(id);
          const bool finished = list.back().event.finished;
          live->second.sink->deliver(std::move(list));
          if (finished) {
            sequence_of_.erase(live->second.ticket);
            live_.erase(live);
          }
        }
      }
      background = engine_->has_background_work();
    }
    publish_load();
  }
}

}  // namespace deepinfer::engine
