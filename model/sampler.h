// Token sampling from logits, and stop-string detection over streamed text.
//
// Thread-safety: a Sampler belongs to one sequence; not thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvserve {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off (CTRL-style: divide positive logits)
  float presence_penalty = 0.0f;    // OpenAI-style, over generated tokens
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  bool has_seed = false;     // without a seed, one is drawn at random
  int32_t max_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings
  bool ignore_eos = false;
  bool logprobs = false;
};

// InvalidArgument naming the field for out-of-range parameters.
[[nodiscard]] absl::Status ValidateSamplingParams(const SamplingParams& p);

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;  // log-probability of `token` under the model's raw distribution
                         // (computed only when SamplingParams::logprobs is set)
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // logits: vocab_size floats (not modified). prompt: the prompt's token ids
  // (repetition penalty covers prompt + generated); generated: tokens sampled
  // so far (presence/frequency penalties).
  // allowed: empty, or a bitmask over the vocabulary (bit i of word i / 32:
  // token i may be drawn; grammar-constrained decoding): every other token's
  // logit is -inf before greedy or sampled selection. The log-probability
  // stays the raw distribution's.
  SampleResult Sample(absl::Span<const float> logits, absl::Span<const int32_t> prompt,
                      absl::Span<const int32_t> generated,
                      absl::Span<const uint32_t> allowed = {});

 private:
  // A token still in the running, with its (possibly unnormalized)
  // probability, or its logit before the softmax.
  struct Candidate {
    float weight;
    int32_t id;
  };

  bool HasPenalties() const;
  // Applies repetition, presence and frequency penalties to scratch_.
  void ApplyPenalties(absl::Span<const int32_t> prompt, absl::Span<const int32_t> generated);
  // Sets scratch_[i] to -inf for every token `allowed` does not set.
  void ApplyMask(absl::Span<const uint32_t> allowed);
  // REQUIRES: temperature > 0; scratch_ holds the (penalized) logits.
  // Overwrites scratch_ and returns the drawn token.
  int32_t SampleFromScratch();
  // log_softmax(logits)[token], using lse_scratch_.
  float RawLogprob(absl::Span<const float> logits, int32_t token);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> scratch_;
  std::vector<float> lse_scratch_;
  std::vector<int32_t> index_scratch_;
  std::vector<Candidate> candidates_;
};

// Watches streamed text for stop strings. Push returns the text that is safe
// to emit: text that might be the start of a stop string is held back until
// it is decided; on a match, everything before the stop string is emitted and
// stopped() becomes true.
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);
  std::string Push(std::string_view text);
  // End of stream without a match: releases what was held back.
  std::string Flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  // Per stop string: KMP failure table, and the length of the longest
  // suffix of the stream so far that is a prefix of it.
  std::vector<std::vector<size_t>> failure_;
  std::vector<size_t> state_;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace kvserve
