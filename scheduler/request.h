// The engine's request and event types, and the one place that validates a
// request. Both front ends (server/service/model_service.cc) and Engine::Submit call
// ValidateEngineRequest, so a rule and its message exist once: a bad field is
// InvalidArgument naming it; a request the KV pool could never hold is
// ResourceExhausted.
//
// Plain data; no thread-safety concerns.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "model/sampler.h"

namespace kvserve {

class CompiledGrammar;  // grammar/structured_output.h

// Token eviction for long contexts: which cached tokens a sequence keeps.
//   none    every token (default)
//   window  the `window` most recent tokens
//   sinks   the first `sinks` tokens (attention sinks, StreamingLLM) + the
//           `window` most recent
//   h2o     `sinks` + `window` + heavy hitters (the tokens with the most
//           accumulated attention, age-normalised) up to `budget` in all
// A sequence that dropped tokens is lossy: its blocks never enter the prefix
// cache. Kept tokens keep their RoPE positions. Blocks shared with other
// sequences (a cached prefix, a fork) are never touched: eviction acts on the
// sequence's private blocks only.
struct KvPolicy {
  enum class Kind { kNone, kWindow, kSinks, kH2O };
  Kind kind = Kind::kNone;
  int32_t sinks = 4;
  int32_t window = 256;
  int32_t budget = 0;  // h2o only: tokens kept in all (> sinks + window)
  // The most tokens the policy keeps.
  int32_t capacity() const {
    switch (kind) {
      case Kind::kNone: return 0;
      case Kind::kWindow: return window;
      case Kind::kSinks: return sinks + window;
      case Kind::kH2O: return budget;
    }
    return 0;
  }
};
// "none", "window", "sinks", "h2o".
const char* KvPolicyName(KvPolicy::Kind k);
// InvalidArgument naming the valid names for anything else.
[[nodiscard]] absl::Status ParseKvPolicyKind(std::string_view name, KvPolicy::Kind* out);

// Which proposers a request uses. kDefault: the server's --speculative.
//   off     none
//   ngram   own prompt + output lookup, and the response cache's candidate
//   suffix  ngram's, plus the index over other requests' outputs
enum class SpecMode { kDefault, kOff, kNgram, kSuffix };
const char* SpecModeName(SpecMode m);
// "off", "ngram", "suffix" (and "default" when allow_default). Otherwise
// InvalidArgument naming `what` and the valid names.
[[nodiscard]] absl::Status ParseSpecMode(std::string_view name, std::string_view what,
                                         SpecMode* out, bool allow_default = false);

struct EngineRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
  int32_t n = 1;         // parallel samples sharing the prompt's KV blocks
  int32_t priority = 0;  // higher runs first; FCFS within a priority
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  // Prefix-cache namespace: requests share cached blocks only with requests
  // of the same salt (tenant isolation).
  std::string cache_salt{};
  KvPolicy kv_policy{};
  // A guess at the answer's first tokens (the response cache's semantic
  // candidate). The engine prefills them after the prompt in the same
  // forward, keeps the longest prefix its own sampler produces from those
  // logits (emitting each kept token as if decoded), rolls the KV of the rest
  // back and decodes on from there: the output is exactly the output without
  // a draft, only sooner. Greedy (temperature 0), n = 1, kv_policy none, at
  // most max_tokens tokens.
  std::vector<int32_t> draft_tokens{};
  // Speculative decoding (scheduler/speculation.h): which proposers draft
  // for this request; kDefault: the engine's default. Never changes the output.
  SpecMode speculative = SpecMode::kDefault;
  // Grammar-constrained decoding (structured outputs, forced tool calls):
  // each sample's tokens are drawn only among those the grammar allows, and
  // the sample stops where the grammar ends. Null: free text. The front end
  // compiles it (grammar/structured_output.h); it is part of the response
  // cache's key.
  std::shared_ptr<const CompiledGrammar> grammar{};
};

// What a request is checked against: the model's and the engine's limits.
struct RequestLimits {
  int32_t vocab_size = 0;
  int32_t context_length = 0;
  int32_t max_n = 16;
  int32_t block_size = 16;
  int64_t num_blocks = 0;  // KV pool size; 0: not checked
  // KV cache groups (hybrid attention): besides the full groups' blocks a
  // sequence holds, at once, at most window_group_blocks in each of its
  // window_groups (Engine::limits; 0: one group, or all-layers layout).
  int32_t full_groups = 1;
  int32_t window_groups = 0;
  int64_t window_group_blocks = 0;
  size_t max_cache_salt_bytes = 256;
  // A sinks or window policy may run past the trained context (positions within the
  // cache, keys re-rotated): prompt + max_tokens is then bounded by the KV
  // the policy keeps, not by the context length. kv_switch_margin: how far
  // ahead of the context a sequence switches (the kept tokens plus it must
  // fit in the context).
  bool kv_past_context = false;
  int32_t kv_switch_margin = 0;
  // Empty when token eviction can run on this engine; else why not (e.g. the
  // KV codec keeps per-block scales), and a kv_policy other than none is
  // refused with that reason.
  std::string kv_eviction_unsupported;
};

// OK, or InvalidArgument naming the first bad field (prompt, n, max_tokens,
// the sampling parameters, cache_salt, kv_policy), or ResourceExhausted when prompt +
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
  // Of cached_tokens, loaded from the host and the disk KV tier.
  int32_t cached_host_tokens = 0;
  int32_t cached_disk_tokens = 0;
  // Of cached_tokens, K/V a KV tier re-encoded lossily (--kv-host-dtype).
  int32_t cached_lossy_tokens = 0;
  // The sample ran on lossy re-encoded K/V (prompt or, after a preemption,
  // its own earlier tokens): not an exact answer.
  bool lossy_kv = false;
  int32_t dropped_tokens = 0;      // tokens this sample's KV policy evicted so far
  int32_t draft_accepted = 0;      // of EngineRequest::draft_tokens, those kept so far
};
using EventCallback = std::function<void(const SeqEvent&)>;

}  // namespace kvserve
