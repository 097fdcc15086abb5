// Token eviction: which slots each policy keeps, compaction moving kept rows
// bit for bit and never writing a shared block, and the engine under a
// policy: a budget the sequence never exceeds changes nothing, a window
// bounds the blocks a sequence holds, a lossy sequence never feeds the
// prefix cache, and a sibling sharing its prefix is unaffected.
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_codec.h"
#include "scheduler/engine.h"
#include "scheduler/kv_eviction.h"
#include "scheduler/kv_policy_eval.h"
#include "tests/testing/generate.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::ElementsAre;

std::vector<int32_t> Range(int32_t a, int32_t b) {
  std::vector<int32_t> v(static_cast<size_t>(b - a));
  std::iota(v.begin(), v.end(), a);
  return v;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

KvPolicy Policy(KvPolicy::Kind kind, int32_t sinks, int32_t window, int32_t budget = 0) {
  KvPolicy p;
  p.kind = kind;
  p.sinks = sinks;
  p.window = window;
  p.budget = budget;
  return p;
}

TEST(ChooseKeptSlotsTest, EachPolicyKeepsItsShare) {
  using K = KvPolicy::Kind;
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kNone, 4, 8), 40, 0, nullptr), Range(0, 40));
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kWindow, 4, 8), 40, 0, nullptr), Range(32, 40));
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kSinks, 4, 8), 40, 0, nullptr),
            Concat(Range(0, 4), Range(32, 40)));
  std::vector<float> score(40, 0.0f);
  score[10] = 5;
  score[20] = 4;
  score[25] = 3;
  score[5] = 2;
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kH2O, 4, 8, 15), 40, 0, score.data()),
            Concat(Concat(Range(0, 4), {10, 20, 25}), Range(32, 40)))
      << "3 heavy hitters by score, kept in slot order";
  // Within capacity nothing goes.
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kSinks, 4, 8), 12, 0, nullptr), Range(0, 12));
}

TEST(ChooseKeptSlotsTest, SharedSlotsStayAndShrinkTheHeavyShare) {
  using K = KvPolicy::Kind;
  // 16 slots live in a shared block: they stay, whatever the policy says.
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kWindow, 0, 8), 40, 16, nullptr),
            Concat(Range(0, 16), Range(32, 40)));
  std::vector<float> score(40, 1.0f);
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kH2O, 4, 8, 26), 40, 16, score.data()),
            Concat(Concat(Range(0, 16), {16, 17}), Range(32, 40)))
      << "budget 26 - 16 shared - 8 recent = 2 heavy hitters";
  // A shared prefix longer than everything: only the window past it.
  EXPECT_EQ(ChooseKeptSlots(Policy(K::kWindow, 0, 8), 40, 36, nullptr), Range(0, 40));
}

class DropSlotsTest : public ::testing::TestWithParam<kernels::KvDType> {};

TEST_P(DropSlotsTest, KeptRowsMoveBitForBitAndBlocksGoBack) {
  KvCacheManagerOptions o;
  o.pool.n_layers = 2;
  o.pool.n_kv_heads = 2;
  o.pool.head_dim = 32;
  o.pool.block_size = 4;
  o.pool.n_blocks = 8;
  o.pool.dtype = GetParam();
  o.prefix_cache = false;
  auto m = KvCacheManager::Create(std::move(o)).value();
  SeqKv kv(m->mutable_pool());
  ASSERT_TRUE(m->AllocateSlots(&kv, 20).ok());
  m->MarkComputed(&kv, 20);
  m->Commit(&kv, "", Range(0, 20), 20);
  std::vector<int32_t> ids;
  kv.table.AppendIds(&ids);
  int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
  kernels::PagedKvView view = m->pool().View(ids.data(), offsets, 1);
  // Random bytes everywhere: rows and their scale areas.
  std::mt19937 rng(7);
  for (int32_t b : ids) {
    uint8_t* p = view.pool + static_cast<int64_t>(b) * view.block_bytes;
    for (int64_t i = 0; i < view.block_bytes; ++i) p[i] = static_cast<uint8_t>(rng());
  }
  auto row = [&](const kernels::PagedKvView& v, int l, int slot, int h) {
    std::vector<uint8_t> out;
    const uint8_t* k = v.KeyAt(l, 0, slot, h);
    out.insert(out.end(), k, k + v.RowBytes());
    out.insert(out.end(), k + v.layer_bytes / 2, k + v.layer_bytes / 2 + v.RowBytes());
    if (v.RowMetaBytes() > 0) {
      const uint8_t* mk = v.KeyMetaAt(l, 0, slot, h);
      out.insert(out.end(), mk, mk + v.RowMetaBytes());
      out.insert(out.end(), mk + v.layer_bytes / 2, mk + v.layer_bytes / 2 + v.RowMetaBytes());
    }
    return out;
  };
  const std::vector<int32_t> keep = {0, 1, 2, 3, 9, 14, 17, 18, 19};
  std::map<std::tuple<int, int, int>, std::vector<uint8_t>> before;
  for (int32_t k : keep) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) before[{k, l, h}] = row(view, l, k, h);
    }
  }
  const int32_t free_before = m->num_free_blocks();
  ASSERT_TRUE(m->DropSlots(&kv, keep));
  EXPECT_EQ(kv.num_computed, 9);
  EXPECT_EQ(kv.position_shift, 11);
  EXPECT_TRUE(kv.lossy);
  EXPECT_EQ(m->num_free_blocks(), free_before + 2) << "20 slots in 5 blocks -> 9 in 3";
  ids.clear();
  kv.table.AppendIds(&ids);
  offsets[1] = static_cast<int32_t>(ids.size());
  view = m->pool().View(ids.data(), offsets, 1);
  for (size_t i = 0; i < keep.size(); ++i) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        EXPECT_EQ(row(view, l, static_cast<int>(i), h), (before[{keep[i], l, h}]))
            << "slot " << keep[i] << " -> " << i << " layer " << l << " head " << h;
      }
    }
  }
  m->Discard(&kv);
  EXPECT_EQ(m->num_free_blocks(), 8);
}

INSTANTIATE_TEST_SUITE_P(PerRowCodecs, DropSlotsTest,
                         ::testing::Values(kernels::KvDType::kF32, kernels::KvDType::kF16,
                                           kernels::KvDType::kInt8, kernels::KvDType::kFp8E4M3,
                                           kernels::KvDType::kInt4),
                         [](const auto& info) {
                           std::string n(kernels::KvDTypeName(info.param));
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// StreamingLLM positions within the cache: a sinks sequence streamed far
// past a 40-token "trained context". Each token's key is written rotated to
// the position the sequence gives it (SeqKv::rope_position), as the forward
// does; after every compaction every kept key must equal its raw vector
// rotated afresh to that slot's position (original positions before the
// switch, the slot itself after it), and no position ever reaches the
// context. Rotation composition against a fresh rotation, per codec.
class SinksPositionsTest : public ::testing::TestWithParam<kernels::KvDType> {};

TEST_P(SinksPositionsTest, KeysFollowTheirSlotsPastTheContext) {
  constexpr int32_t kLayers = 2, kHeads = 2, kDim = 16, kContext = 40;
  KvCacheManagerOptions o;
  o.pool.n_layers = kLayers;
  o.pool.n_kv_heads = kHeads;
  o.pool.head_dim = kDim;
  o.pool.block_size = 4;
  o.pool.n_blocks = 16;
  o.pool.dtype = GetParam();
  o.prefix_cache = false;
  auto m = KvCacheManager::Create(std::move(o)).value();
  KvEvictorOptions eo;
  eo.rope = kernels::RopeParams{kDim, kDim, 10000.0f, kernels::RopeStyle::kNorm};
  eo.context_length = kContext;
  eo.switch_margin = 4;
  eo.can_rotate = true;
  KvEvictor evictor(m.get(), eo);
  const KvPolicy policy = Policy(KvPolicy::Kind::kSinks, 2, 8);
  auto raw = [](int32_t token, int32_t l, int32_t h) {
    std::vector<float> v(kDim);
    std::mt19937 rng(static_cast<uint32_t>(token * 131 + l * 17 + h));
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    for (float& x : v) x = d(rng);
    return v;
  };
  // Tolerance: the codec's rounding of a unit-range row, plus re-encodings.
  const double tol = GetParam() == kernels::KvDType::kF32   ? 1e-5
                     : GetParam() == kernels::KvDType::kF16 ? 5e-3
                                                            : 0.1;
  SeqKv kv(m->mutable_pool());
  std::vector<float> score;
  std::vector<int32_t> age;
  std::vector<int32_t> ids;
  bool switched = false;
  for (int32_t t = 0; t < 200; ++t) {
    ASSERT_TRUE(m->AllocateSlots(&kv, 1).ok());
    const int32_t slot = kv.num_computed;
    ASSERT_LT(kv.rope_position(slot), kContext) << "token " << t;
    ids.clear();
    kv.table.AppendIds(&ids);
    const int32_t offsets[2] = {0, static_cast<int32_t>(ids.size())};
    const kernels::PagedKvView view = m->pool().View(ids.data(), offsets, 1);
    for (int32_t l = 0; l < kLayers; ++l) {
      std::vector<float> k(kHeads * kDim), v(kHeads * kDim, 0.5f);
      for (int32_t h = 0; h < kHeads; ++h) {
        std::vector<float> r = raw(t, l, h);
        kernels::RopeReference(r.data(), 1, kv.rope_position(slot), eo.rope);
        std::copy(r.begin(), r.end(), k.begin() + h * kDim);
      }
      const int32_t seq = 0;
      kernels::AppendKv(view, l, 1, &seq, &slot, k.data(), kHeads * kDim, v.data(), kHeads * kDim);
    }
    m->MarkComputed(&kv, 1);
    m->Commit(&kv, "", {}, 1);
    evictor.MaybeCompact(policy, &kv, &score, &age);
    switched |= kv.cache_positions;
    // Every kept key against a fresh rotation of its raw vector.
    ids.clear();
    kv.table.AppendIds(&ids);
    const int32_t offs[2] = {0, static_cast<int32_t>(ids.size())};
    const kernels::PagedKvView after = m->pool().View(ids.data(), offs, 1);
    std::vector<float> got(kDim);
    for (int32_t i = 0; i < kv.num_computed; ++i) {
      const int32_t token = i < policy.sinks ? i : i + kv.position_shift;
      const int32_t pos = kv.cache_positions ? i : token;
      for (int32_t l = 0; l < kLayers; ++l) {
        for (int32_t h = 0; h < kHeads; ++h) {
          std::vector<float> want = raw(token, l, h);
          kernels::RopeReference(want.data(), 1, pos, eo.rope);
          kernels::ReadKvRow(after, l, 0, i, h, /*value=*/false, got.data());
          double err = 0;
          for (int32_t e = 0; e < kDim; ++e) err = std::max(err, double{std::abs(got[e] - want[e])});
          ASSERT_LT(err, tol) << "token " << t << ": slot " << i << " (token " << token
                              << ", position " << pos << ") layer " << l << " head " << h;
          kernels::ReadKvRow(after, l, 0, i, h, /*value=*/true, got.data());
          ASSERT_NEAR(got[0], 0.5f, 1e-2) << "values are not rotated";
        }
      }
    }
  }
  EXPECT_TRUE(switched) << "200 tokens through a 40-token context never switched";
  EXPECT_GT(evictor.rotated_keys(), 0);
  EXPECT_GT(kv.position_shift, 150);
  m->Discard(&kv);
  EXPECT_EQ(m->num_free_blocks(), 16);
}

// H2O keeps original positions (its kept tokens are no single run); a sinks
// sequence that stays inside the context never switches.
TEST(SinksPositionsTest, H2OAndShortSinksKeepOriginalPositions) {
  KvCacheManagerOptions o;
  o.pool.n_layers = 1;
  o.pool.n_kv_heads = 1;
  o.pool.head_dim = 8;
  o.pool.block_size = 4;
  o.pool.n_blocks = 16;
  o.prefix_cache = false;
  auto m = KvCacheManager::Create(std::move(o)).value();
  KvEvictorOptions eo;
  eo.rope = kernels::RopeParams{8, 8, 10000.0f, kernels::RopeStyle::kNorm};
  eo.context_length = 40;
  eo.switch_margin = 4;
  eo.can_rotate = true;
  KvEvictor evictor(m.get(), eo);
  for (const auto& [policy, tokens] :
       std::vector<std::pair<KvPolicy, int>>{{Policy(KvPolicy::Kind::kH2O, 2, 4, 12), 100},
                                             {Policy(KvPolicy::Kind::kSinks, 2, 8), 30}}) {
    SeqKv kv(m->mutable_pool());
    std::vector<float> score;
    std::vector<int32_t> age;
    for (int32_t t = 0; t < tokens; ++t) {
      ASSERT_TRUE(m->AllocateSlots(&kv, 1).ok());
      m->MarkComputed(&kv, 1);
      m->Commit(&kv, "", {}, 1);
      evictor.MaybeCompact(policy, &kv, &score, &age);
    }
    EXPECT_GT(kv.position_shift, 0) << KvPolicyName(policy.kind);
    EXPECT_FALSE(kv.cache_positions) << KvPolicyName(policy.kind);
    m->Discard(&kv);
  }
  EXPECT_EQ(evictor.rotated_keys(), 0);
}

INSTANTIATE_TEST_SUITE_P(PerRowCodecs, SinksPositionsTest,
                         ::testing::Values(kernels::KvDType::kF32, kernels::KvDType::kF16,
                                           kernels::KvDType::kInt8),
                         [](const auto& info) {
                           std::string n(kernels::KvDTypeName(info.param));
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

TEST(DropSlotsTest, SharedBlocksAreCopiedNeverWritten) {
  KvCacheManagerOptions o;
  o.pool.n_layers = 1;
  o.pool.n_kv_heads = 1;
  o.pool.head_dim = 8;
  o.pool.block_size = 4;
  o.pool.n_blocks = 8;
  o.pool.dtype = kernels::KvDType::kF32;
  auto m = KvCacheManager::Create(std::move(o)).value();
  SeqKv a(m->mutable_pool());
  ASSERT_TRUE(m->AllocateSlots(&a, 12).ok());
  m->MarkComputed(&a, 12);
  m->Commit(&a, "", Range(0, 12), 12);  // 3 full blocks, now shared with the index
  SeqKv b = m->Fork(a);
  EXPECT_EQ(m->FirstPrivateSlot(a), 12);
  std::vector<int32_t> ids;
  b.table.AppendIds(&ids);
  const kernels::PagedKvView pool_view = m->pool().View(ids.data(), nullptr, 0);
  auto bytes_of = [&](int32_t id) {
    const uint8_t* p = pool_view.pool + static_cast<int64_t>(id) * pool_view.block_bytes;
    return std::vector<uint8_t>(p, p + pool_view.block_bytes);
  };
  for (int32_t id : ids) {
    uint8_t* p = pool_view.pool + static_cast<int64_t>(id) * pool_view.block_bytes;
    for (int64_t i = 0; i < pool_view.block_bytes; ++i) p[i] = static_cast<uint8_t>(i * 7 + id);
  }
  std::vector<std::vector<uint8_t>> before;
  for (int32_t id : ids) before.push_back(bytes_of(id));
  // Keep the first block in place and the last one, moved into block 1.
  ASSERT_TRUE(m->DropSlots(&a, {0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_EQ(a.table.blocks()[0].id, ids[0]) << "kept in place: still shared";
  EXPECT_NE(a.table.blocks()[1].id, ids[1]) << "received rows: a private copy";
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(bytes_of(ids[i]), before[i]) << "shared block " << i << " was written";
  }
  EXPECT_EQ(m->prefix_cache()->MatchLength("", Range(0, 12), 12), 12)
      << "the index still holds the full prefix";
  m->Discard(&b);
  m->Discard(&a);
  EXPECT_EQ(m->num_free_blocks() + m->num_evictable_blocks(), 8);
}

// ---- The engine under a policy ----

using Model = testing::WrittenModel;
const Model& Tiny() { return testing::TinyWrittenModel("kv-eviction-tiny", 1024); }
ThreadPool* Pool() { return testing::TestPool(); }

struct Result {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  int32_t dropped = 0;
  FinishReason finish = FinishReason::kNone;
};

EngineRequest Request(std::vector<int32_t> prompt, int max_tokens, KvPolicy policy = {}) {
  EngineRequest r;
  r.prompt = std::move(prompt);
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.logprobs = true;
  r.kv_policy = policy;
  return r;
}

EngineOptions Opts(bool prefix_cache, int32_t blocks = 256) {
  EngineOptions o;
  o.num_blocks = blocks;
  o.block_size = 16;
  o.prefix_cache = prefix_cache;
  return o;
}

// Runs the requests together to completion; results in submission order.
std::vector<Result> RunAll(Engine& e, const std::vector<EngineRequest>& reqs,
                        int32_t* max_blocks_used = nullptr) {
  std::vector<Result> out(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Result* r = &out[i];
    EXPECT_TRUE(e.Submit(reqs[i], [r](const SeqEvent& ev) {
                   r->tokens.insert(r->tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
                   r->logprobs.insert(r->logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
                   r->dropped = std::max(r->dropped, ev.dropped_tokens);
                   if (ev.finish != FinishReason::kNone) r->finish = ev.finish;
                 }).ok());
  }
  while (e.Step()) {
    if (max_blocks_used) {
      *max_blocks_used = std::max<int32_t>(*max_blocks_used,
                                           e.kv_pool().num_blocks() - e.kv_pool().num_free_blocks());
    }
  }
  return out;
}

std::vector<int32_t> Prompt(int n, int seed) {
  std::vector<int32_t> p = {1};
  for (int i = 1; i < n; ++i) p.push_back(3 + (seed * 131 + i * 7919) % 300);
  return p;
}

TEST(KvEvictionEngineTest, ABudgetNeverExceededChangesNothing) {
  const Model& m = Tiny();
  using K = KvPolicy::Kind;
  auto plain = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
  const Result ref = RunAll(*plain, {Request(Prompt(40, 1), 60)})[0];
  for (const KvPolicy& p : {Policy(K::kWindow, 0, 200), Policy(K::kSinks, 4, 200),
                            Policy(K::kH2O, 4, 100, 200)}) {
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
    const Result r = RunAll(*e, {Request(Prompt(40, 1), 60, p)})[0];
    EXPECT_EQ(r.tokens, ref.tokens) << KvPolicyName(p.kind);
    EXPECT_EQ(r.logprobs, ref.logprobs) << KvPolicyName(p.kind) << ": bit-identical";
    EXPECT_EQ(r.dropped, 0);
  }
}

TEST(KvEvictionEngineTest, AWindowBoundsTheBlocksASequenceHolds) {
  const Model& m = Tiny();
  auto plain = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
  int32_t plain_blocks = 0;
  const Result ref = RunAll(*plain, {Request(Prompt(20, 2), 300)}, &plain_blocks)[0];
  for (const KvPolicy& p : {Policy(KvPolicy::Kind::kWindow, 0, 48),
                            Policy(KvPolicy::Kind::kSinks, 4, 44),
                            Policy(KvPolicy::Kind::kH2O, 4, 24, 48)}) {
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
    int32_t blocks = 0;
    const Result r = RunAll(*e, {Request(Prompt(20, 2), 300, p)}, &blocks)[0];
    ASSERT_EQ(r.tokens.size(), 300u) << KvPolicyName(p.kind);
    EXPECT_EQ(r.finish, FinishReason::kLength);
    // 48 kept + up to a block of slack, + the block being written.
    EXPECT_LE(blocks, 48 / 16 + 2) << KvPolicyName(p.kind);
    EXPECT_GE(plain_blocks, (20 + 300) / 16);
    EXPECT_GT(r.dropped, 200) << "usage reports what was dropped";
    EXPECT_NE(r.tokens, ref.tokens) << KvPolicyName(p.kind) << ": eviction changed attention";
    EXPECT_GT(e->Stats().kv_evicted_tokens, 200);
    EXPECT_GT(e->Stats().kv_compactions, 0);
    EXPECT_EQ(e->kv_pool().num_free_blocks(), 256) << "blocks leaked";
  }
}

TEST(KvEvictionEngineTest, ALossySequenceNeverFeedsThePrefixCache) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(true)).value();
  const Result r = RunAll(*e, {Request(Prompt(20, 3), 200, Policy(KvPolicy::Kind::kWindow, 0, 32))})[0];
  ASSERT_GT(r.dropped, 0);
  // What the cache holds was committed before the first compaction: at most
  // the window plus a block of slack, in whole blocks.
  EXPECT_LE(e->prefix_cache()->num_cached_blocks(), (32 + 16) / 16);
  // And each cached block holds the tokens it claims: the cached prefix of
  // the sequence matches it exactly.
  std::vector<int32_t> all = Prompt(20, 3);
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  const int32_t cached = e->prefix_cache()->MatchLength("", all, static_cast<int32_t>(all.size()));
  EXPECT_EQ(cached, e->prefix_cache()->num_cached_blocks() * 16);
}

TEST(KvEvictionEngineTest, ASiblingSharingThePrefixIsUnaffected) {
  const Model& m = Tiny();
  const std::vector<int32_t> shared = Prompt(64, 4);
  std::vector<int32_t> pa = shared, pb = shared;
  pa.push_back(7);
  pb.push_back(9);
  auto alone = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(true)).value();
  const Result b_alone = RunAll(*alone, {Request(pb, 120)})[0];
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(true)).value();
  // The prefix enters the cache first, so the evicting request shares it.
  RunAll(*e, {Request(shared, 1)});
  const auto both =
      RunAll(*e, {Request(pa, 120, Policy(KvPolicy::Kind::kWindow, 0, 16)), Request(pb, 120)});
  EXPECT_GT(both[0].dropped, 0);
  EXPECT_EQ(both[1].tokens, b_alone.tokens) << "the sibling's output must not change";
  EXPECT_EQ(both[1].logprobs, b_alone.logprobs);
  EXPECT_EQ(both[1].dropped, 0);
}

// An h2o sequence batched with a longer plain one: the attention-mass rows
// are sized for the h2o sequences only, and the plain sequence (slots past
// that size) must neither fail the step nor change its output.
TEST(KvEvictionEngineTest, AnH2OSequenceBesideALongerPlainOneRunsBoth) {
  const Model& m = Tiny();
  auto alone = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
  const Result long_alone = RunAll(*alone, {Request(Prompt(150, 6), 40)})[0];
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(false)).value();
  const auto both = RunAll(*e, {Request(Prompt(10, 5), 120, Policy(KvPolicy::Kind::kH2O, 4, 16, 40)),
                                Request(Prompt(150, 6), 40)});
  EXPECT_EQ(both[0].finish, FinishReason::kLength);
  EXPECT_EQ(both[0].tokens.size(), 120u);
  EXPECT_GT(both[0].dropped, 0);
  EXPECT_EQ(both[1].finish, FinishReason::kLength);
  EXPECT_EQ(both[1].tokens, long_alone.tokens);
  EXPECT_EQ(both[1].logprobs, long_alone.logprobs);
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 256) << "blocks leaked";
}

// Generation past the trained context (128 tokens here): sinks and window
// requests run to their length with positions within the cache; plain and
// h2o requests that long are refused, and so is a sinks policy too large to
// leave room for a step below the context.
TEST(KvEvictionEngineTest, SinksGeneratesPastTheTrainedContext) {
  const Model& m = testing::TinyWrittenModel("kv-eviction-ctx128", 128);
  EngineOptions o = Opts(false, 64);
  o.max_batched_tokens = 32;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  const Result r = RunAll(*e, {Request(Prompt(20, 7), 400, Policy(KvPolicy::Kind::kSinks, 4, 32))})[0];
  EXPECT_EQ(r.finish, FinishReason::kLength);
  EXPECT_EQ(r.tokens.size(), 400u);
  EXPECT_GT(r.dropped, 300);
  EXPECT_GT(e->Stats().kv_rotated_keys, 0) << "never switched to positions within the cache";
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 64) << "blocks leaked";
  const Result w = RunAll(*e, {Request(Prompt(20, 7), 300, Policy(KvPolicy::Kind::kWindow, 0, 32))})[0];
  EXPECT_EQ(w.tokens.size(), 300u);
  for (const KvPolicy& p : {KvPolicy{}, Policy(KvPolicy::Kind::kH2O, 4, 16, 40)}) {
    auto s = e->Submit(Request(Prompt(20, 7), 400, p), [](const SeqEvent&) {});
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << KvPolicyName(p.kind);
    EXPECT_THAT(s.status().message(), ::testing::HasSubstr("exceeds the context length"));
  }
  auto big = e->Submit(Request(Prompt(20, 7), 400, Policy(KvPolicy::Kind::kSinks, 4, 100)),
                       [](const SeqEvent&) {});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.status().message(), ::testing::HasSubstr("must stay below the context length"));
}

TEST(KvEvictionEngineTest, UnsupportedCodecsAreRefusedWithTheReason) {
  const Model& m = Tiny();
  EngineOptions o = Opts(false);
  o.kv_dtype = kernels::KvDType::kInt4Kivi;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  const absl::Status st =
      e->Submit(Request(Prompt(8, 5), 4, Policy(KvPolicy::Kind::kSinks, 4, 16)),
                [](const SeqEvent&) {})
          .status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("int4-kivi"));
  const absl::Status small =
      e->Submit(Request(Prompt(8, 5), 4, Policy(KvPolicy::Kind::kH2O, 4, 16, 10)),
                [](const SeqEvent&) {})
          .status();
  EXPECT_TRUE(absl::IsInvalidArgument(small));
}

// Past the context the policy streams alone: sinks and window run with
// positions within the cache and report per-segment perplexity; h2o is
// refused there.
TEST(KvPolicyEvalTest, StreamsPastTheContextUnderSinks) {
  const Model& m = testing::TinyWrittenModel("kv-eviction-ctx128", 128);
  std::vector<int32_t> text = Prompt(400, 9);
  KvPolicyEvalOptions o;
  o.policy = Policy(KvPolicy::Kind::kSinks, 4, 32);
  o.segment = 100;
  auto r = EvaluateKvPolicy(m.model.get(), text, o, Pool());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->reference);
  EXPECT_EQ(r->scored_tokens, 399);
  EXPECT_EQ(r->segment_perplexity.size(), 3u);
  EXPECT_GT(r->rotated_keys, 0);
  EXPECT_LE(r->max_slots, 32 + 4 + 16 + 16);
  EXPECT_TRUE(std::isfinite(r->perplexity_policy));
  o.policy = Policy(KvPolicy::Kind::kH2O, 4, 16, 40);
  EXPECT_EQ(EvaluateKvPolicy(m.model.get(), text, o, Pool()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvPolicyEvalTest, FullKvAgreesWithItselfAndAWindowCostsSomething) {
  const Model& m = Tiny();
  const std::vector<int32_t> text = Prompt(300, 6);
  KvPolicyEvalOptions o;
  o.kv_dtype = kernels::KvDType::kF32;
  const KvPolicyEvalResult none = EvaluateKvPolicy(m.model.get(), text, o, Pool()).value();
  EXPECT_EQ(none.scored_tokens, 299);
  EXPECT_DOUBLE_EQ(none.perplexity_policy, none.perplexity_full);
  EXPECT_EQ(none.same_top1, 1.0);
  EXPECT_EQ(none.mean_kl, 0.0);
  for (const KvPolicy& p : {Policy(KvPolicy::Kind::kWindow, 0, 48),
                            Policy(KvPolicy::Kind::kH2O, 4, 24, 48)}) {
    o.policy = p;
    const KvPolicyEvalResult r = EvaluateKvPolicy(m.model.get(), text, o, Pool()).value();
    EXPECT_DOUBLE_EQ(r.perplexity_full, none.perplexity_full) << "the reference stream is the same";
    EXPECT_NE(r.perplexity_policy, r.perplexity_full) << KvPolicyName(p.kind);
    EXPECT_GT(r.mean_kl, 0.0);
    EXPECT_LE(r.max_slots, 48 + 16 + o.chunk) << "capacity + a block of slack + a chunk";
    EXPECT_GT(r.dropped_tokens, 200);
  }
  o.policy = Policy(KvPolicy::Kind::kH2O, 4, 24, 20);
  EXPECT_TRUE(absl::IsInvalidArgument(EvaluateKvPolicy(m.model.get(), text, o, Pool()).status()));
}

}  // namespace
}  // namespace kvserve
