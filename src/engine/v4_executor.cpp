// V4Executor: the batch as DeepSeekV4Model chunks, one per entry, and host sampling of the sampling entries' rows.
#include "v4_executor.h"

#include <string>

namespace deepinfer::engine {

V4Executor::V4Executor(model::DeepSeekV4Model& model, const backend::Buffer& blocks, size_t block_bytes,
                       int32_t sampling_threads, int64_t parallel_sampling_min_logits)
    : model_(model),
      blocks_(blocks),
      block_bytes_(block_bytes),
      sampling_(model.config().vocab_size, sampling_threads, parallel_sampling_min_logits) {}

Status V4Executor::add_request(SequenceId id, std::span<const TokenId> prompt_token_ids, const SamplingParams& params) {
  if (Status s = sampling_.add_request(id, prompt_token_ids, params); !s.ok()) return s;
  sequences_[id] = model_.new_sequence();
  return Status();
}

void V4Executor::remove_request(SequenceId id) {
  sampling_.remove_request(id);
  sequences_.erase(id);
}

Result<StepOutput> V4Executor::run(const ScheduledBatch& batch) {
  std::vector<model::DeepSeekV4Model::Chunk> chunks;
  chunks.reserve(batch.entries.size());
  std::vector<std::vector<float*>> completed(batch.entries.size());
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
      // Resuming elsewhere: from the start (a recompute after preemption), or at a block boundary from the blocks'
      // payloads (a prefix-cache hit).
      if (start % kvcache::kBlockTokens != 0 ||
          static_cast<int64_t>(entry.block_table.size()) < start / kvcache::kBlockTokens) {
        return Status::internal("DeepSeek-V4: sequence " + std::to_string(entry.sequence_id) + " resumes at position " +
                                std::to_string(start) + ", not a block boundary its block table covers");
      }
      auto fresh = model_.new_sequence();
      if (start > 0) {
        std::vector<const float*> payloads;
        for (int64_t b = 0; b < start / kvcache::kBlockTokens; ++b) payloads.push_back(block(entry.block_table[b]));
        model_.restore(*fresh, payloads);
      }
      it->second = std::move(fresh);
    }
    for (int64_t b = start / kvcache::kBlockTokens + 1; b * kvcache::kBlockTokens <= entry.end_position(); ++b) {
      completed[chunks.size()].push_back(block(entry.block_table[b - 1]));
    }
    chunks.push_back({it->second.get(), entry.token_ids,
                      entry.samples ? model::DeepSeekV4Model::Logits::kLast : model::DeepSeekV4Model::Logits::kNone,
                      completed[chunks.size()]});
  }
  if (Status s = model_.forward(chunks, logits_); !s.ok()) return s;
  StepOutput out;
  out.entries.resize(batch.entries.size());
  if (Status s = sampling_.sample(batch, logits_, out); !s.ok()) return s;
  sampling_.commit(batch, out, /*count_greedy=*/false);
  return out;
}

}  // namespace deepinfer::engine
