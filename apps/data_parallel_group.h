// The ranks of `deepinfer serve --data-parallel-size N --data-parallel-rank R` (attention data parallel with the
// routed experts spread over the ranks: DeepSeek's deployment, vLLM's --data-parallel-size with
// --enable-expert-parallel in its external load-balancing mode, SGLang's --enable-dp-attention). The user starts
// every rank (each its own server: its HTTP port, scheduler and KV cache; `deepinfer router` in front spreads the
// requests); rank 0 serves the rendezvous store on --master-addr:--master-port, the others connect to it. Each rank
// claims its index in the store (a second process with the same --data-parallel-rank is refused, naming it), checks
// the group's size against rank 0's, and joins a Gloo group of all ranks, listening on its local address toward the
// master. The model's MoE layers exchange tokens over that group (ExpertParallel, all-to-all dispatch and combine);
// the engines step in lock step through it (engine::StepGroup: one all-reduce per engine-thread iteration says
// whether any rank has work). A rank may be a tensor-parallel group: its leader is the rank here, and its rank t > 0
// joins the expert exchange of index t with the other ranks' rank t (join_tensor_rank).
// Faults: a collective that fails (a rank died, closed, or stopped answering for the 60 s collective timeout) ends
// the group for good: any_pending() returns ShuttingDown naming it (the engine client ends its live requests with it:
// a 503, and tells later ones the same) and then stop_after_failure() calls the stop set by on_failure() (serve: the server stops at once, answering the requests that were
// not in the engine yet, e.g. waiting for their KV blocks, with a 503 too); the process exits 1 (at the latest 10 s
// later: a stop that hangs on the dead group is cut short). A rank that stops (SIGTERM) leaves the group: the others then
// stop too. CPU only in this build (the CUDA MoE kernels do not take given routing).
// Thread-safety: any_pending() on the engine thread; communicator() for the model's passes, on the same thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "deepinfer/backend/communicator.h"
#include "deepinfer/core/status.h"
#include "deepinfer/engine/engine_client.h"

namespace deepinfer::apps {

// What every rank must agree on, as (flag, value) pairs: the checkpoint's fingerprint and every flag that shapes the
// experts' placement or the passes (a rank that differs would compute other experts, or rebalance at other passes).
using GroupSettings = std::vector<std::pair<std::string, std::string>>;

class DataParallelGroup final : public engine::StepGroup {
 public:
  // Joins (rank 0: serves) the group. A rank other than 0 first checks rank 0's size and `settings` (waiting up to
  // 60 s for its store), then claims its index; then every rank waits up to 60 s for all to join. Errors:
  // InvalidArgument (the index claimed twice; a size or setting other than rank 0's, naming the flag and both
  // values), IoError (the store; not every rank joined), Internal (the Gloo group).
  static Result<std::unique_ptr<DataParallelGroup>> join(int rank, int size, const std::string& master_addr,
                                                         int master_port, const GroupSettings& settings);
  // Data parallel with tensor parallel inside each rank: tensor-parallel rank `tp_rank` (> 0, started by its
  // data-parallel rank's leader) of data-parallel rank `rank` joins the group of the ranks `tp_rank` of every
  // data-parallel rank (waiting up to 60 s for them), over which its model exchanges the experts' tokens (rank 0 of
  // each tensor-parallel group exchanges over the data-parallel group itself). Only communicator() is for use: the
  // lock step is the leaders' (this rank follows its leader's passes). Errors: IoError (the store, the rendezvous).
  static Result<std::unique_ptr<DataParallelGroup>> join_tensor_rank(int tp_rank, int rank, int size,
                                                                     const std::string& master_addr, int master_port);
  ~DataParallelGroup() override;
  backend::Communicator& communicator() { return *comm_; }
  // The group's store (more groups over the same ranks: NCCL's on CUDA).
  backend::TcpStore& store() { return *store_; }
  Result<bool> any_pending(bool mine) override;
  Result<StopPoll> stop_poll(bool mine) override;
  // note_stopping()'s time + the stop budget (set_stop_budget; serve: --shutdown-timeout-s, which the drain shares);
  // now when note_stopping() was never called.
  std::chrono::steady_clock::time_point stop_deadline() const override;
  void set_stop_budget(std::chrono::seconds budget) { stop_budget_ = budget; }
  // 1 ms while the group has been busy in the last ~200 ms; 10 ms after (an idle group then costs each rank ~2% of
  // a core instead of ~20%, and a request that arrives then waits up to 10 ms for the others to join its step).
  std::chrono::microseconds idle_poll() const override;
  // Marks this rank as stopped in the store, so that the others' failure names it (they stop too: exit 1). The
  // destructor does the same for a rank that exits otherwise (a startup error after joining).
  void leave() override { leave_because(leave_reason()); }
  // What leave() says: "was stopped (SIGTERM or Ctrl-C)" unless set (serve: "failed to start" while its server starts,
  // so that a port in use is not reported to the others as a stop). Thread-safe.
  void set_leave_reason(std::string why);
  void leave_because(const std::string& why);
  // What to call once when the group fails (from the engine thread): serve stops its server without draining.
  // Thread-safe; a failure before it is set calls it here; an empty function clears it (before the server goes).
  void on_failure(std::function<void()> stop);
  bool failed() const { return failed_.load(); }
  // serve's stop (SIGTERM, Ctrl-C) began before the group failed. Thread-safe.
  void note_stopping() {
    if (!failed_) asked_to_stop_ = true;
    int64_t expected = 0;  // the first stop's time
    stopping_since_ns_.compare_exchange_strong(
        expected, std::chrono::steady_clock::now().time_since_epoch().count());
  }
  // The group ended because a peer was stopped on purpose while this rank was being stopped too (an orchestrator
  // signalling every rank): a clean stop, exit 0, not a failure.
  bool stopped_cleanly() const { return asked_to_stop_.load() && peer_stopped_.load(); }
  static const char* const kStoppedBySignal;  // what leave() says by default
  // The engine client ended its requests with the failure: calls the stop set by on_failure() (the server's), and
  // ends the process 10 s later (500 ms without a stop) should that stop hang on the dead group.
  void stop_after_failure() override;

 private:
  DataParallelGroup() = default;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<backend::TcpStore> store_;
  std::unique_ptr<backend::Communicator> comm_;
  std::atomic<bool> failed_{false};  // set by the engine thread, read by any
  std::atomic<bool> asked_to_stop_{false};  // note_stopping()
  std::atomic<int64_t> stopping_since_ns_{0};  // note_stopping()'s first call (steady clock), 0: none
  std::chrono::seconds stop_budget_{30};
  // One lock-step question: [this rank's work, this rank stopping] summed over the ranks (any_pending, stop_poll).
  Result<StopPoll> exchange(bool mine, bool stopping);
  std::atomic<bool> peer_stopped_{false};   // the failure: a peer that left because it was stopped on purpose
  std::mutex stop_mu_;
  std::function<void()> stop_;  // on_failure's
  std::string leave_reason_ = kStoppedBySignal;  // guarded by stop_mu_
  std::string leave_reason();
  bool left_ = false;
  bool claimed_ = false;  // this rank's index is claimed in the store
  bool tensor_rank_ = false;  // join_tensor_rank's: no index of its own, nothing to say when it leaves
  std::string why_;       // which rank left, when one said so
  int64_t idle_answers_ = 0;  // consecutive "nobody has work"
};

}  // namespace deepinfer::apps
