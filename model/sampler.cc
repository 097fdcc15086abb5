#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvserve {
namespace {

constexpr size_t kMaxStopStrings = 8;
constexpr size_t kMaxStopStringBytes = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Running log-sum-exp: one pass, and stable because every exp() argument is
// <= 0. -inf (masked) logits contribute nothing and are skipped explicitly,
// since (-inf) - (-inf) would be NaN.
class OnlineLogSumExp {
 public:
  void Add(float x) {
    if (!(x > kNegInf)) return;  // -inf or NaN
    if (x > max_) {
      sum_ = sum_ * std::exp(static_cast<double>(max_) - x) + 1.0;
      max_ = x;
    } else {
      sum_ += std::exp(static_cast<double>(x) - max_);
    }
  }
  double Value() const { return sum_ == 0.0 ? kNegInf : max_ + std::log(sum_); }

 private:
  float max_ = kNegInf;
  double sum_ = 0.0;
};

float RawLogprob(absl::Span<const float> logits, int32_t token) {
  OnlineLogSumExp lse;
  for (float x : logits) lse.Add(x);
  return static_cast<float>(logits[token] - lse.Value());
}

bool InRange(int32_t token, size_t vocab) {
  return token >= 0 && static_cast<size_t>(token) < vocab;
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, got ", p.temperature));
  }
  // Written as !(in range) so that NaN is rejected too.
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", p.top_k));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", p.min_p));
  }
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be finite and > 0, got ", p.repetition_penalty));
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("presence_penalty must be in [-2, 2], got ", p.presence_penalty));
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("frequency_penalty must be in [-2, 2], got ", p.frequency_penalty));
  }
  if (p.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", p.max_tokens));
  }
  if (p.stop.size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", kMaxStopStrings,
                                                   " stop strings, got ", p.stop.size()));
  }
  for (size_t i = 0; i < p.stop.size(); ++i) {
    if (p.stop[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is empty"));
    }
    if (p.stop[i].size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is ", p.stop[i].size(),
                                                     " bytes; the limit is ",
                                                     kMaxStopStringBytes));
    }
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  if (params_.has_seed) {
    rng_.seed(params_.seed);
  } else {
    // random_device yields 32 bits; two draws fill the 64-bit engine's seed.
    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }
}

bool Sampler::HasPenalties() const {
  return params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
         params_.frequency_penalty != 0.0f;
}

void Sampler::ApplyPenalties(absl::Span<const int32_t> prompt,
                             absl::Span<const int32_t> generated) {
  const size_t vocab = scratch_.size();
  // Sorting the ids (instead of a vocab-sized mask) keeps the cost
  // proportional to the sequence length, not the vocabulary.
  if (params_.repetition_penalty != 1.0f) {
    index_scratch_.assign(prompt.begin(), prompt.end());
    index_scratch_.insert(index_scratch_.end(), generated.begin(), generated.end());
    std::sort(index_scratch_.begin(), index_scratch_.end());
    index_scratch_.erase(std::unique(index_scratch_.begin(), index_scratch_.end()),
                         index_scratch_.end());
    const float penalty = params_.repetition_penalty;
    for (int32_t t : index_scratch_) {
      if (!InRange(t, vocab)) continue;
      float& x = scratch_[t];
      // CTRL: always push the token towards "less likely", whatever its sign.
      x = x > 0.0f ? x / penalty : x * penalty;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    index_scratch_.assign(generated.begin(), generated.end());
    std::sort(index_scratch_.begin(), index_scratch_.end());
    for (size_t i = 0; i < index_scratch_.size();) {
      size_t j = i;
      while (j < index_scratch_.size() && index_scratch_[j] == index_scratch_[i]) ++j;
      const int32_t t = index_scratch_[i];
      if (InRange(t, vocab)) {
        const float count = static_cast<float>(j - i);
        scratch_[t] -= params_.presence_penalty + params_.frequency_penalty * count;
      }
      i = j;
    }
  }
}

SampleResult Sampler::Sample(absl::Span<const float> logits, absl::Span<const int32_t> prompt,
                             absl::Span<const int32_t> generated) {
  SampleResult result;
  if (logits.empty()) return result;
  const size_t vocab = logits.size();

  // Penalties need a private copy; without them the raw logits are read
  // directly so greedy decoding stays a single pass over the vocabulary.
  const bool penalized = HasPenalties();
  absl::Span<const float> work = logits;
  if (penalized) {
    scratch_.assign(logits.begin(), logits.end());
    ApplyPenalties(prompt, generated);
    work = scratch_;
  }

  if (params_.temperature == 0.0f) {
    // Strict '>' keeps the lowest id among ties. The raw log-sum-exp rides
    // along in the same pass.
    OnlineLogSumExp lse;
    int32_t best = 0;
    float best_value = work[0];
    lse.Add(logits[0]);
    for (size_t i = 1; i < vocab; ++i) {
      lse.Add(logits[i]);
      if (work[i] > best_value) {
        best_value = work[i];
        best = static_cast<int32_t>(i);
      }
    }
    result.token = best;
    result.logprob = static_cast<float>(logits[best] - lse.Value());
    return result;
  }

  if (!penalized) scratch_.assign(logits.begin(), logits.end());
  result.token = SampleFromScratch();
  result.logprob = RawLogprob(logits, result.token);
  return result;
}

int32_t Sampler::SampleFromScratch() {
  const size_t vocab = scratch_.size();
  // Candidates: every token that is not masked out with -inf.
  index_scratch_.clear();
  for (size_t i = 0; i < vocab; ++i) {
    if (scratch_[i] > kNegInf) index_scratch_.push_back(static_cast<int32_t>(i));
  }
  if (index_scratch_.empty()) return 0;  // everything masked: nothing to choose from

  // Descending logit, ties broken by id so results do not depend on the
  // partition algorithm's internals.
  const auto higher = [this](int32_t a, int32_t b) {
    return scratch_[a] > scratch_[b] || (scratch_[a] == scratch_[b] && a < b);
  };
  auto begin = index_scratch_.begin();
  auto end = index_scratch_.end();

  // Top-k: nth_element is O(vocab); only the k survivors are ever sorted.
  const size_t k = static_cast<size_t>(params_.top_k);
  bool sorted = false;
  if (k > 0 && k < index_scratch_.size()) {
    std::nth_element(begin, begin + k, end, higher);
    end = begin + k;
    if (params_.top_p < 1.0f) {
      std::sort(begin, end, higher);
      sorted = true;
    }
  }

  // Softmax numerators, written over the logits in place (ordering by logit
  // equals ordering by probability, so `higher` stays valid). Temperature
  // divides the logit difference, so the max candidate gets weight 1.
  float max_logit = kNegInf;
  for (auto it = begin; it != end; ++it) max_logit = std::max(max_logit, scratch_[*it]);
  const float inv_temperature = 1.0f / params_.temperature;
  double total = 0.0;
  for (auto it = begin; it != end; ++it) {
    float& x = scratch_[*it];
    x = std::exp((x - max_logit) * inv_temperature);
    total += x;
  }

  if (params_.top_p < 1.0f) {
    // Sort only as far as the nucleus reaches: grow a sorted prefix by
    // doubling, with nth_element picking the next slice. A peaked
    // distribution touches a few dozen tokens instead of the whole vocab.
    const double target = static_cast<double>(params_.top_p) * total;
    double cumulative = 0.0;
    size_t sorted_to = sorted ? static_cast<size_t>(end - begin) : 0;
    size_t taken = 0;
    const size_t n = static_cast<size_t>(end - begin);
    size_t window = 64;
    while (taken < n) {
      if (taken == sorted_to) {
        const size_t next = std::min(n, sorted_to + window);
        if (next < n) std::nth_element(begin + sorted_to, begin + next, end, higher);
        std::sort(begin + sorted_to, begin + next, higher);
        sorted_to = next;
        window *= 2;
      }
      cumulative += scratch_[begin[taken]];
      ++taken;
      if (cumulative >= target) break;
    }
    end = begin + taken;
    total = cumulative;
  }

  if (params_.min_p > 0.0f) {
    // Weights are relative to the max (which is 1), so min_p * p_max is
    // min_p itself; renormalizing later does not move the threshold. The
    // max-weight token always survives since min_p <= 1.
    end = std::remove_if(begin, end, [&](int32_t t) { return scratch_[t] < params_.min_p; });
    total = 0.0;
    for (auto it = begin; it != end; ++it) total += scratch_[*it];
  }

  // Inverse-CDF draw over the surviving weights; dividing by `total` is the
  // renormalization.
  std::uniform_real_distribution<double> uniform(0.0, total);
  const double r = uniform(rng_);
  double cumulative = 0.0;
  int32_t last_positive = *begin;
  for (auto it = begin; it != end; ++it) {
    const float w = scratch_[*it];
    if (w <= 0.0f) continue;
    cumulative += w;
    last_positive = *it;
    if (r < cumulative) return *it;
  }
  // Rounding can leave r == cumulative at the very end.
  return last_positive;
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) {
  // An empty stop string would match before any text; validation rejects
  // it, and here it is simply ignored.
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
  // KMP failure tables: failure_[i][j] is the length of the longest proper
  // border of stops_[i][0..j].
  failure_.resize(stops_.size());
  state_.assign(stops_.size(), 0);
  for (size_t i = 0; i < stops_.size(); ++i) {
    const std::string& s = stops_[i];
    std::vector<size_t>& f = failure_[i];
    f.assign(s.size(), 0);
    size_t k = 0;
    for (size_t j = 1; j < s.size(); ++j) {
      while (k > 0 && s[j] != s[k]) k = f[k - 1];
      if (s[j] == s[k]) ++k;
      f[j] = k;
    }
  }
}

std::string StopStringMatcher::Push(std::string_view text) {
  if (stopped_) return {};
  // One KMP automaton per stop string keeps, for each, the longest suffix of
  // the stream that is a prefix of it. Advancing byte by byte finds the
  // match that *ends* first, which makes the result independent of how the
  // text was chunked; among matches ending at the same byte the longest
  // wins, so none of its prefix leaks out.
  for (size_t pos = 0; pos < text.size(); ++pos) {
    const char c = text[pos];
    size_t matched = stops_.size();
    for (size_t i = 0; i < stops_.size(); ++i) {
      const std::string& s = stops_[i];
      size_t k = state_[i];
      while (k > 0 && s[k] != c) k = failure_[i][k - 1];
      if (s[k] == c) ++k;
      state_[i] = k;
      if (k == s.size() && (matched == stops_.size() || s.size() > stops_[matched].size())) {
        matched = i;
      }
    }
    if (matched != stops_.size()) {
      held_.append(text.substr(0, pos + 1));
      // The automaton state never exceeds the unreleased text (released
      // text provably cannot be part of a match), so this does not underflow.
      held_.resize(held_.size() - stops_[matched].size());
      std::string out = std::move(held_);
      held_.clear();
      stopped_ = true;
      matched_ = stops_[matched];
      return out;
    }
  }
  held_.append(text);
  size_t keep = 0;
  for (size_t k : state_) keep = std::max(keep, k);
  keep = std::min(keep, held_.size());  // cannot trigger; see the invariant above
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::Flush() {
  if (stopped_) return {};
  std::fill(state_.begin(), state_.end(), 0);
  return std::exchange(held_, std::string());
}

}  // namespace kvserve
