// V4Executor: the batch as DeepSeekV4Model chunks, one per entry, and host sampling of the sampling entries' rows.
#include "v4_executor.h"

#include <algorithm>
#include <string>

namespace deepinfer::engine {

V4Executor::V4Executor(model::DeepSeekV4Model& model, const backend::Buffer& blocks, size_t block_bytes,
                       const backend::Buffer& windows, size_t window_bytes, int32_t sampling_threads,
                       int64_t parallel_sampling_min_logits)
    : model_(model),
      blocks_(blocks),
      block_bytes_(block_bytes),
      windows_(windows),
      window_bytes_(window_bytes),
      sampling_(model.config().vocab_size, sampling_threads, parallel_sampling_min_logits) {}

Status V4Executor::add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) {
  if (Status s = sampling_.add_request(id, prompt_token_ids, params); !s.ok()) return s;
  sequences_[id] = model_.new_sequence();
  tokens_[id].assign(prompt_token_ids.begin(), prompt_token_ids.end());
  return Status();
}

void V4Executor::remove_request(SequenceId id) {
  sampling_.remove_request(id);
  sequences_.erase(id);
  tokens_.erase(id);
  last_replayed_.erase(id);
}

Status V4Executor::restore(const ScheduledEntry& entry, std::unique_ptr<model::V4Sequence>& sequence,
                           std::vector<model::DeepSeekV4Model::Chunk>& replay,
                           std::vector<std::vector<float*>>& pointers) {
  const int64_t start = entry.start_position;
  const int64_t blocks = start / kvcache::kBlockTokens;
  if (start % kvcache::kBlockTokens != 0 || static_cast<int64_t>(entry.block_table.size()) < blocks) {
    return Status::internal("DeepSeek-V4: sequence " + std::to_string(entry.sequence_id) + " resumes at position " +
                            std::to_string(start) + ", not a block boundary its block table covers");
  }
  sequence = model_.new_sequence();
  last_replayed_[entry.sequence_id] = 0;
  if (start == 0) return Status();
  const std::vector<TokenId>& tokens = tokens_.at(entry.sequence_id);
  if (static_cast<int64_t>(tokens.size()) < start) {
    return Status::internal("DeepSeek-V4: sequence " + std::to_string(entry.sequence_id) + " resumes at position " +
                            std::to_string(start) + " but only " + std::to_string(tokens.size()) + " tokens are known");
  }
  std::vector<const float*> payloads;
  for (int64_t b = 0; b < blocks; ++b) payloads.push_back(block(entry.block_table[static_cast<size_t>(b)]));
  std::vector<const float*> rows;
  for (int64_t b = std::max<int64_t>(0, blocks - model_.window_blocks()); b < blocks && !entry.rebuild_window; ++b) {
    const float* payload = window(entry, b);
    if (payload == nullptr) {
      rows.clear();
      break;
    }
    rows.push_back(payload);
  }
  const int64_t W = model_.config().sliding_window;
  if (!rows.empty()) {
    return model_.restore(*sequence, payloads, rows);  // exact
  }
  // The last window's rows are gone: replay them (bounded replay), or, for a prefix of at most one window, feed it
  // again from position 0 (exact, and no longer than a replay).
  const int64_t from = start > W ? start - W : 0;
  if (from > 0) DEEPINFER_RETURN_IF_ERROR(model_.restore(*sequence, payloads, {}));
  // The blocks the replay finishes: their block payloads are the cached ones (a replay does not write them; fed
  // again from 0 it writes the same values), their window payloads go to the entry's window blocks where it has one.
  const size_t payload_bytes = static_cast<size_t>(model_.block_payload_floats() * model_.payload_element_bytes());
  if (from == 0 && scratch_.bytes == 0) {
    Result<backend::Buffer> scratch =
        model_.backend().alloc(payload_bytes * static_cast<size_t>(std::max<int64_t>(1, model_.window_blocks())));
    if (!scratch.ok()) return scratch.status();
    scratch_ = std::move(*scratch);
  }
  std::vector<float*>& replay_blocks = pointers.emplace_back();
  std::vector<float*>& replay_windows = pointers.emplace_back();
  for (int64_t b = from / kvcache::kBlockTokens + 1; b <= blocks; ++b) {
    const size_t index = static_cast<size_t>(b - 1);
    // Fed again from 0 the chunk would write block payloads (the same values up to rounding): into scratch, so that
    // the cached blocks stay as they are.
    float* scratch = reinterpret_cast<float*>(static_cast<char*>(scratch_.data()) +
                                              (index % static_cast<size_t>(std::max<int64_t>(1, model_.window_blocks()))) * payload_bytes);
    replay_blocks.push_back(from == 0 ? scratch : block(entry.block_table[index]));
    replay_windows.push_back(window(entry, b - 1));
  }
  replay.push_back({sequence.get(), std::span<const int32_t>(tokens.data() + from, static_cast<size_t>(start - from)),
                    model::DeepSeekV4Model::Logits::kNone, replay_blocks, replay_windows});
  replayed_tokens_ += start - from;
  last_replayed_[entry.sequence_id] = start - from;
  return Status();
}

Result<StepOutput> V4Executor::run(const ScheduledBatch& batch) {
  std::vector<model::DeepSeekV4Model::Chunk> chunks, replay;
  chunks.reserve(batch.entries.size());
  std::vector<std::vector<float*>> replay_pointers;
  replay_pointers.reserve(2 * batch.entries.size());  // no reallocation: the replay chunks' spans point into them
  std::vector<std::vector<float*>> completed(batch.entries.size()), completed_windows(batch.entries.size());
  for (const ScheduledEntry& entry : batch.entries) {
    if (entry.num_lookahead_slots != 0) {
      return Status::invalid_argument("the DeepSeek-V4 executor does not draft: sequence " +
                                      std::to_string(entry.sequence_id) + " was given lookahead slots");
    }
    auto it = sequences_.find(entry.sequence_id);
    if (it == sequences_.end() || !sampling_.contains(entry.sequence_id)) {
      return Status::internal("the executor has no request " + std::to_string(entry.sequence_id));
    }
    const int64_t start = entry.start_position;
    if (start != it->second->length()) {
      if (Status s = restore(entry, it->second, replay, replay_pointers); !s.ok()) return s;
    }
    // Every token fed is kept (a later restore may replay it).
    std::vector<TokenId>& tokens = tokens_.at(entry.sequence_id);
    if (static_cast<int64_t>(tokens.size()) < start) {
      return Status::internal("DeepSeek-V4: sequence " + std::to_string(entry.sequence_id) + " skips positions");
    }
    for (int64_t i = 0; i < entry.num_tokens(); ++i) {
      const size_t p = static_cast<size_t>(start + i);
      if (p < tokens.size()) {
        tokens[p] = entry.token_ids[static_cast<size_t>(i)];
      } else {
        tokens.push_back(entry.token_ids[static_cast<size_t>(i)]);
      }
    }
    const size_t index = chunks.size();
    for (int64_t b = start / kvcache::kBlockTokens + 1; b * kvcache::kBlockTokens <= entry.end_position(); ++b) {
      completed[index].push_back(block(entry.block_table[static_cast<size_t>(b - 1)]));
      completed_windows[index].push_back(window(entry, b - 1));
    }
    chunks.push_back({it->second.get(), entry.token_ids,
                      entry.samples ? model::DeepSeekV4Model::Logits::kLast : model::DeepSeekV4Model::Logits::kNone,
                      completed[index], completed_windows[index]});
  }
  if (!replay.empty()) {
    if (Status s = model_.forward(replay, logits_); !s.ok()) return s;
  }
  StepOutput out;
  out.entries.resize(batch.entries.size());
  // As the model executor: plain greedy steps get the argmax ids, and where the backend samples (CUDA) the ids and
  // logprobs asked for come back instead of the logits.
  const bool plain_greedy = sampling_.all_plain_greedy(batch);
  const bool device_sampled = !plain_greedy && model_.samples_on_device();
  if (plain_greedy || device_sampled) {
    device_rows_.clear();
    device_adjustments_.clear();
    device_logprobs_.clear();
    if (device_sampled) sampling_.device_inputs(batch, device_rows_, device_adjustments_);
    if (Status s = model_.forward_on_device(chunks, device_rows_, device_adjustments_, ids_,
                                            device_sampled ? &device_logprobs_ : nullptr);
        !s.ok()) {
      return s;
    }
    if (Status s = sampling_.take_device_tokens(batch, ids_, device_rows_, device_logprobs_, out); !s.ok()) return s;
  } else {
    if (Status s = model_.forward(chunks, logits_); !s.ok()) return s;
    if (Status s = sampling_.sample(batch, logits_, out); !s.ok()) return s;
  }
  sampling_.commit(batch, out, /*count_greedy=*/plain_greedy || device_sampled);
  return out;
}

}  // namespace deepinfer::engine
