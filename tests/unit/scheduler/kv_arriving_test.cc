// KV arriving asynchronously (the KvLoader seam later tiers and prefill nodes
// use): a sequence whose KV is being loaded is parked in kKvArriving and
// never scheduled until the load lands, then continues from the loaded
// tokens with exactly the output it would have had; a failed load falls back
// to recompute; a request cancelled mid-load keeps its blocks pinned until
// the load is done, then leaks nothing.
#include <atomic>
#include <fstream>
#include <map>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "scheduler/engine.h"
#include "tests/testing/generate.h"
#include "tests/testing/gguf_writer.h"
#include "tests/testing/test_models.h"

namespace kvserve {
namespace {

using Model = testing::WrittenModel;
const Model& Tiny() { return testing::TinyWrittenModel("kv-arriving-tiny", 512); }
ThreadPool* Pool() { return testing::TestPool(); }

// A "remote prefill node" in-process: it computes the requested tokens' K/V
// with the model itself, straight into the target blocks, and reports Done
// only after `polls` polls (the transfer's latency). With `fail`, it writes
// nothing and reports an error.
class ComputingLoader : public KvLoader {
 public:
  ComputingLoader(LlamaModel* model, int polls, bool fail)
      : model_(model), polls_(polls), fail_(fail) {}

  int32_t Lookup(std::string_view, absl::Span<const int32_t>, int32_t from,
                 int32_t limit) override {
    ++lookups;
    return from == 0 ? limit - from : 0;  // whole prompts only
  }

  std::shared_ptr<KvLoad> Start(const KvLoadTarget& t) override {
    auto load = std::make_shared<Load>();
    load->polls_left = polls_;
    if (fail_) {
      load->st = absl::UnavailableError("peer went away");
    } else {
      std::vector<int32_t> seq(t.num_tokens, 0), pos(t.num_tokens);
      for (int32_t i = 0; i < t.num_tokens; ++i) pos[i] = t.first_slot + i;
      const absl::Span<const int32_t> toks =
          t.tokens.subspan(static_cast<size_t>(t.first_slot), static_cast<size_t>(t.num_tokens));
      load->st = model_->Forward(ForwardBatch{toks, seq, pos, {}}, t.view, nullptr, Pool());
    }
    ++started;
    last = load;
    return load;
  }

  struct Load : KvLoad {
    std::atomic<int> polls_left{0};
    absl::Status st;
    bool Done() override { return polls_left.fetch_sub(1) <= 0; }
    absl::Status status() override { return st; }
  };

  int lookups = 0, started = 0;
  std::shared_ptr<Load> last;

 private:
  LlamaModel* model_;
  int polls_;
  bool fail_;
};

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

EngineOptions Opts(KvLoader* loader) {
  EngineOptions o;
  o.num_blocks = 64;
  o.prefix_cache = false;
  o.kv_loader = loader;
  return o;
}

std::vector<int32_t> Prompt() { return {1, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47}; }

std::vector<int32_t> Generate(Engine& e, std::vector<int32_t> prompt, int max_tokens,
                              FinishReason* finish = nullptr) {
  std::vector<int32_t> out;
  FinishReason f = FinishReason::kNone;
  auto id = e.Submit({prompt, Greedy(max_tokens)}, [&](const SeqEvent& ev) {
    out.insert(out.end(), ev.token_ids.begin(), ev.token_ids.end());
    if (ev.finish != FinishReason::kNone) f = ev.finish;
  });
  EXPECT_TRUE(id.ok());
  while (e.Step()) {
  }
  if (finish) *finish = f;
  return out;
}

std::vector<int32_t> Reference(int max_tokens) {
  const Model& m = Tiny();
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(nullptr)).value();
  return Generate(*e, Prompt(), max_tokens);
}

TEST(KvArrivingTest, ParkedUntilTheLoadLandsThenContinuesExactly) {
  const Model& m = Tiny();
  ComputingLoader loader(m.model.get(), /*polls=*/3, /*fail=*/false);
  EngineOptions o = Opts(&loader);
  const int32_t prompt_len = static_cast<int32_t>(Prompt().size());
  int parked_steps = 0;
  std::vector<int32_t> first_chunk;
  o.plan_observer = [&](const BatchPlan& p) {
    for (const ScheduledChunk& c : p.chunks) first_chunk.push_back(c.first_slot);
  };
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
  std::vector<int32_t> out;
  ASSERT_TRUE(e->Submit({Prompt(), Greedy(12)},
                        [&](const SeqEvent& ev) {
                          out.insert(out.end(), ev.token_ids.begin(), ev.token_ids.end());
                        })
                  .ok());
  while (e->Step()) {
    if (e->Stats().kv_arriving > 0) ++parked_steps;
  }
  EXPECT_EQ(loader.started, 1);
  EXPECT_GE(parked_steps, 2) << "the engine waited for the load";
  ASSERT_FALSE(first_chunk.empty());
  EXPECT_EQ(first_chunk.front(), prompt_len - 1)
      << "only the last prompt token is computed here; the rest arrived";
  EXPECT_EQ(out, Reference(12)) << "loaded KV gives the same tokens as computed KV";
  EXPECT_EQ(e->Stats().kv_loads, 1);
  EXPECT_EQ(e->Stats().kv_load_failures, 0);
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 64) << "blocks leaked";
}

TEST(KvArrivingTest, AFailedLoadIsRecomputed) {
  const Model& m = Tiny();
  ComputingLoader loader(m.model.get(), /*polls=*/2, /*fail=*/true);
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(&loader)).value();
  FinishReason f;
  EXPECT_EQ(Generate(*e, Prompt(), 12, &f), Reference(12));
  EXPECT_EQ(f, FinishReason::kLength);
  EXPECT_EQ(e->Stats().kv_load_failures, 1);
  EXPECT_EQ(e->Stats().prompt_tokens_total, static_cast<int64_t>(Prompt().size()));
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 64);
}

TEST(KvArrivingTest, CancelDuringALoadKeepsBlocksPinnedUntilItIsDone) {
  const Model& m = Tiny();
  ComputingLoader loader(m.model.get(), /*polls=*/1000000, /*fail=*/false);
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(&loader)).value();
  FinishReason f = FinishReason::kNone;
  auto id = e->Submit({Prompt(), Greedy(12)}, [&](const SeqEvent& ev) {
    if (ev.finish != FinishReason::kNone) f = ev.finish;
  });
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 3; ++i) e->Step();
  ASSERT_EQ(e->Stats().kv_arriving, 1);
  e->Cancel(*id);
  for (int i = 0; i < 3; ++i) e->Step();
  EXPECT_EQ(f, FinishReason::kCancelled) << "the client hears at once";
  EXPECT_LT(e->kv_pool().num_free_blocks(), 64) << "the load may still write: blocks pinned";
  loader.last->polls_left = 0;  // the transfer completes
  while (e->Step()) {
  }
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 64) << "released once the load was done";
}

TEST(KvArrivingTest, OtherRequestsRunWhileOneIsParked) {
  const Model& m = Tiny();
  ComputingLoader loader(m.model.get(), /*polls=*/1000000, /*fail=*/false);
  auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(&loader)).value();
  auto parked = e->Submit({Prompt(), Greedy(12)}, [](const SeqEvent&) {});
  ASSERT_TRUE(parked.ok());
  e->Step();
  // A one-token prompt has nothing to load: it runs to the end meanwhile.
  FinishReason f = FinishReason::kNone;
  ASSERT_TRUE(e->Submit({{1}, Greedy(5)}, [&](const SeqEvent& ev) {
                 if (ev.finish != FinishReason::kNone) f = ev.finish;
               }).ok());
  for (int i = 0; i < 20 && f == FinishReason::kNone; ++i) e->Step();
  EXPECT_EQ(f, FinishReason::kLength);
  EXPECT_EQ(e->Stats().kv_arriving, 1);
  loader.last->polls_left = 0;
  while (e->Step()) {
  }
  EXPECT_EQ(e->kv_pool().num_free_blocks(), 64);
}

// A loader that supplies from block boundaries only (as a decode node's
// does), with or without asking for the whole-block re-match
// (KvLoader::RematchWholeBlocks).
class BoundaryLoader : public ComputingLoader {
 public:
  BoundaryLoader(LlamaModel* model, bool rematch)
      : ComputingLoader(model, /*polls=*/1, /*fail=*/false), rematch_(rematch) {}
  int32_t Lookup(std::string_view, absl::Span<const int32_t>, int32_t from,
                 int32_t limit) override {
    ++lookups;
    return supply && from % 16 == 0 ? limit - from : 0;
  }
  bool RematchWholeBlocks() const override { return rematch_; }
  bool supply = false;

 private:
  bool rematch_;
};

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(1 + (i * 7 + salt * 13) % 500);
  return t;
}

TEST(KvArrivingTest, WholeBlockRematchIsTheLoadersChoice) {
  const Model& m = Tiny();
  // B shares A's first 24 tokens: its radix match ends inside block 1.
  const std::vector<int32_t> a = Tokens(40, 1);
  std::vector<int32_t> b(a.begin(), a.begin() + 24);
  for (int32_t t : Tokens(24, 2)) b.push_back(t);
  std::vector<int32_t> want;
  {
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), Opts(nullptr)).value();
    want = Generate(*e, b, 6);
  }
  for (const bool rematch : {true, false}) {
    BoundaryLoader loader(m.model.get(), rematch);
    EngineOptions o = Opts(&loader);
    o.prefix_cache = true;
    auto e = Engine::Create(m.model.get(), m.tokenizer.get(), Pool(), o).value();
    (void)Generate(*e, a, 4);  // computed here: A's blocks enter the prefix cache
    ASSERT_EQ(loader.started, 0);
    loader.supply = true;
    EXPECT_EQ(Generate(*e, b, 6), want) << "rematch " << rematch;
    // With the re-match the load runs from the block boundary (16); without
    // it the match stays at 24, where this loader supplies nothing.
    EXPECT_EQ(loader.started, rematch ? 1 : 0) << "rematch " << rematch;
  }
}

}  // namespace
}  // namespace kvserve
