// The DeepSeek forward pass (deepseek_v2 and deepseek_v3 architectures) on a Backend: MLA with or without
// q-LoRA in the absorbed form over a paged latent KV cache, YaRN rope, dense and MoE feed-forward layers.
// Reference: Hugging Face transformers' modeling_deepseek_v2.py / modeling_deepseek_v3.py (5.17), which the
// fixtures' reference logits come from; DeepSeek-V2 paper §2.1 (MLA) and DeepSeek-V3 paper §2.1.2 (routing).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/backend/communicator.h"
#include "deepinfer/core/status.h"
#include "deepinfer/model/config.h"
#include "deepinfer/model/expert_placement.h"

namespace deepinfer::model {

// One sequence's part of a step: `num_tokens` consecutive rows of ForwardBatch::token_ids, at positions
// start_position .. start_position + num_tokens - 1. Tokens before start_position are already in the cache.
struct SequenceChunk {
  int32_t num_tokens = 0;
  int32_t start_position = 0;
  std::vector<int32_t> block_table;  // cache blocks (64 tokens each) covering positions [0, start + num_tokens)
};

struct ForwardBatch {
  std::vector<int32_t> token_ids;        // [T], the sequences' chunks one after another
  std::vector<SequenceChunk> sequences;  // in the order of their rows
  std::vector<int32_t> logits_rows;      // rows whose next-token logits are wanted, ascending
  // Keep every row's final hidden state (after model.norm: the vector lm_head sees) in the model, [T, hidden], for
  // the forward_mtp() that follows (speculative decoding's draft pass). Off: nothing is kept.
  bool keep_hidden = false;
  // Keep every row's residual after the DSpark draft module's target layers (config().dspark->target_layer_ids, in
  // that order), [T, hidden * S], for the forward_dspark_inject() that follows. Models with a module only.
  bool keep_dspark_context = false;
};

// The DSpark draft module (config.h's DsparkDraftConfig; deepseek-v4-spec.md §5.1 in the form this build runs on a
// V2/V3 target). Its S stages keep their own latent caches ([num_blocks, 64, kv_cache_dim()] each, indexed like the
// main layers'). The target conditions the draft only through those caches:
//   inject: for a committed token at position t that the target computed, c_t = main_norm(main_proj([h_l1(t) | ... |
//     h_lS(t)])) (h_l: the residual after target layer l), and stage s's cache entry at t = (kv_a_layernorm_s(
//     kv_a_proj_with_mqa_s(c_t)[:C]), rope(kv_a_proj_with_mqa_s(c_t)[C:], t)) — no input norm;
//   block: per drafting request, gamma rows [anchor, noise, ..., noise] at positions p .. p + gamma - 1 (p: the
//     anchor's, the last committed token, not yet computed by the target), embedded with the target's table, through
//     the S stages as decoder layers (attention over the stage's cache: the injected positions < p, and the block's
//     own rows causally, whose entries the pass writes), then h_k = norm(x_k) (the last stage's norm) and base logits
//     lm_head(h_k); row k predicts the token at p + k + 1.
// The heads on the host (DsparkHeads): logits_k = base_k + markov_w2 · markov_w1[prev_k] (prev_0 = anchor, prev_k =
// draft k), confidence_k = sigmoid(proj · [h_k ; markov_w1[prev_k]]).
struct DsparkInjectBatch {
  std::vector<int32_t> context_rows;     // [T] rows of the context the last forward(keep_dspark_context) kept
  std::vector<SequenceChunk> sequences;  // their positions and the stage caches' block tables, in row order
};
struct DsparkBlockBatch {
  std::vector<int32_t> token_ids;        // [T]: per block the anchor, then dspark noise_token_id rows
  std::vector<SequenceChunk> sequences;  // one per block, block_size rows from the anchor's position
};

// One pass of a multi-token-prediction (next-n) layer (DeepSeek-V3 §2.2), as the draft model of speculative
// decoding. Row t sits at position p of its sequence and reads the hidden state h_p that the previous pass kept
// (row hidden_rows[t] of it: a forward() with keep_hidden, or the previous forward_mtp()) and the token t_{p+1}
// (token_ids[t]); it writes the MTP layer's KV entry of position p into the MTP cache and its logits predict t_{p+2}.
// Rows of one sequence are consecutive, at consecutive positions, like a SequenceChunk of forward().
struct MtpBatch {
  std::vector<int32_t> token_ids;        // [T] t_{p+1} of each row
  std::vector<SequenceChunk> sequences;  // positions and block tables of the MTP cache, in row order
  std::vector<int32_t> hidden_rows;      // [T] row of the kept hidden state each row reads
  std::vector<int32_t> logits_rows;      // rows whose logits (draft distributions) are wanted, ascending
};

// Tensor parallelism (Megatron-LM's split, as vLLM and SGLang apply it to DeepSeek): `size` processes, one per
// device, each loading its shard and running every step in lock step, summing partial results over `comm`:
//   MLA: the heads split (rank r holds heads [r H/size, (r+1) H/size) of q_proj / q_b_proj, kv_b_proj and the
//     columns of o_proj; o_proj's partial outputs are all-reduced). q_a_proj, kv_a_proj_with_mqa and their norms are
//     replicated, so every rank computes and caches the whole latent: the latent KV cache is replicated (it is
//     shared by all heads; splitting it would split nothing but the memory of a [C + R]-wide row).
//   dense MLP, shared experts and each routed expert: gate/up rows and down columns split over the intermediate
//     dimension, outputs all-reduced (the routed and shared experts' partial sums in one all-reduce).
//   embedding and lm_head: vocabulary-parallel (rank r holds ids [r V/size, (r+1) V/size)); the embedding's shards
//     are all-reduced, the logits' gathered, so every rank returns the whole vocabulary's logits.
// Requires num_attention_heads, intermediate_size, moe_intermediate_size and vocab_size divisible by size. An MTP layer
// splits as a decoder layer does (its eh_proj, norms and the latent replicated; the shared embedding and lm_head
// vocabulary-parallel), so forward_mtp() runs tensor-parallel; so do the DSpark module's passes (forward_dspark_*):
// its stages split as decoder layers, main_proj and its own compact head (if any) replicated, the embedding and a
// shared lm_head vocabulary-parallel (logits gathered). size 1: the unsharded model (comm unused).
struct TensorParallel {
  int rank = 0, size = 1;
  backend::Communicator* comm = nullptr;  // not owned, outlives the model; required when size > 1
  // The same group's collectives on host memory (the step commands, the logits' gather): a Gloo group beside an
  // NCCL `comm` on CUDA; null: `comm` (the CPU backend's memory is the host's).
  backend::Communicator* host_comm = nullptr;
  backend::Communicator& host() const { return host_comm != nullptr ? *host_comm : *comm; }
};

// Expert parallel (DeepSeek's deployment, SGLang's DP-attention + EP, DeepEP's dispatch/combine): `size` ranks, each
// an attention data-parallel replica — it runs its own sequences, whose KV cache lives only there — holding experts
// [r E/size, (r+1) E/size) of every MoE layer. Per MoE layer each rank routes its tokens (router logits on the
// backend, top-k on the host by route_token, the single-process rule), sends each token's row once to every rank
// holding one of its top-k experts, with its ids and weights (all-to-all: dispatch); each rank applies its experts to
// the rows it received and sends the weighted sums back (all-to-all: combine), which the owner adds to the token's
// output. Every rank makes every pass in lock step: a rank with nothing to run passes an empty batch (it still
// receives and computes other ranks' tokens). With tensor parallel as well, each expert-parallel rank is a tensor-
// parallel group (world tp.size x size: rank = ep_rank * tp.size + tp_rank) and `comm` links the ranks of one
// tensor-parallel index; the experts' intermediate slices then follow TensorParallel. CPU and CUDA backends (on
// CUDA `comm` is NCCL's and moves the rows on the device; `host_comm`, a Gloo group of the same ranks, moves the
// counts, the routing and EPLB's weights; CUDA graphs are not recorded, the routing being read on the host).
// Requires n_routed_experts divisible by size.
struct ExpertParallel {
  int rank = 0, size = 1;
  backend::Communicator* comm = nullptr;  // not owned, outlives the model; required when size > 1
  // Physical expert slots beyond n_routed_experts (--num-redundant-experts): replicas of hot experts, placed by
  // rebalance_experts(); (n_routed_experts + this) % size == 0. At load, slot p holds expert p mod E.
  int num_redundant_experts = 0;
  // The expert-parallel ranks are the tensor-parallel group itself (vLLM's --enable-expert-parallel, SGLang's EP MoE
  // with --ep-size = --tp-size): every rank holds the same tokens, so none are sent: each rank applies its experts
  // (whole, not intermediate-sharded) to every token, with the routing every rank computes alike, and the tensor-
  // parallel all-reduce of the feed-forward output sums the ranks' parts. REQUIRES size == tp.size, rank == tp.rank,
  // comm == tp.comm.
  bool replicated_tokens = false;
  // Capacity per expert slot per pass (--moe-capacity-factor; 0: none, the default, since a cap changes outputs):
  // at most ceil(factor * tokens * top_k / slots) (token, expert) pairs per slot, tokens counting every rank's; the
  // pairs past it, in arrival order (rank, then token), are dropped and the token keeps its residual path for that
  // expert (its other experts and the shared experts still apply). Counted in EplbStats::capacity_dropped.
  double capacity_factor = 0.0;
  // The same group's collectives on host memory: a Gloo group beside an NCCL `comm` on CUDA (required there); null:
  // `comm` (the CPU backend's memory is the host's). Not owned, outlives the model.
  backend::Communicator* host_comm = nullptr;
  backend::Communicator& host() const { return host_comm != nullptr ? *host_comm : *comm; }
};

// EPLB at run time (rank 0 decides; TensorParallel's followers do as told): every `interval_passes` forward passes,
// rebalance_experts(policy, num_groups, num_nodes) between two passes. 0: never.
struct EplbSchedule {
  int64_t interval_passes = 0;
  EplbPolicy policy = EplbPolicy::kGlobal;
  int64_t num_groups = 1, num_nodes = 1;
};

// Expert parallel's counters, for metrics.
struct EplbStats {
  int64_t rebalances = 0;
  std::vector<double> imbalance_before, imbalance_after;  // per MoE layer, at the last rebalance (max/mean rank load)
  std::vector<std::vector<double>> expert_tokens;         // [MoE layers][E]: tokens routed (this rank's), ever
  int64_t capacity_dropped = 0;  // (token, expert) pairs dropped by the capacity factor on this rank, ever
  // Expert parallel across data-parallel ranks (all-to-all): host wall time of this rank's exchanges, ever — the
  // dispatch (counts, rows, routing) and the combine — and of its whole forward passes, in seconds. What a
  // two-micro-batch overlap could hide at most is the exchanges' share of the passes. On the CPU backend the
  // exchange itself (Gloo is synchronous); zero with the experts over tensor-parallel ranks (no exchange).
  double dispatch_seconds = 0.0, combine_seconds = 0.0, pass_seconds = 0.0;
};

// Whether a model of config `c` splits over `size` tensor-parallel ranks; InvalidArgument naming the dimension that
// does not divide. (load() checks it too; a launcher checks it before starting the ranks.)
Status check_tensor_parallel_shapes(const ModelConfig& c, int size);

// The routed experts' routing rule of a config (scoring, top-k method, groups, scaling): what every MoE layer of the
// model passes to Backend::moe and route_token (src/backend/moe_routing.cpp). Benchmarks of one MoE layer use it too.
backend::MoeRoutingRule routing_rule(const ModelConfig& c);

// Per-layer latent caches the caller owns, in the backend's memory: layer_caches[l] holds
// [num_blocks, 64, kv_cache_dim()] values of backend.cache_dtype(). forward() writes the new tokens' entries
// (normalized latent, then the roped key) into the slots their block tables give.
using LayerCaches = std::span<const backend::Buffer>;

class ExpertDispatch;

class DeepSeekModel {
 public:
  // Loads config.json and the safetensors weights from `dir` into the backend. kF32 keeps float32 weights (the
  // path exact against the reference); kBF16 keeps bf16 weights with float32 accumulation; kFP8 keeps the
  // linear weights an FP8 checkpoint stores as FP8 in FP8 with their block scales (the rest bf16); otherwise FP8
  // checkpoints are dequantized with their block scales. MTP layers are loaded and kept. Prints a progress bar
  // to stderr when `progress` is set. Errors name the file and tensor.
  // With `tp` (size > 1), this rank's shard only (TensorParallel); errors name the dimension that does not divide.
  static Result<std::unique_ptr<DeepSeekModel>> load(const std::filesystem::path& dir, backend::Backend& backend,
                                                     backend::Precision precision, bool progress = false,
                                                     const TensorParallel& tp = {}, const ExpertParallel& ep = {});
  // A model of `config`'s shapes with random weights made on the backend (benchmarks of real configs without
  // their checkpoints): linear weights uniform in +-1/sqrt(in_features), norms 1, router bias 0.
  static Result<std::unique_ptr<DeepSeekModel>> create_random(const ModelConfig& config, backend::Backend& backend,
                                                              backend::Precision precision, uint64_t seed,
                                                              const TensorParallel& tp = {},
                                                              const ExpertParallel& ep = {});
  ~DeepSeekModel();

  const ModelConfig& config() const;
  const TensorParallel& tensor_parallel() const { return tp_; }
  const ExpertParallel& expert_parallel() const { return ep_; }
  // The routed experts' precision on the backend (kF32 for a model without MoE layers).
  backend::Precision expert_precision() const;

  // Serving with tensor parallel: rank 0 leads — its engine schedules, and each forward()/forward_greedy() and
  // make_layer_caches() is first broadcast to the other ranks as a command — and every other rank follows: follow()
  // allocates the same caches and runs the same passes (its results are dropped: rank 0 has the gathered logits)
  // until the leader's model is destroyed (a stop command). REQUIRES: tensor_parallel().size > 1; lead() on rank 0,
  // follow() on the others, before any pass. follow() returns OK on the stop, else the error that ended it (the
  // leader gone, a failed pass).
  void lead();
  Status follow();
  // Tensor parallel, rank 0 (lead()): KV blocks written into the latent caches outside a pass (the host and disk
  // tiers' loads, a prefill worker's blocks imported by a decode worker) must be written on every rank, since each
  // keeps the whole latent. Sends blocks[i]'s payload in[i] (num_layers * layer_block_bytes() bytes, layer-major as
  // backend/kv_block_copy.h lays it out) to the followers, which write it into the same blocks of the caches they
  // follow with (REQUIRES num_layers == num_hidden_layers + the draft layer caches made by make_draft_layer_cache).
  // The caller writes its own caches. Call between passes, never beside one (the command shares the group's channel
  // with the passes'); the engine does so in turns with its steps (Engine::StepGate). No-op unless leading.
  // Errors: ShuttingDown (a collective failed: the group is gone), InvalidArgument (payloads and blocks do not match).
  Status replicate_cache_blocks(std::span<const int32_t> blocks, std::span<const std::byte* const> in,
                                int64_t num_layers);

  // Expert parallel (ExpertParallel): where the routed experts are, and the tokens this rank routed to each logical
  // expert per MoE layer since load or the last rebalance ([MoE layers][n_routed_experts]). Null / empty without.
  const ExpertPlacement* expert_placement() const;
  std::vector<std::vector<double>> expert_load() const;
  // EPLB: sums the ranks' expert load (all-reduce over the expert-parallel group), computes a new placement with
  // `policy` (expert_placement.h; num_groups: the expert groups, n_group; num_nodes: hosts), and moves the experts'
  // weights between ranks to it (all-to-all of the slots whose expert changed; a rank keeps what it already holds),
  // then starts counting anew. FP8 experts move as their stored bytes and block scales (Backend::read_matrix_fp8),
  // bf16 ones as their values. Outputs do not change (greedy tokens identical: the same experts, elsewhere). Every
  // rank of the group calls it between the same two passes; requests continue after it. Errors: the collectives',
  // ResourceExhausted, Unsupported (a backend that cannot read weights back); InvalidArgument without expert parallel.
  // A failure on any rank fails every rank at the same layer (each layer's reads and writes are agreed on before the
  // next exchange); the layers moved before it keep their new experts and placement, the rest their old ones.
  // `before` / `after` (optional): per MoE layer the max/mean rank load of the summed load under the old / new
  // placement.
  Status rebalance_experts(EplbPolicy policy, int64_t num_groups, int64_t num_nodes,
                           std::vector<double>* before = nullptr, std::vector<double>* after = nullptr);
  // Rank 0 (lead()) of a tensor- and expert-parallel model: rebalance on that schedule (the followers follow the
  // command). Without tensor parallel (expert parallel across data-parallel ranks in lock step) every rank sets the
  // same schedule and rebalances before the same pass.
  void set_eplb_schedule(const EplbSchedule& schedule) { eplb_schedule_ = schedule; }
  EplbStats eplb_stats() const;
  size_t weight_bytes() const;
  // Bytes of one cache block (64 tokens) of one layer in the backend's cache dtype.
  size_t layer_block_bytes() const;
  // What the model caches per token, by kind: V2/V3 the MLA latent ("latent", every token) of every layer.
  // The engine turns it into the prefix cache's layout (kvcache/cache_layout.h).
  struct CachedKind {
    std::string name;           // "latent", "indexer_key", "sliding_window", "compressed"
    int32_t num_layers = 0;     // layers caching it
    int64_t token_bytes = 0;    // per token per layer, in the backend's cache dtype
    int32_t window_tokens = 0;  // 0: every token; > 0: only the last window
  };
  // `mtp_layers`: MTP layers whose KV the cache also holds (speculative decoding on; their entries have the
  // latent's size, so they count as layers of the "latent" kind, after the num_hidden_layers main ones).
  std::vector<CachedKind> cached_kinds(int32_t mtp_layers = 0) const;
  // Zero-filled per-layer caches of `num_blocks` blocks on the backend, for forward(). Errors: ResourceExhausted.
  Result<std::vector<backend::Buffer>> make_layer_caches(int64_t num_blocks) const;
  // One zero-filled layer cache of `num_blocks` blocks (an MTP layer's, for forward_mtp). Errors: ResourceExhausted.
  Result<backend::Buffer> make_layer_cache(int64_t num_blocks) const;
  // The same for a draft layer the engine keeps beside the main layers' caches (the MTP layer's; a DSpark stage's):
  // with lead(), made on every rank (a command, as make_layer_caches), so that forward_mtp() runs on the followers
  // over their own copy. make_layer_caches() starts a new set (the followers drop the draft caches they had).
  Result<backend::Buffer> make_draft_layer_cache(int64_t num_blocks);
  // The MTP layers the checkpoint has (config's num_nextn_predict_layers; all loaded).
  int64_t num_mtp_layers() const { return config_.num_nextn_predict_layers; }

  // Runs every layer over the batch's tokens, writes their KV entries, and fills `logits` (host) with
  // [logits_rows.size(), vocab_size] float32 logits. REQUIRES: block tables cover every position touched;
  // token ids < vocab_size (else InvalidArgument). Errors from the backend (ResourceExhausted, Internal) are
  // returned; with tensor or expert parallel, a failed collective is ShuttingDown naming the group (the ranks cannot
  // go on without each other). Not thread-safe (uses per-model scratch buffers).
  Status forward(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<float>& logits);
  // The same pass, but only each logits row's argmax (the lowest id among equal maxima) comes back to the host:
  // ids [logits_rows.size()], -1 for a row holding a NaN or +inf or nothing above -inf. Greedy decoding without
  // moving the logits.
  Status forward_greedy(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<int32_t>& ids);
  // The same pass, each logits row sampled where the logits are (Backend::read_sampled_tokens: the engine sampler's
  // semantics, `adjustments` carrying logit_bias and penalties); ids as forward_greedy. `sampling` has one entry per
  // logits row; rows with DeviceSampling::logprobs >= 0 also get their logprobs into `logprobs` (when non-null:
  // Backend::read_sampled_logprobs). Errors: Unsupported unless samples_on_device() (a backend with device sampling,
  // no tensor parallel); InvalidArgument for a count mismatch; as forward().
  bool samples_on_device() const;
  Status forward_sampled(const ForwardBatch& batch, LayerCaches layer_caches,
                         std::span<const backend::Backend::DeviceSampling> sampling,
                         std::span<const backend::Backend::LogitAdjustment> adjustments, std::vector<int32_t>& ids,
                         std::vector<backend::Backend::SampledLogprobs>* logprobs = nullptr);

  // One pass of MTP layer `mtp_layer` (< num_mtp_layers()) over `batch` (see MtpBatch), following a pass that kept
  // its hidden states (forward() with keep_hidden, or forward_mtp()). The convention the demo model was trained
  // with (tools/README.md) and vLLM's DeepSeekMTP applies: x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]), one
  // decoder layer (attention over `mtp_cache`, [num_blocks, 64, kv_cache_dim]), then shared_head.norm and the
  // shared lm_head. Unlike vLLM, position 0's embedding is not masked (the demo was not trained so). The pass
  // keeps its own hidden state after shared_head.norm (what the head sees: the same convention as the main
  // model's, so that a chained pass reads what the layer was trained on) for the next forward_mtp(). Exactly one
  // of `logits` ([logits_rows, vocab] float32, host) and `greedy` (argmax ids [logits_rows]; -1 as forward_greedy)
  // is non-null; with `greedy`, `greedy_probability` (optional) gets each id's softmax probability [logits_rows]
  // (the draft's confidence, computed where the logits are). Errors: InvalidArgument (no such layer, rows beyond
  // the kept hidden state, bad block tables or token ids, no kept hidden state), the backend's. Not thread-safe.
  // Always eager (no graphs).
  Status forward_mtp(int64_t mtp_layer, const MtpBatch& batch, const backend::Buffer& mtp_cache,
                     std::vector<float>* logits, std::vector<int32_t>* greedy,
                     std::vector<float>* greedy_probability = nullptr);

  // The DSpark module's host heads (config().dspark set), float32. The draft works in its own vocabulary: the ids
  // whose lm_head or markov_w2 row is not all zero (`active`, ascending; the demo's compact vocabulary), every other
  // id's draft logit being exactly 0 (a zero head row and a zero Markov row), so skipping them changes no value;
  // `active` empty: every id. Draft logits rows (forward_dspark_block's, markov's) are [draft_vocab()], entry i for
  // id active[i] (or i). Null without a module. Immutable; thread-safe to read.
  struct DsparkHeads {
    int64_t vocab = 0, hidden = 0, rank = 0;
    std::vector<float> markov_w1;    // [vocab, rank]
    std::vector<float> markov_w2_t;  // [rank, draft_vocab()]: markov_w2's active rows, transposed
    std::vector<float> markov_w2_rows;  // [draft_vocab(), rank]: the same rows untransposed (greedy_draft's few)
    std::vector<float> markov_w2_norm;  // [draft_vocab()]: each row's L2 norm, rounded up (greedy_draft's bound)
    float markov_w2_norm_max = 0.0f;
    std::vector<float> confidence;   // [hidden + rank], the confidence head's proj (no bias)
    std::vector<int32_t> active;
    int64_t draft_vocab() const { return active.empty() ? vocab : static_cast<int64_t>(active.size()); }
    int32_t id_of(int64_t i) const { return active.empty() ? static_cast<int32_t>(i) : active[static_cast<size_t>(i)]; }
    // logits[i] = base[i] + markov_w2[id_of(i)] · markov_w1[previous] ([draft_vocab()] each; may alias).
    void markov(std::span<const float> base, int32_t previous, std::span<float> logits) const;
    // argmax(markov(base, previous)) without the whole Markov term, same result bit for bit: the Markov term of
    // entry i is at most |markov_w2[i]| |markov_w1[previous]| (Cauchy-Schwarz), so only entries whose base logit
    // plus that bound reaches the value of base's own maximum after the term can win; those get the term, the
    // others do not (the Markov term reads rank x draft vocabulary floats, 2 MB per draft on the demo: the heads
    // were memory-bound). Falls back to the whole row when base holds a NaN or infinity. -1 as argmax's.
    int32_t greedy_draft(std::span<const float> base, int32_t previous) const;
    // A greedy chain of up to drafts.size() drafts after `previous`: row k of `base` ([k][draft_vocab()]) and of `h`
    // ([k][hidden]) give drafts[k] = greedy_draft(base_k, previous_k) and confidences[k] = confidence_of(h_k,
    // previous_k), each draft the next row's previous. Returns how many it wrote; it stops after a -1 draft (a row
    // with NaN or infinity), which it writes.
    size_t greedy_chain(std::span<const float> base, std::span<const float> h, int32_t previous,
                        std::span<int32_t> drafts, std::span<double> confidences) const;
    // The greedy draft of a draft-vocabulary row: its largest logit's id, counting the ids outside the draft
    // vocabulary as logit 0 (lowest id among equal maxima); -1 when the row's largest value is NaN or infinite.
    int32_t argmax(std::span<const float> logits) const;
    // argmax's answer once the draft vocabulary's first largest entry `best` (value `best_value`) is known.
    int32_t finish_argmax(size_t best, float best_value) const;
    // The lowest id outside the draft vocabulary (`active`, ascending); vocab when there is none.
    int32_t first_outside() const;
    // The row over the whole vocabulary (zeros outside the draft's), for a sampled draft. full: [vocab].
    void expand(std::span<const float> logits, std::span<float> full) const;
    // sigmoid(confidence · [h ; markov_w1[previous]]) (h: [hidden], the row's h_k).
    double confidence_of(std::span<const float> h, int32_t previous) const;
  };
  const DsparkHeads* dspark_heads() const;
  // The injection pass (see DsparkInjectBatch) into `stage_caches` (S of them), following a forward() with
  // keep_dspark_context. Queued on the device, not waited for (the next pass on the stream reads its entries;
  // synchronize() waits); recorded as a graph where a decode step would be (set_use_graphs). Errors: InvalidArgument
  // (no module, rows beyond the kept context, bad block tables), the backend's (a device error may surface at the
  // next call that waits). Not thread-safe.
  Status forward_dspark_inject(const DsparkInjectBatch& batch, LayerCaches stage_caches);
  // Waits for the work queued on the device (the backend's synchronize). Errors: the backend's. Not thread-safe.
  Status synchronize() { return backend_.synchronize(); }
  // The block pass: base logits [T, dspark_heads()->draft_vocab()] float32 (host, in the draft's vocabulary) and h
  // [T, hidden] float32 (host) of every row; writes the
  // rows' entries into the stage caches. Drops any kept hidden state or context (it may grow the scratch). Errors as
  // forward_dspark_inject's, plus token ids outside the vocabulary. Not thread-safe; runs as a recorded graph under
  // the decode steps' rules (below).
  Status forward_dspark_block(const DsparkBlockBatch& batch, LayerCaches stage_caches, std::vector<float>& logits,
                              std::vector<float>& hidden);
  // The block pass with the greedy heads on the device (Backend::read_dspark_greedy_chains), when
  // has_device_dspark_heads(): block c (batch.sequences[c], block_size rows) gives its first lengths[c] drafts and
  // confidences after previous[c], as dspark_heads()->greedy_chain over forward_dspark_block's outputs would (the
  // same drafts bit for bit; confidences to double rounding), without the logits or the heads' work on the host.
  // drafts and confidences: [blocks * block_size]; 0 past lengths[c]; -1 from a row holding a NaN or infinity on.
  // Errors: Unsupported without device heads; InvalidArgument when previous / lengths / rows disagree; as
  // forward_dspark_block's. Same rules as forward_dspark_block.
  bool has_device_dspark_heads() const;
  Status forward_dspark_block_greedy(const DsparkBlockBatch& batch, LayerCaches stage_caches,
                                     std::span<const int32_t> previous, std::span<const int32_t> lengths,
                                     std::vector<int32_t>& drafts, std::vector<double>& confidences);

  // Decode steps (every sequence at most kGraphMaxRowsPerSequence rows — one, or a speculative verify's last token
  // and drafts —, at most kGraphMaxRows rows, not all at position 0) and DSpark block passes go through
  // Backend::run_graph, which on the CUDA backend replays a CUDA graph per (rows, sequences, block-table bucket,
  // logits rows, greedy or not) instead of launching every op (how the rows split among the sequences is step
  // data, uploaded by begin_step, not part of the graph). On by default; off runs every step eagerly. Either way such a
  // step's block tables are padded to the same power-of-two bucket, so graph and eager runs compute the same
  // values bit for bit. Switching to another set of layer caches, or growing the per-model scratch, discards the
  // backend's graphs (they bake in those addresses).
  void set_use_graphs(bool use_graphs) { use_graphs_ = use_graphs; }
  // The backend's Backend::graph_recordings(): a step during which it grew ran some of its work eagerly to record it.
  int64_t graph_recordings() const { return backend_.graph_recordings(); }
  // Why 256: launch overhead matters at small batches (a 256-row step already takes tens of ms), and up to 256 rows
  // the MoE layers stay on the grouped kernel, which never waits for the host (256 x top-8 = 2048 token copies,
  // under cuda_moe.cpp's 4096); a step that does wait runs eagerly anyway.
  static constexpr int64_t kGraphMaxRows = 256;
  // A verify's rows per sequence: the last token and up to 15 drafts (small prefill chunks past a cached prefix
  // qualify too; longer ones gain little from a graph).
  static constexpr int64_t kGraphMaxRowsPerSequence = 16;

  struct Weights;
  struct Scratch;

 private:
  // forward_dspark_block's device half: the pass, its logits left in the backend and h in the scratch.
  Status run_dspark_block(const DsparkBlockBatch& batch, LayerCaches stage_caches);
  DeepSeekModel(ModelConfig config, backend::Backend& backend, const TensorParallel& tp, const ExpertParallel& ep);
  // The whole vocabulary's logits [rows, vocab] from this rank's [rows, vocab / tp.size] (gathered over tp.comm).
  Status gather_vocab(std::vector<float>& logits);
  // Tensor parallel, after compute_logits(not greedy): the head's logits read and gathered into `logits` (null:
  // tp_logits_), and their argmax ids into `greedy` when given.
  Status read_gathered_logits(std::vector<float>* logits, std::vector<int32_t>* greedy);
  // forward()/forward_greedy()'s end: the pass's time counted (expert parallel), a failed group named.
  Status finish_pass(Status pass, std::chrono::steady_clock::time_point started);
  // lead(): sends a command (kind, then its payload) to the followers.
  static constexpr uint64_t kStopCommand = 0, kCachesCommand = 1, kForwardCommand = 2, kForwardGreedyCommand = 3,
                            kRebalanceCommand = 4, kWriteBlocksCommand = 5, kDraftCacheCommand = 6,
                            kForwardMtpCommand = 7, kDsparkInjectCommand = 8, kDsparkBlockCommand = 9;
  // Tensor parallel, leader: the index in draft_caches_ of stage_caches[0], the S stage caches consecutive there
  // (the followers' copies of the same index); InvalidArgument when they are not draft caches.
  Result<int64_t> stage_cache_index(const char* where, LayerCaches stage_caches) const;
  // Leader: sends a DSpark pass command (kind) naming stage_caches' index, then `rows` (the context rows or the
  // block's token ids) and `sequences` as a ForwardBatch; followers and one-process models: nothing.
  Status send_dspark_command(uint64_t kind, const char* where, LayerCaches stage_caches, std::span<const int32_t> rows,
                             std::span<const SequenceChunk> sequences);
  // The draft layer caches made since the last make_layer_caches(), in order (the followers' commands name the index).
  mutable std::vector<const void*> draft_caches_;
  EplbSchedule eplb_schedule_;
  int64_t passes_since_rebalance_ = 0;
  EplbStats eplb_stats_;
  void send_command(uint64_t kind, std::vector<int64_t> payload) const;
  // A pass's status, or ShuttingDown naming the group when one of its collectives failed (a rank died or hung: the
  // server cannot run without it and stops; its requests get a 503 saying why, not an opaque 500).
  Status group_failure(Status pass) const;
  bool leading_ = false;
  Status reserve_scratch(int64_t rows);
  // forward() (logits set), forward_greedy() (greedy set) or forward_sampled() (greedy set, sampling non-empty).
  Status run(const ForwardBatch& batch, LayerCaches layer_caches, std::vector<float>* logits,
             std::vector<int32_t>* greedy, std::span<const backend::Backend::DeviceSampling> sampling = {},
             std::span<const backend::Backend::LogitAdjustment> adjustments = {},
             std::vector<backend::Backend::SampledLogprobs>* logprobs = nullptr);
  int64_t kept_hidden_rows_ = 0;  // rows of the hidden state the last pass kept (0: none)
  int64_t kept_context_rows_ = 0;  // rows of the DSpark context the last forward() kept (0: none)
  ModelConfig config_;
  // The shapes this rank computes: config_ with num_attention_heads, intermediate_size and moe_intermediate_size
  // divided by the tensor-parallel size (config_ itself at size 1).
  ModelConfig local_;
  TensorParallel tp_;
  ExpertParallel ep_;
  std::unique_ptr<ExpertDispatch> dispatch_;  // ep_.size > 1
  std::vector<float> tp_logits_, tp_gather_;  // tensor parallel: this rank's logits, the gathered blocks
  backend::Backend& backend_;
  std::unique_ptr<Weights> weights_;
  std::unique_ptr<Scratch> scratch_;
  bool use_graphs_ = true;
  uint64_t graph_owner_ = 0;                     // GraphKey::owner: unique per model, never reused
  std::vector<const void*> graph_cache_layers_;  // the layer caches the backend's graphs of this model wrote
  std::vector<const void*> graph_stage_layers_;  // the DSpark stage caches its block-pass graphs wrote
  // Discards the backend's graphs when `caches` are not the ones `recorded` names (then records them).
  void track_graph_caches(std::vector<const void*>& recorded, LayerCaches caches);
};

}  // namespace deepinfer::model
