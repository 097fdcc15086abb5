// The KV cache manager: only committed full blocks reach the radix index
// (never drafts, never a lossy sequence's), truncation rolls back slots and
// returns whole blocks, allocation is all-or-nothing, and a freed sequence
// leaves its committed tokens cached and no reference behind.
#include "scheduler/kv_cache_manager.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace kvserve {
namespace {

constexpr int32_t kBlock = 4;

std::unique_ptr<KvCacheManager> Make(int32_t blocks, bool prefix_cache = true) {
  KvCacheManagerOptions o;
  o.pool.n_layers = 1;
  o.pool.n_kv_heads = 1;
  o.pool.head_dim = 8;
  o.pool.block_size = kBlock;
  o.pool.n_blocks = blocks;
  o.pool.dtype = kernels::KvDType::kF32;
  o.prefix_cache = prefix_cache;
  o.prefix.model_identity = "test";
  return KvCacheManager::Create(std::move(o)).value();
}

std::vector<int32_t> Tokens(int32_t n, int32_t first = 1) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(KvCacheManagerTest, OnlyCommittedFullBlocksAreOffered) {
  auto m = Make(16);
  SeqKv kv(m->mutable_pool());
  const std::vector<int32_t> t = Tokens(12);
  // 1 committed prompt chunk of 6 + 4 lookahead (draft) slots.
  ASSERT_TRUE(m->AllocateSlots(&kv, 6, 4).ok());
  EXPECT_EQ(kv.table.num_tokens(), 10);
  m->MarkComputed(&kv, 10);  // the forward wrote the drafts' K/V too
  m->Commit(&kv, "", t, 6);
  EXPECT_EQ(m->prefix_cache()->num_cached_blocks(), 1) << "one full committed block";
  EXPECT_EQ(m->PeekPrefix("", t, 12), 4);
  // Two drafts accepted, two rejected: the rejected slots roll back.
  m->Commit(&kv, "", t, 2);
  m->Truncate(&kv, 8);
  EXPECT_EQ(kv.num_computed, 8);
  EXPECT_EQ(kv.table.num_tokens(), 8);
  EXPECT_EQ(m->prefix_cache()->num_cached_blocks(), 2);
  EXPECT_EQ(m->PeekPrefix("", t, 12), 8);
  m->CheckInvariants(kv);
  m->Free(&kv, "", t);
  EXPECT_EQ(kv.table.num_blocks(), 0);
  EXPECT_EQ(m->num_free_blocks() + m->num_evictable_blocks(), 16) << "no reference left";
}

TEST(KvCacheManagerTest, UncommittedTokensNeverReachTheIndex) {
  auto m = Make(16);
  SeqKv kv(m->mutable_pool());
  const std::vector<int32_t> t = Tokens(8);
  ASSERT_TRUE(m->AllocateSlots(&kv, 8).ok());
  m->MarkComputed(&kv, 8);
  m->Commit(&kv, "", t, 3);  // 5 computed, not final
  EXPECT_EQ(m->prefix_cache()->num_cached_blocks(), 0);
  m->Free(&kv, "", t);
  // Free caches what is committed (a partial block of 3), nothing more.
  EXPECT_EQ(m->PeekPrefix("", t, 8), 3);
}

TEST(KvCacheManagerTest, LossySequencesNeverFeedTheIndex) {
  auto m = Make(16);
  SeqKv kv(m->mutable_pool());
  const std::vector<int32_t> t = Tokens(8);
  ASSERT_TRUE(m->AllocateSlots(&kv, 8).ok());
  m->MarkComputed(&kv, 8);
  m->MarkLossy(&kv);
  m->Commit(&kv, "", t, 8);
  m->Free(&kv, "", t);
  EXPECT_EQ(m->prefix_cache()->num_cached_blocks(), 0);
  EXPECT_EQ(m->num_free_blocks(), 16);
}

TEST(KvCacheManagerTest, MatchPrefixPinsAndCountsAsCommitted) {
  auto m = Make(16);
  const std::vector<int32_t> t = Tokens(10);
  {
    SeqKv a(m->mutable_pool());
    ASSERT_TRUE(m->AllocateSlots(&a, 10).ok());
    m->MarkComputed(&a, 10);
    m->Commit(&a, "", t, 10);
    m->Free(&a, "", t);
  }
  SeqKv b(m->mutable_pool());
  EXPECT_EQ(m->MatchPrefix(&b, "", t, 9), 9);
  EXPECT_EQ(b.num_computed, 9);
  EXPECT_EQ(b.num_committed, 9);
  EXPECT_EQ(m->num_evictable_blocks(), 0) << "matched blocks are pinned";
  m->Discard(&b);
  EXPECT_EQ(m->num_evictable_blocks(), 3);
}

TEST(KvCacheManagerTest, SaltsDoNotShare) {
  auto m = Make(16);
  const std::vector<int32_t> t = Tokens(8);
  SeqKv a(m->mutable_pool());
  ASSERT_TRUE(m->AllocateSlots(&a, 8).ok());
  m->MarkComputed(&a, 8);
  m->Commit(&a, "tenant-a", t, 8);
  EXPECT_EQ(m->PeekPrefix("tenant-a", t, 8), 8);
  EXPECT_EQ(m->PeekPrefix("tenant-b", t, 8), 0);
  m->Free(&a, "tenant-a", t);
}

TEST(KvCacheManagerTest, AllocationIsAllOrNothingAndEnsureFreeEvicts) {
  auto m = Make(4);
  const std::vector<int32_t> t = Tokens(16);
  SeqKv a(m->mutable_pool());
  ASSERT_TRUE(m->AllocateSlots(&a, 8).ok());
  m->MarkComputed(&a, 8);
  m->Commit(&a, "", t, 8);
  m->Free(&a, "", t);  // 2 blocks cached, evictable
  EXPECT_EQ(m->num_free_blocks(), 2);
  SeqKv b(m->mutable_pool());
  EXPECT_EQ(m->BlocksNeeded(b, 16), 4);
  EXPECT_TRUE(absl::IsResourceExhausted(m->AllocateSlots(&b, 16)));
  EXPECT_EQ(b.table.num_tokens(), 0) << "nothing taken on failure";
  EXPECT_TRUE(m->EnsureFree(4));
  EXPECT_TRUE(m->AllocateSlots(&b, 16).ok());
  EXPECT_FALSE(m->EnsureFree(1)) << "every block is held";
  m->Discard(&b);
  EXPECT_EQ(m->num_free_blocks(), 4);
}

TEST(KvCacheManagerTest, ForkSharesEveryBlock) {
  auto m = Make(8, /*prefix_cache=*/false);
  const std::vector<int32_t> t = Tokens(6);
  SeqKv a(m->mutable_pool());
  ASSERT_TRUE(m->AllocateSlots(&a, 6).ok());
  m->MarkComputed(&a, 6);
  m->Commit(&a, "", t, 6);
  SeqKv b = m->Fork(a);
  EXPECT_EQ(m->num_free_blocks(), 6);
  EXPECT_EQ(b.num_committed, 6);
  // The shared partial last block is copied before either writes into it.
  EXPECT_EQ(m->BlocksNeeded(b, 1), 1);
  ASSERT_TRUE(m->AllocateSlots(&b, 1).ok());
  EXPECT_NE(a.table.blocks().back().id, b.table.blocks().back().id);
  m->Free(&a, "", t);
  m->Free(&b, "", t);
  EXPECT_EQ(m->num_free_blocks(), 8);
}

TEST(KvCacheManagerTest, WithoutThePrefixCacheNothingIsCached) {
  auto m = Make(8, /*prefix_cache=*/false);
  const std::vector<int32_t> t = Tokens(8);
  SeqKv a(m->mutable_pool());
  EXPECT_EQ(m->MatchPrefix(&a, "", t, 8), 0);
  ASSERT_TRUE(m->AllocateSlots(&a, 8).ok());
  m->MarkComputed(&a, 8);
  m->Commit(&a, "", t, 8);
  m->Free(&a, "", t);
  EXPECT_EQ(m->num_free_blocks(), 8);
  EXPECT_EQ(m->ClearPrefixCache(), -1);
}

TEST(KvCacheManagerDeathTest, CommitPastTheComputedSlotsAborts) {
  auto m = Make(8);
  SeqKv a(m->mutable_pool());
  const std::vector<int32_t> t = Tokens(4);
  ASSERT_TRUE(m->AllocateSlots(&a, 4).ok());
  m->MarkComputed(&a, 2);
  EXPECT_DEATH(m->Commit(&a, "", t, 3), "Commit past the computed slots");
  EXPECT_DEATH(m->Truncate(&a, -1), "Truncate below the committed");
  m->Discard(&a);
}

}  // namespace
}  // namespace kvserve
