// BatchPlan: what the scheduler decided for one engine step, as plain data —
// which sequences run, how many tokens each, where they start, which are
// prefill chunks and which produce a token. The model runner executes it
// (ModelRunner), the output processor applies its results
// (OutputProcessor); neither decides who runs. Tests and the metrics read it
// to check what the scheduler did (budget, order, preemptions).
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

class Sequence;

struct ScheduledChunk {
  Sequence* seq = nullptr;
  uint64_t request_id = 0;
  int32_t sample_index = 0;
  int32_t first_slot = 0;   // the sequence's num_computed when scheduled
  int32_t num_tokens = 0;   // input tokens this step (prompt chunk or 1 decode token)
  bool prefill = false;     // not a lone last token (a decode token, or a prompt's last)
  bool sample = false;      // the chunk reaches the end of the input: logits wanted
};

struct BatchPlan {
  std::vector<ScheduledChunk> chunks;  // in batch order: decodes first, then prefill chunks
  int32_t num_tokens = 0;
  int32_t num_decode_tokens = 0;
  int32_t num_prefill_tokens = 0;
  // The step's token budget after the stall-free limit (<= max_batched_tokens).
  int32_t token_budget = 0;
  // Sequences that ran out of blocks this step and were preempted (ids).
  std::vector<uint64_t> preempted;
  int32_t admitted = 0;
  bool empty() const { return chunks.empty(); }
};

}  // namespace kvserve
