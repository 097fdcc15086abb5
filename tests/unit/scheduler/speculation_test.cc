// The draft proposers (n-gram lookup, the bounded suffix index), the step
// cost fit, and the lossless samplers: a chi-square test that rejection
// sampling (general q, and the engine's one-hot q through its own Sampler)
// emits exactly the target distribution — and that the same test rejects a
// sampler that is not lossless, so it cannot pass vacuously.
#include "scheduler/speculation.h"

#include <cmath>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/sampler.h"

namespace kvserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::vector<int32_t> Lookup(const std::vector<int32_t>& tokens, int32_t min_n, int32_t max_n,
                            int32_t k, int32_t* n_out = nullptr) {
  std::vector<int32_t> out;
  const int32_t n = NgramLookup(tokens, tokens, true, min_n, max_n, k, &out);
  if (n_out) *n_out = n;
  return out;
}

TEST(NgramLookupTest, ProposesWhatFollowedTheLatestEarlierOccurrence) {
  // "7 8" occurs at 1 (followed by 9 10) and at 5 (followed by 11 12); the
  // context ends in "7 8": the latest earlier occurrence wins.
  const std::vector<int32_t> t = {1, 7, 8, 9, 10, 7, 8, 11, 12, 3, 7, 8};
  int32_t n = 0;
  EXPECT_THAT(Lookup(t, 2, 2, 3, &n), ElementsAre(11, 12, 3));
  EXPECT_EQ(n, 2);
}

TEST(NgramLookupTest, LongestMatchFirstAndKCaps) {
  // The 3-gram "5 7 8" matches only at 0 (-> 1 2 ...); the 2-gram "7 8" would match later at 6.
  const std::vector<int32_t> t = {5, 7, 8, 1, 2, 3, 7, 8, 4, 9, 5, 7, 8};
  int32_t n = 0;
  EXPECT_THAT(Lookup(t, 2, 3, 2, &n), ElementsAre(1, 2));
  EXPECT_EQ(n, 3);
  EXPECT_THAT(Lookup(t, 2, 2, 2, &n), ElementsAre(4, 9));
}

TEST(NgramLookupTest, NoMatchNoProposalAndNeverTheSuffixItself) {
  EXPECT_THAT(Lookup({1, 2, 3, 4, 5}, 1, 3, 4), IsEmpty());
  EXPECT_THAT(Lookup({4, 4}, 1, 1, 4), ElementsAre(4));  // the earlier 4 is followed by 4
  EXPECT_THAT(Lookup({4}, 1, 1, 4), IsEmpty());
  // Continuation stops at the end of the corpus.
  EXPECT_THAT(Lookup({1, 2, 1}, 1, 1, 8), ElementsAre(2, 1));
}

TEST(NgramLookupTest, ReferenceCorpusRealignsAfterDivergence) {
  ReferenceProposer p(2, 3);
  const std::vector<int32_t> reference = {10, 11, 12, 13, 14, 15, 16};
  // The output diverged (99) then came back to "13 14": continue from there.
  const std::vector<int32_t> tokens = {1, 2, 10, 11, 99, 13, 14};
  DraftProposal out;
  ASSERT_TRUE(p.Propose({tokens, reference}, 3, &out));
  EXPECT_THAT(out.tokens, ElementsAre(15, 16));
  EXPECT_EQ(out.source, DraftSource::kResponseCache);
  EXPECT_FALSE(p.Propose({tokens, {}}, 3, &out));
}

TEST(SuffixIndexTest, ProposesAcrossDocumentsAndStopsAtTheirEnd) {
  SuffixIndex idx(2, 4, 4096);
  idx.Insert(std::vector<int32_t>{100, 101, 102, 103, 104});
  idx.Insert(std::vector<int32_t>{7, 8, 9});
  DraftProposal out;
  const std::vector<int32_t> ctx = {1, 2, 101, 102};
  ASSERT_TRUE(idx.Propose({ctx, {}}, 8, &out));
  EXPECT_THAT(out.tokens, ElementsAre(103, 104));  // not into the next document
  EXPECT_EQ(out.match_length, 2);
  EXPECT_EQ(out.source, DraftSource::kSuffix);
  const std::vector<int32_t> end = {8, 9};  // a document's last tokens: nothing follows
  EXPECT_FALSE(idx.Propose({end, {}}, 8, &out));
  const std::vector<int32_t> none = {5, 6};
  EXPECT_FALSE(idx.Propose({none, {}}, 8, &out));
}

TEST(SuffixIndexTest, MemoryIsBoundedAndOldDocumentsAgeOut) {
  SuffixIndex idx(2, 3, 1024);
  const int64_t bytes = idx.memory_bytes();
  idx.Insert(std::vector<int32_t>{500, 501, 502, 503});
  DraftProposal out;
  const std::vector<int32_t> ctx = {500, 501};
  ASSERT_TRUE(idx.Propose({ctx, {}}, 4, &out));
  // 5000 tokens of other text overwrite the ring (and most of the table).
  std::mt19937 rng(1);
  for (int d = 0; d < 50; ++d) {
    std::vector<int32_t> doc(100);
    for (auto& t : doc) t = static_cast<int32_t>(rng() % 300);
    idx.Insert(doc);
  }
  EXPECT_EQ(idx.memory_bytes(), bytes);
  EXPECT_EQ(idx.size_tokens(), 1024);
  EXPECT_FALSE(idx.Propose({ctx, {}}, 4, &out)) << "a proposal from tokens the ring no longer holds";
}

TEST(StepCostFitTest, FitsFixedAndPerTokenCost) {
  StepCostFit fit;
  for (int i = 0; i < 200; ++i) {
    const int32_t t = 1 + (i % 9);
    fit.Observe(t, 0.010 + 0.002 * t);
  }
  EXPECT_NEAR(fit.alpha(), 0.010, 1e-6);
  EXPECT_NEAR(fit.beta(), 0.002, 1e-7);
  StepCostFit one;
  for (int i = 0; i < 10; ++i) one.Observe(4, 0.020);  // one size only: the prior split
  EXPECT_NEAR(one.alpha() + 4 * one.beta(), 0.020, 1e-9);
}

TEST(StepCostFitTest, MeasuredSizesComeFromTheTableOthersFromTheLine) {
  // A CPU-like curve: up to 3 tokens cost about one (the weights stream
  // once), then every token costs. A line through it is wrong at both ends.
  auto curve = [](int32_t t) { return t <= 3 ? 0.010 + 0.0002 * t : 0.010 + 0.004 * (t - 3); };
  StepCostFit fit;
  for (int i = 0; i < 300; ++i) {
    for (int32_t t : {1, 2, 3, 8}) fit.Observe(t, curve(t));
  }
  for (int32_t t : {1, 2, 3, 8}) {
    EXPECT_TRUE(fit.Measured(t)) << t;
    EXPECT_NEAR(fit.Predict(t), curve(t), 1e-9) << t;
  }
  EXPECT_FALSE(fit.Measured(5));
  EXPECT_NEAR(fit.Predict(5), fit.alpha() + 5 * fit.beta(), 1e-12);
  // One observation is not a measurement.
  fit.Observe(6, 1.0);
  EXPECT_FALSE(fit.Measured(6));
  fit.Observe(6, 1.0);
  EXPECT_TRUE(fit.Measured(6));
  // A size not seen for a long time is priced by the line again.
  for (int i = 0; i < 5000; ++i) fit.Observe(1, curve(1));
  EXPECT_FALSE(fit.Measured(6));
  EXPECT_FALSE(fit.Measured(8));
  EXPECT_TRUE(fit.Measured(1));
}

TEST(SizeDraftsTest, DraftsWhereTheyPayAndNotWhereTheyDoNot) {
  // Flat to 4 tokens, then 4 ms a token.
  StepCostFit cpu;
  auto curve = [](int32_t t) { return t <= 4 ? 0.005 : 0.005 + 0.004 * (t - 4); };
  for (int i = 0; i < 50; ++i) {
    for (int32_t t = 1; t <= 12; ++t) cpu.Observe(t, curve(t));
  }
  // One sequence with a good draft: the 3 tokens the flat part makes
  // nearly free, not the rest (each later token earns < 1 but costs most of
  // a step).
  const DraftOffer good{0.9, 8};
  EXPECT_EQ(SizeDrafts(1, {good}, cpu, 0.03), std::vector<int32_t>{3});
  // Four sequences decoding: the batch fills the flat part itself.
  const std::vector<DraftOffer> four(4, DraftOffer{0.6, 8});
  EXPECT_EQ(SizeDrafts(4, four, cpu, 0.03), std::vector<int32_t>(4, 0));
  // Low acceptance at batch 1: a flat step still pays a little, but not the
  // 3% margin... at 0.02 acceptance two extra tokens earn 0.02.
  EXPECT_EQ(SizeDrafts(1, {DraftOffer{0.02, 8}}, cpu, 0.03), std::vector<int32_t>{0});
  // The best tokens go first: of two sequences the one with the better
  // acceptance gets the free slots.
  EXPECT_EQ(SizeDrafts(2, {DraftOffer{0.3, 8}, DraftOffer{0.9, 8}}, cpu, 0.03),
            (std::vector<int32_t>{0, 2}));
  // A step that costs the same at every size drafts everything offered.
  StepCostFit flat;
  for (int i = 0; i < 50; ++i) {
    for (int32_t t = 1; t <= 20; ++t) flat.Observe(t, 0.005);
  }
  EXPECT_EQ(SizeDrafts(2, {DraftOffer{0.5, 4}, DraftOffer{0.5, 3}}, flat, 0.03),
            (std::vector<int32_t>{4, 3}));
  // The old greedy rule stopped at the first token that did not pay; a step
  // whose cost drops back (a kernel that turns faster at 8 tokens) is seen
  // whole: here 1 + 7 tokens cost about what 1 does, 1 + 1 twice that.
  StepCostFit bump;
  auto bumpy = [](int32_t t) { return t == 1 ? 0.005 : (t == 8 ? 0.006 : 0.012); };
  for (int i = 0; i < 50; ++i) {
    for (int32_t t = 1; t <= 9; ++t) bump.Observe(t, bumpy(t));
  }
  EXPECT_EQ(SizeDrafts(1, {DraftOffer{0.9, 8}}, bump, 0.03), std::vector<int32_t>{7});
}

// Pearson's chi-square of `counts` against probabilities `p`.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& p) {
  const double n = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  double chi = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double e = n * p[i];
    if (e == 0) {
      EXPECT_EQ(counts[i], 0) << "a token the target gives probability 0";
      continue;
    }
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}
// chi-square(df = 7) at p = 0.001.
constexpr double kChi7 = 24.32;

const std::vector<double> kP = {0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08};
const std::vector<double> kQ = {0.05, 0.40, 0.10, 0.20, 0.05, 0.10, 0.05, 0.05};

TEST(RejectionSampleTest, OutputDistributionIsTheTargets) {
  std::mt19937_64 rng(42);
  std::discrete_distribution<int32_t> draft(kQ.begin(), kQ.end());
  constexpr int kN = 200000;
  std::vector<int64_t> counts(kP.size()), naive(kP.size());
  int64_t accepted = 0;
  for (int i = 0; i < kN; ++i) {
    const int32_t d = draft(rng);
    const SpecVerdict v = RejectionSample(kP, kQ, d, &rng);
    ++counts[static_cast<size_t>(v.token)];
    accepted += v.accepted;
    ++naive[static_cast<size_t>(d)];  // "always accept": the draft's distribution
  }
  EXPECT_LT(ChiSquare(counts, kP), kChi7);
  // Acceptance = sum min(p, q).
  double want = 0;
  for (size_t i = 0; i < kP.size(); ++i) want += std::min(kP[i], kQ[i]);
  EXPECT_NEAR(static_cast<double>(accepted) / kN, want, 0.005);
  // The same statistic rejects a lossy sampler (cannot pass vacuously).
  std::vector<double> p_nozero = kP;
  p_nozero[3] = 1e-12;
  EXPECT_GT(ChiSquare(naive, p_nozero), 1000.0);
}

TEST(RejectionSampleTest, OneHotDraftIsAcceptedWithTargetProbability) {
  std::mt19937_64 rng(7);
  constexpr int kN = 200000;
  for (int32_t d : {0, 3, 5}) {
    std::vector<double> q(kP.size(), 0.0);
    q[static_cast<size_t>(d)] = 1.0;
    std::vector<int64_t> counts(kP.size());
    int64_t accepted = 0;
    for (int i = 0; i < kN; ++i) {
      const SpecVerdict v = RejectionSample(kP, q, d, &rng);
      ++counts[static_cast<size_t>(v.token)];
      accepted += v.accepted;
    }
    EXPECT_LT(ChiSquare(counts, kP), kChi7) << "draft " << d;
    EXPECT_NEAR(static_cast<double>(accepted) / kN, kP[static_cast<size_t>(d)], 0.005);
  }
}

// The engine's path (OutputProcessor::Verify) for a deterministic draft:
// draw x with the sequence's Sampler, accept iff x == draft, emit x. Its
// output must follow the target distribution (temperature, top-k/top-p and
// penalties included) and accept with probability p(draft).
TEST(RejectionSampleTest, EngineSamplerVerifyIsLossless) {
  const std::vector<float> logits = {2.0f, 0.5f, 1.5f, -1.0f, 1.0f, 0.8f, 1.2f, 0.1f};
  SamplingParams params;
  params.temperature = 0.7f;
  params.has_seed = true;
  params.seed = 3;
  Sampler sampler(params);
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < logits.size(); ++i) z += (p[i] = std::exp(logits[i] / 0.7));
  for (double& x : p) x /= z;
  constexpr int kN = 200000;
  constexpr int32_t kDraft = 2;
  std::vector<int64_t> counts(p.size()), broken(p.size());
  int64_t accepted = 0;
  std::mt19937_64 coin(11);
  for (int i = 0; i < kN; ++i) {
    const int32_t x = sampler.Sample(logits, {}, {}).token;
    accepted += x == kDraft;
    ++counts[static_cast<size_t>(x)];
    // A classic off-by-one: accept the draft half the time without checking.
    ++broken[static_cast<size_t>((coin() & 1) ? kDraft : x)];
  }
  EXPECT_LT(ChiSquare(counts, p), kChi7);
  EXPECT_NEAR(static_cast<double>(accepted) / kN, p[kDraft], 0.005);
  EXPECT_GT(ChiSquare(broken, p), 1000.0);
}

TEST(AcceptancePriorsTest, MatchLengthsKeepTheirOwnAcceptance) {
  AcceptancePriors pr;
  EXPECT_DOUBLE_EQ(pr.Estimate(DraftSource::kNgram, 2), 0.5);  // nothing seen: 1/2
  // Code edits: drafts on 4-token matches, nearly all kept.
  for (int i = 0; i < 200; ++i) pr.Observe(DraftSource::kNgram, 4, 3, 4);
  // A bucket not seen yet leans on the proposer's overall rate.
  EXPECT_GT(pr.Estimate(DraftSource::kNgram, 2), 0.7);
  // Chat after them: drafts on 2-token matches, mostly rejected.
  for (int i = 0; i < 40; ++i) pr.Observe(DraftSource::kNgram, 2, 0, 1);
  EXPECT_LT(pr.Estimate(DraftSource::kNgram, 2), 0.15);
  EXPECT_GT(pr.Estimate(DraftSource::kNgram, 4), 0.7);
  // Other proposers are untouched; long matches share the last bucket.
  EXPECT_DOUBLE_EQ(pr.Estimate(DraftSource::kSuffix, 4), 0.5);
  EXPECT_EQ(AcceptancePriors::Bucket(100),
            AcceptancePriors::Bucket(AcceptancePriors::kMatchBuckets));
  EXPECT_EQ(AcceptancePriors::Bucket(0), 0);
  // Old evidence decays: a bucket follows a change of workload.
  for (int i = 0; i < 300; ++i) pr.Observe(DraftSource::kNgram, 4, 0, 1);
  EXPECT_LT(pr.Estimate(DraftSource::kNgram, 4), 0.2);
}

TEST(SpecModeTest, ParsesNamesAndRejectsOthersNamingTheField) {
  SpecMode m;
  ASSERT_TRUE(ParseSpecMode("suffix", "speculative", &m).ok());
  EXPECT_EQ(m, SpecMode::kSuffix);
  EXPECT_FALSE(ParseSpecMode("default", "speculative", &m).ok());
  ASSERT_TRUE(ParseSpecMode("default", "speculative", &m, true).ok());
  EXPECT_EQ(m, SpecMode::kDefault);
  const absl::Status st = ParseSpecMode("eagle", "speculative", &m);
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("speculative"));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("eagle"));
  SpeculationOptions o;
  o.max_k = 0;
  EXPECT_FALSE(ValidateSpeculationOptions(o).ok());
  o.max_k = 4;
  o.ngram_min = 3;
  o.ngram_max = 2;
  EXPECT_FALSE(ValidateSpeculationOptions(o).ok());
}

}  // namespace
}  // namespace kvserve
