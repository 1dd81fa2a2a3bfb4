// EPLB's placement policy (expert_placement.h) on skewed loads: every expert keeps a slot, hot experts get the
// redundant ones, the ranks' max/mean load falls, and the hierarchical policy keeps each expert group on one node.
#include "deepinfer/model/expert_placement.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

namespace deepinfer::model {
namespace {

// A Zipf-like load over E experts (expert e gets 1 / (1 + (e * 7 mod E))^s): hot experts spread over the id space.
std::vector<double> zipf(int64_t E, double s) {
  std::vector<double> load(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) load[e] = 1000.0 / std::pow(1.0 + static_cast<double>((e * 7) % E), s);
  return load;
}

TEST(ExpertPlacement, ContiguousPutsExpertsInOrderThenRepeats) {
  ExpertPlacement p = ExpertPlacement::contiguous(2, 8, 4, 4);
  EXPECT_EQ(p.slots_per_rank(), 3);
  EXPECT_EQ(p.phy2log[1], (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
}

TEST(ExpertPlacement, GlobalPolicyBalancesASkewedLoad) {
  // DeepSeek-V3's shape: 256 experts, 8 ranks, 32 redundant slots.
  const std::vector<double> load = zipf(256, 1.2);
  ExpertPlacement contiguous = ExpertPlacement::contiguous(1, 256, 32, 8);
  ExpertPlacement placed = rebalance_experts({load}, 288, 8, EplbPolicy::kGlobal);
  ASSERT_EQ(placed.phy2log.size(), 1u);
  ASSERT_EQ(placed.phy2log[0].size(), 288u);
  std::vector<int> replicas(256, 0);
  for (int32_t e : placed.phy2log[0]) ++replicas[e];
  for (int e = 0; e < 256; ++e) EXPECT_GE(replicas[e], 1) << "expert " << e;
  // The hottest expert (e = 0) gets more than one slot.
  EXPECT_GT(replicas[0], 1);
  const double before = rank_imbalance(load, contiguous.phy2log[0], 8);
  const double after = rank_imbalance(load, placed.phy2log[0], 8);
  std::printf("{\"test\":\"eplb_policy\",\"policy\":\"global\",\"experts\":256,\"ranks\":8,\"redundant\":32,"
              "\"max_over_mean_before\":%.3f,\"max_over_mean_after\":%.3f}\n", before, after);
  EXPECT_GT(before, 1.3);
  EXPECT_LT(after, 1.05);
}

TEST(ExpertPlacement, HierarchicalKeepsEachGroupOnOneNode) {
  // 64 experts in 8 groups, 2 nodes of 4 ranks, 16 redundant: every slot of a node holds an expert of the groups
  // packed onto that node, and each group's experts live on one node.
  const std::vector<double> load = zipf(64, 1.0);
  ExpertPlacement placed = rebalance_experts({load}, 80, 8, EplbPolicy::kHierarchical, 8, 2);
  const std::vector<int32_t>& slots = placed.phy2log[0];
  std::set<int32_t> node_groups[2];
  for (int64_t p = 0; p < 80; ++p) node_groups[p / 40].insert(slots[p] / 8);
  EXPECT_EQ(node_groups[0].size(), 4u);
  EXPECT_EQ(node_groups[1].size(), 4u);
  for (int32_t g : node_groups[0]) EXPECT_EQ(node_groups[1].count(g), 0u) << "group " << g << " on both nodes";
  const double before = rank_imbalance(load, ExpertPlacement::contiguous(1, 64, 16, 8).phy2log[0], 8);
  const double after = rank_imbalance(load, slots, 8);
  std::printf("{\"test\":\"eplb_policy\",\"policy\":\"hierarchical\",\"experts\":64,\"groups\":8,\"nodes\":2,"
              "\"ranks\":8,\"redundant\":16,\"max_over_mean_before\":%.3f,\"max_over_mean_after\":%.3f}\n",
              before, after);
  EXPECT_LT(after, before);
}

TEST(ExpertPlacement, GroupsThatDoNotSplitOverNodesFallBackToGlobal) {
  const std::vector<double> load = zipf(16, 1.0);
  EXPECT_EQ(rebalance_experts({load}, 20, 4, EplbPolicy::kHierarchical, 3, 2).phy2log,
            rebalance_experts({load}, 20, 4, EplbPolicy::kGlobal).phy2log);
}

}  // namespace
}  // namespace deepinfer::model
