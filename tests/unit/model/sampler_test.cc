#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvserve {
namespace {

using ::testing::HasSubstr;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

SamplingParams Seeded(uint64_t seed) {
  SamplingParams p;
  p.has_seed = true;
  p.seed = seed;
  return p;
}

// Logits whose softmax is exactly `probs`.
std::vector<float> LogitsFor(const std::vector<double>& probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

std::vector<float> RandomLogits(size_t vocab, uint64_t seed, float scale = 4.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(vocab);
  for (float& x : logits) x = normal(rng);
  return logits;
}

// Reference log-softmax in double precision.
std::vector<double> LogSoftmax(const std::vector<float>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - max);
  std::vector<double> out;
  for (float x : logits) out.push_back(x - max - std::log(sum));
  return out;
}

std::vector<int> Histogram(Sampler& sampler, const std::vector<float>& logits, int draws) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < draws; ++i) ++counts[sampler.Sample(logits, {}, {}).token];
  return counts;
}

// Pearson chi-square of observed counts against expected probabilities.
// Tokens with zero expected probability must have zero count.
double ChiSquare(const std::vector<int>& counts, const std::vector<double>& expected) {
  const double n = std::accumulate(counts.begin(), counts.end(), 0.0);
  double chi2 = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = n * expected[i];
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi2;
}

// With <= 10 degrees of freedom, chi-square exceeds 50 with probability
// below 1e-6, so these bounds catch a wrong distribution without flaking.
constexpr double kChiSquareBound = 50.0;
constexpr int kDraws = 40000;

std::vector<double> Normalize(std::vector<double> w) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= sum;
  return w;
}

// --- Validation --------------------------------------------------------------

TEST(ValidateSamplingParamsTest, DefaultsAreValid) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
}

TEST(ValidateSamplingParamsTest, BoundaryValuesAreValid) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.max_tokens = 1;
  p.stop = std::vector<std::string>(8, std::string(256, 'x'));
  EXPECT_TRUE(ValidateSamplingParams(p).ok());
}

struct BadParamCase {
  const char* field;
  void (*mutate)(SamplingParams&);
};

class ValidateSamplingParamsBadTest : public ::testing::TestWithParam<BadParamCase> {};

TEST_P(ValidateSamplingParamsBadTest, RejectsAndNamesField) {
  SamplingParams p;
  GetParam().mutate(p);
  const absl::Status status = ValidateSamplingParams(p);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(GetParam().field));
}

INSTANTIATE_TEST_SUITE_P(
    AllFields, ValidateSamplingParamsBadTest,
    ::testing::Values(
        BadParamCase{"temperature", [](SamplingParams& p) { p.temperature = -0.1f; }},
        BadParamCase{"temperature", [](SamplingParams& p) { p.temperature = NAN; }},
        BadParamCase{"temperature", [](SamplingParams& p) { p.temperature = INFINITY; }},
        BadParamCase{"top_p", [](SamplingParams& p) { p.top_p = 0.0f; }},
        BadParamCase{"top_p", [](SamplingParams& p) { p.top_p = 1.01f; }},
        BadParamCase{"top_p", [](SamplingParams& p) { p.top_p = NAN; }},
        BadParamCase{"top_k", [](SamplingParams& p) { p.top_k = -1; }},
        BadParamCase{"min_p", [](SamplingParams& p) { p.min_p = -0.01f; }},
        BadParamCase{"min_p", [](SamplingParams& p) { p.min_p = 1.5f; }},
        BadParamCase{"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; }},
        BadParamCase{"repetition_penalty",
                     [](SamplingParams& p) { p.repetition_penalty = -1.0f; }},
        BadParamCase{"presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.5f; }},
        BadParamCase{"presence_penalty", [](SamplingParams& p) { p.presence_penalty = -2.5f; }},
        BadParamCase{"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = 3.0f; }},
        BadParamCase{"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = NAN; }},
        BadParamCase{"max_tokens", [](SamplingParams& p) { p.max_tokens = 0; }},
        BadParamCase{"stop", [](SamplingParams& p) { p.stop.assign(9, "x"); }},
        BadParamCase{"stop", [](SamplingParams& p) { p.stop = {"ok", std::string(257, 'x')}; }},
        BadParamCase{"stop", [](SamplingParams& p) { p.stop = {"ok", ""}; }}));

// --- Greedy and logprobs -----------------------------------------------------

TEST(SamplerTest, GreedyPicksArgmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler sampler(p);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(49152, seed);
    const int32_t expected =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(sampler.Sample(logits, {}, {}).token, expected);
  }
}

TEST(SamplerTest, GreedyTieGoesToLowestId) {
  SamplingParams p;
  p.temperature = 0.0f;
  Sampler sampler(p);
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
  EXPECT_EQ(sampler.Sample(logits, {}, {}).token, 1);
}

TEST(SamplerTest, GreedyLogprobIsRawLogSoftmax) {
  SamplingParams p;
  p.logprobs = true;
  p.temperature = 0.0f;
  Sampler sampler(p);
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 1.0f};
  const SampleResult r = sampler.Sample(logits, {}, {});
  ASSERT_EQ(r.token, 2);
  // Hand computation: log(e^2 / (e^0.5 + e^-1 + e^2 + e^1)).
  const double expected =
      2.0 - std::log(std::exp(0.5) + std::exp(-1.0) + std::exp(2.0) + std::exp(1.0));
  EXPECT_NEAR(r.logprob, expected, 1e-6);
}

TEST(SamplerTest, LogprobIsRawLogSoftmaxDespiteTemperatureAndPenalties) {
  SamplingParams p = Seeded(7);
  p.logprobs = true;
  p.temperature = 0.7f;
  p.top_k = 3;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 0.5f;
  Sampler sampler(p);
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, 1.5f, -3.0f};
  const std::vector<double> reference = LogSoftmax(logits);
  const std::vector<int32_t> prompt = {1, 3};
  const std::vector<int32_t> generated = {1};
  for (int i = 0; i < 200; ++i) {
    const SampleResult r = sampler.Sample(logits, prompt, generated);
    ASSERT_GE(r.token, 0);
    ASSERT_LT(r.token, 5);
    EXPECT_NEAR(r.logprob, reference[r.token], 1e-5);
  }
}

TEST(SamplerTest, LogprobIsStableForHugeLogits) {
  SamplingParams p;
  p.logprobs = true;
  p.temperature = 0.0f;
  Sampler sampler(p);
  // Naive exp() would overflow; log-softmax is still {-log(1+e), -log(1+1/e)}.
  const std::vector<float> logits = {1000.0f, 1001.0f};
  const SampleResult r = sampler.Sample(logits, {}, {});
  EXPECT_EQ(r.token, 1);
  EXPECT_NEAR(r.logprob, -std::log1p(std::exp(-1.0)), 1e-5);
}

TEST(SamplerTest, MaskedTokensAreNeverSampled) {
  Sampler sampler(Seeded(3));
  const std::vector<float> logits = {kNegInf, 0.0f, kNegInf, 0.0f};
  for (int i = 0; i < 1000; ++i) {
    const int32_t t = sampler.Sample(logits, {}, {}).token;
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
}

// --- Seeds -------------------------------------------------------------------

std::vector<int32_t> Draws(Sampler& sampler, const std::vector<float>& logits, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(sampler.Sample(logits, {}, {}).token);
  return out;
}

TEST(SamplerTest, SameSeedGivesSameSequence) {
  const std::vector<float> logits = RandomLogits(1000, 1, 0.5f);
  SamplingParams p = Seeded(1234);
  p.top_p = 0.9f;
  Sampler a(p);
  Sampler b(p);
  EXPECT_EQ(Draws(a, logits, 300), Draws(b, logits, 300));
}

TEST(SamplerTest, DifferentSeedsGiveDifferentSequences) {
  const std::vector<float> logits = RandomLogits(1000, 1, 0.5f);
  Sampler a(Seeded(1));
  Sampler b(Seeded(2));
  EXPECT_NE(Draws(a, logits, 300), Draws(b, logits, 300));
}

TEST(SamplerTest, UnseededSamplersDiffer) {
  const std::vector<float> logits = RandomLogits(1000, 1, 0.5f);
  Sampler a((SamplingParams()));
  Sampler b((SamplingParams()));
  EXPECT_NE(Draws(a, logits, 300), Draws(b, logits, 300));
}

// --- Distributions -----------------------------------------------------------

TEST(SamplerDistributionTest, TemperatureOneMatchesSoftmax) {
  const std::vector<double> probs = {0.4, 0.25, 0.15, 0.1, 0.06, 0.04};
  Sampler sampler(Seeded(11));
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), probs), kChiSquareBound);
}

TEST(SamplerDistributionTest, TemperatureSharpensAndFlattens) {
  const std::vector<double> probs = {0.4, 0.25, 0.15, 0.1, 0.06, 0.04};
  for (float temperature : {0.5f, 2.0f}) {
    // softmax(log p / T) is proportional to p^(1/T).
    std::vector<double> expected;
    for (double q : probs) expected.push_back(std::pow(q, 1.0 / temperature));
    expected = Normalize(expected);
    SamplingParams p = Seeded(12);
    p.temperature = temperature;
    Sampler sampler(p);
    EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound)
        << "temperature " << temperature;
  }
}

TEST(SamplerDistributionTest, TopKNeverLeavesTopKAndRenormalizes) {
  const std::vector<double> probs = {0.05, 0.3, 0.1, 0.2, 0.15, 0.12, 0.08};
  SamplingParams p = Seeded(13);
  p.top_k = 3;  // tokens 1, 3, 4
  Sampler sampler(p);
  const std::vector<double> expected = Normalize({0, 0.3, 0, 0.2, 0.15, 0, 0});
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound);
}

TEST(SamplerDistributionTest, TopKOnLargeVocab) {
  const std::vector<float> logits = RandomLogits(49152, 5, 1.0f);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const std::vector<int32_t> top(order.begin(), order.begin() + 40);
  SamplingParams p = Seeded(14);
  p.top_k = 40;
  Sampler sampler(p);
  for (int i = 0; i < 2000; ++i) {
    const int32_t t = sampler.Sample(logits, {}, {}).token;
    EXPECT_NE(std::find(top.begin(), top.end(), t), top.end()) << t;
  }
}

TEST(SamplerDistributionTest, TopKOfOneIsGreedy) {
  const std::vector<float> logits = RandomLogits(5000, 6);
  const int32_t argmax =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  SamplingParams p = Seeded(15);
  p.top_k = 1;
  p.temperature = 5.0f;
  Sampler sampler(p);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sampler.Sample(logits, {}, {}).token, argmax);
}

TEST(SamplerDistributionTest, TopKLargerThanVocabIsNoOp) {
  const std::vector<double> probs = {0.5, 0.3, 0.2};
  SamplingParams p = Seeded(16);
  p.top_k = 100;
  Sampler sampler(p);
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), probs), kChiSquareBound);
}

TEST(SamplerDistributionTest, TopPKeepsSmallestNucleus) {
  // Sorted: 0.4 (t2), 0.3 (t0), 0.2 (t3), 0.1 (t1). Cumulative 0.4, 0.7, 0.9:
  // top_p 0.65 needs the first two.
  const std::vector<double> probs = {0.3, 0.1, 0.4, 0.2};
  SamplingParams p = Seeded(17);
  p.top_p = 0.65f;
  Sampler sampler(p);
  const std::vector<double> expected = Normalize({0.3, 0, 0.4, 0});
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound);
}

TEST(SamplerDistributionTest, TopPKeepsAtLeastOneToken) {
  const std::vector<double> probs = {0.3, 0.1, 0.4, 0.2};
  SamplingParams p = Seeded(18);
  p.top_p = 0.01f;
  Sampler sampler(p);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(sampler.Sample(LogitsFor(probs), {}, {}).token, 2);
}

TEST(SamplerDistributionTest, TopPOnLargeVocabStaysInNucleus) {
  // A flat-ish distribution over 49152 tokens makes the nucleus thousands of
  // tokens wide, exercising the incremental partial sort well past its
  // first window.
  for (float top_p : {0.1f, 0.5f, 0.95f}) {
    const std::vector<float> logits = RandomLogits(49152, 8, 1.0f);
    const std::vector<double> logp = LogSoftmax(logits);
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    std::vector<bool> in_nucleus(logits.size(), false);
    double cumulative = 0.0;
    for (int32_t t : order) {
      in_nucleus[t] = true;
      cumulative += std::exp(logp[t]);
      if (cumulative >= top_p) break;
    }
    SamplingParams p = Seeded(19);
    p.top_p = top_p;
    Sampler sampler(p);
    for (int i = 0; i < 500; ++i) {
      const int32_t t = sampler.Sample(logits, {}, {}).token;
      ASSERT_TRUE(in_nucleus[t]) << "top_p " << top_p << " token " << t;
    }
  }
}

TEST(SamplerDistributionTest, TopPAppliesAfterTopK) {
  // top_k 3 renormalizes {0.4, 0.3, 0.2} to {4/9, 3/9, 2/9}; top_p 0.75 then
  // keeps 4/9 + 3/9 = 0.78. On the unrenormalized distribution it would
  // have needed 0.4 + 0.3 + 0.2.
  const std::vector<double> probs = {0.3, 0.1, 0.4, 0.2};
  SamplingParams p = Seeded(20);
  p.top_k = 3;
  p.top_p = 0.75f;
  Sampler sampler(p);
  const std::vector<double> expected = Normalize({0.3, 0, 0.4, 0});
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound);
}

TEST(SamplerDistributionTest, MinPDropsTokensBelowFractionOfMax) {
  // p_max 0.5; min_p 0.25 drops everything below 0.125.
  const std::vector<double> probs = {0.1, 0.5, 0.2, 0.05, 0.15};
  SamplingParams p = Seeded(21);
  p.min_p = 0.25f;
  Sampler sampler(p);
  const std::vector<double> expected = Normalize({0, 0.5, 0.2, 0, 0.15});
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound);
}

TEST(SamplerDistributionTest, MinPUsesTemperatureScaledProbabilities) {
  // At T=0.5, probabilities are proportional to p^2: {0.01, 0.25, 0.04,
  // 0.0025, 0.0225}; min_p 0.1 keeps >= 0.025: tokens 1 and 2.
  const std::vector<double> probs = {0.1, 0.5, 0.2, 0.05, 0.15};
  SamplingParams p = Seeded(22);
  p.temperature = 0.5f;
  p.min_p = 0.1f;
  Sampler sampler(p);
  const std::vector<double> expected = Normalize({0, 0.25, 0.04, 0, 0});
  EXPECT_LT(ChiSquare(Histogram(sampler, LogitsFor(probs), kDraws), expected), kChiSquareBound);
}

// --- Penalties -----------------------------------------------------------------

int32_t Greedy(SamplingParams p, const std::vector<float>& logits,
               const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated) {
  p.temperature = 0.0f;
  Sampler sampler(p);
  return sampler.Sample(logits, prompt, generated).token;
}

TEST(SamplerPenaltyTest, RepetitionPenaltyDividesPositiveLogits) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  // 2.0 / 1.5 = 1.33 < 1.9.
  EXPECT_EQ(Greedy(p, {2.0f, 1.9f}, {0}, {}), 1);
  // 2.0 / 1.5 = 1.33 > 1.3.
  EXPECT_EQ(Greedy(p, {2.0f, 1.3f}, {0}, {}), 0);
  // Generated tokens count too.
  EXPECT_EQ(Greedy(p, {2.0f, 1.9f}, {}, {0}), 1);
}

TEST(SamplerPenaltyTest, RepetitionPenaltyMultipliesNegativeLogits) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  // -1.0 * 1.5 = -1.5 < -1.2 (dividing would have raised it to -0.67).
  EXPECT_EQ(Greedy(p, {-1.0f, -1.2f}, {0}, {}), 1);
  // Penalizing the runner-up instead: -1.2 * 1.5 = -1.8 keeps token 0 on top.
  EXPECT_EQ(Greedy(p, {-1.0f, -1.2f}, {1}, {}), 0);
}

TEST(SamplerPenaltyTest, RepetitionPenaltyAppliesOncePerDistinctToken) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  // Once: 2.0 / 1.5 = 1.33 > 1.0. Three times would be 0.59 < 1.0.
  EXPECT_EQ(Greedy(p, {2.0f, 1.0f}, {0, 0, 0}, {0, 0}), 0);
}

TEST(SamplerPenaltyTest, RepetitionPenaltyBelowOneEncourages) {
  SamplingParams p;
  p.repetition_penalty = 0.5f;
  EXPECT_EQ(Greedy(p, {1.0f, 1.5f}, {0}, {}), 0);  // 1.0 / 0.5 = 2.0
}

TEST(SamplerPenaltyTest, PresencePenaltyIsFlatOverGeneratedTokens) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  EXPECT_EQ(Greedy(p, {1.0f, 0.6f}, {}, {0}), 1);        // 1.0 - 0.5 = 0.5 < 0.6
  EXPECT_EQ(Greedy(p, {1.0f, 0.4f}, {}, {0, 0, 0}), 0);  // still 0.5, count ignored
  EXPECT_EQ(Greedy(p, {1.0f, 0.6f}, {0}, {}), 0);        // the prompt is not penalized
}

TEST(SamplerPenaltyTest, FrequencyPenaltyScalesWithCount) {
  SamplingParams p;
  p.frequency_penalty = 0.15f;
  EXPECT_EQ(Greedy(p, {1.0f, 0.6f}, {}, {0, 0}), 0);     // 1.0 - 0.30 = 0.70
  EXPECT_EQ(Greedy(p, {1.0f, 0.6f}, {}, {0, 0, 0}), 1);  // 1.0 - 0.45 = 0.55
  EXPECT_EQ(Greedy(p, {1.0f, 0.6f}, {0, 0, 0}, {}), 0);  // the prompt is not penalized
}

TEST(SamplerPenaltyTest, PresenceAndFrequencyCombine) {
  SamplingParams p;
  p.presence_penalty = 0.2f;
  p.frequency_penalty = 0.1f;
  // 1.0 - (0.2 + 2 * 0.1) = 0.6 vs 0.65.
  EXPECT_EQ(Greedy(p, {1.0f, 0.65f}, {}, {0, 0}), 1);
  EXPECT_EQ(Greedy(p, {1.0f, 0.55f}, {}, {0, 0}), 0);
}

TEST(SamplerPenaltyTest, NegativePresencePenaltyEncourages) {
  SamplingParams p;
  p.presence_penalty = -1.0f;
  EXPECT_EQ(Greedy(p, {1.0f, 1.5f}, {}, {0}), 0);
}

TEST(SamplerPenaltyTest, RepetitionPenaltyComesBeforeFrequency) {
  // Repetition first: (2.0 / 2) - 0.5 = 0.5 < 0.6. The other order would
  // give (2.0 - 0.5) / 2 = 0.75 > 0.6.
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  EXPECT_EQ(Greedy(p, {2.0f, 0.6f}, {}, {0}), 1);
}

TEST(SamplerPenaltyTest, PenaltiesIgnoreOutOfRangeIds) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 1.0f;
  EXPECT_EQ(Greedy(p, {1.0f, 0.5f}, {-1, 7}, {99}), 0);
}

TEST(SamplerPenaltyTest, PenaltiesShiftSampledDistribution) {
  // Frequency 1.0 on token 0 generated twice: logit log(0.5) - 2.
  const std::vector<double> probs = {0.5, 0.3, 0.2};
  SamplingParams p = Seeded(23);
  p.frequency_penalty = 1.0f;
  Sampler sampler(p);
  const std::vector<float> logits = LogitsFor(probs);
  const std::vector<int32_t> generated = {0, 0};
  std::vector<int> counts(3, 0);
  for (int i = 0; i < kDraws; ++i) ++counts[sampler.Sample(logits, {}, generated).token];
  const std::vector<double> expected = Normalize({0.5 * std::exp(-2.0), 0.3, 0.2});
  EXPECT_LT(ChiSquare(counts, expected), kChiSquareBound);
}

// --- Stop strings --------------------------------------------------------------

// Feeds `chunks` and returns everything emitted, including the final Flush.
std::string Stream(StopStringMatcher& m, const std::vector<std::string>& chunks) {
  std::string out;
  for (const std::string& c : chunks) out += m.Push(c);
  out += m.Flush();
  return out;
}

TEST(StopStringMatcherTest, NoStopsPassesEverythingThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.Push("hello "), "hello ");
  EXPECT_EQ(m.Push("world"), "world");
  EXPECT_EQ(m.Flush(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStringMatcherTest, ReleasesTextThatCannotStartAStop) {
  StopStringMatcher m({"END"});
  EXPECT_EQ(m.Push("hello"), "hello");
  EXPECT_EQ(m.Push(" E"), " ");  // "E" might begin "END"
  EXPECT_EQ(m.Push("N"), "");
  EXPECT_EQ(m.Push("x"), "ENx");  // decided: not a stop
  EXPECT_FALSE(m.stopped());
}

TEST(StopStringMatcherTest, StopSplitAcrossChunksIsNeverEmitted) {
  StopStringMatcher m({"</s>"});
  EXPECT_EQ(m.Push("abc<"), "abc");
  EXPECT_EQ(m.Push("/"), "");
  EXPECT_EQ(m.Push("s>tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "</s>");
  EXPECT_EQ(m.Push("more"), "");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, MatchInsideOneChunkEmitsPrefixOnly) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.Push("go go STOP and more"), "go go ");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStringMatcherTest, FlushReleasesUndecidedTail) {
  StopStringMatcher m({"abc"});
  EXPECT_EQ(m.Push("xab"), "x");
  EXPECT_EQ(m.Flush(), "ab");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStringMatcherTest, ShorterStopThatEndsFirstWins) {
  StopStringMatcher m({"abc", "ab"});
  EXPECT_EQ(m.Push("xa"), "x");
  EXPECT_EQ(m.Push("bc"), "");
  EXPECT_EQ(m.matched(), "ab");
}

TEST(StopStringMatcherTest, PartialLongerStopIsReleasedWhenItFails) {
  StopStringMatcher m({"abc"});
  EXPECT_EQ(m.Push("xab"), "x");
  EXPECT_EQ(m.Push("d"), "abd");
}

TEST(StopStringMatcherTest, SelfOverlappingStopIsFound) {
  // "aab" in "aaab": a naive matcher that restarts after the failed third
  // 'a' misses it.
  StopStringMatcher whole({"aab"});
  EXPECT_EQ(whole.Push("aaab"), "a");
  EXPECT_TRUE(whole.stopped());

  StopStringMatcher bytes({"aab"});
  EXPECT_EQ(bytes.Push("a"), "");
  EXPECT_EQ(bytes.Push("a"), "");
  EXPECT_EQ(bytes.Push("a"), "a");  // only the longest candidate prefix is held
  EXPECT_EQ(bytes.Push("b"), "");
  EXPECT_TRUE(bytes.stopped());
  EXPECT_EQ(bytes.matched(), "aab");
}

TEST(StopStringMatcherTest, FirstOfMultipleStopsWins) {
  StopStringMatcher m({"STOP", "\n\n", "###"});
  EXPECT_EQ(Stream(m, {"one\n", "\ntwo ### STOP"}), "one");
  EXPECT_EQ(m.matched(), "\n\n");
}

TEST(StopStringMatcherTest, HoldsLongestPrefixAcrossStops) {
  StopStringMatcher m({"xyz", "yzw"});
  EXPECT_EQ(m.Push("axy"), "a");   // "xy" could start "xyz"
  EXPECT_EQ(m.Push("z"), "");      // and it does
  EXPECT_EQ(m.matched(), "xyz");
}

TEST(StopStringMatcherTest, Utf8StopsAndContent) {
  StopStringMatcher m({"。"});  // U+3002, three bytes
  const std::string text = "你好。世界";
  std::string out;
  for (char c : text) out += m.Push(std::string(1, c));
  EXPECT_EQ(out, "你好");
  EXPECT_TRUE(m.stopped());

  // "é" and "è" share their first byte: held, then released intact.
  StopStringMatcher n({"cafè"});
  EXPECT_EQ(Stream(n, {"un caf", "\xC3", "\xA9", " noir"}), "un café noir");
  EXPECT_FALSE(n.stopped());
}

TEST(StopStringMatcherTest, EmptyStopStringsAreIgnored) {
  StopStringMatcher m({"", "zz"});
  EXPECT_EQ(m.Push("abc"), "abc");
}

// Property: output does not depend on how the text is chunked, equals the
// text before the earliest-ending stop occurrence, and never contains a stop.
TEST(StopStringMatcherTest, ChunkingDoesNotChangeOutput) {
  std::mt19937_64 rng(99);
  const std::vector<std::string> stops = {"aab", "ba", "abab", "bbb"};
  for (int iter = 0; iter < 2000; ++iter) {
    std::string text;
    const int len = std::uniform_int_distribution<int>(0, 20)(rng);
    for (int i = 0; i < len; ++i) text += "abc"[std::uniform_int_distribution<int>(0, 2)(rng)];

    // Reference: earliest end, then longest.
    size_t best_end = std::string::npos, best_len = 0;
    for (const std::string& s : stops) {
      const size_t pos = text.find(s);
      if (pos == std::string::npos) continue;
      const size_t end = pos + s.size();
      if (end < best_end || (end == best_end && s.size() > best_len)) {
        best_end = end;
        best_len = s.size();
      }
    }
    const std::string expected =
        best_end == std::string::npos ? text : text.substr(0, best_end - best_len);

    std::vector<std::string> chunks;
    for (size_t i = 0; i < text.size();) {
      const size_t n = std::uniform_int_distribution<size_t>(1, 5)(rng);
      chunks.push_back(text.substr(i, n));
      i += n;
    }
    StopStringMatcher m(stops);
    const std::string out = Stream(m, chunks);
    ASSERT_EQ(out, expected) << "text " << text;
    ASSERT_EQ(m.stopped(), best_end != std::string::npos) << "text " << text;
    for (const std::string& s : stops) ASSERT_EQ(out.find(s), std::string::npos);
  }
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

TEST(SamplerLogprobTest, LogprobIsOnlyComputedWhenRequested) {
  SamplingParams p;
  p.temperature = 0;
  Sampler sampler(p);
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f};
  const SampleResult r = sampler.Sample(logits, {}, {});
  EXPECT_EQ(r.token, 1);
  EXPECT_EQ(r.logprob, 0.0f);
}

}  // namespace
}  // namespace kvserve
