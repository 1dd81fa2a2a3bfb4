// Block hashes (byte layout, determinism, the prefix property, incremental chains) and the radix prefix
// index as tables of steps with the expected state after each (matches, node and tier counts, eviction
// order, errors, events), with the step number in every failure message.
#include "deepinfer/kvcache/prefix_index.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <string>
#include <vector>

#include "deepinfer/kvcache/block_hash.h"

namespace deepinfer::kvcache {
namespace {

constexpr int64_t kHourMs = 3600LL * 1000;
constexpr int64_t kDayMs = 24 * kHourMs;

std::vector<int32_t> tokens_from(int32_t seed, size_t count) {
  std::vector<int32_t> tokens(count);
  uint32_t state = static_cast<uint32_t>(seed) * 2654435761u + 1;
  for (auto& token : tokens) {
    state = state * 1664525u + 1013904223u;
    token = static_cast<int32_t>(state % 129280);
  }
  return tokens;
}

const ModelFingerprint kFingerprint = model_fingerprint(R"({"model_type":"deepseek_v3"})", "weights-sha256:abc");

// ---- block hashes -------------------------------------------------------------------------------------------

TEST(BlockHashTest, ByteLayoutIsTheDocumentedOne) {
  // parent (low, high) || tokens as int32 LE || fingerprint (low, high), hashed with XXH3-128, seed 0.
  const BlockHash parent{0x0123456789abcdefull, 0xfedcba9876543210ull};
  const std::vector<int32_t> tokens = {0, 1, -1, 129279, 0x01020304};
  std::vector<unsigned char> bytes;
  auto put = [&](uint64_t value, int size) {
    for (int i = 0; i < size; ++i) bytes.push_back(static_cast<unsigned char>(value >> (8 * i)));
  };
  put(parent.low, 8);
  put(parent.high, 8);
  for (int32_t token : tokens) put(static_cast<uint32_t>(token), 4);
  put(kFingerprint.low, 8);
  put(kFingerprint.high, 8);
  ASSERT_EQ(bytes.size(), 16 + 4 * tokens.size() + 16);
  const XXH128_hash_t expected = XXH3_128bits(bytes.data(), bytes.size());
  const BlockHash hash = hash_block(parent, tokens, kFingerprint);
  EXPECT_EQ(hash.low, expected.low64);
  EXPECT_EQ(hash.high, expected.high64);

  // A full 64-token block is 288 bytes, and block 0's parent is all zero.
  const std::vector<int32_t> block = tokens_from(7, kBlockTokens);
  bytes.clear();
  put(0, 8);
  put(0, 8);
  for (int32_t token : block) put(static_cast<uint32_t>(token), 4);
  put(kFingerprint.low, 8);
  put(kFingerprint.high, 8);
  ASSERT_EQ(bytes.size(), 288u);
  const XXH128_hash_t first = XXH3_128bits(bytes.data(), bytes.size());
  const std::vector<BlockHash> chain = block_hash_chain(block, kFingerprint);
  ASSERT_EQ(chain.size(), 1u);
  EXPECT_EQ(chain[0], (BlockHash{first.low64, first.high64}));
}

TEST(BlockHashTest, FingerprintAndHex) {
  EXPECT_EQ(model_fingerprint("{}", "w"), model_fingerprint("{}", "w"));
  EXPECT_NE(model_fingerprint("{}", "w"), model_fingerprint("{}", "v"));
  EXPECT_NE(model_fingerprint("{}", "w"), model_fingerprint("{ }", "w"));
  // Lengths are hashed, so moving bytes between the two parts changes the fingerprint.
  EXPECT_NE(model_fingerprint("ab", "c"), model_fingerprint("a", "bc"));
  EXPECT_EQ((BlockHash{0x1, 0xab}).to_hex(), "00000000000000ab0000000000000001");
}

TEST(BlockHashTest, ChainIsDeterministicAndCoversFullBlocksOnly) {
  const std::vector<int32_t> tokens = tokens_from(1, 5 * kBlockTokens + 10);
  const std::vector<BlockHash> chain = block_hash_chain(tokens, kFingerprint);
  ASSERT_EQ(chain.size(), 5u) << "the 10-token tail has no hash";
  EXPECT_EQ(chain, block_hash_chain(tokens, kFingerprint));
  for (size_t i = 0; i < chain.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_NE(chain[i], chain[j]) << i << " vs " << j;
  }
  // Another model: every hash differs.
  const std::vector<BlockHash> other = block_hash_chain(tokens, model_fingerprint("{}", "other weights"));
  ASSERT_EQ(other.size(), chain.size());
  for (size_t i = 0; i < chain.size(); ++i) EXPECT_NE(other[i], chain[i]) << "block " << i;
  // Other block sizes (the traces' 512) chain the same way.
  EXPECT_EQ(block_hash_chain(tokens, kFingerprint, 512).size(), 0u);
  EXPECT_EQ(block_hash_chain(tokens, kFingerprint, 100).size(), 3u);
  EXPECT_TRUE(block_hash_chain({}, kFingerprint).empty());
}

TEST(BlockHashTest, OneChangedTokenChangesItsBlockAndEveryLaterOne) {
  const std::vector<int32_t> base_tokens = tokens_from(2, 5 * kBlockTokens + 10);
  const std::vector<BlockHash> base = block_hash_chain(base_tokens, kFingerprint);
  struct Case {
    size_t position;       // token changed
    size_t first_changed;  // expected first block whose hash differs (== size: none)
  };
  const std::vector<Case> cases = {
      {0, 0},           {63, 0},          {64, 1},
      {2 * 64 + 17, 2}, {4 * 64 + 63, 4}, {5 * 64 + 3, 5},  // in the partial tail: no hash changes
  };
  for (size_t step = 0; step < cases.size(); ++step) {
    std::vector<int32_t> tokens = base_tokens;
    tokens[cases[step].position] += 1;
    const std::vector<BlockHash> chain = block_hash_chain(tokens, kFingerprint);
    ASSERT_EQ(chain.size(), base.size()) << "step " << step + 1;
    for (size_t i = 0; i < chain.size(); ++i) {
      if (i < cases[step].first_changed) {
        EXPECT_EQ(chain[i], base[i]) << "step " << step + 1 << ": block " << i << " must keep its hash";
      } else {
        EXPECT_NE(chain[i], base[i]) << "step " << step + 1 << ": block " << i << " must change";
      }
    }
  }
  // Same prefix, different continuation: the shared blocks hash the same.
  std::vector<int32_t> longer(base_tokens.begin(), base_tokens.begin() + 3 * kBlockTokens);
  const std::vector<int32_t> tail = tokens_from(3, 4 * kBlockTokens);
  longer.insert(longer.end(), tail.begin(), tail.end());
  const std::vector<BlockHash> fork = block_hash_chain(longer, kFingerprint);
  ASSERT_EQ(fork.size(), 7u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(fork[i], base[i]) << "shared block " << i;
  for (size_t i = 3; i < 5; ++i) EXPECT_NE(fork[i], base[i]) << "forked block " << i;
}

TEST(BlockHashTest, ExtendingAChainEqualsHashingTheWholeSequence) {
  const std::vector<int32_t> tokens = tokens_from(4, 6 * kBlockTokens + 1);
  std::vector<BlockHash> chain;
  for (size_t length : {0, 10, 64, 65, 200, 256, 256, 385}) {
    extend_block_hash_chain(chain, std::span<const int32_t>(tokens).first(length), kFingerprint);
    EXPECT_EQ(chain, block_hash_chain(std::span<const int32_t>(tokens).first(length), kFingerprint)) << length;
  }
}

// ---- the prefix index ---------------------------------------------------------------------------------------

// Chains over small ids: block hashes {id, 0}.
std::vector<BlockHash> chain_of(std::initializer_list<uint64_t> ids) {
  std::vector<BlockHash> chain;
  for (uint64_t id : ids) chain.push_back(BlockHash{id, 0});
  return chain;
}

// The node at `depth` (1-based) along `chain`, or kNoNode.
NodeId node_at(const PrefixIndex& index, const std::vector<BlockHash>& chain, size_t depth) {
  NodeId node = kNoNode;
  for (size_t i = 0; i < depth; ++i) {
    node = index.find_child(node, chain[i]);
    if (node == kNoNode) return kNoNode;
  }
  return node;
}

enum class Op { kInsert, kMatch, kPin, kUnpin, kEvictLeaf, kRemoveFromTier, kAddToTier, kTouch };

struct IndexStep {
  Op op;
  std::vector<BlockHash> chain;
  size_t depth = 0;           // kMatch: expected matched blocks; others: the node at this depth of `chain`
  Tier tier = Tier::kDevice;  // kInsert / kRemoveFromTier / kAddToTier
  int64_t now_ms = 0;
  StatusCode expected_code = StatusCode::kOk;
  int64_t expected_nodes = -1;  // after the step (-1: not checked)
  int64_t expected_device = -1;
  int64_t expected_host = -1;
  std::vector<std::pair<std::vector<BlockHash>, size_t>> expected_device_order = {};  // eviction order (chain, depth)
  TtlClassId ttl_class = kDefaultTtlClass;
};

struct IndexScenario {
  std::string name;
  std::vector<IndexStep> steps;
};

void run_index_scenario(const IndexScenario& scenario) {
  PrefixIndex index;
  std::vector<CacheEvent> events;
  index.set_listener([&](const CacheEvent& event) { events.push_back(event); });
  int64_t stored = 0, removed = 0;
  for (size_t i = 0; i < scenario.steps.size(); ++i) {
    const IndexStep& step = scenario.steps[i];
    const std::string where = scenario.name + ", step " + std::to_string(i + 1);
    const NodeId node =
        step.op == Op::kInsert || step.op == Op::kMatch ? kNoNode : node_at(index, step.chain, step.depth);
    Status status;
    switch (step.op) {
      case Op::kInsert: {
        Result<std::vector<NodeId>> nodes = index.insert(step.chain, step.tier, step.now_ms, step.ttl_class);
        status = nodes.status();
        if (nodes.ok()) {
          ASSERT_EQ(nodes->size(), step.chain.size()) << where;
          for (size_t d = 0; d < nodes->size(); ++d) EXPECT_EQ((*nodes)[d], node_at(index, step.chain, d + 1)) << where;
        }
        break;
      }
      case Op::kMatch: {
        std::vector<NodeId> matched = index.match(step.chain, step.now_ms);
        EXPECT_EQ(matched.size(), step.depth) << where << ": matched blocks";
        for (size_t d = 0; d < matched.size(); ++d) {
          EXPECT_EQ(matched[d], node_at(index, step.chain, d + 1)) << where;
          EXPECT_EQ(index.node(matched[d]).depth, static_cast<int32_t>(d + 1)) << where;
        }
        break;
      }
      case Op::kPin:
        ASSERT_NE(node, kNoNode) << where;
        for (NodeId n = node; n != kNoNode; n = index.node(n).parent) {
          if (Status s = index.pin(n); !s.ok()) status = s;
        }
        break;
      case Op::kUnpin:
        ASSERT_NE(node, kNoNode) << where;
        for (NodeId n = node; n != kNoNode; n = index.node(n).parent) {
          if (Status s = index.unpin(n); !s.ok()) status = s;
        }
        break;
      case Op::kEvictLeaf:
        ASSERT_NE(node, kNoNode) << where;
        status = index.evict_leaf(node);
        break;
      case Op::kRemoveFromTier:
        ASSERT_NE(node, kNoNode) << where;
        status = index.remove_from_tier(node, step.tier);
        break;
      case Op::kAddToTier:
        ASSERT_NE(node, kNoNode) << where;
        status = index.add_to_tier(node, step.tier);
        break;
      case Op::kTouch: {
        ASSERT_NE(node, kNoNode) << where;
        const NodeId nodes[] = {node};
        index.touch(nodes, step.now_ms, step.ttl_class);
        break;
      }
    }
    EXPECT_EQ(status.code(), step.expected_code) << where << ": " << status.to_string();
    if (!status.ok()) {
      EXPECT_FALSE(status.message().empty()) << where;
    }
    if (step.expected_nodes >= 0) {
      EXPECT_EQ(index.num_nodes(), step.expected_nodes) << where << ": nodes";
    }
    if (step.expected_device >= 0) {
      EXPECT_EQ(index.num_in_tier(Tier::kDevice), step.expected_device) << where << ": device copies";
    }
    if (step.expected_host >= 0) {
      EXPECT_EQ(index.num_in_tier(Tier::kHost), step.expected_host) << where << ": host copies";
    }
    if (!step.expected_device_order.empty() || step.op == Op::kPin) {
      std::vector<NodeId> expected;
      for (const auto& [chain, depth] : step.expected_device_order) expected.push_back(node_at(index, chain, depth));
      EXPECT_EQ(index.eviction_order(Tier::kDevice, 100), expected) << where << ": device eviction order";
      EXPECT_EQ(index.eviction_candidate(Tier::kDevice), expected.empty() ? kNoNode : expected.front()) << where;
    }
    Status invariants = index.check_invariants();
    EXPECT_TRUE(invariants.ok()) << where << ": " << invariants.to_string();
    // Every tier copy gained or lost is one event.
    int64_t copies = index.num_in_tier(Tier::kDevice) + index.num_in_tier(Tier::kHost) + index.num_in_tier(Tier::kDisk);
    for (; static_cast<size_t>(stored + removed) < events.size();) {
      const CacheEvent& event = events[static_cast<size_t>(stored + removed)];
      (event.type == CacheEvent::Type::kStored ? stored : removed) += 1;
    }
    EXPECT_EQ(stored - removed, copies) << where << ": events stored - removed == copies held";
  }
}

const std::vector<BlockHash> kA = chain_of({1, 2, 3});
const std::vector<BlockHash> kB = chain_of({1, 2, 4, 5});
const std::vector<BlockHash> kC = chain_of({6});

TEST(PrefixIndexTest, Scenarios) {
  using C = StatusCode;
  const std::vector<IndexScenario> scenarios = {
      {"insert, match, shared prefixes, leaves-only eviction",
       {
           {Op::kMatch, kA, 0},
           {Op::kInsert, kA, 0, Tier::kDevice, 0, C::kOk, 3, 3, 0, {{kA, 3}}},
           {Op::kMatch, kA, 3},
           {Op::kMatch, chain_of({1, 2, 9}), 2},
           {Op::kMatch, chain_of({2, 3}), 0},  // a hash only counts under its parent
           {Op::kMatch, chain_of({1, 2, 3, 4, 5}), 3},
           {Op::kInsert, kB, 0, Tier::kDevice, 10, C::kOk, 5, 5, 0, {{kA, 3}, {kB, 4}}},  // shares blocks 1, 2
           {Op::kMatch, kB, 4},
           {Op::kInsert, kC, 0, Tier::kDevice, 20, C::kOk, 6, 6, 0, {{kA, 3}, {kB, 4}, {kC, 1}}},
           {Op::kEvictLeaf, kA, 2, Tier::kDevice, 0, C::kInvalidArgument, 6, 6},  // inner node: children first
           {Op::kEvictLeaf, kB, 3, Tier::kDevice, 0, C::kInvalidArgument, 6, 6},
           {Op::kEvictLeaf, kA, 3, Tier::kDevice, 0, C::kOk, 5, 5, 0, {{kB, 4}, {kC, 1}}},
           {Op::kMatch, kA, 2},
           {Op::kEvictLeaf, kB, 4, Tier::kDevice, 0, C::kOk, 4, 4, 0, {{kB, 3}, {kC, 1}}},  // block 4 is a leaf now
           {Op::kEvictLeaf, kB, 3, Tier::kDevice, 0, C::kOk, 3, 3, 0, {{kB, 2}, {kC, 1}}},
           {Op::kMatch, kA, 2},
           {Op::kInsert, kA, 0, Tier::kDevice, 30, C::kOk, 4, 4, 0, {{kC, 1}, {kA, 3}}},  // re-inserted, newest
       }},
      {"pins protect a path; unpin makes it evictable again",
       {
           {Op::kInsert, kA, 0, Tier::kDevice, 0, C::kOk, 3, 3},
           {Op::kInsert, kB, 0, Tier::kDevice, 5, C::kOk, 5, 5, 0, {{kA, 3}, {kB, 4}}},
           {Op::kPin, kB, 4, Tier::kDevice, 0, C::kOk, 5, 5, 0, {{kA, 3}}},
           {Op::kEvictLeaf, kB, 4, Tier::kDevice, 0, C::kInvalidArgument, 5, 5},
           {Op::kEvictLeaf, kA, 3, Tier::kDevice, 0, C::kOk, 4, 4},
           {Op::kPin, kB, 4, Tier::kDevice, 0, C::kOk, 4, 4, 0, {}},  // pinned twice; nothing may go
           {Op::kUnpin, kB, 4, Tier::kDevice, 0, C::kOk, 4, 4, 0, {}},
           {Op::kEvictLeaf, kB, 2, Tier::kDevice, 0, C::kInvalidArgument, 4, 4},
           {Op::kUnpin, kB, 4, Tier::kDevice, 0, C::kOk, 4, 4, 0, {{kB, 4}}},
           {Op::kUnpin, kB, 4, Tier::kDevice, 0, C::kInternal, 4, 4},  // double release
           {Op::kEvictLeaf, kB, 4, Tier::kDevice, 0, C::kOk, 3, 3, 0, {{kB, 3}}},
       }},
      {"tiers: a copy per tier, the leaf rule per tier, the last copy goes last",
       {
           {Op::kInsert, kA, 0, Tier::kDevice, 0, C::kOk, 3, 3, 0},
           {Op::kInsert, kA, 0, Tier::kHost, 1, C::kOk, 3, 3, 3},
           {Op::kInsert, kA, 0, Tier::kHost, 1, C::kOk, 3, 3, 3},  // already there: no change
           {Op::kAddToTier, kA, 1, Tier::kHost, 0, C::kInvalidArgument, 3, 3, 3},
           {Op::kRemoveFromTier, kA, 2, Tier::kDevice, 0, C::kInvalidArgument, 3, 3, 3},  // child 3 on device
           {Op::kRemoveFromTier, kA, 3, Tier::kDevice, 0, C::kOk, 3, 2, 3, {{kA, 2}}},
           {Op::kRemoveFromTier, kA, 2, Tier::kDevice, 0, C::kOk, 3, 1, 3, {{kA, 1}}},
           {Op::kRemoveFromTier, kA, 2, Tier::kHost, 0, C::kInvalidArgument, 3, 1, 3},  // last copy, has a child
           {Op::kRemoveFromTier, kA, 3, Tier::kHost, 0, C::kOk, 2, 1, 2},  // last copy of a leaf: the node goes
           {Op::kMatch, kA, 2},
           {Op::kRemoveFromTier, kA, 1, Tier::kHost, 0, C::kInvalidArgument, 2, 1, 2},  // child 2 on host
           {Op::kMatch, kA, 2},  // block 1 on device and host, block 2 on host: still a prefix
           {Op::kEvictLeaf, kA, 2, Tier::kDevice, 0, C::kOk, 1, 1, 1},
           {Op::kRemoveFromTier, kA, 1, Tier::kHost, 0, C::kOk, 1, 1, 0},               // the device copy stays
           {Op::kRemoveFromTier, kA, 1, Tier::kHost, 0, C::kInvalidArgument, 1, 1, 0},  // no host copy any more
           {Op::kMatch, kA, 1},
           {Op::kEvictLeaf, kA, 1, Tier::kDevice, 0, C::kOk, 0, 0, 0},
       }},
      {"expiry: live through now == expiry, the longer TTL wins, expired blocks evict first",
       {
           {Op::kInsert, kA, 0, Tier::kDevice, 0, C::kOk, 3, 3, 0, {}, /*chat*/ 1},
           {Op::kInsert, kC, 0, Tier::kDevice, 1000, C::kOk, 4, 4, 0, {{kC, 1}, {kA, 3}}, /*agent*/ 2},
           {Op::kMatch, kA, 3, Tier::kDevice, 7 * kDayMs},
           {Op::kMatch, kA, 0, Tier::kDevice, 7 * kDayMs + 1},
           {Op::kMatch, kC, 1, Tier::kDevice, 3 * kDayMs + 1000},
           {Op::kMatch, kC, 0, Tier::kDevice, 3 * kDayMs + 1001},
           // An agent touch at day 5 moves A's leaf to day 8; the chat expiry (day 7) of its parents stays.
           {Op::kTouch, kA, 3, Tier::kDevice, 5 * kDayMs, C::kOk, 4, 4, 0, {{kC, 1}, {kA, 3}}, 2},
           {Op::kMatch, kA, 0, Tier::kDevice, 7 * kDayMs + 1},  // block 1 expired: the prefix is gone
           {Op::kTouch, kA, 3, Tier::kDevice, 5 * kDayMs, C::kOk, 4, 4, 0, {{kC, 1}, {kA, 3}}, 1},  // chat: 12 days
       }},
  };
  for (const IndexScenario& scenario : scenarios) run_index_scenario(scenario);
}

TEST(PrefixIndexTest, CacheKindsMustBeCompleteToMatch) {
  PrefixIndex index;
  Result<std::vector<NodeId>> nodes = index.insert(kA, Tier::kDevice, 0, kDefaultTtlClass, kLatentOnly);
  ASSERT_TRUE(nodes.ok());
  const CacheKindSet v4{CacheKind::kLatent, CacheKind::kSlidingWindow, CacheKind::kCompressed};
  EXPECT_EQ(index.match(kA, 0, kLatentOnly).size(), 3u);
  EXPECT_EQ(index.match(kA, 0, v4).size(), 0u);
  ASSERT_TRUE(index.add_kinds((*nodes)[0], v4).ok());
  ASSERT_TRUE(index.add_kinds((*nodes)[1], v4).ok());
  EXPECT_EQ(index.match(kA, 0, v4).size(), 2u) << "block 3 still lacks the window and compressed kinds";
  EXPECT_TRUE(index.node((*nodes)[0]).kinds.contains_all(v4));
  // A tier filter: only device copies.
  EXPECT_EQ(index.match(kA, 0, kLatentOnly, TierSet{Tier::kHost}).size(), 0u);
}

TEST(PrefixIndexTest, EventsCarryHashesParentsAndDeviceBlocks) {
  PrefixIndex index;
  std::vector<CacheEvent> events;
  index.set_listener([&](const CacheEvent& event) { events.push_back(event); });
  Result<std::vector<NodeId>> nodes = index.insert(chain_of({10, 11}), Tier::kDevice, 0);
  ASSERT_TRUE(nodes.ok());
  ASSERT_TRUE(index.set_device_block((*nodes)[1], 42).ok());
  ASSERT_TRUE(index.add_to_tier((*nodes)[1], Tier::kHost).ok());
  ASSERT_TRUE(index.remove_from_tier((*nodes)[1], Tier::kDevice).ok());
  EXPECT_EQ(index.node((*nodes)[1]).device_block, kNoBlock);
  EXPECT_EQ(index.set_device_block((*nodes)[1], 7).code(), StatusCode::kInvalidArgument) << "no device copy";
  ASSERT_EQ(events.size(), 4u);
  struct Expected {
    CacheEvent::Type type;
    uint64_t hash;
    uint64_t parent;
    int32_t depth;
    Tier tier;
    BlockId block;
  };
  const std::vector<Expected> expected = {
      {CacheEvent::Type::kStored, 10, 0, 1, Tier::kDevice, kNoBlock},
      {CacheEvent::Type::kStored, 11, 10, 2, Tier::kDevice, kNoBlock},
      {CacheEvent::Type::kStored, 11, 10, 2, Tier::kHost, kNoBlock},
      {CacheEvent::Type::kRemoved, 11, 10, 2, Tier::kDevice, 42},  // the owner frees block 42
  };
  for (size_t i = 0; i < expected.size(); ++i) {
    const std::string where = "event " + std::to_string(i + 1);
    EXPECT_EQ(events[i].type, expected[i].type) << where;
    EXPECT_EQ(events[i].hash, (BlockHash{expected[i].hash, 0})) << where;
    EXPECT_EQ(events[i].parent_hash, (BlockHash{expected[i].parent, 0})) << where;
    EXPECT_EQ(events[i].depth, expected[i].depth) << where;
    EXPECT_EQ(events[i].tier, expected[i].tier) << where;
    EXPECT_EQ(events[i].device_block, expected[i].block) << where;
  }
}

TEST(PrefixIndexTest, DeadIdsAndUnknownClassesAreErrors) {
  PrefixIndex index;
  EXPECT_EQ(index.pin(0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index.add_block(5, BlockHash{1, 0}, Tier::kDevice, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(index.add_block(kNoNode, BlockHash{1, 0}, Tier::kDevice, 0, /*ttl_class=*/9).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(index.num_nodes(), 0);
  Result<NodeId> node = index.add_block(kNoNode, BlockHash{1, 0}, Tier::kDevice, 0);
  ASSERT_TRUE(node.ok());
  ASSERT_TRUE(index.evict_leaf(*node).ok());
  EXPECT_FALSE(index.contains(*node));
  EXPECT_EQ(index.evict_leaf(*node).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(index.check_invariants().ok());
}

TEST(RetentionConfigTest, DefaultsAndValidation) {
  const RetentionConfig defaults = RetentionConfig::defaults();
  ASSERT_EQ(defaults.classes.size(), 3u);
  EXPECT_EQ(defaults.ttl_ms(kDefaultTtlClass), 168 * kHourMs);
  EXPECT_EQ(defaults.ttl_ms(*defaults.find("chat")), 7 * kDayMs);
  EXPECT_EQ(defaults.ttl_ms(*defaults.find("agent")), 3 * kDayMs);
  EXPECT_FALSE(defaults.find("batch").has_value());
  EXPECT_EQ(RetentionConfig::defaults(0.5).ttl_ms(kDefaultTtlClass), 1800 * 1000);
  EXPECT_TRUE(defaults.validate().ok());
  RetentionConfig bad = defaults;
  bad.classes.push_back({"chat", 1});
  EXPECT_EQ(bad.validate().code(), StatusCode::kInvalidArgument);
  bad.classes.back() = {"batch", 0};
  EXPECT_EQ(bad.validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RetentionConfig{}.validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deepinfer::kvcache
