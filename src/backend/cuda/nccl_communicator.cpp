// Collectives over NCCL on the CUDA backend's stream (communicator.h's make_nccl_communicator). Device tensors go to
// NCCL as they are; host bytes are staged through a device buffer that grows to the largest seen.
#include <nccl.h>

#include <atomic>
#include <cstring>

#include "cuda_backend.h"
#include "deepinfer/backend/communicator.h"

namespace deepinfer::backend {
namespace {

ncclDataType_t nccl_type(DType dtype) { return dtype == DType::kBF16 ? ncclBfloat16 : ncclFloat32; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(cuda::CudaBackend& backend, ncclComm_t comm, int rank, int size, std::string name)
      : backend_(backend), comm_(comm), rank_(rank), size_(size), name_(std::move(name)) {}
  ~NcclCommunicator() override {
    if (staging_ != nullptr) cudaFree(staging_);
    ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status status() const override { return status_; }
  bool failed() const override { return failed_.load(); }

  void all_reduce_sum(Tensor x) override {
    if (!contiguous(x, "all_reduce_sum") || x.rows * x.cols == 0) return;
    check(ncclAllReduce(x.data, x.data, static_cast<size_t>(x.rows * x.cols), nccl_type(x.dtype), ncclSum, comm_,
                        backend_.stream()),
          "all_reduce");
  }

  void all_gather_rows(const Tensor& in, Tensor out) override {
    if (!contiguous(in, "all_gather_rows") || !contiguous(out, "all_gather_rows")) return;
    check(ncclAllGather(in.data, out.data, static_cast<size_t>(in.rows * in.cols), nccl_type(in.dtype), comm_,
                        backend_.stream()),
          "all_gather");
  }

  void reduce_scatter_rows(const Tensor& in, Tensor out) override {
    if (!contiguous(in, "reduce_scatter_rows") || !contiguous(out, "reduce_scatter_rows")) return;
    check(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.rows * out.cols), nccl_type(in.dtype), ncclSum,
                            comm_, backend_.stream()),
          "reduce_scatter");
  }

  void all_to_all_rows(const Tensor& in, std::span<const int64_t> send_rows, Tensor out,
                       std::span<const int64_t> recv_rows) override {
    if (!contiguous(in, "all_to_all_rows") || !contiguous(out, "all_to_all_rows")) return;
    const size_t element = dtype_size(in.dtype);
    size_t send_at = 0, recv_at = 0;
    if (!check(ncclGroupStart(), "all_to_all")) return;
    for (int q = 0; q < size_; ++q) {
      const size_t send_n = static_cast<size_t>(send_rows[q] * in.cols), recv_n = static_cast<size_t>(recv_rows[q] * out.cols);
      if (send_n > 0) {
        check(ncclSend(static_cast<const char*>(in.data) + send_at * element, send_n, nccl_type(in.dtype), q, comm_,
                       backend_.stream()),
              "all_to_all (send)");
      }
      if (recv_n > 0) {
        check(ncclRecv(static_cast<char*>(out.data) + recv_at * element, recv_n, nccl_type(out.dtype), q, comm_,
                       backend_.stream()),
              "all_to_all (recv)");
      }
      send_at += send_n;
      recv_at += recv_n;
    }
    check(ncclGroupEnd(), "all_to_all");
  }

  void all_to_all_counts(std::span<const int64_t> send, std::span<int64_t> recv) override {
    const size_t bytes = static_cast<size_t>(size_) * sizeof(int64_t);
    char* staging = stage(2 * bytes);
    if (staging == nullptr) return;
    cuda_check(cudaMemcpyAsync(staging, send.data(), bytes, cudaMemcpyHostToDevice, backend_.stream()), "counts in");
    if (!check(ncclGroupStart(), "all_to_all_counts")) return;
    for (int q = 0; q < size_; ++q) {
      check(ncclSend(staging + q * sizeof(int64_t), 1, ncclInt64, q, comm_, backend_.stream()), "all_to_all_counts");
      check(ncclRecv(staging + bytes + q * sizeof(int64_t), 1, ncclInt64, q, comm_, backend_.stream()),
            "all_to_all_counts");
    }
    check(ncclGroupEnd(), "all_to_all_counts");
    cuda_check(cudaMemcpyAsync(recv.data(), staging + bytes, bytes, cudaMemcpyDeviceToHost, backend_.stream()),
               "counts out");
    cuda_check(cudaStreamSynchronize(backend_.stream()), "all_to_all_counts");
  }

  void broadcast_host(std::span<std::byte> bytes, int root) override {
    if (bytes.empty()) return;
    char* staging = stage(bytes.size());
    if (staging == nullptr) return;
    if (rank_ == root) {
      cuda_check(cudaMemcpyAsync(staging, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, backend_.stream()),
                 "broadcast in");
    }
    check(ncclBroadcast(staging, staging, bytes.size(), ncclUint8, root, comm_, backend_.stream()), "broadcast");
    if (rank_ != root) {
      cuda_check(cudaMemcpyAsync(bytes.data(), staging, bytes.size(), cudaMemcpyDeviceToHost, backend_.stream()),
                 "broadcast out");
    }
    cuda_check(cudaStreamSynchronize(backend_.stream()), "broadcast");
  }
  void broadcast_host_waiting(std::span<std::byte> bytes, int root) override { broadcast_host(bytes, root); }

  void broadcast(Tensor x, int root) override {
    if (!contiguous(x, "broadcast")) return;
    check(ncclBroadcast(x.data, x.data, static_cast<size_t>(x.rows * x.cols), nccl_type(x.dtype), root, comm_,
                        backend_.stream()),
          "broadcast");
  }

  void barrier() override {
    char* staging = stage(sizeof(float));
    if (staging == nullptr) return;
    check(ncclAllReduce(staging, staging, 1, ncclFloat32, ncclSum, comm_, backend_.stream()), "barrier");
    cuda_check(cudaStreamSynchronize(backend_.stream()), "barrier");
  }

 private:
  bool contiguous(const Tensor& t, const char* what) {
    if (t.rows <= 1 || t.stride == t.cols) return true;
    fail(std::string(what) + " needs a contiguous tensor");
    return false;
  }
  void fail(const std::string& message) {
    if (status_.ok()) status_ = Status::internal(name_ + " rank " + std::to_string(rank_) + ": " + message);
    failed_ = true;
  }
  bool check(ncclResult_t result, const char* what) {
    if (result == ncclSuccess) return true;
    fail(std::string(what) + ": " + ncclGetErrorString(result) + " (" + ncclGetLastError(comm_) + ")");
    return false;
  }
  bool cuda_check(cudaError_t result, const char* what) {
    if (result == cudaSuccess) return true;
    fail(std::string(what) + ": " + cudaGetErrorString(result));
    return false;
  }
  char* stage(size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_ != nullptr) cudaFree(staging_);
      staging_ = nullptr;
      staging_bytes_ = 0;
      if (!cuda_check(cudaMalloc(&staging_, bytes), "staging buffer")) return nullptr;
      staging_bytes_ = bytes;
    }
    return static_cast<char*>(staging_);
  }

  cuda::CudaBackend& backend_;
  ncclComm_t comm_;
  int rank_, size_;
  std::string name_;
  Status status_;
  std::atomic<bool> failed_{false};
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Backend& backend, TcpStore& store, const std::string& prefix,
                                                             int rank, int size, std::chrono::milliseconds timeout) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) {
    return Status::unsupported("NCCL group '" + prefix + "': the " + std::string(backend.name()) +
                               " backend is not CUDA (the CPU's collectives are Gloo's)");
  }
  const std::string key = prefix + "/nccl_unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return Status::internal("NCCL group '" + prefix + "': ncclGetUniqueId: " + ncclGetErrorString(r));
    }
    Status s = store.set(key, std::as_bytes(std::span(id.internal)));
    if (!s.ok()) return s;
  } else {
    Result<std::vector<std::byte>> value = store.get(key, timeout);
    if (!value.ok()) return value.status();
    if (value->size() != sizeof(id.internal)) return Status::internal("NCCL group '" + prefix + "': a bad unique id");
    std::memcpy(id.internal, value->data(), sizeof(id.internal));
  }
  if (cudaError_t e = cudaSetDevice(cuda_backend->device()); e != cudaSuccess) {
    return Status::internal("NCCL group '" + prefix + "': cudaSetDevice: " + cudaGetErrorString(e));
  }
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = ncclCommInitRank(&comm, size, id, rank); r != ncclSuccess) {
    return Status::internal("NCCL group '" + prefix + "' rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            ": ncclCommInitRank: " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(*cuda_backend, comm, rank, size, "NCCL group '" + prefix + "'"));
}

}  // namespace deepinfer::backend
