// EPLB's placement policy (expert_placement.h).
#include "deepinfer/model/expert_placement.h"

#include <algorithm>
#include <numeric>

namespace deepinfer::model {
namespace {

// Packs n items into `packs` packs of n / packs items each, heaviest item first into the lightest pack with room
// (ties: the lower pack). pack[i], slot[i]: item i's pack and its position in it.
void balanced_packing(const std::vector<double>& weight, int64_t packs, std::vector<int64_t>& pack,
                      std::vector<int64_t>& slot) {
  const int64_t n = static_cast<int64_t>(weight.size()), per_pack = n / packs;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return weight[a] > weight[b]; });
  std::vector<double> total(static_cast<size_t>(packs), 0.0);
  std::vector<int64_t> count(static_cast<size_t>(packs), 0);
  pack.assign(static_cast<size_t>(n), 0);
  slot.assign(static_cast<size_t>(n), 0);
  for (int64_t item : order) {
    int64_t best = -1;
    for (int64_t p = 0; p < packs; ++p) {
      if (count[p] >= per_pack) continue;
      if (best < 0 || total[p] < total[best]) best = p;
    }
    pack[item] = best;
    slot[item] = count[best]++;
    total[best] += weight[item];
  }
}

// Replicates n logical experts into `slots` >= n physical ones: the first n are the experts themselves, each further
// one the expert with the largest load per replica (ties: the lower expert). Returns phy2log; count[e]: replicas.
std::vector<int64_t> replicate(const std::vector<double>& weight, int64_t slots, std::vector<int64_t>& count) {
  const int64_t n = static_cast<int64_t>(weight.size());
  std::vector<int64_t> phy2log(static_cast<size_t>(slots));
  std::iota(phy2log.begin(), phy2log.begin() + n, 0);
  count.assign(static_cast<size_t>(n), 1);
  for (int64_t p = n; p < slots; ++p) {
    int64_t best = 0;
    for (int64_t e = 1; e < n; ++e) {
      if (weight[e] / static_cast<double>(count[e]) > weight[best] / static_cast<double>(count[best])) best = e;
    }
    phy2log[p] = best;
    ++count[best];
  }
  return phy2log;
}

std::vector<int32_t> place_layer(const std::vector<double>& w, int64_t P, int64_t ranks, int64_t groups,
                                 int64_t nodes) {
  const int64_t E = static_cast<int64_t>(w.size()), group_size = E / groups, groups_per_node = groups / nodes;
  // 1. Expert groups onto nodes; mlog: experts renumbered node by node.
  std::vector<double> group_load(static_cast<size_t>(groups), 0.0);
  for (int64_t e = 0; e < E; ++e) group_load[e / group_size] += w[e];
  std::vector<int64_t> group_pack, group_slot;
  balanced_packing(group_load, nodes, group_pack, group_slot);
  std::vector<int64_t> mlog2log(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t g = e / group_size;
    mlog2log[(group_pack[g] * groups_per_node + group_slot[g]) * group_size + e % group_size] = e;
  }
  // 2-3. Within each node: replicate, then pack the node's slots onto its ranks.
  const int64_t experts_per_node = E / nodes, slots_per_node = P / nodes, ranks_per_node = ranks / nodes;
  const int64_t slots_per_rank = slots_per_node / ranks_per_node;
  std::vector<int32_t> phy2log(static_cast<size_t>(P));
  for (int64_t node = 0; node < nodes; ++node) {
    std::vector<double> node_load(static_cast<size_t>(experts_per_node));
    for (int64_t m = 0; m < experts_per_node; ++m) node_load[m] = w[mlog2log[node * experts_per_node + m]];
    std::vector<int64_t> count;
    const std::vector<int64_t> phy2mlog = replicate(node_load, slots_per_node, count);
    std::vector<double> slot_load(static_cast<size_t>(slots_per_node));
    for (int64_t p = 0; p < slots_per_node; ++p) {
      slot_load[p] = node_load[phy2mlog[p]] / static_cast<double>(count[phy2mlog[p]]);
    }
    std::vector<int64_t> rank, position;
    balanced_packing(slot_load, ranks_per_node, rank, position);
    for (int64_t p = 0; p < slots_per_node; ++p) {
      const int64_t placed = node * slots_per_node + rank[p] * slots_per_rank + position[p];
      phy2log[placed] = static_cast<int32_t>(mlog2log[node * experts_per_node + phy2mlog[p]]);
    }
  }
  return phy2log;
}

}  // namespace

ExpertPlacement ExpertPlacement::contiguous(int64_t layers, int64_t num_logical, int64_t num_redundant,
                                            int64_t num_ranks) {
  ExpertPlacement placement;
  placement.num_logical = num_logical;
  placement.num_physical = num_logical + num_redundant;
  placement.num_ranks = num_ranks;
  std::vector<int32_t> slots(static_cast<size_t>(placement.num_physical));
  for (int64_t p = 0; p < placement.num_physical; ++p) slots[p] = static_cast<int32_t>(p % num_logical);
  placement.phy2log.assign(static_cast<size_t>(layers), slots);
  return placement;
}

ExpertPlacement rebalance_experts(const std::vector<std::vector<double>>& load, int64_t num_physical,
                                  int64_t num_ranks, EplbPolicy policy, int64_t num_groups, int64_t num_nodes) {
  ExpertPlacement placement;
  placement.num_logical = load.empty() ? 0 : static_cast<int64_t>(load[0].size());
  placement.num_physical = num_physical;
  placement.num_ranks = num_ranks;
  const int64_t E = placement.num_logical;
  const bool hierarchical = policy == EplbPolicy::kHierarchical && num_groups > 0 && num_nodes > 0 &&
                            E % num_groups == 0 && num_groups % num_nodes == 0 && num_ranks % num_nodes == 0 &&
                            num_physical % num_nodes == 0 && (num_physical / num_nodes) % (num_ranks / num_nodes) == 0;
  for (const std::vector<double>& layer : load) {
    placement.phy2log.push_back(hierarchical ? place_layer(layer, num_physical, num_ranks, num_groups, num_nodes)
                                             : place_layer(layer, num_physical, num_ranks, 1, 1));
  }
  return placement;
}

double rank_imbalance(const std::vector<double>& load, const std::vector<int32_t>& phy2log, int64_t num_ranks) {
  std::vector<int64_t> replicas(load.size(), 0);
  for (int32_t e : phy2log) ++replicas[e];
  const int64_t per_rank = static_cast<int64_t>(phy2log.size()) / num_ranks;
  std::vector<double> rank_load(static_cast<size_t>(num_ranks), 0.0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    rank_load[static_cast<int64_t>(p) / per_rank] += load[phy2log[p]] / static_cast<double>(replicas[phy2log[p]]);
  }
  const double total = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  if (total <= 0.0) return 1.0;
  return *std::max_element(rank_load.begin(), rank_load.end()) / (total / static_cast<double>(num_ranks));
}

}  // namespace deepinfer::model
