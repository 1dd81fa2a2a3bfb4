// The CUDA backend's class, shared by the files of src/backend/cuda, one job each: cuda_backend.cpp (device,
// memory, errors), cuda_weights.cpp (weights and vectors), cuda_step.cpp (step layout, embedding, KV store),
// cuda_gemm.cpp (linear layers, logits), cuda_rowwise.cpp (norms, rope, SiLU, add/copy), cuda_attention.cpp (MLA),
// cuda_moe.cpp (routed experts), cuda_graph.cpp (run_graph: CUDA graphs of decode steps), cuda_v4.cpp (DeepSeek-V4). Internal: model code sees
// only include/deepinfer/backend/backend.h.
//
// Execution model: one CUDA stream per backend; every op enqueues kernels on it and returns. A failed launch or
// allocation inside a void op is recorded (the first one: `sticky_`), the rest of the step's ops are skipped, and
// the next synchronize() / run_graph() / read_logits() / begin_step() returns it. Temporaries live in growable
// per-purpose Scratch buffers (never freed while queued work may still read them).
//
// Graphs (run_graph, cuda_graph.cpp): a pure decode step's ops are run eagerly for a new GraphKey, captured into a
// CUDA graph the second time, and replayed by one cudaGraphLaunch afterwards. A graph bakes in every pointer and
// kernel parameter of its capture, so: the step's device arrays stay at one address per key (begin_step uploads
// into a grow-only buffer); kernel parameters derive from the key's shapes only, never from the step's values
// (the attention split count comes from the block-table stride, not from the contexts); any Scratch growth bumps
// buffers_generation_, which discards the graphs captured before it; cuBLAS gets a fixed workspace.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "deepinfer/backend/backend.h"
#include "deepinfer/kernels/cuda/dspark_heads.h"
#include "deepinfer/kernels/cuda/gemm.h"

namespace deepinfer::backend::cuda {

// A weight in device memory. kBF16 / kF32: values [count * rows][cols]. kFP8: e4m3 values
// [count * rows][stride] with stride = round_up(cols, 128) (zero columns past `cols`, so activations quantize in
// whole 1x128 groups even for the tiny models' 160-wide layers) and f32 block scales
// [count][scale_rows = ceil(rows/128)][scale_ld = fp8_weight_scale_ld(stride)] (run_fp8_gemm's padded layout).
class CudaWeight final : public Weight {
 public:
  Buffer values;
  Buffer scales;  // kFP8 only
  int64_t stride = 0;
  int64_t scale_rows = 0, scale_ld = 0;
};

// Matrix `index` of a weight stack: the pointers the GEMMs take.
struct MatrixRef {
  Precision precision = Precision::kBF16;
  int64_t rows = 0, cols = 0, stride = 0;  // stride: elements per stored row
  const void* values = nullptr;
  const float* scales = nullptr;  // kFP8: [ceil(rows/128)][scale_ld]
  int64_t scale_ld = 0;
};
MatrixRef matrix_of(const Weight& weight, int64_t index);

// make_vector's layout: n float32 values at offset 0, then the same n values as bf16 at vector_bf16_offset(n)
// (rope's inv_freq and the router bias read the f32 copy; RMSNorm's bf16 kernel reads the bf16 one).
inline size_t vector_bf16_offset(int64_t n) { return (static_cast<size_t>(n) * 4 + 255) / 256 * 256; }
inline size_t vector_bytes(int64_t n) { return vector_bf16_offset(n) + static_cast<size_t>(n) * 2; }
// The two copies of a make_vector buffer of n values (checked: the buffer holds at least n (f32) / exactly n (bf16);
// `what` names the op in the failure message).
const float* vector_f32(const Buffer& vector, int64_t n, const char* what);
const uint16_t* vector_bf16(const Buffer& vector, int64_t n, const char* what);

// A growable device buffer for one purpose's temporaries.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch();
  // At least `bytes` of device memory, valid until the next reserve. Growing waits for `stream` first (queued
  // kernels may still read the old memory). Returns the CUDA error, leaving the scratch empty, on failure.
  cudaError_t reserve(size_t bytes, cudaStream_t stream);
  char* data() const { return static_cast<char*>(ptr_); }
  void swap(Scratch& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
  }
  size_t capacity() const { return bytes_; }
  // Whether reserve(bytes) would keep the current memory (no allocation, no synchronization).
  bool fits(size_t bytes) const { return ptr_ != nullptr && bytes <= bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Offsets of several temporaries carved from one Scratch, each 256-byte aligned (cuBLASLt, cp.async and the
// vectorized kernels want 16).
struct ScratchLayout {
  size_t bytes = 0;
  size_t add(size_t n) {
    const size_t offset = bytes;
    bytes += (n + 255) / 256 * 256;
    return offset;
  }
};

// The current step, as begin_step uploaded it: host copies (for dispatch decisions and checks) and device
// pointers into one step buffer.
struct StepState {
  int64_t rows = 0;
  std::vector<int32_t> token_ids, positions, logits_rows;
  // Block table rows on the device: in row order (table row t = row t's sequence) when every sequence has exactly
  // one row (a decode step: the layout run_mla_decode wants), else one per sequence. row_table[t] names row t's.
  bool one_row_per_sequence = false;
  // max_blocks: the block table's row stride (StepLayout::block_table_stride, else the longest table). Kernel
  // parameters derive from it and never from the rows' contexts, so that a graph captured on one step of a
  // GraphKey is right for every other step of it.
  int64_t sequences = 0, table_rows = 0, max_blocks = 1;
  // The expanded form: rows grouped by sequence, each group (cu_seqlens over groups, in row order) at consecutive
  // positions: 0, 1, ... when rows_start_at_zero, else from q_positions[g] (a chunk over a cached prefix, decode
  // rows). `grouped` is false when some sequence's rows are not one run of consecutive positions (no expanded form).
  bool rows_start_at_zero = false;
  bool grouped = false;
  int32_t num_groups = 0, max_group_rows = 0;
  std::vector<int32_t> group_rows, group_contexts;  // host: rows and context (last position + 1) of each group

  const int32_t* token_ids_device = nullptr;    // [rows]
  const int32_t* positions_device = nullptr;    // [rows]
  const int32_t* row_table_device = nullptr;    // [rows]
  const int32_t* row_context_device = nullptr;  // [rows] position + 1
  const int64_t* slots_device = nullptr;        // [rows]
  const int32_t* logits_rows_device = nullptr;  // [logits_rows.size()]
  const int32_t* block_table_device = nullptr;  // [table_rows, max_blocks], padded with 0
  const int32_t* cu_seqlens_device = nullptr;   // [num_groups + 1] when grouped
  const int32_t* q_positions_device = nullptr;  // [num_groups] first row's position of each group
  const int32_t* group_contexts_device = nullptr;  // [num_groups] context of each group (last position + 1)
  const int32_t* group_tables_device = nullptr;    // [num_groups] block-table row of each group
};

// Where compute_logits left the step's head results (device memory in the logits_ scratch), for read_*.
struct HeadResult {
  const float* logits = nullptr;  // [rows, vocab] float32, or null when there are no rows or an op failed
  const int32_t* ids = nullptr;   // [rows] argmax ids when compute_logits ran with greedy, else null
  const float* top_probability = nullptr;  // [rows] softmax probability of each id, beside them
  int64_t rows = 0, vocab = 0;
  bool computed = false;          // compute_logits ran for this step
  bool greedy = false;
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const {
    size_t h = 0;
    for (uint64_t v : {static_cast<uint64_t>(k.rows), static_cast<uint64_t>(k.sequences),
                       static_cast<uint64_t>(k.max_blocks_per_sequence), static_cast<uint64_t>(k.logits_rows),
                       static_cast<uint64_t>(k.variant), k.owner})
      h = h * 1000003u ^ std::hash<uint64_t>{}(v);
    return h;
  }
};

class CudaBackend final : public Backend {
 public:
  // Errors: Unsupported (no usable device, not Hopper), InvalidArgument (no such device), Internal.
  static Result<std::unique_ptr<Backend>> create(int device);
  ~CudaBackend() override;

  std::string_view name() const override { return "cuda"; }
  // The stream every op is queued on, and the device (the NCCL communicator queues its collectives there too).
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  DType activation_dtype() const override { return DType::kBF16; }
  DType cache_dtype() const override { return DType::kBF16; }

  Result<Buffer> alloc(size_t bytes) override;
  Status upload(const void* host, size_t bytes, const Buffer& dst, size_t dst_offset) override;
  Status download(const Buffer& src, size_t src_offset, size_t bytes, void* host) override;
  // Through two pinned staging halves (copy_staging_): the regions' copies into one half run on the stream while
  // the other half's bytes are copied to (or from) their pageable host memory.
  Status download_batch(std::span<const DownloadRegion> regions) override;
  Status upload_batch(std::span<const UploadRegion> regions) override;
  Status check_model_shapes(const ModelShapes& shapes) const override;
  Result<DeviceMemory> device_memory() override;
  Status synchronize() override;

  Result<std::unique_ptr<Weight>> make_weight(int64_t count, int64_t rows, int64_t cols, Precision precision) override;
  Status set_matrix(Weight& w, int64_t index, const HostMatrix& host) override;
  // Expert load balancing: read_matrix reads bf16 and float32 weights (an FP8 one: InvalidArgument, its block scales
  // would not survive the float32 round trip); read_matrix_fp8 reads FP8 ones as stored.
  Result<std::vector<float>> read_matrix(const Weight& w, int64_t index) override;
  Result<Fp8Matrix> read_matrix_fp8(const Weight& w, int64_t index) override;
  void fill_random(Weight& w, uint64_t seed, float scale) override;
  Result<Buffer> make_vector(std::span<const float> values) override;

  Status begin_step(const StepLayout& layout) override;
  Status run_graph(const GraphKey& key, const std::function<void()>& ops) override;
  void reset_graphs() override;
  int64_t graph_replays() const override { return graph_replays_; }
  int64_t graph_recordings() const override { return graph_recordings_; }

  void embed(const Weight& table, Tensor out, int64_t first_id) override;
  void gather_step_rows(const Tensor& src, Tensor out) override;
  void linear(const Tensor& x, const Weight& w, Tensor y) override;
  void linear_heads(const Tensor& x, int64_t x_head_stride, const Weight& w, Tensor y, int64_t y_head_stride) override;
  void rms_norm(const Tensor& x, const Buffer& weight, float eps, Tensor y) override;
  void add_rms_norm(Tensor residual, const Tensor& delta, const Buffer& weight, float eps, Tensor y) override;
  void add(Tensor x, const Tensor& delta) override;
  void fill_zero(Tensor x) override;
  void copy(const Tensor& src, Tensor dst) override;
  void silu_mul(const Tensor& gate_up, Tensor out) override;
  void rope(Tensor x, int64_t vectors_per_position, const Buffer& inv_freq, float attention_factor) override;
  void mla_prepare(Tensor kv, int64_t latent, const Buffer& norm_weight, float eps, Tensor q_rope, int64_t heads,
                   const Buffer& inv_freq, float attention_factor, const Buffer& cache_layer,
                   Tensor q_rope_copy) override;
  void store_kv(const Tensor& kv, const Buffer& cache_layer) override;
  void mla_attention(const MlaAttention& a, const Tensor& q, const Buffer& cache_layer, Tensor out) override;
  bool has_mla_expanded(const MlaExpanded& a) const override;
  bool mla_expanded_pays(const MlaExpanded& a) const override;
  // Keys per chunk of cached context in mla_expanded (the workspace bound, or DEEPINFER_MLA_CONTEXT_CHUNK).
  int64_t context_chunk(const MlaExpanded& a) const;
  void mla_expanded(const MlaExpanded& a, const Tensor& q, const Tensor& kv, const Buffer& cache_layer,
                    Tensor out) override;
  void moe(const Tensor& x, const MoeWeights& w, Tensor out) override;
  void moe_add_rms_norm(const Tensor& x, const MoeWeights& w, Tensor out, Tensor residual, const Buffer& norm_weight,
                        float eps, Tensor y) override;
  bool has_side_lane() const override { return side_lane_enabled_; }
  void begin_side_lane() override;
  void end_side_lane() override;
  void join_side_lane() override;
  void compute_logits(const Tensor& x, const Buffer& norm, float eps, const Weight& lm_head, bool greedy) override;
  Status read_logits(std::vector<float>& host_logits) override;
  Status read_greedy_tokens(std::vector<int32_t>& host_ids) override;
  Status read_top_probabilities(std::vector<float>& host_probabilities) override;
  bool has_v4_ops() const override { return true; }
  void v4_hc_pre(const Tensor& X, const V4HyperMix& m, Tensor y, Tensor post, Tensor comb) override;
  void v4_hc_post(Tensor X, const Tensor& out, const Tensor& post, const Tensor& comb) override;
  void v4_norm_rope(Tensor x, const V4NormRope& p) override;
  void v4_compress(const Tensor& kv, const Tensor& score, const V4Compressor& c,
                   std::span<const V4CompressWork> work) override;
  void v4_indexer_topk(const Tensor& q, const Tensor& weights, double weight_scale, std::span<const V4IndexRow> rows,
                       int64_t topk, const Buffer& ids) override;
  void v4_attention(const V4Attention& a, const Tensor& q, const Tensor& kv, std::span<const V4AttentionRow> rows,
                    Tensor out) override;
  void copy_spans(std::span<const CopySpan> spans) override;
  void silu_mul_clamped(const Tensor& gate_up, float limit, Tensor out) override;
  bool has_device_sampling() const override { return device_sampling_; }
  Status read_sampled_tokens(std::span<const DeviceSampling> rows, std::span<const LogitAdjustment> adjustments,
                             std::vector<int32_t>& host_ids) override;
  Status read_sampled_logprobs(std::vector<SampledLogprobs>& out) override;
  int64_t max_device_dspark_rank() const override { return kernels::cuda::kDsparkMaxRank; }
  Status read_dspark_greedy_chains(const DsparkHeadsOnDevice& heads, const Tensor& h, int32_t gamma,
                                   std::span<const int32_t> previous, std::span<const int32_t> lengths,
                                   std::vector<int32_t>& drafts, std::vector<double>& confidences) override;

 private:
  CudaBackend() = default;

  // Errors (cuda_backend.cpp). failed(): a previous op of this step failed; ops then do nothing.
  bool failed() const { return !sticky_.ok(); }
  void fail(Status status);
  void check_cuda(cudaError_t err, const char* what);
  void check_blas(cublasStatus_t status, const char* what);
  void check_gemm(const kernels::cuda::GemmStatus& status, const char* what);
  Status take_sticky();
  // scratch.reserve(bytes) on the stream; nullptr (failure recorded) when device memory ran out, or when it would
  // have to grow during a graph capture. Growth bumps buffers_generation_.
  char* reserve(Scratch& scratch, size_t bytes);
  // Ops that cannot be captured (they wait for the device on the host) call this: during a warm-up run it marks
  // the key eager-only; during a capture (a bug: the warm-up saw the same ops) it records an Internal error.
  // Returns false when the op must not go on.
  bool note_host_synchronization(const char* what);
  void activate();  // cudaSetDevice: the calling thread may not be the one that created the backend
  Status upload_now(const void* host, size_t bytes, void* device_dst);

  // V4 ops' descriptors (cuda_v4.cpp): `bytes` of host data copied into the pinned arena and on to the device in
  // stream order; returns the device copy (null after a failure, recorded). The arenas are reused from the next
  // begin_step on (recycle_descriptor_arenas waits for the stream when the last step used them).
  const void* upload_descriptors(const void* host, size_t bytes);
  template <typename T>
  const void* upload_descriptors(const std::vector<T>& items) {
    return upload_descriptors(items.data(), items.size() * sizeof(T));
  }
  void recycle_descriptor_arenas();
  void free_descriptor_arenas();
  struct DescriptorArena {
    void* host = nullptr;    // pinned
    void* device = nullptr;
    size_t bytes = 0, used = 0;
  };
  std::vector<DescriptorArena> descriptor_arenas_;

  // Graphs (cuda_graph.cpp).
  struct Graph {
    uint64_t generation = 0;         // buffers_generation_ its buffers belong to
    bool capturable = true;          // its warm-up run issued no host synchronization
    cudaGraphExec_t exec = nullptr;  // null until captured (the key's second run)
    HeadResult head;                 // what the captured ops' compute_logits left: restored at every launch
  };
  Status capture(Graph& graph, const std::function<void()>& ops);
  void destroy_graph(Graph& graph);

  // GEMMs (cuda_gemm.cpp). linear_matrix: y = x · wᵀ for one matrix of any precision, bf16 activations with any
  // row strides. gemm_f32_out: the same with float32 output y [x.rows, ldy].
  void linear_matrix(const Tensor& x, const MatrixRef& w, Tensor y);
  void* pinned_host(size_t bytes);
  // read_greedy_tokens / read_top_probabilities: `n` 4-byte head values at `device` (null: none) into `host`.
  Status read_head_values(const void* device, size_t n, void* host, const char* what);
  void linear_fp8(const Tensor& x, const MatrixRef& w, Tensor y);
  void gemm_f32_out(const Tensor& x, const MatrixRef& w, float* y, int64_t ldy);
  // The router's float32 logits [x.rows, ld] (cuda_moe.cpp): MoE's own, and linear() into a float32 y.
  void router_logits(const Tensor& x, const MatrixRef& router, float* logits, int64_t ld);

  // Row-wise helpers (cuda_rowwise.cpp): the RMSNorm kernel on a bf16 tensor whose rows share x's and y's stride.
  void rms_norm_same_stride(const Tensor& x, const uint16_t* weight, float eps, Tensor y, uint16_t* residual);

  int device_ = 0;
  int num_sms_ = 0;
  // The expert GEMMs' path (cuda_moe.cpp): kAuto picks by rows per expert; the others are forced through the
  // DEEPINFER_MOE_GEMM environment variable (streaming, tiled, per-expert, wgmma, wgmma-128, wgmma-256, wgmma-swap32,
  // wgmma-swap64; in the enum's order after auto), for measurements and comparisons. wgmma-128 and wgmma-256 take the
  // 128-row tiles (never the swapped ones; FP8 tiles are 128 columns wide whatever the width asked).
  enum class MoeGemmPath {
    kAuto,
    kStreaming,
    kTiled,
    kPerExpert,
    kWgmma,
    kWgmma128,
    kWgmma256,
    kWgmmaSwap32,
    kWgmmaSwap64
  };
  MoeGemmPath moe_gemm_path_ = MoeGemmPath::kAuto;
  // MLA over a cached prefix (cuda_attention.cpp): kAuto by the cost model of mla_expanded_pays, or forced by
  // DEEPINFER_MLA_FORM=absorbed|expanded; mla_context_chunk_ (DEEPINFER_MLA_CONTEXT_CHUNK, keys, a multiple of 64)
  // replaces the workspace-derived keys per context chunk when > 0. Measurements and checks.
  enum class MlaForm { kAuto, kAbsorbed, kExpanded };
  MlaForm mla_form_ = MlaForm::kAuto;
  // The expanded form's attention kernel (DEEPINFER_MLA_PREFILL=wgmma|mma|wgmma-serial; measurements): mma.sync,
  // and the wgmma kernel without its softmax / P · V overlap.
  bool mla_prefill_mma_ = false;
  bool mla_prefill_overlap_ = true;
  // The expanded kernel's key splits (DEEPINFER_MLA_KEY_SPLITS=auto|1|2|3|4; measurements): 0 = chosen by waves
  // within a 96 MiB workspace, 1 = never, n = forced.
  int mla_key_splits_ = 0;
  int64_t mla_context_chunk_ = 0;
  // MLA decode's split-KV outside batch-invariant mode: the fewest pages a split reads
  // (DEEPINFER_MLA_SPLIT_PAGES=1|2|4), and the partials its combine loads together
  // (DEEPINFER_MLA_COMBINE_LOADS=8|16|32; 0: the kernel's default). For measuring: the loads change no sum, the split
  // pages change their order (as the batch does outside batch-invariant mode).
  int mla_split_min_pages_ = 2;
  int mla_combine_loads_ = 0;
  // FP8 dense projections at a few rows (cuda_gemm.cpp): the streaming kernel of moe_grouped.h (one matrix, weights
  // read once per 8 rows) up to kStreamingLinearMaxRows rows, cuBLASLt beyond; DEEPINFER_SMALL_LINEAR=cublas keeps
  // cuBLASLt at every size (measurements).
  bool streaming_linear_ = true;
  // Batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1, as vLLM's VLLM_BATCH_INVARIANT=1): each row's result is bit
  // for bit the same whatever the other rows of the step and however many rows its sequence has there (a decode
  // row, the same position inside a speculative verify step, a row beside a prefill chunk), so greedy speculative
  // decoding gives plain decoding's tokens and a request's output does not depend on the batch. What changes:
  //   - every bf16 / FP8 GEMM (linear, linear_heads, the head's logits, the routed experts) runs on the grouped
  //     streaming kernel in the tiled kernel's summation order up to kInvariantStreamingRows rows (per expert), on
  //     the tiled kernel beyond: the same sums in the same order either way (moe_grouped.h, tiled_order); never
  //     cuBLAS, wgmma or the per-expert loop; FP8 weights are widened exactly (the activations are not quantized);
  //   - the MLA decode kernel splits every sequence at fixed pages (kMlaInvariantSplitPages, mla_decode.h);
  //   - every row takes MLA's absorbed form (has_mla_expanded is false), prefill from 0 too, so that a prefix-cache
  //     hit gives a miss's values;
  //   - the float32 router takes its per-(token, expert) kernel at every batch.
  // Float32 dense weights are refused (cuBLAS only). DeepSeek-V2/V3-family steps only (cuda_v4.cpp is not covered:
  // the server refuses the mode for V4). Costs speed: see the README's table.
  bool batch_invariant_ = false;
  // Batch-invariant mode's GEMM: y = x · wᵀ into bf16 `y` or float32 `y32`, rows ldy apart. `what` names the caller.
  void invariant_gemm(const Tensor& x, const MatrixRef& w, void* y, float* y32, int64_t ldy, const char* what);
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;               // strided / batched / f32 GEMMs (leading dimensions)
  void* blas_workspace_ = nullptr;              // blas_'s fixed workspace: cuBLAS never allocates in a capture
  kernels::cuda::GemmLibrary* gemm_ = nullptr;  // FP8 block-scaled GEMMs (cuBLASLt plans)
  Status sticky_;                               // the first error since the last report

  StepState step_;
  Scratch step_buffer_;      // the step's device arrays (StepState's pointers)
  void* staging_ = nullptr;  // pinned host copy of the step arrays, one H2D copy per step
  size_t staging_bytes_ = 0;
  cudaEvent_t staging_copied_ = nullptr;  // the last H2D copy out of staging_ has finished reading it
  int32_t* moe_offsets_host_ = nullptr;   // pinned, the per-expert offsets of one MoE layer
  void* pinned_host_ = nullptr;           // pinned staging for logits / greedy ids on their way to the host
  size_t pinned_host_bytes_ = 0;
  // download_batch / upload_batch: two pinned halves of kCopyStagingHalf bytes (allocated at the first batch) and
  // the event recorded after the copies of each half's latest round.
  static constexpr size_t kCopyStagingHalf = size_t{16} << 20;
  std::byte* copy_staging_[2] = {nullptr, nullptr};
  cudaEvent_t copy_staged_[2] = {nullptr, nullptr};
  Status reserve_copy_staging();
  // Queues the copies dsts[i] <- srcs[i] (sizes[i] bytes) on stream_ in one call, then empties the three lists.
  cudaError_t queue_copies(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes);
  HeadResult head_;                       // compute_logits' results of this step
  std::vector<SampledLogprobs> sampled_logprobs_;  // read_sampled_tokens' logprobs (read_sampled_logprobs)
  size_t moe_offsets_capacity_ = 0;
  // moe with given routing (expert parallel): the permutation built on the host, and its upload.
  std::vector<int32_t> given_offsets_, given_sorted_, given_fill_, given_expert_;
  std::vector<char> given_upload_;

  std::unordered_map<GraphKey, Graph, GraphKeyHash> graphs_;
  uint64_t buffers_generation_ = 0;  // bumped whenever a Scratch grows (graphs captured before it are stale)
  bool capturing_ = false;           // inside cudaStreamBeginCapture .. EndCapture
  bool host_synchronized_ = false;   // an op synchronized with the host since the last run_graph began
  int64_t graph_replays_ = 0;
  int64_t graph_recordings_ = 0;

  // Temporaries by purpose; a function uses only its own, so nested calls never clobber their caller's.
  Scratch gemm_in_;       // linear_fp8 / gemm_f32_out: converted, padded, quantized activations
  Scratch gemm_out_;      // linear_fp8: output staging when y is strided or unaligned
  Scratch gemm_staging_;  // f32 weights: f32 output before bf16; FP8 weights: bf16 output before f32
  Scratch rowwise_;       // silu_mul on strided views
  Scratch attention_;     // MLA split-KV workspace, expanded k/v, contiguous q/out copies
  Scratch attention_tables_;  // MLA decode kernel over a step with several rows per sequence: per-row block tables
  Scratch moe_;           // routing, permutation, permuted activations and expert outputs
  Scratch logits_;        // selected rows and their f32 logits
  Scratch sampling_;      // read_sampled_tokens: the rows' parameters and the sampled ids
  Scratch dspark_;        // read_dspark_greedy_chains: chains' inputs, drafts, confidences, the kernels' scratch
  Scratch v4_;            // V4 ops: mHC mixes, indexer scores

  // The side lane (Backend::begin_side_lane; cuda_backend.cpp): while it is open, its stream, cuBLAS handle, GEMM
  // library and the scratch of the ops that may run there (linear, silu_mul) are swapped into the members above, so
  // every op queues on it unchanged; end_side_lane swaps them back. Created with the backend (64 MiB of
  // workspaces) unless DEEPINFER_SIDE_LANE=0.
  struct SideLane {
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    void* blas_workspace = nullptr;
    kernels::cuda::GemmLibrary* gemm = nullptr;
    Scratch gemm_in, gemm_out, gemm_staging, rowwise;
    cudaEvent_t fork = nullptr, join = nullptr;  // recorded on the main lane at begin, on the side lane at end
  };
  SideLane side_;
  bool side_lane_enabled_ = false;
  // The routed experts' SwiGLU in the streaming gate_up kernel's epilogue (moe_grouped.h, gated) unless
  // DEEPINFER_FUSED_SWIGLU=0: the same bits either way.
  bool fused_swiglu_ = true;
  // The streaming kernel's weight ring (moe_grouped.h, stream_ring): 0 automatic (4 stages of shared memory), or
  // DEEPINFER_MOE_STREAM=registers|ring4|ring6 (-1, 4, 6; A/B). The same bits whichever.
  int moe_stream_ring_ = 0;
  // The streaming kernel copies its first stages of weights before the previous kernel has ended (moe_grouped.h,
  // weights_before_wait) where that is safe: the projections and the MoE's down GEMM. DEEPINFER_EARLY_WEIGHTS=0: off.
  bool early_weights_ = true;
  // moe_add_rms_norm: the residual add and norm in the combine's launch (run_moe_combine with a residual) unless
  // DEEPINFER_FUSED_MOE_NORM=0; the same bits either way. `pending_norm_` carries them into moe() for one call.
  bool fused_moe_norm_ = true;
  struct PendingNorm {
    Tensor residual, y;
    const Buffer* weight = nullptr;
    float eps = 0.0f;
    bool done = false;
  };
  std::optional<PendingNorm> pending_norm_;
  // The most rows at which a bf16 projection runs on the streaming kernel instead of cuBLAS: 1 (H100, 2026-12-06: at
  // 1 row -0.10 ms a V2-Lite step, at 8 rows +0.08 ms); DEEPINFER_SMALL_LINEAR_BF16=0|1|8. FP8 projections take it up
  // to kStreamingLinearMaxRows unless DEEPINFER_SMALL_LINEAR=cublas.
  int64_t streaming_linear_bf16_rows_ = 1;
  enum class LaneState { kNone, kOpen, kPending } lane_state_ = LaneState::kNone;
  void swap_lanes();
  bool device_sampling_ = true;  // DEEPINFER_DEVICE_SAMPLING=0 turns it off (host sampling, for comparisons)
};

}  // namespace deepinfer::backend::cuda
