// OutputProcessor: applies a step's results. For every chunk of the plan it
// marks the K/V the forward wrote as computed and commits it through the
// KvCacheManager (which offers completed blocks to the radix index); for
// every chunk that reached the end of its input it forks an n > 1 request
// whose prompt is in, samples the next token, emits it (text through the
// streaming detokenizer and stop-string matcher), and finishes sequences
// that stop or reach max_tokens; then it lets sequences with a KV policy drop
// tokens (KvEvictor). Finishing (also cancel, deadline and
// errors, which the engine routes here) is the one place a sequence's last
// event is sent and its blocks are handed back.
//
// Not thread-safe: the engine thread owns it. Event callbacks run here and
// must not block.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/types/span.h"
#include "model/tokenizer.h"
#include "scheduler/batch_plan.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_eviction.h"
#include "scheduler/model_runner.h"
#include "scheduler/scheduler.h"
#include "scheduler/sequence.h"

namespace kvserve {

class OutputProcessor {
 public:
  // REQUIRES: every pointer outlives the processor.
  OutputProcessor(KvCacheManager* kv, Scheduler* scheduler, const Tokenizer* tokenizer,
                  KvEvictorOptions eviction = {});

  // REQUIRES: the plan's forward succeeded and produced `result`. Last,
  // sequences with a KV policy are compacted (token eviction).
  void Process(const BatchPlan& plan, const StepResult& result);

  // Sends the sample's last event (with the text still held back, for a
  // normal finish) and frees its KV. Idempotent.
  void FinishSequence(Sequence* s, FinishReason reason);
  // Finishes every sample of a request (an unforked n > 1 request reports n
  // results: its missing samples are created and finished too). Idempotent.
  void FinishGroup(SequenceGroup* g, FinishReason reason);

  // A new sample of g holding `tokens`.
  std::unique_ptr<Sequence> NewSample(SequenceGroup* g, int32_t index,
                                      const std::vector<int32_t>& tokens) const;

  int64_t generation_tokens_total() const { return generation_tokens_total_; }
  int64_t requests_cancelled() const { return requests_cancelled_; }
  const KvEvictor& evictor() const { return evictor_; }

 private:
  void Fork(Sequence* parent);
  // Commits the computed slots that hold final tokens (not draft tokens).
  void CommitFinal(Sequence* s);
  // Accepts the longest prefix of s's draft its sampler reproduces from the
  // rows [first_row, end_row) (the first at position first_position), then
  // emits the sampler's next token; drops the rest of the draft and its KV.
  void Verify(Sequence* s, int32_t first_position, int32_t first_row, int32_t end_row,
              const std::function<absl::Span<const float>(int32_t)>& row_at);
  void EmitToken(Sequence* s, int32_t token, float logprob);
  // The sampler's next token from `row`, drawn among the tokens s's grammar
  // allows when it has one.
  SampleResult SampleNext(Sequence* s, absl::Span<const float> row);
  SeqEvent Event(const Sequence& s) const;

  KvCacheManager* kv_;
  Scheduler* scheduler_;
  const Tokenizer* tokenizer_;
  KvEvictor evictor_;
  int64_t generation_tokens_total_ = 0;
  int64_t requests_cancelled_ = 0;
  std::vector<uint32_t> mask_;  // the grammar's allowed tokens, reused per sample
};

}  // namespace kvserve
