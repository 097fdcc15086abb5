#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops.h"

namespace kvserve {
namespace {

constexpr size_t kMaxStopStrings = 8;
constexpr size_t kMaxStopStringBytes = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

float Sampler::RawLogprob(absl::Span<const float> logits, int32_t token) {
  // Shifting by the max here, not only inside the kernel, keeps precision:
  // the kernel returns max + log(sum) as a float, and for logits near 1000
  // that float's rounding alone is ~1e-4. With the shift it returns just
  // log(sum), a small number. The SIMD softmax kernel is several times
  // faster than scalar exp() over a 49152-entry vocabulary.
  float max = kNegInf;
  for (float x : logits) max = std::max(max, x);
  if (max == kNegInf) return kNegInf;  // every logit masked
  lse_scratch_.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) lse_scratch_[i] = logits[i] - max;
  const float log_sum =
      kernels::SoftmaxInPlace(lse_scratch_.data(), static_cast<int64_t>(lse_scratch_.size()));
  return (logits[token] - max) - log_sum;
}

void Sampler::ApplyMask(absl::Span<const uint32_t> allowed) {
  const size_t vocab = scratch_.size();
  for (size_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t bits = w < allowed.size() ? allowed[w] : 0u;
    if (bits == ~0u) continue;  // the common case in free text: all 32 allowed
    const size_t end = std::min(vocab, w * 32 + 32);
    for (size_t i = w * 32; i < end; ++i) {
      if (!((bits >> (i - w * 32)) & 1u)) scratch_[i] = kNegInf;
    }
  }
}

SampleResult Sampler::Sample(absl::Span<const float> logits, absl::Span<const int32_t> prompt,
                             absl::Span<const int32_t> generated,
                             absl::Span<const uint32_t> allowed) {
  SampleResult result;
  if (logits.empty()) return result;
  const size_t vocab = logits.size();

  // Penalties and a mask need a private copy; without them greedy reads the
  // raw logits directly.
  const bool masked = !allowed.empty();
  const bool penalized = HasPenalties() || masked;
  if (penalized) {
    scratch_.assign(logits.begin(), logits.end());
    if (HasPenalties()) ApplyPenalties(prompt, generated);
    if (masked) ApplyMask(allowed);
  }

  if (params_.temperature == 0.0f) {
    // One pass; strict '>' keeps the lowest id among ties (vectorized:
    // Gemma's 262k logits cost ~0.1 ms a token in the scalar loop).
    const float* work = penalized ? scratch_.data() : logits.data();
    result.token = static_cast<int32_t>(kernels::ArgMax(work, static_cast<int64_t>(vocab)));
  } else {
    if (!penalized) scratch_.assign(logits.begin(), logits.end());
    result.token = SampleFromScratch();
  }
  // A full-vocabulary log-softmax costs as much as the draw itself; only
  // requests that asked for log-probabilities pay for it.
  if (params_.logprobs) result.logprob = RawLogprob(logits, result.token);
  return result;
}

namespace {

// Candidate order: higher weight first, ties to the lower id. A strict total
// order, so every selection below picks the same set whatever the input
// order or partition internals.
template <typename C>
bool Higher(const C& a, const C& b) {
  return a.weight > b.weight || (a.weight == b.weight && a.id < b.id);
}

// Weighted quickselect: rearranges c so that c[0, m) holds the m highest
// candidates, for the smallest m whose weights sum to >= target (m >= 1
// when target > 0). Expected O(n), against O(n log n) for sorting; the
// nucleus of a flat distribution can be most of the vocabulary. Returns m
// and sets *mass to the weight of c[0, m).
template <typename C>
size_t SelectNucleus(std::vector<C>& c, double target, double* mass) {
  size_t lo = 0;
  size_t hi = c.size();
  double above = 0.0;  // weight of c[0, lo), all of which are in the nucleus
  // Invariant: c[0, lo) > c[lo, hi) > c[hi, n) under Higher, and
  // above < target.
  while (lo < hi) {
    // Median of three as the pivot, parked at hi - 1.
    const size_t mid = lo + (hi - lo) / 2;
    if (Higher(c[mid], c[lo])) std::swap(c[mid], c[lo]);
    if (Higher(c[hi - 1], c[lo])) std::swap(c[hi - 1], c[lo]);
    if (Higher(c[mid], c[hi - 1])) std::swap(c[mid], c[hi - 1]);
    const C pivot = c[hi - 1];
    const auto split = std::partition(c.begin() + lo, c.begin() + (hi - 1),
                                      [&](const C& x) { return Higher(x, pivot); });
    const size_t s = static_cast<size_t>(split - c.begin());
    double higher_mass = 0.0;
    for (size_t i = lo; i < s; ++i) higher_mass += c[i].weight;
    if (above + higher_mass >= target) {
      hi = s;  // the boundary is among the higher ones; s > lo since above < target
      continue;
    }
    above += higher_mass;
    std::swap(c[s], c[hi - 1]);
    above += pivot.weight;
    if (above >= target) {
      *mass = above;
      return s + 1;
    }
    lo = s + 1;
  }
  // Only reachable when rounding left the total just short of target:
  // everything is in.
  *mass = above;
  return lo;
}

}  // namespace

int32_t Sampler::SampleFromScratch() {
  const size_t vocab = scratch_.size();
  const float inv_temperature = 1.0f / params_.temperature;
  candidates_.clear();
  double total = 0.0;
  float max_weight = 0.0f;

  const size_t k = static_cast<size_t>(params_.top_k);
  if (k > 0 && k < vocab) {
    // Top-k by logit. For the usual small k a bounded heap is one pass with
    // a single compare per token (replacements are rare once the heap holds
    // good tokens); for large k, nth_element over everything.
    if (k * 8 <= vocab) {
      for (size_t i = 0; i < vocab; ++i) {
        const Candidate c{scratch_[i], static_cast<int32_t>(i)};
        if (!(c.weight > kNegInf)) continue;  // masked
        if (candidates_.size() < k) {
          candidates_.push_back(c);
          std::push_heap(candidates_.begin(), candidates_.end(), Higher<Candidate>);
        } else if (Higher(c, candidates_.front())) {
          // The heap's front is its lowest-ranked member.
          std::pop_heap(candidates_.begin(), candidates_.end(), Higher<Candidate>);
          candidates_.back() = c;
          std::push_heap(candidates_.begin(), candidates_.end(), Higher<Candidate>);
        }
      }
    } else {
      for (size_t i = 0; i < vocab; ++i) {
        if (scratch_[i] > kNegInf) candidates_.push_back({scratch_[i], static_cast<int32_t>(i)});
      }
      if (k < candidates_.size()) {
        std::nth_element(candidates_.begin(), candidates_.begin() + k, candidates_.end(),
                         Higher<Candidate>);
        candidates_.resize(k);
      }
    }
    if (candidates_.empty()) return 0;  // everything masked
    // Softmax numerators over the survivors only; the max gets weight 1.
    float max_logit = kNegInf;
    for (const Candidate& c : candidates_) max_logit = std::max(max_logit, c.weight);
    for (Candidate& c : candidates_) {
      c.weight = std::exp((c.weight - max_logit) * inv_temperature);
      total += c.weight;
    }
    max_weight = 1.0f;
  } else {
    // Softmax over the whole vocabulary with the SIMD kernel.
    if (params_.temperature != 1.0f) {
      for (float& x : scratch_) x *= inv_temperature;
    }
    const float lse = kernels::SoftmaxInPlace(scratch_.data(), static_cast<int64_t>(vocab));
    if (lse == kNegInf) return 0;  // everything masked
    candidates_.reserve(vocab);
    for (size_t i = 0; i < vocab; ++i) {
      const float p = scratch_[i];
      if (p > 0.0f) {
        candidates_.push_back({p, static_cast<int32_t>(i)});
        total += p;
        max_weight = std::max(max_weight, p);
      }
    }
    if (candidates_.empty()) return 0;
  }

  size_t n = candidates_.size();
  if (params_.top_p < 1.0f) {
    n = SelectNucleus(candidates_, static_cast<double>(params_.top_p) * total, &total);
  }

  if (params_.min_p > 0.0f) {
    // Relative to the most likely token (always in the nucleus); renormalizing
    // scales every probability alike, so the threshold does not move. That
    // token always survives since min_p <= 1.
    const float threshold = params_.min_p * max_weight;
    const auto end = std::remove_if(candidates_.begin(), candidates_.begin() + n,
                                    [&](const Candidate& c) { return c.weight < threshold; });
    n = static_cast<size_t>(end - candidates_.begin());
    total = 0.0;
    for (size_t i = 0; i < n; ++i) total += candidates_[i].weight;
  }

  // Inverse-CDF draw; dividing by `total` is the renormalization.
  std::uniform_real_distribution<double> uniform(0.0, total);
  const double r = uniform(rng_);
  double cumulative = 0.0;
  int32_t last_positive = candidates_[0].id;
  for (size_t i = 0; i < n; ++i) {
    const float w = candidates_[i].weight;
    if (w <= 0.0f) continue;  // underflowed at a tiny temperature
    cumulative += w;
    last_positive = candidates_[i].id;
    if (r < cumulative) return candidates_[i].id;
  }
  // Rounding (sums taken in different orders) can leave r just past the
  // end; the last token that had any weight is the right one then.
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
