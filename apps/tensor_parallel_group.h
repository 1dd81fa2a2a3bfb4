// The processes of `deepinfer serve --tensor-parallel-size N`: rank 0 is the server; it serves the rendezvous store
// (torchrun's TCPStore role) on --master-addr:--master-port, starts ranks 1..N-1 as copies of its own command line
// with --internal-tp-rank, and supervises them: a rank that dies (non-zero exit or a signal) takes the server down
// with an error naming it (exit 1, within a second). The ranks follow rank 0's model (DeepSeekModel::follow) and
// die with it (PR_SET_PDEATHSIG).
// Several hosts (--nnodes N --node-rank R, as torchrun / SGLang spell them): the group's ranks are split evenly
// over the hosts, host R holding ranks R*L .. R*L+L-1 (L = size / N). Host 0 runs rank 0 as above, starting its
// L-1 local ranks; on host R > 0 the process the user starts is rank R*L, a "node leader": it joins the group at
// --master-addr:--master-port (given explicitly), starts and supervises its own L-1 local ranks the same way, and
// follows rank 0's model. Every rank listens for the collectives on the local address that routes to the master
// (a connected UDP socket's name: the interface the other hosts reach this one through). Hosts watch each other
// through heartbeats in the store (a connection of their own): a node leader sets its key every second, and exits 1
// (its ranks with it) when the store is gone (rank 0 died); rank 0 exits 1 when a host's key has not moved for
// kHostTimeout (5 s): its node leader died, or one of its ranks (the node leader exits then).
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
  // Rank 0: serves the store, starts ranks 1 .. local_size-1 (this process's command line plus --internal-tp-rank R
  // --master-port P; local_size = size on one host), joins the group. Errors: the store's port, a rank that could
  // not start, the rendezvous.
  static Result<std::unique_ptr<TensorParallelGroup>> lead(int size, int local_size, const std::string& master_addr,
                                                           int master_port);
  // A rank another process started (--internal-tp-rank r): joins the group at master_addr:master_port; dies when
  // its parent (rank 0 or its host's node leader) does.
  static Result<std::unique_ptr<TensorParallelGroup>> join(int rank, int size, const std::string& master_addr,
                                                           int master_port);
  // Host R > 0's first rank (rank = R * local_size), started by the user: starts ranks rank+1 .. rank+local_size-1
  // like rank 0 does, supervises them (one that dies: exit 1), joins the group. Errors: the store unreachable within
  // 60 s, a rank that could not start, the rendezvous.
  static Result<std::unique_ptr<TensorParallelGroup>> lead_node(int rank, int size, int local_size,
                                                                const std::string& master_addr, int master_port);
  // A process that started ranks: waits for them to exit (after the model's stop command), up to 10 s, then kills
  // them.
  ~TensorParallelGroup();

  backend::Communicator& communicator() { return *comm_; }
  backend::TcpStore& store() { return *store_; }
  int rank() const { return rank_; }

 private:
  TensorParallelGroup() = default;
  // Starts ranks first .. last-1 as copies of this process's command line (+ --internal-tp-rank, --master-*).
  Status spawn(int first, int last, const std::string& master_addr, int master_port);
  // What lead() and lead_node() share once the store is reached: start ranks first .. last-1, supervise them, join
  // the group's collectives listening on interface_host.
  Status start_ranks_and_join(int first, int last, int size, const std::string& master_addr, int master_port,
                              const std::string& interface_host);
  void supervise();
  // Kills the ranks this process started and exits 1 (the group cannot run on).
  [[noreturn]] void abort_group();

  int rank_ = 0;
  std::unique_ptr<backend::TcpStore> store_;
  std::unique_ptr<backend::TcpStore> heartbeat_;  // several hosts: a store connection for heartbeats only
  int nnodes_ = 1, local_size_ = 1;
  std::unique_ptr<backend::Communicator> comm_;
  std::vector<pid_t> children_;
  std::vector<int> child_ranks_;  // the rank of each child
  std::atomic<bool> stopping_{false};
  std::atomic<bool> comm_ready_{false};  // comm_ is set (the supervisor starts before the rendezvous ends)
  std::thread supervisor_;
};

}  // namespace deepinfer::apps
