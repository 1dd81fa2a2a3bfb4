// Starting, joining and supervising the tensor-parallel ranks of `deepinfer serve` (tensor_parallel_group.h).
#include "tensor_parallel_group.h"

#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <csignal>
#include <fstream>
#include <iterator>

extern char** environ;

namespace deepinfer::apps {
namespace {

using namespace std::chrono_literals;
// A step's collectives wait this long for a rank (a stopped or wedged one); a dead rank fails them at once anyway.
constexpr auto kCollectiveTimeout = 60s;

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

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::lead(int size, const std::string& master_addr,
                                                                      int master_port) {
  std::unique_ptr<TensorParallelGroup> group(new TensorParallelGroup());
  // NVLink multicast stays off unless asked for (the GPU machines' rule), here and in the ranks this one starts.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  Result<std::unique_ptr<backend::TcpStore>> store = backend::serve_tcp_store(master_addr, master_port);
  if (!store.ok()) return Status::io_error("--master-addr/--master-port: " + store.status().message());
  group->store_ = std::move(store).value();
  const std::vector<std::string> self = own_command_line();
  for (int rank = 1; rank < size; ++rank) {
    std::vector<std::string> args = self;
    args.insert(args.end(), {"--internal-tp-rank", std::to_string(rank), "--master-addr", master_addr,
                             "--master-port", std::to_string(group->store_->port())});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    // The binary's own path (not /proc/self/exe, which would name the ranks "exe" in ps, top and pidof).
    char exe[PATH_MAX] = {};
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    const char* path = n > 0 ? exe : "/proc/self/exe";
    if (int error = posix_spawn(&pid, path, nullptr, nullptr, argv.data(), environ); error != 0) {
      for (pid_t child : group->children_) kill(child, SIGKILL);
      return Status::internal("tensor parallel: could not start rank " + std::to_string(rank) + ": " +
                              std::strerror(error));
    }
    group->children_.push_back(pid);
  }
  group->supervisor_ = std::thread([g = group.get()] { g->supervise(); });
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*group->store_, "tp", 0, size, master_addr, kCollectiveTimeout);
  if (!comm.ok()) return comm.status();
  group->comm_ = std::move(comm).value();
  group->comm_ready_ = true;
  return group;
}

Result<std::unique_ptr<TensorParallelGroup>> TensorParallelGroup::join(int rank, int size,
                                                                      const std::string& master_addr,
                                                                      int master_port) {
  // Rank 0 started this process: go with it (a kill -9 of rank 0 leaves no rank behind). Signals meant for the
  // server (SIGTERM to the whole group, as `kill $(pgrep deepinfer)` or systemd's control-group stop sends; Ctrl-C)
  // are rank 0's to act on: it drains, then stops this rank by command. A rank that left first would fail the
  // requests still draining.
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
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*group->store_, "tp", rank, size, master_addr, kCollectiveTimeout);
  if (!comm.ok()) return comm.status();
  group->comm_ = std::move(comm).value();
  return group;
}

void TensorParallelGroup::supervise() {
  // A rank that exits 0 was stopped by rank 0's model (its stop command); anything else is a failure the server
  // cannot run past: its steps' collectives fail from now on.
  std::vector<bool> done(children_.size(), false);
  size_t remaining = children_.size();
  while (remaining > 0) {
    for (size_t i = 0; i < children_.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(children_[i], &status, WNOHANG) != children_[i]) continue;
      done[i] = true;
      --remaining;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (stopping_) {  // rank 0 is stopping anyway (a rank that did not stop in time was killed)
        spdlog::warn("tensor-parallel rank {} (pid {}) {} while stopping", i + 1, children_[i], describe(status));
        continue;
      }
      spdlog::error("tensor-parallel rank {} (pid {}) {}: the model cannot run without it; stopping the server",
                    i + 1, children_[i], describe(status));
      for (pid_t child : children_) kill(child, SIGKILL);
      std::_Exit(1);
    }
    // A rank alive but unreachable or stuck past the collectives' timeout: the group is broken just the same.
    if (!stopping_ && comm_ready_.load() && comm_->failed()) {
      spdlog::error("tensor parallel: a collective failed (a rank unreachable or stuck past {} s): stopping the server",
                    std::chrono::duration_cast<std::chrono::seconds>(kCollectiveTimeout).count());
      for (pid_t child : children_) kill(child, SIGKILL);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(stopping_ ? 20ms : 100ms);
  }
}

TensorParallelGroup::~TensorParallelGroup() {
  stopping_ = true;
  if (rank_ != 0) return;
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
