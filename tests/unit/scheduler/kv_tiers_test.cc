// KV tiers under the primary pool (scheduler/kv_tiers.h), through the
// engine's seams: blocks the prefix cache evicts are demoted to the host or
// disk tier and loaded back on a later match with greedy output bit-identical
// to tiers off; a corrupted page fails its checksum and is recomputed; a
// request cancelled mid-load keeps its blocks pinned until the load is done;
// the engine keeps serving when every tier is full of pinned blocks. A
// randomized test drives pool, radix index and tiers directly with content
// tags in every block.
#include <xxhash.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "cache/disk_tier.h"
#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "scheduler/kv_tiers.h"
#include "tests/testing/generate.h"
#include "tests/testing/test_models.h"
#include "tests/unit/scheduler/kv_tiers_fixture.h"

namespace kvserve {
namespace {

using Model = testing::WrittenModel;
using tiers_testing::Generate;
using tiers_testing::Greedy;
using tiers_testing::HasTag;
using tiers_testing::kBlocks;
using tiers_testing::Pool;
using tiers_testing::PromptOf;
using tiers_testing::Result;
using tiers_testing::Tag;
using tiers_testing::Tiny;
std::string ScratchDir(const char* name) { return tiers_testing::ScratchDir("tiers-", name); }

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<KvTiers> tiers, int32_t blocks = kBlocks) {
  EngineOptions o;
  o.num_blocks = blocks;
  o.kv_tiers = std::move(tiers);
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::vector<int32_t> Reference(const std::vector<int32_t>& prompt) {
  return Generate(*MakeEngine(nullptr, 64), prompt).tokens;
}

// Every block the cache holds is unpinned and the rest is free: the pool is
// back to its baseline.
void ExpectBaseline(const Engine& e) {
  EXPECT_EQ(e.kv_pool().num_free_blocks() + e.prefix_cache()->num_evictable_blocks(),
            e.kv_pool().num_blocks())
      << "a block is still pinned";
}

// The chained hashes of a prompt's full blocks, as the radix index names them.
std::vector<uint64_t> Chain(const Engine& e, const std::vector<int32_t>& prompt) {
  std::vector<uint64_t> out;
  uint64_t h = e.prefix_cache()->RootHash("");
  const int32_t bs = e.kv_pool().block_size();
  for (size_t i = 0; i + bs <= prompt.size(); i += bs) {
    h = PrefixCache::BlockHash(h, absl::MakeConstSpan(prompt).subspan(i, bs));
    out.push_back(h);
  }
  return out;
}

std::shared_ptr<KvTiers> HostTiers(int64_t bytes = 8 << 20) {
  KvTiersOptions t;
  t.host_bytes = bytes;
  return KvTiers::Create(t).value();
}

TEST(KvTiersTest, EvictedPrefixComesBackFromTheHostTierBitIdentical) {
  const std::vector<int32_t> p1 = PromptOf(1), p2 = PromptOf(2);
  auto tiers = HostTiers();
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);  // needs the pool: p1's blocks are evicted and demoted
  tiers->Flush();
  EXPECT_GE(tiers->stats().demotions_host, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(first.tokens, Reference(p1));
  EXPECT_EQ(again.tokens, first.tokens) << "loaded KV must give the tokens computed KV gives";
  EXPECT_EQ(again.last.cached_tokens, 63) << "all but the last prompt token";
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  EXPECT_EQ(again.last.cached_disk_tokens, 0);
  const EngineStats st = e->Stats();
  EXPECT_EQ(st.kv_loads, 1);
  EXPECT_EQ(st.kv_load_failures, 0);
  EXPECT_EQ(st.tiers.promotions_host, 4);
  EXPECT_EQ(st.tiers.hit_tokens_host, 63);
  EXPECT_EQ(st.tiers.checksum_failures, 0);
  EXPECT_EQ(st.tiers.load_latency_sum_s > 0, true);
  ExpectBaseline(*e);
  tiers->Flush();  // pages the last run evicted publish on the writer
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
}

// Prompts that share their first tokens (a BOS, a chat template's header)
// leave a resident block that matches a demoted prefix only part-way. The
// radix match then ends inside that block; the tiers hold the prefix from
// its first block on, so the scheduler re-matches whole blocks and loads
// from there instead of recomputing all of it.
TEST(KvTiersTest, ADemotedPrefixLoadsEvenWhenAResidentBlockSharesItsFirstTokens) {
  std::vector<int32_t> p1 = PromptOf(1), p2 = PromptOf(2);
  for (int i = 0; i < 5; ++i) p2[i] = p1[i];  // the shared header: 5 of a 16-token block
  auto tiers = HostTiers();
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);  // evicts and demotes p1's blocks; p2's stay resident
  tiers->Flush();
  ASSERT_GE(tiers->stats().demotions_host, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.tokens, Reference(p1));
  EXPECT_EQ(again.last.cached_tokens, 63) << "the 5 shared tokens alone would be a 5-token hit";
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  EXPECT_EQ(e->Stats().kv_loads, 1);
  ExpectBaseline(*e);
  tiers->Flush();  // pages the last run evicted publish on the writer
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
}

// --eviction-policy cost: the engine prices blocks (measured prefill rate,
// the host tier's reload estimate) and the outputs stay what they were.
TEST(KvTiersTest, TheCostAwarePolicyServesTheSameTokensThroughTheTiers) {
  const std::vector<int32_t> p1 = PromptOf(1), p2 = PromptOf(2), p3 = PromptOf(3);
  auto tiers = HostTiers();
  EngineOptions o;
  o.num_blocks = kBlocks;
  o.kv_tiers = tiers;
  o.eviction_policy = EvictionPolicyKind::kCost;
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o).value();
  EXPECT_STREQ(e->prefix_cache()->policy().name(), "cost");
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  Generate(*e, p3);
  tiers->Flush();
  const Result again = Generate(*e, p1);
  EXPECT_EQ(first.tokens, Reference(p1));
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  ExpectBaseline(*e);
}

TEST(KvTiersTest, ACorruptedHostPageFailsItsChecksumAndIsRecomputed) {
  const std::vector<int32_t> p1 = PromptOf(3), p2 = PromptOf(4);
  auto tiers = HostTiers();
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  // Flip one byte of p1's third block in host memory.
  const uint64_t victim = Chain(*e, p1)[2];
  uint64_t cs = 0;
  const uint8_t* page = tiers->host()->Pin(victim, &cs);
  ASSERT_NE(page, nullptr);
  const_cast<uint8_t*>(page)[100] ^= 0x40;
  tiers->host()->Unpin(victim);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, first.tokens) << "recomputed, not served from the bad page";
  EXPECT_EQ(again.last.cached_host_tokens, 0);
  const EngineStats st = e->Stats();
  EXPECT_EQ(st.tiers.checksum_failures, 1);
  EXPECT_EQ(st.kv_load_failures, 1);
  EXPECT_FALSE(tiers->host()->Contains(victim)) << "the bad page is dropped";
  ExpectBaseline(*e);
}

// Reads of the disk tier wait for the test to open a gate.
class GatedFiles : public DiskFileLayer {
 public:
  absl::Status WriteDurably(const std::string& path,
                            const std::vector<std::pair<const void*, size_t>>& parts) override {
    return real()->WriteDurably(path, parts);
  }
  absl::Status Rename(const std::string& a, const std::string& b) override {
    return real()->Rename(a, b);
  }
  absl::Status ReadAt(const std::string& p, int64_t o, void* out, size_t n) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++reads_waiting;
    cv_.wait(lock, [&] { return open_; });
    --reads_waiting;
    lock.unlock();
    return real()->ReadAt(p, o, out, n);
  }
  absl::Status Remove(const std::string& p) override { return real()->Remove(p); }
  absl::Status MakeDirs(const std::string& d) override { return real()->MakeDirs(d); }
  absl::StatusOr<std::vector<std::string>> List(const std::string& d) override {
    return real()->List(d);
  }
  void SetOpen(bool open) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = open;
    }
    cv_.notify_all();
  }
  int reads_waiting = 0;  // guarded by mu_ (read racily by the test: it only waits for it)

 private:
  static DiskFileLayer* real() { return PosixDiskFileLayer(); }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
};

std::shared_ptr<KvTiers> DiskTiers(const std::string& dir, DiskFileLayer* files,
                                   int64_t host_bytes = 0, int32_t min_hits = 0) {
  KvTiersOptions t;
  t.host_bytes = host_bytes;
  t.disk_dir = dir;
  t.disk_bytes = 64 << 20;
  t.model_fingerprint = "test-model";
  t.disk_min_hits = min_hits;
  t.disk_files = files;
  return KvTiers::Create(t).value();
}

TEST(KvTiersTest, ThePrefixComesBackFromTheDiskTierWithoutAHostTier) {
  const std::vector<int32_t> p1 = PromptOf(5), p2 = PromptOf(6);
  auto tiers = DiskTiers(ScratchDir("disk-only"), nullptr);
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  EXPECT_GE(tiers->stats().demotions_disk, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.last.cached_disk_tokens, 63);
  EXPECT_EQ(e->Stats().tiers.promotions_disk, 4);
  ExpectBaseline(*e);
}

// The load-vs-recompute cost model: a tier whose block loads are predicted
// slower than recomputing the block's tokens is left alone (the tokens are
// recomputed, counted), a fast one is loaded, and each timed load moves the
// tier's estimate.
TEST(KvTiersTest, ABlockSlowerToLoadThanToRecomputeIsRecomputed) {
  const std::vector<int32_t> p1 = PromptOf(31), p2 = PromptOf(32);
  KvTiersOptions slow;
  slow.disk_dir = ScratchDir("slow-disk");
  slow.disk_bytes = 64 << 20;
  slow.model_fingerprint = "test-model";
  slow.disk_min_hits = 0;
  slow.disk_block_load_s = 1000;  // far slower than any recompute
  auto tiers = KvTiers::Create(slow).value();
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  ASSERT_GE(tiers->stats().demotions_disk, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.last.cached_disk_tokens, 0) << "recomputed, not loaded";
  const KvTiersStats st = tiers->stats();
  EXPECT_EQ(st.promotions_disk, 0);
  EXPECT_GE(st.recompute_chosen_blocks, 4);
  EXPECT_EQ(st.disk_block_load_s, 1000) << "no load timed: the estimate stays";
  ExpectBaseline(*e);

  // The same with a prior far faster than recomputing: loaded, and the one
  // timed load pulls the estimate up from the prior.
  KvTiersOptions fast = slow;
  fast.disk_dir = ScratchDir("fast-disk");
  fast.disk_block_load_s = 1e-12;
  auto tiers2 = KvTiers::Create(fast).value();
  auto e2 = MakeEngine(tiers2);
  Generate(*e2, p1);
  Generate(*e2, p2);
  tiers2->Flush();
  const Result again2 = Generate(*e2, p1);
  EXPECT_EQ(again2.tokens, first.tokens);
  EXPECT_EQ(again2.last.cached_disk_tokens, 63);
  const KvTiersStats st2 = tiers2->stats();
  EXPECT_EQ(st2.recompute_chosen_blocks, 0);
  EXPECT_GT(st2.disk_block_load_s, 1e-12);
  EXPECT_NEAR(st2.load_predicted_sum_s, 4e-12, 1e-13) << "4 blocks at the prior";
  ExpectBaseline(*e2);
}

TEST(KvTiersTest, TheDiskTakesOnlyBlocksHitAtLeastTwice) {
  const std::vector<int32_t> p1 = PromptOf(7), p2 = PromptOf(8), p3 = PromptOf(9);
  auto tiers = DiskTiers(ScratchDir("min-hits"), nullptr, 0, /*min_hits=*/2);
  // One spare block: a repeat's copy-on-write of the partly matched last
  // block must not evict that block (its node, and its hits, would go).
  auto e = MakeEngine(tiers, kBlocks + 1);
  for (int i = 0; i < 3; ++i) Generate(*e, p1);  // p1's blocks: two hits
  Generate(*e, p2);                              // evicts p1 (to disk)
  Generate(*e, p3);                              // evicts p2 (hit never: dropped)
  tiers->Flush();
  const std::vector<uint64_t> c1 = Chain(*e, p1), c2 = Chain(*e, p2);
  for (uint64_t h : c1) EXPECT_TRUE(tiers->disk()->Contains(h));
  for (uint64_t h : c2) EXPECT_FALSE(tiers->disk()->Contains(h));
  EXPECT_EQ(Generate(*e, p1).last.cached_disk_tokens, 63);
}

TEST(KvTiersTest, HitsBeforeAnEvictionCountTowardsTheDiskAfterARecompute) {
  const std::vector<int32_t> p1 = PromptOf(14), p2 = PromptOf(15);
  auto tiers = DiskTiers(ScratchDir("ghost"), nullptr, 0, /*min_hits=*/2);
  auto e = MakeEngine(tiers, kBlocks + 1);
  Generate(*e, p1);
  Generate(*e, p1);  // one hit
  Generate(*e, p2);  // evicts p1 with one hit: not yet for the disk
  tiers->Flush();
  EXPECT_FALSE(tiers->disk()->Contains(Chain(*e, p1)[1]));
  Generate(*e, p1);  // recomputed: a second use
  Generate(*e, p2);  // evicts it again: now it has proved useful
  tiers->Flush();
  EXPECT_TRUE(tiers->disk()->Contains(Chain(*e, p1)[1]));
}

TEST(KvTiersTest, CancelDuringADiskLoadKeepsBlocksPinnedUntilItEnds) {
  const std::vector<int32_t> p1 = PromptOf(10), p2 = PromptOf(11);
  GatedFiles files;
  auto tiers = DiskTiers(ScratchDir("cancel"), &files);
  auto e = MakeEngine(tiers);
  Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  files.SetOpen(false);
  FinishReason f = FinishReason::kNone;
  auto id = e->Submit({p1, Greedy(8)}, [&](const SeqEvent& ev) {
    if (ev.finish != FinishReason::kNone) f = ev.finish;
  });
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 3; ++i) e->Step();
  ASSERT_EQ(e->Stats().kv_arriving, 1);
  e->Cancel(*id);
  for (int i = 0; i < 3; ++i) e->Step();
  EXPECT_EQ(f, FinishReason::kCancelled) << "the client hears at once";
  EXPECT_LT(e->kv_pool().num_free_blocks() + e->prefix_cache()->num_evictable_blocks(), kBlocks)
      << "the load may still write: its blocks stay pinned";
  files.SetOpen(true);
  while (e->Step()) {
  }
  ExpectBaseline(*e);
  // Nothing pinned in the tier either: a file can be evicted again.
  tiers->Flush();
  uint64_t cs;
  for (uint64_t h : Chain(*e, p1)) {
    ASSERT_TRUE(tiers->disk()->Pin(h, &cs));
    tiers->disk()->Unpin(h);
  }
}

TEST(KvTiersTest, NoDeadlockWhenEveryTierIsFullOfPinnedBlocks) {
  const std::string dir = ScratchDir("full");
  KvTiersOptions t;
  t.host_bytes = 1;  // replaced below: one page
  auto probe = MakeEngine(nullptr);
  const int64_t page = probe->kv_pool().block_bytes();
  probe.reset();
  t.host_bytes = 2 * page;
  t.disk_dir = dir;
  t.disk_bytes = 2 * (page + 64);
  t.model_fingerprint = "test-model";
  t.disk_min_hits = 0;
  auto tiers = KvTiers::Create(t).value();
  auto e = MakeEngine(tiers);
  const std::vector<int32_t> p1 = PromptOf(12);
  Generate(*e, p1);
  Generate(*e, PromptOf(13));
  tiers->Flush();
  // Pin every page and file the tiers hold (as in-flight loads would).
  std::vector<uint64_t> host_pinned, disk_pinned;
  for (int s : {12, 13}) {
    for (uint64_t h : Chain(*e, PromptOf(s))) {
      uint64_t cs;
      if (tiers->host()->Pin(h, &cs) != nullptr) host_pinned.push_back(h);
      if (tiers->disk()->Pin(h, &cs)) disk_pinned.push_back(h);
    }
  }
  ASSERT_EQ(host_pinned.size(), 2u);
  ASSERT_EQ(disk_pinned.size(), 2u);
  // Requests that evict each other keep running: demotions are refused by
  // the full tiers and dropped, never waited for.
  const int64_t dropped_before = e->Stats().tiers.dropped_demotions;
  for (int s = 20; s < 24; ++s) {
    const std::vector<int32_t> p = PromptOf(s);
    EXPECT_EQ(Generate(*e, p).tokens, Reference(p));
  }
  tiers->Flush();
  EXPECT_GT(e->Stats().tiers.dropped_demotions, dropped_before);
  for (uint64_t h : host_pinned) tiers->host()->Unpin(h);
  for (uint64_t h : disk_pinned) tiers->disk()->Unpin(h);
  ExpectBaseline(*e);
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
}

// A decode node's pulls, in-process: it computes a prompt's K/V on a pool of
// its own (as a prefill node would, knowing nothing of the decode side's
// blocks) and copies the requested whole blocks into the target.
class FakePrefillNode : public KvLoader {
 public:
  explicit FakePrefillNode(const KvPoolOptions& o) : pool_(KvPool::Create(o).value()) {}
  bool RematchWholeBlocks() const override { return true; }
  int32_t Lookup(std::string_view, absl::Span<const int32_t>, int32_t from,
                 int32_t limit) override {
    const int32_t bs = pool_->block_size();
    if (from % bs != 0 || limit <= from) return 0;
    return (limit / bs) * bs - from;
  }
  std::shared_ptr<KvLoad> Start(const KvLoadTarget& t) override {
    starts.emplace_back(t.first_slot, t.num_tokens);
    const int32_t bs = pool_->block_size();
    const int32_t end = t.first_slot + t.num_tokens;
    std::vector<BlockHandle> blocks;
    EXPECT_TRUE(pool_->Allocate(end / bs, &blocks).ok());
    std::vector<int32_t> ids, seq(end, 0), pos(end);
    for (const BlockHandle& b : blocks) ids.push_back(b.id);
    for (int32_t i = 0; i < end; ++i) pos[i] = i;
    const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
    auto load = std::make_shared<Landed>();
    load->st = Tiny().model->Forward(
        ForwardBatch{t.tokens.subspan(0, static_cast<size_t>(end)), seq, pos, {}},
        pool_->View(ids.data(), offsets, 1), nullptr, Pool());
    for (int32_t b = t.first_slot / bs; b < end / bs; ++b) {
      std::memcpy(t.view.pool + static_cast<int64_t>(t.view.block_ids[b]) * t.view.block_bytes,
                  pool_->HostBlockData(blocks[b]), static_cast<size_t>(pool_->block_bytes()));
    }
    pool_->Release(blocks);
    return load;
  }
  struct Landed : KvLoad {
    absl::Status st;
    bool Done() override { return true; }
    absl::Status status() override { return st; }
  };
  std::vector<std::pair<int32_t, int32_t>> starts;  // (first_slot, num_tokens)

 private:
  std::unique_ptr<KvPool> pool_;
};

// A decode node with a host tier: the front of a prompt comes from its own
// tier, the rest from the prefill node, in one load; the output is the one
// computed locally.
TEST(KvTiersTest, ADecodeNodeLoadsFromItsTiersFirstAndPullsTheRest) {
  const std::vector<int32_t> p1 = PromptOf(21), p2 = PromptOf(22), p3 = PromptOf(23);
  std::vector<int32_t> longer = p1;  // p1 and two more blocks
  const std::vector<int32_t> more = PromptOf(24, 32);
  longer.insert(longer.end(), more.begin(), more.end());
  auto tiers = HostTiers();
  EngineOptions o;
  o.num_blocks = 8;
  o.kv_tiers = tiers;
  KvPoolOptions po;
  {
    auto probe = MakeEngine(nullptr, 8);
    po = probe->kv_pool().options();
  }
  FakePrefillNode node(po);
  o.kv_loader = &node;
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o).value();
  Generate(*e, p1);
  Generate(*e, p2);
  Generate(*e, p3);  // p1's blocks are evicted into the host tier
  tiers->Flush();
  ASSERT_GE(tiers->stats().demotions_host, 4);
  node.starts.clear();
  const int64_t loads = e->Stats().kv_loads;  // the node supplied p1..p3 too
  const Result r = Generate(*e, longer);
  EXPECT_EQ(r.tokens, Reference(longer)) << "tier blocks + pulled blocks = computed KV";
  EXPECT_EQ(r.last.cached_host_tokens, 64) << "p1's four blocks from the host tier";
  ASSERT_EQ(node.starts.size(), 1u);
  EXPECT_EQ(node.starts[0], std::make_pair(64, 16)) << "the node supplies only what follows";
  EXPECT_EQ(r.last.cached_tokens, 80);
  EXPECT_EQ(e->Stats().kv_loads, loads + 1) << "one load for both halves";
  ExpectBaseline(*e);
}

TEST(KvTiersTest, BadConfigurationsAreNamed) {
  KvTiersOptions t;
  t.disk_dir = ScratchDir("bad");
  t.disk_bytes = 0;
  auto bad = KvTiers::Create(t);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--kv-disk-bytes"), std::string::npos);
  EngineOptions o;
  o.num_blocks = kBlocks;
  o.prefix_cache = false;
  o.kv_tiers = HostTiers();
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("prefix cache"), std::string::npos) << e.status();
  o.prefix_cache = true;
  o.kv_tiers = HostTiers(100);  // less than one block
  e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--kv-host-memory"), std::string::npos) << e.status();
}

// --- Randomized: pool + radix index + tiers, no model --------------------
//
// Every block's bytes are a tag derived from its chained hash, so a block
// that arrives with another block's K/V (a wrong page, a torn copy) is
// caught wherever it is read. Operations: admit a random prompt (match,
// load what the tiers hold — sometimes abandoning the load as a cancel
// does — compute the rest, insert), evict, corrupt a tier page or file.

TEST(KvTiersPropertyTest, RandomDemotePromoteEvictCancelKeepsContentAndCounts) {
  KvPoolOptions po;
  po.n_layers = 2;
  po.n_kv_heads = 1;
  po.head_dim = 4;
  po.block_size = 4;
  po.n_blocks = 14;
  po.dtype = kernels::KvDType::kF32;
  auto pool = KvPool::Create(po).value();
  const int64_t bytes = pool->block_bytes();
  KvTiersOptions to;
  to.host_bytes = 6 * bytes;
  to.disk_dir = ScratchDir("property");
  to.disk_bytes = 10 * (bytes + 64);
  to.model_fingerprint = "property";
  to.disk_min_hits = 1;
  auto tiers = KvTiers::Create(to).value();
  PrefixCacheOptions co;
  co.demotion = tiers.get();
  auto cache = std::make_unique<PrefixCache>(pool.get(), std::move(co));
  ASSERT_TRUE(tiers->Attach(*pool, cache.get()).ok());

  std::mt19937 rng(20261201);
  const int32_t bs = po.block_size;
  int64_t corrupted = 0;  // host pages damaged
  int64_t loads_ok = 0, loads_failed = 0, abandoned = 0;
  for (int op = 0; op < 1500; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 7) {
      // A prompt of 1-4 blocks over a tiny alphabet: prefixes are shared.
      const int32_t n_blocks = 1 + static_cast<int32_t>(rng() % 4);
      std::vector<int32_t> tokens(n_blocks * bs);
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 2);
      std::vector<uint64_t> chain;
      uint64_t h = cache->RootHash("");
      for (int32_t b = 0; b < n_blocks; ++b) {
        h = PrefixCache::BlockHash(h, absl::MakeConstSpan(tokens).subspan(b * bs, bs));
        chain.push_back(h);
      }
      PrefixMatch m = cache->Match("", tokens, static_cast<int32_t>(tokens.size()));
      // A partly shared last block (another prefix's) is not ours to read.
      const int32_t full = m.num_tokens / bs;
      std::vector<BlockHandle> blocks(m.blocks.begin(), m.blocks.begin() + full);
      pool->Release(absl::MakeConstSpan(m.blocks).subspan(full));
      for (size_t b = 0; b < blocks.size(); ++b) {
        ASSERT_TRUE(HasTag(pool->HostBlockData(blocks[b]), bytes, chain[b]))
            << "a cached block holds another block's bytes (op " << op << ")";
      }
      const int32_t from = full * bs;
      const int32_t limit = static_cast<int32_t>(tokens.size());
      const int32_t n = tiers->Lookup("", tokens, from, limit);
      ASSERT_EQ(n % bs, 0);
      const int32_t need = n_blocks - static_cast<int32_t>(blocks.size());
      if (pool->num_free_blocks() < need) cache->Evict(need - pool->num_free_blocks());
      if (pool->num_free_blocks() < need) {
        pool->Release(blocks);
        continue;
      }
      ASSERT_TRUE(pool->Allocate(need, &blocks).ok());
      int32_t computed_from = from;
      if (n > 0) {
        std::vector<int32_t> ids;
        for (const BlockHandle& b : blocks) ids.push_back(b.id);
        const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
        KvLoadTarget t;
        t.tokens = tokens;
        t.first_slot = from;
        t.num_tokens = n;
        t.view = pool->View(ids.data(), offsets, 1);
        std::shared_ptr<KvLoad> load = tiers->Start(t);
        if (load != nullptr) {
          // Demotions and evictions race with the load (the engine goes on).
          if (rng() % 3 == 0) cache->Evict(1 + static_cast<int32_t>(rng() % 3));
          while (!load->Done()) std::this_thread::yield();
          if (!load->status().ok()) {
            ++loads_failed;
            ASSERT_TRUE(absl::IsDataLoss(load->status())) << load->status();
          }
          if (rng() % 5 == 0) {
            ++abandoned;  // as AbandonLoad: released only once Done, never cached
            pool->Release(blocks);
            continue;
          }
          if (load->status().ok()) {
            ++loads_ok;
            for (int32_t b = from / bs; b < (from + n) / bs; ++b) {
              ASSERT_TRUE(HasTag(pool->HostBlockData(blocks[b]), bytes, chain[b]))
                  << "a load delivered wrong bytes (op " << op << ")";
            }
            computed_from = from + n;
          }
        }
      }
      // "Compute" the rest: the tag is what the forward would have written.
      for (int32_t b = computed_from / bs; b < n_blocks; ++b) {
        Tag(const_cast<uint8_t*>(pool->HostBlockData(blocks[b])), bytes, chain[b]);
      }
      cache->Insert("", tokens, blocks);
      pool->Release(blocks);
    } else if (kind < 9) {
      cache->Evict(1 + static_cast<int32_t>(rng() % 5));
    } else {
      // Corrupt one tier copy of a random recent prefix block.
      std::vector<int32_t> tokens(bs);
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 2);
      const uint64_t h = PrefixCache::BlockHash(cache->RootHash(""), tokens);
      tiers->Flush();
      uint64_t cs;
      if (const uint8_t* p = tiers->host()->Pin(h, &cs)) {
        const_cast<uint8_t*>(p)[rng() % bytes] ^= 1;
        tiers->host()->Unpin(h);
        ++corrupted;
      }
    }
  }
  tiers->Flush();
  const KvTiersStats st = tiers->stats();
  EXPECT_GT(loads_ok, 50);
  EXPECT_GT(st.promotions_host, 0) << "the host tier was exercised";
  EXPECT_GT(st.promotions_disk, 0) << "the disk tier was exercised";
  EXPECT_GT(st.demotions_disk, 0);
  EXPECT_GT(abandoned, 0);
  EXPECT_EQ(st.checksum_failures, loads_failed);
  EXPECT_GT(loads_failed, 0) << "corruption was caught (" << corrupted << " pages damaged)";
  cache->Clear();
  EXPECT_EQ(pool->num_free_blocks(), po.n_blocks) << "blocks leaked";
  EXPECT_EQ(tiers->host()->stats().pinned, 0) << "a tier page stayed pinned";
  cache.reset();
}

}  // namespace
}  // namespace kvserve
