// TierPolicy: admission, load-back, demotion and watermark/TTL eviction over the PrefixIndex, each eviction
// paid for from the tier's token bucket. The comments in tier_policy.h state the policy; this file follows it.
#include "deepinfer/core/check.h"
#include "deepinfer/kvcache/tier_policy.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace deepinfer::kvcache {

TokenBucket::TokenBucket(double rate_per_s, double burst)
    : rate_per_s_(rate_per_s), burst_(burst), tokens_(rate_per_s == kUnlimited ? kUnlimited : burst) {
  DEEPINFER_CHECK(rate_per_s > 0 && burst > 0);
}

void TokenBucket::refill(int64_t now_ms) {
  if (!last_ms_.has_value()) {
    last_ms_ = now_ms;
    return;
  }
  if (now_ms <= *last_ms_) return;
  if (!unlimited()) {
    tokens_ = std::min(burst_, tokens_ + rate_per_s_ * static_cast<double>(now_ms - *last_ms_) / 1000.0);
  }
  last_ms_ = now_ms;
}

bool TokenBucket::try_take(double amount) {
  if (unlimited()) return true;
  // A hair of slack so that rates that are exact in decimal (0.1 s of 10 blocks/s) are not lost to rounding.
  if (tokens_ + 1e-9 * std::max(1.0, amount) < amount) return false;
  tokens_ = std::max(0.0, tokens_ - amount);
  return true;
}

void TokenBucket::refund(double amount) {
  if (!unlimited()) tokens_ = std::min(burst_, tokens_ + amount);
}

Status TierPolicyConfig::validate() const {
  if (Status status = retention.validate(); !status.ok()) return status;
  if (bytes_per_block <= 0) {
    return Status::invalid_argument("TierPolicyConfig: bytes_per_block is " + std::to_string(bytes_per_block) +
                                    "; it must be positive");
  }
  if (block_tokens <= 0) {
    return Status::invalid_argument("TierPolicyConfig: block_tokens is " + std::to_string(block_tokens) +
                                    "; it must be positive");
  }
  for (Tier tier : kAllTiers) {
    const TierConfig& t = tiers[static_cast<size_t>(tier_index(tier))];
    const std::string name = "TierPolicyConfig: tier " + std::string(tier_name(tier)) + ": ";
    if (t.capacity_blocks < 0 || (tier == Tier::kDevice && t.capacity_blocks == 0)) {
      return Status::invalid_argument(name + "capacity_blocks is " + std::to_string(t.capacity_blocks) +
                                      (tier == Tier::kDevice ? "; the device tier needs at least one block"
                                                             : "; it must be >= 0 (0: no such tier)"));
    }
    if (!(t.low_watermark > 0 && t.low_watermark <= t.high_watermark && t.high_watermark <= 1.0)) {
      return Status::invalid_argument(name + "watermarks low " + std::to_string(t.low_watermark) + ", high " +
                                      std::to_string(t.high_watermark) + "; need 0 < low <= high <= 1");
    }
    if (!(t.evict_bytes_per_s > 0)) {
      return Status::invalid_argument(name + "evict_bytes_per_s is " + std::to_string(t.evict_bytes_per_s) +
                                      "; it must be positive (kUnlimited for no limit)");
    }
    if (!(t.evict_burst_bytes >= 0) || std::isinf(t.evict_burst_bytes)) {
      return Status::invalid_argument(name + "evict_burst_bytes is " + std::to_string(t.evict_burst_bytes) +
                                      "; it must be finite and >= 0 (0: one second of the rate)");
    }
  }
  return Status::ok_status();
}

namespace {

TokenBucket make_bucket(const TierConfig& tier, int64_t bytes_per_block) {
  const double block = static_cast<double>(bytes_per_block);
  if (tier.evict_bytes_per_s == kUnlimited) return TokenBucket(kUnlimited, block);
  const double burst = tier.evict_burst_bytes > 0 ? tier.evict_burst_bytes : std::max(tier.evict_bytes_per_s, block);
  return TokenBucket(tier.evict_bytes_per_s, burst);
}

// The present tiers that have a present tier below them.
TierSet demoting_tiers(const TierPolicyConfig& config) {
  TierSet demoting;
  bool lower_present = false;
  for (int t = kNumTiers - 1; t >= 0; --t) {
    if (config.tiers[static_cast<size_t>(t)].capacity_blocks == 0) continue;
    if (lower_present) demoting.insert(static_cast<Tier>(t));
    lower_present = true;
  }
  return demoting;
}

int64_t watermark_blocks(int64_t capacity, double fraction) {
  return static_cast<int64_t>(std::floor(fraction * static_cast<double>(capacity)));
}

}  // namespace

Result<TierPolicy> TierPolicy::create(TierPolicyConfig config) {
  if (Status status = config.validate(); !status.ok()) return status;
  return TierPolicy(std::move(config));
}

TierPolicy::TierPolicy(TierPolicyConfig config)
    : config_(std::move(config)),
      index_(config_.retention, demoting_tiers(config_)),
      buckets_{make_bucket(config_.tiers[0], config_.bytes_per_block),
               make_bucket(config_.tiers[1], config_.bytes_per_block),
               make_bucket(config_.tiers[2], config_.bytes_per_block)} {}

std::optional<Tier> TierPolicy::lower_tier(Tier tier) const {
  for (int i = tier_index(tier) + 1; i < kNumTiers; ++i) {
    if (tier_present(static_cast<Tier>(i))) return static_cast<Tier>(i);
  }
  return std::nullopt;
}

bool TierPolicy::make_room(Tier tier, int64_t now_ms) {
  const int64_t capacity = tier_config(tier).capacity_blocks;
  if (index_.num_in_tier(tier) < capacity) return true;
  bucket(tier).refill(now_ms);
  return evict_one(tier, now_ms, /*expired_only=*/false, nullptr) && index_.num_in_tier(tier) < capacity;
}

bool TierPolicy::evict_one(Tier tier, int64_t now_ms, bool expired_only, TickResult* result) {
  // A few candidates, not one: the first may be a last copy whose lower tier is full right now.
  constexpr size_t kCandidatesTried = 8;
  const double cost = static_cast<double>(config_.bytes_per_block);
  for (NodeId node : index_.eviction_order(tier, kCandidatesTried)) {
    if (expired_only && now_ms <= index_.node(node).expiry_ms) return false;  // expired ones sort first
    if (!bucket(tier).try_take(cost)) return false;
    if (evict(node, tier, now_ms, result)) return true;
    bucket(tier).refund(cost);
  }
  return false;
}

bool TierPolicy::admit(NodeId node, Tier tier, int64_t now_ms) {
  if (index_.node(node).tiers.has(tier)) return true;
  TierCounters& counters = tier_counters(tier);
  // A disk copy of a block whose parent has none takes only free room: a start rebuilds disk chains from their first
  // block, so until the parent follows (a host tier demotes a chain from its end) the copy would be dropped at the
  // next start, and evicting for it lost a chain's end that would have survived (a break-it pass: with the disk full,
  // a host eviction demoted block 9 of a prompt whose blocks 5-8 the disk had refused, in block 4's place).
  if (tier == Tier::kDisk && tier_present(tier)) {
    const NodeId parent = index_.node(node).parent;
    if (parent != kNoNode && !index_.node(parent).tiers.has(Tier::kDisk) &&
        index_.num_in_tier(tier) >= tier_config(tier).capacity_blocks) {
      ++counters.refused_blocks;
      return false;
    }
  }
  if (!tier_present(tier) || !make_room(tier, now_ms)) {
    if (tier_present(tier)) ++counters.refused_blocks;
    return false;
  }
  Status status = index_.add_to_tier(node, tier);
  DEEPINFER_CHECK(status.ok());
  (void)status;
  ++counters.admitted_blocks;
  counters.bytes_written += config_.bytes_per_block;
  return true;
}

bool TierPolicy::evict(NodeId node, Tier tier, int64_t now_ms, TickResult* result) {
  const size_t t = static_cast<size_t>(tier_index(tier));
  const PrefixNode& info = index_.node(node);
  const bool expired = now_ms > info.expiry_ms;
  const bool last_copy_with_children = info.tiers.size() == 1 && info.num_children > 0;
  // An expired inner node waits for its (also expired) children to leave their tiers; never demote it.
  if (expired && last_copy_with_children) return false;
  if (!expired) {
    std::optional<Tier> lower = lower_tier(tier);
    if (lower.has_value() && !info.tiers.has(*lower)) {
      // Pin while the lower tier makes room, so its eviction cannot take this node's last copy away.
      Status pinned = index_.pin(node);
      DEEPINFER_CHECK(pinned.ok());
      const bool demoted = admit(node, *lower, now_ms);
      Status unpinned = index_.unpin(node);
      DEEPINFER_CHECK(unpinned.ok());
      (void)pinned;
      (void)unpinned;
      if (demoted) {
        ++counters_.tiers[t].demoted_blocks;
        counters_.tiers[t].bytes_read += config_.bytes_per_block;
        if (result != nullptr) ++result->demoted[t];
      } else if (last_copy_with_children) {
        return false;
      }
    }
  }
  if (expired) {
    ++counters_.tiers[t].expired_blocks;
    if (result != nullptr) ++result->expired[t];
  } else {
    ++counters_.tiers[t].evicted_blocks;
    if (result != nullptr) ++result->evicted[t];
  }
  Status status = index_.remove_from_tier(node, tier);
  DEEPINFER_CHECK(status.ok());
  (void)status;
  return true;
}

LookupResult TierPolicy::lookup(std::span<const BlockHash> chain, int64_t prompt_tokens, int64_t now_ms,
                                TtlClassId ttl_class, size_t max_hit_blocks) {
  DEEPINFER_CHECK(ttl_class < config_.retention.classes.size() && prompt_tokens >= 0);
  LookupResult result;
  std::vector<NodeId> matched = index_.match(chain, now_ms, config_.required_kinds);
  if (matched.size() > max_hit_blocks) matched.resize(max_hit_blocks);
  // Pin the whole match first: loading one block back may evict from device, and must not evict the rest.
  for (NodeId node : matched) {
    Status status = index_.pin(node);
    DEEPINFER_CHECK(status.ok());
    (void)status;
  }
  size_t usable = 0;
  for (; usable < matched.size(); ++usable) {
    const NodeId node = matched[usable];
    const TierSet tiers = index_.node(node).tiers;
    Tier source = Tier::kDisk;
    for (Tier tier : kAllTiers) {
      if (tiers.has(tier)) {
        source = tier;
        break;
      }
    }
    if (source != Tier::kDevice) {
      // Disk -> host -> device: the bytes pass through host memory, which keeps a copy when it has room.
      if (source == Tier::kDisk && tier_present(Tier::kHost)) admit(node, Tier::kHost, now_ms);
      if (!admit(node, Tier::kDevice, now_ms)) break;
      tier_counters(source).bytes_read += config_.bytes_per_block;
      result.bytes_loaded += config_.bytes_per_block;
    }
    result.sources.push_back(source);
  }
  for (size_t i = usable; i < matched.size(); ++i) {
    Status status = index_.unpin(matched[i]);
    DEEPINFER_CHECK(status.ok());
    (void)status;
  }
  matched.resize(usable);
  index_.touch(matched, now_ms, ttl_class);
  result.nodes = std::move(matched);

  // Counters: a block is a hit of the fastest tier holding it and a miss of every present tier above that.
  const int64_t num_blocks = static_cast<int64_t>(chain.size());
  const int64_t num_hits = static_cast<int64_t>(result.nodes.size());
  ++counters_.lookups;
  counters_.lookup_blocks += num_blocks;
  counters_.hit_blocks += num_hits;
  result.hit_tokens = std::min(num_hits * config_.block_tokens, prompt_tokens);
  counters_.lookup_tokens += prompt_tokens;
  counters_.hit_tokens += result.hit_tokens;
  for (Tier source : result.sources) {
    ++tier_counters(source).hit_blocks;
    for (int t = 0; t < tier_index(source); ++t) {
      if (tier_present(static_cast<Tier>(t))) ++counters_.tiers[static_cast<size_t>(t)].miss_blocks;
    }
  }
  for (Tier tier : kAllTiers) {
    if (tier_present(tier)) tier_counters(tier).miss_blocks += num_blocks - num_hits;
  }
  return result;
}

InsertResult TierPolicy::insert(std::span<const BlockHash> chain, int64_t now_ms, TtlClassId ttl_class) {
  DEEPINFER_CHECK(ttl_class < config_.retention.classes.size());
  InsertResult result;
  const bool write_through = config_.write_through_to_host && tier_present(Tier::kHost);
  const bool write_through_disk = config_.write_through_to_disk && tier_present(Tier::kDisk);
  NodeId parent = kNoNode;
  for (const BlockHash& hash : chain) {
    NodeId node = index_.find_child(parent, hash);
    if (node != kNoNode) {
      // Pin first: the admissions below may evict, and must not take this node.
      Status status = index_.pin(node);
      DEEPINFER_CHECK(status.ok());
      (void)status;
      const NodeId touched[] = {node};
      index_.touch(touched, now_ms, ttl_class);
      (void)index_.add_kinds(node, config_.required_kinds);  // cannot fail: the node is live
      admit(node, Tier::kDevice, now_ms);
      if (write_through) admit(node, Tier::kHost, now_ms);
      if (write_through_disk) admit(node, Tier::kDisk, now_ms);
    } else {
      const bool device_room = make_room(Tier::kDevice, now_ms);
      const bool host_room = write_through && make_room(Tier::kHost, now_ms);
      if (!device_room) ++tier_counters(Tier::kDevice).refused_blocks;
      if (write_through && !host_room) ++tier_counters(Tier::kHost).refused_blocks;
      if (!device_room && !host_room) break;
      const Tier first = device_room ? Tier::kDevice : Tier::kHost;
      Result<NodeId> added = index_.add_block(parent, hash, first, now_ms, ttl_class, config_.required_kinds);
      DEEPINFER_CHECK(added.ok());
      node = *added;
      Status status = index_.pin(node);
      DEEPINFER_CHECK(status.ok());
      ++tier_counters(first).admitted_blocks;
      tier_counters(first).bytes_written += config_.bytes_per_block;
      if (device_room && host_room) {
        status = index_.add_to_tier(node, Tier::kHost);
        DEEPINFER_CHECK(status.ok());
        ++tier_counters(Tier::kHost).admitted_blocks;
        tier_counters(Tier::kHost).bytes_written += config_.bytes_per_block;
      }
      (void)status;
      if (write_through_disk) admit(node, Tier::kDisk, now_ms);
      ++result.new_blocks;
      ++counters_.inserted_blocks;
    }
    if (index_.node(node).tiers.has(Tier::kDevice)) ++result.device_blocks;
    result.nodes.push_back(node);
    parent = node;
  }
  return result;
}

void TierPolicy::count_failed_hit(Tier source) {
  TierCounters& tier = tier_counters(source);
  if (tier.hit_blocks == 0) return;
  --tier.hit_blocks;
  ++tier.miss_blocks;
  --counters_.hit_blocks;
}

bool TierPolicy::evict_one_now(Tier tier, int64_t now_ms) {
  if (!tier_present(tier)) return false;
  bucket(tier).refill(now_ms);
  return evict_one(tier, now_ms, /*expired_only=*/false, nullptr);
}

Status TierPolicy::release(std::span<const NodeId> nodes) {
  for (NodeId node : nodes) {
    if (Status status = index_.unpin(node); !status.ok()) return status;
  }
  return Status::ok_status();
}

TickResult TierPolicy::tick(int64_t now_ms) {
  TickResult result;
  for (Tier tier : kAllTiers) {
    if (!tier_present(tier)) continue;
    bucket(tier).refill(now_ms);
    // Expired blocks first: they sort ahead of every live candidate.
    while (evict_one(tier, now_ms, /*expired_only=*/true, &result)) {
    }
    const TierConfig& config = tier_config(tier);
    const int64_t high = watermark_blocks(config.capacity_blocks, config.high_watermark);
    const int64_t low = watermark_blocks(config.capacity_blocks, config.low_watermark);
    bool& running = evicting_[static_cast<size_t>(tier_index(tier))];
    if (index_.num_in_tier(tier) > high) running = true;
    while (running && index_.num_in_tier(tier) > low && evict_one(tier, now_ms, /*expired_only=*/false, &result)) {
    }
    if (index_.num_in_tier(tier) <= low) running = false;
  }
  return result;
}

CacheCounters TierPolicy::counters() const {
  CacheCounters counters = counters_;
  for (Tier tier : kAllTiers) {
    TierCounters& t = counters.tiers[static_cast<size_t>(tier_index(tier))];
    t.usage_blocks = index_.num_in_tier(tier);
    t.capacity_blocks = config_.tiers[static_cast<size_t>(tier_index(tier))].capacity_blocks;
  }
  return counters;
}

}  // namespace deepinfer::kvcache
