#include "scheduler/request.h"

#include <algorithm>

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

const char* KvPolicyName(KvPolicy::Kind k) {
  switch (k) {
    case KvPolicy::Kind::kNone: return "none";
    case KvPolicy::Kind::kWindow: return "window";
    case KvPolicy::Kind::kSinks: return "sinks";
    case KvPolicy::Kind::kH2O: return "h2o";
  }
  return "";
}

absl::Status ParseKvPolicyKind(std::string_view name, KvPolicy::Kind* out) {
  for (KvPolicy::Kind k : {KvPolicy::Kind::kNone, KvPolicy::Kind::kWindow, KvPolicy::Kind::kSinks,
                           KvPolicy::Kind::kH2O}) {
    if (name == KvPolicyName(k)) {
      *out = k;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("kv_policy: unknown policy '", std::string(name),
                                                 "' (expected none, window, sinks or h2o)"));
}

namespace {

absl::Status ValidateKvPolicy(const KvPolicy& p, const RequestLimits& limits) {
  if (p.kind == KvPolicy::Kind::kNone) return absl::OkStatus();
  if (!limits.kv_eviction_unsupported.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_policy: ", KvPolicyName(p.kind), " is not available on this server: ",
                     limits.kv_eviction_unsupported));
  }
  if (p.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_policy.window must be >= 1 (got ", p.window, ")"));
  }
  if (p.kind != KvPolicy::Kind::kWindow && p.sinks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_policy.sinks must be >= 0 (got ", p.sinks, ")"));
  }
  if (p.kind == KvPolicy::Kind::kH2O && p.budget <= p.sinks + p.window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_policy.budget (", p.budget, ") must be larger than sinks + window (", p.sinks, " + ",
        p.window, "): the rest is the heavy hitters' share"));
  }
  if (limits.context_length > 0 && p.capacity() > limits.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("kv_policy keeps up to ", p.capacity(),
                                                   " tokens, more than the context length ",
                                                   limits.context_length));
  }
  return absl::OkStatus();
}

}  // namespace

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
  const bool streaming = (request.kv_policy.kind == KvPolicy::Kind::kSinks ||
                         request.kv_policy.kind == KvPolicy::Kind::kWindow) &&
                        limits.kv_past_context;
  if (need > limits.context_length && !streaming) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens: prompt (", request.prompt.size(), " tokens) + max_tokens (",
        request.params.max_tokens, ") exceeds the context length ", limits.context_length));
  }
  if (request.cache_salt.size() > limits.max_cache_salt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache_salt: ", request.cache_salt.size(),
                                                   " bytes; at most ",
                                                   limits.max_cache_salt_bytes));
  }
  RETURN_IF_ERROR(ValidateKvPolicy(request.kv_policy, limits));
  // Past the trained context the kept tokens and a step's worth must fit in
  // it: positions within the cache never reach the context length.
  int64_t held = need;
  if (streaming && need > limits.context_length) {
    const int64_t most = int64_t{request.kv_policy.capacity()} + limits.kv_switch_margin;
    if (most >= limits.context_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_policy keeps ", request.kv_policy.capacity(), " tokens; they plus a step (",
          limits.kv_switch_margin, " tokens) must stay below the context length ",
          limits.context_length, " to generate past it"));
    }
    held = most;
  }
  if (!request.draft_tokens.empty()) {
    // Verification must reproduce what decoding would: one deterministic
    // sampler run per position, one sequence, every slot kept.
    if (request.params.temperature != 0.0f) {
      return absl::InvalidArgumentError("draft_tokens: only greedy requests (temperature 0)");
    }
    if (request.n != 1) return absl::InvalidArgumentError("draft_tokens: only with n = 1");
    if (request.kv_policy.kind != KvPolicy::Kind::kNone) {
      return absl::InvalidArgumentError("draft_tokens: only with kv_policy none");
    }
    if (static_cast<int64_t>(request.draft_tokens.size()) > request.params.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("draft_tokens: ", request.draft_tokens.size(),
                                                     " tokens; at most max_tokens (",
                                                     request.params.max_tokens, ")"));
    }
    for (int32_t t : request.draft_tokens) {
      if (t < 0 || t >= limits.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("draft_tokens: token id ", t,
                                                       " is outside the vocabulary [0, ",
                                                       limits.vocab_size, ")"));
      }
    }
  }
  // A sequence that could never fit would wait forever.
  const int64_t seq_blocks = (held + limits.block_size - 1) / limits.block_size;
  const int64_t blocks = seq_blocks * limits.full_groups +
                         limits.window_groups * std::min(seq_blocks, limits.window_group_blocks);
  if (limits.num_blocks > 0 && blocks > limits.num_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat("request needs ", blocks,
                                                     " KV blocks; the cache has ",
                                                     limits.num_blocks));
  }
  return absl::OkStatus();
}

const char* SpecModeName(SpecMode m) {
  switch (m) {
    case SpecMode::kDefault: return "default";
    case SpecMode::kOff: return "off";
    case SpecMode::kNgram: return "ngram";
    case SpecMode::kSuffix: return "suffix";
  }
  return "?";
}

absl::Status ParseSpecMode(std::string_view name, std::string_view what, SpecMode* out,
                           bool allow_default) {
  if (name == "off") {
    *out = SpecMode::kOff;
  } else if (name == "ngram") {
    *out = SpecMode::kNgram;
  } else if (name == "suffix") {
    *out = SpecMode::kSuffix;
  } else if (allow_default && name == "default") {
    *out = SpecMode::kDefault;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": unknown speculative mode '", std::string(name),
                                                   "' (expected off, ngram or suffix",
                                                   allow_default ? " or default" : "", ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvserve
