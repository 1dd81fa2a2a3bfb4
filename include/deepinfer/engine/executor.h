// The executor: what runs a ScheduledBatch. The engine's step is
//   ScheduledBatch batch = scheduler.schedule();
//   Result<StepOutput> out = executor.run(batch);
//   scheduler.update(batch, *out);
// The model executor (one forward pass, then sampling) is the one the engine builds without speculation; the
// draft-and-verify executor (MtpExecutor: speculative decoding on the MTP layers) returns several tokens for an
// entry that the scheduler gave lookahead slots; a scripted one drives the scheduler in tests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "deepinfer/core/status.h"
#include "deepinfer/engine/sampler.h"
#include "deepinfer/engine/sampling_params.h"
#include "deepinfer/engine/scheduler.h"

namespace deepinfer::engine {

// What one step produced, per batch entry, in entry order (entries.size() == batch.entries.size()).
//   An entry that does not sample (a prefill chunk before the prompt's end): no tokens.
//   A sampling entry with k = num_lookahead_slots: 1 .. k + 1 tokens. The first j of them (0 <= j <= k) are
//   accepted draft tokens, whose KV the step wrote at positions end_position() .. end_position() + j - 1;
//   the last is the token sampled after them (its KV is the next step's work). The KV written at the
//   remaining k - j lookahead positions belongs to rejected drafts: Scheduler::update rolls it back.
struct StepOutput {
  std::vector<std::vector<SampledToken>> entries;
  // Per entry, the drafts the step checked for it (0 when it verified none); empty: no entry verified any. The
  // engine's speculative-decoding counters come from it (before update() trims tokens past a finish).
  std::vector<int32_t> drafts_verified;

  // One token per sampling entry (no lookahead): the plain decoding case, e.g. for tests.
  static StepOutput one_token_per_sampling_entry(const ScheduledBatch& batch, std::span<const TokenId> token_ids);
};

// Thread-safety: called from the engine's one step thread.
class Executor {
 public:
  virtual ~Executor() = default;
  // A request enters (its sampling parameters and prompt, for penalties and seeded sampling) before its first
  // batch, and leaves after its last. Errors: InvalidArgument for parameters the executor cannot honour.
  virtual Status add_request(SequenceId id, std::span<const TokenId> prompt_token_ids,
                             const SamplingParams& params) = 0;
  virtual void remove_request(SequenceId id) = 0;
  // Runs the batch: writes the KV of every entry's tokens (and of lookahead drafts) into the block tables'
  // blocks, and returns the tokens per entry as StepOutput says. All-or-nothing: an error (a non-finite
  // logit row, a backend failure) returns no tokens, and the batch must not be updated.
  virtual Result<StepOutput> run(const ScheduledBatch& batch) = 0;
};

}  // namespace deepinfer::engine
