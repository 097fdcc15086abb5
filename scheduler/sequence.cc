#include "scheduler/sequence.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

namespace kvserve {

const char* SeqStateName(SeqState s) {
  switch (s) {
    case SeqState::kWaiting: return "waiting";
    case SeqState::kRunning: return "running";
    case SeqState::kPreempted: return "preempted";
    case SeqState::kKvArriving: return "kv_arriving";
    case SeqState::kFinished: return "finished";
  }
  return "";
}

namespace {

// Per-sample seeds: sample i of a seeded request draws from seed + i, so
// every sample is reproducible on its own.
SamplingParams ForSample(const SamplingParams& p, int32_t index) {
  SamplingParams q = p;
  if (q.has_seed) q.seed += static_cast<uint64_t>(index);
  return q;
}

bool Allowed(SeqState from, SeqState to) {
  if (to == SeqState::kFinished) return from != SeqState::kFinished;
  switch (from) {
    case SeqState::kWaiting:
    case SeqState::kPreempted:
      return to == SeqState::kRunning || to == SeqState::kKvArriving;
    case SeqState::kKvArriving:
      // Landed, or preempted while parked is not possible: a parked
      // sequence is never a victim (its blocks are being written).
      return to == SeqState::kRunning;
    case SeqState::kRunning:
      return to == SeqState::kPreempted;
    case SeqState::kFinished:
      return false;
  }
  return false;
}

}  // namespace

Sequence::Sequence(SequenceGroup* group, int32_t index, std::vector<int32_t> tokens,
                   KvPool* pool, const Tokenizer* tokenizer)
    : kv(pool),
      group_(group),
      index_(index),
      tokens_(std::move(tokens)),
      num_prompt_(static_cast<int32_t>(group->request.prompt.size())),
      sampler_(std::make_unique<Sampler>(ForSample(group->request.params, index))),
      detok_(std::make_unique<StreamingDetokenizer>(tokenizer)),
      stops_(std::make_unique<StopStringMatcher>(group->request.params.stop)),
      constraint_(group->request.grammar ? group->request.grammar->NewConstraint() : nullptr) {}

void Sequence::set_state(SeqState next) {
  if (!Allowed(state_, next)) {
    std::fprintf(stderr, "Sequence %llu/%d: illegal transition %s -> %s\n",
                 static_cast<unsigned long long>(group_->id), index_, SeqStateName(state_),
                 SeqStateName(next));
    std::abort();
  }
  state_ = next;
}

void Sequence::CheckInvariants() const {
  auto fail = [&](const char* what) {
    std::fprintf(stderr, "Sequence %llu/%d (%s): %s (tokens %d, computed %d, committed %d)\n",
                 static_cast<unsigned long long>(group_->id), index_, SeqStateName(state_), what,
                 num_tokens(), kv.num_computed, kv.num_committed);
    std::abort();
  };
  // The KV counters' own invariants are KvCacheManager::CheckInvariants'.
  if (num_computed_tokens() > num_tokens() + num_speculative()) fail("computed past the tokens");
  if (num_cached_prompt > num_prompt_) fail("cached more than the prompt");
  if (waiting() && kv.table.num_blocks() > 0) fail("waiting with blocks");
  if (state_ == SeqState::kFinished && kv.table.num_blocks() > 0) fail("finished with blocks");
}

}  // namespace kvserve
