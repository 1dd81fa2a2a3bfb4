// BlockMover: a FIFO of block transfers drained by one thread; completions are collected for the engine thread.
#include "deepinfer/kvcache/transfer/block_mover.h"

#include <algorithm>
#include <string>

#include "deepinfer/core/check.h"

namespace deepinfer::kvcache::transfer {

BlockMover::BlockMover(DeviceBlockIo* io, DiskBlockStore* disk, size_t block_bytes)
    : io_(io), disk_(disk), block_bytes_(block_bytes) {
  DEEPINFER_CHECK(block_bytes > 0);
  thread_ = std::thread([this] { run(); });
}

BlockMover::~BlockMover() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void BlockMover::set_device_io(DeviceBlockIo* io) { io_.store(io); }

uint64_t BlockMover::submit(Transfer transfer) {
  uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
    queue_.emplace_back(id, std::move(transfer));
    ++in_flight_;
  }
  work_cv_.notify_one();
  return id;
}

std::vector<TransferResult> BlockMover::poll() {
  std::lock_guard lock(mu_);
  std::vector<TransferResult> out;
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

int64_t BlockMover::queued() const {
  std::lock_guard lock(mu_);
  return in_flight_;
}

void BlockMover::run() {
  std::vector<std::byte> scratch(block_bytes_);
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and everything ran
    auto [id, transfer] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    TransferResult result = execute(transfer, scratch);
    result.id = id;
    lock.lock();
    completed_.push_back(std::move(result));
    --in_flight_;
    done_cv_.notify_all();
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
