// BlockMover: a FIFO of block transfers drained by one thread; completions are collected for the engine thread.
#include "deepinfer/kvcache/transfer/block_mover.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "deepinfer/core/check.h"

namespace deepinfer::kvcache::transfer {

BlockMover::BlockMover(DeviceBlockIo* io, DiskBlockStore* disk, size_t block_bytes, int workers)
    : io_(io), disk_(disk), block_bytes_(block_bytes) {
  DEEPINFER_CHECK(block_bytes > 0 && workers >= 1);
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { run(); });
}

BlockMover::~BlockMover() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void BlockMover::set_device_io(DeviceBlockIo* io) { io_.store(io); }

void BlockMover::submit(std::vector<Transfer> transfers) {
  if (transfers.empty()) return;
  std::unique_lock lock(mu_);
  const size_t count = transfers.size();
  enqueue_locked(transfers);
  in_flight_ += static_cast<int64_t>(count);
  const int32_t idle = idle_workers_;  // busy workers look at the queue when they finish: no wake-up needed
  lock.unlock();
  if (idle == 1 || count == 1) {
    if (idle > 0) work_cv_.notify_one();
  } else if (idle > 1) {
    work_cv_.notify_all();
  }
}

bool BlockMover::try_submit(std::vector<Transfer>& transfers) {
  if (transfers.empty()) return true;
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  const size_t count = transfers.size();
  enqueue_locked(transfers);
  transfers.clear();
  in_flight_ += static_cast<int64_t>(count);
  const int32_t idle = idle_workers_;
  lock.unlock();
  if (idle > 0) count == 1 || idle == 1 ? work_cv_.notify_one() : work_cv_.notify_all();
  return true;
}

std::vector<TransferResult> BlockMover::poll(bool wait_for_lock) {
  std::vector<TransferResult> out;
  std::unique_lock lock(mu_, std::defer_lock);
  if (wait_for_lock) {
    lock.lock();
  } else if (!lock.try_lock()) {
    return out;
  }
  out.swap(completed_);
  return out;
}

bool BlockMover::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return done_cv_.wait_for(lock, timeout, [this] { return !completed_.empty(); });
}

void BlockMover::drain() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [this] { return in_flight_ == 0; });
}

int64_t BlockMover::queued() const { return in_flight_.load(); }

bool BlockMover::has_completions() const {
  std::lock_guard lock(mu_);
  return !completed_.empty();
}

void BlockMover::enqueue_locked(std::vector<Transfer>& transfers) {
  size_t front = 0;  // urgent ones keep their order among themselves, ahead of the rest
  for (Transfer& transfer : transfers) {
    const bool ahead = transfer.urgent && !queued_.contains(transfer.hash) && !running_.contains(transfer.hash);
    ++queued_[transfer.hash];
    if (ahead) {
      queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(front++), std::move(transfer));
    } else {
      queue_.push_back(std::move(transfer));
    }
  }
}

size_t BlockMover::next_runnable_locked() const {
  // Only the first few: what waits behind a running hash is usually right behind it.
  const size_t window = std::min<size_t>(queue_.size(), 4 * threads_.size() + 16);
  for (size_t i = 0; i < window; ++i) {
    const Transfer& t = queue_[i];
    if (running_.contains(t.hash)) continue;
    // An earlier queued entry holds this one back when it has the same hash (one hash's transfers run in their queue
    // order: without it a block's removal from disk overtook its own write, held behind its parent's, and the write
    // left a file the index no longer counted) or, for a disk write, when it is the parent's (a block file lands
    // only after the one it follows, so a kill -9 never leaves a chain with a gap, whose later blocks the next start
    // could not reach and would drop). Only earlier entries block, so the queue's first entry is always runnable
    // once its own hash is idle (no deadlock).
    const bool to_disk = t.kind == Transfer::Kind::kToDisk;
    bool held = to_disk && running_.contains(t.parent);
    for (size_t j = 0; j < i && !held; ++j) held = queue_[j].hash == t.hash || (to_disk && queue_[j].hash == t.parent);
    if (held) continue;
    return i;
  }
  return queue_.size();
}

void BlockMover::run() {
  // Background work: the lowest priority, so the step thread never waits for a core behind a copy.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  std::vector<std::byte> scratch(block_bytes_);
  std::unique_lock lock(mu_);
  while (true) {
    size_t next = next_runnable_locked();
    while (next == queue_.size()) {
      if (stop_ && queue_.empty()) return;  // everything ran
      ++idle_workers_;
      work_cv_.wait(lock);
      --idle_workers_;
      next = next_runnable_locked();
    }
    Transfer transfer = std::move(queue_[next]);
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(next));
    if (--queued_[transfer.hash] == 0) queued_.erase(transfer.hash);
    running_.insert(transfer.hash);
    lock.unlock();
    TransferResult result = execute(transfer, scratch);
    result.id = transfer.id;
    lock.lock();
    running_.erase(transfer.hash);
    completed_.push_back(std::move(result));
    --in_flight_;
    done_cv_.notify_all();
    if (!queue_.empty()) work_cv_.notify_one();  // a transfer of this hash may be runnable now
  }
}

namespace {
// A HostBlock filled by an earlier transfer: FIFO order means it is no longer pending when this one runs.
Status host_source(const std::shared_ptr<HostBlock>& host) {
  if (host == nullptr) return Status::internal("transfer without its host copy");
  const int state = host->state.load(std::memory_order_acquire);
  if (state == HostBlock::kReady) return Status::ok_status();
  return Status::failed_precondition(state == HostBlock::kFailed ? "the host copy could not be filled"
                                                         : "the host copy is not filled yet");
}
}  // namespace

TransferResult BlockMover::execute(const Transfer& t, std::vector<std::byte>& scratch) {
  const auto start = std::chrono::steady_clock::now();
  TransferResult result;
  result.kind = t.kind;
  result.hash = t.hash;
  result.block = t.block;
  DeviceBlockIo* io = io_.load();
  auto need_io = [&]() -> Status {
    return io != nullptr ? Status::ok_status() : Status::failed_precondition("no device block I/O is set");
  };
  auto need_disk = [&]() -> Status {
    return disk_ != nullptr ? Status::ok_status() : Status::failed_precondition("there is no disk tier");
  };
  Status status;
  switch (t.kind) {
    case Transfer::Kind::kDeviceToHost: {
      status = need_io();
      if (status.ok()) {
        t.host->bytes.resize(block_bytes_);
        status = io->read(t.block, t.host->bytes);
      }
      t.host->state.store(status.ok() ? HostBlock::kReady : HostBlock::kFailed, std::memory_order_release);
      break;
    }
    case Transfer::Kind::kHostToDevice: {
      status = need_io();
      if (status.ok()) status = host_source(t.host);
      if (status.ok()) status = io->write(t.block, t.host->bytes);
      break;
    }
    case Transfer::Kind::kDiskToDevice: {
      status = need_io();
      if (status.ok()) status = need_disk();
      if (status.ok()) status = disk_->get(t.hash, scratch);
      if (status.ok()) status = io->write(t.block, scratch);
      break;
    }
    case Transfer::Kind::kDiskToHost: {
      status = need_disk();
      if (status.ok()) {
        t.host->bytes.resize(block_bytes_);
        status = disk_->get(t.hash, t.host->bytes);
      }
      t.host->state.store(status.ok() ? HostBlock::kReady : HostBlock::kFailed, std::memory_order_release);
      break;
    }
    case Transfer::Kind::kToDisk: {
      status = need_disk();
      std::span<const std::byte> payload;
      if (status.ok() && t.host != nullptr) {
        status = host_source(t.host);
        payload = t.host->bytes;
      } else if (status.ok()) {
        status = need_io();
        if (status.ok()) status = io->read(t.block, scratch);
        payload = scratch;
      }
      if (status.ok()) status = disk_->put(t.hash, t.parent, payload, std::max<int64_t>(t.ttl_ms, 1));
      break;
    }
    case Transfer::Kind::kRemoveFromDisk: {
      status = need_disk();
      if (status.ok()) status = disk_->remove(t.hash);
      break;
    }
  }
  result.status = status;
  if (status.ok() && t.kind != Transfer::Kind::kRemoveFromDisk) result.bytes = static_cast<int64_t>(block_bytes_);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace deepinfer::kvcache::transfer
