// KV events: vLLM's msgpack schema (msgpack-cxx) and the ZeroMQ PUB + ROUTER replay publisher.
#include "deepinfer/kvcache/kv_events.h"

#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <msgpack.hpp>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace deepinfer::kvcache {
namespace {

void hash_bytes(const BlockHash& hash, char out[16]) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((hash.high >> (56 - 8 * i)) & 0xff);
    out[8 + i] = static_cast<char>((hash.low >> (56 - 8 * i)) & 0xff);
  }
}

template <class Packer>
void pack_hash(Packer& packer, const BlockHash& hash) {
  char bytes[16];
  hash_bytes(hash, bytes);
  packer.pack_bin(16);
  packer.pack_bin_body(bytes, 16);
}

std::optional<BlockHash> unpack_hash(const msgpack::object& object) {
  if (object.type == msgpack::type::BIN && object.via.bin.size == 16) {
    BlockHash hash;
    for (int i = 0; i < 8; ++i) {
      hash.high = (hash.high << 8) | static_cast<unsigned char>(object.via.bin.ptr[i]);
      hash.low = (hash.low << 8) | static_cast<unsigned char>(object.via.bin.ptr[8 + i]);
    }
    return hash;
  }
  if (object.type == msgpack::type::POSITIVE_INTEGER) return BlockHash{object.via.u64, 0};  // vLLM's int hashes
  return std::nullopt;
}

std::string_view str_of(const msgpack::object& object) {
  return object.type == msgpack::type::STR ? std::string_view(object.via.str.ptr, object.via.str.size)
                                           : std::string_view();
}

void put_u64_be(uint64_t value, unsigned char out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>((value >> (56 - 8 * i)) & 0xff);
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

KvEvent KvEvent::stored(std::string_view medium, const BlockHash& hash, const BlockHash& parent,
                        std::span<const TokenId> token_ids) {
  KvEvent event;
  event.kind = Kind::kBlockStored;
  event.block_hashes = {hash};
  if (parent != kRootBlockHash) event.parent_block_hash = parent;
  event.token_ids.assign(token_ids.begin(), token_ids.end());
  event.medium = std::string(medium);
  return event;
}

void order_parents_first(std::vector<KvEvent>& events) {
  // A block on a medium: where its BlockStored and BlockRemoved events are in the batch (ascending).
  struct Key {
    BlockHash hash;
    std::string_view medium;
    bool operator==(const Key&) const = default;
  };
  struct KeyHasher {
    size_t operator()(const Key& k) const {
      return BlockHashHasher()(k.hash) ^ (std::hash<std::string_view>()(k.medium) * 0x9e3779b97f4a7c15ULL);
    }
  };
  std::unordered_map<Key, std::vector<size_t>, KeyHasher> stored_at, removed_at;
  std::vector<size_t> cleared_at;
  bool any_parent = false;
  for (size_t i = 0; i < events.size(); ++i) {
    const KvEvent& e = events[i];
    if (e.kind == KvEvent::Kind::kAllBlocksCleared) {
      cleared_at.push_back(i);
      continue;
    }
    auto& at = e.kind == KvEvent::Kind::kBlockStored ? stored_at : removed_at;
    for (const BlockHash& hash : e.block_hashes) at[Key{hash, e.medium}].push_back(i);
    any_parent = any_parent || (e.kind == KvEvent::Kind::kBlockStored && e.parent_block_hash.has_value());
  }
  if (!any_parent) return;
  // Whether sorted `at` holds an index in (i, j).
  auto between = [](const std::vector<size_t>& at, size_t i, size_t j) {
    auto it = std::upper_bound(at.begin(), at.end(), i);
    return it != at.end() && *it < j;
  };
  // The events go out in order; before event `first` goes out, the stored events its chain of parents needs are
  // pulled ahead of it. A pulled event passes every event not yet out between `first` and its own place, so it
  // may not pass a removal of its block or a clear there (removals and clears are never pulled: those not yet out
  // are exactly those after `first`). `held` is what a subscriber holds after the events out so far.
  std::vector<char> emitted(events.size(), 0);
  std::vector<size_t> order;
  order.reserve(events.size());
  std::unordered_set<Key, KeyHasher> held;
  auto emit = [&](size_t i) {
    order.push_back(i);
    const KvEvent& e = events[i];
    if (e.kind == KvEvent::Kind::kAllBlocksCleared) {
      held.clear();
      return;
    }
    for (const BlockHash& hash : e.block_hashes) {
      if (e.kind == KvEvent::Kind::kBlockStored) {
        held.insert(Key{hash, e.medium});
      } else {
        held.erase(Key{hash, e.medium});
      }
    }
  };
  // Whether stored event j may go out just before `first`: no removal of any of its blocks, and no clear, between.
  auto may_pass = [&](size_t j, size_t first) {
    if (between(cleared_at, first, j)) return false;
    for (const BlockHash& hash : events[j].block_hashes) {
      auto r = removed_at.find(Key{hash, events[j].medium});
      if (r != removed_at.end() && between(r->second, first, j)) return false;
    }
    return true;
  };
  std::vector<size_t> stack;
  for (size_t first = 0; first < events.size(); ++first) {
    if (emitted[first]) continue;
    stack.push_back(first);
    emitted[first] = 1;
    while (!stack.empty()) {
      const size_t i = stack.back();
      const KvEvent& e = events[i];
      size_t parent_event = events.size();
      if (e.kind == KvEvent::Kind::kBlockStored && e.parent_block_hash.has_value()) {
        const Key parent{*e.parent_block_hash, e.medium};
        auto s = stored_at.find(parent);
        if (!held.contains(parent) && s != stored_at.end()) {
          // The parent's first store not yet out, after `first` (earlier ones are out).
          auto j = std::upper_bound(s->second.begin(), s->second.end(), first);
          while (j != s->second.end() && emitted[*j]) ++j;
          if (j != s->second.end() && may_pass(*j, first)) parent_event = *j;
        }
      }
      if (parent_event < events.size()) {
        emitted[parent_event] = 1;
        stack.push_back(parent_event);
        continue;
      }
      emit(i);
      stack.pop_back();
    }
  }
  std::vector<KvEvent> sorted;
  sorted.reserve(events.size());
  for (size_t i : order) sorted.push_back(std::move(events[i]));
  events = std::move(sorted);
}

KvEvent KvEvent::removed(std::string_view medium, const BlockHash& hash) {
  KvEvent event;
  event.kind = Kind::kBlockRemoved;
  event.block_hashes = {hash};
  event.medium = std::string(medium);
  return event;
}

KvEvent KvEvent::all_cleared() {
  KvEvent event;
  event.kind = Kind::kAllBlocksCleared;
  return event;
}

std::string encode_kv_event_batch(const KvEventBatch& batch) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  packer.pack_array(2);
  packer.pack_double(batch.ts);
  packer.pack_array(static_cast<uint32_t>(batch.events.size()));
  for (const KvEvent& event : batch.events) {
    switch (event.kind) {
      case KvEvent::Kind::kBlockStored:
        packer.pack_array(7);
        packer.pack(std::string_view("BlockStored"));
        packer.pack_array(static_cast<uint32_t>(event.block_hashes.size()));
        for (const BlockHash& hash : event.block_hashes) pack_hash(packer, hash);
        if (event.parent_block_hash) {
          pack_hash(packer, *event.parent_block_hash);
        } else {
          packer.pack_nil();
        }
        packer.pack_array(static_cast<uint32_t>(event.token_ids.size()));
        for (TokenId token : event.token_ids) packer.pack_int32(token);
        packer.pack_int32(event.block_size);
        packer.pack_nil();  // lora_id
        packer.pack(event.medium);
        break;
      case KvEvent::Kind::kBlockRemoved:
        packer.pack_array(3);
        packer.pack(std::string_view("BlockRemoved"));
        packer.pack_array(static_cast<uint32_t>(event.block_hashes.size()));
        for (const BlockHash& hash : event.block_hashes) pack_hash(packer, hash);
        packer.pack(event.medium);
        break;
      case KvEvent::Kind::kAllBlocksCleared:
        packer.pack_array(1);
        packer.pack(std::string_view("AllBlocksCleared"));
        break;
    }
  }
  return std::string(buffer.data(), buffer.size());
}

Result<KvEventBatch> decode_kv_event_batch(std::string_view payload) {
  msgpack::object_handle handle;
  try {
    handle = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception& e) {
    return Status::corruption(std::string("KV event batch: not msgpack: ") + e.what());
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::ARRAY || root.via.array.size < 2 ||
      root.via.array.ptr[1].type != msgpack::type::ARRAY) {
    return Status::corruption("KV event batch: expected [ts, [events...], ...]");
  }
  KvEventBatch batch;
  const msgpack::object& ts = root.via.array.ptr[0];
  if (ts.type == msgpack::type::FLOAT64 || ts.type == msgpack::type::FLOAT32) batch.ts = ts.via.f64;
  const msgpack::object_array& events = root.via.array.ptr[1].via.array;
  for (uint32_t i = 0; i < events.size; ++i) {
    const msgpack::object& item = events.ptr[i];
    const std::string where = "KV event batch: event " + std::to_string(i);
    if (item.type != msgpack::type::ARRAY || item.via.array.size < 1) return Status::corruption(where + " is not a tagged array");
    const msgpack::object* f = item.via.array.ptr;
    const uint32_t n = item.via.array.size;
    const std::string_view tag = str_of(f[0]);
    KvEvent event;
    auto hashes = [&](const msgpack::object& list) -> Status {
      if (list.type != msgpack::type::ARRAY) return Status::corruption(where + ": block_hashes is not an array");
      for (uint32_t h = 0; h < list.via.array.size; ++h) {
        std::optional<BlockHash> hash = unpack_hash(list.via.array.ptr[h]);
        if (!hash) return Status::corruption(where + ": a block hash is neither 16 bytes nor an integer");
        event.block_hashes.push_back(*hash);
      }
      return Status();
    };
    if (tag == "BlockStored") {
      if (n < 5) return Status::corruption(where + ": BlockStored has " + std::to_string(n) + " fields");
      event.kind = KvEvent::Kind::kBlockStored;
      if (Status s = hashes(f[1]); !s.ok()) return s;
      if (f[2].type != msgpack::type::NIL) {
        event.parent_block_hash = unpack_hash(f[2]);
        if (!event.parent_block_hash) return Status::corruption(where + ": bad parent_block_hash");
      }
      if (f[3].type != msgpack::type::ARRAY) return Status::corruption(where + ": token_ids is not an array");
      for (uint32_t t = 0; t < f[3].via.array.size; ++t) {
        const msgpack::object& token = f[3].via.array.ptr[t];
        if (token.type != msgpack::type::POSITIVE_INTEGER) return Status::corruption(where + ": a token id is not an integer");
        event.token_ids.push_back(static_cast<TokenId>(token.via.u64));
      }
      if (f[4].type != msgpack::type::POSITIVE_INTEGER) return Status::corruption(where + ": block_size is not an integer");
      event.block_size = static_cast<int32_t>(f[4].via.u64);
      if (n >= 7) event.medium = std::string(str_of(f[6]));
    } else if (tag == "BlockRemoved") {
      if (n < 2) return Status::corruption(where + ": BlockRemoved has " + std::to_string(n) + " fields");
      event.kind = KvEvent::Kind::kBlockRemoved;
      if (Status s = hashes(f[1]); !s.ok()) return s;
      if (n >= 3) event.medium = std::string(str_of(f[2]));
    } else if (tag == "AllBlocksCleared") {
      event.kind = KvEvent::Kind::kAllBlocksCleared;
    } else {
      return Status::corruption(where + ": unknown tag '" + std::string(tag) + "'");
    }
    batch.events.push_back(std::move(event));
  }
  return batch;
}

struct KvEventPublisher::Impl {
  KvEventPublisherConfig config;
  void* context = nullptr;
  void* pub = nullptr;
  void* replay = nullptr;
  std::mutex mu;
  std::vector<KvEvent> pending;                     // GUARDED_BY(mu)
  std::deque<std::pair<uint64_t, std::string>> to_send;  // GUARDED_BY(mu)
  uint64_t next_sequence = 0;                       // GUARDED_BY(mu)
  bool stopping = false;                            // GUARDED_BY(mu)
  std::chrono::steady_clock::time_point last_flush = std::chrono::steady_clock::now();  // GUARDED_BY(mu)
  std::deque<std::pair<uint64_t, std::string>> buffer;  // publisher thread only: batches kept for replay
  std::thread thread;

  void flush_locked() {
    last_flush = std::chrono::steady_clock::now();
    if (pending.empty()) return;
    KvEventBatch batch{unix_seconds(), std::move(pending)};
    pending.clear();
    order_parents_first(batch.events);
    to_send.emplace_back(next_sequence++, encode_kv_event_batch(batch));
  }

  static void send_frames(void* socket, std::initializer_list<std::string_view> frames) {
    size_t i = 0;
    for (std::string_view frame : frames) {
      const int flags = ++i < frames.size() ? ZMQ_SNDMORE : 0;
      zmq_send(socket, frame.data(), frame.size(), flags);
    }
  }

  void service_replay() {
    std::vector<std::string> frames;
    while (true) {
      zmq_msg_t message;
      zmq_msg_init(&message);
      if (zmq_msg_recv(&message, replay, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&message);
        break;
      }
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&message)), zmq_msg_size(&message));
      const bool more = zmq_msg_more(&message) != 0;
      zmq_msg_close(&message);
      if (!more) break;
    }
    if (frames.size() != 3 || frames[2].size() != 8) return;  // not a replay request: ignored
    uint64_t start = 0;
    for (unsigned char c : frames[2]) start = (start << 8) | c;
    unsigned char sequence[8];
    for (const auto& [seq, payload] : buffer) {
      if (seq < start) continue;
      put_u64_be(seq, sequence);
      send_frames(replay, {frames[0], "", std::string_view(reinterpret_cast<char*>(sequence), 8), payload});
    }
    put_u64_be(~uint64_t{0}, sequence);
    send_frames(replay, {frames[0], "", std::string_view(reinterpret_cast<char*>(sequence), 8), ""});
  }

  void run() {
    while (true) {
      std::deque<std::pair<uint64_t, std::string>> batches;
      bool stop = false;
      {
        std::lock_guard lock(mu);
        if (std::chrono::steady_clock::now() - last_flush > std::chrono::milliseconds(config.flush_interval_ms)) {
          flush_locked();
        }
        batches.swap(to_send);
        stop = stopping;
      }
      unsigned char sequence[8];
      for (auto& [seq, payload] : batches) {
        put_u64_be(seq, sequence);
        send_frames(pub, {config.topic, std::string_view(reinterpret_cast<char*>(sequence), 8), payload});
        buffer.emplace_back(seq, std::move(payload));
        while (buffer.size() > config.buffer_batches) buffer.pop_front();
      }
      if (stop) return;
      if (replay != nullptr) {
        zmq_pollitem_t item{replay, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 10) > 0) service_replay();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

  ~Impl() {
    if (pub != nullptr) zmq_close(pub);
    if (replay != nullptr) zmq_close(replay);
    if (context != nullptr) zmq_ctx_term(context);
  }
};

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::start(KvEventPublisherConfig config) {
  if (config.endpoint.empty()) return Status::invalid_argument("--kv-events-endpoint is empty");
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  impl->context = zmq_ctx_new();
  impl->pub = zmq_socket(impl->context, ZMQ_PUB);
  const int linger_ms = 1000;  // on shutdown, queued batches get a second to leave
  zmq_setsockopt(impl->pub, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
  if (zmq_bind(impl->pub, impl->config.endpoint.c_str()) != 0) {
    return Status::invalid_argument("--kv-events-endpoint " + impl->config.endpoint + ": cannot bind: " +
                                    zmq_strerror(zmq_errno()) + " (a ZeroMQ endpoint: tcp://HOST:PORT or ipc://PATH)");
  }
  if (!impl->config.replay_endpoint.empty()) {
    impl->replay = zmq_socket(impl->context, ZMQ_ROUTER);
    zmq_setsockopt(impl->replay, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    if (zmq_bind(impl->replay, impl->config.replay_endpoint.c_str()) != 0) {
      return Status::invalid_argument("--kv-events-replay-endpoint " + impl->config.replay_endpoint +
                                      ": cannot bind: " + zmq_strerror(zmq_errno()));
    }
  }
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard lock(impl_->mu);
    impl_->flush_locked();
    impl_->stopping = true;
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

void KvEventPublisher::publish(KvEvent event) {
  std::lock_guard lock(impl_->mu);
  impl_->pending.push_back(std::move(event));
}

void KvEventPublisher::flush() {
  std::lock_guard lock(impl_->mu);
  impl_->flush_locked();
}

uint64_t KvEventPublisher::num_batches() const {
  std::lock_guard lock(impl_->mu);
  return impl_->next_sequence;
}

}  // namespace deepinfer::kvcache
