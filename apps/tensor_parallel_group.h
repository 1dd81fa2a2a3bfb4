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
// (a connected UDP socket's name: the interface the other hosts reach this one through).
// A node leader first claims its --node-rank in the store (an atomic add: a second process with the same --node-rank
// is refused, naming it) and publishes its shape (GroupShape); a shape other than node 0's is refused on both sides,
// naming the flag and both values, before any collective starts. Then the hosts watch each other through heartbeats
// in the store, every second, on a connection and a thread of their own: rank 0 exits 1 when a host's key has not
// moved for kHostTimeout (5 s) (its node leader died or is stopped) or when the host says it left (its node leader got
// SIGTERM, or one of its ranks died); a node leader exits 1 (its ranks with it) when rank 0's key has not moved, or
// the store has not answered, for kHostTimeout (rank 0 stopped or hung), or when the store is gone (rank 0 died).
// SIGTERM, SIGINT or SIGHUP to a node leader: it says so in the store, kills its ranks and exits 0; rank 0 then stops
// the server, naming the host. Before rank 0 exits on a group failure, the server's live requests end with an error
// event naming it (watch_requests).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "deepinfer/backend/communicator.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/engine_client.h"

namespace deepinfer::apps {

// The local address this host reaches `host` from: the name of a UDP socket connected to it (no packet is sent).
// A group's collectives listen there, so the other hosts' ranks can connect back. Errors: InvalidArgument (an
// address that does not resolve), IoError (no route).
Result<std::string> local_address_toward(const std::string& host, int port);

// What every host of a group must agree on: each node leader publishes its own in the store when it joins, and a
// difference from node 0's is reported on both sides naming the flag and both values.
struct GroupShape {
  int size = 1;        // --tensor-parallel-size
  int nnodes = 1;      // --nnodes
  int local_size = 1;  // ranks on each host (size / nnodes)
  std::string model;   // the checkpoint's fingerprint (hex); empty: not compared
  std::vector<std::string> rank_args;  // appended to the command line of the ranks this process starts
};

class LiveRequests;

class TensorParallelGroup {
 public:
  // Rank 0: serves the store, starts ranks 1 .. shape.local_size-1 (this process's command line plus
  // --internal-tp-rank R --master-port P), joins the group. Errors: the store's port, a rank that could not start, the
  // rendezvous. A host whose shape differs from `shape` while the ranks meet: exit 1 naming it.
  static Result<std::unique_ptr<TensorParallelGroup>> lead(const GroupShape& shape, const std::string& master_addr,
                                                           int master_port);
  // A rank another process started (--internal-tp-rank r): joins the group at master_addr:master_port; dies when
  // its parent (rank 0 or its host's node leader) does.
  static Result<std::unique_ptr<TensorParallelGroup>> join(int rank, int size, const std::string& master_addr,
                                                           int master_port);
  // Host node_rank > 0's first rank (rank = node_rank * local_size), started by the user: claims node_rank, checks
  // its shape against node 0's, starts ranks rank+1 .. rank+local_size-1 like rank 0 does, supervises them (one that
  // dies: exit 1), joins the group. Errors: the store unreachable within 60 s, node_rank claimed by another process,
  // a shape other than node 0's (FailedPrecondition naming the flag and both values), a rank that could not start,
  // the rendezvous.
  static Result<std::unique_ptr<TensorParallelGroup>> lead_node(int node_rank, const GroupShape& shape,
                                                                const std::string& master_addr, int master_port);
  // A process that started ranks: waits for them to exit (after the model's stop command), up to 10 s, then kills
  // them.
  ~TensorParallelGroup();

  backend::Communicator& communicator() { return *comm_; }
  backend::TcpStore& store() { return *store_; }
  int rank() const { return rank_; }
  // Rank 0: wraps the server's engine client so that a group failure, before the process exits, ends every live
  // request with an error event naming the failure (ShuttingDown), sent from the supervisor's thread: the engine
  // thread may be stuck in a collective waiting for a stopped rank. Requests that end later are the inner client's.
  // Call once; the returned client may outlive this group.
  std::unique_ptr<engine::EngineClient> watch_requests(std::unique_ptr<engine::EngineClient> inner);

 private:
  TensorParallelGroup() = default;
  // Starts ranks first .. last-1 as copies of this process's command line (+ --internal-tp-rank, --master-*).
  Status spawn(int first, int last, const std::string& master_addr, int master_port);
  // What lead() and lead_node() share once the store is reached: start ranks first .. last-1, supervise them, join
  // the group's collectives listening on interface_host.
  Status start_ranks_and_join(int first, int last, int size, const std::string& master_addr, int master_port,
                              const std::string& interface_host);
  void supervise();
  // Several hosts, on beat_thread_: this host's heartbeat, the other hosts' (rank 0: every host; node leaders:
  // rank 0's), the hosts that left and the shapes they announced (rank 0). Exits through abort_group.
  void watch_hosts();
  // Writes `reason` under this host's exit key for rank 0 to report, waiting at most a second (rank 0's store may not
  // answer).
  void publish_exit(const std::string& reason);
  // Logs `reason`, kills the ranks this process started, tells rank 0 (node leaders) or the live requests (rank 0),
  // and exits 1 (the group cannot run on).
  [[noreturn]] void abort_group(const std::string& reason, bool tell_rank0 = true);

  int rank_ = 0;
  GroupShape shape_;
  std::unique_ptr<backend::TcpStore> store_;
  // Several hosts: a store connection for heartbeats and exit notes only, used by watch_hosts, and by publish_exit
  // when the watcher is not inside a call.
  std::unique_ptr<backend::TcpStore> heartbeat_;  // GUARDED_BY(heartbeat_mu_)
  std::mutex heartbeat_mu_;
  int nnodes_ = 1, local_size_ = 1;
  // Node leaders: when the store last answered the watcher, in steady_clock nanoseconds (0: not watching yet).
  std::atomic<int64_t> store_answered_ns_{0};
  std::mutex live_mu_;
  std::shared_ptr<LiveRequests> live_requests_;  // GUARDED_BY(live_mu_); rank 0, once watch_requests was called
  std::unique_ptr<backend::Communicator> comm_;
  std::vector<pid_t> children_;
  std::vector<int> child_ranks_;  // the rank of each child
  std::atomic<bool> stopping_{false};
  std::atomic<bool> comm_ready_{false};  // comm_ is set (the supervisor starts before the rendezvous ends)
  std::thread supervisor_;
  std::thread beat_thread_;
  std::mutex wake_mu_;
  std::condition_variable wake_;  // stops the watcher's sleep at destruction
};

}  // namespace deepinfer::apps
