#include "cache/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/kv_pool.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

constexpr int32_t kBlockSize = 4;

KvPoolOptions TinyPool(int32_t blocks) {
  KvPoolOptions o;
  o.n_layers = 1;
  o.n_kv_heads = 1;
  o.head_dim = 4;
  o.block_size = kBlockSize;
  o.n_blocks = blocks;
  return o;
}

class FakeClock : public Clock {
 public:
  int64_t NowNanos() override { return now; }
  int64_t now = 0;
};

class RecordingSink : public KvEventSink {
 public:
  void Publish(std::vector<KvCacheEvent> events) override { batches.push_back(std::move(events)); }
  std::vector<std::vector<KvCacheEvent>> batches;
};

// What the hash of a block under `parent` must be, computed independently of
// the cache: XXH3 over the parent hash's bytes then the tokens' bytes.
uint64_t ExpectedHash(uint64_t parent, const std::vector<int32_t>& tokens) {
  std::vector<unsigned char> buf(sizeof(parent) + tokens.size() * sizeof(int32_t));
  std::memcpy(buf.data(), &parent, sizeof(parent));
  std::memcpy(buf.data() + sizeof(parent), tokens.data(), tokens.size() * sizeof(int32_t));
  return XXH3_64bits(buf.data(), buf.size());
}

// A per-block content tag kept in the block's own memory, so a block that was
// freed and handed to someone else shows up as a changed tag.
void WriteTag(KvPool& pool, BlockHandle h, uint64_t tag) {
  const kernels::PagedKvView v = pool.View(nullptr, nullptr, 0);
  std::memcpy(v.pool + static_cast<int64_t>(h.id) * v.block_bytes, &tag, sizeof(tag));
}
uint64_t ReadTag(const KvPool& pool, BlockHandle h) {
  const kernels::PagedKvView v = pool.View(nullptr, nullptr, 0);
  uint64_t tag;
  std::memcpy(&tag, v.pool + static_cast<int64_t>(h.id) * v.block_bytes, sizeof(tag));
  return tag;
}

std::vector<int32_t> Ids(const std::vector<BlockHandle>& hs) {
  std::vector<int32_t> ids;
  for (const BlockHandle& h : hs) ids.push_back(h.id);
  return ids;
}

class PrefixCacheTest : public ::testing::Test {
 protected:
  PrefixCacheTest() : pool_(KvPool::Create(TinyPool(32)).value()) { MakeCache(); }

  void MakeCache() {
    PrefixCacheOptions o;
    o.model_identity = "test-model";
    o.clock = &clock_;
    o.events = &sink_;
    cache_ = std::make_unique<PrefixCache>(pool_.get(), std::move(o));
  }

  // Fresh blocks for the full blocks of tokens, as a finished sequence holds.
  std::vector<BlockHandle> Blocks(const std::vector<int32_t>& tokens) {
    std::vector<BlockHandle> hs;
    EXPECT_TRUE(pool_->Allocate(static_cast<int32_t>(tokens.size()) / kBlockSize, &hs).ok());
    return hs;
  }

  // Inserts like a finished sequence does (insert, then drop its own
  // references); returns the blocks it used.
  std::vector<BlockHandle> InsertFresh(std::string_view salt, const std::vector<int32_t>& tokens,
                                       int32_t* added = nullptr) {
    std::vector<BlockHandle> hs = Blocks(tokens);
    const int32_t n = cache_->Insert(salt, tokens, hs);
    if (added != nullptr) *added = n;
    pool_->Release(hs);
    return hs;
  }

  FakeClock clock_;
  RecordingSink sink_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<PrefixCache> cache_;
};

// Sliding window (W = 6, block 4): hollow nodes keep the path but give their
// block back; a match ends only where its last W tokens all have K/V, and
// hands out the stand-in for hollow blocks before that; an Insert of real
// blocks refills them; evictable counts stay exact; hollow leaves go first
// and free nothing.
TEST_F(PrefixCacheTest, WindowHollowNodesCutMatchesAndRefill) {
  std::vector<BlockHandle> stand;
  ASSERT_TRUE(pool_->Allocate(1, &stand).ok());
  cache_->SetWindow(6, stand[0]);
  std::vector<int32_t> seq;
  for (int32_t i = 0; i < 24; ++i) seq.push_back(100 + i);  // 6 blocks
  const int32_t free0 = pool_->num_free_blocks();
  const std::vector<BlockHandle> hs = InsertFresh("", seq);
  EXPECT_EQ(pool_->num_free_blocks(), free0 - 6);
  // A boundary at 24 keeps blocks 4 and 5 ((24 - 6) / 4 = 4 on).
  EXPECT_EQ(cache_->KeepWindow("", seq, 4), 2);
  for (int32_t b = 0; b < 6; ++b) {
    EXPECT_EQ(cache_->HollowBlock(hs[static_cast<size_t>(b)]), b < 4) << b;
  }
  EXPECT_FALSE(cache_->HollowBlock(hs[0]));  // no node holds it any more
  EXPECT_EQ(cache_->num_hollow_blocks(), 4);
  EXPECT_EQ(cache_->num_cached_blocks(), 2);
  EXPECT_EQ(pool_->num_free_blocks(), free0 - 2);
  EXPECT_EQ(cache_->num_evictable_blocks(), cache_->CountEvictableBlocksSlow());
  // 24 tokens: the window before 24 is blocks 4, 5; fine. 23 too. 16 would
  // need blocks 2, 3: cut to 0. The path still spells 24.
  EXPECT_EQ(cache_->MatchLength("", seq, 24), 24);
  EXPECT_EQ(cache_->MatchLength("", seq, 23), 23);
  EXPECT_EQ(cache_->MatchLength("", seq, 16), 0);
  EXPECT_EQ(cache_->PathLength("", seq, 16), 16);
  EXPECT_EQ(cache_->Probe("", std::vector<int32_t>(seq.begin(), seq.begin() + 16)).window_dropped_tokens,
            16);
  PrefixMatch m = cache_->Match("", seq, 23);
  ASSERT_EQ(m.blocks.size(), 6u);
  for (size_t b = 0; b < 4; ++b) EXPECT_EQ(m.blocks[b].id, stand[0].id) << b;
  EXPECT_EQ(m.blocks[4].id, hs[4].id);
  pool_->Release(m.blocks);
  EXPECT_EQ(cache_->stats().window_dropped_tokens, 0);
  pool_->Release(cache_->Match("", seq, 16).blocks);
  EXPECT_EQ(cache_->stats().window_dropped_tokens, 16);
  // Inserting the stand-in over hollow nodes changes nothing; real blocks
  // refill them.
  const std::vector<BlockHandle> stand6(6, stand[0]);
  EXPECT_EQ(cache_->Insert("", seq, stand6), 0);
  EXPECT_EQ(cache_->num_hollow_blocks(), 4);
  const std::vector<BlockHandle> again = InsertFresh("", std::vector<int32_t>(seq.begin(), seq.begin() + 8));
  EXPECT_EQ(cache_->num_hollow_blocks(), 2);
  EXPECT_EQ(cache_->MatchLength("", seq, 8), 8);
  EXPECT_EQ(cache_->num_evictable_blocks(), cache_->CountEvictableBlocksSlow());
  // Evicting everything: 4 real blocks freed (hollow ones free nothing), and
  // no node is left.
  EXPECT_EQ(cache_->Evict(100), 4);
  EXPECT_EQ(cache_->num_hollow_blocks(), 0);
  EXPECT_EQ(cache_->num_cached_blocks(), 0);
  EXPECT_EQ(pool_->num_free_blocks(), free0);
  pool_->Release(stand);
}

// Nodes inserted from lossy K/V (a re-encoding KV tier) carry the mark:
// a match reports the tokens it covers from them (partly used blocks by
// their shared tokens), an exact path already cached keeps being exact, and
// eviction hands the mark to the demotion sink.
TEST_F(PrefixCacheTest, LossyNodesAreReportedByMatchAndEviction) {
  const std::vector<int32_t> exact = {1, 2, 3, 4};
  InsertFresh("", exact);
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool_->Allocate(3, &hs).ok());
  // The first block is cached exact already: only the two new ones are lossy.
  EXPECT_EQ(cache_->Insert("", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, hs, /*lossy=*/true), 2);
  pool_->Release(hs);
  PrefixMatch m = cache_->Match("", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 77}, 11);
  EXPECT_EQ(m.num_tokens, 10);
  EXPECT_EQ(m.lossy_tokens, 6) << "4 of block 2, 2 shared of block 3";
  pool_->Release(m.blocks);
  PrefixMatch e = cache_->Match("", {1, 2, 3, 4, 9}, 5);
  EXPECT_EQ(e.num_tokens, 4);
  EXPECT_EQ(e.lossy_tokens, 0);
  pool_->Release(e.blocks);

  struct Sink : BlockDemotionSink {
    KvTier Demote(const EvictedBlock& b) override {
      (b.lossy ? lossy : exact) += 1;
      return KvTier::kNone;
    }
    int lossy = 0, exact = 0;
  } sink;
  PrefixCacheOptions o;
  o.model_identity = "test-model";
  o.clock = &clock_;
  o.demotion = &sink;
  cache_.reset();
  cache_ = std::make_unique<PrefixCache>(pool_.get(), std::move(o));
  InsertFresh("", exact);
  std::vector<BlockHandle> hs2;
  ASSERT_TRUE(pool_->Allocate(2, &hs2).ok());
  cache_->Insert("", {1, 2, 3, 4, 5, 6, 7, 8}, hs2, /*lossy=*/true);
  pool_->Release(hs2);
  EXPECT_EQ(cache_->Evict(10), 2);
  EXPECT_EQ(sink.lossy, 1);
  EXPECT_EQ(sink.exact, 1);
}

// A finished sequence's partial last block becomes a childless leaf that
// later prompts reuse up to the tokens it holds.
// A stored chain's first block names its namespace (KvCacheEvent::scope):
// the salt for a salted request, nothing for the default namespace; the
// blocks below a first block never carry one.
TEST_F(PrefixCacheTest, StoredEventsNameTheNamespaceOfFirstBlocks) {
  std::vector<int32_t> tokens(2 * kBlockSize);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i + 1);
  sink_.batches.clear();
  InsertFresh("tenant:acme\x1fs1", tokens);
  InsertFresh("", tokens);
  std::vector<KvCacheEvent> stored;
  for (const auto& b : sink_.batches) {
    for (const KvCacheEvent& e : b) {
      if (e.kind == KvCacheEvent::Kind::kBlockStored) stored.push_back(e);
    }
  }
  ASSERT_EQ(stored.size(), 4u);
  EXPECT_EQ(stored[0].parent_hash, 0u);
  EXPECT_EQ(stored[0].scope, "tenant:acme\x1fs1");
  EXPECT_EQ(stored[1].scope, "");
  EXPECT_EQ(stored[2].parent_hash, 0u);
  EXPECT_EQ(stored[2].scope, "");
  EXPECT_NE(stored[0].block_hash, stored[2].block_hash);
}

TEST_F(PrefixCacheTest, FinishedSequencesCacheTheirPartialLastBlock) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};  // 2 full + 2
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool_->Allocate(3, &hs).ok());
  sink_.batches.clear();
  EXPECT_EQ(cache_->InsertFinished("", seq, hs), 3);
  pool_->Release(hs);
  EXPECT_EQ(cache_->num_cached_blocks(), 3);
  // The next turn: the whole finished sequence, then more.
  const std::vector<int32_t> next = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  PrefixMatch m = cache_->Match("", next, 12);
  EXPECT_EQ(m.num_tokens, 10);
  EXPECT_EQ(Ids(m.blocks), Ids(hs));
  pool_->Release(m.blocks);
  // A prompt that parts from it inside the tail shares only what it shares.
  EXPECT_EQ(cache_->MatchLength("", {1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 1}, 11), 9);
  // The tail leaf's event: parent is the second block, 2 tokens.
  ASSERT_FALSE(sink_.batches.empty());
  const KvCacheEvent& tail = sink_.batches.back().back();
  EXPECT_EQ(tail.token_ids, (std::vector<int32_t>{9, 10}));
  const uint64_t root = cache_->RootHash("");
  const uint64_t b1 = ExpectedHash(ExpectedHash(root, {1, 2, 3, 4}), {5, 6, 7, 8});
  EXPECT_EQ(tail.parent_hash, b1);
  EXPECT_EQ(tail.block_hash, ExpectedHash(b1, {9, 10}));
  // A longer sequence through the same prefix caches its full third block as
  // a sibling; the tail leaf never gets children.
  std::vector<int32_t> longer = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  int32_t added = 0;
  InsertFresh("", longer, &added);
  EXPECT_EQ(added, 2);
  EXPECT_EQ(cache_->MatchLength("", longer, 16), 16);
  // A tail that a cached block already starts with adds nothing.
  std::vector<BlockHandle> again;
  ASSERT_TRUE(pool_->Allocate(3, &again).ok());
  EXPECT_EQ(cache_->InsertFinished("", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, again), 0);
  pool_->Release(again);
  // Everything is evictable again and goes back to the pool.
  EXPECT_EQ(cache_->num_evictable_blocks(), cache_->num_cached_blocks());
  cache_->Clear();
  EXPECT_EQ(pool_->num_free_blocks(), pool_->num_blocks());
}

// Shorter than one block: the tail hangs directly under the namespace root.
TEST_F(PrefixCacheTest, AShortFinishedSequenceIsCachedAsATailUnderTheRoot) {
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool_->Allocate(1, &hs).ok());
  EXPECT_EQ(cache_->InsertFinished("salt", {7, 8}, hs), 1);
  pool_->Release(hs);
  EXPECT_EQ(cache_->MatchLength("salt", {7, 8, 9}, 2), 2);
  EXPECT_EQ(cache_->MatchLength("other", {7, 8, 9}, 2), 0);
  EXPECT_EQ(cache_->Evict(5), 1);
  EXPECT_EQ(pool_->num_free_blocks(), pool_->num_blocks());
}

TEST_F(PrefixCacheTest, FullBlocksMatchWhole) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  int32_t added = 0;
  const std::vector<BlockHandle> stored = InsertFresh("", seq, &added);
  EXPECT_EQ(added, 3);
  EXPECT_EQ(cache_->num_cached_blocks(), 3);

  std::vector<int32_t> longer = seq;
  longer.insert(longer.end(), {13, 14, 15, 16, 17});
  PrefixMatch m = cache_->Match("", longer, 100);
  EXPECT_EQ(m.num_tokens, 12);
  EXPECT_EQ(Ids(m.blocks), Ids(stored));
  for (const BlockHandle& h : m.blocks) EXPECT_EQ(pool_->ref_count(h), 2);  // cache + caller
  pool_->Release(m.blocks);
  for (const BlockHandle& h : m.blocks) EXPECT_EQ(pool_->ref_count(h), 1);
}

TEST_F(PrefixCacheTest, MissReturnsNothing) {
  InsertFresh("", {1, 2, 3, 4});
  PrefixMatch m = cache_->Match("", std::vector<int32_t>{9, 9, 9, 9, 9}, 100);
  EXPECT_EQ(m.num_tokens, 0);
  EXPECT_TRUE(m.blocks.empty());
  EXPECT_EQ(cache_->Match("", {}, 100).num_tokens, 0);
}

TEST_F(PrefixCacheTest, PartialBlockCountsOnlySharedTokens) {
  const std::vector<BlockHandle> stored = InsertFresh("", {1, 2, 3, 4, 5, 6, 7, 8});
  // Diverges inside the second block.
  PrefixMatch m = cache_->Match("", std::vector<int32_t>{1, 2, 3, 4, 5, 6, 0, 0, 0}, 100);
  EXPECT_EQ(m.num_tokens, 6);
  EXPECT_EQ(Ids(m.blocks), Ids(stored));
  pool_->Release(m.blocks);
  // Ends inside the second block.
  m = cache_->Match("", std::vector<int32_t>{1, 2, 3, 4, 5}, 100);
  EXPECT_EQ(m.num_tokens, 5);
  EXPECT_EQ(m.blocks.size(), 2u);
  pool_->Release(m.blocks);
  // Diverges inside the first block.
  m = cache_->Match("", std::vector<int32_t>{1, 2, 0, 0, 0, 0}, 100);
  EXPECT_EQ(m.num_tokens, 2);
  ASSERT_EQ(m.blocks.size(), 1u);
  EXPECT_EQ(m.blocks[0].id, stored[0].id);
  pool_->Release(m.blocks);
}

TEST_F(PrefixCacheTest, PartialMatchTakesTheChildSharingMostAndTiesGoToTheOlder) {
  const std::vector<BlockHandle> a = InsertFresh("", {1, 2, 3, 4, 5, 6, 7, 8});
  const std::vector<BlockHandle> b = InsertFresh("", {1, 2, 3, 4, 5, 9, 9, 9});
  const std::vector<BlockHandle> c = InsertFresh("", {1, 2, 3, 4, 5, 6, 7, 0});
  // a and c both share 3 tokens; a was cached first.
  PrefixMatch m = cache_->Match("", std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 1}, 100);
  EXPECT_EQ(m.num_tokens, 7);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[1].id, a[1].id);
  pool_->Release(m.blocks);
  // Only b shares 2.
  m = cache_->Match("", std::vector<int32_t>{1, 2, 3, 4, 5, 9, 1, 1}, 100);
  EXPECT_EQ(m.num_tokens, 6);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[1].id, b[1].id);
  pool_->Release(m.blocks);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 0, 1}, 100), 8);
  (void)c;
}

TEST_F(PrefixCacheTest, MaxTokensCapsTheMatch) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  InsertFresh("", seq);
  PrefixMatch m = cache_->Match("", seq, 10);
  EXPECT_EQ(m.num_tokens, 10);
  EXPECT_EQ(m.blocks.size(), 3u);  // the third partly used
  pool_->Release(m.blocks);
  m = cache_->Match("", seq, 8);
  EXPECT_EQ(m.num_tokens, 8);
  EXPECT_EQ(m.blocks.size(), 2u);
  pool_->Release(m.blocks);
  m = cache_->Match("", seq, 0);
  EXPECT_EQ(m.num_tokens, 0);
  EXPECT_TRUE(m.blocks.empty());
  EXPECT_EQ(cache_->MatchLength("", seq, 11), 11);
  EXPECT_EQ(cache_->MatchLength("", seq, -5), 0);
  const PrefixCacheStats s = cache_->stats();
  EXPECT_EQ(s.queries, 3);
  EXPECT_EQ(s.query_tokens, 10 + 8 + 0);
  EXPECT_EQ(s.hit_tokens, 10 + 8);
}

TEST_F(PrefixCacheTest, SaltsIsolate) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8};
  InsertFresh("tenant-a", seq);
  EXPECT_EQ(cache_->MatchLength("tenant-a", seq, 100), 8);
  EXPECT_EQ(cache_->MatchLength("tenant-b", seq, 100), 0);
  EXPECT_EQ(cache_->MatchLength("", seq, 100), 0);
  EXPECT_NE(cache_->RootHash("tenant-a"), cache_->RootHash("tenant-b"));
  // The same tokens under another salt are separate nodes with other hashes.
  int32_t added = 0;
  InsertFresh("tenant-b", seq, &added);
  EXPECT_EQ(added, 2);
  const std::vector<KvCacheEvent> dump = cache_->Dump();
  ASSERT_EQ(dump.size(), 4u);
  std::set<uint64_t> hashes;
  for (const KvCacheEvent& e : dump) hashes.insert(e.block_hash);
  EXPECT_EQ(hashes.size(), 4u);
}

TEST(PrefixCacheRootTest, IdentityAndSaltSplitOneWayOnly) {
  auto pool = KvPool::Create(TinyPool(4)).value();
  PrefixCacheOptions o1;
  o1.model_identity = "ab";
  PrefixCacheOptions o2;
  o2.model_identity = "a";
  PrefixCache c1(pool.get(), std::move(o1));
  PrefixCache c2(pool.get(), std::move(o2));
  EXPECT_NE(c1.RootHash("c"), c2.RootHash("bc"));
  EXPECT_EQ(c1.RootHash("c"), c1.RootHash("c"));
  EXPECT_STREQ(c1.policy().name(), "lru");
}

TEST_F(PrefixCacheTest, InsertKeepsTheCachedBlockForTheSameContent) {
  const std::vector<BlockHandle> first = InsertFresh("", {1, 2, 3, 4, 5, 6, 7, 8});
  const std::vector<int32_t> longer = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<BlockHandle> second = Blocks(longer);
  EXPECT_EQ(cache_->Insert("", longer, second), 1);
  // The duplicates were not taken: the caller is their only holder.
  EXPECT_EQ(pool_->ref_count(second[0]), 1);
  EXPECT_EQ(pool_->ref_count(second[1]), 1);
  EXPECT_EQ(pool_->ref_count(second[2]), 2);
  pool_->Release(second);
  EXPECT_EQ(cache_->num_cached_blocks(), 3);
  EXPECT_EQ(pool_->num_free_blocks(), 32 - 3);
  PrefixMatch m = cache_->Match("", longer, 100);
  EXPECT_EQ(Ids(m.blocks), (std::vector<int32_t>{first[0].id, first[1].id, second[2].id}));
  pool_->Release(m.blocks);
  EXPECT_EQ(cache_->stats().inserted_blocks, 3);
}

TEST_F(PrefixCacheTest, InsertIgnoresTheTrailingPartialBlock) {
  int32_t added = 0;
  std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  std::vector<BlockHandle> hs;
  ASSERT_TRUE(pool_->Allocate(3, &hs).ok());  // the sequence's partial third block too
  added = cache_->Insert("", seq, hs);
  EXPECT_EQ(added, 2);
  EXPECT_EQ(pool_->ref_count(hs[2]), 1);
  pool_->Release(hs);
  EXPECT_EQ(cache_->MatchLength("", seq, 100), 8);
}

TEST_F(PrefixCacheTest, EvictsLeastRecentlyUsedFirst) {
  clock_.now = 1;
  InsertFresh("", {1, 1, 1, 1});
  clock_.now = 2;
  InsertFresh("", {2, 2, 2, 2});
  clock_.now = 3;
  InsertFresh("", {3, 3, 3, 3});
  clock_.now = 4;
  pool_->Release(cache_->Match("", std::vector<int32_t>{1, 1, 1, 1}, 100).blocks);
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{2, 2, 2, 2}, 100), 0);
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{3, 3, 3, 3}, 100), 0);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{1, 1, 1, 1}, 100), 4);
  EXPECT_EQ(cache_->stats().evicted_blocks, 2);
}

TEST_F(PrefixCacheTest, TiesGoToTheBlockInsertedFirst) {
  clock_.now = 7;
  InsertFresh("", {2, 2, 2, 2});
  InsertFresh("", {1, 1, 1, 1});
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{2, 2, 2, 2}, 100), 0);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{1, 1, 1, 1}, 100), 4);
}

TEST_F(PrefixCacheTest, MatchLengthNeitherPinsNorTouches) {
  clock_.now = 1;
  const std::vector<BlockHandle> old = InsertFresh("", {1, 1, 1, 1});
  clock_.now = 2;
  InsertFresh("", {2, 2, 2, 2});
  clock_.now = 3;
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{1, 1, 1, 1}, 100), 4);
  EXPECT_EQ(pool_->ref_count(old[0]), 1);
  EXPECT_EQ(cache_->stats().queries, 0);
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{1, 1, 1, 1}, 100), 0);
}

TEST_F(PrefixCacheTest, ParentBecomesACandidateOnceItsChildrenAreGone) {
  clock_.now = 1;
  InsertFresh("", {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3});
  clock_.now = 2;
  InsertFresh("", {9, 9, 9, 9});
  sink_.batches.clear();
  // The whole older chain goes, leaf first, before the newer block.
  EXPECT_EQ(cache_->Evict(3), 3);
  EXPECT_EQ(cache_->num_cached_blocks(), 1);
  EXPECT_EQ(cache_->MatchLength("", std::vector<int32_t>{9, 9, 9, 9}, 100), 4);
  ASSERT_EQ(sink_.batches.size(), 1u);
  const uint64_t h1 = ExpectedHash(cache_->RootHash(""), {1, 1, 1, 1});
  const uint64_t h2 = ExpectedHash(h1, {2, 2, 2, 2});
  const uint64_t h3 = ExpectedHash(h2, {3, 3, 3, 3});
  const std::vector<KvCacheEvent>& removed = sink_.batches[0];
  ASSERT_EQ(removed.size(), 3u);
  EXPECT_EQ(removed[0].block_hash, h3);
  EXPECT_EQ(removed[1].block_hash, h2);
  EXPECT_EQ(removed[2].block_hash, h1);
  for (const KvCacheEvent& e : removed) EXPECT_EQ(e.kind, KvCacheEvent::Kind::kBlockRemoved);
  EXPECT_EQ(pool_->num_free_blocks(), 31);
}

TEST_F(PrefixCacheTest, PinnedBlocksAreNeverEvicted) {
  const std::vector<int32_t> seq = {1, 1, 1, 1, 2, 2, 2, 2};
  InsertFresh("", seq);
  PrefixMatch all = cache_->Match("", seq, 100);
  EXPECT_EQ(cache_->num_evictable_blocks(), 0);
  EXPECT_EQ(cache_->Evict(10), 0);
  pool_->Release(all.blocks);
  // Pinning only the first block leaves its child evictable, not itself.
  PrefixMatch head = cache_->Match("", seq, 4);
  ASSERT_EQ(head.blocks.size(), 1u);
  EXPECT_EQ(cache_->num_evictable_blocks(), 1);
  EXPECT_EQ(cache_->Evict(10), 1);
  EXPECT_EQ(cache_->num_cached_blocks(), 1);
  EXPECT_TRUE(pool_->IsLive(head.blocks[0]));
  pool_->Release(head.blocks);
  EXPECT_EQ(cache_->num_evictable_blocks(), 1);
  EXPECT_EQ(cache_->Evict(10), 1);
  EXPECT_EQ(pool_->num_free_blocks(), 32);
}

TEST_F(PrefixCacheTest, EvictableCountsWholeUnpinnedChains) {
  // a-b-c chain and a-d branch; pin d only.
  InsertFresh("", {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3});
  InsertFresh("", {1, 1, 1, 1, 4, 4, 4, 4});
  EXPECT_EQ(cache_->num_evictable_blocks(), 4);
  std::vector<BlockHandle> d = cache_->Match("", std::vector<int32_t>{1, 1, 1, 1, 4, 4, 4, 4}, 100).blocks;
  ASSERT_EQ(d.size(), 2u);
  pool_->Release(d[0]);  // keep only d pinned, not a
  EXPECT_EQ(cache_->num_evictable_blocks(), 2);  // b and c; a has a pinned child
  EXPECT_EQ(cache_->Evict(10), 2);
  EXPECT_EQ(cache_->num_cached_blocks(), 2);
  pool_->Release(d[1]);
  EXPECT_EQ(cache_->num_evictable_blocks(), 2);
}

// The evictable count is kept incrementally from the pool's refcount
// callbacks: references taken and dropped outside the cache (a sequence's
// table releasing, forks sharing) must move it exactly like a recount.
TEST_F(PrefixCacheTest, EvictableCountFollowsOutsideReferences) {
  auto check = [&](int32_t want) {
    EXPECT_EQ(cache_->num_evictable_blocks(), want);
    EXPECT_EQ(cache_->CountEvictableBlocksSlow(), want);
  };
  // A running sequence offers its blocks while it still holds them.
  const std::vector<int32_t> seq = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4};
  std::vector<BlockHandle> hs = Blocks(seq);
  EXPECT_EQ(cache_->Insert("", seq, hs), 4);
  check(0);
  // A fork shares them (AddRef on shared blocks), the parent finishes.
  for (const BlockHandle& h : hs) pool_->AddRef(h);
  pool_->Release(hs);
  check(0);
  // The fork releases its blocks from the front, as a table does: the chain
  // stays blocked until the deepest block goes.
  for (size_t i = 0; i + 1 < hs.size(); ++i) {
    pool_->Release(hs[i]);
    check(0);
  }
  pool_->Release(hs.back());
  check(4);
  // A match pins the path; releasing the leaf first unblocks from below.
  PrefixMatch m = cache_->Match("", seq, 100);
  ASSERT_EQ(m.blocks.size(), 4u);
  check(0);
  pool_->Release(m.blocks[3]);
  check(1);
  pool_->Release(m.blocks[1]);
  check(1);  // blocks[2] is still pinned, so 1 stays blocked
  pool_->Release(m.blocks[2]);
  check(3);
  pool_->Release(m.blocks[0]);
  check(4);
  // The same pool block cached under two prefixes (a caller's misuse): the
  // cache's own two references keep both pinned, and eviction cannot split them.
  std::vector<BlockHandle> one;
  ASSERT_TRUE(pool_->Allocate(1, &one).ok());
  EXPECT_EQ(cache_->Insert("x", {7, 7, 7, 7}, one), 1);
  EXPECT_EQ(cache_->Insert("y", {8, 8, 8, 8}, one), 1);
  pool_->Release(one);
  check(4);
  EXPECT_EQ(cache_->Evict(100), 4);
  check(0);
  EXPECT_EQ(cache_->Clear(), 2);
  check(0);
  EXPECT_EQ(pool_->num_free_blocks(), 32);
}

// Two caches over one pool both hear every refcount change; destroying one
// leaves the other's count exact.
TEST(PrefixCacheObserverTest, TwoCachesOnOnePool) {
  auto pool = KvPool::Create(TinyPool(8)).value();
  auto a = std::make_unique<PrefixCache>(pool.get(), PrefixCacheOptions{});
  PrefixCache b(pool.get(), PrefixCacheOptions{});
  std::vector<BlockHandle> ha, hb;
  ASSERT_TRUE(pool->Allocate(1, &ha).ok());
  ASSERT_TRUE(pool->Allocate(1, &hb).ok());
  a->Insert("", {1, 1, 1, 1}, ha);
  b.Insert("", {2, 2, 2, 2}, hb);
  EXPECT_EQ(b.num_evictable_blocks(), 0);
  a.reset();
  pool->Release(ha);
  pool->Release(hb);
  EXPECT_EQ(b.num_evictable_blocks(), 1);
  EXPECT_EQ(b.CountEvictableBlocksSlow(), 1);
  EXPECT_EQ(pool->num_free_blocks(), 7);
}

TEST_F(PrefixCacheTest, ClearKeepsPinnedBlocksAlive) {
  const std::vector<int32_t> seq = {1, 1, 1, 1, 2, 2, 2, 2};
  InsertFresh("", seq);
  InsertFresh("x", {5, 5, 5, 5});
  PrefixMatch pinned = cache_->Match("", seq, 100);
  for (const BlockHandle& h : pinned.blocks) WriteTag(*pool_, h, 0xabc0 + h.id);
  sink_.batches.clear();
  EXPECT_EQ(cache_->Clear(), 3);
  EXPECT_EQ(cache_->num_cached_blocks(), 0);
  EXPECT_EQ(cache_->MatchLength("", seq, 100), 0);
  ASSERT_EQ(sink_.batches.size(), 1u);
  ASSERT_EQ(sink_.batches[0].size(), 1u);
  EXPECT_EQ(sink_.batches[0][0].kind, KvCacheEvent::Kind::kAllCleared);
  for (const BlockHandle& h : pinned.blocks) {
    EXPECT_EQ(pool_->ref_count(h), 1);
    EXPECT_EQ(ReadTag(*pool_, h), 0xabc0u + h.id);
  }
  pool_->Release(pinned.blocks);
  EXPECT_EQ(pool_->num_free_blocks(), 32);
}

TEST_F(PrefixCacheTest, DestructorReleasesTheCachesReferences) {
  InsertFresh("", {1, 1, 1, 1, 2, 2, 2, 2});
  sink_.batches.clear();
  cache_.reset();
  EXPECT_EQ(pool_->num_free_blocks(), 32);
  EXPECT_TRUE(sink_.batches.empty());
}

TEST_F(PrefixCacheTest, EventsCarryChainedHashesAndParents) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8};
  InsertFresh("s", seq);
  ASSERT_EQ(sink_.batches.size(), 1u);
  const std::vector<KvCacheEvent>& stored = sink_.batches[0];
  ASSERT_EQ(stored.size(), 2u);
  const uint64_t h1 = ExpectedHash(cache_->RootHash("s"), {1, 2, 3, 4});
  const uint64_t h2 = ExpectedHash(h1, {5, 6, 7, 8});
  EXPECT_EQ(stored[0].kind, KvCacheEvent::Kind::kBlockStored);
  EXPECT_EQ(stored[0].block_hash, h1);
  EXPECT_EQ(stored[0].parent_hash, 0u);
  EXPECT_EQ(stored[0].token_ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(stored[1].block_hash, h2);
  EXPECT_EQ(stored[1].parent_hash, h1);
  EXPECT_EQ(stored[1].token_ids, (std::vector<int32_t>{5, 6, 7, 8}));
  // A duplicate insert changes nothing, so publishes nothing; nor does Match.
  InsertFresh("s", seq);
  pool_->Release(cache_->Match("s", seq, 100).blocks);
  EXPECT_EQ(sink_.batches.size(), 1u);
  EXPECT_EQ(cache_->Evict(5), 2);
  ASSERT_EQ(sink_.batches.size(), 2u);
  ASSERT_EQ(sink_.batches[1].size(), 2u);
  EXPECT_EQ(sink_.batches[1][0].block_hash, h2);
  EXPECT_EQ(sink_.batches[1][1].block_hash, h1);
  EXPECT_EQ(cache_->Evict(5), 0);
  EXPECT_EQ(sink_.batches.size(), 2u);
}

TEST_F(PrefixCacheTest, DumpListsParentsFirst) {
  clock_.now = 1;
  InsertFresh("", {1, 1, 1, 1, 2, 2, 2, 2});
  clock_.now = 2;
  InsertFresh("", {3, 3, 3, 3});
  clock_.now = 3;
  InsertFresh("", {1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5, 6, 6, 6, 6});
  InsertFresh("", {1, 1, 1, 1, 7, 7, 7, 7});
  InsertFresh("t", {1, 1, 1, 1});
  const std::vector<KvCacheEvent> dump = cache_->Dump();
  EXPECT_EQ(dump.size(), 7u);
  std::set<uint64_t> seen;
  for (const KvCacheEvent& e : dump) {
    EXPECT_EQ(e.kind, KvCacheEvent::Kind::kBlockStored);
    EXPECT_TRUE(e.parent_hash == 0 || seen.count(e.parent_hash)) << e.block_hash;
    seen.insert(e.block_hash);
  }
}

TEST_F(PrefixCacheTest, StatsCountQueriesHitsAndBlocks) {
  const std::vector<int32_t> seq = {1, 2, 3, 4, 5, 6, 7, 8};
  InsertFresh("", seq);
  pool_->Release(cache_->Match("", std::vector<int32_t>{1, 2, 3, 4, 5, 0, 0, 0, 0, 0}, 100).blocks);
  pool_->Release(cache_->Match("", std::vector<int32_t>{9, 9}, 100).blocks);
  cache_->Evict(1);
  const PrefixCacheStats s = cache_->stats();
  EXPECT_EQ(s.queries, 2);
  EXPECT_EQ(s.query_tokens, 12);
  EXPECT_EQ(s.hit_tokens, 5);
  EXPECT_EQ(s.inserted_blocks, 2);
  EXPECT_EQ(s.evicted_blocks, 1);
  EXPECT_EQ(s.cached_blocks, 1);
}

// ---------------------------------------------------------------------------
// Randomized: thousands of operations against a deliberately naive model.

// The reference: every cached block keyed by (salt, the whole token prefix it
// ends), found by linear scans. No tree, no hashes.
struct RefBlock {
  std::string salt;
  std::vector<int32_t> prefix;  // tokens [0, end of this block)
  BlockHandle block;
  int64_t last_access = 0;
  uint64_t seq = 0;
};

class ReferenceCache {
 public:
  explicit ReferenceCache(int32_t bs) : bs_(bs) {}

  RefBlock* Find(const std::string& salt, const std::vector<int32_t>& prefix) {
    for (RefBlock& b : blocks_) {
      if (b.salt == salt && b.prefix == prefix) return &b;
    }
    return nullptr;
  }

  // Same answer as PrefixCache::Match, as the list of blocks it returns.
  std::vector<RefBlock*> Match(const std::string& salt, const std::vector<int32_t>& tokens,
                               int32_t max_tokens, int32_t* num_tokens) {
    const int32_t limit = std::max(0, std::min<int32_t>(tokens.size(), max_tokens));
    std::vector<RefBlock*> out;
    int32_t pos = 0;
    while (pos + bs_ <= limit) {
      RefBlock* b = Find(salt, std::vector<int32_t>(tokens.begin(), tokens.begin() + pos + bs_));
      if (b == nullptr) break;
      out.push_back(b);
      pos += bs_;
    }
    *num_tokens = pos;
    if (pos == limit) return out;
    const int32_t rest = std::min(bs_, limit - pos);
    RefBlock* best = nullptr;
    int32_t best_shared = 0;
    for (RefBlock& b : blocks_) {
      if (b.salt != salt || static_cast<int32_t>(b.prefix.size()) != pos + bs_ ||
          !std::equal(tokens.begin(), tokens.begin() + pos, b.prefix.begin())) {
        continue;
      }
      int32_t shared = 0;
      while (shared < rest && b.prefix[pos + shared] == tokens[pos + shared]) ++shared;
      if (shared > best_shared || (shared == best_shared && shared > 0 && b.seq < best->seq)) {
        best = &b;
        best_shared = shared;
      }
    }
    if (best != nullptr) out.push_back(best);
    *num_tokens = pos + best_shared;
    return out;
  }

  int32_t Insert(const std::string& salt, const std::vector<int32_t>& tokens,
                 const std::vector<BlockHandle>& handles, int64_t now) {
    int32_t added = 0;
    for (size_t i = 0; i < tokens.size() / bs_ && i < handles.size(); ++i) {
      std::vector<int32_t> prefix(tokens.begin(), tokens.begin() + (i + 1) * bs_);
      if (RefBlock* b = Find(salt, prefix)) {
        b->last_access = now;
        continue;
      }
      blocks_.push_back(RefBlock{salt, std::move(prefix), handles[i], now, next_seq_++});
      ++added;
    }
    return added;
  }

  bool IsChild(const RefBlock& child, const RefBlock& parent) const {
    return child.salt == parent.salt && child.prefix.size() == parent.prefix.size() + bs_ &&
           std::equal(parent.prefix.begin(), parent.prefix.end(), child.prefix.begin());
  }
  bool IsUnder(const RefBlock& d, const RefBlock& a) const {
    return d.salt == a.salt && d.prefix.size() >= a.prefix.size() &&
           std::equal(a.prefix.begin(), a.prefix.end(), d.prefix.begin());
  }

  // held(block id): how many references the test holds on that block.
  template <typename Held>
  int32_t Evict(int32_t n, Held held) {
    int32_t evicted = 0;
    while (evicted < n) {
      auto victim = blocks_.end();
      for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
        if (held(it->block.id) > 0) continue;
        bool leaf = true;
        for (const RefBlock& o : blocks_) leaf = leaf && !IsChild(o, *it);
        if (!leaf) continue;
        if (victim == blocks_.end() ||
            std::tie(it->last_access, it->seq) < std::tie(victim->last_access, victim->seq)) {
          victim = it;
        }
      }
      if (victim == blocks_.end()) break;
      blocks_.erase(victim);
      ++evicted;
    }
    return evicted;
  }

  template <typename Held>
  int32_t NumEvictable(Held held) const {
    int32_t count = 0;
    for (const RefBlock& a : blocks_) {
      bool free_below = true;
      for (const RefBlock& d : blocks_) {
        if (IsUnder(d, a) && held(d.block.id) > 0) free_below = false;
      }
      count += free_below;
    }
    return count;
  }

  // What Dump must hold: (hash, parent hash or 0, tokens) of every block.
  std::set<std::tuple<uint64_t, uint64_t, std::vector<int32_t>>> Expected(
      const PrefixCache& cache) const {
    std::set<std::tuple<uint64_t, uint64_t, std::vector<int32_t>>> out;
    for (const RefBlock& b : blocks_) {
      uint64_t h = cache.RootHash(b.salt);
      uint64_t parent = 0;
      for (size_t i = 0; i < b.prefix.size(); i += bs_) {
        parent = i == 0 ? 0 : h;
        h = ExpectedHash(h, std::vector<int32_t>(b.prefix.begin() + i, b.prefix.begin() + i + bs_));
      }
      out.emplace(h, parent, std::vector<int32_t>(b.prefix.end() - bs_, b.prefix.end()));
    }
    return out;
  }

  void Clear() { blocks_.clear(); }
  const std::vector<RefBlock>& blocks() const { return blocks_; }

 private:
  int32_t bs_;
  std::vector<RefBlock> blocks_;
  uint64_t next_seq_ = 1;
};

// Applies the event stream, to check it rebuilds exactly what Dump shows.
class ReplicaSink : public KvEventSink {
 public:
  void Publish(std::vector<KvCacheEvent> events) override {
    EXPECT_FALSE(events.empty()) << "empty batch";
    for (KvCacheEvent& e : events) {
      switch (e.kind) {
        case KvCacheEvent::Kind::kBlockStored:
          EXPECT_TRUE(e.parent_hash == 0 || blocks.count(e.parent_hash)) << "orphan store";
          EXPECT_TRUE(blocks.emplace(e.block_hash, std::make_pair(e.parent_hash, e.token_ids)).second)
              << "stored twice";
          break;
        case KvCacheEvent::Kind::kBlockRemoved:
          EXPECT_EQ(blocks.erase(e.block_hash), 1u) << "removed unknown block";
          break;
        case KvCacheEvent::Kind::kAllCleared:
          blocks.clear();
          break;
      }
    }
  }
  std::map<uint64_t, std::pair<uint64_t, std::vector<int32_t>>> blocks;
};

uint64_t ContentTag(const std::string& salt, const std::vector<int32_t>& prefix) {
  std::string s = salt;
  s.push_back('\0');
  s.append(reinterpret_cast<const char*>(prefix.data()), prefix.size() * sizeof(int32_t));
  return XXH3_64bits(s.data(), s.size()) | 1;  // never 0, unlike fresh memory
}

struct Pin {
  BlockHandle block;
  uint64_t tag;
};

// (seed, pool blocks): a smaller pool evicts more and runs short of room.
class PrefixCachePropertyTest
    : public ::testing::TestWithParam<std::tuple<uint32_t, int32_t>> {};

TEST_P(PrefixCachePropertyTest, RandomOperationsAgreeWithANaiveModel) {
  const int32_t kPoolBlocks = std::get<1>(GetParam());
  constexpr int kOps = 6000;
  std::mt19937 rng(std::get<0>(GetParam()));
  auto uniform = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  // Sequences that share prefixes a lot: half extend (a cut of) an earlier
  // one, and a 3-token vocabulary makes even fresh blocks collide and
  // partial matches common.
  std::vector<std::vector<int32_t>> corpus;
  for (int i = 0; i < 300; ++i) {
    std::vector<int32_t> s;
    if (!corpus.empty() && uniform(0, 1) == 0) {
      const std::vector<int32_t>& base = corpus[uniform(0, corpus.size() - 1)];
      s.assign(base.begin(), base.begin() + uniform(0, base.size()));
    }
    const int extra = uniform(0, 14);
    for (int j = 0; j < extra; ++j) s.push_back(uniform(0, 2));
    if (s.size() > 40) s.resize(40);
    corpus.push_back(std::move(s));
  }
  const std::string salts[2] = {"", "tenant-b"};

  auto pool = KvPool::Create(TinyPool(kPoolBlocks)).value();
  FakeClock clock;
  ReplicaSink replica;
  PrefixCacheOptions o;
  o.model_identity = "prop-model";
  o.clock = &clock;
  o.events = &replica;
  PrefixCache cache(pool.get(), std::move(o));
  ReferenceCache ref(kBlockSize);

  std::vector<Pin> pins;
  std::map<int32_t, int32_t> held;  // block id -> references the test holds
  auto held_fn = [&held](int32_t id) {
    auto it = held.find(id);
    return it == held.end() ? 0 : it->second;
  };
  auto hold = [&](BlockHandle h, uint64_t tag) {
    pins.push_back({h, tag});
    ++held[h.id];
  };
  auto drop = [&](size_t i) {
    pool->Release(pins[i].block);
    if (--held[pins[i].block.id] == 0) held.erase(pins[i].block.id);
    pins.erase(pins.begin() + i);
  };
  int64_t ref_inserted = 0, ref_evicted = 0;
  // Frees room for `need` blocks through both caches; false if it cannot.
  auto make_room = [&](int32_t need) {
    const int32_t short_by = need - pool->num_free_blocks();
    if (short_by > 0) {
      const int32_t got = cache.Evict(short_by);
      EXPECT_EQ(got, ref.Evict(short_by, held_fn));
      ref_evicted += got;
    }
    return pool->num_free_blocks() >= need;
  };
  // A Match on both, checked; the returned blocks come back pinned (held).
  auto match_both = [&](const std::string& salt, const std::vector<int32_t>& tokens,
                        int32_t max_tokens, int32_t* num_tokens) {
    int32_t ref_tokens = 0;
    std::vector<RefBlock*> want = ref.Match(salt, tokens, max_tokens, &ref_tokens);
    PrefixMatch got = cache.Match(salt, tokens, max_tokens);
    EXPECT_EQ(got.num_tokens, ref_tokens);
    EXPECT_EQ(got.blocks.size(), want.size());
    std::vector<Pin> out;
    for (size_t i = 0; i < got.blocks.size(); ++i) {
      const uint64_t tag =
          i < want.size() ? ContentTag(salt, want[i]->prefix) : ReadTag(*pool, got.blocks[i]);
      if (i < want.size()) {
        EXPECT_EQ(got.blocks[i].id, want[i]->block.id);
        want[i]->last_access = clock.now;
      }
      EXPECT_EQ(ReadTag(*pool, got.blocks[i]), tag) << "matched block holds other content";
      hold(got.blocks[i], tag);
    }
    *num_tokens = got.num_tokens;
    return got.blocks.size();
  };

  int counts[8] = {};
  for (int op = 0; op < kOps; ++op) {
    SCOPED_TRACE(absl::StrCat("op ", op));
    clock.now += uniform(0, 2);  // 0 makes ties, which insertion order breaks
    const std::string& salt = salts[uniform(0, 1)];
    std::vector<int32_t> tokens = corpus[uniform(0, corpus.size() - 1)];
    const int32_t n_full = static_cast<int32_t>(tokens.size()) / kBlockSize;
    const int dice = uniform(0, 999);
    if (dice < 200) {
      // A finished sequence with fresh blocks for every full block.
      ++counts[0];
      if (!make_room(n_full)) continue;
      std::vector<BlockHandle> hs;
      ASSERT_TRUE(pool->Allocate(n_full, &hs).ok());
      for (int32_t i = 0; i < n_full; ++i) {
        WriteTag(*pool, hs[i],
                 ContentTag(salt, std::vector<int32_t>(tokens.begin(),
                                                       tokens.begin() + (i + 1) * kBlockSize)));
      }
      const int32_t added = cache.Insert(salt, tokens, hs);
      EXPECT_EQ(added, ref.Insert(salt, tokens, hs, clock.now));
      ref_inserted += added;
      pool->Release(hs);
    } else if (dice < 350) {
      // The engine's way: match, reuse the fully matched blocks, compute the
      // rest into fresh ones (the partial block copied first), insert.
      ++counts[1];
      const size_t first_pin = pins.size();
      int32_t matched = 0;
      match_both(salt, tokens, static_cast<int32_t>(tokens.size()), &matched);
      const int32_t reuse = matched / kBlockSize;
      std::vector<BlockHandle> hs;
      for (int32_t i = 0; i < reuse; ++i) hs.push_back(pins[first_pin + i].block);
      const int32_t fresh = n_full - reuse;
      if (make_room(fresh)) {
        std::vector<BlockHandle> extra;
        ASSERT_TRUE(pool->Allocate(fresh, &extra).ok());
        for (int32_t i = 0; i < fresh; ++i) {
          WriteTag(*pool, extra[i],
                   ContentTag(salt, std::vector<int32_t>(
                                        tokens.begin(), tokens.begin() + (reuse + i + 1) * kBlockSize)));
        }
        hs.insert(hs.end(), extra.begin(), extra.end());
        const int32_t added = cache.Insert(salt, tokens, hs);
        EXPECT_EQ(added, ref.Insert(salt, tokens, hs, clock.now));
        ref_inserted += added;
        pool->Release(extra);
      }
      while (pins.size() > first_pin) drop(pins.size() - 1);
    } else if (dice < 600) {
      // A new request: sometimes a variant, sometimes capped, and some keep
      // their pins for a while (running sequences).
      ++counts[2];
      if (!tokens.empty() && uniform(0, 3) == 0) tokens[uniform(0, tokens.size() - 1)] = uniform(0, 2);
      const int32_t max_tokens =
          uniform(0, 1) == 0 ? static_cast<int32_t>(tokens.size()) : uniform(-1, tokens.size() + 2);
      const size_t first_pin = pins.size();
      int32_t matched = 0;
      match_both(salt, tokens, max_tokens, &matched);
      if (pins.size() > 12 || uniform(0, 2) != 0) {
        while (pins.size() > first_pin) drop(pins.size() - 1);
      }
    } else if (dice < 700) {
      ++counts[3];
      const int32_t max_tokens = uniform(0, tokens.size() + 2);
      int32_t want = 0;
      ref.Match(salt, tokens, max_tokens, &want);
      EXPECT_EQ(cache.MatchLength(salt, tokens, max_tokens), want);
    } else if (dice < 800) {
      ++counts[4];
      if (!pins.empty()) drop(uniform(0, pins.size() - 1));
    } else if (dice < 995) {
      ++counts[5];
      const int32_t n = uniform(0, 8);
      const int32_t got = cache.Evict(n);
      EXPECT_EQ(got, ref.Evict(n, held_fn));
      ref_evicted += got;
    } else {
      ++counts[6];
      EXPECT_EQ(cache.Clear(), static_cast<int32_t>(ref.blocks().size()));
      ref.Clear();
    }

    // Invariants after every operation.
    ASSERT_EQ(cache.num_cached_blocks(), static_cast<int32_t>(ref.blocks().size()));
    ASSERT_EQ(cache.num_evictable_blocks(), ref.NumEvictable(held_fn));
    // The incremental count against a full recount over the pool.
    ASSERT_EQ(cache.num_evictable_blocks(), cache.CountEvictableBlocksSlow());
    std::set<int32_t> in_use;
    for (const RefBlock& b : ref.blocks()) {
      // The cache's one reference plus the test's.
      ASSERT_EQ(pool->ref_count(b.block), 1 + held_fn(b.block.id));
      ASSERT_EQ(ReadTag(*pool, b.block), ContentTag(b.salt, b.prefix));
      in_use.insert(b.block.id);
    }
    for (const Pin& p : pins) {
      ASSERT_TRUE(pool->IsLive(p.block));
      ASSERT_GE(pool->ref_count(p.block), 1);
      ASSERT_EQ(ReadTag(*pool, p.block), p.tag) << "a pinned block was reused";
      in_use.insert(p.block.id);
    }
    ASSERT_EQ(pool->num_free_blocks(), kPoolBlocks - static_cast<int32_t>(in_use.size()));
    const auto expected = ref.Expected(cache);
    std::set<std::tuple<uint64_t, uint64_t, std::vector<int32_t>>> dumped, replicated;
    for (const KvCacheEvent& e : cache.Dump()) dumped.emplace(e.block_hash, e.parent_hash, e.token_ids);
    for (const auto& [hash, rest] : replica.blocks) replicated.emplace(hash, rest.first, rest.second);
    ASSERT_EQ(dumped, expected);
    ASSERT_EQ(replicated, expected);
    const PrefixCacheStats s = cache.stats();
    ASSERT_EQ(s.inserted_blocks, ref_inserted);
    ASSERT_EQ(s.evicted_blocks, ref_evicted);
  }
  // The run must have exercised what it claims to.
  EXPECT_GT(ref_evicted, 500);
  EXPECT_GT(counts[6], 10);
  EXPECT_GT(cache.stats().hit_tokens, 1000);

  while (!pins.empty()) drop(pins.size() - 1);
  cache.Clear();
  EXPECT_EQ(pool->num_free_blocks(), kPoolBlocks);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PrefixCachePropertyTest,
                         ::testing::Values(std::make_tuple(20240611u, 48), std::make_tuple(7u, 48),
                                           std::make_tuple(99u, 24), std::make_tuple(1234u, 96)));

// --- Cost-aware eviction (MakeCostAwarePolicy) ---------------------------

// Prices set per block by the first token of its prompt (the test's tag):
// recompute and reload in seconds, reload < 0 meaning no tier takes it.
class FakeCosts : public EvictionCosts {
 public:
  double RecomputeSeconds(const CachedBlockInfo& b) const override {
    auto it = recompute.find(b.hash);
    return it == recompute.end() ? 1.0 : it->second;
  }
  double ReloadSeconds(const CachedBlockInfo& b) const override {
    auto it = reload.find(b.hash);
    return it == reload.end() ? -1.0 : it->second;
  }
  std::map<uint64_t, double> recompute, reload;
};

class CostAwareEvictionTest : public PrefixCacheTest {
 protected:
  CostAwareEvictionTest() {
    PrefixCacheOptions o;
    o.model_identity = "test-model";
    o.clock = &clock_;
    o.policy = MakeCostAwarePolicy(&costs_);
    cache_ = std::make_unique<PrefixCache>(pool_.get(), std::move(o));
  }
  // A one-block prompt tagged t, inserted at time `at`; returns its hash.
  uint64_t Put(int32_t t, int64_t at) {
    clock_.now = at;
    const std::vector<int32_t> tokens = {t, t, t, t};
    InsertFresh("", tokens);
    return ExpectedHash(cache_->RootHash(""), tokens);
  }
  void Hit(int32_t t, int64_t at) {
    clock_.now = at;
    const std::vector<int32_t> tokens = {t, t, t, t, 0};
    PrefixMatch m = cache_->Match("", tokens, 4);
    ASSERT_EQ(m.num_tokens, 4);
    pool_->Release(m.blocks);
  }
  bool Cached(int32_t t) const {
    const std::vector<int32_t> tokens = {t, t, t, t, 0};
    return cache_->MatchLength("", tokens, 4) == 4;
  }
  FakeCosts costs_;
};

TEST_F(CostAwareEvictionTest, EqualCostsAndNoHitsEvictInInsertionOrderLikeLru) {
  for (int32_t t = 1; t <= 4; ++t) Put(t, t);
  EXPECT_STREQ(cache_->policy().name(), "cost");
  EXPECT_EQ(cache_->Evict(2), 2);
  EXPECT_FALSE(Cached(1));
  EXPECT_FALSE(Cached(2));
  EXPECT_TRUE(Cached(3));
  EXPECT_TRUE(Cached(4));
}

TEST_F(CostAwareEvictionTest, ABlockATierWouldReloadGoesBeforeOneThatMustBeRecomputed) {
  const uint64_t a = Put(1, 1);  // older, but dropped if evicted: recompute 1 s
  const uint64_t b = Put(2, 2);  // newer, but the host tier would take it
  costs_.reload[b] = 0.001;
  (void)a;
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_TRUE(Cached(1)) << "LRU would have evicted the older block";
  EXPECT_FALSE(Cached(2));
}

TEST_F(CostAwareEvictionTest, AnExpensiveBlockOutlivesACheapOne) {
  const uint64_t deep = Put(1, 1);
  Put(2, 2);
  costs_.recompute[deep] = 5.0;  // a block deep in a long prompt
  EXPECT_EQ(cache_->Evict(1), 1);
  EXPECT_TRUE(Cached(1));
  EXPECT_FALSE(Cached(2));
}

TEST_F(CostAwareEvictionTest, HitsProtectABlockButEveryBlockAges) {
  Put(1, 1);
  for (int i = 0; i < 3; ++i) Hit(1, 2 + i);  // frequency 4
  // Fresh one-use blocks arrive and the pool evicts one at a time: the hit
  // block outlives the first few, then inflation passes its key and it
  // goes too (it is not kept forever for being popular once).
  int32_t evicted_before_it = 0;
  for (int32_t t = 2; t < 20 && Cached(1); ++t) {
    Put(t, 10 + t);
    ASSERT_EQ(cache_->Evict(1), 1);
    if (Cached(1)) ++evicted_before_it;
  }
  EXPECT_GE(evicted_before_it, 3) << "hits bought the block no extra life";
  EXPECT_FALSE(Cached(1)) << "an untouched block must age out eventually";
}

}  // namespace
}  // namespace kvserve
