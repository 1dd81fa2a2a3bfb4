// The speculative-decoding flags shared by `deepinfer serve` and `deepinfer generate`, spelled as vLLM and SGLang
// users know them: --speculative-algorithm mtp --speculative-num-draft-tokens K (engine/speculative.h).
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/speculative.h"

namespace deepinfer::apps {

struct SpeculativeOptions {
  std::string algorithm;                    // "" or "none": off; "mtp"
  std::optional<int32_t> num_draft_tokens;  // unset with mtp: 1 (DeepSeek's checkpoints train one next-n layer)
};

inline void add_speculative_flags(CLI::App* cmd, SpeculativeOptions& options) {
  cmd->add_option("--speculative-algorithm", options.algorithm,
                  "mtp: draft with the checkpoint's multi-token-prediction layer (num_nextn_predict_layers >= 1), "
                  "verified exactly by the model; none (default): no speculation");
  cmd->add_option("--speculative-num-draft-tokens", options.num_draft_tokens,
                  "Drafts per request per step with --speculative-algorithm mtp (the MTP layer chained K times), "
                  "1.." +
                      std::to_string(engine::SpeculativeConfig::kMaxDraftTokens) + "; default 1");
}

// The engine's config from the flags, checked against the checkpoint's num_nextn_predict_layers (from config.json,
// before any weight loads). Errors: InvalidArgument naming the flag and, for a checkpoint without MTP layers, what
// it lacks.
inline Result<engine::SpeculativeConfig> speculative_config(const SpeculativeOptions& options,
                                                            int64_t num_nextn_predict_layers) {
  Result<engine::SpeculativeAlgorithm> algorithm = engine::parse_speculative_algorithm(options.algorithm);
  if (!algorithm.ok()) return algorithm.status();
  engine::SpeculativeConfig config;
  config.algorithm = *algorithm;
  config.num_draft_tokens = options.num_draft_tokens.value_or(config.enabled() ? 1 : 0);
  if (Status s = config.validate(num_nextn_predict_layers); !s.ok()) return s;
  return config;
}

}  // namespace deepinfer::apps
