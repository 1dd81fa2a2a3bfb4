// Starting, joining and supervising the tensor-parallel ranks of `deepinfer serve` (tensor_parallel_group.h).
#include "tensor_parallel_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <sstream>
#include <unordered_map>

extern char** environ;

namespace deepinfer::apps {
namespace {

using namespace std::chrono_literals;
// A step's collectives wait this long for a rank (a stopped or wedged one); a dead rank fails them at once anyway.
constexpr auto kCollectiveTimeout = 60s;
// Several hosts: a node leader's heartbeat period, and how long rank 0 lets a host's heartbeat stand still.
constexpr auto kHeartbeatPeriod = 1s;
constexpr auto kHostTimeout = 5s;

std::string heartbeat_key(int node) { return "tp/heartbeat/" + std::to_string(node); }
// Per host: "claim" (a counter: the first process to add 1 is node `node`), "shape" (its GroupShape), "exit" (why it
// left the group, for rank 0 to report).
std::string node_key(int node, const char* what) { return "tp/node/" + std::to_string(node) + "/" + what; }
// Every node leader's shape, in the order they joined (1, 2, ...), for rank 0 to check: a host with another --nnodes
// may claim a node index rank 0 does not know.
constexpr const char* kAnnounced = "tp/nodes/announced";

std::vector<std::byte> to_bytes(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return {p, p + text.size()};
}

std::string to_text(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// "node size nnodes local_size model" (the model: a hex fingerprint or "-").
std::string encode_shape(int node, const GroupShape& shape) {
  return std::to_string(node) + " " + std::to_string(shape.size) + " " + std::to_string(shape.nnodes) + " " +
         std::to_string(shape.local_size) + " " + (shape.model.empty() ? "-" : shape.model);
}

std::optional<std::pair<int, GroupShape>> decode_shape(const std::string& text) {
  std::istringstream in(text);
  int node = -1;
  GroupShape shape;
  if (!(in >> node >> shape.size >> shape.nnodes >> shape.local_size >> shape.model)) return std::nullopt;
  if (shape.model == "-") shape.model.clear();
  return std::make_pair(node, shape);
}

// How node `node`'s shape differs from node 0's, e.g. "node 1 says --tensor-parallel-size 2, node 0 says 4"; empty
// when they agree.
std::string shape_mismatch(int node, const GroupShape& theirs, const GroupShape& node0) {
  std::vector<std::string> differences;
  const std::string who = "node " + std::to_string(node);
  if (theirs.size != node0.size) {
    differences.push_back(who + " says --tensor-parallel-size " + std::to_string(theirs.size) + ", node 0 says " +
                          std::to_string(node0.size));
  }
  if (theirs.nnodes != node0.nnodes) {
    differences.push_back(who + " says --nnodes " + std::to_string(theirs.nnodes) + ", node 0 says " +
                          std::to_string(node0.nnodes));
  }
  if (differences.empty() && theirs.local_size != node0.local_size) {
    differences.push_back(who + " runs " + std::to_string(theirs.local_size) + " ranks, node 0 " +
                          std::to_string(node0.local_size));
  }
  if (!theirs.model.empty() && !node0.model.empty() && theirs.model != node0.model) {
    differences.push_back(who + " loads another checkpoint (--model-path; fingerprint " + theirs.model.substr(0, 16) +
                          ", node 0's " + node0.model.substr(0, 16) + ")");
  }
  if (differences.empty()) return {};
  std::string out;
  for (size_t i = 0; i < differences.size(); ++i) out += (i ? "; " : "") + differences[i];
  return out + ": every host must give the same --tensor-parallel-size, --nnodes and checkpoint";
}

// SIGTERM, SIGINT or SIGHUP to a node leader, for its supervisor to act on.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signal) { g_stop_signal.store(signal); }

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// This process's command line, as it was started.
std::vector<std::string> own_command_line() {
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == '\0') {
      args.push_back(all.substr(start, i - start));
      start = i + 1;
    }
  }
  return args;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

Result<std::string> local_address_toward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int e = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); e != 0)
    return Status::invalid_argument("--master-addr '" + host + "': " + gai_strerror(e));
  std::string error = "no address";
  std::string local;
  for (addrinfo* a = found; a != nullptr && local.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage name{};
    socklen_t len = sizeof(name);
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&name), &len) == 0) {
      const void* raw = name.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&name)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&name)->sin_addr);
      if (inet_ntop(name.ss_family, raw, text, sizeof(text)) != nullptr) local = text;
    } else {
      error = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (local.empty()) return Status::io_error("no local address routes to --master-addr " + host + ": " + error);
  return local;
}

// The live requests of rank 0's engine client (watch_requests): each request's sink is wrapped in an Entry that
// forwards its events until its end; fail_all ends the rest from any thread.
class LiveRequests {
 public:
  class Entry final : public engine::EventSink {
   public:
    Entry(LiveRequests& owner, uint64_t id, std::shared_ptr<engine::EventSink> inner)
        : owner_(owner), id_(id), inner_(std::move(inner)) {}
    void deliver(std::vector<engine::GenerationEvent> events) override {
      bool end = false;
      {
        std::lock_guard lock(mu_);
        if (ended_) return;  // failed by the group already: the request's coroutine reads no more
        for (const engine::GenerationEvent& e : events) end = end || e.event.finished || !e.error.ok();
        ended_ = end;
        inner_->deliver(std::move(events));  // never blocks (EventSink's contract)
      }
      if (end) owner_.forget(id_);
    }
    // Ends the request with `error` unless it has ended. Returns whether it did.
    bool fail(const Status& error) {
      std::lock_guard lock(mu_);
      if (ended_) return false;
      ended_ = true;
      engine::GenerationEvent event;
      event.event.finished = true;
      event.event.finish_reason = engine::FinishReason::kCancelled;
      event.error = error;
      inner_->deliver({std::move(event)});
      return true;
    }
    std::atomic<engine::EngineClient::Ticket> ticket{0};

   private:
    LiveRequests& owner_;  // outlives every entry: the client holds both
    const uint64_t id_;
    std::shared_ptr<engine::EventSink> inner_;
    std::mutex mu_;
    bool ended_ = false;  // GUARDED_BY(mu_)
  };

  std::shared_ptr<Entry> track(std::shared_ptr<engine::EventSink> inner) {
    std::lock_guard lock(mu_);
    auto entry = std::make_shared<Entry>(*this, next_id_, std::move(inner));
    entries_.emplace(next_id_++, entry);
    return entry;
  }
  void forget(uint64_t id) {
    std::lock_guard lock(mu_);
    entries_.erase(id);
  }
  void forget_ticket(engine::EngineClient::Ticket ticket) {
    std::lock_guard lock(mu_);
    std::erase_if(entries_, [&](const auto& e) { return e.second->ticket.load() == ticket; });
  }
  // Ends every live request with `error`; returns how many there were. Nothing once closed.
  size_t fail_all(const Status& error) {
    std::vector<std::shared_ptr<Entry>> live;
    {
      std::lock_guard lock(mu_);
      if (closed_) return 0;
      for (auto& [id, entry] : entries_) live.push_back(entry);
    }
    size_t failed = 0;
    for (const std::shared_ptr<Entry>& entry : live) failed += entry->fail(error) ? 1 : 0;
    return failed;
  }
  // The client is being destroyed (its sinks' server with it): fail_all does nothing from now on.
  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    entries_.clear();
  }

 private:
  std::mutex mu_;
  uint64_t next_id_ = 1;                                          // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> entries_;  // GUARDED_BY(mu_)
  bool closed_ = false;                                           // GUARDED_BY(mu_)
};

namespace {

// The server's engine client with its requests tracked in a LiveRequests.
class WatchedClient final : public engine::EngineClient {
 public:
  WatchedClient(std::unique_ptr<engine::EngineClient> inner, std::shared_ptr<LiveRequests> live)
      : inner_(std::move(inner)), live_(std::move(live)) {}
  ~WatchedClient() override {
    live_->close();
    inner_.reset();  // stops the engine: its last events still reach the entries, which `live_` keeps
  }
  Ticket submit(std::vector<TokenId> prompt_token_ids, engine::SamplingParams params,
                std::shared_ptr<engine::EventSink> sink, engine::KvHandoff handoff) override {
    std::shared_ptr<LiveRequests::Entry> entry = live_->track(std::move(sink));
    const Ticket ticket = inner_->submit(std::move(prompt_token_ids), std::move(params), entry, std::move(handoff));
    entry->ticket = ticket;
    return ticket;
  }
  void cancel(Ticket ticket) override {
    live_->forget_ticket(ticket);
    inner_->cancel(ticket);
  }
  void reserve_kv_blocks(std::vector<TokenId> tokens,
                         std::function<void(Result<engine::KvReservation>)> done) override {
    inner_->reserve_kv_blocks(std::move(tokens), std::move(done));
  }
  void release_kv_blocks(uint64_t reservation) override { inner_->release_kv_blocks(reservation); }
  engine::EngineLoad load() const override { return inner_->load(); }
  void stop() override { inner_->stop(); }

 private:
  std::unique_ptr<engine::EngineClient> inner_;
  std::shared_ptr<LiveRequests> live_;
};

}  // namespace

std::unique_ptr<engine::EngineClient> TensorParallelGroup::watch_requests(std::unique_ptr<engine::EngineClient> inner) {
  auto live = std::make_shared<LiveRequests>();
  {
    std::lock_guard lock(live_mu_);
    live_requests_ = live;
  }
  return std::make_unique<WatchedClient>(std::move(inner), std::move(live));
}

Status TensorParallelGroup::spawn(int first, int last, const std::string& master_addr, int master_port) {
  const std::vector<std::string> self = own_command_line();
  // The binary's own path (not /proc/self/exe, which would name the ranks "exe" in ps, top and pidof).
  char exe[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const char* path = n > 0 ? exe : "/proc/self/exe";
  for (int rank = first; rank < last; ++rank) {
    std::vector<std::string> args = self;
    args.insert(args.end(), {"--internal-tp-rank", std::to_string(rank), "--master-addr", master_addr,
                             "--master-port", std::to_string(master_port)});
    args.insert(args.end(), shape_.rank_args.begin(), shape_.rank_args.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (int error = posix_spawn(&pid, path, nullptr, nullptr, argv.data(), environ); error != 0) {
      for (pid_t child : children_) kill(child, SIGKILL);
      return Status::internal("tensor parallel: could not start rank " + std::to_string(rank) + ": " +
                              std::strerror(error));
    }
    children_.push_back(pid);
    child_ranks_.push_back(rank);
  }
  return Status::ok_status();
}

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::lead(const GroupShape& shape,
                                                                       const std::string& master_addr,
                                                                       int master_port) {
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  group->shape_ = shape;
  // NVLink multicast stays off unless asked for (the GPU machines' rule), here and in the ranks this one starts.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  Result<std::unique_ptr<backend::TcpStore>> store = backend::serve_tcp_store(master_addr, master_port);
  if (!store.ok()) {
    return Status::io_error("--master-addr/--master-port: " + store.status().message() +
                            (shape.nnodes > 1 ? " (is another --node-rank 0 of this group running there?)" : ""));
  }
  group->store_ = std::move(store).value();
  group->nnodes_ = shape.nnodes;
  group->local_size_ = shape.local_size;
  // Node leaders compare their shape with this one before they start anything.
  if (Status s = group->store_->set(node_key(0, "shape"), to_bytes(encode_shape(0, shape))); !s.ok()) return s;
  if (group->nnodes_ > 1) {
    Result<std::unique_ptr<backend::TcpStore>> beat =
        backend::connect_tcp_store(master_addr, group->store_->port(), 10s);
    if (!beat.ok()) return beat.status();
    group->heartbeat_ = std::move(beat).value();
  }
  if (Status s =
          group->start_ranks_and_join(1, shape.local_size, shape.size, master_addr, group->store_->port(), master_addr);
      !s.ok())
    return s;
  return group;
}

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::lead_node(int node_rank, const GroupShape& shape,
                                                                            const std::string& master_addr,
                                                                            int master_port) {
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  group->rank_ = node_rank * shape.local_size;
  group->shape_ = shape;
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  // Rank 0 may start after this host: wait for its store as long as a rank does.
  Result<std::unique_ptr<backend::TcpStore>> store = backend::connect_tcp_store(master_addr, master_port, 60s);
  if (!store.ok()) return Status::io_error("--master-addr/--master-port (rank 0's store): " + store.status().message());
  group->store_ = std::move(store).value();
  backend::TcpStore& rendezvous = *group->store_;
  // One process per host index: of two started with the same --node-rank, however they race, the second is refused
  // here, before it starts or joins anything (regression: both joined).
  Result<int64_t> claims = rendezvous.add(node_key(node_rank, "claim"), 1);
  if (!claims.ok()) return claims.status();
  if (*claims != 1) {
    return Status::failed_precondition(
        "--node-rank " + std::to_string(node_rank) + ": another process already joined this group as node " +
        std::to_string(node_rank) + " (rank 0's store at " + master_addr + ":" + std::to_string(master_port) +
        "); give each host its own --node-rank, 0 to " + std::to_string(shape.nnodes - 1) + " (0: rank 0's host)");
  }
  // Until the rendezvous: a failure here gives the index back, so that this host can be started again.
  struct ClaimGuard {
    backend::TcpStore& store;
    std::string key;
    bool armed = true;
    ~ClaimGuard() {
      if (armed) (void)store.add(key, -1);
    }
  } claim{rendezvous, node_key(node_rank, "claim")};
  // This host's shape, for rank 0 to check (it may not know this node index: another --nnodes), then node 0's here.
  const std::string mine = encode_shape(node_rank, shape);
  if (Status s = rendezvous.set(node_key(node_rank, "shape"), to_bytes(mine)); !s.ok()) return s;
  Result<int64_t> announced = rendezvous.add(kAnnounced, 1);
  if (!announced.ok()) return announced.status();
  if (Status s = rendezvous.set(std::string(kAnnounced) + "/" + std::to_string(*announced), to_bytes(mine)); !s.ok())
    return s;
  Result<std::vector<std::byte>> node0 = rendezvous.get(node_key(0, "shape"), 60s);
  if (!node0.ok()) return node0.status();
  const std::optional<std::pair<int, GroupShape>> theirs = decode_shape(to_text(*node0));
  if (!theirs) return Status::corruption("tensor parallel: node 0's shape in the store is unreadable");
  if (std::string mismatch = shape_mismatch(node_rank, shape, theirs->second); !mismatch.empty()) {
    claim.armed = false;  // the group cannot form: rank 0 stops too
    return Status::failed_precondition("tensor parallel: " + mismatch);
  }
  Result<std::unique_ptr<backend::TcpStore>> beat = backend::connect_tcp_store(master_addr, master_port, 10s);
  if (!beat.ok()) return beat.status();
  group->heartbeat_ = std::move(beat).value();
  group->nnodes_ = shape.nnodes;
  group->local_size_ = shape.local_size;
  Result<std::string> local = local_address_toward(master_addr, master_port);
  if (!local.ok()) return local.status();
  if (Status s = group->start_ranks_and_join(group->rank_ + 1, group->rank_ + shape.local_size, shape.size, master_addr,
                                             master_port, *local);
      !s.ok())
    return s;
  claim.armed = false;
  return group;
}

Status TensorParallelGroup::start_ranks_and_join(int first, int last, int size, const std::string& master_addr,
                                                 int master_port, const std::string& interface_host) {
  if (Status s = spawn(first, last, master_addr, master_port); !s.ok()) return s;
  if (rank_ != 0) {
    // A node leader's stop signals are its supervisor's: it stops this host's ranks and tells rank 0 (left to the
    // default, the ranks died with it and rank 0 learnt of it only from a silent heartbeat or a failed collective).
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESTART;  // the collectives' and the store's calls go on
    sigemptyset(&action.sa_mask);
    for (int signal : {SIGTERM, SIGINT, SIGHUP}) sigaction(signal, &action, nullptr);
  }
  supervisor_ = std::thread([this] { supervise(); });
  if (heartbeat_) beat_thread_ = std::thread([this] { watch_hosts(); });
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*store_, "tp", rank_, size, interface_host, kCollectiveTimeout);
  if (!comm.ok()) return comm.status();
  comm_ = std::move(comm).value();
  store_answered_ns_ = steady_ns();
  comm_ready_ = true;
  return Status::ok_status();
}

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::join(int rank, int size,
                                                                      const std::string& master_addr,
                                                                      int master_port) {
  // Rank 0 (or this host's node leader) started this process: go with it (a kill -9 of rank 0 leaves no rank behind).
  // Signals meant for the server (SIGTERM to the whole group, as `kill $(pgrep deepinfer)` or systemd's control-group
  // stop sends; Ctrl-C) are rank 0's to act on: it drains, then stops this rank by command. A rank that left first
  // would fail the requests still draining.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) return Status::internal("tensor parallel: rank 0 is gone");
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  std::signal(SIGHUP, SIG_IGN);
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  group->rank_ = rank;
  Result<std::unique_ptr<backend::TcpStore>> store = backend::connect_tcp_store(master_addr, master_port, 60s);
  if (!store.ok()) return store.status();
  group->store_ = std::move(store).value();
  Result<std::string> local = local_address_toward(master_addr, master_port);
  if (!local.ok()) return local.status();
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*group->store_, "tp", rank, size, *local, kCollectiveTimeout);
  if (!comm.ok()) return comm.status();
  group->comm_ = std::move(comm).value();
  return group;
}

void TensorParallelGroup::supervise() {
  // A rank that exits 0 was stopped by rank 0's model (its stop command); anything else is a failure the server
  // cannot run past: its steps' collectives fail from now on.
  std::vector<bool> done(children_.size(), false);
  size_t remaining = children_.size();
  while (remaining > 0 || !stopping_) {  // also with no local ranks: the collectives' health is watched here
    for (size_t i = 0; i < children_.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(children_[i], &status, WNOHANG) != children_[i]) continue;
      done[i] = true;
      --remaining;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (stopping_) {  // rank 0 is stopping anyway (a rank that did not stop in time was killed)
        spdlog::warn("tensor-parallel rank {} (pid {}) {} while stopping", child_ranks_[i], children_[i],
                     describe(status));
        continue;
      }
      abort_group("tensor-parallel rank " + std::to_string(child_ranks_[i]) + " (pid " + std::to_string(children_[i]) +
                  ") " + describe(status) + ": the model cannot run without it");
    }
    // A rank alive but unreachable or stuck past the collectives' timeout: the group is broken just the same.
    if (!stopping_ && comm_ready_.load() && comm_->failed()) {
      abort_group("a collective failed (a rank unreachable or stuck past " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kCollectiveTimeout).count()) + " s)");
    }
    if (rank_ != 0 && !stopping_) {
      if (const int signal = g_stop_signal.load(); signal != 0) {
        // Asked to stop (systemd, kill, Ctrl-C): this host's ranks go, rank 0 learns why and stops the server.
        const std::string name = std::string("SIG") + sigabbrev_np(signal);
        spdlog::warn("tensor parallel: {}: stopping this host's ranks {} to {}; rank 0 stops the server", name, rank_,
                     rank_ + local_size_ - 1);
        publish_exit("its node leader (pid " + std::to_string(getpid()) + ") got " + name);
        for (pid_t child : children_) kill(child, SIGKILL);
        for (size_t i = 0; i < children_.size(); ++i) {
          if (!done[i]) waitpid(children_[i], nullptr, 0);
        }
        spdlog::info("tensor parallel: this host's ranks stopped");
        std::_Exit(0);
      }
      // Rank 0 stopped (SIGSTOP) or hung: the watcher waits inside a call to its store.
      const int64_t answered = store_answered_ns_.load();
      if (heartbeat_ && comm_ready_.load() && answered != 0 &&
          steady_ns() - answered > std::chrono::duration_cast<std::chrono::nanoseconds>(kHostTimeout).count()) {
        abort_group("rank 0's host (node 0) has not answered for " +
                        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kHostTimeout).count()) +
                        " s (stopped, hung or unreachable: its store at --master-addr does not answer): the model "
                        "cannot run without it",
                    /*tell_rank0=*/false);
      }
    }
    std::this_thread::sleep_for(stopping_ ? 20ms : 100ms);
  }
}

void TensorParallelGroup::watch_hosts() {
  const int node = rank_ / local_size_;
  const auto seconds = [](auto d) { return std::chrono::duration_cast<std::chrono::seconds>(d).count(); };
  const auto ranks_of = [this](int host) {
    return "host " + std::to_string(host) + " (ranks " + std::to_string(host * local_size_) + " to " +
           std::to_string(host * local_size_ + local_size_ - 1) + ")";
  };
  uint64_t beats = 0;
  int64_t next_announced = 1;
  bool watching = false;
  std::vector<std::vector<std::byte>> last_beat(static_cast<size_t>(nnodes_));
  std::vector<std::chrono::steady_clock::time_point> last_change(static_cast<size_t>(nnodes_));
  while (!stopping_) {
    // One round on the store; a reason to stop the group comes out of it (acted on with the connection released).
    std::string failure;
    bool tell_rank0 = true;
    {
      std::lock_guard store_lock(heartbeat_mu_);
      const auto now = std::chrono::steady_clock::now();
      // Rank 0: the shapes the node leaders announced (another --tensor-parallel-size or --nnodes on a host).
      while (rank_ == 0 && failure.empty()) {
        Result<std::vector<std::byte>> got =
            heartbeat_->get(std::string(kAnnounced) + "/" + std::to_string(next_announced), 0ms);
        if (!got.ok()) break;
        ++next_announced;
        const std::optional<std::pair<int, GroupShape>> theirs = decode_shape(to_text(*got));
        if (theirs) failure = shape_mismatch(theirs->first, theirs->second, shape_);
      }
      if (failure.empty() && comm_ready_.load()) {
        if (!watching) {  // the hosts' timeouts count from the end of the rendezvous
          watching = true;
          std::fill(last_change.begin(), last_change.end(), now);
        }
        ++beats;
        const Status beat = heartbeat_->set(heartbeat_key(node), std::as_bytes(std::span<const uint64_t>(&beats, 1)));
        if (!beat.ok()) {
          // A store that stopped answering (its client gives up after 3 s) is rank 0 stopped or hung; one whose
          // connection closed is rank 0 gone.
          const int64_t answered = store_answered_ns_.load();
          failure = beat.message().find("did not answer") != std::string::npos
                        ? "rank 0's host (node 0) has not answered for " +
                              std::to_string(answered == 0 ? 3 : (steady_ns() - answered) / 1000000000) +
                              " s (stopped, hung or unreachable: its store at --master-addr does not answer): the "
                              "model cannot run without it"
                        : "rank 0's host is gone (" + beat.message() + ")";
          tell_rank0 = false;
        }
        for (int host = 0; host < nnodes_ && failure.empty(); ++host) {
          if (host == node || (rank_ != 0 && host != 0)) continue;  // node leaders watch rank 0 only
          if (rank_ == 0) {
            if (Result<std::vector<std::byte>> left = heartbeat_->get(node_key(host, "exit"), 0ms); left.ok()) {
              failure = ranks_of(host) + " left the group: " + to_text(*left);
              break;
            }
          }
          Result<std::vector<std::byte>> got = heartbeat_->get(heartbeat_key(host), 0ms);
          if (got.ok() && *got != last_beat[host]) {
            last_beat[host] = *got;
            last_change[host] = now;
          }
          if (now - last_change[host] > kHostTimeout) {
            failure = (host == 0 ? std::string("rank 0's host (node 0)") : ranks_of(host)) + " has not answered for " +
                      std::to_string(seconds(kHostTimeout)) +
                      " s (stopped, hung or unreachable): the model cannot run without it";
            tell_rank0 = false;
          }
        }
        if (failure.empty()) store_answered_ns_ = steady_ns();
      }
    }
    if (!failure.empty() && !tell_rank0 && rank_ != 0 && failure.starts_with("rank 0's host is gone")) {
      std::this_thread::sleep_for(500ms);  // rank 0 stopping the group normally closes its store too
    }
    if (!failure.empty() && !stopping_) abort_group(failure, tell_rank0);
    std::unique_lock lock(wake_mu_);
    // Before the rendezvous ends, rank 0 reads the announced shapes four times a second.
    const std::chrono::milliseconds pause = watching ? std::chrono::milliseconds(kHeartbeatPeriod) : 250ms;
    wake_.wait_for(lock, pause, [this] { return stopping_.load(); });
  }
}

void TensorParallelGroup::publish_exit(const std::string& reason) {
  if (!heartbeat_ || rank_ == 0) return;
  // A thread of its own, waited for at most a second: rank 0's store may not answer, or the watcher may be inside a
  // call to it. The process exits right after, whatever became of it.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([this, reason, done] {
    std::lock_guard store_lock(heartbeat_mu_);
    (void)heartbeat_->set(node_key(rank_ / local_size_, "exit"), to_bytes(reason));
    *done = true;
  }).detach();
  const auto deadline = std::chrono::steady_clock::now() + 1s;
  while (!*done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
}

void TensorParallelGroup::abort_group(const std::string& reason, bool tell_rank0) {
  spdlog::error("tensor parallel: {}; stopping {}", reason,
                rank_ == 0 ? "the server" : "this host's ranks (rank 0 stops the server)");
  for (pid_t child : children_) kill(child, SIGKILL);
  if (rank_ != 0 && tell_rank0) publish_exit(reason);
  std::shared_ptr<LiveRequests> live;
  {
    std::lock_guard lock(live_mu_);
    live = live_requests_;
  }
  // The server's streams get an error event rather than a cut connection: a moment for their coroutines to write it,
  // also when the engine's own failed step ended them just before (fail_all then finds none left; regression: the
  // process exited at once and cut their connections).
  if (live) {
    (void)live->fail_all(
        Status::shutting_down("the server is stopping: its tensor-parallel group failed (" + reason + ")"));
    std::this_thread::sleep_for(500ms);
  }
  std::_Exit(1);
}

TensorParallelGroup::~TensorParallelGroup() {
  {
    std::lock_guard lock(wake_mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
  if (children_.empty() && !supervisor_.joinable()) return;
  // The model's stop command has gone out (the model dies before the group): the ranks exit 0 shortly.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  if (supervisor_.joinable()) {
    while (std::chrono::steady_clock::now() < deadline) {
      bool alive = false;
      for (pid_t child : children_) alive = alive || kill(child, 0) == 0;
      if (!alive) break;
      std::this_thread::sleep_for(20ms);
    }
    for (pid_t child : children_) kill(child, SIGKILL);
    supervisor_.join();
  }
}

}  // namespace deepinfer::apps
