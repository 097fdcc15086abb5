// KV tiers under a device KV pool (--device cuda with --kv-host-memory /
// --kv-disk-dir): blocks the prefix cache evicts leave device memory on the
// tiers' copy stream into pinned host pages or disk files, and come back into
// fresh device blocks on a later match, with greedy output bit-identical to
// the same CUDA engine without tiers. Also: a corrupted host page fails its
// checksum and is recomputed, a re-encoded host tier reports lossy tokens,
// a shutdown persists the device blocks for a warm restart, and no device
// buffer or pinned page is left behind. The emulator (build-emu) runs these
// with device work deferred until a host synchronization, so a page read
// before its copy's event would be stale and fail its checksum; GPUs run
// them through deploy/gpu-check.sh. Without a usable device they skip.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/kv_pool.h"
#include "cache/prefix_cache.h"
#include "gtest/gtest.h"
#include "kernels/cuda/runtime.h"
#include "model/backend.h"
#include "model/llama_cuda.h"
#include "scheduler/engine.h"
#include "scheduler/kv_tiers.h"
#include "tests/unit/model/cuda_test_skip.h"
#include "tests/unit/scheduler/kv_tiers_fixture.h"

namespace kvserve {
namespace {

using tiers_testing::Generate;
using tiers_testing::HasTag;
using tiers_testing::kBlocks;
using tiers_testing::PromptOf;
using tiers_testing::Result;
using tiers_testing::Tag;
using tiers_testing::Tiny;

std::shared_ptr<CudaLlama> Gpu() {
  auto created = CudaLlama::Create(*Tiny().model);
  EXPECT_TRUE(created.ok()) << created.status();
  return created.ok() ? std::shared_ptr<CudaLlama>(std::move(created).value()) : nullptr;
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<ForwardBackend> gpu,
                                   std::shared_ptr<KvTiers> tiers, int32_t blocks = kBlocks) {
  EngineOptions o;
  o.num_blocks = blocks;
  o.backend = std::move(gpu);
  o.kv_tiers = std::move(tiers);
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), tiers_testing::Pool(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

// The same prompt on the same device with a pool big enough: no tier.
std::vector<int32_t> Reference(const std::shared_ptr<CudaLlama>& gpu,
                               const std::vector<int32_t>& prompt) {
  auto e = MakeEngine(gpu, nullptr, 64);
  return Generate(*e, prompt).tokens;
}

void ExpectBaseline(const Engine& e) {
  EXPECT_EQ(e.kv_pool().num_free_blocks() + e.prefix_cache()->num_evictable_blocks(),
            e.kv_pool().num_blocks())
      << "a block is still pinned";
}

std::shared_ptr<KvTiers> HostTiers(std::optional<kernels::KvDType> host_dtype = std::nullopt) {
  KvTiersOptions t;
  t.host_bytes = 8 << 20;
  t.host_dtype = host_dtype;
  return KvTiers::Create(t).value();
}

std::shared_ptr<KvTiers> DiskTiers(const std::string& dir) {
  KvTiersOptions t;
  t.disk_dir = dir;
  t.disk_bytes = 64 << 20;
  t.disk_min_hits = 0;
  t.model_fingerprint = "tiny-cuda-tiers";
  return KvTiers::Create(t).value();
}

// Pool, radix index and tiers driven directly, with a content tag in every
// device block: nothing else synchronizes the device between an eviction and
// the writer, so a page checksummed before its copy's event would hold stale
// bytes here (and a load unpinned before its copies ran would too).
TEST(CudaKvTiersTest, DeviceBlocksReachTheirPagesAndComeBackByteForByte) {
  KVSERVE_SKIP_WITHOUT_GPU();
  cuda::DeviceMemoryPool memory;
  auto stream = cuda::CudaStream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status();
  KvPoolOptions po;
  po.n_layers = 2;
  po.n_kv_heads = 1;
  po.head_dim = 8;
  po.block_size = 4;
  po.n_blocks = 6;
  po.dtype = kernels::KvDType::kF32;
  po.device_memory = &memory;
  po.device_stream = stream->get();
  auto pool = KvPool::Create(po).value();
  ASSERT_TRUE(pool->on_device());
  const int64_t bytes = pool->block_bytes();
  KvTiersOptions to;
  to.host_bytes = 12 * bytes;
  auto tiers = KvTiers::Create(to).value();
  PrefixCacheOptions co;
  co.demotion = tiers.get();
  auto cache = std::make_unique<PrefixCache>(pool.get(), std::move(co));
  ASSERT_TRUE(tiers->Attach(*pool, cache.get()).ok());
  ASSERT_TRUE(tiers->on_device());

  const int32_t bs = po.block_size;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<uint64_t>> chains;
  std::vector<uint8_t> host(bytes);
  for (int p = 0; p < 3; ++p) {
    std::vector<int32_t> tokens(2 * bs);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 100 * p + static_cast<int32_t>(i);
    std::vector<uint64_t> chain;
    uint64_t h = cache->RootHash("");
    for (int32_t b = 0; b < 2; ++b) {
      h = PrefixCache::BlockHash(h, absl::MakeConstSpan(tokens).subspan(b * bs, bs));
      chain.push_back(h);
    }
    std::vector<BlockHandle> blocks;
    ASSERT_TRUE(pool->Allocate(2, &blocks).ok());
    for (int32_t b = 0; b < 2; ++b) {  // "the forward wrote it"
      Tag(host.data(), bytes, chain[b]);
      ASSERT_TRUE(cuda::CopyToDevice(const_cast<uint8_t*>(pool->BlockData(blocks[b])), host.data(),
                                     static_cast<size_t>(bytes))
                      .ok());
    }
    cache->Insert("", tokens, blocks);
    pool->Release(blocks);
    prompts.push_back(tokens);
    chains.push_back(chain);
  }
  EXPECT_EQ(cache->Evict(6), 6);
  tiers->Flush();
  EXPECT_EQ(tiers->stats().demotions_host, 6);
  for (const auto& chain : chains) {
    for (uint64_t h : chain) {
      uint64_t cs = 0;
      const uint8_t* page = tiers->host()->Pin(h, &cs);
      ASSERT_NE(page, nullptr);
      EXPECT_TRUE(HasTag(page, bytes, h)) << "a host page does not hold its device block's bytes";
      tiers->host()->Unpin(h);
    }
  }
  // Back into fresh device blocks.
  for (size_t p = 0; p < prompts.size(); ++p) {
    ASSERT_EQ(tiers->Lookup("", prompts[p], 0, 2 * bs), 2 * bs);
    std::vector<BlockHandle> blocks;
    ASSERT_TRUE(pool->Allocate(2, &blocks).ok());
    std::vector<int32_t> ids = {blocks[0].id, blocks[1].id};
    const int32_t offsets[2] = {0, 2};
    KvLoadTarget t;
    t.tokens = prompts[p];
    t.first_slot = 0;
    t.num_tokens = 2 * bs;
    t.view = pool->View(ids.data(), offsets, 1);
    std::shared_ptr<KvLoad> load = tiers->Start(t);
    ASSERT_NE(load, nullptr);
    while (!load->Done()) std::this_thread::yield();
    ASSERT_TRUE(load->status().ok()) << load->status();
    EXPECT_EQ(load->sources().host_tokens, 2 * bs);
    for (int32_t b = 0; b < 2; ++b) {
      ASSERT_TRUE(
          cuda::CopyToHost(host.data(), pool->BlockData(blocks[b]), static_cast<size_t>(bytes))
              .ok());
      EXPECT_TRUE(HasTag(host.data(), bytes, chains[p][b])) << "a load delivered wrong bytes";
    }
    pool->Release(blocks);
  }
  EXPECT_EQ(tiers->stats().checksum_failures, 0);
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
  EXPECT_EQ(pool->num_free_blocks(), po.n_blocks);
  cache.reset();
}

TEST(CudaKvTiersTest, EvictedDeviceBlocksComeBackFromPinnedHostPagesBitIdentical) {
  KVSERVE_SKIP_WITHOUT_GPU();
  auto gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const int64_t weights = gpu->device_memory().live_buffers();
  const std::vector<int32_t> p1 = PromptOf(1), p2 = PromptOf(2);
  const std::vector<int32_t> want = Reference(gpu, p1);
  {
    auto tiers = HostTiers();
    auto e = MakeEngine(gpu, tiers);
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->kv_pool().on_device());
    EXPECT_TRUE(tiers->on_device());
    const Result first = Generate(*e, p1);
    Generate(*e, p2);  // needs the pool: p1's device blocks are demoted
    tiers->Flush();
    EXPECT_GE(tiers->stats().demotions_host, 4);
    const Result again = Generate(*e, p1);
    EXPECT_EQ(first.tokens, want);
    EXPECT_EQ(again.tokens, want)
        << "device KV loaded from the host tier must give the same tokens";
    EXPECT_EQ(again.last.cached_tokens, 63);
    EXPECT_EQ(again.last.cached_host_tokens, 63);
    const EngineStats st = e->Stats();
    EXPECT_EQ(st.kv_loads, 1);
    EXPECT_EQ(st.kv_load_failures, 0);
    EXPECT_EQ(st.tiers.promotions_host, 4);
    EXPECT_EQ(st.tiers.checksum_failures, 0) << "a page checksummed before its copy landed";
    EXPECT_EQ(st.tiers.dropped_demotions, 0);
    ExpectBaseline(*e);
    tiers->Flush();
    EXPECT_EQ(tiers->host()->stats().pinned, 0);
  }
  ASSERT_TRUE(gpu->ReleaseScratch().ok());
  EXPECT_EQ(gpu->device_memory().live_buffers(), weights) << "device buffers leaked";
}

TEST(CudaKvTiersTest, ACorruptedHostPageOfADeviceBlockIsRecomputed) {
  KVSERVE_SKIP_WITHOUT_GPU();
  auto gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const std::vector<int32_t> p1 = PromptOf(3), p2 = PromptOf(4);
  auto tiers = HostTiers();
  auto e = MakeEngine(gpu, tiers);
  ASSERT_NE(e, nullptr);
  const Result first = Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  // Flip a byte of one of p1's pages: every held page is one of p1's blocks
  // or p2's still resident ones, so corrupt them all.
  for (const auto& [hash, hits] : tiers->host()->ReadyPages()) {
    uint64_t cs = 0;
    const uint8_t* page = tiers->host()->Pin(hash, &cs);
    ASSERT_NE(page, nullptr);
    const_cast<uint8_t*>(page)[100] ^= 0x40;
    tiers->host()->Unpin(hash);
  }
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, first.tokens) << "recomputed, not served from the bad page";
  EXPECT_EQ(again.last.cached_host_tokens, 0);
  const EngineStats st = e->Stats();
  EXPECT_EQ(st.tiers.checksum_failures, 1) << "the load stops at its first bad page";
  EXPECT_EQ(st.kv_load_failures, 1);
  ExpectBaseline(*e);
  tiers->Flush();  // the recompute evicted p2's blocks: their pages publish
  EXPECT_EQ(tiers->host()->stats().pinned, 0);
}

TEST(CudaKvTiersTest, DeviceBlocksComeBackFromTheDiskTierAlone) {
  KVSERVE_SKIP_WITHOUT_GPU();
  auto gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const std::vector<int32_t> p1 = PromptOf(5), p2 = PromptOf(6);
  const std::vector<int32_t> want = Reference(gpu, p1);
  auto tiers = DiskTiers(tiers_testing::ScratchDir("cuda-tiers-", "disk"));
  auto e = MakeEngine(gpu, tiers);
  ASSERT_NE(e, nullptr);
  Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  EXPECT_GE(tiers->stats().demotions_disk, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, want);
  EXPECT_EQ(again.last.cached_disk_tokens, 63);
  EXPECT_EQ(e->Stats().tiers.checksum_failures, 0);
  ExpectBaseline(*e);
}

TEST(CudaKvTiersTest, AReencodedHostTierLoadsDecodedDeviceBlocksReportedLossy) {
  KVSERVE_SKIP_WITHOUT_GPU();
  auto gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const std::vector<int32_t> p1 = PromptOf(7), p2 = PromptOf(8);
  auto tiers = HostTiers(kernels::KvDType::kInt8);
  auto e = MakeEngine(gpu, tiers);
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(tiers->lossy());
  Generate(*e, p1);
  Generate(*e, p2);
  tiers->Flush();
  EXPECT_GE(tiers->stats().lossy_reencoded_blocks, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.last.cached_host_tokens, 63);
  EXPECT_EQ(again.last.cached_lossy_tokens, 63);
  EXPECT_EQ(e->Stats().tiers.checksum_failures, 0);
  EXPECT_EQ(again.tokens.size(), 8u);
  ExpectBaseline(*e);
}

// A shutdown persists the device pool's cached blocks (device -> host ->
// file); a new engine on the same directory finds them.
TEST(CudaKvTiersTest, AShutdownPersistsDeviceBlocksForAWarmRestart) {
  KVSERVE_SKIP_WITHOUT_GPU();
  auto gpu = Gpu();
  ASSERT_NE(gpu, nullptr);
  const std::string dir = tiers_testing::ScratchDir("cuda-tiers-", "restart");
  const std::vector<int32_t> p1 = PromptOf(9);
  const std::vector<int32_t> want = Reference(gpu, p1);
  {
    auto tiers = DiskTiers(dir);
    auto e = MakeEngine(gpu, tiers, 16);  // room: nothing is evicted
    ASSERT_NE(e, nullptr);
    Generate(*e, p1);
    EXPECT_EQ(tiers->stats().demotions_disk, 0);
  }  // the engine's shutdown writes the cached blocks
  auto tiers = DiskTiers(dir);
  auto e = MakeEngine(gpu, tiers, 16);
  ASSERT_NE(e, nullptr);
  EXPECT_GE(tiers->stats().disk_recovered, 4);
  const Result again = Generate(*e, p1);
  EXPECT_EQ(again.tokens, want);
  EXPECT_EQ(again.last.cached_disk_tokens, 63);
  ExpectBaseline(*e);
}

}  // namespace
}  // namespace kvserve
