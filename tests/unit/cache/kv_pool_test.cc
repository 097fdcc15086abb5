#include "cache/kv_pool.h"

#include <algorithm>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

KvPoolOptions SmallPool(int32_t blocks) {
  KvPoolOptions o;
  o.n_layers = 3;
  o.n_kv_heads = 2;
  o.head_dim = 8;
  o.block_size = 4;
  o.n_blocks = blocks;
  return o;
}

TEST(KvPoolTest, BlockBytesFollowLayout) {
  // 2 (K,V) x 3 layers x 4 slots x 2 heads x 8 dims x 4 bytes.
  EXPECT_EQ(KvPool::BlockBytes(SmallPool(1)), 2 * 3 * 4 * 2 * 8 * 4);
  KvPoolOptions f16 = SmallPool(1);
  f16.dtype = kernels::KvDType::kF16;
  EXPECT_EQ(KvPool::BlockBytes(f16), 2 * 3 * 4 * 2 * 8 * 2);
}

TEST(KvPoolTest, ExhaustionIsResourceExhaustedAndAllocatesNothing) {
  auto pool = KvPool::Create(SmallPool(5)).value();
  std::vector<int32_t> ids;
  ASSERT_TRUE(pool->Allocate(3, &ids).ok());
  absl::Status s = pool->Allocate(3, &ids);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("2 free blocks"));
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(pool->num_free_blocks(), 2);
  pool->Free(ids);
  EXPECT_EQ(pool->num_free_blocks(), 5);
}

TEST(KvPoolTest, IdsAreDistinctUntilFreed) {
  auto pool = KvPool::Create(SmallPool(64)).value();
  std::vector<int32_t> ids;
  ASSERT_TRUE(pool->Allocate(64, &ids).ok());
  EXPECT_EQ(std::set<int32_t>(ids.begin(), ids.end()).size(), 64u);
  pool->Free(absl::MakeConstSpan(ids).subspan(10, 5));
  std::vector<int32_t> again;
  ASSERT_TRUE(pool->Allocate(5, &again).ok());
  std::sort(again.begin(), again.end());
  std::vector<int32_t> freed(ids.begin() + 10, ids.begin() + 15);
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(again, freed);
}

TEST(KvPoolTest, ViewAddressesBlocksAndLayersWithoutOverlap) {
  auto pool = KvPool::Create(SmallPool(4)).value();
  std::vector<int32_t> ids;
  ASSERT_TRUE(pool->Allocate(4, &ids).ok());
  const int32_t offsets[3] = {0, 2, 4};
  kernels::PagedKvView v = pool->View(ids.data(), offsets, 2);
  std::set<const uint8_t*> seen;
  for (int32_t seq = 0; seq < 2; ++seq)
    for (int32_t l = 0; l < 3; ++l)
      for (int32_t pos = 0; pos < 8; ++pos)
        for (int32_t h = 0; h < 2; ++h) {
          EXPECT_TRUE(seen.insert(v.KeyAt(l, seq, pos, h)).second);
          EXPECT_TRUE(seen.insert(v.ValueAt(l, seq, pos, h)).second);
        }
}

TEST(KvPoolTest, RejectsNonPositiveShape) {
  KvPoolOptions o = SmallPool(0);
  EXPECT_EQ(KvPool::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvserve
