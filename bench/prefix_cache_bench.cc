// Radix prefix index micro-benchmarks: Match and Insert throughput in tokens
// per second on two realistic trees (block size 16):
//   - shared: 64 prompts sharing a 1,024-token system prompt, each with its
//     own 512-token user part (64 + 64 x 32 = 2,112 cached blocks);
//   - chain: one 256-turn conversation of 128 tokens a turn (32,768 tokens,
//     a 2,048-block-deep chain).
// Only the index is measured: the pool is a tiny host pool (block contents
// are never touched), the clock is the real steady clock, no event sink.
//
//   ninja -C build-pc prefix_cache_bench
//   build-pc/bench/prefix_cache_bench
//
// tokens/s counts the tokens offered to Match or Insert per second.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cache/kv_pool.h"
#include "cache/prefix_cache.h"

namespace kvserve {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kSystemTokens = 1024;
constexpr int32_t kUserTokens = 512;
constexpr int32_t kPrompts = 64;
constexpr int32_t kTurns = 256;
constexpr int32_t kTurnTokens = 128;

std::unique_ptr<KvPool> MakePool(int32_t blocks) {
  KvPoolOptions o;
  o.n_layers = 1;
  o.n_kv_heads = 1;
  o.head_dim = 1;
  o.block_size = kBlockSize;
  o.n_blocks = blocks;
  return KvPool::Create(o).value();
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, int32_t n) {
  std::uniform_int_distribution<int32_t> vocab(0, 49151);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = vocab(rng);
  return t;
}

// A workload: its sequences, with pool blocks the benchmark holds for the
// whole run (like finished sequences' tables), so Insert always has blocks.
struct Workload {
  std::unique_ptr<KvPool> pool;
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::vector<BlockHandle>> blocks;
};

Workload SharedPrompts() {
  Workload w;
  std::mt19937 rng(1);
  const std::vector<int32_t> system = RandomTokens(rng, kSystemTokens);
  for (int32_t i = 0; i < kPrompts; ++i) {
    std::vector<int32_t> s = system;
    const std::vector<int32_t> user = RandomTokens(rng, kUserTokens);
    s.insert(s.end(), user.begin(), user.end());
    w.seqs.push_back(std::move(s));
  }
  w.pool = MakePool(kPrompts * (kSystemTokens + kUserTokens) / kBlockSize);
  for (const auto& s : w.seqs) {
    w.blocks.emplace_back();
    (void)w.pool->Allocate(static_cast<int32_t>(s.size()) / kBlockSize, &w.blocks.back());
  }
  return w;
}

// Turn t's sequence is the conversation up to and including turn t; all turns
// share one set of blocks (turn t uses the first t x 8 of them).
Workload DeepChain() {
  Workload w;
  std::mt19937 rng(2);
  const std::vector<int32_t> all = RandomTokens(rng, kTurns * kTurnTokens);
  for (int32_t t = 1; t <= kTurns; ++t) w.seqs.emplace_back(all.begin(), all.begin() + t * kTurnTokens);
  w.pool = MakePool(kTurns * kTurnTokens / kBlockSize);
  w.blocks.emplace_back();
  (void)w.pool->Allocate(kTurns * kTurnTokens / kBlockSize, &w.blocks.back());
  return w;
}

std::unique_ptr<PrefixCache> MakeCache(KvPool* pool) {
  PrefixCacheOptions o;
  o.model_identity = "bench-model";
  return std::make_unique<PrefixCache>(pool, std::move(o));
}

void SetTokenRate(benchmark::State& state, int64_t tokens) {
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens),
                                                  benchmark::Counter::kIsRate);
}

// Admission of a prompt that is cached whole (a retried or repeated request).
void BM_MatchSharedFullHit(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (int32_t i = 0; i < kPrompts; ++i) cache->Insert("", w.seqs[i], w.blocks[i]);
  int64_t tokens = 0;
  int32_t i = 0;
  for (auto _ : state) {
    const std::vector<int32_t>& s = w.seqs[i++ % kPrompts];
    PrefixMatch m = cache->Match("", s, static_cast<int32_t>(s.size()));
    benchmark::DoNotOptimize(m.num_tokens);
    w.pool->Release(m.blocks);
    tokens += static_cast<int64_t>(s.size());
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_MatchSharedFullHit);

// Admission of a new user turn: the system prompt hits, the user part misses
// (with a partial-block search among the 64 siblings).
void BM_MatchSharedNewUser(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (int32_t i = 0; i < kPrompts; ++i) cache->Insert("", w.seqs[i], w.blocks[i]);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> fresh;
  for (int32_t i = 0; i < kPrompts; ++i) {
    std::vector<int32_t> s(w.seqs[0].begin(), w.seqs[0].begin() + kSystemTokens);
    const std::vector<int32_t> user = RandomTokens(rng, kUserTokens);
    s.insert(s.end(), user.begin(), user.end());
    fresh.push_back(std::move(s));
  }
  int64_t tokens = 0;
  int32_t i = 0;
  for (auto _ : state) {
    const std::vector<int32_t>& s = fresh[i++ % kPrompts];
    PrefixMatch m = cache->Match("", s, static_cast<int32_t>(s.size()));
    benchmark::DoNotOptimize(m.num_tokens);
    w.pool->Release(m.blocks);
    tokens += static_cast<int64_t>(s.size());
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_MatchSharedNewUser);

// The scheduler's dry run (LPM ordering): no pins, no touches.
void BM_MatchLengthShared(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (int32_t i = 0; i < kPrompts; ++i) cache->Insert("", w.seqs[i], w.blocks[i]);
  int64_t tokens = 0;
  int32_t i = 0;
  for (auto _ : state) {
    const std::vector<int32_t>& s = w.seqs[i++ % kPrompts];
    benchmark::DoNotOptimize(cache->MatchLength("", s, static_cast<int32_t>(s.size())));
    tokens += static_cast<int64_t>(s.size());
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_MatchLengthShared);

// Building the shared tree from empty: 64 inserts, 2,112 new nodes, the
// system prompt deduplicated 63 times. Clear is outside the timing.
void BM_InsertSharedBuild(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  int64_t tokens = 0;
  for (auto _ : state) {
    for (int32_t i = 0; i < kPrompts; ++i) {
      benchmark::DoNotOptimize(cache->Insert("", w.seqs[i], w.blocks[i]));
      tokens += static_cast<int64_t>(w.seqs[i].size());
    }
    state.PauseTiming();
    cache->Clear();
    state.ResumeTiming();
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_InsertSharedBuild)->Unit(benchmark::kMicrosecond);

// A finished sequence whose blocks are all cached already (pure dedupe walk).
void BM_InsertSharedExisting(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (int32_t i = 0; i < kPrompts; ++i) cache->Insert("", w.seqs[i], w.blocks[i]);
  int64_t tokens = 0;
  int32_t i = 0;
  for (auto _ : state) {
    const int32_t k = i++ % kPrompts;
    benchmark::DoNotOptimize(cache->Insert("", w.seqs[k], w.blocks[k]));
    tokens += static_cast<int64_t>(w.seqs[k].size());
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_InsertSharedExisting);

// Admission of the next turn of a 32,768-token conversation: 2,048 levels.
void BM_MatchDeepChain(benchmark::State& state) {
  Workload w = DeepChain();
  auto cache = MakeCache(w.pool.get());
  cache->Insert("", w.seqs.back(), w.blocks[0]);
  const std::vector<int32_t>& s = w.seqs.back();
  int64_t tokens = 0;
  for (auto _ : state) {
    PrefixMatch m = cache->Match("", s, static_cast<int32_t>(s.size()));
    benchmark::DoNotOptimize(m.num_tokens);
    w.pool->Release(m.blocks);
    tokens += static_cast<int64_t>(s.size());
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_MatchDeepChain)->Unit(benchmark::kMicrosecond);

// The conversation as the engine inserts it: after each of the 256 turns the
// whole sequence so far (deduplicating all earlier turns, adding 8 blocks).
void BM_InsertDeepChainTurnByTurn(benchmark::State& state) {
  Workload w = DeepChain();
  auto cache = MakeCache(w.pool.get());
  int64_t tokens = 0;
  for (auto _ : state) {
    for (const std::vector<int32_t>& s : w.seqs) {
      benchmark::DoNotOptimize(cache->Insert("", s, w.blocks[0]));
      tokens += static_cast<int64_t>(s.size());
    }
    state.PauseTiming();
    cache->Clear();
    state.ResumeTiming();
  }
  SetTokenRate(state, tokens);
}
BENCHMARK(BM_InsertDeepChainTurnByTurn)->Unit(benchmark::kMillisecond);

// The engine publishes num_evictable_blocks with its stats every step; this
// is that O(N) pass over the 2,112-node shared tree.
void BM_NumEvictableShared(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (int32_t i = 0; i < kPrompts; ++i) cache->Insert("", w.seqs[i], w.blocks[i]);
  for (auto& hs : w.blocks) w.pool->Release(hs);
  int64_t nodes = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cache->num_evictable_blocks());
    nodes += cache->num_cached_blocks();
  }
  state.counters["nodes/s"] = benchmark::Counter(static_cast<double>(nodes),
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_NumEvictableShared)->Unit(benchmark::kMicrosecond);

// Evicting the whole shared tree one call at a time in batches of 64 blocks
// (each call rescans every node: the cost the engine pays when short).
void BM_EvictSharedInBatches(benchmark::State& state) {
  Workload w = SharedPrompts();
  auto cache = MakeCache(w.pool.get());
  for (auto& hs : w.blocks) w.pool->Release(hs);  // the cache alone holds the blocks
  int64_t blocks = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<BlockHandle> hs;
    for (int32_t i = 0; i < kPrompts; ++i) {
      hs.clear();
      (void)w.pool->Allocate(static_cast<int32_t>(w.seqs[i].size()) / kBlockSize, &hs);
      cache->Insert("", w.seqs[i], hs);
      w.pool->Release(hs);
    }
    state.ResumeTiming();
    while (int32_t n = cache->Evict(64)) blocks += n;
  }
  state.counters["blocks/s"] = benchmark::Counter(static_cast<double>(blocks),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_EvictSharedInBatches)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvserve

BENCHMARK_MAIN();
