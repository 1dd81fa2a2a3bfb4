// make_cuda_backend in a build without CUDA (DEEPINFER_CUDA=OFF): links, and says how to get the real one.
#include "deepinfer/backend/backend.h"
#include "deepinfer/backend/communicator.h"

namespace deepinfer::backend {

Result<std::unique_ptr<Backend>> make_cuda_backend(int /*device*/) {
  return Status::unsupported("this build has no CUDA backend (configure with DEEPINFER_CUDA=ON and CUDA 13)");
}

int cuda_device_count() { return 0; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Backend&, TcpStore&, const std::string&, int, int,
                                                             std::chrono::milliseconds) {
  return Status::unsupported("this build has no NCCL communicator (configure with DEEPINFER_CUDA=ON and CUDA 13)");
}

}  // namespace deepinfer::backend
