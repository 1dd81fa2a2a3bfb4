// The CUDA backend's device setup, memory (alloc / upload / download), error recording and synchronization, and
// make_cuda_backend. The ops live in the sibling files named in cuda_backend.h.
#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "check.h"
#include "deepinfer/kernels/cuda/moe_grouped.h"

namespace deepinfer::backend {

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) { return cuda::CudaBackend::create(device); }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: not an error of a later call
    return 0;
  }
  return count;
}

namespace cuda {
namespace {

// The index of the environment variable `name`'s value among `choices`; -1 when unset or empty; InvalidArgument
// naming the choices (and `what` they choose) for anything else.
Result<int> env_choice(const char* name, std::initializer_list<const char*> choices, const char* what) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return -1;
  std::string expected;
  int index = 0;
  for (const char* choice : choices) {
    if (std::string_view(value) == choice) return index;
    expected += (index == 0 ? "" : index + 1 == static_cast<int>(choices.size()) ? " or " : ", ") + std::string(choice);
    ++index;
  }
  return Status::invalid_argument(std::string(name) + "=" + value + ": expected " + expected + " (" + what + ")");
}

constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;  // gemm.h: plenty on Hopper
// cuBLAS's own handle: a workspace of ours, so that it never allocates one while a graph is being captured (the
// cuBLAS documentation's advice for graph capture; 32 MiB is its recommended size on Hopper).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

}  // namespace

Scratch::~Scratch() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

cudaError_t Scratch::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_ && ptr_ != nullptr) return cudaSuccess;
  if (ptr_ != nullptr) {
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) return err;
    cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  const size_t grown = bytes < 256 ? 256 : bytes + bytes / 4;  // a little headroom: fewer syncs as T varies
  if (cudaError_t err = cudaMalloc(&ptr_, grown); err != cudaSuccess) {
    ptr_ = nullptr;
    return err;
  }
  bytes_ = grown;
  return cudaSuccess;
}

Result<std::unique_ptr<Backend>> CudaBackend::create(int device) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    // Without a GPU, the runtime reports no driver as an "insufficient" one: say what it usually means.
    const bool no_driver = err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice;
    return Status::unsupported(std::string("no usable CUDA device") +
                               (no_driver ? " (no NVIDIA GPU or driver on this machine?)" : "") +
                               ": cudaGetDeviceCount: " + cuda_error_text(err));
  }
  if (count == 0) return Status::unsupported("no CUDA device found (cudaGetDeviceCount returned 0)");
  if (device < 0 || device >= count)
    return Status::invalid_argument("CUDA device " + std::to_string(device) + " does not exist (this machine has " +
                                    std::to_string(count) + ")");
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess)
    return Status::unsupported("cudaGetDeviceProperties(" + std::to_string(device) + "): " + cuda_error_text(err));
  // The kernels are built for sm_90a only (top-level CMakeLists.txt); anything else fails at the first launch.
  if (prop.major != 9 || prop.minor != 0)
    return Status::unsupported("CUDA device " + std::to_string(device) + " (" + prop.name + ") is sm_" +
                               std::to_string(prop.major) + std::to_string(prop.minor) +
                               "; this build's kernels run on sm_90 (Hopper: H100, H200) only");

  std::unique_ptr<CudaBackend> backend(new CudaBackend());
  // Forced paths for measurements and comparisons: each variable names one of its choices (in enum order).
  Result<int> moe_path = env_choice(
      "DEEPINFER_MOE_GEMM",
      {"auto", "streaming", "tiled", "per-expert", "wgmma", "wgmma-128", "wgmma-256", "wgmma-swap32", "wgmma-swap64"},
      "the routed experts' GEMM path");
  if (!moe_path.ok()) return moe_path.status();
  if (*moe_path >= 0) backend->moe_gemm_path_ = static_cast<MoeGemmPath>(*moe_path);
  Result<int> mla_form =
      env_choice("DEEPINFER_MLA_FORM", {"auto", "absorbed", "expanded"}, "MLA over a cached prefix");
  if (!mla_form.ok()) return mla_form.status();
  if (*mla_form >= 0) backend->mla_form_ = static_cast<MlaForm>(*mla_form);
  Result<int> mla_prefill =
      env_choice("DEEPINFER_MLA_PREFILL", {"wgmma", "mma", "wgmma-serial"}, "the expanded form's attention kernel");
  if (!mla_prefill.ok()) return mla_prefill.status();
  backend->mla_prefill_mma_ = *mla_prefill == 1;
  backend->mla_prefill_overlap_ = *mla_prefill != 2;
  Result<int> key_splits =
      env_choice("DEEPINFER_MLA_KEY_SPLITS", {"auto", "1", "2", "3", "4"}, "the expanded kernel's key splits");
  if (!key_splits.ok()) return key_splits.status();
  backend->mla_key_splits_ = std::max(*key_splits, 0);
  Result<int> small_linear =
      env_choice("DEEPINFER_SMALL_LINEAR", {"streaming", "cublas"}, "the dense projections at a few rows");
  if (!small_linear.ok()) return small_linear.status();
  if (*small_linear >= 0) backend->streaming_linear_ = *small_linear == 0;
  // Read by the kernels themselves (kernels/cuda/launch.cuh); checked here so that a value other than 0 or 1 is
  // refused rather than taken as "on".
  if (Result<int> pdl = env_choice("DEEPINFER_PDL", {"0", "1"}, "programmatic dependent launch: 1 on, 0 off");
      !pdl.ok())
    return pdl.status();
  Result<int> invariant = env_choice("DEEPINFER_BATCH_INVARIANT", {"0", "1"},
                                     "1: every row's result independent of the batch (slower), 0: off");
  if (!invariant.ok()) return invariant.status();
  backend->batch_invariant_ = *invariant == 1;
  Result<int> sampling = env_choice("DEEPINFER_DEVICE_SAMPLING", {"0", "1"}, "1 samples on the GPU, 0 on the host");
  if (!sampling.ok()) return sampling.status();
  if (*sampling >= 0) backend->device_sampling_ = *sampling == 1;
  Result<int> side_lane =
      env_choice("DEEPINFER_SIDE_LANE", {"0", "1"},
                 "1: at decode the shared experts beside the routed ones and kv_a beside the queries, 0: in turn");
  if (!side_lane.ok()) return side_lane.status();
  backend->side_lane_enabled_ = *side_lane != 0;
  Result<int> fused_swiglu = env_choice("DEEPINFER_FUSED_SWIGLU", {"0", "1"},
                                        "1: SwiGLU in the streaming MoE kernel's epilogue, 0: silu_mul after it");
  if (!fused_swiglu.ok()) return fused_swiglu.status();
  backend->fused_swiglu_ = *fused_swiglu != 0;
  Result<int> stream_ring = env_choice("DEEPINFER_MOE_STREAM", {"registers", "ring4", "ring6"},
                                       "how the streaming GEMM kernel keeps its weight loads in flight");
  if (!stream_ring.ok()) return stream_ring.status();
  if (*stream_ring >= 0) backend->moe_stream_ring_ = *stream_ring == 0 ? -1 : *stream_ring == 1 ? 4 : 6;
  Result<int> early = env_choice("DEEPINFER_EARLY_WEIGHTS", {"0", "1"},
                                 "1: the streaming kernel copies weights before the previous kernel ends, 0: after");
  if (!early.ok()) return early.status();
  if (*early >= 0) backend->early_weights_ = *early == 1;
  Result<int> moe_norm = env_choice("DEEPINFER_FUSED_MOE_NORM", {"0", "1"},
                                    "1: the next layer's residual add and input norm in the MoE's combine, 0: after it");
  if (!moe_norm.ok()) return moe_norm.status();
  if (*moe_norm >= 0) backend->fused_moe_norm_ = *moe_norm == 1;
  Result<int> linear_bf16 = env_choice("DEEPINFER_SMALL_LINEAR_BF16", {"0", "1", "8"},
                                       "the most rows a bf16 projection runs on the streaming kernel (0: cuBLAS)");
  if (!linear_bf16.ok()) return linear_bf16.status();
  if (*linear_bf16 >= 0) backend->streaming_linear_bf16_rows_ = *linear_bf16 == 0 ? 0 : *linear_bf16 == 1 ? 1 : 8;
  Result<int> split_pages = env_choice("DEEPINFER_MLA_SPLIT_PAGES", {"1", "2", "4"},
                                      "the fewest cache pages an MLA decode split reads (batch-invariant mode: 8)");
  if (!split_pages.ok()) return split_pages.status();
  if (*split_pages >= 0) backend->mla_split_min_pages_ = 1 << *split_pages;
  Result<int> combine_loads = env_choice("DEEPINFER_MLA_COMBINE_LOADS", {"8", "16", "32"},
                                         "partial outputs the MLA decode combine loads together");
  if (!combine_loads.ok()) return combine_loads.status();
  if (*combine_loads >= 0) backend->mla_combine_loads_ = 8 << *combine_loads;
  if (const char* keys = std::getenv("DEEPINFER_MLA_CONTEXT_CHUNK"); keys != nullptr && *keys != '\0') {
    const std::string v = keys;
    const bool digits = v.size() <= 9 && v.find_first_not_of("0123456789") == std::string::npos;
    const int64_t n = digits ? std::stoll(v) : 0;
    if (n <= 0 || n % 64 != 0)
      return Status::invalid_argument("DEEPINFER_MLA_CONTEXT_CHUNK=" + v +
                                      ": expected a positive multiple of 64 (keys per chunk of cached context)");
    backend->mla_context_chunk_ = n;
  }
  backend->device_ = device;

  backend->num_sms_ = prop.multiProcessorCount;
  auto setup_error = [&](const std::string& what, const std::string& detail) {
    return Status::internal("CUDA backend setup on device " + std::to_string(device) + ": " + what + ": " + detail);
  };
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
    return setup_error("cudaSetDevice", cuda_error_text(err));
  // The tiled MoE kernel's shared-memory limit, set here: its first launch may be inside a CUDA graph capture.
  if (cudaError_t err = kernels::cuda::init_moe_grouped_gemm_tiled(); err != cudaSuccess)
    return setup_error("the tiled MoE kernel's shared memory", cuda_error_text(err));
  if (cudaError_t err = kernels::cuda::init_moe_grouped_gemm_wgmma(); err != cudaSuccess)
    return setup_error("the wgmma MoE kernel's shared memory", cuda_error_text(err));
  // One lane's stream, cuBLAS handle with its own workspace, and cuBLASLt library (the main lane, and the side
  // lane's own set); `lane` names it in the errors.
  auto make_lane = [&](const std::string& lane, cudaStream_t& stream, cublasHandle_t& blas, void*& workspace,
                       kernels::cuda::GemmLibrary*& gemm) -> Status {
    if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); err != cudaSuccess)
      return setup_error("cudaStreamCreate" + lane, cuda_error_text(err));
    if (cublasStatus_t st = cublasCreate(&blas); st != CUBLAS_STATUS_SUCCESS)
      return setup_error("cublasCreate" + lane, cublasGetStatusString(st));
    if (cublasStatus_t st = cublasSetStream(blas, stream); st != CUBLAS_STATUS_SUCCESS)
      return setup_error("cublasSetStream" + lane, cublasGetStatusString(st));
    // After cublasSetStream, which resets the handle to the default workspace pool.
    if (cudaError_t err = cudaMalloc(&workspace, kCublasWorkspaceBytes); err != cudaSuccess)
      return setup_error("cudaMalloc (cuBLAS workspace)" + lane, cuda_error_text(err));
    if (cublasStatus_t st = cublasSetWorkspace(blas, workspace, kCublasWorkspaceBytes); st != CUBLAS_STATUS_SUCCESS)
      return setup_error("cublasSetWorkspace" + lane, cublasGetStatusString(st));
    kernels::cuda::GemmStatus gemm_status;
    gemm = kernels::cuda::gemm_library_create(kCublasLtWorkspaceBytes, &gemm_status);
    if (gemm == nullptr)
      return setup_error("gemm_library_create" + lane + ": " + gemm_status.where,
                         gemm_status.cuda != cudaSuccess ? cuda_error_text(gemm_status.cuda)
                                                         : "cuBLAS status " + std::to_string(gemm_status.cublas));
    return Status();
  };
  if (Status s = make_lane("", backend->stream_, backend->blas_, backend->blas_workspace_, backend->gemm_); !s.ok())
    return s;
  if (cudaError_t err = cudaEventCreateWithFlags(&backend->staging_copied_, cudaEventDisableTiming); err != cudaSuccess)
    return setup_error("cudaEventCreate", cuda_error_text(err));
  if (backend->side_lane_enabled_) {
    SideLane& side = backend->side_;
    if (Status s = make_lane(" (side lane)", side.stream, side.blas, side.blas_workspace, side.gemm); !s.ok()) return s;
    for (cudaEvent_t* event : {&side.fork, &side.join}) {
      if (cudaError_t err = cudaEventCreateWithFlags(event, cudaEventDisableTiming); err != cudaSuccess)
        return setup_error("cudaEventCreate (side lane)", cuda_error_text(err));
    }
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

// The side lane's resources trade places with the main lane's: every op queues on whichever is in the members.
void CudaBackend::swap_lanes() {
  std::swap(stream_, side_.stream);
  std::swap(blas_, side_.blas);
  std::swap(blas_workspace_, side_.blas_workspace);
  std::swap(gemm_, side_.gemm);
  gemm_in_.swap(side_.gemm_in);
  gemm_out_.swap(side_.gemm_out);
  gemm_staging_.swap(side_.gemm_staging);
  rowwise_.swap(side_.rowwise);
}

// The fork and join run even after a failed op: a capture must end with the side stream joined.
void CudaBackend::begin_side_lane() {
  if (!side_lane_enabled_) return;
  if (lane_state_ == LaneState::kOpen) {
    fail(Status::invalid_argument("begin_side_lane: the side lane is already open"));
    return;
  }
  activate();
  join_side_lane();  // one lane's work at a time
  check_cuda(cudaEventRecord(side_.fork, stream_), "begin_side_lane (cudaEventRecord)");
  check_cuda(cudaStreamWaitEvent(side_.stream, side_.fork, 0), "begin_side_lane (cudaStreamWaitEvent)");
  swap_lanes();
  lane_state_ = LaneState::kOpen;
}

void CudaBackend::end_side_lane() {
  if (lane_state_ != LaneState::kOpen) return;
  check_cuda(cudaEventRecord(side_.join, stream_), "end_side_lane (cudaEventRecord)");
  swap_lanes();
  lane_state_ = LaneState::kPending;
}

void CudaBackend::join_side_lane() {
  if (lane_state_ == LaneState::kOpen) end_side_lane();
  if (lane_state_ != LaneState::kPending) return;
  check_cuda(cudaStreamWaitEvent(stream_, side_.join, 0), "join_side_lane (cudaStreamWaitEvent)");
  lane_state_ = LaneState::kNone;
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (lane_state_ == LaneState::kOpen) swap_lanes();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (side_.stream != nullptr) cudaStreamSynchronize(side_.stream);
  if (side_.gemm != nullptr) kernels::cuda::gemm_library_destroy(side_.gemm);
  if (side_.blas != nullptr) cublasDestroy(side_.blas);
  if (side_.blas_workspace != nullptr) cudaFree(side_.blas_workspace);
  for (cudaEvent_t event : {side_.fork, side_.join}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  for (auto& [key, graph] : graphs_) destroy_graph(graph);
  free_descriptor_arenas();
  if (gemm_ != nullptr) kernels::cuda::gemm_library_destroy(gemm_);
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (blas_workspace_ != nullptr) cudaFree(blas_workspace_);
  if (staging_ != nullptr) cudaFreeHost(staging_);
  if (moe_offsets_host_ != nullptr) cudaFreeHost(moe_offsets_host_);
  if (pinned_host_ != nullptr) cudaFreeHost(pinned_host_);
  for (int h = 0; h < 2; ++h) {
    if (copy_staging_[h] != nullptr) cudaFreeHost(copy_staging_[h]);
    if (copy_staged_[h] != nullptr) cudaEventDestroy(copy_staged_[h]);
  }
  if (staging_copied_ != nullptr) cudaEventDestroy(staging_copied_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (side_.stream != nullptr) cudaStreamDestroy(side_.stream);
}

void CudaBackend::fail(Status status) {
  if (sticky_.ok()) sticky_ = std::move(status);
}

void CudaBackend::check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that later checks report their own
  fail(Status::internal(std::string("CUDA backend: ") + what + ": " + cuda_error_text(err)));
}

void CudaBackend::check_blas(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail(Status::internal(std::string("CUDA backend: ") + what + ": " + cublasGetStatusString(status)));
}

void CudaBackend::check_gemm(const kernels::cuda::GemmStatus& status, const char* what) {
  if (status.ok()) return;
  if (status.cuda != cudaSuccess) {
    cudaGetLastError();
    fail(Status::internal(std::string("CUDA backend: ") + what + " (" + status.where +
                          "): " + cuda_error_text(status.cuda)));
  } else {
    fail(Status::internal(std::string("CUDA backend: ") + what + " (" + status.where +
                          "): " + cublasGetStatusString(static_cast<cublasStatus_t>(status.cublas))));
  }
}

Status CudaBackend::take_sticky() {
  Status status = std::move(sticky_);
  sticky_ = Status();
  return status;
}

char* CudaBackend::reserve(Scratch& scratch, size_t bytes) {
  if (capturing_ && !scratch.fits(bytes)) {
    // Growing would synchronize the capturing stream and move memory the graph is baking in. The key's warm-up
    // run reserved the same sizes, so this is a bug (an op whose scratch depends on more than the key).
    fail(Status::internal("CUDA backend: a scratch buffer of " + std::to_string(scratch.capacity()) +
                          " bytes must grow to " + std::to_string(bytes) + " during a graph capture"));
    return nullptr;
  }
  const size_t capacity = scratch.capacity();
  if (cudaError_t err = scratch.reserve(bytes, stream_); err != cudaSuccess) {
    ++buffers_generation_;  // a failed allocation comes after freeing the old memory
    cudaGetLastError();
    fail(Status::resource_exhausted("CUDA backend: scratch of " + std::to_string(bytes) + " bytes on device " +
                                    std::to_string(device_) + ": " + cudaGetErrorString(err)));
    return nullptr;
  }
  if (scratch.capacity() != capacity) ++buffers_generation_;
  return scratch.data();
}

bool CudaBackend::note_host_synchronization(const char* what) {
  if (capturing_) {
    fail(Status::internal(std::string("CUDA backend: ") + what +
                          " waits for the device on the host, which a graph capture cannot hold"));
    return false;
  }
  host_synchronized_ = true;
  return true;
}

void CudaBackend::activate() { check_cuda(cudaSetDevice(device_), "cudaSetDevice"); }

Status CudaBackend::upload_now(const void* host, size_t bytes, void* device_dst) {
  cudaError_t err = cudaMemcpyAsync(device_dst, host, bytes, cudaMemcpyHostToDevice, stream_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::internal("CUDA backend: upload of " + std::to_string(bytes) + " bytes: " + cuda_error_text(err));
  }
  return Status();
}

Result<Buffer> CudaBackend::alloc(size_t bytes) {
  activate();
  Buffer buffer;
  if (bytes == 0) return buffer;
  void* ptr = nullptr;
  if (cudaError_t err = cudaMalloc(&ptr, bytes); err != cudaSuccess) {
    cudaGetLastError();
    return Status::resource_exhausted("cudaMalloc of " + std::to_string(bytes) + " bytes on CUDA device " +
                                      std::to_string(device_) + ": " + cudaGetErrorString(err));
  }
  buffer.storage = std::shared_ptr<void>(ptr, [](void* p) { cudaFree(p); });
  buffer.bytes = bytes;
  // Zero-filled in stream order: every later op and copy of this backend runs after it.
  if (cudaError_t err = cudaMemsetAsync(ptr, 0, bytes, stream_); err != cudaSuccess) {
    cudaGetLastError();
    return Status::internal("cudaMemsetAsync of a new " + std::to_string(bytes) +
                            "-byte buffer: " + cuda_error_text(err));
  }
  return buffer;
}

Status CudaBackend::upload(const void* host, size_t bytes, const Buffer& dst, size_t dst_offset) {
  BACKEND_CHECK(!capturing_, "upload inside run_graph's ops");
  BACKEND_CHECK(dst_offset <= dst.bytes && bytes <= dst.bytes - dst_offset,
                "upload of " + std::to_string(bytes) + " bytes at offset " + std::to_string(dst_offset) +
                    " into a buffer of " + std::to_string(dst.bytes));
  if (bytes == 0) return Status();
  activate();
  if (Status s = upload_now(host, bytes, static_cast<char*>(dst.data()) + dst_offset); !s.ok()) fail(std::move(s));
  return synchronize();
}

Status CudaBackend::download(const Buffer& src, size_t src_offset, size_t bytes, void* host) {
  BACKEND_CHECK(!capturing_, "download inside run_graph's ops");
  BACKEND_CHECK(src_offset <= src.bytes && bytes <= src.bytes - src_offset,
                "download of " + std::to_string(bytes) + " bytes at offset " + std::to_string(src_offset) +
                    " from a buffer of " + std::to_string(src.bytes));
  if (bytes == 0) return Status();
  activate();
  check_cuda(
      cudaMemcpyAsync(host, static_cast<const char*>(src.data()) + src_offset, bytes, cudaMemcpyDeviceToHost, stream_),
      "download (cudaMemcpyAsync)");
  check_cuda(cudaStreamSynchronize(stream_), "download (cudaStreamSynchronize)");
  return synchronize();
}

Status CudaBackend::reserve_copy_staging() {
  for (int h = 0; h < 2; ++h) {
    if (copy_staging_[h] == nullptr) {
      void* p = nullptr;
      if (cudaError_t err = cudaHostAlloc(&p, kCopyStagingHalf, cudaHostAllocDefault); err != cudaSuccess) {
        cudaGetLastError();
        return Status::resource_exhausted("pinned staging of " + std::to_string(kCopyStagingHalf) +
                                          " bytes for batched copies: " + cuda_error_text(err));
      }
      copy_staging_[h] = static_cast<std::byte*>(p);
    }
    if (copy_staged_[h] == nullptr) {
      if (cudaError_t err = cudaEventCreateWithFlags(&copy_staged_[h], cudaEventDisableTiming); err != cudaSuccess) {
        cudaGetLastError();
        return Status::internal("cudaEventCreate for batched copies: " + cuda_error_text(err));
      }
    }
  }
  return Status();
}

// Queues copies on `stream` with one cudaMemcpyBatchAsync (a call per copy costs a few microseconds; a KV block is
// one 70-KiB region per layer). Every copy's source is read in stream order.
cudaError_t CudaBackend::queue_copies(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                                      std::vector<size_t>& sizes) {
  if (dsts.empty()) return cudaSuccess;
  cudaMemcpyAttributes attrs{};
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first = 0;
  const cudaError_t err =
      cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attrs, &first, 1, stream_);
  dsts.clear();
  srcs.clear();
  sizes.clear();
  return err;
}

namespace {
// Copies the pieces of a staging round between pinned and pageable memory on a few host threads (one thread copies
// ~10 GB/s; the DMA into the staging runs at ~55).
struct HostPiece {
  std::byte* to;
  const std::byte* from;
  size_t bytes;
};
void copy_pieces(const std::vector<HostPiece>& pieces) {
  const int n = static_cast<int>(pieces.size());
#pragma omp parallel for num_threads(std::min(n, 8)) schedule(dynamic, 1) if (n >= 4)
  for (int i = 0; i < n; ++i) std::memcpy(pieces[i].to, pieces[i].from, pieces[i].bytes);
}
}  // namespace

// Round by round: a half is filled with device -> staging copies on the stream and its event recorded; then the
// other half, whose copies were queued one round earlier, is waited for and scattered into the host memory. So the
// DMA of one round runs while the CPU copies out the round before. (One cudaMemcpyBatchAsync straight into the
// pageable memory, staged by the driver, ran at 1.7-2 GB/s on the H200 machine against this path's 25-27: NOTES.md.)
Status CudaBackend::download_batch(std::span<const DownloadRegion> regions) {
  BACKEND_CHECK(!capturing_, "download_batch inside run_graph's ops");
  for (const DownloadRegion& r : regions) {
    BACKEND_CHECK(r.src != nullptr && r.src_offset <= r.src->bytes && r.bytes <= r.src->bytes - r.src_offset,
                  "download_batch: a region of " + std::to_string(r.bytes) + " bytes at offset " +
                      std::to_string(r.src_offset) + " outside its buffer");
  }
  activate();
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  if (Status s = reserve_copy_staging(); !s.ok()) return s;
  std::vector<HostPiece> pieces[2];
  auto close_round = [&](int h) {
    check_cuda(queue_copies(dsts, srcs, sizes), "download_batch (cudaMemcpyBatchAsync)");
    check_cuda(cudaEventRecord(copy_staged_[h], stream_), "download_batch (cudaEventRecord)");
  };
  auto scatter = [&](int h) {
    if (pieces[h].empty() || failed()) return;
    check_cuda(cudaEventSynchronize(copy_staged_[h]), "download_batch (cudaEventSynchronize)");
    if (failed()) return;
    copy_pieces(pieces[h]);
    pieces[h].clear();
  };
  int half = 0;
  size_t used = 0;
  for (const DownloadRegion& r : regions) {
    const auto* src = static_cast<const std::byte*>(r.src->data()) + r.src_offset;
    for (size_t done = 0; done < r.bytes && !failed();) {
      if (used == kCopyStagingHalf) {
        close_round(half);
        half ^= 1;
        used = 0;
        scatter(half);
      }
      const size_t n = std::min(r.bytes - done, kCopyStagingHalf - used);
      dsts.push_back(copy_staging_[half] + used);
      srcs.push_back(src + done);
      sizes.push_back(n);
      pieces[half].push_back({static_cast<std::byte*>(r.host) + done, copy_staging_[half] + used, n});
      used += n;
      done += n;
    }
  }
  if (!failed()) close_round(half);
  scatter(half ^ 1);
  scatter(half);
  return synchronize();
}

// Round by round: the host bytes are gathered into a half (after that half's previous round of copies has read it)
// and its staging -> device copies queued; one synchronization at the end.
Status CudaBackend::upload_batch(std::span<const UploadRegion> regions) {
  BACKEND_CHECK(!capturing_, "upload_batch inside run_graph's ops");
  for (const UploadRegion& r : regions) {
    BACKEND_CHECK(r.dst != nullptr && r.dst_offset <= r.dst->bytes && r.bytes <= r.dst->bytes - r.dst_offset,
                  "upload_batch: a region of " + std::to_string(r.bytes) + " bytes at offset " +
                      std::to_string(r.dst_offset) + " outside its buffer");
  }
  activate();
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  if (Status s = reserve_copy_staging(); !s.ok()) return s;
  std::vector<HostPiece> pieces;
  bool queued[2] = {false, false};
  int half = 0;
  size_t used = 0;
  auto close_round = [&](int h) {
    copy_pieces(pieces);
    pieces.clear();
    check_cuda(queue_copies(dsts, srcs, sizes), "upload_batch (cudaMemcpyBatchAsync)");
    check_cuda(cudaEventRecord(copy_staged_[h], stream_), "upload_batch (cudaEventRecord)");
    queued[h] = true;
  };
  for (const UploadRegion& r : regions) {
    auto* dst = static_cast<std::byte*>(r.dst->data()) + r.dst_offset;
    for (size_t done = 0; done < r.bytes && !failed();) {
      if (used == kCopyStagingHalf) {
        close_round(half);
        half ^= 1;
        used = 0;
        if (queued[half]) check_cuda(cudaEventSynchronize(copy_staged_[half]), "upload_batch (cudaEventSynchronize)");
        if (failed()) break;
      }
      const size_t n = std::min(r.bytes - done, kCopyStagingHalf - used);
      pieces.push_back({copy_staging_[half] + used, static_cast<const std::byte*>(r.host) + done, n});
      dsts.push_back(dst + done);
      srcs.push_back(copy_staging_[half] + used);
      sizes.push_back(n);
      used += n;
      done += n;
    }
  }
  if (!failed()) close_round(half);
  return synchronize();
}

// The limits of the kernels the ops dispatch to (fused_ops.h, mla_generic.h, mla_decode.h), checked before a
// model's weights are read rather than by an abort at its first step.
Status CudaBackend::check_model_shapes(const ModelShapes& m) const {
  auto limit = [](bool ok, const std::string& what) {
    return ok ? Status() : Status::unsupported("the CUDA backend cannot run this model: " + what);
  };
  Status s;
  if (!(s = limit(m.kv_lora_rank > 0 && m.kv_lora_rank + m.rope_dim <= 1024,
                  "kv_lora_rank + qk_rope_head_dim = " + std::to_string(m.kv_lora_rank + m.rope_dim) +
                      " (the attention kernels take up to 1024)")).ok()) {
    return s;
  }
  if (!(s = limit(m.rope_dim % 2 == 0 && m.rope_dim <= 256,
                  "qk_rope_head_dim " + std::to_string(m.rope_dim) + " (even, up to 256)")).ok()) {
    return s;
  }
  if (!(s = limit(m.num_heads >= 1 && m.num_heads <= 65535,
                  std::to_string(m.num_heads) + " attention heads (up to 65535)")).ok()) {
    return s;
  }
  if (m.num_experts == 0) return Status();
  if (!(s = limit(m.num_experts <= 512 && m.top_k >= 1 && m.top_k <= 32 && m.top_k <= m.num_experts,
                  std::to_string(m.num_experts) + " routed experts, top " + std::to_string(m.top_k) +
                      " (the routing kernel takes up to 512 experts and top 32)")).ok()) {
    return s;
  }
  return limit(m.n_group >= 1 && m.n_group <= 32 && m.num_experts % m.n_group == 0,
               "n_group " + std::to_string(m.n_group) + " (up to 32, dividing the experts)");
}

Result<Backend::DeviceMemory> CudaBackend::device_memory() {
  activate();
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) {
    cudaGetLastError();
    return Status::internal(std::string("cudaMemGetInfo: ") + cudaGetErrorString(err));
  }
  return DeviceMemory{static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes)};
}

Status CudaBackend::synchronize() {
  BACKEND_CHECK(!capturing_, "synchronize inside run_graph's ops");
  activate();
  join_side_lane();  // everything queued so far, the side lane's too
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  check_cuda(cudaGetLastError(), "a kernel of this step");
  return take_sticky();
}

}  // namespace cuda
}  // namespace deepinfer::backend
