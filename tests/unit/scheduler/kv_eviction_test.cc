// Token eviction: which slots each policy keeps, compaction moving kept rows
// bit for bit and never writing a shared block, and the engine under a
// policy: a budget the sequence never exceeds changes nothing, a window
// bounds the blocks a sequence holds, a lossy sequence never feeds the
// prefix cache, and a sibling sharing its prefix is unaffected.
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
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
