// Prometheus text exposition of the server's metrics.
#include "deepinfer/server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace deepinfer::server {
namespace {

// Latency buckets (seconds) as vLLM exposes them, so existing dashboards read the same.
std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}
std::vector<double> tpot_buckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}
std::vector<double> e2e_buckets() {
  return {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0};
}

void scalar(std::string& out, std::string_view name, std::string_view type, std::string_view help, int64_t value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
}

void scalar_seconds(std::string& out, std::string_view name, std::string_view help, double value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {:.3f}\n", name, help, name, name, value);
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), buckets_(bounds_.size(), 0) {}

void Histogram::observe(double value) {
  const size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  std::lock_guard lock(mu_);
  if (bucket < buckets_.size()) ++buckets_[bucket];
  sum_ += value;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard lock(mu_);
  return count_;
}

void Histogram::render(std::string_view name, std::string_view help, std::string& out) const {
  std::lock_guard lock(mu_);
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += buckets_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
}

Metrics::Metrics()
    : time_to_first_token(ttft_buckets()),
      time_per_output_token(tpot_buckets()),
      e2e_request_latency(e2e_buckets()),
      kv_transfer_seconds(ttft_buckets()) {}

void Metrics::count_kv_transfer_failure(std::string_view reason) {
  std::lock_guard lock(mu_);
  auto it = kv_transfer_failures_.find(reason);
  if (it == kv_transfer_failures_.end()) it = kv_transfer_failures_.emplace(std::string(reason), 0).first;
  ++it->second;
}

void Metrics::count_outcome(std::string_view outcome) {
  std::lock_guard lock(mu_);
  auto it = outcomes_.find(outcome);
  if (it == outcomes_.end()) it = outcomes_.emplace(std::string(outcome), 0).first;
  ++it->second;
}

void Metrics::count_http_status(int status) {
  std::lock_guard lock(mu_);
  ++http_statuses_[status];
}

namespace {
// One labelled family: a line per tier that has a value.
void tier_family(std::string& out, std::string_view name, std::string_view type, std::string_view help,
                 const std::vector<std::pair<std::string_view, int64_t>>& values) {
  if (values.empty()) return;
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  for (const auto& [tier, value] : values) out += fmt::format("{}{{tier=\"{}\"}} {}\n", name, tier, value);
}

void render_kv_tiers(const engine::KvTierStats& s, std::string& out) {
  using Values = std::vector<std::pair<std::string_view, int64_t>>;
  auto per_tier = [&](int64_t device, auto field) {
    Values values{{"device", device}};
    if (s.lower) {
      values.emplace_back("host", s.lower->host.*field);
      if (s.lower->disk.capacity_blocks > 0) values.emplace_back("disk", s.lower->disk.*field);
    }
    return values;
  };
  auto lower_only = [&](auto field) {
    Values values;
    if (s.lower) {
      values.emplace_back("host", s.lower->host.*field);
      if (s.lower->disk.capacity_blocks > 0) values.emplace_back("disk", s.lower->disk.*field);
    }
    return values;
  };
  using C = kvcache::OffloadTierCounters;
  tier_family(out, "deepinfer_kv_tier_usage_blocks", "gauge", "Blocks cached in the tier.",
              per_tier(s.device_usage_blocks, &C::usage_blocks));
  tier_family(out, "deepinfer_kv_tier_capacity_blocks", "gauge", "Blocks the tier can hold.",
              per_tier(s.device_capacity_blocks, &C::capacity_blocks));
  tier_family(out, "deepinfer_kv_tier_hits_total", "counter", "Prompt blocks served from the tier at admission.",
              per_tier(s.device_hit_blocks, &C::hit_blocks));
  tier_family(out, "deepinfer_kv_tier_misses_total", "counter",
              "Prompt blocks an admitted request needed from the tier and did not get from it.",
              per_tier(s.device_miss_blocks, &C::miss_blocks));
  tier_family(out, "deepinfer_kv_tier_evictions_total", "counter", "Blocks dropped under capacity pressure.",
              per_tier(s.device_evicted_blocks, &C::evicted_blocks));
  tier_family(out, "deepinfer_kv_tier_expired_total", "counter", "Blocks dropped because their TTL passed.",
              per_tier(s.device_expired_blocks, &C::expired_blocks));
  tier_family(out, "deepinfer_kv_tier_refused_total", "counter", "Stores refused or failed.",
              lower_only(&C::refused_blocks));
  tier_family(out, "deepinfer_kv_tier_corrupt_total", "counter",
              "Loads that found the block corrupt, foreign or gone (deleted behind the index) and dropped it.",
              lower_only(&C::corrupt_blocks));
  tier_family(out, "deepinfer_kv_tier_bytes_written_total", "counter", "Bytes copied into the tier.",
              lower_only(&C::bytes_written));
  tier_family(out, "deepinfer_kv_tier_bytes_read_total", "counter", "Bytes copied out of the tier.",
              lower_only(&C::bytes_read));
  scalar(out, "deepinfer_kv_tier_loaded_blocks_total", "counter",
         "Device blocks filled from host or disk instead of prefill.", s.loaded_blocks);
  if (s.lower && s.lower->disk.capacity_blocks > 0) {
    scalar(out, "deepinfer_kv_disk_queue_blocks", "gauge",
           "KV block transfers queued or running on the background mover (disk writes and reads, host copies).",
           s.lower->disk_queue_blocks);
    const kvcache::DiskRecoveryStats& r = s.lower->disk_recovery;
    out += "# HELP deepinfer_kv_disk_recovery_blocks What the disk tier found in its directory at startup.\n"
           "# TYPE deepinfer_kv_disk_recovery_blocks gauge\n";
    const std::pair<std::string_view, int64_t> outcomes[] = {
        {"recovered", r.recovered_blocks}, {"corrupt", r.corrupt_dropped},      {"foreign", r.foreign_dropped},
        {"expired", r.expired_dropped},    {"temp_file", r.temp_files_removed}, {"evicted", r.evicted},
        {"unchained", r.unchained_dropped}};
    for (const auto& [outcome, value] : outcomes) {
      out += fmt::format("deepinfer_kv_disk_recovery_blocks{{outcome=\"{}\"}} {}\n", outcome, value);
    }
  }
}

// Speculative decoding (engine/speculative.h): totals, acceptance per draft position, and the verify length (the
// tokens one request's verify checked: its last token plus the drafts) as a histogram over 1..K+1.
void render_speculative(const engine::SpeculativeStats& s, std::string& out) {
  scalar(out, "deepinfer_spec_draft_tokens_total", "counter", "Draft tokens the target model verified.",
         s.draft_tokens);
  scalar(out, "deepinfer_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target model.",
         s.accepted_tokens);
  scalar(out, "deepinfer_spec_emitted_tokens_total", "counter",
         "Tokens produced by verify steps (accepted drafts plus one per verify).", s.emitted_tokens);
  out += "# HELP deepinfer_spec_draft_tokens_by_position_total Draft tokens verified, by position in the draft (1 is "
         "the first).\n# TYPE deepinfer_spec_draft_tokens_by_position_total counter\n";
  for (size_t i = 0; i < s.drafted_by_position.size(); ++i) {
    out += fmt::format("deepinfer_spec_draft_tokens_by_position_total{{position=\"{}\"}} {}\n", i + 1,
                       s.drafted_by_position[i]);
  }
  out += "# HELP deepinfer_spec_accepted_tokens_by_position_total Draft tokens accepted, by position in the draft (1 "
         "is the first).\n# TYPE deepinfer_spec_accepted_tokens_by_position_total counter\n";
  for (size_t i = 0; i < s.accepted_by_position.size(); ++i) {
    out += fmt::format("deepinfer_spec_accepted_tokens_by_position_total{{position=\"{}\"}} {}\n", i + 1,
                       s.accepted_by_position[i]);
  }
  out += "# HELP deepinfer_spec_verify_length Tokens per request per verify: its last token plus the drafts checked.\n"
         "# TYPE deepinfer_spec_verify_length histogram\n";
  int64_t cumulative = 0, sum = 0;
  const size_t top = std::max<size_t>(s.verify_length_counts.size(), 2);
  for (size_t n = 1; n < top; ++n) {
    const int64_t count = n < s.verify_length_counts.size() ? s.verify_length_counts[n] : 0;
    cumulative += count;
    sum += count * static_cast<int64_t>(n);
    out += fmt::format("deepinfer_spec_verify_length_bucket{{le=\"{}\"}} {}\n", n, cumulative);
  }
  out += fmt::format("deepinfer_spec_verify_length_bucket{{le=\"+Inf\"}} {}\ndeepinfer_spec_verify_length_sum {}\n"
                     "deepinfer_spec_verify_length_count {}\n",
                     cumulative, sum, cumulative);
  out += "# HELP deepinfer_spec_phase_seconds_total Wall time of a speculative engine's steps by phase (a step that "
         "drafts nothing counts under target_pass): target_pass (verify), "
         "acceptance (host), draft_passes (MTP chain or DSpark injection and block passes), draft_heads (DSpark's host "
         "heads and planner).\n# TYPE deepinfer_spec_phase_seconds_total counter\n";
  for (int p = 0; p < engine::SpeculativeStats::kNumPhases; ++p) {
    out += fmt::format("deepinfer_spec_phase_seconds_total{{phase=\"{}\"}} {}\n", engine::SpeculativeStats::kPhaseNames[p],
                       s.phase_seconds[static_cast<size_t>(p)]);
  }
  scalar(out, "deepinfer_spec_unverified_steps_total", "counter",
         "DSpark: steps where the planner verified none of a request's drafts (it decoded plainly).",
         s.unverified_steps);
  scalar(out, "deepinfer_spec_fallbacks_total", "counter",
         "DSpark: requests put on plain decoding after consecutive rollbacks.", s.fallbacks);
  scalar(out, "deepinfer_spec_fallback_returns_total", "counter",
         "DSpark: requests that drafted again after their probes were confident.", s.fallback_returns);
  scalar(out, "deepinfer_spec_requests_in_fallback", "gauge", "DSpark: requests on plain decoding now.",
         s.requests_in_fallback);
}
// Expert parallel (model/deepseek_model.h's EplbStats): tokens per logical expert per MoE layer (rank 0's tokens:
// with the experts over the tensor-parallel ranks every rank routes all of them), EPLB's rebalances and the ranks'
// max/mean load before and after the last one.
void render_eplb(const model::EplbStats& s, std::string& out) {
  if (s.expert_tokens.empty()) return;
  out += "# HELP deepinfer_moe_expert_tokens_total Tokens routed to each routed expert, by MoE layer.\n"
         "# TYPE deepinfer_moe_expert_tokens_total counter\n";
  for (size_t m = 0; m < s.expert_tokens.size(); ++m) {
    for (size_t e = 0; e < s.expert_tokens[m].size(); ++e) {
      out += fmt::format("deepinfer_moe_expert_tokens_total{{moe_layer=\"{}\",expert=\"{}\"}} {}\n", m, e,
                         static_cast<int64_t>(s.expert_tokens[m][e]));
    }
  }
  scalar(out, "deepinfer_eplb_rebalances_total", "counter", "Expert placements EPLB computed and moved weights to.",
         s.rebalances);
  scalar(out, "deepinfer_moe_capacity_dropped_total", "counter",
         "(token, expert) pairs over --moe-capacity-factor's cap, left to the residual path.", s.capacity_dropped);
  if (s.pass_seconds > 0.0) {
    out += "# HELP deepinfer_moe_exchange_seconds_total Expert parallel across data-parallel ranks: host time in the "
           "MoE layers' all-to-all exchanges, by phase (what overlapping two micro-batches could hide at most).\n"
           "# TYPE deepinfer_moe_exchange_seconds_total counter\n";
    out += fmt::format("deepinfer_moe_exchange_seconds_total{{phase=\"dispatch\"}} {:.6f}\n", s.dispatch_seconds);
    out += fmt::format("deepinfer_moe_exchange_seconds_total{{phase=\"combine\"}} {:.6f}\n", s.combine_seconds);
    out += "# HELP deepinfer_moe_pass_seconds_total Expert parallel across data-parallel ranks: host time in whole "
           "forward passes (the exchanges are a share of it).\n"
           "# TYPE deepinfer_moe_pass_seconds_total counter\n";
    out += fmt::format("deepinfer_moe_pass_seconds_total {:.6f}\n", s.pass_seconds);
  }
  if (s.imbalance_before.empty()) return;
  out += "# HELP deepinfer_eplb_rank_load_imbalance Max over mean of the expert-parallel ranks' load at the last "
         "rebalance, under the placement before and after it, by MoE layer.\n"
         "# TYPE deepinfer_eplb_rank_load_imbalance gauge\n";
  for (size_t m = 0; m < s.imbalance_before.size(); ++m) {
    out += fmt::format("deepinfer_eplb_rank_load_imbalance{{moe_layer=\"{}\",placement=\"before\"}} {:.4f}\n", m,
                       s.imbalance_before[m]);
    out += fmt::format("deepinfer_eplb_rank_load_imbalance{{moe_layer=\"{}\",placement=\"after\"}} {:.4f}\n", m,
                       s.imbalance_after[m]);
  }
}
}  // namespace

std::string Metrics::render(const engine::EngineLoad& load, const recipe::TokenizationCache::Stats& tokenization) const {
  std::string out;
  time_to_first_token.render("deepinfer_time_to_first_token_seconds",
                             "Time from a request's arrival to its first generated token.", out);
  time_per_output_token.render("deepinfer_time_per_output_token_seconds",
                               "Mean time between a request's generated tokens after the first.", out);
  e2e_request_latency.render("deepinfer_e2e_request_latency_seconds",
                             "Time from a request's arrival to the end of its response.", out);
  scalar(out, "deepinfer_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", prompt_tokens);
  scalar(out, "deepinfer_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
         prompt_tokens_cached);
  scalar(out, "deepinfer_generation_tokens_total", "counter", "Generated tokens.", generation_tokens);
  scalar(out, "deepinfer_num_requests_running", "gauge", "Sequences the engine is running.", load.num_running);
  scalar(out, "deepinfer_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", load.num_waiting);
  scalar(out, "deepinfer_kv_cache_blocks_used", "gauge", "KV cache blocks in use.", load.kv_blocks_used);
  scalar(out, "deepinfer_kv_cache_blocks_free", "gauge", "KV cache blocks free.", load.kv_blocks_free);
  scalar_seconds(out, "deepinfer_engine_busy_seconds",
                 "Seconds the engine has been in its current step (0 while idle; /health fails past "
                 "--health-max-step-seconds).",
                 load.busy_seconds);
  render_kv_tiers(load.kv_tiers, out);
  render_speculative(load.speculative, out);
  render_eplb(load.eplb, out);
  if (load.swa_replayed_tokens >= 0) {
    scalar(out, "deepinfer_swa_replayed_tokens_total", "counter",
           "DeepSeek-V4: tokens recomputed to restore cached prefixes whose last window's rows were gone "
           "(--swa-bounded-replay's replays, and prefixes of at most one window fed again).",
           load.swa_replayed_tokens);
  }
  scalar(out, "deepinfer_client_disconnects_total", "counter", "Clients that went away before their response ended.",
         client_disconnects);
  scalar(out, "deepinfer_malformed_tool_calls_total", "counter",
         "Tool-call markup the output parser could not parse (emitted as content).", malformed_tool_calls);
  scalar(out, "deepinfer_tokenization_cache_hits_total", "counter",
         "Prompt text runs whose token ids came from the tokenization cache.", static_cast<int64_t>(tokenization.hits));
  scalar(out, "deepinfer_tokenization_cache_misses_total", "counter",
         "Prompt text runs tokenized and added to the tokenization cache.", static_cast<int64_t>(tokenization.misses));
  scalar(out, "deepinfer_tokenization_cache_hit_tokens_total", "counter",
         "Prompt tokens served from the tokenization cache.", static_cast<int64_t>(tokenization.hit_tokens));
  scalar(out, "deepinfer_tokenization_cache_miss_tokens_total", "counter",
         "Prompt tokens tokenized on a tokenization cache miss.", static_cast<int64_t>(tokenization.miss_tokens));
  scalar(out, "deepinfer_tokenization_cache_evictions_total", "counter",
         "Tokenization cache entries evicted, least recently used first.",
         static_cast<int64_t>(tokenization.evictions));
  scalar(out, "deepinfer_tokenization_cache_bytes", "gauge", "Bytes held by the tokenization cache's entries.",
         static_cast<int64_t>(tokenization.bytes));
  out +=
      "# HELP deepinfer_kv_transfer_blocks_total KV blocks moved between prefill and decode workers, by direction.\n"
      "# TYPE deepinfer_kv_transfer_blocks_total counter\n";
  out += fmt::format("deepinfer_kv_transfer_blocks_total{{direction=\"sent\"}} {}\n", kv_transfer_blocks_sent.load());
  out += fmt::format("deepinfer_kv_transfer_blocks_total{{direction=\"received\"}} {}\n",
                     kv_transfer_blocks_received.load());
  out +=
      "# HELP deepinfer_kv_transfer_bytes_total KV payload bytes moved between prefill and decode workers.\n"
      "# TYPE deepinfer_kv_transfer_bytes_total counter\n";
  out += fmt::format("deepinfer_kv_transfer_bytes_total{{direction=\"sent\"}} {}\n", kv_transfer_bytes_sent.load());
  out += fmt::format("deepinfer_kv_transfer_bytes_total{{direction=\"received\"}} {}\n",
                     kv_transfer_bytes_received.load());
  kv_transfer_seconds.render("deepinfer_kv_transfer_seconds",
                             "Decode side: from asking a prefill worker to holding every block checked.", out);
  std::lock_guard lock(mu_);
  out +=
      "# HELP deepinfer_kv_transfer_failures_total KV transfers a decode worker gave up on (it computed the prompt "
      "itself), by reason.\n"
      "# TYPE deepinfer_kv_transfer_failures_total counter\n";
  for (const auto& [reason, count] : kv_transfer_failures_) {
    out += fmt::format("deepinfer_kv_transfer_failures_total{{reason=\"{}\"}} {}\n", reason, count);
  }
  out +=
      "# HELP deepinfer_requests_total Finished generation requests by outcome.\n"
      "# TYPE deepinfer_requests_total counter\n";
  for (const auto& [outcome, count] : outcomes_) {
    out += fmt::format("deepinfer_requests_total{{outcome=\"{}\"}} {}\n", outcome, count);
  }
  out +=
      "# HELP deepinfer_http_requests_total HTTP responses by status code.\n"
      "# TYPE deepinfer_http_requests_total counter\n";
  for (const auto& [status, count] : http_statuses_) {
    out += fmt::format("deepinfer_http_requests_total{{status=\"{}\"}} {}\n", status, count);
  }
  return out;
}

}  // namespace deepinfer::server
