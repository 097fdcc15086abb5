// ResponseAccumulator folds a request's SeqEvents into one CompletedResponse:
// each sample's tokens, log-probabilities and text in the order they were
// emitted, however the samples interleave and whichever threads add them;
// done() exactly when every sample has finished; usage counts as the front
// ends report them.
#include "server/service/completed_response.h"

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::ElementsAre;

// The k-th token of sample i: distinct across samples, ordered within one.
int32_t TokenOf(int32_t sample, int32_t k) { return 1000 * sample + k; }

SeqEvent TokenEvent(int32_t sample, int32_t k, int32_t prompt_tokens = 7) {
  SeqEvent ev;
  ev.request_id = 42;
  ev.index = sample;
  ev.token_ids = {TokenOf(sample, k)};
  ev.logprobs = {-0.5f * static_cast<float>(k)};
  ev.text = std::to_string(k) + ",";
  ev.prompt_tokens = prompt_tokens;
  ev.completion_tokens = k + 1;
  return ev;
}

SeqEvent FinishEvent(int32_t sample, int32_t tokens, FinishReason why) {
  SeqEvent ev;
  ev.request_id = 42;
  ev.index = sample;
  ev.finish = why;
  ev.prompt_tokens = 7;
  ev.completion_tokens = tokens;
  return ev;
}

// What sample i must hold after `tokens` TokenEvents, in order.
void ExpectSample(const CompletedSample& s, int32_t index, int32_t tokens) {
  EXPECT_EQ(s.index, index);
  std::vector<int32_t> ids;
  std::vector<float> lps;
  std::string text;
  for (int32_t k = 0; k < tokens; ++k) {
    ids.push_back(TokenOf(index, k));
    lps.push_back(-0.5f * static_cast<float>(k));
    text += std::to_string(k) + ",";
  }
  EXPECT_EQ(s.token_ids, ids);
  EXPECT_EQ(s.logprobs, lps);
  EXPECT_EQ(s.text, text);
  EXPECT_EQ(s.completion_tokens, tokens);
}

TEST(ResponseAccumulatorTest, InterleavedSamplesKeepTheirOwnOrder) {
  constexpr int32_t kSamples = 3;
  constexpr int32_t kTokens = 50;
  ResponseAccumulator acc(kSamples, /*prompt_tokens=*/7);
  // A random interleaving that keeps each sample's events in order, as the
  // engine emits them.
  std::vector<int32_t> next(kSamples, 0);
  std::mt19937 rng(1);
  int32_t left = kSamples * kTokens;
  while (left > 0) {
    const int32_t i = static_cast<int32_t>(rng() % kSamples);
    if (next[i] == kTokens) continue;
    EXPECT_FALSE(acc.Add(TokenEvent(i, next[i]++)));
    --left;
  }
  for (int32_t i = 0; i < kSamples; ++i) {
    EXPECT_FALSE(acc.done());
    EXPECT_TRUE(acc.Add(FinishEvent(i, kTokens, FinishReason::kLength)));
  }
  ASSERT_TRUE(acc.done());
  const CompletedResponse r = acc.Take();
  EXPECT_EQ(r.request_id, 42u);
  ASSERT_EQ(r.samples.size(), static_cast<size_t>(kSamples));
  for (int32_t i = 0; i < kSamples; ++i) {
    ExpectSample(r.samples[i], i, kTokens);
    EXPECT_EQ(r.samples[i].finish, FinishReason::kLength);
  }
  EXPECT_EQ(r.prompt_tokens, 7);
  EXPECT_EQ(r.completion_tokens, kSamples * kTokens);
  EXPECT_FALSE(r.aborted());
}

TEST(ResponseAccumulatorTest, EventsFromManyThreadsAreNotLost) {
  // One thread per sample, all adding at once: every event must land, in
  // its thread's order, and done() must turn true only with the last finish.
  constexpr int32_t kSamples = 8;
  constexpr int32_t kTokens = 2000;
  ResponseAccumulator acc(kSamples, /*prompt_tokens=*/7);
  std::atomic<int32_t> ready{0};
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < kSamples; ++i) {
    threads.emplace_back([&acc, &ready, i] {
      ready.fetch_add(1);
      while (ready.load() < kSamples) std::this_thread::yield();
      for (int32_t k = 0; k < kTokens; ++k) acc.Add(TokenEvent(i, k));
      acc.Add(FinishEvent(i, kTokens, FinishReason::kStop));
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(acc.done());
  const CompletedResponse r = acc.Take();
  ASSERT_EQ(r.samples.size(), static_cast<size_t>(kSamples));
  for (int32_t i = 0; i < kSamples; ++i) ExpectSample(r.samples[i], i, kTokens);
  EXPECT_EQ(r.completion_tokens, int64_t{kSamples} * kTokens);
}

TEST(ResponseAccumulatorTest, ConcurrentAddsToOneSampleLoseNothing) {
  // Several threads append to the same sample: the order across threads is
  // theirs to race for, but every token must arrive exactly once, each
  // thread's tokens in its order, with its log-probability beside it.
  constexpr int32_t kThreads = 4;
  constexpr int32_t kTokens = 50000;
  constexpr int32_t kStride = 100000;  // token = thread * kStride + k
  ResponseAccumulator acc(1, 7);
  std::atomic<int32_t> ready{0};
  std::vector<std::thread> threads;
  for (int32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&acc, &ready, t] {
      // All start together, so their Adds overlap.
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      for (int32_t k = 0; k < kTokens; ++k) {
        SeqEvent ev = TokenEvent(0, k);
        ev.token_ids = {t * kStride + k};
        ev.logprobs = {static_cast<float>(t * kStride + k)};
        acc.Add(ev);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  const CompletedResponse r = acc.Snapshot();
  const CompletedSample& s = r.samples[0];
  ASSERT_EQ(s.token_ids.size(), static_cast<size_t>(kThreads * kTokens));
  ASSERT_EQ(s.logprobs.size(), s.token_ids.size());
  std::vector<int32_t> next(kThreads, 0);
  for (size_t j = 0; j < s.token_ids.size(); ++j) {
    const int32_t t = s.token_ids[j] / kStride;
    ASSERT_TRUE(t >= 0 && t < kThreads) << s.token_ids[j];
    ASSERT_EQ(s.token_ids[j] % kStride, next[t]++) << "thread " << t << " out of order";
    EXPECT_EQ(s.logprobs[j], static_cast<float>(s.token_ids[j]));
  }
  for (int32_t t = 0; t < kThreads; ++t) EXPECT_EQ(next[t], kTokens);
}

TEST(ResponseAccumulatorTest, DoneOnlyWhenEverySampleFinishedOnce) {
  ResponseAccumulator acc(2, 5);
  EXPECT_FALSE(acc.done());
  EXPECT_TRUE(acc.Add(FinishEvent(1, 0, FinishReason::kStop)));
  // A second finish for the same sample neither counts nor overwrites.
  EXPECT_FALSE(acc.Add(FinishEvent(1, 0, FinishReason::kLength)));
  EXPECT_FALSE(acc.done());
  EXPECT_TRUE(acc.Add(FinishEvent(0, 0, FinishReason::kLength)));
  EXPECT_TRUE(acc.done());
  const CompletedResponse r = acc.Snapshot();
  EXPECT_EQ(r.samples[0].finish, FinishReason::kLength);
  EXPECT_EQ(r.samples[1].finish, FinishReason::kStop);
}

TEST(ResponseAccumulatorTest, TextSizeTracksTheSampleSoFar) {
  ResponseAccumulator acc(2, 5);
  EXPECT_EQ(acc.text_size(0), 0u);
  acc.Add(TokenEvent(0, 0));   // "0,"
  acc.Add(TokenEvent(1, 10));  // "10,"
  acc.Add(TokenEvent(0, 1));   // "1,"
  EXPECT_EQ(acc.text_size(0), 4u);
  EXPECT_EQ(acc.text_size(1), 3u);
  EXPECT_EQ(acc.text_size(7), 0u);
  EXPECT_EQ(acc.Snapshot().samples[0].text, "0,1,");
}

TEST(ResponseAccumulatorTest, OutOfRangeIndexCountsOnlyTowardUsage) {
  ResponseAccumulator acc(1, 5);
  SeqEvent stray = TokenEvent(3, 0);
  stray.cached_tokens = 4;
  EXPECT_FALSE(acc.Add(stray));
  SeqEvent neg = FinishEvent(-1, 9, FinishReason::kStop);
  EXPECT_FALSE(acc.Add(neg));
  EXPECT_FALSE(acc.done());
  const CompletedResponse r = acc.Snapshot();
  ASSERT_EQ(r.samples.size(), 1u);
  EXPECT_TRUE(r.samples[0].token_ids.empty());
  EXPECT_EQ(r.completion_tokens, 0);
  EXPECT_EQ(r.cached_tokens, 4);
}

TEST(ResponseAccumulatorTest, UsageTakesTheLatestCountsAndTheMostCached) {
  ResponseAccumulator acc(2, /*prompt_tokens=*/5);
  // Before any event reports its own, the caller's prompt count stands.
  EXPECT_EQ(acc.Snapshot().prompt_tokens, 5);
  SeqEvent a = TokenEvent(0, 0, /*prompt_tokens=*/6);
  a.cached_tokens = 3;
  acc.Add(a);
  SeqEvent b = TokenEvent(1, 0, /*prompt_tokens=*/6);
  b.cached_tokens = 1;  // a smaller report does not lower it
  acc.Add(b);
  acc.Add(TokenEvent(0, 1, /*prompt_tokens=*/0));  // 0: no report
  acc.Add(FinishEvent(0, 2, FinishReason::kStop));
  acc.Add(FinishEvent(1, 1, FinishReason::kLength));
  const CompletedResponse r = acc.Take();
  EXPECT_EQ(r.prompt_tokens, 7);  // FinishEvent reports 7
  EXPECT_EQ(r.cached_tokens, 3);
  EXPECT_EQ(r.samples[0].completion_tokens, 2);
  EXPECT_EQ(r.samples[1].completion_tokens, 1);
  EXPECT_EQ(r.completion_tokens, 3);
}

TEST(ResponseAccumulatorTest, DroppedTokensAreEachSamplesMostAndTheirSum) {
  ResponseAccumulator acc(2, /*prompt_tokens=*/5);
  auto with_dropped = [](SeqEvent ev, int32_t dropped) {
    ev.dropped_tokens = dropped;
    return ev;
  };
  acc.Add(with_dropped(TokenEvent(0, 0), 3));
  acc.Add(with_dropped(TokenEvent(1, 0), 10));
  acc.Add(with_dropped(TokenEvent(0, 1), 7));
  // An event that reports no count (0) or an older one lowers nothing.
  acc.Add(with_dropped(TokenEvent(1, 1), 0));
  acc.Add(with_dropped(FinishEvent(0, 2, FinishReason::kStop), 5));
  acc.Add(with_dropped(FinishEvent(1, 2, FinishReason::kLength), 12));
  // A stray index counts nowhere: it has no sample to be the most of.
  acc.Add(with_dropped(TokenEvent(4, 0), 100));
  const CompletedResponse r = acc.Take();
  EXPECT_EQ(r.samples[0].dropped_tokens, 7);
  EXPECT_EQ(r.samples[1].dropped_tokens, 12);
  EXPECT_EQ(r.dropped_tokens, 19);
}

TEST(ResponseAccumulatorTest, CancelAndDeadlineMarkTheResponseAborted) {
  ResponseAccumulator acc(3, 5);
  acc.Add(FinishEvent(0, 0, FinishReason::kStop));
  acc.Add(FinishEvent(1, 0, FinishReason::kCancelled));
  acc.Add(FinishEvent(2, 0, FinishReason::kDeadline));
  ASSERT_TRUE(acc.done());
  const CompletedResponse r = acc.Take();
  EXPECT_TRUE(r.aborted());
  EXPECT_EQ(r.abort_reason, FinishReason::kDeadline);  // the last one
  EXPECT_EQ(r.samples[0].finish, FinishReason::kStop);
}

TEST(ResponseAccumulatorTest, EventsAfterTakeAreIgnored) {
  ResponseAccumulator acc(1, 5);
  acc.Add(TokenEvent(0, 0));
  acc.Add(FinishEvent(0, 1, FinishReason::kStop));
  const CompletedResponse r = acc.Take();
  EXPECT_THAT(r.samples[0].token_ids, ElementsAre(TokenOf(0, 0)));
  EXPECT_FALSE(acc.Add(TokenEvent(0, 1)));
}

TEST(ResponseAccumulatorTest, ZeroSamplesMeansOne) {
  ResponseAccumulator acc(0, 5);
  EXPECT_EQ(acc.Snapshot().samples.size(), 1u);
  EXPECT_TRUE(acc.Add(FinishEvent(0, 0, FinishReason::kStop)));
  EXPECT_TRUE(acc.done());
}

}  // namespace
}  // namespace kvserve
