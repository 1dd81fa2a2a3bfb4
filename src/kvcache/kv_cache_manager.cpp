// KvCacheManager: TierPolicy's decisions carried out on the device pool, the host copies and the disk files,
// through the index's events (one listener; the call context says which blocks an admitted copy occupies).
#include "deepinfer/kvcache/kv_cache_manager.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <string>
#include <utility>

#include "deepinfer/core/check.h"

namespace deepinfer::kvcache {

using transfer::HostBlock;
using transfer::Transfer;
using transfer::TransferResult;

namespace {
int64_t system_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
// The expiry of a disk block written with no expiry.
constexpr int64_t kNeverExpires = std::numeric_limits<int64_t>::max() / 4;
}  // namespace

Status KvCacheConfig::validate() const {
  if (num_device_blocks < 1) {
    return Status::invalid_argument("KvCacheConfig.num_device_blocks must be >= 1, got " +
                                    std::to_string(num_device_blocks));
  }
  if (host_blocks < 0) return Status::invalid_argument("KvCacheConfig.host_blocks must be >= 0");
  if (host_blocks > 0 && !enable_prefix_caching) {
    return Status::invalid_argument("the host/disk KV tiers need prefix caching; it is off");
  }
  if (host_blocks > 0 && block_bytes == 0) {
    return Status::invalid_argument("KvCacheConfig.block_bytes must be > 0 with a host tier");
  }
  if (disk.has_value()) {
    if (host_blocks == 0) return Status::invalid_argument("the disk KV tier loads through the host tier: set host_blocks");
    if (disk->block_bytes != block_bytes) {
      return Status::invalid_argument("KvCacheConfig: disk.block_bytes " + std::to_string(disk->block_bytes) +
                                      " differs from block_bytes " + std::to_string(block_bytes));
    }
    if (disk->capacity_blocks < 1) return Status::invalid_argument("KvCacheConfig: disk.capacity_blocks must be >= 1");
  }
  if (!(host_low_watermark > 0 && host_low_watermark <= host_high_watermark && host_high_watermark <= 1.0)) {
    return Status::invalid_argument("KvCacheConfig: host watermarks low " + std::to_string(host_low_watermark) +
                                    ", high " + std::to_string(host_high_watermark) + "; need 0 < low <= high <= 1");
  }
  if (!(host_evict_bytes_per_s > 0)) {
    return Status::invalid_argument("KvCacheConfig: host_evict_bytes_per_s is " +
                                    std::to_string(host_evict_bytes_per_s) + "; it must be positive");
  }
  if (layout.has_value()) {
    if (Status status = layout->validate(); !status.ok()) return status;
    if (block_bytes > 0 && static_cast<int64_t>(block_bytes) != layout->full_block_bytes()) {
      return Status::invalid_argument("KvCacheConfig: block_bytes " + std::to_string(block_bytes) +
                                      " differs from the cache layout's " + std::to_string(layout->full_block_bytes()) +
                                      " (a block of the kinds that keep every token)");
    }
    if (!layout->window_kinds().empty() && window_blocks < 1) {
      return Status::invalid_argument("KvCacheConfig.window_blocks must be >= 1: the cache layout has a sliding-window kind");
    }
  }
  return retention.validate();
}

KvCacheManager::KvCacheManager(KvCacheConfig config)
    : config_(std::move(config)),
      layout_(config_.layout.value_or(CacheLayout::latent_only(1, std::max<int64_t>(
                                                                   static_cast<int64_t>(config_.block_bytes) / kBlockTokens, 1)))),
      pool_(config_.num_device_blocks) {
  for (const CacheKindSpec& spec : layout_.window_specs()) windows_.push_back({spec, BlockPool(config_.window_blocks), {}, {}});
}

Result<std::unique_ptr<KvCacheManager>> KvCacheManager::create(KvCacheConfig config) {
  if (Status status = config.validate(); !status.ok()) return status;
  TierPolicyConfig policy;
  // Device: as large as the pool, evicted only when a block is wanted (no watermark band: the pool is what
  // the step needs). Host: the operator's watermarks and rate. Disk: evicted on admission, as a full disk must.
  policy.tiers[tier_index(Tier::kDevice)] = {config.num_device_blocks, 1.0, 1.0, kUnlimited, 0};
  if (config.host_blocks > 0) {
    policy.tiers[tier_index(Tier::kHost)] = {config.host_blocks, config.host_high_watermark,
                                             config.host_low_watermark, config.host_evict_bytes_per_s, 0};
  }
  if (config.disk.has_value()) policy.tiers[tier_index(Tier::kDisk)] = {config.disk->capacity_blocks, 1.0, 1.0, kUnlimited, 0};
  policy.bytes_per_block = std::max<int64_t>(static_cast<int64_t>(config.block_bytes), 1);
  policy.block_tokens = kBlockTokens;
  policy.retention = config.retention;
  policy.write_through_to_host = true;
  policy.write_through_to_disk = config.disk.has_value();
  policy.required_kinds = config.layout.has_value() ? config.layout->full_kinds() : kLatentOnly;
  Result<TierPolicy> created = TierPolicy::create(std::move(policy));
  if (!created.ok()) return created.status();

  auto manager = std::unique_ptr<KvCacheManager>(new KvCacheManager(std::move(config)));
  manager->policy_ = std::make_unique<TierPolicy>(std::move(created).value());
  KvCacheManager* self = manager.get();
  manager->policy_->mutable_index().set_listener([self](const CacheEvent& event) { self->on_event(event); });
  const KvCacheConfig& c = manager->config_;
  if (c.disk.has_value()) {
    DiskBlockStoreOptions disk = *c.disk;
    if (!disk.now_unix_ms && c.clock) disk.now_unix_ms = c.clock;  // one clock for the index and the files
    disk.evict_on_put = false;  // the policy evicts (from chains' ends) and removes; see DiskBlockStoreOptions
    Result<std::unique_ptr<DiskBlockStore>> opened = DiskBlockStore::open(std::move(disk));
    if (!opened.ok()) return opened.status();
    manager->disk_ = std::move(opened).value();
  }
  if (c.host_blocks > 0) {
    manager->mover_ = std::make_unique<transfer::BlockMover>(nullptr, manager->disk_.get(), c.block_bytes);
  }
  if (manager->disk_) {
    // Rebuild the disk tier of the index: parents first, from the block files' parent hashes.
    const std::vector<DiskBlockStore::ListedBlock> listed = manager->disk_->list_entries();
    std::unordered_map<BlockHash, std::vector<size_t>, BlockHashHasher> children;
    for (size_t i = 0; i < listed.size(); ++i) children[listed[i].parent].push_back(i);
    std::vector<bool> placed(listed.size(), false);
    std::deque<std::pair<NodeId, BlockHash>> frontier{{kNoNode, kRootBlockHash}};
    PrefixIndex& index = manager->policy_->mutable_index();
    const int64_t now = manager->now_ms();
    manager->context_.kind = CallContext::Kind::kRecover;
    while (!frontier.empty()) {
      auto [parent_node, parent_hash] = frontier.front();
      frontier.pop_front();
      auto it = children.find(parent_hash);
      if (it == children.end()) continue;
      for (size_t i : it->second) {
        if (placed[i]) continue;
        const DiskBlockStore::ListedBlock& block = listed[i];
        // A disk block holds the kinds that keep every token (the layout's full kinds; window kinds live on the
        // device only): recorded as such, or a layout other than latent-only would never match it again.
        Result<NodeId> node = index.add_block(parent_node, block.hash, Tier::kDisk, now, kDefaultTtlClass,
                                              manager->policy_->config().required_kinds);
        DEEPINFER_CHECK(node.ok());
        (void)index.set_expiry(*node, block.expires_at_unix_ms == 0 ? kNeverExpires : block.expires_at_unix_ms);
        placed[i] = true;
        frontier.emplace_back(*node, block.hash);
      }
    }
    manager->context_ = {};
    // A block whose chain does not reach the root can never be matched: deleted, and counted (recovered_blocks
    // is what is left; before, the log and the metric counted these as recovered and the next start found fewer).
    int64_t unchained = 0;
    for (size_t i = 0; i < listed.size(); ++i) {
      if (placed[i]) continue;
      (void)manager->disk_->remove(listed[i].hash);
      ++unchained;
    }
    manager->disk_->finish_recovery(unchained);
  }
  return manager;
}

KvCacheManager::~KvCacheManager() { shutdown(); }

void KvCacheManager::shutdown() {
  if (!mover_) return;
  mover_->submit(std::exchange(submissions_, {}));
  mover_->drain();
  take_completions(mover_->poll());
  mover_.reset();
}

void KvCacheManager::set_device_io(transfer::DeviceBlockIo* io) {
  if (mover_) mover_->set_device_io(io);
}

int64_t KvCacheManager::now_ms() const { return config_.clock ? config_.clock() : system_now_ms(); }

std::string_view KvCacheManager::medium(Tier tier) const {
  switch (tier) {
    case Tier::kDevice:
      return device_medium_;
    case Tier::kHost:
      return kMediumHost;
    case Tier::kDisk:
      return kMediumDisk;
  }
  return device_medium_;
}

void KvCacheManager::set_event_sink(KvEventSink* sink, std::string device_medium) {
  sink_ = sink;
  device_medium_ = std::move(device_medium);
  if (sink_ == nullptr) return;
  // What is already indexed (after a restart: the disk tier), parents before children.
  const PrefixIndex& index = policy_->index();
  std::vector<std::pair<int32_t, NodeId>> nodes;
  for (NodeId id = 0; id < index.id_limit(); ++id) {
    if (index.contains(id)) nodes.emplace_back(index.node(id).depth, id);
  }
  std::sort(nodes.begin(), nodes.end());
  for (const auto& [depth, id] : nodes) {
    const PrefixNode& node = index.node(id);
    const BlockHash parent = node.parent == kNoNode ? kRootBlockHash : index.node(node.parent).hash;
    for (Tier tier : kAllTiers) {
      if (node.tiers.has(tier)) sink_->publish(KvEvent::stored(medium(tier), node.hash, parent, {}));
    }
  }
}

std::span<const TokenId> KvCacheManager::event_tokens(const CacheEvent& event) const {
  const auto position = static_cast<size_t>(event.depth - 1);
  const size_t end = (position + 1) * static_cast<size_t>(kBlockTokens);
  if (position >= context_.chain.size() || context_.chain[position] != event.hash || context_.tokens.size() < end) {
    return {};
  }
  return context_.tokens.subspan(end - kBlockTokens, kBlockTokens);
}

uint64_t KvCacheManager::submit(Transfer transfer, NodeId node) {
  if (!mover_) return 0;  // shut down: nothing moves any more
  const BlockId block = transfer.block;
  const bool touches_device = block != kNoBlock && (transfer.kind == Transfer::Kind::kDeviceToHost ||
                                                    transfer.kind == Transfer::Kind::kHostToDevice ||
                                                    transfer.kind == Transfer::Kind::kDiskToDevice ||
                                                    (transfer.kind == Transfer::Kind::kToDisk && !transfer.host));
  const uint64_t id = next_transfer_id_++;
  transfer.id = id;
  submissions_.push_back(std::move(transfer));
  if (touches_device) {
    ++block_transfers_[block];
    transfer_block_[id] = block;
  }
  transfer_node_[id] = node;
  return id;
}

void KvCacheManager::flush_submissions() {
  // Never wait on the step thread for the mover's lock: what does not go now goes at the next call.
  if (mover_ && !submissions_.empty()) (void)mover_->try_submit(submissions_);
}

void KvCacheManager::on_event(const CacheEvent& event) {
  const PrefixIndex& index = policy_->index();
  if (event.type == CacheEvent::Type::kStored) {
    std::span<const TokenId> tokens = event_tokens(event);
    switch (event.tier) {
      case Tier::kDevice: {
        BlockId block = kNoBlock;
        if (context_.kind == CallContext::Kind::kInsert) {
          const auto position = static_cast<size_t>(event.depth - 1);
          DEEPINFER_CHECK(position < context_.blocks.size() && context_.chain[position] == event.hash,
                          "only the inserted chain's blocks enter the device tier");
          block = context_.blocks[position];
        } else {
          DEEPINFER_CHECK(context_.kind == CallContext::Kind::kAdmit && context_.reserved != nullptr &&
                              !context_.reserved->empty(),
                          "a load-back into device has a reserved block");
          block = context_.reserved->front();
          context_.reserved->erase(context_.reserved->begin());
          Transfer load;
          load.hash = event.hash;
          load.block = block;
          Tier source = Tier::kDisk;
          if (auto host = host_.find(event.hash); host != host_.end()) {
            load.kind = Transfer::Kind::kHostToDevice;
            load.host = host->second;
            if (!context_.via_host.contains(event.hash)) source = Tier::kHost;
          } else {
            load.kind = Transfer::Kind::kDiskToDevice;
          }
          const uint64_t id = submit(std::move(load), event.node);
          loading_[event.hash] = id;
          load_source_[id] = source;
          ++*context_.loaded;
        }
        device_block_[event.hash] = block;
        pool_.set_cached(block, true);
        (void)policy_->mutable_index().set_device_block(event.node, block);
        break;
      }
      case Tier::kHost: {
        auto host = std::make_shared<HostBlock>();
        Transfer fill;
        fill.hash = event.hash;
        fill.host = host;
        if (auto device = device_block_.find(event.hash); device != device_block_.end()) {
          fill.kind = Transfer::Kind::kDeviceToHost;  // write-through or demotion
          fill.block = device->second;
          fill.urgent = true;
        } else {
          fill.kind = Transfer::Kind::kDiskToHost;  // a load-back passing through host
          if (context_.kind == CallContext::Kind::kAdmit) context_.via_host.insert(event.hash);
        }
        submit(std::move(fill), event.node);
        host_[event.hash] = std::move(host);
        host_bytes_written_ += static_cast<int64_t>(config_.block_bytes);
        break;
      }
      case Tier::kDisk: {
        if (context_.kind == CallContext::Kind::kRecover) return;  // already there; published by set_event_sink
        Transfer write;
        write.kind = Transfer::Kind::kToDisk;
        write.hash = event.hash;
        write.parent = event.parent_hash;
        write.ttl_ms = std::max<int64_t>(index.node(event.node).expiry_ms - now_ms(), 1);
        if (auto host = host_.find(event.hash); host != host_.end()) {
          write.host = host->second;
        } else {
          auto device = device_block_.find(event.hash);
          DEEPINFER_CHECK(device != device_block_.end(), "a block written to disk has a host or device copy");
          write.block = device->second;
        }
        submit(std::move(write), event.node);
        break;
      }
    }
    if (sink_ != nullptr) sink_->publish(KvEvent::stored(medium(event.tier), event.hash, event.parent_hash, tokens));
    return;
  }
  if (index.node(event.node).tiers.size() == 1) {  // its last copy: the node leaves the index
    for (WindowPool& window : windows_) forget_window(window, event.hash, /*update_node=*/false);
  }
  switch (event.tier) {
    case Tier::kDevice: {
      auto it = device_block_.find(event.hash);
      DEEPINFER_CHECK(it != device_block_.end());
      const BlockId block = it->second;
      device_block_.erase(it);
      loading_.erase(event.hash);  // nobody pins it, so nobody waits for it
      if (block_transfers_.contains(block)) {
        draining_.insert(block);  // a transfer still reads or writes it: free once it is done
      } else {
        pool_.set_cached(block, false);
      }
      break;
    }
    case Tier::kHost:
      host_.erase(event.hash);
      break;
    case Tier::kDisk: {
      Transfer remove;
      remove.kind = Transfer::Kind::kRemoveFromDisk;
      remove.hash = event.hash;
      submit(std::move(remove), event.node);
      break;
    }
  }
  if (sink_ != nullptr) sink_->publish(KvEvent::removed(medium(event.tier), event.hash));
}

void KvCacheManager::take_completions(std::vector<TransferResult> results) {
  for (const TransferResult& result : results) {
    if (auto it = transfer_block_.find(result.id); it != transfer_block_.end()) {
      const BlockId block = it->second;
      transfer_block_.erase(it);
      if (--block_transfers_[block] == 0) {
        block_transfers_.erase(block);
        if (draining_.erase(block) > 0) pool_.set_cached(block, false);
      }
    }
    NodeId node = kNoNode;
    if (auto it = transfer_node_.find(result.id); it != transfer_node_.end()) {
      node = it->second;
      transfer_node_.erase(it);
    }
    const bool ok = result.status.ok();
    switch (result.kind) {
      case Transfer::Kind::kHostToDevice:
      case Transfer::Kind::kDiskToDevice: {
        auto it = loading_.find(result.hash);
        const bool current = it != loading_.end() && it->second == result.id;
        if (current) loading_.erase(it);
        if (result.kind == Transfer::Kind::kHostToDevice) {
          host_bytes_read_ += result.bytes;
        } else {
          disk_bytes_read_ += result.bytes;
        }
        Tier source = Tier::kDisk;
        if (auto it = load_source_.find(result.id); it != load_source_.end()) {
          source = it->second;
          load_source_.erase(it);
        }
        if (ok) {
          ++loaded_blocks_;
        } else {
          ++failed_loads_;
          policy_->count_failed_hit(source);
          if (result.status.code() == StatusCode::kCorruption || result.status.code() == StatusCode::kNotFound) {
            ++disk_corrupt_;
          }
          if (current && node != kNoNode) failed_[result.hash] = node;
        }
        break;
      }
      case Transfer::Kind::kDiskToHost:
        disk_bytes_read_ += result.bytes;
        if (!ok && (result.status.code() == StatusCode::kCorruption || result.status.code() == StatusCode::kNotFound)) {
          ++disk_corrupt_;
        }
        break;
      case Transfer::Kind::kDeviceToHost:
        if (!ok && node != kNoNode) failed_[result.hash] = node;  // the host copy is unusable
        break;
      case Transfer::Kind::kToDisk:
        if (ok) {
          disk_bytes_written_ += result.bytes;
        } else {
          ++disk_write_failures_;
          // The index counted the copy when the write was queued; it is not there (a full disk, a directory in
          // the block's place: a break-it pass saw usage 58 with 20 files). Another copy remains: drop the disk
          // one; the last copy: the block leaves with what follows it once unpinned, as a failed load does.
          PrefixIndex& index = policy_->mutable_index();
          if (node != kNoNode && index.contains(node) && index.node(node).hash == result.hash &&
              index.node(node).tiers.has(Tier::kDisk)) {
            if (index.can_remove_from_tier(node, Tier::kDisk)) {
              if (index.remove_from_tier(node, Tier::kDisk).ok() && sink_ != nullptr) {
                sink_->publish(KvEvent::removed(kMediumDisk, result.hash));
              }
            } else {
              failed_[result.hash] = node;
            }
          }
        }
        break;
      case Transfer::Kind::kRemoveFromDisk:
        break;
    }
  }
}

void KvCacheManager::drop_failed_subtrees() {
  if (failed_.empty()) return;
  PrefixIndex& index = policy_->mutable_index();
  for (auto it = failed_.begin(); it != failed_.end();) {
    const auto [hash, node] = *it;
    if (!index.contains(node) || index.node(node).hash != hash) {
      it = failed_.erase(it);
      continue;
    }
    std::vector<NodeId> subtree = index.descendants(node);
    subtree.push_back(node);
    const bool pinned = std::any_of(subtree.begin(), subtree.end(),
                                    [&](NodeId id) { return index.node(id).pin_count > 0; });
    if (pinned) {
      ++it;
      continue;
    }
    for (NodeId id : subtree) {  // deepest first: each node leaves after its children
      for (Tier tier : kAllTiers) {
        if (index.contains(id) && index.node(id).tiers.has(tier)) {
          Status status = index.remove_from_tier(id, tier);
          DEEPINFER_CHECK(status.ok(), "the index agrees with the pool");
        }
      }
    }
    it = failed_.erase(it);
  }
}

size_t KvCacheManager::usable_match(std::span<const NodeId> matched) const {
  const CacheKindSet window = layout_.window_kinds();
  if (window.empty() || config_.bounded_replay) return matched.size();
  std::vector<bool> present;
  for (NodeId id : matched) present.push_back(policy_->index().node(id).kinds.contains_all(window));
  return static_cast<size_t>(layout_.usable_blocks(present));
}

void KvCacheManager::forget_window(WindowPool& window, BlockHash hash, bool update_node) {
  auto it = window.cached.find(hash);
  if (it == window.cached.end()) return;
  const CachedWindow cached = it->second;
  window.cached.erase(it);
  window.hash_of.erase(cached.block);
  window.pool.set_cached(cached.block, false);
  PrefixIndex& index = policy_->mutable_index();
  if (update_node && index.contains(cached.node) && index.node(cached.node).hash == hash) {
    (void)index.remove_kinds(cached.node, CacheKindSet{window.spec.kind});
  }
}

std::optional<BlockId> KvCacheManager::allocate_window(int slot) {
  WindowPool& window = windows_[static_cast<size_t>(slot)];
  if (std::optional<BlockId> block = window.pool.allocate()) return block;
  std::optional<BlockId> oldest = window.pool.oldest_free_cached();
  if (!oldest.has_value()) return std::nullopt;
  forget_window(window, window.hash_of.at(*oldest), /*update_node=*/true);
  return window.pool.allocate();
}

void KvCacheManager::release_window(int slot, BlockId block) {
  Status status = windows_[static_cast<size_t>(slot)].pool.release(block);
  DEEPINFER_CHECK(status.ok(), "the window cache agrees with its pool");
}

std::optional<BlockId> KvCacheManager::cached_window_block(int slot, const BlockHash& hash) const {
  const WindowPool& window = windows_[static_cast<size_t>(slot)];
  auto it = window.cached.find(hash);
  if (it == window.cached.end()) return std::nullopt;
  return it->second.block;
}

std::optional<BlockId> KvCacheManager::allocate() {
  if (std::optional<BlockId> block = pool_.allocate()) return block;
  if (!config_.enable_prefix_caching) return std::nullopt;
  const int64_t now = now_ms();
  while (pool_.num_free_uncached() == 0 && policy_->evict_one_now(Tier::kDevice, now)) {
  }
  flush_submissions();  // the demotions' copies
  if (std::optional<BlockId> block = pool_.allocate()) return block;
  // Only evicted blocks still being copied out are left: wait a little for those copies (they run ahead of
  // the queue), not for the whole queue, and never without bound: the caller copes with no block.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  while (!draining_.empty() && mover_ && std::chrono::steady_clock::now() < deadline) {
    mover_->submit(std::exchange(submissions_, {}));
    mover_->wait(std::chrono::milliseconds(5));
    take_completions(mover_->poll());
    if (std::optional<BlockId> block = pool_.allocate()) return block;
  }
  return std::nullopt;
}

void KvCacheManager::retain(BlockId block) {
  Status status = pool_.is_free(block) ? pool_.reclaim(block) : pool_.retain(block);
  DEEPINFER_CHECK(status.ok(), "the index agrees with the pool");
}

void KvCacheManager::release(BlockId block) {
  Status status = pool_.release(block);
  DEEPINFER_CHECK(status.ok(), "the index agrees with the pool");
}

KvCacheManager::PrefixMatch KvCacheManager::match(std::span<const BlockHash> chain) const {
  PrefixMatch result;
  if (!config_.enable_prefix_caching || chain.empty()) return result;
  const PrefixIndex& index = policy_->index();
  std::vector<NodeId> matched = index.match(chain, now_ms(), policy_->config().required_kinds);
  matched.resize(usable_match(matched));
  for (NodeId id : matched) {
    const PrefixNode& node = index.node(id);
    if (result.lower_blocks == 0 && node.tiers.has(Tier::kDevice)) {
      ++result.device_blocks;
      if (pool_.is_free(device_block_.at(node.hash))) ++result.device_free_blocks;
    } else {
      ++result.lower_blocks;
    }
  }
  return result;
}

KvCacheManager::Admission KvCacheManager::admit(std::span<const BlockHash> chain, std::span<const TokenId> tokens,
                                                int64_t prompt_tokens, TtlClassId ttl_class) {
  Admission admission;
  if (!config_.enable_prefix_caching || chain.empty()) return admission;
  const int64_t now = now_ms();
  PrefixIndex& index = policy_->mutable_index();
  // Reserve the blocks the loads will fill, with the prefix pinned so the reservation cannot evict it.
  std::vector<NodeId> matched = index.match(chain, now, policy_->config().required_kinds);
  const size_t max_hit = usable_match(matched);
  matched.resize(max_hit);
  size_t device = 0;
  while (device < matched.size() && index.node(matched[device]).tiers.has(Tier::kDevice)) ++device;
  for (NodeId id : matched) DEEPINFER_CHECK(index.pin(id).ok());
  std::vector<BlockId> reserved;
  for (size_t i = device; i < matched.size(); ++i) {
    std::optional<BlockId> block = allocate();
    if (!block.has_value()) break;
    reserved.push_back(*block);
  }
  for (NodeId id : matched) DEEPINFER_CHECK(index.unpin(id).ok());
  // Short of blocks (the caller checked, so only in a race with nothing): look up no further than they reach.
  std::span<const BlockHash> looked_up =
      reserved.size() == matched.size() - device ? chain : chain.first(device + reserved.size());

  context_ = {};
  context_.kind = CallContext::Kind::kAdmit;
  context_.chain = looked_up;
  context_.reserved = &reserved;
  context_.tokens = tokens;
  context_.loaded = &admission.loaded_blocks;
  LookupResult lookup = policy_->lookup(looked_up, prompt_tokens, now, ttl_class, max_hit);
  context_ = {};
  for (size_t i = 0; i < lookup.nodes.size(); ++i) {
    const BlockId block = device_block_.at(index.node(lookup.nodes[i]).hash);
    // A block loaded for this admission was allocated for it (count 1); a resident one gains an owner.
    if (lookup.sources[i] == Tier::kDevice) retain(block);
    admission.blocks.push_back(block);
  }
  admission.nodes = std::move(lookup.nodes);
  refresh_disk_expiry(admission.nodes);
  for (BlockId block : reserved) release(block);  // loads the lookup did not need
  // The window kinds' blocks of the prefix's last window (the match checked they are there).
  const size_t n = admission.nodes.size();
  const size_t replay = std::min<size_t>(static_cast<size_t>(layout_.replay_blocks()), n);
  for (WindowPool& window : windows_) {
    std::vector<BlockId> table(n, kNoBlock);
    for (size_t i = n - replay; i < n; ++i) {
      auto it = window.cached.find(index.node(admission.nodes[i]).hash);
      if (it == window.cached.end()) continue;
      const BlockId block = it->second.block;
      Status status = window.pool.is_free(block) ? window.pool.reclaim(block) : window.pool.retain(block);
      DEEPINFER_CHECK(status.ok(), "the window cache agrees with its pool");
      table[i] = block;
    }
    admission.window_blocks.push_back(std::move(table));
  }
  flush_submissions();
  return admission;
}

void KvCacheManager::refresh_disk_expiry(std::span<const NodeId> nodes) {
  if (!disk_) return;
  // The policy just moved these nodes' expiries (a use); the disk tier's copies must not expire before them. The
  // deepest one on disk is enough: the store extends the blocks before it (and open() derives theirs from it).
  const PrefixIndex& index = policy_->index();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    if (!index.contains(*it) || !index.node(*it).tiers.has(Tier::kDisk)) continue;
    const int64_t ttl_ms = std::max<int64_t>(index.node(*it).expiry_ms - now_ms(), 1);
    if (Status status = disk_->refresh(index.node(*it).hash, ttl_ms); !status.ok()) ++disk_write_failures_;
    return;
  }
}

bool KvCacheManager::loading(std::span<const NodeId> nodes) const {
  if (loading_.empty()) return false;
  const PrefixIndex& index = policy_->index();
  return std::any_of(nodes.begin(), nodes.end(), [&](NodeId id) {
    return index.contains(id) && loading_.contains(index.node(id).hash);
  });
}

size_t KvCacheManager::usable_prefix(std::span<const NodeId> nodes) const {
  const PrefixIndex& index = policy_->index();
  size_t usable = 0;
  for (NodeId id : nodes) {
    if (!index.contains(id) || failed_.contains(index.node(id).hash) ||
        !device_block_.contains(index.node(id).hash)) {
      break;
    }
    ++usable;
  }
  return usable;
}

std::vector<NodeId> KvCacheManager::insert(std::span<const BlockHash> chain, std::span<const BlockId> blocks,
                                           std::span<const TokenId> tokens, TtlClassId ttl_class,
                                           std::span<const std::vector<BlockId>> window_tables) {
  if (!config_.enable_prefix_caching || chain.empty()) return {};
  DEEPINFER_CHECK(blocks.size() >= chain.size());
  DEEPINFER_CHECK(window_tables.empty() || window_tables.size() == windows_.size(), "one window table per window pool");
  context_ = {};
  context_.kind = CallContext::Kind::kInsert;
  context_.chain = chain;
  context_.blocks = blocks;
  context_.tokens = tokens;
  InsertResult result = policy_->insert(chain, now_ms(), ttl_class);
  context_ = {};
  refresh_disk_expiry(result.nodes);
  // The sequence's window blocks of these blocks join the cache with them (unless one is cached already).
  for (size_t slot = 0; slot < window_tables.size(); ++slot) {
    WindowPool& window = windows_[slot];
    const std::vector<BlockId>& table = window_tables[slot];
    for (size_t i = 0; i < result.nodes.size() && i < table.size(); ++i) {
      const BlockId block = table[i];
      if (block == kNoBlock || window.cached.contains(chain[i]) || window.hash_of.contains(block)) continue;
      window.cached[chain[i]] = {block, result.nodes[i]};
      window.hash_of[block] = chain[i];
      window.pool.set_cached(block, true);
      (void)policy_->mutable_index().add_kinds(result.nodes[i], CacheKindSet{window.spec.kind});
    }
  }
  flush_submissions();
  return std::move(result.nodes);
}

void KvCacheManager::release_nodes(std::span<const NodeId> nodes) {
  if (nodes.empty()) return;
  Status status = policy_->release(nodes);
  DEEPINFER_CHECK(status.ok(), "the index agrees with the pool");
  drop_failed_subtrees();  // a failed block leaves as soon as nobody pins it, before anyone recomputes it
  flush_submissions();
}

void KvCacheManager::tick() {
  if (!config_.enable_prefix_caching) return;
  if (mover_) take_completions(mover_->poll(/*wait_for_lock=*/false));
  drop_failed_subtrees();
  context_ = {};
  policy_->tick(now_ms());
  flush_submissions();
}

bool KvCacheManager::has_background_work() const {
  return mover_ && (!submissions_.empty() || mover_->queued() > 0 || mover_->has_completions());
}

bool KvCacheManager::wait_for_transfers(std::chrono::milliseconds timeout) {
  if (!mover_) return false;
  mover_->submit(std::exchange(submissions_, {}));
  const bool arrived = mover_->wait(timeout);
  take_completions(mover_->poll());
  return arrived;
}

void KvCacheManager::flush() {
  if (!mover_) return;
  // Until nothing is left: a completion may queue more (a failed load's cleanup, a copy that frees a block).
  for (int round = 0; round < 64; ++round) {
    mover_->submit(std::exchange(submissions_, {}));
    mover_->drain();
    take_completions(mover_->poll());
    if (submissions_.empty()) return;
  }
}

int64_t KvCacheManager::num_cached_device_blocks() const { return policy_->index().num_in_tier(Tier::kDevice); }

std::vector<BlockHash> KvCacheManager::blocks_in(Tier tier) const {
  std::vector<BlockHash> out;
  const PrefixIndex& index = policy_->index();
  for (NodeId id = 0; id < index.id_limit(); ++id) {
    if (index.contains(id) && index.node(id).tiers.has(tier)) out.push_back(index.node(id).hash);
  }
  return out;
}

std::optional<BlockId> KvCacheManager::device_block_of(const BlockHash& hash) const {
  auto it = device_block_.find(hash);
  if (it == device_block_.end()) return std::nullopt;
  return it->second;
}

KvCacheCounters KvCacheManager::counters() const {
  KvCacheCounters out;
  const CacheCounters c = policy_->counters();
  const TierCounters& device = c.tiers[tier_index(Tier::kDevice)];
  out.device_usage_blocks = device.usage_blocks;
  out.device_capacity_blocks = pool_.num_total();
  out.device_hit_blocks = device.hit_blocks;
  out.device_miss_blocks = device.miss_blocks;
  out.device_evicted_blocks = device.evicted_blocks;
  out.device_expired_blocks = device.expired_blocks;
  out.completed_loads = loaded_blocks_;
  out.failed_loads = failed_loads_;
  out.lookup_blocks = c.lookup_blocks;
  out.hit_blocks = c.hit_blocks;
  if (config_.host_blocks > 0) {
    OffloadCounters lower;
    auto fill = [](OffloadTierCounters& t, const TierCounters& p) {
      t.usage_blocks = p.usage_blocks;
      t.capacity_blocks = p.capacity_blocks;
      t.hit_blocks = p.hit_blocks;
      t.miss_blocks = p.miss_blocks;
      t.stored_blocks = p.admitted_blocks;
      t.refused_blocks = p.refused_blocks;
      t.evicted_blocks = p.evicted_blocks;
      t.expired_blocks = p.expired_blocks;
    };
    fill(lower.host, c.tiers[tier_index(Tier::kHost)]);
    lower.host.bytes_written = host_bytes_written_;
    lower.host.bytes_read = host_bytes_read_;
    if (disk_) {
      fill(lower.disk, c.tiers[tier_index(Tier::kDisk)]);
      lower.disk.refused_blocks += disk_write_failures_;
      lower.disk.corrupt_blocks = disk_corrupt_;
      lower.disk.bytes_written = disk_bytes_written_;
      lower.disk.bytes_read = disk_bytes_read_;
      lower.disk_recovery = disk_->recovery();
    }
    lower.disk_queue_blocks = (mover_ ? mover_->queued() : 0) + static_cast<int64_t>(submissions_.size());
    out.lower = lower;
  }
  return out;
}

}  // namespace deepinfer::kvcache
