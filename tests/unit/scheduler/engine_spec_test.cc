// Speculative decoding in the engine (scheduler/speculation.h) on the real
// stories260K model: greedy outputs (tokens, one event per token, text,
// finish, log-probabilities) are identical with speculation off, ngram
// (every proposal verified in full) and suffix (adaptive) for 120 prompts run
// together, with drafts actually accepted (so the test cannot pass
// vacuously); seeded sampled outputs are identical too (the verify path draws
// exactly as decoding does); the prefix cache ends up with exactly the
// blocks, byte for byte, of the run without speculation (a rejected draft
// token in a cached block would add a block no plain run has); outputs do
// not change under preemption; and after cancels mid-speculation every
// block is back in the pool.
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

struct Model {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

const Model* Load(const std::string& path) {
  if (path.empty()) return nullptr;
  auto* out = new Model;
  out->model = LlamaModel::Load(path).value();
  out->tokenizer = Tokenizer::FromGguf(out->model->file()).value();
  return out;
}

const Model* Stories() {
  static const Model* m = Load(testing::Stories260KPath());
  return m;
}

const Model* SmolLM2() {
  static const Model* m = Load(testing::SmolLM2Path());
  return m;
}

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

struct Output {
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> event_tokens;
  std::vector<float> logprobs;
  std::string text;
  FinishReason finish = FinishReason::kNone;
};

std::unique_ptr<Engine> MakeEngine(SpecMode mode, bool adaptive, int32_t num_blocks = 4096,
                                   int32_t max_k = 8, const Model* model = Stories()) {
  EngineOptions o;
  o.num_blocks = num_blocks;
  o.max_batched_tokens = 512;
  o.max_seqs = 64;
  o.speculation.mode = mode;
  o.speculation.adaptive = adaptive;
  o.speculation.max_k = max_k;
  o.speculation.ngram_min = 1;
  o.speculation.ngram_max = 3;
  auto e = Engine::Create(model->model.get(), model->tokenizer.get(), Pool(), o).value();
  e->Start();
  return e;
}

std::vector<std::string> Prompts() {
  const std::vector<std::string> starts = {
      "Once upon a time, there was a little girl named Lily. She liked to",
      "The cat sat on the mat. The cat sat on the mat. The cat",
      "Tom and Sue went to the park. Tom and Sue went to the",
      "One day, a big dog saw a ball. The dog",
      "Lily said, \"I want to play!\" Mom said, \"You can play.\" Lily said,",
      "There was a tree. The tree was big. The tree was",
      "Ben had a red car. He liked his red car. He",
      "The sun was hot. The bird was happy. The bird",
  };
  const std::vector<std::string> ends = {"", " and", " with her friend", " every day.",
                                         " so much", " in the garden", " but then",
                                         " because", " too", " again", " very", " "
                                         "happy", " said"};
  std::vector<std::string> out;
  for (const auto& s : starts) {
    for (const auto& e : ends) out.push_back(s + e);
  }
  out.resize(120);
  return out;
}

EngineRequest Request(const std::string& prompt, int32_t max_tokens,
                      const Model* model = Stories()) {
  EngineRequest r;
  r.prompt = model->tokenizer->Encode(prompt, true, false);
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.logprobs = true;
  return r;
}

// Submits every request at once (they batch together) and waits for all.
std::vector<Output> RunAll(Engine* e, std::vector<EngineRequest> reqs,
                           int32_t cancel_after = -1) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Output> out;
    std::map<uint64_t, size_t> index;
    int done = 0;
  } st;
  st.out.resize(reqs.size());
  std::unique_lock<std::mutex> lock(st.mu);
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto id = e->Submit(std::move(reqs[i]), [&st, e, cancel_after](const SeqEvent& ev) {
      std::lock_guard<std::mutex> l(st.mu);
      Output& o = st.out[st.index.at(ev.request_id)];
      o.tokens.insert(o.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
      if (!ev.token_ids.empty()) o.event_tokens.push_back(ev.token_ids);
      o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      o.text += ev.text;
      if (cancel_after >= 0 && static_cast<int32_t>(o.tokens.size()) == cancel_after) {
        e->Cancel(ev.request_id);
      }
      if (ev.finish != FinishReason::kNone) {
        o.finish = ev.finish;
        ++st.done;
        st.cv.notify_all();
      }
    });
    EXPECT_TRUE(id.ok()) << id.status();
    st.index[*id] = i;
  }
  st.cv.wait(lock, [&] { return st.done == static_cast<int>(reqs.size()); });
  return st.out;
}

void ExpectSame(const std::vector<Output>& got, const std::vector<Output>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << what << " prompt " << i;
    EXPECT_EQ(got[i].event_tokens, want[i].event_tokens) << what << " prompt " << i;
    EXPECT_EQ(got[i].text, want[i].text) << what << " prompt " << i;
    EXPECT_EQ(got[i].finish, want[i].finish) << what << " prompt " << i;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size()) << what << " prompt " << i;
    for (size_t j = 0; j < got[i].logprobs.size(); ++j) {
      EXPECT_NEAR(got[i].logprobs[j], want[i].logprobs[j], 1e-4) << what << " prompt " << i;
    }
  }
}

// hash -> (tokens, bytes) of every cached block. REQUIRES: the engine stopped.
std::map<uint64_t, std::pair<std::vector<int32_t>, std::string>> CachedBlocks(const Engine& e) {
  std::map<uint64_t, std::pair<std::vector<int32_t>, std::string>> out;
  for (const KvCacheEvent& ev : e.prefix_cache()->Dump()) out[ev.block_hash].first = ev.token_ids;
  e.prefix_cache()->ForEachFullBlock([&](const EvictedBlock& b) {
    out[b.hash].second.assign(reinterpret_cast<const char*>(b.data), static_cast<size_t>(b.bytes));
  });
  return out;
}

class EngineSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Stories() == nullptr) GTEST_SKIP() << "stories260K not found; skipping (see README)";
  }
};

TEST_F(EngineSpecTest, GreedyOutputsIdenticalOnAndOffAndDraftsAreAccepted) {
  std::vector<EngineRequest> reqs;
  for (const std::string& p : Prompts()) reqs.push_back(Request(p, 64));
  ASSERT_GE(reqs.size(), 100u);

  auto off = MakeEngine(SpecMode::kOff, true);
  const std::vector<Output> plain = RunAll(off.get(), reqs);
  EXPECT_EQ(off->Stats().speculation.proposed_tokens, 0);

  auto ngram = MakeEngine(SpecMode::kNgram, /*adaptive=*/false);
  ExpectSame(RunAll(ngram.get(), reqs), plain, "ngram");
  const SpeculationStats ns = ngram->Stats().speculation;
  EXPECT_GT(ns.accepted_tokens, 0) << "no draft was ever accepted: the comparison is vacuous";
  EXPECT_LT(ns.accepted_tokens, ns.proposed_tokens) << "no draft was ever rejected";
  EXPECT_GT(ns.accepted_by_position[1], 0);

  // Requests that turn it on themselves, against a server default of off:
  // suffix, run twice so the second pass drafts from the first's outputs.
  // (Not adaptive: on this tiny model a step's cost is nearly all per-token,
  // and the adaptive controller rightly drafts little; the test wants drafts.)
  auto suffix = MakeEngine(SpecMode::kOff, /*adaptive=*/false);
  std::vector<EngineRequest> sreqs = reqs;
  for (auto& r : sreqs) r.speculative = SpecMode::kSuffix;
  ExpectSame(RunAll(suffix.get(), sreqs), plain, "suffix, first pass");
  ExpectSame(RunAll(suffix.get(), sreqs), plain, "suffix, second pass");
  const SpeculationStats ss = suffix->Stats().speculation;
  EXPECT_GT(ss.accepted_by_source[static_cast<size_t>(DraftSource::kSuffix)], 0);
  EXPECT_GT(ss.suffix_index_tokens, 0);

  // The prefix cache holds the same blocks (hash = the whole prefix's
  // tokens): a rejected token committed anywhere would add a block the plain
  // run does not have. (Bytes: concurrent runs batch differently, and the
  // CPU kernels' bits depend on the batch; compared in the sequential test.)
  off->Stop();
  ngram->Stop();
  const auto want = CachedBlocks(*off);
  const auto got = CachedBlocks(*ngram);
  EXPECT_GT(want.size(), 100u);
  EXPECT_EQ(got.size(), want.size());
  for (const auto& [hash, block] : want) {
    auto it = got.find(hash);
    ASSERT_NE(it, got.end()) << "a block of the plain run is missing";
    EXPECT_EQ(it->second.first, block.first);
  }
  for (const auto& [hash, block] : got) {
    EXPECT_TRUE(want.count(hash)) << "the speculative run cached a block no plain run has";
  }
  // Every block is back (free, or cached and evictable).
  EXPECT_EQ(ngram->kv_pool().num_free_blocks() + ngram->prefix_cache()->num_evictable_blocks(),
            ngram->kv_pool().num_blocks());
}

// One request at a time (the same batches in both runs but for the draft
// rows): every committed block's KV bytes equal the plain run's.
// SmolLM2 (Q4_1: the quantized kernels give a token's row the same bits
// whatever its batch; stories260K's f32 path does not).
TEST_F(EngineSpecTest, CommittedKvBytesIdenticalToPlain) {
  const Model* m = SmolLM2();
  if (m == nullptr) GTEST_SKIP() << "SmolLM2 not found; skipping";
  auto off = MakeEngine(SpecMode::kOff, true, 512, 8, m);
  auto on = MakeEngine(SpecMode::kNgram, false, 512, 8, m);
  const auto prompts = Prompts();
  for (size_t i = 0; i < 6; ++i) {
    const std::vector<EngineRequest> one = {Request(prompts[i * 13 + 1], 40, m)};
    ExpectSame(RunAll(on.get(), one), RunAll(off.get(), one), "sequential");
  }
  EXPECT_GT(on->Stats().speculation.accepted_tokens, 0);
  off->Stop();
  on->Stop();
  const auto want = CachedBlocks(*off);
  const auto got = CachedBlocks(*on);
  EXPECT_GT(want.size(), 6u);
  EXPECT_EQ(got.size(), want.size());
  int differ = 0;
  for (const auto& [hash, block] : want) {
    auto it = got.find(hash);
    ASSERT_NE(it, got.end()) << "a block of the plain run is missing";
    differ += it->second.second != block.second;
  }
  EXPECT_EQ(differ, 0) << "blocks whose committed KV bytes differ from the plain run's";
}

TEST_F(EngineSpecTest, SeededSamplingIdenticalOnAndOff) {
  std::vector<EngineRequest> reqs;
  const auto prompts = Prompts();
  for (size_t i = 0; i < 24; ++i) {
    EngineRequest r = Request(prompts[i * 5], 48);
    r.params.temperature = 0.7f;
    r.params.top_p = 0.95f;
    r.params.has_seed = true;
    r.params.seed = 1000 + i;
    reqs.push_back(r);
  }
  auto off = MakeEngine(SpecMode::kOff, true);
  auto on = MakeEngine(SpecMode::kNgram, false);
  const auto plain = RunAll(off.get(), reqs);
  ExpectSame(RunAll(on.get(), reqs), plain, "seeded sampling");
  EXPECT_GT(on->Stats().speculation.accepted_tokens, 0);
}

TEST_F(EngineSpecTest, PreemptionKeepsOutputs) {
  // 24 blocks of 16 slots for 16 requests of ~20 + 64 tokens: preemptions.
  std::vector<EngineRequest> reqs;
  const auto prompts = Prompts();
  for (size_t i = 0; i < 16; ++i) reqs.push_back(Request(prompts[i * 7], 64));
  auto off = MakeEngine(SpecMode::kOff, true, 24);
  auto on = MakeEngine(SpecMode::kNgram, false, 24);
  const auto plain = RunAll(off.get(), reqs);
  ExpectSame(RunAll(on.get(), reqs), plain, "under preemption");
  EXPECT_GT(on->Stats().preemptions, 0);
  EXPECT_GT(on->Stats().speculation.accepted_tokens, 0);
  on->Stop();
  EXPECT_EQ(on->kv_pool().num_free_blocks() + on->prefix_cache()->num_evictable_blocks(),
            on->kv_pool().num_blocks());
}

TEST_F(EngineSpecTest, CancelsMidSpeculationLeaveThePoolAtBaseline) {
  auto e = MakeEngine(SpecMode::kNgram, /*adaptive=*/false, 512, 16);
  e->Stop();
  const int32_t baseline = e->kv_pool().num_free_blocks();
  ASSERT_EQ(baseline, e->kv_pool().num_blocks());
  e->Start();
  std::vector<EngineRequest> reqs;
  const auto prompts = Prompts();
  for (size_t i = 0; i < 40; ++i) {
    reqs.push_back(Request(prompts[i * 3], 90));  // the model's context is 128
    reqs.back().params.ignore_eos = true;
  }
  // Cancelled from the callback, i.e. while the step that emitted the token
  // is still verifying its draft; different cut points per run.
  for (int32_t cut : {3, 11, 29}) {
    const auto out = RunAll(e.get(), reqs, cut);
    for (const Output& o : out) EXPECT_EQ(o.finish, FinishReason::kCancelled);
  }
  EXPECT_GT(e->Stats().speculation.proposed_tokens, 0);
  EXPECT_EQ(e->ClearPrefixCache().get() >= 0, true);
  e->Stop();
  EXPECT_EQ(e->kv_pool().num_free_blocks(), baseline);
  EXPECT_EQ(e->prefix_cache()->num_cached_blocks(), 0);
}

TEST_F(EngineSpecTest, NoDraftsInStepsThatCarryPromptChunks) {
  // 120 requests through 64 slots: prompts keep arriving while others
  // decode. A step with prompt chunks is compute-bound, so drafts wait for
  // the next step without them (every proposal verified in full otherwise).
  std::atomic<int> mixed{0}, verify{0}, prompt{0};
  EngineOptions o;
  o.num_blocks = 4096;
  o.max_batched_tokens = 512;
  o.max_seqs = 64;
  o.speculation.mode = SpecMode::kNgram;
  o.speculation.adaptive = false;
  o.speculation.ngram_min = 1;
  o.speculation.ngram_max = 3;
  o.plan_observer = [&](const BatchPlan& plan) {
    bool has_prompt = false, has_verify = false;
    for (const ScheduledChunk& c : plan.chunks) {
      if (c.seq->num_speculative() > 0) {
        has_verify = true;
      } else if (c.prefill) {
        has_prompt = true;
      }
    }
    mixed += has_prompt && has_verify;
    verify += has_verify;
    prompt += has_prompt;
  };
  auto e = Engine::Create(Stories()->model.get(), Stories()->tokenizer.get(), Pool(), o).value();
  e->Start();
  std::vector<EngineRequest> reqs;
  for (const auto& p : Prompts()) reqs.push_back(Request(p, 48));
  RunAll(e.get(), reqs);
  e->Stop();
  EXPECT_EQ(mixed.load(), 0) << "steps with both prompt chunks and drafts";
  EXPECT_GT(verify.load(), 0);
  EXPECT_GT(prompt.load(), 1);
  EXPECT_GT(e->Stats().speculation.held_for_prompts, 0);
  EXPECT_GT(e->Stats().speculation.accepted_tokens, 0);
}

TEST_F(EngineSpecTest, RequestOverrideOffDisablesServerDefault) {
  auto e = MakeEngine(SpecMode::kNgram, false);
  std::vector<EngineRequest> reqs;
  const auto prompts = Prompts();
  for (size_t i = 0; i < 8; ++i) {
    reqs.push_back(Request(prompts[i * 13], 48));
    reqs.back().speculative = SpecMode::kOff;
  }
  RunAll(e.get(), reqs);
  EXPECT_EQ(e->Stats().speculation.proposed_tokens, 0);
}

}  // namespace
}  // namespace kvserve
