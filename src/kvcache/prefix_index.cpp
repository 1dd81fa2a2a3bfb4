// The radix prefix index: a node table with a free list, one hash map from (parent, hash) to child, and per
// tier an ordered set of the nodes allowed to leave that tier. Every mutation of a node takes it out of the
// candidate sets, changes it, and puts it back where the leaf rule allows, so the sets are always exact.
#include "deepinfer/core/check.h"
#include "deepinfer/kvcache/prefix_index.h"

#include <algorithm>
#include <cmath>

namespace deepinfer::kvcache {
namespace {

constexpr int64_t kMsPerHour = 3600LL * 1000;
constexpr int64_t kMsPerDay = 24 * kMsPerHour;

}  // namespace

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kDisk:
      return "disk";
  }
  return "unknown";
}

RetentionConfig RetentionConfig::defaults(double default_ttl_hours) {
  DEEPINFER_CHECK(default_ttl_hours > 0);
  RetentionConfig config;
  config.classes = {{"default", static_cast<int64_t>(std::llround(default_ttl_hours * kMsPerHour))},
                    {"chat", 7 * kMsPerDay},
                    {"agent", 3 * kMsPerDay}};
  return config;
}

std::optional<TtlClassId> RetentionConfig::find(std::string_view name) const {
  for (size_t i = 0; i < classes.size(); ++i) {
    if (classes[i].name == name) return static_cast<TtlClassId>(i);
  }
  return std::nullopt;
}

Status RetentionConfig::validate() const {
  if (classes.empty()) return Status::invalid_argument("RetentionConfig: no TTL class (class 0 is the default)");
  if (classes.size() > 256) {
    return Status::invalid_argument("RetentionConfig: " + std::to_string(classes.size()) + " TTL classes; at most 256");
  }
  for (size_t i = 0; i < classes.size(); ++i) {
    if (classes[i].name.empty())
      return Status::invalid_argument("RetentionConfig: TTL class " + std::to_string(i) + " has no name");
    if (classes[i].ttl_ms <= 0) {
      return Status::invalid_argument("RetentionConfig: TTL class '" + classes[i].name + "' has ttl_ms " +
                                      std::to_string(classes[i].ttl_ms) + "; it must be positive");
    }
    for (size_t j = 0; j < i; ++j) {
      if (classes[j].name == classes[i].name) {
        return Status::invalid_argument("RetentionConfig: TTL class name '" + classes[i].name + "' appears twice");
      }
    }
  }
  return Status::ok_status();
}

PrefixIndex::PrefixIndex(RetentionConfig retention, TierSet demoting_tiers)
    : retention_(std::move(retention)), demoting_tiers_(demoting_tiers) {
  DEEPINFER_CHECK(retention_.validate().ok());
}

Status PrefixIndex::check_live(NodeId node, const char* operation) const {
  if (contains(node)) return Status::ok_status();
  return Status::invalid_argument(std::string("PrefixIndex::") + operation + ": node " + std::to_string(node) +
                                  " is not in the index (never created, or removed since)");
}

PrefixIndex::CandidateKey PrefixIndex::key_of(NodeId node) const {
  const Node& n = nodes_[static_cast<size_t>(node)];
  return {n.info.expiry_ms, n.info.last_access_ms, n.touch_seq, node};
}

bool PrefixIndex::can_remove_from_tier(NodeId node, Tier tier) const {
  DEEPINFER_CHECK(contains(node));
  const PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (!info.tiers.has(tier) || info.pin_count > 0) return false;
  if (info.children_in_tier[static_cast<size_t>(tier_index(tier))] > 0) return false;
  if (info.tiers.size() == 1 && info.num_children > 0) return false;
  return true;
}

bool PrefixIndex::is_eviction_candidate(NodeId node, Tier tier) const {
  DEEPINFER_CHECK(contains(node));
  const PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (!info.tiers.has(tier) || info.pin_count > 0) return false;
  if (info.children_in_tier[static_cast<size_t>(tier_index(tier))] > 0) return false;
  return info.tiers.size() > 1 || info.num_children == 0 || demoting_tiers_.has(tier);
}

void PrefixIndex::unlist(NodeId node) {
  Node& n = nodes_[static_cast<size_t>(node)];
  if (n.listed == 0) return;
  const CandidateKey key = key_of(node);
  for (Tier tier : kAllTiers) {
    if ((n.listed >> tier_index(tier)) & 1u) candidates_[static_cast<size_t>(tier_index(tier))].erase(key);
  }
  n.listed = 0;
}

void PrefixIndex::relist(NodeId node) {
  unlist(node);
  Node& n = nodes_[static_cast<size_t>(node)];
  if (!n.live) return;
  const CandidateKey key = key_of(node);
  for (Tier tier : kAllTiers) {
    if (is_eviction_candidate(node, tier)) {
      candidates_[static_cast<size_t>(tier_index(tier))].insert(key);
      n.listed = static_cast<uint8_t>(n.listed | (1u << tier_index(tier)));
    }
  }
}

void PrefixIndex::emit(CacheEvent::Type type, NodeId node, Tier tier) {
  if (!listener_) return;
  const PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  CacheEvent event;
  event.type = type;
  event.hash = info.hash;
  event.parent_hash = info.parent == kNoNode ? kRootBlockHash : nodes_[static_cast<size_t>(info.parent)].info.hash;
  event.depth = info.depth;
  event.tier = tier;
  event.device_block = tier == Tier::kDevice ? info.device_block : kNoBlock;
  event.node = node;
  listener_(event);
}

std::vector<NodeId> PrefixIndex::match(std::span<const BlockHash> chain, int64_t now_ms, CacheKindSet required_kinds,
                                       TierSet tiers) const {
  std::vector<NodeId> matched;
  NodeId parent = kNoNode;
  for (const BlockHash& hash : chain) {
    NodeId child = find_child(parent, hash);
    if (child == kNoNode) break;
    const PrefixNode& info = nodes_[static_cast<size_t>(child)].info;
    if (now_ms > info.expiry_ms || !info.kinds.contains_all(required_kinds) ||
        (info.tiers.bits() & tiers.bits()) == 0) {
      break;
    }
    matched.push_back(child);
    parent = child;
  }
  return matched;
}

NodeId PrefixIndex::find_child(NodeId parent, const BlockHash& hash) const {
  auto it = children_.find(ChildKey{parent, hash});
  return it == children_.end() ? kNoNode : it->second;
}

void PrefixIndex::touch_one(NodeId node, int64_t now_ms, TtlClassId ttl_class) {
  Node& n = nodes_[static_cast<size_t>(node)];
  n.info.last_access_ms = std::max(n.info.last_access_ms, now_ms);
  const int64_t expiry = now_ms + retention_.ttl_ms(ttl_class);
  if (expiry > n.info.expiry_ms) {
    n.info.expiry_ms = expiry;
    n.info.ttl_class = ttl_class;
  }
  n.touch_seq = next_touch_seq_++;
}

void PrefixIndex::touch(std::span<const NodeId> nodes, int64_t now_ms, TtlClassId ttl_class) {
  DEEPINFER_CHECK(ttl_class < retention_.classes.size());
  for (NodeId node : nodes) {
    DEEPINFER_CHECK(contains(node));
    unlist(node);
    touch_one(node, now_ms, ttl_class);
    relist(node);
  }
}

Result<NodeId> PrefixIndex::add_block(NodeId parent, const BlockHash& hash, Tier tier, int64_t now_ms,
                                      TtlClassId ttl_class, CacheKindSet kinds) {
  if (parent != kNoNode) {
    if (Status status = check_live(parent, "add_block"); !status.ok()) return status;
  }
  if (ttl_class >= retention_.classes.size()) {
    return Status::invalid_argument("PrefixIndex::add_block: TTL class " + std::to_string(ttl_class) + " is unknown (" +
                                    std::to_string(retention_.classes.size()) + " classes)");
  }
  NodeId node = find_child(parent, hash);
  if (node == kNoNode) {
    if (free_ids_.empty()) {
      node = static_cast<NodeId>(nodes_.size());
      nodes_.emplace_back();
    } else {
      node = free_ids_.back();
      free_ids_.pop_back();
    }
    Node& n = nodes_[static_cast<size_t>(node)];
    n = Node{};
    n.live = true;
    n.info.hash = hash;
    n.info.parent = parent;
    n.info.depth = parent == kNoNode ? 1 : nodes_[static_cast<size_t>(parent)].info.depth + 1;
    n.info.ttl_class = ttl_class;
    children_.emplace(ChildKey{parent, hash}, node);
    ++num_live_;
    if (parent != kNoNode) {
      unlist(parent);
      ++nodes_[static_cast<size_t>(parent)].info.num_children;
      relist(parent);
    }
  }
  unlist(node);
  touch_one(node, now_ms, ttl_class);
  nodes_[static_cast<size_t>(node)].info.kinds.insert_all(kinds);
  relist(node);
  if (!nodes_[static_cast<size_t>(node)].info.tiers.has(tier)) {
    Status status = add_to_tier(node, tier);
    DEEPINFER_CHECK(status.ok());
    (void)status;
  }
  return node;
}

Status PrefixIndex::set_expiry(NodeId node, int64_t expiry_ms) {
  if (Status status = check_live(node, "set_expiry"); !status.ok()) return status;
  unlist(node);
  nodes_[static_cast<size_t>(node)].info.expiry_ms = expiry_ms;
  relist(node);
  return Status::ok_status();
}

std::vector<NodeId> PrefixIndex::descendants(NodeId node) const {
  std::vector<NodeId> out;
  if (!contains(node)) return out;
  // Depth below `node` of every live node under it (0: not under it), by walking each node's parents.
  std::vector<std::pair<int32_t, NodeId>> found;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!nodes_[i].live || static_cast<NodeId>(i) == node) continue;
    for (NodeId up = nodes_[i].info.parent; up != kNoNode; up = nodes_[static_cast<size_t>(up)].info.parent) {
      if (up == node) {
        found.emplace_back(nodes_[i].info.depth, static_cast<NodeId>(i));
        break;
      }
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [depth, id] : found) out.push_back(id);
  return out;
}

Result<std::vector<NodeId>> PrefixIndex::insert(std::span<const BlockHash> chain, Tier tier, int64_t now_ms,
                                                TtlClassId ttl_class, CacheKindSet kinds) {
  std::vector<NodeId> nodes;
  nodes.reserve(chain.size());
  NodeId parent = kNoNode;
  for (const BlockHash& hash : chain) {
    Result<NodeId> node = add_block(parent, hash, tier, now_ms, ttl_class, kinds);
    if (!node.ok()) return node.status();
    nodes.push_back(*node);
    parent = *node;
  }
  return nodes;
}

Status PrefixIndex::pin(NodeId node) {
  if (Status status = check_live(node, "pin"); !status.ok()) return status;
  unlist(node);
  ++nodes_[static_cast<size_t>(node)].info.pin_count;
  relist(node);
  return Status::ok_status();
}

Status PrefixIndex::unpin(NodeId node) {
  if (Status status = check_live(node, "unpin"); !status.ok()) return status;
  if (nodes_[static_cast<size_t>(node)].info.pin_count == 0) {
    return Status::internal("PrefixIndex::unpin: node " + std::to_string(node) + " is not pinned (double release)");
  }
  unlist(node);
  --nodes_[static_cast<size_t>(node)].info.pin_count;
  relist(node);
  return Status::ok_status();
}

Status PrefixIndex::add_to_tier(NodeId node, Tier tier) {
  if (Status status = check_live(node, "add_to_tier"); !status.ok()) return status;
  PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (info.tiers.has(tier)) {
    return Status::invalid_argument("PrefixIndex::add_to_tier: node " + std::to_string(node) + " already has a " +
                                    std::string(tier_name(tier)) + " copy");
  }
  unlist(node);
  info.tiers.insert(tier);
  ++num_in_tier_[static_cast<size_t>(tier_index(tier))];
  relist(node);
  if (info.parent != kNoNode) {
    unlist(info.parent);
    ++nodes_[static_cast<size_t>(info.parent)].info.children_in_tier[static_cast<size_t>(tier_index(tier))];
    relist(info.parent);
  }
  emit(CacheEvent::Type::kStored, node, tier);
  return Status::ok_status();
}

Status PrefixIndex::remove_from_tier(NodeId node, Tier tier) {
  if (Status status = check_live(node, "remove_from_tier"); !status.ok()) return status;
  const PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (!info.tiers.has(tier)) {
    return Status::invalid_argument("PrefixIndex::remove_from_tier: node " + std::to_string(node) + " has no " +
                                    std::string(tier_name(tier)) + " copy");
  }
  if (!can_remove_from_tier(node, tier)) {
    std::string why = info.pin_count > 0 ? "it is pinned by " + std::to_string(info.pin_count) + " request(s)"
                      : info.children_in_tier[static_cast<size_t>(tier_index(tier))] > 0
                          ? "a child still has a " + std::string(tier_name(tier)) + " copy (evict leaves first)"
                          : "it is the node's last copy and the node has children (evict leaves first)";
    return Status::invalid_argument("PrefixIndex::remove_from_tier: node " + std::to_string(node) + " cannot leave " +
                                    std::string(tier_name(tier)) + ": " + why);
  }
  emit(CacheEvent::Type::kRemoved, node, tier);
  unlist(node);
  PrefixNode& mutable_info = nodes_[static_cast<size_t>(node)].info;
  mutable_info.tiers.erase(tier);
  if (tier == Tier::kDevice) mutable_info.device_block = kNoBlock;
  --num_in_tier_[static_cast<size_t>(tier_index(tier))];
  const NodeId parent = mutable_info.parent;
  if (parent != kNoNode) {
    unlist(parent);
    --nodes_[static_cast<size_t>(parent)].info.children_in_tier[static_cast<size_t>(tier_index(tier))];
    relist(parent);
  }
  if (mutable_info.tiers.empty()) {
    erase_node(node);
  } else {
    relist(node);
  }
  return Status::ok_status();
}

void PrefixIndex::erase_node(NodeId node) {
  Node& n = nodes_[static_cast<size_t>(node)];
  DEEPINFER_CHECK(n.info.num_children == 0 && n.info.tiers.empty() && n.listed == 0);
  children_.erase(ChildKey{n.info.parent, n.info.hash});
  if (n.info.parent != kNoNode) {
    unlist(n.info.parent);
    --nodes_[static_cast<size_t>(n.info.parent)].info.num_children;
    relist(n.info.parent);
  }
  n.live = false;
  --num_live_;
  free_ids_.push_back(node);
}

Status PrefixIndex::evict_leaf(NodeId node) {
  if (Status status = check_live(node, "evict_leaf"); !status.ok()) return status;
  const PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (info.num_children > 0 || info.pin_count > 0) {
    return Status::invalid_argument("PrefixIndex::evict_leaf: node " + std::to_string(node) +
                                    " is not an unpinned leaf (" + std::to_string(info.num_children) + " children, " +
                                    std::to_string(info.pin_count) + " pins)");
  }
  for (Tier tier : kAllTiers) {
    if (!contains(node) || !nodes_[static_cast<size_t>(node)].info.tiers.has(tier)) continue;
    if (Status status = remove_from_tier(node, tier); !status.ok()) return status;
  }
  return Status::ok_status();
}

Status PrefixIndex::set_device_block(NodeId node, BlockId block) {
  if (Status status = check_live(node, "set_device_block"); !status.ok()) return status;
  PrefixNode& info = nodes_[static_cast<size_t>(node)].info;
  if (!info.tiers.has(Tier::kDevice)) {
    return Status::invalid_argument("PrefixIndex::set_device_block: node " + std::to_string(node) +
                                    " has no device copy");
  }
  info.device_block = block;
  return Status::ok_status();
}

Status PrefixIndex::add_kinds(NodeId node, CacheKindSet kinds) {
  if (Status status = check_live(node, "add_kinds"); !status.ok()) return status;
  nodes_[static_cast<size_t>(node)].info.kinds.insert_all(kinds);
  return Status::ok_status();
}

Status PrefixIndex::remove_kinds(NodeId node, CacheKindSet kinds) {
  if (Status status = check_live(node, "remove_kinds"); !status.ok()) return status;
  CacheKindSet& have = nodes_[static_cast<size_t>(node)].info.kinds;
  for (int k = 0; k < kMaxCacheKinds; ++k) {
    if (kinds.has(static_cast<CacheKind>(k))) have.erase(static_cast<CacheKind>(k));
  }
  return Status::ok_status();
}

NodeId PrefixIndex::eviction_candidate(Tier tier) const {
  const auto& set = candidates_[static_cast<size_t>(tier_index(tier))];
  return set.empty() ? kNoNode : std::get<3>(*set.begin());
}

std::vector<NodeId> PrefixIndex::eviction_order(Tier tier, size_t limit) const {
  std::vector<NodeId> order;
  for (const CandidateKey& key : candidates_[static_cast<size_t>(tier_index(tier))]) {
    if (order.size() >= limit) break;
    order.push_back(std::get<3>(key));
  }
  return order;
}

Status PrefixIndex::check_invariants() const {
  std::vector<int32_t> num_children(nodes_.size(), 0);
  std::vector<std::array<int32_t, kNumTiers>> in_tier(nodes_.size(), std::array<int32_t, kNumTiers>{});
  std::array<int64_t, kNumTiers> tier_counts{};
  int64_t live = 0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (!n.live) continue;
    ++live;
    const std::string where = "PrefixIndex invariant: node " + std::to_string(i) + ": ";
    if (n.info.tiers.empty()) return Status::internal(where + "in no tier");
    auto it = children_.find(ChildKey{n.info.parent, n.info.hash});
    if (it == children_.end() || it->second != static_cast<NodeId>(i))
      return Status::internal(where + "not in the child map");
    for (Tier tier : kAllTiers) {
      if (n.info.tiers.has(tier)) ++tier_counts[static_cast<size_t>(tier_index(tier))];
    }
    if (n.info.parent != kNoNode) {
      if (!contains(n.info.parent)) return Status::internal(where + "parent is dead");
      ++num_children[static_cast<size_t>(n.info.parent)];
      for (Tier tier : kAllTiers) {
        if (n.info.tiers.has(tier))
          ++in_tier[static_cast<size_t>(n.info.parent)][static_cast<size_t>(tier_index(tier))];
      }
    }
  }
  if (live != num_live_) return Status::internal("PrefixIndex invariant: live count");
  if (static_cast<int64_t>(children_.size()) != live) return Status::internal("PrefixIndex invariant: child map size");
  if (tier_counts != num_in_tier_) return Status::internal("PrefixIndex invariant: tier counts");
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    if (!n.live) continue;
    const std::string where = "PrefixIndex invariant: node " + std::to_string(i) + ": ";
    if (n.info.num_children != num_children[i]) return Status::internal(where + "num_children");
    if (n.info.children_in_tier != in_tier[i]) return Status::internal(where + "children_in_tier");
    for (Tier tier : kAllTiers) {
      const bool listed = candidates_[static_cast<size_t>(tier_index(tier))].count(key_of(static_cast<NodeId>(i))) > 0;
      if (listed != is_eviction_candidate(static_cast<NodeId>(i), tier)) {
        return Status::internal(where + "candidate set of " + std::string(tier_name(tier)) + " is stale");
      }
    }
  }
  for (Tier tier : kAllTiers) {
    for (const CandidateKey& key : candidates_[static_cast<size_t>(tier_index(tier))]) {
      if (!contains(std::get<3>(key))) return Status::internal("PrefixIndex invariant: dead node in a candidate set");
    }
  }
  return Status::ok_status();
}

}  // namespace deepinfer::kvcache
