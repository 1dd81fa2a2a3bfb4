// The prefix index: a radix tree over block-hash chains (one node per full block, children keyed by hash)
// with what the cache knows about each cached block: the tiers holding it, its device block id, which cache
// kinds are complete, its TTL class, expiry and pins. It decides nothing about capacity; TierPolicy
// (tier_policy.h) does, and asks the index for eviction candidates.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/block_pool.h"

namespace deepinfer::kvcache {

// Where a copy of a block lives, fastest first (DESIGN.md, "KV cache"): device memory (GPU HBM, or RAM for
// the CPU backend), host RAM, local disk.
enum class Tier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };
inline constexpr int kNumTiers = 3;
inline constexpr std::array<Tier, kNumTiers> kAllTiers = {Tier::kDevice, Tier::kHost, Tier::kDisk};
constexpr int tier_index(Tier tier) { return static_cast<int>(tier); }
// "device", "host", "disk": the spelling of metrics labels and JSON fields.
std::string_view tier_name(Tier tier);

// A set of tiers (3 bits).
class TierSet {
 public:
  constexpr TierSet() = default;
  constexpr TierSet(std::initializer_list<Tier> tiers) {
    for (Tier tier : tiers) insert(tier);
  }
  constexpr bool has(Tier tier) const { return (bits_ >> tier_index(tier)) & 1u; }
  constexpr void insert(Tier tier) { bits_ = static_cast<uint8_t>(bits_ | (1u << tier_index(tier))); }
  constexpr void erase(Tier tier) { bits_ = static_cast<uint8_t>(bits_ & ~(1u << tier_index(tier))); }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr int size() const { return ((bits_ >> 0) & 1) + ((bits_ >> 1) & 1) + ((bits_ >> 2) & 1); }
  constexpr uint8_t bits() const { return bits_; }
  friend constexpr bool operator==(TierSet, TierSet) = default;

 private:
  uint8_t bits_ = 0;
};

// A kind of cached state with its own pool, entry size and retention rule (DESIGN.md, "KV cache"). V2/V3
// layers cache only the MLA latent; V3.2 adds the DSA indexer keys; V4 adds sliding-window layers (only the
// last window lives) and compressed layers. The index records, per block, which kinds are complete for the
// prefix ending at that block; a match can require a set of kinds.
enum class CacheKind : uint8_t { kLatent = 0, kIndexerKey = 1, kSlidingWindow = 2, kCompressed = 3 };
inline constexpr int kMaxCacheKinds = 8;

// A set of cache kinds (8 bits).
class CacheKindSet {
 public:
  constexpr CacheKindSet() = default;
  constexpr CacheKindSet(std::initializer_list<CacheKind> kinds) {
    for (CacheKind kind : kinds) insert(kind);
  }
  constexpr bool has(CacheKind kind) const { return (bits_ >> static_cast<int>(kind)) & 1u; }
  constexpr void insert(CacheKind kind) { bits_ = static_cast<uint8_t>(bits_ | (1u << static_cast<int>(kind))); }
  constexpr void erase(CacheKind kind) { bits_ = static_cast<uint8_t>(bits_ & ~(1u << static_cast<int>(kind))); }
  constexpr void insert_all(CacheKindSet other) { bits_ = static_cast<uint8_t>(bits_ | other.bits_); }
  constexpr bool contains_all(CacheKindSet other) const { return (bits_ & other.bits_) == other.bits_; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr uint8_t bits() const { return bits_; }
  friend constexpr bool operator==(CacheKindSet, CacheKindSet) = default;

 private:
  uint8_t bits_ = 0;
};

// What V2/V3 need: the MLA latent of every token.
inline constexpr CacheKindSet kLatentOnly{CacheKind::kLatent};

// Retention classes. A request names its class (request metadata or a header; the server maps the name with
// find()); a cached block lives until `ttl_ms` after its last access by a request of its class, and is
// dropped earlier only under capacity pressure. Class 0 is the default class, whose TTL the operator sets
// (`--kv-cache-ttl-hours`).
using TtlClassId = uint8_t;
inline constexpr TtlClassId kDefaultTtlClass = 0;

struct TtlClass {
  std::string name;
  int64_t ttl_ms = 0;
};

struct RetentionConfig {
  std::vector<TtlClass> classes;  // indexed by TtlClassId; classes[0] is the default class

  // {"default", default_ttl_hours}, {"chat", 7 days}, {"agent", 3 days}: issue 8's defaults. The default
  // class keeps 7 days (168 h) unless the operator says otherwise. REQUIRES: default_ttl_hours > 0.
  static RetentionConfig defaults(double default_ttl_hours = 168.0);
  // The class named `name`; std::nullopt when there is none (the caller falls back to kDefaultTtlClass
  // or rejects the request).
  std::optional<TtlClassId> find(std::string_view name) const;
  // REQUIRES: id < classes.size().
  int64_t ttl_ms(TtlClassId id) const { return classes[id].ttl_ms; }
  // InvalidArgument when there is no class, more than 256, an empty or duplicate name, or a TTL <= 0.
  Status validate() const;
};

// A node's handle: an index into the index's node table. Valid until the node is removed (it left its last
// tier); a pinned node is never removed, so the ids a request pins stay valid until it unpins them. Ids of
// removed nodes are reused.
using NodeId = int32_t;
inline constexpr NodeId kNoNode = -1;  // also "the root" where a parent is expected
inline constexpr BlockId kNoBlock = -1;

// What the index knows about one cached block (read-only through PrefixIndex::node()).
struct PrefixNode {
  BlockHash hash;                   // the chained hash of this block
  NodeId parent = kNoNode;          // kNoNode: this is block 0 of its chain
  int32_t depth = 0;                // blocks from the root: 1 for block 0
  BlockId device_block = kNoBlock;  // physical block in the device pool while tiers has kDevice (set by the owner)
  CacheKindSet kinds;               // cache kinds complete for the prefix ending here
  TierSet tiers;                    // tiers holding a copy; never empty for a node in the index
  int64_t last_access_ms = 0;       // the latest touch (a match used it, or an insert wrote it)
  int64_t expiry_ms = 0;            // live while now_ms <= expiry_ms; max over touches of now + class TTL
  TtlClassId ttl_class = kDefaultTtlClass;  // the class that set expiry_ms
  int32_t pin_count = 0;                    // running requests using the block; pinned nodes are never evicted
  int32_t num_children = 0;
  std::array<int32_t, kNumTiers> children_in_tier{};  // children with a copy in each tier
};

// A change the router's mirror of this worker's cache needs: a block gained or lost a copy in a tier.
struct CacheEvent {
  enum class Type : uint8_t { kStored, kRemoved };
  Type type = Type::kStored;
  BlockHash hash;
  BlockHash parent_hash;  // kRootBlockHash for block 0
  int32_t depth = 0;
  Tier tier = Tier::kDevice;
  BlockId device_block = kNoBlock;  // for kDevice: the block the copy occupies(d); the owner frees it on kRemoved
  NodeId node = kNoNode;            // the node; on kRemoved of its last tier the id is dead once the call returns
};
using CacheEventListener = std::function<void(const CacheEvent&)>;

// The radix tree. A node is one full block; the path from the root to a node is the chain of hashes of a
// token prefix, so the longest cached prefix of a request is a walk down the tree.
//
// Eviction is by leaves: a node may leave tier T only when it is unpinned, no child has a copy in T, and,
// when T is its last tier, it has no children at all (an inner node goes only after its children). The
// eviction candidates of T are those nodes, plus, when T is one of the `demoting_tiers` given at
// construction, the unpinned nodes whose last copy is in T, with no child in T but children elsewhere: their
// owner moves them to a lower tier first (after which remove_from_tier(T) is allowed). Candidates are
// ordered by expiry, earliest first (ties: least recently touched). Within one TTL class that is LRU; across
// classes the block closer to its expiry goes first, and expired blocks come before any live one.
//
// Time is passed in (now_ms, any monotonic millisecond clock); the index reads no clock.
// Thread-safety: not thread-safe. One owner (the engine thread, or TierPolicy on it) calls everything;
// the event listener runs synchronously inside the mutating call and must not call back into the index.
class PrefixIndex {
 public:
  // `demoting_tiers`: the tiers whose owner demotes a node's last copy before dropping it (see above);
  // TierPolicy passes the tiers that have a lower tier. REQUIRES: retention.validate() is ok.
  explicit PrefixIndex(RetentionConfig retention = RetentionConfig::defaults(), TierSet demoting_tiers = {});

  // The longest prefix of `chain` whose blocks are all in the index, live at now_ms (now_ms <= expiry_ms),
  // have every kind in `required_kinds`, and have a copy in a tier of `tiers`. Returns their ids in chain
  // order (empty on a miss). Does not touch, pin or change anything.
  std::vector<NodeId> match(std::span<const BlockHash> chain, int64_t now_ms, CacheKindSet required_kinds = kLatentOnly,
                            TierSet tiers = {Tier::kDevice, Tier::kHost, Tier::kDisk}) const;

  // The child of `parent` (kNoNode: the root) with hash `hash`, or kNoNode. Ignores expiry.
  // REQUIRES: parent is kNoNode or a live id.
  NodeId find_child(NodeId parent, const BlockHash& hash) const;

  // The child of `parent` with `hash`, created when absent, given a copy in `tier` (a no-op when it has
  // one), touched at now_ms for `ttl_class`, with `kinds` added. Emits kStored when the tier is new.
  // Errors: InvalidArgument when `parent` is not kNoNode or a live id, or ttl_class is unknown. Nothing
  // changes on error.
  Result<NodeId> add_block(NodeId parent, const BlockHash& hash, Tier tier, int64_t now_ms,
                           TtlClassId ttl_class = kDefaultTtlClass, CacheKindSet kinds = kLatentOnly);

  // add_block for every block of `chain` in order, sharing the nodes that exist: the whole chain ends up in
  // the index with a copy in `tier`. Returns the ids in chain order. Errors as add_block.
  Result<std::vector<NodeId>> insert(std::span<const BlockHash> chain, Tier tier, int64_t now_ms,
                                     TtlClassId ttl_class = kDefaultTtlClass, CacheKindSet kinds = kLatentOnly);

  // Records an access: last_access_ms = max(last_access_ms, now_ms); expiry_ms = max(expiry_ms,
  // now_ms + ttl of `ttl_class`) (ttl_class becomes `ttl_class` when that raised it). Touch a whole matched
  // path, so a parent never expires before its child. REQUIRES: live ids, a known class.
  void touch(std::span<const NodeId> nodes, int64_t now_ms, TtlClassId ttl_class = kDefaultTtlClass);

  // Pins protect a node (and so, by the leaf rule, its whole path) from eviction in every tier.
  // Errors: InvalidArgument for a dead id; unpin of an unpinned node is Internal (a double release).
  Status pin(NodeId node);
  Status unpin(NodeId node);

  // Gives `node` a copy in `tier` (kStored), or drops it (kRemoved; after the last tier the node leaves the
  // index and its id dies). Errors: InvalidArgument for a dead id, a tier it already has / lacks, or a drop
  // that breaks the leaf rule (pinned, a child in that tier, or children while it is the last tier).
  Status add_to_tier(NodeId node, Tier tier);
  Status remove_from_tier(NodeId node, Tier tier);
  // Drops every copy of an unpinned node without children: it leaves the index. Errors as remove_from_tier.
  Status evict_leaf(NodeId node);

  // Records the device pool's block for a node with a device copy. Errors: InvalidArgument for a dead id or
  // a node without a device copy.
  Status set_device_block(NodeId node, BlockId block);
  // Marks more cache kinds complete, or some no longer present (a window kind's block was reused).
  // Errors: InvalidArgument for a dead id.
  Status add_kinds(NodeId node, CacheKindSet kinds);
  Status remove_kinds(NodeId node, CacheKindSet kinds);
  // Sets a node's expiry outright (a block recovered from disk keeps the expiry its file recorded).
  // Errors: InvalidArgument for a dead id.
  Status set_expiry(NodeId node, int64_t expiry_ms);
  // Every node below `node` (children, their children, ...), deepest first: the order in which they may leave
  // their tiers. O(nodes); for the rare path that drops a subtree whose root turned out corrupt.
  std::vector<NodeId> descendants(NodeId node) const;

  // Whether remove_from_tier(node, tier) would succeed now. REQUIRES: a live id.
  bool can_remove_from_tier(NodeId node, Tier tier) const;
  // Whether the node is an eviction candidate of `tier` (can_remove_from_tier, or a last copy to demote).
  bool is_eviction_candidate(NodeId node, Tier tier) const;
  // The next node to evict from `tier` (see the class comment), or kNoNode when none may go.
  NodeId eviction_candidate(Tier tier) const;
  // The first `limit` candidates of `tier` in eviction order (for tests and debugging).
  std::vector<NodeId> eviction_order(Tier tier, size_t limit) const;

  // REQUIRES: contains(node).
  const PrefixNode& node(NodeId node) const { return nodes_[static_cast<size_t>(node)].info; }
  bool contains(NodeId node) const {
    return node >= 0 && static_cast<size_t>(node) < nodes_.size() && nodes_[static_cast<size_t>(node)].live;
  }
  int64_t num_nodes() const { return num_live_; }
  // One past the largest node id ever used: live ids are the ones in [0, id_limit()) that contains().
  NodeId id_limit() const { return static_cast<NodeId>(nodes_.size()); }
  int64_t num_in_tier(Tier tier) const { return num_in_tier_[tier_index(tier)]; }
  const RetentionConfig& retention() const { return retention_; }

  // Called synchronously on every kStored / kRemoved. Replaces the previous listener; {} removes it.
  void set_listener(CacheEventListener listener) { listener_ = std::move(listener); }

  // Recounts children, tier counts and candidate sets from scratch; Internal naming the first mismatch.
  // O(nodes); for tests.
  Status check_invariants() const;

 private:
  // Eviction order key: (expiry_ms, last_access_ms, touch sequence, id).
  using CandidateKey = std::tuple<int64_t, int64_t, uint64_t, NodeId>;
  struct Node {
    PrefixNode info;
    uint64_t touch_seq = 0;
    uint8_t listed = 0;  // bit t: the node is in candidates_[t]
    bool live = false;
  };
  struct ChildKey {
    NodeId parent;
    BlockHash hash;
    friend bool operator==(const ChildKey&, const ChildKey&) = default;
  };
  struct ChildKeyHasher {
    size_t operator()(const ChildKey& key) const noexcept {
      return BlockHashHasher{}(key.hash) ^
             (static_cast<size_t>(static_cast<uint32_t>(key.parent)) * 0xC2B2AE3D27D4EB4Full);
    }
  };

  Status check_live(NodeId node, const char* operation) const;
  CandidateKey key_of(NodeId node) const;
  void unlist(NodeId node);
  void relist(NodeId node);
  void emit(CacheEvent::Type type, NodeId node, Tier tier);
  void touch_one(NodeId node, int64_t now_ms, TtlClassId ttl_class);
  void erase_node(NodeId node);

  RetentionConfig retention_;
  TierSet demoting_tiers_;
  std::vector<Node> nodes_;
  std::vector<NodeId> free_ids_;
  std::unordered_map<ChildKey, NodeId, ChildKeyHasher> children_;
  std::array<std::set<CandidateKey>, kNumTiers> candidates_;
  std::array<int64_t, kNumTiers> num_in_tier_{};
  int64_t num_live_ = 0;
  uint64_t next_touch_seq_ = 1;
  CacheEventListener listener_;
};

}  // namespace deepinfer::kvcache
