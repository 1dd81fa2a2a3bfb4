// The processes of `deepinfer serve --tensor-parallel-size N`: rank 0 is the server; it serves the rendezvous store
// (torchrun's TCPStore role) on --master-addr:--master-port, starts ranks 1..N-1 as copies of its own command line
// with --internal-tp-rank, and supervises them: a rank that dies (non-zero exit or a signal) takes the server down
// with an error naming it (exit 1, within a second). The ranks follow rank 0's model (DeepSeekModel::follow) and
// die with it (PR_SET_PDEATHSIG). One host; --nnodes/--node-rank are not in this build.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/backend/communicator.h"
#include "deepinfer/core/status.h"

namespace deepinfer::apps {

class TensorParallelGroup {
 public:
  // Rank 0: serves the store, starts the other ranks (this process's command line plus --internal-tp-rank R
  // --master-port P), joins the group. Errors: the store's port, a rank that could not start, the rendezvous.
  static Result<std::unique_ptr<TensorParallelGroup>> lead(int size, const std::string& master_addr, int master_port);
  // Rank r > 0: joins the group at master_addr:master_port; dies when its parent (rank 0) does.
  static Result<std::unique_ptr<TensorParallelGroup>> join(int rank, int size, const std::string& master_addr,
                                                           int master_port);
  // Rank 0: waits for the other ranks to exit (after the model's stop command), up to 10 s, then kills them.
  ~TensorParallelGroup();

  backend::Communicator& communicator() { return *comm_; }
  backend::TcpStore& store() { return *store_; }
  int rank() const { return rank_; }

 private:
  TensorParallelGroup() = default;
  void supervise();

  int rank_ = 0;
  std::unique_ptr<backend::TcpStore> store_;
  std::unique_ptr<backend::Communicator> comm_;
  std::vector<pid_t> children_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> comm_ready_{false};  // comm_ is set (the supervisor starts before the rendezvous ends)
  std::thread supervisor_;
};

}  // namespace deepinfer::apps
