// KvOffloadStore: the host tier (a hash map of shared payloads ordered by expiry), the disk tier behind it,
// and one background thread that drains the disk write queue in batches and serves prefetches.
#include "deepinfer/core/check.h"
#include "deepinfer/kvcache/offload_store.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace deepinfer::kvcache {

namespace {
// Writes taken off the queue per lock: large enough to amortize the lock, small enough that a prefetch
// (served first) never waits behind a long run of writes.
constexpr size_t kDiskWriteBatch = 16;
}  // namespace

Status OffloadConfig::validate() const {
  if (block_bytes == 0) return Status::invalid_argument("OffloadConfig: block_bytes must be > 0");
  if (host_capacity_blocks <= 0) {
    return Status::invalid_argument("OffloadConfig: host_capacity_blocks is " + std::to_string(host_capacity_blocks) +
                                    "; the host tier needs at least one block (the disk tier loads through it)");
  }
  if (!(low_watermark > 0 && low_watermark <= high_watermark && high_watermark <= 1.0)) {
    return Status::invalid_argument("OffloadConfig: watermarks low " + std::to_string(low_watermark) + ", high " +
                                    std::to_string(high_watermark) + "; need 0 < low <= high <= 1");
  }
  if (!(evict_bytes_per_s > 0)) {
    return Status::invalid_argument("OffloadConfig: evict_bytes_per_s is " + std::to_string(evict_bytes_per_s) +
                                    "; it must be positive");
  }
  if (Status status = retention.validate(); !status.ok()) return status;
  if (disk.has_value() && disk->block_bytes != block_bytes) {
    return Status::invalid_argument("OffloadConfig: disk.block_bytes " + std::to_string(disk->block_bytes) +
                                    " differs from block_bytes " + std::to_string(block_bytes));
  }
  return Status::ok_status();
}

Result<std::unique_ptr<KvOffloadStore>> KvOffloadStore::create(OffloadConfig config) {
  if (Status status = config.validate(); !status.ok()) return status;
  std::unique_ptr<DiskBlockStore> disk;
  if (config.disk.has_value()) {
    Result<std::unique_ptr<DiskBlockStore>> opened = DiskBlockStore::open(*config.disk);
    if (!opened.ok()) return opened.status();
    disk = std::move(opened).value();
  }
  return std::unique_ptr<KvOffloadStore>(new KvOffloadStore(std::move(config), std::move(disk)));
}

namespace {
double bucket_burst(const OffloadConfig& config) {
  if (config.evict_bytes_per_s == kUnlimited) return 1.0;
  return std::max(config.evict_bytes_per_s, static_cast<double>(config.block_bytes));
}
}  // namespace

KvOffloadStore::KvOffloadStore(OffloadConfig config, std::unique_ptr<DiskBlockStore> disk)
    : config_(std::move(config)), disk_(std::move(disk)), host_bucket_(config_.evict_bytes_per_s, bucket_burst(config_)) {
  counters_.host.capacity_blocks = config_.host_capacity_blocks;
  if (disk_) {
    counters_.disk.capacity_blocks = config_.disk->capacity_blocks;
    background_ = std::thread([this] { run_background(); });
  }
}

KvOffloadStore::~KvOffloadStore() {
  if (!background_.joinable()) return;
  flush();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  background_.join();
}

bool KvOffloadStore::host_live_locked(const BlockHash& hash, int64_t now_ms) const {
  auto it = host_.find(hash);
  return it != host_.end() && it->second.expiry_ms > now_ms;
}

void KvOffloadStore::host_erase_locked(const BlockHash& hash) {
  auto it = host_.find(hash);
  if (it == host_.end()) return;
  host_by_expiry_.erase({it->second.expiry_ms, hash});
  host_.erase(it);
}

void KvOffloadStore::touch_locked(const BlockHash& hash, int64_t expiry_ms) {
  auto it = host_.find(hash);
  if (it == host_.end() || expiry_ms <= it->second.expiry_ms) return;
  host_by_expiry_.erase({it->second.expiry_ms, hash});
  it->second.expiry_ms = expiry_ms;
  host_by_expiry_.insert({expiry_ms, hash});
}

bool KvOffloadStore::host_insert_locked(const BlockHash& hash, std::shared_ptr<const std::vector<std::byte>> payload,
                                        int64_t expiry_ms, int64_t now_ms, const BlockHash& parent,
                                        std::span<const TokenId> token_ids, bool prefetched) {
  if (host_.contains(hash)) {
    touch_locked(hash, expiry_ms);
    return true;
  }
  if (static_cast<int64_t>(host_.size()) >= config_.host_capacity_blocks) {
    // Full: one eviction for one admission, and only with a token; an expired copy goes first (free of charge
    // in spirit, but still paid: the bucket bounds all eviction work).
    host_bucket_.refill(now_ms);
    if (host_by_expiry_.empty() || !host_bucket_.try_take(static_cast<double>(config_.block_bytes))) {
      ++counters_.host.refused_blocks;
      return false;
    }
    auto victim = host_by_expiry_.begin();
    if (victim->first <= now_ms) {
      ++counters_.host.expired_blocks;
    } else {
      ++counters_.host.evicted_blocks;
    }
    if (sink_ != nullptr) sink_->publish(KvEvent::removed(kMediumHost, victim->second));
    host_.erase(victim->second);
    host_by_expiry_.erase(victim);
  }
  host_.emplace(hash, HostEntry{std::move(payload), expiry_ms, prefetched});
  host_by_expiry_.insert({expiry_ms, hash});
  if (sink_ != nullptr) sink_->publish(KvEvent::stored(kMediumHost, hash, parent, token_ids));
  ++counters_.host.stored_blocks;
  counters_.host.bytes_written += static_cast<int64_t>(config_.block_bytes);
  return true;
}

void KvOffloadStore::set_event_sink(KvEventSink* sink) {
  std::lock_guard lock(mu_);
  sink_ = sink;
  if (disk_) {
    disk_->set_event_sink(sink);
    if (sink != nullptr) {
      for (const auto& [hash, parent] : disk_->list_blocks()) sink->publish(KvEvent::stored(kMediumDisk, hash, parent, {}));
    }
  }
}

void KvOffloadStore::store(const BlockHash& hash, const BlockHash& parent, std::span<const std::byte> payload,
                           TtlClassId ttl_class, int64_t now_ms, std::span<const TokenId> token_ids) {
  DEEPINFER_CHECK(payload.size() == config_.block_bytes);
  const int64_t expiry_ms = now_ms + config_.retention.ttl_ms(ttl_class);
  std::unique_lock lock(mu_);
  if (host_.contains(hash)) {
    touch_locked(hash, expiry_ms);
    return;
  }
  auto copy = std::make_shared<const std::vector<std::byte>>(payload.begin(), payload.end());
  host_insert_locked(hash, copy, expiry_ms, now_ms, parent, token_ids);
  if (disk_ && !pending_writes_.contains(hash) && !disk_->contains(hash)) {
    pending_writes_.emplace(hash, copy);
    disk_queue_.push_back({hash, parent, std::move(copy), config_.retention.ttl_ms(ttl_class),
                           std::vector<TokenId>(token_ids.begin(), token_ids.end())});
    lock.unlock();
    work_cv_.notify_one();
  }
}

int64_t KvOffloadStore::match(std::span<const BlockHash> chain, int64_t now_ms) {
  std::lock_guard lock(mu_);
  int64_t matched = 0;
  for (const BlockHash& hash : chain) {
    if (!host_live_locked(hash, now_ms)) {
      if (!disk_) break;
      if (!pending_writes_.contains(hash) && !disk_->contains(hash)) break;
    }
    ++matched;
  }
  return matched;
}

void KvOffloadStore::record_miss() {
  std::lock_guard lock(mu_);
  ++counters_.host.miss_blocks;
  if (disk_) ++counters_.disk.miss_blocks;
}

bool KvOffloadStore::load(const BlockHash& hash, std::span<std::byte> out, TtlClassId ttl_class, int64_t now_ms) {
  DEEPINFER_CHECK(out.size() == config_.block_bytes);
  const int64_t expiry_ms = now_ms + config_.retention.ttl_ms(ttl_class);
  {
    std::lock_guard lock(mu_);
    auto it = host_.find(hash);
    if (it != host_.end() && it->second.expiry_ms > now_ms) {
      std::copy(it->second.payload->begin(), it->second.payload->end(), out.begin());
      counters_.host.bytes_read += static_cast<int64_t>(config_.block_bytes);
      if (it->second.prefetched) {
        it->second.prefetched = false;
        ++counters_.host.miss_blocks;
        ++counters_.disk.hit_blocks;
      } else {
        ++counters_.host.hit_blocks;
      }
      touch_locked(hash, expiry_ms);
      return true;
    }
    // Waiting for (or being written by) the disk writer: the bytes are in memory.
    if (auto pending = pending_writes_.find(hash); pending != pending_writes_.end()) {
      std::copy(pending->second->begin(), pending->second->end(), out.begin());
      ++counters_.host.hit_blocks;
      host_insert_locked(hash, pending->second, expiry_ms, now_ms);
      return true;
    }
  }
  if (!disk_) return false;
  if (Status status = disk_->get(hash, out); !status.ok()) return false;
  auto copy = std::make_shared<const std::vector<std::byte>>(out.begin(), out.end());
  std::lock_guard lock(mu_);
  counters_.disk.bytes_read += static_cast<int64_t>(config_.block_bytes);
  ++counters_.host.miss_blocks;
  ++counters_.disk.hit_blocks;
  host_insert_locked(hash, std::move(copy), expiry_ms, now_ms);
  return true;
}

void KvOffloadStore::prefetch(std::span<const BlockHash> chain, TtlClassId ttl_class, int64_t now_ms) {
  if (!disk_) return;
  {
    std::lock_guard lock(mu_);
    for (const BlockHash& hash : chain) {
      if (host_live_locked(hash, now_ms)) continue;
      if (!disk_->contains(hash)) break;  // the match ends here: nothing after it can be used
      prefetch_queue_.push_back({hash, ttl_class, now_ms});
    }
  }
  work_cv_.notify_one();
}

void KvOffloadStore::tick(int64_t now_ms) {
  std::lock_guard lock(mu_);
  host_bucket_.refill(now_ms);
  // Expired copies first, then the watermark band, each paid from the bucket.
  const int64_t capacity = config_.host_capacity_blocks;
  const auto high = static_cast<int64_t>(std::floor(config_.high_watermark * static_cast<double>(capacity)));
  const auto low = static_cast<int64_t>(std::floor(config_.low_watermark * static_cast<double>(capacity)));
  if (static_cast<int64_t>(host_.size()) > high) host_evicting_ = true;
  while (!host_by_expiry_.empty()) {
    auto victim = host_by_expiry_.begin();
    const bool expired = victim->first <= now_ms;
    if (!expired && !(host_evicting_ && static_cast<int64_t>(host_.size()) > low)) break;
    if (!host_bucket_.try_take(static_cast<double>(config_.block_bytes))) break;
    ++(expired ? counters_.host.expired_blocks : counters_.host.evicted_blocks);
    if (sink_ != nullptr) sink_->publish(KvEvent::removed(kMediumHost, victim->second));
    host_.erase(victim->second);
    host_by_expiry_.erase(victim);
  }
  if (static_cast<int64_t>(host_.size()) <= low) host_evicting_ = false;
}

void KvOffloadStore::flush() {
  if (!disk_) return;
  std::unique_lock lock(mu_);
  drain_cv_.wait(lock, [this] { return disk_queue_.empty() && disk_in_flight_ == 0; });
}

void KvOffloadStore::run_background() {
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !disk_queue_.empty() || !prefetch_queue_.empty(); });
    if (stop_ && disk_queue_.empty()) return;
    // Prefetches first: a request is waiting on them.
    if (!prefetch_queue_.empty()) {
      Prefetch prefetch = prefetch_queue_.front();
      prefetch_queue_.pop_front();
      if (host_live_locked(prefetch.hash, prefetch.now_ms)) continue;
      lock.unlock();
      std::vector<std::byte> bytes(config_.block_bytes);
      const bool ok = disk_->get(prefetch.hash, bytes).ok();
      lock.lock();
      if (ok) {
        counters_.disk.bytes_read += static_cast<int64_t>(config_.block_bytes);
        host_insert_locked(prefetch.hash, std::make_shared<const std::vector<std::byte>>(std::move(bytes)),
                           prefetch.now_ms + config_.retention.ttl_ms(prefetch.ttl_class), prefetch.now_ms,
                           kRootBlockHash, {}, /*prefetched=*/true);
      }
      continue;
    }
    std::vector<DiskWrite> batch;
    while (!disk_queue_.empty() && batch.size() < kDiskWriteBatch) {
      batch.push_back(disk_queue_.front());
      disk_queue_.pop_front();
    }
    disk_in_flight_ += static_cast<int64_t>(batch.size());
    lock.unlock();
    int64_t written = 0;
    int64_t failed = 0;
    for (const DiskWrite& write : batch) {
      if (disk_->contains(write.hash)) continue;
      if (disk_->put(write.hash, write.parent, *write.payload, write.ttl_ms, write.token_ids).ok()) {
        ++written;
      } else {
        ++failed;
      }
    }
    lock.lock();
    for (const DiskWrite& write : batch) pending_writes_.erase(write.hash);
    counters_.disk.stored_blocks += written;
    counters_.disk.bytes_written += written * static_cast<int64_t>(config_.block_bytes);
    counters_.disk.refused_blocks += failed;
    disk_in_flight_ -= static_cast<int64_t>(batch.size());
    drain_cv_.notify_all();
  }
}

std::vector<BlockHash> KvOffloadStore::host_blocks() const {
  std::lock_guard lock(mu_);
  std::vector<BlockHash> out;
  for (const auto& [hash, entry] : host_) out.push_back(hash);
  return out;
}

std::vector<BlockHash> KvOffloadStore::disk_blocks() const {
  std::vector<BlockHash> out;
  if (!disk_) return out;
  for (const auto& [hash, parent] : disk_->list_blocks()) out.push_back(hash);
  return out;
}

OffloadCounters KvOffloadStore::counters() const {
  std::lock_guard lock(mu_);
  OffloadCounters counters = counters_;
  counters.host.usage_blocks = static_cast<int64_t>(host_.size());
  counters.disk_queue_blocks = static_cast<int64_t>(disk_queue_.size()) + disk_in_flight_;
  if (disk_) {
    const DiskBlockStoreStats stats = disk_->stats();
    counters.disk.usage_blocks = stats.blocks;
    counters.disk.evicted_blocks = stats.evictions;
    counters.disk.corrupt_blocks = stats.corrupt_dropped + stats.foreign_dropped;
    counters.disk.expired_blocks = stats.expired;
    counters.disk_recovery = disk_->recovery();
  }
  return counters;
}

}  // namespace deepinfer::kvcache
