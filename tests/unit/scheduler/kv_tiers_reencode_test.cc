// --kv-host-dtype (scheduler/kv_tiers.h): blocks re-encoded into a narrower
// codec on demotion and decoded back on promotion. Pages shrink, so a budget
// holds more blocks; a load from such a tier reports its tokens as lossy,
// the radix nodes it enters are marked lossy (a later match from the pool
// reports them too, and so does whatever is computed on top of them); a
// host dtype equal to the pool's is byte-identical; a host dtype that would
// not shrink the pages is refused; the disk tier's directory depends on it.
#include <filesystem>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/kv_transcode.h"
#include "scheduler/engine.h"
#include "scheduler/kv_tiers.h"
#include "tests/testing/generate.h"
#include "tests/testing/test_models.h"
#include "tests/unit/scheduler/kv_tiers_fixture.h"

namespace kvserve {
namespace {

using Model = testing::WrittenModel;
using tiers_testing::Greedy;
using tiers_testing::kBlocks;
using tiers_testing::Pool;
using tiers_testing::PromptOf;
using tiers_testing::Result;
using tiers_testing::Tiny;
using tiers_testing::Generate;
std::string ScratchDir(const char* name) { return tiers_testing::ScratchDir("tiers-reencode-", name); }

absl::StatusOr<std::unique_ptr<Engine>> TryEngine(std::shared_ptr<KvTiers> tiers,
                                                  kernels::KvDType dtype = kernels::KvDType::kF16,
                                                  int32_t blocks = kBlocks) {
  EngineOptions o;
  o.num_blocks = blocks;
  o.kv_dtype = dtype;
  o.kv_tiers = std::move(tiers);
  return Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o);
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<KvTiers> tiers,
                                   kernels::KvDType dtype = kernels::KvDType::kF16,
                                   int32_t blocks = kBlocks) {
  auto e = TryEngine(std::move(tiers), dtype, blocks);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::shared_ptr<KvTiers> HostTiers(std::optional<kernels::KvDType> host_dtype,
                                   int64_t bytes = 8 << 20) {
  KvTiersOptions t;
  t.host_bytes = bytes;
  t.host_dtype = host_dtype;
  return KvTiers::Create(t).value();
}

std::shared_ptr<KvTiers> DiskTiers(const std::string& dir,
                                   std::optional<kernels::KvDType> host_dtype) {
  KvTiersOptions t;
  t.disk_dir = dir;
  t.disk_bytes = 64 << 20;
  t.model_fingerprint = "test-model";
  t.disk_min_hits = 0;
  t.host_dtype = host_dtype;
  return KvTiers::Create(t).value();
}

void ExpectBaseline(const Engine& e) {
  EXPECT_EQ(e.kv_pool().num_free_blocks() + e.prefix_cache()->num_evictable_blocks(),
            e.kv_pool().num_blocks())
      << "a block is still pinned";
}

// How many of a's tokens equal b's from the front.
size_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

TEST(KvTiersReencodeTest, Int8PagesAreSmallerSoTheSameBudgetHoldsMoreBlocks) {
  auto same = HostTiers(std::nullopt, 4 << 20);
  auto int8 = HostTiers(kernels::KvDType::kInt8, 4 << 20);
  auto kivi = HostTiers(kernels::KvDType::kInt4Kivi, 4 << 20);
  auto e1 = MakeEngine(same);
  auto e2 = MakeEngine(int8);
  auto e3 = MakeEngine(kivi);
  const int64_t block = e1->kv_pool().block_bytes();
  EXPECT_FALSE(same->lossy());
  EXPECT_EQ(same->page_bytes(), block);
  EXPECT_TRUE(int8->lossy());
  EXPECT_LT(int8->page_bytes(), block * 3 / 4);
  EXPECT_LT(kivi->page_bytes(), int8->page_bytes());
  EXPECT_GT(int8->host()->capacity_pages(), same->host()->capacity_pages() * 3 / 2);
  EXPECT_GT(kivi->host()->capacity_pages(), int8->host()->capacity_pages());
  const KvPoolOptions& po = e1->kv_pool().options();
  EXPECT_EQ(int8->page_bytes(),
            kernels::KvBlockBytes(kernels::KvDType::kInt8, {po.n_layers, po.n_kv_heads,
                                                            po.head_dim, po.block_size}));
}

TEST(KvTiersReencodeTest, AHostDtypeEqualToThePoolsIsBitIdentical) {
  const std::vector<int32_t> p1 = PromptOf(41), p2 = PromptOf(42);
  auto tiers = HostTiers(kernels::KvDType::kF16);  // the pool's own: same
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  const Result again = Generate(*e, p1);
  EXPECT_FALSE(tiers->lossy());
  EXPECT_EQ(again.tokens, first.tokens);
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  EXPECT_EQ(again.last.cached_lossy_tokens, 0);
  EXPECT_FALSE(again.last.lossy_kv);
  EXPECT_EQ(tiers->stats().lossy_reencoded_blocks, 0);
  // The page is the pool block's bytes, unchanged.
  EXPECT_EQ(tiers->page_bytes(), e->kv_pool().block_bytes());
}

TEST(KvTiersReencodeTest, Int8HostTierRoundTripIsReportedLossyAndMarksTheRadixNodes) {
  const std::vector<int32_t> p1 = PromptOf(43), p2 = PromptOf(44), p3 = PromptOf(45);
  auto tiers = HostTiers(kernels::KvDType::kInt8);
  auto e = MakeEngine(tiers);
  const Result first = Generate(*e, p1);
  EXPECT_EQ(first.last.cached_lossy_tokens, 0);
  EXPECT_FALSE(first.last.lossy_kv);
  Generate(*e, p2);  // evicts p1: re-encoded into int8 host pages
  tiers->Flush();
  EXPECT_GE(tiers->stats().lossy_reencoded_blocks, 4);

  // Back from the host tier, decoded into f16: lossy, and said so.
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  EXPECT_EQ(again.last.cached_lossy_tokens, 63);
  EXPECT_TRUE(again.last.lossy_kv);
  EXPECT_EQ(tiers->stats().lossy_hit_tokens, 63);
  EXPECT_EQ(tiers->stats().checksum_failures, 0);
  EXPECT_EQ(again.tokens.size(), first.tokens.size());
  // int8 K/V on a random tiny model: greedy stays close (the first token at
  // least; near-ties later may flip).
  EXPECT_GE(CommonPrefix(again.tokens, first.tokens), 1u)
      << "int8-decoded K/V changed the very first greedy token";

  // Now matched from the pool's radix index (the promoted blocks), not the
  // tier: the nodes carry the lossy mark.
  const Result third = Generate(*e, p1);
  EXPECT_EQ(third.last.cached_host_tokens, 0);
  EXPECT_EQ(third.last.cached_tokens, 63);
  EXPECT_EQ(third.last.cached_lossy_tokens, 63);
  EXPECT_TRUE(third.last.lossy_kv);
  EXPECT_EQ(third.tokens, again.tokens) << "the same lossy K/V gives the same tokens";

  // An unrelated prompt is exact.
  const Result other = Generate(*e, p3);
  EXPECT_EQ(other.last.cached_lossy_tokens, 0);
  EXPECT_FALSE(other.last.lossy_kv);
  ExpectBaseline(*e);
  tiers->Flush();  // pages the last run evicted publish on the writer
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
}

TEST(KvTiersReencodeTest, EveryHostCodecRoundTripsThroughTheDiskTier) {
  for (kernels::KvDType d :
       {kernels::KvDType::kInt8, kernels::KvDType::kFp8E4M3, kernels::KvDType::kInt4Kivi}) {
    SCOPED_TRACE(std::string(kernels::KvDTypeName(d)));
    const std::vector<int32_t> p1 = PromptOf(46), p2 = PromptOf(47);
    auto tiers = DiskTiers(ScratchDir("disk"), d);
    auto e = MakeEngine(tiers);
    const Result first = Generate(*e, p1);
    Generate(*e, p2);
    tiers->Flush();
    ASSERT_GE(tiers->stats().demotions_disk, 4);
    const Result again = Generate(*e, p1);
    EXPECT_EQ(again.last.cached_disk_tokens, 63);
    EXPECT_EQ(again.last.cached_lossy_tokens, 63);
    EXPECT_EQ(again.tokens.size(), first.tokens.size());
    EXPECT_EQ(tiers->stats().checksum_failures, 0);
    ExpectBaseline(*e);
  }
}

TEST(KvTiersReencodeTest, TheDiskDirectoryDependsOnTheHostDtype) {
  const std::string dir = ScratchDir("restart");
  const std::vector<int32_t> p1 = PromptOf(48);
  {
    auto tiers = DiskTiers(dir, kernels::KvDType::kInt8);
    auto e = MakeEngine(tiers, kernels::KvDType::kF16, 16);
    Generate(*e, p1);
    EXPECT_GE(tiers->PersistForRestart(*e->prefix_cache()), 4);
  }
  {
    auto tiers = DiskTiers(dir, kernels::KvDType::kInt8);  // the same: found again
    auto e = MakeEngine(tiers, kernels::KvDType::kF16, 16);
    EXPECT_GE(tiers->stats().disk_recovered, 4);
    const Result r = Generate(*e, p1);
    EXPECT_EQ(r.last.cached_disk_tokens, 63);
    EXPECT_EQ(r.last.cached_lossy_tokens, 63);
  }
  for (std::optional<kernels::KvDType> other :
       {std::optional<kernels::KvDType>(), std::optional(kernels::KvDType::kFp8E4M3)}) {
    auto tiers = DiskTiers(dir, other);  // another page codec: ignored
    auto e = MakeEngine(tiers, kernels::KvDType::kF16, 16);
    EXPECT_EQ(tiers->stats().disk_recovered, 0);
    EXPECT_EQ(Generate(*e, p1).last.cached_disk_tokens, 0);
  }
}

TEST(KvTiersReencodeTest, AHostDtypeThatDoesNotShrinkThePagesIsRefused) {
  // int8 pool, fp8-e4m3 pages: the same bytes, only lossier.
  auto e = TryEngine(HostTiers(kernels::KvDType::kFp8E4M3), kernels::KvDType::kInt8);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("--kv-host-dtype fp8-e4m3"), std::string::npos)
      << e.status();
  // int4 pool, int8 pages: wider.
  auto e2 = TryEngine(HostTiers(kernels::KvDType::kInt8), kernels::KvDType::kInt4);
  ASSERT_FALSE(e2.ok());
  EXPECT_NE(e2.status().message().find("--kv-host-dtype"), std::string::npos) << e2.status();
  // An int8 pool with int4-kivi pages is narrower: fine.
  EXPECT_TRUE(TryEngine(HostTiers(kernels::KvDType::kInt4Kivi), kernels::KvDType::kInt8).ok());
}

}  // namespace
}  // namespace kvserve
