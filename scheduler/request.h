// The engine's request and event types, and the one place that validates a
// request. Both front ends (server/model_service.cc) and Engine::Submit call
// ValidateEngineRequest, so a rule and its message exist once: a bad field is
// InvalidArgument naming it; a request the KV pool could never hold is
// ResourceExhausted.
//
// Plain data; no thread-safety concerns.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/sampler.h"

namespace kvserve {

struct EngineRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
  int32_t n = 1;         // parallel samples sharing the prompt's KV blocks
  int32_t priority = 0;  // higher runs first; FCFS within a priority
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // Prefix-cache namespace: requests share cached blocks only with requests
  // of the same salt (tenant isolation).
  std::string cache_salt{};
};

// What a request is checked against: the model's and the engine's limits.
struct RequestLimits {
  int32_t vocab_size = 0;
  int32_t context_length = 0;
  int32_t max_n = 16;
  int32_t block_size = 16;
  int64_t num_blocks = 0;  // KV pool size; 0: not checked
  size_t max_cache_salt_bytes = 256;
};

// OK, or InvalidArgument naming the first bad field (prompt, n, max_tokens,
// the sampling parameters, cache_salt), or ResourceExhausted when prompt +
// max_tokens needs more KV blocks than the pool has.
[[nodiscard]] absl::Status ValidateEngineRequest(const EngineRequest& request,
                                                 const RequestLimits& limits);

enum class FinishReason { kNone, kStop, kLength, kCancelled, kDeadline };
const char* FinishReasonName(FinishReason r);

// One update for one sample of a request.
struct SeqEvent {
  uint64_t request_id = 0;
  int32_t index = 0;               // sample index in [0, n)
  std::vector<int32_t> token_ids;  // tokens produced by this step
  std::vector<float> logprobs;
  std::string text;                // text that became final (whole UTF-8 characters)
  FinishReason finish = FinishReason::kNone;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;   // so far
  int32_t cached_tokens = 0;       // prompt tokens served from the prefix cache
};
using EventCallback = std::function<void(const SeqEvent&)>;

}  // namespace kvserve
