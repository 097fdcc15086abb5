#include "cache/block_table.h"

#include <memory>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/cache/kv_pattern.h"

namespace kvserve {
namespace {

using testing_kv::TokenHolds;
using testing_kv::WriteToken;

class BlockTableTest : public ::testing::Test {
 protected:
  void MakePool(int32_t n_blocks, int32_t block_size = 4) {
    KvPoolOptions o;
    o.n_layers = 2;
    o.n_kv_heads = 2;
    o.head_dim = 4;
    o.block_size = block_size;
    o.n_blocks = n_blocks;
    pool_ = KvPool::Create(o).value();
  }

  // Reserve(n) after checking that BlocksNeeded predicted its real cost.
  void ReserveExactly(BlockTable& t, int32_t n) {
    const int32_t predicted = t.BlocksNeeded(n);
    const int32_t before = pool_->num_free_blocks();
    ASSERT_TRUE(t.Reserve(n).ok());
    EXPECT_EQ(before - pool_->num_free_blocks(), predicted) << "Reserve(" << n << ")";
  }

  // Writes tokens [from, to) of t with values base + pos.
  void Write(const BlockTable& t, int32_t from, int32_t to, uint32_t base) {
    for (int32_t p = from; p < to; ++p) WriteToken(*pool_, t, p, base + p);
  }
  void ExpectHolds(const BlockTable& t, int32_t from, int32_t to, uint32_t base) {
    for (int32_t p = from; p < to; ++p) EXPECT_TRUE(TokenHolds(*pool_, t, p, base + p)) << p;
  }

  std::unique_ptr<KvPool> pool_;
};

TEST_F(BlockTableTest, ReserveGrowsAcrossBlockBoundaries) {
  MakePool(8);
  BlockTable t(pool_.get());
  EXPECT_EQ(t.BlocksNeeded(3), 1);
  ReserveExactly(t, 3);
  EXPECT_EQ(t.num_tokens(), 3);
  EXPECT_EQ(t.num_blocks(), 1);
  EXPECT_EQ(t.BlocksNeeded(1), 0);  // fits in the last block
  ReserveExactly(t, 1);
  EXPECT_EQ(t.num_blocks(), 1);
  EXPECT_EQ(t.BlocksNeeded(1), 1);  // block is full
  ReserveExactly(t, 1);
  EXPECT_EQ(t.num_blocks(), 2);
  EXPECT_EQ(t.BlocksNeeded(8), 2);  // 5 + 8 = 13 tokens -> 4 blocks
  ReserveExactly(t, 8);
  EXPECT_EQ(t.num_tokens(), 13);
  EXPECT_EQ(t.num_blocks(), 4);
  EXPECT_EQ(pool_->num_free_blocks(), 4);
  std::vector<int32_t> ids = {42};
  t.AppendIds(&ids);
  ASSERT_EQ(ids.size(), 5u);
  for (int32_t i = 0; i < 4; ++i) EXPECT_EQ(ids[i + 1], t.blocks()[i].id);
  Write(t, 0, 13, 1000);
  ExpectHolds(t, 0, 13, 1000);
}

TEST_F(BlockTableTest, ZeroAndNegativeReservations) {
  MakePool(2);
  BlockTable t(pool_.get());
  EXPECT_EQ(t.BlocksNeeded(0), 0);
  EXPECT_TRUE(t.Reserve(0).ok());
  EXPECT_EQ(t.num_blocks(), 0);
  EXPECT_EQ(t.Reserve(-1).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(BlockTableTest, ForkSharesEveryBlock) {
  MakePool(8);
  BlockTable a(pool_.get());
  ReserveExactly(a, 6);
  Write(a, 0, 6, 100);
  const int32_t free_before = pool_->num_free_blocks();
  BlockTable b = a.Fork();
  EXPECT_EQ(pool_->num_free_blocks(), free_before);
  EXPECT_EQ(b.num_tokens(), 6);
  EXPECT_EQ(b.blocks(), a.blocks());
  for (const BlockHandle& h : a.blocks()) EXPECT_EQ(pool_->ref_count(h), 2);
  ExpectHolds(b, 0, 6, 100);
}

TEST_F(BlockTableTest, WritingAfterForkIntoAPartialBlockCopiesExactlyOneBlock) {
  MakePool(8);
  BlockTable a(pool_.get());
  ReserveExactly(a, 6);  // blocks: [0..3] full, [4..5] partial
  Write(a, 0, 6, 100);
  BlockTable b = a.Fork();
  const BlockHandle shared_full = a.blocks()[0];
  const BlockHandle shared_partial = a.blocks()[1];
  const std::vector<uint8_t> partial_bytes = testing_kv::BlockBytes(*pool_, shared_partial);

  EXPECT_EQ(b.BlocksNeeded(1), 1);  // the copy
  ReserveExactly(b, 1);
  ASSERT_EQ(b.num_blocks(), 2);
  EXPECT_EQ(b.blocks()[0], shared_full);
  EXPECT_NE(b.blocks()[1].id, shared_partial.id);
  EXPECT_EQ(pool_->ref_count(shared_full), 2);
  EXPECT_EQ(pool_->ref_count(shared_partial), 1);
  EXPECT_EQ(pool_->ref_count(b.blocks()[1]), 1);
  ExpectHolds(b, 0, 6, 100);  // the copy carries the tokens written before the fork
  WriteToken(*pool_, b, 6, 7777);

  // The sibling's block, bytes included, is exactly as it was.
  EXPECT_EQ(a.blocks()[1], shared_partial);
  EXPECT_EQ(testing_kv::BlockBytes(*pool_, shared_partial), partial_bytes);
  ExpectHolds(a, 0, 6, 100);
  EXPECT_TRUE(TokenHolds(*pool_, b, 6, 7777));

  // The original now owns its partial block alone: no copy for it.
  EXPECT_EQ(a.BlocksNeeded(1), 0);
  ReserveExactly(a, 1);
  WriteToken(*pool_, a, 6, 8888);
  EXPECT_TRUE(TokenHolds(*pool_, b, 6, 7777));
  EXPECT_TRUE(TokenHolds(*pool_, a, 6, 8888));
}

TEST_F(BlockTableTest, FullLastBlockAfterForkTakesANewBlockNotACopy) {
  MakePool(8);
  BlockTable a(pool_.get());
  ReserveExactly(a, 8);
  Write(a, 0, 8, 100);
  BlockTable b = a.Fork();
  EXPECT_EQ(b.BlocksNeeded(1), 1);
  ReserveExactly(b, 1);
  ASSERT_EQ(b.num_blocks(), 3);
  EXPECT_EQ(pool_->ref_count(a.blocks()[0]), 2);
  EXPECT_EQ(pool_->ref_count(a.blocks()[1]), 2);
  EXPECT_EQ(b.blocks()[1], a.blocks()[1]);
  EXPECT_EQ(pool_->ref_count(b.blocks()[2]), 1);
  WriteToken(*pool_, b, 8, 5);
  ExpectHolds(a, 0, 8, 100);
}

TEST_F(BlockTableTest, BlocksNeededCountsCopyAndNewBlocksTogether) {
  MakePool(8);
  BlockTable a(pool_.get());
  ReserveExactly(a, 6);
  BlockTable b = a.Fork();
  // One copy of the partial block + (11 tokens -> 3 blocks) - 2 = 1 new.
  EXPECT_EQ(b.BlocksNeeded(5), 2);
  ReserveExactly(b, 5);
  EXPECT_EQ(b.num_tokens(), 11);
  EXPECT_EQ(b.num_blocks(), 3);
}

TEST_F(BlockTableTest, ReserveIsAllOrNothingWhenThePoolRunsOut) {
  MakePool(3);
  BlockTable a(pool_.get());
  ReserveExactly(a, 6);
  BlockTable b = a.Fork();
  const std::vector<BlockHandle> before = b.blocks();
  EXPECT_EQ(b.BlocksNeeded(7), 3);  // copy + 2 new, with 1 free
  absl::Status s = b.Reserve(7);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("1 free blocks, 3 needed"));
  EXPECT_EQ(b.blocks(), before);
  EXPECT_EQ(b.num_tokens(), 6);
  EXPECT_EQ(pool_->num_free_blocks(), 1);
  for (const BlockHandle& h : before) EXPECT_EQ(pool_->ref_count(h), 2);
}

TEST_F(BlockTableTest, ReleaseAndDestructionReturnEverything) {
  MakePool(16);
  {
    BlockTable a(pool_.get());
    ReserveExactly(a, 10);
    BlockTable b = a.Fork();
    ReserveExactly(b, 9);
    BlockTable c = b.Fork();
    a.Release();
    EXPECT_EQ(a.num_tokens(), 0);
    EXPECT_EQ(a.num_blocks(), 0);
    EXPECT_LT(pool_->num_free_blocks(), 16);
    a.Release();  // idempotent
  }
  EXPECT_EQ(pool_->num_free_blocks(), 16);
}

TEST_F(BlockTableTest, MovesLeaveTheSourceEmpty) {
  MakePool(8);
  BlockTable a(pool_.get());
  ReserveExactly(a, 5);
  const std::vector<BlockHandle> blocks = a.blocks();
  BlockTable b(std::move(a));
  EXPECT_EQ(a.num_tokens(), 0);  // NOLINT(bugprone-use-after-move): the contract under test
  EXPECT_TRUE(a.blocks().empty());
  EXPECT_EQ(b.blocks(), blocks);
  EXPECT_EQ(b.num_tokens(), 5);

  BlockTable c(pool_.get());
  ReserveExactly(c, 4);
  c = std::move(b);                 // c's own block goes back to the pool
  EXPECT_TRUE(b.blocks().empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.num_tokens(), 0);     // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(c.blocks(), blocks);
  EXPECT_EQ(pool_->num_free_blocks(), 6);
  for (const BlockHandle& h : blocks) EXPECT_EQ(pool_->ref_count(h), 1);

  // A moved-from table is still usable.
  ReserveExactly(a, 1);
  EXPECT_EQ(a.num_blocks(), 1);
}

}  // namespace
}  // namespace kvserve
