// Internal to the router: one thread that subscribes to every worker's KV events (ZeroMQ SUB, vLLM's schema,
// kvcache/kv_events.h) and applies them to the KvIndex. Sequence numbers are checked per worker: on a gap the
// missing batches are asked from the worker's replay endpoint (ZeroMQ DEALER, answered within 1 s) and, when
// that cannot fill it, the worker's entries are dropped (they would be stale) and indexing goes on from the
// batch received. When a worker is connected, its history is replayed from sequence 0 so that a router
// started after its workers sees what they already cache; a worker that restarted (another instance id in its
// /worker/info) is connected afresh, its old entries dropped.
//
// Thread-safety: connect() and the counters may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/router/kv_index.h"

namespace deepinfer::router {

class KvEventSubscriber {
 public:
  KvEventSubscriber(KvIndex& index, int32_t num_workers);
  ~KvEventSubscriber();  // stops the thread, closes the sockets
  KvEventSubscriber(const KvEventSubscriber&) = delete;
  KvEventSubscriber& operator=(const KvEventSubscriber&) = delete;

  // (Re)subscribes `worker` to `endpoint` (and replays from `replay_endpoint` when not empty). Asynchronous:
  // the subscriber thread connects on its next turn. The same endpoints and `instance` again: a no-op; else the
  // worker's entries are dropped and it is subscribed afresh.
  void connect(int32_t worker, std::string endpoint, std::string replay_endpoint, std::string instance);

  uint64_t batches(int32_t worker) const { return counters_[static_cast<size_t>(worker)].batches.load(); }
  uint64_t gaps(int32_t worker) const { return counters_[static_cast<size_t>(worker)].gaps.load(); }

 private:
  struct Counters {
    std::atomic<uint64_t> batches{0};
    std::atomic<uint64_t> gaps{0};
  };
  struct Subscription;
  void run();
  void open_pending();
  void receive(Subscription& sub);
  // Asks sub's replay endpoint for the batches from `from` on and applies them (sub.expected moves past them);
  // false when the replay did not answer within 1 s.
  bool replay(Subscription& sub, uint64_t from);

  KvIndex& index_;
  std::vector<Counters> counters_;
  void* context_ = nullptr;
  std::mutex mu_;
  std::vector<std::unique_ptr<Subscription>> pending_;  // GUARDED_BY(mu_): connect() requests
  std::vector<std::unique_ptr<Subscription>> subs_;     // subscriber thread only
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace deepinfer::router
