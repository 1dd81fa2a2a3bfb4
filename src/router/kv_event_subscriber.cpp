#include "kv_event_subscriber.h"

#include <spdlog/spdlog.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace deepinfer::router {
namespace {

constexpr uint64_t kReplayEnd = ~uint64_t{0};
constexpr int kReplayTimeoutMs = 1000;

uint64_t get_u64_be(std::string_view bytes) {
  uint64_t value = 0;
  for (unsigned char c : bytes) value = (value << 8) | c;
  return value;
}

std::string put_u64_be(uint64_t value) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i, value >>= 8) out[static_cast<size_t>(i)] = static_cast<char>(value & 0xff);
  return out;
}

// The frames of one multipart message; empty when none is waiting (or, with a timeout, none came).
std::vector<std::string> receive_frames(void* socket, int flags) {
  std::vector<std::string> frames;
  while (true) {
    zmq_msg_t message;
    zmq_msg_init(&message);
    if (zmq_msg_recv(&message, socket, frames.empty() ? flags : 0) < 0) {
      zmq_msg_close(&message);
      return {};
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&message)), zmq_msg_size(&message));
    const bool more = zmq_msg_more(&message) != 0;
    zmq_msg_close(&message);
    if (!more) return frames;
  }
}

}  // namespace

struct KvEventSubscriber::Subscription {
  int32_t worker = 0;
  std::string endpoint;
  std::string replay_endpoint;
  std::string instance;
  void* sub = nullptr;
  std::optional<uint64_t> expected;  // the next sequence number; nullopt before the first batch
  ~Subscription() {
    if (sub != nullptr) zmq_close(sub);
  }
};

KvEventSubscriber::KvEventSubscriber(KvIndex& index, int32_t num_workers)
    : index_(index), counters_(static_cast<size_t>(num_workers)) {
  context_ = zmq_ctx_new();
  thread_ = std::thread([this] { run(); });
}

KvEventSubscriber::~KvEventSubscriber() {
  stop_ = true;
  thread_.join();
  subs_.clear();
  pending_.clear();
  zmq_ctx_term(context_);
}

void KvEventSubscriber::connect(int32_t worker, std::string endpoint, std::string replay_endpoint,
                                std::string instance) {
  auto sub = std::make_unique<Subscription>();
  sub->worker = worker;
  sub->instance = std::move(instance);
  sub->endpoint = std::move(endpoint);
  sub->replay_endpoint = std::move(replay_endpoint);
  std::lock_guard lock(mu_);
  pending_.push_back(std::move(sub));
}

void KvEventSubscriber::open_pending() {
  std::vector<std::unique_ptr<Subscription>> fresh;
  {
    std::lock_guard lock(mu_);
    fresh.swap(pending_);
  }
  for (auto& sub : fresh) {
    auto same = std::find_if(subs_.begin(), subs_.end(), [&](const auto& s) { return s->worker == sub->worker; });
    if (same != subs_.end()) {
      if ((*same)->endpoint == sub->endpoint && (*same)->replay_endpoint == sub->replay_endpoint &&
          (*same)->instance == sub->instance) {
        continue;
      }
      subs_.erase(same);
      index_.clear_worker(sub->worker);
    }
    sub->sub = zmq_socket(context_, ZMQ_SUB);
    const int linger_ms = 0;
    zmq_setsockopt(sub->sub, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    zmq_setsockopt(sub->sub, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(sub->sub, sub->endpoint.c_str()) != 0) {
      spdlog::warn("router: worker {}: cannot subscribe to KV events at {}: {}", sub->worker, sub->endpoint,
                   zmq_strerror(zmq_errno()));
      continue;
    }
    spdlog::info("router: worker {}: KV events from {}{}", sub->worker, sub->endpoint,
                 sub->replay_endpoint.empty() ? "" : ", replay from " + sub->replay_endpoint);
    // What the worker cached before we came: its history, from the start (a replay that does not answer
    // leaves the index to the live events).
    if (!sub->replay_endpoint.empty() && !replay(*sub, 0)) {
      spdlog::warn("router: worker {}: no answer from the KV event replay at {}", sub->worker, sub->replay_endpoint);
    }
    subs_.push_back(std::move(sub));
  }
}

bool KvEventSubscriber::replay(Subscription& sub, uint64_t from) {
  void* dealer = zmq_socket(context_, ZMQ_DEALER);
  const int linger_ms = 0;
  zmq_setsockopt(dealer, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
  zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &kReplayTimeoutMs, sizeof kReplayTimeoutMs);
  bool answered = false;
  if (zmq_connect(dealer, sub.replay_endpoint.c_str()) == 0) {
    const std::string start = put_u64_be(from);
    zmq_send(dealer, "", 0, ZMQ_SNDMORE);
    zmq_send(dealer, start.data(), start.size(), 0);
    while (true) {
      std::vector<std::string> frames = receive_frames(dealer, 0);  // RCVTIMEO bounds the wait
      if (frames.size() != 3 || frames[1].size() != 8) break;
      const uint64_t seq = get_u64_be(frames[1]);
      if (seq == kReplayEnd) {
        answered = true;
        break;
      }
      if (sub.expected && seq < *sub.expected) continue;
      Result<kvcache::KvEventBatch> batch = kvcache::decode_kv_event_batch(frames[2]);
      if (!batch.ok()) break;
      index_.apply(sub.worker, *batch);
      counters_[static_cast<size_t>(sub.worker)].batches.fetch_add(1);
      sub.expected = seq + 1;
    }
  }
  zmq_close(dealer);
  return answered;
}

void KvEventSubscriber::receive(Subscription& sub) {
  while (true) {
    std::vector<std::string> frames = receive_frames(sub.sub, ZMQ_DONTWAIT);
    if (frames.empty()) return;
    if (frames.size() != 3 || frames[1].size() != 8) continue;  // not a KV event batch
    const uint64_t seq = get_u64_be(frames[1]);
    Counters& counters = counters_[static_cast<size_t>(sub.worker)];
    if (sub.expected && seq < *sub.expected) continue;  // a replay applied it already
    if (sub.expected && seq > *sub.expected) {
      counters.gaps.fetch_add(1);
      const bool replayed = !sub.replay_endpoint.empty() && replay(sub, *sub.expected);
      if (replayed && *sub.expected > seq) continue;  // the replay brought this one too
      if (!replayed) {
        spdlog::warn("router: worker {}: KV event batches {}..{} lost; its index entries dropped", sub.worker,
                     *sub.expected, seq - 1);
        index_.clear_worker(sub.worker);
      }
    }
    Result<kvcache::KvEventBatch> batch = kvcache::decode_kv_event_batch(frames[2]);
    sub.expected = seq + 1;
    if (!batch.ok()) {
      spdlog::warn("router: worker {}: a malformed KV event batch ignored: {}", sub.worker, batch.status().to_string());
      continue;
    }
    index_.apply(sub.worker, *batch);
    counters.batches.fetch_add(1);
  }
}

void KvEventSubscriber::run() {
  while (!stop_) {
    open_pending();
    std::vector<zmq_pollitem_t> items;
    for (const auto& sub : subs_) items.push_back({sub->sub, 0, ZMQ_POLLIN, 0});
    if (items.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (zmq_poll(items.data(), static_cast<int>(items.size()), 50) <= 0) continue;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].revents & ZMQ_POLLIN) receive(*subs_[i]);
    }
  }
}

}  // namespace deepinfer::router
