// Draft verification (EngineRequest::draft_tokens, the response cache's
// semantic-verified hits): a greedy request with a draft produces exactly
// the output it produces without one — token for token and event for event —
// whether the draft is all right, right up to some token, or wrong from the
// first; the draft_accepted count is exactly the agreeing prefix (an
// off-by-one in acceptance fails here), also when the prompt and draft are
// prefilled over several steps and when the prompt comes from the prefix
// cache; and no block is left behind.
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

struct Model {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
};

const Model& Tiny() {
  static const Model* m = [] {
    testing::TinyLlamaOptions o;
    o.context_length = 512;
    const std::string path = testing::TempDir() + "/engine-draft-tiny.gguf";
    std::ofstream(path, std::ios::binary) << testing::MakeTinyLlamaGguf(o);
    auto* out = new Model;
    out->model = LlamaModel::Load(path).value();
    out->tokenizer = Tokenizer::FromGguf(out->model->file()).value();
    return out;
  }();
  return *m;
}

ThreadPool* Pool() {
  static ThreadPool pool(2);
  return &pool;
}

struct Output {
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> event_tokens;  // per event with tokens
  std::string text;
  FinishReason finish = FinishReason::kNone;
  int32_t accepted = 0;
};

std::unique_ptr<Engine> MakeEngine(int32_t budget = 512, bool prefix_cache = true,
                                   int32_t num_blocks = 128, bool start = true) {
  EngineOptions o;
  o.num_blocks = num_blocks;
  o.max_batched_tokens = budget;
  o.prefix_cache = prefix_cache;
  auto e = Engine::Create(Tiny().model.get(), Tiny().tokenizer.get(), Pool(), o).value();
  if (start) e->Start();
  return e;
}

EngineRequest Greedy(int32_t max_tokens) {
  EngineRequest r;
  r.prompt = {1, 17, 33, 48, 5, 91, 120, 7, 64, 200, 13, 42, 8, 150, 77, 3, 99, 21};
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  return r;
}

// One request's output as its events arrive; Wait() blocks until it ends.
struct Collected {
  std::mutex mu;
  std::condition_variable cv;
  Output out;
  bool done = false;
  Output Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return out;
  }
};

void Submit(Engine* e, EngineRequest r, Collected* st) {
  auto id = e->Submit(std::move(r), [st](const SeqEvent& ev) {
    std::lock_guard<std::mutex> lock(st->mu);
    st->out.tokens.insert(st->out.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
    if (!ev.token_ids.empty()) st->out.event_tokens.push_back(ev.token_ids);
    st->out.text += ev.text;
    st->out.accepted = std::max(st->out.accepted, ev.draft_accepted);
    if (ev.finish != FinishReason::kNone) {
      st->out.finish = ev.finish;
      st->done = true;
      st->cv.notify_all();
    }
  });
  EXPECT_TRUE(id.ok()) << id.status();
}

Output Generate(Engine* e, EngineRequest r) {
  Collected st;
  Submit(e, std::move(r), &st);
  return st.Wait();
}

void ExpectSame(const Output& got, const Output& want, const std::string& what) {
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.event_tokens, want.event_tokens) << what << ": one token per event, as decoded";
  EXPECT_EQ(got.text, want.text) << what;
  EXPECT_EQ(got.finish, want.finish) << what;
}

// A token other than `t` (the draft's wrong guess).
int32_t Other(int32_t t) { return t == 5 ? 6 : 5; }

class EngineDraftTest : public ::testing::TestWithParam<int32_t /* step budget */> {};

TEST_P(EngineDraftTest, GreedyOutputNeverChangesAndAcceptanceIsExact) {
  constexpr int32_t kMax = 24;
  auto e = MakeEngine(GetParam(), /*prefix_cache=*/false);
  const Output plain = Generate(e.get(), Greedy(kMax));
  ASSERT_EQ(plain.tokens.size(), static_cast<size_t>(kMax));
  EXPECT_EQ(plain.accepted, 0);

  // All right: every token is accepted.
  {
    EngineRequest r = Greedy(kMax);
    r.draft_tokens = plain.tokens;
    const Output got = Generate(e.get(), r);
    ExpectSame(got, plain, "fully right draft");
    EXPECT_EQ(got.accepted, kMax);
  }
  // Right for k tokens, then wrong (and right again after: those must not
  // count, the model's own token replaced the wrong one).
  for (int32_t k : {0, 1, 7, 15, kMax - 1}) {
    EngineRequest r = Greedy(kMax);
    r.draft_tokens = plain.tokens;
    r.draft_tokens[k] = Other(r.draft_tokens[k]);
    const Output got = Generate(e.get(), r);
    ExpectSame(got, plain, "wrong at " + std::to_string(k));
    EXPECT_EQ(got.accepted, k) << "wrong at " << k;
  }
  // A right prefix, shorter than the answer.
  {
    EngineRequest r = Greedy(kMax);
    r.draft_tokens.assign(plain.tokens.begin(), plain.tokens.begin() + 9);
    const Output got = Generate(e.get(), r);
    ExpectSame(got, plain, "right prefix of 9");
    EXPECT_EQ(got.accepted, 9);
  }
  // Entirely wrong.
  {
    EngineRequest r = Greedy(kMax);
    for (int32_t t : plain.tokens) r.draft_tokens.push_back(Other(t));
    const Output got = Generate(e.get(), r);
    ExpectSame(got, plain, "all wrong");
    EXPECT_EQ(got.accepted, 0);
  }
  // Stats are published after the step that sent the last event.
  int64_t used = -1;
  for (int i = 0; i < 200 && used != 0; ++i) {
    used = e->Stats().blocks_used;
    if (used != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(used, 0) << "a verified request left blocks behind";
}

// 512: prompt and draft in one forward; 4 and 7: prefilled over several
// steps, so verification rows span chunk boundaries.
INSTANTIATE_TEST_SUITE_P(Budgets, EngineDraftTest, ::testing::Values(512, 4, 7));

TEST(EngineDraftPrefixTest, VerifiesOnACachedPromptAndCachesOnlyFinalTokens) {
  constexpr int32_t kMax = 20;
  auto e = MakeEngine(512, /*prefix_cache=*/true);
  const Output plain = Generate(e.get(), Greedy(kMax));
  for (int32_t k : {3, 12}) {
    EngineRequest r = Greedy(kMax);
    r.draft_tokens = plain.tokens;
    r.draft_tokens[k] = Other(r.draft_tokens[k]);
    const Output got = Generate(e.get(), r);
    ExpectSame(got, plain, "wrong at " + std::to_string(k) + " with a cached prompt");
    EXPECT_EQ(got.accepted, k);
  }
  // Whatever the drafts left in the prefix cache is the true continuation:
  // a plain run over it still gives the same answer.
  ExpectSame(Generate(e.get(), Greedy(kMax)), plain, "after drafted runs");
}

TEST(EngineDraftPreemptionTest, DraftedRequestsSurvivePreemptionByRecompute) {
  constexpr int32_t kMax = 24;
  const Output plain = [] {
    auto e = MakeEngine(512, false);
    return Generate(e.get(), Greedy(kMax));
  }();
  // Six requests of three blocks each in a pool of seven: they preempt each
  // other (recompute) while their drafts are being verified.
  // All six are submitted before the engine starts, so they run together
  // however the machine schedules threads (with a submitting thread each, a
  // loaded CI machine let them arrive one at a time and none was preempted).
  auto e = MakeEngine(512, /*prefix_cache=*/false, /*num_blocks=*/7, /*start=*/false);
  std::vector<Collected> collected(6);
  for (int i = 0; i < 6; ++i) {
    EngineRequest r = Greedy(kMax);
    r.draft_tokens = plain.tokens;
    if (i % 2 == 1) r.draft_tokens[5 + i] = Other(r.draft_tokens[5 + i]);
    Submit(e.get(), std::move(r), &collected[i]);
  }
  e->Start();
  std::vector<Output> outs;
  for (Collected& c : collected) outs.push_back(c.Wait());
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(outs[i].tokens, plain.tokens) << "request " << i;
    EXPECT_EQ(outs[i].text, plain.text) << "request " << i;
    EXPECT_EQ(outs[i].accepted, i % 2 == 1 ? 5 + i : kMax) << "request " << i;
  }
  EXPECT_GT(e->Stats().preemptions, 0) << "the pool was meant to force preemption";
}

TEST(EngineDraftValidationTest, DraftsNeedAGreedySingleSampleRequest) {
  auto e = MakeEngine();
  auto check = [&](EngineRequest r, const std::string& want) {
    auto id = e->Submit(std::move(r), [](const SeqEvent&) {});
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(id.status().message()), ::testing::HasSubstr(want));
  };
  EngineRequest r = Greedy(8);
  r.draft_tokens = {5, 6};
  r.params.temperature = 0.7f;
  check(r, "temperature 0");
  r = Greedy(8);
  r.draft_tokens = {5, 6};
  r.n = 2;
  check(r, "n = 1");
  r = Greedy(2);
  r.draft_tokens = {5, 6, 7};
  check(r, "at most max_tokens");
  r = Greedy(8);
  r.draft_tokens = {5, 1 << 20};
  check(r, "outside the vocabulary");
  r = Greedy(8);
  r.draft_tokens = {5};
  r.kv_policy.kind = KvPolicy::Kind::kWindow;
  check(r, "kv_policy none");
}

}  // namespace
}  // namespace kvserve
