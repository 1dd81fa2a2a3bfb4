#include "deepinfer/router/kv_index.h"

#include <algorithm>

#include "deepinfer/core/check.h"

namespace deepinfer::router {
namespace {

constexpr uint8_t kDeviceBit = 1;
constexpr uint8_t kHostBit = 2;
constexpr uint8_t kDiskBit = 4;

uint8_t tier_bit(std::string_view medium) {
  if (medium == kvcache::kMediumHost) return kHostBit;
  if (medium == kvcache::kMediumDisk) return kDiskBit;
  return kDeviceBit;  // "GPU", "DEVICE", or a medium another engine names
}

}  // namespace

KvIndex::KvIndex(int32_t num_workers) : num_workers_(num_workers), worker_blocks_(static_cast<size_t>(num_workers), 0) {
  DEEPINFER_CHECK(num_workers > 0 && num_workers <= 65535);
}

void KvIndex::drop_tier_locked(int32_t worker, const kvcache::BlockHash& hash, uint8_t bit) {
  auto it = blocks_.find(hash);
  if (it == blocks_.end()) return;
  std::vector<Holder>& holders = it->second;
  auto holder = std::find_if(holders.begin(), holders.end(), [&](const Holder& h) { return h.worker == worker; });
  if (holder == holders.end()) return;
  holder->tiers = static_cast<uint8_t>(holder->tiers & ~bit);
  if (holder->tiers != 0) return;
  holders.erase(holder);
  --worker_blocks_[static_cast<size_t>(worker)];
  if (holders.empty()) blocks_.erase(it);
}

void KvIndex::apply(int32_t worker, const kvcache::KvEventBatch& batch) {
  DEEPINFER_CHECK(worker >= 0 && worker < num_workers_);
  std::lock_guard lock(mutex_);
  for (const kvcache::KvEvent& event : batch.events) {
    switch (event.kind) {
      case kvcache::KvEvent::Kind::kBlockStored: {
        const uint8_t bit = tier_bit(event.medium);
        for (const kvcache::BlockHash& hash : event.block_hashes) {
          std::vector<Holder>& holders = blocks_[hash];
          auto holder = std::find_if(holders.begin(), holders.end(), [&](const Holder& h) { return h.worker == worker; });
          if (holder == holders.end()) {
            holders.push_back({static_cast<uint16_t>(worker), bit});
            ++worker_blocks_[static_cast<size_t>(worker)];
          } else {
            holder->tiers = static_cast<uint8_t>(holder->tiers | bit);
          }
        }
        break;
      }
      case kvcache::KvEvent::Kind::kBlockRemoved: {
        const uint8_t bit = tier_bit(event.medium);
        for (const kvcache::BlockHash& hash : event.block_hashes) drop_tier_locked(worker, hash, bit);
        break;
      }
      case kvcache::KvEvent::Kind::kAllBlocksCleared:
        for (auto it = blocks_.begin(); it != blocks_.end();) {
          std::erase_if(it->second, [&](const Holder& h) { return h.worker == worker; });
          it = it->second.empty() ? blocks_.erase(it) : std::next(it);
        }
        worker_blocks_[static_cast<size_t>(worker)] = 0;
        break;
    }
  }
}

void KvIndex::clear_worker(int32_t worker) {
  kvcache::KvEventBatch batch;
  batch.events.push_back(kvcache::KvEvent::all_cleared());
  apply(worker, batch);
}

std::vector<PrefixMatch> KvIndex::match(std::span<const kvcache::BlockHash> chain) const {
  std::vector<PrefixMatch> out(static_cast<size_t>(num_workers_));
  std::vector<uint8_t> open(static_cast<size_t>(num_workers_), 1);  // still matching block by block
  int32_t num_open = num_workers_;
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < chain.size() && num_open > 0; ++i) {
    auto it = blocks_.find(chain[i]);
    if (it == blocks_.end()) break;
    std::vector<uint8_t> held(static_cast<size_t>(num_workers_), 0);
    for (const Holder& holder : it->second) held[holder.worker] = holder.tiers;
    for (int32_t w = 0; w < num_workers_; ++w) {
      if (!open[static_cast<size_t>(w)]) continue;
      const uint8_t tiers = held[static_cast<size_t>(w)];
      if (tiers == 0) {
        open[static_cast<size_t>(w)] = 0;
        --num_open;
        continue;
      }
      PrefixMatch& m = out[static_cast<size_t>(w)];
      ++m.blocks;
      if (!(tiers & kDeviceBit)) {
        if (tiers & kHostBit) {
          ++m.host_blocks;
        } else {
          ++m.disk_blocks;
        }
      }
    }
  }
  return out;
}

int64_t KvIndex::worker_blocks(int32_t worker) const {
  std::lock_guard lock(mutex_);
  return worker_blocks_.at(static_cast<size_t>(worker));
}

int64_t KvIndex::distinct_blocks() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(blocks_.size());
}

}  // namespace deepinfer::router
