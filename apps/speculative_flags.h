// The speculative-decoding flags shared by `deepinfer serve` and `deepinfer generate`, spelled as vLLM and SGLang
// users know them: --speculative-algorithm mtp --speculative-num-draft-tokens K (engine/speculative.h); and DSpark's
// as the seed spells them: --dspark-enable --dspark-confidence-threshold --dspark-max-draft-tokens
// --dspark-abort-on-rollback-rate (engine/dspark.h), plus --dspark-step-time-table.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "commands.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/checkpoint_fingerprint.h"
#include "deepinfer/engine/speculative.h"

namespace deepinfer::apps {

struct SpeculativeOptions {
  std::string algorithm;                    // "" or "none": off; "mtp"; "dspark" (as --dspark-enable)
  std::optional<int32_t> num_draft_tokens;  // unset with mtp: 1 (DeepSeek's checkpoints train one next-n layer)
  // DSpark (the seed's flags; engine/dspark.h).
  bool dspark_enable = false;
  std::optional<double> dspark_confidence_threshold;    // default 0.85
  std::optional<int32_t> dspark_max_draft_tokens;       // default 6
  std::optional<double> dspark_abort_on_rollback_rate;  // default 0.30
  std::optional<std::string> dspark_step_time_table;    // default: the cache directory (dspark_step_time_path)
};

inline void add_speculative_flags(CLI::App* cmd, SpeculativeOptions& options) {
  cmd->add_option("--speculative-algorithm", options.algorithm,
                  "mtp: draft with the checkpoint's multi-token-prediction layer (num_nextn_predict_layers >= 1), "
                  "verified exactly by the model; dspark: the same drafts under DSpark's planner (as --dspark-enable); "
                  "none (default): no speculation")
      ->check(non_empty());
  cmd->add_option("--speculative-num-draft-tokens", options.num_draft_tokens,
                  "Drafts per request per step with --speculative-algorithm mtp (the MTP layer chained K times), "
                  "1.." +
                      std::to_string(engine::SpeculativeConfig::kMaxDraftTokens) + "; default 1")
      ->check(at_least(1, engine::SpeculativeConfig::kMaxDraftTokens));
  cmd->add_flag("--dspark-enable", options.dspark_enable,
                "DSpark: draft with the checkpoint's DSpark draft module (dspark_* config keys; else its MTP layer) "
                "and let the planner choose, per step and request, how many drafts to verify from their confidence "
                "and the step time measured on this machine (same as --speculative-algorithm dspark)");
  cmd->add_option("--dspark-confidence-threshold", options.dspark_confidence_threshold,
                  "A draft chain stops after a draft less confident than this; a request on plain decoding returns "
                  "after 3 probes at or above it (0..1, default 0.85)")
      ->check(non_empty());
  cmd->add_option("--dspark-max-draft-tokens", options.dspark_max_draft_tokens,
                  "The most drafts per request per step with DSpark (1.." +
                      std::to_string(engine::SpeculativeConfig::kMaxDraftTokens) + ", default 6)")
      ->check(at_least(1, engine::SpeculativeConfig::kMaxDraftTokens));
  cmd->add_option("--dspark-abort-on-rollback-rate", options.dspark_abort_on_rollback_rate,
                  "A verify rejecting more than this fraction of its drafts is a rollback; 3 in a row put the request "
                  "on plain decoding until its drafts are confident again (in (0, 1], default 0.30)")
      ->check(non_empty());
  cmd->add_option("--dspark-step-time-table", options.dspark_step_time_table,
                  "JSON file of the step time per verified rows (measured at startup when missing or measured for "
                  "other weights or another device, then written there), or 'const' (verify every draft); default "
                  "$XDG_CACHE_HOME/deepinfer/dspark/step-time-<checkpoint>.json")
      ->check(non_empty());
}

// Where the step-time table of a checkpoint lives by default: $XDG_CACHE_HOME (else $HOME/.cache)/deepinfer/dspark/
// step-time-<identity hash>.json; "" (measured every start, not written) when neither variable is set.
inline std::string dspark_step_time_path(const std::string& identity_hash) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string root;
  if (xdg != nullptr && *xdg != '\0') {
    root = xdg;
  } else if (home != nullptr && *home != '\0') {
    root = std::string(home) + "/.cache";
  } else {
    return "";
  }
  return root + "/deepinfer/dspark/step-time-" + identity_hash + ".json";
}

// The engine's config from the flags, checked against the checkpoint's num_nextn_predict_layers (from config.json,
// before any weight loads). Errors: InvalidArgument naming the flag and, for a checkpoint without MTP layers, what
// it lacks.
inline Result<engine::SpeculativeConfig> speculative_config(const SpeculativeOptions& options,
                                                            int64_t num_nextn_predict_layers,
                                                            bool has_dspark_module = false) {
  Result<engine::SpeculativeAlgorithm> algorithm = engine::parse_speculative_algorithm(options.algorithm);
  if (!algorithm.ok()) return algorithm.status();
  engine::SpeculativeConfig config;
  config.algorithm = *algorithm;
  if (options.dspark_enable) {
    if (!options.algorithm.empty() && config.algorithm != engine::SpeculativeAlgorithm::kDspark) {
      return Status::invalid_argument("--dspark-enable and --speculative-algorithm " + options.algorithm +
                                      ": choose one");
    }
    config.algorithm = engine::SpeculativeAlgorithm::kDspark;
  }
  const bool dspark = config.algorithm == engine::SpeculativeAlgorithm::kDspark;
  if (!dspark) {
    const char* given = options.dspark_confidence_threshold    ? "--dspark-confidence-threshold"
                        : options.dspark_max_draft_tokens      ? "--dspark-max-draft-tokens"
                        : options.dspark_abort_on_rollback_rate ? "--dspark-abort-on-rollback-rate"
                        : options.dspark_step_time_table       ? "--dspark-step-time-table"
                                                               : nullptr;
    if (given != nullptr) return Status::invalid_argument(std::string(given) + " needs --dspark-enable");
    config.num_draft_tokens = options.num_draft_tokens.value_or(config.enabled() ? 1 : 0);
  } else {
    if (options.num_draft_tokens) {
      return Status::invalid_argument(
          "--speculative-num-draft-tokens does not apply with --dspark-enable: the planner chooses each request's "
          "length up to --dspark-max-draft-tokens");
    }
    config.num_draft_tokens = options.dspark_max_draft_tokens.value_or(6);
    config.dspark.confidence_threshold = options.dspark_confidence_threshold.value_or(0.85);
    config.dspark.abort_on_rollback_rate = options.dspark_abort_on_rollback_rate.value_or(0.30);
    if (options.dspark_step_time_table) config.dspark.step_time_table = *options.dspark_step_time_table;
  }
  if (Status s = config.validate(num_nextn_predict_layers, has_dspark_module); !s.ok()) return s;
  return config;
}

// With DSpark: what the step-time table is valid for (the checkpoint's fingerprint, the backend and its compute
// mode, the CPU threads) and, unless --dspark-step-time-table was given, where it is cached. Errors: the
// fingerprint's (IOError naming the file).
inline Status set_dspark_table(engine::SpeculativeConfig& config, const SpeculativeOptions& options,
                               const std::filesystem::path& model_path, const std::string& backend_name,
                               const std::string& compute_mode) {
  if (config.algorithm != engine::SpeculativeAlgorithm::kDspark) return Status();
  const char* threads = std::getenv("OMP_NUM_THREADS");
  const std::string mode = compute_mode + ", step time on " + backend_name + ", " +
                           (threads != nullptr ? std::string(threads) : std::to_string(std::thread::hardware_concurrency())) +
                           " threads";
  Result<kvcache::ModelFingerprint> fingerprint = engine::checkpoint_fingerprint(model_path, mode);
  if (!fingerprint.ok()) return fingerprint.status();
  config.dspark.identity = fingerprint->to_hex() + " (" + mode + ")";
  if (!options.dspark_step_time_table) config.dspark.step_time_table = dspark_step_time_path(fingerprint->to_hex());
  return Status();
}

}  // namespace deepinfer::apps
