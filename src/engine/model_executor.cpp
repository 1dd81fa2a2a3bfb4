// ModelExecutor: the batch as one ForwardBatch, the greedy shortcut, sampling on host threads.
#include "model_executor.h"

#include <omp.h>

#include <algorithm>
#include <string>

namespace deepinfer::engine {

RequestSampling::RequestSampling(int64_t vocab_size, int32_t sampling_threads, int64_t parallel_sampling_min_logits)
    : parallel_sampling_min_logits_(parallel_sampling_min_logits),
      samplers_(static_cast<size_t>(std::max(sampling_threads, 1)), Sampler(vocab_size)) {}

Status RequestSampling::add_request(SequenceId id, std::span<const TokenId> prompt_token_ids,
                                    const SamplingParams& params) {
  if (requests_.contains(id)) return Status::invalid_argument("request " + std::to_string(id) + " is already live");
  requests_[id] = {std::vector<TokenId>(prompt_token_ids.begin(), prompt_token_ids.end()), {}, params,
                   make_request_rng(params, static_cast<uint64_t>(id))};
  return Status();
}

void RequestSampling::remove_request(SequenceId id) { requests_.erase(id); }

void RequestSampling::device_adjustments(SequenceId id, int32_t row,
                                         std::vector<backend::Backend::LogitAdjustment>& out) const {
  const RequestState& r = requests_.at(id);
  append_logit_adjustments(r.params, r.prompt, r.output, row, out);
}

backend::Backend::DeviceSampling RequestSampling::device_row(SequenceId id) const {
  const RequestState& r = requests_.at(id);
  backend::Backend::DeviceSampling row;
  row.temperature = r.params.temperature;
  row.top_k = r.params.top_k;
  row.top_p = r.params.top_p;
  row.min_p = r.params.min_p;
  row.seed = r.rng.seed;
  row.counter = r.rng.counter;
  row.logprobs = r.params.logprobs.value_or(-1);
  return row;
}

Status RequestSampling::sample(const ScheduledBatch& batch, std::span<const float> logits, StepOutput& out) {
  const int64_t vocab = samplers_[0].vocab_size();
  std::vector<SamplerRow> rows;
  std::vector<size_t> entry_of_row;
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    if (!entry.samples) continue;
    RequestState& request = requests_.at(entry.sequence_id);
    SamplerRow row;
    row.logits = logits.subspan(rows.size() * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    row.params = &request.params;
    row.prompt_token_ids = request.prompt;
    row.output_token_ids = request.output;
    row.rng = &request.rng;
    rows.push_back(row);
    entry_of_row.push_back(i);
  }
  std::vector<SampledToken> sampled(rows.size());
  if (Status s = sample_rows(rows, sampled); !s.ok()) return s;
  for (size_t r = 0; r < sampled.size(); ++r) out.entries[entry_of_row[r]].push_back(std::move(sampled[r]));
  return Status();
}

bool RequestSampling::all_plain_greedy(const ScheduledBatch& batch) const {
  for (const ScheduledEntry& entry : batch.entries) {
    if (entry.samples && !is_plain_greedy(entry.sequence_id)) return false;
  }
  return true;
}

void RequestSampling::device_inputs(const ScheduledBatch& batch, std::vector<backend::Backend::DeviceSampling>& rows,
                                    std::vector<backend::Backend::LogitAdjustment>& adjustments) const {
  rows.clear();
  adjustments.clear();
  for (const ScheduledEntry& entry : batch.entries) {
    if (!entry.samples) continue;
    device_adjustments(entry.sequence_id, static_cast<int32_t>(rows.size()), adjustments);
    rows.push_back(device_row(entry.sequence_id));
  }
}

Status RequestSampling::take_device_tokens(const ScheduledBatch& batch, std::span<const int32_t> ids,
                                           std::span<const backend::Backend::DeviceSampling> rows,
                                           std::span<const backend::Backend::SampledLogprobs> logprobs,
                                           StepOutput& out) const {
  size_t row = 0;
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    const ScheduledEntry& entry = batch.entries[i];
    if (!entry.samples) continue;
    if (row >= ids.size()) {
      return Status::internal("the backend returned " + std::to_string(ids.size()) + " ids for more sampling rows");
    }
    const int32_t id = ids[row];
    // The sampler's verdict on such a row (InvalidArgument), whichever path sampled it.
    if (id < 0) {
      return Status::invalid_argument("row of sequence " + std::to_string(entry.sequence_id) +
                                      ": logits hold a NaN or +inf, or nothing above -inf; logits must be finite "
                                      "or -inf");
    }
    SampledToken token{id, std::nullopt, {}};
    if (row < rows.size() && rows[row].logprobs >= 0 && row < logprobs.size()) {
      const backend::Backend::SampledLogprobs& lp = logprobs[row];
      token.logprob = lp.logprob;
      for (const auto& [top_id, top_logprob] : lp.top) token.top_logprobs.push_back(TokenLogprob{top_id, top_logprob});
    }
    out.entries[i].push_back(std::move(token));
    ++row;
  }
  return Status();
}

void RequestSampling::commit(const ScheduledBatch& batch, const StepOutput& out, bool count_greedy) {
  for (size_t i = 0; i < batch.entries.size(); ++i) {
    if (out.entries[i].empty()) continue;
    RequestState& request = requests_.at(batch.entries[i].sequence_id);
    if (count_greedy) ++request.rng.counter;
    for (const SampledToken& token : out.entries[i]) request.output.push_back(token.token_id);
  }
}

ModelExecutor::ModelExecutor(model::DeepSeekModel& model, std::span<const backend::Buffer> layer_caches,
                             int32_t sampling_threads, int64_t parallel_sampling_min_logits)
    : model_(model),
      layer_caches_(layer_caches),
      sampling_(model.config().vocab_size, sampling_threads, parallel_sampling_min_logits) {}

Result<StepOutput> ModelExecutor::run(const ScheduledBatch& batch) {
  model::ForwardBatch forward;
  for (const ScheduledEntry& entry : batch.entries) {
    if (entry.num_lookahead_slots != 0) {
      return Status::invalid_argument("the model executor does not draft: sequence " +
                                      std::to_string(entry.sequence_id) + " was given " +
                                      std::to_string(entry.num_lookahead_slots) + " lookahead slots");
    }
    if (!sampling_.contains(entry.sequence_id)) {
      return Status::internal("the executor has no request " + std::to_string(entry.sequence_id));
    }
    const int32_t first_row = static_cast<int32_t>(forward.token_ids.size());
    forward.token_ids.insert(forward.token_ids.end(), entry.token_ids.begin(), entry.token_ids.end());
    forward.sequences.push_back(
        {static_cast<int32_t>(entry.num_tokens()), static_cast<int32_t>(entry.start_position), entry.block_table});
    if (entry.samples) forward.logits_rows.push_back(first_row + static_cast<int32_t>(entry.num_tokens()) - 1);
  }
  StepOutput out;
  out.entries.resize(batch.entries.size());
  // A step whose every sampled row is plain greedy gets only the argmax ids from the backend, not the logits.
  const bool plain_greedy = sampling_.all_plain_greedy(batch);
  // Otherwise, when the backend samples where the logits are, the ids (and the logprobs asked for) come back instead
  // of the logits (the same semantics as the host Sampler, logit_bias, penalties and logprobs included).
  const bool device_sampled = !plain_greedy && model_.samples_on_device();
  if (plain_greedy || device_sampled) {
    Status s;
    device_rows_.clear();
    device_adjustments_.clear();
    device_logprobs_.clear();
    if (plain_greedy) {
      s = model_.forward_greedy(forward, layer_caches_, greedy_ids_);
    } else {
      sampling_.device_inputs(batch, device_rows_, device_adjustments_);
      s = model_.forward_sampled(forward, layer_caches_, device_rows_, device_adjustments_, greedy_ids_,
                                 &device_logprobs_);
    }
    if (!s.ok()) return s;
    if (Status t = sampling_.take_device_tokens(batch, greedy_ids_, device_rows_, device_logprobs_, out); !t.ok()) {
      return t;
    }
  } else {
    if (Status s = model_.forward(forward, layer_caches_, logits_); !s.ok()) return s;
    if (Status s = sampling_.sample(batch, logits_, out); !s.ok()) return s;
  }
  // Committed: the RNG streams advance (the device paths too, as the host sampler does for every row) and the
  // generated tokens join the penalty windows.
  sampling_.commit(batch, out, plain_greedy || device_sampled);
  return out;
}

// Rows are independent (each request draws from its own Philox stream), so a large step's rows are split over
// threads, one Sampler each: the same tokens as one Sampler, in a fraction of the time (measured on the 2-core dev
// machine: 256 rows of a 129,280-token vocabulary at top_p 0.9 cost 408 ms on one core; the GPU step they follow
// took 12 ms). Every row is checked before any is sampled, so the step stays all-or-nothing; each row is checked
// once, by the thread that samples it.
Status RequestSampling::sample_rows(std::span<const SamplerRow> rows, std::span<SampledToken> sampled) {
  const int64_t work = static_cast<int64_t>(rows.size()) * samplers_[0].vocab_size();
  const int64_t threads = std::min<int64_t>(static_cast<int64_t>(samplers_.size()), static_cast<int64_t>(rows.size()));
  if (threads <= 1 || work < parallel_sampling_min_logits_) return samplers_[0].sample(rows, sampled);
  const int64_t per = (static_cast<int64_t>(rows.size()) + threads - 1) / threads;
  auto begin_of = [&](int64_t t) {
    return static_cast<size_t>(std::min<int64_t>(t * per, static_cast<int64_t>(rows.size())));
  };
  auto count_of = [&](int64_t t) {
    return std::min(rows.size(), begin_of(t) + static_cast<size_t>(per)) - begin_of(t);
  };
  std::vector<Status> checks(static_cast<size_t>(threads));
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(threads))
  for (int64_t t = 0; t < threads; ++t) {
    checks[static_cast<size_t>(t)] = samplers_[static_cast<size_t>(t)].check(
        rows.subspan(begin_of(t), count_of(t)), sampled.subspan(begin_of(t), count_of(t)), begin_of(t));
  }
  for (const Status& s : checks) {
    if (!s.ok()) return s;
  }
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(threads))
  for (int64_t t = 0; t < threads; ++t) {
    samplers_[static_cast<size_t>(t)].sample_checked(rows.subspan(begin_of(t), count_of(t)),
                                                     sampled.subspan(begin_of(t), count_of(t)));
  }
  return Status();
}

}  // namespace deepinfer::engine
