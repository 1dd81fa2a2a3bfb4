// Starting, joining and supervising the tensor-parallel ranks of `deepinfer serve` (tensor_parallel_group.h).
#include "tensor_parallel_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstring>
#include <csignal>
#include <fstream>
#include <iterator>
#include <span>

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

// The local address this host reaches `host` from: the name of a UDP socket connected to it (no packet is sent).
// The collectives listen there, so the other hosts' ranks can connect back.
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

}  // namespace

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

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::lead(int size, int local_size,
                                                                      const std::string& master_addr,
                                                                      int master_port) {
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  // NVLink multicast stays off unless asked for (the GPU machines' rule), here and in the ranks this one starts.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  Result<std::unique_ptr<backend::TcpStore>> store = backend::serve_tcp_store(master_addr, master_port);
  if (!store.ok()) return Status::io_error("--master-addr/--master-port: " + store.status().message());
  group->store_ = std::move(store).value();
  group->nnodes_ = size / local_size;
  group->local_size_ = local_size;
  if (group->nnodes_ > 1) {
    Result<std::unique_ptr<backend::TcpStore>> beat =
        backend::connect_tcp_store(master_addr, group->store_->port(), 10s);
    if (!beat.ok()) return beat.status();
    group->heartbeat_ = std::move(beat).value();
  }
  if (Status s = group->start_ranks_and_join(1, local_size, size, master_addr, group->store_->port(), master_addr);
      !s.ok())
    return s;
  return group;
}

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::lead_node(int rank, int size, int local_size,
                                                                           const std::string& master_addr,
                                                                           int master_port) {
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  group->rank_ = rank;
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  // Rank 0 may start after this host: wait for its store as long as a rank does.
  Result<std::unique_ptr<backend::TcpStore>> store = backend::connect_tcp_store(master_addr, master_port, 60s);
  if (!store.ok()) return Status::io_error("--master-addr/--master-port (rank 0's store): " + store.status().message());
  group->store_ = std::move(store).value();
  Result<std::unique_ptr<backend::TcpStore>> beat = backend::connect_tcp_store(master_addr, master_port, 10s);
  if (!beat.ok()) return beat.status();
  group->heartbeat_ = std::move(beat).value();
  group->nnodes_ = size / local_size;
  group->local_size_ = local_size;
  Result<std::string> local = local_address_toward(master_addr, master_port);
  if (!local.ok()) return local.status();
  if (Status s = group->start_ranks_and_join(rank + 1, rank + local_size, size, master_addr, master_port, *local);
      !s.ok())
    return s;
  return group;
}

Status TensorParallelGroup::start_ranks_and_join(int first, int last, int size, const std::string& master_addr,
                                                 int master_port, const std::string& interface_host) {
  if (Status s = spawn(first, last, master_addr, master_port); !s.ok()) return s;
  supervisor_ = std::thread([this] { supervise(); });
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*store_, "tp", rank_, size, interface_host, kCollectiveTimeout);
  if (!comm.ok()) return comm.status();
  comm_ = std::move(comm).value();
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
  // Several hosts: this host's beats (node leaders), or the last beat seen from each host and when (rank 0).
  auto next_beat = std::chrono::steady_clock::now();
  uint64_t beats = 0;
  bool watching = false;
  std::vector<std::vector<std::byte>> last_beat(static_cast<size_t>(nnodes_));
  std::vector<std::chrono::steady_clock::time_point> last_change(static_cast<size_t>(nnodes_),
                                                                  std::chrono::steady_clock::now());
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
      spdlog::error("tensor-parallel rank {} (pid {}) {}: the model cannot run without it; stopping {}",
                    child_ranks_[i], children_[i], describe(status),
                    rank_ == 0 ? "the server" : "this host's ranks (rank 0 stops when its collectives fail)");
      abort_group();
    }
    // A rank alive but unreachable or stuck past the collectives' timeout: the group is broken just the same.
    if (!stopping_ && comm_ready_.load() && comm_->failed()) {
      spdlog::error("tensor parallel: a collective failed (a rank unreachable or stuck past {} s): stopping {}",
                    std::chrono::duration_cast<std::chrono::seconds>(kCollectiveTimeout).count(),
                    rank_ == 0 ? "the server" : "this host's ranks");
      abort_group();
    }
    if (heartbeat_ && !stopping_ && comm_ready_.load() && std::chrono::steady_clock::now() >= next_beat) {
      const auto now = std::chrono::steady_clock::now();
      if (!watching) {  // the hosts' timeouts count from the end of the rendezvous
        watching = true;
        std::fill(last_change.begin(), last_change.end(), now);
      }
      next_beat = now + kHeartbeatPeriod;
      if (rank_ != 0) {
        ++beats;
        const Status s = heartbeat_->set(heartbeat_key(rank_ / local_size_),
                                         std::as_bytes(std::span<const uint64_t>(&beats, 1)));
        if (!s.ok() && !stopping_) {
          spdlog::error("tensor parallel: rank 0's host is gone ({}): stopping this host's ranks", s.message());
          abort_group();
        }
      } else {
        for (int node = 1; node < nnodes_; ++node) {
          Result<std::vector<std::byte>> got = heartbeat_->get(heartbeat_key(node), 0ms);
          if (got.ok() && *got != last_beat[node]) {
            last_beat[node] = *got;
            last_change[node] = now;
          }
          if (now - last_change[node] > kHostTimeout && !stopping_) {
            spdlog::error("tensor parallel: host {} (ranks {} to {}) has not answered for {} s: the model cannot run "
                          "without it; stopping the server",
                          node, node * local_size_, node * local_size_ + local_size_ - 1,
                          std::chrono::duration_cast<std::chrono::seconds>(kHostTimeout).count());
            abort_group();
          }
        }
      }
    }
    std::this_thread::sleep_for(stopping_ ? 20ms : 100ms);
  }
}

void TensorParallelGroup::abort_group() {
  for (pid_t child : children_) kill(child, SIGKILL);
  std::_Exit(1);
}

TensorParallelGroup::~TensorParallelGroup() {
  stopping_ = true;
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
