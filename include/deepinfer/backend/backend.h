// The backend interface: the few batched operations the DeepSeek forward pass is made of, over memory the
// backend owns (host RAM for the CPU backend, device memory for CUDA). Model code sees only this header; the
// implementations live in src/backend/cpu and src/backend/cuda (ggml's narrow backend interface: one forward
// pass, one test definition, several backends).
//
// A step goes: begin_step(layout) once (the rows' token ids, positions, cache slots and block tables, given on
// the host; a device backend uploads them), then ops over Tensors, then logits() copies the wanted rows'
// logits to the host. Every op is batch-first: rows are tokens of one step, from any number of sequences.
// The ops between begin_step and the logits' read may go through run_graph, which lets a device backend record
// them once per shape and replay the recording (CUDA graphs) instead of launching each op again.
//
// Conventions: activations are 2-D row-major views (Tensor) in the backend's activation dtype (CPU: float32,
// CUDA: bfloat16); outputs are caller-owned, written entirely, and must not alias inputs unless stated. Ops
// on a device backend are asynchronous on the backend's stream; logits(), read_logits(), download() and
// synchronize() wait.
// Weights and vectors are uploaded once (make_weight / make_vector) and are immutable afterwards.
// Thread-safety: a Backend is used by one engine thread at a time; it may use threads internally.
// Errors: shape mismatches are programming errors (checked with DEEPINFER_CHECK-style aborts in the backends);
// memory exhaustion and device faults are reported as Status by the calls that return one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "deepinfer/backend/moe_routing.h"
#include "deepinfer/core/status.h"

namespace deepinfer::backend {

enum class DType : uint8_t { kF32, kBF16 };
inline size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// Backend memory (host or device), freed when the last copy goes away. Never dereference data() on the host
// unless the backend is the CPU one.
struct Buffer {
  std::shared_ptr<void> storage;
  size_t bytes = 0;
  void* data() const { return storage.get(); }
};

// A 2-D view of backend memory: rows x cols elements of `dtype`, row stride `stride` elements (>= cols).
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0, stride = 0;

  // Columns [begin, begin + count) of every row.
  Tensor cols_slice(int64_t begin, int64_t count) const {
    return {static_cast<char*>(data) + begin * static_cast<int64_t>(dtype_size(dtype)), dtype, rows, count, stride};
  }
  // Rows [begin, begin + count).
  Tensor rows_slice(int64_t begin, int64_t count) const {
    return {static_cast<char*>(data) + begin * stride * static_cast<int64_t>(dtype_size(dtype)), dtype, count, cols,
            stride};
  }
  // The same memory seen as rows of `new_cols` (contiguous views only: stride == cols, rows*cols % new_cols == 0).
  Tensor reshaped(int64_t new_cols) const { return {data, dtype, rows * cols / new_cols, new_cols, new_cols}; }
};

// How a weight matrix is kept: kF32 is the reference-exact path (CPU); kBF16 halves the bytes and accumulates in
// float32; kFP8 keeps DeepSeek's native float8_e4m3fn values with one float32 scale per 128x128 block
// (CUDA: block-scaled FP8 GEMMs with 1x128 activation scales; the CPU backend widens FP8 to bfloat16).
enum class Precision { kF32, kBF16, kFP8 };

// Host data of one matrix [rows][cols], in one of two forms: float32 values (rounded to the weight's
// precision; an FP8 weight takes only the second form), or the checkpoint's float8_e4m3fn bytes with their block
// scales [ceil(rows/128)][ceil(cols/128)] (scale_inv as stored: value = fp8 * scale). Borrowed for the call.
struct HostMatrix {
  int64_t rows = 0, cols = 0;
  std::span<const float> f32;
  std::span<const uint8_t> fp8;
  std::span<const float> fp8_scales;
};

// A weight on the backend: `count` matrices [rows][cols] (out_features x in_features, as checkpoints store them).
class Weight {
 public:
  virtual ~Weight() = default;
  Precision precision = Precision::kF32;
  int64_t count = 1, rows = 0, cols = 0;
  size_t bytes = 0;  // backend memory held
};

// What one step's rows are. Host spans, read during begin_step only.
struct StepLayout {
  std::span<const int32_t> token_ids;     // [T]
  std::span<const int32_t> positions;     // [T] position of each row in its sequence
  std::span<const int32_t> row_sequence;  // [T] index into block_tables
  std::span<const int64_t> slots;         // [T] cache slot of each row: block * 64 + position % 64
  std::span<const std::vector<int32_t>> block_tables;  // per sequence: block ids (64 tokens each)
  // (No block tables at all: a model that keeps its own cache (DeepSeek-V4, through the V4 ops): row_sequence and
  // slots are then not read and may be empty, and the MLA ops and store_kv must not be called.)
  std::span<const int32_t> logits_rows;   // rows whose logits are wanted, ascending
  // Per sequence, when every sequence's rows start at position 0 (a prefill with nothing cached): lets a backend
  // attend within the step's rows only (the expanded form). Empty otherwise.
  bool rows_start_at_zero = false;
  // Blocks per block-table row on the device (each table padded with block 0 up to it): 0 means the longest
  // table's length; else at least that (else InvalidArgument). A caller that runs steps through run_graph passes
  // the GraphKey's max_blocks_per_sequence, so that steps of one key share their device layout and every kernel
  // parameter derived from it (the CUDA backend's attention split count among them). The CPU backend ignores it.
  int64_t block_table_stride = 0;
};

// What a run_graph recording depends on besides the ops themselves: the step's shapes, which the recorded kernels
// bake in. Equal keys promise the same sequence of ops over the same shapes and the same caller-owned buffers.
struct GraphKey {
  int64_t rows = 0;                     // the step's rows (T)
  int64_t sequences = 0;                // block tables
  int64_t max_blocks_per_sequence = 0;  // StepLayout::block_table_stride of the step (not 0)
  int64_t logits_rows = 0;              // StepLayout::logits_rows.size()
  int64_t variant = 0;                  // the caller's: tells apart op sequences over the same shapes
  uint64_t owner = 0;                   // the caller's: callers sharing one backend use distinct owners
  bool operator==(const GraphKey&) const = default;
};

// The shapes of a model that decide whether a backend's kernels can run it.
struct ModelShapes {
  int64_t num_heads = 0, kv_lora_rank = 0, rope_dim = 0, nope_dim = 0, v_dim = 0, hidden = 0;
  int64_t num_experts = 0, top_k = 0, n_group = 1;  // num_experts 0: no MoE layer
};

// One MoE layer's routed experts: router [E, hidden] (kF32 always, as the reference computes router logits in
// float32), optional e_score_correction_bias [E], experts stacked as gate_up [E][2I][hidden] (gate rows then up
// rows) and down [E][hidden][I].
// Expert parallel (a rank holding some experts, applying routing its tokens' owner computed): gate_up / down hold
// experts [first_expert, first_expert + gate_up->count) of the rule's E, and `routed_ids` / `routed_weights` (host,
// [T * top_k] each, route_token's order per row) replace the router: row t gets the sum over its ids in the held
// range only. Both backends take it; the CUDA backend then builds the permutation on the host (a host
// synchronization: not inside a graph) and computes only the pairs whose expert it holds with a weight other than 0.
// DeepSeek-V4's variants (model/deepseek_v4.h): `hash_ids` ([vocab][top_k] int32, alloc + upload) routes a row by its
// token id (begin_step's token_ids: the first num_hash_layers layers) instead of by top-k of the choice, the weights
// being computed from the scores as for top-k; `swiglu_limit` > 0 clamps the expert activation: up to [-limit, limit],
// gate to at most limit, before silu(gate) * up. Backends without has_v4_ops() take neither.
struct MoeWeights {
  MoeRoutingRule rule;
  const Weight* router = nullptr;
  const Buffer* bias = nullptr;  // make_vector of E values, or null
  const Weight* gate_up = nullptr;
  const Weight* down = nullptr;
  int64_t first_expert = 0;
  std::span<const int32_t> routed_ids = {};
  std::span<const float> routed_weights = {};
  const Buffer* hash_ids = nullptr;
  float swiglu_limit = 0.0f;
};

// ---- DeepSeek-V4 (model/deepseek_v4.h; DeepSeek's V4-Flash-0731 inference/model.py, spec §2-§3) ----
// The V4-specific steps of the forward pass, batch-first like the ops above. Host descriptors (spans of the structs
// below) are read during the call only; the pointers in them point into this backend's memory (Buffer::data() plus
// an offset), never at host memory on a device backend. Small per-row outputs (post, comb) are float32 Tensors on
// every backend; activations are in activation_dtype(). Rotary tables are float64 buffers (alloc + upload of R / 2
// doubles: the reference computes the angles in double); rotation is of interleaved pairs (x[2i], x[2i+1]) in place.

// The hyper-connection mix (mHC): before a sublayer, from the residual streams X [T, hc * d]:
//   mixes = X · fnᵀ (float32), rs = 1 / sqrt(mean(X_t²) + norm_eps) over all hc * d values,
//   pre_j = sigmoid(mixes_j · rs · scale0 + base_j) + hc_eps,  post_j = 2 · sigmoid(mixes_{hc+j} · rs · scale1 + base_{hc+j}),
//   comb = Sinkhorn(row softmax of (mixes_{2hc+..} · rs · scale2 + base) + hc_eps; sinkhorn_iters column/row passes),
//   y = Σ_j pre_j · X_j.
// head: the final mix (fn [hc][hc * d], scale [1]): pre only (post and comb not written).
struct V4HyperMix {
  const Weight* fn = nullptr;     // kF32, [(2 + hc) * hc][hc * d] (head: [hc][hc * d])
  const Buffer* base = nullptr;   // float32 [(2 + hc) * hc] (head: [hc])
  const Buffer* scale = nullptr;  // float32 [3] (head: [1])
  int64_t hc = 4, sinkhorn_iters = 20;
  double norm_eps = 1e-6, hc_eps = 1e-6;
  bool head = false;
};

// Per-row RMS norm (optional weight) and/or rotation of the last rope_dim values, in place on the rows of x; row r
// is at the step's positions[r / vectors_per_position]; inverse rotates by -position.
struct V4NormRope {
  bool norm = false;
  const Buffer* weight = nullptr;  // float32 [x.cols], or null: no weight
  double eps = 1e-6;
  const Buffer* inv_freq = nullptr;  // float64 [rope_dim / 2], or null: no rotation
  int64_t rope_dim = 0;
  bool inverse = false;
  int64_t vectors_per_position = 1;
};

// A compressor (model.py Compressor): ratio m, entry dim, coff = 2 when overlapped (m == 4), width = coff * dim.
struct V4Compressor {
  int64_t ratio = 0, dim = 0, coff = 1;
  const Buffer* ape = nullptr;   // float32 [m][width], added to the score rows by position % m
  const Buffer* norm = nullptr;  // float32 [dim]
  double eps = 1e-6;
  const Buffer* inv_freq = nullptr;  // float64 [rope_dim / 2]
  int64_t rope_dim = 0;
};
// Where the raw rows at a 64-token block boundary go (a window payload's compressor rows): the rows of positions
// [boundary - n, boundary), n = kept rows (overlapped: the last finished block's m rows; plain: boundary % m), kv to
// kv_rows and score (ape added) to score_rows, [n][width] each.
struct V4RowSnapshot {
  int64_t boundary = 0;
  void* kv_rows = nullptr;
  void* score_rows = nullptr;
};
// One sequence's chunk in a compress call: rows [row_first, row_first + count) of kv / score are its positions
// [start, start + count). Rows of earlier positions are in the rings ([2m][width], position p at slot p % 2m, score
// with ape added; only the last 2m positions before `start` are read).
struct V4CompressWork {
  int64_t row_first = 0, start = 0, count = 0;
  void* ring_kv = nullptr;
  void* ring_score = nullptr;
  void* entries = nullptr;                  // [..][dim]: entry j at row j
  int64_t first_entry = 0, end_entry = 0;   // the entries to make: each one's rows end at or before start + count
  std::span<const V4RowSnapshot> snapshots = {};
};

// Lightning indexer of one row: its sequence's indexer keys [visible][index_dim].
struct V4IndexRow {
  const void* keys = nullptr;
  int64_t visible = 0;
};

// Sparse attention with sinks of one row (model.py sparse_attn over the row's window and compressed entries).
// Window keys: positions [window_first, position]; a position >= step_start is the step's kv row row_first +
// (s - step_start), an earlier one the ring's row s % window. Then compressed entries: the first entry_count of
// `entries`, or with `indexed` the row's ids (V4Attention::ids row, entry_count of them).
struct V4AttentionRow {
  int64_t position = 0, window_first = 0, step_start = 0, row_first = 0;
  const void* ring = nullptr;  // [window][head_dim]
  const void* entries = nullptr;
  int64_t entry_count = 0;
  bool indexed = false;
};
// Per row and head h: scores s_k = scale · q_h · k over the row's keys (K = V = the key rows), out_h = Σ_k
// softmax_k · k with sink[h] in the softmax's denominator (exp(sink - max)), as the reference.
struct V4Attention {
  int64_t heads = 0, head_dim = 0, window = 0;
  double scale = 1.0;
  const Buffer* sinks = nullptr;  // float32 [heads]
  const Buffer* ids = nullptr;    // int32 [T][topk] (v4_indexer_topk's), for indexed rows
  int64_t topk = 0;
};

// A copy of `bytes` bytes within this backend's memory.
struct CopySpan {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};

// MLA attention in the absorbed form over a paged latent cache (DeepSeek-V2 paper §2.1.2-2.1.3; FlashMLA's
// layout): q holds, per row t and head h, [q_latent (C) | roped q_rope (R)] at q[t, h*(C+R) ...]; the cache
// layer holds [num_blocks, 64, C + R] entries (latent | roped key) in the backend's cache dtype. For each row t
// (at position p of its sequence) and head h:
//   score(t, j) = scale * (q_latent · latent[j, :C] + q_rope · latent[j, C:]) over j <= p,
//   out[t, h*C ...] = sum_j softmax_j(score) * latent[j, :C].
struct MlaAttention {
  int64_t num_heads = 0, kv_lora_rank = 0, rope_dim = 0;
  float scale = 0.0f;  // softmax scale, mscale included
};

// The expanded form of MLA: q [T, H*(nope+R)] (q_nope | roped q_rope per head), kv [T, C+R] (the step's rows'
// normalized latent | roped key, already stored in the cache), kv_b the checkpoint's kv_b_proj [H*(nope+V), C];
// out [T, H*V] = causal softmax(q·kᵀ·scale)·v per head with k = [kv_b_k(latent) | rope key], v = kv_b_v(latent),
// over every position up to the row's. On a step whose rows all start at position 0 the keys are the step's own
// rows (kv); on others (a chunk over a cached prefix) the backend up-projects the latents of the cache layer, in
// chunks of key positions merged by log-sum-exp (vLLM's "MLA chunked context", FlashMLA's prefill).
struct MlaExpanded {
  int64_t num_heads = 0, kv_lora_rank = 0, rope_dim = 0, nope_dim = 0, v_dim = 0;
  float scale = 0.0f;
  const Weight* kv_b = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual DType activation_dtype() const = 0;
  virtual DType cache_dtype() const = 0;

  // Memory. alloc returns zero-filled memory; errors: ResourceExhausted. upload/download copy between host
  // and backend memory and return when the copy is done (after the ops queued before them); a failed copy, or
  // an earlier op's device fault, is returned (Internal) and the destination is then unspecified.
  virtual Result<Buffer> alloc(size_t bytes) = 0;
  virtual Status upload(const void* host, size_t bytes, const Buffer& dst, size_t dst_offset) = 0;
  virtual Status download(const Buffer& src, size_t src_offset, size_t bytes, void* host) = 0;
  // Many copies at once (a KV block is one region of every layer's cache; a transfer moves many blocks): the same
  // contract as download / upload for each region, one wait for all of them. The default runs them one by one; a
  // device backend batches them through pinned host staging (CUDA: no pageable copy, one synchronization per
  // staging round instead of one per region). Regions must not overlap one another. Errors: as download / upload;
  // on an error the destinations are unspecified.
  struct DownloadRegion {
    const Buffer* src = nullptr;
    size_t src_offset = 0;
    size_t bytes = 0;
    void* host = nullptr;  // bytes of host memory, written
  };
  struct UploadRegion {
    const void* host = nullptr;  // bytes of host memory, read
    size_t bytes = 0;
    const Buffer* dst = nullptr;
    size_t dst_offset = 0;
  };
  virtual Status download_batch(std::span<const DownloadRegion> regions) {
    for (const DownloadRegion& r : regions) {
      if (Status s = download(*r.src, r.src_offset, r.bytes, r.host); !s.ok()) return s;
    }
    return Status();
  }
  virtual Status upload_batch(std::span<const UploadRegion> regions) {
    for (const UploadRegion& r : regions) {
      if (Status s = upload(r.host, r.bytes, *r.dst, r.dst_offset); !s.ok()) return s;
    }
    return Status();
  }
  // Whether this backend runs a model of these shapes (called when a model loads, before any weight is read).
  // Errors: Unsupported naming the limit.
  virtual Status check_model_shapes(const ModelShapes& shapes) const = 0;
  // Waits for every queued op; reports a device fault (Internal) if one happened.
  virtual Status synchronize() = 0;
  // The device's memory in bytes, as its driver counts it (all processes): total and free now. Unsupported on
  // backends without a device of their own (the CPU's).
  struct DeviceMemory {
    int64_t total_bytes = 0, free_bytes = 0;
  };
  virtual Result<DeviceMemory> device_memory() {
    return Status::unsupported(std::string(name()) + " backend: no device memory of its own");
  }

  // Weights: make_weight allocates `count` stacked matrices (count > 1: per-head or per-expert weights; linear()
  // takes count 1), set_matrix fills matrix `index` from the host, fill_random fills all of them with values
  // uniform in [-scale, scale) from `seed` (benchmarks; FP8 draws the 8-bit values and sets the block scales so).
  // Errors: ResourceExhausted; InvalidArgument when the host data's shape or form does not match.
  virtual Result<std::unique_ptr<Weight>> make_weight(int64_t count, int64_t rows, int64_t cols,
                                                      Precision precision) = 0;
  virtual Status set_matrix(Weight& w, int64_t index, const HostMatrix& host) = 0;
  virtual void fill_random(Weight& w, uint64_t seed, float scale) = 0;
  // The float32 values of matrix `index` of `w` [rows * cols] (bf16 widened exactly): a weight moving to another rank
  // (expert load balancing). Errors: InvalidArgument (index, or an FP8 weight: read_matrix_fp8 reads those);
  // Unsupported on a backend that cannot read weights back.
  virtual Result<std::vector<float>> read_matrix(const Weight& w, int64_t index) {
    (void)w;
    (void)index;
    return Status::unsupported(std::string(name()) + " backend: reading a weight back (expert load balancing)");
  }
  // Matrix `index` of an FP8 block-scaled weight as set_matrix takes it (and a checkpoint stores it): the e4m3 bytes
  // [rows * cols] and the float32 block scales [ceil(rows / 128)][ceil(cols / 128)], bit for bit what was set: an FP8
  // expert moving to another rank (expert load balancing). Errors: InvalidArgument (index, or a weight that is not
  // FP8); Unsupported on a backend that keeps no FP8 weights (the CPU's: it stores them dequantized, kBF16).
  struct Fp8Matrix {
    std::vector<uint8_t> values;
    std::vector<float> scales;
  };
  virtual Result<Fp8Matrix> read_matrix_fp8(const Weight& w, int64_t index) {
    (void)w;
    (void)index;
    return Status::unsupported(std::string(name()) + " backend: no FP8 weights to read back");
  }
  // A float32 vector (norm weights, biases) in whatever form the backend's ops read.
  virtual Result<Buffer> make_vector(std::span<const float> values) = 0;

  // Step. Errors: ResourceExhausted.
  virtual Status begin_step(const StepLayout& layout) = 0;

  // Runs `ops`, which issue this step's device work through this backend's ops and nothing else: no upload,
  // download, synchronize, begin_step or read_* (no host-visible result until run_graph returns), and no decision
  // on the host from device data. A backend may record them: the CUDA backend runs them eagerly the first time it
  // sees `key` (scratch buffers grow, GEMM plans are made), records them into a CUDA graph the second time and
  // launches it, and afterwards launches the recording without calling `ops`. Every pointer and host-side value
  // the recording baked in must therefore be the same for every step of `key`: the step's arrays (re-uploaded by
  // each begin_step into the same device memory) are read on the device, and the caller must not free, move or
  // swap a buffer the ops use (activations, caches) while recordings of it exist: call reset_graphs() first.
  // Backend memory that moves (scratch growth) discards the recordings that used it. A backend may run any call
  // eagerly (the CPU backend always; the CUDA backend for steps that are not pure decode (one row per sequence,
  // not rows_start_at_zero), and for keys whose ops synchronized with the host during the eager run).
  // REQUIRES: begin_step succeeded for a step of `key`'s shapes. Errors: those of the ops (reported here, as
  // synchronize() would), Internal when recording fails; the step's results are then undefined.
  // Not reentrant: ops must not call run_graph.
  virtual Status run_graph(const GraphKey& key, const std::function<void()>& ops) = 0;
  // Discards every recording (the next run_graph of each key runs eagerly again). Call before freeing or
  // replacing a buffer that recorded ops used. No-op on backends that do not record.
  virtual void reset_graphs() {}
  // How many times a recording was launched in place of calling ops (0 on backends that do not record): tests
  // use it to check that graphs ran.
  virtual int64_t graph_replays() const { return 0; }
  // How many times run_graph ran ops to make a recording: a new key's eager first run, then its capture (0 on
  // backends that do not record). Such a step takes several times its steady time; timing rules that learn from
  // step times (DSpark's drafting guard, dspark.h) leave those steps out.
  virtual int64_t graph_recordings() const { return 0; }

  // out[t] = table[token_ids[t] - first_id] for the step's rows. table: count 1, [vocab, hidden], or a
  // vocabulary-parallel shard holding ids [first_id, first_id + rows): rows of ids outside it are 0 (the tensor-
  // parallel ranks' shards then sum to the embedding). The caller checks ids against the vocabulary.
  virtual void embed(const Weight& table, Tensor out, int64_t first_id) = 0;
  // out[t] = src[token_ids[t]] for the step's rows: the step's token ids index src's rows (DSpark's injection
  // gathers the kept target rows so, inside a recorded graph). src and out: the activation dtype, same cols; the
  // caller checks every id < src.rows.
  virtual void gather_step_rows(const Tensor& src, Tensor out) = 0;
  // y = x · wᵀ (y [rows, w.rows]; x [rows, w.cols]). y may be float32 where x is the activation dtype (router logits:
  // expert parallel routes on the host from them; CUDA computes them as its moe op does).
  virtual void linear(const Tensor& x, const Weight& w, Tensor y) = 0;
  // Per stacked matrix h < w.count: y[:, h*y_head_stride ...+w.rows] = x[:, h*x_head_stride ...+w.cols] · w_hᵀ.
  virtual void linear_heads(const Tensor& x, int64_t x_head_stride, const Weight& w, Tensor y,
                            int64_t y_head_stride) = 0;
  // y[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight; y may alias x.
  virtual void rms_norm(const Tensor& x, const Buffer& weight, float eps, Tensor y) = 0;
  // residual += delta, then y = rms_norm(residual).
  virtual void add_rms_norm(Tensor residual, const Tensor& delta, const Buffer& weight, float eps, Tensor y) = 0;
  // x += delta.
  virtual void add(Tensor x, const Tensor& delta) = 0;
  // x = 0.
  virtual void fill_zero(Tensor x) = 0;
  // dst = src (same shape; strides may differ).
  virtual void copy(const Tensor& src, Tensor dst) = 0;
  // out[r, :n] = silu(gate_up[r, :n]) * gate_up[r, n:2n], n = out.cols.
  virtual void silu_mul(const Tensor& gate_up, Tensor out) = 0;
  // Rotary embedding in place on x's rows (each `cols` = rope dim values); row r is at position
  // positions[r / vectors_per_position] of the step. Pairs (x[2i], x[2i+1]) rotate by pos * inv_freq[i], written
  // de-interleaved (first halves, then second halves), as DeepSeek's checkpoints expect (transformers'
  // apply_rotary_pos_emb_interleave); cos/sin times `attention_factor`. inv_freq: make_vector of cols/2 values.
  virtual void rope(Tensor x, int64_t vectors_per_position, const Buffer& inv_freq, float attention_factor) = 0;
  // cache[slots[t]] = kv[t] for the step's rows (kv [T, C+R]; cache in cache_dtype()).
  virtual void store_kv(const Tensor& kv, const Buffer& cache_layer) = 0;
  // MLA's per-token preparation before attention, in this order's result: kv [T, C + R] (the step's rows): the latent
  // kv[:, :C] = rms_norm(kv[:, :C]) * norm_weight (in place), the key kv[:, C:] roped (one vector per position),
  // store_kv(kv, cache_layer); q_rope [T * heads, R] roped in place (`heads` vectors per position) and, when
  // q_rope_copy has rows, copied there ([T * heads, R], e.g. the absorbed query's rope part). The base version runs
  // rms_norm, rope, store_kv, rope and copy; the CUDA backend runs them as one kernel with the same arithmetic
  // (bit-identical bf16 results, tests/gpu/gpu_check_backend.cpp).
  virtual void mla_prepare(Tensor kv, int64_t latent, const Buffer& norm_weight, float eps, Tensor q_rope,
                           int64_t heads, const Buffer& inv_freq, float attention_factor, const Buffer& cache_layer,
                           Tensor q_rope_copy);
  virtual void mla_attention(const MlaAttention& a, const Tensor& q, const Buffer& cache_layer, Tensor out) = 0;
  // Whether mla_expanded() may be called for steps with rows_start_at_zero (a faster prefill).
  virtual bool has_mla_expanded(const MlaExpanded& a) const = 0;
  // Whether mla_expanded() may be called on the current step (begin_step) although its rows do not all start at 0,
  // and costs less than mla_attention() by the backend's cost model (FLOPs and bytes of each form at the device's
  // measured rates: the expanded form up-projects every visible key once, the absorbed one pays (2C + R) / (nope +
  // R + V) more per (row, key) pair). False on backends without has_mla_expanded() and on steps whose rows of a
  // sequence are not consecutive positions.
  virtual bool mla_expanded_pays(const MlaExpanded&) const { return false; }
  virtual void mla_expanded(const MlaExpanded& a, const Tensor& q, const Tensor& kv, const Buffer& cache_layer,
                            Tensor out) = 0;
  // out += sum over the token's top-k experts of weight_e * down_e(silu(gate_e x) * up_e x). `out` is read only by
  // the last step (the combine), after join_side_lane(): a side lane's ops (the shared experts) may write it.
  virtual void moe(const Tensor& x, const MoeWeights& w, Tensor out) = 0;
  // moe(x, w, out), then add_rms_norm(residual, out, norm_weight, eps, y): the next layer's residual add and input
  // norm after a MoE layer, which a backend may fuse into the MoE's combine (CUDA: one launch fewer per layer, the
  // same bits). `y` may be `x` (read by the MoE before y is written). The default runs the two ops.
  virtual void moe_add_rms_norm(const Tensor& x, const MoeWeights& w, Tensor out, Tensor residual,
                                const Buffer& norm_weight, float eps, Tensor y) {
    moe(x, w, out);
    add_rms_norm(residual, out, norm_weight, eps, y);
  }
  // A second lane of work, for ops that may run beside the ones after them (SGLang's alt_stream for DeepSeek's
  // shared experts). begin_side_lane(): the ops issued from now on go to the side lane, after everything issued so
  // far; end_side_lane(): ops go to the main lane again, not waiting for the side lane's; join_side_lane(): the main
  // lane's later ops run after the side lane's (moe() joins before it reads `out`, synchronize() and begin_step()
  // before anything else; a no-op with nothing pending).
  // The two lanes' ops must not write what the other reads or writes; each op's arithmetic is the same on either
  // lane. Calls pair in that order, one lane at a time (begin inside an open lane: InvalidArgument, recorded). The
  // base backend has none (has_side_lane false: the calls are no-ops and ops run in order). On CUDA: a second stream
  // with its own cuBLAS handles, workspaces and GEMM scratch, forked and joined by events (CUDA graphs capture them
  // as edges); off with DEEPINFER_SIDE_LANE=0. Not thread-safe (the backend's rule).
  virtual bool has_side_lane() const { return false; }
  virtual void begin_side_lane() {}
  virtual void end_side_lane() {}
  virtual void join_side_lane() {}
  // ---- DeepSeek-V4 ops (the structs above). has_v4_ops(): whether this backend has them (the model refuses to
  // load otherwise); the base versions abort.
  virtual bool has_v4_ops() const { return false; }
  // X [T, hc * d] (activation dtype); y [T, d]; post [T, hc], comb [T, hc * hc] float32 (not written with head).
  virtual void v4_hc_pre(const Tensor& X, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb);
  // In place: X_j = post_j · out + Σ_i comb[i][j] · X_i per row (out [T, d]).
  virtual void v4_hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb);
  virtual void v4_norm_rope(Tensor x, const V4NormRope& p);
  // kv, score [T, width]: the compressor's linear outputs for the step's rows (score without ape). For each work
  // item: makes entries [first_entry, end_entry) (entry j: per channel a softmax over its block's rows of score
  // (overlapped: block j - 1's first `dim` channels with block j's last `dim`), the weighted sum of kv; then RMS norm
  // with `norm` and rotation at position j · m), writes the snapshots, then the chunk's last min(count, 2m) rows into
  // the rings.
  virtual void v4_compress(const Tensor& kv, const Tensor& score, const V4Compressor& c,
                           std::span<const V4CompressWork> work);
  // q [T, heads * index_dim] (roped), weights [T, heads]; per row with visible > topk: score_s = Σ_h relu(q_h · k_s) ·
  // weights_h · weight_scale over its keys; ids[t][0..topk) = the topk best s, descending, equal scores by lower s
  // (int32 Buffer [T][topk]; the CPU backend writes them in that order, the CUDA backend in any). Rows with visible
  // <= topk are not written.
  virtual void v4_indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale,
                               std::span<const V4IndexRow> rows, int64_t topk, const Buffer& ids);
  // q [T, heads * head_dim] (normed, roped), kv [T, head_dim] (the step's key rows); out [T, heads * head_dim].
  virtual void v4_attention(const V4Attention& a, const Tensor& q, const Tensor& kv,
                            std::span<const V4AttentionRow> rows, Tensor out);
  // Every span's copy. Spans must not overlap one another (a device backend copies them at once).
  virtual void copy_spans(std::span<const CopySpan> spans);
  // out[r, :n] = silu(min(gate, limit)) * clamp(up, -limit, limit) (limit > 0; else silu_mul), n = out.cols.
  virtual void silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out);

  // The step's head, in two halves so that the device half may run inside run_graph. compute_logits: rows
  // logits_rows of x, final norm, then logits = x · lm_headᵀ in float32 [logits_rows.size(), lm_head.rows], and
  // with `greedy` also per row the argmax (the lowest id among equal maxima, the engine sampler's rule; -1 for a
  // row holding a NaN or +inf, or nothing above -inf); both kept in the backend for one read. read_logits / read_greedy_tokens move
  // them to host memory, wait for the step, and report its errors.
  // REQUIRES (read_*): compute_logits ran for this step (with `greedy` for read_greedy_tokens) and its results were
  // not read yet.
  virtual void compute_logits(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head, bool greedy) = 0;
  virtual Status read_logits(std::vector<float>& host_logits) = 0;
  virtual Status read_greedy_tokens(std::vector<int32_t>& host_ids) = 0;
  // After read_greedy_tokens, the same step: per row the softmax probability of its argmax id (1 / sum(exp(l -
  // max)), float32; 0 for a row whose id is -1): a greedy draft's confidence (speculative decoding) without moving
  // the logits. REQUIRES: compute_logits(greedy) ran for this step.
  virtual Status read_top_probabilities(std::vector<float>& host_probabilities) = 0;

  // Sampling where the logits are (after compute_logits without `greedy`, outside run_graph's ops): per logits row
  // one token drawn with the engine sampler's semantics (engine/sampler.h steps 1-8:
  // `adjustments` carry logit_bias and the penalties per (row, token), applied in the host's order and float
  // arithmetic; greedy below temperature 1e-5, top-k, top-p, min-p, the Philox draw at (seed, counter)); host ids
  // [rows], -1 for a row holding a NaN or +inf or nothing above -inf. Waits for the step.
  // has_device_sampling() says whether the backend has it (the CUDA backend, unless DEEPINFER_DEVICE_SAMPLING=0);
  // others return Unsupported. REQUIRES: rows.size() == logits_rows.size() of the step.
  struct DeviceSampling {
    float temperature = 1.0f;
    int32_t top_k = 0;  // <= 0: all
    float top_p = 1.0f, min_p = 0.0f;
    uint64_t seed = 0, counter = 0;
    int32_t logprobs = -1;  // -1: none; 0..20: the drawn token's logprob and this many alternatives
                            // (read_sampled_logprobs)
  };
  // One (row, token)'s logit_bias and penalties (distinct pairs): l += bias (has_bias; clamped already); with
  // repetition != 1, l = l > 0 ? l / repetition : l * repetition; when in_output, l -= frequency (the host's
  // frequency_penalty * count, in float) and l -= presence.
  struct LogitAdjustment {
    int32_t row = 0, token = 0;
    float bias = 0.0f, repetition = 1.0f, frequency = 0.0f, presence = 0.0f;
    bool has_bias = false, in_output = false;
  };
  // After read_sampled_tokens, the same step: per row whose DeviceSampling::logprobs >= 0 the engine Sampler's
  // fill_logprobs on the RAW logits (before logit_bias and penalties): the drawn token's log-softmax (float(l -
  // (max + log(sum exp(l - max)))), the sum and log in double; NaN when the row's id is -1) and the `logprobs` largest
  // logits (ties to the lower id) with theirs; rows without: logprob NaN, top empty; no entries at all when no row
  // asked. Host work only (the values came with the ids). REQUIRES: read_sampled_tokens ran for this step.
  struct SampledLogprobs {
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;  // (id, logprob), largest first
  };
  virtual Status read_sampled_logprobs(std::vector<SampledLogprobs>& out) {
    (void)out;
    return Status::unsupported(std::string(name()) + " backend: no sampling on the device");
  }
  virtual bool has_device_sampling() const { return false; }
  virtual Status read_sampled_tokens(std::span<const DeviceSampling> rows, std::span<const LogitAdjustment> adjustments,
                                     std::vector<int32_t>& host_ids) {
    (void)rows;
    (void)adjustments;
    (void)host_ids;
    return Status::unsupported(std::string(name()) + " backend: no sampling on the device");
  }

  // DSpark's greedy heads where the logits are: after compute_logits (not greedy) of a DSpark block pass whose
  // logits rows are chain * gamma + k, per chain DeepSeekModel::DsparkHeads::greedy_chain (the Markov head's pruned
  // argmax and the confidence head; kernels/cuda/dspark_heads.h states the arithmetic, the host's to the bit but for
  // the confidences' double sums' order) from previous[c] over its first lengths[c] rows, so that neither the
  // [chains * gamma, draft_vocab] logits nor the heads' work reach the host. `heads`: device copies of the heads'
  // weights (DeepSeekModel uploads them when has_device_dspark_heads()); h: the block's h rows [chains * gamma,
  // hidden] in the activation dtype. Host out [chains * gamma]: drafts (-1 for a row whose values hold a NaN or
  // infinity, and every later row of its chain; 0 past lengths[c]) and confidences in [0, 1]. Waits for the step.
  // Others than CUDA return Unsupported. REQUIRES: compute_logits ran for this step with chains * gamma rows of
  // heads.draft_vocab columns; previous and lengths of one size (chains, at most kMaxDeviceDsparkChains);
  // 0 <= lengths[c] <= gamma; heads.rank <= max_device_dspark_rank().
  struct DsparkHeadsOnDevice {
    Buffer w1;          // f32 [vocab, rank]: markov_w1
    Buffer w2_rows;     // f32 [draft_vocab, rank]: markov_w2's active rows
    Buffer w2_norm;     // f32 [draft_vocab]: their norms rounded up; empty: no pruning (every entry gets its term)
    Buffer confidence;  // f32 [hidden + rank]
    Buffer active;      // int32 [draft_vocab]: the draft vocabulary's ids, ascending; empty: ids 0..vocab-1
    float w2_norm_max = 0.0f;
    int64_t vocab = 0, draft_vocab = 0, rank = 0, hidden = 0;
    int32_t outside = 0;  // the lowest id outside `active` (>= vocab: none)
  };
  // The largest Markov rank read_dspark_greedy_chains takes (0: it is Unsupported), and the most chains per call.
  virtual int64_t max_device_dspark_rank() const { return 0; }
  static constexpr int64_t kMaxDeviceDsparkChains = 65535;
  virtual Status read_dspark_greedy_chains(const DsparkHeadsOnDevice& heads, const Tensor& h, int32_t gamma,
                                           std::span<const int32_t> previous, std::span<const int32_t> lengths,
                                           std::vector<int32_t>& drafts, std::vector<double>& confidences) {
    (void)heads, (void)h, (void)gamma, (void)previous, (void)lengths, (void)drafts, (void)confidences;
    return Status::unsupported(std::string(name()) + " backend: no DSpark heads on the device");
  }

  // compute_logits then read_logits: host logits [logits_rows.size(), lm_head.rows]. Waits for the step.
  Status logits(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head,
                std::vector<float>& host_logits) {
    compute_logits(x, norm, eps, lm_head, false);
    return read_logits(host_logits);
  }
  // Greedy decoding without the logits on the host: compute_logits with the argmax, then read_greedy_tokens (host
  // ids [logits_rows.size()]). Waits for the step.
  Status greedy_tokens(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head,
                       std::vector<int32_t>& host_ids) {
    compute_logits(x, norm, eps, lm_head, true);
    return read_greedy_tokens(host_ids);
  }
};

// The softmax probability of `id` in a row of logits, 1 / sum(exp(row[i] - row[id])) summed in double: what
// read_top_probabilities returns for a row, computed on the host (the CPU backend; the gathered logits of a
// tensor-parallel model).
float softmax_probability_of(std::span<const float> row, int32_t id);

// The CPU backend: OpenBLAS GEMMs, OpenMP loops, AVX-512 bf16 widening where the CPU has it (detected at
// run time).
std::unique_ptr<Backend> make_cpu_backend();
// The SIMD features the CPU backend found, e.g. "baseline,avx2,avx512f,avx512bw,avx512bf16".
std::string cpu_features();
// The CUDA backend on device `device` (built with DEEPINFER_CUDA; else, or with no usable GPU, Unsupported).
Result<std::unique_ptr<Backend>> make_cuda_backend(int device);
// How many CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 without the CUDA backend or a usable GPU.
int cuda_device_count();

}  // namespace deepinfer::backend
