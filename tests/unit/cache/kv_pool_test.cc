#include "cache/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

KvPoolOptions SmallPool(int32_t blocks) {
  KvPoolOptions o;
  o.n_layers = 3;
  o.n_kv_heads = 2;
  o.head_dim = 8;
  o.block_size = 4;
  o.n_blocks = blocks;
  return o;
}

std::vector<int32_t> Ids(const std::vector<BlockHandle>& hs) {
  std::vector<int32_t> ids;
  for (const BlockHandle& h : hs) ids.push_back(h.id);
  return ids;
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
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(3, &hs).ok());
  absl::Status s = pool->Allocate(3, &hs);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("2 free blocks, 3 needed"));
  EXPECT_EQ(hs.size(), 3u);
  EXPECT_EQ(pool->num_free_blocks(), 2);
  pool->Release(hs);
  EXPECT_EQ(pool->num_free_blocks(), 5);
}

TEST(KvPoolTest, FreshBlocksHaveOneReferenceAndAreDistinct) {
  auto pool = KvPool::Create(SmallPool(64)).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(64, &hs).ok());
  const std::vector<int32_t> ids = Ids(hs);
  EXPECT_EQ(std::set<int32_t>(ids.begin(), ids.end()).size(), 64u);
  for (const BlockHandle& h : hs) {
    EXPECT_TRUE(pool->IsLive(h));
    EXPECT_EQ(pool->ref_count(h), 1);
  }
  pool->Release(absl::MakeConstSpan(hs).subspan(10, 5));
  std::vector<BlockHandle> again;
  ASSERT_TRUE(pool->Allocate(5, &again).ok());
  std::vector<int32_t> got = Ids(again), freed(ids.begin() + 10, ids.begin() + 15);
  std::sort(got.begin(), got.end());
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(got, freed);
}

TEST(KvPoolTest, ReferenceCountsFollowAddRefAndRelease) {
  auto pool = KvPool::Create(SmallPool(2)).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(1, &hs).ok());
  const BlockHandle h = hs[0];
  pool->AddRef(h);
  pool->AddRef(h);
  EXPECT_EQ(pool->ref_count(h), 3);
  EXPECT_EQ(pool->num_free_blocks(), 1);
  pool->Release(h);
  pool->Release(h);
  EXPECT_EQ(pool->ref_count(h), 1);
  EXPECT_EQ(pool->num_free_blocks(), 1);  // still referenced: not back yet
  pool->Release(h);
  EXPECT_EQ(pool->ref_count(h), 0);
  EXPECT_EQ(pool->num_free_blocks(), 2);
}

TEST(KvPoolTest, ReturnAdvancesGenerationSoOldHandlesAreNotLive) {
  auto pool = KvPool::Create(SmallPool(1)).value();
  std::vector<BlockHandle> first, second;
  ASSERT_TRUE(pool->Allocate(1, &first).ok());
  pool->Release(first[0]);
  EXPECT_FALSE(pool->IsLive(first[0]));
  ASSERT_TRUE(pool->Allocate(1, &second).ok());
  // Same memory, new identity: the old handle must not read the new owner's K/V.
  EXPECT_EQ(second[0].id, first[0].id);
  EXPECT_NE(second[0].generation, first[0].generation);
  EXPECT_FALSE(pool->IsLive(first[0]));
  EXPECT_EQ(pool->ref_count(first[0]), 0);
  EXPECT_TRUE(pool->IsLive(second[0]));
  EXPECT_FALSE(pool->IsLive(BlockHandle{}));
  EXPECT_FALSE(pool->IsLive(BlockHandle{7, 0}));
}

TEST(KvPoolTest, NegativeCountIsInvalidArgument) {
  auto pool = KvPool::Create(SmallPool(1)).value();
  std::vector<BlockHandle> hs;
  EXPECT_EQ(pool->Allocate(-1, &hs).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool->Allocate(0, &hs).ok());
  EXPECT_TRUE(hs.empty());
}

class KvPoolCopyTest : public ::testing::TestWithParam<kernels::KvDType> {};

TEST_P(KvPoolCopyTest, CopyBlockCopiesEveryLayersKeysAndValues) {
  KvPoolOptions o = SmallPool(3);
  o.dtype = GetParam();
  auto pool = KvPool::Create(o).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(3, &hs).ok());
  const int32_t ids[3] = {hs[0].id, hs[1].id, hs[2].id};
  const int32_t offsets[4] = {0, 1, 2, 3};
  const kernels::PagedKvView v = pool->View(ids, offsets, 3);
  const int64_t elem = kernels::KvElemBytes(o.dtype);
  // A distinct byte for every byte of every slot, differing between sequences,
  // layers, heads and K/V, so a partial copy cannot pass.
  auto pattern = [](int32_t seq, int32_t l, int32_t kv, int32_t h, int32_t pos, int64_t b) {
    return static_cast<uint8_t>(seq * 101 + l * 37 + kv * 17 + h * 11 + pos * 5 + b);
  };
  for (int32_t seq = 0; seq < 3; ++seq)
    for (int32_t l = 0; l < o.n_layers; ++l)
      for (int32_t h = 0; h < o.n_kv_heads; ++h)
        for (int32_t pos = 0; pos < o.block_size; ++pos)
          for (int64_t b = 0; b < o.head_dim * elem; ++b) {
            v.KeyAt(l, seq, pos, h)[b] = pattern(seq, l, 0, h, pos, b);
            v.ValueAt(l, seq, pos, h)[b] = pattern(seq, l, 1, h, pos, b);
          }
  pool->CopyBlock(hs[0], hs[1]);
  for (int32_t l = 0; l < o.n_layers; ++l)
    for (int32_t h = 0; h < o.n_kv_heads; ++h)
      for (int32_t pos = 0; pos < o.block_size; ++pos)
        for (int64_t b = 0; b < o.head_dim * elem; ++b) {
          ASSERT_EQ(v.KeyAt(l, 1, pos, h)[b], pattern(0, l, 0, h, pos, b)) << l << " " << h;
          ASSERT_EQ(v.ValueAt(l, 1, pos, h)[b], pattern(0, l, 1, h, pos, b)) << l << " " << h;
          // Neither the source nor an unrelated block changes.
          ASSERT_EQ(v.KeyAt(l, 0, pos, h)[b], pattern(0, l, 0, h, pos, b));
          ASSERT_EQ(v.ValueAt(l, 2, pos, h)[b], pattern(2, l, 1, h, pos, b));
        }
  EXPECT_EQ(pool->ref_count(hs[0]), 1);
  EXPECT_EQ(pool->ref_count(hs[1]), 1);
}

INSTANTIATE_TEST_SUITE_P(DTypes, KvPoolCopyTest,
                         ::testing::Values(kernels::KvDType::kF32, kernels::KvDType::kF16),
                         [](const auto& info) {
                           return info.param == kernels::KvDType::kF32 ? "F32" : "F16";
                         });

// Quantized pools keep their scales inside the block, so CopyBlock (used by
// copy-on-write) carries data and scales together: every byte of the block.
class KvPoolQuantizedCopyTest : public ::testing::TestWithParam<kernels::KvDType> {};

TEST_P(KvPoolQuantizedCopyTest, CopyBlockCopiesDataAndScales) {
  KvPoolOptions o = SmallPool(3);
  o.dtype = GetParam();
  auto pool = KvPool::Create(o).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(3, &hs).ok());
  const int32_t ids[3] = {hs[0].id, hs[1].id, hs[2].id};
  const int32_t offsets[4] = {0, 1, 2, 3};
  const kernels::PagedKvView v = pool->View(ids, offsets, 3);
  ASSERT_EQ(v.block_bytes, KvPool::BlockBytes(o));
  auto block = [&](int32_t i) { return v.pool + int64_t{ids[i]} * v.block_bytes; };
  for (int32_t i = 0; i < 3; ++i) {
    for (int64_t b = 0; b < v.block_bytes; ++b) block(i)[b] = static_cast<uint8_t>(i * 89 + b * 7);
  }
  // The last scale row of V of the last layer ends exactly at the block end.
  const int32_t last = o.block_size - 1;
  EXPECT_EQ(v.ValueMetaAt(o.n_layers - 1, 0, last, o.n_kv_heads - 1) + v.RowMetaBytes(),
            block(0) + v.block_bytes);
  pool->CopyBlock(hs[0], hs[1]);
  EXPECT_EQ(std::memcmp(block(0), block(1), v.block_bytes), 0);
  EXPECT_NE(std::memcmp(block(2), block(1), v.block_bytes), 0);
}

INSTANTIATE_TEST_SUITE_P(Codecs, KvPoolQuantizedCopyTest,
                         ::testing::Values(kernels::KvDType::kInt8, kernels::KvDType::kInt4,
                                           kernels::KvDType::kFp8E4M3),
                         [](const auto& info) {
                           std::string name(kernels::KvDTypeName(info.param));
                           return name.substr(0, name.find('-'));
                         });

TEST(KvPoolTest, ViewAddressesBlocksAndLayersWithoutOverlap) {
  auto pool = KvPool::Create(SmallPool(4)).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(4, &hs).ok());
  const std::vector<int32_t> ids = Ids(hs);
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

// Stale handles are programmer errors: the pool aborts instead of letting a
// sequence touch memory that now belongs to someone else.
using KvPoolDeathTest = ::testing::Test;

TEST_F(KvPoolDeathTest, ReleasingAStaleHandleAborts) {
  auto pool = KvPool::Create(SmallPool(1)).value();
  std::vector<BlockHandle> old_h, new_h;
  ASSERT_TRUE(pool->Allocate(1, &old_h).ok());
  pool->Release(old_h[0]);
  ASSERT_TRUE(pool->Allocate(1, &new_h).ok());  // same id, next generation
  EXPECT_DEATH(pool->Release(old_h[0]), "KvPool::Release: block 0 \\(generation 0\\) is not live");
  EXPECT_EQ(pool->ref_count(new_h[0]), 1);
}

TEST_F(KvPoolDeathTest, DoubleReleaseAborts) {
  auto pool = KvPool::Create(SmallPool(2)).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(1, &hs).ok());
  pool->Release(hs[0]);
  EXPECT_DEATH(pool->Release(hs[0]), "double release");
}

TEST_F(KvPoolDeathTest, StaleOrForeignHandlesAbortEverywhere) {
  auto pool = KvPool::Create(SmallPool(2)).value();
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool->Allocate(2, &hs).ok());
  const BlockHandle stale = hs[1];
  pool->Release(stale);
  EXPECT_DEATH(pool->AddRef(stale), "KvPool::AddRef: .* is not live");
  EXPECT_DEATH(pool->CopyBlock(hs[0], stale), "KvPool::CopyBlock: .*destination");
  EXPECT_DEATH(pool->CopyBlock(stale, hs[0]), "KvPool::CopyBlock: .*source");
  EXPECT_DEATH(pool->CopyBlock(hs[0], hs[0]), "both source and destination");
  EXPECT_DEATH(pool->Release(BlockHandle{99, 0}), "block 99");
  EXPECT_DEATH(pool->AddRef(BlockHandle{}), "block -1");
}

}  // namespace
}  // namespace kvserve
