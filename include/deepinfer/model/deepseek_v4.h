// DeepSeek-V4 (model_type "deepseek_v4": V4-Flash, V4-Pro) over the backend interface: the reference path of the V4
// family on the CPU backend, bf16 on the CUDA backend.
//
// What V4 is (../shared/research/deepseek-v4-spec.md §1-§4; DeepSeek's own V4-Flash-0731 inference/model.py is the
// reference the fixture tiny-deepseek-v4-official was computed with):
//   - manifold-constrained hyper-connections (mHC): the residual is hc_mult (4) streams [T, 4, d]; before each
//     sublayer a mix (RMS-scaled projection, sigmoid, Sinkhorn-normalised 4x4 combination) reduces them to one
//     input and afterwards spreads the output back;
//   - shared-KV attention (one KV head, K = V, head_dim D with rope on the LAST rope dims, interleaved pairs),
//     per-head weightless q RMS norm, a sink logit per head in the softmax denominator, output de-roped and
//     projected through o_groups low-rank groups (wo_a per group, then wo_b);
//   - three layer kinds by compress_ratios[layer]: 0 = sliding window (SWA, the last `sliding_window` raw tokens),
//     4 = compressed-sparse (CSA: overlapped 4:1 compressed entries, chosen per query by a lightning indexer's
//     top-k, plus the raw window), 128 = heavily compressed (HCA: every visible 128:1 entry plus the window).
//     Query at position p sees compressed entry j only when j < (p + 1) / m (its own just-finished block counts);
//   - MoE on every layer: sqrt(softplus) scores; the first num_hash_layers layers route by a frozen token-id table
//     (tid2eid), the others by top-k of score + bias; weights = normalised scores x routed_scaling_factor; SwiGLU
//     clamped at swiglu_limit on routed and shared experts.
// Rope: window layers use rope_theta without YaRN; compressed layers use compress_rope_theta with YaRN (factor,
// original_max_position_embeddings, beta_fast, beta_slow; cos/sin unscaled).
//
// Numerics on the CPU: float32 activations, weights widened exactly from the checkpoint (bf16 / f32); the KV is kept
// in float32 (no FP8 / FP4 rounding of cached entries, the indexer's Hadamard rotation omitted: it is orthogonal and
// applied to both indexer q and k, so it changes no score) - as the fixture's reference computed it. On CUDA: bf16
// weights, activations and cache, float32 arithmetic inside the ops.
//
// The cache is per sequence (V4Sequence): per layer a ring of the last `sliding_window` raw KV rows, the
// compressed entries so far, the compressors' unfinished blocks (and, overlapped, the previous block), and for CSA
// layers the indexer's compressed keys. Feeding a sequence's tokens in any chunking gives the same result. A forward
// can also write each finished 64-token block's part of that state (a block payload: the compressed entries and indexer
// keys it finishes) and its raw window rows with the compressors' rows at its end (a window payload); restore()
// rebuilds a sequence at a block boundary from its blocks' payloads and the window payloads of its last window
// (exact), or from the block payloads alone for a bounded replay: the last `sliding_window` tokens are fed again and
// rebuild only the window rows and the compressors' rows (SGLang keeps that state with its SWA pages), attending a
// window truncated at the replay's start (SGLang's V4.1 "SWA bounded replay", research/deepseek-v4-spec.md §7.2:
// an approximation, measured in the README). This is the engine's hybrid prefix cache over V4: block payloads in
// the main pool and the tiers, window payloads in a window pool on the device, only for the last window.
//
// Status of the V4 path (issue 20): the forward pass is the backend's ops (backend.h: the shared ones, and the V4
// ops for mHC, norm+rotary, compressors, indexer and sparse attention); any backend with has_v4_ops() runs it (the CPU
// and CUDA ones). Checkpoints in the release's quantization (FP8 e4m3 weights with ue8m0 block scales, FP4 experts)
// are dequantized exactly at load on the CPU (float32); with FP8 asked for (CUDA's default) the FP8 weights stay FP8
// and FP4 experts become FP8 where that is exact (load()). Not yet: the MTP layer.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"
#include "deepinfer/model/config.h"

namespace deepinfer::model {

// config.json of a deepseek_v4 checkpoint (transformers' DeepseekV4Config field names; spec §1.2).
struct V4Config {
  std::string model_type;  // "deepseek_v4"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;             // d
  int64_t moe_intermediate_size = 0;   // each routed and shared expert
  int64_t num_hidden_layers = 0;       // the backbone (compress_ratios also lists the MTP layers after it)
  int64_t num_attention_heads = 0;     // H
  int64_t head_dim = 0;                // D (K = V), rope on its last qk_rope_head_dim dims
  int64_t qk_rope_head_dim = 0;        // R
  int64_t q_lora_rank = 0;
  int64_t o_lora_rank = 0;             // L
  int64_t o_groups = 0;                // G; H % G == 0
  std::vector<int64_t> compress_ratios;  // per layer (+ MTP layers): 0, 4 or 128
  double rope_theta = 10000.0;           // window layers, no YaRN
  double compress_rope_theta = 40000.0;  // compressed layers, with YaRN
  RopeScaling rope_scaling;              // YaRN of the compressed layers
  int64_t sliding_window = 128;          // W
  int64_t index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int64_t hc_mult = 4, hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  int64_t n_routed_experts = 0, num_experts_per_tok = 0, n_shared_experts = 1;
  std::string scoring_func = "sqrtsoftplus";  // "sqrtsoftplus" | "sigmoid" | "softmax"
  double routed_scaling_factor = 1.0;
  double swiglu_limit = 0.0;  // 0: no clamp
  int64_t num_hash_layers = 0;
  double rms_norm_eps = 1e-6;
  int64_t num_nextn_predict_layers = 0;
  int64_t max_position_embeddings = 0;
  int64_t bos_token_id = 0;
  std::vector<int64_t> eos_token_ids;
  // quantization_config (fp8, e4m3): the [rows, cols] blocks of each FP8 weight's `.scale` (ue8m0 / F8_E8M0 or
  // float; V4 128x128, V4.1 32x32); empty: not quantized. expert_dtype: "fp4" (routed experts packed two E2M1
  // values per byte, I8/U8 [out, in / 2], low nibble first, with a scale per 32 inputs [out, in / 32]), "fp8"
  // (block-scaled like the dense weights) or "" (as stored). The CPU path dequantizes every one exactly to float32.
  std::vector<int64_t> weight_block_size;
  std::string expert_dtype;
};

// Parses `dir/config.json` (or the file) of a deepseek_v4 checkpoint. Required: model_type "deepseek_v4",
// vocab_size, hidden_size, moe_intermediate_size, num_hidden_layers, num_attention_heads, head_dim,
// qk_rope_head_dim, q_lora_rank, o_lora_rank, o_groups, compress_ratios, n_routed_experts, num_experts_per_tok,
// index_n_heads, index_head_dim, index_topk when any ratio is 4; the rest default as in the spec's §1.2.
// Errors name the file and field: InvalidArgument (types, values: compress_ratios length num_hidden_layers +
// num_nextn_predict_layers with values 0/4/128, num_key_value_heads != 1, head_dim <= rope dims, H % G, ...),
// Unsupported (a quantization other than fp8 e4m3 with block scales, expert_dtype other than fp4/fp8,
// topk_method other than noaux_tc, tie_word_embeddings, rope_scaling type other than yarn), NotFound / IoError /
// Corruption as load_model_config.
Result<V4Config> load_v4_config(const std::filesystem::path& path);

// The fields of the V2/V3 config the engine and server read (vocabulary, EOS/BOS, lengths, sizes for logs) for a
// V4 checkpoint: model_type "deepseek_v4", num_nextn_predict_layers 0 (the V4 path does not run the MTP layer).
ModelConfig v4_engine_view(const V4Config& config);

// Every tensor a checkpoint of `config` holds in the release layout, with its shape ([] dims as the loader checks
// them); `token_table` marks layers.N.ffn.gate.tid2eid (integers), every other tensor is floating point.
struct V4TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool token_table = false;
};
std::vector<V4TensorSpec> v4_tensors(const V4Config& config);

// The config the engine and server read for the checkpoint at `path`: load_model_config for V2/V3, and
// v4_engine_view(load_v4_config) for model_type "deepseek_v4". Errors as those loaders and read_model_type.
Result<ModelConfig> load_engine_model_config(const std::filesystem::path& path);

// The model_type field of `dir/config.json` (or the file), for choosing a loader. Errors as load_model_config.
Result<std::string> read_model_type(const std::filesystem::path& path);

namespace detail {
class V4Forward;
class V4Memory;
}

// One sequence's V4 cache (see the header comment), in the model's backend memory (allocated by its first forward or
// restore). Owned by the caller; used by one forward at a time; must not outlive the model.
class V4Sequence {
 public:
  int64_t length() const { return length_; }  // tokens fed so far (the next token's position)

 private:
  friend class DeepSeekV4Model;
  friend class detail::V4Forward;
  friend class detail::V4Memory;
  struct Compressor {
    // The raw rows of the last 2m positions fed: [2m][width], position p at row p % 2m (score with ape added).
    backend::Buffer ring_kv, ring_score;
    backend::Buffer entries;  // [capacity][dim]: finished entries (normed, roped), entry j = block j
    int64_t capacity = 0, made = 0;
  };
  struct Layer {
    backend::Buffer window;  // [W][D] ring: row p % W holds the raw KV of position p
    Compressor attention, indexer;
  };
  std::vector<Layer> layers_;  // empty until allocated
  int64_t length_ = 0;
  int64_t window_start_ = 0;  // the first position whose raw rows exist (> 0 after a bounded replay's restore)
  int64_t replay_end_ = 0;    // positions below it are a bounded replay's (restore()); 0: none
};

class DeepSeekV4Model {
 public:
  // Loads config.json and every tensor of the release layout (embed.weight, head.weight, norm.weight, hc_head_*,
  // layers.N.{attn_norm,ffn_norm,hc_attn_*,hc_ffn_*,attn.*,ffn.*}); each tensor's shape is checked.
  // `backend` must have the V4 ops (backend.h: has_v4_ops) and outlive the model.
  // Errors: those of load_v4_config and Checkpoint; InvalidArgument naming a tensor whose shape differs, that is
  // missing, or whose quantization does not match the config (an FP8 tensor without its scales, packed FP4 outside
  // the routed experts); Unsupported for a backend without the V4 ops.
  // `precision`: how the large matrices are kept: default float32 on a float32 backend (the CPU's: exact) and bf16 on
  // others. kFP8 (the CUDA backend's default through `serve`): a tensor stored as FP8 e4m3 in 128x128 blocks (cols a
  // multiple of 128) keeps its bytes and scales (block-scaled FP8 GEMMs), except attn.wo_a (bf16, as SGLang); packed
  // FP4 routed experts become FP8 with 128x128 power-of-two block scales when every value's FP4 scale is within 2^14
  // of its block's largest (exact: e2m1 * 2^k for k in [-8, 6] is an e4m3 value), else bf16 (exact); all the rest
  // (bf16 tensors, FP8 in other block sizes such as V4.1's 32x32) is dequantized to bf16. fp8_weights() counts them.
  static Result<std::unique_ptr<DeepSeekV4Model>> load(const std::filesystem::path& dir, backend::Backend& backend,
                                                       std::optional<backend::Precision> precision = std::nullopt);
  // A model of `config`'s shapes with random weights made on the backend (benchmarks of real configs without their
  // checkpoints: bench/gpu/bench_model): matrices uniform in ±1/sqrt(in features), norms 1, biases and sinks 0, the
  // hash table spread over the experts; deterministic in `seed`. Errors: ResourceExhausted; Unsupported as load().
  // `precision` as load()'s; kFP8 makes FP8 the matrices the release stores in FP8 (wq_a, wq_b, wkv, wo_b, the
  // indexer's wq_b, shared and routed experts) where cols is a multiple of 128.
  static Result<std::unique_ptr<DeepSeekV4Model>> create_random(const V4Config& config, backend::Backend& backend,
                                                                 uint64_t seed,
                                                                 std::optional<backend::Precision> precision = std::nullopt);
  // Weight matrices handed to the backend in FP8 (stacked experts count once per stack; a backend without FP8 weights,
  // the CPU's, widens them to bf16 exactly); 0 unless FP8 was asked for.
  int64_t fp8_weights() const;
  // Bytes of the weights one forward reads besides the routed experts, and of one routed expert (gate, up, down):
  // the benchmarks' memory rooflines.
  int64_t dense_weight_bytes() const;
  int64_t expert_bytes() const;
  // Parameters of those dense weights (the benchmarks' FLOPs; a routed expert has 3 * moe_intermediate_size * hidden).
  int64_t dense_weight_params() const;
  ~DeepSeekV4Model();

  const V4Config& config() const { return config_; }
  // The backend the model runs on (its sequences' and payloads' memory).
  backend::Backend& backend() const { return backend_; }
  // Bytes of one element of the cache payloads and sequence buffers: the backend's activation dtype (CPU: float32,
  // CUDA: bf16). Payload sizes below count elements ("floats" on the CPU).
  int64_t payload_element_bytes() const;
  // v4_engine_view(config()).
  ModelConfig engine_config() const { return v4_engine_view(config_); }
  // Fixed cache bytes per sequence: the window rings and the compressors' row rings of every layer.
  int64_t window_bytes_per_sequence() const;
  std::unique_ptr<V4Sequence> new_sequence() const;

  // One sequence's next tokens: feeds token_ids at positions sequence->length() ... and advances it.
  enum class Logits { kNone, kLast, kAll };  // which of the chunk's rows get logits
  struct Chunk {
    V4Sequence* sequence = nullptr;
    std::span<const int32_t> token_ids;
    Logits logits = Logits::kLast;
    // Where to write the cache of each 64-token block the chunk completes (block payloads, below): one pointer per
    // multiple of 64 in (start, start + n], in order, each to block_payload_floats() elements in the backend's memory.
    // Empty: none written.
    std::span<float* const> completed_blocks = {};
    // The same blocks' window payloads (window_payload_floats() each), written with the block payloads; shorter,
    // or a null pointer: that block's window rows are not written.
    std::span<float* const> completed_windows = {};
  };

  // A block payload: what every block of a cached prefix must hold, enough (with the window payloads of the last
  // window) to resume the sequence at the block's end (restore()). Per layer, in layer order: on compressed layers
  // the entries the block finishes ([64 / m][D], for m = 128 one slot, filled on odd blocks); on CSA layers also the
  // indexer keys it finishes ([16][index_head_dim]). Elements of payload_element_bytes(). The engine keeps payloads as the blocks of its paged
  // cache (prefix caching, host and disk tiers). (At least 1: a model of window layers only has one unused float.)
  int64_t block_payload_floats() const;
  // A window payload: what only a prefix's last window needs. Per layer, in layer order: the block's raw KV rows
  // [64][D]; on compressed layers the compressor's rows at the block's end (raw kv | score+ape rows, at most m
  // rows of [c * D] each: the overlapped compressor's last finished block (4 rows), the 128:1 one's unfinished
  // half (0 or 64 rows)); on CSA layers the indexer compressor's 4 rows the same way. Elements of
  // payload_element_bytes(). The engine keeps
  // them in its window pool (device only).
  int64_t window_payload_floats() const;
  // Blocks of the last window a restore reads window payloads of: ceil(sliding_window / 64).
  int64_t window_blocks() const;
  // Sets `sequence` to the state after position P = 64 * blocks.size() from those blocks' payloads (block 0 first)
  // and `windows`, the window payloads of the last min(window_blocks(), P / 64) blocks (exact). With `windows`
  // empty and P > sliding_window: a bounded replay - the sequence then stands at P - sliding_window and its next
  // forward chunk must be exactly the tokens of positions [P - sliding_window, P) (they rebuild the window rows;
  // the compressed state stays as restored); it continues exactly as a sequence whose window was computed from
  // that point on. REQUIRES: the payloads were written for this model, of one token sequence; windows as said.
  // Errors: ResourceExhausted (the sequence's backend memory).
  Status restore(V4Sequence& sequence, std::span<const float* const> blocks,
                 std::span<const float* const> windows) const;
  // Runs the chunks as one batch (distinct sequences). logits: float32 [rows][vocab_size], rows in chunk order
  // (each chunk's wanted rows in position order). Errors: InvalidArgument (empty chunk, token id outside the
  // vocabulary, a sequence twice, position past max_position_embeddings); the sequences are then unchanged.
  Status forward(std::span<const Chunk> chunks, std::vector<float>& logits);
  // forward() with the head's rows kept where the logits are: `ids` gets one token per wanted row (chunk order),
  // drawn there with `sampling[i]` for row i and `adjustments` (Backend::read_sampled_tokens; then `logprobs`, when
  // given, the rows' asked-for logprobs), or with `sampling` empty the argmax (Backend::read_greedy_tokens, on any
  // backend). REQUIRES: samples_on_device() when `sampling` is not empty. Errors: forward()'s, and the backend's.
  Status forward_on_device(std::span<const Chunk> chunks, std::span<const backend::Backend::DeviceSampling> sampling,
                           std::span<const backend::Backend::LogitAdjustment> adjustments, std::vector<int32_t>& ids,
                           std::vector<backend::Backend::SampledLogprobs>* logprobs);
  // Whether the backend samples where the logits are (the CUDA backend).
  bool samples_on_device() const { return backend_.has_device_sampling(); }

 private:
  // forward()'s body up to the head: validates, runs the layers; head_in gets the wanted rows' hidden states and
  // `wanted` how many there are.
  Status run_layers(std::span<const Chunk> chunks, backend::Tensor& head_in, size_t& wanted);
  struct Weights;
  explicit DeepSeekV4Model(V4Config config, backend::Backend& backend);
  V4Config config_;
  backend::Backend& backend_;
  std::unique_ptr<Weights> w_;
};

}  // namespace deepinfer::model
