// Routed experts on the CUDA backend: float32 router logits, routing (run_moe_routing: the model's rule exactly),
// permutation of the token copies by expert, the expert GEMMs over each expert's contiguous rows, SiLU·mul over all
// rows at once, and the weighted combine added onto `out`. The expert GEMMs take one of two kinds of path (see
// "Which kernel runs the expert GEMMs" below):
//   - the streaming, tiled or wgmma kernel of moe_grouped.h, one launch per projection reading the expert offsets
//     on the device, so the layer never waits for the host;
//   - one cuBLAS / cuBLASLt GEMM per non-empty expert, after copying the offsets to the host (a host
//     synchronization, so a step that takes this path never runs as a CUDA graph).
#include <algorithm>
#include <cstring>
#include <string>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/backend_ops.h"
#include "deepinfer/kernels/cuda/fused_ops.h"
#include "deepinfer/kernels/cuda/gemm.h"
#include "deepinfer/kernels/cuda/moe_grouped.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

// Which kernel runs the expert GEMMs, by token copies per expert on average (P / E):
//   - the streaming kernel (moe_grouped.h), each expert's weights read once per chunk of 8 rows: bf16 up to
//     streaming_max_rows_per_expert() (4), FP8 below one row an expert (decode at batches up to E / top_k; FP8
//     shapes the wgmma kernel cannot take up to 8 rows), where the layer is bound by reading the weights;
//   - bf16 up to kTiledMaxRowsPerExpert: the tiled kernel (64-row tiles, mma.sync, one launch, no host sync), but
//     from 24 to 64 rows the wgmma kernel's 64-token swapped tiles (kc::moe_wgmma_swap_tokens);
//   - then up to kWgmmaMaxRowsPerExpert: the wgmma kernel (128-row tiles on Hopper's warpgroup MMA, one launch, no
//     host sync); FP8 experts take it right after the streaming kernel, with the activations quantized per 1 x 128
//     first, as the per-expert path does (FP8 shapes whose K is not whole 128-wide groups take the tiled kernel up
//     to kTiledMaxRowsPerExpert instead), up to 64 rows per expert on its swapped tiles (the weights as wgmma's M,
//     32 or 64 tokens as its N: kc::moe_wgmma_swap_tokens);
//   - beyond: one cuBLAS GEMM per expert (after the offsets' host copy), whose large tiles (and TMA multicast) win
//     once every expert has hundreds of rows.
// The bounds are measured (bench_model --moe-sweep on the H200; bench/gpu/NOTES.md, "Grouped MoE GEMMs" and "FP8
// experts on the wgmma kernel"), one MoE layer, µs (2026-12-04):
//   V2-Lite bf16: at 48 rows per expert tiled 411, wgmma 425, per-expert 1,199; at 96 tiled 701, wgmma 483; at 384
//   tiled 2,221, wgmma 1,321, per-expert 1,523; at 768 wgmma 2,441, per-expert 2,146.
//   V3 FP8: at 2 rows streaming 2,733, at 16 streaming 7,680, tiled 8,102, wgmma 5,655; at 64 tiled 12,325, wgmma
//   6,611, per-expert 13,662; at 128 wgmma 9,759, per-expert 16,770; at 512 wgmma 30,398, per-expert 32,241.
// The streaming bound again after its shared-memory ring (H100, 2026-12-06, --moe-sweep 16,32,64,128,256,
// bench/results/2026-12-06-h100-moe-sweep-ring-16-256.jsonl): V2-Lite bf16 streaming / tiled at 1.5 rows per expert
// 314 / 355, at 3 375 / 413, at 6 455 / 431, at 12 764 / 449 (the 16 of before cost 0.3 ms a layer there); V3 FP8
// streaming / wgmma at 2 3,306 / 4,601, at 4 3,826 / 5,318, at 8 5,470 / 5,594.
// FP8 streaming / swapped 32-token tiles (H200, 2026-12-07, bench/results/2026-12-07-h200-run32-sweep-v3.jsonl): at
// 1 row an expert 1,974 / 1,927, at 2 2,712 / 2,539, at 4 3,168 / 2,894, at 8 5,068 / 3,105. The bound below is
// the automatic one for bf16 and for FP8 shapes the wgmma kernel cannot take, and batch-invariant mode's (which
// pairs the streaming kernel with the tiled one).
int64_t streaming_max_rows_per_expert(bool fp8) { return fp8 ? 8 : 4; }
constexpr int64_t kTiledMaxRowsPerExpert = 64;
constexpr int64_t kWgmmaMaxRowsPerExpert = 512;
constexpr int64_t kRouterKernelMaxTokens = 64;  // run_moe_router_logits up to this many tokens, cuBLAS beyond

// Whether the grouped kernel takes this expert stack: bf16 or FP8 weights (float32 ones, a test-only precision,
// stay on cuBLAS), and input widths that split into 16-byte vectors (cols % 8 == 0; every DeepSeek shape does).
bool grouped_supports(const Weight& w) {
  return (w.precision == Precision::kBF16 || w.precision == Precision::kFP8) && w.cols % 8 == 0;
}

// The grouped kernel's parameters for y [P, w.rows] = x [P, w.cols] · W[e]ᵀ over the rows offsets[e]..offsets[e+1]
// (x and y contiguous scratch views; CudaWeight's layout: matrices rows * stride elements apart, FP8 scales
// scale_rows * scale_ld floats apart).
kc::MoeGroupedGemmParams grouped_params(const Tensor& x, const Weight& weight, const int32_t* offsets, Tensor y,
                                        int num_sms, int stream_ring, cudaStream_t stream) {
  const auto* w = dynamic_cast<const CudaWeight*>(&weight);
  BACKEND_CHECK(w != nullptr, "a weight made by another backend was passed to the CUDA backend");
  BACKEND_CHECK(x.stride == x.cols && y.stride == y.cols && x.cols == w->cols && y.cols == w->rows && x.rows == y.rows,
                "moe (grouped): contiguous x [P, " + std::to_string(w->cols) + "] and y [P, " +
                    std::to_string(w->rows) + "] expected");
  kc::MoeGroupedGemmParams p;
  p.format = w->precision == Precision::kFP8 ? kc::MoeWeightFormat::kFP8 : kc::MoeWeightFormat::kBF16;
  p.rows = x.rows;
  p.num_experts = w->count;
  p.n = w->rows;
  p.k = w->cols;
  p.offsets = offsets;
  p.x = static_cast<const uint16_t*>(x.data);
  p.w = w->values.data();
  p.w_ld = w->stride;
  p.w_matrix_stride = w->rows * w->stride;
  if (w->precision == Precision::kFP8) {
    p.w_scale = static_cast<const float*>(w->scales.data());
    p.w_scale_ld = w->scale_ld;
    p.w_scale_matrix_stride = w->scale_rows * w->scale_ld;
  }
  p.y = static_cast<uint16_t*>(y.data);
  p.num_sms = num_sms;
  p.stream_ring = stream_ring;
  p.stream = stream;
  return p;
}

int grouping_of(MoeRoutingRule::TopK topk) {
  switch (topk) {
    case MoeRoutingRule::TopK::kGreedy:
      return 0;
    case MoeRoutingRule::TopK::kGroupLimitedGreedy:
      return 1;
    case MoeRoutingRule::TopK::kNoauxTc:
      return 2;
  }
  return 0;
}

}  // namespace

// Float32 router logits: for a few tokens one small kernel (cuBLAS's SGEMM path took three launches: widening x,
// the dot products, their reduction); otherwise cuBLAS. The batch-invariant mode always takes the kernel.
void CudaBackend::router_logits(const Tensor& x, const MatrixRef& router, float* logits, int64_t ld) {
  if (router.precision == Precision::kF32 && (x.rows <= kRouterKernelMaxTokens || batch_invariant_)) {
    kc::MoeRouterLogitsParams rl;
    rl.tokens = x.rows;
    rl.num_experts = router.rows;
    rl.hidden = x.cols;
    rl.x = static_cast<const uint16_t*>(x.data);
    rl.x_stride = x.stride;
    rl.w = static_cast<const float*>(router.values);
    rl.w_stride = router.stride;
    rl.logits = logits;
    rl.logits_stride = ld;
    rl.stream = stream_;
    check_cuda(kc::run_moe_router_logits(rl), "moe (router logits)");
  } else {
    gemm_f32_out(x, router, logits, ld);
  }
}

void CudaBackend::moe(const Tensor& x, const MoeWeights& w, Tensor out) {
  // A side lane's ops (the shared experts writing `out`) are joined before the combine reads it, and on every
  // early return: the ops after this one read `out`.
  struct JoinAtExit {
    CudaBackend* backend;
    ~JoinAtExit() { backend->join_side_lane(); }
  } join_at_exit{this};
  const MoeRoutingRule& rule = w.rule;
  const int64_t T = x.rows, hidden = x.cols, E = rule.num_experts, k = rule.top_k;
  BACKEND_CHECK(w.gate_up != nullptr && w.down != nullptr, "moe: missing weights");
  BACKEND_CHECK(x.dtype == DType::kBF16 && out.dtype == DType::kBF16 && out.rows == T && out.cols == hidden,
                "moe: x and out must be bf16 of the same shape");
  // Expert parallel (MoeWeights): the routing given on the host, experts [first, first + held) in the stacks.
  // (A stack of fewer than E experts is a rank's share even with no rows to route: T = 0.)
  const bool given = !w.routed_ids.empty() || w.first_expert != 0 || w.gate_up->count != E;
  const int64_t first = given ? w.first_expert : 0, held = given ? w.gate_up->count : E;
  const int64_t I = w.gate_up->rows / 2;
  BACKEND_CHECK(w.gate_up->count == held && w.gate_up->rows == 2 * I && w.gate_up->cols == hidden &&
                    w.down->count == held && w.down->rows == hidden && w.down->cols == I,
                "moe: experts must stack gate_up [E][2I][hidden] and down [E][hidden][I]");
  int grouping = 0;
  const float* bias = nullptr;
  if (given) {
    BACKEND_CHECK(first >= 0 && held >= 1 && first + held <= E && k >= 1 && k <= E,
                  "moe: experts [" + std::to_string(first) + ", " + std::to_string(first + held) + ") of " +
                      std::to_string(E) + ", top " + std::to_string(k));
    BACKEND_CHECK(static_cast<int64_t>(w.routed_ids.size()) == T * k && w.routed_weights.size() == w.routed_ids.size(),
                  "moe: the given routing must be [T * top_k] ids and weights");
  } else {
    BACKEND_CHECK(w.router != nullptr, "moe: missing router");
    BACKEND_CHECK(w.router->count == 1 && w.router->rows == E && w.router->cols == hidden,
                  "moe: the router must be one [" + std::to_string(E) + ", " + std::to_string(hidden) + "] matrix");
    // run_moe_routing's limits (fused_ops.h).
    BACKEND_CHECK(E >= 1 && E <= 512 && k >= 1 && k <= 32 && k <= E,
                  "moe: " + std::to_string(E) + " experts, top " + std::to_string(k) +
                      " (the routing kernel takes E <= 512, k <= min(E, 32))");
    grouping = grouping_of(rule.topk);
    BACKEND_CHECK(grouping == 0 || (rule.n_group >= 1 && rule.n_group <= 32 && E % rule.n_group == 0 &&
                                    rule.topk_group >= 1 && rule.topk_group <= rule.n_group),
                  "moe: n_group " + std::to_string(rule.n_group) + ", topk_group " + std::to_string(rule.topk_group) +
                      " (n_group <= 32 dividing E, topk_group <= n_group)");
    bias = w.bias != nullptr ? vector_f32(*w.bias, E, "moe (e_score_correction_bias)") : nullptr;
  }
  if (failed() || T == 0) return;

  // Given routing: the permutation built here on the host over the held experts only (entries routed elsewhere, or
  // dropped by a capacity factor with weight 0, are not computed: their combine reads a zero row at weight 0).
  given_offsets_.clear();
  given_sorted_.clear();
  if (given) {
    if (!note_host_synchronization("moe (given routing)")) return;
    given_offsets_.assign(static_cast<size_t>(held + 1), 0);
    given_expert_.resize(w.routed_ids.size());  // each entry's held expert, -1: not computed here
    for (size_t j = 0; j < w.routed_ids.size(); ++j) {
      const int64_t e = w.routed_ids[j] - first;
      given_expert_[j] = e >= 0 && e < held && w.routed_weights[j] != 0.0f ? static_cast<int32_t>(e) : -1;
      if (given_expert_[j] >= 0) ++given_offsets_[static_cast<size_t>(e + 1)];
    }
    for (int64_t e = 0; e < held; ++e) given_offsets_[static_cast<size_t>(e + 1)] += given_offsets_[static_cast<size_t>(e)];
    given_sorted_.resize(static_cast<size_t>(given_offsets_[static_cast<size_t>(held)]));
    if (given_sorted_.empty()) return;  // none of these rows' experts is held here
  }
  const int64_t P = given ? static_cast<int64_t>(given_sorted_.size()) : T * k;  // token copies computed here
  const int64_t E_held = held;                                                    // experts in the stacks
  // The path: by rows per expert, or forced (DEEPINFER_MOE_GEMM: where the forced kernel cannot take the shape, e.g.
  // wgmma with float32 weights or FP8 with K not in whole 128-groups, the per-expert path runs instead; FP8 wgmma
  // tiles are 128 columns whatever the width asked); float32 weights (tests) take cuBLAS.
  enum class Path { kStreaming, kTiled, kWgmma, kPerExpert } path = Path::kPerExpert;
  const bool kernels_take = grouped_supports(*w.gate_up) && grouped_supports(*w.down);
  const bool tiled_fits = kc::moe_grouped_row_tiles(P, E_held, 64) <= kc::kMoeMaxRowTiles;  // the tiled kernel's grid.y
  // The wgmma kernel: bf16 experts, or FP8 ones whose K (hidden, I) are whole 128-wide groups (the activations are
  // quantized per 1 x 128); its grid.y (128-row tiles) within CUDA's limit.
  const bool fp8 = w.gate_up->precision == Precision::kFP8;
  int wgmma_tile_n = 0;  // automatic
  // Swapped tiles: forced by the path (wgmma-128 / wgmma-256: never), else the kernel's automatic choice.
  const int wgmma_swap_tokens = moe_gemm_path_ == MoeGemmPath::kWgmmaSwap32   ? 32
                                : moe_gemm_path_ == MoeGemmPath::kWgmmaSwap64 ? 64
                                : moe_gemm_path_ == MoeGemmPath::kWgmma128 || moe_gemm_path_ == MoeGemmPath::kWgmma256
                                    ? -1
                                    : 0;
  const int wgmma_swap = kc::moe_wgmma_swap_tokens(P, E_held, fp8, wgmma_swap_tokens);
  const bool wgmma_takes =
      kernels_take && w.gate_up->precision == w.down->precision &&
      (!fp8 || (hidden % kc::kFp8GroupSize == 0 && I % kc::kFp8GroupSize == 0)) &&
      kc::moe_grouped_row_tiles(P, E_held, wgmma_swap > 0 ? wgmma_swap : 128) <= kc::kMoeMaxRowTiles;
  // Batch-invariant mode (cuda_backend.h): the streaming kernel in the tiled order or the tiled kernel, whose sums
  // are the same; the boundary is the auto one.
  MoeGemmPath choice = moe_gemm_path_;
  if (batch_invariant_) {
    BACKEND_CHECK(kernels_take, "moe: batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1) takes bf16 and FP8 experts "
                                "with K % 8 == 0 (the grouped kernels); these are not");
    choice = P > streaming_max_rows_per_expert(fp8) * E_held && tiled_fits ? MoeGemmPath::kTiled
                                                                             : MoeGemmPath::kStreaming;
  }
  switch (choice) {
    case MoeGemmPath::kAuto:
      if (kernels_take && (fp8 && wgmma_takes ? P < E_held : P <= streaming_max_rows_per_expert(fp8) * E_held))
        path = Path::kStreaming;
      else if (wgmma_takes && (fp8 || wgmma_swap > 0 || P > kTiledMaxRowsPerExpert * E_held) &&
               P <= kWgmmaMaxRowsPerExpert * E_held)
        path = Path::kWgmma;
      else if (kernels_take && tiled_fits && P <= kTiledMaxRowsPerExpert * E_held)
        path = Path::kTiled;
      break;
    case MoeGemmPath::kStreaming:
      if (kernels_take) path = Path::kStreaming;
      break;
    case MoeGemmPath::kTiled:
      if (kernels_take && tiled_fits) path = Path::kTiled;
      break;
    case MoeGemmPath::kWgmma:
    case MoeGemmPath::kWgmma128:
    case MoeGemmPath::kWgmma256:
    case MoeGemmPath::kWgmmaSwap32:
    case MoeGemmPath::kWgmmaSwap64:
      if (wgmma_takes) path = Path::kWgmma;
      if (!fp8)  // FP8 tiles are 128 columns wide
        wgmma_tile_n = moe_gemm_path_ == MoeGemmPath::kWgmma128   ? 128
                       : moe_gemm_path_ == MoeGemmPath::kWgmma256 ? 256
                                                                  : 0;
      break;
    case MoeGemmPath::kPerExpert:
      break;
  }
  // FP8 on the wgmma kernel: x quantized per 1 x 128 first (run_act_quant), as the per-expert cuBLASLt path does.
  const bool quantized = path == Path::kWgmma && fp8;
  const bool direct_x = x.stride == hidden, direct_out = out.stride == hidden;
  ScratchLayout l;
  // Given routing: offsets [held + 1], sorted entries [P], entry positions [T k] and weights [T k] are one upload.
  const size_t o_logits = given ? 0 : l.add(static_cast<size_t>(T * E) * 4);
  const size_t o_ids = given ? 0 : l.add(static_cast<size_t>(T * k) * 4);
  const size_t o_counts = given ? 0 : l.add(static_cast<size_t>(E) * 4);
  const size_t o_workspace = given ? 0 : l.add(kc::moe_permute_workspace_bytes(T * k, E));
  const size_t o_offsets = l.add(static_cast<size_t>(E_held + 1) * 4);
  const size_t o_sorted = l.add(static_cast<size_t>(P) * 4);
  const size_t o_position = l.add(static_cast<size_t>(T * k) * 4);
  const size_t o_weights = l.add(static_cast<size_t>(T * k) * 4);
  const size_t o_x = direct_x ? 0 : l.add(static_cast<size_t>(T * hidden) * 2);
  const size_t o_permuted = l.add(static_cast<size_t>(P * hidden) * 2);
  const size_t o_gate_up = l.add(static_cast<size_t>(P * 2 * I) * 2);
  const size_t o_act = l.add(static_cast<size_t>(P * I) * 2);
  // Given routing: one more row, of zeros, for the entries not computed here.
  const size_t o_expert_out = l.add(static_cast<size_t>((P + (given ? 1 : 0)) * hidden) * 2);
  const size_t o_out = direct_out ? 0 : l.add(static_cast<size_t>(T * hidden) * 2);
  // FP8 experts on the wgmma kernel: the permuted rows, then the SiLU output, quantized per 1 x 128 (one at a time).
  const int64_t quant_cols = std::max(hidden, I);
  const size_t o_quant = quantized ? l.add(static_cast<size_t>(P * quant_cols)) : 0;
  const size_t o_quant_scale =
      quantized ? l.add(static_cast<size_t>(P * (quant_cols / kc::kFp8GroupSize + 1)) * 4) : 0;
  char* base = reserve(moe_, l.bytes);
  if (base == nullptr) return;
  auto* ids = reinterpret_cast<int32_t*>(base + o_ids);
  auto* weights = reinterpret_cast<float*>(base + o_weights);
  auto* offsets = reinterpret_cast<int32_t*>(base + o_offsets);
  auto* sorted = reinterpret_cast<int32_t*>(base + o_sorted);
  auto* position = reinterpret_cast<int32_t*>(base + o_position);
  auto* logits = reinterpret_cast<float*>(base + o_logits);

  if (given) {
    // The permutation (moe_permute's layout: within an expert in entry order) and the weights, in one upload.
    given_upload_.assign(o_weights + static_cast<size_t>(T * k) * 4 - o_offsets, 0);
    auto at = [&](size_t offset) { return given_upload_.data() + (offset - o_offsets); };
    std::vector<int32_t>& fill = given_fill_;
    fill.assign(given_offsets_.begin(), given_offsets_.end() - 1);
    const auto zero_row = static_cast<int32_t>(P);
    for (size_t j = 0; j < w.routed_ids.size(); ++j) {
      const int32_t e = given_expert_[j];
      int32_t position_j = zero_row;
      float weight_j = 0.0f;
      if (e >= 0) {
        position_j = fill[static_cast<size_t>(e)]++;
        given_sorted_[static_cast<size_t>(position_j)] = static_cast<int32_t>(j);
        weight_j = w.routed_weights[j];
      }
      std::memcpy(at(o_position) + j * 4, &position_j, 4);
      std::memcpy(at(o_weights) + j * 4, &weight_j, 4);
    }
    std::memcpy(at(o_offsets), given_offsets_.data(), given_offsets_.size() * 4);
    std::memcpy(at(o_sorted), given_sorted_.data(), given_sorted_.size() * 4);
    if (Status st = upload_now(given_upload_.data(), given_upload_.size(), base + o_offsets); !st.ok()) {
      fail(std::move(st));
      return;
    }
    check_cuda(cudaMemsetAsync(base + o_expert_out + static_cast<size_t>(P * hidden) * 2, 0,
                               static_cast<size_t>(hidden) * 2, stream_),
               "moe (the zero row)");
  } else {
    router_logits(x, matrix_of(*w.router, 0), logits, E);

    kc::MoeRoutingParams r;
    r.tokens = T;
    r.num_experts = E;
    r.top_k = k;
    r.sigmoid = rule.scoring == MoeRoutingRule::Scoring::kSigmoid;
    r.sqrt_softplus = rule.scoring == MoeRoutingRule::Scoring::kSqrtSoftplus;
    if (w.hash_ids != nullptr) {
      r.fixed_ids = static_cast<const int32_t*>(w.hash_ids->data());
      r.token_ids = step_.token_ids_device;
    }
    r.grouping = grouping;
    r.n_group = static_cast<int>(rule.n_group);
    r.topk_group = static_cast<int>(rule.topk_group);
    r.norm_topk_prob = rule.norm_topk_prob;
    r.scale_after_normalize = rule.scale_after_normalize;
    r.routed_scaling_factor = rule.routed_scaling_factor;
    r.logits = logits;
    r.bias = bias;
    r.ids = ids;
    r.weights = weights;
    r.stream = stream_;

    kc::MoePermuteParams perm;
    perm.tokens = T;
    perm.top_k = k;
    perm.num_experts = E;
    perm.ids = ids;
    perm.counts = reinterpret_cast<int32_t*>(base + o_counts);
    perm.offsets = offsets;
    perm.sorted_entries = sorted;
    perm.entry_position = position;
    perm.workspace = base + o_workspace;
    perm.stream = stream_;
    check_cuda(kc::run_moe_route_and_permute(r, perm), "moe (routing and permutation)");
  }

  const bool grouped = path != Path::kPerExpert;

  // Per-expert GEMMs: the per-expert row ranges decide which GEMMs to launch, so the host needs them: one
  // device-to-host copy and one stream synchronization per MoE layer. The grouped path reads them on the device.
  const int32_t* host_offsets = given ? given_offsets_.data() : nullptr;
  if (!grouped && !given) {
    // The one op that waits for the device on the host: run_graph runs keys that reach it eagerly.
    if (!note_host_synchronization("moe (per-expert GEMMs)")) return;
    if (static_cast<size_t>(E + 1) > moe_offsets_capacity_) {
      if (moe_offsets_host_ != nullptr) cudaFreeHost(moe_offsets_host_);
      moe_offsets_host_ = nullptr;
      moe_offsets_capacity_ = 0;
      void* pinned = nullptr;
      check_cuda(cudaHostAlloc(&pinned, static_cast<size_t>(E + 1) * 4, cudaHostAllocDefault), "moe (pinned offsets)");
      if (failed()) return;
      moe_offsets_host_ = static_cast<int32_t*>(pinned);
      moe_offsets_capacity_ = static_cast<size_t>(E + 1);
    }
    check_cuda(
        cudaMemcpyAsync(moe_offsets_host_, offsets, static_cast<size_t>(E + 1) * 4, cudaMemcpyDeviceToHost, stream_),
        "moe (offsets to host)");
    check_cuda(cudaStreamSynchronize(stream_), "moe (waiting for the routing)");
    if (failed()) return;
    host_offsets = moe_offsets_host_;
    bool offsets_ok = host_offsets[0] == 0 && host_offsets[E] == P;
    for (int64_t e = 0; e < E && offsets_ok; ++e) offsets_ok = host_offsets[e] <= host_offsets[e + 1];
    if (!offsets_ok) {
      fail(Status::internal("moe: the permutation's expert offsets are inconsistent (offsets[E] = " +
                            std::to_string(host_offsets[E]) + ", want " + std::to_string(P) + ")"));
      return;
    }
  }

  // SwiGLU, clamped for DeepSeek-V4's experts (swiglu_limit).
  auto activate = [&](const Tensor& in, Tensor result) {
    if (w.swiglu_limit > 0.0f) {
      silu_mul_clamped(in, w.swiglu_limit, result);
    } else {
      silu_mul(in, result);
    }
  };
  Tensor x_rows = x;
  if (!direct_x) {
    x_rows = Tensor{base + o_x, DType::kBF16, T, hidden, hidden};
    copy(x, x_rows);
  }
  const Tensor permuted{base + o_permuted, DType::kBF16, P, hidden, hidden};
  const Tensor gate_up{base + o_gate_up, DType::kBF16, P, 2 * I, 2 * I};
  const Tensor act{base + o_act, DType::kBF16, P, I, I};
  const Tensor expert_out{base + o_expert_out, DType::kBF16, P, hidden, hidden};
  // The streaming kernel reads each copy's x row through the permutation itself (no gather pass).
  const bool gather_in_kernel = path == Path::kStreaming;
  if (!gather_in_kernel) {
    kc::MoeGatherParams g;
    g.entries = P;
    g.top_k = k;
    g.hidden = hidden;
    g.x = static_cast<const uint16_t*>(x_rows.data);
    g.sorted_entries = sorted;
    g.permuted = reinterpret_cast<uint16_t*>(base + o_permuted);
    g.stream = stream_;
    check_cuda(kc::run_moe_gather(g), "moe (gather)");
  }

  if (grouped) {
    const auto run = path == Path::kTiled   ? kc::run_moe_grouped_gemm_tiled
                     : path == Path::kWgmma ? kc::run_moe_grouped_gemm_wgmma
                                            : kc::run_moe_grouped_gemm;
    // FP8 experts: the streaming and tiled kernels multiply the bf16 activations by the exactly widened FP8 weights
    // (no act_quant); the wgmma kernel and the per-expert cuBLASLt path quantize the activations to e4m3 per 1 x 128
    // first (DeepSeek's fp8_gemm). So an FP8 layer's rounding changes at the streaming bound (8 rows per expert:
    // V3's 256 experts top-8 past 256 tokens in a step).
    auto quantize = [&](const Tensor& rows, kc::MoeGroupedGemmParams& params) {
      if (!quantized) return;
      kc::ActQuantParams q;
      q.m = static_cast<int>(P);
      q.k = static_cast<int>(rows.cols);
      q.x = static_cast<const uint16_t*>(rows.data);
      q.x_fp8 = reinterpret_cast<uint8_t*>(base + o_quant);
      q.x_scale = reinterpret_cast<float*>(base + o_quant_scale);
      q.stream = stream_;
      check_cuda(kc::run_act_quant(q), "moe (FP8 act_quant for the wgmma kernel)");
      params.x_fp8 = q.x_fp8;
      params.x_scale = q.x_scale;
    };
    kc::MoeGroupedGemmParams gp =
        grouped_params(permuted, *w.gate_up, offsets, gate_up, num_sms_, moe_stream_ring_, stream_);
    gp.wgmma_tile_n = wgmma_tile_n;
    gp.wgmma_swap_tokens = wgmma_swap_tokens;
    gp.tiled_order = batch_invariant_ && path == Path::kStreaming;
    quantize(permuted, gp);
    if (gather_in_kernel) {
      gp.x = static_cast<const uint16_t*>(x_rows.data);
      gp.x_rows = sorted;
      gp.x_rows_divisor = k;
    }
    // The streaming kernel applies SwiGLU in its epilogue (bit for bit silu_mul's result): no gate_up round trip,
    // one launch less per layer. Not V4's clamped SwiGLU (DEEPINFER_FUSED_SWIGLU=0: the unfused pair, to compare).
    const bool fused_swiglu = fused_swiglu_ && path == Path::kStreaming && w.swiglu_limit <= 0.0f && (2 * I) % 16 == 0;
    if (fused_swiglu) {
      gp.gated = true;
      gp.y = static_cast<uint16_t*>(act.data);
    }
    check_cuda(run(gp), path == Path::kTiled   ? "moe (tiled gate_up)"
                        : path == Path::kWgmma ? "moe (wgmma gate_up)"
                        : fused_swiglu         ? "moe (grouped gate_up with SwiGLU)"
                                               : "moe (grouped gate_up)");
    if (!fused_swiglu) activate(gate_up, act);
    kc::MoeGroupedGemmParams dp =
        grouped_params(act, *w.down, offsets, expert_out, num_sms_, moe_stream_ring_, stream_);
    dp.wgmma_tile_n = wgmma_tile_n;
    dp.wgmma_swap_tokens = wgmma_swap_tokens;
    dp.tiled_order = gp.tiled_order;
    dp.weights_before_wait = early_weights_;  // the offsets were written before gate_up ran (moe_grouped.h)
    quantize(act, dp);
    check_cuda(run(dp), path == Path::kTiled   ? "moe (tiled down)"
                        : path == Path::kWgmma ? "moe (wgmma down)"
                                               : "moe (grouped down)");
  } else {
    // One GEMM per non-empty expert over its contiguous rows.
    auto per_expert = [&](const Tensor& in, const Weight& weight, const Tensor& result) {
      for (int64_t e = 0; e < E_held; ++e) {
        const int64_t begin = host_offsets[e], count = host_offsets[e + 1] - begin;
        if (count > 0)
          linear_matrix(in.rows_slice(begin, count), matrix_of(weight, e), result.rows_slice(begin, count));
      }
    };
    per_expert(permuted, *w.gate_up, gate_up);
    activate(gate_up, act);
    per_expert(act, *w.down, expert_out);
  }

  // combine: out = base + Σ_slot weight · expert_out, in float, rounded once; base may alias out, but both are
  // indexed as contiguous [T, hidden], so a strided out goes through a contiguous copy.
  join_side_lane();
  Tensor accumulated = out;
  if (!direct_out) {
    accumulated = Tensor{base + o_out, DType::kBF16, T, hidden, hidden};
    copy(out, accumulated);
  }
  kc::MoeCombineParams c;
  c.tokens = T;
  c.top_k = k;
  c.hidden = hidden;
  c.expert_out = static_cast<const uint16_t*>(expert_out.data);
  c.entry_position = position;
  c.weights = weights;
  c.base = static_cast<const uint16_t*>(accumulated.data);
  c.out = static_cast<uint16_t*>(accumulated.data);
  c.stream = stream_;
  // moe_add_rms_norm's residual add and norm in the same launch, where the matrices are contiguous bf16 rows.
  if (PendingNorm* norm = pending_norm_ ? &*pending_norm_ : nullptr;
      norm != nullptr && direct_out && norm->residual.dtype == DType::kBF16 && norm->y.dtype == DType::kBF16 &&
      norm->residual.rows == T && norm->residual.cols == hidden && norm->residual.stride == hidden &&
      norm->y.rows == T && norm->y.cols == hidden && norm->y.stride == hidden) {
    c.residual = static_cast<uint16_t*>(norm->residual.data);
    c.norm_weight = vector_bf16(*norm->weight, hidden, "moe_add_rms_norm");
    c.normed = static_cast<uint16_t*>(norm->y.data);
    c.eps = norm->eps;
    if (kc::moe_combine_norm_fits(c)) {
      check_cuda(kc::run_moe_combine(c), "moe (combine with the residual add and norm)");
      norm->done = true;
      return;
    }
    c.residual = nullptr;
    c.norm_weight = nullptr;
    c.normed = nullptr;
  }
  check_cuda(kc::run_moe_combine(c), "moe (combine)");
  if (!direct_out) copy(accumulated, out);
}

void CudaBackend::moe_add_rms_norm(const Tensor& x, const MoeWeights& w, Tensor out, Tensor residual,
                                   const Buffer& norm_weight, float eps, Tensor y) {
  bool fused = false;
  if (fused_moe_norm_) {
    pending_norm_ = PendingNorm{residual, y, &norm_weight, eps, false};
    struct Clear {
      std::optional<PendingNorm>& pending;
      ~Clear() { pending.reset(); }
    } clear{pending_norm_};
    moe(x, w, out);
    fused = pending_norm_->done;
  } else {
    moe(x, w, out);
  }
  if (!fused) add_rms_norm(residual, out, norm_weight, eps, y);
}

}  // namespace deepinfer::backend::cuda
