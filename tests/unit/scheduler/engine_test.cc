// The continuous-batching engine: concurrent requests produce exactly what
// they produce alone (also through preemption by recompute), n > 1 samples
// share the prompt's blocks, and cancellation/deadlines free every block.
#include "scheduler/engine.h"

#include <atomic>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

struct Model {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

Model Load(const std::string& path) {
  Model m;
  m.model = LlamaModel::Load(path).value();
  m.tokenizer = Tokenizer::FromGguf(m.model->file()).value();
  return m;
}

const Model& Tiny() {
  static const Model* m = [] {
    testing::TinyLlamaOptions o;
    o.context_length = 512;
    const std::string path = testing::TempDir() + "/engine-tiny.gguf";
    std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
    return new Model(Load(path));
  }();
  return *m;
}

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

std::pair<uint64_t, int> Key(uint64_t id, int index) { return {id, index}; }

// Collects events per (request, sample).
struct Collector {
  std::mutex mu;
  std::map<std::pair<uint64_t, int>, std::vector<int32_t>> tokens;
  std::map<std::pair<uint64_t, int>, std::string> text;
  std::map<std::pair<uint64_t, int>, FinishReason> finish;
  EventCallback Callback() {
    return [this](const SeqEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      auto key = std::make_pair(e.request_id, e.index);
      auto& t = tokens[key];
      t.insert(t.end(), e.token_ids.begin(), e.token_ids.end());
      text[key] += e.text;
      if (e.finish != FinishReason::kNone) finish[key] = e.finish;
    };
  }
};

EngineOptions Opts(int32_t num_blocks, int32_t budget = 512, int32_t max_seqs = 64,
                   kernels::KvDType kv_dtype = kernels::KvDType::kF16) {
  EngineOptions o;
  o.kv_dtype = kv_dtype;
  o.num_blocks = num_blocks;
  o.max_batched_tokens = budget;
  o.max_seqs = max_seqs;
  return o;
}

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  return p;
}

void RunToCompletion(Engine& e) {
  while (e.Step()) {
  }
}

// Blocks that are free or could be freed at once: what no running sequence
// holds. With the prefix cache on, finished sequences leave their full
// blocks cached (and evictable) instead of free, so a leak check counts both.
int32_t Reclaimable(const Engine& e) {
  return e.kv_pool().num_free_blocks() +
         (e.prefix_cache() ? e.prefix_cache()->num_evictable_blocks() : 0);
}

std::vector<std::vector<int32_t>> Prompts(const Tokenizer& tok, int count, uint32_t seed) {
  const std::string text =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends. One day, she saw a big red ball under a tree and ran to get it. "
      "Her mom said that they had to go home soon, so Lily played as fast as she could.";
  std::vector<int32_t> all = tok.Encode(text, tok.add_bos_default(), false);
  std::vector<std::vector<int32_t>> out;
  std::mt19937 rng(seed);
  for (int i = 0; i < count; ++i) {
    const size_t len = 1 + rng() % (all.size() - 1);
    const size_t start = tok.add_bos_default() ? 0 : rng() % (all.size() - len + 1);
    out.emplace_back(all.begin() + start, all.begin() + start + len);
  }
  return out;
}

// Every request alone, then all at once (optionally under memory pressure),
// expecting identical tokens.
void ExpectConcurrentEqualsAlone(const Model& m, int count, int max_tokens, int32_t pressure_blocks,
                                 bool expect_preemption,
                                 kernels::KvDType kv_dtype = kernels::KvDType::kF16) {
  const auto prompts = Prompts(*m.tokenizer, count, 7);
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts) {
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(),
                            Opts(256, 512, 64, kv_dtype))
                 .value();
    Collector c;
    auto id = e->Submit({p, Greedy(max_tokens)}, c.Callback());
    ASSERT_TRUE(id.ok()) << id.status();
    RunToCompletion(*e);
    alone.push_back(c.tokens[Key(*id, 0)]);
  }
  for (int32_t blocks : {1024, pressure_blocks}) {
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(),
                            Opts(blocks, 48, 64, kv_dtype))
                 .value();
    Collector c;
    std::vector<uint64_t> ids;
    for (const auto& p : prompts) ids.push_back(e->Submit({p, Greedy(max_tokens)}, c.Callback()).value());
    RunToCompletion(*e);
    for (int i = 0; i < count; ++i) {
      EXPECT_EQ(c.tokens[Key(ids[i], 0)], alone[i]) << "request " << i << " with " << blocks << " blocks";
      EXPECT_TRUE(c.finish.count(Key(ids[i], 0)));
    }
    const EngineStats st = e->Stats();
    if (blocks == pressure_blocks && expect_preemption) {
      EXPECT_GT(st.preemptions, 0);
    }
    EXPECT_EQ(Reclaimable(*e), blocks) << "blocks leaked";
    EXPECT_EQ(st.requests_finished, count);
  }
}

TEST(EngineTest, TinyModelConcurrentEqualsAloneAlsoUnderPreemption) {
  ExpectConcurrentEqualsAlone(Tiny(), 32, 20, /*pressure_blocks=*/24, /*expect_preemption=*/true);
}

// Quantized blocks are copied, shared and recomputed as bytes: preemption and
// prefix sharing must not change an int8 run's tokens either.
TEST(EngineTest, TinyModelInt8KvConcurrentEqualsAloneAlsoUnderPreemption) {
  ExpectConcurrentEqualsAlone(Tiny(), 32, 20, /*pressure_blocks=*/24, /*expect_preemption=*/true,
                              kernels::KvDType::kInt8);
}

TEST(EngineTest, Stories260KConcurrentEqualsAloneAlsoUnderPreemption) {
  const std::string path = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(path, "stories260K.gguf");
  static const Model m = Load(path);
  ExpectConcurrentEqualsAlone(m, 32, 24, /*pressure_blocks=*/20, /*expect_preemption=*/true);
}

TEST(EngineTest, SmolLM2ConcurrentEqualsAloneAlsoUnderPreemption) {
  const std::string path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(path, "SmolLM2 (run deploy/setup.sh)");
  static const Model m = Load(path);
  ExpectConcurrentEqualsAlone(m, 32, 8, /*pressure_blocks=*/10, /*expect_preemption=*/true);
}

TEST(EngineTest, ParallelSamplesShareThePromptBlocksAndAreReproducible) {
  const Model& m = Tiny();
  std::vector<int32_t> prompt = m.tokenizer->Encode("the quick brown fox jumps over the lazy dog again",
                                                    true, false);
  prompt.resize(21);  // 21 tokens: 5 full blocks of 4 and one partial
  SamplingParams p;
  p.temperature = 0.9f;
  p.seed = 42;
  p.has_seed = true;
  p.max_tokens = 6;
  p.ignore_eos = true;
  EngineOptions o = Opts(64);
  o.block_size = 4;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  Collector c;
  const uint64_t id = e->Submit({prompt, p, /*n=*/4}, c.Callback()).value();
  ASSERT_TRUE(e->Step());  // prefill + fork + first token of each sample
  EXPECT_EQ(e->kv_pool().num_blocks() - e->kv_pool().num_free_blocks(), 6)
      << "the four samples share the prompt's 6 blocks";
  ASSERT_TRUE(e->Step());  // first decode: the shared partial block is copied, 3 times
  EXPECT_EQ(e->kv_pool().num_blocks() - e->kv_pool().num_free_blocks(), 5 + 4);
  RunToCompletion(*e);
  EXPECT_EQ(Reclaimable(*e), 64);
  // Each sample equals a single-sample request seeded with seed + index.
  for (int i = 0; i < 4; ++i) {
    auto single = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
    Collector cs;
    SamplingParams ps = p;
    ps.seed = 42 + i;
    const uint64_t sid = single->Submit({prompt, ps}, cs.Callback()).value();
    RunToCompletion(*single);
    EXPECT_EQ(c.tokens[Key(id, i)], cs.tokens[Key(sid, 0)]) << "sample " << i;
    EXPECT_EQ(c.tokens[Key(id, i)].size(), 6u);
  }
  EXPECT_NE(c.tokens[Key(id, 0)], c.tokens[Key(id, 1)]);
}

TEST(EngineTest, CancelFreesEveryBlockAtOnce) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(64)).value();
  Collector c;
  SamplingParams p = Greedy(200);
  p.ignore_eos = true;
  const uint64_t a = e->Submit({Prompts(*m.tokenizer, 1, 3)[0], p}, c.Callback()).value();
  const uint64_t b = e->Submit({Prompts(*m.tokenizer, 1, 4)[0], p}, c.Callback()).value();
  for (int i = 0; i < 5; ++i) e->Step();
  EXPECT_LT(e->kv_pool().num_free_blocks(), 64);
  e->Cancel(a);
  e->Step();
  EXPECT_EQ(c.finish[Key(a, 0)], FinishReason::kCancelled);
  EXPECT_FALSE(c.finish.count(Key(b, 0))) << "the other request is undisturbed";
  e->Cancel(b);
  e->Step();
  EXPECT_EQ(Reclaimable(*e), 64);
  EXPECT_EQ(e->Stats().requests_cancelled, 2);
}

TEST(EngineTest, ExpiredDeadlineFinishesTheRequest) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(64)).value();
  Collector c;
  EngineRequest r{Prompts(*m.tokenizer, 1, 5)[0], Greedy(100)};
  r.params.ignore_eos = true;
  r.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  const uint64_t id = e->Submit(r, c.Callback()).value();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  RunToCompletion(*e);
  EXPECT_EQ(c.finish[Key(id, 0)], FinishReason::kDeadline);
  EXPECT_EQ(Reclaimable(*e), 64);
}

TEST(EngineTest, HigherPriorityIsAdmittedFirst) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(64, 512, 1)).value();
  std::vector<uint64_t> order;
  std::mutex mu;
  auto cb = [&](const SeqEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    if (ev.finish != FinishReason::kNone) order.push_back(ev.request_id);
  };
  EngineRequest low{Prompts(*m.tokenizer, 1, 1)[0], Greedy(3)};
  EngineRequest high = low;
  high.priority = 5;
  const uint64_t l = e->Submit(low, cb).value();
  const uint64_t h = e->Submit(high, cb).value();
  RunToCompletion(*e);
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], h);
  EXPECT_EQ(order[1], l);
}

TEST(EngineTest, StaticBatchingAdmitsNoOneUntilTheBatchFinishes) {
  const Model& m = Tiny();
  EngineOptions o = Opts(256, 512, 4);
  o.static_batching = true;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  SamplingParams p = Greedy(4);
  p.ignore_eos = true;
  SamplingParams longer = Greedy(12);
  longer.ignore_eos = true;
  const auto prompts = Prompts(*m.tokenizer, 6, 9);
  // Every event in arrival order: (request id, finished?).
  std::vector<std::pair<uint64_t, bool>> log;
  EventCallback cb = [&log](const SeqEvent& ev) {
    log.emplace_back(ev.request_id, ev.finish != FinishReason::kNone);
  };
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(e->Submit({prompts[i], i == 0 ? longer : p}, cb).value());
  bool saw_partial_batch = false;
  while (e->Step()) {
    const EngineStats st = e->Stats();
    if (st.running > 0 && st.running < 4) {
      saw_partial_batch = true;
      if (st.requests_finished < 4) {
        // The first batch shrinks to the long request; the last two wait.
        EXPECT_EQ(st.waiting, 2) << "a request joined a static batch that had not finished";
        EXPECT_EQ(st.running, 4 - st.requests_finished);
      } else {
        // The second batch is the last two, admitted together.
        EXPECT_EQ(st.waiting, 0);
        EXPECT_EQ(st.running, 6 - st.requests_finished);
      }
    }
  }
  EXPECT_TRUE(saw_partial_batch);
  EXPECT_EQ(e->Stats().requests_finished, 6);
  // No event of the second batch before the first batch's last finish.
  auto first_event = [&](uint64_t id) {
    return std::find_if(log.begin(), log.end(), [id](const auto& x) { return x.first == id; }) -
           log.begin();
  };
  auto finish_event = [&](uint64_t id) {
    return std::find(log.begin(), log.end(), std::make_pair(id, true)) - log.begin();
  };
  ptrdiff_t first_batch_done = 0;
  for (int i = 0; i < 4; ++i) first_batch_done = std::max(first_batch_done, finish_event(ids[i]));
  ASSERT_LT(first_batch_done, static_cast<ptrdiff_t>(log.size()));
  EXPECT_EQ(first_batch_done, finish_event(ids[0])) << "the long request ends the first batch";
  for (int i = 4; i < 6; ++i) {
    EXPECT_GT(first_event(ids[i]), first_batch_done) << "request " << i << " ran before the batch ended";
  }
}

TEST(EngineTest, InvalidRequestsAreRejectedWithTheField) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(64)).value();
  auto cb = [](const SeqEvent&) {};
  EXPECT_THAT(std::string(e->Submit({{}, Greedy(4)}, cb).status().message()), HasSubstr("prompt is empty"));
  EXPECT_THAT(std::string(e->Submit({{1, 99999}, Greedy(4)}, cb).status().message()), HasSubstr("outside the vocabulary"));
  EXPECT_THAT(std::string(e->Submit({{1, 5}, Greedy(4), 99}, cb).status().message()), HasSubstr("n must be between 1 and"));
  EXPECT_THAT(std::string(e->Submit({{1, 5}, Greedy(100000)}, cb).status().message()), HasSubstr("context length"));
  SamplingParams bad = Greedy(4);
  bad.top_p = 0;
  EXPECT_THAT(std::string(e->Submit({{1, 5}, bad}, cb).status().message()), HasSubstr("top_p"));
  EXPECT_FALSE(e->Step()) << "nothing was queued";
}

TEST(EngineTest, EngineThreadServesManySubmittingThreads) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(128, 64, 16)).value();
  e->Start();
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  auto cb = [&](const SeqEvent& ev) {
    if (ev.finish == FinishReason::kNone) return;
    std::lock_guard<std::mutex> lock(mu);
    ++done;
    cv.notify_all();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (const auto& p : Prompts(*m.tokenizer, 10, 100 + t)) ASSERT_TRUE(e->Submit({p, Greedy(6)}, cb).ok());
    });
  }
  for (auto& t : threads) t.join();
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return done == 40; }));
  lock.unlock();
  e->Stop();
  EXPECT_EQ(Reclaimable(*e), 128);
}

// ---- Prefix cache -------------------------------------------------------

// A shared prefix (a system prompt) followed by distinct questions, each at
// least a block long so every request fills the block that ends the prefix.
std::vector<std::vector<int32_t>> SharedPrefixPrompts(const Tokenizer& tok, int count,
                                                      size_t* prefix_len) {
  std::vector<int32_t> prefix = tok.Encode(
      "You are a helpful assistant. Answer briefly and kindly. Once upon a time there was a "
      "little girl named Lily who loved the park.",
      tok.add_bos_default(), false);
  *prefix_len = prefix.size();
  const char* questions[] = {"What did Lily see in the park that day?",
                             "Where does the little girl like to play?",
                             "Why did her mother call her home so soon?",
                             "How fast could Lily run to the big red ball?",
                             "Who were the friends that came to the park?",
                             "Tell me a story about a dog and a cat."};
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p = prefix;
    std::vector<int32_t> q = tok.Encode(questions[i % 6], false, false);
    // Distinct first tokens after the prefix: the match ends exactly there.
    q.insert(q.begin(), static_cast<int32_t>(10 + i));
    while (q.size() < 20) q.push_back(static_cast<int32_t>(20 + (q.size() * 7 + i) % 50));
    p.insert(p.end(), q.begin(), q.end());
    out.push_back(p);
  }
  return out;
}

struct PrefixRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int32_t> cached;  // cached_tokens each request reported
  EngineStats stats;
};

// The first request alone, then the rest together; greedy.
PrefixRun RunSharedPrefix(const Model& m, const std::vector<std::vector<int32_t>>& prompts,
                          bool prefix_cache, int max_tokens, kernels::KvDType kv_dtype) {
  EngineOptions o = Opts(512, 64, 64, kv_dtype);
  o.block_size = 8;
  o.prefix_cache = prefix_cache;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  std::mutex mu;
  std::map<uint64_t, int32_t> cached;
  Collector c;
  auto collect = c.Callback();
  auto cb = [&](const SeqEvent& ev) {
    collect(ev);
    std::lock_guard<std::mutex> lock(mu);
    cached[ev.request_id] = ev.cached_tokens;
  };
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams p = Greedy(max_tokens);
    p.ignore_eos = true;
    ids.push_back(e->Submit({prompts[i], p}, cb).value());
    if (i == 0) RunToCompletion(*e);
  }
  RunToCompletion(*e);
  PrefixRun r;
  for (uint64_t id : ids) {
    r.tokens.push_back(c.tokens[Key(id, 0)]);
    r.cached.push_back(cached[id]);
  }
  r.stats = e->Stats();
  EXPECT_EQ(Reclaimable(*e), 512) << "blocks leaked";
  if (prefix_cache) {
    auto cleared = e->ClearPrefixCache();
    e->Step();
    EXPECT_EQ(cleared.get(), r.stats.prefix_cached_blocks);
  }
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 512) << "blocks leaked";
  return r;
}

void ExpectPrefixCacheChangesNothingButWork(const Model& m, int max_tokens,
                                           kernels::KvDType kv_dtype = kernels::KvDType::kF16) {
  size_t prefix_len = 0;
  const auto prompts = SharedPrefixPrompts(*m.tokenizer, 6, &prefix_len);
  const PrefixRun off = RunSharedPrefix(m, prompts, false, max_tokens, kv_dtype);
  const PrefixRun on = RunSharedPrefix(m, prompts, true, max_tokens, kv_dtype);
  EXPECT_EQ(on.tokens, off.tokens) << "greedy output changed with the prefix cache";
  int64_t total = 0, suffixes = 0;
  for (const auto& p : prompts) {
    total += static_cast<int64_t>(p.size());
    suffixes += static_cast<int64_t>(p.size() - prefix_len);
  }
  EXPECT_EQ(off.stats.prompt_tokens_total, total);
  // The prefix is computed once, by the first request; the others compute
  // only their own questions (the block ending the prefix is shared partly,
  // by copy-on-write).
  EXPECT_EQ(on.stats.prompt_tokens_total, static_cast<int64_t>(prefix_len) + suffixes);
  EXPECT_EQ(on.cached[0], 0);
  for (size_t i = 1; i < prompts.size(); ++i) {
    EXPECT_EQ(on.cached[i], static_cast<int32_t>(prefix_len)) << "request " << i;
  }
  EXPECT_EQ(on.stats.prefix_queries, 6);
  EXPECT_EQ(on.stats.prefix_query_tokens, total);
  EXPECT_EQ(on.stats.prefix_hit_tokens, 5 * static_cast<int64_t>(prefix_len));
  EXPECT_FALSE(off.stats.prefix_cache_enabled);
  EXPECT_EQ(off.cached, std::vector<int32_t>(6, 0));
}

TEST(EnginePrefixCacheTest, TinyModelSameTokensPrefixComputedOnce) {
  ExpectPrefixCacheChangesNothingButWork(Tiny(), 12);
}

// Per-token codecs quantize each row on its own, so a shared (and partly
// copied) quantized block holds exactly the bytes recomputation would write.
// int4-kivi's per-channel key steps depend on how a block was written (all
// at once or token by token), so its shared blocks can differ from
// recomputed ones in the last bits; on this model the greedy tokens agree.
TEST(EnginePrefixCacheTest, TinyModelQuantizedBlocksAreSharedQuantized) {
  for (kernels::KvDType t : {kernels::KvDType::kInt8, kernels::KvDType::kFp8E4M3,
                             kernels::KvDType::kInt4, kernels::KvDType::kInt4Kivi}) {
    SCOPED_TRACE(std::string(kernels::KvDTypeName(t)));
    ExpectPrefixCacheChangesNothingButWork(Tiny(), 12, t);
  }
}

TEST(EnginePrefixCacheTest, Stories260KSameTokensPrefixComputedOnce) {
  const std::string path = testing::Stories260KPath();
  KVSERVE_SKIP_IF_MISSING(path, "stories260K.gguf");
  static const Model m = Load(path);
  ExpectPrefixCacheChangesNothingButWork(m, 16);
}

TEST(EnginePrefixCacheTest, SmolLM2SameTokensPrefixComputedOnce) {
  const std::string path = testing::SmolLM2Path();
  KVSERVE_SKIP_IF_MISSING(path, "SmolLM2 (run deploy/setup.sh)");
  static const Model m = Load(path);
  ExpectPrefixCacheChangesNothingButWork(m, 8);
}

// Runs one request to completion and returns the cached_tokens it reported.
int32_t CachedTokensOf(Engine& e, const std::vector<int32_t>& prompt, const std::string& salt) {
  int32_t cached = -1;
  EngineRequest r{prompt, Greedy(2)};
  r.cache_salt = salt;
  EXPECT_TRUE(e.Submit(r, [&](const SeqEvent& ev) { cached = ev.cached_tokens; }).ok());
  RunToCompletion(e);
  return cached;
}

// The next turn of a conversation starts with the whole previous one: it
// reuses the previous request's partly filled last block too.
TEST(EnginePrefixCacheTest, TheNextTurnReusesThePreviousTurnsPartialBlock) {
  const Model& m = Tiny();
  EngineOptions o = Opts(128);
  o.block_size = 4;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  std::vector<int32_t> turn1(10, 0);
  for (int i = 0; i < 10; ++i) turn1[i] = 5 + i;
  Collector c;
  SamplingParams p = Greedy(5);
  p.ignore_eos = true;
  const uint64_t id = e->Submit({turn1, p}, c.Callback()).value();
  RunToCompletion(*e);
  // 10 prompt tokens + 4 of the 5 generated ones have K/V: 3 full blocks
  // and 2 tokens in a fourth.
  std::vector<int32_t> turn2 = turn1;
  const auto& reply = c.tokens[Key(id, 0)];
  ASSERT_EQ(reply.size(), 5u);
  turn2.insert(turn2.end(), reply.begin(), reply.end());
  turn2.insert(turn2.end(), {30, 31, 32});
  EXPECT_EQ(CachedTokensOf(*e, turn2, ""), 14);
  EXPECT_EQ(Reclaimable(*e), 128);
}

TEST(EnginePrefixCacheTest, SaltsIsolateTenants) {
  const Model& m = Tiny();
  EngineOptions o = Opts(128);
  o.block_size = 4;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  std::vector<int32_t> prompt = Prompts(*m.tokenizer, 1, 11)[0];
  ASSERT_GE(prompt.size(), 17u);
  prompt.resize(17);  // 17 + 1 computed tokens fill 4 blocks: 16 cacheable
  EXPECT_EQ(CachedTokensOf(*e, prompt, "tenant-a"), 0);
  EXPECT_EQ(CachedTokensOf(*e, prompt, "tenant-b"), 0) << "another salt must not see a's blocks";
  EXPECT_EQ(CachedTokensOf(*e, prompt, ""), 0) << "nor the unsalted namespace";
  EXPECT_EQ(CachedTokensOf(*e, prompt, "tenant-a"), static_cast<int32_t>(prompt.size()) - 1);
  EXPECT_EQ(CachedTokensOf(*e, prompt, "tenant-b"), static_cast<int32_t>(prompt.size()) - 1);
}

TEST(EnginePrefixCacheTest, CachedBlocksAreEvictedBeforeAnyPreemption) {
  const Model& m = Tiny();
  EngineOptions o = Opts(24, 512, 8);
  o.block_size = 4;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  // Fill the cache with finished requests.
  for (int i = 0; i < 4; ++i) CachedTokensOf(*e, std::vector<int32_t>(13, 20 + i), "");
  ASSERT_GT(e->Stats().prefix_cached_blocks, 0);
  // Two long requests that need the whole pool between them.
  Collector c;
  SamplingParams p = Greedy(40);
  p.ignore_eos = true;
  std::vector<int32_t> a(7, 5), b(7, 9);
  ASSERT_TRUE(e->Submit({a, p}, c.Callback()).ok());
  ASSERT_TRUE(e->Submit({b, p}, c.Callback()).ok());
  RunToCompletion(*e);
  const EngineStats st = e->Stats();
  EXPECT_EQ(st.preemptions, 0) << "idle cached blocks must go first";
  EXPECT_GT(st.prefix_evicted_blocks, 0);
  EXPECT_EQ(Reclaimable(*e), 24);
}

TEST(EnginePrefixCacheTest, PreemptedSequenceResumesFromItsCachedBlocks) {
  const Model& m = Tiny();
  // Disjoint prompts, so only a sequence's own blocks can serve its recompute.
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(std::vector<int32_t>(12, 10 + i));
  int64_t computed[2];
  std::vector<std::vector<int32_t>> outputs[2];
  for (int on = 0; on < 2; ++on) {
    EngineOptions o = Opts(20, 48, 64);
    o.block_size = 4;
    o.prefix_cache = on == 1;
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
    Collector c;
    std::vector<uint64_t> ids;
    for (const auto& p : prompts) {
      SamplingParams sp = Greedy(16);
      sp.ignore_eos = true;
      ids.push_back(e->Submit({p, sp}, c.Callback()).value());
    }
    RunToCompletion(*e);
    EXPECT_GT(e->Stats().preemptions, 0);
    computed[on] = e->Stats().prompt_tokens_total;
    for (uint64_t id : ids) outputs[on].push_back(c.tokens[Key(id, 0)]);
    EXPECT_EQ(Reclaimable(*e), 20);
  }
  EXPECT_EQ(outputs[1], outputs[0]);
  EXPECT_LT(computed[1], computed[0]) << "recompute should reuse cached blocks";
}

TEST(EnginePrefixCacheTest, LongestPrefixMatchAdmitsTheCachedPromptFirst) {
  const Model& m = Tiny();
  std::vector<int32_t> cached_prompt(24, 7), other1(24, 8), other2(24, 9);
  cached_prompt.push_back(3);
  for (auto policy : {EngineOptions::SchedulePolicy::kFcfs, EngineOptions::SchedulePolicy::kLpm}) {
    EngineOptions o = Opts(128, 512, 1);
    o.block_size = 4;
    o.schedule_policy = policy;
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
    CachedTokensOf(*e, std::vector<int32_t>(cached_prompt.begin(), cached_prompt.end() - 1), "");
    std::vector<uint64_t> order;
    auto cb = [&](const SeqEvent& ev) {
      if (ev.finish != FinishReason::kNone) order.push_back(ev.request_id);
    };
    const uint64_t a = e->Submit({other1, Greedy(2)}, cb).value();
    const uint64_t b = e->Submit({other2, Greedy(2)}, cb).value();
    const uint64_t c = e->Submit({cached_prompt, Greedy(2)}, cb).value();
    RunToCompletion(*e);
    const std::vector<uint64_t> want =
        policy == EngineOptions::SchedulePolicy::kLpm ? std::vector<uint64_t>{c, a, b}
                                                      : std::vector<uint64_t>{a, b, c};
    EXPECT_EQ(order, want);
  }
  EXPECT_FALSE(ParseSchedulePolicy("random").ok());
}

TEST(EnginePrefixCacheTest, ClearDropsIdleBlocksButNotRunningOnes) {
  const Model& m = Tiny();
  EngineOptions o = Opts(64);
  o.block_size = 4;
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  const std::vector<int32_t> prompt(17, 6);
  CachedTokensOf(*e, prompt, "");
  Collector c;
  SamplingParams p = Greedy(30);
  p.ignore_eos = true;
  const uint64_t id = e->Submit({prompt, p}, c.Callback()).value();
  e->Step();
  auto cleared = e->ClearPrefixCache();
  e->Step();
  EXPECT_EQ(cleared.get(), 5) << "the four full prompt blocks and the first request's tail";
  EXPECT_EQ(e->Stats().prefix_cached_blocks, e->prefix_cache()->num_cached_blocks());
  RunToCompletion(*e);
  EXPECT_EQ(c.finish[Key(id, 0)], FinishReason::kLength);
  EXPECT_EQ(c.tokens[Key(id, 0)].size(), 30u);
  EXPECT_EQ(Reclaimable(*e), 64);

  EngineOptions off = o;
  off.prefix_cache = false;
  auto e2 = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), off).value();
  auto none = e2->ClearPrefixCache();
  e2->Step();
  EXPECT_EQ(none.get(), -1);
}

}  // namespace
}  // namespace kvserve
