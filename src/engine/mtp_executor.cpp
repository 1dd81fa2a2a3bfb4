// MtpExecutor: verify last step's drafts in one target forward, accept (greedy or rejection sampling), then draft
// the next step's with the MTP layer chained K times (mtp_executor.h).
#include "mtp_executor.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "deepinfer/core/check.h"

namespace deepinfer::engine {

MtpExecutor::MtpExecutor(model::DeepSeekModel& model, std::span<const backend::Buffer> layer_caches, int32_t num_blocks,
                         int32_t max_num_seqs, int32_t num_draft_tokens, std::unique_ptr<DraftPlanner> planner,
                         bool use_dspark_module)
    : model_(model),
      layer_caches_(layer_caches),
      num_blocks_(num_blocks),
      max_num_seqs_(max_num_seqs),
      num_draft_tokens_(num_draft_tokens),
      dspark_module_(use_dspark_module),
      planner_(planner != nullptr ? std::move(planner) : std::make_unique<DraftPlanner>()),
      sampler_(model.config().vocab_size) {
  DEEPINFER_CHECK(num_draft_tokens >= 1 && num_draft_tokens <= SpeculativeConfig::kMaxDraftTokens);
  if (use_dspark_module) {
    DEEPINFER_CHECK(model.config().dspark.has_value(), "the DSpark executor needs a DSpark draft module");
    DEEPINFER_CHECK(static_cast<int64_t>(layer_caches.size()) ==
                        model.config().num_hidden_layers + model.config().dspark->num_stages(),
                    "the main layers' caches, then the DSpark stages'");
  } else {
    DEEPINFER_CHECK(model.num_mtp_layers() >= 1, "the MTP executor needs an MTP layer");
    DEEPINFER_CHECK(static_cast<int64_t>(layer_caches.size()) == model.config().num_hidden_layers + 1,
                    "the main layers' caches, then the MTP layer's");
  }
}

void MtpExecutor::RequestState::clear_drafts() {
  drafts.clear();
  draft_distributions.clear();
  draft_confidences.clear();
  draft_position = -1;
}

TokenId MtpExecutor::RequestState::token_at(int64_t position) const {
  const int64_t prompt_size = static_cast<int64_t>(prompt.size());
  return position < prompt_size ? prompt[static_cast<size_t>(position)]
                                : output[static_cast<size_t>(position - prompt_size)];
}

Status MtpExecutor::add_request(SequenceId id, std::span<const TokenId> prompt_token_ids,
                                const SamplingParams& params) {
  if (requests_.contains(id)) return Status::invalid_argument("request " + std::to_string(id) + " is already live");
  RequestState state;
  state.prompt.assign(prompt_token_ids.begin(), prompt_token_ids.end());
  state.params = params;
  state.rng = make_request_rng(params, static_cast<uint64_t>(id));
  requests_[id] = std::move(state);
  return Status();
}

void MtpExecutor::remove_request(SequenceId id) {
  requests_.erase(id);
  planner_->on_removed(id);
}

std::chrono::steady_clock::time_point MtpExecutor::lap(SpeculativeStats::Phase phase,
                                                      std::chrono::steady_clock::time_point since) {
  const auto now = std::chrono::steady_clock::now();
  phase_seconds_[phase] += std::chrono::duration<double>(now - since).count();
  return now;
}

Result<StepOutput> MtpExecutor::run(const ScheduledBatch& batch) {
  auto clock = std::chrono::steady_clock::now();
  const auto step_start = clock;
  const int64_t graph_recordings = model_.graph_recordings();
  const size_t num_entries = batch.entries.size();
  // 1. The target pass: every entry's tokens, plus the drafts of those that drafted for this very step.
  model::ForwardBatch forward;
  forward.keep_hidden = !dspark_module_;
  forward.keep_dspark_context = dspark_module_;
  std::vector<int32_t> first_rows(num_entries, 0), num_drafts(num_entries, 0), available(num_entries, 0);
  // The drafts each entry could verify; then how many the planner keeps (all, without DSpark).
  int64_t base_tokens = 0, committing = 0;
  std::vector<VerifyRequest> verify;
  std::vector<size_t> verify_entry;
  for (size_t i = 0; i < num_entries; ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    auto it = requests_.find(entry.sequence_id);
    if (it == requests_.end())
      return Status::internal("the executor has no request " + std::to_string(entry.sequence_id));
    const RequestState& request = it->second;
    base_tokens += entry.num_tokens();
    committing += entry.samples ? 1 : 0;
    if (entry.samples && entry.num_lookahead_slots > 0 && request.draft_position == entry.end_position()) {
      available[i] = std::min<int32_t>(static_cast<int32_t>(request.drafts.size()), entry.num_lookahead_slots);
    }
    num_drafts[i] = available[i];
    if (available[i] > 0) {
      VerifyRequest candidate;
      candidate.id = entry.sequence_id;
      candidate.confidences.assign(request.draft_confidences.begin(),
                                   request.draft_confidences.begin() + available[i]);
      candidate.verify_drafts = available[i];
      verify.push_back(std::move(candidate));
      verify_entry.push_back(i);
    }
  }
  if (!verify.empty()) {
    planner_->plan(base_tokens, committing, verify);
    for (size_t j = 0; j < verify.size(); ++j) {
      num_drafts[verify_entry[j]] = std::clamp(verify[j].verify_drafts, 0, available[verify_entry[j]]);
    }
  }
  bool plain_greedy = true;
  for (size_t i = 0; i < num_entries; ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    const RequestState& request = requests_.at(entry.sequence_id);
    const int32_t m = num_drafts[i];
    first_rows[i] = static_cast<int32_t>(forward.token_ids.size());
    forward.token_ids.insert(forward.token_ids.end(), entry.token_ids.begin(), entry.token_ids.end());
    forward.token_ids.insert(forward.token_ids.end(), request.drafts.begin(), request.drafts.begin() + m);
    forward.sequences.push_back(
        {static_cast<int32_t>(entry.num_tokens()) + m, static_cast<int32_t>(entry.start_position), entry.block_table});
    if (!entry.samples) continue;
    for (int32_t k = 0; k <= m; ++k) {
      forward.logits_rows.push_back(first_rows[i] + static_cast<int32_t>(entry.num_tokens()) - 1 + k);
    }
    plain_greedy = plain_greedy && request.params.is_plain_greedy();
  }
  const std::span<const backend::Buffer> main_caches =
      layer_caches_.first(static_cast<size_t>(model_.config().num_hidden_layers));
  Status forwarded = plain_greedy ? model_.forward_greedy(forward, main_caches, greedy_ids_)
                                  : model_.forward(forward, main_caches, logits_);
  if (!forwarded.ok()) return forwarded;
  clock = lap(SpeculativeStats::kTargetPass, clock);

  // 2. Acceptance. Nothing is committed until every entry is decided (all-or-nothing).
  StepOutput out;
  out.entries.resize(num_entries);
  out.drafts_verified.assign(num_entries, 0);
  std::vector<int32_t> kept_rows(num_entries, 0);
  const int64_t vocab = model_.config().vocab_size;
  size_t logits_row = 0;
  for (size_t i = 0; i < num_entries; ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    kept_rows[i] = static_cast<int32_t>(entry.num_tokens());
    if (!entry.samples) continue;
    RequestState& request = requests_.at(entry.sequence_id);
    const int32_t m = num_drafts[i];
    int32_t accepted = 0;
    std::vector<SampledToken>& tokens = out.entries[i];
    if (plain_greedy) {
      for (int32_t k = 0; k <= m; ++k) {
        if (greedy_ids_[logits_row + static_cast<size_t>(k)] < 0) {
          return Status::invalid_argument("row of sequence " + std::to_string(entry.sequence_id) +
                                          ": logits hold a NaN or +inf, or nothing above -inf; logits must be finite "
                                          "or -inf");
        }
      }
      while (accepted < m &&
             request.drafts[static_cast<size_t>(accepted)] == greedy_ids_[logits_row + static_cast<size_t>(accepted)]) {
        ++accepted;
      }
      for (int32_t k = 0; k < accepted; ++k)
        tokens.push_back({request.drafts[static_cast<size_t>(k)], std::nullopt, {}});
      tokens.push_back({greedy_ids_[logits_row + static_cast<size_t>(accepted)], std::nullopt, {}});
    } else {
      const std::span<const float> rows(logits_.data() + logits_row * static_cast<size_t>(vocab),
                                        static_cast<size_t>((m + 1) * vocab));
      if (Status s = verify_sampled(entry, request, rows, m, tokens, accepted); !s.ok()) return s;
    }
    logits_row += static_cast<size_t>(m) + 1;
    out.drafts_verified[i] = m;
    kept_rows[i] += accepted;
  }
  for (size_t i = 0; i < num_entries; ++i) {
    if (available[i] > 0) {
      planner_->on_verified(batch.entries[i].sequence_id, num_drafts[i],
                            static_cast<int32_t>(out.entries[i].size()) - 1);
    }
  }
  // Committed: the tokens join the requests' outputs (penalty windows), the RNG counters follow them.
  std::vector<size_t> output_sizes(num_entries, 0);
  for (size_t i = 0; i < num_entries; ++i) {
    RequestState& request = requests_.at(batch.entries[i].sequence_id);
    output_sizes[i] = request.output.size();
    for (const SampledToken& token : out.entries[i]) request.output.push_back(token.token_id);
    request.rng.counter = request.output.size();
  }

  clock = lap(SpeculativeStats::kAcceptance, clock);

  // 3-4. The next step's drafts. A failure here undoes the commit, so the step stays all-or-nothing.
  Status drafted = dspark_module_ ? draft_block(batch, first_rows, kept_rows) : draft(batch, first_rows, kept_rows);
  if (!dspark_module_) lap(SpeculativeStats::kDraftPasses, clock);  // draft_block times its own phases
  if (Status s = std::move(drafted); !s.ok()) {
    for (size_t i = 0; i < num_entries; ++i) {
      RequestState& request = requests_.at(batch.entries[i].sequence_id);
      request.output.resize(output_sizes[i]);
      request.rng.counter = request.output.size();
      request.clear_drafts();
    }
    return s;
  }
  int64_t drafts_verified = 0, committed = 0;
  for (int32_t n : out.drafts_verified) drafts_verified += n;
  for (const std::vector<SampledToken>& tokens : out.entries) committed += static_cast<int64_t>(tokens.size());
  planner_->on_step(drafts_verified, committed,
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count(),
                    base_tokens == committing && model_.graph_recordings() == graph_recordings);
  if (drafts_verified == 0) out.drafts_verified.clear();
  return out;
}

Status MtpExecutor::verify_sampled(const ScheduledEntry& entry, RequestState& request, std::span<const float> logits,
                                   int32_t num_drafts, std::vector<SampledToken>& tokens, int32_t& accepted) {
  const size_t vocab = static_cast<size_t>(model_.config().vocab_size);
  const uint64_t first_counter = request.output.size();
  std::vector<TokenProbability> target;
  for (int32_t k = 0; k <= num_drafts; ++k) {
    // The penalties see the output as it would be at this position: the committed tokens and the drafts before it.
    penalty_window_.assign(request.output.begin(), request.output.end());
    penalty_window_.insert(penalty_window_.end(), request.drafts.begin(), request.drafts.begin() + k);
    RequestRng rng{request.rng.seed, first_counter + static_cast<uint64_t>(k)};
    SamplerRow row;
    row.logits = logits.subspan(static_cast<size_t>(k) * vocab, vocab);
    row.params = &request.params;
    row.prompt_token_ids = request.prompt;
    row.output_token_ids = penalty_window_;
    row.rng = &rng;
    SampledToken token;
    if (k == num_drafts) {
      // Every draft accepted (or none to check): the next token is plainly sampled, as without speculation.
      if (Status s = sampler_.sample(std::span(&row, 1), std::span(&token, 1)); !s.ok()) {
        return Status::invalid_argument("sequence " + std::to_string(entry.sequence_id) + ": " + s.message());
      }
      tokens.push_back(std::move(token));
      accepted = num_drafts;
      return Status();
    }
    if (Status s = sampler_.final_distribution(row, target); !s.ok()) {
      return Status::invalid_argument("sequence " + std::to_string(entry.sequence_id) + ": " + s.message());
    }
    const TokenId draft = request.drafts[static_cast<size_t>(k)];
    const DraftVerdict verdict = verify_draft(target, request.draft_distributions[static_cast<size_t>(k)], draft,
                                              request.rng.seed, first_counter + static_cast<uint64_t>(k));
    if (Status s = sampler_.describe(row, verdict.token_id, token); !s.ok()) return s;
    tokens.push_back(std::move(token));
    if (!verdict.accepted) {
      accepted = k;
      return Status();
    }
  }
  DEEPINFER_CHECK(false, "unreachable: the last row samples");
  return Status();
}

namespace {
// The softmax probability of the row's largest logit (a greedy draft's confidence on the logits path).
double top_probability(std::span<const float> logits) {
  const float best = *std::max_element(logits.begin(), logits.end());
  return std::isfinite(best) ? std::exp(best - log_sum_exp(logits)) : 0.0;
}
}  // namespace

Status MtpExecutor::draft_from_logits(RequestState& request, std::span<const float> logits,
                                      std::span<const TokenId> chain, TokenId& token,
                                      std::vector<TokenProbability>& distribution, double& confidence) {
  penalty_window_.assign(request.output.begin(), request.output.end());
  penalty_window_.insert(penalty_window_.end(), chain.begin(), chain.end());
  RequestRng unused = request.rng;
  SamplerRow row;
  row.logits = logits;
  row.params = &request.params;
  row.prompt_token_ids = request.prompt;
  row.output_token_ids = penalty_window_;
  row.rng = &unused;
  if (Status s = sampler_.final_distribution(row, distribution); !s.ok()) return s;
  if (request.params.is_greedy()) {
    token = distribution.front().token_id;  // the argmax alone, probability 1
    confidence = planner_->wants_confidence() ? top_probability(logits) : 1.0;
  } else {
    // The draft for output index output.size() + chain.size(), from its own stream.
    const double u = philox_uniform(request.rng.seed, request.output.size() + chain.size(), kDraftStream);
    token = draw_from(distribution, u);
    confidence = 0.0;
    for (const TokenProbability& entry : distribution) confidence = std::max(confidence, entry.probability);
  }
  return Status();
}

void MtpExecutor::begin_drafting(const ScheduledBatch& batch) {
  const int64_t sampling = std::count_if(batch.entries.begin(), batch.entries.end(),
                                         [](const ScheduledEntry& entry) { return entry.samples; });
  planner_->set_all_greedy(std::all_of(batch.entries.begin(), batch.entries.end(), [&](const ScheduledEntry& entry) {
    return !entry.samples || requests_.at(entry.sequence_id).params.is_plain_greedy();
  }));
  planner_->begin_drafting(sampling, sampling, sampling);
}

Status MtpExecutor::draft(const ScheduledBatch& batch, std::span<const int32_t> first_rows,
                          std::span<const int32_t> kept_rows) {
  const backend::Buffer& mtp_cache = layer_caches_.back();
  const size_t vocab = static_cast<size_t>(model_.config().vocab_size);
  // A request that drafts: its row in the latest pass, the position of that row, its MTP block table.
  struct Chain {
    RequestState* request = nullptr;
    SequenceId id = 0;
    int32_t row = 0;
    int64_t position = 0;
    int32_t max_drafts = 0;
    std::vector<int32_t> block_table;
  };
  std::vector<Chain> chains;
  // The chains' length this step (DSpark: from the next step's expected cost; its rows: one per sampling entry).
  begin_drafting(batch);
  // Pass 1: every computed row whose next token is known, at its own position, reading the target's hidden state.
  model::MtpBatch pass;
  bool greedy_ids = true;
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    RequestState& request = requests_.at(entry.sequence_id);
    request.clear_drafts();
    const int32_t kept = kept_rows[i];
    const int32_t max_drafts =
        entry.samples ? std::clamp(planner_->max_drafts(entry.sequence_id, num_draft_tokens_), 0, num_draft_tokens_)
                      : 0;
    for (int32_t k = 0; k < kept; ++k) {
      pass.token_ids.push_back(request.token_at(entry.start_position + k + 1));
      pass.hidden_rows.push_back(first_rows[i] + k);
    }
    pass.sequences.push_back({kept, static_cast<int32_t>(entry.start_position), entry.block_table});
    if (max_drafts == 0) continue;
    Chain chain;
    chain.request = &request;
    chain.id = entry.sequence_id;
    chain.row = static_cast<int32_t>(pass.token_ids.size()) - 1;
    chain.position = entry.start_position + kept - 1;
    chain.max_drafts = max_drafts;
    chain.block_table = entry.block_table;
    // The chain's last position may lie past the blocks the scheduler gave (at most one block: K <= 16): that
    // block is this chain's scratch block of the MTP cache, which nothing else reads.
    const int64_t last_block = (chain.position + max_drafts - 1) / kBlockTokens;
    if (last_block >= static_cast<int64_t>(chain.block_table.size())) {
      if (last_block > static_cast<int64_t>(chain.block_table.size()) ||
          static_cast<int32_t>(chains.size()) >= max_num_seqs_) {
        return Status::internal("draft chain of sequence " + std::to_string(entry.sequence_id) + " reaches position " +
                                std::to_string(chain.position + max_drafts - 1) + ", past its block table and scratch");
      }
      chain.block_table.push_back(num_blocks_ + static_cast<int32_t>(chains.size()));
    }
    pass.logits_rows.push_back(chain.row);
    greedy_ids = greedy_ids && request.params.is_plain_greedy();
    chains.push_back(std::move(chain));
  }
  if (pass.token_ids.empty()) return Status();
  // No chain this step and a planner that lets the MTP layer's KV lag (DSpark, where keeping it would cost more than
  // 5% of the step): skip the pass. Those positions keep stale MTP entries, which can only make later drafts worse
  // (verification is exact whatever they are).
  if (chains.empty() && planner_->skips_idle_draft_pass()) return Status();
  // Draft step c (0-based) over the chains still drafting: their tokens from the pass's logits rows, in order.
  auto take_drafts = [&](std::vector<Chain>& active) -> Status {
    for (size_t a = 0; a < active.size(); ++a) {
      RequestState& request = *active[a].request;
      TokenId token = 0;
      std::vector<TokenProbability> distribution;
      double confidence = 1.0;
      if (greedy_ids) {
        token = greedy_ids_[a];
        if (token < 0) return Status::invalid_argument("the MTP layer's logits hold a NaN or +inf");
        distribution = {{token, 1.0}};
        if (planner_->wants_confidence()) confidence = greedy_probabilities_[a];
      } else {
        const std::span<const float> row(logits_.data() + a * vocab, vocab);
        if (Status s = draft_from_logits(request, row, request.drafts, token, distribution, confidence); !s.ok()) {
          return s;
        }
      }
      request.drafts.push_back(token);
      request.draft_distributions.push_back(std::move(distribution));
      request.draft_confidences.push_back(confidence);
    }
    return Status();
  };
  auto run_pass = [&](const model::MtpBatch& mtp) {
    return model_.forward_mtp(0, mtp, mtp_cache, greedy_ids ? nullptr : &logits_, greedy_ids ? &greedy_ids_ : nullptr,
                              greedy_ids && planner_->wants_confidence() ? &greedy_probabilities_ : nullptr);
  };
  if (Status s = run_pass(pass); !s.ok()) return s;
  std::vector<Chain> active = std::move(chains);
  if (Status s = take_drafts(active); !s.ok()) return s;
  for (Chain& chain : active) chain.request->draft_position = chain.position + 2;
  // Passes 2..K: one row per chain still drafting, at the next position, with its last draft. The planner sees
  // every draft's confidence (a probe's too) before the length limit is applied.
  for (int32_t step = 1;; ++step) {
    std::vector<Chain> next;
    for (Chain& chain : active) {
      const RequestState& request = *chain.request;
      const bool more = planner_->continue_after(chain.id, static_cast<int32_t>(request.drafts.size()) - 1,
                                                 request.draft_confidences.back());
      if (more && static_cast<int32_t>(request.drafts.size()) < chain.max_drafts) next.push_back(std::move(chain));
    }
    if (next.empty() || step >= num_draft_tokens_) break;
    model::MtpBatch chained;
    for (size_t a = 0; a < next.size(); ++a) {
      Chain& chain = next[a];
      chained.token_ids.push_back(chain.request->drafts.back());
      chained.hidden_rows.push_back(chain.row);
      chain.position += 1;
      chain.row = static_cast<int32_t>(a);
      chained.sequences.push_back({1, static_cast<int32_t>(chain.position), chain.block_table});
      chained.logits_rows.push_back(static_cast<int32_t>(a));
    }
    if (Status s = run_pass(chained); !s.ok()) return s;
    if (Status s = take_drafts(next); !s.ok()) return s;
    active = std::move(next);
  }
  return Status();
}

Status MtpExecutor::draft_block(const ScheduledBatch& batch, std::span<const int32_t> first_rows,
                                std::span<const int32_t> kept_rows) {
  const model::ModelConfig& c = model_.config();
  const int32_t gamma = static_cast<int32_t>(c.dspark->block_size);
  const int32_t longest = std::min(num_draft_tokens_, gamma);
  const model::DeepSeekModel::DsparkHeads& heads = *model_.dspark_heads();
  const std::span<const backend::Buffer> stage_caches = layer_caches_.subspan(static_cast<size_t>(c.num_hidden_layers));
  const size_t vocab = static_cast<size_t>(c.vocab_size), hidden = static_cast<size_t>(c.hidden_size);
  struct Block {
    RequestState* request = nullptr;
    SequenceId id = 0;
    int32_t max_drafts = 0;
    int64_t position = 0;  // the anchor's
  };
  std::vector<Block> blocks;
  begin_drafting(batch);
  model::DsparkInjectBatch inject;
  model::DsparkBlockBatch block;
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    RequestState& request = requests_.at(entry.sequence_id);
    request.clear_drafts();
    const int32_t kept = kept_rows[i];
    for (int32_t k = 0; k < kept; ++k) inject.context_rows.push_back(first_rows[i] + k);
    inject.sequences.push_back({kept, static_cast<int32_t>(entry.start_position), entry.block_table});
    const int32_t max_drafts =
        entry.samples ? std::clamp(planner_->max_drafts(entry.sequence_id, longest), 0, longest) : 0;
    if (max_drafts == 0) continue;
    Block b{&request, entry.sequence_id, max_drafts, entry.start_position + kept};
    std::vector<int32_t> table = entry.block_table;
    // The block's rows past the blocks the scheduler gave go to this request's scratch block of the stage caches
    // (at most one: gamma <= 16); a block that would need more does not draft this step.
    const int64_t last_block = (b.position + gamma - 1) / kBlockTokens;
    if (last_block > static_cast<int64_t>(table.size())) continue;
    if (last_block == static_cast<int64_t>(table.size())) {
      if (static_cast<int32_t>(blocks.size()) >= max_num_seqs_) continue;
      table.push_back(num_blocks_ + static_cast<int32_t>(blocks.size()));
    }
    block.token_ids.push_back(request.token_at(b.position));
    for (int32_t k = 1; k < gamma; ++k) block.token_ids.push_back(static_cast<int32_t>(c.dspark->noise_token_id));
    block.sequences.push_back({gamma, static_cast<int32_t>(b.position), std::move(table)});
    blocks.push_back(b);
  }
  // Nobody drafts and keeping the stage caches current costs too much (the planner's rule): skip the injection.
  if (blocks.empty() && planner_->skips_idle_draft_pass()) return Status();
  // Where every drafting request is plain greedy and the backend has DSpark's heads on the device, the chains are
  // made there (the block pass's logits never reach the host); else the heads run here.
  bool device_heads = model_.has_device_dspark_heads() && !blocks.empty() &&
                      static_cast<int64_t>(blocks.size()) <= backend::Backend::kMaxDeviceDsparkChains;
  for (const Block& b : blocks) device_heads = device_heads && b.request->params.is_plain_greedy();
  const size_t rows = blocks.size() * static_cast<size_t>(gamma);
  std::vector<TokenId> greedy_drafts(rows, 0);
  std::vector<double> confidences(rows, 0.0);
  auto clock = std::chrono::steady_clock::now();
  Status passes = model_.forward_dspark_inject(inject, stage_caches);
  if (passes.ok() && device_heads) {
    std::vector<int32_t> previous, lengths;
    for (const Block& b : blocks) {
      previous.push_back(b.request->token_at(b.position));
      lengths.push_back(b.max_drafts);
    }
    passes = model_.forward_dspark_block_greedy(block, stage_caches, previous, lengths, greedy_drafts, confidences);
  } else if (passes.ok() && !blocks.empty()) {
    passes = model_.forward_dspark_block(block, stage_caches, logits_, block_hidden_);
  }
  clock = lap(SpeculativeStats::kDraftPasses, clock);
  if (!passes.ok() || blocks.empty()) return passes;
  struct HeadsTime {  // whatever way this function returns
    MtpExecutor& executor;
    std::chrono::steady_clock::time_point start;
    ~HeadsTime() { executor.lap(SpeculativeStats::kDraftHeads, start); }
  } heads_time{*this, clock};
  // Greedy requests' chains in parallel (each block on its own: the Markov head reads the block's previous draft);
  // the planner then cuts each chain in order. Sampled requests draw theirs with the sampler, one after another.
  const size_t draft_vocab = static_cast<size_t>(heads.draft_vocab());
  int32_t bad_row = -1;
  if (device_heads) {  // the chains came back made: find a failed row
    for (size_t b = 0; b < blocks.size() && bad_row < 0; ++b) {
      for (int32_t k = 0; k < blocks[b].max_drafts && bad_row < 0; ++k) {
        const size_t row = b * static_cast<size_t>(gamma) + static_cast<size_t>(k);
        if (greedy_drafts[row] < 0) bad_row = static_cast<int32_t>(row);
      }
    }
  } else {
    corrected_.resize(rows * draft_vocab);
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < blocks.size(); ++b) {
      const RequestState& request = *blocks[b].request;
      const TokenId previous = request.token_at(blocks[b].position);
      const size_t first = b * static_cast<size_t>(gamma), length = static_cast<size_t>(blocks[b].max_drafts);
      if (!request.params.is_plain_greedy()) {  // drawn below, row by row; the first row's heads here
        confidences[first] = heads.confidence_of(std::span(block_hidden_.data() + first * hidden, hidden), previous);
        heads.markov(std::span(logits_.data() + first * draft_vocab, draft_vocab), previous,
                     std::span(corrected_.data() + first * draft_vocab, draft_vocab));
        continue;
      }
      const size_t made =
          heads.greedy_chain(std::span(logits_.data() + first * draft_vocab, length * draft_vocab),
                             std::span(block_hidden_.data() + first * hidden, length * hidden), previous,
                             std::span(greedy_drafts.data() + first, length),
                             std::span(confidences.data() + first, length));
      if (made > 0 && greedy_drafts[first + made - 1] < 0) {
#pragma omp critical
        bad_row = static_cast<int32_t>(first + made - 1);
      }
    }
  }
  if (bad_row >= 0) return Status::invalid_argument("the DSpark draft's logits hold a NaN or inf");
  std::vector<float> full;
  for (size_t b = 0; b < blocks.size(); ++b) {
    RequestState& request = *blocks[b].request;
    const bool greedy = request.params.is_plain_greedy();
    TokenId previous = request.token_at(blocks[b].position);
    for (int32_t k = 0; k < blocks[b].max_drafts; ++k) {
      const size_t row = b * static_cast<size_t>(gamma) + static_cast<size_t>(k);
      TokenId token = greedy_drafts[row];
      double confidence = confidences[row];
      std::vector<TokenProbability> distribution;
      if (greedy) {
        distribution = {{token, 1.0}};
      } else {
        const std::span<float> corrected(corrected_.data() + row * draft_vocab, draft_vocab);
        if (k > 0) {  // the Markov term of this request's own previous draft
          heads.markov(std::span(logits_.data() + row * draft_vocab, draft_vocab), previous, corrected);
          confidence = heads.confidence_of(std::span(block_hidden_.data() + row * hidden, hidden), previous);
        }
        full.resize(vocab);
        heads.expand(corrected, full);
        double unused = 0.0;
        if (Status s = draft_from_logits(request, full, request.drafts, token, distribution, unused); !s.ok()) return s;
      }
      request.drafts.push_back(token);
      request.draft_distributions.push_back(std::move(distribution));
      request.draft_confidences.push_back(confidence);
      if (!planner_->continue_after(blocks[b].id, k, confidence)) break;
      previous = token;
    }
    request.draft_position = blocks[b].position + 1;
  }
  return Status();
}

}  // namespace deepinfer::engine
