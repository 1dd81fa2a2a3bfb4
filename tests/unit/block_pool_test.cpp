// BlockPool: scripted operations with the expected result, ref count and free count after each step
// (allocation order, sharing through ref counts, exhaustion, errors that change nothing).
#include "deepinfer/kvcache/block_pool.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer::kvcache {
namespace {

enum class Op { kAllocate, kRetain, kRelease, kReclaim };

struct PoolStep {
  Op op;
  BlockId block;               // argument of retain/release/reclaim; for allocate, the id expected (-1: none)
  StatusCode expected_code;    // retain/release/reclaim; kOk for allocate
  int32_t expected_ref_count;  // of `block` after the step (when in range)
  int32_t expected_free;
};

struct PoolScenario {
  std::string name;
  int32_t num_blocks;
  std::vector<PoolStep> steps;
};

constexpr StatusCode kOk = StatusCode::kOk;
constexpr StatusCode kInternal = StatusCode::kInternal;
constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;

void run_pool_scenario(const PoolScenario& scenario) {
  BlockPool pool(scenario.num_blocks);
  ASSERT_EQ(pool.num_total(), scenario.num_blocks) << scenario.name;
  ASSERT_EQ(pool.num_free(), scenario.num_blocks) << scenario.name;
  for (size_t i = 0; i < scenario.steps.size(); ++i) {
    const PoolStep& step = scenario.steps[i];
    std::string where = scenario.name + ", step " + std::to_string(i + 1);
    switch (step.op) {
      case Op::kAllocate: {
        std::optional<BlockId> block = pool.allocate();
        if (step.block < 0) {
          EXPECT_FALSE(block.has_value()) << where << ": allocate should fail, got block " << block.value_or(-1);
        } else {
          ASSERT_TRUE(block.has_value()) << where << ": allocate failed";
          EXPECT_EQ(*block, step.block) << where;
        }
        break;
      }
      case Op::kRetain:
      case Op::kRelease:
      case Op::kReclaim: {
        Status status = step.op == Op::kRetain    ? pool.retain(step.block)
                        : step.op == Op::kRelease ? pool.release(step.block)
                                                  : pool.reclaim(step.block);
        EXPECT_EQ(status.code(), step.expected_code) << where << ": " << status.to_string();
        if (!status.ok()) {
          EXPECT_FALSE(status.message().empty()) << where;
        }
        break;
      }
    }
    if (step.block >= 0 && step.block < pool.num_total()) {
      EXPECT_EQ(pool.ref_count(step.block), step.expected_ref_count) << where << ": ref count of " << step.block;
    }
    EXPECT_EQ(pool.num_free(), step.expected_free) << where;
    EXPECT_EQ(pool.num_used(), pool.num_total() - step.expected_free) << where;
  }
}

TEST(BlockPoolTest, Scenarios) {
  const std::vector<PoolScenario> scenarios = {
      {"allocate in id order, release, reuse least recently freed",
       4,
       {
           {Op::kAllocate, 0, kOk, 1, 3},
           {Op::kAllocate, 1, kOk, 1, 2},
           {Op::kAllocate, 2, kOk, 1, 1},
           {Op::kRelease, 1, kOk, 0, 2},   // free list: 3, 1
           {Op::kRelease, 0, kOk, 0, 3},   // free list: 3, 1, 0
           {Op::kAllocate, 3, kOk, 1, 2},  // the never-used block first
           {Op::kAllocate, 1, kOk, 1, 1},  // then the least recently freed
           {Op::kAllocate, 0, kOk, 1, 0},
       }},
      {"exhaustion, then a release makes room",
       2,
       {
           {Op::kAllocate, 0, kOk, 1, 1},
           {Op::kAllocate, 1, kOk, 1, 0},
           {Op::kAllocate, -1, kOk, 0, 0},
           {Op::kAllocate, -1, kOk, 0, 0},
           {Op::kRelease, 1, kOk, 0, 1},
           {Op::kAllocate, 1, kOk, 1, 0},
       }},
      {"sharing: the block is free only after the last owner releases",
       2,
       {
           {Op::kAllocate, 0, kOk, 1, 1},
           {Op::kRetain, 0, kOk, 2, 1},
           {Op::kRetain, 0, kOk, 3, 1},
           {Op::kRelease, 0, kOk, 2, 1},
           {Op::kRelease, 0, kOk, 1, 1},
           {Op::kRelease, 0, kOk, 0, 2},
           {Op::kRelease, 0, kInternal, 0, 2},  // one release too many
       }},
      {"double release is an error that changes nothing",
       3,
       {
           {Op::kAllocate, 0, kOk, 1, 2},
           {Op::kAllocate, 1, kOk, 1, 1},
           {Op::kRelease, 0, kOk, 0, 2},
           {Op::kRelease, 0, kInternal, 0, 2},
           {Op::kAllocate, 2, kOk, 1, 1},  // the free list is intact: 2, then 0
           {Op::kAllocate, 0, kOk, 1, 0},
           {Op::kAllocate, -1, kOk, 0, 0},
       }},
      {"retain of a free block and ids out of range are errors",
       2,
       {
           {Op::kRetain, 1, kInternal, 0, 2},
           {Op::kRetain, 2, kInvalid, 0, 2},
           {Op::kRelease, -1, kInvalid, 0, 2},
           {Op::kRelease, 7, kInvalid, 0, 2},
           {Op::kReclaim, 9, kInvalid, 0, 2},
       }},
      {"reclaim takes a specific free block back; reclaiming a used one is an error",
       4,
       {
           {Op::kAllocate, 0, kOk, 1, 3},
           {Op::kAllocate, 1, kOk, 1, 2},
           {Op::kRelease, 0, kOk, 0, 3},  // free list: 2, 3, 0
           {Op::kReclaim, 3, kOk, 1, 2},  // from the middle: 2, 0
           {Op::kReclaim, 3, kInternal, 1, 2},
           {Op::kReclaim, 0, kOk, 1, 1},  // the tail: 2
           {Op::kReclaim, 2, kOk, 1, 0},  // the head and last one
           {Op::kAllocate, -1, kOk, 0, 0},
           {Op::kRelease, 2, kOk, 0, 1},  // the list rebuilds from empty: 2
           {Op::kRelease, 3, kOk, 0, 2},  // 2, 3
           {Op::kAllocate, 2, kOk, 1, 1},
           {Op::kAllocate, 3, kOk, 1, 0},
       }},
      {"empty pool",
       0,
       {
           {Op::kAllocate, -1, kOk, 0, 0},
           {Op::kRelease, 0, kInvalid, 0, 0},
       }},
  };
  for (const PoolScenario& scenario : scenarios) run_pool_scenario(scenario);
}

TEST(BlockPoolTest, EveryBlockAllocatedOnceThenAllFreeAgain) {
  BlockPool pool(100);
  std::vector<BlockId> blocks;
  while (std::optional<BlockId> block = pool.allocate()) blocks.push_back(*block);
  ASSERT_EQ(blocks.size(), 100u);
  for (size_t i = 0; i < blocks.size(); ++i) EXPECT_EQ(blocks[i], static_cast<BlockId>(i)) << "allocation " << i;
  for (size_t i = blocks.size(); i-- > 0;) ASSERT_TRUE(pool.release(blocks[i]).ok()) << "release " << i;
  EXPECT_EQ(pool.num_free(), 100);
  // Released in reverse, so reused in reverse.
  EXPECT_EQ(pool.allocate(), std::optional<BlockId>(99));
}

TEST(BlocksForTokensTest, RoundsUpToWholeBlocks) {
  struct Case {
    int64_t tokens;
    int64_t blocks;
  };
  const Case cases[] = {{0, 0}, {1, 1}, {63, 1}, {64, 1}, {65, 2}, {128, 2}, {129, 3}};
  for (const Case& c : cases) EXPECT_EQ(blocks_for_tokens(c.tokens), c.blocks) << c.tokens << " tokens";
}

}  // namespace
}  // namespace deepinfer::kvcache
