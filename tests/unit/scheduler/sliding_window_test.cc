// Sliding-window KV on a Mistral-layout fixture (every layer windowed):
// sequences keep only the blocks their window reaches, the blocks they let
// go return to the pool (or stay in the prefix cache), a repeated long
// prompt is still served from the cache with identical greedy output, and
// nothing leaks.
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/memory_planner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "scheduler/engine.h"
#include "scheduler/kv_cache_manager.h"
#include "cache/prefix_cache.h"
#include "tests/testing/generate.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

constexpr int32_t kWindow = 16;
constexpr int32_t kBlock = 4;

struct Loaded {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Loaded LoadWindowed(int32_t window, const std::string& name) {
  testing::TinyLlamaOptions o;
  o.architecture = "mistral";
  o.sliding_window = window;
  o.context_length = 256;
  o.seed = 7;
  const std::string path = testing::TempDir() + "/" + name + ".gguf";
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  Loaded l;
  l.model = LlamaModel::Load(path).value();
  l.tokenizer = Tokenizer::FromGguf(l.model->file()).value();
  return l;
}

std::vector<int32_t> Prompt(int32_t n, int32_t salt) {
  std::vector<int32_t> p = {1};
  for (int32_t i = 1; i < n; ++i) p.push_back(3 + (i * 31 + salt * 17) % 250);
  return p;
}

EngineRequest Greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  return r;
}

struct RunResult {
  std::vector<int32_t> tokens;
  int32_t cached_tokens = -1;
};

class SlidingWindowKvTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> MakeEngine(bool prefix_cache, int32_t num_blocks = 64) {
    EngineOptions o;
    o.block_size = kBlock;
    o.num_blocks = num_blocks;
    o.max_batched_tokens = 8;  // chunked prefill: the window moves during the prompt
    o.prefix_cache = prefix_cache;
    return Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).value();
  }
  // Runs the requests together; records the most blocks in use at any step.
  std::vector<RunResult> RunAll(Engine* e, const std::vector<EngineRequest>& reqs, int64_t* peak_used) {
    std::vector<RunResult> out(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto id = e->Submit(reqs[i], [&out, i](const SeqEvent& ev) {
        out[i].tokens.insert(out[i].tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
        if (out[i].cached_tokens < 0) out[i].cached_tokens = ev.cached_tokens;
      });
      EXPECT_TRUE(id.ok()) << id.status();
    }
    while (e->Step()) {
      if (peak_used != nullptr) *peak_used = std::max(*peak_used, Held(*e));
    }
    return out;
  }
  // Blocks neither free nor cached-and-evictable: what running sequences
  // (and the placeholder) hold.
  static int64_t Held(const Engine& e) {
    const int64_t evictable =
        e.prefix_cache() != nullptr ? e.prefix_cache()->num_evictable_blocks() : 0;
    return e.kv_pool().num_blocks() - e.kv_pool().num_free_blocks() - evictable;
  }

  Loaded m_ = LoadWindowed(kWindow, "mistral-window");
};

TEST_F(SlidingWindowKvTest, ModelAndManagerSeeTheWindow) {
  EXPECT_EQ(m_.model->config().sliding_window, kWindow);
  EXPECT_EQ(m_.model->config().n_windowed_layers(), m_.model->config().n_layers);
  auto e = MakeEngine(true);
  EXPECT_EQ(e->Stats().sliding_window, kWindow);
}

// The test the issue names: a repeated 2 x W-token prompt is served from the
// prefix cache, and the greedy output is the same both times.
TEST_F(SlidingWindowKvTest, RepeatedLongPromptIsServedFromTheCache) {
  auto e = MakeEngine(true);
  const std::vector<int32_t> prompt = Prompt(2 * kWindow + 1, 1);
  int64_t peak = 0;
  const RunResult first = RunAll(e.get(), {Greedy(prompt, 12)}, &peak)[0];
  const RunResult second = RunAll(e.get(), {Greedy(prompt, 12)}, nullptr)[0];
  ASSERT_EQ(first.tokens.size(), 12u);
  EXPECT_EQ(first.cached_tokens, 0);
  EXPECT_GE(second.cached_tokens, 2 * kWindow);  // every full block of the prompt
  EXPECT_EQ(second.tokens, first.tokens);
  const EngineStats st = e->Stats();
  EXPECT_GT(st.window_released_blocks, 0);
  EXPECT_GT(st.window_kept_cached_blocks, 0);
  EXPECT_EQ(st.window_lost_prefix_blocks, 0);
  // With the prefix cache on, the blocks the window let go are interior
  // nodes of the running sequence's cached path: the index keeps them (and
  // cannot evict them before the sequence ends), so the peak is the whole
  // context here; the savings show with the cache off (next test).
  EXPECT_LE(peak, (2 * kWindow + 1 + 12 + kBlock - 1) / kBlock + 1);
  EXPECT_EQ(Held(*e), 1);  // only the placeholder once everything finished
}

// Without the prefix cache the blocks a window leaves go straight back to
// the pool, and other sequences reuse them at once: concurrent requests
// still give exactly what each gives alone (nothing reads a block it let go).
TEST_F(SlidingWindowKvTest, ReleasedBlocksAreReusedWithoutChangingOutputs) {
  std::vector<EngineRequest> reqs;
  for (int32_t i = 0; i < 4; ++i) reqs.push_back(Greedy(Prompt(40 + 3 * i, 10 + i), 20));
  std::vector<std::vector<int32_t>> alone;
  for (const EngineRequest& r : reqs) {
    auto e = MakeEngine(false);
    alone.push_back(RunAll(e.get(), {r}, nullptr)[0].tokens);
  }
  // 4 sequences of 60..69 tokens need 60+ blocks under full attention; the
  // window lets them run together in 32 (each holds its window, one
  // prefill chunk and the next token's block).
  auto e = MakeEngine(false, 32);
  int64_t peak = 0;
  const std::vector<RunResult> together = RunAll(e.get(), reqs, &peak);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(together[i].tokens, alone[i]) << i;
  EXPECT_LE(peak, 4 * (WindowBlocks(kWindow, kBlock) + 8 / kBlock) + 1);
  EXPECT_LT(peak, 4 * (60 / kBlock));
  EXPECT_EQ(Held(*e), 1);
  EXPECT_GT(e->Stats().window_released_blocks, 0);
}

// When the cache evicted an early block that the window had let go, the
// later blocks of that prefix cannot be cached (nothing could match them):
// the manager counts them instead of caching a broken path.
TEST(SlidingWindowManagerTest, LostPrefixIsCountedNotCached) {
  KvCacheManagerOptions o;
  o.pool = KvPoolOptions{1, 1, 8, kBlock, 16, kernels::KvDType::kF32};
  o.sliding_window = 8;
  auto m = KvCacheManager::Create(std::move(o)).value();
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 40; ++i) tokens.push_back(100 + i);
  SeqKv kv(m->mutable_pool());
  const int32_t free_at_start = m->num_free_blocks();
  // 16 tokens: blocks 0..3 full and cached; the window (8) needs slots >= 9.
  ASSERT_TRUE(m->AllocateSlots(&kv, 16).ok());
  m->MarkComputed(&kv, 16);
  m->Commit(&kv, "", tokens, 16);
  EXPECT_EQ(kv.num_window_released, 2);  // blocks 0 and 1 (slots 0..7)
  EXPECT_EQ(m->window_stats().blocks_released, 2);
  EXPECT_EQ(m->window_stats().blocks_kept_cached, 2);
  // The cache is emptied (blocks 0, 1 were only its own by now).
  EXPECT_EQ(m->ClearPrefixCache(), 4);
  EXPECT_EQ(m->PeekPrefix("", tokens, 16), 0);
  ASSERT_TRUE(m->AllocateSlots(&kv, 8).ok());
  m->MarkComputed(&kv, 8);
  m->Commit(&kv, "", tokens, 8);
  EXPECT_EQ(m->window_stats().prefix_blocks_lost, 2);  // blocks 4 and 5
  EXPECT_EQ(m->PeekPrefix("", tokens, 24), 0);         // no broken path was cached
  m->Free(&kv, "", tokens);
  EXPECT_EQ(m->num_free_blocks() + m->num_evictable_blocks(), free_at_start);
}

TEST(SlidingWindowPlanTest, PlanCountsTheWindow) {
  // A Mistral-7B-like shape: 32 layers, 8 KV heads of 128, window 4096.
  KvShape full{32, 8, 128, 32768};
  KvShape windowed = full;
  windowed.sliding_window = 4096;
  windowed.windowed_layers = 32;
  const int64_t budget = int64_t{16} << 30;
  auto a = PlanKvMemory(full, 16, kernels::KvDType::kF16, budget).value();
  auto b = PlanKvMemory(windowed, 16, kernels::KvDType::kF16, budget).value();
  EXPECT_EQ(a.full_context_sequences, 4);   // 16 GiB / (32k x 128 KiB)
  EXPECT_EQ(b.sequences_at_32k_full_attention, 4);
  EXPECT_EQ(b.window_blocks_per_sequence, 4096 / 16 + 2);
  EXPECT_EQ(b.sequences_at_32k_windowed, b.num_blocks / (4096 / 16 + 2));
  EXPECT_GT(b.sequences_at_32k_windowed, 7 * a.full_context_sequences);
  EXPECT_THAT(b.ToString(), ::testing::HasSubstr("32k-token sequences: "));
  // A per-layer pattern frees nothing: blocks hold every layer.
  windowed.windowed_layers = 16;
  auto c = PlanKvMemory(windowed, 16, kernels::KvDType::kF16, budget).value();
  EXPECT_EQ(c.sequences_at_32k_windowed, c.sequences_at_32k_full_attention);
  EXPECT_THAT(c.ToString(), ::testing::HasSubstr("none freed"));
}

}  // namespace
}  // namespace kvserve
