#include "scheduler/request.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvserve {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kDeadline: return "deadline";
  }
  return "";
}

absl::Status ValidateEngineRequest(const EngineRequest& request, const RequestLimits& limits) {
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: token id ", t, " is outside the vocabulary [0, ", limits.vocab_size, ")"));
    }
  }
  if (request.n < 1 || request.n > limits.max_n) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be between 1 and ", limits.max_n, " (got ", request.n, ")"));
  }
  RETURN_IF_ERROR(ValidateSamplingParams(request.params));
  const int64_t need = static_cast<int64_t>(request.prompt.size()) + request.params.max_tokens;
  if (need > limits.context_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens: prompt (", request.prompt.size(), " tokens) + max_tokens (",
        request.params.max_tokens, ") exceeds the context length ", limits.context_length));
  }
  if (request.cache_salt.size() > limits.max_cache_salt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache_salt: ", request.cache_salt.size(),
                                                   " bytes; at most ",
                                                   limits.max_cache_salt_bytes));
  }
  // A sequence that could never fit would wait forever.
  const int64_t blocks = (need + limits.block_size - 1) / limits.block_size;
  if (limits.num_blocks > 0 && blocks > limits.num_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat("request needs ", blocks,
                                                     " KV blocks; the cache has ",
                                                     limits.num_blocks));
  }
  return absl::OkStatus();
}

}  // namespace kvserve
