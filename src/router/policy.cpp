#include "deepinfer/router/policy.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>

#include "deepinfer/core/check.h"
#include "deepinfer/core/types.h"

namespace deepinfer::router {
namespace {

constexpr int32_t kVirtualNodes = 160;
constexpr double kBlockTokensD = static_cast<double>(kBlockTokens);

}  // namespace

std::string_view policy_name(Policy policy) {
  switch (policy) {
    case Policy::kKvAware:
      return "kv-aware";
    case Policy::kRoundRobin:
      return "round-robin";
    case Policy::kConsistentHash:
      return "consistent-hash";
    case Policy::kLeastLoad:
      return "least-load";
  }
  return "?";
}

Result<Policy> parse_policy(std::string_view name) {
  for (Policy p : {Policy::kKvAware, Policy::kRoundRobin, Policy::kConsistentHash, Policy::kLeastLoad}) {
    if (name == policy_name(p)) return p;
  }
  return Status::invalid_argument("--policy '" + std::string(name) + "' is not one of " + std::string(kPolicyNames));
}

uint64_t affinity_key(std::string_view text, int64_t max_chars) {
  // Cut after max_chars code points: count the bytes that do not continue a UTF-8 sequence.
  size_t chars = 0;
  size_t end = 0;
  for (; end < text.size(); ++end) {
    const auto byte = static_cast<unsigned char>(text[end]);
    if ((byte & 0xC0) != 0x80) {
      if (static_cast<int64_t>(chars) == max_chars) break;
      ++chars;
    }
  }
  return XXH3_64bits(text.data(), end);
}

RoutingPolicy::RoutingPolicy(Policy policy, std::vector<std::string> worker_names, CostWeights weights)
    : policy_(policy), weights_(weights) {
  DEEPINFER_CHECK(!worker_names.empty());
  for (size_t w = 0; w < worker_names.size(); ++w) {
    for (int32_t v = 0; v < kVirtualNodes; ++v) {
      const std::string point = worker_names[w] + "#" + std::to_string(v);
      ring_.emplace_back(XXH3_64bits(point.data(), point.size()), static_cast<int32_t>(w));
    }
  }
  std::sort(ring_.begin(), ring_.end());
}

double RoutingPolicy::uncached_tokens(int64_t prompt_tokens, const PrefixMatch& match) const {
  const double loaded = weights_.host_block_cost * match.host_blocks + weights_.disk_block_cost * match.disk_blocks;
  const double value = static_cast<double>(prompt_tokens) - kBlockTokensD * (match.blocks - loaded);
  return std::max(0.0, value);
}

bool RoutingPolicy::eligible(const RouteRequest& request, std::span<const WorkerState> workers, int32_t w) const {
  if (!workers[static_cast<size_t>(w)].healthy) return false;
  return request.excluded.empty() || request.excluded[static_cast<size_t>(w)] == 0;
}

int32_t RoutingPolicy::in_turn(const std::vector<int32_t>& candidates) {
  return candidates[static_cast<size_t>(turn_++ % candidates.size())];
}

Decision RoutingPolicy::kv_aware(const RouteRequest& request, std::span<const WorkerState> workers) {
  const int32_t n = static_cast<int32_t>(workers.size());
  double best_cost = 0;
  int32_t best_blocks = -1;
  int32_t longest = 0;  // over eligible workers
  std::vector<int32_t> tied;
  for (int32_t w = 0; w < n; ++w) {
    if (!eligible(request, workers, w)) continue;
    const PrefixMatch match = request.matches.empty() ? PrefixMatch{} : request.matches[static_cast<size_t>(w)];
    const WorkerState& state = workers[static_cast<size_t>(w)];
    const double uncached = uncached_tokens(request.prompt_tokens, match);
    const double cost = (weights_.prefill_weight * uncached +
                         weights_.queue_weight * static_cast<double>(state.pending_prefill_tokens) +
                         weights_.decode_weight * static_cast<double>(state.active_tokens)) /
                        kBlockTokensD;
    longest = std::max(longest, match.blocks);
    const bool better = tied.empty() || cost < best_cost - 1e-9 ||
                        (std::abs(cost - best_cost) <= 1e-9 && match.blocks > best_blocks);
    if (better) {
      tied.assign(1, w);
      best_cost = cost;
      best_blocks = match.blocks;
    } else if (std::abs(cost - best_cost) <= 1e-9 && match.blocks == best_blocks) {
      tied.push_back(w);
    }
  }
  Decision d;
  if (tied.empty()) return d;
  d.worker = in_turn(tied);
  const PrefixMatch match = request.matches.empty() ? PrefixMatch{} : request.matches[static_cast<size_t>(d.worker)];
  d.cached_tokens = std::min<int64_t>(request.prompt_tokens, int64_t{kBlockTokens} * match.blocks);
  d.uncached_tokens = static_cast<int64_t>(std::llround(uncached_tokens(request.prompt_tokens, match)));
  d.reason = longest == 0 ? "no_cache_hit" : match.blocks == longest ? "cache_hit" : "load";
  return d;
}

Decision RoutingPolicy::consistent_hash(const RouteRequest& request, std::span<const WorkerState> workers) const {
  Decision d;
  auto start = std::lower_bound(ring_.begin(), ring_.end(), std::make_pair(request.affinity_key, int32_t{-1}));
  for (size_t i = 0; i < ring_.size(); ++i) {
    auto it = ring_.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(start - ring_.begin()) + i) % ring_.size());
    if (it->second < static_cast<int32_t>(workers.size()) && eligible(request, workers, it->second)) {
      d.worker = it->second;
      d.reason = "consistent_hash";
      return d;
    }
  }
  return d;
}

Decision RoutingPolicy::choose(const RouteRequest& request, std::span<const WorkerState> workers) {
  DEEPINFER_CHECK(request.matches.empty() || request.matches.size() == workers.size());
  DEEPINFER_CHECK(request.excluded.empty() || request.excluded.size() == workers.size());
  Decision d;
  const int32_t n = static_cast<int32_t>(workers.size());
  switch (policy_) {
    case Policy::kKvAware:
      return kv_aware(request, workers);
    case Policy::kConsistentHash:
      d = consistent_hash(request, workers);
      break;
    case Policy::kRoundRobin: {
      std::vector<int32_t> all;
      for (int32_t w = 0; w < n; ++w) {
        if (eligible(request, workers, w)) all.push_back(w);
      }
      if (!all.empty()) {
        // One turn per request over every worker, skipping the ineligible, so a dead worker's share moves on.
        for (int32_t k = 0; k < n; ++k) {
          const int32_t w = static_cast<int32_t>((turn_ + static_cast<uint64_t>(k)) % static_cast<uint64_t>(n));
          if (eligible(request, workers, w)) {
            d.worker = w;
            break;
          }
        }
        ++turn_;
        d.reason = "round_robin";
      }
      break;
    }
    case Policy::kLeastLoad: {
      std::vector<int32_t> least;
      int32_t fewest = 0;
      for (int32_t w = 0; w < n; ++w) {
        if (!eligible(request, workers, w)) continue;
        const int32_t load = workers[static_cast<size_t>(w)].in_flight;
        if (least.empty() || load < fewest) {
          least.assign(1, w);
          fewest = load;
        } else if (load == fewest) {
          least.push_back(w);
        }
      }
      if (!least.empty()) {
        d.worker = in_turn(least);
        d.reason = "least_load";
      }
      break;
    }
  }
  if (d.worker >= 0) d.uncached_tokens = request.prompt_tokens;
  return d;
}

}  // namespace deepinfer::router
