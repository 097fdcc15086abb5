// KV cache groups for hybrid attention (issue 41): a model that mixes full
// and sliding-window layers keeps one block table per group of equal-sized
// layer groups over one pool, and the window groups hold only their window.
// Checked here: the layer-to-group map; the forward's logits with groups
// equal the all-layers layout's (a fixture, and the real Gemma 3 270M when
// present), f32 and quantized KV; greedy outputs through the engine equal
// the all-layers layout's with and without the prefix cache and through
// preemption; a repeated long prompt is served from the cache in every
// group; a multi-turn conversation keeps hitting; the window groups return
// blocks to the pool; a randomized run of allocate / commit / window
// release / evict / fork / truncate / cancel over the groups with content
// tags in the blocks reads no freed or foreign block and leaks nothing; and
// the features that do not know the groups are refused by name; a retention
// lease keeps every group's blocks of its prefix through an eviction.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/memory_planner.h"
#include "gtest/gtest.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "scheduler/cache_control.h"
#include "scheduler/engine.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_tiers.h"
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

// Six layers, a 16-token window on layers 0, 1, 3, 4 (pattern 3: every third
// layer global): two full layers and four windowed ones, so three groups of
// two layers (one full, two window groups).
Loaded LoadHybrid() {
  testing::TinyLlamaOptions o;
  o.n_layers = 6;
  o.sliding_window = kWindow;
  o.sliding_window_pattern = 3;
  o.context_length = 512;
  o.seed = 11;
  const std::string path = testing::TempDir() + "/hybrid-groups.gguf";
  std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
  Loaded l;
  l.model = LlamaModel::Load(path).value();
  l.tokenizer = Tokenizer::FromGguf(l.model->file()).value();
  return l;
}

std::vector<int32_t> Prompt(int32_t n, int32_t salt, int32_t vocab = 250) {
  std::vector<int32_t> p = {1};
  for (int32_t i = 1; i < n; ++i) p.push_back(3 + (i * 31 + salt * 17 + i * i * salt) % vocab);
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
  int32_t tier_tokens = -1;  // of those, loaded from the host and disk tiers
};

std::vector<RunResult> RunAll(Engine* e, const std::vector<EngineRequest>& reqs,
                              int64_t* peak_pool = nullptr) {
  std::vector<RunResult> out(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto id = e->Submit(reqs[i], [&out, i](const SeqEvent& ev) {
      out[i].tokens.insert(out[i].tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (out[i].cached_tokens < 0) {
        out[i].cached_tokens = ev.cached_tokens;
        out[i].tier_tokens = ev.cached_host_tokens + ev.cached_disk_tokens;
      }
    });
    EXPECT_TRUE(id.ok()) << id.status();
  }
  while (e->Step()) {
    if (peak_pool != nullptr) {
      *peak_pool =
          std::max<int64_t>(*peak_pool, e->kv_pool().num_blocks() - e->kv_pool().num_free_blocks());
    }
  }
  return out;
}

std::unique_ptr<Engine> MakeEngine(const Loaded& m, bool groups, bool prefix_cache,
                                   int32_t num_blocks, int32_t block = kBlock,
                                   int32_t max_batched = 8,
                                   kernels::KvDType dtype = kernels::KvDType::kF32) {
  EngineOptions o;
  o.block_size = block;
  o.num_blocks = num_blocks;
  o.max_batched_tokens = max_batched;  // chunked prefill: the window moves during the prompt
  o.prefix_cache = prefix_cache;
  o.kv_cache_groups = groups;
  o.kv_dtype = dtype;
  return Engine::Create(m.model.get(), m.tokenizer.get(), testing::TestPool(), o).value();
}

TEST(KvGroupsConfigTest, LayersFormEqualGroupsFullFirst) {
  const Loaded m = LoadHybrid();
  const LlamaConfig& c = m.model->config();
  const LlamaConfig::KvGroups g = c.MakeKvGroups();
  EXPECT_EQ(g.layers_per_group, 2);
  EXPECT_EQ(g.group_window, (std::vector<int32_t>{0, kWindow, kWindow}));
  EXPECT_EQ(g.layer_group, (std::vector<int32_t>{1, 1, 0, 2, 2, 0}));
  EXPECT_EQ(g.layer_index, (std::vector<int32_t>{0, 1, 0, 0, 1, 1}));
  const LlamaConfig::KvGroups all = c.MakeKvGroups(false);
  EXPECT_EQ(all.layers_per_group, 6);
  EXPECT_EQ(all.group_window, (std::vector<int32_t>{0}));
  // Gemma 3 270M's shape: 18 layers, every sixth global.
  LlamaConfig gemma;
  gemma.n_layers = 18;
  gemma.sliding_window = 512;
  for (int32_t l = 0; l < 18; ++l) gemma.layer_window.push_back((l + 1) % 6 != 0);
  const LlamaConfig::KvGroups gg = gemma.MakeKvGroups();
  EXPECT_EQ(gg.layers_per_group, 3);
  EXPECT_EQ(gg.num_groups(), 6);
  EXPECT_EQ(gg.group_window[0], 0);
  for (int32_t i = 1; i < 6; ++i) EXPECT_EQ(gg.group_window[i], 512);
  EXPECT_EQ(gg.layer_group[5], 0);
  EXPECT_EQ(gg.layer_index[17], 2);
}

// The planner's figures for Gemma 3 270M's shape (18 layers, 1 KV head of
// 256, window 512 on 15 layers) at 8k tokens, f16, block 16, 1 GiB.
TEST(KvGroupsPlanTest, GemmaShapeAt8kHoldsOver4xTheSequences) {
  KvShape shape{18, 1, 256, 8192, 512, 15};
  shape.layers_per_block = 3;
  shape.full_groups = 1;
  shape.window_groups = 5;
  const MemoryPlan p = PlanKvMemory(shape, 16, kernels::KvDType::kF16, int64_t{1} << 30).value();
  EXPECT_EQ(p.block_bytes, 2 * 3 * 16 * 256 * 2);
  EXPECT_EQ(p.kv_groups, 6);
  EXPECT_EQ(p.group_pages_per_sequence, 512 + 5 * (511 / 16 + 1 + 2));
  EXPECT_GE(p.full_context_sequences, 4 * p.full_context_sequences_all_layers);
  KvShape all{18, 1, 256, 8192, 512, 15};
  const MemoryPlan q = PlanKvMemory(all, 16, kernels::KvDType::kF16, int64_t{1} << 30).value();
  EXPECT_EQ(q.full_context_sequences, p.full_context_sequences_all_layers);
  EXPECT_NE(p.ToString().find("KV cache groups: 6 of 3 layers"), std::string::npos) << p.ToString();
}

// Measured on the allocator itself: Gemma 3 270M's KV shape (18 layers, 1
// KV head of 256, window 512 on 15 layers; f16, block 16) and one byte
// budget; sequences of 8,192 tokens are prefilled in 512-token chunks
// (allocate, compute, commit: the window groups let go as they commit)
// until the pool refuses the next chunk. The count is what fits at once.
int32_t SequencesThatFit(bool groups, int64_t budget_bytes, int32_t context) {
  LlamaConfig c;
  c.n_layers = 18;
  c.n_kv_heads = 1;
  c.head_dim = 256;
  c.sliding_window = 512;
  for (int32_t l = 0; l < 18; ++l) c.layer_window.push_back((l + 1) % 6 != 0);
  const LlamaConfig::KvGroups g = c.MakeKvGroups(groups);
  KvCacheManagerOptions ko;
  ko.pool.n_layers = g.layers_per_group;
  ko.pool.n_kv_heads = 1;
  ko.pool.head_dim = 256;
  ko.pool.block_size = 16;
  ko.pool.dtype = kernels::KvDType::kF16;
  ko.pool.n_blocks = static_cast<int32_t>(budget_bytes / KvPool::BlockBytes(ko.pool));
  ko.prefix_cache = false;
  if (g.num_groups() > 1) {
    ko.group_windows = g.group_window;
    ko.layer_group = g.layer_group;
    ko.layer_index = g.layer_index;
  } else {
    ko.sliding_window = g.group_window[0];
  }
  auto kvm = KvCacheManager::Create(std::move(ko)).value();
  std::vector<std::unique_ptr<SeqKv>> seqs;
  std::vector<int32_t> tokens(static_cast<size_t>(context), 5);
  for (;;) {
    auto kv = std::make_unique<SeqKv>(kvm->mutable_pool());
    kvm->MatchPrefix(kv.get(), "", tokens, 0);
    for (int32_t done = 0; done < context; done += 512) {
      const int32_t n = std::min(512, context - done);
      if (!kvm->AllocateSlots(kv.get(), n).ok()) {
        kvm->Discard(kv.get());
        for (auto& s : seqs) kvm->Discard(s.get());
        return static_cast<int32_t>(seqs.size());
      }
      kvm->MarkComputed(kv.get(), n);
      kvm->Commit(kv.get(), "", tokens, n);
    }
    seqs.push_back(std::move(kv));
  }
}

TEST(KvGroupsCapacityTest, Gemma3ShapeAt8kFitsOver4xTheSequences) {
  for (int64_t mib : {256, 1024}) {
    const int32_t with_groups = SequencesThatFit(true, mib << 20, 8192);
    const int32_t all_layers = SequencesThatFit(false, mib << 20, 8192);
    std::printf(
        "KV budget %lld MiB, 8192-token sequences that fit: %d with groups, %d all-layers\n",
        static_cast<long long>(mib), with_groups, all_layers);
    EXPECT_GE(all_layers, 1);
    EXPECT_GE(with_groups, 4 * all_layers) << mib << " MiB";
  }
}

// Runs tokens through the model directly (chunks, then one token at a time)
// with the KV in groups or in the all-layers layout; returns every row's
// logits and the pool blocks in use at the end.
std::vector<float> DirectLogits(LlamaModel* model, bool groups, absl::Span<const int32_t> tokens,
                                int32_t prefill, int32_t chunk, int32_t block,
                                kernels::KvDType dtype, int64_t* pool_bytes_used) {
  const LlamaConfig& c = model->config();
  const LlamaConfig::KvGroups g = c.MakeKvGroups(groups);
  KvCacheManagerOptions ko;
  ko.pool.n_layers = g.layers_per_group;
  ko.pool.n_kv_heads = c.n_kv_heads;
  ko.pool.head_dim = c.head_dim;
  ko.pool.block_size = block;
  ko.pool.dtype = dtype;
  ko.pool.n_blocks = g.num_groups() * static_cast<int32_t>((tokens.size() + block - 1) / block) + 8;
  ko.prefix_cache = false;
  if (g.num_groups() > 1) {
    ko.group_windows = g.group_window;
    ko.layer_group = g.layer_group;
    ko.layer_index = g.layer_index;
  } else {
    ko.sliding_window = g.group_window[0];
  }
  auto kvm = KvCacheManager::Create(std::move(ko)).value();
  SeqKv kv(kvm->mutable_pool());
  EXPECT_EQ(kvm->MatchPrefix(&kv, "", tokens, 0), 0);
  std::vector<float> out;
  std::vector<float> logits;
  int32_t pos = 0;
  while (pos < static_cast<int32_t>(tokens.size())) {
    const int32_t n = pos < prefill ? std::min(chunk, prefill - pos) : 1;
    EXPECT_TRUE(kvm->AllocateSlots(&kv, n).ok());
    std::vector<int32_t> toks(tokens.begin() + pos, tokens.begin() + pos + n);
    std::vector<int32_t> seq(n, 0), positions(n), rows(n);
    for (int32_t i = 0; i < n; ++i) positions[i] = pos + i, rows[i] = i;
    std::vector<std::vector<int32_t>> ids(kvm->num_groups());
    std::vector<std::vector<int32_t>> offs(kvm->num_groups());
    std::vector<kernels::PagedKvView> views;
    for (int32_t gi = 0; gi < kvm->num_groups(); ++gi) {
      kvm->group_table(kv, gi).AppendIds(&ids[gi]);
      offs[gi] = {0, static_cast<int32_t>(ids[gi].size())};
      views.push_back(kvm->View(ids[gi].data(), offs[gi].data(), 1));
    }
    ForwardBatch b;
    b.tokens = toks;
    b.token_seq = seq;
    b.positions = positions;
    b.logit_rows = rows;
    if (kvm->hybrid()) {
      b.group_kv = views;
      b.layer_group = kvm->layer_group();
      b.layer_index = kvm->layer_index();
    }
    logits.resize(static_cast<size_t>(n) * c.vocab_size);
    EXPECT_TRUE(model->Forward(b, views[0], logits.data(), testing::TestPool()).ok());
    out.insert(out.end(), logits.begin(), logits.end());
    kvm->MarkComputed(&kv, n);
    kvm->Commit(&kv, "", tokens, n);
    kvm->CheckInvariants(kv);
    pos += n;
  }
  *pool_bytes_used =
      int64_t{kvm->num_blocks() - kvm->num_free_blocks()} * kvm->pool().block_bytes();
  kvm->Discard(&kv);
  EXPECT_EQ(
      kvm->num_free_blocks(),
      kvm->num_blocks() - (kvm->hybrid() ? kvm->num_groups() - 1 : (kvm->sliding_window() > 0)));
  return out;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

TEST(KvGroupsForwardTest, LogitsEqualTheAllLayersLayoutOnAFixture) {
  Loaded m = LoadHybrid();
  const std::vector<int32_t> tokens = Prompt(120, 5);
  for (kernels::KvDType dt : {kernels::KvDType::kF32, kernels::KvDType::kF16,
                              kernels::KvDType::kInt8, kernels::KvDType::kInt4}) {
    int64_t bytes_groups = 0, bytes_all = 0;
    const std::vector<float> a =
        DirectLogits(m.model.get(), true, tokens, 90, 16, kBlock, dt, &bytes_groups);
    const std::vector<float> b =
        DirectLogits(m.model.get(), false, tokens, 90, 16, kBlock, dt, &bytes_all);
    EXPECT_LE(MaxAbsDiff(a, b), 1e-5f) << kernels::KvDTypeName(dt);
    // The window groups hold about their window; the all-layers layout the
    // whole context.
    EXPECT_LT(bytes_groups * 2, bytes_all) << kernels::KvDTypeName(dt);
  }
}

TEST(KvGroupsForwardTest, LogitsEqualTheAllLayersLayoutOnGemma3) {
  const std::string path = testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf");
  KVSERVE_SKIP_IF_MISSING(path, "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
  auto model = LlamaModel::Load(path).value();
  ASSERT_EQ(model->config().MakeKvGroups().num_groups(), 6);
  // Past the 512-token window, so the window groups release blocks.
  const std::vector<int32_t> tokens = Prompt(700, 9, 20000);
  int64_t bytes_groups = 0, bytes_all = 0;
  const std::vector<float> a =
      DirectLogits(model.get(), true, tokens, 690, 256, 16, kernels::KvDType::kF16, &bytes_groups);
  const std::vector<float> b =
      DirectLogits(model.get(), false, tokens, 690, 256, 16, kernels::KvDType::kF16, &bytes_all);
  EXPECT_LE(MaxAbsDiff(a, b), 1e-4f);
  EXPECT_LT(bytes_groups, bytes_all);
}

class KvGroupsEngineTest : public ::testing::Test {
 protected:
  Loaded m_ = LoadHybrid();
};

TEST_F(KvGroupsEngineTest, GreedyOutputsEqualTheAllLayersLayout) {
  std::vector<EngineRequest> reqs;
  for (int32_t i = 0; i < 4; ++i) reqs.push_back(Greedy(Prompt(3 * kWindow + 5 * i, i + 1), 40));
  auto ref_engine = MakeEngine(m_, false, false, 512);
  const std::vector<RunResult> ref = RunAll(ref_engine.get(), reqs);
  for (bool prefix : {false, true}) {
    auto e = MakeEngine(m_, true, prefix, 512);
    EXPECT_EQ(e->kv_manager().num_groups(), 3);
    int64_t peak = 0;
    const std::vector<RunResult> got = RunAll(e.get(), reqs, &peak);
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_EQ(got[i].tokens.size(), 40u);
      EXPECT_EQ(got[i].tokens, ref[i].tokens) << "request " << i << " prefix cache " << prefix;
    }
    if (!prefix) {
      // Four sequences of ~100 tokens: the full group holds ~25 blocks
      // each, each window group at most WindowBlocks (7).
      EXPECT_LE(peak, 4 * (26 + 2 * 7) + 2 + 8);
      EXPECT_EQ(e->kv_pool().num_free_blocks(), e->kv_pool().num_blocks() - 2);  // placeholders
    }
  }
}

TEST_F(KvGroupsEngineTest, RepeatedPromptAndMultiTurnHitInEveryGroup) {
  auto plain = MakeEngine(m_, false, false, 512);
  auto e = MakeEngine(m_, true, true, 512);
  // A conversation: each turn resends the transcript plus new text.
  std::vector<int32_t> transcript = Prompt(2 * kWindow + 3, 4);
  int32_t previous = 0;
  for (int32_t turn = 0; turn < 6; ++turn) {
    const RunResult ref = RunAll(plain.get(), {Greedy(transcript, 12)})[0];
    const RunResult got = RunAll(e.get(), {Greedy(transcript, 12)})[0];
    EXPECT_EQ(got.tokens, ref.tokens) << "turn " << turn;
    if (turn > 0) {
      // Everything the previous turn sent and generated, but the last
      // (partial) block, is served from the cache.
      EXPECT_GE(got.cached_tokens, previous - kBlock) << "turn " << turn;
    }
    transcript.insert(transcript.end(), got.tokens.begin(), got.tokens.end());
    previous = static_cast<int32_t>(transcript.size()) - 1;
    const std::vector<int32_t> more = Prompt(9, 20 + turn);
    transcript.insert(transcript.end(), more.begin() + 1, more.end());
  }
  // A repeated prompt: served again in full (but the last block), same output.
  RunAll(e.get(), {Greedy(transcript, 12)});
  const RunResult again = RunAll(e.get(), {Greedy(transcript, 12)})[0];
  const RunResult ref = RunAll(plain.get(), {Greedy(transcript, 12)})[0];
  EXPECT_GE(again.cached_tokens, static_cast<int32_t>(transcript.size()) - kBlock);
  EXPECT_EQ(again.tokens, ref.tokens);
  EXPECT_GT(e->Stats().window_released_blocks, 0);
}

// A prompt that continues 24 tokens into an earlier generation: the full
// group holds all of it, but the window groups kept only the window before
// the earlier prompt's end and its sequence's end, so the hit is cut back to
// the prompt boundary; the cache report says window_dropped, and the output
// is the uncached one.
TEST_F(KvGroupsEngineTest, ShortenedHitIsExplainedAsWindowDropped) {
  auto plain = MakeEngine(m_, false, false, 512);
  auto e = MakeEngine(m_, true, true, 512);
  const std::vector<int32_t> prompt = Prompt(2 * kWindow + 1, 6);
  const RunResult first = RunAll(e.get(), {Greedy(prompt, 60)})[0];
  std::vector<int32_t> next = prompt;
  next.insert(next.end(), first.tokens.begin(), first.tokens.begin() + 24);
  next.push_back(77);
  next.push_back(78);
  CacheControl cc(CacheControlOptions{});
  const CacheReport r =
      cc.Explain(e->kv_manager(), nullptr, "", next, [](const std::string&) { return true; });
  EXPECT_EQ(r.reason, "window_dropped") << r.detail;
  EXPECT_LT(r.cached_tokens + kBlock, static_cast<int32_t>(next.size()) - 2);  // cut back
  EXPECT_GT(r.window_dropped_tokens, 0);
  const RunResult got = RunAll(e.get(), {Greedy(next, 16)})[0];
  const RunResult ref = RunAll(plain.get(), {Greedy(next, 16)})[0];
  EXPECT_EQ(got.tokens, ref.tokens);
  EXPECT_EQ(got.cached_tokens, r.cached_tokens);
  EXPECT_GT(e->kv_manager().group_window_dropped_tokens(), 0);
}

TEST_F(KvGroupsEngineTest, PreemptionGivesTheSameOutput) {
  std::vector<EngineRequest> reqs;
  for (int32_t i = 0; i < 4; ++i) reqs.push_back(Greedy(Prompt(2 * kWindow + 3 * i, i + 7), 60));
  auto ref_engine = MakeEngine(m_, false, false, 512);
  const std::vector<RunResult> ref = RunAll(ref_engine.get(), reqs);
  for (bool prefix : {false, true}) {
    // Too few blocks for all four at once: the scheduler preempts and
    // recomputes.
    auto e = MakeEngine(m_, true, prefix, 110);
    const std::vector<RunResult> got = RunAll(e.get(), reqs);
    EXPECT_GT(e->Stats().preemptions, 0) << "prefix cache " << prefix;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, ref[i].tokens) << "request " << i << " prefix cache " << prefix;
    }
  }
}

// The manager's admission count for a hybrid model: a window group counts
// at most its window and one chunk, and that is never less than what the
// pool actually supplies while the chunks are allocated and committed; a
// one-group model counts exactly BlocksNeeded.
TEST(KvGroupsAdmissionTest, PeakCountBoundsTheChunkedPrefillAndIsExactForOneGroup) {
  Loaded m = LoadHybrid();
  for (bool groups : {true, false}) {
    const LlamaConfig::KvGroups g = m.model->config().MakeKvGroups(groups);
    for (int32_t chunk : {1, 3, 4, 7, 16, 33, 64}) {
      for (int32_t prompt : {5, 17, 40, 131}) {
        KvCacheManagerOptions ko;
        ko.pool.n_layers = g.layers_per_group;
        ko.pool.n_kv_heads = m.model->config().n_kv_heads;
        ko.pool.head_dim = m.model->config().head_dim;
        ko.pool.block_size = kBlock;
        ko.pool.n_blocks = 512;
        ko.prefix_cache = false;
        if (g.num_groups() > 1) {
          ko.group_windows = g.group_window;
          ko.layer_group = g.layer_group;
          ko.layer_index = g.layer_index;
        } else {
          ko.sliding_window = g.group_window[0];
        }
        auto kvm = KvCacheManager::Create(std::move(ko)).value();
        const std::vector<int32_t> tokens = Prompt(prompt, chunk);
        SeqKv kv(kvm->mutable_pool());
        kvm->MatchPrefix(&kv, "", tokens, 0);
        const int32_t counted = kvm->PeakBlocksNeeded(kv, prompt, chunk);
        const int32_t whole = kvm->BlocksNeeded(kv, prompt);
        if (!groups) EXPECT_EQ(counted, whole) << "one group: chunk " << chunk << " prompt " << prompt;
        const int32_t free0 = kvm->num_free_blocks();
        int32_t peak = 0;
        for (int32_t done = 0; done < prompt; done += chunk) {
          const int32_t n = std::min(chunk, prompt - done);
          ASSERT_TRUE(kvm->AllocateSlots(&kv, n).ok());
          peak = std::max(peak, free0 - kvm->num_free_blocks());
          kvm->MarkComputed(&kv, n);
          kvm->Commit(&kv, "", tokens, n);
        }
        EXPECT_GE(counted, peak) << "groups " << groups << " chunk " << chunk << " prompt " << prompt;
        EXPECT_LE(counted, whole);
        if (groups && prompt >= 131 && chunk <= 16) {
          EXPECT_LT(counted, whole) << "chunk " << chunk;  // the window groups count less
        }
        kvm->Discard(&kv);
      }
    }
  }
}

// The allocator's capacity for the fixture's groups: sequences of `prompt`
// tokens prefilled in chunks of `chunk` (allocate, compute, commit), then
// `decode` tokens one at a time, each held until every one is in.
int32_t FixtureSequencesThatFit(const LlamaModel& model, int32_t num_blocks, int32_t prompt,
                                int32_t chunk, int32_t decode) {
  const LlamaConfig::KvGroups g = model.config().MakeKvGroups(true);
  KvCacheManagerOptions ko;
  ko.pool.n_layers = g.layers_per_group;
  ko.pool.n_kv_heads = model.config().n_kv_heads;
  ko.pool.head_dim = model.config().head_dim;
  ko.pool.block_size = kBlock;
  ko.pool.n_blocks = num_blocks;
  ko.prefix_cache = false;
  ko.group_windows = g.group_window;
  ko.layer_group = g.layer_group;
  ko.layer_index = g.layer_index;
  auto kvm = KvCacheManager::Create(std::move(ko)).value();
  std::vector<std::unique_ptr<SeqKv>> seqs;
  const std::vector<int32_t> tokens(static_cast<size_t>(prompt + decode), 5);
  for (;;) {
    auto kv = std::make_unique<SeqKv>(kvm->mutable_pool());
    kvm->MatchPrefix(kv.get(), "", tokens, 0);
    for (int32_t done = 0; done < prompt + decode;) {
      const int32_t n = done < prompt ? std::min(chunk, prompt - done) : 1;
      if (!kvm->AllocateSlots(kv.get(), n).ok()) {
        kvm->Discard(kv.get());
        for (auto& s : seqs) kvm->Discard(s.get());
        return static_cast<int32_t>(seqs.size());
      }
      kvm->MarkComputed(kv.get(), n);
      kvm->Commit(kv.get(), "", tokens, n);
      done += n;
    }
    seqs.push_back(std::move(kv));
  }
}

// Through the engine: long prompts (16 windows) on a pool the allocator
// fills with K such sequences run K at once, without a preemption. Counting
// the whole prompt in every group at admission (the old count) left the
// last one waiting for a finished sequence's blocks.
TEST_F(KvGroupsEngineTest, EngineAdmitsAsManyLongPromptsAsTheAllocatorHolds) {
  constexpr int32_t kPrompt = 16 * kWindow;
  constexpr int32_t kChunk = 64;
  constexpr int32_t kDecode = 40;
  constexpr int32_t kBlocks = 530;
  const int32_t fit = FixtureSequencesThatFit(*m_.model, kBlocks, kPrompt, kChunk, kDecode);
  ASSERT_GE(fit, 3);
  std::vector<EngineRequest> reqs;
  for (int32_t i = 0; i < fit; ++i) reqs.push_back(Greedy(Prompt(kPrompt, i + 30), kDecode));
  auto e = MakeEngine(m_, true, false, kBlocks, kBlock, kChunk);
  for (const EngineRequest& r : reqs) ASSERT_TRUE(e->Submit(r, [](const SeqEvent&) {}).ok());
  int32_t peak_running = 0;
  while (e->Step()) peak_running = std::max(peak_running, e->Stats().running);
  std::printf("pool %d blocks, %d-token prompts + %d tokens: allocator holds %d, engine ran %d at once\n",
              kBlocks, kPrompt, kDecode, fit, peak_running);
  EXPECT_EQ(peak_running, fit);
  EXPECT_EQ(e->Stats().preemptions, 0);
  // Every whole-prompt-per-group count would not fit the last one beside
  // the others: the pool is smaller than that.
  EXPECT_LT(kBlocks, (fit - 1) * ((kPrompt + kDecode) / kBlock + 2 * 6) +
                         3 * (kPrompt / kBlock) + 2);
}

TEST_F(KvGroupsEngineTest, FeaturesThatDoNotKnowTheGroupsAreRefused) {
  auto e = MakeEngine(m_, true, true, 256);
  EngineRequest r = Greedy(Prompt(20, 1), 4);
  r.kv_policy.kind = KvPolicy::Kind::kH2O;
  r.kv_policy.budget = 64;
  const auto st = e->Submit(r, [](const SeqEvent&) {});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("kv_policy"), std::string::npos) << st.status();
  EXPECT_NE(st.status().message().find("KV cache groups"), std::string::npos) << st.status();

  EngineOptions o;
  o.block_size = kBlock;
  o.num_blocks = 256;
  // KV events run: they publish the full group's index (group 0).
  struct NullSink : KvEventSink {
    void Publish(std::vector<KvCacheEvent>) override {}
  } sink;
  o.kv_events = &sink;
  ASSERT_TRUE(Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).ok());
  o.kv_events = nullptr;
  // A KV loader (a decode node's pulls) gets every group's table in its
  // targets (tests/e2e/pd_hybrid_test.cc): accepted. Never called here.
  KvLoader* loader = reinterpret_cast<KvLoader*>(&sink);
  o.kv_loader = loader;
  ASSERT_TRUE(Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).ok());
  o.kv_loader = nullptr;
  // The KV tiers know the groups (TierRoundTrip... below).
  KvTiersOptions to;
  to.host_bytes = int64_t{1} << 20;
  o.kv_tiers = KvTiers::Create(std::move(to)).value();
  ASSERT_TRUE(Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).ok());
  EXPECT_EQ(o.kv_tiers->num_groups(), 3);
  o.kv_tiers = nullptr;
  // Retention leases know the groups (RetentionLease... below).
  // The all-layers layout runs them (one group).
  o.kv_loader = nullptr;
  o.kv_cache_groups = false;
  auto all = Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).value();
  EXPECT_EQ(all->kv_manager().num_groups(), 1);
}

// KV events (issue 41): every group's index publishes into the engine's
// sink, each event tagged with its group. The window groups store the same
// chains under the same hashes as the full group, and release the blocks
// their window leaves behind (hollow nodes: not published as removed).
TEST_F(KvGroupsEngineTest, EveryGroupPublishesItsIndexTaggedWithItsGroup) {
  struct Capture : KvEventSink {
    std::vector<KvCacheEvent> events;
    void Publish(std::vector<KvCacheEvent> e) override {
      events.insert(events.end(), e.begin(), e.end());
    }
  } sink;
  EngineOptions o;
  o.block_size = kBlock;
  o.num_blocks = 256;
  o.max_batched_tokens = 8;
  o.kv_events = &sink;
  auto e = Engine::Create(m_.model.get(), m_.tokenizer.get(), testing::TestPool(), o).value();
  RunAll(e.get(), {Greedy(Prompt(3 * kWindow + 7, 12), 8)});
  // Replay the events per group, as a consumer keyed by (group, hash) does.
  std::map<int32_t, std::set<uint64_t>> stored, live;
  std::map<int32_t, int> removed;
  for (const KvCacheEvent& ev : sink.events) {
    if (ev.kind == KvCacheEvent::Kind::kBlockStored) {
      stored[ev.group].insert(ev.block_hash);
      live[ev.group].insert(ev.block_hash);
    } else if (ev.kind == KvCacheEvent::Kind::kBlockRemoved) {
      ++removed[ev.group];
      live[ev.group].erase(ev.block_hash);
    }
  }
  ASSERT_EQ(stored.size(), 3u) << "groups 0, 1 and 2 publish";
  EXPECT_GE(stored[0].size(), 13u);
  EXPECT_EQ(removed[0], 0);
  EXPECT_EQ(live[0], stored[0]);
  for (int32_t g : {1, 2}) {
    // The same chains under the same hashes; the blocks the window left
    // behind were removed (hollow), the boundary's window stays.
    EXPECT_EQ(stored[g], stored[0]) << "group " << g;
    EXPECT_GT(removed[g], 0) << "group " << g;
    EXPECT_LT(live[g].size(), stored[0].size()) << "group " << g;
    EXPECT_GE(live[g].size(), static_cast<size_t>(kWindow / kBlock)) << "group " << g;
    const int32_t cached = e->kv_manager().group_manager(g).prefix_cache()->num_cached_blocks();
    EXPECT_EQ(static_cast<int32_t>(live[g].size()), cached)
        << "group " << g << ": the replica holds what the group's index holds";
  }
}

// ---- The host and disk tiers on a hybrid model ----

std::string TierDir(const char* name) {
  const std::string d = testing::TempDir() + "/kv-groups-tiers-" + name;
  std::filesystem::remove_all(d);
  return d;
}

std::shared_ptr<KvTiers> GroupTiers(bool host, const std::string& disk_dir) {
  KvTiersOptions to;
  if (host) to.host_bytes = int64_t{8} << 20;
  if (!disk_dir.empty()) {
    to.disk_dir = disk_dir;
    to.disk_bytes = int64_t{64} << 20;
    to.disk_min_hits = 0;
    to.model_fingerprint = "kv-groups-fixture";
  }
  return KvTiers::Create(std::move(to)).value();
}

std::unique_ptr<Engine> MakeTierEngine(const Loaded& m, std::shared_ptr<KvTiers> tiers,
                                       int32_t num_blocks, int32_t block = kBlock,
                                       int32_t max_batched = 8, bool groups = true) {
  EngineOptions o;
  o.block_size = block;
  o.num_blocks = num_blocks;
  o.max_batched_tokens = max_batched;
  o.kv_cache_groups = groups;
  o.prefix_cache = tiers != nullptr;
  o.kv_tiers = std::move(tiers);
  return Engine::Create(m.model.get(), m.tokenizer.get(), testing::TestPool(), o).value();
}

// Evicts every cached block (so each is demoted to the tiers) on the engine
// thread, as pool pressure would.
void DemoteEverything(Engine* e) {
  auto done = e->EvictAllCachedForTest();
  e->Step();
  done.wait();
}

// A retention lease on a hybrid model (issue 41) pins the full group's
// blocks of the whole prefix and each window group's last window's, so an
// eviction of everything cached keeps the hit in every group (same text as
// the all-layers layout without a cache); without the lease the same
// eviction loses it. Released, every block goes back to the pool.
TEST_F(KvGroupsEngineTest, RetentionLeaseKeepsTheHitInEveryGroupThroughEviction) {
  const std::vector<int32_t> target = Prompt(3 * kWindow + 7, 9);  // 55 tokens: 13 full blocks
  auto plain = MakeEngine(m_, false, false, 512);
  const RunResult ref = RunAll(plain.get(), {Greedy(target, 16)})[0];
  for (bool retain : {false, true}) {
    auto e = MakeEngine(m_, true, true, 200);
    const int32_t baseline = e->kv_pool().num_free_blocks();  // the placeholders are held
    EXPECT_EQ(RunAll(e.get(), {Greedy(target, 16)})[0].tokens, ref.tokens);
    KvCacheManager* kv = const_cast<KvCacheManager*>(&e->kv_manager());
    CacheControl cc(CacheControlOptions{});
    RetainAnswer a;
    if (retain) {
      RetainRequest rr;
      rr.tokens = target;
      rr.ttl_s = 60;
      a = cc.Retain(kv, rr);
      ASSERT_EQ(a.outcome, RetainAnswer::Outcome::kGranted) << a.reason << ": " << a.detail;
      EXPECT_EQ(a.lease.tokens, 52);
      // 13 full-group blocks and, in each of the two window groups, the
      // blocks its window reaches from slot 52 (37 on: blocks 9..12).
      EXPECT_EQ(a.lease.blocks, 13 + 2 * 4);
      EXPECT_EQ(a.lease.bytes, (13 + 2 * 4) * e->kv_pool().block_bytes());
    }
    DemoteEverything(e.get());  // no tiers: every evictable cached block is dropped
    const RunResult again = RunAll(e.get(), {Greedy(target, 16)})[0];
    EXPECT_EQ(again.tokens, ref.tokens) << "retain " << retain;
    if (retain) {
      EXPECT_EQ(again.cached_tokens, 52) << "the lease keeps every group's blocks";
      EXPECT_TRUE(cc.Release(kv, a.lease.id, std::nullopt));
    } else {
      EXPECT_EQ(again.cached_tokens, 0) << "without a lease the eviction loses the prefix";
    }
    DemoteEverything(e.get());
    EXPECT_EQ(e->kv_pool().num_free_blocks(), baseline) << "retain " << retain;
  }
}

// A demote -> promote round trip (issue 41): the prompt's blocks leave the
// pool for the host tier, the disk tier alone, or both, each KV cache group
// its own pages (the full group's for the whole prefix, each window
// group's for the window the prefix-cache hit rule needs); the prompt sent
// again is loaded from there in every group and generates what the
// all-layers layout without any cache generates.
TEST_F(KvGroupsEngineTest, TierRoundTripGivesTheSameOutput) {
  const std::vector<int32_t> target = Prompt(3 * kWindow + 7, 5);  // 55 tokens: 13 full blocks
  auto plain = MakeEngine(m_, false, false, 512);
  const RunResult ref = RunAll(plain.get(), {Greedy(target, 24)})[0];
  ASSERT_EQ(ref.tokens.size(), 24u);
  struct Mode {
    const char* name;
    bool host, disk;
  };
  for (const Mode& mode : {Mode{"host", true, false}, Mode{"disk", false, true},
                           Mode{"host+disk", true, true}}) {
    auto tiers = GroupTiers(mode.host, mode.disk ? TierDir(mode.name) : std::string());
    auto e = MakeTierEngine(m_, tiers, 200);
    const RunResult first = RunAll(e.get(), {Greedy(target, 24)})[0];
    EXPECT_EQ(first.tokens, ref.tokens) << mode.name;
    DemoteEverything(e.get());
    const KvTiersStats demoted = e->Stats().tiers;
    EXPECT_GT(demoted.demotions_host + demoted.demotions_disk, 13 + 2 * 4) << mode.name;
    EXPECT_EQ(e->kv_manager().prefix_cache()->num_cached_blocks(), 0) << mode.name;
    const RunResult again = RunAll(e.get(), {Greedy(target, 24)})[0];
    EXPECT_EQ(again.tokens, ref.tokens) << mode.name << ": loaded KV must give the same tokens";
    // The 13 full blocks came back from the tiers, in every group (the
    // partial 14th is never demoted).
    EXPECT_EQ(again.tier_tokens, 52) << mode.name;
    EXPECT_EQ(again.cached_tokens, 52) << mode.name;
    const EngineStats st = e->Stats();
    EXPECT_EQ(st.kv_loads, 1) << mode.name;
    EXPECT_EQ(st.kv_load_failures, 0) << mode.name;
    // 13 full-group pages and, in each window group, the blocks of its
    // last window (slots 52 - 16 + 1 = 37 on: blocks 9..12).
    EXPECT_EQ(st.tiers.promotions_host + st.tiers.promotions_disk, 13 + 2 * 4) << mode.name;
    EXPECT_EQ(st.tiers.checksum_failures, 0) << mode.name;
    // Running again hits the pool in every group (the loaded blocks were
    // cached, the parked ones as hollow nodes): same text.
    const RunResult third = RunAll(e.get(), {Greedy(target, 24)})[0];
    EXPECT_EQ(third.tokens, ref.tokens) << mode.name;
    EXPECT_GE(third.cached_tokens, 52) << mode.name;
    EXPECT_EQ(third.tier_tokens, 0) << mode.name;
  }
}

// Warm restart on a hybrid model: an engine with a disk tier stops (its
// shutdown persists every group's cached blocks); a new engine over the
// same directory loads the prompt from disk in every group and generates
// the same text.
TEST_F(KvGroupsEngineTest, WarmRestartReloadsEveryGroupFromDisk) {
  const std::vector<int32_t> target = Prompt(3 * kWindow + 7, 8);
  auto plain = MakeEngine(m_, false, false, 512);
  const RunResult ref = RunAll(plain.get(), {Greedy(target, 20)})[0];
  const std::string dir = TierDir("restart");
  {
    auto tiers = GroupTiers(false, dir);
    auto e = MakeTierEngine(m_, tiers, 200);
    EXPECT_EQ(RunAll(e.get(), {Greedy(target, 20)})[0].tokens, ref.tokens);
    e->Stop();
    e.reset();  // shutdown: persists the cached blocks of every group
    tiers->Flush();
    EXPECT_GT(tiers->stats().demotions_disk, 13) << "every group's blocks on disk";
  }
  auto tiers = GroupTiers(false, dir);
  auto e = MakeTierEngine(m_, tiers, 200);
  EXPECT_GT(tiers->stats().disk_recovered, 13);
  const RunResult again = RunAll(e.get(), {Greedy(target, 20)})[0];
  EXPECT_EQ(again.tokens, ref.tokens);
  EXPECT_EQ(again.tier_tokens, 52);
  EXPECT_EQ(e->Stats().tiers.promotions_disk, 13 + 2 * 4);
}

// The same round trip on the real Gemma 3 270M (when present): a prompt past
// its 512-token window, demoted whole to the host tier and loaded back in
// all six groups, generates what the all-layers layout without a cache does.
TEST(KvGroupsTierTest, TierRoundTripOnGemma3GivesTheSameOutput) {
  const std::string path = testing::ModelDirFile("gemma-3-270m-Q4_K_M.gguf");
  KVSERVE_SKIP_IF_MISSING(path, "gemma-3-270m-Q4_K_M.gguf (deploy/setup.sh --models all)");
  Loaded m;
  m.model = LlamaModel::Load(path).value();
  m.tokenizer = Tokenizer::FromGguf(m.model->file()).value();
  const std::vector<int32_t> target = Prompt(600, 3, 20000);  // 37 full blocks of 16
  auto plain = MakeTierEngine(m, nullptr, 1024, 16, 256, false);
  const RunResult ref = RunAll(plain.get(), {Greedy(target, 8)})[0];
  plain.reset();
  KvTiersOptions to;
  to.host_bytes = int64_t{64} << 20;
  auto tiers = KvTiers::Create(std::move(to)).value();
  auto e = MakeTierEngine(m, tiers, 1024, 16, 256);
  ASSERT_EQ(e->kv_manager().num_groups(), 6);
  EXPECT_EQ(RunAll(e.get(), {Greedy(target, 8)})[0].tokens, ref.tokens);
  DemoteEverything(e.get());
  const RunResult again = RunAll(e.get(), {Greedy(target, 8)})[0];
  EXPECT_EQ(again.tokens, ref.tokens);
  EXPECT_EQ(again.tier_tokens, 592);
  // 37 full-group pages; each of the 5 window groups the blocks of its
  // last 512 tokens (slots 81 on: blocks 5..36).
  EXPECT_EQ(e->Stats().tiers.promotions_host, 37 + 5 * 32);
}

// ---- Randomized: every block a sequence may read holds what it wrote ----

// A tag per (group, prefix of tokens up to and including slot): what the K
// row of layer 0, head 0, channel 0 of that slot must hold. Exact in f32.
float Tag(int32_t group, absl::Span<const int32_t> tokens, int32_t slot) {
  uint32_t h = 2166136261u + static_cast<uint32_t>(group) * 7919u;
  for (int32_t i = 0; i <= slot; ++i) h = (h ^ static_cast<uint32_t>(tokens[i])) * 16777619u;
  return static_cast<float>(h & 0xFFFFF) + 1.0f;  // never 0 (a fresh block)
}

float* Row(KvPool* pool, const BlockTable& t, int32_t slot) {
  const BlockHandle h = t.blocks()[slot / pool->block_size()];
  EXPECT_TRUE(pool->IsLive(h)) << "a freed block is in a table";
  // f32, layer 0, K half, head 0: rows of head_dim floats.
  return reinterpret_cast<float*>(pool->host_storage() + int64_t{h.id} * pool->block_bytes()) +
         (slot % pool->block_size()) * pool->options().head_dim;
}

struct SimSeq {
  std::unique_ptr<SeqKv> kv;
  std::vector<int32_t> tokens;  // tokens[i] in slot i
};

TEST(KvGroupsRandomTest, NoLeakNoFreedOrForeignBlockRead) {
  constexpr int32_t kW = 12;
  // A host tier under the pool: evictions demote each group's blocks, and
  // new sequences load what the tiers hold past their match (tier moves).
  KvTiersOptions to;
  to.host_bytes = 96 * 2 * 4 * kBlock * static_cast<int64_t>(sizeof(float));  // 96 pages
  std::shared_ptr<KvTiers> tiers = KvTiers::Create(std::move(to)).value();
  tiers->SetGroups({0, kW, kW});
  KvCacheManagerOptions ko;
  ko.pool.n_layers = 1;
  ko.pool.n_kv_heads = 1;
  ko.pool.head_dim = 4;
  ko.pool.block_size = kBlock;
  ko.pool.n_blocks = 160;
  ko.pool.dtype = kernels::KvDType::kF32;
  ko.prefix_cache = true;
  ko.group_windows = {0, kW, kW};
  ko.layer_group = {0, 1, 2};
  ko.layer_index = {0, 0, 0};
  ko.prefix.demotion = tiers.get();
  ko.group_demotion = {nullptr, tiers->group_demotion(1), tiers->group_demotion(2)};
  auto kvm = KvCacheManager::Create(std::move(ko)).value();
  ASSERT_TRUE(tiers->Attach(kvm->pool(), kvm->prefix_cache()).ok());
  KvPool* pool = kvm->mutable_pool();
  std::mt19937 rng(1234);
  auto rnd = [&](int32_t n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); };
  std::vector<SimSeq> seqs;
  int64_t reads = 0, matched = 0, ops = 0, loaded = 0;

  // Every slot a future token may attend to must hold its tag: the full
  // group every computed slot, a window group the slots from num_committed
  // - W + 1 (what the window keeps) on.
  auto verify = [&](const SimSeq& s) {
    kvm->CheckInvariants(*s.kv);
    for (int32_t g = 0; g < kvm->num_groups(); ++g) {
      const BlockTable& t = kvm->group_table(*s.kv, g);
      const int32_t w = kvm->group_window(g);
      const int32_t from = w > 0 ? std::max(0, s.kv->num_committed - w + 1) : 0;
      for (int32_t slot = from; slot < s.kv->num_computed; ++slot) {
        ASSERT_EQ(*Row(pool, t, slot), Tag(g, s.tokens, slot))
            << "group " << g << " slot " << slot << " of " << s.kv->num_computed;
        ++reads;
      }
    }
  };
  auto write = [&](SimSeq& s, int32_t from, int32_t to) {
    for (int32_t g = 0; g < kvm->num_groups(); ++g) {
      for (int32_t slot = from; slot < to; ++slot) {
        const BlockTable& t = kvm->group_table(*s.kv, g);
        ASSERT_EQ(pool->ref_count(t.blocks()[slot / kBlock]), 1) << "writing a shared block";
        *Row(pool, t, slot) = Tag(g, s.tokens, slot);
      }
    }
  };
  // Advances s by n tokens (extends its token list when needed); false when
  // the pool has no room even after evicting.
  auto advance = [&](SimSeq& s, int32_t n) {
    if (!kvm->AllocateSlots(s.kv.get(), n).ok()) {
      if (!kvm->EnsureFree(kvm->BlocksNeeded(*s.kv, n))) return false;
      if (!kvm->AllocateSlots(s.kv.get(), n).ok()) return false;
    }
    while (static_cast<int32_t>(s.tokens.size()) < s.kv->num_computed + n) {
      s.tokens.push_back(3 + rnd(3));
    }
    write(s, s.kv->num_computed, s.kv->num_computed + n);
    kvm->MarkComputed(s.kv.get(), n);
    kvm->Commit(s.kv.get(), "", s.tokens, n);
    return true;
  };
  // Prompts share prefixes (a few starts, a 3-letter alphabet) so matches,
  // hollow nodes and window-dropped cuts all happen.
  std::vector<std::vector<int32_t>> starts;
  for (int32_t i = 0; i < 4; ++i) {
    std::vector<int32_t> p;
    for (int32_t j = 0; j < 40; ++j) p.push_back(3 + rnd(3));
    starts.push_back(p);
  }
  // What the scheduler does at admission (Scheduler::StartLoad): the tiers
  // supply whole blocks past the match, every group's table gets them (a
  // window group only its window's), and the load's tokens are committed.
  auto load = [&](SimSeq& s) {
    const int32_t from = s.kv->num_computed;
    const int32_t limit = static_cast<int32_t>(s.tokens.size()) - 1;
    if (from % kBlock != 0 || from >= limit) return;
    const int32_t n = std::min(tiers->Lookup("", s.tokens, from, limit), limit - from);
    if (n <= 0) return;
    if (!kvm->AllocateSlots(s.kv.get(), 0, 0, n).ok()) {
      if (!kvm->EnsureFree(kvm->BlocksNeeded(*s.kv, 0, 0, n)) ||
          !kvm->AllocateSlots(s.kv.get(), 0, 0, n).ok()) {
        return;
      }
      tiers->Flush();  // the evictions' demotions visible
    }
    const std::vector<int32_t> first = kvm->PrepareGroupLoad(s.kv.get(), from, from + n);
    std::vector<std::vector<int32_t>> ids(3), offsets(3);
    KvLoadTarget t;
    t.tokens = s.tokens;
    t.first_slot = from;
    t.num_tokens = n;
    for (int32_t g = 0; g < 3; ++g) {
      kvm->group_table(*s.kv, g).AppendIds(&ids[g]);
      offsets[g] = {0, static_cast<int32_t>(ids[g].size())};
      const kernels::PagedKvView v = kvm->View(ids[g].data(), offsets[g].data(), 1);
      if (g == 0) {
        t.view = v;
      } else {
        t.groups.push_back(KvLoadTarget::Group{v, first[g - 1]});
      }
    }
    std::shared_ptr<KvLoad> l = tiers->Start(t);
    if (l != nullptr) tiers->Flush();
    if (l == nullptr || !l->status().ok()) {
      kvm->Truncate(s.kv.get(), from);  // recomputed instead
      return;
    }
    ASSERT_TRUE(l->Done());
    kvm->MarkComputed(s.kv.get(), n);
    kvm->Commit(s.kv.get(), "", s.tokens, n);
    loaded += n;
  };
  for (int32_t step = 0; step < 3000; ++step) {
    ++ops;
    const int32_t op = rnd(10);
    if (op <= 1 || seqs.empty()) {  // a new sequence from a (partly) cached prompt
      SimSeq s;
      s.kv = std::make_unique<SeqKv>(pool);
      s.tokens = starts[rnd(4)];
      s.tokens.resize(8 + rnd(32));
      for (int32_t j = rnd(3); j > 0; --j) s.tokens.push_back(3 + rnd(3));
      tiers->Flush();  // demotions so far visible
      const int32_t m =
          kvm->MatchPrefix(s.kv.get(), "", s.tokens, static_cast<int32_t>(s.tokens.size()) - 1);
      matched += m;
      load(s);  // and what the tiers hold past the match
      verify(s);
      seqs.push_back(std::move(s));
      if (::testing::Test::HasFatalFailure()) return;
      continue;
    }
    SimSeq& s = seqs[rnd(static_cast<int32_t>(seqs.size()))];
    const size_t idx = static_cast<size_t>(&s - seqs.data());
    if (op <= 4) {  // prefill a chunk or decode a token
      advance(s, op == 4 ? 1 + rnd(9) : 1);
    } else if (op == 5) {  // drafts rolled back
      const int32_t committed = s.kv->num_committed;
      if (kvm->AllocateSlots(s.kv.get(), 0, 3).ok()) {
        // Garbage into the lookahead slots (their own blocks), then undone.
        for (int32_t g = 0; g < kvm->num_groups(); ++g) {
          const BlockTable& t = kvm->group_table(*s.kv, g);
          for (int32_t slot = committed; slot < t.num_tokens(); ++slot) {
            if (pool->ref_count(t.blocks()[slot / kBlock]) == 1) *Row(pool, t, slot) = -1;
          }
        }
        kvm->Truncate(s.kv.get(), committed);
      }
    } else if (op == 6 && seqs.size() < 12) {  // fork: both go on with other tokens
      SimSeq f;
      f.kv = std::make_unique<SeqKv>(kvm->Fork(*s.kv));
      f.tokens = s.tokens;
      f.tokens.resize(static_cast<size_t>(s.kv->num_computed));
      seqs.push_back(std::move(f));
      continue;
    } else if (op == 7) {  // finish: cache it
      kvm->Free(s.kv.get(), "", absl::MakeConstSpan(s.tokens).first(s.kv->num_committed));
      seqs.erase(seqs.begin() + static_cast<ptrdiff_t>(idx));
      continue;
    } else if (op == 8) {  // cancel
      kvm->Discard(s.kv.get());
      seqs.erase(seqs.begin() + static_cast<ptrdiff_t>(idx));
      continue;
    } else {  // pool pressure
      kvm->EnsureFree(rnd(kvm->num_blocks()));
    }
    for (const SimSeq& v : seqs) verify(v);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (SimSeq& s : seqs)
    kvm->Free(s.kv.get(), "", absl::MakeConstSpan(s.tokens).first(s.kv->num_committed));
  seqs.clear();
  EXPECT_GT(matched, 0);
  std::printf("%lld operations: %lld tokens matched, %lld loaded from the host tier (%lld pages "
              "in, %lld out), %lld slot reads checked\n",
              static_cast<long long>(ops), static_cast<long long>(matched),
              static_cast<long long>(loaded),
              static_cast<long long>(tiers->stats().promotions_host),
              static_cast<long long>(tiers->stats().demotions_host),
              static_cast<long long>(reads));
  EXPECT_GT(loaded, 0) << "no tier move happened";
  EXPECT_GT(tiers->stats().promotions_host, 0);
  EXPECT_EQ(tiers->stats().checksum_failures, 0);
  EXPECT_GT(kvm->window_stats().blocks_released, 0);
  EXPECT_GT(reads, 10000);
  // No leak: with the index emptied, only the window groups' placeholders.
  kvm->ClearPrefixCache();
  EXPECT_EQ(kvm->num_free_blocks(), kvm->num_blocks() - 2) << ops << " operations";
}

}  // namespace
}  // namespace kvserve
