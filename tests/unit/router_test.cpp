// The router's decisions with no HTTP and no model: the KV index fed by KV events (kv_index.h), each routing
// policy (policy.h), the consistent-hash key (routing_keys.h) and worker URL parsing (router.h).
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "deepinfer/kvcache/block_hash.h"
#include "deepinfer/kvcache/kv_events.h"
#include "deepinfer/router/kv_index.h"
#include "deepinfer/router/policy.h"
#include "deepinfer/router/router.h"
#include "deepinfer/router/routing_keys.h"

namespace deepinfer::router {
namespace {

using kvcache::BlockHash;
using kvcache::KvEvent;
using kvcache::KvEventBatch;

const kvcache::ModelFingerprint kFingerprint = kvcache::model_fingerprint("{}", "router-test");

std::vector<int32_t> tokens(int32_t count, int32_t first) {
  std::vector<int32_t> out(static_cast<size_t>(count));
  std::iota(out.begin(), out.end(), first);
  return out;
}

// The events a worker publishes when `chain`'s blocks [begin, end) enter `medium`.
KvEventBatch stored(const std::vector<BlockHash>& chain, size_t begin, size_t end, std::string_view medium) {
  KvEventBatch batch;
  for (size_t i = begin; i < end; ++i) {
    const std::vector<int32_t> none;
    batch.events.push_back(KvEvent::stored(medium, chain[i], i == 0 ? kvcache::kRootBlockHash : chain[i - 1], none));
  }
  return batch;
}

KvEventBatch removed(const std::vector<BlockHash>& chain, size_t begin, size_t end, std::string_view medium) {
  KvEventBatch batch;
  for (size_t i = begin; i < end; ++i) batch.events.push_back(KvEvent::removed(medium, chain[i]));
  return batch;
}

TEST(RouterKvIndex, MatchesTheLeadingRunEachWorkerHoldsByTier) {
  const std::vector<BlockHash> chain = kvcache::block_hash_chain(tokens(64 * 6, 100), kFingerprint);
  ASSERT_EQ(chain.size(), 6u);
  KvIndex index(3);
  index.apply(0, stored(chain, 0, 4, kvcache::kMediumGpu));   // worker 0: blocks 0-3 on the device
  index.apply(1, stored(chain, 0, 2, kvcache::kMediumGpu));   // worker 1: 0-1 on the device,
  index.apply(1, stored(chain, 2, 5, kvcache::kMediumHost));  //           2-4 in host RAM,
  index.apply(1, stored(chain, 5, 6, kvcache::kMediumDisk));  //           5 on disk
  index.apply(2, stored(chain, 1, 6, kvcache::kMediumGpu));   // worker 2: everything but block 0: no prefix
  std::vector<PrefixMatch> m = index.match(chain);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].blocks, 4);
  EXPECT_EQ(m[0].host_blocks, 0);
  EXPECT_EQ(m[1].blocks, 6);
  EXPECT_EQ(m[1].host_blocks, 3);
  EXPECT_EQ(m[1].disk_blocks, 1);
  EXPECT_EQ(m[2].blocks, 0);
  EXPECT_EQ(index.worker_blocks(1), 6);
  EXPECT_EQ(index.distinct_blocks(), 6);

  // Block 2 leaves worker 0's device: its match stops at 2. A copy in two tiers stays until both are gone.
  index.apply(0, removed(chain, 2, 3, kvcache::kMediumGpu));
  index.apply(1, stored(chain, 2, 3, kvcache::kMediumGpu));
  index.apply(1, removed(chain, 2, 3, kvcache::kMediumHost));
  m = index.match(chain);
  EXPECT_EQ(m[0].blocks, 2);
  EXPECT_EQ(m[1].blocks, 6);
  EXPECT_EQ(m[1].host_blocks, 2);  // block 2 is on the device now
  // Removing what was never stored (an event lost earlier) changes nothing.
  index.apply(2, removed(chain, 0, 1, kvcache::kMediumGpu));
  EXPECT_EQ(index.worker_blocks(2), 5);

  // AllBlocksCleared and clear_worker forget one worker only.
  KvEventBatch cleared;
  cleared.events.push_back(KvEvent::all_cleared());
  index.apply(1, cleared);
  index.clear_worker(2);
  m = index.match(chain);
  EXPECT_EQ(m[0].blocks, 2);
  EXPECT_EQ(m[1].blocks, 0);
  EXPECT_EQ(m[2].blocks, 0);
  EXPECT_EQ(index.worker_blocks(1), 0);
  EXPECT_EQ(index.distinct_blocks(), 3);  // worker 0: blocks 0, 1 and 3
}

TEST(RouterKvIndex, ADivergingSuffixStopsTheMatchAtTheFork) {
  std::vector<int32_t> a = tokens(64 * 4, 100);
  std::vector<int32_t> b = a;
  b[64 * 2 + 5] = 7;  // b differs from a in block 2
  const std::vector<BlockHash> chain_a = kvcache::block_hash_chain(a, kFingerprint);
  const std::vector<BlockHash> chain_b = kvcache::block_hash_chain(b, kFingerprint);
  KvIndex index(1);
  index.apply(0, stored(chain_a, 0, 4, kvcache::kMediumDevice));
  EXPECT_EQ(index.match(chain_a)[0].blocks, 4);
  EXPECT_EQ(index.match(chain_b)[0].blocks, 2);
  // Another model's fingerprint shares nothing.
  const std::vector<BlockHash> other = kvcache::block_hash_chain(a, kvcache::model_fingerprint("{}", "other"));
  EXPECT_EQ(index.match(other)[0].blocks, 0);
}

std::vector<WorkerState> idle(int32_t n) { return std::vector<WorkerState>(static_cast<size_t>(n)); }

TEST(RouterPolicy, KvAwarePicksTheLongestMatchWhenLoadsAreEqual) {
  RoutingPolicy policy(Policy::kKvAware, {"a", "b", "c"});
  RouteRequest request;
  request.prompt_tokens = 64 * 10 + 5;  // (10 blocks and 5 tokens)
  request.matches = {{2, 0, 0}, {8, 0, 0}, {5, 0, 0}};
  const Decision d = policy.choose(request, idle(3));
  EXPECT_EQ(d.worker, 1);
  EXPECT_EQ(d.reason, "cache_hit");
  EXPECT_EQ(d.cached_tokens, 64 * 8);
  EXPECT_EQ(d.uncached_tokens, 64 * 2 + 5);
}

TEST(RouterPolicy, KvAwareWeighsHostAndDiskHitsBelowDeviceHits) {
  RoutingPolicy policy(Policy::kKvAware, {"a", "b"}, CostWeights{1.0, 1.0, 0.1, 0.1, 0.3});
  RouteRequest request;
  request.prompt_tokens = 64 * 10;
  // a: 8 blocks, all on disk: 2 + 8 * 0.3 = 4.4 blocks of work; b: 6 on the device: 4 blocks of work.
  request.matches = {{8, 0, 8}, {6, 0, 0}};
  EXPECT_NEAR(policy.uncached_tokens(request.prompt_tokens, request.matches[0]), 64 * 4.4, 1e-9);
  EXPECT_EQ(policy.choose(request, idle(2)).worker, 1);
  // In host RAM instead: 2 + 0.8 = 2.8 blocks: a wins.
  request.matches[0] = {8, 8, 0};
  EXPECT_EQ(policy.choose(request, idle(2)).worker, 0);
}

TEST(RouterPolicy, KvAwareLetsLoadOutweighAShortHit) {
  RoutingPolicy policy(Policy::kKvAware, {"a", "b"}, CostWeights{1.0, 1.0, 1.0, 0.1, 0.3});  // decode weighed as Dynamo does
  RouteRequest request;
  request.prompt_tokens = 64 * 4;
  request.matches = {{3, 0, 0}, {0, 0, 0}};
  std::vector<WorkerState> workers = idle(2);
  // a holds 3 of 4 blocks but has 20 blocks of prefill queued: b (4 blocks of work) is cheaper.
  workers[0].pending_prefill_tokens = 64 * 20;
  EXPECT_EQ(policy.choose(request, workers).worker, 1);
  // With the default queue weight (0.25) 20 queued blocks count 5: still more than b's 3 extra blocks ...
  RoutingPolicy defaults(Policy::kKvAware, {"a", "b"});
  EXPECT_EQ(defaults.choose(request, workers).worker, 1);
  // ... 8 queued blocks count 2: a keeps the request and its cache.
  workers[0].pending_prefill_tokens = 64 * 8;
  EXPECT_EQ(defaults.choose(request, workers).worker, 0);
  workers[0].pending_prefill_tokens = 64 * 20;
  Decision d = policy.choose(request, workers);
  EXPECT_EQ(d.worker, 1);
  EXPECT_EQ(d.reason, "load");
  // Decode load counts too: a's requests in flight hold 30 blocks of KV.
  workers[0].pending_prefill_tokens = 0;
  workers[0].active_tokens = 64 * 30;
  EXPECT_EQ(policy.choose(request, workers).worker, 1);
  workers[0].active_tokens = 64 * 2;
  EXPECT_EQ(policy.choose(request, workers).worker, 0);
}

TEST(RouterPolicy, KvAwareSpreadsRequestsNobodyHoldsInTurn) {
  RoutingPolicy policy(Policy::kKvAware, {"a", "b", "c"});
  RouteRequest request;
  request.prompt_tokens = 100;
  request.matches = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
  std::set<int32_t> chosen;
  for (int i = 0; i < 3; ++i) {
    const Decision d = policy.choose(request, idle(3));
    EXPECT_EQ(d.reason, "no_cache_hit");
    chosen.insert(d.worker);
  }
  EXPECT_EQ(chosen.size(), 3u);
}

TEST(RouterPolicy, EveryPolicySkipsUnhealthyAndExcludedWorkers) {
  for (Policy p : {Policy::kKvAware, Policy::kRoundRobin, Policy::kConsistentHash, Policy::kLeastLoad}) {
    SCOPED_TRACE(std::string(policy_name(p)));
    RoutingPolicy policy(p, {"a", "b", "c"});
    RouteRequest request;
    request.prompt_tokens = 64 * 3;
    request.matches = {{3, 0, 0}, {3, 0, 0}, {0, 0, 0}};
    request.affinity_key = 12345;
    request.excluded = {0, 1, 0};
    std::vector<WorkerState> workers = idle(3);
    workers[0].healthy = false;
    for (int i = 0; i < 5; ++i) EXPECT_EQ(policy.choose(request, workers).worker, 2);
    workers[2].healthy = false;
    const Decision none = policy.choose(request, workers);
    EXPECT_EQ(none.worker, -1);
  }
}

TEST(RouterPolicy, RoundRobinAndLeastLoad) {
  RoutingPolicy rr(Policy::kRoundRobin, {"a", "b", "c"});
  RouteRequest request;
  std::vector<int32_t> order;
  for (int i = 0; i < 6; ++i) order.push_back(rr.choose(request, idle(3)).worker);
  EXPECT_EQ(order, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));

  RoutingPolicy least(Policy::kLeastLoad, {"a", "b", "c"});
  std::vector<WorkerState> workers = idle(3);
  workers[0].in_flight = 2;
  workers[1].in_flight = 1;
  workers[2].in_flight = 3;
  const Decision d = least.choose(request, workers);
  EXPECT_EQ(d.worker, 1);
  EXPECT_EQ(d.reason, "least_load");
}

TEST(RouterPolicy, ConsistentHashIsStableAndMovesOnlyADeadWorkersKeys) {
  RoutingPolicy policy(Policy::kConsistentHash, {"http://a:1", "http://b:1", "http://c:1", "http://d:1"});
  std::map<uint64_t, int32_t> first;
  std::vector<int32_t> per_worker(4, 0);
  for (uint64_t key = 0; key < 2000; ++key) {
    RouteRequest request;
    request.affinity_key = affinity_key("conversation " + std::to_string(key));
    const Decision d = policy.choose(request, idle(4));
    ASSERT_GE(d.worker, 0);
    EXPECT_EQ(d.reason, "consistent_hash");
    first[request.affinity_key] = d.worker;
    ++per_worker[static_cast<size_t>(d.worker)];
    EXPECT_EQ(policy.choose(request, idle(4)).worker, d.worker);  // the same key, the same worker
  }
  for (int32_t count : per_worker) EXPECT_GT(count, 300);  // 160 virtual nodes spread 2,000 keys roughly evenly
  std::vector<WorkerState> workers = idle(4);
  workers[2].healthy = false;
  for (const auto& [key, worker] : first) {
    RouteRequest request;
    request.affinity_key = key;
    const int32_t now = policy.choose(request, workers).worker;
    if (worker != 2) {
      EXPECT_EQ(now, worker);  // only worker 2's keys move
    }
    EXPECT_NE(now, 2);
  }
}

TEST(RouterPolicy, ParsesPolicyNames) {
  EXPECT_EQ(*parse_policy("kv-aware"), Policy::kKvAware);
  EXPECT_EQ(*parse_policy("consistent-hash"), Policy::kConsistentHash);
  Result<Policy> bad = parse_policy("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'random' is not one of kv-aware"), std::string::npos);
}

TEST(RouterKeys, AffinityKeyHashesTheFirst2048Characters) {
  const std::string base(2048, 'x');
  EXPECT_EQ(affinity_key(base + "tail one"), affinity_key(base + "another tail"));
  EXPECT_NE(affinity_key(base.substr(1) + "a"), affinity_key(base.substr(1) + "b"));
  // Characters, not bytes: 2,048 two-byte characters are all kept.
  std::string wide;
  for (int i = 0; i < 2047; ++i) wide += "\xc3\xa9";  // é
  EXPECT_NE(affinity_key(wide + "a"), affinity_key(wide + "b"));
  EXPECT_EQ(affinity_key(wide + "a" + "b"), affinity_key(wide + "a" + "c"));
}

TEST(RouterKeys, AffinityTextTakesSystemAndUserTextOfEveryDialect) {
  const auto text = [](std::string_view body) {
    return affinity_text(boost::json::parse(body).as_object(), nullptr);
  };
  EXPECT_EQ(text(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                                  {"role": "assistant", "content": "A"},
                                  {"role": "user", "content": [{"type": "text", "text": "U2"}]}]})"),
            "S\nU1\nU2");
  EXPECT_EQ(text(R"({"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "U"}]})"),
            "S\nU");
  EXPECT_EQ(text(R"({"instructions": "I", "input": "hello"})"), "I\nhello");
  EXPECT_EQ(text(R"({"prompt": [5, 6]})"), "5 6 ");
  EXPECT_EQ(text(R"({"prompt": "p", "messages": 3})"), "p");
}

TEST(RouterUrls, ParsesWorkerUrlsAndRewritesWildcardEndpoints) {
  Result<WorkerAddress> a = parse_worker_url("http://10.0.0.2:8000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "10.0.0.2");
  EXPECT_EQ(a->port, 8000);
  Result<WorkerAddress> b = parse_worker_url("http://[fd00::1]:9000/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "fd00::1");
  for (const char* bad : {"10.0.0.2:8000", "http://host", "http://host:0", "http://host:70000", "http://host:80/v1",
                          "https://host:443", "http://:80"}) {
    EXPECT_FALSE(parse_worker_url(bad).ok()) << bad;
  }
  EXPECT_EQ(reachable_endpoint("tcp://*:5557", "10.0.0.2"), "tcp://10.0.0.2:5557");
  EXPECT_EQ(reachable_endpoint("tcp://0.0.0.0:5557", "fd00::1"), "tcp://[fd00::1]:5557");
  EXPECT_EQ(reachable_endpoint("tcp://10.0.0.9:5557", "10.0.0.2"), "tcp://10.0.0.9:5557");
}

}  // namespace
}  // namespace deepinfer::router
