// Teacher-forced evaluation of a KV policy (token eviction) on a text: the
// tokens stream through the model in chunks twice in lockstep, once with
// every token's KV and once under the policy — compacted by the same
// KvEvictor the engine uses, with the same attention-mass scores — and every
// position's next-token distribution is compared: perplexity of each, mean
// KL(full || policy) and how often the top-1 token agrees. Positions are
// the engine's (SeqKv::rope_position): the tokens' own, except that a sinks
// policy switches to positions within the cache before the context length
// (StreamingLLM). A text longer than the context streams under the sinks
// policy alone (every-token KV past the context is not a reference), and
// the result gives its perplexity per segment: bounded for sinks, rising
// for a window with original positions (which is refused past the context,
// since its positions would leave the trained range).
//
// Thread-safety: a call is self-contained (its own KV pools); the model's
// forward is not re-entrant, so one call at a time per model.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "kernels/kv_view.h"
#include "model/llama.h"
#include "scheduler/request.h"

namespace kvserve {

struct KvPolicyEvalOptions {
  KvPolicy policy;
  int32_t chunk = 16;  // tokens per forward (eviction runs between chunks)
  int32_t block_size = 16;
  kernels::KvDType kv_dtype = kernels::KvDType::kF16;
  int32_t segment = 0;  // > 0: also the policy's perplexity per this many scored tokens
};

struct KvPolicyEvalResult {
  int64_t scored_tokens = 0;
  double perplexity_full = 0;
  double perplexity_policy = 0;
  double mean_kl = 0;    // nats, KL(full || policy) per position
  double same_top1 = 0;  // fraction of positions whose argmax agrees
  int32_t max_slots = 0;  // most KV slots the policy sequence held
  int64_t dropped_tokens = 0;
  bool reference = true;  // false past the context: only the policy ran (full/KL/top-1 unset)
  std::vector<double> segment_perplexity;  // the policy's, per options.segment tokens
  int64_t rotated_keys = 0;                // keys re-rotated (sinks past the context)
};

// InvalidArgument for a text past the context length under any policy but
// sinks, or a sinks policy too large to leave a chunk of room below it.
[[nodiscard]] absl::StatusOr<KvPolicyEvalResult> EvaluateKvPolicy(
    LlamaModel* model, absl::Span<const int32_t> tokens, const KvPolicyEvalOptions& options,
    ThreadPool* pool);

}  // namespace kvserve
