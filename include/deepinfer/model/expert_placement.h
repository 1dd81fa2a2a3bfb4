// Where each MoE layer's routed experts live across the expert-parallel ranks, and the expert-parallel load balancer
// (EPLB) that moves them. A layer has P physical slots (P = n_routed_experts + redundant experts, P divisible by the
// ranks); slot p lives on rank p / (P / ranks) and holds logical expert phy2log[p]; every logical expert has at least
// one slot, hot ones several (replicas share their tokens).
//
// The policy is DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py `rebalance_experts`), written from its
// description: replicate the heaviest experts (each redundant slot goes to the expert with the largest load per
// replica), then pack the slots onto ranks with balanced packing (heaviest first, to the lightest rank that has room).
// Hierarchical: the expert groups (n_group) are first packed onto nodes, replication and packing then run within each
// node (expert groups stay on one node: group-limited routing then crosses fewer nodes); global: one group, one node.
// Pure functions of the load, deterministic: every rank computes the same placement from the same (all-reduced) load.
#pragma once

#include <cstdint>
#include <vector>

namespace deepinfer::model {

struct ExpertPlacement {
  int64_t num_logical = 0, num_physical = 0, num_ranks = 1;
  std::vector<std::vector<int32_t>> phy2log;  // [layers][num_physical]

  int64_t slots_per_rank() const { return num_physical / num_ranks; }
  // Slots p = 0..P-1 hold p mod E: experts in order on consecutive ranks, the redundant slots again from expert 0.
  static ExpertPlacement contiguous(int64_t layers, int64_t num_logical, int64_t num_redundant, int64_t num_ranks);
};

enum class EplbPolicy { kGlobal, kHierarchical };

// A placement for `load` ([layers][num_logical] tokens per logical expert, e.g. counted over recent steps).
// REQUIRES: num_physical >= num_logical, num_physical % num_ranks == 0; hierarchical: num_logical % num_groups == 0,
// num_groups % num_nodes == 0, num_ranks % num_nodes == 0, num_physical % num_nodes == 0 (else it falls back to
// global, as eplb.py does when groups do not divide among nodes).
ExpertPlacement rebalance_experts(const std::vector<std::vector<double>>& load, int64_t num_physical,
                                  int64_t num_ranks, EplbPolicy policy, int64_t num_groups = 1, int64_t num_nodes = 1);

// max over ranks / mean over ranks of the load a placement gives each rank (a logical expert's load split evenly over
// its replicas), for one layer. 1.0 is perfect balance.
double rank_imbalance(const std::vector<double>& load, const std::vector<int32_t>& phy2log, int64_t num_ranks);

}  // namespace deepinfer::model
