// Speculative decoding's configuration checks, counters and acceptance rule (speculative.h).
#include "deepinfer/engine/speculative.h"

#include <algorithm>
#include <cctype>

namespace deepinfer::engine {

Result<SpeculativeAlgorithm> parse_speculative_algorithm(const std::string& name) {
  // Case-insensitive: SGLang users write MTP / DSPARK.
  std::string lower = name;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.empty() || lower == "none") return SpeculativeAlgorithm::kNone;
  if (lower == "mtp") return SpeculativeAlgorithm::kMtp;
  if (lower == "dspark") return SpeculativeAlgorithm::kDspark;
  return Status::invalid_argument("--speculative-algorithm must be mtp or dspark (or none), got '" + name + "'");
}

Status SpeculativeConfig::validate(int64_t num_nextn_predict_layers, bool has_dspark_module) const {
  if (!enabled()) {
    if (num_draft_tokens != 0) {
      return Status::invalid_argument("--speculative-num-draft-tokens " + std::to_string(num_draft_tokens) +
                                      " needs --speculative-algorithm mtp");
    }
    return Status();
  }
  const bool is_dspark = algorithm == SpeculativeAlgorithm::kDspark;
  const std::string enabled_by = is_dspark ? "--dspark-enable" : "--speculative-algorithm mtp";
  if (num_draft_tokens < 1 || num_draft_tokens > kMaxDraftTokens) {
    return Status::invalid_argument(std::string(is_dspark ? "--dspark-max-draft-tokens" : "--speculative-num-draft-tokens") +
                                    " must be in [1, " + std::to_string(kMaxDraftTokens) + "] with " + enabled_by +
                                    ", got " + std::to_string(num_draft_tokens));
  }
  if (is_dspark) {
    if (!(dspark.confidence_threshold >= 0.0 && dspark.confidence_threshold <= 1.0)) {
      return Status::invalid_argument("--dspark-confidence-threshold must be in [0, 1], got " +
                                      std::to_string(dspark.confidence_threshold));
    }
    if (!(dspark.abort_on_rollback_rate > 0.0 && dspark.abort_on_rollback_rate <= 1.0)) {
      return Status::invalid_argument("--dspark-abort-on-rollback-rate must be in (0, 1], got " +
                                      std::to_string(dspark.abort_on_rollback_rate));
    }
  }
  if (num_nextn_predict_layers < 1 && !(is_dspark && has_dspark_module)) {
    return Status::invalid_argument(
        enabled_by + " needs the checkpoint's multi-token-prediction layers" +
        (is_dspark ? " or a DSpark draft module (dspark_* keys in config.json)" : "") +
        ", but its config.json has num_nextn_predict_layers " +
        std::to_string(num_nextn_predict_layers) +
        " (no model.layers.{num_hidden_layers}.eh_proj / enorm / hnorm tensors to draft with)");
  }
  return Status();
}

void SpeculativeStats::record(int32_t drafts, int32_t accepted) {
  const size_t n = static_cast<size_t>(drafts);
  if (drafted_by_position.size() < n) {
    drafted_by_position.resize(n, 0);
    accepted_by_position.resize(n, 0);
  }
  if (verify_length_counts.size() < n + 2) verify_length_counts.resize(n + 2, 0);
  draft_tokens += drafts;
  accepted_tokens += accepted;
  ++verifies;
  emitted_tokens += accepted + 1;
  for (int32_t i = 0; i < drafts; ++i) ++drafted_by_position[static_cast<size_t>(i)];
  for (int32_t i = 0; i < accepted; ++i) ++accepted_by_position[static_cast<size_t>(i)];
  ++verify_length_counts[n + 1];
}

TokenId draw_from(std::span<const TokenProbability> distribution, double u) {
  double total = 0.0;
  for (const TokenProbability& entry : distribution) total += entry.probability;
  const double target = u * total;
  double cumulative = 0.0;
  TokenId token = distribution.front().token_id;
  for (const TokenProbability& entry : distribution) {
    if (entry.probability <= 0.0) continue;
    cumulative += entry.probability;
    token = entry.token_id;
    if (cumulative > target) break;
  }
  return token;
}

namespace {
double probability_of(std::span<const TokenProbability> distribution, TokenId token) {
  auto it = std::lower_bound(distribution.begin(), distribution.end(), token,
                             [](const TokenProbability& entry, TokenId id) { return entry.token_id < id; });
  return it != distribution.end() && it->token_id == token ? it->probability : 0.0;
}
}  // namespace

DraftVerdict verify_draft(std::span<const TokenProbability> target,
                          std::span<const TokenProbability> draft_distribution, TokenId draft, uint64_t seed,
                          uint64_t counter) {
  const double p = probability_of(target, draft);
  const double q = probability_of(draft_distribution, draft);
  // u < p / q, written without the division (q > 0 for a drawn draft; q == 0 would be a caller bug: reject).
  if (q > 0.0 && philox_uniform(seed, counter, kAcceptanceStream) * q < p) return {true, draft};
  // Residual max(0, p - q) over p's support (outside it p - q <= 0), merged by ascending id.
  std::vector<TokenProbability> residual;
  residual.reserve(target.size());
  size_t j = 0;
  double mass = 0.0;
  for (const TokenProbability& entry : target) {
    while (j < draft_distribution.size() && draft_distribution[j].token_id < entry.token_id) ++j;
    const double q_here = j < draft_distribution.size() && draft_distribution[j].token_id == entry.token_id
                              ? draft_distribution[j].probability
                              : 0.0;
    const double r = std::max(0.0, entry.probability - q_here);
    if (r > 0.0) {
      residual.push_back({entry.token_id, r});
      mass += r;
    }
  }
  const double u = philox_uniform(seed, counter, kSamplingStream);
  return {false, mass > 0.0 ? draw_from(residual, u) : draw_from(target, u)};
}

}  // namespace deepinfer::engine
