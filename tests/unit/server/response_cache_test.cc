// The exact response cache: its key changes with every input that changes a
// reply (and only those), a salt cannot forge another tenant's scope, only
// completed deterministic replies are stored, the byte bound / LRU / TTL hold
// on a fake clock, and a hit replays the original stream chunk for chunk —
// in the cache alone and through ModelService over a real (tiny, written)
// model and engine.
#include "server/service/response_cache.h"

#include <atomic>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "grammar/structured_output.h"
#include "server/service/admission.h"
#include "server/service/model_service.h"
#include "server/service/semantic_cache.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

class FakeClock : public Clock {
 public:
  int64_t NowNanos() override { return now; }
  int64_t now = 1'000'000'000;
};

CacheIdentity Identity() { return {"model-abc", "kv=f16;block=16;device=cpu"}; }

EngineRequest BaseRequest() {
  EngineRequest r;
  r.prompt = {1, 5, 9, 12};
  r.params.temperature = 0;
  r.params.max_tokens = 8;
  return r;
}

// A compiled grammar as the key sees it (its key only).
class KeyOnlyGrammar : public CompiledGrammar {
 public:
  explicit KeyOnlyGrammar(std::string key) : CompiledGrammar(std::move(key)) {}
  std::unique_ptr<TokenConstraint> NewConstraint() const override { return nullptr; }
};

TEST(ResponseCacheKeyTest, EveryOutputRelevantInputChangesTheKey) {
  const std::string base = ResponseCacheKey(Identity(), "tenant-a", BaseRequest());
  EXPECT_EQ(base, ResponseCacheKey(Identity(), "tenant-a", BaseRequest())) << "not deterministic";
  EXPECT_EQ(base.size(), 64u);
  std::vector<std::pair<std::string, std::function<void(EngineRequest*)>>> changes = {
      {"prompt token (system prompt)", [](EngineRequest* r) { r->prompt[1] = 6; }},
      {"prompt length", [](EngineRequest* r) { r->prompt.push_back(3); }},
      {"temperature", [](EngineRequest* r) { r->params.temperature = 0.5f; }},
      {"top_k", [](EngineRequest* r) { r->params.top_k = 5; }},
      {"top_p", [](EngineRequest* r) { r->params.top_p = 0.9f; }},
      {"min_p", [](EngineRequest* r) { r->params.min_p = 0.1f; }},
      {"repetition_penalty", [](EngineRequest* r) { r->params.repetition_penalty = 1.1f; }},
      {"presence_penalty", [](EngineRequest* r) { r->params.presence_penalty = 0.5f; }},
      {"frequency_penalty", [](EngineRequest* r) { r->params.frequency_penalty = 0.5f; }},
      {"seed",
       [](EngineRequest* r) {
         r->params.has_seed = true;
         r->params.seed = 7;
       }},
      {"max_tokens", [](EngineRequest* r) { r->params.max_tokens = 9; }},
      {"stop string", [](EngineRequest* r) { r->params.stop = {"."}; }},
      {"stop token id", [](EngineRequest* r) { r->params.stop_token_ids = {13}; }},
      {"ignore_eos", [](EngineRequest* r) { r->params.ignore_eos = true; }},
      {"logprobs", [](EngineRequest* r) { r->params.logprobs = true; }},
      {"n", [](EngineRequest* r) { r->n = 2; }},
      {"kv_policy", [](EngineRequest* r) { r->kv_policy.kind = KvPolicy::Kind::kWindow; }},
      {"cache_salt", [](EngineRequest* r) { r->cache_salt = "x"; }},
      {"grammar",
       [](EngineRequest* r) { r->grammar = std::make_shared<KeyOnlyGrammar>("regex|1|3:a+b|0"); }},
      {"another grammar",
       [](EngineRequest* r) { r->grammar = std::make_shared<KeyOnlyGrammar>("regex|1|3:a+c|0"); }},
  };
  std::set<std::string> seen = {base};
  for (const auto& [what, change] : changes) {
    EngineRequest r = BaseRequest();
    change(&r);
    const std::string key = ResponseCacheKey(Identity(), "tenant-a", r);
    EXPECT_NE(key, base) << what << " does not change the key";
    EXPECT_TRUE(seen.insert(key).second) << what << " collides with another change";
  }
  // Two stop lists that concatenate alike.
  EngineRequest a = BaseRequest(), b = BaseRequest();
  a.params.stop = {"ab", "c"};
  b.params.stop = {"a", "bc"};
  EXPECT_NE(ResponseCacheKey(Identity(), "t", a), ResponseCacheKey(Identity(), "t", b));
  // Identity and tenant.
  CacheIdentity other_model = Identity();
  other_model.model_fingerprint = "model-abd";
  CacheIdentity other_kv = Identity();
  other_kv.numerics = "kv=q8_0;block=16;device=cpu";
  EXPECT_NE(ResponseCacheKey(other_model, "tenant-a", BaseRequest()), base) << "model file";
  EXPECT_NE(ResponseCacheKey(other_kv, "tenant-a", BaseRequest()), base) << "KV dtype";
  EXPECT_NE(ResponseCacheKey(Identity(), "tenant-b", BaseRequest()), base) << "tenant";
  EXPECT_NE(ResponseCacheKey(Identity(), "", BaseRequest()), base) << "no tenant";
}

TEST(ResponseCacheKeyTest, WhenAndHowUrgentDoNotChangeTheKey) {
  const std::string base = ResponseCacheKey(Identity(), "t", BaseRequest());
  EngineRequest r = BaseRequest();
  r.priority = 5;
  r.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  EXPECT_EQ(ResponseCacheKey(Identity(), "t", r), base);
}

TEST(ResponseCacheKeyTest, ASaltCannotForgeAnotherTenantsScope) {
  EngineRequest a = BaseRequest(), b = BaseRequest();
  a.cache_salt = "bx";
  b.cache_salt = "x";
  EXPECT_NE(ResponseCacheKey(Identity(), "a", a), ResponseCacheKey(Identity(), "ab", b));
  EXPECT_NE(ResponseCacheScope(Identity(), "a", "bx"), ResponseCacheScope(Identity(), "ab", "x"));
  // The tenant is a digest of the key, never the key.
  EXPECT_EQ(TenantFromApiKey(""), "");
  EXPECT_THAT(TenantFromApiKey("secret"), ::testing::Not(::testing::HasSubstr("secret")));
  EXPECT_NE(TenantFromApiKey("secret"), TenantFromApiKey("secret2"));
}

TEST(ResponseCacheKeyTest, ModelFingerprintSeesOneChangedByte) {
  const std::string dir = testing::TempDir();
  std::string bytes(3 << 20, 'w');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 2654435761u >> 24);
  const std::string a = dir + "/fp-a.bin", b = dir + "/fp-b.bin";
  std::ofstream(a, std::ios::binary) << bytes;
  bytes[bytes.size() / 2 + 17] ^= 1;
  std::ofstream(b, std::ios::binary) << bytes;
  EXPECT_EQ(ModelFingerprint(a).value(), ModelFingerprint(a).value());
  EXPECT_NE(ModelFingerprint(a).value(), ModelFingerprint(b).value());
  // The sampled digest of big files: a change in the head is seen.
  std::string c = bytes;
  c[100] ^= 1;
  const std::string cp = dir + "/fp-c.bin";
  std::ofstream(cp, std::ios::binary) << c;
  EXPECT_NE(ModelFingerprint(b, 1 << 20).value(), ModelFingerprint(cp, 1 << 20).value());
  EXPECT_FALSE(ModelFingerprint(dir + "/no-such-model.gguf").ok());
}

TEST(ResponseCachePolicyTest, OnlyDeterministicRequestsAreCacheable) {
  EngineRequest r = BaseRequest();
  EXPECT_TRUE(CacheableRequest(r));
  r.params.temperature = 0.8f;
  EXPECT_FALSE(CacheableRequest(r)) << "sampled without a seed";
  r.params.has_seed = true;
  r.params.seed = 3;
  EXPECT_TRUE(CacheableRequest(r));
}

TEST(ResponseCachePolicyTest, OnlyCompletedRepliesAreStorable) {
  CompletedResponse ok;
  ok.samples.resize(2);
  ok.samples[0].finish = FinishReason::kStop;
  ok.samples[1].finish = FinishReason::kLength;
  EXPECT_TRUE(StorableResponse(ok));
  for (FinishReason bad :
       {FinishReason::kCancelled, FinishReason::kDeadline, FinishReason::kNone}) {
    CompletedResponse r = ok;
    r.samples[1].finish = bad;
    if (bad != FinishReason::kNone) r.abort_reason = bad;
    EXPECT_FALSE(StorableResponse(r)) << FinishReasonName(bad);
  }
  EXPECT_FALSE(StorableResponse(CompletedResponse{}));
}

TEST(ResponseCachePolicyTest, RepliesOnLossyReencodedKvAreNotStorable) {
  CompletedResponse ok;
  ok.samples.resize(1);
  ok.samples[0].finish = FinishReason::kStop;
  ASSERT_TRUE(StorableResponse(ok));
  CompletedResponse lossy_prompt = ok;
  lossy_prompt.cached_lossy_tokens = 16;  // prompt K/V from a re-encoded tier page
  EXPECT_FALSE(StorableResponse(lossy_prompt));
  CompletedResponse lossy_run = ok;
  lossy_run.lossy_kv = true;  // e.g. its own blocks came back lossy after a preemption
  EXPECT_FALSE(StorableResponse(lossy_run));
}

TEST(ResponseCachePolicyTest, TheAccumulatorCarriesTheLossyMark) {
  ResponseAccumulator acc(1, 10);
  SeqEvent ev;
  ev.index = 0;
  ev.cached_tokens = 8;
  ev.cached_lossy_tokens = 8;
  ev.lossy_kv = true;
  ev.finish = FinishReason::kStop;
  ASSERT_TRUE(acc.Add(ev));
  const CompletedResponse r = acc.Take();
  EXPECT_EQ(r.cached_lossy_tokens, 8);
  EXPECT_TRUE(r.lossy_kv);
  EXPECT_FALSE(StorableResponse(r));
}

std::shared_ptr<CachedReply> Reply(const std::string& text, const std::string& tenant = "t",
                                   const std::string& scope = "s") {
  auto r = std::make_shared<CachedReply>();
  r->response.samples.resize(1);
  r->response.samples[0].text = text;
  r->response.samples[0].finish = FinishReason::kStop;
  r->tenant = tenant;
  r->scope = scope;
  return r;
}

TEST(ResponseCacheTest, HitsMissesAndStats) {
  ResponseCache cache({1 << 20, 0, nullptr});
  EXPECT_EQ(cache.Lookup("k"), nullptr);
  ASSERT_TRUE(cache.Insert("k", Reply("hello")));
  auto hit = cache.Lookup("k");
  ASSERT_NE(hit, nullptr);
  EXPECT_EQ(hit->response.samples[0].text, "hello");
  const ResponseCacheStats s = cache.Stats();
  EXPECT_EQ(s.lookups, 2);
  EXPECT_EQ(s.misses, 1);
  EXPECT_EQ(s.hits_exact, 1);
  EXPECT_EQ(s.stores, 1);
  EXPECT_EQ(s.entries, 1);
  EXPECT_GT(s.bytes, 5);
  std::string metrics;
  cache.RenderMetrics("model_name=\"m\"", &metrics);
  EXPECT_THAT(metrics, ::testing::HasSubstr(
                           "kvserve:response_cache_hits_total{model_name=\"m\",kind=\"exact\"} 1"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("kvserve:response_cache_entries{model_name=\"m\"} 1"));
}

TEST(ResponseCacheTest, DisabledStoresNothing) {
  ResponseCache cache({0, 0, nullptr});
  EXPECT_FALSE(cache.enabled());
  EXPECT_FALSE(cache.Insert("k", Reply("x")));
  EXPECT_EQ(cache.Lookup("k"), nullptr);
}

TEST(ResponseCacheTest, LeastRecentlyUsedGoesFirstWithinTheByteBound) {
  const int64_t one = static_cast<int64_t>(Reply(std::string(1000, 'a'))->ApproximateBytes() + 1);
  // Room for nine entries (each just under an eighth of the bound).
  ResponseCache big({one * 9, 0, nullptr});
  for (const char* k : {"a", "b", "c", "d"})
    ASSERT_TRUE(big.Insert(k, Reply(std::string(1000, *k))));
  ASSERT_NE(big.Lookup("a"), nullptr);  // a is now the most recent
  for (const char* k : {"e", "f", "g", "h", "i", "j"}) {
    ASSERT_TRUE(big.Insert(k, Reply(std::string(1000, *k))));
  }
  const ResponseCacheStats s = big.Stats();
  EXPECT_LE(s.bytes, one * 9);
  EXPECT_EQ(s.entries + s.evictions, 10);
  EXPECT_GT(s.evictions, 0);
  EXPECT_EQ(big.Peek("b"), nullptr) << "b was the least recently used";
  EXPECT_NE(big.Peek("a"), nullptr) << "a was touched, so c and d go before it";
  EXPECT_NE(big.Peek("j"), nullptr);
}

TEST(ResponseCacheTest, OneHugeReplyIsRefused) {
  ResponseCache cache({8000, 0, nullptr});
  EXPECT_FALSE(cache.Insert("k", Reply(std::string(2000, 'x'))));
  EXPECT_TRUE(cache.Insert("k", Reply("small")));
  EXPECT_EQ(cache.Stats().store_rejected, 1);
}

TEST(ResponseCacheTest, EntriesExpireAfterTheTtl) {
  FakeClock clock;
  ResponseCache cache({1 << 20, 10'000'000'000 /* 10 s */, &clock});
  ASSERT_TRUE(cache.Insert("k", Reply("x")));
  clock.now += 9'999'999'999;
  EXPECT_NE(cache.Lookup("k"), nullptr);
  clock.now += 1;
  EXPECT_EQ(cache.Lookup("k"), nullptr);
  EXPECT_EQ(cache.Stats().expirations, 1);
  EXPECT_EQ(cache.Stats().entries, 0);
  // A hit does not renew the entry: the TTL counts from the store.
  ASSERT_TRUE(cache.Insert("k2", Reply("y")));
  clock.now += 6'000'000'000;
  EXPECT_NE(cache.Lookup("k2"), nullptr);
  clock.now += 6'000'000'000;
  EXPECT_EQ(cache.Lookup("k2"), nullptr);
}

TEST(ResponseCacheTest, PurgeByTenantScopeOrAll) {
  ResponseCache cache({1 << 20, 0, nullptr});
  ASSERT_TRUE(cache.Insert("1", Reply("x", "alice", "alice-s1")));
  ASSERT_TRUE(cache.Insert("2", Reply("x", "alice", "alice-s2")));
  ASSERT_TRUE(cache.Insert("3", Reply("x", "bob", "bob-s1")));
  EXPECT_EQ(cache.Purge(std::nullopt, std::string("alice-s2")), 1);
  EXPECT_EQ(cache.Purge(std::string("alice")), 1);
  EXPECT_NE(cache.Peek("3"), nullptr) << "another tenant's entry went too";
  EXPECT_EQ(cache.Purge(), 1);
  EXPECT_EQ(cache.Stats().entries, 0);
  EXPECT_EQ(cache.Stats().purged, 3);
}

TEST(ResponseCacheTest, ConcurrentUseKeepsTheBound) {
  ResponseCache cache({40'000, 0, nullptr});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      for (int i = 0; i < 500; ++i) {
        const std::string key = std::to_string((i * 7 + t) % 97);
        if (i % 3 == 0) {
          cache.Insert(key, Reply(std::string(100 + i % 50, 'z')));
        } else {
          cache.Lookup(key);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const ResponseCacheStats s = cache.Stats();
  EXPECT_LE(s.bytes, 40'000);
  EXPECT_EQ(s.lookups, s.hits_exact + s.misses);
}

TEST(ReplyRecorderTest, ReplayReproducesTheStream) {
  ReplyRecorder rec(2, 4);
  std::vector<SeqEvent> events;
  auto ev = [&](int index, std::vector<int32_t> toks, std::string text, FinishReason f,
                int32_t completion) {
    SeqEvent e;
    e.request_id = 77;
    e.index = index;
    e.token_ids = std::move(toks);
    e.logprobs.assign(e.token_ids.size(), -0.5f);
    e.text = std::move(text);
    e.finish = f;
    e.prompt_tokens = 4;
    e.completion_tokens = completion;
    events.push_back(e);
  };
  ev(0, {10}, "He", FinishReason::kNone, 1);
  ev(1, {11}, "", FinishReason::kNone, 1);  // a token whose text is held back
  ev(0, {12}, "llo", FinishReason::kNone, 2);
  ev(1, {13}, "W\xC3\xB6", FinishReason::kNone, 2);
  ev(0, {}, " tail", FinishReason::kNone, 2);  // released at the finish
  ev(0, {}, "", FinishReason::kStop, 2);
  ev(1, {}, "", FinishReason::kLength, 2);
  bool done = false;
  for (const SeqEvent& e : events) done = rec.Add(e);
  ASSERT_TRUE(done);
  const CachedReply reply = rec.Take();
  ASSERT_TRUE(StorableResponse(reply.response));
  const std::vector<SeqEvent> replay = reply.Replay(99);
  // Per sample, the same chunks in the same order, then the finish.
  for (int index : {0, 1}) {
    std::vector<std::pair<std::vector<int32_t>, std::string>> want, got;
    FinishReason want_finish = FinishReason::kNone, got_finish = FinishReason::kNone;
    for (const SeqEvent& e : events) {
      if (e.index != index) continue;
      if (e.finish != FinishReason::kNone) want_finish = e.finish;
      if (!e.token_ids.empty() || !e.text.empty()) want.push_back({e.token_ids, e.text});
    }
    for (const SeqEvent& e : replay) {
      if (e.index != index) continue;
      EXPECT_EQ(e.request_id, 99u);
      EXPECT_EQ(e.logprobs.size(), e.token_ids.size());
      if (e.finish != FinishReason::kNone) got_finish = e.finish;
      if (!e.token_ids.empty() || !e.text.empty()) got.push_back({e.token_ids, e.text});
    }
    EXPECT_EQ(got, want) << "sample " << index;
    EXPECT_EQ(got_finish, want_finish) << "sample " << index;
  }
  EXPECT_EQ(replay.back().completion_tokens, 2);
}

// ---------------------------------------------------------------------------
// Through ModelService, over a written tiny model and a real engine.

struct Served {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<ResponseCache> cache;
  std::unique_ptr<ModelService> service;
  ~Served() {
    // The engine thread calls into the service's callbacks: stop it first.
    if (engine) engine->Stop();
    service.reset();
  }
};

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

std::unique_ptr<Served> Serve(int64_t cache_bytes) {
  static const std::string path = [] {
    testing::TinyLlamaOptions o;
    o.context_length = 512;
    const std::string p = testing::TempDir() + "/response-cache-tiny.gguf";
    std::ofstream(p, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
    return p;
  }();
  auto s = std::make_unique<Served>();
  s->model = LlamaModel::Load(path).value();
  s->tokenizer = Tokenizer::FromGguf(s->model->file()).value();
  EngineOptions o;
  o.num_blocks = 256;
  s->engine = Engine::Create(s->model.get(), s->tokenizer.get(), Pool(), o).value();
  s->metrics = std::make_unique<Metrics>("tiny");
  s->service =
      std::make_unique<ModelService>("tiny", s->model.get(), s->tokenizer.get(), std::nullopt,
                                     s->engine.get(), ServiceLimits{}, s->metrics.get());
  s->cache = std::make_unique<ResponseCache>(ResponseCacheOptions{cache_bytes, 0, nullptr});
  s->service->EnableResponseCache(s->cache.get(),
                                  {ModelFingerprint(path).value(), "kv=f16;block=16;device=cpu"});
  s->engine->Start();
  return s;
}

struct RunResult {
  CacheOutcome outcome;
  std::vector<SeqEvent> events;
  uint64_t id = 0;
};

// Runs to the end (or cancels after the first token when `cancel`).
RunResult RunPrepared(ModelService* service, PreparedRequest prepared, bool cancel = false) {
  RunResult out;
  const int32_t n = prepared.engine.n;
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<SeqEvent> events;
    int finished = 0;
  };
  auto st = std::make_shared<State>();
  absl::StatusOr<uint64_t> id = service->Start(
      std::move(prepared),
      [st](const SeqEvent& ev) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->events.push_back(ev);
        if (ev.finish != FinishReason::kNone) ++st->finished;
        st->cv.notify_all();
      },
      &out.outcome);
  EXPECT_TRUE(id.ok()) << id.status();
  out.id = *id;
  std::unique_lock<std::mutex> lock(st->mu);
  if (cancel) {
    st->cv.wait(lock, [&] { return !st->events.empty(); });
    service->Cancel(*id);
  }
  st->cv.wait(lock, [&] { return st->finished == n; });
  out.events = st->events;
  return out;
}

RunResult RunRequest(ModelService* service, const CompletionParams& p, bool cancel = false) {
  return RunPrepared(service, service->Prepare(p).value(), cancel);
}

std::string TextOf(const RunResult& r) {
  std::string t;
  for (const SeqEvent& e : r.events) t += e.text;
  return t;
}

CompletionParams Greedy(int32_t max_tokens = 12) {
  CompletionParams p;
  p.prompt_ids = std::vector<int32_t>{1, 20, 30, 40, 50};
  p.max_tokens = max_tokens;
  p.temperature = 0;
  p.ignore_eos = true;
  return p;
}

TEST(ModelServiceCacheTest, SecondIdenticalGreedyRequestIsAnExactReplay) {
  auto s = Serve(1 << 20);
  const RunResult first = RunRequest(s->service.get(), Greedy());
  EXPECT_EQ(first.outcome.kind, CacheHitKind::kMiss);
  const RunResult second = RunRequest(s->service.get(), Greedy());
  EXPECT_EQ(second.outcome.kind, CacheHitKind::kExact);
  EXPECT_EQ(TextOf(second), TextOf(first));
  ASSERT_EQ(second.events.size(), first.events.size()) << "chunking differs";
  for (size_t i = 0; i < first.events.size(); ++i) {
    EXPECT_EQ(second.events[i].token_ids, first.events[i].token_ids) << i;
    EXPECT_EQ(second.events[i].text, first.events[i].text) << i;
    EXPECT_EQ(second.events[i].finish, first.events[i].finish) << i;
  }
  EXPECT_NE(second.id, first.id);
  // Another tenant, another salt or another sampling parameter: computed.
  CompletionParams other = Greedy();
  other.tenant = "key:other";
  EXPECT_EQ(RunRequest(s->service.get(), other).outcome.kind, CacheHitKind::kMiss);
  other = Greedy();
  other.cache_salt = "salt";
  EXPECT_EQ(RunRequest(s->service.get(), other).outcome.kind, CacheHitKind::kMiss);
  other = Greedy();
  other.stop = {"zz"};
  EXPECT_EQ(RunRequest(s->service.get(), other).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(s->cache->Stats().hits_exact, 1);
}

TEST(ModelServiceCacheTest, LookupAndStoreCanBeTurnedOffPerRequest) {
  auto s = Serve(1 << 20);
  CompletionParams no_store = Greedy();
  no_store.response_cache.store = false;
  EXPECT_EQ(RunRequest(s->service.get(), no_store).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(s->cache->Stats().entries, 0) << "stored despite store=false";
  RunRequest(s->service.get(), Greedy());
  CompletionParams bypass = Greedy();
  bypass.response_cache.lookup = false;
  EXPECT_EQ(RunRequest(s->service.get(), bypass).outcome.kind, CacheHitKind::kBypass);
  EXPECT_EQ(RunRequest(s->service.get(), Greedy()).outcome.kind, CacheHitKind::kExact);
}

TEST(ModelServiceCacheTest, UnseededSampledRequestsAreNeverStored) {
  auto s = Serve(1 << 20);
  CompletionParams sampled = Greedy();
  sampled.temperature = 0.9f;
  EXPECT_EQ(RunRequest(s->service.get(), sampled).outcome.kind, CacheHitKind::kBypass);
  EXPECT_EQ(RunRequest(s->service.get(), sampled).outcome.kind, CacheHitKind::kBypass);
  EXPECT_EQ(s->cache->Stats().entries, 0);
  EXPECT_EQ(s->cache->Stats().stores, 0);
  // With a seed it is deterministic, so cached.
  sampled.seed = 42;
  const RunResult a = RunRequest(s->service.get(), sampled);
  const RunResult b = RunRequest(s->service.get(), sampled);
  EXPECT_EQ(a.outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(b.outcome.kind, CacheHitKind::kExact);
  EXPECT_EQ(TextOf(a), TextOf(b));
}

TEST(ModelServiceCacheTest, CancelledRequestsAreNeverStored) {
  auto s = Serve(1 << 20);
  CompletionParams p = Greedy(400);
  const RunResult cancelled = RunRequest(s->service.get(), p, /*cancel=*/true);
  EXPECT_EQ(cancelled.events.back().finish, FinishReason::kCancelled);
  EXPECT_EQ(s->cache->Stats().entries, 0);
  EXPECT_EQ(RunRequest(s->service.get(), p).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(s->cache->Stats().entries, 1);
}

TEST(ModelServiceCacheTest, DeadlineCutsAreNeverStored) {
  auto s = Serve(1 << 20);
  PreparedRequest prepared = s->service->Prepare(Greedy(400)).value();
  prepared.engine.deadline = std::chrono::steady_clock::now();  // already past
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  ASSERT_TRUE(s->service
                  ->Start(std::move(prepared),
                          [&](const SeqEvent& ev) {
                            if (ev.finish == FinishReason::kNone) return;
                            std::lock_guard<std::mutex> lock(mu);
                            finished = true;
                            reason = ev.finish;
                            cv.notify_all();
                          })
                  .ok());
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
  EXPECT_EQ(reason, FinishReason::kDeadline);
  EXPECT_EQ(s->cache->Stats().entries, 0);
}

TEST(ModelServiceCacheTest, ErrorsAreNeverStored) {
  auto s = Serve(1 << 20);
  CompletionParams bad = Greedy();
  bad.prompt_ids = std::vector<int32_t>{1, 1 << 20};  // outside the vocabulary
  EXPECT_FALSE(s->service->Prepare(bad).ok());
  EXPECT_EQ(s->cache->Stats().entries, 0);
  EXPECT_EQ(s->cache->Stats().stores, 0);
}

TEST(ModelServiceCacheTest, PurgeDropsTheTenantsEntries) {
  auto s = Serve(1 << 20);
  CompletionParams alice = Greedy();
  alice.tenant = "alice";
  CompletionParams bob = Greedy();
  bob.tenant = "bob";
  RunRequest(s->service.get(), alice);
  RunRequest(s->service.get(), bob);
  EXPECT_EQ(s->service->PurgeResponseCache(std::string("alice"), std::nullopt).value(), 1);
  EXPECT_EQ(RunRequest(s->service.get(), alice).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(RunRequest(s->service.get(), bob).outcome.kind, CacheHitKind::kExact);
  EXPECT_EQ(s->service->PurgeResponseCache(std::nullopt, std::nullopt).value(), 2);
}

// ---------------------------------------------------------------------------
// Admission (server/service/admission.h): the scopes come from the caller.

TEST(AdmissionTest, ScopeComesFromTheCallerNeverFromTheBody) {
  CompletionParams p = Greedy();
  p.tenant = "tenant:bob";  // what a forged request would carry
  p.cache_tenant = "bob";
  ScopeToCaller(CallerAuth{false, "alice"}, "key:operator", &p);
  EXPECT_EQ(p.tenant, "tenant:alice");
  EXPECT_EQ(p.cache_tenant, "alice");
  ScopeToCaller(CallerAuth{true, ""}, "key:operator", &p);
  EXPECT_EQ(p.tenant, "key:operator");
  EXPECT_EQ(p.cache_tenant, "");
}

TEST(AdmissionTest, TenantsShareNeitherCachedRepliesNorPrefixScopes) {
  auto s = Serve(1 << 20);
  const Admission admission(s->service.get(), "operator-key");
  const CallerAuth alice{false, "alice"};
  const CallerAuth bob{false, "bob"};
  const CallerAuth op;
  auto prepare = [&](const CallerAuth& who) { return admission.Prepare(Greedy(), who).value(); };
  PreparedRequest a = prepare(alice);
  PreparedRequest b = prepare(bob);
  EXPECT_NE(a.engine.cache_salt, b.engine.cache_salt);
  EXPECT_NE(a.engine.cache_salt, prepare(op).engine.cache_salt);
  ModelService* svc = s->service.get();
  EXPECT_EQ(RunPrepared(svc, std::move(a)).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(RunPrepared(svc, prepare(alice)).outcome.kind, CacheHitKind::kExact);
  EXPECT_EQ(RunPrepared(svc, std::move(b)).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(RunPrepared(svc, prepare(op)).outcome.kind, CacheHitKind::kMiss);
  EXPECT_EQ(RunPrepared(svc, prepare(op)).outcome.kind, CacheHitKind::kExact);
  // Another operator key is another response-cache scope.
  const Admission other(s->service.get(), "another-operator-key");
  EXPECT_EQ(RunPrepared(svc, other.Prepare(Greedy(), op).value()).outcome.kind,
            CacheHitKind::kMiss);
}

TEST(AdmissionTest, ACallsDeadlineTightensTheEngineRequests) {
  auto s = Serve(0);
  const Admission admission(s->service.get(), "");
  const auto soon = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  EXPECT_EQ(admission.Prepare(Greedy(), {}, soon).value().engine.deadline, soon);
  EXPECT_GT(admission.Prepare(Greedy(), {}).value().engine.deadline, soon);
  CompletionParams bad = Greedy();
  bad.n = 0;
  absl::StatusOr<PreparedRequest> refused = admission.Prepare(bad, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("n"));
}

// ---------------------------------------------------------------------------
// The semantic layer, with a test embedder: a bag of words (lower-cased,
// punctuation dropped) hashed into 64 buckets, so rewordings with the same
// words are identical and a negation is close but not identical.

class BagOfWordsEmbedder : public TextEmbedder {
 public:
  int32_t dim() const override { return 64; }
  std::string fingerprint() const override { return "test-bag-of-words-v1"; }
  absl::StatusOr<std::vector<float>> Embed(std::string_view text) const override {
    std::vector<float> v(64, 0.0f);
    std::string word;
    auto flush = [&] {
      if (word.empty()) return;
      v[std::hash<std::string>()(word) % 64] += 1.0f;
      word.clear();
    };
    for (char c : text) {
      if (std::isalnum(static_cast<unsigned char>(c))) {
        word += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      } else {
        flush();
      }
    }
    flush();
    float norm = 0;
    for (float x : v) norm += x * x;
    if (norm == 0) return absl::InvalidArgumentError("no words");
    for (float& x : v) x /= std::sqrt(norm);
    return v;
  }
};

float Dot(const std::vector<float>& a, const std::vector<float>& b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += a[i] * b[i];
  return d;
}

TEST(SemanticIndexTest, NearestLiveReplyAboveTheThreshold) {
  ResponseCache cache({1 << 20, 0, nullptr});
  SemanticIndex index(64, &cache);
  BagOfWordsEmbedder emb;
  const auto cat = emb.Embed("the cat sat on the mat").value();
  const auto dog = emb.Embed("a dog ran in the park").value();
  ASSERT_TRUE(cache.Insert("k-cat", Reply("cat answer")));
  ASSERT_TRUE(cache.Insert("k-dog", Reply("dog answer")));
  ASSERT_TRUE(index.Insert("scope", cat, "k-cat"));
  ASSERT_TRUE(index.Insert("scope", dog, "k-dog"));
  const auto query = emb.Embed("The cat sat on the mat!").value();
  auto c = index.Find("scope", query, 0.9f);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->key, "k-cat");
  EXPECT_NEAR(c->similarity, 1.0f, 1e-4);
  EXPECT_FALSE(index.Find("other-scope", query, 0.9f).has_value()) << "scopes leak";
  const auto trap = emb.Embed("the cat did not sit on the mat").value();
  const float sim = Dot(trap, cat);
  EXPECT_FALSE(index.Find("scope", trap, sim + 0.01f).has_value());
  EXPECT_TRUE(index.Find("scope", trap, sim - 0.01f).has_value());
  // The exact cache drops the reply: it is no candidate any more (and the
  // points of dropped replies go when a lookup meets them).
  cache.Purge();
  EXPECT_FALSE(index.Find("scope", query, -1.0f).has_value());
  EXPECT_EQ(index.size(), 0);
}

class SemanticIndexScanTest : public ::testing::TestWithParam<int32_t /* exact_scan_limit */> {};

// Exact scan (limit 2048) and HNSW (limit 0) alike; growing past the first
// HNSW capacity (64) resizes it.
TEST_P(SemanticIndexScanTest, BoundedAndGrowing) {
  ResponseCache cache({1 << 20, 0, nullptr});
  SemanticIndexOptions o;
  o.max_entries = 100;
  o.exact_scan_limit = GetParam();
  SemanticIndex index(64, &cache, o);
  BagOfWordsEmbedder emb;
  int stored = 0;
  for (int i = 0; i < 120; ++i) {
    const std::string key = "k" + std::to_string(i);
    cache.Insert(key, Reply("x"));
    stored += index.Insert("s", emb.Embed("word" + std::to_string(i) + " common").value(), key);
  }
  EXPECT_EQ(stored, 100);
  EXPECT_EQ(index.size(), 100);
  // Words of their own (HNSW's graph search has no ties to get lost in).
  auto found = index.Find("s", emb.Embed("word42 common").value(), -1.0f);
  ASSERT_TRUE(found.has_value());
  if (GetParam() > 0) EXPECT_GT(found->similarity, 0.99f) << found->key;
  EXPECT_GT(found->similarity, 0.7f) << found->key;
}

INSTANTIATE_TEST_SUITE_P(ExactAndHnsw, SemanticIndexScanTest, ::testing::Values(2048, 0));

TEST(SemanticIndexTest, ExactScanFindsTheExactNeighbour) {
  ResponseCache cache({1 << 20, 0, nullptr});
  SemanticIndex index(64, &cache);
  BagOfWordsEmbedder emb;
  for (int i = 0; i < 100; ++i) {
    const std::string key = "k" + std::to_string(i);
    cache.Insert(key, Reply("x"));
    ASSERT_TRUE(index.Insert("s", emb.Embed("word" + std::to_string(i) + " common").value(), key));
  }
  for (int i = 0; i < 100; ++i) {
    auto found = index.Find("s", emb.Embed("word" + std::to_string(i) + " common").value(), 0.99f);
    ASSERT_TRUE(found.has_value()) << i;
  }
}

TEST(SemanticScopeTest, TheSamplerMayDifferNothingElse) {
  EngineRequest r = BaseRequest();
  const std::string base = SemanticScope(Identity(), "t", r, "ctx", "emb");
  EngineRequest sampled = r;
  sampled.params.temperature = 0.9f;
  sampled.params.has_seed = true;
  sampled.params.seed = 3;
  sampled.prompt = {1, 2};  // the query is the embedding's business
  EXPECT_EQ(SemanticScope(Identity(), "t", sampled, "ctx", "emb"), base);
  EngineRequest other = r;
  other.params.max_tokens = 99;
  EXPECT_NE(SemanticScope(Identity(), "t", other, "ctx", "emb"), base);
  other = r;
  other.params.stop = {"."};
  EXPECT_NE(SemanticScope(Identity(), "t", other, "ctx", "emb"), base);
  EXPECT_NE(SemanticScope(Identity(), "t2", r, "ctx", "emb"), base) << "tenant";
  EXPECT_NE(SemanticScope(Identity(), "t", r, "system: be brief", "emb"), base) << "system prompt";
  EXPECT_NE(SemanticScope(Identity(), "t", r, "ctx", "emb2"), base) << "embedder";
}

struct SemanticServed {
  std::unique_ptr<Served> served;
  BagOfWordsEmbedder embedder;
  std::unique_ptr<SemanticIndex> index;
};

std::unique_ptr<SemanticServed> ServeSemantic(float threshold) {
  auto s = std::make_unique<SemanticServed>();
  s->served = Serve(1 << 20);
  s->index = std::make_unique<SemanticIndex>(64, s->served->cache.get());
  s->served->service->EnableSemanticCache(s->index.get(), &s->embedder, threshold,
                                          SemanticMode::kOff);
  return s;
}

CompletionParams TextParams(const std::string& prompt, SemanticMode mode, int32_t max_tokens = 16) {
  CompletionParams p;
  p.prompt_text = prompt;
  p.max_tokens = max_tokens;
  p.temperature = 0;
  p.ignore_eos = true;
  p.response_cache.semantic = mode;
  return p;
}

// The model's own greedy answer, computed without the cache.
RunResult Plain(ModelService* service, CompletionParams p) {
  p.response_cache.lookup = false;
  p.response_cache.store = false;
  return RunRequest(service, p);
}

std::vector<int32_t> Tokens(const RunResult& r) {
  std::vector<int32_t> t;
  for (const SeqEvent& e : r.events) t.insert(t.end(), e.token_ids.begin(), e.token_ids.end());
  return t;
}

TEST(ModelServiceSemanticTest, VerifiedHitsNeverChangeTheGreedyAnswer) {
  auto s = ServeSemantic(0.5f);
  ModelService* service = s->served->service.get();
  const RunResult stored =
      RunRequest(service, TextParams("the cat sat on the mat", SemanticMode::kVerified));
  EXPECT_EQ(stored.outcome.kind, CacheHitKind::kMiss);
  ASSERT_EQ(s->index->size(), 1);

  // A rewording (same words, other case and punctuation): a candidate; its
  // tokens are the draft; the answer is the model's own for this prompt.
  for (const std::string& prompt :
       {std::string("The cat sat on the mat!"), std::string("the cat did not sit on the mat"),
        std::string("on the mat the cat sat")}) {
    const RunResult want = Plain(service, TextParams(prompt, SemanticMode::kOff));
    const RunResult got = RunRequest(service, TextParams(prompt, SemanticMode::kVerified));
    EXPECT_EQ(got.outcome.kind, CacheHitKind::kSemanticVerified) << prompt;
    EXPECT_EQ(got.outcome.draft_tokens, 16) << prompt;
    EXPECT_GT(got.outcome.similarity, 0.5f) << prompt;
    EXPECT_EQ(Tokens(got), Tokens(want)) << prompt << ": verification changed a greedy answer";
    EXPECT_EQ(TextOf(got), TextOf(want)) << prompt;
  }
  const ResponseCacheStats st = s->served->cache->Stats();
  EXPECT_EQ(st.hits_semantic_verified, 3);
  EXPECT_EQ(st.verify_draft_tokens, 48);
  EXPECT_LE(st.verify_accepted_tokens, 48);
  EXPECT_GE(st.semantic_candidates, 3);
}

TEST(ModelServiceSemanticTest, LookupOffStillIndexesAndStoreOffDoesNot) {
  auto s = ServeSemantic(0.5f);
  ModelService* service = s->served->service.get();
  CompletionParams no_store = TextParams("a dog ran in the park", SemanticMode::kVerified);
  no_store.response_cache.store = false;
  RunRequest(service, no_store);
  EXPECT_EQ(s->index->size(), 0);
  CompletionParams no_lookup = TextParams("the cat sat on the mat", SemanticMode::kVerified);
  no_lookup.response_cache.lookup = false;
  EXPECT_EQ(RunRequest(service, no_lookup).outcome.kind, CacheHitKind::kBypass);
  EXPECT_EQ(s->index->size(), 1);
  EXPECT_EQ(RunRequest(service, TextParams("The cat sat on the mat.", SemanticMode::kVerified))
                .outcome.kind,
            CacheHitKind::kSemanticVerified);
}

TEST(ModelServiceSemanticTest, ApproximateServesTheCachedAnswerAndSaysSo) {
  auto s = ServeSemantic(0.95f);
  ModelService* service = s->served->service.get();
  const RunResult stored =
      RunRequest(service, TextParams("the cat sat on the mat", SemanticMode::kApproximate));
  CompletionParams sampled = TextParams("The cat sat on the mat?", SemanticMode::kApproximate);
  sampled.temperature = 0.8f;  // no seed: never stored, only approximate may answer it
  const RunResult got = RunRequest(service, sampled);
  EXPECT_EQ(got.outcome.kind, CacheHitKind::kApproximate);
  EXPECT_EQ(TextOf(got), TextOf(stored));
  // Below the threshold (a negation adds a word): computed, not served.
  CompletionParams trap = TextParams("the cat did not sit on the mat", SemanticMode::kApproximate);
  trap.temperature = 0.8f;
  EXPECT_EQ(RunRequest(service, trap).outcome.kind, CacheHitKind::kBypass);
  // Semantic off (the default here): no semantic lookup at all.
  EXPECT_EQ(
      RunRequest(service, TextParams("The cat sat on the mat?", SemanticMode::kOff)).outcome.kind,
      CacheHitKind::kMiss);
  EXPECT_EQ(s->served->cache->Stats().hits_approximate, 1);
}

}  // namespace
}  // namespace kvserve
