// BlockPool: reference counts plus an intrusive doubly linked free list over block ids, so allocate,
// release and reclaim are O(1) and deterministic.
#include "deepinfer/core/check.h"
#include "deepinfer/kvcache/block_pool.h"

#include <limits>
#include <string>

namespace deepinfer::kvcache {

BlockPool::BlockPool(int32_t num_blocks)
    : ref_counts_(static_cast<size_t>(num_blocks > 0 ? num_blocks : 0), 0),
      cached_(ref_counts_.size(), 0),
      next_free_(ref_counts_.size(), kNone),
      prev_free_(ref_counts_.size(), kNone) {
  DEEPINFER_CHECK(num_blocks >= 0);
  for (BlockId id = 0; id < num_total(); ++id) push_free_tail(id);
}

std::optional<BlockId> BlockPool::allocate() {
  if (free_head_[0] == kNone) return std::nullopt;
  BlockId id = free_head_[0];
  unlink_free(id);
  ref_counts_[id] = 1;
  return id;
}

Status BlockPool::retain(BlockId id) {
  if (Status status = check_range(id, "retain"); !status.ok()) return status;
  if (ref_counts_[id] == 0) {
    return Status::internal("BlockPool::retain: block " + std::to_string(id) +
                            " is free; an owner kept its id after releasing it");
  }
  ++ref_counts_[id];
  return Status::ok_status();
}

Status BlockPool::release(BlockId id) {
  if (Status status = check_range(id, "release"); !status.ok()) return status;
  if (ref_counts_[id] == 0) {
    return Status::internal("BlockPool::release: block " + std::to_string(id) + " is already free (double release)");
  }
  if (--ref_counts_[id] == 0) push_free_tail(id);
  return Status::ok_status();
}

Status BlockPool::reclaim(BlockId id) {
  if (Status status = check_range(id, "reclaim"); !status.ok()) return status;
  if (ref_counts_[id] != 0) {
    return Status::internal("BlockPool::reclaim: block " + std::to_string(id) + " is in use (ref count " +
                            std::to_string(ref_counts_[id]) + "); retain it instead");
  }
  unlink_free(id);
  ref_counts_[id] = 1;
  return Status::ok_status();
}

void BlockPool::set_cached(BlockId id, bool cached) {
  DEEPINFER_CHECK(id >= 0 && id < num_total());
  if ((cached_[static_cast<size_t>(id)] != 0) == cached) return;
  const bool free = ref_counts_[id] == 0;
  if (free) unlink_free(id);
  cached_[static_cast<size_t>(id)] = cached ? 1 : 0;
  if (free) push_free_tail(id);
}

int32_t BlockPool::ref_count(BlockId id) const {
  DEEPINFER_CHECK(id >= 0 && id < num_total());
  return ref_counts_[id];
}

Status BlockPool::check_range(BlockId id, const char* operation) const {
  if (id >= 0 && id < num_total()) return Status::ok_status();
  return Status::invalid_argument(std::string("BlockPool::") + operation + ": block id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(num_total()) + ")");
}

void BlockPool::push_free_tail(BlockId id) {
  const int list = cached_[static_cast<size_t>(id)];
  prev_free_[id] = free_tail_[list];
  next_free_[id] = kNone;
  if (free_tail_[list] == kNone) {
    free_head_[list] = id;
  } else {
    next_free_[free_tail_[list]] = id;
  }
  free_tail_[list] = id;
  ++num_free_[list];
}

void BlockPool::unlink_free(BlockId id) {
  const int list = cached_[static_cast<size_t>(id)];
  BlockId prev = prev_free_[id];
  BlockId next = next_free_[id];
  if (prev == kNone) {
    free_head_[list] = next;
  } else {
    next_free_[prev] = next;
  }
  if (next == kNone) {
    free_tail_[list] = prev;
  } else {
    prev_free_[next] = prev;
  }
  prev_free_[id] = kNone;
  next_free_[id] = kNone;
  --num_free_[list];
}

// ---------------------------------------------------------------------------------------------------------

std::optional<BlockId> BlockPool::oldest_free_cached() const {
  if (free_head_[1] == kNone) return std::nullopt;
  return free_head_[1];
}

}  // namespace deepinfer::kvcache
