// Speculative decoding without a draft model: cheap proposers guess the next
// k tokens of a running sequence, the engine verifies them in the same ragged
// forward (the sequence contributes 1 + k tokens), keeps the prefix its own
// sampler reproduces and emits the sampler's token at the first disagreement
// (OutputProcessor::Verify), so the output is exactly the output without a
// draft. Only accepted tokens are committed (Commit never sees a draft), so
// only committed full blocks reach the radix index; rejected slots are
// truncated and reused by the next step.
//
// Proposers (one interface, best proposal per sequence per step):
//   PromptLookupProposer  n-gram lookup over the sequence's own prompt and
//                         output (llama.cpp lookup / vLLM ngram)
//   SuffixIndex           n-gram index over recent outputs of every request,
//                         in a bounded ring (vLLM / ArcticInference suffix)
//   ReferenceProposer     the response cache's semantic candidate
//                         (EngineRequest::draft_tokens), realigned to the
//                         output after a divergence
//
// Speculator decides each step how many draft tokens each sequence gets:
// every draft token j of sequence i is worth a_i^j expected tokens (a_i: its
// recent acceptance); the step's cost at each size is measured (StepCostFit:
// per step size, a line for sizes not measured). The number of draft tokens
// kept, best first, is the one with the most expected tokens per second, and
// none unless that beats plain decoding by a margin, so the predicted speedup
// is never below 1; when the step cost grows with tokens (large batches on a
// compute-bound CPU) speculation turns itself down or off.
//
// Not thread-safe: the engine thread owns the Speculator.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "scheduler/request.h"

namespace kvserve {

class Sequence;
struct BatchPlan;

enum class DraftSource { kNgram = 0, kSuffix = 1, kResponseCache = 2 };
inline constexpr int kNumDraftSources = 3;
const char* DraftSourceName(DraftSource s);

struct DraftProposal {
  std::vector<int32_t> tokens;
  int32_t match_length = 0;  // tokens of context the proposal was matched on
  DraftSource source = DraftSource::kNgram;
};

// What a proposer sees of a sequence.
struct ProposeContext {
  absl::Span<const int32_t> tokens;     // prompt + committed output
  absl::Span<const int32_t> reference;  // the response cache's candidate (may be empty)
};

class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // Up to max_k tokens that may follow ctx.tokens; false when it has none.
  virtual bool Propose(const ProposeContext& ctx, int32_t max_k, DraftProposal* out) = 0;
};

// The most recent earlier occurrence in `corpus` of the last n tokens of
// `context` (n from max_n down to min_n, longest first) and up to max_k
// tokens that followed it there. When corpus is the context itself the
// trivial match (the suffix itself) is skipped. Returns the n matched (0:
// none) and fills *out.
int32_t NgramLookup(absl::Span<const int32_t> corpus, absl::Span<const int32_t> context,
                    bool corpus_is_context, int32_t min_n, int32_t max_n, int32_t max_k,
                    std::vector<int32_t>* out);

class PromptLookupProposer : public DraftProposer {
 public:
  PromptLookupProposer(int32_t min_n, int32_t max_n) : min_n_(min_n), max_n_(max_n) {}
  bool Propose(const ProposeContext& ctx, int32_t max_k, DraftProposal* out) override;

 private:
  int32_t min_n_, max_n_;
};

class ReferenceProposer : public DraftProposer {
 public:
  ReferenceProposer(int32_t min_n, int32_t max_n) : min_n_(min_n), max_n_(max_n) {}
  bool Propose(const ProposeContext& ctx, int32_t max_k, DraftProposal* out) override;

 private:
  int32_t min_n_, max_n_;
};

// An n-gram index over the outputs of finished requests: a ring of the last
// `capacity_tokens` tokens (documents separated) and a fixed-size
// direct-mapped table from the hash of every n-gram (min_n..max_n) to the
// ring position after it; newer entries overwrite older ones, and a lookup
// checks the ring still holds the matched tokens. Memory is fixed at
// construction: 4 bytes a ring token plus 16 bytes a table slot.
class SuffixIndex : public DraftProposer {
 public:
  SuffixIndex(int32_t min_n, int32_t max_n, int64_t capacity_tokens);
  // Adds one document (a finished request's output, or its prompt + output).
  void Insert(absl::Span<const int32_t> tokens);
  bool Propose(const ProposeContext& ctx, int32_t max_k, DraftProposal* out) override;
  int64_t size_tokens() const { return std::min<int64_t>(written_, capacity_); }
  int64_t memory_bytes() const {
    return static_cast<int64_t>(ring_.size() * sizeof(int32_t) + table_.size() * sizeof(Slot));
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int64_t next = -1;  // absolute position (written_ counter) after the n-gram
  };
  static constexpr int32_t kSeparator = -1;
  int32_t At(int64_t abs) const { return ring_[static_cast<size_t>(abs % capacity_)]; }
  static uint64_t Hash(const int32_t* begin, int32_t n);

  int32_t min_n_, max_n_;
  int64_t capacity_;
  std::vector<int32_t> ring_;
  std::vector<Slot> table_;
  int64_t written_ = 0;  // tokens ever written; the ring holds [written_ - capacity_, written_)
};

// Lossless verification of one draft token d drawn from a draft
// distribution q against the target distribution p (both normalised, same
// size): accept d with probability min(1, p(d) / q(d)); on reject draw from
// norm(max(p - q, 0)). The emitted token is distributed exactly as p.
//
// The engine's drafts are deterministic (q one-hot at d), for which this is
// accept with probability p(d), else draw from p without d — exactly what
// drawing x ~ p with the sequence's own Sampler and accepting iff x == d
// does (OutputProcessor::Verify). That coupled form uses the same random
// draw a plain decode step would, so even seeded sampling gives the same
// output with speculation on and off.
struct SpecVerdict {
  int32_t token = -1;
  bool accepted = false;
};
SpecVerdict RejectionSample(absl::Span<const double> p, absl::Span<const double> q, int32_t draft,
                            std::mt19937_64* rng);

struct SpeculationOptions {
  SpecMode mode = SpecMode::kOff;  // for requests that leave it unset
  int32_t ngram_min = 2;
  int32_t ngram_max = 4;
  int32_t max_k = 8;               // draft tokens per sequence per step at most
  int64_t suffix_capacity_tokens = 1 << 18;
  // false: every proposal is verified in full (tests; measuring the cost
  // model's effect).
  bool adaptive = true;
};
// InvalidArgument naming the bad option.
[[nodiscard]] absl::Status ValidateSpeculationOptions(const SpeculationOptions& o);

inline constexpr int kMaxSpecK = 16;  // the scheduler verifies at most 16 draft tokens a step
// Match lengths the acceptance statistics tell apart (the last: that or more).
inline constexpr int kSpecMatchBuckets = 8;

struct SpeculationStats {
  int64_t proposed_tokens = 0;  // draft tokens verified
  int64_t accepted_tokens = 0;  // of those, kept
  int64_t drafts = 0;           // sequence-steps that verified a draft
  int64_t emitted_tokens = 0;   // tokens those sequence-steps produced (accepted + 1 each)
  std::array<int64_t, kNumDraftSources> proposed_by_source{};
  std::array<int64_t, kNumDraftSources> accepted_by_source{};
  // Position j (0-based) of a draft: how often it was verified, and kept.
  std::array<int64_t, kMaxSpecK> proposed_by_position{};
  std::array<int64_t, kMaxSpecK> accepted_by_position{};
  // By the match length the draft was found on (1 to 8, the last "8 or more").
  std::array<int64_t, kSpecMatchBuckets> proposed_by_match{};
  std::array<int64_t, kSpecMatchBuckets> accepted_by_match{};
  int64_t skipped_by_cost = 0;  // proposals the cost model dropped in full
  int64_t cut_by_grammar = 0;   // proposals whose first token the request's grammar refuses
  int64_t held_for_prompts = 0;  // steps without drafts because prompts waited
  // The measured step cost line (alpha + beta * tokens) the decisions use
  // for step sizes the per-size table has not measured.
  double step_fixed_ms = 0;
  double step_ms_per_token = 0;
  // Step sizes (tokens) the table prices from measurements now.
  int32_t step_sizes_measured = 0;
  int64_t suffix_index_tokens = 0;
  int64_t suffix_index_bytes = 0;
};

// What a step of decode and verify tokens costs, measured online over steps
// without prompt chunks: for each step size (tokens) seen lately, the
// decayed mean time of steps of that size; for other sizes, a least-squares
// line alpha + beta * tokens over all of them, exponentially decayed (until
// it has steps of clearly different sizes the line assumes
// beta = alpha * prior_ratio). The table is what the decisions use where it
// has data: a step's cost is not linear in its tokens (on a CPU a few
// tokens cost about one, since the weights stream once, and past that the
// cost grows with every token), and a line through both regimes prices
// drafts wrong in both.
class StepCostFit {
 public:
  static constexpr int32_t kTableTokens = 256;  // sizes the table keeps
  explicit StepCostFit(double prior_ratio = 1.0 / 16) : prior_ratio_(prior_ratio) {}
  void Observe(int32_t tokens, double seconds);
  double alpha() const { return alpha_; }
  double beta() const { return beta_; }
  bool ready() const { return w_ > 0; }
  // Predicted seconds of a step of `tokens` tokens: the table's mean for a
  // size observed at least twice among the last kStaleSteps steps, else the
  // line.
  double Predict(int32_t tokens) const;
  // Whether Predict(tokens) comes from the table.
  bool Measured(int32_t tokens) const;

 private:
  static constexpr double kSizeDecay = 0.9;     // ~10 recent steps per size
  static constexpr int64_t kStaleSteps = 4096;  // then re-priced by the line
  struct Size {
    double mean = 0, w = 0;
    int64_t last = 0;
  };
  double prior_ratio_;
  double decay_ = 0.995;
  double w_ = 0, sx_ = 0, sy_ = 0, sxx_ = 0, sxy_ = 0;
  double alpha_ = 1, beta_ = 1.0 / 16;
  std::vector<Size> sizes_ = std::vector<Size>(kTableTokens + 1);
  int64_t observed_ = 0;
};

// The adaptive choice: given `batch` decoding sequences, and for each
// sequence with a draft its acceptance estimate and draft length, how many
// draft tokens each verifies. Draft token j of a sequence with acceptance a
// is worth a^j expected tokens; tokens are ordered best first and the
// number K kept is the one that maximizes predicted tokens per second,
// (batch + sum of the first K values) / cost.Predict(batch + K), provided
// that beats plain decoding, batch / cost.Predict(batch), by more than
// min_gain (a fraction): below that the measured difference is noise, and
// speculation that does not clearly pay is turned off.
struct DraftOffer {
  double acceptance = 0;
  int32_t length = 0;
};
std::vector<int32_t> SizeDrafts(int32_t batch, absl::Span<const DraftOffer> offers,
                                const StepCostFit& cost, double min_gain);

// The acceptance a new sequence's drafts start from, learned from the
// drafts every earlier sequence verified: per proposer and per match length
// (the tokens of context the draft was matched on, 1 to kMatchBuckets, the
// last bucket holding every longer match), as exponentially decayed
// (accepted, trials) counts. A bucket with little evidence leans on its
// proposer's overall rate, which leans on 1/2. One prior per proposer let a
// run of code edits (long matches, most accepted) set the prior of the chat
// requests after them (short matches, few accepted): chat then drafted at a
// loss until each sequence had seen its own rejections.
class AcceptancePriors {
 public:
  static constexpr int kMatchBuckets = kSpecMatchBuckets;
  static int Bucket(int32_t match_length) { return std::clamp(match_length, 1, kMatchBuckets) - 1; }
  // `accepted` of `trials` conditional acceptances, from one verified draft.
  void Observe(DraftSource src, int32_t match_length, double accepted, double trials);
  // The estimated acceptance of a draft token, in (0, 1).
  double Estimate(DraftSource src, int32_t match_length) const;

 private:
  static constexpr double kDecay = 0.98;      // per verified draft
  static constexpr double kSourceWeight = 4;  // trials the proposer's rate counts as in a bucket
  struct Counts {
    double hits = 0, trials = 0;
  };
  std::array<Counts, kNumDraftSources> source_{};
  std::array<std::array<Counts, kMatchBuckets>, kNumDraftSources> bucket_{};
};

class Speculator {
 public:
  explicit Speculator(const SpeculationOptions& options);

  // Before scheduling: gives the running sequences that are decoding (one
  // token of input left, n = 1, no KV policy, speculation on for them) a
  // draft, sized by the cost model. With `prompts_pending` (prompt chunks
  // will share the step) no sequence gets one: the step is compute-bound,
  // and verify tokens would take the chunks' budget (counted in
  // SpeculationStats::held_for_prompts).
  void Propose(const std::vector<Sequence*>& running, bool prompts_pending = false);
  // After OutputProcessor::Process: what the drafts earned, and the step's
  // cost. REQUIRES: every sequence Propose saw is still alive (OnDestroy
  // first for those that are not).
  void AfterStep(const BatchPlan& plan, double seconds);
  // The sequence is about to be destroyed: forget it (its output feeds the
  // suffix index).
  void OnDestroy(const Sequence* s);

  SpeculationStats stats() const;
  const SpeculationOptions& options() const { return options_; }
  // The mode that applies to s.
  SpecMode ModeOf(const Sequence& s) const;

 private:
  struct SeqSpec {
    double acc_hits = 0, acc_trials = 0;  // decayed acceptance counts
    // A draft in flight.
    int32_t pending_k = 0;
    int32_t accepted_before = 0;
    DraftSource pending_source = DraftSource::kNgram;
    int32_t pending_match = 0;
  };
  double AcceptanceOf(const SeqSpec& st, const DraftProposal& p) const;

  SpeculationOptions options_;
  PromptLookupProposer ngram_;
  ReferenceProposer reference_;
  SuffixIndex suffix_;
  StepCostFit cost_;
  std::unordered_map<const Sequence*, SeqSpec> seqs_;
  // The prior for a new sequence, per source and match length.
  AcceptancePriors priors_;
  // This step's drafts: sequence -> draft length (to classify the step for the cost fit).
  std::unordered_map<const Sequence*, int32_t> step_drafts_;
  SpeculationStats stats_;
};

}  // namespace kvserve
