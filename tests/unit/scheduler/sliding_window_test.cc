// Sliding-window KV on a Mistral-layout fixture (every layer windowed):
// sequences keep only the blocks their window reaches, the blocks they let
// go return to the pool (or stay in the prefix cache), a repeated long
// prompt is still served from the cache with identical greedy output, and
// nothing leaks.
#include <cstdio>
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
  std::vector<RunResult> RunAll(Engine* e, const std::vector<EngineRequest>& reqs, int64_t* peak_used,
                                int64_t* peak_pool = nullptr) {
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
      if (peak_pool != nullptr) {
        *peak_pool = std::max<int64_t>(*peak_pool,
                                       e->kv_pool().num_blocks() - e->kv_pool().num_free_blocks());
      }
      if (e->prefix_cache() != nullptr) {
        // The incremental evictable count stays exact with hollow nodes.
        EXPECT_EQ(e->prefix_cache()->num_evictable_blocks(),
                  e->prefix_cache()->CountEvictableBlocksSlow());
      }
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

// With the prefix cache on, the blocks the window leaves go back to the pool
// during the sequence's life too - all but the window before the prompt's
// end, which a repeated prompt's match needs (their cache nodes keep only
// their tokens). So the pool's use stays bounded however long the
// generation; the output is the one without the cache; the repeated prompt
// is still served from the cache; and a longer prompt whose match would end
// where the window dropped K/V is cut back to a usable boundary (counted),
// with the output still the uncached one.
TEST_F(SlidingWindowKvTest, LongGenerationFreesBlocksWithThePrefixCacheOn) {
  constexpr int32_t kGen = 120;
  const std::vector<int32_t> prompt = Prompt(2 * kWindow + 1, 3);
  auto plain = MakeEngine(false, 128);
  const RunResult ref = RunAll(plain.get(), {Greedy(prompt, kGen)}, nullptr)[0];
  ASSERT_EQ(ref.tokens.size(), static_cast<size_t>(kGen));

  auto e = MakeEngine(true, 128);
  int64_t peak_pool = 0;
  const RunResult first = RunAll(e.get(), {Greedy(prompt, kGen)}, nullptr, &peak_pool)[0];
  EXPECT_EQ(first.tokens, ref.tokens);
  // The prompt boundary's window (blocks (33 - 16) / 4 .. 32 / 4), the
  // sequence's own window, one prefill chunk, the placeholder, and a block
  // of slack for the step a block fills; full attention would hold
  // (33 + 120) / 4 = 38 blocks.
  const int64_t bound = 5 + WindowBlocks(kWindow, kBlock) + 8 / kBlock + 1 + 1;
  std::printf("pool blocks in use at most %lld during a %d-token generation (bound %lld)\n",
              static_cast<long long>(peak_pool), kGen, static_cast<long long>(bound));
  EXPECT_LE(peak_pool, bound);
  EXPECT_LT(peak_pool, (2 * kWindow + 1 + kGen) / kBlock / 2);
  EXPECT_LE(e->kv_pool().num_blocks() - e->kv_pool().num_free_blocks(), bound);
  EngineStats st = e->Stats();
  EXPECT_GT(st.window_hollowed_blocks, 20);
  EXPECT_GT(st.window_kept_cached_blocks, 0);  // the prompt boundary's window
  EXPECT_GT(st.window_hollow_nodes, 20);
  EXPECT_EQ(st.window_lost_prefix_blocks, 0);

  const RunResult again = RunAll(e.get(), {Greedy(prompt, kGen)}, nullptr, &peak_pool)[0];
  EXPECT_GE(again.cached_tokens, 2 * kWindow);
  EXPECT_EQ(again.tokens, ref.tokens);
  EXPECT_EQ(e->Stats().window_dropped_prefix_tokens, 0);

  // prompt + 60 generated tokens: the tree spells it, but the window before
  // token 92 was dropped; the match is cut back to the prompt boundary's
  // window, and the output is what an uncached engine gives.
  std::vector<int32_t> longer = prompt;
  longer.insert(longer.end(), ref.tokens.begin(), ref.tokens.begin() + 60);
  const RunResult ref_longer = RunAll(plain.get(), {Greedy(longer, 20)}, nullptr)[0];
  const RunResult cut = RunAll(e.get(), {Greedy(longer, 20)}, nullptr, &peak_pool)[0];
  EXPECT_GE(cut.cached_tokens, 2 * kWindow);
  EXPECT_LT(cut.cached_tokens, 60);
  EXPECT_EQ(cut.tokens, ref_longer.tokens);
  EXPECT_GT(e->Stats().window_dropped_prefix_tokens, 0);
  // It was computed again, so now it is a cached boundary of its own.
  const RunResult cut_again = RunAll(e.get(), {Greedy(longer, 20)}, nullptr)[0];
  EXPECT_GE(cut_again.cached_tokens, static_cast<int32_t>(longer.size()) - kBlock);
  EXPECT_EQ(cut_again.tokens, ref_longer.tokens);
  EXPECT_LE(peak_pool, 2 * bound);
  EXPECT_EQ(Held(*e), 1);  // only the placeholder once everything finished
  // Under pressure everything cached goes, hollow nodes included.
  EXPECT_TRUE(e->Stats().prefix_evictable_blocks > 0);
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
  // A prompt of 8 tokens (nothing cached yet): its boundary's window is
  // blocks 0 and 1, which the cache keeps when the sequence's window leaves.
  EXPECT_EQ(m->MatchPrefix(&kv, "", absl::MakeConstSpan(tokens).first(8), 7), 0);
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

// Blocks outside every cached boundary's window go hollow in the index and
// back to the pool at once; a match never ends where it would need them.
TEST(SlidingWindowManagerTest, BlocksNoBoundaryNeedsGoBackToThePool) {
  KvCacheManagerOptions o;
  o.pool = KvPoolOptions{1, 1, 8, kBlock, 32, kernels::KvDType::kF32};
  o.sliding_window = 8;
  auto m = KvCacheManager::Create(std::move(o)).value();
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 64; ++i) tokens.push_back(100 + i);
  const int32_t free_at_start = m->num_free_blocks();
  SeqKv kv(m->mutable_pool());
  // Prompt of 12 tokens: the boundary window is blocks 1 and 2.
  EXPECT_EQ(m->MatchPrefix(&kv, "", absl::MakeConstSpan(tokens).first(12), 11), 0);
  for (int32_t step = 0; step < 48; ++step) {
    ASSERT_TRUE(m->AllocateSlots(&kv, 1).ok());
    m->MarkComputed(&kv, 1);
    m->Commit(&kv, "", tokens, 1);
    // Held by the sequence: its window (<= 3 blocks) and the one filling;
    // by the cache alone: the boundary's 2 blocks; plus the placeholder.
    EXPECT_LE(free_at_start - m->num_free_blocks(), 3 + 1 + 2 + 1) << step;
  }
  EXPECT_EQ(m->window_stats().blocks_kept_cached, 2);
  EXPECT_GT(m->window_stats().blocks_hollowed, 5);
  EXPECT_GT(m->prefix_cache()->num_hollow_blocks(), 5);
  // The prompt still matches (its last window is there); a match ending
  // at token 40 would need hollow blocks, so it is cut back to 12.
  EXPECT_EQ(m->PeekPrefix("", tokens, 11), 11);
  EXPECT_EQ(m->PeekPrefix("", tokens, 40), 12);
  EXPECT_EQ(m->prefix_cache()->PathLength("", tokens, 40), 40);
  const PrefixProbe p = m->prefix_cache()->Probe("", absl::MakeConstSpan(tokens).first(40));
  EXPECT_EQ(p.matched_tokens, 12);
  EXPECT_EQ(p.window_dropped_tokens, 28);
  m->Free(&kv, "", absl::MakeConstSpan(tokens).first(48));
  // The finished end is a boundary too.
  EXPECT_EQ(m->PeekPrefix("", tokens, 48), 48);
  EXPECT_EQ(m->prefix_cache()->num_evictable_blocks(),
            m->prefix_cache()->CountEvictableBlocksSlow());
  // A match through hollow blocks hands out the placeholder for them and
  // reads nothing of it; freeing it leaks nothing.
  SeqKv again(m->mutable_pool());
  EXPECT_EQ(m->MatchPrefix(&again, "", tokens, 48), 48);
  m->Free(&again, "", absl::MakeConstSpan(tokens).first(48));
  EXPECT_TRUE(m->EnsureFree(m->num_free_blocks() + m->num_evictable_blocks()));
  EXPECT_EQ(m->num_free_blocks(), free_at_start);
  EXPECT_EQ(m->prefix_cache()->num_cached_blocks(), 0);
  EXPECT_EQ(m->prefix_cache()->num_hollow_blocks(), 0);  // hollow leaves went too
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
  EXPECT_THAT(b.ToString(), ::testing::HasSubstr("keeps at most 257 per cached prompt boundary"));
  // A per-layer pattern frees nothing: blocks hold every layer.
  windowed.windowed_layers = 16;
  auto c = PlanKvMemory(windowed, 16, kernels::KvDType::kF16, budget).value();
  EXPECT_EQ(c.sequences_at_32k_windowed, c.sequences_at_32k_full_attention);
  EXPECT_THAT(c.ToString(), ::testing::HasSubstr("none freed"));
}

}  // namespace
}  // namespace kvserve
