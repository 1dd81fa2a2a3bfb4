// The ranks of `deepinfer serve --data-parallel-size N` (data_parallel_group.h).
#include "data_parallel_group.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tensor_parallel_group.h"

namespace deepinfer::apps {
namespace {
using namespace std::chrono_literals;
constexpr auto kCollectiveTimeout = 60s;
}  // namespace

const char* const DataParallelGroup::kStoppedBySignal = "was stopped (SIGTERM or Ctrl-C)";

namespace {
std::string encode(const GroupSettings& settings) {
  std::string out;
  for (const auto& [flag, value] : settings) out += flag + "\t" + value + "\n";
  return out;
}
GroupSettings decode(const std::string& text) {
  GroupSettings out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t tab = text.find('\t', at), end = text.find('\n', at);
    if (tab == std::string::npos || end == std::string::npos || tab > end) break;
    out.emplace_back(text.substr(at, tab - at), text.substr(tab + 1, end - tab - 1));
    at = end + 1;
  }
  return out;
}
std::string text_of(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
}  // namespace

Result<std::unique_ptr<DataParallelGroup>> DataParallelGroup::join(int rank, int size, const std::string& master_addr,
                                                                   int master_port, const GroupSettings& settings) {
  std::unique_ptr<DataParallelGroup> group(new DataParallelGroup());
  group->rank_ = rank;
  group->size_ = size;
  Result<std::unique_ptr<backend::TcpStore>> store = rank == 0 ? backend::serve_tcp_store(master_addr, master_port)
                                                               : backend::connect_tcp_store(master_addr, master_port, 60s);
  if (!store.ok()) {
    return Status::io_error("data parallel: " + std::string(rank == 0 ? "serving" : "reaching") +
                            " the rendezvous store at " + master_addr + ":" + std::to_string(master_port) + ": " +
                            store.status().message());
  }
  group->store_ = std::move(store).value();
  auto not_a_store = [&](const Status& s) {
    return Status::io_error("data parallel: " + master_addr + ":" + std::to_string(master_port) +
                            " (--master-addr:--master-port) does not answer as rank 0's rendezvous store: " +
                            s.message());
  };
  const std::string size_text = std::to_string(size), settings_text = encode(settings);
  if (rank != 0) {
    // Rank 0's size and settings first (a rank refused here claims nothing), then the index.
    spdlog::info("data parallel: rank {} of {}: waiting up to 60 s for rank 0 at {}:{}", rank, size, master_addr,
                 master_port);
    Result<std::vector<std::byte>> theirs = group->store_->get("dp/size", 60s);
    if (!theirs.ok()) return not_a_store(theirs.status());
    if (text_of(*theirs) != size_text) {
      return Status::invalid_argument("--data-parallel-size " + size_text + " on rank " + std::to_string(rank) +
                                      ", but rank 0 says " + text_of(*theirs));
    }
    Result<std::vector<std::byte>> shape = group->store_->get("dp/settings", 60s);
    if (!shape.ok()) return not_a_store(shape.status());
    const GroupSettings rank0 = decode(text_of(*shape));
    for (const auto& [flag, value] : settings) {
      std::string theirs_value = "(not set)";
      for (const auto& [f, v] : rank0) {
        if (f == flag) theirs_value = v;
      }
      if (theirs_value != value) {
        const std::string why = flag + " " + value + " on rank " + std::to_string(rank) + ", but rank 0 says " +
                                theirs_value;
        // Rank 0 names it when the group does not form (it waits for this rank until then).
        (void)group->store_->set("dp/refused/" + std::to_string(rank), std::as_bytes(std::span(why)));
        return Status::invalid_argument(why + ": every data-parallel rank must run the same checkpoint with the same "
                                        "expert and EPLB flags");
      }
    }
  }
  // Claim the index (of several processes given the same --data-parallel-rank, exactly one gets 1).
  Result<int64_t> claims = group->store_->add("dp/rank/" + std::to_string(rank), 1);
  if (!claims.ok()) return not_a_store(claims.status());
  if (*claims > 1) {
    return Status::invalid_argument("--data-parallel-rank " + std::to_string(rank) +
                                    ": another process already joined this group as rank " + std::to_string(rank));
  }
  group->claimed_ = true;
  if (rank == 0) {
    if (Status s = group->store_->set("dp/settings", std::as_bytes(std::span(settings_text))); !s.ok()) return s;
    if (Status s = group->store_->set("dp/size", std::as_bytes(std::span(size_text))); !s.ok()) return s;
  }
  Result<std::string> local = local_address_toward(master_addr, master_port);
  if (!local.ok()) return local.status();
  spdlog::info("data parallel: rank {} of {}: waiting up to 60 s for every rank to join at {}:{}", rank, size,
               master_addr, master_port);
  Result<std::unique_ptr<backend::Communicator>> comm =
      backend::make_gloo_communicator(*group->store_, "dp", rank, size, *local, kCollectiveTimeout);
  if (!comm.ok()) {
    std::string refused;
    for (int r = 1; r < size && rank == 0; ++r) {
      Result<std::vector<std::byte>> why = group->store_->get("dp/refused/" + std::to_string(r), 100ms);
      if (why.ok()) refused += "; rank " + std::to_string(r) + " was refused: " + text_of(*why);
    }
    return Status::io_error("data parallel: not every rank joined within 60 s (start each --data-parallel-rank 0 to " +
                            std::to_string(size - 1) + " with --master-addr " + master_addr + " --master-port " +
                            std::to_string(master_port) + "): " + comm.status().message() + refused);
  }
  group->comm_ = std::move(comm).value();
  return group;
}

Result<std::unique_ptr<DataParallelGroup>> DataParallelGroup::join_tensor_rank(int tp_rank, int rank, int size,
                                                                               const std::string& master_addr,
                                                                               int master_port) {
  std::unique_ptr<DataParallelGroup> group(new DataParallelGroup());
  group->rank_ = rank;
  group->size_ = size;
  group->tensor_rank_ = true;
  Result<std::unique_ptr<backend::TcpStore>> store = backend::connect_tcp_store(master_addr, master_port, 60s);
  if (!store.ok()) {
    return Status::io_error("data parallel: tensor-parallel rank " + std::to_string(tp_rank) + " of rank " +
                            std::to_string(rank) + ": reaching the rendezvous store at " + master_addr + ":" +
                            std::to_string(master_port) + ": " + store.status().message());
  }
  group->store_ = std::move(store).value();
  Result<std::string> local = local_address_toward(master_addr, master_port);
  if (!local.ok()) return local.status();
  Result<std::unique_ptr<backend::Communicator>> comm = backend::make_gloo_communicator(
      *group->store_, "dp-tp" + std::to_string(tp_rank), rank, size, *local, kCollectiveTimeout);
  if (!comm.ok()) {
    return Status::io_error("data parallel: tensor-parallel rank " + std::to_string(tp_rank) + " of rank " +
                            std::to_string(rank) + ": joining the expert exchange of the ranks' tensor-parallel rank " +
                            std::to_string(tp_rank) + ": " + comm.status().message());
  }
  group->comm_ = std::move(comm).value();
  return group;
}

Result<bool> DataParallelGroup::any_pending(bool mine) {
  Result<StopPoll> poll = exchange(mine, false);
  if (!poll.ok()) return poll.status();
  return poll->any_pending;
}

Result<engine::StepGroup::StopPoll> DataParallelGroup::stop_poll(bool mine) { return exchange(mine, true); }

std::chrono::steady_clock::time_point DataParallelGroup::stop_deadline() const {
  // Not asked to stop (e.g. its server failed to start): nothing to wait for, the rank leaves at once.
  const int64_t since = stopping_since_ns_.load();
  if (since == 0) return std::chrono::steady_clock::now();
  return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(since)) + stop_budget_;
}

Result<engine::StepGroup::StopPoll> DataParallelGroup::exchange(bool mine, bool stopping) {
  float answers[2] = {mine ? 1.0f : 0.0f, stopping ? 1.0f : 0.0f};
  if (!failed_) comm_->all_reduce_sum(backend::Tensor{answers, backend::DType::kF32, 1, 2, 2});
  const float pending = answers[0];
  if (Status s = comm_->status(); failed_ || !s.ok()) {
    if (!failed_) {
      failed_ = true;
      // A rank stopped on purpose said so in the store (leave()); rank 0's going takes the store with it.
      std::string& why = why_;
      for (int r = 0; r < size_ && why.empty(); ++r) {
        if (r == rank_) continue;
        Result<std::vector<std::byte>> left = store_->get("dp/left/" + std::to_string(r), 200ms);
        if (left.ok()) {
          why = "rank " + std::to_string(r) + " " + text_of(*left) + " and left the group; ";
          peer_stopped_ = text_of(*left) == kStoppedBySignal;
        }
      }
      if (why.empty() && rank_ != 0 && !store_->add("dp/alive", 0).ok()) why = "rank 0 (it serves the store) is gone; ";
      if (stopped_cleanly()) {
        spdlog::info("data parallel: rank {} of {}: the group ended ({}{}) while this rank stops too", rank_, size_,
                     why, s.message());
      } else {
        spdlog::error("data parallel: rank {} of {}: the group failed ({}{}); stopping the server", rank_, size_, why,
                      s.message());
      }
    }
    return Status::shutting_down("the server is stopping: its data-parallel group failed (" + why_ + s.message() + ")");
  }
  idle_answers_ = pending > 0.0f ? 0 : idle_answers_ + 1;
  return StopPoll{answers[1] >= static_cast<float>(size_), pending > 0.0f};
}

void DataParallelGroup::stop_after_failure() {
  // The engine client has ended the live requests with the group's error (and tells later ones the same); the stop
  // answers the ones not in the engine yet. Their connections need a moment to write it; without a stop (or should
  // it hang), the process ends here.
  std::function<void()> stop;
  {
    std::lock_guard lock(stop_mu_);  // failed_ is set: a later on_failure() calls its stop itself
    stop = stop_;
  }
  if (stop) stop();
  std::thread([has_stop = static_cast<bool>(stop)] {
    std::this_thread::sleep_for(has_stop ? 10s : 500ms);
    std::_Exit(1);
  }).detach();
}

void DataParallelGroup::on_failure(std::function<void()> stop) {
  {
    std::lock_guard lock(stop_mu_);
    stop_ = stop;
    if (!failed_) return;
  }
  if (stop) stop();  // the group failed before the server started (a second stop_after_failure() call is harmless)
}

void DataParallelGroup::set_leave_reason(std::string why) {
  std::lock_guard lock(stop_mu_);
  leave_reason_ = std::move(why);
}

std::string DataParallelGroup::leave_reason() {
  std::lock_guard lock(stop_mu_);
  return leave_reason_;
}

void DataParallelGroup::leave_because(const std::string& why) {
  if (left_ || store_ == nullptr || tensor_rank_) return;
  left_ = true;
  (void)store_->set("dp/left/" + std::to_string(rank_), std::as_bytes(std::span(why)));
}

DataParallelGroup::~DataParallelGroup() {
  if (comm_ != nullptr) leave_because("exited (see its log)");
  // A rank refused after its claim (the Gloo group never formed) gives its index back for a corrected restart.
  if (comm_ == nullptr && claimed_ && store_ != nullptr) (void)store_->add("dp/rank/" + std::to_string(rank_), -1);
}

std::chrono::microseconds DataParallelGroup::idle_poll() const {
  return idle_answers_ < 200 ? std::chrono::microseconds(1000) : std::chrono::microseconds(10000);
}

}  // namespace deepinfer::apps
